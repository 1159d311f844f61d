"""Greedy sampling's argmax over each row of logits in one short launch.

A decode step ends with `argmax(logits, axis=-1)` over the vocabulary. MLX's CUDA `arg_reduce`
takes ~22.5 µs of GPU time a step for one row of 128,256 bf16 logits (CUPTI in the engine, an
H100, `ops/gpu_time.py`): 2% of a llama-1b step, for 256 KB. Here one block of 1,024 threads
takes a row, each thread issuing four 16-byte loads (where the row is 16-byte aligned) before it
compares their elements: 7.5 µs a step on the same H100 (`ops/results/argmax_ab_gpu_h100_2026-12-06.json`),
where a loop of one load then its compares waits a memory latency a pass (an earlier one-block
kernel so, 512 threads, took 20.7 µs; `docs/gpu_log.md`). It reduces (value, index) pairs by warp
shuffles, then across warps in shared memory. The result is numpy's and MLX's: the first index
of the largest value, a NaN counting as larger than any number (the first NaN wins).
Elsewhere (the CPU, Metal) `argmax_rows` is `mx.argmax`.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from kernels import cuda_kv

THREADS = 1024
LOADS_IN_FLIGHT = 4  # 16-byte loads a thread issues before comparing: a row of 128,256 bf16 takes 4 passes

_SOURCE = r"""
  // Row blockIdx.x of logits [B, V]; thread t reads W elements at t*W of each stride of THREADS*W, by one
  // 16-byte load where the row starts 16-byte aligned (W > 1), else one element at a time.
  const T* x = logits + (size_t)blockIdx.x * V;
  const int t = threadIdx.x;
  float best = __int_as_float(0xff800000);  // -inf
  int at = V;  // past the row: loses to every real element
  if (W > 1 && (reinterpret_cast<unsigned long long>(x) & 15) == 0) {
    constexpr int STEP = THREADS * W;  // elements a pass of the block's loads covers
    for (int i0 = t * W; i0 < V; i0 += U * STEP) {  // U loads in flight a thread, then their compares
      uint4 words[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = i0 + u * STEP;
        if (i + W <= V) words[u] = *reinterpret_cast<const uint4*>(x + i);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = i0 + u * STEP;
        if (i + W > V) break;
        const T* vals = reinterpret_cast<const T*>(&words[u]);
#pragma unroll
        for (int j = 0; j < W; ++j) bm_take((float)vals[j], i + j, best, at);
      }
    }
    for (int i = V / W * W + t; i < V; i += THREADS) bm_take((float)x[i], i, best, at);  // a tail under one load
  } else {
    for (int i = t; i < V; i += THREADS) bm_take((float)x[i], i, best, at);
  }
  bm_warp_best(best, at);
  __shared__ float warp_best[THREADS / 32];
  __shared__ int warp_at[THREADS / 32];
  if ((t & 31) == 0) { warp_best[t >> 5] = best; warp_at[t >> 5] = at; }
  __syncthreads();
  if (t < 32) {
    best = warp_best[t]; at = warp_at[t];  // THREADS / 32 == 32 warps
    bm_warp_best(best, at);
    if (t == 0) out[blockIdx.x] = at == V ? 0u : (uint32_t)at;  // nothing taken: every element is -inf
  }
"""

_HEADER = r"""
// Whether (v, i) beats (best, at) in numpy's argmax order: NaN above every number, then the larger
// value, ties (and NaN against NaN) to the smaller index.
__device__ __forceinline__ bool bm_wins(float v, int i, float best, int at) {
  const bool vn = v != v, bn = best != best;
  if (vn != bn) return vn;
  if (!vn && v != best) return v > best;
  return i < at;
}

// The warp's winning (best, at) in every lane, by a butterfly of `bm_wins`.
__device__ __forceinline__ void bm_warp_best(float& best, int& at) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float b = __shfl_xor_sync(0xffffffffu, best, off);
    const int a = __shfl_xor_sync(0xffffffffu, at, off);
    if (bm_wins(b, a, best, at)) { best = b; at = a; }
  }
}

// A thread's own scan, in increasing index order: a later element wins only if strictly larger, or the
// first NaN (then nothing beats it); a -inf is never taken (a row of them all leaves `at` past the row).
__device__ __forceinline__ void bm_take(float v, int i, float& best, int& at) {
  if (v > best || (v != v && best == best)) { best = v; at = i; }
}
"""


@functools.cache
def _kernel():
    return cuda_kv.custom_kernel("bm_argmax_rows", _SOURCE, _HEADER, input_names=["logits"], output_names=["out"])


def argmax_rows(logits: mx.array) -> mx.array:
    """The index of each row's largest logit (greedy sampling).

    Args:
        logits (mx.array): [B, V], float16/bfloat16/float32, V < 2**31.

    Returns:
        mx.array: uint32 [B]: per row, the first index of its largest value; a NaN counts as larger
        than any number (numpy's and `mx.argmax`'s order).

    Raises:
        ValueError: logits not 2-D, or with no columns.
    """
    if logits.ndim != 2 or logits.shape[1] == 0:
        raise ValueError(f"argmax_rows takes [B, V] logits with V >= 1, got {logits.shape}")
    if not cuda_kv.is_available() or logits.dtype not in (mx.float16, mx.bfloat16, mx.float32):
        return mx.argmax(logits, axis=-1)
    batch, vocab = logits.shape
    width = 16 // logits.dtype.size  # elements a 16-byte load reads
    (out,) = _kernel()(inputs=[logits], template=[("T", logits.dtype), ("V", vocab), ("W", width),
                                                   ("THREADS", THREADS), ("U", LOADS_IN_FLIGHT)],
                       grid=(batch * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                       output_shapes=[(batch,)], output_dtypes=[mx.uint32])
    return out
