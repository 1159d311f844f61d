"""exp for the CPU's softmax: range reduction plus a polynomial, in elementwise MLX ops.

MLX's CPU backend evaluates `mx.exp` one element at a time (`simd::exp<float, 1>`): ~15 ns an
element on a 2-core machine, 0.47 ms of a 4096-token affine4 decode chunk's 2.3 (the default
model's layer, 9 query heads) and a third of a raw one. Written as multiplies, adds, a cast and an
exponent built in the float's bits, the same function compiles (`mx.compile`, as the decode step
is) into one fused loop of ~3 ns an element.

Source: Cody & Waite range reduction (Cody & Waite, "Software Manual for the Elementary Functions",
1980, ch. 6): e^x = 2^n * 2^f with x * log2(e) = n + f, n its integer part (toward zero: a cast,
which fuses where `mx.floor` would not), f in (-1, 0]; 2^f by a degree-6 polynomial fitted to it in
relative error on (-1, 0] (2.2e-9 before float32 rounding).
"""

from __future__ import annotations

import mlx.core as mx

_LOG2E = 1.4426950408889634
# 2^f ~ sum_i C[i] f^i on (-1, 0]: least squares in relative error at 4000 Chebyshev nodes, C[0] = 1.
_C = (1.0, 0.6931470589634013, 0.24022430554914775, 0.05549050595864398, 0.009578721066611496,
      0.001274359288687443, 0.00010889857807438772)
POLY_MIN_ELEMENTS = 4096  # softmax_exp: below this, mx.exp (see there)
_MIN_EXPONENT = -127.0  # 2^-127 is built as the float with all exponent bits clear: +0.0


def exp_nonpositive(x: mx.array) -> mx.array:
    """e^x of float32 x <= 0 (softmax's `scores - max`), -inf giving exactly 0.

    Args:
        x (mx.array): float32, any shape; every element <= 0 or -inf (NaN stays NaN).

    Returns:
        mx.array: float32, x's shape: e^x within (4 + 1.5 |x|) * 2^-24 relative (x * log2(e) is
        rounded to float32 first; `mx.exp` measures the same: 1.2e-7 on [-1, 0], 3.7e-6 at -80),
        0 where e^x < 2^-126 (below float32's normal range; softmax weights there are negligible
        against the max's 1).
    """
    t = mx.maximum(x * _LOG2E, _MIN_EXPONENT)
    n = t.astype(mx.int32)  # toward zero: t <= 0 gives f in (-1, 0]
    f = t - n.astype(mx.float32)
    p = _C[-1]
    for c in reversed(_C[:-1]):
        p = p * f + c
    scale = mx.view((n + 127) << 23, mx.float32)  # 2^n (biased exponent n + 127)
    return p * scale


def softmax_exp(x: mx.array) -> mx.array:
    """e^x of softmax's x <= 0: `exp_nonpositive` on the CPU from `POLY_MIN_ELEMENTS` elements, else `mx.exp`.

    Below that size, outside `mx.compile` (the single-sequence `generate` path), the polynomial's ~20
    separate ops cost more than they save: 9 x 50 elements 154 against 103 us, even at 9 x 500, ahead
    from 9 x 1000 (208 against 244); compiled it is never slower (82 against 91 at 9 x 50). Off the CPU
    `mx.exp` is the backend's own.
    """
    if mx.default_device() == mx.cpu and x.size >= POLY_MIN_ELEMENTS:
        return exp_nonpositive(x)
    return mx.exp(x)
