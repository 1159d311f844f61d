"""What one forward over paged storage sees: the storage arrays, the index arrays, per-layer caches.

Split from `batched.py` so a forward can be built over any set of storage arrays, the
cache's own or the placeholders `mx.compile` traces with: nothing here keeps state
across forwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .codecs import Fields, KVCodec
from .paged_index import GroupIndex
from .protocol import AttendingCache
from .window import Window


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One attention layer's codecs and window (`None`: full attention)."""

    key_codec: KVCodec
    value_codec: KVCodec
    window: Window | None = None


class PagedStorage:
    """Per layer and codec field, one page array `[num_pages * n_kv_heads * page_size, *]` for K and one for V.

    Writes rebind the arrays it holds (MLX arrays are values): the caller reads `arrays`
    afterwards to get the written versions.
    """

    def __init__(self, keys: list[list[mx.array]], values: list[list[mx.array]], *, n_kv_heads: int, page_size: int):
        self.keys, self.values, self.n_kv_heads, self.page_size = keys, values, n_kv_heads, page_size

    @property
    def arrays(self) -> list[mx.array]:
        """Every array, layer by layer (K fields, then V fields)."""
        return [f for k, v in zip(self.keys, self.values) for f in (*k, *v)]

    def with_arrays(self, arrays: Sequence[mx.array]) -> PagedStorage:
        """The same structure over other arrays (in `arrays` order)."""
        it = iter(arrays)
        keys, values = [], []
        for k, v in zip(self.keys, self.values):
            keys.append([next(it) for _ in k])
            values.append([next(it) for _ in v])
        return PagedStorage(keys, values, n_kv_heads=self.n_kv_heads, page_size=self.page_size)

    def write(self, layer: int, index: ForwardIndex, k_new: Fields, v_new: Fields) -> None:
        """Scatter encoded new tokens [B, n_kv_heads, L, *] into the layer's pages."""
        for store, new in ((self.keys[layer], k_new), (self.values[layer], v_new)):
            for i, x in enumerate(new):
                x = x.reshape(-1, *store[i].shape[1:])
                if index.write_source is not None:
                    x = mx.take(x, index.write_source, axis=0)
                store[i][index.write_rows] = x

    def gather(self, layer: int, index: ForwardIndex) -> tuple[Fields, Fields]:
        """The attended (page, head) blocks of the layer: K and V fields [B, n_kv_heads, T, *]."""

        def blocks(store: list[mx.array]) -> Fields:
            return tuple(
                mx.take(f.reshape(-1, self.page_size, *f.shape[1:]), index.read_blocks, axis=0).reshape(
                    index.batch, self.n_kv_heads, index.num_read, *f.shape[1:]
                )
                for f in store
            )

        return blocks(self.keys[layer]), blocks(self.values[layer])


@dataclass(frozen=True, slots=True)
class ForwardIndex:
    """A `GroupIndex` as MLX arrays, shared by every layer with the same window rule.

    Attributes:
        window (Window | None): The layers' window rule.
        batch (int): B rows.
        num_new (int): L new tokens per row.
        num_read (int): T token slots gathered per row.
        read_first (bool): See `GroupIndex`.
        write_rows, write_source, read_blocks (mx.array): See `GroupIndex` (int32).
        offset (int | mx.array): RoPE offset: an int for one row, else int32 [B].
        mask: `None`, `"causal"` or bool [B, 1, L, K].
        host (GroupIndex | None): The numpy plan (None for a forward rebuilt from arrays).
    """

    window: Window | None
    batch: int
    num_new: int
    num_read: int
    read_first: bool
    write_rows: mx.array
    write_source: mx.array | None
    read_blocks: mx.array
    offset: int | mx.array
    mask: object
    host: GroupIndex | None

    @classmethod
    def from_plan(
        cls, window: Window | None, index: GroupIndex, starts: np.ndarray, *, as_arrays: bool
    ) -> ForwardIndex:
        """Move a plan to the device: its integer indices as one transfer, sliced there.

        Args:
            as_arrays (bool): Offset and mask always as arrays (what a traced forward needs);
                otherwise one row keeps an int offset and the mask may be `None` or `"causal"`.
        """
        source = np.zeros(0, np.int32) if index.write_source is None else index.write_source
        parts = [index.write_rows, source, index.read_blocks, starts.astype(np.int32)]
        packed = mx.array(np.concatenate(parts))
        bounds = np.cumsum([0] + [len(p) for p in parts])
        rows, sources, blocks, offsets = (packed[a:b] for a, b in zip(bounds, bounds[1:]))
        visible = index.visible(window)
        if as_arrays:
            offset, mask = offsets, mx.array(visible)
        else:  # one row keeps the int offset and the cheapest mask, as KVCache does
            offset = int(starts[0]) if len(starts) == 1 else offsets
            mask = None if visible.all() else "causal" if index.is_causal(visible) else mx.array(visible)
        batch, num_new = index.query_positions.shape
        return cls(window, batch, num_new, index.num_read, index.read_first, rows,
                   None if index.write_source is None else sources, blocks, offset, mask, index)

    def decode_arrays(self) -> list[mx.array]:
        """What a traced decode forward takes: write rows, read blocks, offsets, mask."""
        return [self.write_rows, self.read_blocks, self.offset, self.mask]

    @classmethod
    def from_decode_arrays(cls, window: Window | None, arrays: Sequence[mx.array], *, page_size: int) -> ForwardIndex:
        """Rebuild a one-token-per-row forward from `decode_arrays` (shapes give the sizes)."""
        rows, blocks, offsets, mask = arrays
        return cls(window, offsets.shape[0], 1, mask.shape[-1], False, rows, None, blocks, offsets, mask, None)


