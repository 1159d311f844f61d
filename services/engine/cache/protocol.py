"""The cache protocol our layer caches speak (mlx-lm's, written down)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol, runtime_checkable

import mlx.core as mx


@runtime_checkable
class LayerCache(Protocol):
    """What an mlx-lm model and our engine may call on one layer's cache.

    `offset` is the number of tokens seen (it drives RoPE); `nbytes` the bytes held
    for live tokens. Tests check every cache class of ours against this protocol.
    """

    offset: int

    def make_mask(self, N: int, *args, **kwargs): ...

    @property
    def nbytes(self) -> int: ...

    @property
    def state(self): ...

    @property
    def meta_state(self) -> dict[str, str]: ...

    def is_trimmable(self) -> bool: ...

    def trim(self, n: int) -> int: ...

    def size(self) -> int: ...

    def empty(self) -> bool: ...


class AttendingCache(ABC):
    """Base of caches that compute attention on their own storage (see `services.engine.attention`)."""

    @abstractmethod
    def attend(self, queries: mx.array, keys, values, *, scale: float, mask, sinks=None) -> mx.array:
        """Attention of queries [B, n_heads, L, head_dim] over what `update_and_fetch` returned."""
