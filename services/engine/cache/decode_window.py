"""Decode windows: N decode steps launched back to back, writing a small tail pool.

A forward writes its pool in place only when no launched work still reads it (MLX donates
a buffer only then; otherwise the scatter copies the whole pool). So the N steps of a window
write their new tokens not to the main pools but to *tail pages*: before the window, each
row's pages that the window will write (its last, partly filled page and the next ones) are
copied into tail pages; during the window attention reads the main pages plus those tail
pages (page ids >= num_pages in the page table name tail pages), and each step's write lands
in the small tail pool (in place, by the q/k/v kernel, in a lean CUDA step:
`kernels.qkv_rope.split_qkv_rope_store`; else by a scatter, whose copy of the pool, at worst,
costs little); after the window the tail pages are copied back, in place: once the engine has
waited for it, or, where the next window is launched ahead of the read-back, by that launch, in
stream order before the next window's copy into the tail. The host therefore launches step n+1
while step n runs, without ever waiting inside a window.

Everything here is index math in numpy, built once per window for all N steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .paged_index import live_tokens
from .pool_rows import flat_rows
from .window import Window

TAIL_PAGES_PER_ROW = 4  # a window of <= page_size steps touches at most 4 pages of a row (a ring that wraps)


@dataclass(frozen=True, slots=True)
class WindowIndex:
    """Where the N steps of a window write and read, for one window rule.

    Attributes:
        write_rows (np.ndarray): int32 [N, B * n_kv_heads], tail-pool rows step i writes.
        page_table (np.ndarray): int32 [B, NP], pages attention reads (tail pages as
            `num_pages + tail page`), the same for every step.
        lengths (np.ndarray): int32 [N, B], live tokens per row after step i's write.
        main_rows (np.ndarray): int32 [m], main-pool rows of the pages moved to the tail.
        tail_rows (np.ndarray): int32 [m], the tail-pool rows they are copied to (and back from).
        copy_in (np.ndarray): bool [m], rows holding tokens from before the window (copied in).
    """

    write_rows: np.ndarray
    page_table: np.ndarray
    lengths: np.ndarray
    main_rows: np.ndarray
    tail_rows: np.ndarray
    copy_in: np.ndarray


def plan_window(
    window: Window | None,
    starts: np.ndarray,
    num_steps: int,
    page_tables: np.ndarray,
    *,
    n_kv_heads: int,
    num_pages: int,
    tail_pages: int,
    page_size: int,
    read_pages,
    use_tail: bool = True,
) -> WindowIndex:
    """Plan a window of `num_steps` one-token steps over rows at positions `starts`.

    Args:
        window (Window | None): The layers' window rule, or None for full attention.
        starts (np.ndarray): int64 [B], position of each row's first new token.
        num_steps (int): N, at most `page_size`.
        page_tables (np.ndarray): int64 [B, P], each row's main pages (padded past its own),
            covering every slot the window writes.
        n_kv_heads, num_pages, tail_pages, page_size (int): Pool geometry.
        read_pages (Callable[[int], int]): Maps pages needed to pages read (traced shapes).
        use_tail (bool): Write tail pages (steps launched back to back); False writes the main
            pages directly (each step then waits for the previous one: the CPU backend, where
            overlapping buys little and the tail's extra reads cost).

    Raises:
        ValueError: more steps than a page holds, or more rows than the tail pool serves.
    """
    batch = starts.size
    if num_steps > page_size or (window is not None and num_steps > window.ring):
        raise ValueError(f"a decode window of {num_steps} steps exceeds the page size {page_size} or a window ring")
    if use_tail and batch * TAIL_PAGES_PER_ROW > tail_pages:
        raise ValueError(f"{batch} rows need {batch * TAIL_PAGES_PER_ROW} tail pages, the pool has {tail_pages}")
    positions = starts[:, None] + np.arange(num_steps)[None, :]  # [B, N]
    indices = positions if window is None else window.storage_index(positions)
    lengths = live_tokens(window, positions + 1)  # [B, N]
    needed = max(1, int(-(-lengths.max() // page_size)))
    width = read_pages(needed)
    table = np.pad(page_tables, ((0, 0), (0, max(0, width - page_tables.shape[1]))))[:, :width].copy()
    live_pages = -(-lengths[:, -1] // page_size)
    table = np.where(np.arange(width)[None, :] < live_pages[:, None], table, table[:, :1])
    if not use_tail:
        rows = flat_rows(page_tables, indices, n_kv_heads=n_kv_heads, num_pages=num_pages, page_size=page_size)
        write_rows, moves = rows.transpose(2, 0, 1), (np.zeros(0, np.int64),) * 2 + (np.zeros(0, bool),)
    elif window is None:
        write_rows, moves = _full_attention_writes(starts, num_steps, page_tables, table, n_kv_heads=n_kv_heads,
                                                   num_pages=num_pages, tail_pages=tail_pages, page_size=page_size)
    else:
        write_rows, moves = _windowed_writes(window, starts, indices, page_tables, table, n_kv_heads=n_kv_heads,
                                         num_pages=num_pages, tail_pages=tail_pages, page_size=page_size)
    main_rows, tail_rows, copy_in = moves
    return WindowIndex(
        write_rows=write_rows.reshape(num_steps, -1).astype(np.int32),
        page_table=table.astype(np.int32),
        lengths=lengths.T.astype(np.int32).copy(),
        main_rows=main_rows.astype(np.int32),
        tail_rows=tail_rows.astype(np.int32),
        copy_in=copy_in,
    )


def _full_attention_writes(starts, num_steps, page_tables, table, *, n_kv_heads, num_pages, tail_pages, page_size):
    """Vectorized plan of full-attention rows: a window touches a row's page of `start` and maybe the next."""
    batch = starts.size
    first = starts // page_size
    pages = (starts[:, None] + np.arange(num_steps)[None, :]) // page_size - first[:, None]  # [B, N]: 0 or 1
    touched = pages[:, -1] + 1  # [B]
    tail = np.arange(batch)[:, None] * TAIL_PAGES_PER_ROW + np.arange(2)[None, :]  # [B, 2]
    for k in range(2):
        rows = np.nonzero(touched > k)[0]
        table[rows, first[rows] + k] = num_pages + tail[rows, k]
    heads = np.arange(n_kv_heads)
    slot_in_page = (starts[:, None] + np.arange(num_steps)[None, :]) % page_size  # [B, N]
    tail_of_step = np.take_along_axis(tail, pages, axis=1)  # [B, N]
    write_rows = ((heads[None, None, :] * tail_pages + tail_of_step.T[:, :, None]) * page_size
                  + slot_in_page.T[:, :, None])  # [N, B, H]
    b, k = np.nonzero(np.arange(2)[None, :] < touched[:, None])  # touched (row, k) pairs
    main_page = page_tables[b, first[b] + k]
    offsets = np.arange(page_size)
    main_rows = (heads[None, :, None] * num_pages + main_page[:, None, None]) * page_size + offsets[None, None, :]
    tail_rows = (heads[None, :, None] * tail_pages + tail[b, k][:, None, None]) * page_size + offsets[None, None, :]
    held = (first[b] + k)[:, None, None] * page_size + offsets[None, None, :] < starts[b][:, None, None]
    copy_in = np.broadcast_to(held, main_rows.shape)
    return write_rows, (main_rows.reshape(-1), tail_rows.reshape(-1), copy_in.reshape(-1))


def _windowed_writes(window, starts, indices, page_tables, table, *, n_kv_heads, num_pages, tail_pages, page_size):
    """Plan of windowed rows, row by row: a ring can revisit a page within one window."""
    num_steps = indices.shape[1]
    heads = np.arange(n_kv_heads)
    write_rows = np.zeros((num_steps, starts.size, n_kv_heads), np.int64)
    main_rows, tail_rows, copy_in = [], [], []
    for b in range(starts.size):
        logical = list(dict.fromkeys((indices[b] // page_size).tolist()))  # touched pages, in order
        for k, page_index in enumerate(logical):
            tail = b * TAIL_PAGES_PER_ROW + k
            table[b, page_index] = num_pages + tail
            rows = np.arange(page_size)
            main_rows.append(((heads[:, None] * num_pages + page_tables[b, page_index]) * page_size + rows[None]).reshape(-1))
            tail_rows.append(((heads[:, None] * tail_pages + tail) * page_size + rows[None]).reshape(-1))
            old = _held_before(window, int(starts[b]), page_index * page_size + rows)
            copy_in.append(np.broadcast_to(old, (n_kv_heads, page_size)).reshape(-1))
            for i in np.nonzero(indices[b] // page_size == page_index)[0]:
                write_rows[i, b] = (heads * tail_pages + tail) * page_size + indices[b, i] % page_size
    return write_rows, (np.concatenate(main_rows), np.concatenate(tail_rows), np.concatenate(copy_in))


def _held_before(window: Window | None, start: int, indices: np.ndarray) -> np.ndarray:
    """Whether each storage index holds a live token before position `start` is written."""
    return indices < live_tokens(window, np.array(start))
