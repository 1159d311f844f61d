"""SwiGLU and the down projection of one row in one launch.

A Llama MLP ends with `down(silu(gate) * up)`. At single-stream decode the down projection is a
gemv and the SwiGLU before it a launch of its own: ~1.6 µs of GPU time and one more primitive for
the host a layer (issue 10). `swiglu_down` forms `silu(gate) * up` of the fused gate/up output once
per block in shared memory and streams the weight as MLX's own gemv does (`gemv_single`: a block of
8 warps, a weight row a warp, a block per 8 rows; a lane loads 16-byte words `lane + 32 i`, so a warp
reads 512 contiguous bytes, its first words issued before the SwiGLU is formed). Where MLX's CUDA
backend is the default device it is one kernel; elsewhere mlx-lm's `swiglu` and a matmul.

The SwiGLU is computed as `kernels.swiglu` computes it (MLX's `Sigmoid`, each step in the dtype), the
sums in float32, rounded once: the fused and unfused forms differ only in summation order.

Folding the RMSNorms and residual adds into the other projections as well was measured and rejected
(`ops/results/gemv_fold_rejected_gpu.json`): a norm staged once a block behind a barrier, or taken by
every warp on its own, ran the q/k/v, gate/up and head projections 1.4-1.7x slower than MLX's gemv,
more than the launches it saved (single stream 0.74-0.97x).

Sources: Shazeer, "GLU Variants Improve Transformer" (2020); Elfwing et al., "Sigmoid-Weighted Linear
Units" (2017).
"""

from __future__ import annotations

import functools

import mlx.core as mx
from mlx_lm.models.activations import swiglu as mlx_swiglu

from kernels import cuda_kv

MAX_K = 16384  # down projection's input width at most (the staged row: 32 KB of shared memory)
_WARPS = 8  # a block: one weight row a warp

_SOURCE = r"""
  // out[0, n] = sum_k a[k] * w[n, k], a = silu(x[:K]) * x[K:]. Warp: weight row n; lane: 16-byte words lane + 32 i
  // of it (a warp reads 512 contiguous bytes a load), U at once, the first U issued before a is formed.
  static_assert(sizeof(T) == 2 && K % 256 == 0, "fp16/bf16, K in whole 256-element steps");
  constexpr int NV = K / 8;   // 16-byte words of a row
  constexpr int J = K / 256;  // words a lane takes of a row
  constexpr int U = J % 8 == 0 ? 8 : (J % 4 == 0 ? 4 : (J % 2 == 0 ? 2 : 1));
  const int lane = threadIdx.x & 31;
  const int N = w_shape[0];
  const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const uint4* wv = reinterpret_cast<const uint4*>(w) + (size_t)(n < N ? n : 0) * NV + lane;
  uint4 cur[U];
#pragma unroll
  for (int u = 0; u < U; ++u) cur[u] = __ldg(wv + 32 * u);
  // a in T's arithmetic with MLX's Sigmoid (kernels.swiglu's), once a block in shared memory
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  __shared__ __align__(16) T staged[K];
  uint4* a4 = reinterpret_cast<uint4*>(staged);
  for (int v = threadIdx.x; v < NV; v += blockDim.x) {
    T g[8], p[8], o[8];
    const uint4 gv = x4[v], pv = x4[NV + v];
    memcpy(g, &gv, 16);
    memcpy(p, &pv, 16);
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = (g[j] * Sigmoid{}(g[j])) * p[j];
    memcpy(&a4[v], o, 16);
  }
  __syncthreads();
  if (n >= N) return;
  float acc = 0.f;
  for (int c = 0; c < J; c += U) {
    if (c > 0) {
#pragma unroll
      for (int u = 0; u < U; ++u) cur[u] = __ldg(wv + 32 * (c + u));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      T a[8], b[8];
      const uint4 av = a4[lane + 32 * (c + u)];
      memcpy(a, &av, 16);
      memcpy(b, &cur[u], 16);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc = fmaf(static_cast<float>(a[j]), static_cast<float>(b[j]), acc);
    }
  }
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) out[n] = static_cast<T>(acc);
"""
_SIGMOID_HEADER = '#include "mlx/backend/cuda/device/unary_ops.cuh"\n'  # MLX's elementwise functors


@functools.cache
def _kernel():
    return cuda_kv.custom_kernel("bm_swiglu_down", _SOURCE, _SIGMOID_HEADER, input_names=["x", "w"],
                                 output_names=["out"])


def takes(weight: mx.array) -> bool:
    """Whether the kernel takes `weight` [N, K] for one row: MLX's CUDA backend, fp16/bf16, K a multiple of 256
    and at most `MAX_K`."""
    if weight.ndim != 2 or weight.dtype not in (mx.float16, mx.bfloat16):
        return False
    return weight.shape[1] % 256 == 0 and weight.shape[1] <= MAX_K and cuda_kv.is_available()


def serves(h: mx.array, weight: mx.array) -> bool:
    """Whether `swiglu_down(h, weight)` runs as one kernel: `takes(weight)` and h one row [1, 2 * K] of its dtype."""
    if h.ndim != 2 or h.shape[0] != 1 or weight.ndim != 2 or h.shape[1] != 2 * weight.shape[1]:
        return False
    return h.dtype == weight.dtype and takes(weight)


def swiglu_down(h: mx.array, weight: mx.array) -> mx.array:
    """`silu(gate) * up @ weight.T` of `h = [gate | up]`, one launch where `serves` holds.

    Args:
        h (mx.array): [B, 2 * K], the fused gate/up projection's output (gate first), float16/bfloat16 on the
            kernel path (one row), any float dtype and rows through MLX ops, row-contiguous.
        weight (mx.array): [N, K] (the down projection's `nn.Linear` weight as stored), h's dtype.

    Returns:
        mx.array: [B, N] in h's dtype (float32 sums, rounded once).

    Raises:
        ValueError: h not [B, 2 * K] for weight [N, K].
    """
    if h.ndim != 2 or weight.ndim != 2 or h.shape[1] != 2 * weight.shape[1]:
        raise ValueError(f"swiglu_down takes h [B, 2 * K] and weight [N, K]; got {h.shape}, {weight.shape}")
    k = weight.shape[1]
    if not serves(h, weight):
        return mlx_swiglu(h[:, :k], h[:, k:]) @ weight.T
    (out,) = _kernel()(inputs=[h, weight], template=[("T", h.dtype), ("K", k)],
                       grid=(-(-weight.shape[0] // _WARPS) * 32 * _WARPS, 1, 1), threadgroup=(32 * _WARPS, 1, 1),
                       output_shapes=[(1, weight.shape[0])], output_dtypes=[h.dtype])
    return out
