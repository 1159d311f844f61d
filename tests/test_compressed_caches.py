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

from kernels.kv_format import AFFINE, AURA, RAW, LayerFormat, PartFormat
from kernels.paged_attention import uses_cuda
from services.engine.cache import CacheOptions, KVCache, make_layer_caches
from services.engine.cache.persist import load_caches, save_caches
from services.engine.cache.schemes import layer_parts, part_from_meta
from tests.conftest import make_tiny_llama

B, N_HEADS, N_KV_HEADS, D = 1, 4, 2, 64

# Bytes per token, per layer and KV head, for K then V, at head_dim 64 (CACHES.md "Bytes per
# token"): codes d*bits/8; affine adds an fp16 scale and bias per group; AURA one fp16 scale.
HAND_BYTES = {
    "raw": (64 * 4, 64 * 4),  # float32 on CPU
    "affine8": (64 + 2 * 2 * 1, 64 + 2 * 2 * 1),  # one group of 64
    "affine6": (48 + 2 * 2 * 1, 48 + 2 * 2 * 1),  # one group of 64
    "affine4": (32 + 2 * 2 * 2, 32 + 2 * 2 * 2),  # two groups of 32
    "aura4v4": (4 * 64 // 8 + 2, 4 * 64 // 8 + 2),
    "aura4v2": (4 * 64 // 8 + 2, 2 * 64 // 8 + 2),
    "aura8v4": (8 * 64 // 8 + 2, 4 * 64 // 8 + 2),
    "aura8v8": (8 * 64 // 8 + 2, 8 * 64 // 8 + 2),
    "aura5v3": (5 * 64 // 8 + 2, 3 * 64 // 8 + 2),
    "aura9v10": (9 * 64 // 8 + 2, 10 * 64 // 8 + 2),
}


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

    cache = KVCache(*layer_parts(scheme, layer=3, dtype=mx.float32), max_tokens=4096,
                    window=None if window is None else Window(*window))
    x = mx.array(np.random.default_rng(3).standard_normal((B, N_KV_HEADS, 70, D)).astype(np.float32))
    cache.update_and_fetch(x, x)
    key_bytes, value_bytes = HAND_BYTES[scheme]
    live = 70 if window is None else 32
    assert cache.nbytes == live * N_KV_HEADS * (key_bytes + value_bytes)
    assert cache.capacity_nbytes == cache.capacity * N_KV_HEADS * (key_bytes + value_bytes)
    assert cache.capacity == (256 if window is None else 32)


def test_affine_scales_are_float16_whatever_the_model_dtype():
    """Row meta holds float16 scale and bias per group: [K scales, K biases, V scales, V biases]."""
    for dtype in (mx.float32, mx.bfloat16):
        fmt = LayerFormat(*layer_parts("affine4", layer=0, dtype=dtype), 64)
        x = (mx.array(np.random.default_rng(4).standard_normal((1, 2, 3, 64)) * 5)).astype(dtype)
        (rows,) = fmt.encode(x, x)
        meta = np.array(mx.view(mx.contiguous(rows[..., fmt.meta_offset :]), mx.float16))
        groups = np.array(x.astype(mx.float32)).reshape(1, 2, 3, 2, 32)
        span = (groups.max(-1) - groups.min(-1)) / 15  # |scale| before the edge snaps to the grid
        np.testing.assert_allclose(np.abs(meta[..., :2]), span, rtol=0.1)
        assert rows.dtype == mx.uint32 and rows.shape[-1] == 8 + 8 + 4  # K codes, V codes, 8 float16 meta
    assert LayerFormat(*layer_parts("affine8", layer=0, dtype=mx.float32), 64).bits_per_element() == 8.5
    assert LayerFormat(*layer_parts("affine6", layer=0, dtype=mx.float32), 64).bits_per_element() == 6.5
    assert LayerFormat(*layer_parts("affine4", layer=0, dtype=mx.float32), 64).bits_per_element() == 5.0


def test_raw_layers_store_exact_values_and_others_compress(tiny_llama):
    caches = make_layer_caches(tiny_llama, CacheOptions(scheme="aura4v2", max_context=256, raw_layers=frozenset({1})))
    assert [(c.key.kind, c.value.kind) for c in caches] == [(AURA, AURA), (RAW, RAW)]
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


@pytest.mark.parametrize("part", [
    PartFormat(RAW, 16, dtype=mx.bfloat16), PartFormat(AFFINE, 4, 32, dtype=mx.float16),
    PartFormat(AFFINE, 8, 64, dtype=mx.float32), PartFormat(AURA, 5, seed=1234), PartFormat(AURA, 2, seed=7, dtype=mx.bfloat16),
])
def test_part_meta_round_trips(part):
    assert part_from_meta(part.meta()) == part


@pytest.mark.parametrize("meta", [
    {"kind": "zip", "bits": "4", "group_size": "0", "seed": "0", "dtype": "float32"},
    {"kind": "aura", "dtype": "float32"},
    {"kind": "raw", "bits": "16", "group_size": "0", "seed": "0", "dtype": "int7"},
])
def test_part_meta_rejects_unknown_or_incomplete(meta):
    with pytest.raises(ValueError):
        part_from_meta(meta)


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
    assert caches[1].key == layer_parts("aura8v8", layer=1, dtype=mx.float32)[0]


@pytest.mark.parametrize("scheme, message", [("aura4v4+x=raw", "override"), ("aura4v4+1=", "override"),
                                             ("aura4v4+1=zip", "zip"), ("zip+1=raw", "zip"),
                                             ("aura4v4+1=raw+1=raw", "layer 1 is overridden twice")])
def test_malformed_layer_overrides_are_rejected(scheme, message):
    with pytest.raises(ValueError, match=message):
        layer_parts(scheme, layer=0, dtype=mx.float32)


def _settings(scheme: str, **kwargs):
    from shared.settings import ModelSettings

    return ModelSettings(kv_cache=scheme, **kwargs)


def _loaded(model):
    from pathlib import Path

    from services.engine.model.loader import LoadedModel

    return LoadedModel(model=model, tokenizer=None, path=Path("x"), config={"max_position_embeddings": 4096})


@pytest.mark.parametrize("scheme", ["affine8", "affine4", "aura4v4", "aura5v3", "aura4v4+1=affine6"])
@pytest.mark.parametrize("head_dim", [80, 96])
def test_geometries_beyond_powers_of_two_are_served(scheme, head_dim):
    """Issue 13.5: head_dim 80 and 96 under AURA (Hadamard orders 20 * 4, 12 * 8) and affine (tail groups)."""
    from services.engine.runtime import cache_options

    model = make_tiny_llama(head_dim=head_dim)
    assert cache_options(_settings(scheme), _loaded(model)).scheme == scheme


@pytest.mark.parametrize("scheme, raw_layers, refused", [
    ("aura4v4", [], "layer 0 \\(aura4v4\\): AURA needs a Hadamard rotation of head_dim 72"),
    ("aura4v4+0=raw", [], "layer 1 \\(aura4v4\\)"),
    ("affine4+1=aura8v8", [], "layer 1 \\(aura8v8\\): AURA"),
    ("aura4v4", [0, 1], None),  # every layer raw
    ("affine8", [], None),  # affine stores any width (a tail group of 8)
])
def test_a_scheme_that_cannot_store_a_geometry_is_refused_at_configuration(scheme, raw_layers, refused):
    """Issue 11.15: caught when the engine or generate is configured, not at the first prefill.
    head_dim 72 = 9 * 8 has no Hadamard matrix: AURA is refused there, layer by layer."""
    from services.engine.runtime import cache_options
    from shared.errors import BadRequest

    loaded = _loaded(make_tiny_llama(head_dim=72))
    if refused is None:
        cache_options(_settings(scheme, kv_raw_layers=raw_layers), loaded)
        return
    with pytest.raises(BadRequest, match=refused):
        cache_options(_settings(scheme, kv_raw_layers=raw_layers), loaded)


@pytest.mark.parametrize("scheme, raw_layers, refused", [
    ("aura4v4+2=aura8v8", [], "--kv-cache: layer 2 is not a layer of this model, which has 2 \\(0-1\\)"),
    ("aura4v4", [0, 5], "--kv-raw-layers: layer 5 is not a layer of this model, which has 2 \\(0-1\\)"),
    ("aura4v4+1=aura8v8", [1], None),  # both name the tiny model's last layer
])
def test_layer_numbers_past_the_model_are_refused_not_ignored(scheme, raw_layers, refused):
    """An override or raw layer that names no layer would leave the user's request silently unapplied."""
    from services.engine.runtime import cache_options
    from shared.errors import BadRequest

    loaded = _loaded(make_tiny_llama())
    assert len(loaded.model.layers) == 2
    if refused is None:
        cache_options(_settings(scheme, kv_raw_layers=raw_layers), loaded)
        return
    with pytest.raises(BadRequest, match=refused):
        cache_options(_settings(scheme, kv_raw_layers=raw_layers), loaded)


def test_the_gateway_checks_scheme_names_without_weights():
    from services.engine.runtime import cache_options
    from shared.errors import BadRequest

    loaded = _loaded(None)
    assert cache_options(_settings("aura4v4"), loaded).scheme == "aura4v4"
    with pytest.raises(BadRequest, match="unknown KV cache scheme"):
        cache_options(_settings("aura11v9"), loaded)


def test_aura_widths_above_8_bits_take_the_mlx_ops_path():
    fmt = LayerFormat(*layer_parts("aura9v10", layer=0, dtype=mx.float32), 64)
    assert fmt.name == "aura9v10" and not fmt.is_regular  # the CUDA kernels' codebooks hold 256 centroids
    assert not uses_cuda(fmt)
    for bad in ("aura11v8", "aura8v1", "aura1v1"):
        with pytest.raises(ValueError, match="2..10"):
            layer_parts(bad, layer=0, dtype=mx.float32)
