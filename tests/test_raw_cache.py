"""Our raw KVCache against mlx-lm's own cache, and its storage rules."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from services.engine.cache import CacheOptions, KVCache, make_layer_caches
from services.engine.cache.protocol import LayerCache
from shared.errors import ContextOverflow


def greedy(model, prompt_ids, caches, steps):
    """Plain greedy loop (no pipelining): the reference both caches are driven by."""
    logits = model(mx.array(prompt_ids)[None], cache=caches)[0, -1]
    out = []
    for _ in range(steps):
        token = int(mx.argmax(logits).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=caches)[0, -1]
    return out


@pytest.mark.model
@pytest.mark.parametrize("prompt", [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
])
def test_greedy_tokens_match_mlx_lm_cache(default_model, prompt):
    model, tok = default_model.model, default_model.tokenizer
    ids = tok.encode(prompt)
    ours = greedy(model, ids, make_layer_caches(model, CacheOptions(max_context=8192)), 64)
    theirs = greedy(model, ids, make_prompt_cache(model), 64)
    assert ours == theirs


def test_logits_equal_mlx_lm_cache_on_chunked_prefill(tiny_llama):
    tokens = mx.array(np.random.default_rng(1).integers(0, 128, (1, 300)))
    ours = make_layer_caches(tiny_llama, CacheOptions(max_context=4096))
    theirs = make_prompt_cache(tiny_llama)
    for start, stop in [(0, 100), (100, 290), (290, 291), (291, 300)]:
        a = tiny_llama(tokens[:, start:stop], cache=ours)
        b = tiny_llama(tokens[:, start:stop], cache=theirs)
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_storage_grows_in_steps_and_nbytes_counts_live_tokens(tiny_llama):
    cache = make_layer_caches(tiny_llama, CacheOptions(max_context=4096))[0]
    assert isinstance(cache, LayerCache)
    k = mx.zeros((1, 2, 10, 64))
    cache.update_and_fetch(k, k)
    assert cache.capacity == KVCache.step
    # K and V, 2 heads x 64 dims x 4 bytes each, per token.
    assert cache.nbytes == 10 * 2 * (2 * 64 * 4)
    cache.update_and_fetch(mx.zeros((1, 2, 250, 64)), mx.zeros((1, 2, 250, 64)))
    assert (cache.offset, cache.capacity) == (260, 2 * KVCache.step)


def test_storage_never_passes_the_context_cap(tiny_llama):
    cache = make_layer_caches(tiny_llama, CacheOptions(max_context=300))[0]
    cache.update_and_fetch(mx.zeros((1, 2, 290, 64)), mx.zeros((1, 2, 290, 64)))
    assert cache.capacity == 304  # the cap, 300, rounded up to whole pages of 16 slots
    with pytest.raises(ContextOverflow, match="301 tokens.*300"):
        cache.update_and_fetch(mx.zeros((1, 2, 11, 64)), mx.zeros((1, 2, 11, 64)))


def test_trim_forgets_tail_tokens(tiny_llama):
    tokens = mx.array(np.random.default_rng(2).integers(0, 128, (1, 20)))
    caches = make_layer_caches(tiny_llama, CacheOptions(max_context=4096))
    tiny_llama(tokens, cache=caches)
    assert [c.trim(5) for c in caches] == [5, 5]
    again = tiny_llama(tokens[:, 15:], cache=caches)
    fresh = tiny_llama(tokens, cache=make_layer_caches(tiny_llama, CacheOptions(max_context=4096)))
    np.testing.assert_allclose(np.array(again), np.array(fresh[:, 15:]), atol=1e-5)
