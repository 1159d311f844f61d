"""Aggregate decode throughput of our continuous batching against mlx-lm's `BatchGenerator`.

Both run in one process on the same model, alternating per batch size, with the same
prompts (random token ids of different lengths) and no EOS, so every stream generates
exactly `--max-tokens` tokens. Throughput counts the tokens generated after every stream
of the batch has its first token, over the time that took (prefill excluded). Our engine
is built once per batch size and reused across runs, as a server keeps it (its decode
traces are then warm); each side gets one warm-up run. The ratio compares medians.

Per batch size it also reports `profile` (one decode step over rows of
`--profile-context` tokens: graph building and the whole step)
and `breakdown` (where the engine's time goes, ms per decode step: a window of steps is one
engine step, so each figure is divided by the decode steps it covered).

    python -m ops.bench_batching                          # CPU, the default model
    python -m ops.bench_batching --random-model llama-1b  # GPU, a Llama-3.2-1B-shaped model, bf16

Prints JSON and writes it to `ops/results/batching_<device>.json` (not a test).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from statistics import median
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator

from ops.decode_clock import DecodeClock
from services.engine.cache import CacheOptions
from services.engine.core import EngineCore
from services.engine.model.loader import LoadedModel, load_model
from services.engine.request import Request
from shared.protocol import SamplingParams

RESULTS = Path(__file__).parent / "results"


def random_model(name: str, dtype: str) -> LoadedModel:
    """A random-initialized model of a real shape (`ops.bench_kv.RANDOM_MODELS`; no tokenizer: no EOS)."""
    from ops.bench_kv import RANDOM_MODELS
    from ops.bench_kv import random_model as build

    _, config, label = RANDOM_MODELS[name]
    model = build(name, getattr(mx, dtype))
    return LoadedModel(model=model, tokenizer=SimpleNamespace(eos_token_ids=set()), path=Path(label), config=config)


def prompts_for(batch: int, vocab: int, seed: int) -> list[list[int]]:
    """`batch` prompts of 8..24 random token ids (different lengths)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(8, 25))).tolist() for _ in range(batch)]


def make_core(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int, page_size: int) -> EngineCore:
    """An engine sized for these streams; a server keeps one, so the bench reuses it across runs."""
    longest = max(map(len, prompts)) + max_tokens
    return EngineCore(
        loaded, CacheOptions(max_context=longest + 1), capacity_tokens=len(prompts) * (longest + page_size),
        max_slots=len(prompts), step_token_budget=max(512, len(prompts)), page_size=page_size,
    )


