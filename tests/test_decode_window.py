"""Decode-window planning (services.engine.cache.decode_window): the vectorized full-attention plan
against the row-by-row plan, and the page-touch rules of a window ring."""

from __future__ import annotations

import numpy as np
import pytest

from services.engine.cache import decode_window as dw
from services.engine.cache.window import Window

P, H, NUM_PAGES = 16, 3, 200


def geometry(batch: int) -> dict:
    return {"n_kv_heads": H, "num_pages": NUM_PAGES, "tail_pages": batch * dw.TAIL_PAGES_PER_ROW, "page_size": P}


@pytest.mark.parametrize("steps", [1, 5, 16])
def test_full_attention_plan_equals_row_by_row_plan(steps):
    """A ring too large to wrap is full attention; the row-by-row planner is the reference."""
    rng = np.random.default_rng(steps)
    batch = 7
    starts = rng.integers(0, 100, batch)
    tables = np.stack([rng.permutation(NUM_PAGES)[:12] for _ in range(batch)])
    plan = dw.plan_window(None, starts, steps, tables, **geometry(batch), read_pages=lambda n: n)
    positions = starts[:, None] + np.arange(steps)[None]
    table = np.pad(tables, ((0, 0), (0, max(0, plan.page_table.shape[1] - 12))))[:, : plan.page_table.shape[1]]
    table = np.where(np.arange(table.shape[1])[None] < -(-(positions[:, -1] + 1) // P)[:, None], table, table[:, :1])
    rows, (main, tail, copy) = dw._windowed_writes(Window(10**6), starts, positions, tables, table, **geometry(batch))
    assert (rows.reshape(steps, -1) == plan.write_rows).all() and (table == plan.page_table).all()
    got, want = np.lexsort((plan.tail_rows, plan.main_rows)), np.lexsort((tail, main))
    assert (plan.main_rows[got] == main[want]).all() and (plan.tail_rows[got] == tail[want]).all()
    assert (plan.copy_in[got] == copy[want]).all()
    # Every write lands in a tail page the page table names, at the slot of its position.
    for i in range(steps):
        for b in range(batch):
            position = starts[b] + i
            page = plan.page_table[b, position // P] - NUM_PAGES
            assert plan.write_rows[i, b * H] == page * P + position % P


def test_ring_that_revisits_a_page_gives_it_one_tail_page():
    """keep 4, ring 28, pages of 16: slots 30, 31 (page 1), then 4..15 (page 0), then 16 (page 1 again)."""
    window = Window(32, 4)
    start = 30 + 28 * 3  # storage_index(start) == 30
    plan = dw.plan_window(window, np.array([start]), 15, np.array([[5, 9, 11]]), **geometry(1),
                          read_pages=lambda n: n)
    assert sorted(set(plan.page_table[0].tolist())) == [NUM_PAGES, NUM_PAGES + 1]  # two tail pages, not three
    assert plan.copy_in.all()  # a wrapped ring: every index is live before the window
    indices = window.storage_index(start + np.arange(15))
    assert indices[0] == 30 and indices[2] == 4 and indices[-1] == 16


def test_window_longer_than_a_page_or_a_ring_is_refused():
    with pytest.raises(ValueError, match="exceeds"):
        dw.plan_window(None, np.array([0]), P + 1, np.array([[1, 2]]), **geometry(1), read_pages=lambda n: n)
    with pytest.raises(ValueError, match="exceeds"):
        dw.plan_window(Window(8, 2), np.array([0]), 7, np.array([[1]]), **geometry(1), read_pages=lambda n: n)
