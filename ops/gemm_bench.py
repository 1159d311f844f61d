"""Few-row projections on the GPU (batched decode), kernel time by CUPTI: MLX's matmul (cuBLASLt) against
`kernels.skinny_gemm` launch shapes, at llama-1b's and qwen3-1.7b's projection shapes and 16 to 64 rows.

Each weight is rotated over 2 to 24 copies (up to 256 MiB in all; more than the L2 at these shapes), so
every launch reads from HBM, as a decode step does. Reports each product's GPU time a launch (µs: every
kernel and memset it ran, summed, over the timed launches), the weight's read rate (GB/s), and the
kernel's error against a float32 product (max |got - ref| / max |ref|). The host's side is not here: a
cuBLASLt call costs ~20 µs more of it than a custom launch (`kernels.skinny_gemm`'s note). Where
`kernels.skinny_gemm.default_tuning` comes from.

Needs PyTorch with CUDA next to MLX's CUDA backend (as `ops/gpu_time.py`):

    python -m ops.gemm_bench --out ops/results/skinny_gemm_gpu.json

Writes JSON; not a test.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from kernels.skinny_gemm import SkinnyTuning, default_tuning, skinny_matmul
from ops.gemv_bench import ROTATION_BYTES, SHAPES

CANDIDATES = [SkinnyTuning(1, 1, 8, 4), SkinnyTuning(2, 1, 8, 2), SkinnyTuning(4, 1, 8, 2), SkinnyTuning(4, 1, 8, 1),
              SkinnyTuning(2, 2, 8, 2), SkinnyTuning(4, 2, 8, 1), SkinnyTuning(4, 4, 8, 1), SkinnyTuning(2, 4, 8, 1),
              SkinnyTuning(4, 8, 4, 1), SkinnyTuning(2, 8, 4, 1), SkinnyTuning(4, 4, 4, 2), SkinnyTuning(1, 4, 8, 1),
              SkinnyTuning(1, 2, 8, 2), SkinnyTuning(1, 1, 8, 2, True), SkinnyTuning(1, 1, 4, 2, True),
              SkinnyTuning(2, 1, 8, 1, True), SkinnyTuning(2, 1, 4, 2, True), SkinnyTuning(1, 4, 8, 1, True),
              SkinnyTuning(1, 2, 8, 2, True), SkinnyTuning(1, 1, 4, 4, True)]


def cupti_us(launch, copies: list, iters: int) -> float:
    """GPU time (µs) a call of `launch(copy)`: every CUDA kernel and memset of `iters` calls, cycling through
    `copies`, summed and divided by `iters`."""
    from torch.profiler import ProfilerActivity, profile

    for c in copies[:2]:
        mx.eval(launch(c))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            mx.eval(launch(copies[i % len(copies)]))
    return sum(e.device_time_total for e in prof.events()
               if e.device_type.name == "CUDA" and "emcpy" not in e.name) / iters


def label(t: SkinnyTuning) -> str:
    return f"r{t.tiles}ks{t.splits}w{t.warps}u{t.unroll}" + ("p" if t.prefetch else "")


def weight_copies(n: int, k: int, rng: np.random.Generator) -> list[mx.array]:
    """A random bf16 [n, k] weight in 2 to 24 distinct buffers, up to ROTATION_BYTES in all."""
    count = max(2, min(24, -(-ROTATION_BYTES // (n * k * 2))))
    w0 = mx.array(rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)).astype(mx.bfloat16)
    copies = [mx.contiguous(w0 + mx.array(0.0, mx.bfloat16) * i) for i in range(count)]
    mx.eval(copies)
    return copies


def bench_shape(copies: list[mx.array], rows: int, iters: int, rng: np.random.Generator) -> dict:
    """One projection shape at `rows` rows: cuBLASLt, then every candidate launch shape that fits."""
    w0, (n, k), count = copies[0], copies[0].shape, len(copies)
    transposed = [c.T for c in copies]
    mx.eval(transposed)
    x = mx.array(rng.standard_normal((rows, k), dtype=np.float32)).astype(mx.bfloat16)
    ref = np.array(x.astype(mx.float32) @ w0.astype(mx.float32).T)
    gb = n * k * 2 / 1e3  # bytes / 1e3: GB/s from µs
    cublas = cupti_us(lambda wt: x @ wt, transposed, iters)
    row = {"n": n, "k": k, "rows": rows, "mib": round(n * k * 2 / 2**20, 1), "copies": count,
           "cublas_us": round(cublas, 2), "cublas_gb_s": round(gb / cublas),
           "default": label(default_tuning(rows, n, k))}
    for t in dict.fromkeys([*CANDIDATES, default_tuning(rows, n, k)]):
        if not t.fits(rows, n, k):
            continue
        err = float(np.abs(np.array(skinny_matmul(x, w0, t).astype(mx.float32)) - ref).max() / np.abs(ref).max())
        us = cupti_us(lambda w, t=t: skinny_matmul(x, w, t), copies, iters)
        row[label(t)] = {"us": round(us, 2), "gb_s": round(gb / us), "err": err}
    best = min((v["us"], key) for key, v in row.items() if isinstance(v, dict))
    row["best"], row["best_over_cublas"] = best[1], round(cublas / best[0], 3)
    row["default_over_cublas"] = round(cublas / row[row["default"]]["us"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30, help="launches timed per kernel")
    parser.add_argument("--rows", default="16,32,64", help="comma-separated row counts")
    parser.add_argument("--models", default=",".join(SHAPES), help="comma-separated models of ops.gemv_bench.SHAPES")
    parser.add_argument("--out", type=Path, default=Path("ops/results/skinny_gemm_gpu.json"))
    args = parser.parse_args()
    import torch

    torch.cuda.init()  # CUPTI needs a CUDA context of PyTorch's own
    rng = np.random.default_rng(0)
    results = []
    for model in args.models.split(","):
        for name, (n, k, _) in SHAPES[model].items():
            copies = weight_copies(n, k, rng)
            for rows in map(int, args.rows.split(",")):
                row = {"model": model, "proj": name, **bench_shape(copies, rows, args.iters, rng)}
                results.append(row)
                print(json.dumps(row), flush=True)
                args.out.write_text(json.dumps({"device": str(mx.default_device()), "rows": results}, indent=1))
            del copies
            mx.clear_cache()


if __name__ == "__main__":
    main()
