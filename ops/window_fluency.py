"""Long generation under a sliding window: fluency and memory per block of tokens.

Generates `--tokens` tokens (default 5,000; temperature 0.8, top-p 0.95, seed 0) with a window (default 256, keep 4) and
records, per block of 500 generated tokens, the distinct-token ratio (distinct ids / block
size: a looping model collapses towards 0) and the KV bytes held at the block's end (flat once
the window is full). JSON to stdout and `ops/results/window_fluency_<device>.json`.

    python -m ops.window_fluency [--kv-cache raw] [--window 256 --keep 4] [--tokens 5000]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx

RESULTS = Path(__file__).parent / "results"
PROMPT = "Tell me a very long story about a dairy farm, its animals and the people who work there, season by season."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache", default="raw")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--keep", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=5000)
    parser.add_argument("--block", type=int, default=500)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--no-window", action="store_true", help="full cache, for comparison")
    args = parser.parse_args()

    from services.engine.cache import CacheOptions, Window, make_layer_caches
    from services.engine.generate import GenerationStats, generate
    from services.engine.model.loader import load_model
    from shared.protocol import SamplingParams

    loaded = load_model("default")
    loaded.tokenizer.eos_token_ids = set()  # run the full length
    options = CacheOptions(scheme=args.kv_cache, max_context=loaded.advertised_context,
                           window=None if args.no_window else Window(args.window, args.keep))
    caches = make_layer_caches(loaded.model, options)
    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    stats, blocks, text, t0 = GenerationStats(), [], [], time.perf_counter()
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=0, max_tokens=args.tokens)
    # max_context only caps full-attention caches; a window keeps memory bounded whatever the length.
    for piece in generate(loaded.model, loaded.tokenizer, list(ids), caches, params,
                          max_context=len(ids) + args.tokens, stats=stats):
        text.append(piece)
        if len(stats.token_ids) % args.block == 0 and len(stats.token_ids) // args.block > len(blocks):
            block = stats.token_ids[-args.block:]
            blocks.append({"block": len(blocks), "distinct_ratio": round(len(set(block)) / len(block), 3),
                           "kv_bytes": sum(c.nbytes for c in caches),
                           "kv_capacity_bytes": sum(c.capacity_nbytes for c in caches),
                           "sample": loaded.tokenizer.decode(block[:40])})
    result = {"benchmark": "window_fluency", "device": str(mx.default_device()), "kv_cache": args.kv_cache,
              "window": None if args.no_window else args.window, "keep": args.keep,
              "temperature": args.temperature, "top_p": args.top_p, "generated_tokens": stats.generated_tokens,
              "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2), "seconds": round(time.perf_counter() - t0, 1),
              "blocks": blocks}
    RESULTS.mkdir(exist_ok=True)
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    tag = f"{args.kv_cache}_{'full' if args.no_window else f'w{args.window}'}_t{args.temperature:g}"
    (RESULTS / f"window_fluency_{device}_{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
