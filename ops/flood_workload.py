"""The tokenizer-flood workload of `ops.loadgen`: does one short prompt get through a flood of huge ones?

`--clients` connections each send as many prompts as a connection may have in flight
(`client_max_active + client_max_queued`, 20 by default) of `--flood-chars` characters each:
far over the context, so each is tokenized (the gateway's one tokenizer thread, ~1 s a MB on
one core) and then refused `context_overflow`. `--flood-head-start-s` later a probe connection
sends one short greedy generate (`--max-tokens`). Recorded: the probe's outcome, its time to
first token (TTFT) and to its end, and the flood's outcomes by error code ("made way": ended
`overloaded` to give another connection its place at the tokenizer). Written to
`ops/results/loadgen_flood_<device>.json`; a benchmark, not a test.

    python -m ops.loadgen --workload flood --start --clients 4
    python -m ops.loadgen --workload flood --address tcp://127.0.0.1:5555   # a server already running
"""

from __future__ import annotations

import asyncio
import collections
import os
import time

from services.gateway.clients import ClientLimits
from shared.client import AsyncClient, ServerError

from .loadgen import PROMPT, start_server, stop_server

PER_CONNECTION = ClientLimits().max_active + ClientLimits().max_queued  # what a connection may have in flight


async def _flood_one(client: AsyncClient, text: str, outcomes: collections.Counter) -> None:
    try:
        await (await client.stream(prompt=text, max_tokens=4, timeout_s=900)).collect()
        outcomes["done"] += 1
    except ServerError as exc:
        outcomes[exc.code.value + (" (made way)" if "made way" in exc.message else "")] += 1


async def _probe(address: str, max_tokens: int) -> dict:
    async with AsyncClient(address) as client:
        start = time.monotonic()
        try:
            done = await (await client.stream(prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                              timeout_s=900)).collect()  # fmt: skip
        except ServerError as exc:
            return {"outcome": exc.code.value, "message": exc.message, "end_s": round(time.monotonic() - start, 2)}
        return {"outcome": done.finish_reason, "ttft_s": round(done.first_token_s, 2),
                "end_s": round(time.monotonic() - start, 2), "completion_tokens": len(done.token_ids)}  # fmt: skip


async def one_run(address: str, clients: int, flood_chars: int, head_start_s: float, max_tokens: int) -> dict:
    """One flood and one probe; returns the probe's figures and the flood's outcomes."""
    text = ("milk " * (flood_chars // 5 + 1))[:flood_chars]
    outcomes: collections.Counter = collections.Counter()
    flooders = [AsyncClient(address) for _ in range(clients)]
    start = time.monotonic()
    tasks = [asyncio.create_task(_flood_one(c, text, outcomes)) for c in flooders for _ in range(PER_CONNECTION)]
    await asyncio.sleep(head_start_s)
    probe = await _probe(address, max_tokens)
    await asyncio.gather(*tasks)
    for client in flooders:
        await client.close()
    return {"probe": probe, "flood_outcomes": dict(outcomes), "flood_end_s": round(time.monotonic() - start, 1)}


def run(args) -> dict:
    """The whole workload: one flood + probe on a server started here (`--start`) or at `--address`."""
    report = {"workload": "flood", "device": args.device, "model": args.model, "flood_connections": args.clients,
              "prompts_per_connection": PER_CONNECTION, "flood_chars": args.flood_chars,
              "head_start_s": args.flood_head_start_s, "load_average_at_start": os.getloadavg()[0]}  # fmt: skip
    proc, address = (None, args.address)
    if not address:
        proc, address = start_server(args.model, 1, ["--device", args.device])
    try:
        report.update(asyncio.run(one_run(address, args.clients, args.flood_chars, args.flood_head_start_s,
                                          args.max_tokens)))  # fmt: skip
    finally:
        if proc is not None:
            stop_server(proc)
    return report
