"""Projections of a few rows (2 to 8) on the tensor cores, in one cheap launch.

At batched decode every projection multiplies a handful of rows by a weight matrix. MLX's CUDA
backend sends such a product to cuBLASLt, whose evaluation, at every call, builds descriptors,
queries the algorithm heuristic and captures a stream into the step's graph: ~20 µs of host time
more than a custom kernel's launch (measured: with 65 projections a llama-1b step, 32 rows spent
2.55 ms of host time a step through cuBLASLt, 1.23 ms through this kernel). One row keeps MLX's
gemv; 2 to 8 rows take this kernel where MLX's CUDA backend is the default device.

The kernel streams the weight once: each block takes 16 weight rows, its warps split K, and each
warp runs `mma.sync` m16n8k16 with the weight tile as A (16 rows x 16 k) and the activations as
B (16 k x 8 rows), float32 accumulators; the warps' sums meet in shared memory. Within each 32-wide
chunk of K the order of the products is permuted so that a lane's fragments of two steps come
from one 16-byte load per row (a warp reads whole 32-byte sectors): a dot product's order is free,
so the result is the same sum in another order (float32, then rounded to the activations' dtype
once; cuBLAS sums in its own order, so the two may differ in the last bit). The kernel takes up to
8 tiles of 8 rows (`MT`), but every block reads all the activations from L2: at 32 and 64 rows
that traffic made the H200 step slower than cuBLAS's (`ops/results/batching_gpu_llama-1b_skinny.json`),
so more than 8 rows keep cuBLAS.

Source: PTX ISA, "Matrix fragments for mma.m16n8k16" (the operand layouts).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from kernels import cuda_kv
from kernels.cuda_mma import MMA_HEADER

MAX_ROWS = 8  # rows the dispatch sends here (one tile; see the module's note on more)
_WARPS = 8  # warps of a block, splitting K

_SOURCE = r"""
  // out[m, n] = sum_k x[m, k] * w[n, k]. Block: weight rows n0 .. n0 + 15; warp: K slice [kb, kb + K / W).
  // Lane (g, t) = (lane / 4, lane % 4) loads 16 bytes at k = 8t of each 32-wide chunk of weight rows g and
  // g + 8 and of activation row 8j + g (tile j); step s of the chunk takes words 2s, 2s + 1 of them.
  // MT 8-row tiles of activations: the dispatch sends one (more re-read them from L2 in every block and
  // measured slower than cuBLAS; the H200 tests passed up to 8 tiles).
  static_assert(sizeof(T) == 2 && K % (W * 32 * U) == 0, "fp16/bf16, K in whole chunks");
  constexpr int KW = K / W;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int M = x_shape[0];
  const int N = gridDim.x * 16;
  const int n0 = blockIdx.x * 16, kb = warp * KW;
  const uint4* w0 = reinterpret_cast<const uint4*>(w + (size_t)(n0 + g) * K + kb) + t;
  const uint4* w1 = reinterpret_cast<const uint4*>(w + (size_t)(n0 + g + 8) * K + kb) + t;
  float acc[MT][4];
#pragma unroll
  for (int j = 0; j < MT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  for (int c = 0; c < KW / 32; c += U) {
    uint4 a0[U], a1[U], b[MT][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      a0[u] = __ldg(w0 + 4 * (c + u));
      a1[u] = __ldg(w1 + 4 * (c + u));
    }
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      const int m = 8 * j + g;
      const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)m * K + kb) + t;
#pragma unroll
      for (int u = 0; u < U; ++u) b[j][u] = m < M ? __ldg(xr + 4 * (c + u)) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t s0[4] = {a0[u].x, a1[u].x, a0[u].y, a1[u].y};
      const uint32_t s1[4] = {a0[u].z, a1[u].z, a0[u].w, a1[u].w};
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        mma16816<T>(acc[j], s0, b[j][u].x, b[j][u].y);
        mma16816<T>(acc[j], s1, b[j][u].z, b[j][u].w);
      }
    }
  }
  __shared__ float red[W][MT][4][32];
#pragma unroll
  for (int j = 0; j < MT; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) red[warp][j][r][lane] = acc[j][r];
  __syncthreads();
  for (int e = threadIdx.x; e < MT * 128; e += blockDim.x) {  // e = (j, r, l): lane l's accumulator r of tile j
    const int j = e >> 7, r = (e >> 5) & 3, l = e & 31;
    const int m = 8 * j + 2 * (l & 3) + (r & 1), n = n0 + (l >> 2) + (r >> 1) * 8;
    if (m < M) {
      float s = 0.f;
#pragma unroll
      for (int v = 0; v < W; ++v) s += red[v][j][r][l];
      out[(size_t)m * N + n] = static_cast<T>(s);
    }
  }
"""


@functools.cache
def _kernel():
    return cuda_kv.custom_kernel("bm_skinny_gemm", _SOURCE, MMA_HEADER, input_names=["x", "w"], output_names=["out"])


def serves(x: mx.array, weight: mx.array) -> bool:
    """Whether `skinny_matmul` takes `x @ weight.T`: MLX's CUDA backend, 2 to 8 rows, fp16/bf16 of one dtype,
    K a multiple of 256 and N of 16."""
    if x.ndim != 2 or weight.ndim != 2 or not 2 <= x.shape[0] <= MAX_ROWS or x.shape[1] != weight.shape[1]:
        return False
    if x.dtype not in (mx.float16, mx.bfloat16) or weight.dtype != x.dtype:
        return False
    return x.shape[1] % (_WARPS * 32) == 0 and weight.shape[0] % 16 == 0 and cuda_kv.is_available()


def skinny_matmul(x: mx.array, weight: mx.array) -> mx.array:
    """`x @ weight.T` of a few rows, one launch (`serves` must hold).

    Args:
        x (mx.array): [M, K] activations, 2 <= M <= 8, float16/bfloat16, row-contiguous.
        weight (mx.array): [N, K] (an `nn.Linear` weight as stored), x's dtype, row-contiguous, rows on
            16-byte boundaries (a whole array, not an offset view).

    Returns:
        mx.array: [M, N] in x's dtype (float32 sums, rounded once).

    Raises:
        ValueError: shapes, dtypes or a backend `serves` does not take.
    """
    if not serves(x, weight):
        raise ValueError(f"skinny_matmul takes [2..{MAX_ROWS}, K] @ [N, K].T in fp16/bf16 on CUDA, K % 256 == 0 and "
                         f"N % 16 == 0; got {x.shape} {x.dtype} and {weight.shape} {weight.dtype}")
    rows, k = x.shape
    unroll = 4  # 32-wide chunks a warp loads at once: 2 x 4 16-byte weight loads in flight a lane
    while k % (_WARPS * 32 * unroll):
        unroll //= 2
    (out,) = _kernel()(inputs=[x, weight], template=[("T", x.dtype), ("K", k), ("MT", 1), ("W", _WARPS), ("U", unroll)],
                       grid=(weight.shape[0] // 16 * 32 * _WARPS, 1, 1), threadgroup=(32 * _WARPS, 1, 1),
                       output_shapes=[(rows, weight.shape[0])], output_dtypes=[x.dtype])
    return out
