"""The prefix cache's bookkeeping: page names, mapping, claims, eviction, windows, the write guard.

Pure `SlotTable` and `Scheduler` tests (no model): each sequence is admitted the way the
scheduler does it (map the cached prefix, reserve the rest, publish) and its forwards are
stood in for by `begin_forward`, which is where the runner's forwards get their pages.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from services.engine.cache import CacheOptions, Window
from services.engine.cache.batched import BatchedKVCache
from services.engine.cache.pages import LayerBudget, SlotTable
from services.engine.cache.prefix import format_root, page_hashes
from services.engine.request import Request
from shared.protocol import SamplingParams
from services.engine.scheduler import Scheduler
from shared.errors import CapacityExhausted

PAGE = 4
ROOT = format_root("test")


def make_table(num_pages: int = 16, *, layers=(LayerBudget(None, 8),), root=ROOT, **kwargs) -> SlotTable:
    return SlotTable(num_pages=num_pages, page_size=PAGE, max_slots=4, layers=layers, prefix_root=root, **kwargs)


def admit(slots: SlotTable, tokens: list[int], *, extent: int | None = None, write: bool = True):
    """Admit a new sequence as the scheduler does, then run its prompt forward unless `write` is False."""
    extent = extent or len(tokens) + 8
    view = slots.acquire()
    hit = slots.prefix.match(tokens, max_positions=extent)
    slots.prefix.map(view, hit)
    slots.reserve([(view, len(tokens) - hit.num_tokens)])
    slots.prefix.publish(view, tokens, max_positions=extent)
    if write:
        slots.begin_forward([view], len(tokens) - hit.num_tokens)
    return view, hit


def pass_fence(slots: SlotTable) -> None:
    slots.complete_step(slots.launch_step())


def test_pages_are_named_by_their_tokens_their_prefix_and_the_format(tiny_llama):
    tokens = list(range(10))
    hashes = page_hashes(ROOT, tokens, PAGE)
    assert len(hashes) == 2  # the partly filled third page has no name
    first = hashlib.sha256(ROOT + np.arange(4, dtype=np.int64).tobytes()).digest()
    assert hashes == [first, hashlib.sha256(first + np.arange(4, 8, dtype=np.int64).tobytes()).digest()]
    changed = page_hashes(ROOT, [99] + tokens[1:], PAGE)
    assert changed[0] != hashes[0] and changed[1] != hashes[1]  # a page's name carries its whole prefix
    assert page_hashes(ROOT, tokens[:5] + [99] + tokens[6:], PAGE)[0] == hashes[0]
    assert page_hashes(format_root("another model"), tokens, PAGE)[0] != hashes[0]

    def root(**options) -> bytes:
        cache = BatchedKVCache.for_model(tiny_llama, CacheOptions(**options),
                                         capacity_tokens=64, max_slots=1, prefix_key="tiny|float32")  # fmt: skip
        return cache.slots.prefix.root

    formats = [{}, {"scheme": "affine8"}, {"scheme": "aura4v4"}, {"scheme": "aura4v2"},
               {"scheme": "aura4v4", "raw_layers": frozenset({1})}, {"window": Window(64, 4)}]  # fmt: skip
    roots = [root(**f) for f in formats]
    assert len(set(roots)) == len(formats) and root(scheme="aura4v4") == roots[2]


def test_a_second_sequence_maps_the_cached_pages_and_holds_them_once():
    slots = make_table()
    prompt = list(range(10))
    a, miss = admit(slots, prompt)
    assert miss.num_pages == 0 and slots.prefix.num_cached_pages == 2  # two full pages; the third is partial
    b, hit = admit(slots, prompt[:8] + [50, 51, 52])
    assert hit.page_ids == a.page_table[:2] == b.page_table[:2] and hit.num_tokens == 8
    assert b.num_tokens == 11 and b.page_table[2] not in a.page_table
    assert slots.num_held_pages == 3 + 1 and slots.free_tokens == (16 - 4) * PAGE
    counters = slots.prefix.counters
    assert (counters.query_tokens, counters.hit_tokens) == (10 + 11, 8)
    _, again = admit(slots, list(range(8)))  # the page holding the last token is computed again (it samples)
    assert again.page_ids == a.page_table[:1]


def test_a_prefix_being_computed_blocks_lookups_until_written_and_its_claims_end_with_it():
    slots = make_table()
    prompt = list(range(12))
    a, _ = admit(slots, prompt, write=False)  # admitted: its three pages are claimed, none written
    assert slots.prefix.match(prompt + [1], max_positions=20).is_blocked
    slots.begin_forward([a], 4)  # its first chunk is launched: page 0 is written
    hit = slots.prefix.match(prompt + [1], max_positions=20)
    assert hit.page_ids == a.page_table[:1] and hit.is_blocked
    first_page = a.page_table[0]
    slots.release(a)  # cancelled mid-prompt: the claims on unwritten pages are forgotten
    hit = slots.prefix.match(prompt + [1], max_positions=20)
    assert hit.page_ids == (first_page,) and not hit.is_blocked and hit.num_revived == 0  # still fenced
    pass_fence(slots)
    assert slots.prefix.match(prompt + [1], max_positions=20).num_revived == 1
    b, _ = admit(slots, prompt, write=False)
    slots.prefix.end_claims(b)  # a request that ends early forgets its claims, released or kept for a session
    assert not slots.prefix.match(prompt + [1], max_positions=20).is_blocked


def test_unheld_cached_pages_are_evicted_tail_first_and_held_pages_never():
    slots = make_table(num_pages=6)
    a, _ = admit(slots, list(range(8)))
    a_pages = a.page_table
    slots.release(a)
    b, _ = admit(slots, list(range(100, 108)))
    b_pages = b.page_table
    slots.release(b)
    pass_fence(slots)
    assert (slots.prefix.num_cached_pages, slots.prefix.num_evictable_pages, slots.free_tokens) == (4, 4, 6 * PAGE)
    c, hit = admit(slots, list(range(4)) + [9, 9, 9])  # maps A's first page again
    assert hit.page_ids == a_pages[:1] and hit.num_revived == 1
    d, _ = admit(slots, list(range(200, 216)))  # 4 pages: the last free one, then 3 evicted LRU
    assert d.page_table[1:] == (a_pages[1], b_pages[1], b_pages[0])  # each sequence's tail went first
    assert slots.prefix.counters.evicted_pages == 3 and a_pages[0] in c.page_table
    assert slots.prefix.match(list(range(9)), max_positions=9).page_ids == a_pages[:1]
    with pytest.raises(CapacityExhausted):
        admit(slots, [5, 5, 5, 5, 5])
    assert slots.num_held_pages == 6 and c.page_table[0] == a_pages[0]


def test_a_forward_never_writes_a_shared_or_cached_page():
    slots = make_table()
    a, _ = admit(slots, list(range(10)))
    b, _ = admit(slots, list(range(8)) + [1, 2])
    for view in (a, b):  # as if a bug rewound a slot into its shared pages
        slots.slot(view).num_tokens = 4
        with pytest.raises(AssertionError, match="shared or cached"):
            slots.begin_forward([view], 1)


def test_windowed_layers_share_only_pages_they_never_overwrite():
    layers = (LayerBudget(None, 8), LayerBudget(12, 8, pinned_tokens=4))  # a ring of 8 after 4 sinks
    slots = make_table(layers=layers)
    assert [slots.prefix.shareable_pages(n) for n in (12, 13, 100)] == [3, 1, 1]
    prompt = list(range(11))
    admit(slots, prompt, extent=40)  # may wrap its ring: publishes only the sink page
    assert slots.prefix.num_cached_pages == 1
    _, short = admit(slots, prompt, extent=12)  # never wraps: maps the sink page, publishes its second page
    assert short.num_pages == 1 and slots.prefix.num_cached_pages == 2
    assert slots.prefix.match(prompt, max_positions=12).num_pages == 2
    assert slots.prefix.match(prompt, max_positions=13).num_pages == 1  # a longer one would overwrite page 1


def test_recurrent_layers_resume_only_at_a_state_snapshot():
    prompt = list(range(17))
    snapshots = set(page_hashes(ROOT, prompt, PAGE)[:2])  # a state snapshot after pages 0 and 1 only
    slots = make_table(has_state_at=snapshots.__contains__)
    admit(slots, prompt)
    assert slots.prefix.num_cached_pages == 4
    assert slots.prefix.match(prompt + [3], max_positions=30).num_pages == 2


def test_truncating_into_a_cached_page_makes_it_private_or_lets_it_go():
    slots = make_table()
    a, _ = admit(slots, list(range(12)))
    assert slots.truncate(a, 6) == 6  # page 1 was cached, only A holds it: it leaves the cache
    assert slots.prefix.match(list(range(12)), max_positions=20).num_pages == 1
    slots.begin_forward([a], 2)  # positions 6 and 7 rewrite page 1: allowed, it is private again
    slots.prefix.publish(a, list(range(8)), max_positions=20)
    b, hit = admit(slots, list(range(10)))
    assert hit.num_pages == 2
    assert slots.truncate(a, 5) == 4  # page 1 is shared with B: A lets it go and keeps 4 positions
    assert a.page_table == b.page_table[:1] and slots.num_held_pages == 3


def test_truncating_a_window_that_has_not_wrapped_keeps_no_cached_page_past_the_cut():
    slots = make_table(layers=(LayerBudget(None, 8), LayerBudget(64, 8, pinned_tokens=4)))
    a, _ = admit(slots, list(range(20)), extent=64)
    assert slots.prefix.num_cached_pages == 5
    assert slots.truncate(a, 6) == 6 and len(a.page_table) == 2  # pages 2-4 stay cached, not held
    slots.begin_forward([a], 14)  # positions 6-19 are written again, into private pages only
    assert slots.prefix.num_cached_pages == 4 and slots.num_held_pages == 5


def fake_steps(scheduler: Scheduler, num_steps: int) -> None:
    """Stand in for the runner: each forward takes its pages (`begin_forward`); every token is 7."""
    slots = scheduler.slots
    for _ in range(num_steps):
        plan = scheduler.schedule()
        step_id = slots.launch_step()
        for chunk in plan.prefills:
            slots.begin_forward([chunk.request.slot], chunk.num_tokens)
        if plan.decodes:
            slots.begin_forward([r.slot for r in plan.decodes], plan.steps)
        slots.complete_step(step_id)
        scheduler.update(plan, {r.request_id: [7] * (plan.steps if r in plan.decodes else 1) for r in plan.sampling})


@pytest.mark.parametrize("root", [ROOT, None], ids=["prefix_cache", "no_prefix_cache"])
def test_admission_counts_shared_pages_once(root):
    """Ten pages of 4 tokens; three requests of a 24-token system prompt plus 2 tokens, 3 outputs
    each (28 positions). Alone a request needs 7 pages; sharing the 6 system pages, three need
    7 + 1 + 1 = 9."""
    slots = make_table(num_pages=10, root=root)
    scheduler = Scheduler(slots, step_token_budget=64, max_context=64, eos_token_ids=())
    system = list(range(24))
    for i in range(3):
        scheduler.add(Request(f"r{i}", system + [40 + i] * 2, SamplingParams(max_tokens=3)))
    fake_steps(scheduler, 2)
    if root is None:  # each holds its own copy: the second waits for the first to finish
        assert [r.request_id for r in scheduler.running] == ["r0"] and slots.num_held_pages == 7
        return
    assert [r.request_id for r in scheduler.running] == ["r0", "r1", "r2"] and slots.num_held_pages == 9
    assert [r.num_cached_tokens for r in scheduler.running] == [0, 24, 24]
    fake_steps(scheduler, 3)
    assert not scheduler.has_unfinished() and slots.num_held_pages == 0 and slots.free_tokens == 40
