"""The decode step's q, k, v from the fused projection, q/k RMSNorm and RoPE in one launch.

After a fused QKV projection a Llama-style decode step splits the output into query, key and
value heads, RMS-normalizes q and k per head (Qwen3) and rotates them (RoPE): on MLX that is a
reshape, three slices and two to four kernels per layer, each costing host launch time (issue
10). Where MLX's CUDA backend is the default device, `split_qkv_rope` does it all in one
kernel; elsewhere it runs the same MLX ops the model would (`mx.fast.rms_norm`,
`mx.fast.rope`). The kernel mirrors MLX's CUDA RoPE (`theta = (scale * position) * inv_freq`,
`inv_freq = 2^(-i / (dims / 2) * log2(base))` or `1 / freqs[i]`, float32 math, precise
`cos`/`sin`) and rounds as MLX does; its RMSNorm sums squares in another order than
`mx.fast.rms_norm`, so a normalized value may differ in its last bit.

Source: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021);
Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019); MLX's
`mlx/backend/cuda/rope.cu` (the numerics mirrored).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import Llama3RoPE

from kernels import cuda_kv

_SOURCE = r"""
  // One block of D / 2 threads per head vector n = b * NV + j (NV = H + 2 * KV): j < H a query,
  // j < H + KV a key, else a value. Thread i holds elements i and i + D / 2.
  constexpr int NT = D / 2;
  const int n = blockIdx.x, b = n / NV, j = n % NV, i = threadIdx.x;
  const bool is_q = j < H, is_k = !is_q && j < H + KV;
  const T* src = qkv + (size_t)n * D;
  float a = static_cast<float>(src[i]), c = static_cast<float>(src[i + NT]);
  if (!is_q && !is_k) {  // a value head: copied
    T* dst = vo + ((size_t)b * KV + (j - H - KV)) * D;
    dst[i] = src[i];
    dst[i + NT] = src[i + NT];
    return;  // no barrier below is reached by a value block
  }
  __shared__ float x[D];
  __shared__ float ss[NT];
  if ((is_q && QNORM) || (is_k && KNORM)) {  // y = w * T(x * rsqrt(mean(x^2) + eps)), as MLX rounds
    ss[i] = fmaf(a, a, c * c);
    __syncthreads();
    if (i == 0) {
      float total = 0.f;
      for (int k = 0; k < NT; ++k) total += ss[k];
      ss[0] = rsqrtf(total / D + fp[is_q ? 2 : 3]);
    }
    __syncthreads();
    const float inv = ss[0];
    const T* w = is_q ? qw : kw;
    a = static_cast<float>(static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(static_cast<T>(a * inv))));
    c = static_cast<float>(static_cast<T>(static_cast<float>(w[i + NT]) *
                                          static_cast<float>(static_cast<T>(c * inv))));
  }
  x[i] = a;
  x[i + NT] = c;
  __syncthreads();
  T* dst = is_q ? qo + ((size_t)b * H + j) * D : ko + ((size_t)b * KV + (j - H)) * D;
  if (i < DIMS / 2) {  // pair i: (i, i + DIMS / 2), traditional (2i, 2i + 1)
    const int i1 = TRAD ? 2 * i : i, i2 = TRAD ? 2 * i + 1 : i + DIMS / 2;
    const float inv_freq = HAS_FREQS ? static_cast<float>(1.0 / static_cast<double>(freqs[i]))
                                     : exp2f(-(static_cast<float>(i) / static_cast<float>(DIMS / 2)) * fp[1]);
    const float theta = (fp[0] * static_cast<float>(pos[b])) * inv_freq;
    const float ct = cosf(theta), st = sinf(theta);
    const float x1 = x[i1], x2 = x[i2];
    dst[i1] = static_cast<T>(x1 * ct - x2 * st);
    dst[i2] = static_cast<T>(x1 * st + x2 * ct);
  } else {  // past the rotated dims: two elements passed through
    const int e = DIMS + 2 * (i - DIMS / 2);
    dst[e] = static_cast<T>(x[e]);
    dst[e + 1] = static_cast<T>(x[e + 1]);
  }
