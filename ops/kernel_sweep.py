"""Sweep the launch shape of the fused paged decode kernel (`kernels.cuda_kv.Tuning`) on the GPU.

For each model shape, scheme and (streams, context), builds one layer's worth of page pools per
layer of the model (random codes, finite meta: the kernel's cost does not depend on the values),
then times the model's attention layers back to back (every layer's pools are distinct, so the
L2 cache does not hold them) for each tuning (the case's `default_tuning` among them), best of
`--repeats` rounds over all tunings, each sample after `WARM_S` of back-to-back steps (steady GPU
clocks). GPU time per decode step's attention is what it reports (ms), with the bytes each step
reads and the bandwidth that implies.

    python -m ops.kernel_sweep                      # CUDA only; writes ops/results/kernel_sweep_gpu.json

Prints JSON (not a test).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from kernels import cuda_kv
from kernels.cuda_kv import Tuning
from services.engine.cache.schemes import layer_format

RESULTS = Path(__file__).parent / "results"
PAGE = 16
WARM_S = 0.2  # seconds of back-to-back steps before each sample
# (name, layers, query heads, kv heads, head_dim)
SHAPES = {"llama-1b": (16, 32, 8, 64), "qwen3-1.7b": (28, 16, 8, 128)}


def _pools(fmt, rows: int) -> tuple[mx.array, ...]:
    out = []
    for width, dtype in fmt.pool_specs():
        if dtype == mx.uint32:  # random codes; meta halves 0x3C00 (1.0) so every value is finite
            codes = mx.random.randint(0, 2**31, (rows, width)).astype(mx.uint32)
            meta = mx.full((rows, width - fmt.meta_offset), 0x3C003C00, dtype=mx.uint32)
            out.append(mx.concatenate([codes[:, : fmt.meta_offset], meta], axis=1))
        else:
            out.append(mx.random.normal((rows, width)).astype(dtype))
    return tuple(out)


def decode_inputs(fmt, shape, streams: int, context: int, layers: int) -> tuple:
    """Evaluated inputs of `layers` layers' decode attention: (pools per layer, page table int32 [streams,
    pages a row], lengths int32 [streams] all `context`, query bf16 [streams, n_heads, 1, head_dim]); every
    row's pages are its own, in order.

    The page table and lengths are written by the GPU, so they sit in device memory as the engine's do (its
    decode window's index arrays reach the device once, migrated on first touch). MLX's CUDA allocator keeps
    an array built on the host in managed memory and one of 8 bytes or fewer in a small pool the GPU reads
    in place from host memory: on the H200 a lone row's lengths there added about 15 us to every launch
    (ncu, llama 1 x 32K raw partial 43.4 against 27.7 us; `ops/results/ncu_resident_inputs_gpu_2026-12-03.json`).
    """
    _, n_heads, n_kv, head_dim = shape
    pages_per_row = -(-context // PAGE)
    num_pages = streams * pages_per_row
    pools = [_pools(fmt, n_kv * num_pages * PAGE) for _ in range(layers)]
    # made on the GPU and over 8 bytes (sliced down): device memory, not the host-side pool
    table = mx.arange(num_pages + 8, dtype=mx.int32)[:num_pages].reshape(streams, pages_per_row)
    lengths = mx.full((streams + 8,), context, dtype=mx.int32)[:streams]
    q = mx.random.normal((streams, n_heads, 1, head_dim)).astype(mx.bfloat16)
    mx.eval(pools, table, lengths, q)
    return pools, table, lengths, q


def layer_timer(fmt, shape, streams: int, context: int, gpu_time: bool = False):
    """A function `(tuning, iters) -> ms` timing every layer's decode attention over fresh pools.

    `gpu_time`: the partial and combine kernels' GPU time (CUPTI), not the wall clock with launches.
    """
    layers, _, n_kv, head_dim = shape
    pools, table, lengths, q = decode_inputs(fmt, shape, streams, context, layers)

    def steps(tuning, count: int):
        """`count` decode steps' attention, chained: each layer's (and step's) query is the last output, so
        the GPU runs one kernel at a time, as in a model (independent chains would overlap)."""
        out = q
        for _ in range(count):
            for layer in pools:
                out = cuda_kv.decode_attention(out, fmt, layer, None, table, lengths, n_kv_heads=n_kv,
                                               page_size=PAGE, scale=head_dim**-0.5, tuning=tuning)
        return out

    def warm(tuning: Tuning) -> None:
        """Keep the GPU busy for `WARM_S` first, so the sample runs at steady clocks (idle GPUs clock down)."""
        end = time.perf_counter() + WARM_S
        while time.perf_counter() < end:
            mx.eval(steps(tuning, 4))

    def timed(tuning: Tuning, iters: int) -> float:
        warm(tuning)
        start = time.perf_counter()
        mx.eval(steps(tuning, iters))
        return (time.perf_counter() - start) / iters * 1e3

    def gpu_timed(tuning: Tuning, iters: int) -> float:
        """GPU busy time of the kernels (CUPTI through PyTorch's profiler; overlaps merged), ms per step."""
        from torch.profiler import ProfilerActivity, profile

        from ops.gpu_time import busy_us

        warm(tuning)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            mx.eval(steps(tuning, iters))
        spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type.name == "CUDA" and "paged_decode" in e.name]
        return busy_us(spans) / iters / 1e3

    return gpu_timed if gpu_time else timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-1b,qwen3-1.7b")
    parser.add_argument("--schemes", default="raw,affine8,affine4,aura8v4,aura4v4")
    parser.add_argument("--cases", default="1x32768,32x8192", help="streams x context")
    parser.add_argument("--dims-per-lane", default="8,16")
    parser.add_argument("--unroll", default="1,2,4")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--waves", default="4,16")
    parser.add_argument("--query-in-registers", default="1")
    parser.add_argument("--prefetch", default="0,1")
    parser.add_argument("--stages", default="0,4", help="0: loads straight to registers; n: a ring of n stages")
    parser.add_argument("--stage-bytes", default="8192")
    parser.add_argument("--mma", default="0,1", help="1: the tensor-core kernel (dims per lane, prefetch unused)")
    parser.add_argument("--one-split-tokens", default="0", help="page tables this wide or narrower: one split")
    parser.add_argument("--slabs", default="1", help="tensor-core kernel: 16-token slabs a warp takes at once")
    parser.add_argument("--register-tables", default="0", help="tensor-core kernel, AURA codes: 1 takes the "
                        "register-table lookups (Tuning.register_tables)")
    parser.add_argument("--page-copies", default="1", help="tensor-core kernel: 0 looks up a pool row for every "
                        "16-byte copy of a tile, 1 once a page (Tuning.page_copies)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10, help="decode steps (all layers) per sample")
    parser.add_argument("--gpu-time", action="store_true",
                        help="time the kernels alone with CUPTI (needs PyTorch with CUDA), not the wall clock")
    parser.add_argument("--out", help="JSON path (default ops/results/kernel_sweep_gpu.json, _cupti with --gpu-time)")
    args = parser.parse_args()
    args.out = args.out or str(RESULTS / ("kernel_sweep_gpu_cupti.json" if args.gpu_time else "kernel_sweep_gpu.json"))
    if args.gpu_time:
        import torch

        torch.cuda.init()  # CUPTI needs a CUDA context of PyTorch's own
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    grid = [Tuning(*t) for t in itertools.product(ints(args.dims_per_lane), ints(args.unroll), ints(args.warps),
                                                   ints(args.waves), map(bool, ints(args.query_in_registers)),
                                                   map(bool, ints(args.prefetch)), ints(args.stages),
                                                   ints(args.stage_bytes), map(bool, ints(args.mma)),
                                                   ints(args.one_split_tokens), ints(args.slabs),
                                                   map(bool, ints(args.register_tables)),
                                                   map(bool, ints(args.page_copies)))]
    tunings = [t for t in grid  # prefetching is the unstaged FMA kernel's; the tensor-core kernel needs 2+ stages
               if not (t.prefetch and t.stages) and not (t.mma and (t.prefetch or t.stages < 2))
               and (t.mma or t.slabs == 1 and not t.register_tables and t.page_copies)]  # the tensor-core kernel's knobs
    results = []
    for model, scheme, case in itertools.product(args.models.split(","), args.schemes.split(","),
                                                 args.cases.split(",")):
        shape = SHAPES[model]
        streams, context = map(int, case.split("x"))
        fmt = layer_format(scheme, layer=0, dtype=mx.bfloat16, head_dim=shape[3])
        default_tuning = cuda_kv.default_tuning(fmt, streams * shape[2])
        timings = {t: float("inf") for t in [*tunings, default_tuning]}  # the default is always timed
        timed = layer_timer(fmt, shape, streams, context, args.gpu_time)
        for _ in range(args.repeats):  # round robin: drift in the GPU's clocks falls on every tuning alike
            for tuning in timings:
                if timings[tuning] != timings[tuning]:
                    continue
                try:
                    timings[tuning] = min(timings[tuning], timed(tuning, args.iters))
                except Exception as exc:  # a shape the kernel cannot compile (registers, shared memory)
                    timings[tuning] = float("nan")
                    print("skip", model, scheme, case, tuning, repr(exc)[:200], flush=True)
        default = timings[default_tuning]
        best = min((t for t in timings if timings[t] == timings[t]), key=timings.get)
        read = shape[0] * streams * context * shape[2] * fmt.bytes_per_row
        row = {"model": model, "scheme": scheme, "streams": streams, "context": context,
               "default_ms": round(default, 4), "best_ms": round(timings[best], 4), "best": dataclasses.asdict(best),
               "bytes_read": read, "best_tb_s": round(read / timings[best] / 1e9, 3),
               "all": [{**dataclasses.asdict(t), "ms": round(ms, 4)} for t, ms in timings.items()]}
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "all"}), flush=True)
        _write(args.out, results)
        del timed
        mx.clear_cache()


def _write(path: str, results: list[dict]) -> None:
    out = {"device": str(mx.default_device()), "mlx": mx.__version__, "page_size": PAGE, "results": results}
    Path(path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
