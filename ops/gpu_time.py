"""Where the GPU time of the engine's decode goes: every CUDA kernel the process runs, timed by CUPTI.

MLX has no GPU timer, so this borrows PyTorch's profiler (CUPTI activity records cover every
kernel of the process, MLX's included). It drives `EngineCore` over random-weight streams, then
reports per decode step the GPU's busy time (kernels, overlaps merged), the span from first to
last kernel, the idle gaps between kernels by length, kernel time by name (with deciles of a call's
time: a name's calls from prefill and from decode differ in size), the host-side events CUPTI records,
by name (count and host time per step: CUDA runtime and driver calls, such as graph updates and
launches, and the profiler's own) and those that overlap the GPU's idle gaps of 100 µs or more, and
the main thread's CPU time (MLX's waits spin, so it counts them).
Host activity is recorded too, which slows the host: compare busy time with an unprofiled run's wall
time per step. Busy close to the wall time per step means the step is bound by GPU execution, not by
the host's launches.

Needs PyTorch with CUDA next to MLX's CUDA backend (PyTorch is not a buttermilk dependency):

    python -m ops.gpu_time --random-model llama-1b --batch-sizes 1,64
    python -m ops.gpu_time --random-model llama-1b --kv-cache raw,aura4v4 --context 8192 --batch-sizes 1,32
    python -m ops.gpu_time --random-model qwen3-1.7b --context 32768 --tuning waves=2   # a launch-shape variant

Writes JSON (default `ops/results/gpu_time_<model>.json`); not a test.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import statistics
import time
from pathlib import Path

import mlx.core as mx

RESULTS = Path(__file__).resolve().parent / "results"
CONTEXT_WARMUP = 4  # decode steps per stream before --context runs count tokens/s


def tuning_override(text: str) -> dict[str, int]:
    """`FIELD=INT[,FIELD=INT]` as `kernels.cuda_kv.Tuning` fields to replace in every decode-attention launch
    (INT: a non-negative integer; a bool field takes 0 or 1).

    Raises:
        ValueError: an item not `FIELD=INT`, a field `Tuning` does not have, or a field named twice.
    """
    from kernels.cuda_kv import Tuning

    fields = {f.name for f in dataclasses.fields(Tuning)}
    out = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in fields or not re.fullmatch(r"\d+", value) or name in out:
            raise ValueError(f"--tuning takes FIELD=INT items (each field once) of {sorted(fields)}, got {item!r}")
        out[name] = int(value)
    return out


def apply_tuning_override(text: str) -> dict[str, int]:
    """Make every later decode-attention launch take `tuning_override(text)`'s fields over
    `kernels.cuda_kv.default_tuning`'s (patched in place); returns the override ({} changes nothing).

    Raises:
        ValueError: as `tuning_override`.
    """
    override = tuning_override(text)
    if override:
        from kernels import cuda_kv

        default = cuda_kv.default_tuning
        cuda_kv.default_tuning = lambda fmt, rows: dataclasses.replace(default(fmt, rows), **override)
    return override


def merged_spans(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as disjoint intervals, in order."""
    merged: list[list[float]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def busy_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (µs in, µs out)."""
    return sum(e - s for s, e in merged_spans(spans))


GAP_EDGES_US = (2.0, 5.0, 20.0, 100.0)  # idle gaps between kernels, bucketed: graph-internal ... host-starved


def kernel_gaps(kernels: list[tuple[float, float, str]]) -> list[tuple[float, float, str, str]]:
    """The idle gaps between kernels' [start, end) intervals (overlaps merged), in order: (start µs, end µs,
    name of the kernel that ended last before the gap, name of the one that ends it)."""
    out, end, last = [], None, ""
    for start, stop, name in sorted(kernels):
        if end is not None and start > end:
            out.append((end, start, last, name))
        if end is None or stop > end:
            end, last = stop, name
    return out


def idle_gaps(spans: list[tuple[float, float]]) -> dict[str, list[float]]:
    """Idle time between kernels of [start, end) intervals (µs), bucketed by gap length.

    Returns:
        dict[str, list[float]]: per bucket ("<2", "2-5", "5-20", "20-100", ">=100" µs) the gap
        count and their total µs. Small gaps are the GPU's own cost between launches of one
        graph; long ones are the GPU waiting for the host (or for a synchronization).
    """
    names = [f"<{GAP_EDGES_US[0]:g}"] + [f"{a:g}-{b:g}" for a, b in zip(GAP_EDGES_US, GAP_EDGES_US[1:])]
    names.append(f">={GAP_EDGES_US[-1]:g}")
    out = {name: [0, 0.0] for name in names}
    for start, end, _, _ in kernel_gaps([(s, e, "") for s, e in spans]):
        gap = end - start
        name = names[sum(gap >= edge for edge in GAP_EDGES_US)]
        out[name][0] += 1
        out[name][1] += gap
    return {name: [n, round(us, 1)] for name, (n, us) in out.items()}


def gap_neighbours(kernels: list[tuple[float, float, str]], min_us: float = 5.0, top: int = 8) -> list[dict]:
    """Which kernels the idle gaps of at least `min_us` fall between, by pair of names (most idle time first).

    Args:
        kernels (list[tuple[float, float, str]]): Each kernel's (start µs, end µs, name).

    Returns:
        list[dict]: up to `top` entries {"before", "after", "count", "us"}: the kernel that ended last before
        the gap, the one that started it, how many such gaps and their total µs.
    """
    pairs: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for start, end, before, after in kernel_gaps(kernels):
        if end - start >= min_us:
            pairs[(before, after)].append(end - start)
    ranked = sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [{"before": a, "after": b, "count": len(us), "us": round(sum(us), 1)} for (a, b), us in ranked]


def host_during_gaps(kernels: list[tuple[float, float]], host: list[tuple[float, float, str]], min_us: float = 100.0,
                     top: int = 12) -> list[dict]:
    """What the host was doing while the GPU sat idle for at least `min_us`: each host event's overlap with those
    gaps, summed by name (most overlapped time first).

    Args:
        kernels (list[tuple[float, float]]): Each kernel's [start, end) (µs).
        host (list[tuple[float, float, str]]): Each host event's (start µs, end µs, name), on the kernels' clock.

    Returns:
        list[dict]: up to `top` entries {"name", "count", "us"}: events that overlap a gap, and their µs inside
        the gaps (nested events each count their own overlap).
    """
    gaps = [(a, b) for a, b, _, _ in kernel_gaps([(s, e, "") for s, e in kernels]) if b - a >= min_us]
    inside: dict[str, list[float]] = collections.defaultdict(list)
    for start, stop, name in host:
        us = sum(max(0.0, min(stop, b) - max(start, a)) for a, b in gaps)
        if us > 0:
            inside[name].append(us)
    ranked = sorted(inside.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [{"name": name, "count": len(us), "us": round(sum(us), 1)} for name, us in ranked]


def short_name(kernel: str) -> str:
    """A kernel's name without MLX's namespaces and its argument list, cut to 48 characters."""
    name = kernel.split("(")[0].removeprefix("void ").replace("mlx::core::cu::", "").replace("custom_kernel_", "")
    return name[:48]


def profile_batch(loaded, batch: int, tokens: int, top: int, scheme: str = "raw", context: int = 0,
                  host_trace: bool = True) -> dict:
    """One run of `batch` streams decoding `tokens` each under the profiler, after an untimed warm-up run.

    `context` 0: short random prompts (`ops.bench_batching`); else every stream starts from
    `context` tokens of random K/V in a `scheme` cache (`ops.engine_fill`, as `ops.bench_kv`) and
    decodes `CONTEXT_WARMUP` more tokens: `tok_s` leaves those out, the per-step figures (all
    steps profiled) do not.
    """
    from torch.profiler import ProfilerActivity, profile

    from ops.bench_batching import make_core, prompts_for, run_ours
    from ops.bench_kv import decode_rate
    from ops.engine_fill import filled_engine

    host: dict = {}  # with context: the timed part's launches, and how many ran ahead (`decode_rate`)
    if context:  # the fill (encoder launches) happens before the profiler starts
        def run():
            core, requests = filled_engine(loaded, scheme, [context] * batch, max_tokens=tokens + CONTEXT_WARMUP)
            mx.eval(core.cache.arrays)
            return lambda: decode_rate(core, requests, warmup=CONTEXT_WARMUP, host=host)
    else:
        prompts = prompts_for(batch, loaded.model.args.vocab_size, seed=batch)
        core = make_core(loaded, prompts, tokens, page_size=16)

        def run():
            return lambda: run_ours(core, prompts, tokens)
    run()()
    timed = run()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if host_trace else [ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        rate = timed()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name = collections.defaultdict(list)  # kernel name -> each call's µs
    for e in kernels:
        by_name[e.name[:200]].append(e.device_time_total)
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    busy, span = busy_us(spans), max(e for _, e in spans) - min(s for s, _ in spans)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    tokens = tokens + CONTEXT_WARMUP if context else tokens  # steps profiled (with context, the warm-up's too)
    calls = collections.defaultdict(list)  # host-side event (CUDA runtime / driver call, ...) -> each one's µs
    host_spans = []
    for e in prof.events():
        if e.device_type.name == "CPU":
            calls[e.name[:80]].append(e.cpu_time_total)
            host_spans.append((e.time_range.start, e.time_range.end, e.name[:80]))
    return {"tok_s": round(rate, 1), "wall_s": round(wall, 4), "kernels": len(kernels),
            "gpu_busy_us": round(busy, 1), "gpu_span_us": round(span, 1),
            "per_step_busy_us": round(busy / tokens, 1), "per_step_span_us": round(span / tokens, 1),
            "per_step_thread_cpu_us": round(cpu / tokens * 1e6, 1),
            "kernels_per_step": round(len(kernels) / tokens, 1),
            "idle_gaps_us": {name: [n / tokens, round(us / tokens, 1)] for name, (n, us) in idle_gaps(spans).items()},
            "gaps_between": gap_neighbours([(e.time_range.start, e.time_range.end, short_name(e.name))
                                            for e in kernels]),
            "top": [{"name": name, "count": len(us), "us_total": round(sum(us), 1),
                     "us_per_step": round(sum(us) / tokens, 2), "us_median": round(statistics.median(us), 2),
                     "us_deciles": [round(x, 1) for x in statistics.quantiles(us, n=10)] if len(us) > 1 else us,
                     "us_max": round(max(us), 1)} for name, us in ranked],
            "host_during_long_gaps": host_during_gaps(spans, host_spans),
            "host_calls": {name: {"per_step": round(len(us) / tokens, 1), "us_per_step": round(sum(us) / tokens, 1),
                                  "us_median": round(statistics.median(us), 2)}
                           for name, us in sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:16]},
            **({"launched_ahead": f'{host["launches_ahead"]}/{host["launches"]}'} if host else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-model", default="llama-1b", choices=["llama-1b", "qwen3-1.7b"])
    parser.add_argument("--batch-sizes", default="1", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--tokens", type=int, default=64,
                        help="decode tokens per stream (per-step figures divide by the steps profiled)")
    parser.add_argument("--top", type=int, default=40, help="kernel names kept, by total time")
    parser.add_argument("--kv-cache", default="raw", help="cache scheme, or several comma-separated (with --context)")
    parser.add_argument("--context", type=int, default=0, help="tokens of random K/V per stream before decode (0: short prompts)")
    parser.add_argument("--no-host-trace", action="store_true",
                        help="record only CUDA activity (the host runs closer to its unprofiled pace)")
    parser.add_argument("--tuning", default="", help="FIELD=INT[,...]: replace these fields of the decode-attention "
                        "launch shape (kernels.cuda_kv.Tuning) in every launch, e.g. waves=2,warps=1")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.kv_cache != "raw" and not args.context:
        parser.error("--kv-cache needs --context (short-prompt runs use the raw cache)")
    try:
        override = apply_tuning_override(args.tuning)
    except ValueError as exc:
        parser.error(str(exc))
    import torch

    from ops.bench_batching import random_model

    torch.cuda.init()  # CUPTI needs a CUDA context of PyTorch's own
    loaded = random_model(args.random_model, "bfloat16")
    schemes = args.kv_cache.split(",")
    result = {scheme: {str(b): profile_batch(loaded, b, args.tokens, args.top, scheme, args.context,
                                                 host_trace=not args.no_host_trace)
                       for b in args.batch_sizes} for scheme in schemes}
    result = result[schemes[0]] if len(schemes) == 1 else result
    if override:
        result = {"tuning": override, **result}
    suffix = f"_{args.kv_cache.replace(',', '-')}_{args.context}" if args.context else ""
    out = args.out or RESULTS / f"gpu_time_{args.random_model}{suffix}.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(_without_top(result), indent=1))


def _without_top(result: dict) -> dict:
    """The result with each run's kernel table ("top") left out (for the terminal)."""
    return {k: _without_top(v) if isinstance(v, dict) else v for k, v in result.items() if k != "top"}


if __name__ == "__main__":
    main()
