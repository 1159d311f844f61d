"""Slow float64 NumPy references for the KV-cache kernels. Used only by tests.

Everything here is written independently of the MLX kernels: bits are packed by explicit
bit expansion, Hadamard matrices are built by the Sylvester recursion and, for orders
m * 2^k (m = 12, 20, 28), by Paley's constructions written out entry by entry (Euler's
criterion for the quadratic character), nearest centroids are found by argmin over
distances, and Lloyd-Max distortion is integrated by Gauss-Legendre quadrature.

Source: CACHES.md "AURA encode / decode"; TurboQuant (arXiv 2504.19874); MLX `mx.quantize`.
"""

from __future__ import annotations

import math

import numpy as np


def pack_bits_ref(values: np.ndarray, bits: int) -> np.ndarray:
    """Little-endian bit-stream packing of `[..., n]` values into uint32 `[..., ceil(n*bits/32)]` (zero-padded)."""
    stream = (values[..., None].astype(np.uint64) >> np.arange(bits, dtype=np.uint64)) & 1
    stream = stream.reshape(*values.shape[:-1], -1)
    stream = np.concatenate([stream, np.zeros((*stream.shape[:-1], -stream.shape[-1] % 32), np.uint64)], axis=-1)
    stream = stream.reshape(*values.shape[:-1], -1, 32)
    return (stream << np.arange(32, dtype=np.uint64)).sum(axis=-1).astype(np.uint32)


def unpack_bits_ref(packed: np.ndarray, bits: int, count: int | None = None) -> np.ndarray:
    """Inverse of `pack_bits_ref`: uint32 `[..., words]` to int64 `[..., count]` (default `words*32//bits`)."""
    count = packed.shape[-1] * 32 // bits if count is None else count
    stream = (packed[..., None].astype(np.int64) >> np.arange(32)) & 1
    stream = stream.reshape(*packed.shape[:-1], -1)[..., : count * bits]
    stream = stream.reshape(*packed.shape[:-1], count, bits)
    return (stream << np.arange(bits)).sum(axis=-1)


def affine_dequantize_ref(
    packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int,
    head_dim: int | None = None,
) -> np.ndarray:
    """`scale * q + bias` per group, float64 `[..., d]`, from MLX's affine layout.

    Element i belongs to group `i // group_size`; with `head_dim` not a multiple of
    `group_size` the last group is a shorter tail.
    """
    head_dim = scales.shape[-1] * group_size if head_dim is None else head_dim
    q = unpack_bits_ref(packed, bits, head_dim).astype(np.float64)
    group = np.arange(head_dim) // group_size
    return q * scales[..., group].astype(np.float64) + biases[..., group].astype(np.float64)


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


def paley_hadamard_ref(m: int) -> np.ndarray:
    """Hadamard matrix of order 12 or 20 (Paley I, q = m - 1) or 28 (Paley II, q = 13), entry by entry."""
    q = {12: 11, 20: 19, 28: 13}[m]

    def chi(a: int) -> int:  # Euler's criterion: a^((q-1)/2) mod q
        a %= q
        return 0 if a == 0 else (1 if pow(a, (q - 1) // 2, q) == 1 else -1)

    n = q + 1
    core = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            if i == 0 and j > 0:
                core[i, j] = 1
            elif j == 0 and i > 0:
                core[i, j] = -1 if q % 4 == 3 else 1
            elif i > 0 and j > 0:
                core[i, j] = chi(j - i)
    if q % 4 == 3:
        return core + np.eye(n)
    out = np.zeros((2 * n, 2 * n))
    for i in range(n):
        for j in range(n):
            block = [[1, -1], [-1, -1]] if i == j else ([[1, 1], [1, -1]] if core[i, j] > 0 else [[-1, -1], [-1, 1]])
            out[2 * i : 2 * i + 2, 2 * j : 2 * j + 2] = block
    return out


def hadamard_ref(d: int) -> np.ndarray:
    """Unnormalised Hadamard matrix of order d: Sylvester's, or `H_m (x) H_{2^k}` for d = m * 2^k."""
    if d & (d - 1) == 0:
        return sylvester_hadamard(d)
    m = next(m for m in (12, 20, 28) if d % m == 0 and (d // m) & (d // m - 1) == 0)
    return np.kron(paley_hadamard_ref(m), sylvester_hadamard(d // m))


def rotation_matrix_ref(signs: np.ndarray) -> np.ndarray:
    """`Pi = H diag(signs) / sqrt(d)`, float64 `[d, d]`; rows act on column vectors."""
    d = signs.size
    return hadamard_ref(d) * signs[None, :] / math.sqrt(d)


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
    x: np.ndarray, signs: np.ndarray, codebook: np.ndarray, gains: tuple[float, ...] = (1.0,)
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """AURA encode of `[..., d]` vectors in float64; `gains=kernels.aura.GAINS`: its gain search.

    For each gain `g` (in order), the nearest centroids of `u / g` (argmin over the codebook);
    a vector keeps the first gain with the largest `cos(u, c[index])`. The default `(1.0,)`:
    plain nearest-centroid coding.

    Returns:
        `(index, scale, u)`: int64 `[..., d]` nearest-centroid indices, float64 `[..., 1]`
        norm-corrected scales `||x|| / ||c[index]||`, and the coded coordinates `u / g` of
        the kept gain, `u = sqrt(d) * Pi x / ||x||` (for tie diagnostics).
    """
    x = x.astype(np.float64)
    d = x.shape[-1]
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    u = math.sqrt(d) * (x @ rotation_matrix_ref(signs).T) / norm
    best_cos = np.full(u.shape[:-1], -np.inf)
    index, coded = np.zeros(u.shape, dtype=np.int64), np.zeros_like(u)
    for gain in gains:
        scaled = u / gain
        candidate = np.argmin(np.abs(scaled[..., None] - codebook), axis=-1)
        c = codebook[candidate]
        cos = np.sum(c * u, axis=-1) / np.linalg.norm(c, axis=-1) / np.linalg.norm(u, axis=-1)
        better = cos > best_cos
        best_cos = np.where(better, cos, best_cos)
        index = np.where(better[..., None], candidate, index)
        coded = np.where(better[..., None], scaled, coded)
    scale = norm / np.linalg.norm(codebook[index], axis=-1, keepdims=True)
    return index, scale, coded


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
