"""Benchmark KV-cache schemes: decode tokens/s and peak memory per context, attention paths, prefill memory.

Modes (`--mode`):
- `decode` (default): per scheme and context T, an engine (`EngineCore`, the serving path:
  decode windows, traced step) whose `--streams` slots hold T tokens of random K/V of the
  model's shape (`ops.engine_fill`: a real 32K prefill takes long, and a decode step's cost
  depends on T and the storage, not on the values); times `--steps` greedy tokens per stream
  after `--warmup`, best of `--repeats`. Peak memory runs from before the fill to the end.
  `--interleave` also times every scheme's engine alive at once, `--turn-windows` decode windows each
  in turn, the last one timed (`interleaved_*` fields: the aggregate ratio to raw, the median of the
  rounds' ratios, which a stalled round does not move, the host's launch time per token, and the rate of
  a turn's untimed first windows, there to take whatever switching engines costs), each round in a fresh
  order: single-stream steps are bound by the host, whose pace drifts.
- `attention`: one attention layer per scheme, decode (1 query) and prefill
  (`--prefill-queries` queries) at each T: in place (what the caches run) against
  dequantize + `mx.fast` SDPA, time and peak temporary memory.
- `prefill-memory`: a real chunked prefill of `--prefill-tokens` tokens (default 4096 in 512s)
  per scheme, peak memory from `mx.reset_peak_memory()` to the end.

Results go to stdout and `ops/results/bench_kv[_<mode>]_<device>[_<model>][_<field><value>...].json` (the
last part: a `--tuning` override of the decode-attention launch shape, CUDA only). No downloads:
`--random-model llama-1b` builds a random-initialized Llama-3.2-1B-shaped model (bf16) on
whatever `mx.default_device()` is.

    python -m ops.bench_kv                                                  # CPU, default model, T = 512, 2048, 8192
    python -m ops.bench_kv --random-model llama-1b --contexts 512,8192,32768   # GPU (also qwen3-1.7b)
    python -m ops.bench_kv --random-model llama-1b --contexts 8192 --streams 32 --schemes raw,affine4,aura4v4
    python -m ops.bench_kv --random-model llama-1b --contexts 8192,32768 --steps 256 --repeats 1 --interleave
    python -m ops.bench_kv --random-model llama-1b --contexts 32768 --schemes raw --tuning waves=2   # a launch-shape A/B
    python -m ops.bench_kv --mode attention
    python -m ops.bench_kv --mode prefill-memory --schemes raw,affine4,aura4v4
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ops.decode_clock import DecodeClock
from ops.gpu_time import apply_tuning_override
from shared.blas import active_blas

RESULTS = Path(__file__).parent / "results"
DEFAULT_SCHEMES = "raw,affine8,affine4,aura8v8,aura8v4,aura5v3,aura4v4,aura4v2"
# Llama-3.2-1B's shape (config.json of meta-llama/Llama-3.2-1B), random weights.
LLAMA_1B = dict(
    model_type="llama", hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
    tie_word_embeddings=True, max_position_embeddings=131072,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)


# Qwen3-1.7B's shape (head_dim 128; the anchor `shared/gpu/anchor_mlxlm_qwen3.py` uses the same).
QWEN3_1_7B = dict(
    model_type="qwen3", hidden_size=2048, num_hidden_layers=28, intermediate_size=6144, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, vocab_size=151936, max_position_embeddings=40960,
    rope_theta=1e6, tie_word_embeddings=True,
)
RANDOM_MODELS = {"llama-1b": ("llama", LLAMA_1B, "random-llama-3.2-1b-shape"),
                 "qwen3-1.7b": ("qwen3", QWEN3_1_7B, "random-qwen3-1.7b-shape")}


def random_model(name: str, dtype: mx.Dtype = mx.bfloat16):
    """A random-initialized model of a known shape (`RANDOM_MODELS`) in `dtype` (no files, no downloads)."""
    import importlib

    from services.engine import attention

    attention.install()  # before the model module binds mlx-lm's attention
    family, config, _ = RANDOM_MODELS[name]
    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def random_llama_1b(dtype: mx.Dtype = mx.bfloat16):
    """A random-initialized model of Llama-3.2-1B's shape in `dtype`."""
    return random_model("llama-1b", dtype)


