"""Per-token codecs: how one K or V head vector is stored and read back.

Every scheme encodes each token vector on its own, so a cache can write, overwrite
(window ring) or gather (pages) single token slots along axis 2 without touching
its neighbours. A codec also owns the attention domain: keys may be returned in a
rotated basis, in which case the query is rotated the same way and the output of
attention is rotated back (both rotations are orthogonal, so scores are unchanged).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import mlx.core as mx

Fields = tuple[mx.array, ...]  # every field is [B, n_kv_heads, T, *] with the token axis at 2


@runtime_checkable
class KVCodec(Protocol):
    """Encodes `[B, n_kv_heads, L, head_dim]` tensors into storage fields and back."""

    name: str

    def encode(self, x: mx.array) -> Fields:
        """Encode `x` [B, H, L, D] into fields, each [B, H, L, *]."""

    def decode(self, fields: Fields) -> mx.array:
        """Decode fields [B, H, T, *] into [B, H, T, D] in the attention domain (model dtype)."""

    def rotate_query(self, queries: mx.array) -> mx.array:
        """Map queries [B, n_heads, L, D] into the domain `decode` returns keys in."""

    def unrotate_output(self, out: mx.array) -> mx.array:
        """Map attention output [B, n_heads, L, D] back from the value domain."""

    def bits_per_element(self, head_dim: int) -> float:
        """Stored bits per K or V element, metadata (scales, biases) included."""

    def meta(self) -> dict[str, str]:
        """Everything needed to rebuild this codec (part of the stored format)."""


class RawCodec:
    """Stores vectors as they come, in the model dtype (fp16/bf16; fp32 on the CPU backend)."""

    name = "raw"

    def __init__(self, dtype: mx.Dtype):
        self.dtype = dtype

    def encode(self, x: mx.array) -> Fields:
        return (x if x.dtype == self.dtype else x.astype(self.dtype),)

    def decode(self, fields: Fields) -> mx.array:
        return fields[0]

    def rotate_query(self, queries: mx.array) -> mx.array:
        return queries

    def unrotate_output(self, out: mx.array) -> mx.array:
        return out

    def bits_per_element(self, head_dim: int) -> float:
        return 8.0 * self.dtype.size

    def meta(self) -> dict[str, str]:
        return {"codec": "raw", "dtype": str(self.dtype).removeprefix("mlx.core.")}
