"""Compressed KV caches: attention paths, memory, byte accounting, raw layers, save/load.

References are independent of the code under test: float64 NumPy attention over
`kernels.reference` dequantization, byte counts derived by hand from CACHES.md, and logits
of the same cache continued in another process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from kernels import reference as ref
from services.engine.cache import CacheOptions, KVCache, make_layer_caches
from services.engine.cache import kv as kv_module
from services.engine.cache.codecs import RawCodec
from services.engine.cache.persist import load_caches, save_caches
from services.engine.cache.quantized import AffineCodec, AuraCodec, Packed, affine_attention
from services.engine.cache.schemes import codec_from_meta, make_codecs
from tests.conftest import make_tiny_llama

B, N_HEADS, N_KV_HEADS, D = 1, 4, 2, 64

# Bytes per token, per layer and KV head, for K then V, at head_dim 64 (CACHES.md "Bytes per
# token"): codes d*bits/8; affine adds an fp16 scale and bias per group; AURA one fp16 scale.
HAND_BYTES = {
    "raw": (64 * 4, 64 * 4),  # float32 on CPU
    "affine8": (64 + 2 * 2 * 1, 64 + 2 * 2 * 1),  # one group of 64
    "affine4": (32 + 2 * 2 * 2, 32 + 2 * 2 * 2),  # two groups of 32
    "aura4v4": (4 * 64 // 8 + 2, 4 * 64 // 8 + 2),
    "aura4v2": (4 * 64 // 8 + 2, 2 * 64 // 8 + 2),
    "aura8v4": (8 * 64 // 8 + 2, 4 * 64 // 8 + 2),
    "aura8v8": (8 * 64 // 8 + 2, 8 * 64 // 8 + 2),
    "aura5v3": (5 * 64 // 8 + 2, 3 * 64 // 8 + 2),
}


def attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, mask: np.ndarray | None) -> np.ndarray:
    """float64 softmax attention with GQA by head repetition: q [B,H,L,D], k/v [B,Hkv,T,D]."""
    reps = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, reps, axis=1), np.repeat(v, reps, axis=1)
    scores = scale * q @ k.swapaxes(-1, -2)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v


def dequantized(codec: AffineCodec, fields) -> np.ndarray:
    packed, scales, biases = (np.array(f) for f in fields)
    return ref.affine_dequantize_ref(packed, scales, biases, codec.bits, codec.group_size)


@pytest.mark.parametrize("bits, group", [(8, 64), (4, 32)])
@pytest.mark.parametrize("num_queries, mask_kind", [(1, None), (5, "causal"), (5, "array")])
def test_packed_affine_attention_matches_float64_reference(bits, group, num_queries, mask_kind):
    rng = np.random.default_rng(bits + num_queries)
    codec = AffineCodec(bits, group, mx.float32)
    k = codec.encode(mx.array(rng.standard_normal((B, N_KV_HEADS, 40, D)).astype(np.float32)))
    v = codec.encode(mx.array(rng.standard_normal((B, N_KV_HEADS, 40, D)).astype(np.float32)))
    q = rng.standard_normal((B, N_HEADS, num_queries, D)).astype(np.float32)
    causal = np.arange(40 - num_queries, 40)[:, None] >= np.arange(40)[None]
    allowed = {None: None, "causal": causal, "array": causal & (rng.random((num_queries, 40)) < 0.7)}[mask_kind]
    mask = mx.array(allowed) if mask_kind == "array" else mask_kind
    got = affine_attention(mx.array(q), k, v, key_codec=codec, value_codec=codec, scale=0.125, mask=mask)
    want = attention_ref(q.astype(np.float64), dequantized(codec, k), dequantized(codec, v), 0.125, allowed)
    assert got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("scheme", ["affine8", "affine4"])
def test_decode_attends_on_packed_codes_and_matches_decoded_path(tiny_llama, scheme, monkeypatch):
    tokens = mx.array(np.random.default_rng(0).integers(0, 128, (1, 60)))

    def decode_logits():
        caches = make_layer_caches(tiny_llama, CacheOptions(scheme=scheme, max_context=256))
        tiny_llama(tokens[:, :50], cache=caches)
        return np.array(mx.concatenate([tiny_llama(tokens[:, i : i + 1], cache=caches) for i in range(50, 60)], 1))

    seen = []
    original = affine_attention
    monkeypatch.setattr(kv_module, "affine_attention", lambda *a, **k: seen.append(1) or original(*a, **k))
    packed = decode_logits()
    assert len(seen) == 10 * 2  # every decode step, both layers
    monkeypatch.setattr(kv_module, "attends_packed", lambda *a: False)
    np.testing.assert_allclose(packed, decode_logits(), atol=1e-4)


def test_update_and_fetch_returns_packed_fields_only_for_affine_decode():
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((B, N_KV_HEADS, 8, D)).astype(np.float32))
    for scheme, decode_packed in [("affine4", True), ("aura4v4", False), ("raw", False)]:
        cache = KVCache(*make_codecs(scheme, layer=0, dtype=mx.float32), max_tokens=64)
        prefill_k, _ = cache.update_and_fetch(x, x)
        decode_k, _ = cache.update_and_fetch(x[:, :, :1], x[:, :, :1])
        assert not isinstance(prefill_k, Packed) and prefill_k.shape == (B, N_KV_HEADS, 8, D)
        assert isinstance(decode_k, Packed) == decode_packed


def prefill_peak_bytes(model, scheme: str, tokens: np.ndarray, chunk: int) -> int:
    caches = make_layer_caches(model, CacheOptions(scheme=scheme, max_context=len(tokens)))
    mx.clear_cache()
    mx.reset_peak_memory()
    for start in range(0, len(tokens), chunk):
        mx.eval(model(mx.array(tokens[None, start : start + chunk]), cache=caches))
    return mx.get_peak_memory()


def test_long_prefill_peak_memory_stays_below_raw():
    """2048 tokens in 512-token chunks: compressed caches peak below the raw cache.

    Twelve layers make the cache (raw: 2048 tokens x 12 layers x 1 KiB = 24 MiB) the bulk of
    what differs between schemes; one layer's transient scores and dequantized K/V are the
    same or smaller. Each compressed peak must sit below raw's by at least half of what its
    storage saves. (`ops/bench_kv.py --mode prefill-memory` measures the default model.)
    """
    model = make_tiny_llama(n_layers=12)
    tokens = np.random.default_rng(2).integers(0, 128, 2048)
    peaks = {s: prefill_peak_bytes(model, s, tokens, 512) for s in ("raw", "affine4", "aura4v4")}
    for scheme in ("affine4", "aura4v4"):
        saved = 2048 * 12 * N_KV_HEADS * (sum(HAND_BYTES["raw"]) - sum(HAND_BYTES[scheme]))
        assert peaks[scheme] < peaks["raw"] - saved // 2, peaks


@pytest.mark.parametrize("scheme", list(HAND_BYTES))
@pytest.mark.parametrize("window", [None, (32, 4)])
def test_nbytes_equals_hand_derived_bytes(scheme, window):
    from services.engine.cache import Window

    cache = KVCache(*make_codecs(scheme, layer=3, dtype=mx.float32), max_tokens=4096,
                    window=None if window is None else Window(*window))
    x = mx.array(np.random.default_rng(3).standard_normal((B, N_KV_HEADS, 70, D)).astype(np.float32))
    cache.update_and_fetch(x, x)
    key_bytes, value_bytes = HAND_BYTES[scheme]
    live = 70 if window is None else 32
    assert cache.nbytes == live * N_KV_HEADS * (key_bytes + value_bytes)
    assert cache.capacity_nbytes == cache.capacity * N_KV_HEADS * (key_bytes + value_bytes)
    assert cache.capacity == (256 if window is None else 32)


def test_affine_scales_are_float16_whatever_the_model_dtype():
    for dtype in (mx.float32, mx.bfloat16):
        codec = make_codecs("affine4", layer=0, dtype=dtype)[0]
        x = mx.array(np.random.default_rng(4).standard_normal((1, 2, 3, 64)) * 5).astype(dtype)
        packed, scales, biases = codec.encode(x)
        decoded = codec.decode((packed, scales, biases))
        assert (scales.dtype, biases.dtype, decoded.dtype) == (mx.float16, mx.float16, dtype)
    assert make_codecs("affine8", layer=0, dtype=mx.float32)[0].bits_per_element(64) == 8.5
    assert make_codecs("affine4", layer=0, dtype=mx.float32)[0].bits_per_element(64) == 5.0


def test_raw_layers_store_exact_values_and_others_compress(tiny_llama):
    caches = make_layer_caches(tiny_llama, CacheOptions(scheme="aura4v2", max_context=256, raw_layers=frozenset({1})))
    assert [type(c.key_codec) for c in caches] == [AuraCodec, RawCodec]
    stored = []
    update = caches[1].update_and_fetch
    caches[1].update_and_fetch = lambda k, v: stored.append((k, v)) or update(k, v)
    tiny_llama(mx.array(np.random.default_rng(5).integers(0, 128, (1, 20))), cache=caches)
    keys, values = stored[0]
    np.testing.assert_array_equal(np.array(caches[1].state[0]), np.array(keys))
    np.testing.assert_array_equal(np.array(caches[1].state[1]), np.array(values))
    assert caches[0].nbytes == 20 * N_KV_HEADS * sum(HAND_BYTES["aura4v2"])
    assert caches[1].nbytes == 20 * N_KV_HEADS * sum(HAND_BYTES["raw"])


@pytest.mark.model
def test_inspect_reports_raw_layers_bits_and_ratio_per_layer():
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "inspect", "--kv-cache", "aura4v2", "--kv-raw-layers", "0,29",
         "--layer-trace", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    layers = json.loads(proc.stdout)["layers"]
    assert [row["scheme"] for row in layers] == ["raw"] + ["aura4v2"] * 28 + ["raw"]
    aura = layers[1]
    # Per token per layer: 3 KV heads x ((4*64/8 + 2) + (2*64/8 + 2)) bytes; raw 3 x 2 x 64 x 4.
    assert aura["bytes_per_token"] == 3 * (34 + 18) and aura["bits_per_element"] == 3.25
    assert aura["ratio_to_raw"] == round(3 * 52 / (3 * 2 * 64 * 4), 4)
    assert layers[0]["ratio_to_raw"] == 1.0 and layers[0]["bits_per_element"] == 32.0


@pytest.mark.parametrize("codec", [
    RawCodec(mx.bfloat16), AffineCodec(4, 32, mx.float16), AffineCodec(8, 64, mx.float32, scale_dtype=mx.float32),
    AuraCodec(5, 1234, mx.float32), AuraCodec(2, 7, mx.bfloat16),
])
def test_codec_meta_round_trips(codec):
    rebuilt = codec_from_meta(codec.meta())
    assert type(rebuilt) is type(codec) and rebuilt.meta() == codec.meta()


@pytest.mark.parametrize("meta", [{"codec": "zip", "dtype": "float32"}, {"codec": "aura", "dtype": "float32"},
                                  {"codec": "raw", "dtype": "int7"}])
def test_codec_meta_rejects_unknown_or_incomplete(meta):
    with pytest.raises(ValueError):
        codec_from_meta(meta)


def test_load_rejects_foreign_safetensors(tmp_path):
    path = tmp_path / "other.safetensors"
    mx.save_safetensors(str(path), {"x": mx.zeros(3)}, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="not a buttermilk.kv_caches"):
        load_caches(path)


CONTINUE_IN_SUBPROCESS = """
import sys, numpy as np, mlx.core as mx
from services.engine.cache.persist import load_caches
from tests.conftest import make_tiny_llama
caches, meta = load_caches(sys.argv[1])
model = make_tiny_llama()
tokens = mx.array(meta["next_tokens"])[None]
np.save(sys.argv[2], np.array(mx.concatenate([model(tokens[:, i : i + 1], cache=caches) for i in range(3)], 1)))
"""


def test_aura_cache_continues_identically_in_a_fresh_process(tiny_llama, tmp_path):
    """The rotation seeds travel in the file: another process decodes the same codes the same way."""
    caches = make_layer_caches(tiny_llama, CacheOptions(scheme="aura5v3", max_context=256))
    tiny_llama(mx.array(np.random.default_rng(7).integers(0, 128, (1, 40))), cache=caches)
    next_tokens = [5, 77, 3]
    path = save_caches(tmp_path / "caches", caches, metadata={"next_tokens": next_tokens})
    tokens = mx.array(next_tokens)[None]
    here = np.array(mx.concatenate([tiny_llama(tokens[:, i : i + 1], cache=caches) for i in range(3)], 1))
    proc = subprocess.run([sys.executable, "-c", CONTINUE_IN_SUBPROCESS, str(path), str(tmp_path / "there.npy")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "there.npy"), here)


def test_layer_override_gives_one_layer_another_scheme(tiny_llama):
    caches = make_layer_caches(tiny_llama, CacheOptions(scheme="aura4v2+1=aura8v8", max_context=256))
    tiny_llama(mx.array(np.random.default_rng(8).integers(0, 128, (1, 10))), cache=caches)
    assert [c.nbytes for c in caches] == [10 * N_KV_HEADS * sum(HAND_BYTES[s]) for s in ("aura4v2", "aura8v8")]
    # Layer 1's rotation seeds are its own, as if the whole model ran aura8v8.
    assert caches[1].key_codec.meta() == make_codecs("aura8v8", layer=1, dtype=mx.float32)[0].meta()


@pytest.mark.parametrize("scheme", ["aura4v4+x=raw", "aura4v4+1=", "aura4v4+1=zip", "zip+1=raw", "aura4v4+1=raw+1=raw"])
def test_malformed_layer_overrides_are_rejected(scheme):
    with pytest.raises(ValueError, match="zip|override"):
        make_codecs(scheme, layer=0, dtype=mx.float32)
