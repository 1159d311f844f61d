"""Helpers for the pipeline tests: a real `buttermilk serve` in a subprocess, and waits on it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ops.serving import child_pids, free_tcp_address, free_tcp_port, is_alive
from services.engine.service import SNAPSHOT_EVERY_S
from shared.client import AsyncClient, ServerError
from shared.protocol_internal import HEARTBEAT_S

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180.0
SERVER_FLAGS = ("--capacity-tokens", "4096", "--max-slots", "8", "--step-token-budget", "256",
                "--max-context", "256")  # fmt: skip
MAX_CONTEXT = 256
SETTLE_S = SNAPSHOT_EVERY_S + HEARTBEAT_S + 0.3  # an engine report sent after this began was made after it


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


@dataclass
class Server:
    """A `buttermilk serve` process and where to reach it (ZeroMQ `address`, HTTP `http_url`)."""

    proc: subprocess.Popen
    address: str
    run_dir: Path
    log_path: Path
    num_engines: int
    http_url: str = ""  # e.g. http://127.0.0.1:41234 (the OpenAI API is under /v1)
    children: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, tmp: Path, *flags: str, engines: int = 1, model: str = "default",
              base_flags: tuple[str, ...] = SERVER_FLAGS) -> Server:
        address = free_tcp_address()
        http = f"127.0.0.1:{free_tcp_port()}"
        run_dir = tmp / "run"
        log_path = tmp / "serve.log"
        argv = [sys.executable, "-m", "services.cli", "serve", "--model", model, "--address", address,
                "--engines", str(engines), "--run-dir", str(run_dir), "--http-address", http, *base_flags,
                *flags]  # fmt: skip
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        server = cls(proc, address, run_dir, log_path, engines, http_url=f"http://{http}")
        server.wait_ready()
        server.children = child_pids(proc.pid)
        return server

    @classmethod
    @contextlib.contextmanager
    def serving(cls, tmp: Path, *flags: str, clean_stop: bool = True, **kwargs):
        """`start`, yield the server, then stop it: SIGTERM, asserting a clean exit (`clean_stop`), else
        (or when that fails) SIGKILL of everything. For a module's shared server fixture."""
        server = cls.start(tmp, *flags, **kwargs)
        try:
            yield server
        finally:
            if server.proc.poll() is None:
                status = server.stop() if clean_stop else None
                if status != 0:
                    server.kill_everything()
                assert not clean_stop or status == 0, server.log()[-3000:]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                health = run(health_of(self.address))
            except (TimeoutError, ServerError):
                return False
            return health.engines_live == self.num_engines

        wait_until(ready, START_TIMEOUT_S, "the server to be ready", poll_s=0.5)

    def stop(self) -> int:
        """SIGTERM the supervisor; returns its exit status after checking nothing is left."""
        pids = set(self.children) | set(child_pids(self.proc.pid))
        self.proc.send_signal(signal.SIGTERM)
        status = self.proc.wait(timeout=30)
        wait_until(lambda: not any(is_alive(p) for p in pids), 10, "every child to exit")
        return status

    def kill_everything(self) -> None:
        """Last-resort cleanup for a failed test: SIGKILL the supervisor's group and children."""
        for pid in set(self.children) | set(child_pids(self.proc.pid)):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def run(coro):
    """Run a coroutine to completion on a fresh event loop (for sync fixtures)."""
    return asyncio.run(coro)


async def health_of(address: str):
    async with AsyncClient(address) as client:
        return await client.health(timeout_s=1.0)


async def stats_of(address: str):
    async with AsyncClient(address) as client:
        return await client.stats()


def is_idle(stats, *, sessions: int = 0) -> bool:
    """No reservations, leases, queued or active requests, held tokens or slots (but `sessions`)."""
    pool = stats.pool
    counts = (stats.num_reservations, stats.num_leases, stats.num_sessions, pool.active, pool.queued)
    engines_idle = all(
        e.reserved_tokens == 0 and (sessions or (e.held_tokens == 0 and e.used_slots == 0 and e.engine_tokens == 0))
        for e in stats.engines
    )
    return counts == (0, 0, sessions, 0, 0) and engines_idle


async def wait_idle(address: str, *, sessions: int = 0, timeout_s: float = 10.0):
    """Poll `stats` until the server is idle and its engines' figures have settled; returns the last stats.

    Engines relay their figures (slots, KV tokens, prefix-cache counters) by heartbeat, refreshed
    every `SNAPSHOT_EVERY_S` and sent every `HEARTBEAT_S`, so one idle reply may predate work that
    ended just before it. Two idle replies `SETTLE_S` apart with equal engine figures mean every
    report now postdates the first reply. Raises AssertionError on timeout.
    """
    deadline = time.monotonic() + timeout_s
    settled = None  # the previous idle reply
    while True:
        stats = await stats_of(address)
        if not is_idle(stats, sessions=sessions):
            settled = None
        elif settled is not None and settled.engines == stats.engines:
            return stats
        else:
            settled = stats
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout_s} s: {stats}")
        await asyncio.sleep(SETTLE_S if settled is not None else 0.2)


def reference_generation(loaded, token_ids: list[int], max_tokens: int, max_context: int = MAX_CONTEXT):
    """Greedy in-process generation with a raw KVCache: (text, token ids incl. EOS, reason)."""
    from services.engine.cache import CacheOptions, make_layer_caches
    from services.engine.generate import GenerationStats, generate
    from shared.protocol import SamplingParams

    caches = make_layer_caches(loaded.model, CacheOptions(max_context=max_context))
    stats = GenerationStats()
    params = SamplingParams(max_tokens=max_tokens)
    text = "".join(generate(loaded.model, loaded.tokenizer, token_ids, caches, params,
                            max_context=max_context, stats=stats))  # fmt: skip
    return text, stats.token_ids, stats.finish_reason


def cli(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    """Run `python -m services.cli ARGS` to completion (text output captured)."""
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s)  # fmt: skip


NOISE = ("Traceback", "Task was destroyed", "Event loop is closed", "ZMQError", "errors.pydantic.dev")
