"""Compressed codecs: affine (per-group scale + bias) and AURA (rotation + Lloyd-Max codebook)."""

from __future__ import annotations

import mlx.core as mx

from kernels.affine import AffineCodes, affine_dequantize, affine_quantize, bits_per_element
from kernels.aura import SCALE_DTYPE, AuraCodes, aura_decode_rotated, aura_encode
from kernels.rotation import RandomizedHadamard

from .codecs import Fields

AURA_SEED = 0x0A0A  # base of the per-layer rotation seeds; part of the stored format


class AffineCodec:
    """`mx.quantize` layout: packed uint32 codes, per-group scale and bias in the model dtype.

    Args:
        bits (int): 8 or 4 (also 2, 3, 5, 6).
        group_size (int): Elements per scale/bias group along head_dim (64 for 8 bits, 32 for 4).
        dtype (mx.Dtype): Model dtype: scales, biases and decoded tensors use it.
    """

    def __init__(self, bits: int, group_size: int, dtype: mx.Dtype):
        self.bits, self.group_size, self.dtype = bits, group_size, dtype
        self.name = f"affine{bits}"

    def encode(self, x: mx.array) -> Fields:
        return tuple(affine_quantize(x.astype(self.dtype), bits=self.bits, group_size=self.group_size))

    def decode(self, fields: Fields) -> mx.array:
        return affine_dequantize(AffineCodes(*fields), bits=self.bits, group_size=self.group_size, dtype=self.dtype)

    def rotate_query(self, queries: mx.array) -> mx.array:
        return queries

    def unrotate_output(self, out: mx.array) -> mx.array:
        return out

    def bits_per_element(self, head_dim: int) -> float:
        return bits_per_element(self.bits, self.group_size, scale_bits=8 * self.dtype.size)

    def meta(self) -> dict[str, str]:
        return {"codec": "affine", "bits": str(self.bits), "group_size": str(self.group_size),
                "dtype": str(self.dtype).removeprefix("mlx.core.")}


class AuraCodec:
    """AURA: seeded randomized Hadamard rotation, Lloyd-Max indices, one fp16 norm-corrected scale.

    Keys and values are read back in the rotated domain (no inverse rotation per cached
    token); the query is rotated by the key rotation and the attention output un-rotated by
    the value rotation, once per head (both rotations are orthogonal, so scores are exact).

    Args:
        bits (int): Index bits per coordinate, 2..8.
        seed (int): Rotation seed (per layer and per K/V).
        dtype (mx.Dtype): Model dtype of decoded tensors.

    Source: TurboQuant (arXiv 2504.19874) without QJL; CACHES.md "AURA encode / decode".
    """

    def __init__(self, bits: int, seed: int, dtype: mx.Dtype):
        self.bits, self.seed, self.dtype = bits, seed, dtype
        self.name = f"aura{bits}"
        self._rotation: RandomizedHadamard | None = None

    def rotation(self, head_dim: int) -> RandomizedHadamard:
        if self._rotation is None or self._rotation.head_dim != head_dim:
            self._rotation = RandomizedHadamard(head_dim, self.seed)
        return self._rotation

    def encode(self, x: mx.array) -> Fields:
        return tuple(aura_encode(x, bits=self.bits, rotation=self.rotation(x.shape[-1])))

    def decode(self, fields: Fields) -> mx.array:
        return aura_decode_rotated(AuraCodes(*fields), bits=self.bits, dtype=self.dtype)

    def rotate_query(self, queries: mx.array) -> mx.array:
        return self.rotation(queries.shape[-1]).forward(queries)

    def unrotate_output(self, out: mx.array) -> mx.array:
        return self.rotation(out.shape[-1]).inverse(out)

    def bits_per_element(self, head_dim: int) -> float:
        return self.bits + 8 * SCALE_DTYPE.size / head_dim

    def meta(self) -> dict[str, str]:
        return {"codec": "aura", "bits": str(self.bits), "seed": str(self.seed),
                "dtype": str(self.dtype).removeprefix("mlx.core.")}
