"""The lean decode forward computes what mlx-lm's forward computes, over the same paged caches."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from services.engine import attention
from services.engine.cache import CacheOptions
from services.engine.cache.batched import BatchedKVCache
from services.engine.cache.paged_layers import PagedLayerCache
from services.engine.model.decode import LeanDecoder
from services.engine.model.fuse import fuse_projections


def _tiny(family: str, **extra):
    attention.install()
    module = __import__(f"mlx_lm.models.{family}", fromlist=["Model"])
    args = module.ModelArgs(model_type=family, hidden_size=128, num_hidden_layers=2, intermediate_size=192,
                            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=96,
                            max_position_embeddings=4096, rope_theta=10000.0, **extra)
    mx.random.seed(3)
    model = module.Model(args)
    mx.eval(model.parameters())
    return model


def _both_forwards(model, scheme: str, prompt_lengths=(5, 17, 33)):
    """Logits and first-layer pools of one decode step over ragged rows (mlx-lm's forward, then the lean one),
    and the pool rows the step wrote."""
    rows = len(prompt_lengths)
    cache = BatchedKVCache.for_model(model, CacheOptions(scheme=scheme, max_context=256),
                                     capacity_tokens=max(512, 64 * rows), page_size=16, max_slots=max(4, rows))
    rng = np.random.default_rng(0)
    vocab = model.args.vocab_size
    views = [cache.acquire() for _ in prompt_lengths]
    for view, n in zip(views, prompt_lengths):
        batch = cache.batch([view], n)
        mx.eval(model(mx.array(rng.integers(0, vocab, (1, n)), mx.uint32), cache=batch.layers), cache.arrays)
    tokens = mx.array(rng.integers(0, vocab, len(views)), mx.uint32)
    before = [a + 0 for a in cache.arrays]  # copies: the lean step writes them (on CUDA in place)
    mx.eval(before)
    batch = cache.batch(views, 1)
    storage = cache.storage.with_arrays(before)
    # The main pools stand in for a window's tail (page ids past the main pages would name tail pages; none do):
    # on CUDA the q/k/v launch writes k and v into them in place, as a decode window's step writes its tail.
    lean_caches = [PagedLayerCache(storage, i, c.spec, c.index, tail=storage) for i, c in enumerate(batch.layers)]
    want = model(tokens[:, None], cache=batch.layers)[:, -1]
    decoder = LeanDecoder.build(model)
    assert decoder is not None
    got = decoder(tokens, lean_caches)
    written = np.array(batch.layers[0].index.write_rows)  # the pool rows the step wrote
    return (_np(want), _np(cache.arrays[0])), (_np(got), _np(storage.arrays[0])), written


def _np(a: mx.array) -> np.ndarray:
    """NumPy has no bfloat16: such arrays come as float32 (exactly)."""
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


@pytest.mark.parametrize("scheme", ["raw", "aura4v4", "affine4"])
def test_default_model_lean_step_equals_mlx_lm_forward(default_model, scheme):
    fuse_projections(default_model.model)
    (want, want_pool), (got, got_pool), written = _both_forwards(default_model.model, scheme)
    assert got.shape == want.shape == (3, default_model.model.args.vocab_size)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    np.testing.assert_allclose(got_pool, want_pool, rtol=1e-5, atol=1e-5)  # the same K/V written


@pytest.mark.parametrize("family, extra", [
    ("qwen3", {"tie_word_embeddings": False, "head_dim": 48}),  # q/k RMSNorm, separate lm_head, head_dim != hidden / heads
    ("qwen2", {"tie_word_embeddings": True}),  # q/k/v bias
    ("llama", {"attention_bias": True, "tie_word_embeddings": False}),  # q/k/v and o_proj bias
])
def test_other_families_lean_step_equals_mlx_lm_forward(family, extra):
    model = _tiny(family, **extra)
    fuse_projections(model)
    (want, want_pool), (got, got_pool), written = _both_forwards(model, "raw")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_pool, want_pool, rtol=1e-6, atol=1e-6)
    assert np.abs(want_pool).sum() > 0  # the step wrote K/V (pages start zeroed)


@pytest.mark.parametrize("scheme", ["affine4", "aura4v4", "aura8v4"])
def test_compressed_lean_step_equals_mlx_lm_forward(scheme):
    """head_dim 64, compressed caches: on CUDA the lean step codes k and v into their rows in its q/k/v launch
    (`split_qkv_rope_store`), mlx-lm's forward through the cache's encoder."""
    model = _tiny("llama", tie_word_embeddings=True, head_dim=64)
    fuse_projections(model)
    (want, want_pool), (got, got_pool), written = _both_forwards(model, scheme)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # the same rows written; on CUDA the kernel's RoPE may round a key 1 ulp off mx.fast.rope's, which can move
    # a coordinate sitting on a code threshold: a word or two of the step's 6 rows
    assert np.all(np.abs(want_pool[written]).sum(-1) > 0)
    assert np.mean(got_pool[written] == want_pool[written]) >= 0.95


@pytest.mark.parametrize("prompt_lengths", [(5, 17, 33), tuple(range(3, 23)), (17,)],
                         ids=["3 rows", "20 rows", "1 row"])
def test_bfloat16_lean_step_equals_mlx_lm_forward(prompt_lengths):
    """bf16, K a multiple of 256: on CUDA, 2 to 32 rows project through `kernels.skinny_gemm` (at 20 rows the
    down projection, K = 4 N, split over 2 blocks; float32 sums in another order than cuBLAS: bf16 rounding
    differences, which each layer carries on), one row through `kernels.norm_gemv` (MLX's gemv off CUDA)."""
    attention.install()
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=1024,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=96,
                           max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True)
    mx.random.seed(4)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    fuse_projections(model)
    (want, _), (got, _), _ = _both_forwards(model, "raw", prompt_lengths)
    assert got.shape == want.shape == (len(prompt_lengths), 96)
    np.testing.assert_allclose(got, want, rtol=0, atol=0.05 * np.abs(want).max())


@pytest.mark.parametrize("family, extra", [("llama", {}), ("qwen3", {"head_dim": 64}), ("qwen2", {})])
def test_one_row_step_folds_each_norm_into_the_projection_after_it(monkeypatch, family, extra):
    """One row: every layer's two norms and the final one run inside `norm_gemv`, made to serve here (float32: its
    MLX-ops fallback, on the H200 too; its kernel is checked in tests/test_norm_gemv.py), and the logits equal
    mlx-lm's forward. qwen2's q/k/v bias keeps the other path (`norm_gemv` adds none)."""
    from kernels import norm_gemv

    calls = []
    real = norm_gemv.norm_gemv
    monkeypatch.setattr(norm_gemv, "serves", lambda x, w: x.shape[0] == 1)
    monkeypatch.setattr(norm_gemv, "norm_gemv", lambda *a, **k: calls.append(k.get("swiglu", False)) or real(*a, **k))
    attention.install()
    module = __import__(f"mlx_lm.models.{family}", fromlist=["Model"])
    args = module.ModelArgs(model_type=family, hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=96,
                            max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True, **extra)
    mx.random.seed(5)
    model = module.Model(args)
    norms = [model.model.norm] + [n for block in model.model.layers
                                  for n in (block.input_layernorm, block.post_attention_layernorm)]
    for norm in norms:  # distinct scales, so a norm applied in the wrong place shows
        norm.weight = 1 + 0.3 * mx.random.normal(norm.weight.shape)
    mx.eval(model.parameters())
    fuse_projections(model)
    (want, want_pool), (got, got_pool), _ = _both_forwards(model, "raw", (17,))
    # per layer q/k/v, then gate/up + SwiGLU; the head last
    assert calls == ([] if family == "qwen2" else [False, True, False, True, False])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_pool, want_pool, rtol=1e-6, atol=1e-6)


