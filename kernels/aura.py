"""AURA: Adaptive Unified Rotated Activations, a per-vector KV-cache code.

TurboQuant-MSE without the QJL residual, as a shape-gain code. Each token vector `x` (length
`d`) is rotated, `y = Pi x` (`RandomizedHadamard`), normalised to `u = sqrt(d) * y / ||x||`
(coordinates close to N(0, 1)), and every coordinate of `u / g` is replaced by the index of
its nearest Lloyd-Max centroid `c`, for the gain `g` of `GAINS` whose codes point closest to
`u` (largest cos(u, c[idx])). One scale per vector, `s = ||x|| / ||c[idx]||`, is stored so
the reconstruction `y_hat = s * c[idx]` (rotated domain) has exactly the norm of `x` (up to
the float16 rounding of `s`, relative error <= 2**-11).

Why the gain search: the codebook is MSE-optimal for the ensemble of coordinates, but one
vector's `d` coordinates fill its cells unevenly (64 samples rarely reach the outer
centroids at 4 bits), and the decoder only needs the direction of `c[idx]`. Searching nine
gains in [0.8, 1.2] (g = 1 among them, so no vector gets worse) cuts the mean squared error of
N(0, I) vectors at d = 64 by 2% at 2 bits, 10% at 3, 20% at 4 (float64 Monte Carlo), and the
held-out KL of aura4v4 on the default model from 0.034 to 0.027. The decoder is unchanged. At
9-10 bits the gains' cosines differ by ~1e-7, near float32 rounding, so the float32 search
keeps most but not all of its gain there (d = 64: error x0.77-0.83 of one gain's, vs ~0.75).
Source of the idea: the scale search of llama.cpp's k-quants (`make_qx_quants`); shape-gain
quantization (Sabin and Gray, IEEE Trans. ASSP 32(6), 1984).

Stored format per vector: `d * bits` code bits in `ceil(d * bits / 32)` uint32 words (zero
bits pad the last word when `d * bits % 32 != 0`, e.g. d = 80 at 3 bits), plus one float16
scale. The bit layout is the little-endian bit stream of `mx.quantize`: index `i` occupies
stream bits `[i*bits, (i+1)*bits)`, stream bit `k` is bit `k % 32` of word `k // 32`.

Source: CACHES.md "AURA encode / decode" and "Bytes per token"; TurboQuant
(arXiv 2504.19874) Algorithm 1; PolarQuant (arXiv 2502.02617).
"""

from __future__ import annotations

import functools
import math
import re
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from kernels.lloyd_max import MAX_BITS, MIN_BITS, lloyd_max_codebook, lloyd_max_thresholds
from kernels.rotation import RandomizedHadamard

SCALE_DTYPE = mx.float16
SCHEME_MIN_BITS = 2
GAINS = tuple(0.8 + 0.05 * i for i in range(9))  # the gains searched per vector; 1.0 is GAINS[4]
_WORD_BITS = 32
_SCHEME = re.compile(r"aura([1-9]\d*)v([1-9]\d*)")


class AuraCodes(NamedTuple):
    """AURA codes of `x` with shape `[B, H, L, d]`; the token axis is 2 in every field.

    Attributes:
        packed: uint32 `[B, H, L, d * bits / 32]`, codebook indices as a bit stream.
        scales: float16 `[B, H, L, 1]`, `||x|| / ||c[idx]||` per vector.
    """

    packed: mx.array
    scales: mx.array


def _validate(bits: int) -> None:
    if not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"AURA bits must be an int in {MIN_BITS}..{MAX_BITS}, got {bits!r}")


