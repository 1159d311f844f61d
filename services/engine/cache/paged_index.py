"""Index math of one batched forward over paged storage, in numpy (no MLX arrays).

Storage of one layer field is laid out `[num_pages, n_kv_heads, page_size, *]`. Writes see
it flattened to `[num_pages * n_kv_heads * page_size, *]`: a sequence's token with logical
slot `t` (its position, or `window.slot(position)` under a window) lives at flat row
`(page_table[t // page_size] * n_kv_heads + head) * page_size + t % page_size`, so writing
any set of new tokens is one scatter. Reads see it as `[num_pages * n_kv_heads, page_size, *]`
and gather whole (page, head) blocks, `page_size` tokens each, in page-table order: the
result is directly `[B, n_kv_heads, pages * page_size, *]`, and copying blocks is much
cheaper than copying single tokens. Rows are padded to the longest page table (masked).

Every layer that shares a window rule shares these indices, so they are built once per
forward, not once per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .window import Window


@dataclass(frozen=True, slots=True)
class GroupIndex:
    """Where one forward writes and reads, and what each query may see, for one window rule.

    Attributes:
        read_first (bool): A chunk wraps the window: attention reads the old live slots
            plus the chunk itself, and the ring is written afterwards (the `KVCache` rule).
        write_rows (np.ndarray): int32 [n_write], flat storage rows written.
        write_source (np.ndarray | None): int32 [n_write], rows of the new tokens flattened
            to [B * n_kv_heads * L] feeding `write_rows`; None means all of them, in order.
        read_blocks (np.ndarray): int32 [B * n_kv_heads * pages], (page, head) blocks gathered.
        num_read (int): T = pages * page_size, token slots gathered per row.
        query_positions (np.ndarray): int64 [B, L], absolute positions of the new tokens.
        key_positions (np.ndarray): int64 [B, K], absolute position of each attended key
            (K = T, or T + L when `read_first`).
        key_valid (np.ndarray): bool [B, K], False on padding.
    """

    read_first: bool
    write_rows: np.ndarray
    write_source: np.ndarray | None
    read_blocks: np.ndarray
    num_read: int
    query_positions: np.ndarray
    key_positions: np.ndarray
    key_valid: np.ndarray

    def visible(self, window: Window | None, window_size: int | None = None) -> np.ndarray:
        """Boolean mask [B, 1, L, K]: may query l of row b attend to key k.

        Args:
            window (Window | None): The layers' window rule, or None for full attention.
            window_size (int | None): An extra plain sliding window some models ask for
                on full-attention layers (mlx-lm's `make_mask(window_size=...)`).
        """
        q = self.query_positions[:, :, None]
        k = self.key_positions[:, None, :]
        mask = self.key_valid[:, None, :] & (k <= q)
        if window is not None:
            mask &= (k < window.keep) | (k > q - window.ring)
        elif window_size is not None:
            mask &= k > q - window_size
        return mask[:, None]

    def is_causal(self, visible: np.ndarray) -> bool:
        """Whether `visible` is the plain causal mask: one row, keys at positions 0..last query in order."""
        keys, queries = self.key_positions, self.query_positions
        if keys.shape[0] != 1 or keys.shape[1] != queries[0, -1] + 1:
            return False
        causal = keys[0][None, :] <= queries[0][:, None]
        return bool((keys[0] == np.arange(keys.shape[1])).all() and (visible[0, 0] == causal).all())


def live_tokens(window: Window | None, num_seen: np.ndarray) -> np.ndarray:
    """Token slots held per row after `num_seen` positions (int64, same shape)."""
    return num_seen if window is None else np.minimum(num_seen, window.max_size)


def flat_rows(page_tables: np.ndarray, logical: np.ndarray, *, n_kv_heads: int, page_size: int) -> np.ndarray:
    """Flat storage rows [B, n_kv_heads, N] of logical slots [B, N] under page tables [B, P]."""
    pages = np.take_along_axis(page_tables, logical // page_size, axis=1)
    heads = np.arange(n_kv_heads)[None, :, None]
    return (pages[:, None, :] * n_kv_heads + heads) * page_size + (logical % page_size)[:, None, :]


def _stored(window: Window | None, num_seen: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the position held by each of `width` logical slots and whether it is live."""
    live = live_tokens(window, num_seen)
    valid = np.arange(width)[None, :] < live[:, None]
    if window is None:
        return np.broadcast_to(np.arange(width), valid.shape).copy(), valid
    positions = np.zeros(valid.shape, np.int64)
    for row, seen in enumerate(num_seen):
        held = window.stored_positions(int(seen))
        positions[row, : len(held)] = held
    return positions, valid


def _read_blocks(
    page_tables: np.ndarray, live: np.ndarray, width: int, *, n_kv_heads: int, page_size: int
) -> np.ndarray:
    """(page, head) blocks [B, n_kv_heads, width] covering each row's live slots, padded with its first page."""
    num_pages = -(-live // page_size)
    tables = np.pad(page_tables, ((0, 0), (0, max(0, width - page_tables.shape[1]))))[:, :width]
    pages = np.where(np.arange(width)[None, :] < num_pages[:, None], tables, page_tables[:, :1])
    return pages[:, None, :] * n_kv_heads + np.arange(n_kv_heads)[None, :, None]


def plan_group(
    window: Window | None,
    starts: np.ndarray,
    num_new: int,
    page_tables: np.ndarray,
    *,
    n_kv_heads: int,
    page_size: int,
    read_pages: Callable[[int], int] | None = None,
) -> GroupIndex:
    """Build the write/read indices and key positions of one forward for one window rule.

    Args:
        window (Window | None): The layers' window, or None for full attention.
        starts (np.ndarray): int64 [B], position of each row's first new token.
        num_new (int): L, new tokens per row.
        page_tables (np.ndarray): int64 [B, P], each row's pages (padded past its own).
        n_kv_heads (int): KV heads per layer.
        page_size (int): Token slots per page.
        read_pages (Callable[[int], int] | None): Maps the pages the longest row needs to the
            pages read per row (rounding up keeps traced shapes stable); None reads exactly those.

    Returns:
        GroupIndex: the plan every layer with this window rule follows.
    """
    queries = starts[:, None] + np.arange(num_new)[None, :]
    shape = {"n_kv_heads": n_kv_heads, "page_size": page_size}
    read_first = window is not None and num_new > 1 and bool((starts + num_new > window.max_size).any())
    live = live_tokens(window, starts if read_first else starts + num_new)
    needed = int(-(-live.max() // page_size))
    blocks = _read_blocks(page_tables, live, needed if read_pages is None else read_pages(needed), **shape)
    num_read = blocks.shape[2] * page_size
    keys, valid = _stored(window, starts if read_first else starts + num_new, num_read)
    if read_first:
        keys = np.concatenate([keys, queries], axis=1)
        valid = np.concatenate([valid, np.ones(queries.shape, bool)], axis=1)
        write_rows, write_source = _ring_writes(window, queries, page_tables, **shape)
    else:
        logical = queries if window is None else window.slot(queries)
        write_rows, write_source = flat_rows(page_tables, logical, **shape).reshape(-1), None
    return GroupIndex(
        read_first=read_first,
        write_rows=write_rows.astype(np.int32),
        write_source=write_source,
        read_blocks=blocks.reshape(-1).astype(np.int32),
        num_read=num_read,
        query_positions=queries,
        key_positions=keys,
        key_valid=valid,
    )


def _ring_writes(
    window: Window, queries: np.ndarray, page_tables: np.ndarray, *, n_kv_heads: int, page_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Rows and sources of a chunk written into the ring: per slot only its newest position survives."""
    batch, num_new = queries.shape
    shape = {"n_kv_heads": n_kv_heads, "page_size": page_size}
    rows, sources = [], []
    heads = np.arange(n_kv_heads)[:, None]
    for b in range(batch):
        slots = window.slot(queries[b])
        # np.unique on the reversed slots finds each slot's last occurrence in the chunk.
        _, first_from_end = np.unique(slots[::-1], return_index=True)
        chunk_index = num_new - 1 - first_from_end
        rows.append(flat_rows(page_tables[b : b + 1], slots[None, chunk_index], **shape)[0].reshape(-1))
        sources.append(((b * n_kv_heads + heads) * num_new + chunk_index[None, :]).reshape(-1))
    return np.concatenate(rows), np.concatenate(sources).astype(np.int32)
