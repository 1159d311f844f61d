"""Issue 11 against real processes: every accepted request ends, every resource has an owner.

One server (one engine, four slots, four active places, two per client) is shared by the module;
after every test it must be idle again. The soak and the frame fuzzer run in their short forms;
the last test stops the server with SIGTERM and checks that it drains.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio

from ops.fuzz_frames import fuzz
from ops.soak import run_soak
from shared.client import AsyncClient, ServerError
from shared.errors import ErrorCode
from shared.protocol import MAX_FRAME_BYTES, Error, decode

from .pipeline_helpers import (
    REPO,
    Server,
    child_pids,
    is_alive,
    reference_generation,
    run,
    stats_of,
    wait_idle,
    wait_until,
)

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPT = "Once upon a time, in a small village, there lived"  # a long greedy continuation
FLAGS = ("--max-slots", "4", "--max-active-requests", "4", "--client-max-active", "2", "--client-max-queued", "4",
         "--engine-timeout-s", "2", "--drain-timeout-s", "3")  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with Server.serving(tmp_path_factory.mktemp("serve-reliability"), *FLAGS, clean_stop=False) as srv:
        yield srv


@pytest.fixture(autouse=True)
def idle_after(server):
    yield
    if server.proc.poll() is None:
        run(wait_idle(server.address, timeout_s=15))


async def _outcome(coro):
    try:
        return await coro
    except ServerError as exc:
        return exc


def test_idle_sessions_cannot_starve_a_request_item1(server, default_model):
    """4 slots held by 4 idle sessions; another client's request evicts the oldest and runs."""
    prompt = "The capital of France is"
    ids = list(default_model.tokenizer.encode(prompt, add_special_tokens=True))
    expected_text, _, _ = reference_generation(default_model, ids, 4)

    async def main():
        async with AsyncClient(server.address) as keeper, AsyncClient(server.address) as other:
            for i in range(4):
                await keeper.generate(prompt="hi", max_tokens=1, session_id=f"idle{i}", new_session=True)
            held = await keeper.stats()
            got = await other.generate(prompt=prompt, max_tokens=4, timeout_s=60)
            evicted = await _outcome(keeper.generate(token_ids=[198], max_tokens=1, session_id="idle0"))
            kept = await keeper.generate(token_ids=[198], max_tokens=1, session_id="idle3")
            for i in range(1, 4):
                await keeper.close_session(f"idle{i}")
            return held, got, evicted, kept

    held, got, evicted, kept = run(main())
    assert (held.num_sessions, held.engines[0].reserved_slots, held.engines[0].max_slots) == (4, 4, 4)
    assert got.text == expected_text and got.usage.completion_tokens == 4
    assert isinstance(evicted, ServerError) and evicted.code == ErrorCode.CANCELLED  # the oldest went
    assert kept.usage.cached_tokens > 0


def test_a_stop_string_leaves_the_session_with_what_was_reported_item5(server, default_model):
    async def main():
        async with AsyncClient(server.address) as client:
            one = await client.generate(prompt="1, 2, 3, 4, 5,", stop=[" 9, 10"], max_tokens=40, session_id="s",
                                        new_session=True)  # fmt: skip
            two = await client.generate(token_ids=[198], max_tokens=2, session_id="s")
            await client.close_session("s")
            return one, two

    one, two = run(main())
    assert one.finish_reason == "stop"
    assert two.usage.prompt_tokens == one.usage.prompt_tokens + one.usage.completion_tokens + 1
    history = list(default_model.tokenizer.encode("1, 2, 3, 4, 5,", add_special_tokens=True)) + one.token_ids
    text, _, _ = reference_generation(default_model, [*history, 198], 2)
    assert two.text == text  # the engine's KV was cut to the reported history too


