"""Closed-loop token-id load, through `serve` or straight into an in-process `EngineCore`.

Each of C clients sends `requests_per_client` greedy requests one after the other; a request's
prompt is `prompt_tokens` random token ids (seeded by client and index, so both paths run the
same prompts) and it generates exactly `max_tokens` tokens (random-weight models never sample
their EOS). Per request the record holds the send time and one arrival time per token (tokens
that came in one message or one engine step share a time), all in `time.monotonic()` seconds,
which one host's processes share. Over the wire the clients run in several processes so that
one Python event loop does not bound what is measured.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, dataclass, field

from ops.loadgen import gaps, percentiles

CLIENTS_PER_PROCESS = 16  # clients sharing one worker process's event loop


@dataclass(frozen=True)
class Workload:
    """What every client sends."""

    vocab_size: int  # prompt ids are drawn from [0, vocab_size)
    prompt_tokens: int = 512  # tokens per prompt
    max_tokens: int = 128  # tokens generated per request
    requests_per_client: int = 2  # sent one after the other
    timeout_s: float = 300.0  # deadline of one request, seconds
    seed: int = 0

    def prompt(self, client: int, index: int) -> list[int]:
        """The token ids of request `index` of `client` (deterministic)."""
        import random

        rng = random.Random(f"{self.seed}:{client}:{index}")
        return [rng.randrange(self.vocab_size) for _ in range(self.prompt_tokens)]


@dataclass
class RequestRecord:
    """One request's outcome; times are `time.monotonic()` seconds."""

    client: int
    start_s: float
    token_times_s: list[float] = field(default_factory=list)  # one entry per completion token
    finish_reason: str | None = None  # "length", ...; None when it failed
    error_code: str | None = None  # the wire error code when it failed
    error_message: str | None = None
    ended_s: float | None = None  # when its `done` or `error` arrived

    @property
    def end_s(self) -> float:
        if self.ended_s is not None:
            return self.ended_s
        return self.token_times_s[-1] if self.token_times_s else self.start_s


def summarize(records: list[RequestRecord], concurrency: int) -> dict:
    """Level figures: throughput (completion tokens/s over the level's wall time), TTFT,
    inter-token latency (ITL) and time per output token (TPOT, a request's decode time over
    its tokens after the first) as p50/p95 in milliseconds, and failures by code.

    TTFT is also split: `ttft_first_ms` over each client's first request (all sent at once, so they
    queue for prefill together) and `ttft_next_ms` over the rest (each sent when its client's last one
    ended, so it joins a batch that is decoding)."""
    done = [r for r in records if r.error_code is None]
    first: dict[int, RequestRecord] = {}
    for r in sorted(records, key=lambda r: r.start_s):
        first.setdefault(r.client, r)
    ttft = [(r.token_times_s[0] - r.start_s, first[r.client] is r) for r in done if r.token_times_s]
    tokens = sum(len(r.token_times_s) for r in records)
    wall_s = max((r.end_s for r in records), default=0.0) - min((r.start_s for r in records), default=0.0)
    failed: dict[str, int] = {}
    for r in records:
        if r.error_code is not None:
            failed[r.error_code] = failed.get(r.error_code, 0) + 1
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "failed": failed,
        "completion_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "throughput_tok_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
        "ttft_ms": percentiles([t for t, _ in ttft]),
        "ttft_first_ms": percentiles([t for t, is_first in ttft if is_first]),
        "ttft_next_ms": percentiles([t for t, is_first in ttft if not is_first]),
        "itl_ms": percentiles([g for r in done for g in gaps(r.token_times_s)]),
        "tpot_ms": percentiles([(r.token_times_s[-1] - r.token_times_s[0]) / (len(r.token_times_s) - 1)
                                for r in done if len(r.token_times_s) > 1]),  # fmt: skip
    }


# ---- over the wire ------------------------------------------------------------------------


async def wire_request(client, workload: Workload, client_index: int, index: int, *,
                       max_tokens: int | None = None) -> RequestRecord:  # fmt: skip
    """Send one token-id request and read it to its end (an error becomes the record's code)."""
    from shared.client import ServerError

    record = RequestRecord(client_index, time.monotonic())
    try:
        stream = await client.stream(token_ids=workload.prompt(client_index, index), temperature=0.0,
                                     max_tokens=max_tokens or workload.max_tokens, timeout_s=workload.timeout_s)  # fmt: skip
    except (ServerError, TimeoutError) as exc:
        return _ended(record, exc)
    return await finish_record(stream, record)


