"""Residual add fused with the next RMSNorm: one kernel launch instead of two.

A decoder layer adds each sublayer's output to the residual stream and normalizes the sum for
the next sublayer; at decode the step's cost is one host launch per kernel (issue 10), so the
pair runs as one CUDA kernel where MLX's CUDA backend is the default device, and as
`x + r` then `mx.fast.rms_norm` elsewhere. Both round the sum and the normalized value to the
input dtype as MLX does; the kernel sums the squares in another order, so its normalizer may
differ from `mx.fast.rms_norm`'s in the last bit.

Source: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019); the fused
add-norm of vLLM's `fused_add_rms_norm`.
"""

from __future__ import annotations

import functools
import struct

import mlx.core as mx

from kernels import cuda_kv

# The norm of one row, shared with `kernels.norm_gemv`: thread t keeps elements [t * E, t * E + E) in registers,
# so each input is read once, all loads (the weights too) issued before the reduction's barriers:
# h = T(x + r) (MLX's add; x itself without ADD), y = T(w * T(h * rsqrt(mean(h^2) + eps))) (MLX's norm);
# store(i, h_i, y_i) for each element. `part`: 32 floats of shared memory.
NORM_ROW = r"""
template <typename T, int H, int NT, bool ADD, typename Store>
__device__ __forceinline__ void norm_row(const T* x, const T* r, const T* w, float eps, float* part, Store store) {
  constexpr int E = (H + NT - 1) / NT;
  const int first = threadIdx.x * E;
  float v[E], wv[E];
  float ss = 0.f;
  auto scalar = [&]() {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int i = first + e;
      const float xi = i < H ? static_cast<float>(x[i]) : 0.f;
      v[e] = i < H && ADD ? static_cast<float>(static_cast<T>(xi + static_cast<float>(r[i]))) : xi;
      wv[e] = i < H ? static_cast<float>(w[i]) : 0.f;
      ss = fmaf(v[e], v[e], ss);
    }
  };
  if constexpr (E == 8 && sizeof(T) == 2 && H % 8 == 0) {  // one 16-byte load an input where aligned (every
    // block of a norm_gemv reads the same row: 8x fewer requests); the same operations in the same order
    const bool aligned = ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(r) |
                           reinterpret_cast<uintptr_t>(w)) & 15) == 0;
    if (aligned) {
      uint4 xw = {}, rw = {}, ww = {};
      if (first < H) {
        xw = *reinterpret_cast<const uint4*>(x + first);
        if (ADD) rw = *reinterpret_cast<const uint4*>(r + first);
        ww = *reinterpret_cast<const uint4*>(w + first);
      }
      const T *xe = reinterpret_cast<const T*>(&xw), *re = reinterpret_cast<const T*>(&rw);
      const T* we = reinterpret_cast<const T*>(&ww);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float xi = static_cast<float>(xe[e]);
        v[e] = ADD ? static_cast<float>(static_cast<T>(xi + static_cast<float>(re[e]))) : xi;
        wv[e] = static_cast<float>(we[e]);
        ss = fmaf(v[e], v[e], ss);
      }
    } else {
      scalar();
    }
  } else {
    scalar();
  }
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float t = threadIdx.x < NT / 32 ? part[threadIdx.x] : 0.f;
    for (int off = 16; off > 0; off >>= 1) t += __shfl_xor_sync(0xffffffffu, t, off);
    if (threadIdx.x == 0) part[0] = t;
  }
  __syncthreads();
  const float inv = rsqrtf(part[0] / H + eps);
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int i = first + e;
    if (i < H) store(i, static_cast<T>(v[e]), static_cast<T>(wv[e] * static_cast<float>(static_cast<T>(v[e] * inv))));
  }
}
"""

_SOURCE = r"""
  // One block of NT threads per row.
  const size_t base = (size_t)blockIdx.x * H;
  __shared__ float part[32];
  norm_row<T, H, NT, true>(x + base, r + base, w, __int_as_float(EPS), part, [&](int i, T hv, T yv) {
    h[base + i] = hv;
    y[base + i] = yv;
  });
"""


@functools.cache
def _kernel():
    return cuda_kv.custom_kernel("bm_add_rms_norm", _SOURCE, NORM_ROW, input_names=["x", "r", "w"],
                                 output_names=["h", "y"])


def norm_threads(hidden: int) -> int:
    """Threads of a block normalizing one row of `hidden` elements: about 8 elements a thread, whole warps,
    at most 1024."""
    return min(1024, (-(-hidden // 8) + 31) // 32 * 32)


def float_bits(value: float) -> int:
    """The bits of `value` as a float32, as a signed int: a kernel's template argument, read back with
    `__int_as_float`. A scalar passed as a 4-byte array would sit in MLX's small host-side pool, which the GPU
    reads in place from host memory at every launch (`ops.kernel_sweep.decode_inputs`)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def add_rms_norm(x: mx.array, residual: mx.array, weight: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """`h = x + residual` and `rms_norm(h) * weight`, in one launch on CUDA.

    Args:
        x (mx.array): [B, H] activations (the residual stream), float16/bfloat16/float32.
        residual (mx.array): [B, H], same dtype: the sublayer output to add.
        weight (mx.array): [H], the norm's scale, same dtype.
        eps (float): Added to the mean square.

    Returns:
        tuple[mx.array, mx.array]: `h` [B, H] (the new residual stream) and the normalized `h` [B, H],
        both in `x`'s dtype.

    Raises:
        ValueError: shapes that are not [B, H], [B, H], [H], or dtypes that differ.
    """
    if x.ndim != 2 or residual.shape != x.shape or weight.shape != (x.shape[1],):
        raise ValueError(f"add_rms_norm takes [B, H], [B, H], [H]; got {x.shape}, {residual.shape}, {weight.shape}")
    if residual.dtype != x.dtype or weight.dtype != x.dtype:
        raise ValueError(f"add_rms_norm takes one dtype; got {x.dtype}, {residual.dtype}, {weight.dtype}")
    if not cuda_kv.is_available():
        h = x + residual
        return h, mx.fast.rms_norm(h, weight, eps)
    batch, hidden = x.shape
    threads = norm_threads(hidden)
    return tuple(_kernel()(
        inputs=[x, residual, weight],
        template=[("T", x.dtype), ("H", hidden), ("NT", threads), ("EPS", float_bits(eps))],
        grid=(batch * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype],
    ))
