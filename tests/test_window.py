"""Sliding-window FIFO eviction with attention sinks, against full caches with explicit masks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from services.engine.cache import CacheOptions, Window, make_layer_caches
from services.engine.cache.schemes import SCHEMES


def windowed_logits(model, tokens: np.ndarray, options: CacheOptions, *, prompt_len: int, chunk: int):
    """Chunked prefill of `prompt_len` tokens, then one token per step (teacher-forced)."""
    caches = make_layer_caches(model, options)
    outs = [model(mx.array(tokens[None, s : min(s + chunk, prompt_len)]), cache=caches)
            for s in range(0, prompt_len, chunk)]
    outs += [model(mx.array(tokens[None, i : i + 1]), cache=caches) for i in range(prompt_len, len(tokens))]
    return np.array(mx.concatenate(outs, axis=1)[0]), caches


def masked_full_logits(model, tokens: np.ndarray, options: CacheOptions, rule: np.ndarray):
    """One forward over every token on full caches, the window rule given as an explicit mask."""
    caches = make_layer_caches(model, CacheOptions(scheme=options.scheme, max_context=options.max_context))
    mask = mx.array(rule)
    for c in caches:
        c.make_mask = lambda N, *a, **k: mask
    return np.array(model(mx.array(tokens[None]), cache=caches)[0])


def rule_mask(window: Window, n: int) -> np.ndarray:
    """The rule, restated independently: sinks, plus the last `max_size - keep` positions, causal."""
    q, k = np.arange(n)[:, None], np.arange(n)[None, :]
    return (k <= q) & ((k < window.keep) | (q - k < window.max_size - window.keep))


@pytest.mark.model
def test_window_equals_full_cache_with_explicit_mask_raw(default_model):
    window = Window(32, 4)
    tokens = np.random.default_rng(0).integers(100, 20000, 140)
    options = CacheOptions(max_context=8192, window=window)
    got, caches = windowed_logits(default_model.model, tokens, options, prompt_len=100, chunk=48)
    want = masked_full_logits(default_model.model, tokens, options, rule_mask(window, 140))
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    assert caches[0].offset == 140 and caches[0].num_live == 32


@pytest.mark.parametrize("scheme", SCHEMES)
def test_window_equals_own_scheme_with_explicit_mask(tiny_llama, scheme):
    """Each scheme windowed equals the same scheme on a full cache under the explicit rule.

    Quantization is discontinuous: a 1-ulp difference in a key (the two runs sum in different
    orders) can flip one rounding, so compressed schemes get a 0.05 bound on logits (flips moved them by up
    to 0.021, aura8v4 with one-row products through GEMV). A rule off by a single position moves logits by
    more than 0.3 (0.58-0.67 measured; checked below), far outside it.
    """
    window = Window(32, 4)
    tokens = np.random.default_rng(1).integers(0, 128, 140)
    options = CacheOptions(scheme=scheme, max_context=4096, window=window)
    got, _ = windowed_logits(tiny_llama, tokens, options, prompt_len=100, chunk=48)
    want = masked_full_logits(tiny_llama, tokens, options, rule_mask(window, 140))
    off_by_one = masked_full_logits(tiny_llama, tokens, options, rule_mask(Window(33, 4), 140))
    bound = 1e-4 if scheme == "raw" else 0.05
    assert np.abs(got - want).max() < bound
    assert np.abs(got - off_by_one).max() > 0.3


def test_prompt_longer_than_window_in_one_chunk(tiny_llama):
    window = Window(16, 2)
    tokens = np.random.default_rng(2).integers(0, 128, 70)
    options = CacheOptions(max_context=4096, window=window)
    got, _ = windowed_logits(tiny_llama, tokens, options, prompt_len=60, chunk=60)
    want = masked_full_logits(tiny_llama, tokens, options, rule_mask(window, 70))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_bytes_flat_after_ten_windows(tiny_llama, scheme):
    caches = make_layer_caches(tiny_llama, CacheOptions(scheme=scheme, max_context=4096, window=Window(32, 4)))
    tokens = mx.array(np.random.default_rng(3).integers(0, 128, (1, 320)))
    tiny_llama(tokens[:, :32], cache=caches)
    after_one = [(c.nbytes, c.capacity_nbytes) for c in caches]
    for s in range(32, 320, 24):
        tiny_llama(tokens[:, s : s + 24], cache=caches)
    assert [(c.nbytes, c.capacity_nbytes) for c in caches] == after_one
    assert all(c.capacity == 32 for c in caches)


def test_rope_position_after_wrap_counts_every_token(tiny_llama):
    """The next token's RoPE offset is the number of tokens seen, not the live length."""
    caches = make_layer_caches(tiny_llama, CacheOptions(max_context=4096, window=Window(16, 4)))
    tiny_llama(mx.array(np.random.default_rng(4).integers(0, 128, (1, 50))), cache=caches)
    assert [(c.offset, c.num_live) for c in caches] == [(50, 16), (50, 16)]
    seen = []
    store = caches[0].update_and_fetch

    def spy(keys, values):
        seen.append(keys)
        return store(keys, values)

    caches[0].update_and_fetch = spy
    tiny_llama(mx.array([[7]]), cache=caches)
    # The key handed to the cache is the un-roped key rotated at position 50.
    layer = tiny_llama.model.layers[0]
    x = layer.input_layernorm(tiny_llama.model.embed_tokens(mx.array([[7]])))
    raw_k = layer.self_attn.k_proj(x).reshape(1, 1, 2, 64).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(np.array(seen[0]), np.array(layer.self_attn.rope(raw_k, offset=50)), atol=1e-5)


