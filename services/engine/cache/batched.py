"""`BatchedKVCache`: paged K/V storage shared by many sequences, in any codec, windows included.

Layout. Capacity is counted in tokens and cut into pages of `page_size` token slots. Each
layer keeps, per codec field, one array laid out `[num_pages, n_kv_heads, page_size, *]`
(stored flattened to `[num_pages * n_kv_heads * page_size, *]`, see `paged_index`), and one
`SlotTable` (one allocator, one page table per slot) serves all layers: page `p` names the
same token slots in every layer. A forward over a set of slots writes its new tokens with one
scatter per field and reads the rows it attends to with one gather per field; the indices are
built once per forward (numpy) and shared by all layers with the same window rule.

Costs of this layout:
- Every forward gathers the attended K/V into a dense `[B, n_kv_heads, T_max, *]` copy (then
  decodes it): one extra read and write of the live KV per layer and step, on top of
  attention's own read. Rows shorter than the longest are padded (masked out).
- Storage is allocated once for `capacity_tokens`; a slot's last page is partly empty (at
  most `page_size - 1` token slots per sequence are held but unused).
- Writes land in place only when no other pending work reads the same storage array (MLX
  buffer donation): the runner evaluates each forward before the next one's writes are
  encoded, and a chunk that wraps a window reads its old slots through `PagedBatch.prefetch`,
  evaluated before that forward. Otherwise a write copies the whole layer storage.
- Page tables are shared by all layers, so in a model mixing full and windowed layers a slot
  gets pages for its full length and the windowed layers leave most of them unused.

Windows follow `KVCache` exactly: a windowed sequence holds at most `window.max_size` token
slots (logical slot `window.slot(position)`); the decode token overwrites the evicted slot
first; a multi-token chunk that wraps attends over the old slots plus the chunk, then writes
the ring (per slot, only its newest position).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .codecs import Fields, KVCodec
from .factory import CacheOptions, make_layer_caches
from .kv import KVCache
from .pages import LayerBudget, SlotTable, SlotView
from .paged_index import GroupIndex, plan_group
from .protocol import AttendingCache
from .window import Window


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One attention layer's codecs and window (`None`: full attention)."""

    key_codec: KVCodec
    value_codec: KVCodec
    window: Window | None = None


def layer_specs(model: nn.Module, options: CacheOptions) -> list[LayerSpec]:
    """Per-layer codecs and windows, translated as `make_layer_caches` does.

    Raises:
        ValueError: a layer that is not attention (recurrent state cannot be paged), or an
            unknown scheme.
    """
    specs = []
    for layer, cache in enumerate(make_layer_caches(model, options)):
        if not isinstance(cache, KVCache):
            raise ValueError(f"layer {layer}: {type(cache).__name__} layers are not supported by BatchedKVCache")
        specs.append(LayerSpec(cache.key_codec, cache.value_codec, cache.window))
    return specs


