"""Group-wise affine (min/max) quantization of cached K/V vectors.

A thin, validated wrapper over `mx.quantize(mode="affine")` so cache codes keep MLX's
layout and can feed `mx.quantized_matmul` directly. Groups run along the last axis
(`head_dim`), so every token vector is coded independently.

Layout (MLX's): `bits`-bit codes packed little-endian into uint32 as one bit stream per
row (element `i` occupies stream bits `[i*bits, (i+1)*bits)`, stream bit `k` is bit `k % 32`
of word `k // 32`); per group one scale and one bias, in the input's dtype, with
`x_hat = scale * q + bias`.

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

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)


class AffineCodes(NamedTuple):
    """Affine codes of `x` with shape `[B, H, L, d]`; the token axis is 2 in every field.

    Attributes:
        packed: uint32 `[B, H, L, d * bits / 32]`.
        scales: `x.dtype` `[B, H, L, d / group_size]`.
        biases: `x.dtype` `[B, H, L, d / group_size]`.
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


def _resolve(bits: int, group_size: int | None, head_dim: int | None = None) -> int:
    if not isinstance(bits, int) or bits not in AFFINE_BITS:
        raise ValueError(f"affine bits must be one of {AFFINE_BITS}, got {bits!r}")
    group_size = default_group_size(bits) if group_size is None else group_size
    if not isinstance(group_size, int) or group_size not in AFFINE_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {AFFINE_GROUP_SIZES}, got {group_size!r}")
    if head_dim is not None and head_dim % group_size:
        raise ValueError(f"head_dim {head_dim} is not divisible by group_size {group_size}")
    return group_size


def affine_quantize(x: mx.array, *, bits: int, group_size: int | None = None) -> AffineCodes:
    """Quantize each group of `group_size` consecutive elements to `bits` bits.

    Args:
        x: `[B, H, L, d]` (any rank >= 2) float16, bfloat16 or float32 array.
        bits: Code width, one of 2, 3, 4, 5, 6, 8.
        group_size: 32, 64 or 128 dividing `d`; `None` means `default_group_size(bits)`.

    Returns:
        `AffineCodes`; scales and biases have `x.dtype` (so float32 input costs 32-bit
        metadata, and `bits_per_element(..., scale_bits=32)`).

    Raises:
        ValueError: On unsupported `bits` or `group_size`, or `d % group_size != 0`.

    Source: CACHES.md "Bytes per token"; KIVI (arXiv 2402.02750).
    """
    group_size = _resolve(bits, group_size, x.shape[-1])
    if x.size == 0:  # mx.quantize rejects empty arrays; a cache may pass zero tokens.
        *lead, head_dim = x.shape
        meta = mx.zeros((*lead, head_dim // group_size), dtype=x.dtype)
        return AffineCodes(mx.zeros((*lead, head_dim * bits // 32), dtype=mx.uint32), meta, meta)
    return AffineCodes(*mx.quantize(x, group_size=group_size, bits=bits, mode="affine"))


def affine_dequantize(
    codes: AffineCodes, *, bits: int, group_size: int | None = None, dtype: mx.Dtype | None = None
) -> mx.array:
    """Reconstruct `scale * q + bias` from `affine_quantize` output.

    Args:
        codes: `AffineCodes` with packed `[..., d * bits / 32]`.
        bits: The width the codes were made with.
        group_size: The group size they were made with; `None` means
            `default_group_size(bits)`.
        dtype: Output dtype; `None` means the scales' dtype.

    Returns:
        `[..., d]` array of `dtype`.

    Raises:
        ValueError: On unsupported `bits` or `group_size`.
    """
    group_size = _resolve(bits, group_size)
    dtype = codes.scales.dtype if dtype is None else dtype
    if codes.packed.size == 0:  # mx.dequantize rejects empty arrays
        *lead, words = codes.packed.shape
        return mx.zeros((*lead, words * 32 // bits), dtype=dtype)
    return mx.dequantize(*codes, group_size=group_size, bits=bits, mode="affine").astype(dtype)


def bits_per_element(bits: int, group_size: int, scale_bits: int = 16) -> float:
    """Stored bits per cached element: the code plus one scale and one bias per group.

    Args:
        bits: Code width.
        group_size: Elements per group.
        scale_bits: Width of each stored scale and bias (16 for fp16/bf16, 32 for fp32).

    Returns:
        `bits + 2 * scale_bits / group_size`, e.g. 8.5 for 8 bits at group 64.

    Source: CACHES.md "Bytes per token".
    """
    return bits + 2 * scale_bits / group_size