def parameter_bytes(model) -> int:
    """Bytes of the model's parameters: the "weights" that peak memory is reported over. Not the allocator's
    active memory after loading, which on CUDA still counted buffers of the random init (4.03 GB read for a
    2.47 GB model, so a decode peak came out 1.2 GB below the weights)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def load(args):
    """The model to run (a `LoadedModel`; random models have no tokenizer: no EOS) and its name."""
    from types import SimpleNamespace

    from services.engine.model.loader import LoadedModel, load_model

    if args.random_model:
        family, config, name = RANDOM_MODELS[args.random_model]
        return LoadedModel(model=random_model(args.random_model), tokenizer=SimpleNamespace(eos_token_ids=set()),
                           path=Path(name), config=config), name
    loaded = load_model(args.model)
    return dataclasses.replace(loaded, tokenizer=SimpleNamespace(eos_token_ids=set())), loaded.path.name


def geometry(model) -> tuple[int, int, int]:
    """(n_layers, n_kv_heads, head_dim) of an mlx-lm llama-style model."""
    attn = model.layers[0].self_attn
    return len(model.layers), attn.n_kv_heads, attn.head_dim


def fill_random(caches: list, model, num_tokens: int, chunk: int) -> None:
    """Write `num_tokens` tokens of N(0, 1) K/V into every layer's cache through its codec."""
    from services.engine.cache import model_dtype

    _, n_kv_heads, head_dim = geometry(model)
    dtype = model_dtype(model)
    for cache in caches:
        for start in range(0, num_tokens, chunk):
            shape = (1, n_kv_heads, min(chunk, num_tokens - start), head_dim)
            cache.update_and_fetch(mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype))
            mx.eval(cache.state)


def decode_rate(core, requests, warmup: int, host: dict | None = None) -> float:
    """Aggregate decode tokens/s after every stream has `warmup` tokens (prefill and warm-up excluded).

    Counts only the tokens of steps launched after the clock started (`ops.decode_clock`): a GPU engine runs a
    window ahead, and that window's tokens were paid for before the start.

    `host` (optional) receives, over the timed part, the seconds the host spent building and launching
    steps (`launch_s`: `ModelRunner.run`) and waiting for them (`wait_s`: `ModelRunner.collect`), the steps
    launched (`launches`) and how many of them ran ahead of the window in flight (`launches_ahead`), and this
    thread's CPU seconds (`thread_cpu_s`: MLX's waits for the GPU spin, so it tracks the wall time; it is not
    the host's work alone).

    Raises:
        ValueError: no step after the warm-up was timed (too few steps).
    """
    for request in requests:
        core.add_request(request)
    runner, spent = core.runner, {"launch_s": 0.0, "wait_s": 0.0, "launches": 0, "launches_ahead": 0}
    run, collect = runner.run, runner.collect

    timed_run = _timed_into(run, spent, "launch_s")

    def launch(plan, ahead_of=None):  # counts the launches that ran ahead of the window in flight
        spent["launches"] += 1
        spent["launches_ahead"] += ahead_of is not None
        return timed_run(plan, ahead_of)

    runner.run, runner.collect = launch, _timed_into(collect, spent, "wait_s")
    clock, cpu = DecodeClock(len(requests), warmup), None
    try:
        while core.has_unfinished():
            clock.record([out.request_id for out in core.step() for _ in out.new_token_ids], ahead=core.in_flight)
            if cpu is None and clock.start is not None:
                cpu = time.thread_time()
                spent.update(launch_s=0.0, wait_s=0.0, launches=0, launches_ahead=0)
    finally:
        runner.run, runner.collect = run, collect
    if not clock.tokens:
        raise ValueError("no decode step after the warm-up was timed; ask for more --steps")
    if host is not None:
        host.update({k: round(v, 4) for k, v in spent.items()}, timed_s=round(clock.seconds, 4),
                    thread_cpu_s=round(time.thread_time() - cpu, 4))
    return clock.rate()