class BatchedKVCache:
    """K/V storage of many sequences in fixed-size pages, one `SlotTable` for all layers.

    Args:
        layers (Sequence[LayerSpec]): One spec per attention layer.
        n_kv_heads (int): KV heads per layer.
        head_dim (int): Dimensions per head.
        capacity_tokens (int): Token slots of storage, rounded down to whole pages.
        page_size (int): Token slots per page. Default: 16.
        max_slots (int): Sequences held at once. Default: 64.

    Raises:
        ValueError: capacity below one page, or a non-positive size.
    """

    def __init__(
        self,
        layers: Sequence[LayerSpec],
        *,
        n_kv_heads: int,
        head_dim: int,
        capacity_tokens: int,
        page_size: int = 16,
        max_slots: int = 64,
    ):
        if page_size < 1 or capacity_tokens < page_size:
            raise ValueError(f"capacity_tokens {capacity_tokens} must hold at least one page of {page_size} tokens")
        self.layers, self.n_kv_heads, self.head_dim = tuple(layers), n_kv_heads, head_dim
        num_pages = capacity_tokens // page_size
        rows = num_pages * n_kv_heads * page_size
        probe = mx.zeros((1, n_kv_heads, 1, head_dim), mx.float32)
        self._keys = [_allocate(spec.key_codec.encode(probe), rows) for spec in self.layers]
        self._values = [_allocate(spec.value_codec.encode(probe), rows) for spec in self.layers]
        budgets = [
            LayerBudget(None if s.window is None else s.window.max_size, _row_bytes(k + v) * n_kv_heads)
            for s, k, v in zip(self.layers, self._keys, self._values)
        ]
        self.slots = SlotTable(num_pages=num_pages, page_size=page_size, max_slots=max_slots, layers=budgets)
        self.windows = tuple(dict.fromkeys(spec.window for spec in self.layers))  # distinct rules, in order

    @classmethod
    def for_model(cls, model: nn.Module, options: CacheOptions, **kwargs) -> BatchedKVCache:
        """Build for a model's layers (see `layer_specs`); `kwargs` as in the constructor."""
        return cls(layer_specs(model, options), **kwargs)

    # -- bookkeeping (delegated to the slot table) ---------------------------------

    @property
    def page_size(self) -> int:
        return self.slots.page_size

    @property
    def capacity_tokens(self) -> int:
        return self.slots.capacity_tokens

    @property
    def free_tokens(self) -> int:
        return self.slots.free_tokens

    @property
    def bytes_per_token(self) -> int:
        return self.slots.bytes_per_token

    def acquire(self) -> SlotView:
        return self.slots.acquire()

    def release(self, view: SlotView) -> int:
        return self.slots.release(view)

    @property
    def arrays(self) -> list[mx.array]:
        """Every storage array (evaluate them after each forward so the graph stays short)."""
        return [f for fields in self._keys + self._values for f in fields]

    # -- forwards ---------------------------------------------------------------

    def batch(self, views: Sequence[SlotView], num_new: int) -> PagedBatch:
        """Reserve, advance and index one forward of `num_new` tokens for each of `views`.

        All rows get their pages or none does; the offsets advance at once (the forward
        must follow).

        Args:
            views (Sequence[SlotView]): The rows, in the order of the model's batch axis.
            num_new (int): L, new tokens per row.

        Returns:
            PagedBatch: per-layer caches to pass as `model(..., cache=batch.layers)`.

        Raises:
            CapacityExhausted: the free pages do not cover the new tokens; nothing changed.
            StaleSlot: a view is stale; nothing changed.
            ValueError: no rows, or `num_new < 1`.
        """
        if not views or num_new < 1:
            raise ValueError(f"a forward needs rows and new tokens, got {len(views)} rows of {num_new}")
        starts, tables = self.slots.begin_forward(views, num_new)
        padded = np.zeros((len(tables), max(map(len, tables))), np.int64)
        for row, table in enumerate(tables):
            padded[row, : len(table)] = table
        starts = np.array(starts, np.int64)
        shape = {"n_kv_heads": self.n_kv_heads, "page_size": self.page_size}
        groups = {w: _GroupArrays(w, plan_group(w, starts, num_new, padded, **shape), starts) for w in self.windows}
        layers = [PagedLayerCache(self, i, groups[spec.window]) for i, spec in enumerate(self.layers)]
        return PagedBatch(layers, [a for layer in layers for a in layer.prefetched])

    def write(self, layer: int, group: _GroupArrays, k_new: Fields, v_new: Fields) -> None:
        """Scatter encoded new tokens [B, n_kv_heads, L, *] into the layer's pages (in place)."""
        for store, new in ((self._keys[layer], k_new), (self._values[layer], v_new)):
            for f, x in zip(store, new):
                x = x.reshape(-1, *f.shape[1:])
                if group.write_source is not None:
                    x = mx.take(x, group.write_source, axis=0)
                f[group.write_rows] = x

    def read(self, layer: int, group: _GroupArrays) -> tuple[mx.array, mx.array]:
        """Gather and decode the attended slots: K and V [B, n_kv_heads, T, head_dim]."""
        index = group.index
        batch = index.query_positions.shape[0]
        spec = self.layers[layer]

        def gather(store: list[mx.array]) -> Fields:
            return tuple(
                mx.take(f.reshape(-1, self.page_size, *f.shape[1:]), group.read_blocks, axis=0).reshape(
                    batch, self.n_kv_heads, index.num_read, *f.shape[1:]
                )
                for f in store
            )

        return spec.key_codec.decode(gather(self._keys[layer])), spec.value_codec.decode(gather(self._values[layer]))


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """One forward's per-layer caches, and arrays to evaluate before running it.

    Attributes:
        layers (list[PagedLayerCache]): Pass as `cache=` to the model.
        prefetch (list[mx.array]): Old K/V a window-wrapping chunk reads; evaluating them
            before the forward lets its writes land in place (empty in every other case).
    """

    layers: list[PagedLayerCache]
    prefetch: list[mx.array]


