"""Compressed codecs: affine (per-group scale + bias) and AURA (rotation + Lloyd-Max codebook).

Attention paths. `KVCache` hands attention either decoded K/V (then `mx.fast` SDPA) or,
where `attends_packed` says so, the packed affine fields (then `affine_attention`, two
`mx.quantized_matmul` calls as in mlx-lm's quantized SDPA). Measured with
`python -m ops.bench_kv --mode attention` on the CPU backend (2 cores, OpenBLAS, mlx 0.32.4),
one layer of the default model (9 query heads, 3 KV heads, head_dim 64, float32 queries,
float16 affine scales), median ms per call ("dq": dequantize + SDPA, "pk": packed):

| phase (queries) | T    | raw  | affine8 dq | affine8 pk | affine4 dq | affine4 pk | aura4v4 dq |
|-----------------|------|------|------------|------------|------------|------------|------------|
| decode (1)      | 512  | 0.17 | 0.61       | 0.50       | 1.05       | 0.70       | 1.55       |
| decode (1)      | 2048 | 0.77 | 2.04       | 1.52       | 2.61       | 1.52       | 6.53       |
| decode (1)      | 8192 | 2.30 | 12.2       | 6.72       | 15.1       | 5.55       | 38.0       |
| prefill (512)   | 512  | 35.9 | 37.8       | 153        | 36.5       | 147        | 40.3       |
| prefill (512)   | 2048 | 158  | 159        | 592        | 157        | 604        | 167        |
| prefill (512)   | 8192 | 618  | 674        | 2468       | 624        | 2430       | 659        |

So decode runs on the packed codes (no dequantized copy of the history is made at all) and
prefill dequantizes the live slice once per layer and uses the BLAS-backed SDPA: the packed
kernel is not BLAS-backed and loses about 4x there (a noisier sweep over 1, 2, 4 and 8
queries put the crossover between 4 and 8; `PACKED_MAX_QUERIES = 1` keeps the choice per
phase). AURA keeps the rotated-domain dequantize +
SDPA path in both phases: its codebook is not affine, so `quantized_matmul` does not apply,
and on this backend the codebook gather (`mx.take`, ~5.5 ns per element) dominates decode;
folding the per-vector scales into scores and probabilities instead of the dequantized
vectors measured no faster (31.1 against 32.9 ms at T = 8192).

Source: CACHES.md "Bytes per token" and "AURA encode / decode"; mlx-lm
`models/base.py::quantized_scaled_dot_product_attention`; TurboQuant (arXiv 2504.19874).
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from kernels.affine import AffineCodes, affine_dequantize, affine_quantize, bits_per_element
from kernels.aura import SCALE_DTYPE, AuraCodes, aura_decode_rotated, aura_encode
from kernels.rotation import RandomizedHadamard

from .codecs import Fields

AURA_SEED = 0x0A0A  # base of the per-layer rotation seeds; part of the stored format
AFFINE_SCALE_DTYPE = mx.float16  # affine scales and biases, whatever the model dtype
PACKED_MAX_QUERIES = 1  # most queries per call that attend on packed codes (see the table)


def dtype_name(dtype: mx.Dtype) -> str:
    """`mx.float16` -> `"float16"` (the spelling stored in codec meta)."""
    return str(dtype).removeprefix("mlx.core.")


class AffineCodec:
    """`mx.quantize` layout: packed uint32 codes and one float16 scale and bias per group.

    Scales and biases are stored as float16 whatever the model dtype. Against the float32
    the CPU model would otherwise give them, they save 0.5 bit per element at affine8/g64 and
    1.0 at affine4/g32 (8.5 and 5.0 bits, as CACHES.md counts), at no measurable cost on the
    default model (2048 Lee tokens, mean KL / top-1): affine8 0.00040 / 98.83% against
    0.00040 / 98.88% with float32, affine4 0.0615 / 86.67% against 0.0607 / 86.62%. bfloat16
    (a GPU model's dtype) would round an 8-bit reconstruction by up to ~2.5 steps (see
    `kernels.affine`); float16 keeps it under 0.2 step. Codes are chosen in float32; the
    float16 rounding of scale and bias adds at most `2**-11 * (q|s| + |b|)`. K/V elements
    must stay below float16's 65504 in magnitude (activations of every model we run do).

    Args:
        bits (int): Code width, 8 or 4 (also 2, 3, 5, 6).
        group_size (int): Elements per scale/bias group along head_dim (64 for 8 bits, 32 for 4).
        dtype (mx.Dtype): Model dtype of decoded tensors.
        scale_dtype (mx.Dtype): Storage dtype of scales and biases.
    """

    def __init__(self, bits: int, group_size: int, dtype: mx.Dtype, *, scale_dtype: mx.Dtype = AFFINE_SCALE_DTYPE):
        self.bits, self.group_size, self.dtype, self.scale_dtype = bits, group_size, dtype, scale_dtype
        self.name = f"affine{bits}"

    def encode(self, x: mx.array) -> Fields:
        """Fields of `x` [B, H, L, D]: packed uint32 [B, H, L, D*bits/32], scales and biases [B, H, L, D/group]."""
        codes = affine_quantize(x.astype(mx.float32), bits=self.bits, group_size=self.group_size)
        return codes.packed, codes.scales.astype(self.scale_dtype), codes.biases.astype(self.scale_dtype)

    def decode(self, fields: Fields) -> mx.array:
        """`scale * q + bias` [B, H, T, D] in the model dtype, formed in float32."""
        return affine_dequantize(self._float32(fields), bits=self.bits, group_size=self.group_size, dtype=self.dtype)

    def rotate_query(self, queries: mx.array) -> mx.array:
        return queries

    def unrotate_output(self, out: mx.array) -> mx.array:
        return out

    def bits_per_element(self, head_dim: int) -> float:
        return bits_per_element(self.bits, self.group_size, scale_bits=8 * self.scale_dtype.size)

    def meta(self) -> dict[str, str]:
        return {"codec": "affine", "bits": str(self.bits), "group_size": str(self.group_size),
                "scale_dtype": dtype_name(self.scale_dtype), "dtype": dtype_name(self.dtype)}

    @staticmethod
    def _float32(fields: Fields) -> AffineCodes:
        packed, scales, biases = fields
        return AffineCodes(packed, scales.astype(mx.float32), biases.astype(mx.float32))


class AuraCodec:
    """AURA: seeded randomized Hadamard rotation, Lloyd-Max indices, one fp16 scale per vector.

    Keys and values are read back in the rotated domain (no inverse rotation per cached
    token); the query is rotated by the key rotation and the attention output un-rotated by
    the value rotation, once per head (both rotations are orthogonal, so scores are exact).

    The scale is the norm-corrected `||x|| / ||c[idx]||` at every width. The plain
    `||x|| / sqrt(d)` has 1.7% lower MSE at 2 bits (d = 64), but on the default model it
    measured worse as a cache (2048 Lee tokens, mean KL): aura4v2 0.181 with plain value
    scales against 0.160, aura4v4 0.0545 plain against 0.0520. Keeping the norm exact matters
    more than the MSE, so there is one format for every width.

    Args:
        bits (int): Index bits per coordinate, 2..8.
        seed (int): Rotation seed (per layer and per K/V); part of the stored format.
        dtype (mx.Dtype): Model dtype of decoded tensors.

    Source: TurboQuant (arXiv 2504.19874) without QJL; CACHES.md "AURA encode / decode".
    """

    def __init__(self, bits: int, seed: int, dtype: mx.Dtype):
        self.bits, self.seed, self.dtype = bits, seed, dtype
        self.name = f"aura{bits}"
        self._rotation: RandomizedHadamard | None = None

    def rotation(self, head_dim: int) -> RandomizedHadamard:
        """The seeded rotation for vectors of `head_dim` (built once)."""
        if self._rotation is None or self._rotation.head_dim != head_dim:
            self._rotation = RandomizedHadamard(head_dim, self.seed)
        return self._rotation

    def encode(self, x: mx.array) -> Fields:
        """Fields of `x` [B, H, L, D]: packed uint32 [B, H, L, D*bits/32], float16 scales [B, H, L, 1]."""
        return tuple(aura_encode(x, bits=self.bits, rotation=self.rotation(x.shape[-1])))

    def decode(self, fields: Fields) -> mx.array:
        """`scale * c[idx]` [B, H, T, D] in the rotated domain, model dtype."""
        return aura_decode_rotated(AuraCodes(*fields), bits=self.bits, dtype=self.dtype)

    def rotate_query(self, queries: mx.array) -> mx.array:
        return self.rotation(queries.shape[-1]).forward(queries)

    def unrotate_output(self, out: mx.array) -> mx.array:
        return self.rotation(out.shape[-1]).inverse(out)

    def bits_per_element(self, head_dim: int) -> float:
        return self.bits + 8 * SCALE_DTYPE.size / head_dim

    def meta(self) -> dict[str, str]:
        return {"codec": "aura", "bits": str(self.bits), "seed": str(self.seed), "dtype": dtype_name(self.dtype)}


class Packed(NamedTuple):
    """Encoded K or V fields [B, n_kv_heads, T, *] handed to attention without decoding."""

    fields: Fields


def attends_packed(key_codec, value_codec, num_queries: int) -> bool:
    """Whether attention for `num_queries` queries runs on the packed codes: affine decode on CPU.

    CPU only: on the CUDA backend (mlx 0.32.4, H200) `quantized_matmul` has no kernel for the
    batched, broadcast shapes attention needs ("No implementation for problem shape"), and
    on Metal the choice is unmeasured; there the decoded path runs.
    """
    return (num_queries <= PACKED_MAX_QUERIES and mx.default_device() == mx.cpu
            and isinstance(key_codec, AffineCodec) and isinstance(value_codec, AffineCodec))


def affine_attention(
    queries: mx.array, keys: Fields, values: Fields, *,
    key_codec: AffineCodec, value_codec: AffineCodec, scale: float, mask,
) -> mx.array:
    """Scaled dot-product attention on affine codes with `mx.quantized_matmul` (no dequantized K/V).

    Query heads are grouped onto their KV head by reshaping (GQA); scores are
    `quantized_matmul(q * scale, K^T)`, masked, softmaxed in float32-precise mode, then
    multiplied into V the same way. Computed in the promotion of the query and scale dtypes
    (float32 on the CPU backend and for bf16 queries against fp16 scales).

    Args:
        queries: [B, n_heads, L, D], `n_heads` a multiple of `n_kv_heads`.
        keys, values: `AffineCodec` fields [B, n_kv_heads, T, *].
        key_codec, value_codec: The codecs that made them.
        scale: Score scale, usually D**-0.5.
        mask: `None`, `"causal"` (queries are the last L of the T positions), or a boolean
            or additive array broadcastable to [B, n_heads, L, T] ([L, T] or [B, 1, L, T]).

    Returns:
        [B, n_heads, L, D] in the queries' dtype.

    Source: mlx-lm `models/base.py::quantized_scaled_dot_product_attention`.
    """
    batch, n_heads, num_queries, head_dim = queries.shape
    n_kv_heads = keys[0].shape[1]
    compute = mx.result_type(queries.dtype, keys[1].dtype)
    q = (queries.astype(compute) * scale).reshape(batch, n_kv_heads, n_heads // n_kv_heads, num_queries, head_dim)
    k, v = _grouped(keys, compute), _grouped(values, compute)
    scores = mx.quantized_matmul(q, *k, transpose=True, group_size=key_codec.group_size, bits=key_codec.bits)
    probs = mx.softmax(_masked(scores, mask), axis=-1, precise=True)
    out = mx.quantized_matmul(probs, *v, transpose=False, group_size=value_codec.group_size, bits=value_codec.bits)
    return out.reshape(batch, n_heads, num_queries, head_dim).astype(queries.dtype)


def _grouped(fields: Fields, dtype: mx.Dtype) -> Fields:
    """[B, H, T, *] fields as [B, H, 1, T, *], scales and biases in `dtype`."""
    packed, scales, biases = fields
    return tuple(mx.expand_dims(f, 2) for f in (packed, scales.astype(dtype), biases.astype(dtype)))


def _masked(scores: mx.array, mask) -> mx.array:
    """Apply an attention mask to grouped scores [B, n_kv_heads, reps, L, T]."""
    if mask is None:
        return scores
    num_queries, num_keys = scores.shape[-2:]
    if isinstance(mask, str):
        mask = mx.arange(num_keys - num_queries, num_keys)[:, None] >= mx.arange(num_keys)[None]
    elif mask.ndim > 3:  # [B, 1, L, T] -> [B, 1, 1, L, T]
        mask = mx.expand_dims(mask, -3)
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return scores + mask
