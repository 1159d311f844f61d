"""BatchedKVCache against single-sequence KVCache runs, and its slot/page/fence rules."""

from __future__ import annotations

import io

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache

from kernels.kv_format import LayerFormat
from services.engine.cache import CacheOptions, KVCache, Window, make_layer_caches
from services.engine.cache.batched import BatchedKVCache
from services.engine.cache.paged_layers import PagedLayerCache
from services.engine.cache.protocol import AttendingCache
from services.engine.cache.schemes import SCHEMES, layer_parts
from shared.errors import CapacityExhausted, StaleSlot
from tests.batching_helpers import make_tiny_mixed_llama

VOCAB = 128
COMPRESSED = [s for s in ("affine8", "aura4v4") if s in SCHEMES]


def make_cache(model, options: CacheOptions, *, capacity_tokens=1024, page_size=4, max_slots=8) -> BatchedKVCache:
    return BatchedKVCache.for_model(model, options, capacity_tokens=capacity_tokens, page_size=page_size,
                                    max_slots=max_slots)


def random_prompts(lengths, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).tolist() for n in lengths]


def forward(model, cache: BatchedKVCache, views, tokens: mx.array) -> mx.array:
    """One batched forward [B, L] as the runner does it (prefetch first); logits [B, L, vocab]."""
    batch = cache.batch(views, tokens.shape[1])
    if batch.prefetch:
        mx.eval(batch.prefetch)
    logits = model(tokens, cache=batch.layers)
    mx.eval(logits, cache.arrays)
    return logits


def reference_logits(model, options, prompt, chunks, feed) -> list[mx.array]:
    """Single-sequence KVCache: the prompt in `chunks` (sizes), then one token per entry of `feed`."""
    caches, out, start = make_layer_caches(model, options), [], 0
    for size in chunks:
        out.append(model(mx.array(prompt[start : start + size])[None], cache=caches)[0, -1])
        start += size
    for token in feed:
        out.append(model(mx.array([[token]]), cache=caches)[0, -1])
    return out


def run_batched(model, cache, prompts, chunks, feed) -> list[list[mx.array]]:
    """Chunked B=1 prefills, then batched decode steps feeding `feed` to every row."""
    views = [cache.acquire() for _ in prompts]
    out = [[] for _ in prompts]
    for view, prompt, sizes, row in zip(views, prompts, chunks, out):
        start = 0
        for size in sizes:
            row.append(forward(model, cache, [view], mx.array(prompt[start : start + size])[None])[0, -1])
            start += size
    for token in feed:
        logits = forward(model, cache, views, mx.full((len(views), 1), token))
        for i, row in enumerate(out):
            row.append(logits[i, -1])
    return out


WINDOWS = [None, Window(12, 2), Window(7, 0)]


@pytest.mark.parametrize("window", WINDOWS, ids=["full", "window12keep2", "window7"])
@pytest.mark.parametrize("scheme", ["raw", *COMPRESSED])
def test_batched_forwards_match_single_sequence_caches(tiny_llama, window, scheme):
    options = CacheOptions(scheme=scheme, max_context=4096, window=window)
    prompts = random_prompts([3, 9, 21, 1, 14])
    chunks = [[3], [4, 5], [8, 8, 5], [1], [14]]  # chunks that wrap the window included
    feed = [5, 17, 99, 3, 64, 2, 7, 11, 90, 1, 42, 8, 13, 21]
    cache = make_cache(tiny_llama, options)
    batched = run_batched(tiny_llama, cache, prompts, chunks, feed)
    # KVCache attends on packed affine codes when decoding (quantized_matmul); we decode the
    # codes first: the same math, rounded differently.
    atol = 5e-3 if scheme.startswith("affine") else 2e-4
    for prompt, sizes, rows in zip(prompts, chunks, batched):
        expected = reference_logits(tiny_llama, options, prompt, sizes, feed)
        np.testing.assert_allclose(np.array(mx.stack(rows)), np.array(mx.stack(expected)), atol=atol)


