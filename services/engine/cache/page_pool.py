"""Page ids of a `SlotTable`: reference counts, the free list, the step fence and the prefix cache.

Pure bookkeeping (no arrays of storage). A page is in exactly one of these states:

- *held*: in the page table of one or more slots (`refcount >= 1`); a page held by several
  slots is a shared prefix page, and so is any page the prefix cache has marked written;
- *pending*: no slot holds it any more, but a launched step may still read it; it waits for the
  step fence (`complete_step`), see `pages.py`;
- *cached*: unreferenced, past the fence, still findable by its hash; the least recently
  released is evicted first when a reservation needs a page;
- *free*: unreferenced, past the fence, not cached.

The prefix cache maps a page hash (`prefix.page_hashes`) to the page holding those tokens. A
page can be registered while its K/V is still being computed (a *claim* by the request that is
prefilling it): lookups then report the chain as blocked, so a second request with the same
prefix waits for it instead of computing it again. Claims end when the K/V is written
(`mark_written`) or when their holder lets go first (the hash is forgotten).

Source: vLLM's prefix caching (reference-counted blocks, hash of parent hash and block
tokens, LRU eviction of free cached blocks, the tail of a request's blocks evicted first) and
nano-vllm's `BlockManager`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from shared.errors import CapacityExhausted


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    """The longest run of cached pages a hash chain finds (a query; nothing changed).

    Attributes:
        page_ids (tuple[int, ...]): Cached pages holding the chain's first pages, in order.
        is_blocked (bool): The chain goes on into a page whose K/V another request is computing.
    """

    page_ids: tuple[int, ...] = ()
    is_blocked: bool = False


@dataclass(frozen=True, slots=True)
class PrefixCounters:
    """Prefix cache activity since the pool was created."""

    query_tokens: int = 0  # tokens looked up at admission (not already held by their slot)
    hit_tokens: int = 0  # of them, tokens mapped from cached pages instead of computed
    evicted_pages: int = 0  # cached pages reclaimed for new K/V


class PagePool:
    """Owns every page id's state; see the module docstring.

    Args:
        num_pages (int): Pages of storage.
    """

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._refs = np.zeros(num_pages, np.int32)  # slots holding each page
        self._free: deque[int] = deque(range(num_pages))
        self._pending: dict[int, int] = {}  # unreferenced page -> first step id that may reuse it
        self._next_step_id = 0
        self._page_of: dict[bytes, int] = {}  # page hash -> page
        self._hash_of: dict[int, bytes] = {}  # page -> page hash
        self._claimed: set[int] = set()  # registered pages whose K/V is not written yet
        self._is_cached = np.zeros(num_pages, bool)  # registered and written: other slots may read it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, LRU first
        self._query_tokens = self._hit_tokens = self._evicted = 0

    # -- sizes ----------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Pages a reservation can take now: free ones, then cached ones (evicted LRU first)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_free(self) -> int:
        """Pages on the free list (neither held, pending nor cached)."""
        return len(self._free)

    @property
    def num_pending(self) -> int:
        """Unreferenced pages waiting for the step fence."""
        return len(self._pending)

    @property
    def num_cached(self) -> int:
        """Pages the prefix cache can hand out (K/V written), held by a slot or not."""
        return len(self._hash_of) - len(self._claimed)

    @property
    def num_evictable(self) -> int:
        """Cached pages no slot holds (reclaimed when capacity is needed)."""
        return len(self._evictable)

    @property
    def num_held(self) -> int:
        """Pages held by at least one slot (a shared page counts once)."""
        return int(np.count_nonzero(self._refs))

    @property
    def counters(self) -> PrefixCounters:
        return PrefixCounters(self._query_tokens, self._hit_tokens, self._evicted)

    def refcount(self, page: int) -> int:
        return int(self._refs[page])

    def is_read_only(self, pages: np.ndarray) -> np.ndarray:
        """bool, same shape: pages another sequence may read (held twice, or cached and written)."""
        return self._is_cached[pages] | (self._refs[pages] > 1)

    # -- holding ----------------------------------------------------------------------

    def take(self, num: int) -> list[int]:
        """Hold `num` private pages: free ones first, then the least recently used cached ones.

        Raises:
            CapacityExhausted: fewer than `num` pages are available; nothing changed.
        """
        if num > self.num_available:
            raise CapacityExhausted(f"{num} pages needed, {self.num_available} available")
        pages = []
        for _ in range(num):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                if self._refs[page]:
                    raise AssertionError(f"page {page} would be evicted while a slot holds it")
                self._forget(page)
                self._evicted += 1
            self._refs[page] = 1
            pages.append(page)
        return pages

    def hold(self, pages: Iterable[int]) -> None:
        """Add one holder to each of `pages` (cached pages mapped into one more slot)."""
        for page in pages:
            if self._refs[page] == 0:
                self._evictable.pop(page, None)
                self._pending.pop(page, None)  # only read from now on: no need to wait for the fence
            self._refs[page] += 1

    def drop(self, pages: Sequence[int]) -> None:
        """Remove one holder from each of `pages`; those left unreferenced wait for the fence.

        The last page goes first, so a sequence's tail is evicted before its head (a head
        page shared by more prefixes is worth more).
        """
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] < 0:
                raise AssertionError(f"page {page} dropped more often than held")
            if self._refs[page] == 0:
                if page in self._claimed:  # its K/V will never be written: nobody may find it
                    self._forget(page)
                self._pending[page] = self._next_step_id

    # -- the step fence -----------------------------------------------------------------

    def launch_step(self) -> int:
        """Register a step being launched now; returns its id (increasing)."""
        step_id = self._next_step_id
        self._next_step_id += 1
        return step_id

    def complete_step(self, step_id: int) -> None:
        """Step `step_id`, and so every earlier one, has been evaluated: unreferenced pages dropped
        before it was launched become free, or evictable if cached."""
        for page in [p for p, first in self._pending.items() if first <= step_id]:
            del self._pending[page]
            if page in self._hash_of:
                self._evictable[page] = None
            else:
                self._free.append(page)

    # -- the prefix cache ----------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> PrefixLookup:
        """The longest run of `hashes` (a chain, in order) found in the cache."""
        pages = []
        for page_hash in hashes:
            page = self._page_of.get(page_hash)
            if page is None:
                break
            if page in self._claimed:
                return PrefixLookup(tuple(pages), is_blocked=True)
            pages.append(page)
        return PrefixLookup(tuple(pages))

    def register(self, page: int, page_hash: bytes, *, is_written: bool) -> None:
        """Make a held page findable by its hash (a claim until its K/V `is_written`).

        A page already registered, or a hash already held by another page, is left as it is
        (that page stays private to its slot).
        """
        if self._refs[page] < 1:
            raise AssertionError(f"page {page} registered while no slot holds it")
        if page in self._hash_of or page_hash in self._page_of:
            return
        self._page_of[page_hash], self._hash_of[page] = page, page_hash
        if is_written:
            self._is_cached[page] = True
        else:
            self._claimed.add(page)

    def mark_written(self, pages: Iterable[int]) -> None:
        """The K/V of `pages` is written (launched): claims among them become cached pages."""
        for page in pages:
            if page in self._claimed:
                self._claimed.remove(page)
                self._is_cached[page] = True

    @property
    def has_claims(self) -> bool:
        return bool(self._claimed)

    def forget(self, pages: Iterable[int]) -> None:
        """Unregister held pages (claims ended, or a page its only holder writes again)."""
        for page in pages:
            if page in self._hash_of:
                self._forget(page)

    def is_claimed(self, page: int) -> bool:
        return page in self._claimed

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def count_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """Record one admission's lookup (for the hit rate)."""
        self._query_tokens += query_tokens
        self._hit_tokens += hit_tokens

    def _forget(self, page: int) -> None:
        del self._page_of[self._hash_of.pop(page)]
        self._claimed.discard(page)
        self._is_cached[page] = False
