"""The decode step's q, k, v from the fused projection, q/k RMSNorm and RoPE in one launch.

After a fused QKV projection a Llama-style decode step splits the output into query, key and
value heads, RMS-normalizes q and k per head (Qwen3) and rotates them (RoPE): on MLX that is a
reshape, three slices and two to four kernels per layer, each costing host launch time (issue
10). Where MLX's CUDA backend is the default device, `split_qkv_rope` does it all in one
kernel; elsewhere it runs the same MLX ops the model would (`mx.fast.rms_norm`,
`mx.fast.rope`). In a decode window, `split_qkv_rope_store` also writes k and v (coded, in a
compressed layer) into their tail-pool rows in place: one launch where a scatter per pool and
its reshapes followed. The kernel mirrors MLX's CUDA RoPE (`theta = (scale * position) * inv_freq`,
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
from kernels.kv_format import LayerFormat
from kernels.paged_attention import uses_cuda

# One block of BT >= D / 2 threads per head vector n = b * NV + j (NV = H + 2 * KV): j < H a query,
# j < H + KV a key, else a value. Thread i < D / 2 holds elements i and i + D / 2 (threads past them, a coded
# launch's extra search warps, hold none). `KEY_OUT` / `VALUE_OUT` (below) say where keys and values go: out as
# they are, or into shared memory `y` for `_ENCODE`.
_SOURCE = r"""
  constexpr int NT = D / 2;
  const int n = blockIdx.x, b = n / NV, j = n % NV, i = threadIdx.x;
  const bool is_q = j < H, is_k = !is_q && j < H + KV, holds = BT == NT || i < NT;
  const T* src = qkv + (size_t)n * D;
  float a = holds ? static_cast<float>(src[i]) : 0.f, c = holds ? static_cast<float>(src[i + NT]) : 0.f;
  PROLOGUE
  __shared__ float x[D];
  __shared__ float ss[NT];
  __shared__ float y[ENC ? D : 1];  // ENC: this key's or value's elements, as rounded to T, to be coded
  if (!is_q && !is_k) {  // a value head
    VALUE_OUT
  } else {
    if ((is_q && QNORM) || (is_k && KNORM)) {  // y = w * T(x * rsqrt(mean(x^2) + eps)), as MLX rounds
      if (holds) ss[i] = fmaf(a, a, c * c);
      __syncthreads();
      if (i == 0) {
        float total = 0.f;
        for (int k = 0; k < NT; ++k) total += ss[k];
        ss[0] = rsqrtf(total / D + fp[is_q ? 2 : 3]);
      }
      __syncthreads();
      const float inv = ss[0];
      const T* w = is_q ? qw : kw;
      if (holds) {  // w holds D elements
        a = static_cast<float>(static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(static_cast<T>(a * inv))));
        c = static_cast<float>(static_cast<T>(static_cast<float>(w[i + NT]) *
                                              static_cast<float>(static_cast<T>(c * inv))));
      }
    }
    if (holds) {
      x[i] = a;
      x[i + NT] = c;
    }
    __syncthreads();
    T* dst = is_q ? qo + ((size_t)b * H + j) * D : KEY_OUT;
    auto put = [&](int e, T r) {  // element e of the output: a query's or key's row, or `y` (ENC keys)
      if (ENC && !is_q) y[e] = static_cast<float>(r); else dst[e] = r;
    };
    if (holds && i < DIMS / 2) {  // pair i: (i, i + DIMS / 2), traditional (2i, 2i + 1)
      const int i1 = TRAD ? 2 * i : i, i2 = TRAD ? 2 * i + 1 : i + DIMS / 2;
      const float inv_freq = HAS_FREQS ? static_cast<float>(1.0 / static_cast<double>(freqs[i]))
                                       : exp2f(-(static_cast<float>(i) / static_cast<float>(DIMS / 2)) * fp[1]);
      const float theta = (fp[0] * static_cast<float>(pos[b])) * inv_freq;
      const float ct = cosf(theta), st = sinf(theta);
      const float x1 = x[i1], x2 = x[i2];
      put(i1, static_cast<T>(x1 * ct - x2 * st));
      put(i2, static_cast<T>(x1 * st + x2 * ct));
    } else if (holds) {  // past the rotated dims: two elements passed through
      const int e = DIMS + 2 * (i - DIMS / 2);
      put(e, static_cast<T>(x[e]));
      put(e + 1, static_cast<T>(x[e + 1]));
    }
  }
"""
def _direct(key_row: str, value_row: str) -> dict[str, str]:
    """`_SOURCE`'s markers for keys and values written as they are, at the given row pointers."""
    return {"PROLOGUE": "", "VALUE_OUT": f"""T* dst = {value_row};
    dst[i] = src[i];
    dst[i + NT] = src[i + NT];
    return;  // no barrier below is reached by a value block""", "KEY_OUT": key_row}