def test_overwritten_quantized_slot_holds_only_the_new_token(tiny_llama):
    """After a full wrap, every ring slot decodes to a token of the latest window, never a stale one."""
    caches = make_layer_caches(tiny_llama, CacheOptions(max_context=4096, window=Window(8, 2)))
    cache = caches[0]
    keys = mx.array(np.random.default_rng(5).normal(size=(1, 2, 30, 64)).astype(np.float32))
    for i in range(30):
        cache.update_and_fetch(keys[:, :, i : i + 1], keys[:, :, i : i + 1])
    stored = np.array(cache.state[0])
    positions = Window(8, 2).stored_positions(30)
    np.testing.assert_array_equal(stored, np.array(keys)[:, :, positions])
    assert sorted(positions) == [0, 1, 24, 25, 26, 27, 28, 29]


def test_architectural_window_composes_with_user_window():
    from mlx_lm.models import llama

    from services.engine import attention

    attention.install()
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128,
                           head_dim=16, layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    mx.random.seed(0)
    model = llama.Model(args)
    caches = make_layer_caches(model, CacheOptions(max_context=4096))
    assert [c.window for c in caches] == [Window(16, 0), None]
    caches = make_layer_caches(model, CacheOptions(max_context=4096, window=Window(8, 2)))
    assert [c.window for c in caches] == [Window(8, 2), Window(8, 2)]
    caches = make_layer_caches(model, CacheOptions(max_context=4096, window=Window(64, 4)))
    assert [c.window for c in caches] == [Window(16, 0), Window(64, 4)]
    # The sliding layer follows the architectural rule (keep 0) against an explicit mask.
    tokens = np.random.default_rng(6).integers(0, 128, 60)
    got, _ = windowed_logits(model, tokens, CacheOptions(max_context=4096), prompt_len=40, chunk=24)
    from mlx_lm.models.cache import KVCache as MlxKVCache

    ref = [MlxKVCache(), MlxKVCache()]  # full caches; the rule is all in the explicit masks
    sliding, full = mx.array(rule_mask(Window(16, 0), 60)), mx.array(np.tril(np.ones((60, 60), bool)))
    ref[0].make_mask = lambda N, *a, **k: sliding
    ref[1].make_mask = lambda N, *a, **k: full
    want = np.array(model(mx.array(tokens[None]), cache=ref)[0])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
