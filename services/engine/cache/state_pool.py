"""`StatePool`: the recurrent state of every slot of a `BatchedKVCache` (hybrid models).

Each recurrent layer keeps a few arrays per sequence whose size does not depend on its
length (a conv window [K-1, C]; an SSM or delta-rule state [H, Dh, N]). The pool holds them
for all `max_slots` slots at once, per layer and array `[max_slots, *shape]`, allocated when
the engine starts: a slot's state costs a fixed `bytes_per_slot`, beside its pages. Rows are
addressed by slot id, so a slot's K/V pages and its state share the slot's generation (a
stale view cannot reach either). Stored in the dtype the model produces: never quantized.

A forward reads its rows' state (one gather per array) and the layer's view writes the new
state back (one scatter per array, `PooledStateCache`). Decode windows carry the gathered rows
from step to step instead (traceable: no pool access inside a step) and write them once, when
the window is collected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import cache as mlx_cache

from .recurrent import RecurrentStateCache


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One recurrent layer's arrays for one sequence.

    Attributes:
        shapes (tuple[tuple[int, ...], ...]): Per array, its shape without the batch axis.
        dtypes (tuple[mx.Dtype, ...]): Per array, the dtype the model writes.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[mx.Dtype, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of one sequence's state in this layer."""
        return sum(int(np.prod(s)) * d.size for s, d in zip(self.shapes, self.dtypes))


def probe_state_specs(model: nn.Module) -> list[StateSpec]:
    """Shapes and dtypes of every recurrent layer's state, in cache-list order.

    Builds (without evaluating: MLX knows shapes when an op is created) two one-token forwards
    over mlx-lm's own caches; the second gives the steady-state dtypes.

    Raises:
        ValueError: a recurrent layer left an array unset.
    """
    template = model.make_cache()
    tokens = mx.zeros((1, 1), mx.uint32)
    for _ in range(2):
        model(tokens, cache=template)
    leaves = []
    for cache in template:
        leaves.extend(cache.caches if isinstance(cache, mlx_cache.CacheList) else [cache])
    specs = []
    for cache in (c for c in leaves if isinstance(c, mlx_cache.ArraysCache)):
        if any(a is None for a in cache.cache):
            raise ValueError("a recurrent layer left a state array unset after a forward; cannot size its pool")
        specs.append(StateSpec(tuple(tuple(a.shape[1:]) for a in cache.cache), tuple(a.dtype for a in cache.cache)))
    return specs


class PooledStateCache(RecurrentStateCache):
    """A recurrent layer's view of one forward: the rows' state, written back to the pool on set.

    Args:
        pool (StatePool): The pool the rows live in.
        layer (int): Recurrent layer index (layout order).
        slot_ids (mx.array): int32 [B], the rows' slots.
        rows (list[mx.array | None]): Per array [B, *shape], or `None` when every row starts fresh.
    """

    def __init__(self, pool: StatePool, layer: int, slot_ids: mx.array, rows: list):
        super().__init__(len(rows))
        self.cache = list(rows)
        self.pool, self.layer, self.slot_ids = pool, layer, slot_ids

    def __setitem__(self, idx: int, value: mx.array) -> None:
        self.cache[idx] = value
        self.pool.write_array(self.layer, idx, self.slot_ids, value)


class StatePool:
    """Per-slot recurrent state of every recurrent layer, `[max_slots, *shape]` per array.

    Args:
        specs (Sequence[StateSpec]): Per recurrent layer (may be empty: a model without any).
        max_slots (int): Slots, as in the `SlotTable`.
    """

    def __init__(self, specs: Sequence[StateSpec], max_slots: int):
        self.specs, self.max_slots = tuple(specs), max_slots
        self.pools = [[mx.zeros((max_slots, *shape), dtype) for shape, dtype in zip(s.shapes, s.dtypes)]
                      for s in self.specs]

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one slot's state across all recurrent layers (0 without any)."""
        return sum(s.nbytes for s in self.specs)

    @property
    def arrays(self) -> list[mx.array]:
        """Every pool array, layer by layer."""
        return [a for layer in self.pools for a in layer]

    def replace_arrays(self, arrays: Sequence[mx.array]) -> None:
        """Adopt arrays in `arrays` order."""
        it = iter(arrays)
        self.pools = [[next(it) for _ in layer] for layer in self.pools]

    def read(self, slot_ids: mx.array) -> list[mx.array]:
        """The rows' state, every layer's arrays in `arrays` order ([B, *shape] each; lazy)."""
        return [mx.take(a, slot_ids, axis=0) for a in self.arrays]

    def write(self, slot_ids: mx.array, rows: Sequence[mx.array]) -> None:
        """Store rows ([B, *shape], `arrays` order) into their slots."""
        it = iter(rows)
        for layer, arrays in enumerate(self.pools):
            for idx in range(len(arrays)):
                self.write_array(layer, idx, slot_ids, next(it))

    def write_array(self, layer: int, idx: int, slot_ids: mx.array, value: mx.array) -> None:
        pool = self.pools[layer][idx]
        pool[slot_ids] = value.astype(pool.dtype)
        self.pools[layer][idx] = pool

    def views(self, slot_ids: mx.array, fresh: np.ndarray) -> list[PooledStateCache]:
        """Per recurrent layer, the view of a forward over `slot_ids` that writes back.

        Args:
            slot_ids (mx.array): int32 [B].
            fresh (np.ndarray): bool [B], rows that start at position 0 (their state is zero,
                whatever a previous holder of the slot left).
        """
        if fresh.all():
            rows = [[None] * len(layer) for layer in self.pools]
        else:
            keep = mx.array(~fresh)
            rows = [[self._gather(a, slot_ids, keep, fresh.any()) for a in layer] for layer in self.pools]
        return [PooledStateCache(self, j, slot_ids, r) for j, r in enumerate(rows)]

    def row_views(self, rows: Sequence[mx.array]) -> list[RecurrentStateCache]:
        """Per recurrent layer, a view over given rows (`arrays` order) that touches no pool (traceable)."""
        it, views = iter(rows), []
        for layer in self.pools:
            view = RecurrentStateCache(len(layer))
            view.cache = [next(it) for _ in layer]
            views.append(view)
        return views

    @staticmethod
    def _gather(pool: mx.array, slot_ids: mx.array, keep: mx.array, any_fresh: bool) -> mx.array:
        rows = mx.take(pool, slot_ids, axis=0)
        if not any_fresh:
            return rows
        return mx.where(keep.reshape(-1, *([1] * (rows.ndim - 1))), rows, mx.zeros_like(rows))
