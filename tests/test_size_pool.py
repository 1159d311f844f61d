"""Pool sizing against hand-derived figures (CACHES.md), the engine's own cache, and measured nbytes."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import pytest

from services.commands.engine import pool_capacity
from shared.settings import EngineSettings
from services.commands.pool_size import TokenCounts
from services.engine import sizing
from services.engine.cache import CacheOptions, make_layer_caches, schemes
from services.engine.cache.schemes import SCHEMES
from services.engine.runtime import cache_options
from shared.errors import BadRequest

from .pipeline_helpers import cli

SMOLLM = sizing.KVGeometry(n_layers=30, n_kv_heads=3, head_dim=64, dtype=mx.float16)
# CACHES.md "Bytes per token": stored bits per K or V element at head_dim 64, fp16 model.
BITS = {"raw": 16, "affine8": 8 + 2 * 16 / 64, "affine6": 6 + 2 * 16 / 64, "affine4": 4 + 2 * 16 / 32, "aura4v4": (4.25, 4.25),
        "aura4v2": (4.25, 2.25), "aura8v4": (8.25, 4.25), "aura8v8": (8.25, 8.25)}  # fmt: skip


def hand_bytes_per_token(scheme: str, g: sizing.KVGeometry) -> float:
    """`n_layers x n_kv_heads x head_dim x (bits_K + bits_V) / 8` in float64."""
    bits = BITS[scheme]
    key_bits, value_bits = bits if isinstance(bits, tuple) else (bits, bits)
    return g.n_layers * g.n_kv_heads * g.head_dim * (key_bits + value_bits) / 8


@pytest.mark.parametrize("scheme", SCHEMES)
def test_bytes_per_token_match_the_caches_md_table(scheme):
    assert sizing.bytes_per_token(scheme, SMOLLM) == hand_bytes_per_token(scheme, SMOLLM)


def test_overrides_raw_layers_and_fp32():
    aura4v4 = hand_bytes_per_token("aura4v4", SMOLLM) / 30
    aura8v8 = hand_bytes_per_token("aura8v8", SMOLLM) / 30
    assert sizing.bytes_per_token("aura4v4+1=aura8v8", SMOLLM) == 29 * aura4v4 + aura8v8
    raw_layer = hand_bytes_per_token("raw", SMOLLM) / 30
    assert sizing.bytes_per_token("aura4v4", SMOLLM, raw_layers=frozenset({0, 29})) == 28 * aura4v4 + 2 * raw_layer
    fp32 = sizing.KVGeometry(30, 3, 64, mx.float32)
    assert sizing.bytes_per_token("raw", fp32) == 2 * 23040  # 30 x 2 x 3 x 64 x 4 bytes


def test_capacity_concurrency_and_budget():
    # 1 GiB of raw fp16 SmolLM2 KV: 2**30 // 23040 = 46603 tokens, 2912 whole pages of 16.
    assert sizing.capacity_tokens(2**30, 23040, page_size=16) == 2912 * 16
    with pytest.raises(ValueError):
        sizing.capacity_tokens(23040 * 15, 23040, page_size=16)
    # A 1000-token request holds 63 pages (1008 slots); a window of 256 caps it at 16 pages.
    assert sizing.max_concurrency(46592, 1000, page_size=16) == 46592 / 1008
    assert sizing.max_concurrency(46592, 1000, page_size=16, window=256) == 46592 / 256
    assert sizing.concurrency_line(4096, 11.375) == "Maximum concurrency for 4,096 tokens per request: 11.38x"
    assert sizing.budget_bytes(memory_fraction=0.25, device_memory=8 * 2**30) == 2 * 2**30
    assert sizing.budget_bytes(memory_gib=1.5) == 3 * 2**29
    for bad in ({}, {"memory_gib": 1, "memory_fraction": 0.5}, {"memory_fraction": 1.5}, {"memory_gib": -1}):
        with pytest.raises(ValueError):
            sizing.budget_bytes(**bad, device_memory=2**30)


def test_recurrent_state_comes_off_the_budget_first():
    # 16 slots x 1 MiB of state leave 1 GiB - 16 MiB: 45875 tokens of 23,040 bytes, 2867 whole pages of 16.
    assert sizing.capacity_tokens(2**30, 23040, page_size=16, state_bytes=16 * 2**20) == 2867 * 16
    with pytest.raises(ValueError, match="recurrent state"):
        sizing.capacity_tokens(2**20, 23040, page_size=16, state_bytes=2**20)


def test_token_count_specs():
    assert TokenCounts.parse("512") == TokenCounts(512, 512)
    assert TokenCounts.parse("128-2048") == TokenCounts(1088, 2048)
    assert TokenCounts.parse("100,200,600") == TokenCounts(300, 600)
    for bad in ("x", "5-2", "-3", ""):
        with pytest.raises(ValueError):
            TokenCounts.parse(bad)


def test_pool_size_command_prints_figures_for_the_workload():
    proc = cli("pool-size", "--memory-gib", "1", "--n-layers", "30", "--n-kv-heads", "3", "--head-dim", "64",
               "--dtype", "float16", "--schemes", "raw,aura4v2", "--prompt-tokens", "100-900", "--output-tokens",
               "100", "--concurrency", "46", "--context", "4096", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    raw, aura = report["rows"]
    assert raw["bytes_per_token"] == 23040 and raw["capacity_tokens"] == 2912 * 16
    # Mean request 500 + 100 = 600 tokens (38 pages), worst 1000 (63 pages).
    assert raw["max_concurrency"] == {"context": round(46592 / 4096, 2), "mean": round(46592 / 608, 2),
                                      "worst": round(46592 / 1008, 2)}  # fmt: skip
    assert raw["bytes_for_concurrency"] == 46 * 1008 * 23040 and raw["fits_concurrency"]  # 46368 <= 46592 slots
    assert aura["bytes_per_token"] == hand_bytes_per_token("aura4v2", SMOLLM)
    table = cli("pool-size", "--memory-gib", "1", "--schemes", "raw")
    assert table.returncode == 0 and "Maximum concurrency for 8,192 tokens per request" in table.stdout
    with pytest.raises(ValueError, match="unknown KV cache scheme 'raw8'"):
        sizing.bytes_per_token("raw8", SMOLLM)
    past = cli("pool-size", "--memory-gib", "1", "--n-layers", "30", "--n-kv-heads", "3", "--head-dim", "64",
               "--schemes", "aura4v4+30=aura8v8")
    assert past.returncode == 2 and "--schemes: layer 30 is not a layer of this model, which has 30" in past.stderr
    bad = cli("pool-size", "--memory-gib", "1", "--kv-raw-layers", "x")
    assert bad.returncode == 2 and "argument --kv-raw-layers: expected comma-separated layer numbers" in bad.stderr
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_pool_size_workload_past_the_context():
    geometry = ["--memory-gib", "1", "--n-layers", "30", "--n-kv-heads", "3", "--head-dim", "64", "--schemes", "raw",
                "--context", "4096"]  # fmt: skip
    capped = cli("pool-size", *geometry, "--prompt-tokens", "1000", "--output-tokens", "5000", "--json")
    assert capped.returncode == 0, capped.stderr  # the server stops every request at the context: 4,096 tokens
    assert json.loads(capped.stdout)["workload"]["tokens_per_request"] == {"context": 4096, "mean": 4096, "worst": 4096}
    for flags, message in ((["--prompt-tokens", "4096"], "a prompt of 4096 tokens leaves no room to generate"),
                           (["--concurrency", "-1"], "--concurrency -1: expected requests >= 0")):
        proc = cli("pool-size", *geometry, *flags)
        assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


@pytest.fixture(scope="module")
def predictions() -> dict[str, dict]:
    """`buttermilk pool-size` for 0.05 GiB and the default model, every named scheme, by scheme."""
    proc = cli("pool-size", "--memory-gib", "0.05", "--json")
    assert proc.returncode == 0, proc.stderr
    return {row["scheme"]: row for row in json.loads(proc.stdout)["rows"]}


@pytest.mark.model
@pytest.mark.parametrize("scheme", SCHEMES)
def test_engine_allocates_the_predicted_capacity(default_model, predictions, scheme):
    """The engine's budget path (`pool_capacity`) and its real cache agree with `pool-size`."""
    from services.engine.core import EngineCore

    settings = EngineSettings(kv_cache=scheme, kv_memory_gib=0.05, max_context=256, max_slots=4)
    options = cache_options(settings, default_model)
    predicted = predictions[scheme]
    core = EngineCore(default_model, options, capacity_tokens=pool_capacity(settings, default_model, options),
                      max_slots=4, step_token_budget=64)  # fmt: skip
    assert core.geometry["capacity_tokens"] == predicted["capacity_tokens"]
    assert core.cache.bytes_per_token == predicted["bytes_per_token"]
    assert schemes.bytes_per_token(scheme, model=default_model.model) == predicted["bytes_per_token"]
    allocated = sum(a.nbytes for a in core.cache.arrays)  # the page pools' arrays, measured
    assert allocated == predicted["capacity_tokens"] * predicted["bytes_per_token"]
    assert predicted["capacity_tokens"] * predicted["bytes_per_token"] <= 0.05 * 2**30


