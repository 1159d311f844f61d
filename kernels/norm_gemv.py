"""One decode row's RMSNorm and the projection after it, in one launch (SwiGLU too, after gate/up).

A single-stream decode step is bound by the host's launches (issue 10): each residual add and
RMSNorm (`kernels.fused_norm`), each MLX matmul and the SwiGLU after the gate/up projection is
one. Where MLX's CUDA backend is the default device, `norm_gemv` runs `h = x + residual`,
`y = rms_norm(h) * norm_weight` and `y @ weight.T` for one row in one kernel, and with
`swiglu=True` also `silu(gate) * up` of the fused gate/up output: a layer launches three kernels
fewer (before the q/k/v projection, before gate/up, and the SwiGLU).

Every block computes the norm of the row itself (a few KB from L2, with `add_rms_norm`'s
arithmetic, so y is bit for bit the fused norm's) while its first weight rows are already in
flight; block 0 writes h. eps is a template argument: as a 4-byte array it sat in MLX's host-side
small pool, and every warp's read crossed the bus (13 µs a launch on the H200). Each warp then dots units of weight rows with y: lane l reads 16-byte
words l, l + 32, ... of a row (a warp reads whole 512-byte stretches), float32 sums, a butterfly
across the warp, rounded to the model's dtype once. A unit is two rows, or with `swiglu` gate row
j and up row j (`I` apart), whose outputs round to the dtype and meet as MLX's compiled `swiglu`
computes (its `Sigmoid` functor, each step in the dtype). MLX's gemv sums in another order, so an
output may differ from `mx.fast.rms_norm` then `@` in its last bit.

Source: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019); Shazeer, "GLU Variants
Improve Transformer" (2020); vLLM's fused add + RMSNorm.
"""

from __future__ import annotations

import functools

import mlx.core as mx
from mlx_lm.models.activations import swiglu as mlx_swiglu

from kernels import cuda_kv
from kernels.fused_norm import NORM_ROW, float_bits, norm_threads
from kernels.swiglu import SIGMOID

MAX_BLOCKS = 1024  # blocks past this loop over more units (each block pays one norm of the row)
CHUNK_WORDS = 4  # most 16-byte words of each row a lane holds at once (registers: 2 rows x 16 bytes each); 4
# against 8: qkv 6.78 against 7.43 µs, gate/up + SwiGLU 23.36 against 24.80 at llama-1b's shapes, the head
# 0.4% slower (CUPTI on an H100, ops/results/row_gemv_gpu_2026-12-05.json); the sums' order, so every output bit,
# does not depend on it
UNIT_ROWS = 2  # weight rows a warp dots at once (a SwiGLU unit: a gate row and its up row)

_SOURCE = r"""
  static_assert(sizeof(T) == 2 && H % 256 == 0 && NT % 32 == 0, "fp16/bf16, H in whole 256-element chunks");
  constexpr int KW = H / 256, CH = row_chunk(KW, CM), WPB = NT / 32;  // 16-byte words a lane takes of a row
  static_assert(!SWI || R == 2, "a SwiGLU unit is a gate row and its up row");
  const int N = w_shape[0];
  const int units = SWI ? N / 2 : (N + R - 1) / R;
  const int lane = threadIdx.x & 31;
  const int stride = gridDim.x * WPB;
  int u = blockIdx.x * WPB + (threadIdx.x >> 5);
  __shared__ __align__(16) T ys[H];
  __shared__ float part[32];
  uint4 wv[R][CH];
  auto load = [&](int unit, int c0) {  // chunk c0 of the unit's rows
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const int row = SWI ? unit + q * (N / 2) : unit * R + q;
      const uint4* p = reinterpret_cast<const uint4*>(w + (size_t)row * H) + c0 * 32 + lane;
#pragma unroll
      for (int c = 0; c < CH; ++c) wv[q][c] = row < N ? __ldg(p + 32 * c) : make_uint4(0u, 0u, 0u, 0u);
    }
  };
  if (u < units) load(u, 0);  // the first weights in flight while the block computes the norm
  norm_row<T, H, NT, ADD>(x, r, nw, __int_as_float(EPS), part, [&](int i, T hv, T yv) {
    ys[i] = yv;
    if (blockIdx.x == 0) h[i] = hv;
  });
  __syncthreads();
  const uint4* y4 = reinterpret_cast<const uint4*>(ys);
  for (bool first = true; u < units; u += stride, first = false) {
    float acc[R] = {};
#pragma unroll
    for (int c0 = 0; c0 < KW; c0 += CH) {
      if (!first || c0 > 0) load(u, c0);
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        const uint4 yw = y4[(c0 + c) * 32 + lane];
#pragma unroll
        for (int q = 0; q < R; ++q) acc[q] = dot8<T>(wv[q][c], yw, acc[q]);
      }
    }
#pragma unroll
    for (int q = 0; q < R; ++q)
      for (int off = 16; off > 0; off >>= 1) acc[q] += __shfl_xor_sync(0xffffffffu, acc[q], off);
    if (lane == 0) {
      if (SWI) {
        const T g = static_cast<T>(acc[0]), up = static_cast<T>(acc[1]);
        out[u] = (g * Sigmoid{}(g)) * up;
      } else {
#pragma unroll
        for (int q = 0; q < R; ++q)
          if (u * R + q < N) out[u * R + q] = static_cast<T>(acc[q]);
      }
    }
  }
"""

