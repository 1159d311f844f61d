"""Flags shared by commands that load a model, and their translation into settings and options."""

from __future__ import annotations

import argparse

from pydantic import ValidationError

from shared.errors import BadRequest
from shared.settings import ModelSettings


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--model`, `--dtype`, cache and context flags (defaults come from settings)."""
    parser.add_argument("--model", help="'default' (SmolLM2-135M-Instruct), 'gemma3-270m' (needs the [gemma] extra), a local HF/MLX folder, or a .gguf file")
    parser.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], help="weight dtype (auto: float32 on CPU)")
    parser.add_argument("--kv-cache", help="raw | affine8 | affine4 | aura4v4 | aura4v2 | aura8v4 | aura8v8 | aura{K}v{V}")
    parser.add_argument("--kv-raw-layers", type=lambda s: tuple(int(x) for x in s.split(",") if x), help="comma-separated layers kept raw, e.g. 0,29")
    parser.add_argument("--kv-window-size", type=int, help="sliding window per layer, in tokens (sinks included)")
    parser.add_argument("--kv-window-keep", type=int, help="attention-sink tokens pinned under a window (default 4)")
    parser.add_argument("--max-context", type=int, help="context cap in tokens (default: the model's advertised window)")
    parser.add_argument("--prefill-chunk", type=int, help="prompt tokens per prefill forward (default 512)")
    parser.add_argument("--log-json", action="store_true", default=None, help="JSON log lines")


def settings_from_args(args: argparse.Namespace) -> ModelSettings:
    """Settings from the environment, overridden by the flags that were given."""
    overrides = {
        name: getattr(args, name)
        for name in ModelSettings.model_fields
        if getattr(args, name, None) is not None
    }
    try:
        return ModelSettings(**overrides)
    except ValidationError as exc:
        raise BadRequest(one_line(exc)) from exc


def one_line(exc: ValidationError) -> str:
    """A pydantic validation error as one line: `field: reason; field: reason`."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors())
