"""Group-wise affine (min/max) quantization of cached K/V vectors.

A thin, validated wrapper over `mx.quantize(mode="affine")` so cache codes keep MLX's
layout and can feed `mx.quantized_matmul` directly. Groups run along the last axis
(`head_dim`), so every token vector is coded independently.

Layout (MLX's): `bits`-bit codes packed little-endian into uint32 as one bit stream per
row (element `i` occupies stream bits `[i*bits, (i+1)*bits)`, stream bit `k` is bit `k % 32`
of word `k // 32`); per group one scale and one bias, in the input's dtype, with
`x_hat = scale * q + bias`.

A head_dim the group size does not divide ends with one smaller *tail group* (head_dim 80 at
group 64: groups of 64 and 16), coded by the same rule: scale and bias depend on the group's
min and max only, so the tail is quantized as a full group filled with copies of itself and
the filler's codes are dropped (the last word's unused bits are zero). This keeps the scheme's
group size everywhere it fits and costs one extra scale and bias per vector, where falling
back to a smaller group size that divides head_dim would pay for every group (affine8 at
d = 80: 8.8 bits per element, against 10.0 with groups of 16).

Error (what mx.quantize does, measured in the tests): MLX keeps the larger-magnitude group
edge as the bias and snaps zero onto the grid (`scale = edge / round(edge / step)`, possibly
negative), so each element is within `|scale| / 2` of its grid point, except that the grid
may stop short of the far edge by up to one step (those elements are clipped, error
< `|scale|`). Scale and bias are rounded from float32 to `x.dtype` after the codes are
chosen, adding up to `u * (q * |scale| + |bias|)` (u: unit roundoff, 2**-11 for float16,
2**-8 for bfloat16, where 8-bit errors reach ~2.5 steps). MSE on Gaussian groups is within
5% of exact min/max rounding.

Source: CACHES.md "Bytes per token"; KIVI (arXiv 2402.02750); MLX `mx.quantize` docs.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from kernels.aura import packed_words, unpack_bits

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)


class AffineCodes(NamedTuple):
    """Affine codes of `x` with shape `[B, H, L, d]`; the token axis is 2 in every field.

    Attributes:
        packed: uint32 `[B, H, L, ceil(d * bits / 32)]`.
        scales: `x.dtype` `[B, H, L, ceil(d / group_size)]` (the last one a tail group's when
            `group_size` does not divide `d`).
        biases: `x.dtype` `[B, H, L, ceil(d / group_size)]`.
    """

    packed: mx.array
    scales: mx.array
    biases: mx.array


def default_group_size(bits: int) -> int:
    """Group size used when none is given: 64 for 5..8 bits, 32 for 2..4 bits.

    Coarse codes get smaller groups so the step size stays bounded (affine8 = g64,
    affine4 = g32, matching CACHES.md).
    """
    return 64 if bits >= 5 else 32


def num_groups(head_dim: int, group_size: int) -> int:
    """Scale/bias groups per vector: `ceil(head_dim / group_size)` (a tail group included)."""
    return -(-head_dim // group_size)


def _resolve(bits: int, group_size: int | None) -> int:
    if not isinstance(bits, int) or bits not in AFFINE_BITS:
        raise ValueError(f"affine bits must be one of {AFFINE_BITS}, got {bits!r}")
    group_size = default_group_size(bits) if group_size is None else group_size
    if not isinstance(group_size, int) or group_size not in AFFINE_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {AFFINE_GROUP_SIZES}, got {group_size!r}")
    return group_size


def affine_quantize(x: mx.array, *, bits: int, group_size: int | None = None) -> AffineCodes:
    """Quantize each group of `group_size` consecutive elements to `bits` bits.

    Args:
        x: `[B, H, L, d]` (any rank >= 2) float16, bfloat16 or float32 array.
        bits: Code width, one of 2, 3, 4, 5, 6, 8.
        group_size: 32, 64 or 128; when it does not divide `d`, the last group is a tail of
            `d % group_size` elements. `None` means `default_group_size(bits)`.

    Returns:
        `AffineCodes`; scales and biases have `x.dtype` (so float32 input costs 32-bit
        metadata, and `bits_per_element(..., scale_bits=32)`).

    Raises:
        ValueError: On unsupported `bits` or `group_size`.

    Source: CACHES.md "Bytes per token"; KIVI (arXiv 2402.02750).
    """
    group_size = _resolve(bits, group_size)
    *lead, head_dim = x.shape
    if x.size == 0:  # mx.quantize rejects empty arrays; a cache may pass zero tokens.
        meta = mx.zeros((*lead, num_groups(head_dim, group_size)), dtype=x.dtype)
        return AffineCodes(mx.zeros((*lead, packed_words(head_dim, bits)), dtype=mx.uint32), meta, meta)
    full = head_dim - head_dim % group_size
    if full == head_dim:
        return AffineCodes(*mx.quantize(x, group_size=group_size, bits=bits, mode="affine"))
    parts = [] if not full else [mx.quantize(x[..., :full], group_size=group_size, bits=bits, mode="affine")]
    parts.append(_quantize_tail(x[..., full:], bits, group_size))
    return AffineCodes(*(mx.concatenate([p[i] for p in parts], axis=-1) for i in range(3)))


def _quantize_tail(tail: mx.array, bits: int, group_size: int) -> tuple[mx.array, mx.array, mx.array]:
    """One group of `t < group_size` elements: (codes [..., ceil(t*bits/32)], scale [..., 1], bias [..., 1]).

    The group is filled to `group_size` with copies of its own elements, which leaves its min
    and max, hence MLX's scale, bias and codes, unchanged; the copies' codes are dropped.
    """
    size = tail.shape[-1]
    filled = mx.concatenate([tail] * -(-group_size // size), axis=-1)[..., :group_size]
    packed, scales, biases = mx.quantize(filled, group_size=group_size, bits=bits, mode="affine")
    words = packed_words(size, bits)
    packed, used = packed[..., :words], size * bits % 32
    if used:  # zero the filler's bits in the last word: the stored format does not depend on them
        keep = mx.array([0xFFFFFFFF] * (words - 1) + [(1 << used) - 1], dtype=mx.uint32)
        packed = packed & keep
    return packed, scales, biases


def affine_dequantize(
    codes: AffineCodes, *, bits: int, group_size: int | None = None, dtype: mx.Dtype | None = None,
    head_dim: int | None = None,
) -> mx.array:
    """Reconstruct `scale * q + bias` from `affine_quantize` output.

    Args:
        codes: `AffineCodes` with packed `[..., ceil(d * bits / 32)]`.
        bits: The width the codes were made with.
        group_size: The group size they were made with; `None` means
            `default_group_size(bits)`.
        dtype: Output dtype; `None` means the scales' dtype.
        head_dim: `d`; None: every group is full (`d = groups * group_size`).

    Returns:
        `[..., d]` array of `dtype`.

    Raises:
        ValueError: On unsupported `bits` or `group_size`, or codes that do not match `head_dim`.
    """
    group_size = _resolve(bits, group_size)
    dtype = codes.scales.dtype if dtype is None else dtype
    head_dim = codes.scales.shape[-1] * group_size if head_dim is None else head_dim
    if codes.scales.shape[-1] != num_groups(head_dim, group_size) or codes.packed.shape[-1] != packed_words(
            head_dim, bits):
        raise ValueError(f"codes {codes.packed.shape} / scales {codes.scales.shape} do not hold head_dim {head_dim} "
                         f"at {bits} bits, group {group_size}")
    if codes.packed.size == 0:  # mx.dequantize rejects empty arrays
        return mx.zeros((*codes.packed.shape[:-1], head_dim), dtype=dtype)
    full = head_dim - head_dim % group_size
    if full == head_dim:
        return mx.dequantize(*codes, group_size=group_size, bits=bits, mode="affine").astype(dtype)
    full_words, groups = full * bits // 32, full // group_size
    parts = []
    if full:
        parts.append(mx.dequantize(codes.packed[..., :full_words], codes.scales[..., :groups],
                                   codes.biases[..., :groups], group_size=group_size, bits=bits, mode="affine"))
    q = unpack_bits(mx.contiguous(codes.packed[..., full_words:]), bits, head_dim - full).astype(mx.float32)
    scale, bias = (a[..., groups:].astype(mx.float32) for a in (codes.scales, codes.biases))
    parts.append(q * scale + bias)
    return mx.concatenate([p.astype(mx.float32) for p in parts], axis=-1).astype(dtype)


def bits_per_element(bits: int, group_size: int, scale_bits: int = 16) -> float:
    """Stored bits per cached element: the code plus one scale and one bias per group.

    Args:
        bits: Code width.
        group_size: Elements per group.
        scale_bits: Width of each stored scale and bias (16 for fp16/bf16, 32 for fp32).

    Returns:
        `bits + 2 * scale_bits / group_size`, e.g. 8.5 for 8 bits at group 64 (a head_dim
        with a tail group stores `2 * scale_bits * ceil(d / group_size) / d` of metadata).

    Source: CACHES.md "Bytes per token".
    """
    return bits + 2 * scale_bits / group_size