def packed_words(count: int, bits: int) -> int:
    """uint32 words that hold `count` values of `bits` bits: `ceil(count * bits / 32)`."""
    return -(-count * bits // _WORD_BITS)


@functools.lru_cache(maxsize=None)
def aura_codebook(bits: int) -> mx.array:
    """`lloyd_max_codebook(bits)` as a float32 `mx.array` `[2**bits]` (cached)."""
    return mx.array(lloyd_max_codebook(bits), dtype=mx.float32)


@functools.lru_cache(maxsize=None)
def _block_plan(bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """Static shift plan for one block of the bit stream.

    The layout repeats every `P = 32 / gcd(bits, 32)` values, which fill exactly
    `Q = bits / gcd(bits, 32)` words. Value `p` of a block starts at bit
    `start = p*bits - 32*q` of word `q` of that block (negative when it began in an
    earlier word); it touches the word iff `-bits < start < 32`, contributing
    `(v << max(start, 0)) >> max(-start, 0)` truncated to 32 bits. Every shift is < 32.

    Returns:
        `(left, right, touches)`, each uint32 `[Q, P]`.
    """
    values = _WORD_BITS // math.gcd(bits, _WORD_BITS)
    words = values * bits // _WORD_BITS
    start = np.arange(values)[None, :] * bits - np.arange(words)[:, None] * _WORD_BITS
    touches = (start > -bits) & (start < _WORD_BITS)
    left = np.where(touches, np.maximum(start, 0), 0)
    right = np.where(touches, np.maximum(-start, 0), 0)
    return tuple(mx.array(a.astype(np.uint32)) for a in (left, right, touches))


def pack_bits(values: mx.array, bits: int) -> mx.array:
    """Pack `bits`-bit unsigned values into uint32 words along the last axis.

    Vectorized over blocks of `32 / gcd(bits, 32)` values (no gathers); odd widths cost
    `bits / gcd(bits, 32)` times more arithmetic than widths dividing 32.

    Args:
        values: Integer array `[..., n]` with values in `[0, 2**bits)`.
        bits: Width of each value, 1..10.

    Returns:
        uint32 `[..., ceil(n * bits / 32)]` in the `mx.quantize` bit-stream layout; bits past
        `n * bits` in the last word are zero.
    """
    left, right, touches = _block_plan(bits)
    words_per_block, values_per_block = left.shape
    *lead, count = values.shape
    num_blocks = -(-count // values_per_block)
    values = values.astype(mx.uint32)
    if num_blocks * values_per_block != count:  # zero values fill the last block
        values = mx.pad(values, [(0, 0)] * len(lead) + [(0, num_blocks * values_per_block - count)])
    blocks = values.reshape(*lead, num_blocks, 1, values_per_block)
    words = (((blocks << left) >> right) * touches).sum(axis=-1)
    return words.reshape(*lead, num_blocks * words_per_block)[..., : packed_words(count, bits)]


def unpack_bits(packed: mx.array, bits: int, count: int | None = None) -> mx.array:
    """Inverse of `pack_bits`.

    Value i starts at bit `i * bits` of the stream: it is word `i * bits // 32` shifted right,
    with the next word's low bits added when it spills over. Both words are gathered with
    `take_along_axis` (MLX's GatherAxis; on the CPU up to 10x faster than shifting whole blocks
    of words as `pack_bits` does, most at widths that do not divide 32).

    Args:
        packed: uint32 `[..., words]`.
        bits: Width of each value, 1..10.
        count: Values to read; None: `words * 32 // bits`.

    Returns:
        uint32 `[..., count]` with values in `[0, 2**bits)`.
    """
    *lead, words = packed.shape
    count = words * _WORD_BITS // bits if count is None else count
    rows = math.prod(lead)
    flat = packed.reshape(rows, words)
    first, shift, spill = _unpack_plan(bits, count, words)

    def word(index: mx.array) -> mx.array:  # [rows, count]: word `index[i]` of each row
        return mx.take_along_axis(flat, mx.broadcast_to(index, (rows, count)), axis=1)

    values = word(first) >> shift
    if spill is not None:
        following, left, spills = spill
        values = values | (word(following) << left) * spills
    return (values & ((1 << bits) - 1)).reshape(*lead, count)


@functools.lru_cache(maxsize=None)
def _unpack_plan(bits: int, count: int, words: int):
    """uint32 `[1, count]` arrays for `unpack_bits`: each value's word and right shift, and, when some
    value spills into the next word, (that word, the left shift putting its low bits above the first
    word's, 1 where the value spills and 0 elsewhere), else None. Shifts stay below 32."""
    start = np.arange(count) * bits
    first, shift = start // _WORD_BITS, start % _WORD_BITS

    def as_row(a: np.ndarray) -> mx.array:
        return mx.array(a.astype(np.uint32))[None]

    spills = shift + bits > _WORD_BITS
    if not spills.any():
        return as_row(first), as_row(shift), None
    return as_row(first), as_row(shift), (as_row(np.minimum(first + 1, words - 1)),
                                          as_row((_WORD_BITS - shift) % _WORD_BITS), as_row(spills))


def aura_encode(x: mx.array, *, bits: int, rotation: RandomizedHadamard) -> AuraCodes:
    """Encode every vector along the last axis independently (module docstring: the gain search).

    Computed in float32: `u = sqrt(d) * rotation.forward(x) / ||x||`; for each gain `g` in
    `GAINS`, `idx_g` = nearest centroid of `u / g` in `lloyd_max_codebook(bits)`, i.e.
    `count(thresholds < u / g)` (ties go to the lower cell), every gain's found by one
    binary search over `gain_cells` (`_cells_of`); the vector keeps the `idx_g` with the largest
    `(u . c) |u . c| / ||c||^2`, `c = c[idx_g]` (the largest cos(u, c); the first gain on a
    bitwise tie); `scale = ||x|| / ||c[idx]||`.
    A zero vector gets scale 0 (and decodes to zeros).

    Args:
        x: `[B, H, L, d]` (any leading shape) float16, bfloat16 or float32 array.
        bits: Code width, 1..10.
        rotation: The layer's rotation; `rotation.head_dim == d`.

    Returns:
        `AuraCodes` with packed uint32 `[B, H, L, ceil(d * bits / 32)]` and float16 scales
        `[B, H, L, 1]`.

    Raises:
        ValueError: If `bits` is outside 1..10 or `d` differs from `rotation.head_dim`.

    Source: CACHES.md "AURA encode / decode"; TurboQuant (arXiv 2504.19874) Algorithm 1; the
    gain search as in the module docstring.
    """
    head_dim = x.shape[-1]
    _validate(bits)
    x = x.astype(mx.float32)
    norm = mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))
    inverse_norm = mx.where(norm > 0, math.sqrt(head_dim) / norm, 0.0)
    u = rotation.forward(x) * inverse_norm
    if u.size == 0:  # no vectors (argmax cannot reduce an empty array)
        return AuraCodes(mx.zeros((*x.shape[:-1], packed_words(head_dim, bits)), mx.uint32), norm.astype(SCALE_DTYPE))
    _, centroids_by_cell, index_by_cell = gain_cells(bits)
    gains = len(GAINS)
    flat = u.reshape(-1, head_dim)
    cell = _cells_of(bits, flat)  # [N, d]: one search for every gain at once
    # Every lookup below gathers along axis 1 of a one-row table with all indices in one row: a table
    # broadcast to every vector counts as vectors x cells elements, over 2^31 for 9- and 10-bit codes at
    # 66,000 vectors, where MLX's CUDA backend (0.32.4) returned zero centroids (infinite scales).
    by_gain = mx.broadcast_to(cell.reshape(1, -1, 1), (1, cell.size, gains))
    centroids = mx.take_along_axis(centroids_by_cell[None], by_gain, axis=1).reshape(*u.shape, gains)
    dot = mx.sum(centroids * u[..., None], axis=-2)  # [..., gains] (not a matmul: CUDA's would round to TF32)
    energy = mx.sum(centroids * centroids, axis=-2)
    best = mx.argmax(dot * mx.abs(dot) / energy, axis=-1, keepdims=True)  # [..., 1]
    index = mx.take_along_axis(index_by_cell[None], (cell * gains + best.reshape(-1, 1).astype(mx.uint32)).reshape(1, -1),
                               axis=1)
    scale = norm / mx.sqrt(mx.take_along_axis(energy, best, axis=-1))
    return AuraCodes(pack_bits(index.reshape(u.shape), bits), scale.astype(SCALE_DTYPE))


@functools.lru_cache(maxsize=None)
def _padded_edges(bits: int) -> mx.array:
    """`gain_cells(bits)` edges, float32 `[1, 2**k]`, padded with +inf to a power of two above their count."""
    edges = gain_cells(bits)[0]
    size = 1 << edges.shape[0].bit_length()
    return mx.concatenate([edges, mx.full((size - edges.shape[0],), mx.inf, mx.float32)])[None]


def _cells_of(bits: int, u: mx.array) -> mx.array:
    """uint32 `[N, d]`: how many of the gain cells' edges lie below each element of float32 `u` `[N, d]`.

    A branchless binary search: `log2` steps of one `take_along_axis` probe each, which the CPU
    backend runs 2.5-4x faster than `mx.searchsorted` (equal results: the count of edges < u). The probes
    gather from the one-row table with every index in one row (see `aura_encode`: never a broadcast table).
    """
    edges = _padded_edges(bits)
    cell = mx.zeros((1, u.size), mx.uint32)
    flat = u.reshape(1, -1)
    step = edges.shape[1] // 2
    while step:
        probe = mx.take_along_axis(edges, cell + (step - 1), axis=1)
        cell = cell + step * (probe < flat).astype(mx.uint32)
        step //= 2
    return cell.reshape(u.shape)


@functools.lru_cache(maxsize=None)
def gain_cells(bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """Cells of `u` inside which no gain's code changes, so one search serves all of them
    (the MLX encoder's; the CUDA encoder searches thresholds x gain for each gain,
    `kernels.cuda_kv.search_table`, which gives the same codes).

    The code of `u` under gain `g` changes only where `u / g` crosses a threshold, i.e. at
    `u = t * g`. Those edges, sorted, cut the line into cells; within one the codes of every
    gain are fixed. (Edges are `t * g` in float32, so a coordinate within rounding of one may
    take its neighbour's code, as the rotation's own rounding can.)

    Returns:
        `(edges, centroids, index)`: float32 `[E]` sorted edges; float32 `[E + 1, gains]`
        centroid of each cell under each gain; uint32 `[(E + 1) * gains]` its code index,
        flat as `cell * gains + gain`.
    """
    thresholds = np.array(lloyd_max_thresholds(bits), dtype=np.float32)
    gains = np.array(GAINS, dtype=np.float32)
    edges = np.unique(thresholds[None, :] * gains[:, None])
    inside = np.concatenate([[edges[0] - 1], 0.5 * (edges[:-1] + edges[1:]), [edges[-1] + 1]])  # a point per cell
    index = np.searchsorted(thresholds, inside[:, None] / gains[None, :])  # [E + 1, gains]
    codebook = np.array(lloyd_max_codebook(bits), dtype=np.float32)
    return mx.array(edges), mx.array(codebook[index]), mx.array(index.astype(np.uint32).ravel())


def aura_decode_rotated(codes: AuraCodes, *, bits: int, dtype: mx.Dtype, head_dim: int | None = None) -> mx.array:
    """Reconstruct in the rotated domain: `y_hat = scale * c[idx]`, `||y_hat|| = ||x||`.

    This is what compressed-domain attention uses: `q . x_hat = (Pi q) . y_hat`.

    Args:
        codes: `AuraCodes` from `aura_encode`.
        bits: The width the codes were made with.
        dtype: Output dtype (the product is formed in float32).
        head_dim: `d`; None: every bit of the packed words is a code (`words * 32 / bits`).

    Returns:
        `[B, H, L, d]` array of `dtype`.

    Raises:
        ValueError: If `bits` is outside 1..10 or the packed width does not hold `head_dim` codes.

    Source: CACHES.md "AURA encode / decode".
    """
    _validate(bits)
    if head_dim is not None and packed_words(head_dim, bits) != codes.packed.shape[-1]:
        raise ValueError(f"{codes.packed.shape[-1]} words do not hold {head_dim} codes of {bits} bits")
    centroids = mx.take(aura_codebook(bits), unpack_bits(codes.packed, bits, head_dim))
    return (centroids * codes.scales.astype(mx.float32)).astype(dtype)


def aura_decode(
    codes: AuraCodes, *, bits: int, rotation: RandomizedHadamard, dtype: mx.Dtype
) -> mx.array:
    """Reconstruct `x_hat = rotation.inverse(y_hat)` (computed in float32).

    Args:
        codes: `AuraCodes` from `aura_encode`.
        bits: The width the codes were made with.
        rotation: The rotation they were made with.
        dtype: Output dtype.

    Returns:
        `[B, H, L, d]` array of `dtype`.

    Raises:
        ValueError: As `aura_decode_rotated`, or if `d` differs from `rotation.head_dim`.

    Source: CACHES.md "AURA encode / decode".
    """
    rotated = aura_decode_rotated(codes, bits=bits, dtype=mx.float32, head_dim=rotation.head_dim)
    return rotation.inverse(rotated).astype(dtype)


def aura_bits_per_element(
    key_bits: int, value_bits: int, head_dim: int, scale_bits: int = 16
) -> float:
    """Stored bits per cached element for `aura{K}v{V}`, averaged over K and V.

    Args:
        key_bits: Code width of keys.
        value_bits: Code width of values.
        head_dim: `d`; each vector carries one scale of `scale_bits`.
        scale_bits: Width of the per-vector scale (16: float16).

    Returns:
        `(K + scale_bits/d + V + scale_bits/d) / 2`, e.g. 4.25 for aura4v4 at d=64.

    Source: CACHES.md "Bytes per token".
    """
    overhead = scale_bits / head_dim
    return (key_bits + overhead + value_bits + overhead) / 2


def parse_aura_scheme(name: str) -> tuple[int, int]:
    """Parse `"aura{K}v{V}"` into `(K, V)` code widths.

    Args:
        name: Scheme name such as `"aura5v3"`; K and V must be in 2..10.

    Returns:
        `(key_bits, value_bits)`.

    Raises:
        ValueError: If `name` does not match or a width is outside 2..10.
    """
    match = _SCHEME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        raise ValueError(f"AURA scheme must look like 'aura4v2', got {name!r}")
    key_bits, value_bits = int(match[1]), int(match[2])
    for bits in (key_bits, value_bits):
        if not SCHEME_MIN_BITS <= bits <= MAX_BITS:
            raise ValueError(
                f"AURA scheme widths must be in {SCHEME_MIN_BITS}..{MAX_BITS}, got {name!r}"
            )
    return key_bits, value_bits