class PagedLayerCache(AttendingCache):
    """One layer's view of a forward over a set of slots, speaking mlx-lm's cache protocol.

    `offset` is an int for one row, else an int32 [B] array of per-row start positions
    (mlx's RoPE takes either). `update_and_fetch` writes the new tokens into the rows'
    pages and returns dense K/V [B, n_kv_heads, T, head_dim] in the codec's attention
    domain; `make_mask` returns the matching mask; `attend` runs attention on them.
    """

    def __init__(self, storage: PagedStorage, layer: int, spec: LayerSpec, index: ForwardIndex):
        self.storage, self.layer, self.spec, self.index, self.offset = storage, layer, spec, index, index.offset
        self.prefetched: list[mx.array] = []
        if index.read_first:
            self.prefetched = list(self._read())

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store L new tokens per row and return what attention reads.

        Args:
            keys (mx.array): [B, n_kv_heads, L, head_dim], RoPE applied at each row's positions.
            values (mx.array): [B, n_kv_heads, L, head_dim].

        Returns:
            tuple[mx.array, mx.array]: K and V [B, n_kv_heads, K, head_dim], ordered as
            `make_mask` assumes (K = T, or T + L for a chunk that wraps a window).

        Raises:
            ValueError: B or L differ from what the forward was planned for.
        """
        index = self.index
        if keys.shape[0] != index.batch or keys.shape[2] != index.num_new:
            raise ValueError(f"planned for {index.batch} rows of {index.num_new} tokens, got keys {keys.shape}")
        k_new, v_new = self.spec.key_codec.encode(keys), self.spec.value_codec.encode(values)
        if not index.read_first:
            self.storage.write(self.layer, index, k_new, v_new)
            return self._read()
        old_k, old_v = self.prefetched
        new_k, new_v = self.spec.key_codec.decode(k_new), self.spec.value_codec.decode(v_new)
        self.storage.write(self.layer, index, k_new, v_new)
        return mx.concatenate([old_k, new_k], axis=2), mx.concatenate([old_v, new_v], axis=2)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """Mask for the planned queries: `None`, `"causal"` or a boolean [B, 1, L, K] array.

        Raises:
            ValueError: N differs from the planned L, or an extra `window_size` is asked of a
                forward rebuilt from arrays (its mask cannot change).
        """
        index = self.index
        if N != index.num_new:
            raise ValueError(f"planned {index.num_new} queries per row, asked for {N}")
        if window_size is not None and index.window is None:
            if index.host is None:
                raise ValueError("a traced decode forward cannot add a window_size to its mask")
            return mx.array(index.host.visible(None, window_size))
        if return_array and not isinstance(index.mask, mx.array):
            return mx.array(index.host.visible(index.window))
        return index.mask

    def attend(self, queries, keys, values, *, scale: float, mask, sinks=None) -> mx.array:
        """Attention of queries [B, n_heads, L, head_dim] over `update_and_fetch`'s K/V (as `KVCache.attend`)."""
        q = self.spec.key_codec.rotate_query(queries)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask, sinks=sinks)
        return self.spec.value_codec.unrotate_output(out)

    def _read(self) -> tuple[mx.array, mx.array]:
        k, v = self.storage.gather(self.layer, self.index)
        return self.spec.key_codec.decode(k), self.spec.value_codec.decode(v)