def decode_run(loaded, scheme: str, context: int, args) -> dict:
    """One timed run: fill `--streams` slots with `context` tokens each, then time the engine's decode."""
    from ops.engine_fill import filled_engine
    from services.engine.cache import schemes

    gc.collect()
    mx.clear_cache()
    weights = args.weights_bytes  # the model's parameter bytes (`parameter_bytes`)
    streams = args.streams
    if args.memory_budget_gib:  # as many streams as the budget's KV capacity holds
        per_token = schemes.bytes_per_token(scheme, model=loaded.model)
        streams = int(args.memory_budget_gib * 2**30 // per_token) // (context + args.warmup + args.steps + 32)
    mx.reset_peak_memory()
    core, requests = filled_engine(loaded, scheme, [context] * streams, max_tokens=args.warmup + args.steps,
                                   decode_window=args.decode_window)
    kv_bytes = sum(core.cache.slots.nbytes(s.slot) for s in core.scheduler.sessions.values())
    capacity_bytes = sum(a.nbytes for a in core.cache.arrays)
    mx.reset_peak_memory()  # decode's peak: the fill's temporaries do not count
    host: dict = {}
    rate = decode_rate(core, requests, args.warmup, host)
    peak = mx.get_peak_memory()
    del core, requests
    gc.collect()
    return {"scheme": scheme, "context_tokens": context, "streams": streams, "decode_tokens_per_s": rate,
            "kv_nbytes_after_fill": kv_bytes, "kv_bytes_per_token": kv_bytes / (context * streams),
            "pool_bytes": capacity_bytes, "peak_memory_bytes": peak, "peak_over_weights_bytes": peak - weights,
            "host": host}


def run_decode(loaded, args) -> list[dict]:
    """Per context, `--repeats` rounds over every scheme (a fresh engine per run, schemes alternating so
    drift in the host's speed falls on all of them); each scheme's fastest run counts (its median is kept
    too), its highest peak."""
    rows = []
    for context in args.contexts:
        runs: dict[str, list[dict]] = {scheme: [] for scheme in args.schemes}
        for _ in range(args.repeats):
            for scheme in args.schemes:
                runs[scheme].append(decode_run(loaded, scheme, context, args))
        for scheme, done in runs.items():
            row = max(done, key=lambda r: r["decode_tokens_per_s"])
            row = {**row, "peak_memory_bytes": max(r["peak_memory_bytes"] for r in done),
                   "peak_over_weights_bytes": max(r["peak_over_weights_bytes"] for r in done),
                   "runs_tokens_per_s": [round(r["decode_tokens_per_s"], 1) for r in done],
                   "runs_launch_share": [round(r["host"]["launch_s"] / r["host"]["timed_s"], 3) for r in done],
                   "runs_launched_ahead": [f'{r["host"]["launches_ahead"]}/{r["host"]["launches"]}' for r in done],
                   "runs_thread_cpu_us_per_token": [round(r["host"]["thread_cpu_s"] / r["host"]["timed_s"]
                                                          / r["decode_tokens_per_s"] * 1e6, 1) for r in done]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.interleave:
        for context in args.contexts:
            rates = interleaved_rates(loaded, context, args)
            base = rates.get("raw")
            for r in rows:
                if r["context_tokens"] == context:
                    rate = rates[r["scheme"]]
                    r["interleaved_tokens_per_s"] = rate["tokens_per_s"]
                    r["interleaved_round_tokens_per_s"] = rate["round_tokens_per_s"]
                    r["interleaved_launch_us_per_token"] = rate["launch_us_per_token"]
                    r["interleaved_switch_tokens_per_s"] = rate["switch_tokens_per_s"]
                    r["interleaved_ratio_to_raw"] = rate["tokens_per_s"] / base["tokens_per_s"] if base else None
                    r["interleaved_round_ratio_median"] = (
                        median_round_ratio(rate["round_tokens_per_s"], base["round_tokens_per_s"]) if base else None)
                    shown = ("scheme", "context", "interleaved_t", "interleaved_ra", "interleaved_round_ratio",
                             "interleaved_launch", "interleaved_switch")
                    print(json.dumps({k: v for k, v in r.items() if k.startswith(shown)}), flush=True)
    raw = {r["context_tokens"]: r for r in rows if r["scheme"] == "raw"}
    for r in rows:  # best against best, and median against median (a noisy host can favour either)
        r["median_tokens_per_s"] = statistics.median(r["runs_tokens_per_s"])
        base = raw.get(r["context_tokens"])
        r["ratio_to_raw"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"] if base else None
        r["median_ratio_to_raw"] = (r["median_tokens_per_s"] / statistics.median(base["runs_tokens_per_s"])
                                    if base else None)
    return rows


def median_round_ratio(rounds: list[float], raw_rounds: list[float]) -> float:
    """The median over interleaved rounds of a scheme's tok/s against raw's in the same round: robust to one
    round a host stall slowed (the aggregate `interleaved_ratio_to_raw` is not). Not `median_ratio_to_raw`,
    which compares the sequential runs' medians (one run each with `--repeats 1`)."""
    return statistics.median(a / b for a, b in zip(rounds, raw_rounds, strict=True))


def interleaved_rates(loaded, context: int, args) -> dict[str, dict]:
    """Every scheme's engine at once, stepped in turn: per round, `--turn-windows` `EngineCore.step`s of each
    (decode windows), each waited for before the next, so a host whose speed drifts over the run (single-stream
    steps are bound by the host) slows every scheme alike. Only a turn's last window is timed: the ones before
    it are there to take whatever switching engines costs (MLX's buffer cache, its cached CUDA graph
    executables and the host's CPU caches last served another engine), which a serving process, one engine
    stepping on, never pays. Each round steps the engines in a fresh order (a seeded shuffle), so none keeps
    the same predecessor.

    Returns:
        dict[str, dict]: per scheme, `tokens_per_s` (tokens over seconds of the timed windows after every
        stream has `--warmup` tokens), `round_tokens_per_s` (each timed window), `launch_us_per_token` (the
        host's time in `ModelRunner.run`, building and launching the timed windows, per token: where the host
        sets the pace, a scheme that costs it more shows here) and `switch_tokens_per_s` (the untimed windows
        after the warm-up that opened a turn, aggregate; None with one window a turn): against `tokens_per_s`,
        what switching engines cost.

    Raises:
        ValueError: a scheme finished before a window after its warm-up was timed (too few `--steps`).
    """
    from ops.engine_fill import filled_engine

    engines, windows, launch_s = {}, {}, {}
    for scheme in args.schemes:
        core, requests = filled_engine(loaded, scheme, [context] * args.streams, max_tokens=args.warmup + args.steps,
                                       decode_window=args.decode_window)
        for request in requests:
            core.add_request(request)
        engines[scheme], windows[scheme] = core, []
        core.runner.run = _timed_into(core.runner.run, launch_s, scheme)
    mx.eval([a for core in engines.values() for a in core.cache.arrays])
    produced = dict.fromkeys(engines, 0)
    order, shuffle = list(engines), random.Random(0).shuffle
    while any(core.has_unfinished() for core in engines.values()):
        shuffle(order)
        for scheme in order:
            core = engines[scheme]
            for w in range(args.turn_windows):
                if not core.has_unfinished():
                    break
                launch_s[scheme] = 0.0
                begin = time.perf_counter()
                outputs = core.step()  # launches the next window (run ahead: before or after collecting the last)
                mx.synchronize()  # ... and waits for it: the next window starts on an idle GPU
                seconds = time.perf_counter() - begin
                tokens = sum(len(out.new_token_ids) for out in outputs)
                if core.run_ahead and windows[scheme]:  # this step's tokens are the window launched by the last one
                    windows[scheme][-1][0] = tokens
                warm = produced[scheme] >= args.warmup * args.streams
                kind = "warmup" if not warm else "timed" if w == args.turn_windows - 1 else "switch"
                windows[scheme].append([0 if core.run_ahead else tokens, seconds, launch_s[scheme], kind])
                produced[scheme] += tokens
    out = {}
    for scheme, done in windows.items():
        timed = [(n, t, h) for n, t, h, kind in done if n and kind == "timed"]
        if not timed:
            raise ValueError(f"{scheme}: no decode window after the warm-up was timed; ask for more steps")
        switch = [(n, t) for n, t, _, kind in done if n and kind == "switch"]
        tokens = sum(n for n, _, _ in timed)
        out[scheme] = {"tokens_per_s": tokens / sum(t for _, t, _ in timed),
                       "round_tokens_per_s": [round(n / t, 1) for n, t, _ in timed],
                       "launch_us_per_token": round(sum(h for _, _, h in timed) / tokens * 1e6, 1),
                       "switch_tokens_per_s": (round(sum(n for n, _ in switch) / sum(t for _, t in switch), 1)
                                               if switch else None)}
    del engines
    gc.collect()
    return out


def _timed_into(fn, spent: dict, key: str):
    """`fn`, adding the seconds each call takes to `spent[key]`."""
    def call(*args):
        begin = time.perf_counter()
        try:
            return fn(*args)
        finally:
            spent[key] += time.perf_counter() - begin
    return call


def median_ms(fn, repeats: int) -> float:
    """Median wall time of `mx.eval(fn())` in milliseconds, after two warm-up calls."""
    for _ in range(2):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def attention_row(loaded, scheme: str, context: int, num_queries: int, repeats: int) -> dict:
    """Time one layer's attention over `context` random tokens: in place vs dequantize + SDPA.

    "in place" is what the caches run (`kernels.paged_attention`: fused CUDA kernels, or MLX ops
    over chunks of pages); "dequantized" decodes the whole history first (the old path).
    Peak memory of each is measured over its calls.
    """
    from services.engine.cache import CacheOptions, make_layer_caches, model_dtype

    model = loaded.model
    cache = make_layer_caches(model, CacheOptions(scheme=scheme, max_context=context + num_queries))[0]
    fill_random([cache], model, context, 4096)
    n_heads = model.layers[0].self_attn.n_heads
    head_dim = cache.fmt.head_dim
    queries = mx.random.normal((1, n_heads, num_queries, head_dim)).astype(model_dtype(model))
    fmt, scale = cache.fmt, head_dim**-0.5
    new = mx.random.normal((1, cache._heads, num_queries, head_dim)).astype(model_dtype(model))
    cache.update_and_fetch(new, new)
    mx.eval(cache.state)

    def in_place():
        return cache.attend(queries, None, None, scale=scale, mask=None)

    def decoded():
        keys, values = fmt.decode(cache.state)
        q = fmt.rotate_query(queries.astype(keys.dtype))
        out = mx.fast.scaled_dot_product_attention(q, keys, values.astype(keys.dtype), scale=scale,
                                                   mask=None if num_queries == 1 else "causal")
        return fmt.unrotate_output(out)

    row = {"scheme": scheme, "context_tokens": context, "queries": num_queries}
    for name, fn in (("in_place", in_place), ("dequantized", decoded)):
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        row[f"{name}_ms"] = median_ms(fn, repeats)
        row[f"{name}_peak_temp_bytes"] = mx.get_peak_memory() - base
    return row


def run_attention(loaded, args) -> list[dict]:
    rows = []
    for context in args.contexts:
        for num_queries in (1, args.prefill_queries):
            for scheme in args.schemes:
                rows.append(attention_row(loaded, scheme, context, num_queries, 20 if num_queries == 1 else 5))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def run_prefill_memory(loaded, args) -> list[dict]:
    """Peak memory of a real chunked prefill (random token ids) per scheme."""
    from services.engine.cache import CacheOptions, make_layer_caches
    from services.engine.generate import prefill

    ids = np.random.default_rng(0).integers(100, 20000, args.prefill_tokens).tolist()
    model, rows = loaded.model, []
    for scheme in args.schemes:
        gc.collect()
        mx.clear_cache()
        weights = args.weights_bytes
        mx.reset_peak_memory()
        caches = make_layer_caches(model, CacheOptions(scheme=scheme, max_context=args.prefill_tokens))
        start = time.perf_counter()
        mx.eval(prefill(model, caches, ids, chunk=args.prefill_chunk))
        seconds, peak = time.perf_counter() - start, mx.get_peak_memory()
        rows.append({"scheme": scheme, "prefill_tokens": args.prefill_tokens, "chunk": args.prefill_chunk,
                     "seconds": seconds, "kv_nbytes": sum(c.nbytes for c in caches),
                     "peak_memory_bytes": peak, "peak_over_weights_bytes": peak - weights})
        print(json.dumps(rows[-1]), flush=True)
        del caches
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["decode", "attention", "prefill-memory"], default="decode")
    parser.add_argument("--model", default="default", help="model to load (ignored with --random-model)")
    parser.add_argument("--random-model", choices=sorted(RANDOM_MODELS), help="random-initialized model of a known shape")
    parser.add_argument("--schemes", default=DEFAULT_SCHEMES, type=lambda s: [x for x in s.split(",") if x])
    parser.add_argument("--contexts", default="512,2048,8192", type=lambda s: [int(x) for x in s.split(",") if x])
    parser.add_argument("--steps", type=int, default=64, help="timed decode tokens per stream")
    parser.add_argument("--warmup", type=int, default=9, help="untimed tokens per stream first (traces, allocator)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row; the fastest counts (as the anchor)")
    parser.add_argument("--streams", type=int, default=1, help="concurrent streams, each at the context (decode mode)")
    parser.add_argument("--memory-budget-gib", type=float, default=0.0,
                        help="decode mode: instead of --streams, as many streams as this KV budget holds per scheme")
    parser.add_argument("--decode-window", type=int, default=None,
                        help="decode steps per host sync (decode mode; default: the engine's, 16 on a GPU, 8 on the CPU)")
    parser.add_argument("--interleave", action="store_true",
                        help="decode mode: also time every scheme's engine at once, --turn-windows windows each in turn")
    parser.add_argument("--turn-windows", type=int, default=1,
                        help="with --interleave: windows an engine steps a turn, the last one timed (the ones before "
                             "it are there to take whatever switching engines costs)")
    parser.add_argument("--fill-chunk", type=int, default=1024, help="tokens of random K/V written per call")
    parser.add_argument("--prefill-queries", type=int, default=512, help="prefill-phase queries (attention mode)")
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--tuning", default="", help="FIELD=INT[,...]: replace these fields of the decode-attention "
                        "launch shape (kernels.cuda_kv.Tuning) in every launch, e.g. waves=2")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON result")
    args = parser.parse_args()
    if args.turn_windows < 1:
        parser.error("--turn-windows is at least 1")
    try:
        args.tuning = apply_tuning_override(args.tuning)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main() -> None:
    args = parse_args()
    loaded, name = load(args)
    model = loaded.model
    mx.eval(model.parameters())
    args.weights_bytes = parameter_bytes(model)
    from services.engine.cache import model_dtype

    run = {"decode": run_decode, "attention": run_attention, "prefill-memory": run_prefill_memory}[args.mode]
    rows = run(loaded, args)
    device = mx.default_device()
    result = {
        "benchmark": f"kv_{args.mode}", "device": str(device), "device_info": _jsonable(mx.device_info()),
        "blas": active_blas(), "model": name, "dtype": str(model_dtype(model)).removeprefix("mlx.core."),
        "fill": "random N(0,1) K/V through each layer's encoder" if args.mode == "decode" else None,
        "path": "EngineCore (decode windows, compiled step)" if args.mode == "decode" else "one layer's cache",
        "steps": args.steps, "warmup": args.warmup, "turn_windows": args.turn_windows if args.interleave else None,
        "streams": args.streams, "decode_window": args.decode_window or "engine default (16 on a GPU, 8 on the CPU)",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "tuning": args.tuning, "results": rows,
    }
    suffix = "" if args.mode == "decode" else f"_{args.mode.replace('-', '_')}"
    model_tag = f"_{args.random_model}" if args.random_model else ""
    args.out.mkdir(parents=True, exist_ok=True)
    tuning_tag = "".join(f"_{k}{v}" for k, v in args.tuning.items())  # A/B runs into one folder keep both
    path = args.out / f"bench_kv{suffix}_{device.type.name}{model_tag}{tuning_tag}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


def _jsonable(info: dict) -> dict:
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in info.items()}


if __name__ == "__main__":
    main()
