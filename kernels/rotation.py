"""Seeded randomized Hadamard rotation of head vectors.

The rotation is `Pi = H D / sqrt(d)` with `D = diag(signs)` a random +-1 diagonal and `H`
a Hadamard matrix (entries +-1, `H H^T = d I`), so `Pi` is orthogonal:
`y = H (signs * x) / sqrt(d)` and `x = signs * (H^T y) / sqrt(d)`. After it, every coordinate
of a fixed vector is a near-Gaussian mix of all input coordinates, which spreads outlier
channels before scalar quantization.

`H` is Sylvester's for a power-of-two `d` (applied by `mx.hadamard_transform`, O(d log d)),
and `H_m (x) H_{2^k}` for `d = m * 2^k` with `m` in 12, 20, 28 (head_dim 80, 96, 112, 160,
192, ...), the `H_m` built by Paley's constructions and the product applied as one dense
`[d, d]` matmul. Measured at equal bytes on the default model's real K/V
(`ops/aura_rotation_choice.py`, `ops/results/aura_rotation_choice.json`), a rotation padded to
the next power of two is 2.7-40x worse in attention KL (its codes spend bits on the padding),
and a block-diagonal Sylvester rotation (80 = 64 + 16) is 4-9% worse at d = 80 and within
+-5% at d = 96 and 192 (values: 1-8% worse); the full Hadamard rotation is kept.

The signs are drawn with NumPy's PCG64 generator (`np.random.default_rng(seed)`), whose
stream is stable across processes, platforms and NumPy versions, and independent of MLX.
They are part of the stored cache format: changing the recipe invalidates stored codes.

Source: CACHES.md "AURA encode / decode"; QuaRot (arXiv 2404.00456); TurboQuant
(arXiv 2504.19874) section 3; R. E. A. C. Paley, "On orthogonal matrices" (J. Math. Phys. 12,
1933) for `H_12` (Paley I, q = 11), `H_20` (Paley I, q = 19) and `H_28` (Paley II, q = 13).
"""

from __future__ import annotations

import math

import functools

import mlx.core as mx
import numpy as np

