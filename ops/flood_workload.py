"""The tokenizer-flood workload of `ops.loadgen`: does one short prompt get through a flood of huge ones?

`--clients` flooding connections each send as many prompts as a connection may have in flight
(`client_max_active + client_max_queued`, 20 by default) of `--flood-chars` characters each: far
over the context, so each is tokenized (the gateway's one tokenizer thread, ~0.5 s a MB on one
core of a 2-core host) and then refused `context_overflow` (over HTTP `context_length_exceeded`).
`--flood-head-start-s` later a probe sends one short greedy generate (`--max-tokens`). Recorded:
the probe's outcome, its time to first token (TTFT) and to its end, and the flood's outcomes by
error code ("made way": ended `overloaded` to give another connection its place at the
tokenizer) with the `retry_after_ms` they were told (one flood prompt sent before the flood sets
the tokenizer's measured rate). Written to `ops/results/loadgen_flood_<device>.json`
(`loadgen_flood_http_<device>.json` over HTTP); a benchmark, not a test.

Over HTTP (`--flood-via http`, a server started here) every request is a connection of its own,
and the gateway gives each caller one turn of the tokenizer's deficit round robin: an OpenAI `user`, else
a client address. The run is made twice: every request anonymous (one caller, 127.0.0.1: first
come, first served), then each flooding connection's requests, and the probe, naming a `user`.

    python -m ops.loadgen --workload flood --start --clients 4
    python -m ops.loadgen --workload flood --address tcp://127.0.0.1:5555   # a server already running
    python -m ops.loadgen --workload flood --start --flood-via http
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import statistics
import time
from collections.abc import Awaitable, Callable

from services.gateway.clients import ClientLimits
from shared.client import AsyncClient, ServerError

from .loadgen import PROMPT, start_server, stop_server

PER_CONNECTION = ClientLimits().max_active + ClientLimits().max_queued  # what a connection may have in flight
Flood = Callable[[int, str], Awaitable[tuple[str, int | None]]]  # (flooder, text) -> (outcome, retry_after_ms)
Probe = Callable[[int], Awaitable[dict]]  # max_tokens -> figures
Transport = tuple[Flood, Probe, Callable[[], Awaitable[None]]]  # and close


def _outcome(code: str, message: str, retry_after_ms: int | None) -> tuple[str, int | None]:
    return code + (" (made way)" if "made way" in message else ""), retry_after_ms


async def _zmq(address: str, clients: int) -> Transport:
    flooders = [AsyncClient(address) for _ in range(clients)]

    async def flood(i: int, text: str) -> tuple[str, int | None]:
        try:
            await (await flooders[i].stream(prompt=text, max_tokens=4, timeout_s=900)).collect()
            return "done", None
        except ServerError as exc:
            return _outcome(exc.code.value, exc.message, exc.retry_after_ms)

    async def probe(max_tokens: int) -> dict:
        async with AsyncClient(address) as client:
            start = time.monotonic()
            try:
                done = await (await client.stream(prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                                  timeout_s=900)).collect()  # fmt: skip
            except ServerError as exc:
                return {"outcome": exc.code.value, "message": exc.message, "retry_after_ms": exc.retry_after_ms,
                        "end_s": round(time.monotonic() - start, 2)}  # fmt: skip
            return {"outcome": done.finish_reason, "ttft_s": round(done.first_token_s, 2),
                    "end_s": round(time.monotonic() - start, 2), "completion_tokens": len(done.token_ids)}  # fmt: skip

    async def close() -> None:
        for client in flooders:
            await client.close()

    return flood, probe, close


async def _http(url: str, named: bool) -> Transport:
    import openai  # the `test` extra's; only this transport needs it

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)

    def user(name: str) -> dict:
        return {"user": name} if named else {}

    def failed(exc: openai.APIError) -> tuple[str, int | None]:  # an error status, or an error event in the stream
        retry = exc.response.headers.get("retry-after-ms") if isinstance(exc, openai.APIStatusError) else None
        return _outcome(exc.code or type(exc).__name__, exc.message, retry and int(retry))

    async def flood(i: int, text: str) -> tuple[str, int | None]:
        try:
            await client.completions.create(model="default", prompt=text, max_tokens=4, **user(f"flooder{i}"))
            return "done", None
        except openai.APIError as exc:
            return failed(exc)

    async def probe(max_tokens: int) -> dict:
        start, first, finish = time.monotonic(), None, None
        try:
            stream = await client.completions.create(model="default", prompt=PROMPT, max_tokens=max_tokens,
                                                     temperature=0, stream=True, **user("probe"))  # fmt: skip
            async for chunk in stream:
                for choice in chunk.choices:
                    if choice.text and first is None:
                        first = time.monotonic() - start
                    finish = choice.finish_reason or finish
        except openai.APIError as exc:
            outcome, retry_after_ms = failed(exc)
            return {"outcome": outcome, "message": exc.message, "retry_after_ms": retry_after_ms,
                    "end_s": round(time.monotonic() - start, 2)}  # fmt: skip
        return {"outcome": finish, "ttft_s": first and round(first, 2), "end_s": round(time.monotonic() - start, 2)}

    return flood, probe, client.close


async def one_run(
    transport: Awaitable[Transport], clients: int, flood_chars: int, head_start_s: float, max_tokens: int
) -> dict:
    """One flood and one probe over `transport` (`_zmq`'s or `_http`'s); the probe's figures, the flood's outcomes."""
    flood, probe, close = await transport
    text = ("milk " * (flood_chars // 5 + 1))[:flood_chars]
    await probe(1)  # warm-up: the first run on a fresh server is not slower for it,
    await flood(0, text)  # and the tokenizer's rate is measured before the flood
    outcomes: collections.Counter = collections.Counter()
    retries: list[int] = []  # the overloaded prompts' retry_after_ms

    async def one(flooder: int) -> None:
        outcome, retry_after_ms = await flood(flooder, text)
        outcomes[outcome] += 1
        retries.extend([retry_after_ms] if retry_after_ms is not None else [])

    start = time.monotonic()
    tasks = [asyncio.create_task(one(i)) for i in range(clients) for _ in range(PER_CONNECTION)]
    await asyncio.sleep(head_start_s)
    figures = await probe(max_tokens)
    await asyncio.gather(*tasks)
    await close()
    retry = {"min": min(retries), "median": statistics.median(retries), "max": max(retries)} if retries else None
    return {"probe": figures, "flood_outcomes": dict(outcomes), "flood_retry_after_ms": retry,
            "flood_end_s": round(time.monotonic() - start, 1)}  # fmt: skip


def run(args) -> dict:
    """The whole workload: flood + probe on a server started here (`--start`) or at `--address` (ZeroMQ only).

    Raises:
        SystemExit: `--address` with `--flood-via http` (that run starts its own server).
    """
    report = {"workload": "flood", "via": args.flood_via, "device": args.device, "model": args.model,
              "flood_connections": args.clients, "prompts_per_connection": PER_CONNECTION,
              "flood_chars": args.flood_chars, "head_start_s": args.flood_head_start_s,
              "load_average_at_start": os.getloadavg()[0]}  # fmt: skip
    shape = (args.clients, args.flood_chars, args.flood_head_start_s, args.max_tokens)
    if args.flood_via == "http":
        if args.address:
            raise SystemExit("--flood-via http starts its own server (with HTTP on); leave out --address")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            http_address = f"127.0.0.1:{sock.getsockname()[1]}"
        url = f"http://{http_address}"
        proc, _ = start_server(args.model, 1, ["--device", args.device, "--http-address", http_address])
        try:
            for named in (False, True):
                report["named_users" if named else "anonymous"] = asyncio.run(one_run(_http(url, named), *shape))
        finally:
            stop_server(proc)
        return report
    proc, address = (None, args.address)
    if not address:
        proc, address = start_server(args.model, 1, ["--device", args.device])
    try:
        report.update(asyncio.run(one_run(_zmq(address, args.clients), *shape)))
    finally:
        if proc is not None:
            stop_server(proc)
    return report
