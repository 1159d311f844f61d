"""The prefix-sharing workload of `ops.loadgen`: N clients, one long system prompt, a question each.

For each scheme a server is started twice, with the prefix cache and with `--no-prefix-cache`,
and in each of `--rounds` rounds N clients send at once the same system prompt (the first
`--system-tokens` tokens of the Lee corpus, as token ids) followed by a question of their own
(greedy, `--max-tokens`). Round 1 finds the cache empty (the first request computes the system
prompt and the others wait for it); later rounds find it cached. Recorded per round: TTFT
p50/p95, inter-token latency, aggregate throughput (completion tokens over the round's wall
time), prompt tokens computed (prompt minus `cached_tokens`) and, per run, the engine's prefix
cache figures from `stats`. Written to `ops/results/loadgen_prefix_<device>.json`.

    python -m ops.loadgen --workload prefix --schemes all --clients 16 --system-tokens 1000
"""

from __future__ import annotations

import asyncio
import os
import time

from shared.client import AsyncClient

from .loadgen import gaps, percentiles, start_server, stop_server


def prompts(model: str, system_tokens: int, clients: int, rounds: int) -> tuple[list[int], list[list[list[int]]]]:
    """(system prompt ids, per round the question ids of each client); questions differ in every round."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from services.engine.dtypes import resolve_dtype
    from services.engine.model.paths import resolve_model
    from services.eval.corpus import corpus_token_ids

    tokenizer = load_tokenizer(resolve_model(model, dtype=resolve_dtype("auto")))
    system = corpus_token_ids(tokenizer, system_tokens)
    questions = [[tokenizer.encode(f"\n\nQ{r}.{c}: which person, place or date does the text name first?")
                  for c in range(clients)] for r in range(rounds)]  # fmt: skip
    return system, questions


async def one_round(address: str, system: list[int], questions: list[list[int]], max_tokens: int) -> dict:
    async def client(question: list[int]):
        async with AsyncClient(address) as c:
            return await c.generate(token_ids=system + question, max_tokens=max_tokens, timeout_s=3600)

    start = time.perf_counter()
    done = await asyncio.gather(*(client(q) for q in questions))
    wall_s = time.perf_counter() - start
    tokens = sum(c.usage.completion_tokens for c in done)
    computed = sum(c.usage.prompt_tokens - c.usage.cached_tokens for c in done)
    return {
        "wall_s": round(wall_s, 2),
        "completion_tokens": tokens,
        "throughput_tok_s": round(tokens / wall_s, 2),
        "ttft_ms": percentiles([c.first_token_s for c in done if c.first_token_s is not None]),
        "itl_ms": percentiles([g for c in done for g in gaps(c.token_times_s)]),
        "prompt_tokens": sum(c.usage.prompt_tokens for c in done),
        "prompt_tokens_computed": computed,
        "cached_tokens": sorted(c.usage.cached_tokens for c in done),
    }


async def engine_prefix_stats(address: str, timeout_s: float = 10.0) -> dict | None:
    """The engine's prefix cache figures once its heartbeat shows no KV held (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    async with AsyncClient(address) as c:
        while True:
            engine = (await c.stats()).engines[0]
            if engine.engine_tokens == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    return None if engine.prefix_cache is None else engine.prefix_cache.model_dump()


def run_scheme(args, scheme: str, prefix_cache: bool, system: list[int], questions: list[list[list[int]]]) -> dict:
    """Start a server for one scheme, run every round, stop it."""
    clients, context = args.clients, len(system) + max(map(len, questions[0])) + args.max_tokens
    flags = ["--device", args.device, "--kv-cache", scheme, "--max-slots", str(clients),
             "--max-active-requests", str(clients), "--max-context", str(context + 16),
             "--capacity-tokens", str(clients * (context + 32))]  # fmt: skip
    proc, address = start_server(args.model, 1, flags + ([] if prefix_cache else ["--no-prefix-cache"]))
    try:
        asyncio.run(one_round(address, [1, 2, 3], [[4]], 2))  # warm-up, sharing nothing with the workload
        rounds = [asyncio.run(one_round(address, system, qs, args.max_tokens)) for qs in questions]
        return {"rounds": rounds, "engine_prefix_cache": asyncio.run(engine_prefix_stats(address))}
    finally:
        stop_server(proc)


def run(args) -> dict:
    """The whole workload: every scheme, with and without the prefix cache."""
    from services.engine.cache.schemes import SCHEMES

    schemes = list(SCHEMES) if args.schemes == "all" else args.schemes.split(",")
    system, questions = prompts(args.model, args.system_tokens, args.clients, args.rounds)
    report = {"workload": "prefix", "device": args.device, "model": args.model, "system_tokens": len(system),
              "clients": args.clients, "rounds": args.rounds, "max_tokens": args.max_tokens,
              "load_average_at_start": os.getloadavg()[0], "schemes": {}}  # fmt: skip
    for scheme in schemes:
        report["schemes"][scheme] = {
            name: run_scheme(args, scheme, on, system, questions)
            for name, on in (("prefix_cache", True), ("no_prefix_cache", False))
        }
    return report
