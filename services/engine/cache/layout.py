"""`CacheLayout`: where each entry of a model's cache list lives in a `BatchedKVCache`.

A model's cache list (`model.make_cache()`) mixes attention layers (K/V in the page pools),
recurrent layers (per-slot state in the state pool) and, in models that run several mixers in
one layer (falcon_h1), groups of both. The list's index is the model's cache index, which is
not always its layer index (nemotron_h gives MLP blocks no cache). The layout numbers the
attention entries and the recurrent entries separately, in list order, and puts a forward's
per-layer caches back into the model's shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .kv import KVCache
from .recurrent import CacheGroup, RecurrentStateCache

KV, STATE = "kv", "state"


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """The shape of a model's cache list.

    Attributes:
        entries (tuple): Per cache index: `("kv", i)` (the i-th attention layer), `("state", j)`
            (the j-th recurrent layer) or a tuple of such entries (one `CacheGroup`).
    """

    entries: tuple

    @classmethod
    def of(cls, caches: Sequence) -> CacheLayout:
        """The layout of a translated cache list (`make_layer_caches`).

        Raises:
            ValueError: a cache kind the engine does not store.
        """
        counts = {KV: 0, STATE: 0}

        def entry(cache):
            if isinstance(cache, CacheGroup):
                return tuple(entry(member) for member in cache.caches)
            kind = KV if isinstance(cache, KVCache) else STATE if isinstance(cache, RecurrentStateCache) else None
            if kind is None:
                raise ValueError(f"{type(cache).__name__} layers are not supported by BatchedKVCache")
            counts[kind] += 1
            return kind, counts[kind] - 1

        return cls(tuple(entry(cache) for cache in caches))

    @property
    def num_kv(self) -> int:
        return sum(1 for kind, _ in self._leaves(self.entries) if kind == KV)

    @property
    def num_state(self) -> int:
        return sum(1 for kind, _ in self._leaves(self.entries) if kind == STATE)

    def assemble(self, kv: Sequence, states: Sequence) -> list:
        """The model's cache list over one forward's per-layer caches.

        Args:
            kv (Sequence): Per attention layer, in layout order.
            states (Sequence): Per recurrent layer, in layout order.

        Returns:
            list: Pass as `model(..., cache=...)`; groups become `CacheGroup`s.
        """
        pick = {KV: kv, STATE: states}

        def build(entry):
            if isinstance(entry[0], tuple):
                return CacheGroup(*(build(member) for member in entry))
            kind, index = entry
            return pick[kind][index]

        return [build(entry) for entry in self.entries]

    @classmethod
    def _leaves(cls, entries):
        for entry in entries:
            if isinstance(entry[0], tuple):
                yield from cls._leaves(entry)
            else:
                yield entry