def test_llama3_rope_model_lean_step_equals_mlx_lm_forward():
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # short, so positions here cross every band
    model = _tiny("llama", tie_word_embeddings=True, rope_scaling=scaling)
    fuse_projections(model)
    (want, want_pool), (got, got_pool), written = _both_forwards(model, "raw", prompt_lengths=(5, 70, 200))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_pool, want_pool, rtol=1e-6, atol=1e-6)


def test_models_with_other_ropes_or_mixed_norm_dtypes_keep_their_own_forward():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    model = _tiny("llama", tie_word_embeddings=True, rope_scaling=yarn)
    fuse_projections(model)
    assert LeanDecoder.build(model) is None
    model = _tiny("qwen3", tie_word_embeddings=True, head_dim=32)
    fuse_projections(model)
    model.model.layers[1].self_attn.q_norm.weight = model.model.layers[1].self_attn.q_norm.weight.astype(mx.float16)
    assert LeanDecoder.build(model) is None


def test_mixed_dtype_models_keep_their_own_forward():
    model = _tiny("qwen3", tie_word_embeddings=True, head_dim=32)
    fuse_projections(model)
    model.model.norm.weight = model.model.norm.weight.astype(mx.float16)
    assert LeanDecoder.build(model) is None


def test_unfused_or_foreign_models_keep_their_own_forward():
    model = _tiny("qwen3", tie_word_embeddings=True, head_dim=32)
    assert LeanDecoder.build(model) is None  # separate q/k/v: not the layout it reads
    fuse_projections(model)
    assert LeanDecoder.build(model) is not None
    gemma = __import__("mlx_lm.models.gemma3_text", fromlist=["Model"])
    assert LeanDecoder.build(gemma.Model(gemma.ModelArgs(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=1, intermediate_size=96, num_attention_heads=2,
        head_dim=32, rms_norm_eps=1e-6, vocab_size=64, num_key_value_heads=1))) is None


