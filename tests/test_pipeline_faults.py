"""Admission, leases and failures against real processes: FIFO queueing, cancel while queued,
a client that vanishes, `kill -9` of an engine, and clean shutdown.

One server with two engines, at most two active requests and a queue of four is shared by
the module. After every test the server must be idle again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from shared.client import AsyncClient, ServerError
from shared.errors import ErrorCode
from shared.protocol_internal import DEFAULT_ENGINE_TIMEOUT_S

from .pipeline_helpers import (
    NOISE,
    REPO,
    Server,
    child_pids,
    cli,
    free_tcp_address,
    is_alive,
    run,
    stats_of,
    wait_idle,
    wait_until,
)

pytestmark = [pytest.mark.model, pytest.mark.slow]

LEASE_TTL_S = 2.0
PROMPT = "Once upon a time, in a small village, there lived"  # long greedy continuation


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with Server.serving(
        tmp_path_factory.mktemp("serve-faults"), "--max-active-requests", "2", "--max-queue", "4",
        "--engine-timeout-s", str(DEFAULT_ENGINE_TIMEOUT_S), engines=2, clean_stop=False,
    ) as srv:  # fmt: skip  (the product's timeout: 3 s once declared a live engine dead on a loaded 2-core machine)
        yield srv


@pytest.fixture(autouse=True)
def idle_after(request):
    yield
    if "server" not in request.fixturenames:
        return  # a test of its own processes: no shared server needed
    server = request.getfixturevalue("server")
    if server.proc.poll() is None:
        run(wait_idle(server.address, timeout_s=LEASE_TTL_S + 10))


def test_starts_follow_fifo_order(server):
    async def client(index: int, first_token_at: dict[int, float]):
        await asyncio.sleep(0.15 * index)  # fixes the arrival order at the gateway
        async with AsyncClient(server.address) as c:
            stream = await c.stream(prompt=PROMPT, max_tokens=6)
            async for _ in stream:
                first_token_at.setdefault(index, time.monotonic())
            return stream.done

    async def main():
        first_token_at: dict[int, float] = {}
        dones = await asyncio.gather(*(client(i, first_token_at) for i in range(6)))
        return sorted(first_token_at, key=first_token_at.get), dones

    starts, dones = run(main())
    assert all(d.finish_reason in ("length", "stop") for d in dones), dones
    # At most two run at once, so a request can only start after every request two or more
    # places ahead of it has started (the two running ones may swap).
    for pos, index in enumerate(starts):
        assert all(earlier in starts[:pos] for earlier in range(index - 1)), starts


def test_full_queue_is_overloaded_and_queued_cancel_is_immediate(server):
    async def main():
        async with AsyncClient(server.address) as c:
            running = [await c.stream(prompt=PROMPT, max_tokens=120) for _ in range(2)]
            for stream in running:
                await stream.__anext__()  # both are generating now
            queued = [await c.stream(prompt=PROMPT, max_tokens=4) for _ in range(4)]
            await asyncio.sleep(0.2)
            with pytest.raises(ServerError) as full:
                await c.generate(prompt=PROMPT, max_tokens=4)
            t0 = time.monotonic()
            await queued[1].cancel()
            cancelled = await queued[1].collect()
            cancel_s = time.monotonic() - t0
            stats = await c.stats()
            for stream in [*running, queued[0], queued[2], queued[3]]:
                await stream.cancel()
                await stream.collect()
            return full.value, cancelled, cancel_s, stats

    full, cancelled, cancel_s, stats = run(main())
    assert full.code == ErrorCode.OVERLOADED and full.retry_after_ms > 0
    assert cancelled.finish_reason == "cancelled" and cancelled.usage.completion_tokens == 0
    assert cancel_s < 1.0
    assert (stats.pool.active, stats.pool.queued) == (2, 3)


def test_vanished_client_lease_expires_and_releases_everything(server, tmp_path):
    script = tmp_path / "vanish.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, sys
        from shared.client import AsyncClient

        async def main():
            c = AsyncClient({server.address!r})
            await c.open_lease(ttl_s={LEASE_TTL_S})
            await c.generate(prompt="hello", max_tokens=2, session_id="vanish-s", new_session=True)
            stream = await c.stream(prompt={PROMPT!r}, max_tokens=200)
            await stream.__anext__()
            print("streaming", flush=True)
            await asyncio.sleep(3600)

        asyncio.run(main())
    """))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "streaming"
        held = run(stats_of(server.address))
        assert (held.num_leases, held.num_sessions, held.num_reservations) == (1, 1, 1)
        proc.kill()  # no lease_close, no cancel: the heartbeat just stops
        proc.wait()
        t0 = time.monotonic()
        run(wait_idle(server.address, timeout_s=LEASE_TTL_S + 5))
        assert time.monotonic() - t0 <= LEASE_TTL_S + 5
    finally:
        if proc.poll() is None:
            proc.kill()


