"""One row's projection with its neighbours folded in: RMSNorm or SwiGLU before, the residual add after.

At single-stream decode a Llama layer runs four projections of one activation row, and between them
an RMSNorm after each residual add and a SwiGLU: small launches, each costing the GPU ~3–5 µs and
the host one more primitive (issue 10; `ops/results/gpu_time_llama-1b_32k_long_tiles.json`: 48 such
launches a llama-1b step, ~190 µs of GPU time). `gemv` projects one row and computes its input
(`x` itself, `rms_norm(x) * nw`, or `silu(gate) * up` of a fused gate/up output) as it goes, and
can add the residual stream to its output, so a layer needs no norm or SwiGLU launch. Where MLX's
CUDA backend is the default device it is one kernel; elsewhere MLX ops.

The kernel is shaped as MLX's own gemv (`gemv_single`: a block of 8 warps, a weight row a warp, a
block per 8 rows, so nothing holds a block back and many warps are resident): a lane loads 16-byte
words `lane + 32 i` of its row (a warp reads 512 contiguous bytes), its first words issued before
the input is prepared. The norm's sum of squares is taken by every warp itself (4 KB from L1), and
the normalized input formed word by word, so no warp waits for another (`ops/results/gemv_sweep_gpu.json`:
staging it once a block in shared memory behind a barrier, or striding a few blocks per SM over the
rows, ran q/k/v and gate/up 1.4–2.8x slower than MLX's gemv); SwiGLU, a sigmoid a product, is staged
once a block. Sums are float32; the input is rounded to the dtype as the unfused ops round it (norm:
MLX's `rms_norm` arithmetic, as `kernels.fused_norm`; SwiGLU: MLX's `Sigmoid` in the dtype, as
`kernels.swiglu`), and the residual add rounds the product first (`T(res + T(sum))`, MLX's add of
two dtype arrays), so the fused and unfused forms differ only in summation order.

Sources: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019); Shazeer, "GLU Variants
Improve Transformer" (2020).
"""

from __future__ import annotations

import functools

import mlx.core as mx
from mlx_lm.models.activations import swiglu as mlx_swiglu

from kernels import cuda_kv

MAX_K = 16384  # input width at most (the staged SwiGLU row: 32 KB of shared memory)
_WARPS = 8  # a block: one weight row a warp

_HEAD = r"""
  // out[0, n] = epilogue(sum_k a[k] * w[n, k]). Warp: weight row n; lane: 16-byte words lane + 32 i of it (a warp
  // reads 512 contiguous bytes a load), U at once, the first U issued before the input is prepared. act(i): the
  // lane's word i of the input a, as 8 T.
  static_assert(sizeof(T) == 2 && K % 256 == 0, "fp16/bf16, K in whole 256-element steps");
  constexpr int NV = K / 8;   // 16-byte words of a row
  constexpr int J = K / 256;  // words a lane takes of a row
  constexpr int U = J % 8 == 0 ? 8 : (J % 4 == 0 ? 4 : (J % 2 == 0 ? 2 : 1));
  const int lane = threadIdx.x & 31;
  const int N = w_shape[0];
  const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const uint4* wv = reinterpret_cast<const uint4*>(w) + (size_t)(n < N ? n : 0) * NV + lane;
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  uint4 cur[U];
#pragma unroll
  for (int u = 0; u < U; ++u) cur[u] = __ldg(wv + 32 * u);
"""

_STAGE = {
    "copy": r"""
  auto act = [&](int i) { return __ldg(x4 + lane + 32 * i); };
""",
    "norm": r"""
  // a = T(nw * T(x * rsqrt(mean(x^2) + eps))), MLX's rms_norm arithmetic (kernels.fused_norm's); each warp sums
  // the squares itself (a butterfly: every lane gets the same total), so no block waits on another warp
  const uint4* nw4 = reinterpret_cast<const uint4*>(nw);
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < J; ++i) {
    T e[8];
    const uint4 u = __ldg(x4 + lane + 32 * i);
    memcpy(e, &u, 16);
#pragma unroll
    for (int j = 0; j < 8; ++j) ss = fmaf(static_cast<float>(e[j]), static_cast<float>(e[j]), ss);
  }
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  const float inv = rsqrtf(ss / K + eps[0]);
  auto act = [&](int i) {
    T e[8], s[8], o[8];
    const uint4 u = __ldg(x4 + lane + 32 * i), g = __ldg(nw4 + lane + 32 * i);
    memcpy(e, &u, 16);
    memcpy(s, &g, 16);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      o[j] = static_cast<T>(static_cast<float>(s[j]) * static_cast<float>(static_cast<T>(static_cast<float>(e[j]) * inv)));
    uint4 r;
    memcpy(&r, o, 16);
    return r;
  };
""",
    "swiglu": r"""
  // a = silu(x[k]) * x[K + k] in T's arithmetic with MLX's Sigmoid (kernels.swiglu's), once a block in shared
  // memory (a sigmoid a warp would cost more than the row's loads)
  __shared__ __align__(16) T staged[K];
  uint4* staged4 = reinterpret_cast<uint4*>(staged);
  for (int v = threadIdx.x; v < NV; v += blockDim.x) {
    T g[8], p[8], o[8];
    const uint4 a = x4[v], b = x4[NV + v];
    memcpy(g, &a, 16);
    memcpy(p, &b, 16);
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = (g[j] * Sigmoid{}(g[j])) * p[j];
    memcpy(&staged4[v], o, 16);
  }
  __syncthreads();
  auto act = [&](int i) { return staged4[lane + 32 * i]; };
""",
}

