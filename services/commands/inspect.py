"""Show the model geometry and, with --layer-trace, each layer's cache after a short prompt.

Per layer: cache kind, scheme, window, live tokens, stored field shapes and dtypes, bytes
held, bytes per token and the ratio to a raw cache in the model dtype; for a hybrid model,
its recurrent layers' state and the state bytes each engine slot holds.
"""

from __future__ import annotations

import argparse
import json

from .options import add_model_arguments, settings_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--prompt", default="The capital of France is Paris. The capital of Italy is",
                        help="prompt run through the model before the trace")
    parser.add_argument("--layer-trace", action="store_true", help="per-layer cache report")
    parser.add_argument("--json", action="store_true", help="one JSON object")


def run(args: argparse.Namespace) -> int:
    from shared.logging import configure_logging
    from services.engine.cache import make_layer_caches
    from services.engine.cache.report import geometry, layer_reports, state_bytes_per_slot
    from services.engine.generate import prefill
    from services.engine.runtime import open_model

    settings = settings_from_args(args)
    configure_logging(json=settings.log_json, level=settings.log_level)
    loaded, options = open_model(settings)
    report = {"model": str(loaded.path), "kv_cache": options.scheme, "max_context": options.max_context,
              "window": None if options.window is None else {"size": options.window.max_size, "keep": options.window.keep},
              **geometry(loaded), "state_bytes_per_slot": state_bytes_per_slot(loaded.model)}
    if args.layer_trace:
        caches = make_layer_caches(loaded.model, options)
        ids = list(loaded.tokenizer.encode(args.prompt))
        import mlx.core as mx

        mx.eval(prefill(loaded.model, caches, ids, chunk=settings.prefill_chunk))
        report["prompt_tokens"] = len(ids)
        report["layers"] = layer_reports(caches, loaded.dtype)
        report["kv_bytes"] = sum(c.nbytes for c in caches)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0


def print_report(report: dict) -> None:
    for key, value in report.items():
        if key == "window" and value is None:
            print(f"{key:>22}: none asked (--kv-window-size); the model's own windows show per layer")
        elif key != "layers":
            print(f"{key:>22}: {value}")
    for row in report.get("layers", []):
        pools = " ".join(f"{p['shape']}:{p['dtype']}" for p in row.get("pools", []))
        window = row.get("window")  # [size, keep] of a windowed layer (the model's own, or --kv-window-size)
        window = f"window={window[0]}+{window[1]}" if window else "window=-"
        print(f"layer {row['layer']:>3} {row['kind']:<20} {row.get('scheme', ''):<8} {window:<14} live={row.get('live_tokens', '-'):<6} "
              f"{row['nbytes']:>10} B  {row.get('bytes_per_token', '-')} B/tok  x{row.get('ratio_to_raw', '-')}  {pools}")
