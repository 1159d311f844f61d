"""`BatchedKVCache`: paged K/V storage shared by many sequences, in any scheme, windows included.

Layout. Capacity is counted in tokens and cut into pages of `page_size` token positions. Each
layer keeps its pools (`kernels.kv_format`: raw K and V, or one compressed row per token and
head), head-major `[n_kv_heads * num_pages * page_size, width]` (`pool_rows`), and one
`SlotTable` (one allocator, one page table per slot) serves all layers: page `p` names the
same token positions in every layer. A forward over a set of slots writes its new tokens with one
scatter per pool (a lean decode step on CUDA: in place, by its q/k/v kernel) and attends through the page tables in place (`kernels.paged_attention`:
fused CUDA kernels, or MLX ops over chunks of pages) — no gathered copy of the history, no
dequantized copy. The indices are built once per forward (numpy), moved to the device in one
transfer, and shared by all layers with the same window rule.

Costs of this layout:
- Storage is allocated once for `capacity_tokens`; a slot's last page is partly empty (at
  most `page_size - 1` tokens per sequence are held but unused).
- Writes land in place only when no other pending work reads the same pool (MLX buffer
  donation): the runner lets a forward's reads finish before the next forward's writes are
  launched, and a chunk that wraps a window reads its old slots through `PagedBatch.prefetch`,
  evaluated before that forward. Otherwise a write copies the whole pool.
- Decode runs in windows of steps (`decode_window`): the steps write a small tail pool, so
  the host launches step n+1 while step n runs; a window step can be traced once and replayed
  (`window_indices` / `window_layers`, for `mx.compile`): its pages read per row are rounded up
  (`bucket_pages`) so the shapes, and the traces, change rarely; lengths mask the padding.
- Page tables are shared by all layers, so in a model mixing full and windowed layers a slot
  gets pages for its full length and the windowed layers leave most of them unused.

Hybrid models: recurrent layers keep a fixed-size state per slot in a `StatePool` beside the
pages (same slot ids, so the same generations); a `CacheLayout` puts each forward's attention
and recurrent caches back into the model's cache-list shape. A forward reads its rows' state
and writes the new state back; a decode window carries the rows' state from step to step and
`write_window_states` stores it when the window is collected.

Windows follow `KVCache` exactly: a windowed sequence holds at most `window.max_size` tokens
(at storage index `window.storage_index(position)`); the decode token overwrites the evicted
index first; a multi-token chunk that wraps attends over the old indices plus the chunk, then
writes the ring (per index, only its newest position).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kernels import pool_move
from kernels.kv_format import LayerFormat

from . import pool_rows
from .factory import CacheOptions, make_layer_caches
from .kv import KVCache
from .layout import CacheLayout
from .pages import LayerBudget, SlotTable, SlotView
from .prefix import format_root
from .decode_window import TAIL_PAGES_PER_ROW, WindowIndex, plan_window
from .paged_index import plan_group
from .paged_layers import ForwardIndex, LayerSpec, PagedLayerCache, PagedStorage
from .recurrent import leaf_caches
from .state_pool import StatePool, StateSpec, probe_state_specs


def layer_specs(model: nn.Module, options: CacheOptions) -> list[tuple]:
    """Per attention layer (key part, value part, window, geometry, key mean), translated as `make_layer_caches` does.

    Recurrent layers are skipped (they keep state, not pages: see `CacheLayout`).

    Raises:
        ValueError: an unknown scheme, a cache kind we do not translate, or a scheme that cannot
            store a layer's widths.
    """
    return [(c.key, c.value, c.window, c.geometry, c.key_mean) for c in leaf_caches(make_layer_caches(model, options))
            if isinstance(c, KVCache)]


def bucket_pages(num_pages: int) -> int:
    """Pages a traced decode reads per row: a power of two up to 16, then a multiple of 16."""
    return 1 << (num_pages - 1).bit_length() if num_pages <= 16 else 16 * math.ceil(num_pages / 16)


class BatchedKVCache:
    """K/V storage of many sequences in fixed-size pages, one `SlotTable` for all layers.

    Args:
        layers (Sequence[tuple[PartFormat, PartFormat, Window | None, LayerGeometry, mx.array | None]]): Per
            attention layer: its parts, window, geometry (widths may differ between layers
            and between keys and values; the number of kv heads may not) and the mean its keys are
            stored centered on (`centering`; None: as they come), as `layer_specs` gives them.
        capacity_tokens (int): Tokens of storage, rounded down to whole pages.
        page_size (int): Tokens per page. Default: 16.
        max_slots (int): Sequences held at once. Default: 64.
        prefix_key (str | None): The model's identity (path, weight dtype): turns the prefix
            cache on, its hash chains rooted in it and in every layer's format and window
            (`prefix.format_root`). None: pages are never shared; also off for models with
            recurrent state (a state cannot resume from shared K/V). Default: None.
        states (Sequence[StateSpec]): Per recurrent layer, its state per slot. Default: none.
        layout (CacheLayout | None): The model's cache list over `layers` and `states`.
            Default: the attention layers in order.

    Raises:
        ValueError: capacity below one page, a non-positive size, no attention layer, a layout
            that does not match, layers storing different numbers of kv heads, or a scheme that
            cannot store a layer's widths.
    """

    def __init__(
        self,
        layers: Sequence[tuple],
        *,
        capacity_tokens: int,
        page_size: int = 16,
        max_slots: int = 64,
        prefix_key: str | None = None,
        states: Sequence[StateSpec] = (),
        layout: CacheLayout | None = None,
    ):
        self.layout = layout or CacheLayout(tuple(("kv", i) for i in range(len(layers))))
        if (self.layout.num_kv, self.layout.num_state) != (len(layers), len(states)) or not layers:
            raise ValueError(f"a layout of {self.layout.num_kv} attention and {self.layout.num_state} recurrent "
                             f"layers for {len(layers)} and {len(states)} (at least one attention layer)")
        if page_size < 1 or capacity_tokens < page_size:
            raise ValueError(f"capacity_tokens {capacity_tokens} must hold at least one page of {page_size} tokens")
        heads = sorted({g.n_kv_heads for _, _, _, g, _ in layers})
        if len(heads) != 1:
            raise ValueError(f"layers store {heads} kv heads per token; BatchedKVCache needs one count for every layer")
        self.layers = tuple(LayerSpec(LayerFormat(k, v, g.key_dim, g.value_dim), w, g.latent, mean)
                            for k, v, w, g, mean in layers)
        n_kv_heads = self.n_kv_heads = heads[0]
        num_pages = capacity_tokens // page_size
        rows = num_pages * n_kv_heads * page_size
        pools = [pool_rows.allocate(spec.fmt, rows) for spec in self.layers]
        self.storage = PagedStorage(pools, n_kv_heads=n_kv_heads, page_size=page_size)
        budgets = [
            LayerBudget(None if s.window is None else s.window.max_size, s.fmt.bytes_per_row * n_kv_heads,
                        0 if s.window is None else s.window.keep)
            for s in self.layers
        ]
        self.states = StatePool(states, max_slots)
        shared = prefix_key is not None and not self.states.bytes_per_slot
        root = format_root(prefix_key, self.layers, n_kv_heads, page_size) if shared else None
        self.slots = SlotTable(num_pages=num_pages, page_size=page_size, max_slots=max_slots, layers=budgets,
                               prefix_root=root, state_bytes_per_slot=self.states.bytes_per_slot)
        # Decode windows write a tail pool where steps are launched back to back (a GPU); on the
        # CPU backend they write the main pools, each step after the last (decode_window).
        self.use_tail = mx.default_device() != mx.cpu
        self.tail_pages = max_slots * TAIL_PAGES_PER_ROW if self.use_tail else 1
        tails = [pool_rows.allocate(spec.fmt, self.tail_pages * n_kv_heads * page_size) for spec in self.layers]
        self.tail = PagedStorage(tails, n_kv_heads=n_kv_heads, page_size=page_size)
        self.windows = tuple(dict.fromkeys(spec.window for spec in self.layers))  # distinct rules, in order

    @classmethod
    def for_model(cls, model: nn.Module, options: CacheOptions, **kwargs) -> BatchedKVCache:
        """Build for a model's layers (see `layer_specs`; recurrent state sized by `probe_state_specs`).

        `kwargs` as in the constructor.
        """
        layout = CacheLayout.of(make_layer_caches(model, options))
        if not layout.num_kv:
            raise ValueError("the model has no attention layer: the engine serves models with at least one")
        states = probe_state_specs(model) if layout.num_state else ()
        return cls(layer_specs(model, options), states=states, layout=layout, **kwargs)

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
    def state_bytes_per_slot(self) -> int:
        """Recurrent state bytes of one slot (0 for models without recurrent layers)."""
        return self.states.bytes_per_slot

    @property
    def arrays(self) -> list[mx.array]:
        """Every page pool array (evaluate them after each forward so the graph stays short).

        On CUDA a decode window's tail moves write them in place, unseen by MLX (`copy_from_tail`): read
        one on the host only after `mx.synchronize()`.
        """
        return self.storage.arrays

    def replace_arrays(self, arrays: Sequence[mx.array]) -> None:
        """Adopt the storage arrays a traced forward returned (same order as `arrays`)."""
        self.storage = self.storage.with_arrays(arrays)

    @property
    def state_arrays(self) -> list[mx.array]:
        """Every recurrent state pool array (hybrid models; evaluate them with `arrays`)."""
        return self.states.arrays

    # -- forwards ---------------------------------------------------------------

    def batch(self, views: Sequence[SlotView], num_new: int) -> PagedBatch:
        """Reserve, advance and index one forward of `num_new` tokens for each of `views`.

        All rows get their pages or none does; the offsets advance at once (the forward
        must follow).

        Args:
            views (Sequence[SlotView]): The rows, in the order of the model's batch axis.
            num_new (int): L, new tokens per row.

        Returns:
            PagedBatch: the caches to pass as `model(..., cache=batch.layers)`; recurrent layers
            read the rows' state (zero for a row starting at position 0) and write it back.

        Raises:
            CapacityExhausted: the free pages do not cover the new tokens; nothing changed.
            StaleSlot: a view is stale; nothing changed.
            ValueError: no rows, or `num_new < 1`.
        """
        starts, indices = self._plan(views, num_new)
        layers = [PagedLayerCache(self.storage, i, spec, indices[spec.window]) for i, spec in enumerate(self.layers)]
        states = self.states.views(self._slot_ids(views), starts == 0) if self.states.specs else []
        return PagedBatch(self.layout.assemble(layers, states), [a for layer in layers for a in layer.prefetched])

    @property
    def num_pages(self) -> int:
        return self.slots.num_pages

    def plan_window(self, views: Sequence[SlotView], num_steps: int) -> list[WindowIndex]:
        """Reserve and advance `num_steps` tokens per row; plan a decode window (`decode_window`).

        Returns:
            list[WindowIndex]: per window rule, in `windows` order.

        Raises:
            CapacityExhausted, StaleSlot, ValueError: as `batch`; ValueError also for a window
                longer than a page or more rows than the tail pool serves.
        """
        starts, padded = self._begin(views, num_steps, keeps_start_state=True)
        shape = {"n_kv_heads": self.n_kv_heads, "num_pages": self.num_pages, "tail_pages": self.tail_pages,
                 "page_size": self.page_size, "read_pages": bucket_pages, "use_tail": self.use_tail}
        return [plan_window(w, starts, num_steps, padded, **shape) for w in self.windows]

    def window_indices(self, plans: Sequence[WindowIndex], starts: np.ndarray) -> WindowArrays:
        """A window's device index arrays, every one a contiguous slice of one upload (`WindowArrays`).

        One upload: MLX places an array built from host data in managed memory, which the GPU takes over at a
        page fault, so the steps' indices and both tail moves' rows share one, and one fault a window (44-154 us
        on the H200, paid by the first kernel to read the upload: the tail move's launch, which copies its rows
        in ~3 us; `ops/results/host_cost_gpu_2026-12-04.json`). Slices, not rows taken by an integer index:
        that would be a gather kernel, and a one-row batch's 4-byte lengths and positions would land in MLX's
        small pool in host memory, read by every attention and q/k/v block across the bus
        (`ops/results/index_slices_gpu_2026-12-04.json`).
        """
        num_steps = plans[0].lengths.shape[0]
        offsets = (starts[None, :] + np.arange(num_steps)[:, None]).astype(np.int32)
        parts = [offsets] + [a for p in plans for a in (p.write_rows, p.page_table, p.lengths)]
        parts += [a for p in plans for a in (p.main_rows[p.copy_in], p.tail_rows[p.copy_in], p.tail_rows, p.main_rows)]
        packed = mx.array(np.concatenate([a.reshape(-1).astype(np.int32) for a in parts]))
        bounds = np.cumsum([0] + [a.size for a in parts]).tolist()

        def part(k: int) -> mx.array:
            return packed[bounds[k] : bounds[k + 1]]

        def step_row(k: int, i: int) -> mx.array:  # row i of per-step part k, flat
            width = parts[k].size // num_steps
            return packed[bounds[k] + i * width : bounds[k] + (i + 1) * width]

        def move(k: int) -> tuple[mx.array, mx.array] | None:  # (source rows, target rows) of move parts k, k + 1
            return (part(k), part(k + 1)) if parts[k].size else None

        rules = range(len(plans))
        tables = [part(2 + 3 * g).reshape(p.page_table.shape) for g, p in zip(rules, plans)]
        steps = [[[step_row(1 + 3 * g, i), tables[g], step_row(3 + 3 * g, i), step_row(0, i)] for g in rules]
                 for i in range(num_steps)]
        first = 1 + 3 * len(plans)
        return WindowArrays(steps, [move(first + 4 * g) for g in rules], [move(first + 4 * g + 2) for g in rules])

    def copy_to_tail(self, arrays: WindowArrays) -> None:
        """Copy the pages a window writes into their tail pages (tokens from before it only; none without a tail).

        On CUDA one launch per window rule moves every layer's rows in place (`kernels.pool_move`), evaluated
        here on its own, so the stream runs it after what came before and before the window's steps.
        """
        self._move_pages(arrays.to_tail, to_tail=True)

    def copy_from_tail(self, arrays: WindowArrays) -> None:
        """Copy a window's tail pages back to their pages, after its steps and before the next window's copy
        into the tail (the runner calls it after waiting for the window, or launching the next one ahead).

        A lean CUDA step writes the tail in place (`kernels.qkv_rope.split_qkv_rope_store`), which MLX does
        not see, so a copy evaluated in the same graph as that step would not be ordered after its write. On
        CUDA the copy is one launch per window rule, in place (`kernels.pool_move`), evaluated here on its own,
        so the stream orders it after the window's steps: a host read of a pool after it must wait for the
        stream (`mx.synchronize`). Elsewhere it is MLX's scatter, ordered by its data.
        """
        self._move_pages(arrays.from_tail, to_tail=False)

    @property
    def moves_in_place(self) -> bool:
        """Whether tail-page moves are `kernels.pool_move` launches (MLX's CUDA backend), in place and ordered by
        the stream, rather than MLX scatters, which copy a whole pool while launched work still reads it."""
        return self.use_tail and all(pool_move.serves(*pairs) for rule in self.windows
                                     for pairs in self._move_launches(rule, to_tail=True))

    def _move_launches(self, rule, *, to_tail: bool) -> list[tuple[list[mx.array], list[mx.array]]]:
        """(sources, targets) pool lists of one window rule's layers, `pool_move.MAX_PAIRS` pairs a launch."""
        layers = self._rule_layers(rule)
        main = [a for i in layers for a in self.storage.pools[i]]
        tail = [a for i in layers for a in self.tail.pools[i]]
        sources, targets = (main, tail) if to_tail else (tail, main)
        step = pool_move.MAX_PAIRS
        return [(sources[k : k + step], targets[k : k + step]) for k in range(0, len(sources), step)]

    def _rule_layers(self, rule) -> list[int]:
        """Indices of the layers under window rule `rule` (an entry of `windows`)."""
        return [i for i, spec in enumerate(self.layers) if spec.window == rule]

    def _move_pages(self, moves: Sequence[tuple[mx.array, mx.array] | None], *, to_tail: bool) -> None:
        """Per window rule (`windows` order), rows `moves[rule][0]` of each of its layers' main (`to_tail`) or
        tail pools into rows `moves[rule][1]` of the other (int32 [m] each; None: nothing to move)."""
        for rule, rows in zip(self.windows, moves):
            if rows is None:
                continue
            launches = self._move_launches(rule, to_tail=to_tail)
            if all(pool_move.serves(*pairs) for pairs in launches):
                for pairs in launches:  # each evaluated alone (kernels.pool_move)
                    mx.async_eval(pool_move.move_rows(*pairs, *rows))
                continue
            source, target = (self.storage, self.tail) if to_tail else (self.tail, self.storage)
            for i in self._rule_layers(rule):
                target.pools[i] = pool_rows.move(source.pools[i], rows[0], target.pools[i], rows[1])

    @property
    def tail_arrays(self) -> list[mx.array]:
        return self.tail.arrays

    def replace_tail_arrays(self, arrays: Sequence[mx.array]) -> None:
        self.tail = self.tail.with_arrays(arrays)

    def read_window_states(self, views: Sequence[SlotView]) -> list[mx.array]:
        """The rows' recurrent state at a decode window's start (`states.arrays` order, [B, ...]; lazy)."""
        return self.states.read(self._slot_ids(views)) if self.states.specs else []

    def write_window_states(self, views: Sequence[SlotView], rows: Sequence[mx.array]) -> None:
        """Store rows' recurrent state (as `read_window_states` orders it) into their slots."""
        if rows:
            self.states.write(self._slot_ids(views), rows)

    def window_layers(self, arrays: Sequence[mx.array], tail_arrays: Sequence[mx.array], indices,
                      state_rows: Sequence[mx.array] = ()):
        """The caches of one window step over given arrays (traceable: no state read).

        Args:
            arrays, tail_arrays: Main and tail pool arrays, as `arrays` / `tail_arrays` order them.
            indices: One step of `window_indices` (per window rule: rows, page table, lengths, offsets).
            state_rows: The rows' recurrent state before the step (`read_window_states` order).

        Returns:
            tuple[list, PagedStorage, list[RecurrentStateCache]]: the caches to run the model with,
            the storage they write — the tail, or the main pools without one (read its `arrays`
            after) — and the recurrent layers' views (their `cache` lists hold the state after the step).
        """
        storage = self.storage.with_arrays(arrays)
        tail = self.tail.with_arrays(tail_arrays) if self.use_tail else None
        index = {window: ForwardIndex.from_decode_arrays(group) for window, group in zip(self.windows, indices)}
        layers = [PagedLayerCache(storage, i, spec, index[spec.window], tail=tail) for i, spec in enumerate(self.layers)]
        states = self.states.row_views(state_rows) if self.states.specs else []
        return self.layout.assemble(layers, states), tail if self.use_tail else storage, states

    @staticmethod
    def _slot_ids(views: Sequence[SlotView]) -> mx.array:
        return mx.array([view.slot_id for view in views], mx.int32)

    def _begin(self, views: Sequence[SlotView], num_new: int, *, keeps_start_state: bool = False):
        if not views or num_new < 1:
            raise ValueError(f"a forward needs rows and new tokens, got {len(views)} rows of {num_new}")
        starts, tables = self.slots.begin_forward(views, num_new, keeps_start_state=keeps_start_state)
        padded = np.zeros((len(tables), max(map(len, tables))), np.int64)
        for row, table in enumerate(tables):
            padded[row, : len(table)] = table
        return np.array(starts, np.int64), padded

    def _plan(self, views: Sequence[SlotView], num_new: int) -> tuple[np.ndarray, dict]:
        starts, padded = self._begin(views, num_new)
        shape = {"n_kv_heads": self.n_kv_heads, "num_pages": self.num_pages, "page_size": self.page_size}
        return starts, {w: ForwardIndex.from_plan(plan_group(w, starts, num_new, padded, **shape), starts)
                        for w in self.windows}


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """One forward's per-layer caches, and arrays to evaluate before running it.

    Attributes:
        layers (list): Pass as `cache=` to the model (per cache index: a `PagedLayerCache`, a
            recurrent layer's `PooledStateCache`, or a `CacheGroup` of them).
        prefetch (list[mx.array]): Old K/V a window-wrapping chunk reads; evaluating them
            before the forward lets its writes land in place (empty in every other case).
    """

    layers: list
    prefetch: list[mx.array]


@dataclass(frozen=True, slots=True)
class WindowArrays:
    """A decode window's device index arrays (`BatchedKVCache.window_indices`), all slices of one upload.

    Attributes:
        steps (list): `[step][window rule] -> [write rows, page table, lengths, positions]`, int32 (the plan's
            `write_rows[i]`, `page_table`, `lengths[i]`, and each row's start + i).
        to_tail (list): per window rule, (main rows, tail rows) int32 [m] of the pages' tokens held before the
            window, or None where there are none.
        from_tail (list): per window rule, (tail rows, main rows) int32 [m] of every tail page, or None.
    """

    steps: list[list[list[mx.array]]]
    to_tail: list[tuple[mx.array, mx.array] | None]
    from_tail: list[tuple[mx.array, mx.array] | None]
