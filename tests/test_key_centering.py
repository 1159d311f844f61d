"""Key centering (`services.engine.cache.centering`): the means, the exact invariance, the gain, the wiring."""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kernels.kv_format import RAW, PartFormat
from services.engine.cache import CacheOptions, KVCache, Window, make_layer_caches
from services.engine.cache.batched import BatchedKVCache
from services.engine.cache.centering import KeyMeans
from services.engine.runtime import cache_options
from services.eval.corpus import LEE_CORPUS, split_halves, text_token_ids
from services.eval.metrics import KLReference, logprob_chunks
from shared.settings import ModelSettings
from tests.conftest import make_tiny_llama

# MLX's CUDA backend runs float32 matmuls in TF32 (10-bit mantissa): two forwards that chunk or order
# the work differently agree to ~1e-3 there, to ~1e-6 on the CPU.
ON_GPU = mx.default_device() == mx.gpu
RTOL = 1e-2 if ON_GPU else 1e-4


def test_means_equal_float64_mean_of_mlx_lm_keys(tiny_llama):
    """Per layer, the mean of the post-RoPE keys mlx-lm's own cache holds, in float64."""
    ids = [int(x) for x in np.random.default_rng(0).integers(0, 128, 300)]
    means = KeyMeans.measure(tiny_llama, ids, chunk=128)
    caches = make_prompt_cache(tiny_llama)  # mlx-lm's KVCache: not ours, so attention falls through to mlx-lm
    tiny_llama(mx.array([ids]), cache=caches)
    assert len(means.means) == len(caches)
    for mean, cache in zip(means.means, caches):
        want = np.array(cache.keys[0, :, : len(ids)], dtype=np.float64).mean(axis=1, keepdims=True)  # [H, 1, D]
        np.testing.assert_allclose(np.array(mean), want, rtol=RTOL / 10, atol=RTOL / 100)


@pytest.mark.parametrize("window", [None, Window(24, 3)])
def test_centered_keys_leave_attention_unchanged(window):
    """softmax(q.(k - mu)) = softmax(q.k): float32 keys stored centered give the same logits, over chunked
    prefill and decode, with and without a window (sinks and ring)."""
    model = make_tiny_llama(seed=3)
    part = PartFormat(RAW, 32, dtype=mx.float32)
    mu = mx.array(np.random.default_rng(1).normal(0, 3, (2, 1, 64)).astype(np.float32))  # large: a real shift
    prompt = [int(x) for x in np.random.default_rng(2).integers(0, 128, 40)]

    def logits(center: bool) -> np.ndarray:
        caches = [KVCache(part, part, max_tokens=64, window=window) for _ in range(2)]
        for cache in caches:
            cache.key_mean = mu if center else None
        out = [model(mx.array([prompt[i : i + 16]]), cache=caches)[0] for i in range(0, len(prompt), 16)]
        token = mx.argmax(out[-1][-1:], axis=-1)[None]
        for _ in range(8):
            out.append(model(token, cache=caches)[0])
            token = mx.argmax(out[-1], axis=-1)[None]
        return np.concatenate([np.array(o) for o in out])

    np.testing.assert_allclose(logits(True), logits(False), rtol=RTOL, atol=RTOL)


def _means(n: int = 2) -> KeyMeans:
    return KeyMeans(tuple(mx.full((2, 1, 64), i + 1.0) for i in range(n)))


def test_factory_centers_compressed_layers_only(tiny_llama):
    means = _means()
    caches = make_layer_caches(tiny_llama, CacheOptions(scheme="aura4v4+1=raw", key_means=means))
    assert caches[0].key_mean is means.means[0] and caches[1].key_mean is None
    with pytest.raises(ValueError, match="key means for 1 attention layers"):
        make_layer_caches(tiny_llama, CacheOptions(scheme="aura4v4", key_means=_means(1)))


def test_batched_cache_layers_carry_the_means(tiny_llama):
    means = _means()
    cache = BatchedKVCache.for_model(tiny_llama, CacheOptions(scheme="aura4v4", key_means=means),
                                     capacity_tokens=256, max_slots=2)
    assert all(spec.key_mean is mean for spec, mean in zip(cache.layers, means.means))


