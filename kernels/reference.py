"""Slow float64 NumPy references for the KV-cache kernels. Used only by tests.

Everything here is written independently of the MLX kernels: bits are packed by explicit
bit expansion, the Hadamard matrix is built by the Sylvester recursion, nearest centroids
are found by argmin over distances, and Lloyd-Max distortion is integrated by
Gauss-Legendre quadrature.

Source: CACHES.md "AURA encode / decode"; TurboQuant (arXiv 2504.19874); MLX `mx.quantize`.
"""

from __future__ import annotations

import math

import numpy as np


def pack_bits_ref(values: np.ndarray, bits: int) -> np.ndarray:
    """Little-endian bit-stream packing of `[..., n]` values into uint32 `[..., n*bits/32]`."""
    stream = (values[..., None].astype(np.uint64) >> np.arange(bits, dtype=np.uint64)) & 1
    stream = stream.reshape(*values.shape[:-1], -1, 32)
    return (stream << np.arange(32, dtype=np.uint64)).sum(axis=-1).astype(np.uint32)


def unpack_bits_ref(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of `pack_bits_ref`: uint32 `[..., words]` to int64 `[..., words*32/bits]`."""
    stream = (packed[..., None].astype(np.int64) >> np.arange(32)) & 1
    stream = stream.reshape(*packed.shape[:-1], -1, bits)
    return (stream << np.arange(bits)).sum(axis=-1)


def affine_dequantize_ref(
    packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int
) -> np.ndarray:
    """`scale * q + bias` per group, float64 `[..., d]`, from MLX's affine layout."""
    q = unpack_bits_ref(packed, bits).astype(np.float64)
    q = q.reshape(*q.shape[:-1], -1, group_size)
    out = q * scales[..., None].astype(np.float64) + biases[..., None].astype(np.float64)
    return out.reshape(*out.shape[:-2], -1)


def affine_round_trip_ref(x: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    """Exact min/max affine round trip in float64: step `(max - min) / (2**bits - 1)`."""
    groups = x.astype(np.float64).reshape(*x.shape[:-1], -1, group_size)
    low = groups.min(axis=-1, keepdims=True)
    step = (groups.max(axis=-1, keepdims=True) - low) / (2**bits - 1)
    safe = np.where(step > 0, step, 1.0)
    out = np.round((groups - low) / safe) * step + low
    return out.reshape(x.shape)


def sylvester_hadamard(d: int) -> np.ndarray:
    """Unnormalised Sylvester Hadamard matrix `[d, d]` of +-1 (`d` a power of two)."""
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


def rotation_matrix_ref(signs: np.ndarray) -> np.ndarray:
    """`Pi = H diag(signs) / sqrt(d)`, float64 `[d, d]`; rows act on column vectors."""
    d = signs.size
    return sylvester_hadamard(d) * signs[None, :] / math.sqrt(d)


def lloyd_max_mse_quadrature(codebook: np.ndarray) -> float:
    """E[(Z - Q(Z))^2] for Z ~ N(0, 1) by Gauss-Legendre quadrature over each cell."""
    nodes, weights = np.polynomial.legendre.leggauss(40)
    edges = np.concatenate([[-14.0], 0.5 * (codebook[:-1] + codebook[1:]), [14.0]])
    total = 0.0
    for centroid, low, high in zip(codebook, edges[:-1], edges[1:]):
        pieces = np.linspace(low, high, 65)
        for a, b in zip(pieces[:-1], pieces[1:]):
            z = 0.5 * (b - a) * nodes + 0.5 * (b + a)
            density = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
            total += 0.5 * (b - a) * np.sum(weights * density * (z - centroid) ** 2)
    return float(total)


def aura_encode_ref(
    x: np.ndarray, signs: np.ndarray, codebook: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """AURA encode of `[..., d]` vectors in float64.

    Returns:
        `(index, scale, u)`: int64 `[..., d]` nearest-centroid indices, float64 `[..., 1]`
        norm-corrected scales `||x|| / ||c[index]||`, and the normalised rotated
        coordinates `u = sqrt(d) * Pi x / ||x||` (for tie diagnostics).
    """
    x = x.astype(np.float64)
    d = x.shape[-1]
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    u = math.sqrt(d) * (x @ rotation_matrix_ref(signs).T) / norm
    index = np.argmin(np.abs(u[..., None] - codebook), axis=-1)
    scale = norm / np.linalg.norm(codebook[index], axis=-1, keepdims=True)
    return index, scale, u


def aura_decode_ref(
    index: np.ndarray, scale: np.ndarray, signs: np.ndarray, codebook: np.ndarray
) -> np.ndarray:
    """AURA decode in float64: `Pi^T (scale * c[index])`, `[..., d]`."""
    return (scale * codebook[index]) @ rotation_matrix_ref(signs)


def lloyd_step_ref(codebook: np.ndarray) -> np.ndarray:
    """One Lloyd step on a full, sorted N(0, 1) codebook: conditional means of the cells.

    Cells are bounded by midpoints; probabilities use erfc on the side away from 0 so tail
    cells keep full relative precision.
    """
    edges = np.concatenate([[-np.inf], 0.5 * (codebook[:-1] + codebook[1:]), [np.inf]])
    means = []
    for a, b in zip(edges[:-1], edges[1:]):
        if a >= 0:
            mass = 0.5 * (math.erfc(a / math.sqrt(2)) - math.erfc(b / math.sqrt(2)))
        elif b <= 0:
            mass = 0.5 * (math.erfc(-b / math.sqrt(2)) - math.erfc(-a / math.sqrt(2)))
        else:
            mass = 0.5 * (math.erf(b / math.sqrt(2)) - math.erf(a / math.sqrt(2)))
        density = [math.exp(-0.5 * t * t) / math.sqrt(2 * math.pi) for t in (a, b)]
        means.append((density[0] - density[1]) / mass)
    return np.array(means)
