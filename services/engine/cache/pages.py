"""Slots, page tables, the page free list and the step fence of a `BatchedKVCache`.

Pure bookkeeping (no arrays), so the scheduler can decide and commit allocations
before the runner touches storage (nano-vllm's `BlockManager` split). One `SlotTable`
serves every layer: a page id names the same `page_size` token positions in each layer's
storage, so one page table per slot covers the whole model.

Hybrid models also keep a fixed-size recurrent state per slot (`state_pool`): it counts
`state_bytes_per_slot` bytes while the slot holds a token, and it cannot be cut back to an
arbitrary position, so truncation is exact only to nothing, to every position seen, or to the
slot's *checkpoint*: the position where the last decode window began, whose state the engine
keeps until the slot's next forward.

MLX is lazy, so a step that was launched may still read or write a page after the
sequence that owned it is released. Released pages therefore wait on a pending list
and return to the free list only when the engine reports (`complete_step`) that a
step launched after the release has been evaluated: by then every earlier step has
finished too (one stream, in order).

Pages are reference-counted (`page_pool`): the prefix cache (`prefix`, `SlotTable.prefix`)
maps cached pages of a common prefix into several page tables. A page is written only while
it is private: forwards write positions from a slot's current length on, mapped pages hold
positions below it, and `begin_forward` checks it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from shared.errors import CapacityExhausted, StaleSlot

from .page_pool import PagePool
from .prefix import PrefixCache
from .window import Window


@dataclass(slots=True)
class _Slot:
    generation: int = 0  # +1 on every release, so views of the previous holder go stale
    page_table: list[int] = field(default_factory=list)  # page ids in logical order
    num_tokens: int = 0  # positions seen: RoPE position of the next token (grows past any window)
    is_held: bool = False
    checkpoint: int | None = None  # an earlier position whose recurrent state is kept (see the module doc)


@dataclass(frozen=True, slots=True)
class LayerBudget:
    """What one layer keeps per sequence: its window bound (tokens) and its bytes per token."""

    max_live_tokens: int | None  # `window.max_size`, or None for full attention
    bytes_per_token: int  # K and V, every codec field included
    pinned_tokens: int = 0  # `window.keep`: leading positions the window never overwrites


class SlotView:
    """A stable handle on one sequence's slot; any use after the slot's release raises `StaleSlot`.

    Attributes:
        slot_id (int): Row of the cache, `0 <= slot_id < max_slots`.
        generation (int): The slot's generation when this view was handed out.
    """

    __slots__ = ("_table", "slot_id", "generation")

    def __init__(self, table: SlotTable, slot_id: int, generation: int):
        self._table, self.slot_id, self.generation = table, slot_id, generation

    @property
    def is_stale(self) -> bool:
        """Whether the slot was released (or reused) since this view was handed out."""
        return self._table.is_stale(self)

    @property
    def num_tokens(self) -> int:
        """Positions seen (tokens); the RoPE offset of the next token."""
        return self._table.slot(self).num_tokens

    @property
    def page_table(self) -> tuple[int, ...]:
        """Page ids of this sequence in logical order (a copy)."""
        return tuple(self._table.slot(self).page_table)

    @property
    def tokens_held(self) -> int:
        """Token positions whose K/V are held (the window bound applied), in tokens."""
        return self._table.tokens_held(self)

    @property
    def nbytes(self) -> int:
        """Bytes held for live tokens across all layers (K, V, every field), recurrent state included."""
        return self._table.nbytes(self)

    def __repr__(self) -> str:
        return f"SlotView(slot_id={self.slot_id}, generation={self.generation})"


class SlotTable:
    """Slots, their page tables, the page free list and the step fence.

    Args:
        num_pages (int): Pages of storage shared by all slots.
        page_size (int): Tokens per page.
        max_slots (int): Sequences held at once (sessions between turns included).
        layers (Sequence[LayerBudget]): One entry per attention layer, for page and byte accounting.
        prefix_root (bytes | None): `prefix.format_root` of the storage: turns the prefix cache
            on (None: off; pages are never shared).
        has_state_at (Callable[[bytes], bool] | None): For layers with recurrent state, see
            `prefix.PrefixCache`. None: attention only.
        state_bytes_per_slot (int): Recurrent state bytes of one slot, all layers (0: no
            recurrent layers). Default: 0.

    Raises:
        ValueError: a non-positive size, or no layers.
    """

    def __init__(self, *, num_pages: int, page_size: int, max_slots: int, layers: Sequence[LayerBudget],
                 prefix_root: bytes | None = None, has_state_at: Callable[[bytes], bool] | None = None,
                 state_bytes_per_slot: int = 0):
        if num_pages < 1 or page_size < 1 or max_slots < 1 or not layers:
            raise ValueError(
                f"need num_pages, page_size, max_slots >= 1 and at least one layer, got "
                f"{num_pages}, {page_size}, {max_slots}, {len(layers)} layers"
            )
        self.page_size, self.max_slots, self.layers = page_size, max_slots, tuple(layers)
        self.num_pages, self.state_bytes_per_slot = num_pages, state_bytes_per_slot
        bounds = [layer.max_live_tokens for layer in self.layers]
        # Page tables are shared by all layers, so the widest layer decides how many pages a slot needs.
        self.max_live_tokens: int | None = None if None in bounds else max(bounds)
        self._bytes_by_bound: dict[int | None, int] = {}  # window bound -> bytes per token of its layers
        for layer in self.layers:
            bound = layer.max_live_tokens
            self._bytes_by_bound[bound] = self._bytes_by_bound.get(bound, 0) + layer.bytes_per_token
        # Distinct write rules (None: full attention): a forward's writes are checked under each.
        self.write_rules: tuple[Window | None, ...] = tuple(dict.fromkeys(
            None if b.max_live_tokens is None else Window(b.max_live_tokens, b.pinned_tokens) for b in self.layers))
        self._slots = [_Slot() for _ in range(max_slots)]
        self._free_slots = deque(range(max_slots))
        self._pages = PagePool(num_pages)
        self.prefix = PrefixCache(self, self._pages, prefix_root, has_state_at=has_state_at)

    # -- sizes -----------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        """Tokens of storage, all slots together (tokens)."""
        return self.num_pages * self.page_size

    @property
    def free_tokens(self) -> int:
        """Tokens a reservation can take now (tokens): free pages and unreferenced cached
        pages (evicted on demand); pages waiting on the fence are not free yet."""
        return self._pages.num_available * self.page_size

    @property
    def num_free_pages(self) -> int:
        """Pages a reservation can take now (see `free_tokens`)."""
        return self._pages.num_available

    @property
    def num_pending_pages(self) -> int:
        """Released pages still waiting for the step fence."""
        return self._pages.num_pending

    @property
    def num_held_pages(self) -> int:
        """Pages held by slots, a page shared by several counted once."""
        return self._pages.num_held

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token position occupies across all layers (K, V, every field)."""
        return sum(layer.bytes_per_token for layer in self.layers)

    @property
    def used_slots(self) -> int:
        return self.max_slots - len(self._free_slots)

    def pages_for(self, num_tokens: int) -> int:
        """Pages a sequence that has seen `num_tokens` positions holds."""
        live = num_tokens if self.max_live_tokens is None else min(num_tokens, self.max_live_tokens)
        return math.ceil(live / self.page_size)

    # -- slots -----------------------------------------------------------------

    def can_acquire(self) -> bool:
        return bool(self._free_slots)

    def acquire(self) -> SlotView:
        """Hand out a free slot (no pages yet).

        Raises:
            CapacityExhausted: every slot is held.
        """
        if not self._free_slots:
            raise CapacityExhausted(f"all {self.max_slots} slots are held")
        slot_id = self._free_slots.popleft()
        slot = self._slots[slot_id]
        slot.is_held, slot.num_tokens, slot.page_table, slot.checkpoint = True, 0, [], None
        return SlotView(self, slot_id, slot.generation)

    def release(self, view: SlotView) -> int:
        """Free a slot at once and its pages after the fence; returns the tokens it held.

        Raises:
            StaleSlot: the view was already released.
        """
        slot = self.slot(view)
        held = self.tokens_held(view)
        self._pages.drop(slot.page_table)
        slot.generation += 1
        slot.is_held, slot.num_tokens, slot.page_table, slot.checkpoint = False, 0, [], None
        self._free_slots.append(view.slot_id)
        return held

    def is_stale(self, view: SlotView) -> bool:
        slot = self._slots[view.slot_id]
        return not slot.is_held or slot.generation != view.generation

    def slot(self, view: SlotView) -> _Slot:
        """The live slot behind a view.

        Raises:
            StaleSlot: the slot was released or reused since the view was handed out.
        """
        if self.is_stale(view):
            raise StaleSlot(
                f"slot {view.slot_id} generation {view.generation} is stale "
                f"(now generation {self._slots[view.slot_id].generation})"
            )
        return self._slots[view.slot_id]

    def tokens_held(self, view: SlotView) -> int:
        num_tokens = self.slot(view).num_tokens
        return num_tokens if self.max_live_tokens is None else min(num_tokens, self.max_live_tokens)

    def nbytes(self, view: SlotView) -> int:
        """Exact bytes held: per layer, its live tokens times its bytes per token, plus the
        recurrent state once the slot has seen a token."""
        num_tokens = self.slot(view).num_tokens
        return (num_tokens > 0) * self.state_bytes_per_slot + sum(
            (num_tokens if bound is None else min(num_tokens, bound)) * nbytes
            for bound, nbytes in self._bytes_by_bound.items()
        )

    # -- pages -----------------------------------------------------------------

    def pages_needed(self, view: SlotView, num_new: int) -> int:
        """Extra pages the slot needs to take `num_new` more tokens."""
        slot = self.slot(view)
        return max(0, self.pages_for(slot.num_tokens + num_new) - len(slot.page_table))

    def reserve(self, rows: Sequence[tuple[SlotView, int]]) -> None:
        """Give each `(view, num_new)` row the pages its next `num_new` tokens need, all or nothing.

        Raises:
            CapacityExhausted: the free list cannot cover every row; nothing changed.
            StaleSlot: a view is stale; nothing changed.
        """
        needed = [(self.slot(view), self.pages_needed(view, n)) for view, n in rows]
        total = sum(n for _, n in needed)
        if total > self._pages.num_available:
            raise CapacityExhausted(
                f"{total * self.page_size} more KV tokens needed, {self.free_tokens} free "
                f"of {self.capacity_tokens} (page_size {self.page_size})"
            )
        for slot, n in needed:
            slot.page_table.extend(self._pages.take(n))

    def begin_forward(self, views: Sequence[SlotView], num_new: int, *,
                      keeps_start_state: bool = False) -> tuple[list[int], list[list[int]]]:
        """Reserve and count `num_new` tokens for every row of a forward, all or nothing.

        Args:
            views (Sequence[SlotView]): The rows.
            num_new (int): New tokens per row.
            keeps_start_state (bool): The engine keeps each row's recurrent state at its first
                new position until the row's next forward (a decode window): it becomes the
                row's checkpoint. Default: False.

        Returns:
            tuple[list[int], list[list[int]]]: each row's first new position, and its page
            table (the live list: read it before the next change).

        Raises:
            CapacityExhausted: the free list cannot cover every row; nothing changed.
            StaleSlot: a view is stale; nothing changed.
        """
        self.reserve([(view, num_new) for view in views])
        slots = [self._slots[view.slot_id] for view in views]
        starts = [slot.num_tokens for slot in slots]
        self._check_private_writes(slots, num_new)
        for slot in slots:
            slot.checkpoint = slot.num_tokens if keeps_start_state else None
            slot.num_tokens += num_new
        if self._pages.has_claims:  # claimed pages this forward completes become cached
            for slot, start in zip(slots, starts):
                self._pages.mark_written(slot.page_table[start // self.page_size : slot.num_tokens // self.page_size])
        return starts, [slot.page_table for slot in slots]

    def _check_private_writes(self, slots: Sequence[_Slot], num_new: int) -> None:
        """The guard of page sharing: no forward writes a page another sequence may read.

        Raises:
            AssertionError: a position about to be written lies in a shared or cached page.
        """
        starts = np.array([slot.num_tokens for slot in slots], np.int64)
        positions = starts[:, None] + np.arange(num_new)[None, :]
        for rule in self.write_rules:
            logical = positions if rule is None else rule.storage_index(positions)
            # only the pages written (a window's few), not each row's whole table: O(pages) a window at long context
            pages = np.array([slot.page_table[i] for slot, row in zip(slots, logical // self.page_size)
                              for i in np.unique(row).tolist()], np.int64)
            shared = pages[self._pages.is_read_only(pages)]
            if shared.size:
                raise AssertionError(f"a forward would write shared or cached pages {sorted(set(shared.tolist()))}")

    def can_truncate(self, view: SlotView, num_tokens: int) -> bool:
        """Whether forgetting positions from `num_tokens` on is exact for every layer.

        Forgetting everything always is. For K/V, forgetting only the last position is too;
        otherwise a windowed layer must not have evicted anything yet (past positions a later
        query would see are gone). Recurrent state (hybrid models) is exact only at 0, at every
        position seen, and at the slot's checkpoint.

        Raises:
            StaleSlot: the view is stale.
        """
        slot = self.slot(view)
        seen = slot.num_tokens
        if not 0 <= num_tokens <= seen:
            return False
        if self.state_bytes_per_slot and num_tokens not in (0, seen, slot.checkpoint):
            return False
        if num_tokens == 0 or seen - num_tokens <= 1:
            return True
        return all(bound is None or seen <= bound for bound in self._bytes_by_bound)

    def truncation_point(self, view: SlotView, num_tokens: int) -> int:
        """The most positions, at most `num_tokens`, the slot can keep exactly (`can_truncate`).

        Raises:
            StaleSlot: the view is stale.
        """
        checkpoint = self.slot(view).checkpoint
        candidates = [num_tokens] + ([checkpoint] if checkpoint is not None and checkpoint < num_tokens else [])
        return next((n for n in candidates if self.can_truncate(view, n)), 0)

    def truncate(self, view: SlotView, num_tokens: int) -> int:
        """Forget positions from `num_tokens` on; pages no longer needed go back after the fence.

        The page holding position `num_tokens` is written next, so it must be private: a cached
        page only this slot holds leaves the prefix cache; one shared with other slots is let go
        too, and the slot keeps only the positions before it.

        Returns:
            int: positions the slot keeps (`num_tokens`, or less when a shared page was let go).

        Raises:
            StaleSlot: the view is stale.
            ValueError: the truncation is not exact for every layer (`can_truncate`).
        """
        slot = self.slot(view)
        if not self.can_truncate(view, num_tokens):
            raise ValueError(f"cannot truncate slot {view.slot_id} from {slot.num_tokens} to {num_tokens} tokens "
                             "exactly (a window has evicted positions a later query would see)")
        wrapped = any(bound is not None and slot.num_tokens > bound for bound in self._bytes_by_bound)
        keep = self.pages_for(num_tokens)  # slot t holds position t in every layer
        if num_tokens and wrapped:  # a ring keeps the slots it holds: the truncated one is rewritten next
            keep = max(self.pages_for(num_tokens if bound is None else min(slot.num_tokens, bound))
                       for bound in self._bytes_by_bound)
        self._pages.drop(slot.page_table[keep:])
        del slot.page_table[keep:]
        slot.num_tokens, slot.checkpoint = num_tokens, None
        index = num_tokens // self.page_size
        if not wrapped and num_tokens % self.page_size:  # (a wrapped ring's pages are never shared)
            page = slot.page_table[index]
            if self._pages.refcount(page) > 1:
                self._pages.drop([page])
                del slot.page_table[index:]
                slot.num_tokens = index * self.page_size
            else:
                self._pages.forget([page])
        return slot.num_tokens

    # -- the step fence ----------------------------------------------------------------

    def launch_step(self) -> int:
        """Register a step whose work is being launched now; returns its id (increasing)."""
        return self._pages.launch_step()

    def complete_step(self, step_id: int) -> None:
        """Report that step `step_id`, and so every earlier step, has been evaluated."""
        self._pages.complete_step(step_id)