@pytest.mark.model
def test_engine_options_center_compressed_keys_unless_told_not_to(default_model):
    centered = cache_options(ModelSettings(kv_cache="aura4v4"), default_model)
    assert centered.key_means is not None and len(centered.key_means.means) == 30
    assert cache_options(ModelSettings(kv_cache="aura4v4", no_kv_center_keys=True), default_model).key_means is None
    assert cache_options(ModelSettings(kv_cache="raw"), default_model).key_means is None


@pytest.mark.model
def test_centering_lowers_aura_kl_on_held_out_text(default_model):
    """Means from the first half of the Lee corpus, KL measured on 256 tokens of the second half."""
    model, tok = default_model.model, default_model.tokenizer
    first, second = split_halves(LEE_CORPUS.read_text())
    means = KeyMeans.measure(model, text_token_ids(tok, first, 512))
    held = text_token_ids(tok, second, 256)

    def chunks(scheme: str, key_means) -> list[np.ndarray]:
        options = CacheOptions(scheme=scheme, max_context=len(held), key_means=key_means)
        return list(logprob_chunks(model, make_layer_caches(model, options), held, chunk=128))

    reference = [KLReference.from_logprobs(c) for c in chunks("raw", None)]
    kl = {center: float(np.mean(np.concatenate([r.kl(c) for r, c in zip(reference, chunks("aura4v4", m))])))
          for center, m in ((False, None), (True, means))}
    assert kl[True] < 0.8 * kl[False], kl  # measured 0.031 vs 0.051


def test_cli_flag_turns_centering_off():
    from services.commands.options import add_model_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    assert settings_from_args(parser.parse_args([])).no_kv_center_keys is False
    assert settings_from_args(parser.parse_args(["--no-kv-center-keys"])).no_kv_center_keys is True
    from services.commands.serve import child_flags  # what `serve` hands each engine

    assert child_flags({"no_kv_center_keys": True}) == ["--no-kv-center-keys"]


def test_saved_cache_keeps_its_key_means(tiny_llama, tmp_path):
    """A loaded cache centers its later keys as the saved one did: the same logits, token for token."""
    from services.engine.cache.persist import load_caches, save_caches

    ids = [int(x) for x in np.random.default_rng(4).integers(0, 128, 40)]
    options = CacheOptions(scheme="aura4v4", max_context=64, key_means=KeyMeans.measure(tiny_llama, ids))
    caches = make_layer_caches(tiny_llama, options)
    tiny_llama(mx.array([ids]), cache=caches)
    loaded, _ = load_caches(save_caches(tmp_path / "state", caches))
    for mean, cache in zip(options.key_means.means, loaded):
        np.testing.assert_array_equal(np.array(cache.key_mean), np.array(mean))
    for token in (5, 77, 3):
        want = tiny_llama(mx.array([[token]]), cache=caches)
        np.testing.assert_array_equal(np.array(tiny_llama(mx.array([[token]]), cache=loaded)), np.array(want))


def test_layers_with_learned_sinks_keep_their_keys():
    """gpt-oss passes sink logits to attention: the sink does not shift with the scores, so its layers are
    not centered (the geometry probe records it)."""
    from services.engine import attention

    attention.install()
    from mlx_lm.models import gpt_oss

    args = gpt_oss.ModelArgs(num_hidden_layers=2, num_local_experts=2, num_experts_per_tok=1, vocab_size=64,
                             hidden_size=64, intermediate_size=64, head_dim=32, num_attention_heads=4,
                             num_key_value_heads=2, sliding_window=8)  # one sliding layer, one full
    model = gpt_oss.Model(args)
    means = KeyMeans(tuple(mx.zeros((2, 1, 32)) for _ in range(2)))
    caches = make_layer_caches(model, CacheOptions(scheme="aura4v4", max_context=16, key_means=means))
    assert [c.geometry.sinks for c in caches] == [True, True]
    assert [c.key_mean for c in caches] == [None, None]
    tiny = make_layer_caches(make_tiny_llama(), CacheOptions(scheme="aura4v4"))
    assert [c.geometry.sinks for c in tiny] == [False, False]