VANISHING_CLIENT = """
import asyncio, sys
from shared.client import AsyncClient

async def main():
    c = AsyncClient(sys.argv[1])
    await c.generate(prompt="hi", max_tokens=1, session_id="mine", new_session=True)
    await c.stream(prompt=sys.argv[2], max_tokens=200, stream=sys.argv[3] == "stream")
    print("sent", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.parametrize("mode", ["stream", "whole"])
def test_a_client_without_a_lease_that_dies_stops_its_work_item4(server, tmp_path, mode):
    script = tmp_path / "vanish.py"
    script.write_text(VANISHING_CLIENT)
    proc = subprocess.Popen([sys.executable, str(script), server.address, PROMPT, mode], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "sent"

        def running() -> bool:
            stats = run(stats_of(server.address))
            return stats.pool.active == 1 and stats.engines[0].engine_tokens > 0

        wait_until(running, 60, "the request to run on the engine")
        proc.kill()  # no cancel, no close: the connection just goes away
        proc.wait()
        # 200 tokens take tens of seconds here; the work and the connection's session end within seconds.
        run(wait_idle(server.address, timeout_s=8))
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sessions_are_private_to_their_owner_item7(server):
    async def main():
        async with AsyncClient(server.address) as owner, AsyncClient(server.address) as other:
            await owner.generate(prompt="My name is Ada.", max_tokens=2, session_id="chat", new_session=True)
            theirs = await _outcome(other.generate(token_ids=[198], max_tokens=1, session_id="chat"))
            never = await _outcome(other.generate(token_ids=[198], max_tokens=1, session_id="none"))
            await other.close_session("chat")  # answered like any unknown id, and changes nothing
            own = await other.generate(prompt="hi", max_tokens=1, session_id="chat", new_session=True)
            mine = await owner.generate(token_ids=[198], max_tokens=1, session_id="chat")
            stats = await owner.stats()
            await owner.close_session("chat")
            await other.close_session("chat")
            return theirs, never, own, mine, stats

    theirs, never, own, mine, stats = run(main())
    assert theirs.code == never.code == ErrorCode.BAD_REQUEST
    assert theirs.message.replace("'chat'", "'none'") == never.message
    assert own.usage.cached_tokens == 0 and mine.usage.cached_tokens > 0 and stats.num_sessions == 2


def test_per_client_limits_item8(server):
    async def main():
        async with AsyncClient(server.address) as greedy, AsyncClient(server.address) as polite:
            streams = [await greedy.stream(prompt="hi", max_tokens=3, stream=False) for _ in range(7)]
            outcomes = await asyncio.gather(*(_outcome(s.collect()) for s in streams))
            served = await polite.generate(prompt="hi", max_tokens=3)
            leases = [await _outcome(greedy.open_lease(ttl_s=30, heartbeat=False)) for _ in range(5)]
            for lease_id in leases[:4]:
                greedy.lease_id = lease_id
                await greedy.close_lease()
            return leases, outcomes, served

    leases, outcomes, served = run(main())
    assert all(isinstance(x, str) for x in leases[:4]) and isinstance(leases[4], ServerError)
    assert leases[4].code == ErrorCode.OVERLOADED and "client_max_leases 4" in leases[4].message
    refused = [o for o in outcomes if isinstance(o, ServerError)]
    assert len(refused) == 1 and refused[0].code == ErrorCode.OVERLOADED
    assert "client_max_active 2 + client_max_queued 4" in refused[0].message
    assert sum(not isinstance(o, ServerError) for o in outcomes) == 6 and served.usage.completion_tokens == 3


def test_huge_prompts_do_not_starve_engine_liveness_item9(server):
    """Tokenizing 4 prompts of 1,048,575 characters took seconds on the gateway's loop; the
    engine (heartbeat timeout 2 s here) was declared dead. Now the stream beside them ends well."""
    huge = "word " * 209_715

    async def main():
        async with AsyncClient(server.address) as client:
            before = await client.stats()
            stream = await client.stream(prompt=PROMPT, max_tokens=30)
            await stream.__anext__()
            bulk = [_outcome(client.generate(prompt=huge, max_tokens=1, timeout_s=120)) for _ in range(4)]
            results = await asyncio.gather(stream.collect(), *bulk)
            return before, results, await client.stats()

    before, (streamed, *big), after = run(main())
    assert streamed.finish_reason == "length" and streamed.usage.completion_tokens == 30
    assert all(isinstance(b, ServerError) and b.code == ErrorCode.CONTEXT_OVERFLOW for b in big)
    assert after.engines[0].epoch == before.engines[0].epoch  # never declared dead


def _gateway_rss_kib(server: Server) -> int:
    for pid in child_pids(server.proc.pid):
        if b"gateway" in Path(f"/proc/{pid}/cmdline").read_bytes():
            status = Path(f"/proc/{pid}/status").read_text()
            return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
    raise AssertionError("no gateway process")


def test_frames_are_answered_with_their_readable_id_and_huge_ones_cut_unread_item10(server):
    invalid_utf8 = msgpack.packb({"v": 1, "type": "generate", "id": "u1", "prompt": "zz"})
    invalid_utf8 = invalid_utf8.replace(b"\xa2zz", b"\xa2\xff\xfe")
    int_key = msgpack.packb({"v": 1, "type": "generate", "id": "u2", "prompt": "x", "extra": {1: 2}})

    async def main():
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(server.address)
        replies = []
        for frame in (invalid_utf8, int_key):
            await sock.send(frame)
            replies.append(decode(await asyncio.wait_for(sock.recv(), 10)))
        rss_before = _gateway_rss_kib(server)
        big = ctx.socket(zmq.DEALER)
        big.connect(server.address)
        await big.send(b"\x00" * (64 * 1024 * 1024))  # 64 MiB: refused by the socket as it arrives
        answered = await big.poll(timeout=2000)
        rss_after = _gateway_rss_kib(server)
        for s in (sock, big):
            s.close(0)
        ctx.term()
        async with AsyncClient(server.address) as client:
            return replies, answered, rss_after - rss_before, await client.health()

    replies, answered, grown_kib, health = run(main())
    assert [(r.id, r.code) for r in replies] == [("u1", ErrorCode.BAD_REQUEST), ("u2", ErrorCode.BAD_REQUEST)]
    assert all(isinstance(r, Error) for r in replies)
    assert not answered and grown_kib < 16 * 1024  # the frame was never buffered whole
    assert health.status == "ok" and MAX_FRAME_BYTES < 64 * 1024 * 1024


def test_tiny_temperature_and_top_p_are_greedy_item11(server, default_model):
    ids = list(default_model.tokenizer.encode(PROMPT, add_special_tokens=True))
    expected, _, _ = reference_generation(default_model, ids, 8)

    async def main():
        async with AsyncClient(server.address) as client:
            tiny_t = await client.generate(prompt=PROMPT, max_tokens=8, temperature=1e-39, seed=1)
            tiny_p = await client.generate(prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=1e-300, seed=1)
            return tiny_t, tiny_p

    tiny_t, tiny_p = run(main())
    assert tiny_t.text == expected and tiny_p.text == expected


def test_soak_and_fuzzer_short_forms(server):
    """`python -m ops.soak` and `python -m ops.fuzz_frames` in short form (see ops/ for the long ones)."""
    soak = run_soak(server.address, duration_s=12, clients=4, workers=2, engine_kills=1, client_kills=2, seed=1,
                    server_pids=[server.proc.pid, *child_pids(server.proc.pid)], num_prompts=3,
                    log=lambda _: None)  # fmt: skip
    assert soak["completed"] > 0 and soak["engine_kills"] == 1 and soak["client_kills"] == 2
    problems = {k: soak[k] for k in ("wrong", "hung", "unanswered", "unexpected_deaths")}
    examples = {k: soak[k] for k in ("wrong_examples", "hung_examples") if soak.get(k)}
    assert problems == {"wrong": 0, "hung": 0, "unanswered": 0, "unexpected_deaths": 0}, (examples, soak)  # why first
    assert soak["leaks"] == {}, soak
    server.wait_ready()
    fuzzed = run(fuzz(server.address, frames=300, seed=1, timeout_s=90))
    assert (fuzzed["hung"], fuzzed["problems"], fuzzed["health_after"]) == (0, {}, "ok"), fuzzed
    assert fuzzed["oversized"]["answered"] == 0


def test_sigterm_drains_and_every_request_gets_its_end_item2(server):
    """Two requests running and one queued (this client's cap is 2): SIGTERM to `serve`."""

    async def main():
        async with AsyncClient(server.address) as client:
            running = [await client.stream(prompt=PROMPT, max_tokens=200) for _ in range(2)]
            for stream in running:
                await stream.__anext__()
            queued = await client.stream(prompt=PROMPT, max_tokens=4)
            await asyncio.sleep(0.3)
            server.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*(_outcome(s.collect()) for s in [*running, queued]))

    pids = child_pids(server.proc.pid)
    *running, queued = run(main())
    assert isinstance(queued, ServerError) and queued.code == ErrorCode.UNAVAILABLE and queued.retryable
    for outcome in running:  # 200 tokens take far longer than the 3 s grace here
        assert isinstance(outcome, ServerError) and outcome.code == ErrorCode.UNAVAILABLE, outcome
    assert server.proc.wait(timeout=60) == 0
    wait_until(lambda: not any(is_alive(p) for p in pids), 10, "every child to exit")
