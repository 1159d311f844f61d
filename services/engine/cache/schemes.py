"""Cache schemes by name: which codec stores keys and which stores values, per layer."""

from __future__ import annotations

import mlx.core as mx

from kernels.aura import parse_aura_scheme
from services.engine.model.gguf import DTYPES

from .codecs import KVCodec, RawCodec
from .quantized import AURA_SEED, AffineCodec, AuraCodec

AFFINE = {"affine8": (8, 64), "affine4": (4, 32)}  # name → (bits, group_size)
SCHEMES = ("raw", "affine8", "affine4", "aura4v4", "aura4v2", "aura8v4", "aura8v8")  # named in --help


def make_codecs(scheme: str, *, layer: int, dtype: mx.Dtype) -> tuple[KVCodec, KVCodec]:
    """Build the (key, value) codecs of one layer.

    A scheme may give single layers another scheme: `aura4v4+1=aura8v8` is aura4v4 except
    layer 1, which gets aura8v8. On the default model layer 1 is the most sensitive by far
    (mean KL of aura4v2 on 2048 Lee tokens drops 0.160 -> 0.128 with layer 1 at aura8v8, but
    only to 0.151 / 0.153 / 0.158 / 0.157 for layers 0 / 2 / 15 / 29), so `+1=aura8v8` buys
    11-21% lower KL for 0.13 bit per element (numbers in `services/eval/README.md`).

    Args:
        scheme (str): `raw`, `affine8`, `affine4`, or `aura{K}v{V}` with K, V in 2..8,
            optionally followed by `+{layer}={scheme}` overrides.
        layer (int): Layer index (seeds its AURA rotations: K and V get different ones).
        dtype (mx.Dtype): The model dtype; raw storage and decoded tensors use it.

    Raises:
        ValueError: unknown scheme or malformed override (the message lists the known ones).
    """
    base, overrides = parse_layer_overrides(scheme)
    for name in (base, *overrides.values()):
        _single_codecs(name, layer=layer, dtype=dtype)  # validate every part, whichever layer this is
    return _single_codecs(overrides.get(layer, base), layer=layer, dtype=dtype)


def parse_layer_overrides(scheme: str) -> tuple[str, dict[int, str]]:
    """Split `base+{layer}={name}+...` into the base scheme and `{layer: name}`.

    Raises:
        ValueError: an override is not `{non-negative int}={name}`, or repeats a layer.
    """
    base, *parts = scheme.split("+")
    overrides: dict[int, str] = {}
    for part in parts:
        layer, sep, name = part.partition("=")
        if not sep or not layer.isdigit() or not name or int(layer) in overrides:
            raise ValueError(f"bad layer override {part!r} in KV cache scheme {scheme!r}; expected e.g. "
                             "'aura4v4+1=aura8v8'")
        overrides[int(layer)] = name
    return base, overrides


def _single_codecs(scheme: str, *, layer: int, dtype: mx.Dtype) -> tuple[KVCodec, KVCodec]:
    if scheme == "raw":
        return RawCodec(dtype), RawCodec(dtype)
    if scheme in AFFINE:
        bits, group = AFFINE[scheme]
        return AffineCodec(bits, group, dtype), AffineCodec(bits, group, dtype)
    if scheme.startswith("aura"):
        key_bits, value_bits = parse_aura_scheme(scheme)
        seed = AURA_SEED + 2 * layer
        return AuraCodec(key_bits, seed, dtype), AuraCodec(value_bits, seed + 1, dtype)
    raise ValueError(f"unknown KV cache scheme {scheme!r}; choose one of {', '.join(SCHEMES)} or aura{{K}}v{{V}}, "
                     "optionally with layer overrides such as +1=aura8v8")


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
            return AuraCodec(int(meta["bits"]), int(meta["seed"]), dtype)
    except KeyError as exc:
        raise ValueError(f"codec meta {meta} lacks {exc}") from exc
    raise ValueError(f"unknown codec {kind!r} in meta {meta}")


def _dtype(name: str) -> mx.Dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]
