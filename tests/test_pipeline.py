"""The serving pipeline end to end: real `buttermilk serve` processes, real sockets, real model.

One server (one engine) is shared by the module. After every test the server must be idle:
no reservations, leases, sessions, queued or active requests, held KV tokens or slots.
"""

from __future__ import annotations

import asyncio
import os
import random
import select
import signal
import subprocess
import sys
import time

import msgpack
import pytest
import zmq
import zmq.asyncio

from shared.client import AsyncClient, ServerError
from services.engine.request import cap_max_tokens
from shared.errors import ContextOverflow, ErrorCode
from services.eval.corpus import corpus_token_ids
from shared.protocol import MAX_FRAME_BYTES, Error, decode

from .pipeline_helpers import (
    MAX_CONTEXT,
    NOISE,
    REPO,
    Server,
    cli,
    is_alive,
    reference_generation,
    run,
    stats_of,
    wait_idle,
    wait_until,
)

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The three primary colors are",
    "A haiku about the sea:",
    "The largest planet in our solar system is",
    "To make a cup of tea, first",
    "The chemical symbol for gold is",
    "Once upon a time, in a small village,",
]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with Server.serving(tmp_path_factory.mktemp("serve"), "--max-active-requests", "8") as srv:
        yield srv


@pytest.fixture(autouse=True)
def idle_after(server):
    yield
    run(wait_idle(server.address))


@pytest.fixture(scope="module")
def references(default_model):
    """Greedy in-process completions of every prompt (tokenized as the gateway does)."""
    out = {}
    for prompt in PROMPTS:
        ids = list(default_model.tokenizer.encode(prompt, add_special_tokens=True))
        out[prompt] = reference_generation(default_model, ids, MAX_TOKENS)
    return out


def test_concurrent_clients_match_in_process_generation(server, references, default_model):
    eos = set(default_model.tokenizer.eos_token_ids)

    async def one_client(index: int) -> list[tuple[str, object]]:
        results = []
        async with AsyncClient(server.address) as client:
            for turn in range(4):
                prompt = PROMPTS[(index + turn) % len(PROMPTS)]
                results.append((prompt, await client.generate(prompt=prompt, max_tokens=MAX_TOKENS, timeout_s=120)))
        return results

    async def main():
        return await asyncio.gather(*(one_client(i) for i in range(8)))

    for results in run(main()):
        for prompt, got in results:
            text, ids, reason = references[prompt]
            assert (got.text, got.finish_reason) == (text, reason), prompt
            assert got.token_ids == [t for t in ids if t not in eos]
            assert got.usage.completion_tokens == len(ids)


def test_streaming_is_incremental_and_indexed(server):
    async def main():
        async with AsyncClient(server.address) as client:
            stream = await client.stream(prompt=PROMPTS[7], max_tokens=8)
            return [t async for t in stream], stream.done

    tokens, done = run(main())
    assert len(tokens) >= 2  # several token messages, not one blob
    index = 0
    for token in tokens:
        assert token.index == index
        index += len(token.token_ids)
    assert done.usage.completion_tokens == 8 and done.finish_reason == "length"


def test_stop_string_ends_the_stream(server, references):
    text, _, _ = references[PROMPTS[7]]
    stop = text[4:7]  # a piece the model is known to produce, after some text

    async def main():
        async with AsyncClient(server.address) as client:
            return await client.generate(prompt=PROMPTS[7], max_tokens=MAX_TOKENS, stop=[stop])

    got = run(main())
    assert got.finish_reason == "stop" and got.text == text[: text.index(stop)]


def test_multi_turn_session_reuses_its_kv(server, default_model):
    tokenizer = default_model.tokenizer
    first, second = "My name is Ada and I like", " Tell me more about it:"

    async def main():
        async with AsyncClient(server.address) as client:
            one = await client.generate(prompt=first, max_tokens=6, session_id="chat-1", new_session=True)
            two = await client.generate(prompt=second, max_tokens=8, session_id="chat-1")
            stats = await client.stats()
            await client.close_session("chat-1")
            return one, two, stats

    one, two, stats = run(main())
    assert two.usage.cached_tokens > 0
    assert stats.num_sessions == 1 and stats.engines[0].held_tokens > 0
    history = list(tokenizer.encode(first, add_special_tokens=True)) + one.token_ids
    if one.finish_reason == "stop":
        history.append(next(iter(tokenizer.eos_token_ids)))
    whole = history + list(tokenizer.encode(second, add_special_tokens=False))
    assert two.usage.prompt_tokens == len(whole)
    text, _, _ = reference_generation(default_model, whole, 8)
    assert two.text == text