def test_kill_engine_mid_stream(server):
    async def main():
        async with AsyncClient(server.address) as c:
            streams = [await c.stream(prompt=PROMPT, max_tokens=60) for _ in range(2)]
            for stream in streams:
                await stream.__anext__()
            before = await c.stats()
            victim = next(e for e in before.engines if e.reserved_tokens > 0 and e.engine_id == "e0")
            os.kill(victim.pid, signal.SIGKILL)
            t0 = time.monotonic()
            outcomes = await asyncio.gather(*(_finish(s, t0) for s in streams))
            return victim, outcomes

    victim, outcomes = run(main())
    failed = [(o, s) for o, s in outcomes if isinstance(o, ServerError)]
    assert len(failed) == 1 and failed[0][0].code == ErrorCode.ENGINE_FAILED
    assert [o.finish_reason for o, _ in outcomes if not isinstance(o, ServerError)] == ["length"]
    # Only the victim's stream is bounded: the supervisor reports the exit at once, and even a
    # missed report is caught by --engine-timeout-s. The survivor's 60 tokens take what they take.
    assert failed[0][1] < 15

    def restarted() -> bool:
        stats = run(stats_of(server.address))
        return any(e.engine_id == victim.engine_id and e.epoch == victim.epoch + 1 for e in stats.engines)

    wait_until(restarted, 120, "the supervisor to restart the engine at epoch+1", poll_s=0.5)
    server.wait_ready()

    async def after():
        async with AsyncClient(server.address) as c:
            return await asyncio.gather(*(c.generate(prompt="Hello", max_tokens=3) for _ in range(4)))

    assert all(r.usage.completion_tokens == 3 for r in run(after()))


async def _finish(stream, since: float | None = None):
    """The stream's completion or error; with `since`, also the seconds from `since` to its end."""
    try:
        outcome = await stream.collect()
    except ServerError as exc:
        outcome = exc
    return outcome if since is None else (outcome, time.monotonic() - since)