_PASS = _direct("ko + ((size_t)b * KV + (j - H)) * D", "vo + ((size_t)b * KV + (j - H - KV)) * D")
# In place: a raw layer's key and value go straight into their pool rows `wrows[b * KV + h]` (inputs that
# MLX passes as const: see `split_qkv_rope_store` for why writing them is sound).
_STORE_RAW = _direct("const_cast<T*>(kpool) + (size_t)wrows[b * KV + (j - H)] * D",
                     "const_cast<T*>(vpool) + (size_t)wrows[b * KV + (j - H - KV)] * D")
# Coded: a key or value block stages its part's search table and rotation signs
# (`kernels.cuda_kv.codec_constants`) beside its q/k/v loads, so all wait one memory latency together,
# then leaves its rotated vector in `y` for `_ENCODE`. A key block's search lanes load their dims of the key mean
# (CENTER) there too: issued after the RoPE, that load's latency was the coding's to wait.
_CODE = {"VALUE_OUT": "if (holds) {\n      y[i] = a;\n      y[i + NT] = c;\n    }", "KEY_OUT": "nullptr", "PROLOGUE": r"""
  constexpr int KT = table_floats(KMODE, KBITS, NG), VT = table_floats(VMODE, VBITS, NG);
  float km[D / 32];  // CENTER, a key block's lane i % 32 of its first WD * WG warps: its dims of the key mean
  if (CENTER && is_k && i < 32 * WD * WG) {
#pragma unroll
    for (int e = 0; e < D / 32; ++e) km[e] = kmean[(j - H) * D + (i % 32) * (D / 32) + e];
  }
  constexpr int TMAX = KT > VT ? KT : VT;
  __shared__ float stab[TMAX > 0 ? TMAX : 1];
  __shared__ float ssign[D];
  if (!is_q) {  // block-uniform
    const int nt = is_k ? KT : VT;
    const float* tab = codec + 2 * D + (is_k ? 0 : KT);
#pragma unroll
    for (int u = 0; u < (TMAX + BT - 1) / BT; ++u) {  // unrolled: a thread's loads fly together
      const int t = i + u * BT;
      if (t < nt) stab[t] = tab[t];
    }
    if (holds) {
      ssign[i] = codec[(is_k ? 0 : D) + i];
      ssign[i + NT] = codec[(is_k ? 0 : D) + i + NT];
    }
  }"""}

# `_SOURCE` with ENC: key and value blocks then code their vector into its pool row: the block's first
# WD * WG warps (`kernels.cuda_kv.decode_encode_warps`), each holding all of `y`, lane j dims
# [j * E, j * E + E) (E = D / 32), subtract the key mean (CENTER, loaded in the prologue) and run
# `encode_part` (`kernels.cuda_source`), as `ENCODE` does on the same values but with the gain search
# spread over WG warps: a key and a value of one row are coded by two blocks into disjoint words and halves.
_ENCODE = r"""
  if (is_q) return;  // block-uniform: no barrier follows for a query block
  constexpr int E = D / 32;
  constexpr int W = WD * WG;
  static_assert(W * 32 <= BT, "the block holds the part's warps");
  const int h = is_k ? j - H : j - H - KV, lane = i % 32;
  __syncthreads();  // y, the signs and the search table staged
  if (i >= 32 * W) return;
  float xe[E];
#pragma unroll
  for (int e = 0; e < E; ++e) xe[e] = CENTER && is_k ? y[lane * E + e] - km[e] : y[lane * E + e];
  __shared__ uint32_t sidx[D];
  __shared__ float red[W * 2 * NG];
  uint32_t* row = const_cast<uint32_t*>(pool) + (size_t)wrows[b * KV + h] * ROWW;  // in place
  __half* meta = reinterpret_cast<__half*>(row + MOFF);
  if (is_k) {
    encode_part<KMODE, KBITS, KGS, D, NG, WD, WG>(xe, lane, i / 32, 1, ssign, stab, sidx, red, row, meta);
  } else {
    encode_part<VMODE, VBITS, VGS, D, NG, WD, WG>(xe, lane, i / 32, 1, ssign, stab, sidx, red, row + KWORDS, meta + KMH);
    if (PADMETA && i == 0) meta[KMH + VMH] = __float2half(0.f);
  }
"""


def _source(parts: dict[str, str]) -> str:
    out = _SOURCE
    for marker, text in parts.items():
        out = out.replace(marker, text)
    return out


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


_ROPE_INPUTS = ("qkv", "pos", "freqs", "qw", "kw", "fp")


