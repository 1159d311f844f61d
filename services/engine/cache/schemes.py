"""Cache schemes by name: which codec stores keys and which stores values, per layer."""

from __future__ import annotations

import mlx.core as mx

from .codecs import KVCodec, RawCodec

SCHEMES = ("raw",)  # the names `--kv-cache` accepts


def make_codecs(scheme: str, *, layer: int, dtype: mx.Dtype) -> tuple[KVCodec, KVCodec]:
    """Build the (key, value) codecs of one layer.

    Args:
        scheme (str): A name from `SCHEMES`.
        layer (int): Layer index (seeds per-layer rotations).
        dtype (mx.Dtype): The model dtype; raw storage and decoded tensors use it.

    Raises:
        ValueError: unknown scheme (the message lists the known ones).
    """
    if scheme == "raw":
        return RawCodec(dtype), RawCodec(dtype)
    raise ValueError(f"unknown KV cache scheme {scheme!r}; choose one of: {', '.join(SCHEMES)}")
