"""Identity of a page of K/V for the prefix cache: a hash chain over token ids, rooted in the format.

Page p of a sequence is named by `sha256(hash of page p-1 ‖ token ids of page p)`, the chain
starting from a root that hashes everything else that decides the page's bytes: the model
(path, weight dtype), each layer's storage format (kinds, bits, group sizes, AURA seeds, dtypes),
each layer's window, and the pool geometry. Equal hashes therefore mean the same tokens after
the same prefix in the same format, and a page is never reused across formats. Only full pages
are named: a partly filled page is never shared.

`PrefixCache` is the policy: which pages of a slot may be shared (`shareable_pages`), the
lookup of a sequence's cached pages (`match`), mapping them into a slot (`map`) and making a
slot's pages findable (`publish`). Page states and the hash index live in `page_pool.PagePool`,
slots in `pages.SlotTable`.

Source: vLLM's prefix caching (block hash = hash(parent hash, block tokens, extra keys),
SHA-256 so that crafted prompts cannot collide).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .page_pool import PagePool, PrefixCounters

if TYPE_CHECKING:
    from .pages import SlotTable, SlotView


def format_root(*parts: object) -> bytes:
    """The chain's root: a digest of `repr(parts)` (formats, windows, model identity...)."""
    return hashlib.sha256(repr(parts).encode()).digest()


