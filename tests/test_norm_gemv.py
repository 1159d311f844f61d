"""One row's RMSNorm + projection (+ SwiGLU) equals its float64 definition, with the fused add-norm's normalized
row: the CUDA kernel on the H200, its MLX-ops fallback on a CPU-only machine."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels import cuda_kv
from kernels.fused_norm import add_rms_norm
from kernels.norm_gemv import norm_gemv, serves

ON_CUDA = cuda_kv.is_available()


def _f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), np.float64)


def _inputs(dtype, hidden: int, rows: int, seed: int):
    rng = np.random.default_rng(seed)
    x, r = (mx.array(rng.standard_normal((1, hidden)) * 2, dtype) for _ in range(2))
    nw = mx.array(1 + 0.3 * rng.standard_normal(hidden), dtype)
    w = mx.array(rng.standard_normal((rows, hidden)) / np.sqrt(hidden), dtype)
    return x, r, nw, w


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("add", [True, False], ids=["add", "no-add"])
@pytest.mark.parametrize("hidden, rows", [(256, 96), (256, 4001), (2048, 3072), (3072, 200), (3328, 33), (4096, 130)])
def test_norm_gemv_projection_matches_float64(dtype, add, hidden, rows):
    """(256, 4001): an odd row count and, in the kernel, more units than MAX_BLOCKS blocks take, so warps loop;
    3072 and 3328: a lane's 12 and 13 words of a row taken in chunks of 6 and 1."""
    eps = mx.finfo(dtype).eps
    x, r, nw, w = _inputs(dtype, hidden, rows, hidden + rows)
    h, got = norm_gemv(x, r if add else None, nw, 1e-5, w)
    assert h.shape == x.shape and got.shape == (1, rows) and got.dtype == h.dtype == dtype
    want_h, y = add_rms_norm(x, r if add else mx.zeros_like(x), nw, 1e-5)  # adding zeros: x, normalized alike
    np.testing.assert_array_equal(_f64(h), _f64(want_h))
    yf, wf = _f64(y), _f64(w)
    want = yf @ wf.T
    # the row the kernel normalizes is add_rms_norm's, bit for bit; float32 sums of its exact products (K terms, 2^-24 each of
    # sum |y w|, doubled for room), rounded once to the dtype: half an ulp
    bound = 0.5 * eps * np.abs(want) + hidden * 2.0**-23 * (np.abs(yf) @ np.abs(wf).T) + 1e-30
    np.testing.assert_array_less(np.abs(_f64(got) - want), bound * 1.01)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("hidden, width", [(256, 48), (2048, 8192), (2560, 700), (4096, 3000)])
def test_norm_gemv_swiglu_matches_float64(dtype, hidden, width):
    eps = mx.finfo(dtype).eps
    x, r, nw, w = _inputs(dtype, hidden, 2 * width, hidden + width)
    h, got = norm_gemv(x, r, nw, 1e-6, w, swiglu=True)
    assert got.shape == (1, width) and got.dtype == dtype
    want_h, y = add_rms_norm(x, r, nw, 1e-6)
    np.testing.assert_array_equal(_f64(h), _f64(want_h))
    yf, wf = _f64(y), _f64(w)
    proj, sums = yf @ wf.T, hidden * 2.0**-23 * (np.abs(yf) @ np.abs(wf).T)  # float32 sums' error, as above
    (gate, up), (e_gate, e_up) = np.split(proj, 2, axis=1), np.split(sums, 2, axis=1)
    silu = gate / (1 + np.exp(-gate))
    want = silu * up
    # gate and up rounded to the dtype (half an ulp each, after their sums' error), then MLX's swiglu in the dtype:
    # its sigmoid rounds a few times (~1.3 ulp at most in bf16), the two products half an ulp each, so ~2.7 ulp
    # in all, within the 4 allowed; the silu's slope is at most 1.1
    bound = 4 * eps * np.abs(want) + 1.1 * (0.5 * eps * np.abs(gate) + e_gate) * np.abs(up) + e_up * np.abs(silu)
    np.testing.assert_array_less(np.abs(_f64(got) - want), bound)


def test_serves_one_half_type_row_whole_chunks_on_cuda_only():
    w = mx.zeros((48, 512), mx.bfloat16)
    assert serves(mx.zeros((1, 512), mx.bfloat16), w) == ON_CUDA
    for x, weight in [(mx.zeros((2, 512), mx.bfloat16), w),  # two rows: skinny_gemm and the fused norm
                      (mx.zeros((1, 512), mx.float32), w.astype(mx.float32)),
                      (mx.zeros((1, 512), mx.float16), w),  # dtypes differ
                      (mx.zeros((1, 384), mx.bfloat16), mx.zeros((48, 384), mx.bfloat16)),  # H % 256
                      (mx.zeros((1, 8192), mx.bfloat16), mx.zeros((48, 8192), mx.bfloat16)),  # past 4096
                      (mx.zeros((1, 1, 512), mx.bfloat16), w)]:
        assert not serves(x, weight)
    with pytest.raises(ValueError, match="norm_gemv takes"):
        norm_gemv(mx.zeros((2, 512), mx.bfloat16), None, mx.zeros(512, mx.bfloat16), 1e-5, w)
    with pytest.raises(ValueError, match="norm_gemv takes"):
        norm_gemv(mx.zeros((1, 512), mx.bfloat16), None, mx.zeros(512, mx.bfloat16), 1e-5, mx.zeros((48, 256)))


def test_norm_gemv_rejects_mismatched_norm_residual_or_odd_swiglu():
    x, w = mx.zeros((1, 512), mx.bfloat16), mx.zeros((49, 512), mx.bfloat16)
    nw = mx.zeros(512, mx.bfloat16)
    with pytest.raises(ValueError, match="norm weight"):
        norm_gemv(x, None, mx.zeros(256, mx.bfloat16), 1e-5, w)
    with pytest.raises(ValueError, match="residual"):
        norm_gemv(x, mx.zeros((1, 512), mx.float16), nw, 1e-5, w)
    with pytest.raises(ValueError, match="equal widths"):
        norm_gemv(x, None, nw, 1e-5, w, swiglu=True)
