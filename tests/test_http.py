"""The OpenAI-compatible HTTP API and /metrics of a live `buttermilk serve`, with the official client.

One server (one engine, 2 running + 1 queued requests at most, the KV pool sized by memory)
is shared by the module. HTTP answers are compared with the ZeroMQ path's for the same
inputs; after every test the server is idle again. The engine-failure test kills the engine
(the supervisor restarts it), so it runs last.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.client import AsyncClient, Client

from .pipeline_helpers import REPO, Server, cli, run, stats_of, wait_idle, wait_until

pytestmark = [pytest.mark.model, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
KV_MEMORY_GIB = "0.2"
FLAGS = ("--kv-memory-gib", KV_MEMORY_GIB, "--max-slots", "8", "--step-token-budget", "256", "--max-context", "256")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
STORY = "Once upon a time, in a small village,"  # greedy, runs long without an end-of-sequence token
MAX_TOKENS = 8
LONG = 200  # tokens of a request meant to be interrupted


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with Server.serving(tmp_path_factory.mktemp("http"), "--max-active-requests", "2", "--max-queue", "1",
                        base_flags=FLAGS) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def api(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(autouse=True)
def idle_after(server):
    yield
    run(wait_idle(server.address, timeout_s=30))


def zmq(server, **request):
    with Client(server.address) as client:
        return client.generate(**request)


def scrape(server) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics by (name, sorted labels)."""
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


def total(samples: dict, name: str) -> float:
    """Sum of a series over all its label sets."""
    return sum(v for (n, _), v in samples.items() if n == "buttermilk:" + name)


def delta(after: dict, before: dict, name: str) -> float:
    return total(after, name) - total(before, name)


def usage_of(u) -> tuple[int, int, int]:
    return u.prompt_tokens, u.completion_tokens, u.prompt_tokens_details.cached_tokens