@functools.cache
def _kernel():
    return cuda_kv.custom_kernel("bm_qkv_rope", _source(_PASS), input_names=list(_ROPE_INPUTS),
                                 output_names=["qo", "ko", "vo"])


@functools.cache
def _store_kernel(coded: bool):
    """The in-place kernel: q out; k and v into pool rows as they are (raw) or coded (`_ENCODE`)."""
    if not coded:
        return cuda_kv.custom_kernel("bm_qkv_rope_store", _source(_STORE_RAW),
                                     input_names=[*_ROPE_INPUTS, "kpool", "vpool", "wrows"], output_names=["qo"])
    return cuda_kv.custom_kernel(
        "bm_qkv_rope_encode", _source(_CODE) + _ENCODE,
        input_names=[*_ROPE_INPUTS, "pool", "wrows", "codec", "kmean"],
        output_names=["qo"])


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
    batch, heads = _check(qkv, n_heads, n_kv_heads, head_dim, offset, q_norm, k_norm)
    if not cuda_kv.is_available() or head_dim % 2 or rope.dims % 2 or rope.dims > head_dim:
        x = qkv.reshape(batch, heads, 1, head_dim)
        q, k, v = x[:, :n_heads], x[:, n_heads: n_heads + n_kv_heads], x[:, n_heads + n_kv_heads:]
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return rope.apply(q, offset), rope.apply(k, offset), v
    inputs, template = _rope_args(qkv, n_heads, n_kv_heads, head_dim, rope, offset, q_norm, k_norm)
    return tuple(_kernel()(
        inputs=inputs, template=[*template, ("ENC", False), ("BT", head_dim // 2)],
        grid=(batch * heads * (head_dim // 2), 1, 1), threadgroup=(head_dim // 2, 1, 1),
        output_shapes=[(batch, n_heads, 1, head_dim), (batch, n_kv_heads, 1, head_dim),
                       (batch, n_kv_heads, 1, head_dim)],
        output_dtypes=[qkv.dtype] * 3,
    ))


def stores(fmt: LayerFormat, head_dim: int, rope: RopeSpec, dtype: mx.Dtype) -> bool:
    """Whether `split_qkv_rope_store` serves a layer: a format the fused CUDA attention reads
    (`kernels.paged_attention.uses_cuda`: its kernel takes q, so it runs after the write; the MLX-ops
    path's page gathers do not, and could read the rows before they are written), a RoPE the kernel
    applies, and raw pools head_dim wide in the activations' dtype, or compressed rows of head_dim >= 64
    (the block's first warps code each vector)."""
    if not uses_cuda(fmt) or fmt.key_dim != head_dim or head_dim % 2 or rope.dims % 2 or rope.dims > head_dim:
        return False
    return fmt.key.dtype == fmt.value.dtype == dtype if fmt.is_raw else head_dim >= 64


def split_qkv_rope_store(
    qkv: mx.array,
    fmt: LayerFormat,
    key_mean: mx.array | None,
    pools: tuple[mx.array, ...],
    rows: mx.array,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    rope: RopeSpec,
    offset: int | mx.array,
    q_norm: nn.RMSNorm | None = None,
    k_norm: nn.RMSNorm | None = None,
) -> mx.array:
    """`split_qkv_rope`'s queries; its keys and values written into their pool rows in the same launch, in place.

    A raw layer's k and v land as `split_qkv_rope` returns them; a compressed layer's are coded into one row
    each, equal bit for bit to `kernels.cuda_kv.encode_rows(fmt, k, v, key_mean)` (the same values through
    the same `encode_part`). One launch, where the split, the coding and a scatter per pool took three to
    five primitives a layer, each costing host time at every decode step (issue 10).

    In place: MLX arrays are values, and this kernel writes into `pools`, which MLX passes it as read-only
    inputs and still considers unchanged. That is sound only as the decode window uses it
    (`services.engine.cache.decode_window`): the pools are row-contiguous buffers (MLX hands them over
    uncopied: evaluated arrays, which the window's tail copy, `kernels.pool_move`, wrote in place before) that their
    owner keeps alive and no other array shares; every read of the written rows depends on the
    returned q (the step's attention) or comes in a later evaluation (the copy back to the main pages
    does); and nothing evaluated together with this launch reads those rows without such a dependency
    (MLX orders a graph's kernels only by the data they pass). `stores` admits only layers whose attention is
    the fused CUDA kernel, which takes q.

    Args:
        qkv, n_heads, n_kv_heads, head_dim, rope, offset, q_norm, k_norm: As `split_qkv_rope`.
        fmt (LayerFormat): The layer's format (`stores` must hold).
        key_mean (mx.array | None): float32 [n_kv_heads, 1, head_dim], row-contiguous: compressed keys are
            coded centered on it (`services.engine.cache.centering`); None: as they come (raw: must be None).
        pools (tuple[mx.array, ...]): raw (K, V) `[R, head_dim]` in qkv's dtype, or (codes,) uint32
            `[R, row_words]`: pool rows `(h * pages + page) * P + slot` (`services.engine.cache.pool_rows`).
        rows (mx.array): int32 [B * n_kv_heads]: the pool row of kv head h of row b at `b * n_kv_heads + h`.

    Returns:
        mx.array: q [B, H, 1, D], normalized, RoPE applied, in qkv's dtype.

    Raises:
        ValueError: as `split_qkv_rope`; a layer `stores` does not serve; pools or rows of another shape or
            dtype; a key mean for a raw layer.
    """
    batch, heads = _check(qkv, n_heads, n_kv_heads, head_dim, offset, q_norm, k_norm)
    want = [(qkv.dtype, head_dim)] * 2 if fmt.is_raw else [(mx.uint32, fmt.row_words)]
    if [(p.dtype, p.shape[1] if p.ndim == 2 else None) for p in pools] != want:
        raise ValueError(f"pools must be {len(want)} of [R, width] (dtype, width) {want}, got "
                         f"{[(p.dtype, p.shape) for p in pools]}")
    if rows.dtype != mx.int32 or rows.shape != (batch * n_kv_heads,):
        raise ValueError(f"rows must be int32 [{batch * n_kv_heads}], got {rows.dtype} {rows.shape}")
    if fmt.is_raw and key_mean is not None:
        raise ValueError("raw layers store keys as they come: no key mean")
    if not stores(fmt, head_dim, rope, qkv.dtype):
        raise ValueError(f"the in-place q/k/v kernel serves CUDA, raw pools in the activations' dtype or compressed "
                         f"regular formats of head_dim >= 64; got {fmt} at head_dim {head_dim}, {qkv.dtype}")
    inputs, template = _rope_args(qkv, n_heads, n_kv_heads, head_dim, rope, offset, q_norm, k_norm)
    shape = dict(output_shapes=[(batch, n_heads, 1, head_dim)], output_dtypes=[qkv.dtype])
    if fmt.is_raw:
        threads = head_dim // 2
        (q,) = _store_kernel(False)(inputs=[*inputs, *pools, rows],
                                    template=[*template, ("ENC", False), ("BT", threads)],
                                    grid=(batch * heads * threads, 1, 1), threadgroup=(threads, 1, 1), **shape)
        return q
    code_inputs, code_template = cuda_kv.encoder_args(fmt, head_dim, key_mean)
    dims, gains = cuda_kv.decode_encode_warps(fmt, head_dim)
    threads = max(head_dim // 2, 32 * dims * gains)  # a vector's elements, or its search warps
    (q,) = _store_kernel(True)(
        inputs=[*inputs, pools[0], rows, *code_inputs],
        template=[*template, ("ENC", True), ("BT", threads), ("WD", dims), ("WG", gains),
                  *[arg for arg in code_template if arg[0] != "D"]],
        grid=(batch * heads * threads, 1, 1), threadgroup=(threads, 1, 1), **shape)
    return q


def _check(qkv, n_heads, n_kv_heads, head_dim, offset, q_norm, k_norm) -> tuple[int, int]:
    """(B, heads in qkv) after `split_qkv_rope`'s argument checks (its Raises)."""
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
    return batch, heads


def _rope_args(qkv, n_heads, n_kv_heads, head_dim, rope, offset, q_norm, k_norm) -> tuple[list, list]:
    """The inputs and template arguments (but `ENC`) of the q/k/v kernels."""
    batch = qkv.shape[0]
    norm = q_norm is not None
    pos = mx.full((batch,), offset, mx.int32) if not isinstance(offset, mx.array) or offset.ndim == 0 else offset
    inputs = [qkv, pos if pos.dtype == mx.int32 else pos.astype(mx.int32),
              rope.freqs if rope.freqs is not None else _one(mx.float32),
              q_norm.weight if norm else _one(qkv.dtype), k_norm.weight if norm else _one(qkv.dtype),
              _params(rope.scale, rope.base, q_norm.eps if norm else 0.0, k_norm.eps if norm else 0.0)]
    template = [("T", qkv.dtype), ("D", head_dim), ("H", n_heads), ("KV", n_kv_heads),
                ("NV", n_heads + 2 * n_kv_heads), ("DIMS", rope.dims), ("TRAD", rope.traditional),
                ("HAS_FREQS", rope.freqs is not None), ("QNORM", norm), ("KNORM", norm)]
    return inputs, template
