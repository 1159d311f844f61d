"""SwiGLU of the fused gate/up output equals its float64 definition and mlx-lm's `swiglu` (the CUDA kernel
where it runs, on the H200; the MLX-ops fallback on a CPU-only machine)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu

from kernels.swiglu import swiglu_halves


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("batch, width", [(1, 96), (1, 8192), (3, 1000), (64, 2816)])
def test_swiglu_halves_matches_float64_and_mlx_lm(dtype, batch, width):
    eps = mx.finfo(dtype).eps  # one ulp at 1.0
    rng = np.random.default_rng(width + batch)
    h = mx.array(rng.standard_normal((batch, 2 * width)) * 4, dtype)
    got = swiglu_halves(h)
    assert got.shape == (batch, width) and got.dtype == dtype
    x = np.array(h.astype(mx.float32), np.float64)
    gate, up = x[:, :width], x[:, width:]
    want = gate / (1 + np.exp(-gate)) * up
    # the sigmoid's steps, the SiLU and the product each round to the dtype: within 3 ulp of the largest magnitude
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.array(got.astype(mx.float32)) / scale, want / scale, rtol=0, atol=3 * eps)
    mlx = np.array(swiglu(h[:, :width], h[:, width:]).astype(mx.float32))
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), mlx, rtol=2 * eps, atol=2 * eps * scale)


def test_swiglu_halves_rejects_odd_widths_and_other_ranks():
    for bad in (mx.zeros((2, 7)), mx.zeros((2, 1, 8))):
        with pytest.raises(ValueError, match=r"\[B, 2 \* I\]"):
            swiglu_halves(bad)