@pytest.mark.parametrize("spec, names", [("aura4v2+1=aura8v8", ("aura4v2", "aura8v8")),
                                         ("affine4+1=raw", ("affine4", "raw")), ("raw+0=aura4v4", ("aura4v4", "raw"))])
def test_per_layer_schemes_match_hand_built_layer_caches(tiny_llama, spec, names):
    """`--kv-cache` with a layer override: each layer of the batched cache is stored and attended in its own
    scheme (its own AURA seeds), as single-sequence caches built layer by layer without the override parser."""
    cache = make_cache(tiny_llama, CacheOptions(scheme=spec, max_context=4096))
    assert [layer.fmt for layer in cache.layers] == [
        LayerFormat(*layer_parts(name, layer=i, dtype=mx.float32), 64) for i, name in enumerate(names)]
    prompts, chunks, feed = random_prompts([3, 21, 14], seed=4), [[3], [8, 8, 5], [14]], [5, 17, 99, 3, 64]
    for prompt, sizes, rows in zip(prompts, chunks, run_batched(tiny_llama, cache, prompts, chunks, feed)):
        caches = [KVCache(*layer_parts(name, layer=i, dtype=mx.float32), max_tokens=4096) for i, name in enumerate(names)]
        expected, start = [], 0
        for size in sizes:
            expected.append(tiny_llama(mx.array(prompt[start : start + size])[None], cache=caches)[0, -1])
            start += size
        expected += [tiny_llama(mx.array([[token]]), cache=caches)[0, -1] for token in feed]
        # a batched forward rounds as GEMM, a one-row one as GEMV: an AURA code near a boundary may flip
        # (aura4v2+1=aura8v8: 2.1e-4; the others ~2e-6)
        np.testing.assert_allclose(np.array(mx.stack(rows)), np.array(mx.stack(expected)), atol=5e-3)


def test_mixed_full_and_sliding_layers_match_single_sequence(tiny_mixed_llama):
    options = CacheOptions(max_context=4096)
    prompts = random_prompts([5, 13, 2], seed=3)
    chunks, feed = [[5], [6, 7], [2]], [4, 8, 15, 16, 23, 42, 1, 2, 3, 4]
    cache = make_cache(tiny_mixed_llama, options)
    assert [spec.window for spec in cache.layers] == [None, Window(6)]
    batched = run_batched(tiny_mixed_llama, cache, prompts, chunks, feed)
    for prompt, sizes, rows in zip(prompts, chunks, batched):
        expected = reference_logits(tiny_mixed_llama, options, prompt, sizes, feed)
        np.testing.assert_allclose(np.array(mx.stack(rows)), np.array(mx.stack(expected)), atol=2e-4)


def test_layer_views_speak_the_cache_protocol(tiny_llama):
    cache = make_cache(tiny_llama, CacheOptions(max_context=4096))
    views = [cache.acquire(), cache.acquire()]
    forward(tiny_llama, cache, [views[0]], mx.array([[1, 2, 3]]))
    layer = cache.batch(views, 1).layers[0]
    assert isinstance(layer, (PagedLayerCache, AttendingCache))
    assert layer.offset.tolist() == [3, 0]
    assert layer.make_mask(1) is None  # attention masks by each row's live-slot count
    assert layer.index.lengths.tolist() == [4, 1]  # every live slot once this token is written
    keys, values = mx.zeros((2, 2, 1, 64)), mx.ones((2, 2, 1, 64))
    assert layer.update_and_fetch(keys, values) == (keys, values)