_LOOP = r"""
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
      const uint4 av = act(c + u);
      memcpy(a, &av, 16);
      memcpy(b, &cur[u], 16);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc = fmaf(static_cast<float>(a[j]), static_cast<float>(b[j]), acc);
    }
  }
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) out[n] = EPILOGUE;
"""

_EPILOGUE = {False: "static_cast<T>(acc)",
             True: "static_cast<T>(static_cast<float>(res[n]) + static_cast<float>(static_cast<T>(acc)))"}
_SIGMOID_HEADER = '#include "mlx/backend/cuda/device/unary_ops.cuh"\n'  # MLX's elementwise functors

@functools.cache
def _kernel(stage: str, residual: bool):
    names = ["x", "w"] + (["nw", "eps"] if stage == "norm" else []) + (["res"] if residual else [])
    source = _HEAD + _STAGE[stage] + _LOOP.replace("EPILOGUE", _EPILOGUE[residual])
    header = _SIGMOID_HEADER if stage == "swiglu" else ""
    return cuda_kv.custom_kernel(f"bm_gemv_{stage}{'_res' if residual else ''}", source, header, input_names=names,
                                 output_names=["out"])


@functools.cache
def _eps(value: float) -> mx.array:
    return mx.array([value], mx.float32)


def takes(weight: mx.array) -> bool:
    """Whether the kernel projects one row through `weight` [N, K]: MLX's CUDA backend, fp16/bf16, K a
    multiple of 256 and at most `MAX_K`."""
    if weight.ndim != 2 or weight.dtype not in (mx.float16, mx.bfloat16):
        return False
    return weight.shape[1] % 256 == 0 and weight.shape[1] <= MAX_K and cuda_kv.is_available()


def serves(x: mx.array, weight: mx.array, swiglu: bool = False) -> bool:
    """Whether `gemv(x, weight, ...)` runs as one kernel: `takes(weight)` and x one row of its dtype and width."""
    if x.ndim != 2 or x.shape[0] != 1 or weight.ndim != 2 or x.shape[1] != weight.shape[1] * (2 if swiglu else 1):
        return False
    return x.dtype == weight.dtype and takes(weight)


def gemv(x: mx.array, weight: mx.array, *, norm: tuple[mx.array, float] | None = None, swiglu: bool = False,
         residual: mx.array | None = None) -> mx.array:
    """`residual + a @ weight.T` for one row, where `a` is `x`, `rms_norm(x) * nw` or `silu(gate) * up`.

    Args:
        x (mx.array): [1, K] activations, or [1, 2 * K] (`swiglu`: gate first, then up), float16/bfloat16 on
            the kernel path (any float dtype through MLX ops), row-contiguous.
        weight (mx.array): [N, K] (an `nn.Linear` weight as stored), x's dtype.
        norm (tuple[mx.array, float] | None): The RMSNorm to apply to `x` first: its [K] weight (x's dtype)
            and eps.
        swiglu (bool): Take `silu(x[:, :K]) * x[:, K:]` as the input (MLX's `Sigmoid`, in the dtype).
        residual (mx.array | None): [1, N], x's dtype, added to the rounded product.

    Returns:
        mx.array: [1, N] in x's dtype (float32 sums, rounded once; plus `residual`, rounded again).

    Raises:
        ValueError: both `norm` and `swiglu`, or shapes that do not fit as described.
    """
    k = weight.shape[-1]
    if norm is not None and swiglu:
        raise ValueError("gemv takes a norm or a SwiGLU before the projection, not both")
    if x.ndim != 2 or x.shape[0] != 1 or weight.ndim != 2 or x.shape[1] != k * (2 if swiglu else 1):
        raise ValueError(f"gemv takes x [1, {'2 * ' if swiglu else ''}K] and weight [N, K]; got {x.shape}, "
                         f"{weight.shape}")
    if norm is not None and norm[0].shape != (k,):
        raise ValueError(f"gemv's norm weight must be [{k}], got {norm[0].shape}")
    if residual is not None and residual.shape != (1, weight.shape[0]):
        raise ValueError(f"gemv's residual must be [1, {weight.shape[0]}], got {residual.shape}")
    if not serves(x, weight, swiglu):
        a = mx.fast.rms_norm(x, norm[0], norm[1]) if norm is not None else x
        a = mlx_swiglu(x[:, :k], x[:, k:]) if swiglu else a
        y = a @ weight.T
        return y if residual is None else residual + y
    stage = "norm" if norm is not None else ("swiglu" if swiglu else "copy")
    inputs = [x, weight] + ([norm[0], _eps(float(norm[1]))] if norm is not None else [])
    inputs += [residual] if residual is not None else []
    blocks = -(-weight.shape[0] // _WARPS)
    (out,) = _kernel(stage, residual is not None)(
        inputs=inputs, template=[("T", x.dtype), ("K", k)],
        grid=(blocks * 32 * _WARPS, 1, 1), threadgroup=(32 * _WARPS, 1, 1),
        output_shapes=[(1, weight.shape[0])], output_dtypes=[x.dtype])
    return out