@pytest.mark.model
@pytest.mark.parametrize("scheme", SCHEMES)
def test_predicted_bytes_match_measured_nbytes(default_model, scheme):
    num_tokens = 100
    caches = make_layer_caches(default_model.model, CacheOptions(scheme=scheme, max_context=256))
    tokens = mx.array([list(range(1000, 1000 + num_tokens))], dtype=mx.int32)
    mx.eval(default_model.model(tokens, cache=caches))
    geometry = sizing.KVGeometry.from_config(default_model.config, default_model.dtype)
    predicted = num_tokens * sizing.bytes_per_token(scheme, geometry)
    reported = sum(c.nbytes for c in caches)
    # The arrays allocated (whole pages per sequence), scaled to the tokens held.
    measured = sum(c.capacity_nbytes * c.num_live / c.capacity for c in caches)
    assert math.isclose(measured, predicted, rel_tol=0.01), (measured, predicted)
    assert math.isclose(reported, predicted, rel_tol=0.01), (reported, predicted)


@pytest.mark.model
def test_budget_and_capacity_tokens_are_exclusive(default_model):
    settings = EngineSettings(kv_memory_gib=0.05, capacity_tokens=4096)
    with pytest.raises(BadRequest, match="not both"):
        pool_capacity(settings, default_model, cache_options(settings, default_model))