def test_stale_view_raises_after_release_and_reuse(tiny_llama):
    cache = make_cache(tiny_llama, CacheOptions(max_context=4096), max_slots=1)
    view = cache.acquire()
    forward(tiny_llama, cache, [view], mx.array([[1, 2]]))
    assert cache.release(view) == 2
    with pytest.raises(StaleSlot):
        cache.batch([view], 1)
    again = cache.acquire()
    assert (again.slot_id, again.generation) == (view.slot_id, view.generation + 1)
    with pytest.raises(StaleSlot):
        _ = view.num_tokens
    assert again.num_tokens == 0 and not again.is_stale


def test_capacity_exhausted_refuses_and_writes_nothing(tiny_llama):
    options = CacheOptions(max_context=4096)
    cache = make_cache(tiny_llama, options, capacity_tokens=16, page_size=4)
    first, second = cache.acquire(), cache.acquire()
    prompt = random_prompts([10], seed=5)[0]
    forward(tiny_llama, cache, [first], mx.array(prompt)[None])
    storage = [np.array(a) for a in cache.arrays]
    with pytest.raises(CapacityExhausted, match="free"):
        cache.batch([first, second], 4)  # first needs 1 page, second 1: only 1 is free
    assert (first.num_tokens, second.num_tokens, second.page_table) == (10, 0, ())
    assert cache.free_tokens == 4
    for before, after in zip(storage, cache.arrays):
        np.testing.assert_array_equal(before, np.array(after))
    # The first sequence goes on exactly as a single-sequence cache would.
    logits = forward(tiny_llama, cache, [first], mx.array([[7]]))[0, -1]
    expected = reference_logits(tiny_llama, options, prompt, [10], [7])[-1]
    np.testing.assert_allclose(np.array(logits), np.array(expected), atol=2e-4)


def test_released_pages_wait_for_a_step_launched_after_release(tiny_llama):
    cache = make_cache(tiny_llama, CacheOptions(max_context=4096), capacity_tokens=8, page_size=4)
    slots = cache.slots
    view = cache.acquire()
    forward(tiny_llama, cache, [view], mx.array([[1, 2, 3, 4, 5, 6, 7, 8]]))
    before = slots.launch_step()  # a step in flight when the sequence is released
    pages = view.page_table
    cache.release(view)
    assert cache.free_tokens == 0 and slots.num_pending_pages == 2
    other = cache.acquire()
    with pytest.raises(CapacityExhausted):
        cache.batch([other], 1)
    slots.complete_step(before)  # launched before the release: not enough
    assert cache.free_tokens == 0
    after = slots.launch_step()
    slots.complete_step(after)
    assert cache.free_tokens == 8
    forward(tiny_llama, cache, [other], mx.array([[1]]))
    assert other.page_table[0] in pages


def test_nbytes_counts_live_tokens_of_every_layer_and_field(tiny_llama):
    cache = make_cache(tiny_llama, CacheOptions(max_context=4096, window=Window(6, 1)))
    view = cache.acquire()
    forward(tiny_llama, cache, [view], mx.array([[1, 2, 3, 4]]))
    per_token = 2 * 2 * (2 * 64 * 4)  # layers x (K and V) x (2 heads x 64 dims x 4 bytes)
    assert cache.bytes_per_token == per_token
    assert (view.tokens_held, view.nbytes) == (4, 4 * per_token)
    forward(tiny_llama, cache, [view], mx.array([[5, 6, 7, 8, 9]]))
    assert (view.num_tokens, view.tokens_held, view.nbytes) == (9, 6, 6 * per_token)
    assert view.page_table == tuple(view.page_table[:2])  # a window of 6 never needs a third page of 4


@pytest.mark.parametrize("scheme", COMPRESSED)
def test_compressed_storage_is_smaller_and_exact_in_bytes(tiny_llama, scheme):
    raw = make_cache(tiny_llama, CacheOptions(max_context=4096))
    packed = make_cache(tiny_llama, CacheOptions(scheme=scheme, max_context=4096))
    reference = make_layer_caches(tiny_llama, CacheOptions(scheme=scheme, max_context=4096))
    tiny_llama(mx.array([[1, 2, 3]]), cache=reference)
    assert packed.bytes_per_token < raw.bytes_per_token
    assert packed.bytes_per_token * 3 == sum(c.nbytes for c in reference)


