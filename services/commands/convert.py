"""Convert a GGUF file into a folder mlx-lm loads (config.json, safetensors, tokenizer)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gguf", help="input .gguf file")
    parser.add_argument("out_dir", help="output folder (created)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                        help="weight dtype (default: float32 on CPU, float16 on GPU)")


def run(args: argparse.Namespace) -> int:
    from services.engine.model.gguf import convert_gguf

    out = convert_gguf(args.gguf, args.out_dir, dtype=args.dtype)
    print(out)
    return 0
