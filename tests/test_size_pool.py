"""Pool sizing arithmetic against hand-derived figures (CACHES.md) and the caches' real bytes."""

from __future__ import annotations

import mlx.core as mx
import pytest

from ops.size_pool import bits_per_element, bytes_per_token, size
from services.engine.cache import CacheOptions, make_layer_caches

SMOLLM = {"n_layers": 30, "n_kv_heads": 3, "head_dim": 64, "dtype_bytes": 2}


@pytest.mark.parametrize(("scheme", "bits"), [
    ("raw", 16), ("affine8", 8.5), ("affine4", 5.0), ("aura4v4", 4.25), ("aura4v2", 3.25), ("aura8v8", 8.25),
])
def test_bits_per_element_table(scheme, bits):
    assert bits_per_element(scheme, head_dim=64, dtype_bytes=2) == bits


def test_smollm_raw_fp16_bytes_per_token_and_capacity():
    # 30 layers x (K, V) x 3 heads x 64 dims x 2 bytes = 23,040 bytes per token.
    assert bytes_per_token("raw", **SMOLLM) == 23040
    row = size("raw", memory_bytes=2**30, context=4096, window=0, **SMOLLM)
    assert row["capacity_tokens"] == 2**30 // 23040 and row["sessions_at_context"] == (2**30 // 23040) // 4096
    assert size("raw", memory_bytes=2**30, context=4096, window=256, **SMOLLM)["tokens_per_session"] == 256


@pytest.mark.parametrize("scheme", ["raw", "aura4v4", "aura4v2"])
def test_formula_matches_the_cache_bytes(tiny_llama, scheme):
    caches = make_layer_caches(tiny_llama, CacheOptions(scheme=scheme, max_context=4096))
    tiny_llama(mx.zeros((1, 10), dtype=mx.int32), cache=caches)
    geometry = {"n_layers": 2, "n_kv_heads": 2, "head_dim": 64, "dtype_bytes": 4}  # the tiny llama, float32
    assert sum(c.nbytes for c in caches) == 10 * bytes_per_token(scheme, **geometry)
