"""A/B of single-stream decode with and without the SwiGLU inside the down projection's launch
(`kernels.swiglu_down`) in one process: per context and scheme, both engines filled alike and stepped in turn
(`ops.bench_kv.step_in_turn`), so the host's drift falls on both. The engine without it is built with
`kernels.swiglu_down.takes` answering False (the lean step then launches `kernels.swiglu` and the projection,
as at 2 or more rows).

    python -m ops.swiglu_down_ab --random-model llama-1b --contexts 512,8192,32768 --schemes raw,aura4v4

Prints JSON rows and writes `swiglu_down_ab_<device>_<model>.json` to `--out` (not a test).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from pathlib import Path
from unittest import mock

import mlx.core as mx

from ops.bench_kv import RANDOM_MODELS, step_in_turn
from ops.bench_batching import random_model
from ops.engine_fill import filled_engine

RESULTS = Path(__file__).parent / "results"


def ab_row(loaded, scheme: str, context: int, args) -> dict:
    """Both engines at `context`, `--rounds` times: tok/s of each and their ratio (best and median)."""
    runs = {"fold": [], "unfolded": []}
    for _ in range(args.rounds):
        engines = {"fold": filled_engine(loaded, scheme, [context], max_tokens=args.warmup + args.steps)}
        with mock.patch("kernels.swiglu_down.takes", return_value=False):
            engines["unfolded"] = filled_engine(loaded, scheme, [context], max_tokens=args.warmup + args.steps)
        assert engines["fold"][0].runner._lean.swiglu_in_down == (mx.default_device() == mx.gpu)
        for name, rate in step_in_turn(engines, args.warmup).items():
            runs[name].append(round(rate["tokens_per_s"], 1))
        del engines
        gc.collect()
    best = {name: max(r) for name, r in runs.items()}
    mid = {name: statistics.median(r) for name, r in runs.items()}
    return {"scheme": scheme, "context_tokens": context, "fold_tokens_per_s": best["fold"],
            "unfolded_tokens_per_s": best["unfolded"], "ratio": round(best["fold"] / best["unfolded"], 3),
            "median_ratio": round(mid["fold"] / mid["unfolded"], 3), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-model", choices=sorted(RANDOM_MODELS), default="llama-1b")
    parser.add_argument("--schemes", default="raw", type=lambda s: [x for x in s.split(",") if x])
    parser.add_argument("--contexts", default="512,8192", type=lambda s: [int(x) for x in s.split(",") if x])
    parser.add_argument("--steps", type=int, default=256, help="timed decode tokens a run")
    parser.add_argument("--warmup", type=int, default=32, help="untimed tokens first (traces, allocator)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of both engines a row")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    loaded = random_model(args.random_model, "bfloat16")
    rows = []
    for context in args.contexts:
        for scheme in args.schemes:
            rows.append(ab_row(loaded, scheme, context, args))
            print(json.dumps(rows[-1]), flush=True)
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    result = {"benchmark": "swiglu_down_ab", "model": args.random_model, "dtype": "bfloat16", "device": device,
              "mlx": mx.__version__, "steps": args.steps, "rounds": args.rounds, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"swiglu_down_ab_{device}_{args.random_model}.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
