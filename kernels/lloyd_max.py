"""Lloyd-Max scalar quantizer codebooks for the standard normal distribution.

AURA codes every rotated, norm-normalised coordinate with the MSE-optimal scalar
quantizer of N(0, 1). The codebook satisfies Lloyd's two fixed-point conditions:
thresholds are midpoints of adjacent centroids, and each centroid is the conditional
mean of N(0, 1) over its cell. Only the positive half is solved for (the law is
symmetric, so zero is always a threshold).

Plain Lloyd iteration converges linearly with a rate near 1 for many levels (about
1.2e5 iterations and several seconds at 8 bits), so the same fixed point is solved by
Newton's method on the Lloyd map, started from the Panter-Dite point density (the
N(0, 3) quantiles); it reaches a Lloyd step below 1e-12 within 5 steps for 1..10 bits.

Note: Max (1960) prints 0.009497 for the 16-level MSE; the exact value of that
codebook is 0.0095010 (confirmed by independent quadrature in the tests). All other
tabulated centroids and MSEs agree to the printed digits.

Source: CACHES.md "AURA encode / decode"; J. Max, "Quantizing for minimum distortion",
IRE Trans. Inf. Theory 6(1), 1960; TurboQuant (arXiv 2504.19874) section 3.1.
"""

from __future__ import annotations

import functools
import math
from statistics import NormalDist

import numpy as np

MIN_BITS = 1
MAX_BITS = 10

_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TOLERANCE = 1e-12  # max |Lloyd step| at the fixed point
_MAX_NEWTON_STEPS = 50


def _validate_bits(bits: int) -> None:
    if not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"Lloyd-Max bits must be an int in {MIN_BITS}..{MAX_BITS}, got {bits!r}")


def _pdf(t: np.ndarray) -> np.ndarray:
    return _INV_SQRT_2PI * np.exp(-0.5 * t * t)


def _upper_tail(t: np.ndarray) -> np.ndarray:
    """P(Z > t) for Z ~ N(0, 1), via erfc so that tail cells keep full precision."""
    return np.array([0.5 * math.erfc(v / _SQRT2) for v in t])


def _lloyd_map(half: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One Lloyd step on the positive-half centroids.

    Args:
        half: Sorted positive centroids, float64 `[n]`.

    Returns:
        `(new, lower, pdf_edges, mass)`: the conditional means of the cells, float64 `[n]`;
        the lower cell edges `[n]` (0 then midpoints); the N(0, 1) density at the
        `n + 1` cell edges (the last edge is +inf, density 0); the cell probabilities `[n]`.
    """
    lower = np.concatenate([[0.0], 0.5 * (half[:-1] + half[1:])])
    tail = np.append(_upper_tail(lower), 0.0)
    pdf_edges = np.append(_pdf(lower), 0.0)
    mass = tail[:-1] - tail[1:]
    return (pdf_edges[:-1] - pdf_edges[1:]) / mass, lower, pdf_edges, mass


def _lloyd_map_jacobian(half: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The Lloyd map and its (tridiagonal) Jacobian with respect to the centroids.

    A cell mean m = (pdf(a) - pdf(b)) / (P(b) - P(a)) has dm/da = pdf(a)(m - a)/mass and
    dm/db = pdf(b)(b - m)/mass; each interior edge is the midpoint of two centroids. The
    edge at 0 is fixed by symmetry and the edge at +inf has zero density.
    """
    new, lower, pdf_edges, mass = _lloyd_map(half)
    upper = np.append(lower[1:], 0.0)  # last value unused: its density is 0
    d_lower = pdf_edges[:-1] * (new - lower) / mass
    d_lower[0] = 0.0
    d_upper = pdf_edges[1:] * (upper - new) / mass
    n = half.size
    jac = np.diag(0.5 * (d_lower + d_upper))
    jac[np.arange(1, n), np.arange(n - 1)] = 0.5 * d_lower[1:]
    jac[np.arange(n - 1), np.arange(1, n)] = 0.5 * d_upper[:-1]
    return new, jac


def _panter_dite_start(n: int) -> np.ndarray:
    """Positive half of the N(0, 3) quantiles: the high-rate optimal point density."""
    levels = 2 * n
    quantile = NormalDist(0.0, math.sqrt(3.0)).inv_cdf
    return np.array([quantile((k + 0.5) / levels) for k in range(n, levels)])


@functools.lru_cache(maxsize=None)
def _positive_half(bits: int) -> np.ndarray:
    half = _panter_dite_start(2 ** (bits - 1))
    for _ in range(_MAX_NEWTON_STEPS):
        new, jac = _lloyd_map_jacobian(half)
        residual = new - half
        if np.max(np.abs(residual)) < _TOLERANCE:
            half.flags.writeable = False
            return half
        half = half - np.linalg.solve(jac - np.eye(half.size), residual)
    raise RuntimeError(f"Lloyd-Max solve for {bits} bits did not converge")


@functools.lru_cache(maxsize=None)
def lloyd_max_codebook(bits: int) -> np.ndarray:
    """MSE-optimal scalar codebook for N(0, 1).

    Args:
        bits: Code width, 1..10.

    Returns:
        Read-only float64 array `[2**bits]`, sorted ascending and symmetric about 0.
        For 2 bits: `[-1.5104, -0.4528, 0.4528, 1.5104]`.

    Raises:
        ValueError: If `bits` is not an int in 1..10.

    Source: CACHES.md "AURA encode / decode"; Max (1960).
    """
    _validate_bits(bits)
    half = _positive_half(bits)
    codebook = np.concatenate([-half[::-1], half])
    codebook.flags.writeable = False
    return codebook


@functools.lru_cache(maxsize=None)
def lloyd_max_thresholds(bits: int) -> np.ndarray:
    """Decision thresholds of `lloyd_max_codebook(bits)`: midpoints of adjacent centroids.

    A value `u` codes to index `count(thresholds < u)`, i.e. ties go to the lower cell.

    Args:
        bits: Code width, 1..10.

    Returns:
        Read-only float64 array `[2**bits - 1]`, sorted ascending.

    Raises:
        ValueError: If `bits` is not an int in 1..10.
    """
    codebook = lloyd_max_codebook(bits)
    thresholds = 0.5 * (codebook[:-1] + codebook[1:])
    thresholds.flags.writeable = False
    return thresholds


@functools.lru_cache(maxsize=None)
def lloyd_max_mse(bits: int) -> float:
    """Expected squared error per coordinate of the codebook on N(0, 1).

    At the Lloyd fixed point E[(Z - Q(Z))^2] = E[Z^2] - E[Q(Z)^2] = 1 - sum_i p_i c_i^2.

    Args:
        bits: Code width, 1..10.

    Returns:
        The distortion (unit variance input), e.g. 0.1175 at 2 bits.

    Raises:
        ValueError: If `bits` is not an int in 1..10.
    """
    _validate_bits(bits)
    half = _positive_half(bits)
    _, _, _, mass = _lloyd_map(half)
    return float(1.0 - 2.0 * np.sum(mass * half * half))
