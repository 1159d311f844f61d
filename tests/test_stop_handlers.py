"""Stopping a service process on SIGINT/SIGTERM: the deadline that stands in for the supervisor's SIGKILL
(`services.supervisor.install_stop_handlers`). Real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from .pipeline_helpers import REPO


@pytest.mark.parametrize("in_loop", [False, True], ids=["thread", "asyncio"])
def test_a_stop_that_hangs_ends_the_process_at_its_deadline(in_loop):
    """After `kill -9` of `serve` no SIGKILL follows a child's SIGTERM, so a stop that never finishes must end the
    process itself: exit 1, `stop_overrun` logged, `deadline_s` (1 s) after the first signal. A second signal 0.7 s
    later neither ends it sooner nor moves the deadline (that would be 1.7 s)."""
    body = textwrap.dedent(f"""
        import asyncio, time
        from services.supervisor import install_stop_handlers
        from shared.logging import configure_logging
        configure_logging(json=True, level="info")
        async def main():
            install_stop_handlers(lambda: None, 1.0)
            print("ready", flush=True)
            await asyncio.sleep(30)
        if {in_loop}:
            asyncio.run(main())
        else:
            install_stop_handlers(lambda: None, 1.0)
            print("ready", flush=True)
            time.sleep(30)
    """)
    proc = subprocess.Popen([sys.executable, "-c", body], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.7)
        proc.send_signal(signal.SIGINT)
        status = proc.wait(timeout=10)
        elapsed = time.monotonic() - t0
        out = proc.stdout.read()
    finally:
        proc.kill()
    assert status == 1 and "stop_overrun" in out, out
    assert 0.9 <= elapsed < 1.6, elapsed