def page_hashes(root: bytes, token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """Hashes of the full pages of `token_ids` (`len(token_ids) // page_size` of them), in order.

    Args:
        root (bytes): `format_root` of the cache the pages live in.
        token_ids (Sequence[int]): The sequence from position 0.
        page_size (int): Tokens per page.
    """
    num_pages = len(token_ids) // page_size
    tokens = np.asarray(token_ids[: num_pages * page_size], dtype=np.int64).reshape(num_pages, page_size)
    hashes, parent = [], root
    for page in tokens:
        parent = hashlib.sha256(parent + page.tobytes()).digest()
        hashes.append(parent)
    return hashes


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Cached pages a sequence can map instead of computing them (a query; nothing changed).

    Attributes:
        start_tokens (int): Positions the slot held when the lookup was made (page-aligned).
        page_ids (tuple[int, ...]): Cached pages continuing the slot from `start_tokens`.
        num_revived (int): Of them, unreferenced ones: mapping them uses available pages.
        is_blocked (bool): The next page is being computed by another request: waiting for it
            saves computing it twice.
        query_tokens (int): Tokens looked up (the sequence's tokens past `start_tokens`).
        page_size (int): Tokens per page.
    """

    start_tokens: int = 0
    page_ids: tuple[int, ...] = ()
    num_revived: int = 0
    is_blocked: bool = False
    query_tokens: int = 0
    page_size: int = 1

    @property
    def num_pages(self) -> int:
        return len(self.page_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens the mapped pages hold."""
        return len(self.page_ids) * self.page_size


class PrefixCache:
    """Shares full pages of common prefixes between the slots of one `SlotTable`.

    Args:
        table (SlotTable): The slots whose page tables it extends.
        pool (PagePool): The table's pages (reference counts, hash index, eviction).
        root (bytes | None): `format_root` of the storage; None turns the cache off (lookups
            find nothing, publishing registers nothing).
        has_state_at (Callable[[bytes], bool] | None): Hook for layers with recurrent state:
            whether a snapshot of that state exists at the boundary after the page with this
            hash. A prefix is then reused only up to such a boundary, and the owner of the
            state restores the snapshot when `map` maps it (and saves snapshots at the page
            boundaries it publishes). None: attention only, every boundary works.
    """

    def __init__(self, table: SlotTable, pool: PagePool, root: bytes | None, *,
                 has_state_at: Callable[[bytes], bool] | None = None):  # fmt: skip
        self.table, self.pool, self.root, self.has_state_at = table, pool, root, has_state_at
        self.page_size = table.page_size

    @property
    def is_enabled(self) -> bool:
        return self.root is not None

    @property
    def num_cached_pages(self) -> int:
        """Pages it can hand out (K/V written), held or not."""
        return self.pool.num_cached

    @property
    def num_evictable_pages(self) -> int:
        """Cached pages no slot holds: counted free, reclaimed least recently used first."""
        return self.pool.num_evictable

    @property
    def counters(self) -> PrefixCounters:
        """Tokens looked up and found at admissions, and cached pages evicted, since creation."""
        return self.pool.counters

    def shareable_pages(self, max_positions: int) -> int:
        """Leading pages a sequence that sees at most `max_positions` positions may share.

        A windowed layer's ring overwrites its slots once a sequence passes `max_size`
        positions, so such a sequence shares only pages inside the pinned sinks.
        """
        pages = max_positions // self.page_size
        for rule in self.table.write_rules:
            if rule is not None and max_positions > rule.max_size:
                pages = min(pages, rule.keep // self.page_size)
        return pages

    def match(self, token_ids: Sequence[int], *, start_tokens: int = 0, max_positions: int) -> PrefixHit:
        """Cached pages that continue a slot holding the first `start_tokens` of `token_ids` (a query).

        The last token is never mapped (its forward samples the first output), and a slot
        holding a partial page is not extended.

        Args:
            token_ids (Sequence[int]): The sequence from position 0 (history and prompt).
            start_tokens (int): Positions the slot holds already (0 for a new slot).
            max_positions (int): Most positions the sequence may reach (`shareable_pages`).
        """
        size = self.page_size
        empty = PrefixHit(start_tokens, query_tokens=len(token_ids) - start_tokens, page_size=size)
        usable = min((len(token_ids) - 1) // size, self.shareable_pages(max_positions))
        if self.root is None or start_tokens % size or usable <= start_tokens // size:
            return empty
        hashes = page_hashes(self.root, token_ids[: usable * size], size)[start_tokens // size :]
        found = self.pool.lookup(hashes)
        pages = list(found.page_ids)
        if self.has_state_at is not None:  # recurrent layers resume only at a state snapshot
            while pages and not self.has_state_at(hashes[len(pages) - 1]):
                pages.pop()
        revived = sum(self.pool.is_evictable(p) for p in pages)
        blocked = found.is_blocked and len(pages) == len(found.page_ids)
        return PrefixHit(start_tokens, tuple(pages), revived, blocked, empty.query_tokens, size)

    def map(self, view: SlotView, hit: PrefixHit) -> None:
        """Map a hit's pages after the slot's positions; they count as computed (no forward).

        Raises:
            StaleSlot: the view is stale.
            ValueError: the slot changed since the lookup.
        """
        slot = self.table.slot(view)
        self.pool.count_lookup(hit.query_tokens, hit.num_tokens)
        if not hit.page_ids:
            return
        if slot.num_tokens != hit.start_tokens or len(slot.page_table) != hit.start_tokens // self.page_size:
            raise ValueError(f"slot {view.slot_id} holds {slot.num_tokens} tokens; the hit starts at "
                             f"{hit.start_tokens}")  # fmt: skip
        self.pool.hold(hit.page_ids)
        slot.page_table.extend(hit.page_ids)
        slot.num_tokens += hit.num_tokens

    def publish(self, view: SlotView, token_ids: Sequence[int], *, max_positions: int) -> None:
        """Register the slot's full pages of `token_ids`, so other sequences find them.

        Pages whose K/V is written become cached; the others are claims on K/V the slot's
        next forwards write (so give only tokens it holds, or an admitted prompt).

        Args:
            view (SlotView): The slot.
            token_ids (Sequence[int]): Its sequence from position 0.
            max_positions (int): Most positions the slot may reach (`shareable_pages`).

        Raises:
            StaleSlot: the view is stale.
        """
        slot = self.table.slot(view)
        if self.root is None:
            return
        num = min(len(token_ids) // self.page_size, len(slot.page_table), self.shareable_pages(max_positions))
        hashes = page_hashes(self.root, token_ids[: num * self.page_size], self.page_size)
        for index, (page, page_hash) in enumerate(zip(slot.page_table, hashes)):
            self.pool.register(page, page_hash, is_written=(index + 1) * self.page_size <= slot.num_tokens)

    def end_claims(self, view: SlotView) -> None:
        """Forget the slot's claims whose K/V was not written (its prompt ended early).

        Raises:
            StaleSlot: the view is stale.
        """
        self.pool.forget([p for p in self.table.slot(view).page_table if self.pool.is_claimed(p)])
