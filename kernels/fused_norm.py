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

import mlx.core as mx

from kernels import cuda_kv

_SOURCE = r"""
  // One block of NT threads per row; thread t keeps elements [t * E, t * E + E) in registers, so each
  // input is read once, all loads (the weights and eps too) issued before the reduction's barriers:
  // h = T(x + r) (MLX's add), y = T(w * T(h * rsqrt(mean(h^2) + eps))) (MLX's norm).
  constexpr int E = (H + NT - 1) / NT;
  const size_t base = (size_t)blockIdx.x * H;
  const int first = threadIdx.x * E;
  float v[E], wv[E];
  const float epsv = eps[0];
  float ss = 0.f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int i = first + e;
    v[e] = i < H ? static_cast<float>(static_cast<T>(static_cast<float>(x[base + i]) + static_cast<float>(r[base + i])))
                 : 0.f;
    wv[e] = i < H ? static_cast<float>(w[i]) : 0.f;
    ss = fmaf(v[e], v[e], ss);
  }
  __shared__ float part[32];
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float t = threadIdx.x < NT / 32 ? part[threadIdx.x] : 0.f;
    for (int off = 16; off > 0; off >>= 1) t += __shfl_xor_sync(0xffffffffu, t, off);
    if (threadIdx.x == 0) part[0] = t;
  }
  __syncthreads();
  const float inv = rsqrtf(part[0] / H + epsv);
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int i = first + e;
    if (i < H) {
      h[base + i] = static_cast<T>(v[e]);
      y[base + i] = static_cast<T>(wv[e] * static_cast<float>(static_cast<T>(v[e] * inv)));
    }
  }
"""


@functools.cache
def _kernel():
    return cuda_kv.custom_kernel("bm_add_rms_norm", _SOURCE, input_names=["x", "r", "w", "eps"],
                                 output_names=["h", "y"])


@functools.cache
def _eps(value: float) -> mx.array:
    return mx.array([value], mx.float32)


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
    threads = min(1024, (-(-hidden // 8) + 31) // 32 * 32)  # about 8 elements a thread, whole warps
    return tuple(_kernel()(
        inputs=[x, residual, weight, _eps(float(eps))],
        template=[("T", x.dtype), ("H", hidden), ("NT", threads)],
        grid=(batch * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype],
    ))
