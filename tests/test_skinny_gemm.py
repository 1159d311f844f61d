"""The few-row projection kernel equals its float64 definition and MLX's matmul (on the H200; on a CPU-only
machine only its dispatch rules run)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels import cuda_kv
from kernels.skinny_gemm import MAX_ROWS, serves, skinny_matmul

ON_CUDA = cuda_kv.is_available()


@pytest.mark.skipif(not ON_CUDA, reason="the kernel needs MLX's CUDA backend; run on the H200")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("rows", [2, 3, 5, 8])
@pytest.mark.parametrize("k, n", [(256, 16), (768, 48), (2048, 3072), (8192, 2048)])
def test_skinny_matmul_matches_float64_and_mlx(dtype, rows, k, n):
    eps = mx.finfo(dtype).eps  # one ulp at 1.0
    rng = np.random.default_rng(rows * 7 + k + n)
    x = mx.array(rng.standard_normal((rows, k)), dtype)
    w = mx.array(rng.standard_normal((n, k)) / np.sqrt(k), dtype)
    got = skinny_matmul(x, w)
    assert got.shape == (rows, n) and got.dtype == dtype
    xf, wf = (np.array(a.astype(mx.float32), np.float64) for a in (x, w))
    want = xf @ wf.T
    # float32 sums of exact products, rounded once to the dtype: half an ulp of each output, plus the float32 sum's
    # error (K terms; 2^-22 each of sum |x w|, room for tensor cores that truncate rather than round)
    bound = 0.5 * eps * np.abs(want) + k * 2.0**-22 * (np.abs(xf) @ np.abs(wf).T) + 1e-30
    np.testing.assert_array_less(np.abs(np.array(got.astype(mx.float32), np.float64) - want), bound * 1.01)
    mlx = np.array((x @ w.T).astype(mx.float32))  # cuBLAS: its own order, the same rounding
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), mlx, rtol=eps, atol=eps * np.abs(mlx).max())


def test_serves_a_few_rows_of_half_types_in_whole_tiles_on_cuda_only():
    w = mx.zeros((48, 512), mx.bfloat16)
    assert serves(mx.zeros((2, 512), mx.bfloat16), w) == serves(mx.zeros((MAX_ROWS, 512), mx.bfloat16), w) == ON_CUDA
    for x, weight in [(mx.zeros((1, 512), mx.bfloat16), w),  # one row: MLX's gemv
                      (mx.zeros((MAX_ROWS + 1, 512), mx.bfloat16), w),
                      (mx.zeros((4, 512), mx.float32), w.astype(mx.float32)),
                      (mx.zeros((4, 512), mx.float16), w),  # dtypes differ
                      (mx.zeros((4, 384), mx.bfloat16), mx.zeros((48, 384), mx.bfloat16)),  # K % 256
                      (mx.zeros((4, 512), mx.bfloat16), mx.zeros((40, 512), mx.bfloat16)),  # N % 16
                      (mx.zeros((4, 1, 512), mx.bfloat16), w)]:
        assert not serves(x, weight)
    with pytest.raises(ValueError, match="skinny_matmul takes"):
        skinny_matmul(mx.zeros((1, 512), mx.bfloat16), w)
