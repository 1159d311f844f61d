"""`KVCache`: one layer's K/V of B sequences in page pools, any scheme, optionally windowed."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kernels.kv_format import LayerFormat, PartFormat
from kernels.latent_attention import latent_mask, latent_operands
from kernels.paged_attention import (History, PoolRef, WindowRule, contiguous_attention, decode_attention,
                                     prefill_attention, uses_cuda)
from shared.errors import ContextOverflow

from . import pool_rows
from .geometry import LayerGeometry
from .paged_index import ring_writes
from .protocol import AttendingCache
from .window import Window

PAGE_SIZE = 16  # tokens per page of a single-sequence cache


@dataclass(frozen=True, slots=True)
class _Update:
    """What `attend` needs about the tokens the last `update_and_fetch` stored."""

    start: int  # position of the first new token
    num_new: int  # L
    rows: tuple[mx.array, ...]  # the new tokens' pool rows [B, H, L, width]
    history: tuple[mx.array, ...] | None  # old ring slots [B, H, T, width] when a chunk wrapped the window


class KVCache(AttendingCache):
    """One attention layer's cache, speaking mlx-lm's cache protocol.

    Storage is the layer's pools (`kernels.kv_format`), row b of the batch owning pages
    `b * NP .. (b + 1) * NP - 1`, grown `step` tokens at a time and never past `max_tokens`
    (the context cap) or, under a window, past `window.max_size`: memory is never preallocated
    to the advertised context. `offset` counts every token seen (it drives RoPE) and keeps
    growing across window evictions, while the live length stays `<= window.max_size`.
    Attention reads the pools in place (`kernels.paged_attention`), except in a latent layer
    (MLA), where `update_and_fetch` returns the decoded slots and the model attends over what
    it derives from them (`kernels.latent_attention`).

    Args:
        key (PartFormat): How keys are stored.
        value (PartFormat): How values are stored.
        max_tokens (int): Context cap for this sequence, in tokens (`--max-context`).
        window (Window | None): Sliding window with sinks, or `None` for full attention.
        geometry (LayerGeometry | None): The layer's K/V shapes and kind (`geometry.probe_geometry`);
            None: widths are read at the first update and the layer is attended in place.

    Raises:
        ContextOverflow: from `update_and_fetch` when a full-attention cache would pass `max_tokens`.
        ValueError: here (or at the first `update_and_fetch` without `geometry`) when the scheme
            cannot store the layer's widths; from `update_and_fetch` for widths other than `geometry`'s.
    """

    step = 256

    def __init__(self, key: PartFormat, value: PartFormat, *, max_tokens: int, window: Window | None = None,
                 geometry: LayerGeometry | None = None):
        self.key, self.value = key, value
        self.max_tokens, self.window = max_tokens, window
        self.offset = 0
        self.geometry = geometry
        self.latent = geometry is not None and geometry.latent
        self.fmt: LayerFormat | None = None  # known from geometry, else at the first update
        if geometry is not None:
            self.fmt = LayerFormat(key, value, geometry.key_dim, geometry.value_dim)
        self._store: tuple[mx.array, ...] | None = None  # per pool [H, B, capacity, width]
        self._batch = self._heads = self._row_pages = 0
        self._update: _Update | None = None
        self.key_mean: mx.array | None = None  # keys are stored centered on it (`centering`); set by the factory

    # -- sizes -----------------------------------------------------------------

    @property
    def num_live(self) -> int:
        """Tokens whose K/V are held per row (tokens)."""
        return self.offset if self.window is None else min(self.offset, self.window.max_size)

    @property
    def capacity(self) -> int:
        """Tokens allocated per batch row (tokens)."""
        return self._row_pages * PAGE_SIZE

    @property
    def nbytes(self) -> int:
        """Bytes held for live tokens, K and V, metadata included, all rows."""
        return 0 if self.fmt is None else self.num_live * self._batch * self._heads * self.fmt.bytes_per_row

    @property
    def capacity_nbytes(self) -> int:
        """Bytes allocated, live or not."""
        return 0 if self._store is None else sum(p.nbytes for p in self._store)

    def size(self) -> int:
        return self.num_live

    def empty(self) -> bool:
        return self._store is None

    @property
    def _pools(self) -> tuple[mx.array, ...]:
        """The store as pools `[H * B * capacity, width]` (row b owns pages `b * NP ..`), views."""
        return tuple(p.reshape(-1, p.shape[-1]) for p in self._store)

    # -- the protocol ------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store L new tokens; `attend` then computes attention over what is held.

        Args:
            keys (mx.array): [B, n_kv_heads, L, Dk], RoPE applied at positions `offset ..`.
            values (mx.array): [B, n_kv_heads, L, Dv].

        Returns:
            tuple: `keys, values` unchanged (attention reads the pools, see `attend`); in a latent
            layer, every slot the new tokens see, decoded: [B, n_kv_heads, T, Dk | Dv] in `keys`' dtype.

        Raises:
            ContextOverflow: the sequence would pass `max_tokens` (full attention only).
            ValueError: widths other than the layer's geometry.
        """
        batch, heads, num_new, key_dim = keys.shape
        start = self.offset
        if self.window is None and start + num_new > self.max_tokens:
            raise ContextOverflow(start + num_new, self.max_tokens, what="sequence")
        if self.fmt is None:
            self.fmt = LayerFormat(self.key, self.value, key_dim, values.shape[-1])
        elif (key_dim, values.shape[-1]) != (self.fmt.key_dim, self.fmt.value_dim):
            raise ValueError(f"layer stores keys of {self.fmt.key_dim} and values of {self.fmt.value_dim}, "
                             f"got {key_dim} and {values.shape[-1]}")
        if self._store is None:
            self._batch, self._heads = batch, heads
        new = pool_rows.encode(self.fmt, keys, values, self.key_mean)
        window, history = self.window, None
        if window is None or start + num_new <= window.max_size:
            self._write(start, new)
        elif num_new == 1:  # the slot it evicts is exactly the one that fell out of the window
            self._write(int(window.storage_index(np.array([start]))[0]), new)
        else:  # a chunk that wraps: attention reads the old ring, then the ring is written
            self._reserve(self.window.max_size)
            history = self._views(self.num_live)
            self._write_ring(new, start)
        self.offset += num_new
        self._update = _Update(start, num_new, new, history)
        if self.latent:
            ref = PoolRef(self.fmt, self._pools, self._heads, PAGE_SIZE)
            return latent_operands(ref, self._latent_history(start, num_new, history), None if num_new == 1 else new,
                                   keys.dtype)
        return keys, values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """`None` for one query, else `"causal"`; `attend` masks from positions, not from this.

        A latent layer gets, for a prompt chunk, the visibility [1, 1, N, T] of the slots its
        `update_and_fetch` will return (the model applies it).

        Raises:
            ValueError: a plain `window_size` asked of a full-attention layer that it would cut.
        """
        if window_size is not None and self.window is None and self.offset + N > window_size:
            raise ValueError("a sliding window_size on a full-attention cache is not supported; "
                             "give the layer a window (make_cache's RotatingKVCache)")
        if N == 1:
            return None
        if not self.latent:
            return "causal"
        queries = mx.arange(self.offset, self.offset + N, dtype=mx.int32)[None]
        rule = None if self.window is None else WindowRule(self.window.keep, self.window.ring)
        return latent_mask(self._latent_history(self.offset, N, None), self._seen(self.offset), queries, rule)

    def _seen(self, start: int) -> int:
        """Live slots before position `start` is stored (tokens)."""
        return start if self.window is None else min(start, self.window.max_size)

    def _latent_history(self, start: int, num_new: int, wrapped: tuple[mx.array, ...] | None) -> History | None:
        """The stored slots a latent layer's forward sees besides its chunk (decode: every live slot).

        Called before the update (`make_mask`, rows unread) and after it (`update_and_fetch`,
        `wrapped` the old ring when the chunk wrapped the window), with the same answer.
        """
        window = self.window
        if num_new == 1:
            live = start + 1 if window is None else min(start + 1, window.max_size)
            return History(_lengths(1, live), rows=self._views(live) if self._store is not None else None)
        seen = self._seen(start)
        if not seen:
            return None
        rows = wrapped if wrapped is not None else (self._views(seen) if self._store is not None else None)
        positions = None
        if window is not None and start + num_new > window.max_size:
            positions = mx.array(window.stored_positions(start)[None].astype(np.int32))
        return History(_lengths(1, seen), rows=rows, positions=positions)

    def attend(self, queries, keys, values, *, scale: float, mask, sinks=None) -> mx.array:
        """Attention of queries [B, n_heads, L, head_dim] over the held tokens (and the new ones).

        Visibility follows from positions (causal, the window rule); `mask` is used only when
        a caller passes an explicit array ([L, T] over the live slots in slot order): then
        the live slots are decoded and given to `mx.fast` SDPA with it.

        Returns:
            mx.array: [B, n_heads, L, head_dim] in the queries' dtype.

        Raises:
            ValueError: an explicit mask for a chunk that wrapped the window.
        """
        update, fmt = self._update, self.fmt
        if self.latent:  # keys and values are what the model derived from `update_and_fetch`'s slots
            return contiguous_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if isinstance(mask, mx.array):
            return self._dense(queries, mask, scale, sinks)
        ref = PoolRef(fmt, self._pools, self._heads, PAGE_SIZE)
        live, batch = self.num_live, self._batch
        if update.history is not None:
            positions = mx.array(np.tile(self.window.stored_positions(update.start), (batch, 1)).astype(np.int32))
            history = History(self._lengths(update.history[0].shape[2]), rows=update.history, positions=positions)
            return self._prefill(queries, ref, history, update, WindowRule(self.window.keep, self.window.ring),
                                 scale, sinks)
        if update.num_new == 1 and (not fmt.is_raw or uses_cuda(fmt)):
            return decode_attention(queries, ref, self._page_table(-(-live // PAGE_SIZE)), self._lengths(live),
                                    scale=scale, sinks=sinks)
        if fmt.is_raw:
            k, v = self._views(live)
            return contiguous_attention(queries, k, v, scale=scale, mask=None if update.num_new == 1 else "causal",
                                        sinks=sinks)
        history = None
        if update.start:
            history = History(self._lengths(update.start), self._page_table(-(-update.start // PAGE_SIZE)))
        return self._prefill(queries, ref, history, update, None, scale, sinks)

    def _dense(self, queries, mask, scale, sinks):
        if self._update.history is not None:
            raise ValueError("an explicit mask is not supported for a chunk that wraps the window")
        keys, values = self.fmt.decode(self._views(self.num_live))
        q = self.fmt.rotate_query(queries.astype(keys.dtype))
        out = contiguous_attention(q, keys, values.astype(keys.dtype), scale=scale, mask=mask, sinks=sinks)
        return self.fmt.unrotate_output(out).astype(queries.dtype)

    def _prefill(self, queries, ref, history, update: _Update, window, scale, sinks):
        new_k, new_v = self.fmt.decode(update.rows)
        positions = mx.broadcast_to(mx.arange(update.start, update.start + update.num_new, dtype=mx.int32)[None],
                                    (self._batch, update.num_new))
        return prefill_attention(queries, ref, history, new_k, new_v, positions, window=window, scale=scale,
                                 sinks=sinks)

    def is_trimmable(self) -> bool:
        return self.window is None or self.offset <= self.window.max_size

    def trim(self, n: int) -> int:
        """Forget the last `n` tokens (tokens actually trimmed is returned)."""
        n = min(self.offset, n) if self.is_trimmable() else 0
        self.offset -= n
        return n

    # -- state (save/load) ------------------------------------------------------

    @property
    def state(self) -> tuple[mx.array, ...]:
        """Per pool, the live slots' rows [B, n_kv_heads, T, width] in slot order."""
        return () if self._store is None else self._views(self.num_live)

    @state.setter
    def state(self, arrays) -> None:
        arrays = tuple(arrays)
        if not arrays:
            self._store, self._row_pages = None, 0
            return
        self._batch, self._heads, num_slots, _ = arrays[0].shape
        self._row_pages = -(-num_slots // PAGE_SIZE)
        pad = self._row_pages * PAGE_SIZE - num_slots
        self._store = tuple(mx.pad(a, [(0, 0), (0, 0), (0, pad), (0, 0)]).transpose(1, 0, 2, 3) for a in arrays)

    @property
    def meta_state(self) -> dict[str, str]:
        meta = {"offset": str(self.offset), "max_tokens": str(self.max_tokens)}
        if self.fmt is not None:
            meta |= {"key_dim": str(self.fmt.key_dim), "value_dim": str(self.fmt.value_dim)}
        if self.latent:
            meta["latent"] = "1"
        if self.window is not None:
            meta |= {"window_max_size": str(self.window.max_size), "window_keep": str(self.window.keep)}
        meta |= {f"key_{k}": v for k, v in self.key.meta().items()}
        return meta | {f"value_{k}": v for k, v in self.value.meta().items()}

    def restore_format(self, key_dim: int, value_dim: int, *, latent: bool = False) -> None:
        """Set the layer format after `state` was assigned (persistence)."""
        self.fmt = LayerFormat(self.key, self.value, key_dim, value_dim)
        self.geometry = LayerGeometry(self._heads, key_dim, value_dim, latent)
        self.latent = latent

    # -- storage ----------------------------------------------------------------

    def _views(self, num_slots: int) -> tuple[mx.array, ...]:
        """Slots `0 .. num_slots-1` of every row as views [B, H, num_slots, width] per pool."""
        return tuple(p.transpose(1, 0, 2, 3)[:, :, :num_slots] for p in self._store)

    def _lengths(self, n: int) -> mx.array:
        return _lengths(self._batch, n)

    def _page_table(self, num_pages: int) -> mx.array:
        return _identity_table(self._batch, self._row_pages, num_pages)

    def _limit(self) -> int:
        return self.max_tokens if self.window is None else self.window.max_size

    def _reserve(self, needed: int) -> None:
        """Grow every row to hold `needed` slots (rounded up to `step`, capped; pages appended)."""
        if needed <= self.capacity:
            return
        tokens = min(max(self._limit(), needed), self.step * math.ceil(needed / self.step))
        pages = -(-tokens // PAGE_SIZE)
        shape = (self._heads, self._batch, pages * PAGE_SIZE)
        if self._store is None:
            self._store = tuple(p.reshape(*shape, -1) for p in pool_rows.allocate(self.fmt, math.prod(shape)))
        else:
            grow = [(0, 0), (0, 0), (0, pages * PAGE_SIZE - self.capacity), (0, 0)]
            self._store = tuple(mx.pad(p, grow) for p in self._store)
        self._row_pages = pages

    def _write(self, first: int, new: tuple[mx.array, ...]) -> None:
        """Write the new tokens [B, H, L, width] to slots `first .. first+L-1` of every row (a slice update)."""
        num_new = new[0].shape[2]
        self._reserve(first + num_new)
        store = []
        for pool, x in zip(self._store, new):
            pool[:, :, first : first + num_new] = x.transpose(1, 0, 2, 3)
            store.append(pool)
        self._store = tuple(store)

    def _write_ring(self, new: tuple[mx.array, ...], start: int) -> None:
        """Write a wrapping chunk: per slot, only the newest position that maps to it survives."""
        num_new = new[0].shape[2]
        self._reserve(self.window.max_size)
        table = np.arange(self._batch)[:, None] * self._row_pages + np.arange(self._row_pages)[None, :]
        queries = np.broadcast_to(np.arange(start, start + num_new), (self._batch, num_new))
        rows, source = ring_writes(self.window, queries, table, n_kv_heads=self._heads,
                                   num_pages=self._batch * self._row_pages, page_size=PAGE_SIZE)
        pools = pool_rows.write(self._pools, mx.array(rows.astype(np.int32)), new, mx.array(source))
        self._store = tuple(p.reshape(s.shape) for p, s in zip(pools, self._store))


@functools.lru_cache(maxsize=256)
def _lengths(batch: int, n: int) -> mx.array:
    """int32 [batch] of n (shared by every layer of a step)."""
    return mx.full((batch,), n, dtype=mx.int32)


@functools.lru_cache(maxsize=64)
def _identity_table(batch: int, row_pages: int, num_pages: int) -> mx.array:
    """int32 [batch, num_pages]: row b owns pages `b * row_pages ..` in order."""
    rows = np.arange(batch)[:, None] * row_pages + np.arange(num_pages)[None, :]
    return mx.array(rows.astype(np.int32))
