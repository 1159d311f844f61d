"""Cache schemes by name: which codec stores keys and which stores values, per layer."""

from __future__ import annotations

import mlx.core as mx

from kernels.aura import parse_aura_scheme

from .codecs import KVCodec, RawCodec
from .quantized import AURA_SEED, AffineCodec, AuraCodec

AFFINE = {"affine8": (8, 64), "affine4": (4, 32)}  # name → (bits, group_size)
SCHEMES = ("raw", "affine8", "affine4", "aura4v4", "aura4v2", "aura8v4", "aura8v8")  # named in --help


def make_codecs(scheme: str, *, layer: int, dtype: mx.Dtype) -> tuple[KVCodec, KVCodec]:
    """Build the (key, value) codecs of one layer.

    Args:
        scheme (str): `raw`, `affine8`, `affine4`, or `aura{K}v{V}` with K, V in 2..8.
        layer (int): Layer index (seeds its AURA rotations: K and V get different ones).
        dtype (mx.Dtype): The model dtype; raw storage, affine scales and decoded tensors use it.

    Raises:
        ValueError: unknown scheme (the message lists the known ones).
    """
    if scheme == "raw":
        return RawCodec(dtype), RawCodec(dtype)
    if scheme in AFFINE:
        bits, group = AFFINE[scheme]
        return AffineCodec(bits, group, dtype), AffineCodec(bits, group, dtype)
    if scheme.startswith("aura"):
        key_bits, value_bits = parse_aura_scheme(scheme)
        seed = AURA_SEED + 2 * layer
        return AuraCodec(key_bits, seed, dtype), AuraCodec(value_bits, seed + 1, dtype)
    raise ValueError(f"unknown KV cache scheme {scheme!r}; choose one of {', '.join(SCHEMES)} or aura{{K}}v{{V}}")