class _GroupArrays:
    """A `GroupIndex` as MLX arrays, shared by the layers that follow it.

    The integer indices travel to the device as one array and are sliced there (one
    transfer per forward instead of three).
    """

    def __init__(self, window: Window | None, index: GroupIndex, starts: np.ndarray):
        self.window, self.index = window, index
        source = np.zeros(0, np.int32) if index.write_source is None else index.write_source
        parts = [index.write_rows, source, index.read_blocks, starts.astype(np.int32)]
        packed = mx.array(np.concatenate(parts))
        bounds = np.cumsum([0] + [len(p) for p in parts])
        write_rows, write_source, self.read_blocks, offsets = (packed[a:b] for a, b in zip(bounds, bounds[1:]))
        self.write_rows = write_rows
        self.write_source = None if index.write_source is None else write_source
        # mlx's RoPE takes an int or a per-row [B] array; one row keeps the int (as KVCache does).
        self.offset = int(starts[0]) if len(starts) == 1 else offsets
        self.mask = self._default_mask()

    def _default_mask(self):
        visible = self.index.visible(self.window)
        if visible.all():
            return None
        return "causal" if self.index.is_causal(visible) else mx.array(visible)


class PagedLayerCache(AttendingCache):
    """One layer's view of a forward over a set of slots, speaking mlx-lm's cache protocol.

    `offset` is an int for one row, else an int32 [B] array of per-row start positions
    (mlx's RoPE takes either). `update_and_fetch` writes the new tokens into the rows'
    pages and returns dense K/V [B, n_kv_heads, T, head_dim] in the codec's attention
    domain; `make_mask` returns the matching mask; `attend` runs attention on them.
    """

    def __init__(self, owner: BatchedKVCache, layer: int, group: _GroupArrays):
        self.owner, self.layer, self.group, self.offset = owner, layer, group, group.offset
        self.spec = owner.layers[layer]
        self.prefetched: list[mx.array] = []
        if group.index.read_first:
            self.prefetched = list(owner.read(layer, group))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store L new tokens per row and return what attention reads.

        Args:
            keys (mx.array): [B, n_kv_heads, L, head_dim], RoPE applied at each row's positions.
            values (mx.array): [B, n_kv_heads, L, head_dim].

        Returns:
            tuple[mx.array, mx.array]: K and V [B, n_kv_heads, K, head_dim], ordered as
            `make_mask` assumes (K = T, or T + L for a chunk that wraps a window).

        Raises:
            ValueError: B or L differ from what `BatchedKVCache.batch` planned.
        """
        index = self.group.index
        if keys.shape[0] != index.query_positions.shape[0] or keys.shape[2] != index.query_positions.shape[1]:
            raise ValueError(f"planned for {index.query_positions.shape} (rows, tokens), got keys {keys.shape}")
        k_new, v_new = self.spec.key_codec.encode(keys), self.spec.value_codec.encode(values)
        if not index.read_first:
            self.owner.write(self.layer, self.group, k_new, v_new)
            return self.owner.read(self.layer, self.group)
        old_k, old_v = self.prefetched
        new_k, new_v = self.spec.key_codec.decode(k_new), self.spec.value_codec.decode(v_new)
        self.owner.write(self.layer, self.group, k_new, v_new)
        return mx.concatenate([old_k, new_k], axis=2), mx.concatenate([old_v, new_v], axis=2)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """Mask for the planned queries: `None`, `"causal"` or a boolean [B, 1, L, K] array.

        Raises:
            ValueError: N differs from the planned L.
        """
        index = self.group.index
        if N != index.query_positions.shape[1]:
            raise ValueError(f"planned {index.query_positions.shape[1]} queries per row, asked for {N}")
        if window_size is not None and self.group.window is None:
            return mx.array(index.visible(None, window_size))
        if return_array and not isinstance(self.group.mask, mx.array):
            return mx.array(index.visible(self.group.window))
        return self.group.mask

    def attend(self, queries, keys, values, *, scale: float, mask, sinks=None) -> mx.array:
        """Attention of queries [B, n_heads, L, head_dim] over `update_and_fetch`'s K/V (as `KVCache.attend`)."""
        q = self.spec.key_codec.rotate_query(queries)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask, sinks=sinks)
        return self.spec.value_codec.unrotate_output(out)


def _allocate(probe: Fields, rows: int) -> list[mx.array]:
    """Zeroed storage `[rows, *]` for each field of a probe encoding [1, H, 1, *]."""
    return [mx.zeros((rows, *f.shape[3:]), f.dtype) for f in probe]


def _row_bytes(fields: Sequence[mx.array]) -> int:
    """Bytes of one storage row (one head of one token) across fields."""
    return sum(math.prod(f.shape[1:]) * f.dtype.size for f in fields)
