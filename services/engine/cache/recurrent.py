"""Caches of hybrid models: `RecurrentStateCache` (Mamba, Mamba2, GatedDeltaNet, short-conv
mixers) and `CacheGroup` (several caches for one layer, mlx-lm's `CacheList`).

Hybrid models keep a fixed-size state per recurrent layer instead of K/V per token: a short
convolution window and, for SSM and delta-rule mixers, the recurrent state. mlx-lm's models
index it as a list (`cache[0]`, `cache[1]`), read `lengths` / `left_padding` (for padded
batches: ours never pad, so both stay `None`) and ask for an SSM mask; nothing grows with the
sequence, so `nbytes` is constant after the first token. The state is never quantized: it is
stored in the dtype the model produces.
"""

from __future__ import annotations

import mlx.core as mx


class RecurrentStateCache:
    """Fixed-size recurrent state for one layer (B unpadded rows, each one token per step or one row).

    The engine builds one per recurrent layer and forward over the rows' gathered state
    (`state_pool`); single-sequence generation keeps one per layer for the whole sequence.

    Args:
        num_arrays (int): State arrays the layer keeps (e.g. 2: conv window [B, K-1, C] and SSM
            state [B, H, Dh, N]; 1 for a short convolution).
    """

    def __init__(self, num_arrays: int):
        self.cache: list[mx.array | None] = [None] * num_arrays
        self.left_padding = None  # mlx-lm models read these two for padded batches
        self.lengths = None
        self.offset = 0  # tokens this object saw (mixers call `advance`); models never read it

    def __getitem__(self, idx: int) -> mx.array | None:
        return self.cache[idx]

    def __setitem__(self, idx: int, value: mx.array) -> None:
        self.cache[idx] = value

    def make_mask(self, N: int, *args, **kwargs):
        """No mask: rows are never padded."""
        return None

    def advance(self, N: int) -> None:
        """Count N more tokens as seen (mlx-lm's mixers call it after each forward)."""
        self.offset += N

    @property
    def nbytes(self) -> int:
        """Bytes of state held (constant in sequence length)."""
        return sum(c.nbytes for c in self.cache if c is not None)

    def size(self) -> int:
        return 0

    def empty(self) -> bool:
        return self.cache[0] is None

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    @property
    def state(self) -> list[mx.array | None]:
        return list(self.cache)

    @state.setter
    def state(self, arrays) -> None:
        self.cache = list(arrays)

    @property
    def meta_state(self) -> dict[str, str]:
        return {"num_arrays": str(len(self.cache)), "offset": str(self.offset)}


class CacheGroup:
    """The caches of one layer that runs several mixers (falcon_h1: Mamba2 and attention).

    Speaks mlx-lm's `CacheList` protocol: the model indexes the members (`cache[0]`, `cache[1]`).

    Args:
        *caches: The member caches, in the order the model indexes them.
    """

    def __init__(self, *caches):
        self.caches = tuple(caches)

    def __getitem__(self, idx: int):
        return self.caches[idx]

    @property
    def offset(self) -> int:
        """Tokens seen (every member sees every token)."""
        return max(getattr(c, "offset", 0) for c in self.caches)

    def make_mask(self, N: int, *args, **kwargs):
        """The first member's mask (mlx-lm's models ask the members directly)."""
        return self.caches[0].make_mask(N, *args, **kwargs)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def size(self) -> int:
        return max(c.size() for c in self.caches)

    def empty(self) -> bool:
        return all(c.empty() for c in self.caches)

    def is_trimmable(self) -> bool:
        return all(c.is_trimmable() for c in self.caches)

    def trim(self, n: int) -> int:
        return min(c.trim(n) for c in self.caches) if self.is_trimmable() else 0

    @property
    def state(self) -> list:
        """The members' states, in order (a nested list)."""
        return [c.state for c in self.caches]

    @property
    def meta_state(self) -> dict[str, str]:
        return {"num_caches": str(len(self.caches))}


def leaf_caches(caches: list) -> list:
    """The caches of a model's cache list with every `CacheGroup` flattened, in order."""
    out = []
    for cache in caches:
        out.extend(leaf_caches(list(cache.caches)) if isinstance(cache, CacheGroup) else [cache])
    return out