def raw_post(server, path: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POST `body` as JSON; the caller closes the connection (that is what closes the socket)."""
    conn = http.client.HTTPConnection(server.http_url.removeprefix("http://"), timeout=60)
    conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
    return conn, conn.getresponse()


def test_models_health_and_ready(server, api):
    assert [m.id for m in api.models.list().data] == [MODEL]
    before = scrape(server)
    for path, status in (("/health", 200), ("/ready", 200), ("/ready?engine_id=e0", 200), ("/ready?engine_id=e9", 503)):
        try:
            with urllib.request.urlopen(server.http_url + path, timeout=10) as resp:
                code = resp.status
        except urllib.error.HTTPError as exc:
            code = exc.code
        assert code == status, path
    after = scrape(server)
    assert delta(after, before, "request_received_total") == 0  # health never runs a generation


def test_chat_matches_the_zmq_path_streamed_or_not(server, api):
    zmq(server, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0.0)  # the prompt's full pages enter the prefix cache
    ref = zmq(server, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0.0)  # as warm as the HTTP requests below
    resp = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    choice = resp.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", ref.text, ref.finish_reason)
    assert usage_of(resp.usage) == (ref.usage.prompt_tokens, ref.usage.completion_tokens, ref.usage.cached_tokens)
    assert resp.usage.total_tokens == ref.usage.prompt_tokens + ref.usage.completion_tokens
    chunks = list(api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    body, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].delta.content or "" for c in body) == ref.text
    finishes = [c.choices[0].finish_reason for c in body]
    assert finishes[-1] == ref.finish_reason and set(finishes[:-1]) == {None}
    assert usage_chunk.choices == [] and usage_of(usage_chunk.usage) == usage_of(resp.usage)
    # max_completion_tokens wins over max_tokens.
    short = zmq(server, messages=CHAT, max_tokens=3, temperature=0.0)
    capped = api.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=3, max_tokens=50,
                                         temperature=0)  # fmt: skip
    assert (capped.choices[0].message.content, capped.usage.completion_tokens) == (short.text, 3)


def test_completions_match_the_zmq_path_streamed_or_not(server, api):
    zmq(server, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)  # warms the prefix cache, as above
    ref = zmq(server, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    resp = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert (resp.choices[0].text, resp.choices[0].finish_reason) == (ref.text, ref.finish_reason)
    assert usage_of(resp.usage) == (ref.usage.prompt_tokens, ref.usage.completion_tokens, ref.usage.cached_tokens)
    chunks = list(api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == ref.finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk
    by_ids = api.completions.create(model=MODEL, prompt=ref_token_ids(server), max_tokens=MAX_TOKENS, temperature=0)
    assert by_ids.choices[0].text == ref.text


def ref_token_ids(server) -> list[int]:
    """The prompt's token ids as the gateway encodes it (from the default model's tokenizer)."""
    from mlx_lm.utils import load_config, load_tokenizer

    from services.engine.model.paths import resolve_model

    path = resolve_model("default", dtype="float32")
    tokenizer = load_tokenizer(path, eos_token_ids=load_config(path).get("eos_token_id"))
    return list(tokenizer.encode(PROMPT, add_special_tokens=True))


def test_stream_wire_format(server):
    conn, resp = raw_post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 4,
                                                           "stream": True, "stream_options": {"include_usage": True}})
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = resp.read().decode().split("\n\n")
    conn.close()
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 4
    assert all(p["usage"] is None for p in payloads[:-1]) and len({p["id"] for p in payloads}) == 1


def test_stop_strings(server, api):
    full = zmq(server, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0.0).text
    assert "Paris" in full, full
    ref = zmq(server, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0.0, stop=["Paris"])
    resp = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stop="Paris")
    assert resp.choices[0].message.content == ref.text == full[: full.index("Paris")]
    assert resp.choices[0].finish_reason == "stop"
    assert usage_of(resp.usage)[:2] == (ref.usage.prompt_tokens, ref.usage.completion_tokens)
    streamed = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                           stop=["Paris", "France"], stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == full[: full.index("France")]


def test_seed_makes_sampling_reproducible(server, api):
    request = {"model": MODEL, "messages": CHAT, "max_tokens": 5, "temperature": 1.0, "seed": 1234}
    first, second = (api.chat.completions.create(**request).choices[0].message.content for _ in range(2))
    ref = zmq(server, messages=CHAT, max_tokens=5, temperature=1.0, seed=1234)
    assert first == second == ref.text


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_bad_requests_are_400_and_unknown_models_404(server, api):
    with pytest.raises(openai.BadRequestError) as n:
        api.chat.completions.create(model=MODEL, messages=CHAT, n=2)
    assert error_of(n.value)["param"] == "n" and n.value.response.headers["x-should-retry"] == "false"
    with pytest.raises(openai.BadRequestError) as long:
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "milk " * 400}])
    error = error_of(long.value)
    assert (error["code"], error["param"], error["type"]) == ("context_length_exceeded", "messages",
                                                               "invalid_request_error")  # fmt: skip
    with pytest.raises(openai.NotFoundError) as missing:
        api.completions.create(model="gpt-4", prompt=PROMPT)
    assert error_of(missing.value)["code"] == "model_not_found"


async def occupy(server, num: int):
    """Start `num` long ZeroMQ streams; returns (client, streams) once the pool shows them."""
    client = AsyncClient(server.address)
    streams = [await client.stream(prompt=STORY, max_tokens=LONG, temperature=0.0) for _ in range(num)]
    deadline = time.monotonic() + 30
    while (pool := (await client.stats()).pool).active + pool.queued < num:
        assert time.monotonic() < deadline, "the pool never showed the streams"
        await asyncio.sleep(0.05)
    return client, streams


async def release(client, streams) -> None:
    for stream in streams:
        await stream.cancel()
    for stream in streams:
        async for _ in stream:
            pass
    await client.close()


def test_full_queue_is_429_with_retry_after(server, api):
    async def scenario():
        client, streams = await occupy(server, 3)  # 2 running + 1 queued: full
        try:
            return await asyncio.to_thread(lambda: pytest.raises(openai.RateLimitError, api.chat.completions.create,
                                                                 model=MODEL, messages=CHAT, max_tokens=4))
        finally:
            await release(client, streams)

    caught = run(scenario())
    error, headers = error_of(caught.value), caught.value.response.headers
    assert caught.value.status_code == 429 and error["code"] == "overloaded" and error["type"] == "rate_limit_error"
    assert int(headers["retry-after-ms"]) >= 50 and headers["x-should-retry"] == "true"


def gauges_at_baseline(samples: dict) -> bool:
    return all(total(samples, n) == 0 for n in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                                                  "kv_tokens_reserved", "kv_tokens_held", "slots_used"))  # fmt: skip


def test_disconnect_mid_stream_returns_every_counter_to_baseline(server):
    before = scrape(server)
    assert gauges_at_baseline(before)
    conn, resp = raw_post(server, "/v1/completions", {"model": MODEL, "prompt": STORY, "max_tokens": LONG,
                                                      "temperature": 0, "stream": True})  # fmt: skip
    for _ in range(2):  # two text chunks
        assert resp.readline().startswith(b"data: {") and resp.readline() == b"\n"
    resp.close()
    conn.close()  # the client goes away mid-stream
    stats = run(wait_idle(server.address, timeout_s=30))
    assert stats.engines[0].engine_tokens == 0 and stats.engines[0].used_slots == 0
    wait_until(lambda: gauges_at_baseline(scrape(server)), 10, "the gauges to return to baseline")
    after = scrape(server)
    assert delta(after, before, "request_cancelled_total") == 1
    assert delta(after, before, "request_received_total") == 1
    assert 0 < delta(after, before, "generation_tokens_total") < LONG  # aborted on the engine


def test_disconnect_while_queued_leaves_the_queue(server):
    async def scenario():
        client, streams = await occupy(server, 2)  # both running places taken
        try:
            resp = await asyncio.to_thread(_queued_then_gone, server)
            deadline = time.monotonic() + 10
            while (await client.stats()).pool.queued:
                assert time.monotonic() < deadline, "the queued HTTP request stayed queued"
                await asyncio.sleep(0.05)
            return resp
        finally:
            await release(client, streams)

    run(scenario())


def _queued_then_gone(server) -> None:
    conn = http.client.HTTPConnection(server.http_url.removeprefix("http://"), timeout=60)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "stream": True}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    wait_until(lambda: run(stats_of(server.address)).pool.queued == 1, 10, "the HTTP request to queue")
    conn.close()


def one_request(api, kind: str) -> tuple[str, tuple[int, int] | None]:
    """Run one scripted request; returns (outcome, (prompt, completion tokens) when it finished)."""
    try:
        if kind == "chat":
            r = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
            return "ok", (r.usage.prompt_tokens, r.usage.completion_tokens)
        if kind == "stream":
            chunks = list(api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True,
                                                 stream_options={"include_usage": True}, seed=3))  # fmt: skip
            return "ok", (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens)
        api.completions.create(model=MODEL, prompt="milk " * 400)
    except openai.RateLimitError:
        return "overloaded", None
    except openai.BadRequestError as exc:
        return error_of(exc)["code"], None
    raise AssertionError("a too-long prompt was accepted")


def test_scripted_load_counters_add_up(server, api):
    before = scrape(server)
    kinds = ["chat", "stream", "chat", "long", "stream", "chat", "long", "chat"]
    with ThreadPoolExecutor(len(kinds)) as pool:
        results = list(pool.map(lambda k: one_request(api, k), kinds))
    run(wait_idle(server.address, timeout_s=30))
    after = scrape(server)
    outcomes = [o for o, _ in results]
    finished = [u for _, u in results if u is not None]
    # a long prompt is refused for its length, or `overloaded` first where it found the tokenizer's places full
    assert {o for k, o in zip(kinds, outcomes) if k == "long"} <= {"context_length_exceeded", "overloaded"}
    assert finished and all(o in ("ok", "overloaded") for k, o in zip(kinds, outcomes) if k != "long")
    assert delta(after, before, "request_received_total") == len(kinds)
    assert delta(after, before, "request_success_total") == len(finished)
    assert delta(after, before, "request_failure_total") == len(kinds) - len(finished)
    assert delta(after, before, "admission_rejections_total") == len(kinds) - len(finished)
    assert delta(after, before, "request_cancelled_total") == 0
    assert delta(after, before, "prompt_tokens_total") == sum(p for p, _ in finished)
    assert delta(after, before, "generation_tokens_total") == sum(c for _, c in finished)
    for histogram in ("e2e_request_latency_seconds_count", "time_to_first_token_seconds_count"):
        assert delta(after, before, histogram) == len(finished)
    assert (total(after, "request_received_total") == total(after, "request_success_total")
            + total(after, "request_cancelled_total") + total(after, "request_failure_total"))  # fmt: skip


def test_kv_usage_matches_the_engine_report_and_sessions_free_it(server, api):
    first = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"session_id": "http-s1", "new_session": True})  # fmt: skip
    held = first.usage.prompt_tokens + first.usage.completion_tokens - 1  # the last token's K/V is never computed
    pages = 16 * math.ceil(held / 16)  # whole pages
    run(wait_idle(server.address, sessions=1))
    # engine_tokens is the engine's latest heartbeat (every 0.5 s): wait for one sent after the turn.
    wait_until(lambda: run(stats_of(server.address)).engines[0].engine_tokens == pages, 10, "the engine to report the session")
    engine = run(stats_of(server.address)).engines[0]
    assert engine.held_tokens == held and engine.engine_tokens == pages
    labels = (("engine_id", "e0"),)
    samples = scrape(server)
    capacity = samples[("buttermilk:kv_cache_capacity_tokens", labels)]
    wait_until(lambda: scrape(server)[("buttermilk:kv_cache_usage_perc", labels)] == engine.engine_tokens / capacity,
               10, "the KV usage gauge to show the session")  # fmt: skip
    assert scrape(server)[("buttermilk:kv_tokens_held", labels)] == held
    second = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "And of Spain?"}],
                                         max_tokens=MAX_TOKENS, temperature=0, extra_body={"session_id": "http-s1"})
    assert second.usage.prompt_tokens_details.cached_tokens == held
    with urllib.request.urlopen(urllib.request.Request(server.http_url + "/v1/sessions/http-s1", method="DELETE")) as r:
        assert json.loads(r.read()) == {"id": "http-s1", "object": "session", "deleted": True}
    run(wait_idle(server.address))
    wait_until(lambda: gauges_at_baseline(scrape(server)), 10, "the gauges to return to baseline")


def test_pool_size_predicts_the_running_engine_capacity(server):
    proc = cli("pool-size", "--memory-gib", KV_MEMORY_GIB, "--schemes", "raw", "--context", "256", "--json")
    predicted = json.loads(proc.stdout)["rows"][0]
    assert scrape(server)[("buttermilk:kv_cache_capacity_tokens", (("engine_id", "e0"),))] == predicted["capacity_tokens"]
    line = next(line for line in server.log().splitlines() if "kv_pool" in line)
    assert f"capacity_tokens={predicted['capacity_tokens']}" in line
    assert f"Maximum concurrency for 256 tokens per request: {predicted['max_concurrency']['context']:.2f}x" in line


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_readme_curl_streams(server):
    readme = (REPO / "README.md").read_text()
    command = re.search(r"```bash\n(curl -N [^`]*?)\n```", readme).group(1)
    command = command.replace("127.0.0.1:8000", server.http_url.removeprefix("http://"))
    command = re.sub(r'"max_tokens": \d+', '"max_tokens": 4', command)  # the same request, shorter
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.rstrip().endswith("data: [DONE]"), out.stdout[-500:]
    assert '"role":"assistant"' in out.stdout


def test_engine_failure_is_503_then_the_engine_comes_back(server, api):
    """Kill the engine mid-request: 503 engine_failed, /ready 503, then a restart at epoch 1."""
    result: dict = {}

    def call() -> None:
        try:
            api.completions.create(model=MODEL, prompt=STORY, max_tokens=LONG, temperature=0)
        except openai.APIStatusError as exc:
            result["error"] = exc

    thread = threading.Thread(target=call)
    thread.start()
    wait_until(lambda: any(e.engine_tokens for e in run(stats_of(server.address)).engines), 30, "the request to run")
    pid = run(stats_of(server.address)).engines[0].pid
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=60)
    error = result["error"]
    assert error.status_code == 503 and error_of(error)["code"] == "engine_failed"
    assert error.response.headers["x-should-retry"] == "true"
    with pytest.raises(urllib.error.HTTPError) as not_ready:
        urllib.request.urlopen(server.http_url + "/ready", timeout=10)
    assert not_ready.value.code == 503
    server.wait_ready()
    assert scrape(server)[("buttermilk:engine_restarts_total", (("engine_id", "e0"),))] == 1
    assert api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).usage.completion_tokens == 2
