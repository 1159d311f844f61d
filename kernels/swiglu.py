"""SwiGLU of a fused gate/up projection's output in one launch.

After the fused gate/up projection (`services.engine.model.fuse`) a Llama-style MLP takes
`silu(h[:, :I]) * h[:, I:]`: on MLX two slices and a compiled kernel, three primitives a layer,
each costing host time at every decode step (issue 10). Where MLX's CUDA backend is the default
device, `swiglu_halves` reads both halves in one kernel; elsewhere it runs mlx-lm's `swiglu` on
the two slices. The kernel computes as MLX's compiled `swiglu` does (its `Sigmoid` functor, each
step in the input dtype); the H200 tests hold it within 2 ulp of mlx-lm's.

Source: Shazeer, "GLU Variants Improve Transformer" (2020); Elfwing et al., "Sigmoid-Weighted
Linear Units" (2017).
"""

from __future__ import annotations

import functools

import mlx.core as mx
from mlx_lm.models.activations import swiglu

from kernels import cuda_kv

_SOURCE = r"""
  // Row blockIdx.y; element i of the gate half and of the up half (I apart). MLX's own `Sigmoid`
  // functor, and T's operators: the arithmetic of mlx-lm's compiled `swiglu`, rounding for rounding.
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= I) return;
  const size_t row = (size_t)blockIdx.y * 2 * I;
  const T g = h[row + i];
  out[(size_t)blockIdx.y * I + i] = (g * Sigmoid{}(g)) * h[row + I + i];
"""
SIGMOID = '#include "mlx/backend/cuda/device/unary_ops.cuh"\n'  # MLX's elementwise functors (NVRTC finds MLX's headers)


@functools.cache
def _kernel():
    return cuda_kv.custom_kernel("bm_swiglu", _SOURCE, SIGMOID, input_names=["h"], output_names=["out"])


def swiglu_halves(h: mx.array) -> mx.array:
    """`silu(gate) * up` of `h = [gate | up]`, in one launch on CUDA.

    Args:
        h (mx.array): [B, 2 * I], the fused gate/up projection's output (gate first),
            float16/bfloat16/float32, row-contiguous.

    Returns:
        mx.array: [B, I] in h's dtype.

    Raises:
        ValueError: h is not [B, 2 * I].
    """
    if h.ndim != 2 or h.shape[1] % 2:
        raise ValueError(f"swiglu_halves takes [B, 2 * I], got {h.shape}")
    width = h.shape[1] // 2
    if not cuda_kv.is_available():
        return swiglu(h[:, :width], h[:, width:])
    threads = min(256, (width + 31) // 32 * 32)
    (out,) = _kernel()(inputs=[h], template=[("T", h.dtype), ("I", width)],
                       grid=(-(-width // threads) * threads, h.shape[0], 1), threadgroup=(threads, 1, 1),
                       output_shapes=[(h.shape[0], width)], output_dtypes=[h.dtype])
    return out