_MAX_POW2_DIM = 8192  # mx.hadamard_transform's float32 limit for power-of-two sizes
_MAX_MATRIX_DIM = 1024  # a dense rotation matrix above this would cost more than it is worth
_PALEY = {12: ("I", 11), 20: ("I", 19), 28: ("II", 13)}  # m -> (construction, q)


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def supports_head_dim(head_dim: int) -> bool:
    """Whether a Hadamard rotation of `head_dim` exists here: `m * 2^k`, m in 1, 12, 20, 28."""
    if not isinstance(head_dim, int) or head_dim < 1:
        return False
    if is_power_of_two(head_dim):
        return head_dim <= _MAX_POW2_DIM
    return head_dim <= _MAX_MATRIX_DIM and any(head_dim % m == 0 and is_power_of_two(head_dim // m) for m in _PALEY)


def _jacobsthal(q: int) -> np.ndarray:
    """`Q[i, j] = chi(j - i)`, chi the quadratic character mod the prime q (chi(0) = 0)."""
    chi = -np.ones(q)
    chi[0] = 0
    chi[[i * i % q for i in range(1, q)]] = 1
    index = np.arange(q)
    return chi[(index[None, :] - index[:, None]) % q]


def paley_hadamard(m: int) -> np.ndarray:
    """Hadamard matrix `[m, m]` of +-1 for m in 12, 20, 28 (Paley I for q = 11, 19; II for q = 13)."""
    kind, q = _PALEY[m]
    core = np.zeros((q + 1, q + 1))
    core[0, 1:] = 1
    core[1:, 0] = -1 if kind == "I" else 1
    core[1:, 1:] = _jacobsthal(q)
    if kind == "I":  # core is a skew conference matrix: H = I + C
        return np.eye(q + 1) + core
    return np.kron(core, [[1, 1], [1, -1]]) + np.kron(np.eye(q + 1), [[1, -1], [-1, -1]])


def hadamard_matrix(head_dim: int) -> np.ndarray:
    """The unnormalised Hadamard matrix `[d, d]` of +-1 the rotation uses (float64).

    Raises:
        ValueError: `head_dim` is not supported (`supports_head_dim`).
    """
    if not supports_head_dim(head_dim):
        raise ValueError(f"no Hadamard rotation of size {head_dim}: AURA needs head_dim = m * 2^k with m in "
                         f"1, 12, 20, 28 (64, 80, 96, 112, 128, 160, 192, 256, ...)")
    core, power = np.ones((1, 1)), head_dim
    for m in _PALEY:
        if not is_power_of_two(head_dim) and head_dim % m == 0 and is_power_of_two(head_dim // m):
            core, power = paley_hadamard(m), head_dim // m
    sylvester = np.ones((1, 1))
    while sylvester.shape[0] < power:
        sylvester = np.block([[sylvester, sylvester], [sylvester, -sylvester]])
    return np.kron(core, sylvester)


def hadamard_signs(head_dim: int, seed: int) -> np.ndarray:
    """The +-1 diagonal of the rotation.

    Recipe (part of the format): `1 - 2 * np.random.default_rng(seed).integers(0, 2, head_dim)`.

    Args:
        head_dim: Vector length `d`.
        seed: Non-negative integer seed.

    Returns:
        float64 array `[head_dim]` of +-1.
    """
    bits = np.random.default_rng(seed).integers(0, 2, size=head_dim)
    return (1 - 2 * bits).astype(np.float64)


class RandomizedHadamard:
    """Orthogonal rotation `y = H (signs * x) / sqrt(d)` over the last axis.

    Args:
        head_dim: Length `d` of the rotated axis: a power of two up to 8192, or `m * 2^k` with
            m in 12, 20, 28 up to 1024 (`supports_head_dim`).
        seed: Non-negative integer seed of the sign vector (one per layer and per K/V).

    Raises:
        ValueError: If `head_dim` is not supported or `seed` is negative or not an int.

    Attributes:
        head_dim: `d`.
        seed: The seed the signs were drawn from.
        signs: float32 `mx.array` `[d]` of +-1.

    Source: CACHES.md "AURA encode / decode".
    """

    def __init__(self, head_dim: int, seed: int) -> None:
        if not supports_head_dim(head_dim):
            raise ValueError(f"head_dim must be a power of two up to {_MAX_POW2_DIM} or m * 2^k (m in 12, 20, 28) "
                             f"up to {_MAX_MATRIX_DIM}, got {head_dim!r}")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.head_dim = head_dim
        self.seed = seed
        self.signs = mx.array(hadamard_signs(head_dim, seed), dtype=mx.float32)
        self._scale = 1.0 / math.sqrt(head_dim)
        # Non-power-of-two sizes: Pi^T as one dense matrix (forward is x @ Pi^T, inverse y @ Pi).
        self._matrix = None if is_power_of_two(head_dim) else _dense_rotation(head_dim, seed)

    def __repr__(self) -> str:
        return f"RandomizedHadamard(head_dim={self.head_dim}, seed={self.seed})"

    def _check(self, x: mx.array) -> None:
        if x.ndim == 0 or x.shape[-1] != self.head_dim:
            raise ValueError(f"last axis must be {self.head_dim}, got shape {tuple(x.shape)}")

    def _transform(self, x: mx.array) -> mx.array:
        # mx.hadamard_transform rejects empty arrays; a cache may pass zero tokens.
        if x.size == 0:
            return x
        return mx.hadamard_transform(x, scale=self._scale)

    def forward(self, x: mx.array) -> mx.array:
        """Rotate: `H (signs * x) / sqrt(d)`.

        Args:
            x: `[..., d]` floating array (any float dtype).

        Returns:
            `[..., d]` array of `x`'s dtype, same norm as `x` along the last axis.

        Raises:
            ValueError: If the last axis is not `head_dim`.
        """
        self._check(x)
        if self._matrix is not None:
            return x if x.size == 0 else x @ self._matrix.astype(x.dtype)
        return self._transform(self.signs.astype(x.dtype) * x)

    def inverse(self, y: mx.array) -> mx.array:
        """Undo `forward`: `signs * (H^T y) / sqrt(d)` (Sylvester's `H` is symmetric).

        Args:
            y: `[..., d]` floating array in the rotated domain.

        Returns:
            `[..., d]` array of `y`'s dtype.

        Raises:
            ValueError: If the last axis is not `head_dim`.
        """
        self._check(y)
        if self._matrix is not None:
            return y if y.size == 0 else y @ self._matrix.T.astype(y.dtype)
        return self.signs.astype(y.dtype) * self._transform(y)


@functools.lru_cache(maxsize=None)
def _dense_rotation(head_dim: int, seed: int) -> mx.array:
    """`Pi^T = (H diag(signs) / sqrt(d))^T` as float32 `[d, d]` (rounded once from float64)."""
    matrix = hadamard_matrix(head_dim) * hadamard_signs(head_dim, seed)[None, :] / math.sqrt(head_dim)
    return mx.array(matrix.T.astype(np.float32))