def test_store_target_is_the_tail_of_a_one_token_forward(monkeypatch):
    """`store_target`: the layer's tail pools and the step's write rows where the fused CUDA attention reads the
    format (forced here, as on the H200); none without a tail, for a prompt chunk, or off that kernel."""
    from services.engine.cache import paged_layers

    model = _tiny("llama", tie_word_embeddings=True, head_dim=64)
    for scheme, n_pools in (("raw", 2), ("aura4v4", 1)):
        cache = BatchedKVCache.for_model(model, CacheOptions(scheme=scheme, max_context=256), capacity_tokens=512,
                                         page_size=16, max_slots=4)
        views = [cache.acquire() for _ in range(2)]
        layer = cache.batch(views, 1).layers[1]
        tail = cache.storage.with_arrays(cache.arrays)
        windowed = PagedLayerCache(tail, 1, layer.spec, layer.index, tail=tail)
        with monkeypatch.context() as patch:
            patch.setattr(paged_layers, "uses_cuda", lambda fmt: True)
            assert layer.store_target is None  # no tail: update_and_fetch writes the main pools
            pools, rows = windowed.store_target
            assert len(pools) == n_pools and all(p is q for p, q in zip(pools, tail.pools[1]))
            assert rows is layer.index.write_rows and rows.shape == (2 * 2,) and rows.dtype == mx.int32
            chunk = cache.batch([cache.acquire()], 5).layers[1]
            assert PagedLayerCache(tail, 1, chunk.spec, chunk.index, tail=tail).store_target is None  # 5 tokens a row
            patch.setattr(paged_layers, "uses_cuda", lambda fmt: False)
            assert windowed.store_target is None  # the MLX-ops attention would not wait for the write


def test_flat_attention_takes_one_query_per_row():
    model = _tiny("llama", tie_word_embeddings=True, head_dim=64)
    cache = BatchedKVCache.for_model(model, CacheOptions(scheme="raw", max_context=256), capacity_tokens=512,
                                     page_size=16, max_slots=4)
    layer = cache.batch([cache.acquire()], 3).layers[0]
    q = mx.zeros((1, 4, 3, 64))
    with pytest.raises(ValueError, match="one query per row"):
        layer.attend(q, None, None, scale=1.0, mask=None, flat=True)