def test_session_turn_rules(server):
    async def main():
        async with AsyncClient(server.address) as client:
            with pytest.raises(ServerError) as unknown:
                await client.generate(prompt="hi", max_tokens=2, session_id="nope")
            await client.generate(prompt="hi", max_tokens=2, session_id="s2", new_session=True)
            with pytest.raises(ServerError) as again:
                await client.generate(prompt="hi", max_tokens=2, session_id="s2", new_session=True)
            await client.close_session("s2")
            return unknown.value, again.value

    unknown, again = run(main())
    assert unknown.code == again.code == ErrorCode.BAD_REQUEST


def test_cancel_mid_stream(server):
    async def main():
        async with AsyncClient(server.address) as client:
            stream = await client.stream(prompt=PROMPTS[3], max_tokens=200)
            received = 0
            async for token in stream:
                received += len(token.token_ids)
                if received >= 2:
                    await stream.cancel()
            return stream.done

    done = run(main())
    assert done.finish_reason == "cancelled" and 2 <= done.usage.completion_tokens < 200


def test_context_overflow_and_max_tokens_cap(server):
    async def main():
        async with AsyncClient(server.address) as client:
            with pytest.raises(ServerError) as overflow:
                await client.generate(prompt="word " * (MAX_CONTEXT + 10), max_tokens=4)
            with pytest.raises(ServerError) as full:
                await client.generate(token_ids=[28120] * MAX_CONTEXT, max_tokens=4)
            capped = await client.generate(token_ids=[28120] * (MAX_CONTEXT - 6), max_tokens=100)
            return overflow.value, full.value, capped

    overflow, full, capped = run(main())
    assert overflow.code == ErrorCode.CONTEXT_OVERFLOW and str(MAX_CONTEXT) in overflow.message
    with pytest.raises(ContextOverflow) as local:  # in-process generation counts the same tokens
        cap_max_tokens(MAX_CONTEXT, 4, MAX_CONTEXT)
    assert full.message == str(local.value)
    assert f"prompt ({MAX_CONTEXT} tokens) plus one generated token needs {MAX_CONTEXT + 1} tokens" in full.message
    assert capped.usage.completion_tokens <= 6 and capped.usage.prompt_tokens == MAX_CONTEXT - 6
    for args, code in ((["--prompt", "word " * (MAX_CONTEXT + 10)], "context_overflow"),
                       (["--prompt", "hi", "--session", "never-opened"], "bad_request")):
        proc = cli("client", "--address", server.address, *args)  # the request's own fault: a usage error
        assert proc.returncode == 2 and proc.stderr.startswith("buttermilk: error: " + code), proc.stderr
        assert proc.stderr.count("\n") == 1, proc.stderr


