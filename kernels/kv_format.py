"""How one layer stores a token's K and V head vectors: the row format of its page pools.

A layer's KV storage is one or two *pools*, arrays `[rows, width]` whose rows each hold one
(token, kv head) pair (see `services.engine.cache.layer_pool` for how rows are addressed):

- raw layers: a K pool `[rows, key_dim]` and a V pool `[rows, value_dim]` in the raw dtype;
- compressed layers (affine, AURA): one uint32 pool whose row holds both vectors:
  `[K codes | V codes | K meta, V meta]` — codes as the little-endian bit stream of
  `mx.quantize` (`ceil(dim * bits / 32)` words each), then float16 meta packed two per word:
  affine `[scales, biases]` per part (one per group each), AURA one norm-corrected scale per part.

Keys and values may have different widths (DeepSeek-V2: 192 and 128; an MLA latent and its
RoPE part: 512 and 64); `head_dim` names the width when they are equal.

One row per (token, head) means a forward writes each layer with one scatter per pool and a
fused kernel reads a token's K and V from one place; the byte count is exactly CACHES.md's
(AURA 4/4 at d=64: 17 words = 68 bytes = 4.25 bits per element).

Source: CACHES.md "Bytes per token", "AURA encode / decode"; MLX `mx.quantize` (affine layout).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx

import numpy as np

from kernels.affine import AffineCodes, affine_dequantize, affine_quantize, num_groups
from kernels.aura import aura_codebook, aura_encode, packed_words, unpack_bits
from kernels.rotation import RandomizedHadamard, is_power_of_two, supports_head_dim

META_DTYPE = mx.float16  # affine scales/biases and AURA scales, whatever the model dtype
RAW, AFFINE, AURA = "raw", "affine", "aura"


@dataclass(frozen=True, slots=True)
class PartFormat:
    """How one K or V head vector is stored.

    Attributes:
        kind (str): `raw`, `affine` or `aura`.
        bits (int): Code width (raw: the dtype's width).
        group_size (int): Affine elements per scale/bias group along head_dim (0 otherwise).
        seed (int): AURA rotation seed (part of the stored format; 0 otherwise).
        dtype (mx.Dtype): Raw storage dtype; for compressed parts, the dtype decoding returns.
    """

    kind: str
    bits: int
    group_size: int = 0
    seed: int = 0
    dtype: mx.Dtype = mx.float32

    def code_words(self, head_dim: int) -> int:
        """uint32 words of codes per vector (compressed parts): `ceil(head_dim * bits / 32)`."""
        return packed_words(head_dim, self.bits)

    def meta_halves(self, head_dim: int) -> int:
        """float16 meta values per vector: affine scales + biases (a tail group included), the AURA scale."""
        if self.kind == AFFINE:
            return 2 * num_groups(head_dim, self.group_size)
        return {RAW: 0, AURA: 1}[self.kind]

    def bits_per_element(self, head_dim: int) -> float:
        """Stored bits per element, metadata and the last word's padding included (CACHES.md "Bytes per token")."""
        if self.kind == RAW:
            return 8.0 * self.dtype.size
        return (32 * self.code_words(head_dim) + 16 * self.meta_halves(head_dim)) / head_dim

    def rotation(self, head_dim: int) -> RandomizedHadamard | None:
        """The AURA rotation of this part (None for other kinds)."""
        return _rotation(head_dim, self.seed) if self.kind == AURA else None

    def check(self, head_dim: int) -> None:
        """Raise ValueError when this part cannot store vectors of `head_dim`."""
        if not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
        if self.kind == AURA and not supports_head_dim(head_dim):
            raise ValueError(f"AURA needs a Hadamard rotation of head_dim {head_dim}: head_dim = m * 2^k with m in "
                             "1, 12, 20, 28 (64, 80, 96, 112, 128, 160, 192, 256, ...); keep such layers raw or affine")

    def is_regular(self, head_dim: int) -> bool:
        """Codes fill whole words, affine groups divide head_dim, AURA's rotation is Sylvester's and its codebook
        has at most 256 centroids (what the CUDA kernels take)."""
        if self.kind == RAW:
            return True
        if head_dim * self.bits % 32 or (self.kind == AURA and self.bits > 8):
            return False
        return head_dim % self.group_size == 0 if self.kind == AFFINE else is_power_of_two(head_dim)

    def meta(self) -> dict[str, str]:
        """Everything needed to rebuild this part (stored with persisted caches)."""
        return {"kind": self.kind, "bits": str(self.bits), "group_size": str(self.group_size),
                "seed": str(self.seed), "dtype": dtype_name(self.dtype)}


@functools.lru_cache(maxsize=None)
def _rotation(head_dim: int, seed: int) -> RandomizedHadamard:
    return RandomizedHadamard(head_dim, seed)


def dtype_name(dtype: mx.Dtype) -> str:
    """`mx.float16` -> `"float16"`."""
    return str(dtype).removeprefix("mlx.core.")


@dataclass(frozen=True, slots=True)
class LayerFormat:
    """One layer's K and V parts and the row layout they imply.

    Args:
        key (PartFormat): How keys are stored.
        value (PartFormat): How values are stored.
        key_dim (int): Dk, elements per key vector.
        value_dim (int): Dv, elements per value vector; 0 (default) means `key_dim`.

    Raises:
        ValueError: one part is raw and the other not, or a part cannot store its width.
    """

    key: PartFormat
    value: PartFormat
    key_dim: int
    value_dim: int = 0

    def __post_init__(self):
        if not self.value_dim:
            object.__setattr__(self, "value_dim", self.key_dim)
        if (self.key.kind == RAW) != (self.value.kind == RAW):
            raise ValueError("keys and values must both be raw or both be compressed")
        self.key.check(self.key_dim)
        self.value.check(self.value_dim)

    # -- layout --------------------------------------------------------------------

    @property
    def is_raw(self) -> bool:
        return self.key.kind == RAW

    @property
    def head_dim(self) -> int:
        """D when keys and values have one width.

        Raises:
            ValueError: keys and values have different widths (use `key_dim` / `value_dim`).
        """
        if self.key_dim != self.value_dim:
            raise ValueError(f"keys ({self.key_dim}) and values ({self.value_dim}) have different widths")
        return self.key_dim

    @property
    def is_regular(self) -> bool:
        """One width, codes in whole words, groups dividing it, Sylvester rotations: what the CUDA kernels take."""
        return self.key_dim == self.value_dim and all(p.is_regular(self.key_dim) for p in (self.key, self.value))

    @property
    def name(self) -> str:
        """`raw`, `affine8`, `aura4v2`, … (the scheme name of this layer)."""
        k, v = self.key, self.value
        if k.kind == AURA:
            return f"aura{k.bits}v{v.bits}"
        if k.kind == AFFINE and (k.bits, k.group_size) == (v.bits, v.group_size):
            return f"affine{k.bits}"
        return RAW if self.is_raw else f"{k.kind}{k.bits}/{v.kind}{v.bits}"

    @property
    def key_words(self) -> int:
        return self.key.code_words(self.key_dim)

    @property
    def value_words(self) -> int:
        return self.value.code_words(self.value_dim)

    @property
    def meta_offset(self) -> int:
        """Word where the float16 meta starts in a compressed row."""
        return self.key_words + self.value_words

    @property
    def key_meta_halves(self) -> int:
        return self.key.meta_halves(self.key_dim)

    @property
    def value_meta_halves(self) -> int:
        return self.value.meta_halves(self.value_dim)

    @property
    def row_words(self) -> int:
        """uint32 words per compressed row (meta rounded up to whole words)."""
        return self.meta_offset + math.ceil((self.key_meta_halves + self.value_meta_halves) / 2)

    def pool_specs(self) -> list[tuple[int, mx.Dtype]]:
        """(width, dtype) of each pool: `[(Dk, dtype), (Dv, dtype)]` for raw, `[(row_words, uint32)]` else."""
        if self.is_raw:
            return [(self.key_dim, self.key.dtype), (self.value_dim, self.value.dtype)]
        return [(self.row_words, mx.uint32)]

    @property
    def bytes_per_row(self) -> int:
        """Bytes one (token, head) occupies across pools."""
        return sum(width * dtype.size for width, dtype in self.pool_specs())

    def bits_per_element(self) -> float:
        """Mean stored bits per K/V element (CACHES.md)."""
        return 8 * self.bytes_per_row / (self.key_dim + self.value_dim)

    # -- encode / decode in MLX ops (the reference path every backend can run) -----

    def encode(self, keys: mx.array, values: mx.array) -> tuple[mx.array, ...]:
        """Encode K and V `[..., D]` into pool rows `[..., width]`, one array per pool.

        Args:
            keys (mx.array): `[..., Dk]` float (RoPE applied).
            values (mx.array): `[..., Dv]` float, same leading shape.

        Returns:
            tuple[mx.array, ...]: raw: (K, V) in the raw dtype; compressed: (rows uint32,).
        """
        if self.is_raw:
            return _cast(keys, self.key.dtype), _cast(values, self.value.dtype)
        k_codes, k_meta = _encode_part(self.key, keys)
        v_codes, v_meta = _encode_part(self.value, values)
        meta = mx.concatenate([k_meta, v_meta], axis=-1)
        if meta.shape[-1] % 2:
            meta = mx.concatenate([meta, mx.zeros((*meta.shape[:-1], 1), META_DTYPE)], axis=-1)
        return (mx.concatenate([k_codes, v_codes, mx.view(meta, mx.uint32)], axis=-1),)

    def decode(self, pools: tuple[mx.array, ...]) -> tuple[mx.array, mx.array]:
        """Decode pool rows `[..., width]` into K `[..., Dk]` and V `[..., Dv]` in the attention domain.

        AURA parts come back rotated (`y = Pi x`; see `rotate_query` / `unrotate_output`),
        float32; affine parts as `scale * q + bias` in float32; raw parts as stored.
        """
        (keys, k_scale), (values, v_scale) = self.decode_factored(pools)
        return (keys if k_scale is None else keys * k_scale), (values if v_scale is None else values * v_scale)

    def decode_factored(self, pools: tuple[mx.array, ...]) -> tuple[tuple[mx.array, mx.array | None], ...]:
        """`decode`, with each AURA part's per-vector scale left out: ((K, k_scale), (V, v_scale)).

        AURA parts come back as unit centroids float32 `[..., D]` with their scale float32
        `[..., 1]` (so `decode` is `K * k_scale`), which attention can apply to a score or a
        probability instead of to every element; other parts as `decode`, scale None.
        """
        if self.is_raw:
            return (pools[0], None), (pools[1], None)
        (rows,) = pools
        meta = mx.view(mx.contiguous(rows[..., self.meta_offset:]), META_DTYPE)
        k_meta = meta[..., : self.key_meta_halves]
        v_meta = meta[..., self.key_meta_halves : self.key_meta_halves + self.value_meta_halves]
        return (_decode_part(self.key, rows[..., : self.key_words], k_meta, self.key_dim),
                _decode_part(self.value, rows[..., self.key_words : self.meta_offset], v_meta, self.value_dim))

    def decode_plain(self, pools: tuple[mx.array, ...]) -> tuple[mx.array, mx.array]:
        """Decode pool rows into K and V in the model's own domain (AURA parts un-rotated).

        For layers whose attention runs on operands derived from the cache (MLA's latent), where
        the rotated domain cannot be used. Raw parts come back as stored, others float32.
        """
        keys, values = self.decode(pools)
        return self.unrotate_keys(keys), self.unrotate_output(values)

    def rotate_query(self, queries: mx.array) -> mx.array:
        """Map queries `[..., Dk]` into the domain keys are decoded in (AURA: rotate)."""
        rotation = self.key.rotation(self.key_dim)
        return queries if rotation is None else rotation.forward(queries)

    def unrotate_keys(self, keys: mx.array) -> mx.array:
        """Map decoded keys `[..., Dk]` back to the model's domain (AURA: un-rotate)."""
        rotation = self.key.rotation(self.key_dim)
        return keys if rotation is None else rotation.inverse(keys)

    def unrotate_output(self, out: mx.array) -> mx.array:
        """Map attention output (or decoded values) `[..., Dv]` back from the value domain (AURA: un-rotate)."""
        rotation = self.value.rotation(self.value_dim)
        return out if rotation is None else rotation.inverse(out)


def _cast(x: mx.array, dtype: mx.Dtype) -> mx.array:
    return x if x.dtype == dtype else x.astype(dtype)


def _encode_part(part: PartFormat, x: mx.array) -> tuple[mx.array, mx.array]:
    """(codes uint32 [..., words], meta float16 [..., halves]) of one part."""
    if part.kind == AFFINE:
        codes = affine_quantize(x.astype(mx.float32), bits=part.bits, group_size=part.group_size)
        return codes.packed, mx.concatenate([codes.scales, codes.biases], axis=-1).astype(META_DTYPE)
    codes = aura_encode(x, bits=part.bits, rotation=part.rotation(x.shape[-1]))
    return codes.packed, codes.scales.astype(META_DTYPE)


def _decode_part(part: PartFormat, codes: mx.array, meta: mx.array, dim: int) -> tuple[mx.array, mx.array | None]:
    """(float32 [..., dim], scale float32 [..., 1] or None) from codes [..., words] and meta [..., halves].

    Affine parts come back dequantized (scale None); AURA parts as unit centroids and their scale.
    """
    if part.kind == AFFINE:
        groups = meta.shape[-1] // 2
        scales, biases = meta[..., :groups].astype(mx.float32), meta[..., groups:].astype(mx.float32)
        return affine_dequantize(AffineCodes(mx.contiguous(codes), scales, biases), bits=part.bits,
                                 group_size=part.group_size, dtype=mx.float32, head_dim=dim), None
    return aura_lookup(codes, part.bits, dim), meta.astype(mx.float32)


@functools.lru_cache(maxsize=None)
def _byte_table(bits: int) -> mx.array:
    """Centroids of every byte of codes (bits dividing 8): float32 `[256, 1]` at 8 bits, else complex64
    `[256, 4 / bits]` (pairs of centroids, one gathered element each)."""
    per = 8 // bits
    byte = np.arange(256, dtype=np.int64)[:, None]
    index = (byte >> (bits * np.arange(per))[None, :]) & ((1 << bits) - 1)
    table = np.array(aura_codebook(bits), np.float32)[index]
    return mx.array(table) if per == 1 else mx.view(mx.array(table.reshape(-1)), mx.complex64).reshape(256, per // 2)


def aura_lookup(codes: mx.array, bits: int, dim: int | None = None) -> mx.array:
    """Unit-scale centroids `c[idx]` float32 `[..., dim]` of packed AURA codes `[..., words]`.

    Widths dividing 8 look up each byte of codes at once (a table of 256 rows); others unpack,
    then look up each index. Both gather with `take_along_axis` (MLX's GatherAxis), which the CPU
    backend runs 5-9x faster than `take` (Gather) for these lookups: aura8v4 keys of one 8K-token
    layer of the default model, 5.0 -> 0.54 ms. All indices sit in one row, so the table is never
    broadcast to every row (see `kernels.aura.aura_encode`). `dim` None: every bit of the words is a code.
    """
    lead, words = codes.shape[:-1], codes.shape[-1]
    rows = math.prod(lead)
    if 8 % bits:
        index = unpack_bits(codes, bits, dim)
        out = mx.take_along_axis(aura_codebook(bits)[None], index.reshape(1, -1), axis=1)
        return out.reshape(*lead, index.shape[-1])
    byte = mx.view(mx.contiguous(codes), mx.uint8).reshape(1, rows * 4 * words)
    table = _byte_table(bits)  # [256, k]
    index = mx.broadcast_to(byte[..., None], (1, rows * 4 * words, table.shape[1]))
    out = mx.view(mx.take_along_axis(table[None], index, axis=1), mx.float32).reshape(*lead, 32 // bits * words)
    return out if dim is None or dim == out.shape[-1] else out[..., :dim]


