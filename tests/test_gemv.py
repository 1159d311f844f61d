"""One row's projection with a norm or SwiGLU before it and a residual add after: its MLX-ops form equals the
float64 definition on every backend; its kernel equals the float64 definition and MLX's unfused ops on the H200."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu

from kernels import cuda_kv
from kernels.gemv import MAX_K, gemv, serves, takes

ON_CUDA = cuda_kv.is_available()
EPS = 1e-5


def _f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), np.float64)


def _inputs(dtype, k: int, n: int, stage: str, seed: int):
    rng = np.random.default_rng(seed)
    width = 2 * k if stage == "swiglu" else k
    x = mx.array(rng.standard_normal((1, width)) * (3.0 if stage == "norm" else 1.0), dtype)  # the norm rescales
    w = mx.array(rng.standard_normal((n, k)) / np.sqrt(k), dtype)
    nw = mx.array(1.0 + 0.1 * rng.standard_normal(k), dtype)
    res = mx.array(rng.standard_normal((1, n)), dtype)
    return x, w, nw, res


def _staged(stage: str, x: np.ndarray, nw: np.ndarray, k: int) -> np.ndarray:
    """The projection's input in float64, unrounded."""
    if stage == "norm":
        return x / np.sqrt(np.mean(x**2) + EPS) * nw
    if stage == "swiglu":
        gate, up = x[:, :k], x[:, k:]
        return gate / (1.0 + np.exp(-gate)) * up
    return x


def _call(stage: str, x, w, nw, res):
    return gemv(x, w, norm=(nw, EPS) if stage == "norm" else None, swiglu=stage == "swiglu", residual=res)


@pytest.mark.parametrize("stage", ["copy", "norm", "swiglu"])
@pytest.mark.parametrize("residual", [False, True])
def test_mlx_ops_form_matches_float64(stage, residual):
    k, n = 96, 40  # not a kernel shape: MLX ops on every backend
    x, w, nw, res = _inputs(mx.float32, k, n, stage, seed=len(stage) + residual)
    got = _call(stage, x, w, nw, res if residual else None)
    want = _staged(stage, _f64(x), _f64(nw), k) @ _f64(w).T + (_f64(res) if residual else 0.0)
    assert got.shape == (1, n) and got.dtype == mx.float32
    np.testing.assert_allclose(_f64(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend; run on the H200")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("stage", ["copy", "norm", "swiglu"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("k, n", [(256, 1), (256, 13), (2048, 3072), (8192, 2048), (2048, 40000)])
def test_kernel_matches_float64_and_unfused_mlx(dtype, stage, residual, k, n):
    eps = mx.finfo(dtype).eps  # one ulp at 1.0
    x, w, nw, res = _inputs(dtype, k, n, stage, seed=k + n + len(stage) + residual)
    assert serves(x, w, swiglu=stage == "swiglu")
    got = _call(stage, x, w, nw, res if residual else None)
    assert got.shape == (1, n) and got.dtype == dtype
    a = _staged(stage, _f64(x), _f64(nw), k)
    wf = _f64(w)
    product = a @ wf.T
    want = product + (_f64(res) if residual else 0.0)
    # the input rounded to the dtype (an ulp of each element at most: rsqrtf, the sigmoid), float32 sums of K
    # terms, the product rounded once, the residual add rounded again
    scale = np.abs(a) @ np.abs(wf).T
    bound = 2 * eps * scale + k * 2.0**-22 * scale + 0.5 * eps * (np.abs(product) + np.abs(want)) + 1e-30
    np.testing.assert_array_less(np.abs(_f64(got) - want), bound * 1.01)
    staged = (mx.fast.rms_norm(x, nw, EPS) if stage == "norm"
              else swiglu(x[:, :k], x[:, k:]) if stage == "swiglu" else x)
    mlx = staged @ w.T
    mlx = _f64(res + mlx if residual else mlx)  # cuBLAS's order and MLX's kernels: within an ulp or two
    np.testing.assert_allclose(_f64(got), mlx, rtol=2 * eps, atol=2 * eps * np.abs(mlx).max())


def test_serves_one_half_precision_row_in_whole_256_steps_on_cuda_only():
    w = mx.zeros((48, 512), mx.bfloat16)
    assert takes(w) == serves(mx.zeros((1, 512), mx.bfloat16), w) == ON_CUDA
    assert serves(mx.zeros((1, 1024), mx.bfloat16), w, swiglu=True) == ON_CUDA
    assert not takes(mx.zeros((8, MAX_K + 256), mx.bfloat16)) and not takes(mx.zeros((8, 384), mx.bfloat16))
    assert not takes(mx.zeros((8, 512), mx.float32))
    for x in [mx.zeros((2, 512), mx.bfloat16), mx.zeros((1, 512), mx.float16), mx.zeros((1, 1024), mx.bfloat16)]:
        assert not serves(x, w)


def test_bad_shapes_raise():
    x, w = mx.zeros((1, 64)), mx.zeros((8, 64))
    with pytest.raises(ValueError, match="not both"):
        gemv(x, w, norm=(mx.ones(64), EPS), swiglu=True)
    with pytest.raises(ValueError, match="gemv takes x"):
        gemv(mx.zeros((2, 64)), w)
    with pytest.raises(ValueError, match="gemv takes x"):
        gemv(x, w, swiglu=True)
    with pytest.raises(ValueError, match="norm weight must be"):
        gemv(x, w, norm=(mx.ones(32), EPS))
    with pytest.raises(ValueError, match="residual must be"):
        gemv(x, w, residual=mx.zeros((1, 7)))