async def finish_record(stream, record: RequestRecord) -> RequestRecord:
    """Read `stream` to its end into `record`: token arrival times, finish reason or error, end time."""
    from shared.client import ServerError

    try:
        async for token in stream:
            record.token_times_s += [time.monotonic()] * len(token.token_ids)
        record.finish_reason = stream.done.finish_reason.value
    except (ServerError, TimeoutError) as exc:
        return _ended(record, exc)
    record.ended_s = time.monotonic()
    return record


def _ended(record: RequestRecord, exc: Exception) -> RequestRecord:
    from shared.client import ServerError

    if isinstance(exc, ServerError):
        record.error_code, record.error_message = exc.code.value, exc.message
    else:
        record.error_code, record.error_message = "client_timeout", str(exc)
    record.ended_s = time.monotonic()
    return record


async def _clients(address: str, workload: Workload, client_ids: list[int], start_at: float) -> list[RequestRecord]:
    from shared.client import AsyncClient

    async def one(client_index: int) -> list[RequestRecord]:
        async with AsyncClient(address) as client:
            return [await wire_request(client, workload, client_index, i) for i in range(workload.requests_per_client)]

    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    return [r for per_client in await asyncio.gather(*(one(c) for c in client_ids)) for r in per_client]


def _worker(address: str, workload: dict, client_ids: list[int], start_at: float) -> list[dict]:
    """Process-pool entry point: run some clients, return their records as dicts."""
    records = asyncio.run(_clients(address, Workload(**workload), client_ids, start_at))
    return [asdict(r) for r in records]


def _noop(seconds: float) -> None:
    time.sleep(seconds)


class WireLoad:
    """A pool of client processes for closed-loop levels against one server address."""

    def __init__(self, address: str, max_concurrency: int):
        import multiprocessing

        self.address = address
        self.num_procs = max(1, math.ceil(max_concurrency / CLIENTS_PER_PROCESS))
        self.pool = multiprocessing.get_context("spawn").Pool(self.num_procs)
        self.pool.map(_noop, [0.5] * self.num_procs, chunksize=1)  # start every worker now

    def run_level(self, workload: Workload, concurrency: int, on_wait=None) -> list[RequestRecord]:
        """Run `concurrency` clients to completion; `on_wait()` is called every ~0.2 s meanwhile."""
        procs = min(self.num_procs, math.ceil(concurrency / CLIENTS_PER_PROCESS))
        shares = [list(range(concurrency))[p::procs] for p in range(procs)]
        start_at = time.monotonic() + 0.2
        results = [self.pool.apply_async(_worker, (self.address, asdict(workload), s, start_at)) for s in shares]
        while not all(r.ready() for r in results):
            if on_wait is not None:
                on_wait()
            time.sleep(0.2)
        return [RequestRecord(**r) for result in results for r in result.get()]

    def close(self) -> None:
        """Stop the client processes now (a level cut short leaves none behind)."""
        self.pool.terminate()
        self.pool.join()


# ---- in process ---------------------------------------------------------------------------


def core_level(core, workload: Workload, concurrency: int) -> list[RequestRecord]:
    """The same closed loop driven straight into `core` (an `EngineCore`; no sockets)."""
    from services.engine.request import Request
    from shared.protocol import SamplingParams

    records: dict[str, RequestRecord] = {}
    sent = dict.fromkeys(range(concurrency), 0)

    def send(client: int) -> None:
        request_id = f"c{client}-{sent[client]}"
        records[request_id] = RequestRecord(client, time.monotonic())
        params = SamplingParams(temperature=0.0, max_tokens=workload.max_tokens)
        core.add_request(Request(request_id, workload.prompt(client, sent[client]), params))
        sent[client] += 1

    def take(outputs) -> None:
        now = time.monotonic()
        for out in outputs:
            record = records[out.request_id]
            record.token_times_s += [now] * len(out.new_token_ids)
            if out.finish_reason is not None:
                record.finish_reason = out.finish_reason
                if out.finish_reason == "error":
                    record.error_code = out.error.code.value if out.error else "internal"
                if sent[record.client] < workload.requests_per_client:
                    send(record.client)

    for client in range(concurrency):
        send(client)
    while core.has_unfinished():  # as the engine service steps: launch ahead, read back, take in, launch
        take(core.launch_ahead())
        take(core.collect())
        if not core.in_flight:
            take(core.launch())
    return list(records.values())
