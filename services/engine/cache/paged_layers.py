"""What one forward over page pools sees: the pools, the index arrays, per-layer caches.

Split from `batched.py` so a forward can be built over any set of pool arrays, the cache's
own or the placeholders `mx.compile` traces with: nothing here keeps state across forwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from kernels.kv_format import LayerFormat
from kernels.latent_attention import latent_mask, latent_operands
from kernels.paged_attention import (History, PoolRef, WindowRule, contiguous_attention, decode_attention,
                                     prefill_attention, uses_cuda)

from . import pool_rows
from .paged_index import GroupIndex
from .protocol import AttendingCache
from .window import Window


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One attention layer's storage format, window (`None`: full attention), kind (latent: MLA) and the
    mean its keys are stored centered on (`centering`; None: as they come)."""

    fmt: LayerFormat
    window: Window | None = None
    latent: bool = False
    key_mean: mx.array | None = field(default=None, repr=False, compare=False)  # one engine has one set

    @property
    def rule(self) -> WindowRule | None:
        return None if self.window is None else WindowRule(self.window.keep, self.window.ring)


class PagedStorage:
    """Per layer, its pools `[n_kv_heads * num_pages * page_size, width]` (one or two arrays).

    Writes rebind the arrays it holds (MLX arrays are values): the caller reads `arrays`
    afterwards to get the written versions.
    """

    def __init__(self, pools: list[tuple[mx.array, ...]], *, n_kv_heads: int, page_size: int):
        self.pools, self.n_kv_heads, self.page_size = pools, n_kv_heads, page_size

    @property
    def arrays(self) -> list[mx.array]:
        """Every pool array, layer by layer."""
        return [a for layer in self.pools for a in layer]

    def with_arrays(self, arrays: Sequence[mx.array]) -> PagedStorage:
        """The same structure over other arrays (in `arrays` order)."""
        it = iter(arrays)
        return PagedStorage([tuple(next(it) for _ in layer) for layer in self.pools], n_kv_heads=self.n_kv_heads,
                            page_size=self.page_size)

    def ref(self, layer: int, fmt: LayerFormat) -> PoolRef:
        return PoolRef(fmt, self.pools[layer], self.n_kv_heads, self.page_size)


@dataclass(frozen=True, slots=True)
class ForwardIndex:
    """A `GroupIndex` as MLX arrays, shared by every layer with the same window rule.

    Attributes:
        batch (int): B rows.
        num_new (int): L new tokens per row.
        read_first (bool): See `GroupIndex`.
        write_rows, write_source, page_table, lengths (mx.array): See `GroupIndex` (int32).
        positions (mx.array | None): See `GroupIndex`.
        query_positions (mx.array | None): int32 [B, L] (prompt chunks only).
        offset (int | mx.array): RoPE offset: an int for one row, else int32 [B].
    """

    batch: int
    num_new: int
    read_first: bool
    write_rows: mx.array
    write_source: mx.array | None
    page_table: mx.array
    lengths: mx.array
    positions: mx.array | None
    query_positions: mx.array | None
    offset: int | mx.array

    @classmethod
    def from_plan(cls, index: GroupIndex, starts: np.ndarray) -> ForwardIndex:
        """Move a plan to the device: its integer indices as one transfer, sliced there (one row keeps an int offset)."""
        source = np.zeros(0, np.int32) if index.write_source is None else index.write_source
        parts = [index.write_rows, source, index.page_table.reshape(-1), index.lengths, starts.astype(np.int32),
                 index.query_positions.reshape(-1)]
        packed = mx.array(np.concatenate(parts))
        bounds = np.cumsum([0] + [len(p) for p in parts])
        rows, sources, table, lengths, offsets, queries = (packed[a:b] for a, b in zip(bounds, bounds[1:]))
        batch, num_new = index.query_positions.shape
        offset = int(starts[0]) if len(starts) == 1 else offsets
        positions = None if index.positions is None else mx.array(index.positions)
        return cls(batch, num_new, index.read_first, rows, None if index.write_source is None else sources,
                   table.reshape(index.page_table.shape), lengths, positions,
                   None if num_new == 1 else queries.reshape(batch, num_new), offset)

    @classmethod
    def from_decode_arrays(cls, arrays: Sequence[mx.array]) -> ForwardIndex:
        """A one-token-per-row forward from [write rows, page table, lengths, offsets] (shapes give the sizes)."""
        rows, table, lengths, offsets = arrays
        return cls(offsets.shape[0], 1, False, rows, None, table, lengths, None, None, offsets)


