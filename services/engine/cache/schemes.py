"""Cache schemes by name: one registry entry per family, read by every part of the product.

A scheme name (`raw`, `affine8`, `aura4v2`, …) gives the key and value `PartFormat` of a layer;
`base+{layer}={name}` overrides single layers. Everything else — bits per element, bytes per
token, persistence (`PartFormat.meta`), help texts — derives from the parts, so adding a
family means its codec (encode/decode in `kernels.kv_format` and the CUDA kernels) plus one
`Family` entry here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import mlx.core as mx

from kernels.aura import SCHEME_MIN_BITS
from kernels.kv_format import AFFINE, AURA, RAW, LayerFormat, PartFormat
from kernels.lloyd_max import MAX_BITS
from services.engine.dtypes import mx_dtype

AURA_SEED = 0x0A0A  # base of the per-layer rotation seeds (K: +2*layer, V: +2*layer+1); part of the format
# Affine bits -> group size. affine6 at group 64 (6.5 bits/element) sits between affine4
# (5.0) and affine8 (8.5) in bytes and in KL (`buttermilk eval-kv`, README table).
AFFINE_GROUP_SIZES = {8: 64, 6: 64, 4: 32}

Parts = tuple[PartFormat, PartFormat]


@dataclass(frozen=True, slots=True)
class Family:
    """One family of scheme names.

    Attributes:
        pattern (re.Pattern): Full-match pattern of the names.
        build (Callable[[re.Match, int, mx.Dtype], Parts]): (match, layer, model dtype) -> parts.
        listed (tuple[str, ...]): Names shown in help texts and benchmark defaults.
        spelling (str): How the family is spelled in error messages.
    """

    pattern: re.Pattern
    build: Callable[[re.Match, int, mx.Dtype], Parts]
    listed: tuple[str, ...]
    spelling: str


def _raw(match: re.Match, layer: int, dtype: mx.Dtype) -> Parts:
    part = PartFormat(RAW, 8 * dtype.size, dtype=dtype)
    return part, part


def _affine(match: re.Match, layer: int, dtype: mx.Dtype) -> Parts:
    bits = int(match[1])
    part = PartFormat(AFFINE, bits, AFFINE_GROUP_SIZES[bits], dtype=dtype)
    return part, part


def _aura(match: re.Match, layer: int, dtype: mx.Dtype) -> Parts:
    seed = AURA_SEED + 2 * layer
    return (PartFormat(AURA, int(match[1]), seed=seed, dtype=dtype),
            PartFormat(AURA, int(match[2]), seed=seed + 1, dtype=dtype))


_AURA_WIDTH = "|".join(map(str, range(SCHEME_MIN_BITS, MAX_BITS + 1)))  # kernels.aura's scheme widths
FAMILIES = (
    Family(re.compile(r"raw"), _raw, ("raw",), "raw"),
    Family(re.compile(r"affine(8|6|4)"), _affine, ("affine8", "affine6", "affine4"), "affine{8,6,4}"),
    Family(re.compile(rf"aura({_AURA_WIDTH})v({_AURA_WIDTH})"), _aura, ("aura4v4", "aura4v2", "aura8v4", "aura8v8"),
           f"aura{{K}}v{{V}} with K, V in {SCHEME_MIN_BITS}..{MAX_BITS}"),
)
SCHEMES = tuple(name for family in FAMILIES for name in family.listed)  # named in --help


def layer_parts(scheme: str, *, layer: int, dtype: mx.Dtype) -> Parts:
    """The (key, value) parts of one layer under a scheme spec.

    A spec may give single layers another scheme: `aura4v4+1=aura8v8` is aura4v4 except
    layer 1, which gets aura8v8. On the default model layer 1 is the most sensitive by far
    (mean KL of aura4v2 on 2048 Lee tokens drops 0.160 -> 0.128 with layer 1 at aura8v8, but
    only to 0.151 / 0.153 / 0.158 / 0.157 for layers 0 / 2 / 15 / 29).

    Args:
        scheme (str): A name, optionally followed by `+{layer}={name}` overrides.
        layer (int): Layer index (seeds its AURA rotations: K and V get different ones).
        dtype (mx.Dtype): The model dtype; raw storage uses it.

    Raises:
        ValueError: unknown name or malformed override (the message lists the known ones).
    """
    base, overrides = check_scheme(scheme)  # every part, whichever layer this is
    return _single(overrides.get(layer, base), layer=layer, dtype=dtype)


def check_scheme(scheme: str) -> tuple[str, dict[int, str]]:
    """Check that a scheme spec names known schemes only, base and overrides (no model needed).

    Returns:
        tuple[str, dict[int, str]]: the base scheme and `{layer: name}` (`parse_layer_overrides`).

    Raises:
        ValueError: as `layer_parts`.
    """
    base, overrides = parse_layer_overrides(scheme)
    for name in (base, *overrides.values()):
        _single(name, layer=0, dtype=mx.float16)
    return base, overrides


def layer_format(scheme: str, *, layer: int, dtype: mx.Dtype, head_dim: int, value_dim: int = 0) -> LayerFormat:
    """`layer_parts` as a `LayerFormat` for keys of `head_dim` and values of `value_dim` (0: the same).

    Raises:
        ValueError: as `layer_parts`, or the parts cannot store those widths.
    """
    return LayerFormat(*layer_parts(scheme, layer=layer, dtype=dtype), head_dim, value_dim)


def parse_layer_overrides(scheme: str) -> tuple[str, dict[int, str]]:
    """Split `base+{layer}={name}+...` into the base scheme and `{layer: name}`.

    Raises:
        ValueError: an override is not `{non-negative int}={name}`, or repeats a layer.
    """
    base, *parts = scheme.split("+")
    overrides: dict[int, str] = {}
    for part in parts:
        layer, sep, name = part.partition("=")
        if not sep or not layer.isdigit() or not name:
            raise ValueError(f"bad layer override {part!r} in KV cache scheme {scheme!r}; expected e.g. "
                             "'aura4v4+1=aura8v8'")
        if int(layer) in overrides:
            raise ValueError(f"layer {int(layer)} is overridden twice in KV cache scheme {scheme!r}")
        overrides[int(layer)] = name
    return base, overrides


def check_layer_numbers(scheme: str, raw_layers: Iterable[int], num_layers: int, *,
                        scheme_option: str = "--kv-cache", raw_option: str = "--kv-raw-layers") -> None:
    """Check that every layer a scheme's overrides (`+{layer}=`) or `raw_layers` name is one of the model's.

    Raises:
        ValueError: a layer number outside 0 .. num_layers - 1, naming the option that gave it
            (`scheme_option` or `raw_option`): such a layer would be silently ignored.
    """
    _, overrides = parse_layer_overrides(scheme)
    for option, layers in ((scheme_option, overrides), (raw_option, raw_layers)):
        outside = sorted(n for n in layers if not 0 <= n < num_layers)
        if outside:
            raise ValueError(f"{option}: layer {outside[0]} is not a layer of this model, which has {num_layers} "
                             f"(0-{num_layers - 1})")


def _single(name: str, *, layer: int, dtype: mx.Dtype) -> Parts:
    for family in FAMILIES:
        match = family.pattern.fullmatch(name)
        if match:
            return family.build(match, layer, dtype)
    families = "; ".join(f.spelling for f in FAMILIES)
    raise ValueError(f"unknown KV cache scheme {name!r}; choose one of {', '.join(SCHEMES)} (families: {families}), "
                     "optionally with layer overrides such as +1=aura8v8")


def bits_per_element(scheme: str, *, head_dim: int, dtype: mx.Dtype, layer: int = 0) -> float:
    """Stored bits per K/V element of one layer under `scheme`, metadata included (CACHES.md)."""
    return layer_format(scheme, layer=layer, dtype=dtype, head_dim=head_dim).bits_per_element()


def bytes_per_token(scheme: str, *, model) -> int:
    """KV bytes one token costs across a model's attention layers under `scheme` (layer overrides included).

    Args:
        scheme (str): A scheme spec.
        model: An mlx-lm model (its layers' caches decide which are attention layers).
    """
    from .batched import layer_specs
    from .factory import CacheOptions

    return sum(LayerFormat(k, v, g.key_dim, g.value_dim).bytes_per_row * g.n_kv_heads
               for k, v, _, g, _ in layer_specs(model, CacheOptions(scheme=scheme)))


def part_from_meta(meta: dict[str, str]) -> PartFormat:
    """Rebuild a part from its `meta()` (the stored format: rotation seeds included).

    Raises:
        ValueError: an unknown kind or dtype, or a missing key.
    """
    try:
        kind = meta["kind"]
        if kind not in (RAW, AFFINE, AURA):
            raise ValueError(f"unknown KV part kind {kind!r} in meta {meta}")
        return PartFormat(kind, int(meta["bits"]), int(meta["group_size"]), int(meta["seed"]),
                          mx_dtype(meta["dtype"]))
    except KeyError as exc:
        raise ValueError(f"KV part meta {meta} lacks {exc}") from exc
