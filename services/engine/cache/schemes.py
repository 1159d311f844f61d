"""Cache schemes by name: which codec stores keys and which stores values, per layer."""

from __future__ import annotations

import mlx.core as mx

from kernels.aura import parse_aura_scheme

from .codecs import KVCodec, RawCodec
from .quantized import AURA_SEED, AffineCodec, AuraCodec

AFFINE = {"affine8": (8, 64), "affine4": (4, 32)}  # name → (bits, group_size)
SCHEMES = ("raw", "affine8", "affine4", "aura4v4", "aura4v2", "aura8v4", "aura8v8")  # named in --help
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def make_codecs(scheme: str, *, layer: int, dtype: mx.Dtype) -> tuple[KVCodec, KVCodec]:
    """Build the (key, value) codecs of one layer.

    Args:
        scheme (str): `raw`, `affine8`, `affine4`, or `aura{K}v{V}` with K, V in 2..8.
        layer (int): Layer index (seeds its AURA rotations: K and V get different ones).
        dtype (mx.Dtype): The model dtype; raw storage and decoded tensors use it.

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


def scheme_name(key_codec: KVCodec, value_codec: KVCodec) -> str:
    """The `--kv-cache` name of a codec pair: `raw`, `affine8`, `aura4v2`, or `key/value` names."""
    if isinstance(key_codec, AuraCodec) and isinstance(value_codec, AuraCodec):
        return f"aura{key_codec.bits}v{value_codec.bits}"
    if key_codec.name == value_codec.name:
        return key_codec.name
    return f"{key_codec.name}/{value_codec.name}"


def codec_from_meta(meta: dict[str, str]) -> KVCodec:
    """Rebuild a codec from its `meta()` (the stored format: rotation seeds included).

    Args:
        meta (dict[str, str]): What `codec.meta()` returned.

    Returns:
        A codec equal in every stored-format respect to the one that wrote `meta`.

    Raises:
        ValueError: an unknown codec or dtype, or a missing key.
    """
    try:
        kind, dtype = meta["codec"], _dtype(meta["dtype"])
        if kind == "raw":
            return RawCodec(dtype)
        if kind == "affine":
            return AffineCodec(int(meta["bits"]), int(meta["group_size"]), dtype,
                               scale_dtype=_dtype(meta["scale_dtype"]))
        if kind == "aura":
            return AuraCodec(int(meta["bits"]), int(meta["seed"]), dtype, scale_rule=meta["scale_rule"])
    except KeyError as exc:
        raise ValueError(f"codec meta {meta} lacks {exc}") from exc
    raise ValueError(f"unknown codec {kind!r} in meta {meta}")


def _dtype(name: str) -> mx.Dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]