class _RecurrentModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(2, 2)]

    def make_cache(self):
        return [ArraysCache(2)]


def test_a_model_without_attention_layers_is_refused_clearly():
    with pytest.raises(ValueError, match="no attention layer"):
        BatchedKVCache.for_model(_RecurrentModel(), CacheOptions(), capacity_tokens=16)


@pytest.fixture(scope="module")
def tiny_mixed_llama():
    return make_tiny_mixed_llama(vocab=VOCAB)


def test_truncation_is_exact_for_every_layer_or_refused():
    """Issue 11.14: full layer + sliding layer (window 32) holding 101 tokens. Forgetting 5 would
    let later queries see positions the ring already overwrote: refused. Forgetting the last one,
    or everything, is exact: the next logits equal a fresh prefill's."""
    model = make_tiny_mixed_llama(vocab=VOCAB, sliding_window=32)
    options = CacheOptions(max_context=4096)
    tokens = random_prompts([101], seed=21)[0]
    cache = make_cache(model, options, capacity_tokens=512, page_size=16, max_slots=2)
    view = cache.acquire()
    for start in range(0, 101, 40):
        forward(model, cache, [view], mx.array([tokens[start : start + 40]]))
    assert not cache.slots.can_truncate(view, 96)
    with pytest.raises(ValueError, match="exactly"):
        cache.slots.truncate(view, 96)
    cache.slots.truncate(view, 100)
    again = forward(model, cache, [view], mx.array([tokens[100:101]]))[0, -1]
    fresh_cache = make_cache(model, options, capacity_tokens=512, page_size=16, max_slots=2)
    fresh_view = fresh_cache.acquire()
    for start in range(0, 101, 40):
        fresh = forward(model, fresh_cache, [fresh_view], mx.array([tokens[start : start + 40]]))[0, -1]
    np.testing.assert_allclose(np.array(again), np.array(fresh), atol=1e-4)
    assert cache.slots.can_truncate(view, 0)


def test_window_indices_give_each_step_its_rows_of_the_plan():
    """Every step's [write rows, page table, lengths, positions], per window rule, equal the plan's rows for
    that step (the positions count on from each row's start), and none is computed by a gather."""
    model = make_tiny_mixed_llama(vocab=VOCAB)  # two rules: full attention, a sliding window
    cache = make_cache(model, CacheOptions())
    views = [cache.acquire() for _ in range(3)]
    for view, n in zip(views, (5, 9, 2)):
        cache.batch([view], n)  # rows of 5, 9 and 2 tokens
    starts = np.array([v.num_tokens for v in views], np.int64)
    plans = cache.plan_window(views, 3)
    arrays = cache.window_indices(plans, starts)
    steps = arrays.steps
    assert len(plans) == 2 and len(steps) == 3 and all(len(step) == 2 for step in steps)
    graph = io.StringIO()  # before any is evaluated
    mx.export_to_dot(graph, *[a for step in steps for rule in step for a in rule],
                     *[a for moves in arrays.to_tail + arrays.from_tail for a in moves or ()])
    assert "Gather" not in graph.getvalue()  # views of the upload: an integer index would gather (a kernel on a GPU)
    for i, step in enumerate(steps):
        for plan, (rows, table, lengths, offsets) in zip(plans, step):
            np.testing.assert_array_equal(np.array(rows), plan.write_rows[i])
            np.testing.assert_array_equal(np.array(table), plan.page_table)
            np.testing.assert_array_equal(np.array(lengths), plan.lengths[i])
            np.testing.assert_array_equal(np.array(offsets), starts + i)
            assert rows.dtype == table.dtype == lengths.dtype == offsets.dtype == mx.int32
