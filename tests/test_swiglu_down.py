"""SwiGLU then the down projection of one row: its MLX-ops form equals the float64 definition on every backend;
its kernel equals the float64 definition and MLX's unfused ops on the H200."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu

from kernels import cuda_kv
from kernels.swiglu_down import MAX_K, serves, swiglu_down, takes

ON_CUDA = cuda_kv.is_available()


def _f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), np.float64)


def _inputs(dtype, rows: int, k: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    h = mx.array(rng.standard_normal((rows, 2 * k)), dtype)
    w = mx.array(rng.standard_normal((n, k)) / np.sqrt(k), dtype)
    return h, w


def _swiglu64(h: np.ndarray, k: int) -> np.ndarray:
    gate, up = h[:, :k], h[:, k:]
    return gate / (1.0 + np.exp(-gate)) * up


@pytest.mark.parametrize("rows", [1, 3])
def test_mlx_ops_form_matches_float64(rows):
    k, n = 96, 40  # not a kernel shape: MLX ops on every backend
    h, w = _inputs(mx.float32, rows, k, n, seed=rows)
    got = swiglu_down(h, w)
    assert got.shape == (rows, n) and got.dtype == mx.float32
    np.testing.assert_allclose(_f64(got), _swiglu64(_f64(h), k) @ _f64(w).T, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend; run on the H200")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("k, n", [(256, 1), (256, 13), (2048, 3000), (6144, 2048), (8192, 2048)])
def test_kernel_matches_float64_and_unfused_mlx(dtype, k, n):
    eps = mx.finfo(dtype).eps  # one ulp at 1.0
    h, w = _inputs(dtype, 1, k, n, seed=k + n)
    assert serves(h, w)
    got = swiglu_down(h, w)
    assert got.shape == (1, n) and got.dtype == dtype
    a, wf = _swiglu64(_f64(h), k), _f64(w)
    want = a @ wf.T
    # SwiGLU in the dtype (three roundings an element: within 2 ulp of a), float32 sums of K terms, rounded once
    scale = np.abs(a) @ np.abs(wf).T
    bound = 2 * eps * scale + k * 2.0**-22 * scale + 0.5 * eps * np.abs(want) + 1e-30
    np.testing.assert_array_less(np.abs(_f64(got) - want), bound * 1.01)
    mlx = _f64(swiglu(h[:, :k], h[:, k:]) @ w.T)  # MLX's kernels and cuBLAS's order: within an ulp or two
    np.testing.assert_allclose(_f64(got), mlx, rtol=2 * eps, atol=2 * eps * np.abs(mlx).max())


def test_serves_one_half_precision_row_in_whole_256_steps_on_cuda_only():
    w = mx.zeros((48, 512), mx.bfloat16)
    assert takes(w) == serves(mx.zeros((1, 1024), mx.bfloat16), w) == ON_CUDA
    assert not takes(mx.zeros((8, MAX_K + 256), mx.bfloat16)) and not takes(mx.zeros((8, 384), mx.bfloat16))
    assert not takes(mx.zeros((8, 512), mx.float32))
    for h in [mx.zeros((2, 1024), mx.bfloat16), mx.zeros((1, 1024), mx.float16), mx.zeros((1, 512), mx.bfloat16)]:
        assert not serves(h, w)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="swiglu_down takes"):
        swiglu_down(mx.zeros((1, 64)), mx.zeros((8, 64)))
    with pytest.raises(ValueError, match="swiglu_down takes"):
        swiglu_down(mx.zeros((128,)), mx.zeros((8, 64)))
