"""A `buttermilk serve` process for ops scripts and tests: start it on loopback, find its children
and their CPU time, ask its stats, stop it.

    with ServeProcess.start(["--engines", "2"], log_path=Path("serve.log")) as server:
        ... server.address, server.children(), server.stats() ...
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared.client import AsyncClient, ServerError

START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0


def free_tcp_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_tcp_address() -> str:
    """A loopback tcp:// endpoint on a port that was free a moment ago."""
    return f"tcp://127.0.0.1:{free_tcp_port()}"


def child_pids(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def is_alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads, seconds) the live process `pid` has used, from /proc.

    Raises:
        OSError: no such process.
    """
    fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (stat 14, 15)


def serve_roles(pid: int) -> dict[str, int]:
    """The children of `buttermilk serve` (pid `pid`) by role: gateway, controller, engine e0, ...

    A child's role is its `services.cli` command, and an engine's its `--engine-id`.
    """
    roles = {}
    for child in child_pids(pid):
        try:
            argv = (Path("/proc") / str(child) / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "services.cli" not in argv or argv.index("services.cli") + 1 >= len(argv):
            continue
        role = argv[argv.index("services.cli") + 1]
        if role == "engine" and "--engine-id" in argv[:-1]:
            role = f"engine {argv[argv.index('--engine-id') + 1]}"
        roles[role] = child
    return roles


async def engines_live(address: str, timeout_s: float = 2.0) -> int:
    """How many engines the gateway at `address` counts as live (0 when it does not answer)."""
    try:
        async with AsyncClient(address) as client:
            return (await client.health(timeout_s=timeout_s)).engines_live
    except (TimeoutError, ServerError):
        return 0


class ServeProcess:
    """`buttermilk serve` on a free loopback port, in its own process group, the HTTP API off.

    `start` launches it and waits until every engine is live; `launch` only launches (then
    `wait_ready`). With a log path, serve's pid is written beside it (`.pid`), so a wrapper
    script can stop the group should the driving process be SIGKILLed.

    Args:
        proc (subprocess.Popen): the supervisor.
        address (str): the gateway's client endpoint.
        num_engines (int): engines it runs.
        log_path (Path | None): its stdout and stderr (None: discarded).
    """

    def __init__(self, proc: subprocess.Popen, address: str, num_engines: int, log_path: Path | None = None):
        self.proc, self.address, self.num_engines, self.log_path = proc, address, num_engines, log_path
        self.pid_path = log_path.with_suffix(".pid") if log_path else None
        if self.pid_path:
            self.pid_path.write_text(f"{proc.pid}\n")

    @classmethod
    def launch(cls, flags: list[str], *, engines: int = 1, log_path: Path | None = None) -> ServeProcess:
        """Start serve with `flags` (the default model unless they name one); do not wait."""
        address = free_tcp_address()
        run_dir = Path(tempfile.mkdtemp(prefix="buttermilk-ops-")) / "run"
        argv = [sys.executable, "-m", "services.cli", "serve", "--model", "default", "--address", address,
                "--engines", str(engines), "--run-dir", str(run_dir), "--http-address", "off", *flags]  # fmt: skip
        with open(log_path, "ab") if log_path else open(os.devnull, "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return cls(proc, address, engines, log_path)

    @classmethod
    def start(cls, flags: list[str], *, engines: int = 1, log_path: Path | None = None) -> ServeProcess:
        """`launch`, then wait until every engine is live.

        Raises:
            RuntimeError: it exited or did not become ready within START_TIMEOUT_S (it is killed).
        """
        server = cls.launch(flags, engines=engines, log_path=log_path)
        try:
            server.wait_ready(START_TIMEOUT_S)
        except RuntimeError:
            server.kill()
            raise
        return server

    def wait_ready(self, timeout_s: float) -> float:
        """Block until every engine is live; returns the seconds it took.

        Raises:
            RuntimeError: serve exited, or was not ready within `timeout_s`.
        """
        start = time.monotonic()
        where = f"; see {self.log_path}" if self.log_path else ""
        while asyncio.run(engines_live(self.address)) < self.num_engines:
            if self.proc.poll() is not None:
                raise RuntimeError(f"buttermilk serve exited with status {self.proc.returncode}{where}")
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"buttermilk serve was not ready within {timeout_s} s{where}")
            time.sleep(0.5)
        return time.monotonic() - start

    def stats(self):
        """The gateway's `stats` reply (`shared.protocol.StatsReply`)."""
        return asyncio.run(_ask(self.address, "stats"))

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def children(self) -> list[int]:
        return child_pids(self.proc.pid)

    def stop(self) -> int | None:
        """SIGTERM, wait; SIGKILL the group if it does not exit. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.pid_path:
            self.pid_path.unlink(missing_ok=True)
        return self.proc.returncode

    def kill(self) -> None:
        for pid in [*self.children(), self.proc.pid]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc.wait()


async def _ask(address: str, verb: str):
    async with AsyncClient(address) as client:
        return await getattr(client, verb)(timeout_s=2.0)


def engine_table(stats) -> list[dict]:
    """Per engine: id, epoch, pid, device and CUDA_VISIBLE_DEVICES, as `stats` shows them."""
    return [{"engine_id": e.engine_id, "epoch": e.epoch, "pid": e.pid, "device": e.device,
             "cuda_visible_devices": e.cuda_visible_devices, "capacity_tokens": e.capacity_tokens,
             "max_slots": e.max_slots} for e in stats.engines]  # fmt: skip