def run_ours(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> float:
    """Decode tokens/s after every stream's first token (`ops.decode_clock`: none launched before the start)."""
    for i, prompt in enumerate(prompts):
        core.add_request(Request(str(i), prompt, SamplingParams(max_tokens=max_tokens)))
    clock = DecodeClock(len(prompts))
    while core.has_unfinished():
        clock.record([out.request_id for out in core.step() for _ in out.new_token_ids], ahead=core.in_flight)
    return clock.rate()


def run_mlx_lm(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int) -> float:
    """The same rate for mlx-lm's `BatchGenerator`, which always has its next step in flight when it returns."""
    gen = BatchGenerator(
        loaded.model, max_tokens=max_tokens, completion_batch_size=len(prompts), prefill_batch_size=len(prompts)
    )
    gen.insert(prompts)
    clock = DecodeClock(len(prompts))
    while responses := gen.next_generated():
        clock.record([r.uid for r in responses], ahead=True)
    gen.close()
    return clock.rate()


def profile_decode(loaded: LoadedModel, batch: int, context: int, page_size: int, repeats: int = 5) -> dict:
    """Time one eager decode step over `batch` rows of about `context` tokens.

    Reports graph building and the whole step (ms, medians).
    """
    core = EngineCore(loaded, CacheOptions(max_context=context + 64), capacity_tokens=batch * (context + 64),
                      max_slots=batch, step_token_budget=max(512, batch), page_size=page_size)
    cache, model = core.cache, loaded.model
    views = [cache.acquire() for _ in range(batch)]
    for i, view in enumerate(views):  # rows of different lengths; their K/V stay zero (costs do not depend on it)
        cache.batch([view], context - i % 8)
    tokens = mx.zeros((batch, 1), mx.uint32)

    def build():
        forward = cache.batch(views, 1)
        return forward, mx.argmax(model(tokens, cache=forward.layers)[:, -1], axis=-1)

    build_s, step_s = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        forward, out = build()
        t1 = time.perf_counter()
        mx.eval(out, cache.arrays)
        build_s.append(t1 - t0), step_s.append(time.perf_counter() - t0)
    # The first round warms up; the median of the rest counts.
    build_ms, step_ms = (median(xs[1:]) * 1e3 for xs in (build_s, step_s))
    return {"context": context, "build_ms": round(build_ms, 3), "step_ms": round(step_ms, 3)}


def step_breakdown(loaded: LoadedModel, batch: int, page_size: int, steps: int = 12) -> dict:
    """Where the engine's decode step goes (ms per step): each phase timed by wrapping the engine's own calls.

    The same requests run twice on one engine, the second time timed: the first traces the decode step at
    every page-table width the rows grow through and compiles those shapes' kernels (the likely cause of
    two H200 breakdowns' 9-11 ms steps at batch 8).
    """
    from services.engine import runner as runner_module
    from services.engine.cache import batched as cache_module  # evaluates a window's tail moves (CUDA)

    max_tokens = page_size * (steps + 6)
    core = EngineCore(loaded, CacheOptions(max_context=4096), capacity_tokens=batch * (64 + max_tokens + 2 * page_size),
                      max_slots=batch, step_token_budget=max(512, batch), page_size=page_size)
    prompts = prompts_for(batch, loaded.config.get("vocab_size", 32000), seed=1)
    for round_ in ("warm", "timed"):
        for i, prompt in enumerate(prompts):
            core.add_request(Request(f"{round_}{i}", prompt, SamplingParams(max_tokens=max_tokens)))
        if round_ == "warm":
            while core.has_unfinished():
                core.step()
    for _ in range(4):  # past the prefills: every step is a decode window
        core.step()
    spent: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    core.scheduler.schedule = timed("schedule", core.scheduler.schedule)
    core.runner._step = timed("trace_call", core.runner._step)
    core.runner.collect = timed("collect", core.runner.collect)
    core.scheduler.update = timed("update", core.scheduler.update)
    core.cache.plan_window = timed("plan_window", core.cache.plan_window)
    proxy = SimpleNamespace(**{k: getattr(mx, k) for k in dir(mx) if not k.startswith("__")})
    proxy.synchronize, proxy.async_eval = timed("wait", mx.synchronize), timed("launch", mx.async_eval)
    runner_module.mx = cache_module.mx = proxy
    tokens = 0
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            tokens += sum(len(out.new_token_ids) for out in core.step())
        total = time.perf_counter() - t0
    finally:
        runner_module.mx = cache_module.mx = mx
    per_token = {name: round(t / tokens * 1e3 * batch, 4) for name, t in spent.items()}
    per_token["other"] = round((total - sum(spent.values())) / tokens * 1e3 * batch, 4)
    return {"ms_per_decode_step": round(total / tokens * batch * 1e3, 3), "tokens": tokens} | per_token


def compare(loaded: LoadedModel, stock: LoadedModel, batch: int, args: argparse.Namespace) -> dict:
    """One batch size: alternating runs of both engines after a warm-up each, then the profiles."""
    prompts = prompts_for(batch, loaded.config.get("vocab_size", 32000), seed=batch)
    core = make_core(loaded, prompts, args.max_tokens, args.page_size)
    run_ours(core, prompts, args.max_tokens)  # warm-up: kernels, allocator, decode traces
    run_mlx_lm(stock, prompts, args.max_tokens)
    ours, theirs = [], []
    for _ in range(args.repeats):
        ours.append(run_ours(core, prompts, args.max_tokens))
        theirs.append(run_mlx_lm(stock, prompts, args.max_tokens))
    return {
        "batch": batch, "ours_tok_s": round(median(ours), 2), "mlx_lm_tok_s": round(median(theirs), 2),
        "ratio": round(median(ours) / median(theirs), 3), "ratio_of_best": round(max(ours) / max(theirs), 3),
        "ours_runs": [round(x, 2) for x in ours], "mlx_lm_runs": [round(x, 2) for x in theirs],
        "profile": profile_decode(loaded, batch, args.profile_context, args.page_size),
        "breakdown": step_breakdown(loaded, batch, args.page_size),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="model spec for load_model (ignored with --random-model)")
    parser.add_argument("--random-model", choices=["llama-1b", "qwen3-1.7b"], help="random weights of a real shape")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the random model")
    parser.add_argument("--batch-sizes", default="1,4,16,32")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per stream")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per batch size after a warm-up each")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--profile-context", type=int, default=256, help="tokens per row in the decode-step profile")
    parser.add_argument("--out", type=Path, help="default: ops/results/batching_<device>.json")
    args = parser.parse_args(argv)
    def load() -> LoadedModel:  # mlx-lm runs without EOS too
        loaded = random_model(args.random_model, args.dtype) if args.random_model else load_model(args.model)
        return dataclasses.replace(loaded, tokenizer=SimpleNamespace(eos_token_ids=set()))

    loaded, stock = load(), load()  # our engine fuses its model's projections; mlx-lm gets its own, as shipped
    rows = []
    for batch in map(int, args.batch_sizes.split(",")):
        rows.append(compare(loaded, stock, batch, args))
        print(json.dumps(rows[-1]), flush=True)
    device = mx.default_device().type.name
    result = {
        "device": device, "model": args.random_model or args.model,
        "dtype": str(loaded.dtype).removeprefix("mlx.core."),
        "max_tokens": args.max_tokens, "prompt_tokens": "8..24 random ids", "page_size": args.page_size,
        "mlx": mx.__version__, "results": rows,
    }
    out = args.out or RESULTS / f"batching_{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
