"""Seeded randomized Hadamard rotation of head vectors.

The rotation is `Pi = H D / sqrt(d)` with `D = diag(signs)` a random +-1 diagonal and `H`
the Sylvester Walsh-Hadamard matrix (entries +-1, `H H^T = d I`), so `Pi` is orthogonal:
`y = H (signs * x) / sqrt(d)` and `x = signs * (H y) / sqrt(d)`. After it, every coordinate
of a fixed vector is a near-Gaussian mix of all input coordinates, which spreads outlier
channels before scalar quantization.

The signs are drawn with NumPy's PCG64 generator (`np.random.default_rng(seed)`), whose
stream is stable across processes, platforms and NumPy versions, and independent of MLX.
They are part of the stored cache format: changing the recipe invalidates stored codes.

Source: CACHES.md "AURA encode / decode"; QuaRot (arXiv 2404.00456); TurboQuant
(arXiv 2504.19874) section 3.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np


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
        head_dim: Length `d` of the rotated axis; a power of two, at most 8192.
        seed: Non-negative integer seed of the sign vector (one per layer and per K/V).

    Raises:
        ValueError: If `head_dim` is not a power of two in 1..8192 or `seed` is negative
            or not an int.

    Attributes:
        head_dim: `d`.
        seed: The seed the signs were drawn from.
        signs: float32 `mx.array` `[d]` of +-1.

    Source: CACHES.md "AURA encode / decode".
    """

    _MAX_DIM = 8192  # mx.hadamard_transform's float32 limit for power-of-two sizes

    def __init__(self, head_dim: int, seed: int) -> None:
        if not isinstance(head_dim, int) or head_dim < 1 or head_dim & (head_dim - 1):
            raise ValueError(f"head_dim must be a power of two, got {head_dim!r}")
        if head_dim > self._MAX_DIM:
            raise ValueError(f"head_dim must be at most {self._MAX_DIM}, got {head_dim}")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.head_dim = head_dim
        self.seed = seed
        self.signs = mx.array(hadamard_signs(head_dim, seed), dtype=mx.float32)
        self._scale = 1.0 / math.sqrt(head_dim)

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
        return self._transform(self.signs.astype(x.dtype) * x)

    def inverse(self, y: mx.array) -> mx.array:
        """Undo `forward`: `signs * (H y) / sqrt(d)` (`H` is symmetric).

        Args:
            y: `[..., d]` floating array in the rotated domain.

        Returns:
            `[..., d]` array of `y`'s dtype.

        Raises:
            ValueError: If the last axis is not `head_dim`.
        """
        self._check(y)
        return self.signs.astype(y.dtype) * self._transform(y)