def test_silent_engine_is_declared_dead_by_heartbeat_timeout(server):
    """A frozen engine (SIGSTOP) is not an exit the supervisor sees: heartbeats catch it."""

    async def main():
        async with AsyncClient(server.address) as c:
            stream = await c.stream(prompt=PROMPT, max_tokens=100)
            await stream.__anext__()
            stats = await c.stats()
            frozen = next(e for e in stats.engines if e.reserved_tokens > 0)
            os.kill(frozen.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            outcome = await _finish(stream)
            return frozen, outcome, time.monotonic() - t0

    frozen, outcome, elapsed = run(main())
    try:
        assert isinstance(outcome, ServerError) and outcome.code == ErrorCode.ENGINE_FAILED
        assert elapsed < DEFAULT_ENGINE_TIMEOUT_S + 3  # --engine-timeout-s, plus ticks
    finally:
        os.kill(frozen.pid, signal.SIGCONT)  # it learns its epoch is dead and exits for a restart

    def restarted() -> bool:
        stats = run(stats_of(server.address))
        return any(e.engine_id == frozen.engine_id and e.epoch > frozen.epoch for e in stats.engines)

    wait_until(restarted, 120, "the frozen engine to be replaced at a newer epoch", poll_s=0.5)
    server.wait_ready()


def test_shutdown_leaves_no_process_behind(server):
    pids = child_pids(server.proc.pid)
    assert len(pids) == 4  # controller, gateway, two engines
    assert server.stop() == 0
    assert not any(is_alive(p) for p in pids)


def test_unusable_model_fails_fast_with_a_clear_message(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "--model", "/nonexistent/model", "--address",
         f"ipc://{tmp_path}/c"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "/nonexistent/model" in proc.stderr and "Traceback" not in proc.stderr


def test_engine_config_error_stops_serve_without_orphans(tmp_path):
    """A setting only an engine can check (a layer override past the model's 30 layers: serve checks scheme
    names, the engine the model) stops serve with exit 2 and leaves no process behind."""
    argv = [sys.executable, "-m", "services.cli", "serve", "--model", "default", "--address",
            f"ipc://{tmp_path}/c", "--kv-cache", "aura4v4+99=aura8v8", "--http-address", "off"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= set(child_pids(proc.pid))
        time.sleep(0.1)
    stderr = proc.communicate(timeout=30)[1]
    assert proc.returncode == 2, stderr[-2000:]
    assert "layer 99 is not a layer of this model" in stderr
    assert seen and not any(is_alive(p) for p in seen)


def test_killed_supervisor_takes_its_children_along(tmp_path):
    """`kill -9` of `serve` itself: the kernel signals every child (PR_SET_PDEATHSIG)."""
    srv = Server.start(tmp_path, "--max-active-requests", "1")
    try:
        pids = child_pids(srv.proc.pid)
        assert len(pids) == 3
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()
        wait_until(lambda: not any(is_alive(p) for p in pids), 15, "every orphaned child to exit")
    finally:
        srv.kill_everything()


def test_serve_with_an_invalid_address_fails_fast(tmp_path):
    t0 = time.monotonic()
    proc = cli("serve", "--model", "default", "--address", "127.0.0.1:5759", "--run-dir", str(tmp_path / "run"),
               timeout_s=30)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("buttermilk: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "127.0.0.1:5759" in proc.stderr and not any(n in proc.stderr for n in NOISE)
    assert time.monotonic() - t0 < 20


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--address", "127.0.0.1:5757"), "invalid address"),
        (("--timeout", "0"), "--timeout"),
        (("--timeout", "-1"), "--timeout"),
        (("--max-tokens", "-1"), "max_tokens"),
        (("--temperature", "nan"), "temperature"),
        (("--seed", "-1"), "seed"),
        (("--stop", ""), "stop"),
        (("--new-session",), "--new-session needs --session"),
        (("--session", "", "--new-session"), "--new-session needs --session"),
        (("--health", "--stats"), "--health and --stats"),
    ],
)  # fmt: skip
def test_client_usage_errors_are_one_line(flags, expected):
    proc = cli("client", "--prompt", "hi", "--address", free_tcp_address(), *flags, timeout_s=30)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("buttermilk: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert expected in proc.stderr and not any(n in proc.stderr for n in NOISE), proc.stderr


def test_client_with_no_server_fails_within_its_connect_timeout():
    address = free_tcp_address()
    t0 = time.monotonic()
    proc = cli("client", "--prompt", "hi", "--address", address, "--connect-timeout-s", "1", timeout_s=30)
    assert time.monotonic() - t0 < 10
    assert proc.returncode == 1, proc.stderr
    assert f"no server answered at {address} within 1 s" in proc.stderr, proc.stderr
    assert not any(n in proc.stderr for n in NOISE), proc.stderr


def _fake_gateway(address: str, stop: threading.Event) -> None:
    """Answers health, streams one token for a generate, then falls silent (a dead server)."""
    import zmq

    from shared.protocol import Generate, Health, HealthOk, Token, decode, encode

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    dead = False
    try:
        while not stop.is_set():
            if not sock.poll(50):
                continue
            peer, frame = sock.recv_multipart()
            msg = decode(frame)
            if dead:
                continue
            if isinstance(msg, Health):
                sock.send_multipart([peer, encode(HealthOk(id=msg.id, status="ok", engines_live=1))])
            elif isinstance(msg, Generate):
                sock.send_multipart([peer, encode(Token(id=msg.id, text="Hi", token_ids=[1], index=0))])
                dead = True
    finally:
        sock.close(linger=0)
        ctx.term()


def test_client_reports_a_server_that_dies_mid_stream():
    address = free_tcp_address()
    stop = threading.Event()
    thread = threading.Thread(target=_fake_gateway, args=(address, stop), daemon=True)
    thread.start()
    try:
        t0 = time.monotonic()
        proc = cli("client", "--prompt", "hi", "--address", address, "--connect-timeout-s", "1", timeout_s=30)
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        thread.join(timeout=5)
    assert proc.returncode == 1 and proc.stdout.startswith("Hi"), (proc.stdout, proc.stderr)
    assert f"no server answered at {address} within 1 s" in proc.stderr, proc.stderr
    assert not any(n in proc.stderr for n in NOISE) and elapsed < 10
