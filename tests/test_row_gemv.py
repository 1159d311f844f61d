"""The one-row projection kernel equals its float64 definition and MLX's gemv (on the H200; on a CPU-only
machine only its dispatch rules run)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels import cuda_kv
from kernels.row_gemv import SHARED_BYTES, STEP, RowTuning, default_tuning, row_gemv, serves

ON_CUDA = cuda_kv.is_available()
TUNINGS = [None, RowTuning(8, 1, 1, 8), RowTuning(8, 2, 2, 4), RowTuning(8, 4, 1, 2), RowTuning(4, 1, 4, 3),
           RowTuning(8, 1, 1, 8, 1), RowTuning(8, 2, 1, 4, 2), RowTuning(4, 2, 2, 3, 3)]


@pytest.mark.skipif(not ON_CUDA, reason="row_gemv is a CUDA kernel: only MLX's CUDA backend runs it "
                    "(an H100/H200 host); on a CPU its dispatch and launch-shape tests below run")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("tuning", TUNINGS, ids=lambda t: "default" if t is None else
                         f"w{t.warps}s{t.split}r{t.rows}u{t.unroll}p{t.stages}")
@pytest.mark.parametrize("k, n", [(1024, 64), (2048, 3072), (6144, 2048), (8192, 2048)])
def test_row_gemv_matches_float64_and_mlx(dtype, tuning, k, n):
    eps = mx.finfo(dtype).eps  # one ulp at 1.0
    rng = np.random.default_rng(k + n)
    x = mx.array(rng.standard_normal((1, k)), dtype)
    w = mx.array(rng.standard_normal((n, k)) / np.sqrt(k), dtype)
    got = row_gemv(x, w, tuning)
    assert got.shape == (1, n) and got.dtype == dtype
    xf, wf = (np.array(a.astype(mx.float32), np.float64) for a in (x, w))
    want = xf @ wf.T
    # float32 sums of exact products, rounded once to the dtype: half an ulp of each output, plus the float32
    # sum's error (K terms, 2^-24 each of sum |x w|)
    bound = 0.5 * eps * np.abs(want) + k * 2.0**-24 * (np.abs(xf) @ np.abs(wf).T) + 1e-30
    np.testing.assert_array_less(np.abs(np.array(got.astype(mx.float32), np.float64) - want), bound * 1.01)
    mlx = np.array((x @ w.T).astype(mx.float32))  # MLX's gemv: another order, the same rounding
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), mlx, rtol=eps, atol=eps * np.abs(mlx).max())


def test_serves_one_row_of_half_types_in_whole_blocks_on_cuda_only():
    w = mx.zeros((64, 512), mx.bfloat16)
    assert serves(mx.zeros((1, 512), mx.bfloat16), w) == ON_CUDA
    for x, weight, tuning in [(mx.zeros((2, 512), mx.bfloat16), w, None),  # two rows: kernels.skinny_gemm
                              (mx.zeros((1, 512), mx.float32), w.astype(mx.float32), None),
                              (mx.zeros((1, 512), mx.float16), w, None),  # dtypes differ
                              (mx.zeros((1, 384), mx.bfloat16), mx.zeros((64, 384), mx.bfloat16), None),  # K % 256
                              (mx.zeros((1, 512), mx.bfloat16), w, RowTuning(8, 4, 1, 8)),  # K % (256 * split)
                              (mx.zeros((1, 512), mx.bfloat16), mx.zeros((34, 512), mx.bfloat16), None),  # N % 4 (split 2)
                              (mx.zeros((1, 4096), mx.bfloat16), mx.zeros((64, 4096), mx.bfloat16),
                               RowTuning(8, 1, 2, 8, 2)),  # a 64 KiB ring
                              (mx.zeros((1, 1, 512), mx.bfloat16), w, None)]:
        assert not serves(x, weight, tuning)
    with pytest.raises(ValueError, match="row_gemv takes"):
        row_gemv(mx.zeros((2, 512), mx.bfloat16), w)


@pytest.mark.parametrize("n", [2048, 4096, 151936])
def test_default_tuning_splits_every_whole_step_width_evenly(n):
    """For every K in whole 256-column steps up to 32K, the default launch shape's warps split K evenly, a block
    covers whole rows of N (any N of 8-row multiples) and its ring fits the static shared memory."""
    for k in range(STEP, 32 * 1024 + 1, STEP):
        t = default_tuning(n, k)
        steps = k // STEP // t.split
        unroll = max(u for u in range(1, min(steps, t.unroll) + 1) if steps % u == 0)
        assert k % (STEP * t.split) == 0 and t.warps % t.split == 0 and n % (t.warps // t.split * t.rows) == 0
        assert t.warps * t.stages * t.rows * unroll * 32 * 16 <= SHARED_BYTES
