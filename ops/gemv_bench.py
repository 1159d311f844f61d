"""One-row projections on the GPU, kernel time by CUPTI: MLX's gemv against `kernels.row_gemv` launch shapes and
`kernels.norm_gemv` chunk caps, at llama-1b's and qwen3-1.7b's single-stream decode shapes.

Each weight is rotated over copies of at least 256 MiB in all, so every launch reads from HBM, not L2, as a decode
step does. Reports each kernel's median time a launch (µs) and the row_gemv output's error against a float32
product (max |got - ref| / max |ref|). Where `kernels.row_gemv.default_tuning` and `norm_gemv.CHUNK_WORDS` come
from (`ops/results/row_gemv_gpu_2026-12-05.json`).

Needs PyTorch with CUDA next to MLX's CUDA backend (as `ops/gpu_time.py`):

    python -m ops.gemv_bench --out ops/results/gemv_bench_gpu.json

Writes JSON; not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import mlx.core as mx
import numpy as np

from kernels import norm_gemv
from kernels.row_gemv import RowTuning, row_gemv, serves

SHAPES = {  # model -> projection -> (N, K, kind): "mlx" runs MLX's gemv in the engine today, "norm" norm_gemv
    "llama-1b": {"qkv": (3072, 2048, "norm"), "o": (2048, 2048, "mlx"), "gate_up": (16384, 2048, "swiglu"),
                 "down": (2048, 8192, "mlx"), "head": (128256, 2048, "norm")},
    "qwen3-1.7b": {"qkv": (4096, 2048, "norm"), "o": (2048, 2048, "mlx"), "gate_up": (12288, 2048, "swiglu"),
                   "down": (2048, 6144, "mlx"), "head": (151936, 2048, "norm")},
}
TUNINGS = [RowTuning(8, 1, 1, 8, 0), RowTuning(8, 2, 1, 8, 0), RowTuning(8, 4, 1, 8, 0), RowTuning(8, 1, 1, 8, 1),
           RowTuning(8, 1, 1, 4, 2), RowTuning(8, 2, 1, 8, 1), RowTuning(8, 2, 1, 4, 2), RowTuning(8, 4, 1, 4, 2),
           RowTuning(8, 2, 2, 4, 1), RowTuning(4, 1, 2, 4, 2), RowTuning(16, 4, 1, 2, 2), RowTuning(4, 2, 1, 4, 3)]
ROTATION_BYTES = 256 * 2**20


def cupti_median_us(launch, copies: list, iters: int) -> float:
    """Median CUDA kernel time (µs) of `launch(copy)` over `iters` launches, cycling through `copies`."""
    from torch.profiler import ProfilerActivity, profile

    for c in copies[:2]:
        mx.eval(launch(c))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            mx.eval(launch(copies[i % len(copies)]))
    return statistics.median(e.device_time_total for e in prof.events()
                             if e.device_type.name == "CUDA" and "emcpy" not in e.name)


def bench_shape(n: int, k: int, kind: str, iters: int, rng: np.random.Generator) -> dict:
    """One projection shape: MLX's gemv, every row_gemv tuning it serves, and norm_gemv's chunk caps."""
    count = max(2, min(24, -(-ROTATION_BYTES // (n * k * 2))))
    w0 = mx.array(rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)).astype(mx.bfloat16)
    copies = [mx.contiguous(w0 + mx.array(0.0, mx.bfloat16) * i) for i in range(count)]  # distinct buffers
    transposed = [c.T for c in copies]
    mx.eval(copies, transposed)
    x = mx.array(rng.standard_normal((1, k), dtype=np.float32)).astype(mx.bfloat16)
    ref = np.array(x.astype(mx.float32) @ w0.astype(mx.float32).T)
    row = {"n": n, "k": k, "mib": round(n * k * 2 / 2**20, 1), "kind": kind, "copies": count,
           "mlx_gemv_us": cupti_median_us(lambda wt: x @ wt, transposed, iters)}
    for t in TUNINGS:
        if serves(x, w0, t):
            err = float(np.abs(np.array(row_gemv(x, w0, t).astype(mx.float32)) - ref).max() / np.abs(ref).max())
            us = cupti_median_us(lambda w, t=t: row_gemv(x, w, t), copies, iters)
            row[f"w{t.warps}s{t.split}r{t.rows}u{t.unroll}p{t.stages}"] = {"us": us, "err": err}
    if kind != "mlx" and k <= 4096:
        nw = mx.array(1 + 0.1 * rng.standard_normal(k).astype(np.float32)).astype(mx.bfloat16)
        r = mx.array(rng.standard_normal((1, k), dtype=np.float32)).astype(mx.bfloat16)
        default = norm_gemv.CHUNK_WORDS
        try:
            for cap in (8, 4, 2):
                norm_gemv.CHUNK_WORDS = cap
                row[f"norm_gemv_cap{cap}_us"] = cupti_median_us(
                    lambda w: norm_gemv.norm_gemv(x, r, nw, 1e-5, w, swiglu=kind == "swiglu")[1], copies, iters)
        finally:
            norm_gemv.CHUNK_WORDS = default
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=40, help="launches timed per kernel")
    parser.add_argument("--out", type=Path, default=Path("ops/results/gemv_bench_gpu.json"))
    args = parser.parse_args()
    import torch

    torch.cuda.init()  # CUPTI needs a CUDA context of PyTorch's own
    rng = np.random.default_rng(0)
    rows = {}
    for model, shapes in SHAPES.items():
        for name, (n, k, kind) in shapes.items():
            rows[f"{model}/{name}"] = bench_shape(n, k, kind, args.iters, rng)
            print(f"{model}/{name}", json.dumps(rows[f"{model}/{name}"]), flush=True)
            mx.clear_cache()
    args.out.write_text(json.dumps({"device": str(mx.default_device()), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
