"""GPU time of one row's projections (`kernels.gemv`) against MLX's gemv and the launches the fold replaces
(`kernels.fused_norm.add_rms_norm`, `kernels.swiglu.swiglu_halves`).

For each model shape and projection kind (q/k/v after the input norm, o plus the residual, gate/up after the
post-attention norm, down after SwiGLU plus the residual, the head after the final norm), launches the
model's layers' worth of that projection over distinct random weights (so the L2 cache does not hold them),
and reads each kernel's GPU time with CUPTI (PyTorch's profiler), µs a launch; `step_us` adds a decode step's
worth (every layer's four projections and the head): fused, and MLX's gemv plus the unfused norm and SwiGLU
launches.

    python -m ops.gemv_sweep --out ops/results/gemv_sweep_gpu.json    # CUDA only

Prints JSON (not a test).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx

from kernels.fused_norm import add_rms_norm
from kernels.gemv import gemv
from kernels.swiglu import swiglu_halves

RESULTS = Path(__file__).parent / "results"
# layers, hidden, intermediate, q/k/v width, vocab
SHAPES = {"llama-1b": (16, 2048, 8192, 3072, 128256), "qwen3-1.7b": (28, 2048, 6144, 4096, 151936)}
EPS = 1e-5


def gpu_us(fn, launches: int, match: str | None = None) -> float:
    """Mean GPU µs of the CUDA kernels `fn()` launches (names containing `match`, if given), per launch."""
    from torch.profiler import ProfilerActivity, profile

    from ops.gpu_time import busy_us

    end = time.perf_counter() + 0.2  # steady clocks first
    while time.perf_counter() < end:
        mx.eval(fn())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        mx.eval(fn())
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type.name == "CUDA" and (match is None or match in e.name)]
    return busy_us(spans) / launches


def sweep(name: str) -> dict:
    layers, hidden, inter, qkv, vocab = SHAPES[name]
    rnd = lambda *shape: (mx.random.normal(shape) * shape[-1] ** -0.5).astype(mx.bfloat16)  # noqa: E731
    kinds = {  # kind: (stage, K, N, count a step)
        "qkv": ("norm", hidden, qkv, layers), "o": ("copy_res", hidden, hidden, layers),
        "gate_up": ("norm", hidden, 2 * inter, layers), "down": ("swiglu_res", inter, hidden, layers),
        "head": ("norm", hidden, vocab, 1)}
    x, gu, res, nw = rnd(1, hidden), rnd(1, 2 * inter), rnd(1, hidden), 1 + rnd(hidden)
    out = {"kinds": {}}
    for kind, (stage, k, n, count) in kinds.items():
        weights = [rnd(n, k) for _ in range(min(count, 4) if kind == "head" else count)]
        weights_t = [w.T for w in weights]
        mx.eval(weights, weights_t)
        inp = gu if stage == "swiglu_res" else x
        row = {"stage": stage, "k": k, "n": n, "per_step": count}
        a = gu[:, :inter] if stage == "swiglu_res" else x
        row["mlx_gemv_us"] = round(gpu_us(lambda: [a @ w for w in weights_t], len(weights), "gemv"), 2)
        kw = dict(norm=(nw, EPS) if stage == "norm" else None, swiglu=stage == "swiglu_res",
                  residual=res if stage.endswith("_res") else None)
        row["fused_us"] = round(gpu_us(lambda: [gemv(inp, w, **kw) for w in weights], len(weights)), 2)
        out["kinds"][kind] = row
        print(json.dumps({name: {kind: row}}), flush=True)
        del weights, weights_t
    out["add_rms_norm_us"] = round(gpu_us(lambda: [add_rms_norm(x, res, nw, EPS) for _ in range(16)], 16), 2)
    out["swiglu_us"] = round(gpu_us(lambda: [swiglu_halves(gu) for _ in range(16)], 16), 2)
    rows = out["kinds"].values()
    unfused = sum(r["mlx_gemv_us"] * r["per_step"] for r in rows)
    unfused += layers * (2 * out["add_rms_norm_us"] + out["swiglu_us"])
    out["step_us"] = {"mlx_gemv_norm_swiglu": round(unfused, 1),
                      "fused": round(sum(r["fused_us"] * r["per_step"] for r in rows), 1)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama-1b,qwen3-1.7b", type=lambda s: s.split(","))
    parser.add_argument("--out", type=Path, default=RESULTS / "gemv_sweep_gpu.json")
    args = parser.parse_args()
    result = {"benchmark": "gemv_sweep", "mlx": mx.__version__, "dtype": "bfloat16", "shapes": {}}
    for name in args.shapes:
        result["shapes"][name] = sweep(name)
        print(json.dumps({name: result["shapes"][name]["step_us"]}), flush=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