_CHUNK = r"""
// Words of a row a lane holds at once: the largest divisor of kw up to most.
__host__ __device__ constexpr int row_chunk(int kw, int most) {
  for (int c = most; c > 1; --c)
    if (kw % c == 0) return c;
  return 1;
}
"""

# Packed fp16 / bf16 dot products in float32, shared with `kernels.row_gemv`.
PACKED_DOT = r"""
// Two packed fp16 / bf16 values as floats (low half first).
__device__ __forceinline__ float2 unpack2(uint32_t w, __half) { return __half22float2(*reinterpret_cast<__half2*>(&w)); }
__device__ __forceinline__ float2 unpack2(uint32_t w, __nv_bfloat16) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

// acc + the dot product of 8 packed fp16/bf16 pairs, in order, float32.
template <typename T>
__device__ __forceinline__ float dot8(uint4 a, uint4 b, float acc) {
  const uint32_t aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 fa = unpack2(aw[k], T{}), fb = unpack2(bw[k], T{});
    acc = fmaf(fa.x, fb.x, acc);
    acc = fmaf(fa.y, fb.y, acc);
  }
  return acc;
}
"""


@functools.cache
def _kernel():
    return cuda_kv.custom_kernel("bm_norm_gemv", _SOURCE, SIGMOID + NORM_ROW + _CHUNK + PACKED_DOT,
                                 input_names=["x", "r", "nw", "w"], output_names=["out", "h"])


def serves(x: mx.array, weight: mx.array) -> bool:
    """Whether `norm_gemv` runs `x` and `weight` in its CUDA kernel: MLX's CUDA backend, one row, fp16/bf16 of
    one dtype, the hidden width a multiple of 256 and at most 4096 (a block of H / 8 threads must fit its
    registers). Elsewhere it runs MLX ops."""
    return _kernel_takes(x, weight)


def _kernel_takes(x: mx.array, weight: mx.array) -> bool:
    if x.ndim != 2 or x.shape[0] != 1 or weight.ndim != 2 or weight.shape[1] != x.shape[1]:
        return False
    if x.dtype not in (mx.float16, mx.bfloat16) or weight.dtype != x.dtype:
        return False
    return x.shape[1] % 256 == 0 and x.shape[1] <= 4096 and cuda_kv.is_available()


def norm_gemv(x: mx.array, residual: mx.array | None, norm_weight: mx.array, eps: float, weight: mx.array, *,
              swiglu: bool = False) -> tuple[mx.array, mx.array]:
    """`h = x + residual`, `y = rms_norm(h) * norm_weight` and `y @ weight.T` (then SwiGLU) for one row: one
    launch where `serves` holds, else MLX's ops (`x + residual`, `mx.fast.rms_norm`, matmul, mlx-lm's `swiglu`).

    Args:
        x (mx.array): [1, H] activations (the residual stream).
        residual (mx.array | None): [1, H], x's dtype, the sublayer output to add; None normalizes x itself.
        norm_weight (mx.array): [H], the RMSNorm's scale, x's dtype.
        eps (float): Added to the mean square.
        weight (mx.array): [N, H] (an `nn.Linear` weight as stored), x's dtype, a whole row-contiguous array;
            with `swiglu`, the fused [gate; up] weight (N = 2 * I, gate rows first).
        swiglu (bool): Return `silu(gate) * up` [1, I] instead of the projection [1, N].

    Returns:
        tuple[mx.array, mx.array]: `h` [1, H] (x's values when `residual` is None) and the output [1, N]
        (or [1, N / 2] with `swiglu`), in x's dtype.

    Raises:
        ValueError: x not one row [1, H], a weight not [N, H], a norm or residual of another shape or dtype,
            or an odd N with `swiglu`.
    """
    if x.ndim != 2 or x.shape[0] != 1 or weight.ndim != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"norm_gemv takes [1, H] @ [N, H].T; got {x.shape} and {weight.shape}")
    hidden = x.shape[1]
    if norm_weight.shape != (hidden,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"norm_gemv's norm weight must be [{hidden}] {x.dtype}; got {norm_weight.shape} "
                         f"{norm_weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"norm_gemv's residual must be {x.shape} {x.dtype}; got {residual.shape} {residual.dtype}")
    rows = weight.shape[0]
    if swiglu and rows % 2:
        raise ValueError(f"norm_gemv with swiglu takes [gate; up] of equal widths; got {rows} rows")
    width = rows // 2 if swiglu else rows
    if not _kernel_takes(x, weight):
        h = x if residual is None else x + residual
        out = mx.fast.rms_norm(h, norm_weight, eps) @ weight.T
        return h, (mlx_swiglu(out[:, :width], out[:, width:]) if swiglu else out)
    threads = norm_threads(hidden)
    units = rows // 2 if swiglu else -(-rows // UNIT_ROWS)
    blocks = min(MAX_BLOCKS, -(-units // (threads // 32)))
    out, h = _kernel()(
        inputs=[x, x if residual is None else residual, norm_weight, weight],
        template=[("T", x.dtype), ("H", hidden), ("NT", threads), ("EPS", float_bits(eps)),
                  ("ADD", residual is not None), ("SWI", swiglu), ("R", 2 if swiglu else UNIT_ROWS), ("CM", CHUNK_WORDS)],
        grid=(blocks * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(1, width), x.shape], output_dtypes=[x.dtype, x.dtype],
    )
    return h, out
