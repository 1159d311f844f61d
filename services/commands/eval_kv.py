"""Measure how much each KV-cache scheme changes the model, against the raw cache, on real text.

Teacher-forced over the first --tokens tokens of the Lee background corpus in chunks of
--chunk (later chunks attend to history the scheme stored): mean KL(raw || scheme), top-1
agreement, perplexity and its change; plus free-running greedy: tokens until the first
difference from the raw cache; plus passkey retrieval: a pass key told once, --recall-filler
tokens of news text, then the question, answered greedily with the full cache and under a
--recall-window whose sinks keep the key, each answer compared with the raw cache's. Writes eval_kv.json,
eval_kv.md and eval_kv.png to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from services.commands.options import layer_list

DEFAULT_SCHEMES = "affine8,affine6,affine4,aura8v8,aura8v4,aura5v3,aura4v4,aura4v2"
DEFAULT_OUT = Path("ops/results/eval_kv")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), 'gemma3-270m', a local folder or a .gguf file")
    parser.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                        help="weight dtype (auto: float32 on CPU); the raw reference stores K/V in it")
    parser.add_argument("--schemes", default=DEFAULT_SCHEMES, help=f"comma-separated (default {DEFAULT_SCHEMES})")
    parser.add_argument("--tokens", type=int, default=2048, help="teacher-forced predictions (default 2048)")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per forward (default 256)")
    parser.add_argument("--prompts", type=int, default=4, help="free-running prompts (default 4)")
    parser.add_argument("--max-new", type=int, default=48, help="most greedy tokens per prompt (default 48)")
    parser.add_argument("--kv-raw-layers", type=lambda s: frozenset(layer_list(s)),
                        default=frozenset(), help="layers kept raw in every scheme, e.g. 1")
    parser.add_argument("--recall-keys", type=int, default=5, help="passkey prompts, 0 to 5 (default 5; 0: off)")
    parser.add_argument("--recall-filler", type=int, default=1500, help="filler tokens before the question (default 1500)")
    parser.add_argument("--recall-window", type=int, default=256,
                        help="window of the windowed recall answers, tokens incl. the fact's sinks (default 256)")
    parser.add_argument("--no-center-keys", dest="center_keys", action="store_false",
                        help="store compressed keys as they come (default: centered on the model's mean keys, "
                             "measured as the engine does, on the first 512 Lee tokens: inside the scored span; "
                             "ops/centering_gain.py measures held out)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")


def run(args: argparse.Namespace) -> int:
    from services.commands.progress import RunProgress
    from services.engine.cache import CacheOptions, make_layer_caches
    from services.engine.cache.schemes import check_layer_numbers
    from services.engine.model.loader import load_model
    from services.engine.runtime import default_key_means
    from services.eval.kv_eval import EvalConfig, evaluate
    from services.eval.plot import plot_quality
    from services.eval.recall import FACTS
    from services.eval.report import markdown_table, recall_table, results_dict

    for name, value in (("--tokens", args.tokens), ("--chunk", args.chunk), ("--prompts", args.prompts),
                        ("--recall-filler", args.recall_filler)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if not 0 <= args.recall_keys <= len(FACTS):
        raise ValueError(f"--recall-keys must be 0..{len(FACTS)}, got {args.recall_keys}")
    loaded = load_model(args.model, dtype=args.dtype)
    num_layers = len(make_layer_caches(loaded.model, CacheOptions(max_context=1)))
    for scheme in args.schemes.split(","):  # before minutes of runs, not silently past the model
        check_layer_numbers(scheme, args.kv_raw_layers, num_layers, scheme_option="--schemes")
    config = EvalConfig(schemes=tuple(s for s in args.schemes.split(",") if s), num_tokens=args.tokens,
                        chunk=args.chunk, num_prompts=args.prompts, max_new=args.max_new,
                        raw_layers=args.kv_raw_layers, recall_keys=args.recall_keys,
                        recall_filler_tokens=args.recall_filler, recall_window=args.recall_window,
                        key_means=default_key_means(loaded) if args.center_keys else None)
    progress = RunProgress(1 + sum(s != "raw" for s in config.schemes), "eval-kv")
    try:
        results = evaluate(loaded.model, loaded.tokenizer, config, on_run=progress.step)
    finally:
        progress.close()
    dtype = str(loaded.dtype).removeprefix("mlx.core.")
    args.out.mkdir(parents=True, exist_ok=True)
    report = results_dict(results, config, model=loaded.path.name, dtype=dtype)
    (args.out / "eval_kv.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown_table(results) + ("\n" + recall_table(results) if args.recall_keys else "")
    (args.out / "eval_kv.md").write_text(table)
    title = f"{loaded.path.name} ({dtype}), {args.tokens} Lee-corpus tokens in chunks of {args.chunk}"
    plot_quality(results, args.out / "eval_kv.png", title=title)
    print(table, end="")
    return 0
