"""Index math of one batched forward over page pools, in numpy (no MLX arrays).

Pools are head-major (`pool_rows`): kv head h of the token in slot s of page p is row
`(h * num_pages + p) * page_size + s`, so writing any set of new tokens is one scatter.
Attention reads through the page table itself (`kernels.paged_attention`): a forward passes
each row's pages, its live slot count and, for a window ring that has wrapped, the position
each slot holds — never a dense copy of the history, never an [L, T] mask.

Every layer that shares a window rule shares these indices, so they are built once per
forward, not once per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .pool_rows import flat_rows
from .window import Window


@dataclass(frozen=True, slots=True)
class GroupIndex:
    """Where one forward writes and what it reads, for one window rule.

    Attributes:
        read_first (bool): A chunk wraps the window: attention reads the old live slots
            (gathered before the forward) plus the chunk itself, and the ring is written after.
        write_rows (np.ndarray): int32 [n_write], pool rows written.
        write_source (np.ndarray | None): int32 [n_write], rows of the new tokens flattened to
            [B * n_kv_heads * L] feeding `write_rows`; None means all of them, in order.
        page_table (np.ndarray): int32 [B, NP], pages attention reads (rows shorter than the
            longest are padded with their first page; `lengths` masks them).
        lengths (np.ndarray): int32 [B], slots attention reads per row: decode, every live slot
            after the write; a prompt chunk, the history before it (its own tokens come separately).
        positions (np.ndarray | None): int32 [B, NP * page_size], position held by each slot
            (a wrapped ring), or None when slot t holds position t.
        query_positions (np.ndarray): int32 [B, L], absolute positions of the new tokens.
    """

    read_first: bool
    write_rows: np.ndarray
    write_source: np.ndarray | None
    page_table: np.ndarray
    lengths: np.ndarray
    positions: np.ndarray | None
    query_positions: np.ndarray


def live_tokens(window: Window | None, num_seen: np.ndarray) -> np.ndarray:
    """Tokens held per row after `num_seen` positions (int64, same shape)."""
    return num_seen if window is None else np.minimum(num_seen, window.max_size)


def _read_pages(page_tables: np.ndarray, live: np.ndarray, width: int, page_size: int) -> np.ndarray:
    """Pages [B, width] covering each row's live slots, padded with the row's first page."""
    num_pages = -(-live // page_size)
    tables = np.pad(page_tables, ((0, 0), (0, max(0, width - page_tables.shape[1]))))[:, :width]
    return np.where(np.arange(width)[None, :] < num_pages[:, None], tables, page_tables[:, :1])


def _positions(window: Window, num_seen: np.ndarray, width: int) -> np.ndarray:
    positions = np.zeros((num_seen.size, width), np.int64)
    for row, seen in enumerate(num_seen):
        held = window.stored_positions(int(seen))
        positions[row, : len(held)] = held
    return positions


def plan_group(
    window: Window | None,
    starts: np.ndarray,
    num_new: int,
    page_tables: np.ndarray,
    *,
    n_kv_heads: int,
    num_pages: int,
    page_size: int,
    read_pages: Callable[[int], int] | None = None,
) -> GroupIndex:
    """Build the write/read indices of one forward for one window rule.

    Args:
        window (Window | None): The layers' window, or None for full attention.
        starts (np.ndarray): int64 [B], position of each row's first new token.
        num_new (int): L, new tokens per row.
        page_tables (np.ndarray): int64 [B, P], each row's pages (padded past its own).
        n_kv_heads (int): KV heads per layer.
        num_pages (int): Pages of the pool.
        page_size (int): Tokens per page.
        read_pages (Callable[[int], int] | None): Maps the pages the longest row needs to the
            pages read per row (rounding up keeps traced shapes stable); None reads exactly those.

    Returns:
        GroupIndex: the plan every layer with this window rule follows.
    """
    queries = starts[:, None] + np.arange(num_new)[None, :]
    shape = {"n_kv_heads": n_kv_heads, "num_pages": num_pages, "page_size": page_size}
    wraps = window is not None and num_new > 1 and bool((starts + num_new > window.max_size).any())
    decode = num_new == 1
    live = live_tokens(window, starts + 1 if decode else starts)  # what attention reads from the pools
    needed = max(1, int(-(-live.max() // page_size)))
    table = _read_pages(page_tables, live, needed if read_pages is None else read_pages(needed), page_size)
    positions = None
    if window is not None and not decode and bool((starts > window.max_size).any()):
        positions = _positions(window, starts, table.shape[1] * page_size).astype(np.int32)
    if wraps:
        write_rows, write_source = ring_writes(window, queries, page_tables, **shape)
    else:
        logical = queries if window is None else window.storage_index(queries)
        write_rows, write_source = flat_rows(page_tables, logical, **shape).reshape(-1), None
    return GroupIndex(
        read_first=wraps,
        write_rows=write_rows.astype(np.int32),
        write_source=write_source,
        page_table=table.astype(np.int32),
        lengths=live.astype(np.int32),
        positions=positions,
        query_positions=queries.astype(np.int32),
    )


def ring_writes(
    window: Window, queries: np.ndarray, page_tables: np.ndarray, *, n_kv_heads: int, num_pages: int, page_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Rows and sources of a chunk written into the ring: per storage index only its newest position survives."""
    batch, num_new = queries.shape
    shape = {"n_kv_heads": n_kv_heads, "num_pages": num_pages, "page_size": page_size}
    rows, sources = [], []
    heads = np.arange(n_kv_heads)[:, None]
    for b in range(batch):
        indices = window.storage_index(queries[b])
        # np.unique on the reversed indices finds each index's last occurrence in the chunk.
        _, first_from_end = np.unique(indices[::-1], return_index=True)
        chunk_index = num_new - 1 - first_from_end
        rows.append(flat_rows(page_tables[b : b + 1], indices[None, chunk_index], **shape)[0].reshape(-1))
        sources.append(((b * n_kv_heads + heads) * num_new + chunk_index[None, :]).reshape(-1))
    return np.concatenate(rows), np.concatenate(sources).astype(np.int32)