class PagedLayerCache(AttendingCache):
    """One layer's view of a forward over a set of slots, speaking mlx-lm's cache protocol.

    `offset` is an int for one row, else an int32 [B] array of per-row start positions
    (mlx's RoPE takes either). `update_and_fetch` writes the new tokens into the rows' pages;
    `attend` reads the pools in place (`kernels.paged_attention`). A latent layer (MLA) instead
    returns every slot the rows see, decoded, from `update_and_fetch`, and its `make_mask` gives
    their visibility per row (`kernels.latent_attention`).
    """

    def __init__(self, storage: PagedStorage, layer: int, spec: LayerSpec, index: ForwardIndex, *,
                 tail: PagedStorage | None = None):
        self.storage, self.layer, self.spec, self.index, self.offset = storage, layer, spec, index, index.offset
        self.tail = tail  # a decode window's tail pages: writes go there, reads see them
        self.prefetched: tuple[mx.array, ...] = ()
        self._new: tuple[mx.array, ...] = ()
        if index.read_first:  # the old ring, read before this forward writes it
            self.prefetched = storage.ref(layer, spec.fmt).gather(index.page_table)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store L new tokens per row; returns `keys, values` unchanged (`attend` reads the pools).

        Args:
            keys (mx.array): [B, n_kv_heads, L, Dk], RoPE applied at each row's positions.
            values (mx.array): [B, n_kv_heads, L, Dv].

        Returns:
            tuple: `keys, values` unchanged; in a latent layer the rows' slots, decoded, in `keys`' dtype:
            [B, n_kv_heads, T, Dk | Dv] (T: history slots read, then the L new ones; zeros past a row's length).

        Raises:
            ValueError: B or L differ from what the forward was planned for.
        """
        index = self.index
        if keys.shape[0] != index.batch or keys.shape[2] != index.num_new:
            raise ValueError(f"planned for {index.batch} rows of {index.num_new} tokens, got keys {keys.shape}")
        self._write(pool_rows.encode(self.spec.fmt, keys, values, self.spec.key_mean))
        if self.spec.latent:
            return latent_operands(self._ref(), self._history(), None if index.num_new == 1 else self._new, keys.dtype)
        return keys, values

    @property
    def store_target(self) -> tuple[tuple[mx.array, ...], mx.array] | None:
        """Where a one-token-per-row forward of a decode window may write its new K/V in place: the layer's
        tail pools and the pool rows, int32 [B * n_kv_heads] in (row, kv head) order
        (`kernels.qkv_rope.split_qkv_rope_store`); None where `update_and_fetch` must be called: prompt
        chunks, latent layers, forwards without a tail, writes picked by a source index, and formats whose
        decode attention is not the fused CUDA kernel (it takes q, so it runs after the write; the MLX-ops
        path's page gathers do not)."""
        index = self.index
        if self.tail is None or self.spec.latent or index.num_new != 1 or index.write_source is not None:
            return None
        if index.read_first or not uses_cuda(self.spec.fmt):
            return None
        return self.tail.pools[self.layer], index.write_rows

    def _write(self, new: tuple[mx.array, ...]) -> None:
        """Scatter the forward's new pool rows (per pool `[B, H, L, width]`) into its pages (a decode window's: the tail)."""
        self._new, index = new, self.index
        pools = (self.storage if self.tail is None else self.tail).pools
        pools[self.layer] = pool_rows.write(pools[self.layer], index.write_rows, new, index.write_source)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """`None` for one query, else `"causal"`; `attend` masks from positions, not from this.

        Raises:
            ValueError: N differs from the planned L.
        """
        if N != self.index.num_new:
            raise ValueError(f"planned {self.index.num_new} queries per row, asked for {N}")
        if self.spec.latent:  # [B, 1, L, T] of what update_and_fetch will return
            history = self._history()
            return latent_mask(history, history.num_slots(self.storage.page_size), self.index.query_positions,
                               self.spec.rule)
        return None if N == 1 else "causal"

    def attend(self, queries, keys, values, *, scale: float, mask, sinks=None, flat: bool = False) -> mx.array:
        """Attention of queries [B, n_heads, L, Dk] over the rows' slots: [B, n_heads, L, Dv]; `mask` is ignored
        (latent: used). `flat`, for one query per row: [B, n_heads * Dv] (the decode kernel writes it so).

        Raises:
            ValueError: `flat` with more than one query per row.
        """
        index, spec = self.index, self.spec
        if flat and queries.shape[2] != 1:
            raise ValueError(f"flat output takes one query per row, got {queries.shape[2]}")
        if spec.latent:  # keys and values are what the model derived from update_and_fetch's slots
            out = contiguous_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        elif index.num_new == 1:
            return decode_attention(queries, self._ref(), index.page_table, index.lengths, scale=scale, sinks=sinks,
                                    flat=flat)
        else:
            new_k, new_v = spec.fmt.decode(self._new)
            out = prefill_attention(queries, self._ref(), self._history(), new_k, new_v, index.query_positions,
                                    window=spec.rule, scale=scale, sinks=sinks)
        return out.reshape(out.shape[0], -1) if flat else out

    def _ref(self) -> PoolRef:
        ref = self.storage.ref(self.layer, self.spec.fmt)
        if self.tail is None:
            return ref
        return PoolRef(self.spec.fmt, ref.pools, ref.n_kv_heads, ref.page_size, self.tail.pools[self.layer])

    def _history(self) -> History:
        """The stored slots the forward reads (decode: every live slot; a chunk: those before it)."""
        index = self.index
        if index.read_first:
            return History(index.lengths, rows=self.prefetched, positions=index.positions)
        return History(index.lengths, index.page_table, positions=index.positions)
