"""The fused residual add + RMSNorm equals its float64 definition and MLX's own norm (the CUDA kernel where
it runs, on the H200; the MLX-ops fallback on a CPU-only machine)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels.fused_norm import add_rms_norm


@pytest.mark.parametrize("dtype, tol", [(mx.float32, 1e-5), (mx.float16, 4e-3), (mx.bfloat16, 2e-2)])
@pytest.mark.parametrize("batch, hidden", [(1, 96), (1, 576), (2, 1000), (3, 2048), (5, 4096), (2, 16384)])
def test_add_rms_norm_matches_float64(dtype, tol, batch, hidden):
    rng = np.random.default_rng(hidden + batch)
    x, r = (mx.array(rng.standard_normal((batch, hidden)) * 3, dtype) for _ in range(2))
    w = mx.array(rng.standard_normal(hidden), dtype)
    h, y = add_rms_norm(x, r, w, 1e-5)
    want_h = np.array((x.astype(mx.float32) + r.astype(mx.float32)).astype(dtype).astype(mx.float32), np.float64)
    want_y = want_h / np.sqrt((want_h**2).mean(-1, keepdims=True) + 1e-5) * np.array(w.astype(mx.float32), np.float64)
    assert h.dtype == y.dtype == dtype and h.shape == y.shape == (batch, hidden)
    np.testing.assert_array_equal(np.array(h.astype(mx.float32)), want_h)  # the sum rounds as MLX's add
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), want_y, rtol=tol, atol=tol)
    ulp = {mx.float32: 2.0**-23, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}[dtype]  # MLX's own norm, within 2 ulp
    mlx = np.array(mx.fast.rms_norm(x + r, w, 1e-5).astype(mx.float32))
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), mlx, rtol=2 * ulp, atol=2 * ulp)


def test_add_rms_norm_rejects_mismatched_shapes_and_dtypes():
    with pytest.raises(ValueError, match=r"\[B, H\]"):
        add_rms_norm(mx.zeros((2, 8)), mx.zeros((2, 4)), mx.zeros(8), 1e-5)
    with pytest.raises(ValueError, match="one dtype"):
        add_rms_norm(mx.zeros((2, 8), mx.bfloat16), mx.zeros((2, 8), mx.bfloat16), mx.zeros(8), 1e-5)
