"""A decode window's tail-page moves: the one-launch CUDA kernel and the MLX-ops fallback against NumPy copies."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels import cuda_kv, pool_move
from services.engine.cache import CacheOptions
from services.engine.cache.batched import BatchedKVCache
from tests.batching_helpers import make_tiny_mixed_llama

move_rows = pool_move.move_rows
needs_cuda = pytest.mark.skipif(not cuda_kv.is_available(),
                                reason="a CUDA kernel: it runs where MLX's CUDA backend does (the H200 ran it), not on a CPU")


def host(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)  # bf16 values are exact in float32


def random_pool(rng: np.random.Generator, rows: int, width: int, dtype: mx.Dtype) -> mx.array:
    if dtype == mx.uint32:
        return mx.array(rng.integers(0, 2**32, (rows, width), dtype=np.uint64).astype(np.uint32))
    return mx.array(rng.standard_normal((rows, width)).astype(np.float32)).astype(dtype)


@needs_cuda
@pytest.mark.parametrize("moved", [1, 17, 9000])  # 9000 rows of 32 words: more threads than the grid, so a stride
def test_move_rows_copies_each_pairs_rows_in_place_and_nothing_else(moved):
    rng = np.random.default_rng(moved)
    shapes = [(10_000, 64, mx.bfloat16), (10_000, 13, mx.uint32), (10_000, 6, mx.float16), (10_000, 3, mx.float32)]
    sources = [random_pool(rng, r, w, d) for r, w, d in shapes]
    targets = [random_pool(rng, r - 37, w, d) for r, w, d in shapes]  # fewer rows than the sources
    mx.eval(sources, targets)
    before_s, before_t = [host(a) for a in sources], [host(a) for a in targets]
    src = rng.choice(10_000, moved, replace=False).astype(np.int32)
    dst = rng.choice(10_000 - 37, moved, replace=False).astype(np.int32)
    mx.eval(pool_move.move_rows(sources, targets, mx.array(src), mx.array(dst)))  # waits for the launch
    for s, t, s0, t0 in zip(sources, targets, before_s, before_t):
        expected = t0.copy()
        expected[dst] = s0[src]
        np.testing.assert_array_equal(host(t), expected)  # bit for bit (a copy), in the same array
        np.testing.assert_array_equal(host(s), s0)


def test_move_rows_refuses_pairs_it_cannot_copy_by_words():
    a, b = mx.zeros((4, 3), mx.float16), mx.zeros((4, 3), mx.float16)  # 6 bytes a row
    assert not pool_move.serves([a], [b])
    assert not pool_move.serves([mx.zeros((4, 4), mx.float16)], [mx.zeros((4, 4), mx.float32)])
    with pytest.raises(ValueError, match="pairs of 2-D pools"):
        pool_move.move_rows([a], [b], mx.array([0], mx.int32), mx.array([1], mx.int32))


def test_move_rows_refuses_rows_of_another_dtype_or_shape():
    a, b = mx.zeros((4, 4), mx.float16), mx.zeros((4, 4), mx.float16)
    with pytest.raises(ValueError, match="rows must be int32"):
        pool_move.move_rows([a], [b], mx.array([0]).astype(mx.int64), mx.array([1], mx.int32))
    with pytest.raises(ValueError, match="rows must be int32"):
        pool_move.move_rows([a], [b], mx.array([0, 1], mx.int32), mx.array([1], mx.int32))


@pytest.mark.parametrize("scheme", ["raw", "aura4v4"])
def test_a_windows_tail_moves_copy_the_planned_rows_of_every_layer(scheme, monkeypatch):
    """`copy_to_tail` puts each rule's held rows (main -> tail), `copy_from_tail` every tail row back, in every
    layer's pools: against NumPy copies of the plans' rows. Two rules (full attention, a sliding window); on
    CUDA the one-launch kernel, elsewhere the MLX-ops path (the tail forced on, as a GPU has it)."""
    model = make_tiny_mixed_llama(vocab=128, sliding_window=6)
    with monkeypatch.context() as patch:
        if not cuda_kv.is_available():
            patch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu, 0))
        cache = BatchedKVCache.for_model(model, CacheOptions(scheme=scheme), capacity_tokens=256, page_size=4,
                                         max_slots=4)
    assert cache.use_tail and len(cache.windows) == 2
    rng = np.random.default_rng(3)
    cache.replace_arrays([random_pool(rng, *a.shape, a.dtype) for a in cache.arrays])
    cache.replace_tail_arrays([random_pool(rng, *a.shape, a.dtype) for a in cache.tail_arrays])
    views = [cache.acquire() for _ in range(3)]
    for view, n in zip(views, (5, 10, 2)):
        cache.batch([view], n)  # rows of 5, 10 and 2 tokens: partly filled pages, a ring of 6 that wraps
    starts = np.array([v.num_tokens for v in views], np.int64)
    plans = cache.plan_window(views, 3)
    arrays = cache.window_indices(plans, starts)
    read = lambda arrays: [np.array(a) for a in arrays]  # noqa: E731
    main, tail = read(cache.arrays), read(cache.tail_arrays)
    rules = [cache.windows.index(spec.window) for i, spec in enumerate(cache.layers) for _ in cache.storage.pools[i]]
    assert any(p.copy_in.any() for p in plans) and any((~p.copy_in).any() for p in plans)
    launches = []
    monkeypatch.setattr(pool_move, "move_rows", lambda *args: launches.append(args) or move_rows(*args))

    cache.copy_to_tail(arrays)
    mx.synchronize()  # MLX does not see the in-place write: a host read waits for the stream itself
    for m, t, rule in zip(main, tail, rules):
        held = plans[rule].copy_in
        t[plans[rule].tail_rows[held]] = m[plans[rule].main_rows[held]]
    for got, want in zip(read(cache.tail_arrays) + read(cache.arrays), tail + main):
        np.testing.assert_array_equal(got, want)

    tail = [t + 1 if t.dtype != np.uint32 else t ^ np.uint32(0xFFFF) for t in tail]  # as if the window wrote them
    cache.replace_tail_arrays([mx.array(t) for t in tail])
    cache.copy_from_tail(arrays)
    mx.synchronize()
    for m, t, rule in zip(main, tail, rules):
        m[plans[rule].main_rows] = t[plans[rule].tail_rows]
    for got, want in zip(read(cache.arrays) + read(cache.tail_arrays), main + tail):
        np.testing.assert_array_equal(got, want)
    moving = sum(p.copy_in.any() for p in plans) + sum(p.tail_rows.size > 0 for p in plans)
    assert len(launches) == (moving if cuda_kv.is_available() else 0)  # one launch per rule and direction on CUDA
