"""A `buttermilk serve` child process for benchmarks: start, wait until ready, stats, stop."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_tcp_address() -> str:
    """tcp://127.0.0.1:<a port free now>."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


class ServeProcess:
    """`buttermilk serve` with `flags` on a free 127.0.0.1 port; its log in `log_path`, its pid beside it.

    Args:
        flags (list[str]): `serve` flags (model, engines, device, sizes).
        num_engines (int): engines that must be live before `wait_ready` returns.
        log_path (Path): stdout and stderr of serve and its children.
    """

    def __init__(self, flags: list[str], num_engines: int, log_path: Path):
        self.address = free_tcp_address()
        self.num_engines = num_engines
        self.log_path = log_path
        # The HTTP API is off: the benchmark drives the ZeroMQ pipeline, and a fixed port could clash.
        argv = [sys.executable, "-m", "services.cli", "serve", "--address", self.address, "--http-address", "off",
                *flags]  # fmt: skip
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        # For a wrapper script's cleanup should this process be SIGKILLed: serve leads its own group.
        self.pid_path = log_path.with_suffix(".pid")
        self.pid_path.write_text(f"{self.proc.pid}\n")

    def wait_ready(self, timeout_s: float) -> float:
        """Block until every engine is live; returns the seconds it took.

        Raises:
            RuntimeError: serve exited, or was not ready within `timeout_s`.
        """
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if self.health().engines_live >= self.num_engines:
                    return time.monotonic() - start
            except (TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"serve was not ready within {timeout_s} s; see {self.log_path}")

    def health(self):
        return asyncio.run(_control(self.address, "health"))

    def stats(self):
        return asyncio.run(_control(self.address, "stats"))

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM serve (it stops its children); SIGKILL the group if it lingers. Returns its status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.pid_path.unlink(missing_ok=True)
        return self.proc.returncode


async def _control(address: str, verb: str):
    from shared.client import AsyncClient

    async with AsyncClient(address) as client:
        return await getattr(client, verb)(timeout_s=2.0)


def engine_table(stats) -> list[dict]:
    """Per engine: id, epoch, pid, device and CUDA_VISIBLE_DEVICES, as `stats` shows them."""
    return [{"engine_id": e.engine_id, "epoch": e.epoch, "pid": e.pid, "device": e.device,
             "cuda_visible_devices": e.cuda_visible_devices, "capacity_tokens": e.capacity_tokens,
             "max_slots": e.max_slots} for e in stats.engines]  # fmt: skip
