"""The few-row projection kernel equals its float64 definition and MLX's matmul (on the H200; on a CPU-only
machine only its dispatch rules run)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels import cuda_kv, skinny_gemm
from kernels.skinny_gemm import KERNEL_ROWS, MAX_ROWS, SkinnyTuning, default_tuning, serves, skinny_matmul

ON_CUDA = cuda_kv.is_available()


def _check(x: mx.array, w: mx.array, got: mx.array) -> None:
    dtype, k = x.dtype, x.shape[1]
    eps = mx.finfo(dtype).eps  # one ulp at 1.0
    assert got.shape == (x.shape[0], w.shape[0]) and got.dtype == dtype
    xf, wf = (np.array(a.astype(mx.float32), np.float64) for a in (x, w))
    want = xf @ wf.T
    # float32 sums of exact products, rounded once to the dtype: half an ulp of each output, plus the float32 sum's
    # error (K terms; 2^-22 each of sum |x w|, room for tensor cores that truncate rather than round)
    bound = 0.5 * eps * np.abs(want) + k * 2.0**-22 * (np.abs(xf) @ np.abs(wf).T) + 1e-30
    np.testing.assert_array_less(np.abs(np.array(got.astype(mx.float32), np.float64) - want), bound * 1.01)
    mlx = np.array((x @ w.T).astype(mx.float32))  # cuBLAS: its own order, the same rounding
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), mlx, rtol=eps, atol=eps * np.abs(mlx).max())


def _operands(dtype, rows: int, k: int, n: int, seed: int) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal((rows, k)), dtype), mx.array(rng.standard_normal((n, k)) / np.sqrt(k), dtype)


@pytest.mark.skipif(not ON_CUDA, reason="the kernel needs MLX's CUDA backend; run on the H200")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("rows", [2, 3, 5, 8, 9, 16, 31, 32, 47, 64])
@pytest.mark.parametrize("k, n", [(256, 16), (768, 48), (2048, 3072), (8192, 2048), (2048, 2048)])
def test_skinny_matmul_matches_float64_and_mlx(dtype, rows, k, n):
    x, w = _operands(dtype, rows, k, n, rows * 7 + k + n)
    _check(x, w, skinny_matmul(x, w))


@pytest.mark.skipif(not ON_CUDA, reason="the kernel needs MLX's CUDA backend; run on the H200")
@pytest.mark.parametrize("tuning", [SkinnyTuning(1, 1, 8, 4), SkinnyTuning(2, 1, 8, 2), SkinnyTuning(4, 2, 8, 1),
                                    SkinnyTuning(2, 4, 4, 2), SkinnyTuning(1, 8, 4, 1), SkinnyTuning(4, 8, 8, 1),
                                    SkinnyTuning(1, 1, 8, 2, True), SkinnyTuning(2, 4, 4, 1, True)],
                         ids=str)
@pytest.mark.parametrize("rows", [4, 17, 32])
def test_every_launch_shape_sums_alike_and_a_split_launch_leaves_its_counts_at_zero(tuning, rows):
    """Split launches of one weight in a row: each uses the counts the last one left, so a count not set back
    to 0 would make a later launch's last block another than the one that has every partial."""
    assert tuning.fits(rows, 2048, 2048)
    x, w = _operands(mx.bfloat16, rows, 2048, 2048, rows + tuning.splits)
    for i in range(3):
        _check(x * (i + 1), w, skinny_matmul(x * (i + 1), w, tuning))
    if tuning.splits > 1:
        assert not np.array(skinny_gemm._split_counts(w, 2048 // (16 * tuning.tiles))).any()


def test_serves_a_few_rows_of_half_types_in_whole_tiles_on_cuda_only():
    w = mx.zeros((48, 512), mx.bfloat16)
    assert serves(mx.zeros((2, 512), mx.bfloat16), w) == serves(mx.zeros((MAX_ROWS, 512), mx.bfloat16), w) == ON_CUDA
    for x, weight in [(mx.zeros((1, 512), mx.bfloat16), w),  # one row: MLX's gemv
                      (mx.zeros((MAX_ROWS + 1, 512), mx.bfloat16), w),  # more: cuBLAS
                      (mx.zeros((4, 512), mx.float32), w.astype(mx.float32)),
                      (mx.zeros((4, 512), mx.float16), w),  # dtypes differ
                      (mx.zeros((4, 384), mx.bfloat16), mx.zeros((48, 384), mx.bfloat16)),  # K % 256
                      (mx.zeros((4, 512), mx.bfloat16), mx.zeros((40, 512), mx.bfloat16)),  # N % 16
                      (mx.zeros((4, 1, 512), mx.bfloat16), w)]:
        assert not serves(x, weight)
    assert serves(mx.zeros((KERNEL_ROWS, 512), mx.bfloat16), w, KERNEL_ROWS) == ON_CUDA
    with pytest.raises(ValueError, match="skinny_matmul takes"):
        skinny_matmul(mx.zeros((1, 512), mx.bfloat16), w)
    with pytest.raises(ValueError, match="skinny_matmul takes"):
        skinny_matmul(mx.zeros((KERNEL_ROWS + 1, 512), mx.bfloat16), w)


SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048),  # llama-1b's projections
          (4096, 2048), (12288, 2048), (2048, 6144), (151936, 2048), (256, 512), (48, 768)]  # qwen3-1.7b's, small


@pytest.mark.parametrize("n, k", SHAPES)
def test_default_tuning_fits_every_row_count_and_keeps_one_tile_up_to_eight_rows(n, k):
    for rows in range(2, KERNEL_ROWS + 1):
        t = default_tuning(rows, n, k)
        assert t.fits(rows, n, k), (rows, t)
        if rows <= 8:
            assert (t.tiles, t.splits) == (1, 1)
