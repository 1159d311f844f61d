"""Issue 11 item 6: the services as separate processes (the docker-compose layout); `kill -9` of
the gateway with 4 requests in flight, then a restart on the same addresses. What the dead
gateway reserved belongs to it: the controller releases it when the new instance speaks, and the
engine stops the orphaned work."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from shared.client import AsyncClient

from .pipeline_helpers import REPO, free_tcp_address, run, stats_of, wait_until

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPT = "Once upon a time, in a small village, there lived"
COMMON = ("--model", "default", "--dtype", "float32", "--max-context", "256")


class Services:
    """Controller, engine and gateway, each started on its own."""

    def __init__(self, tmp_path):
        self.client, self.engine_cmd, self.engine_out, self.controller = (free_tcp_address() for _ in range(4))
        self.tmp, self.procs = tmp_path, {}

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", *args], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.procs[name] = proc
        return proc

    def gateway(self) -> subprocess.Popen:
        return self.start("gateway", "gateway", *COMMON, "--address", self.client, "--engine-cmd-address",
                          self.engine_cmd, "--engine-out-address", self.engine_out, "--controller-address",
                          self.controller)  # fmt: skip

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def live_engines(address: str) -> int:
    async def probe():
        async with AsyncClient(address) as client:
            return (await client.health(timeout_s=1.0)).engines_live

    try:
        return run(probe())
    except Exception:  # not up yet
        return 0


def test_a_killed_gateways_reservations_are_released_when_it_restarts(tmp_path):
    services = Services(tmp_path)
    try:
        services.start("controller", "controller", "--controller-address", services.controller)
        services.start("engine", "engine", *COMMON, "--engine-id", "e0", "--epoch", "0", "--capacity-tokens", "4096",
                       "--max-slots", "8", "--step-token-budget", "256", "--engine-cmd-address", services.engine_cmd,
                       "--engine-out-address", services.engine_out, "--controller-address", services.controller)  # fmt: skip
        first = services.gateway()
        wait_until(lambda: live_engines(services.client) == 1, 180, "the services to be ready", poll_s=0.5)

        async def four_in_flight():
            async with AsyncClient(services.client) as client:
                streams = [await client.stream(prompt=PROMPT, max_tokens=150) for _ in range(4)]
                for stream in streams:
                    await stream.__anext__()
                stats = await client.stats()
                os.killpg(first.pid, signal.SIGKILL)  # before this client goes: nothing is cancelled
                first.wait()
                return stats

        held = run(four_in_flight())
        assert held.num_reservations == 4 and held.engines[0].reserved_tokens > 0
        services.gateway()  # the same addresses
        wait_until(lambda: live_engines(services.client) == 1, 60, "the new gateway to see the engine", poll_s=0.5)

        def released() -> bool:
            stats = run(stats_of(services.client))
            engine = stats.engines[0]
            counts = (stats.num_reservations, engine.reserved_tokens, engine.reserved_slots, engine.used_slots,
                      engine.engine_tokens)  # fmt: skip
            return counts == (0, 0, 0, 0, 0)

        # Well inside the controller's 30 s gateway timeout: the new instance's heartbeat did it.
        wait_until(released, 10, "the dead gateway's reservations to be released and its work aborted")

        async def after():
            async with AsyncClient(services.client) as client:
                return await client.generate(prompt="Hello", max_tokens=3)

        assert run(after()).usage.completion_tokens == 3
    finally:
        services.stop()
