"""Benchmark: our in-process generation against mlx-lm's `stream_generate`, one process, same prompt.

Both run the same loaded model on the same prompt tokens, greedy, for `--repeats` rounds after a
warm-up, each round's first side alternating; the medians of prefill and decode tok/s and their
ratios (ours / mlx-lm) go to stdout and `ops/results/generate_<device>.json`.

    python -m ops.bench_generate [--prompt-tokens 512] [--max-tokens 128] [--repeats 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from shared.blas import active_blas

RESULTS = Path(__file__).parent / "results"


def ours(loaded, options, ids, max_tokens):
    from services.engine.cache import make_layer_caches
    from services.engine.generate import GenerationStats, generate
    from shared.protocol import SamplingParams

    stats = GenerationStats()
    caches = make_layer_caches(loaded.model, options)
    for _ in generate(loaded.model, loaded.tokenizer, ids, caches, SamplingParams(max_tokens=max_tokens),
                      max_context=options.max_context, prefill_chunk=2048, stats=stats):
        pass
    return stats.prefill_tokens_per_s, stats.decode_tokens_per_s, stats.generated_tokens


def theirs(loaded, ids, max_tokens):
    from mlx_lm.generate import stream_generate

    last = None
    for last in stream_generate(loaded.model, loaded.tokenizer, ids, max_tokens=max_tokens):
        pass
    return last.prompt_tps, last.generation_tps, last.generation_tokens


def prompt_ids(tokenizer, n: int) -> list[int]:
    text = " ".join(f"Sentence {i} tells of milk, butter and the long history of churning." for i in range(n))
    return list(tokenizer.encode(text))[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="JSON path (default ops/results/generate_<device>.json)")
    args = parser.parse_args()

    from services.engine.cache import CacheOptions
    from services.engine.model.loader import load_model

    loaded = load_model(args.model)
    options = CacheOptions(max_context=loaded.advertised_context)
    ids = prompt_ids(loaded.tokenizer, args.prompt_tokens)
    # Ignore EOS so both decode exactly max_tokens tokens.
    loaded.tokenizer.eos_token_ids = set()
    ours(loaded, options, ids[:32], 8), theirs(loaded, ids[:32], 8)  # warm-up
    runs = {"ours": [], "mlx_lm": []}
    sides = {"ours": lambda: ours(loaded, options, ids, args.max_tokens),
             "mlx_lm": lambda: theirs(loaded, ids, args.max_tokens)}
    for r in range(args.repeats):  # who goes first alternates: the order alone moved the ratio ~2%
        for side in (("ours", "mlx_lm") if r % 2 == 0 else ("mlx_lm", "ours")):
            runs[side].append(sides[side]())
    med = {k: [statistics.median(r[i] for r in v) for i in range(2)] for k, v in runs.items()}
    result = {
        "benchmark": "generate", "device": str(mx.default_device()), "blas": active_blas(),
        "model": str(loaded.path.name), "dtype": str(loaded.dtype), "prompt_tokens": len(ids),
        "max_tokens": args.max_tokens, "repeats": args.repeats, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "ours": {"prefill_tokens_per_s": med["ours"][0], "decode_tokens_per_s": med["ours"][1]},
        "mlx_lm": {"prefill_tokens_per_s": med["mlx_lm"][0], "decode_tokens_per_s": med["mlx_lm"][1]},
        "ratio": {"prefill": med["ours"][0] / med["mlx_lm"][0], "decode": med["ours"][1] / med["mlx_lm"][1]},
    }
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    out = args.out or RESULTS / f"generate_{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