"""


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """The `mx.fast.rope` parameters of a model's RoPE module.

    Attributes:
        dims (int): Rotated dims (the first `dims` of each head; the rest pass through).
        traditional (bool): Rotate adjacent pairs (2i, 2i + 1) instead of (i, i + dims / 2).
        scale (float): Position scale.
        base (float | None): Frequency base (None when `freqs` is given).
        freqs (mx.array | None): float32 [dims / 2] wavelength factors (`inv_freq = 1 / freqs`), or None.
    """

    dims: int
    traditional: bool
    scale: float
    base: float | None
    freqs: mx.array | None

    @classmethod
    def of(cls, module: nn.Module) -> RopeSpec | None:
        """The spec of mlx's `nn.RoPE` or mlx-lm's `Llama3RoPE`; None for any other RoPE (YaRN, LongRoPE, ...)."""
        if type(module) is nn.RoPE:
            return cls(module.dims, module.traditional, float(module.scale), float(module.base), None)
        if type(module) is Llama3RoPE:
            return cls(module.dims, module.traditional, 1.0, None, module._freqs.astype(mx.float32))
        return None

    def apply(self, x: mx.array, offset: int | mx.array) -> mx.array:
        """`mx.fast.rope` of x [B, heads, L, D] at positions `offset + l` (offset: an int or int32 [B])."""
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale,
                            offset=offset, freqs=self.freqs)


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(name="bm_qkv_rope", input_names=["qkv", "pos", "freqs", "qw", "kw", "fp"],
                               output_names=["qo", "ko", "vo"], source=_SOURCE)


@functools.cache
def _params(scale: float, base: float | None, q_eps: float, k_eps: float) -> mx.array:
    return mx.array([scale, math.log2(base) if base else 0.0, q_eps, k_eps], mx.float32)


@functools.cache
def _one(dtype: mx.Dtype) -> mx.array:
    return mx.ones((1,), dtype)


def split_qkv_rope(
    qkv: mx.array,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    rope: RopeSpec,
    offset: int | mx.array,
    q_norm: nn.RMSNorm | None = None,
    k_norm: nn.RMSNorm | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """Queries and keys (normalized, rotated) and values of one token per row.

    Args:
        qkv (mx.array): [B, (n_heads + 2 * n_kv_heads) * head_dim], the fused projection's output
            (heads in the order q, k, v), float16/bfloat16/float32, row-contiguous.
        n_heads, n_kv_heads, head_dim (int): H, KV, D.
        rope (RopeSpec): The model's RoPE.
        offset (int | mx.array): Each row's position: an int, or int32 [B] (hot paths: an int costs a launch
            on CUDA to spread it over the rows).
        q_norm, k_norm (nn.RMSNorm | None): Per-head RMSNorm of queries and keys (Qwen3), both or neither,
            weights in qkv's dtype.

    Returns:
        tuple: q [B, H, 1, D], k [B, KV, 1, D] (RoPE applied) and v [B, KV, 1, D], in qkv's dtype.

    Raises:
        ValueError: qkv is not [B, (H + 2 KV) D], only one of the norms is given, a norm weight is in another
            dtype, or offset is an array of another shape than [B].
    """
    heads = n_heads + 2 * n_kv_heads
    if qkv.ndim != 2 or qkv.shape[1] != heads * head_dim:
        raise ValueError(f"qkv must be [B, ({n_heads} + 2 * {n_kv_heads}) * {head_dim}], got {qkv.shape}")
    batch = qkv.shape[0]
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together (Qwen3) or not at all")
    if q_norm is not None and not q_norm.weight.dtype == k_norm.weight.dtype == qkv.dtype:
        raise ValueError(f"q/k norm weights must be in qkv's dtype {qkv.dtype}, got {q_norm.weight.dtype}, "
                         f"{k_norm.weight.dtype}")
    if isinstance(offset, mx.array) and offset.shape not in ((), (batch,)):
        raise ValueError(f"offset must be an int or int32 [{batch}], got shape {offset.shape}")
    if not cuda_kv.is_available() or head_dim % 2 or rope.dims % 2 or rope.dims > head_dim:
        x = qkv.reshape(batch, heads, 1, head_dim)
        q, k, v = x[:, :n_heads], x[:, n_heads: n_heads + n_kv_heads], x[:, n_heads + n_kv_heads:]
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return rope.apply(q, offset), rope.apply(k, offset), v
    norm = q_norm is not None
    pos = mx.full((batch,), offset, mx.int32) if not isinstance(offset, mx.array) or offset.ndim == 0 else offset
    return tuple(_kernel()(
        inputs=[qkv, pos if pos.dtype == mx.int32 else pos.astype(mx.int32), rope.freqs if rope.freqs is not None else _one(mx.float32),
                q_norm.weight if norm else _one(qkv.dtype), k_norm.weight if norm else _one(qkv.dtype),
                _params(rope.scale, rope.base, q_norm.eps if norm else 0.0, k_norm.eps if norm else 0.0)],
        template=[("T", qkv.dtype), ("D", head_dim), ("H", n_heads), ("KV", n_kv_heads), ("NV", heads),
                  ("DIMS", rope.dims), ("TRAD", rope.traditional), ("HAS_FREQS", rope.freqs is not None),
                  ("QNORM", norm), ("KNORM", norm)],
        grid=(batch * heads * (head_dim // 2), 1, 1), threadgroup=(head_dim // 2, 1, 1),
        output_shapes=[(batch, n_heads, 1, head_dim), (batch, n_kv_heads, 1, head_dim),
                       (batch, n_kv_heads, 1, head_dim)],
        output_dtypes=[qkv.dtype] * 3,
    ))