def test_malformed_frames_get_errors_and_nothing_dies(server):
    junk = [
        os.urandom(64),
        b"",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"v": 1, "type": "generate", "id": "r", "prompt": 5}),
        msgpack.packb({"v": 1, "type": "generate", "id": "r", "prompt": "x", "max_tokens": "many"}),
        msgpack.packb({"v": 1, "type": "teleport", "id": "r"}),
        msgpack.packb({"v": 1, "type": "reserve", "request_id": "r", "tokens": 5}),  # internal type
        msgpack.packb({"v": 1, "type": "generate", "id": "r", "prompt": "x" * (MAX_FRAME_BYTES // 2)}),
        msgpack.packb({"v": 2, "type": "health"}),
    ]

    async def main():
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(server.address)
        replies = []
        for frame in junk:
            await sock.send(frame)
            replies.append(decode(await asyncio.wait_for(sock.recv(), 10)))
        await sock.send_multipart([b"two", b"frames"])
        replies.append(decode(await asyncio.wait_for(sock.recv(), 10)))
        sock.close(0)
        ctx.term()
        await _garbage_to_internal_sockets(server)
        async with AsyncClient(server.address) as client:
            return replies, await client.generate(prompt=PROMPTS[0], max_tokens=3)

    replies, after = run(main())
    for reply in replies:
        assert isinstance(reply, Error) and reply.code == ErrorCode.BAD_REQUEST, reply
    assert after.usage.completion_tokens == 3
    assert server.proc.poll() is None and all(is_alive(p) for p in server.children)


async def _garbage_to_internal_sockets(server: Server) -> None:
    """Random frames on the controller, engine-cmd and engine-out sockets are logged and dropped."""
    ctx = zmq.asyncio.Context()
    rng = random.Random(7)
    for name, kind in (("controller", zmq.DEALER), ("engine-cmd", zmq.DEALER), ("engine-out", zmq.PUSH)):
        sock = ctx.socket(kind)
        sock.connect(f"ipc://{server.run_dir}/{name}")
        for _ in range(5):
            await sock.send(rng.randbytes(rng.randint(0, 100)))
        await sock.send(msgpack.packb({"v": 1, "type": "engine_finished", "id": "x"}))
        await asyncio.sleep(0.2)
        sock.close(0)
    ctx.term()


def test_ready_line_is_singular_for_one_engine(server):
    wait_until(lambda: "serving on" in server.log(), 10, "the ready line")
    assert f"serving on {server.address} (1 engine)" in server.log()


def test_second_serve_on_the_same_address_fails_cleanly(server, tmp_path):
    proc = cli("serve", "--model", "default", "--address", server.address, "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "address already in use" in proc.stderr and "serving on" not in proc.stderr
    assert not any(n in proc.stderr for n in NOISE), proc.stderr
    assert run(stats_of(server.address)).engines  # the first server is untouched


def test_a_deadline_mid_stream_puts_the_error_on_its_own_line(server):
    proc = cli("client", "--address", server.address, "--prompt", "Once upon a time", "--max-tokens", "200",
               "--timeout", "1.5")  # fmt: skip  (~15 tokens/s on a CPU: the deadline comes mid-stream)
    assert proc.returncode == 1 and proc.stderr.startswith("buttermilk: timeout: request"), proc.stderr
    assert proc.stdout.strip() and proc.stdout.endswith("\n"), proc.stdout
    assert not any(n in proc.stderr for n in NOISE), proc.stderr
    run(wait_idle(server.address))  # the cancelled request returned what it held


def test_ctrl_c_on_client_cancels_its_request(server):
    argv = [sys.executable, "-m", "services.cli", "client", "--address", server.address,
            "--prompt", "Once upon a time, in a small village, there lived", "--max-tokens", "200"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert select.select([proc.stdout], [], [], 60)[0], "no token streamed"
        os.read(proc.stdout.fileno(), 1)  # the first token arrived: the request is generating
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = stderr.decode(errors="replace")
    assert proc.returncode == 130, stderr
    assert not any(n in stderr for n in NOISE), stderr
    t0 = time.monotonic()
    stats = run(wait_idle(server.address, timeout_s=3))  # active 0, no engine tokens held
    assert stats.pool.active == 0 and time.monotonic() - t0 < 3


def test_clients_sharing_a_system_prompt_reuse_its_pages(server, default_model):
    """Issue 15 over the wire: 8 clients at once, one 200-token system prompt. The engine computes
    it once (12 full pages); `cached_tokens` tells the others, `stats` shows the prefix cache, and
    after the load only its evictable pages remain."""
    tokenizer = default_model.tokenizer
    system = corpus_token_ids(tokenizer, 200)
    questions = [list(tokenizer.encode(f" Q{i}: who is named first?")) for i in range(8)]

    async def ask(question):
        async with AsyncClient(server.address) as client:
            return await client.generate(token_ids=system + question, max_tokens=4)

    async def main():
        return await asyncio.gather(*(ask(q) for q in questions))

    before = run(wait_idle(server.address)).engines[0].prefix_cache
    done = run(main())
    assert sorted(c.usage.cached_tokens for c in done) == [0] + [192] * 7
    after = run(wait_idle(server.address)).engines[0].prefix_cache
    assert after.hit_tokens - before.hit_tokens == 7 * 192
    assert after.query_tokens - before.query_tokens == sum(c.usage.prompt_tokens for c in done)
    assert after.cached_tokens == after.evictable_tokens >= 192
    for question, completion in list(zip(questions, done))[:2]:
        text, _, _ = reference_generation(default_model, system + question, 4)
        assert completion.text == text
