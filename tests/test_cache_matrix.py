"""Every scheme x {full attention, window} x {default model, tiny random llama, tiny hybrid}.

For each combination: generation runs (chunked prefill that wraps the window, then greedy
decode), the state saved to disk and loaded continues with identical logits, and `nbytes`
equals the byte count derived by hand from CACHES.md "Bytes per token" (the hybrid's
recurrent state: from its config). The hybrid (falcon_h1: Mamba2 and attention in every
layer, one `CacheGroup` per layer) also runs in the engine, whose tokens equal the
single-sequence caches' under every scheme and window. On the default model
each scheme also holds a quality floor against the raw cache on real text (teacher-forced;
the raw log-probabilities are computed once for the module).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

from services.engine.cache import CacheOptions, KVCache, Window, make_layer_caches
from services.engine.cache.persist import load_caches, save_caches
from services.engine.cache.recurrent import leaf_caches
from services.engine.cache.report import bits_per_element
from services.engine.cache.schemes import SCHEMES
from services.engine.request import Request
from shared.protocol import SamplingParams
from services.eval.corpus import corpus_token_ids
from services.eval.kv_eval import score_chunks
from services.eval.metrics import logprob_chunks
from tests.hybrid_models import CONFIGS, loaded_hybrid, make_hybrid, uncompiled

MATRIX_SCHEMES = (*SCHEMES, "aura5v3")
WINDOWS = {"full": None, "window64": Window(64, 4)}
PROMPT_TOKENS, PREFILL_CHUNK, DECODE_STEPS = 100, 48, 3
NEXT_TOKENS = [11, 42, 7]  # fed after the round trip to original and loaded caches alike


def hand_token_bytes(scheme: str, head_dim: int, raw_bytes: int) -> tuple[int, int]:
    """(key, value) bytes per token and KV head, from CACHES.md, with fp16 scales and biases."""
    if scheme == "raw":
        return head_dim * raw_bytes, head_dim * raw_bytes
    if scheme.startswith("affine"):
        bits = int(scheme.removeprefix("affine"))
        group = {8: 64, 6: 64, 4: 32}[bits]  # README: affine8 g64, affine6 g64, affine4 g32
        per_vector = head_dim * bits // 8 + 2 * 2 * head_dim // group
        return per_vector, per_vector
    key_bits, value_bits = map(int, re.fullmatch(r"aura(\d)v(\d)", scheme).groups())
    return head_dim * key_bits // 8 + 2, head_dim * value_bits // 8 + 2


@dataclass
class Run:
    model: object
    caches: list
    generated: list[int]
    last_logits: mx.array
    head_dim: int
    n_kv_heads: int
    vocab: int
    scheme: str
    window: Window | None


def prompt_for(name: str, model_fixture) -> list[int]:
    if name == "default":
        return corpus_token_ids(model_fixture.tokenizer, PROMPT_TOKENS)
    return np.random.default_rng(0).integers(0, 128, PROMPT_TOKENS).tolist()


PARAMS = [
    pytest.param((model, scheme, window), id=f"{model}-{scheme}-{window}",
                 marks=[pytest.mark.model] if model == "default" else [])
    for model in ("tiny", "hybrid", "default") for scheme in MATRIX_SCHEMES for window in WINDOWS
]
HYBRID = "falcon_h1"
HYBRID_HEAD_DIM = 64  # every scheme stores it (affine groups of 64, AURA's power-of-two rotation)


@pytest.fixture(scope="module")
def tiny_hybrid():
    return make_hybrid(HYBRID, head_dim=HYBRID_HEAD_DIM, amplify=True)


@pytest.fixture(scope="module", params=PARAMS)
def run(request) -> Run:
    """Prefill 100 tokens in chunks of 48 (a window of 64 wraps), then 3 greedy decode steps."""
    name, scheme, window_name = request.param
    loaded = request.getfixturevalue("default_model") if name == "default" else None
    model = loaded.model if loaded else request.getfixturevalue("tiny_hybrid" if name == "hybrid" else "tiny_llama")
    window = WINDOWS[window_name]
    caches = make_layer_caches(model, CacheOptions(scheme=scheme, max_context=512, window=window))
    tokens = mx.array(prompt_for(name, loaded))[None]
    with uncompiled():
        for start in range(0, PROMPT_TOKENS, PREFILL_CHUNK):
            logits = model(tokens[:, start : start + PREFILL_CHUNK], cache=caches)
        generated = []
        for _ in range(DECODE_STEPS):
            generated.append(int(mx.argmax(logits[0, -1]).item()))
            logits = model(mx.array([generated[-1:]]), cache=caches)
    if name == "hybrid":
        head_dim, n_kv_heads = HYBRID_HEAD_DIM, CONFIGS[HYBRID]["num_key_value_heads"]
    else:
        attn = model.layers[0].self_attn
        head_dim, n_kv_heads = attn.k_proj.weight.shape[0] // attn.n_kv_heads, attn.n_kv_heads
    return Run(model, caches, generated, logits, head_dim, n_kv_heads, logits.shape[-1], scheme, window)


def kv_caches(run: Run) -> list[KVCache]:
    return [c for c in leaf_caches(run.caches) if isinstance(c, KVCache)]


def hand_state_bytes() -> int:
    """One falcon_h1 layer's Mamba2 state (float32): conv window (d_conv - 1) x conv channels,
    SSM state heads x d_head x d_state."""
    c = CONFIGS[HYBRID]
    conv = (c["mamba_d_conv"] - 1) * (c["mamba_d_ssm"] + 2 * c["mamba_n_groups"] * c["mamba_d_state"])
    return 4 * (conv + c["mamba_n_heads"] * c["mamba_d_head"] * c["mamba_d_state"])


def test_generation_runs(run):
    total = PROMPT_TOKENS + DECODE_STEPS
    live = total if run.window is None else run.window.max_size
    assert all(0 <= t < run.vocab for t in run.generated)
    assert np.isfinite(np.array(run.last_logits)).all()
    assert [(c.offset, c.num_live) for c in kv_caches(run)] == [(total, live)] * len(kv_caches(run))


def test_nbytes_equals_hand_formula(run):
    key_bytes, value_bytes = hand_token_bytes(run.scheme, run.head_dim, 4)  # every model runs float32 here
    for cache in kv_caches(run):
        assert cache.nbytes == cache.num_live * run.n_kv_heads * (key_bytes + value_bytes)
        assert cache.capacity_nbytes == cache.capacity * run.n_kv_heads * (key_bytes + value_bytes)
    for cache in (c for c in leaf_caches(run.caches) if not isinstance(c, KVCache)):
        assert cache.nbytes == hand_state_bytes()  # recurrent state: fixed, never quantized
    assert bits_per_element(run.caches) == 8 * (key_bytes + value_bytes) / (2 * run.head_dim)


def test_save_load_continues_with_identical_logits(run, tmp_path):
    path = save_caches(tmp_path / "state", run.caches, metadata={"scheme": run.scheme})
    loaded, metadata = load_caches(path)
    assert metadata == {"scheme": run.scheme}
    assert [c.meta_state for c in leaf_caches(loaded)] == [c.meta_state for c in leaf_caches(run.caches)]
    assert [c.nbytes for c in loaded] == [c.nbytes for c in run.caches]
    with uncompiled():
        for token in NEXT_TOKENS:
            want = run.model(mx.array([[token]]), cache=run.caches)
            got = run.model(mx.array([[token]]), cache=loaded)
            np.testing.assert_array_equal(np.array(got), np.array(want))


@pytest.mark.parametrize("window_name", WINDOWS)
@pytest.mark.parametrize("scheme", MATRIX_SCHEMES)
def test_hybrid_engine_equals_single_sequence(tiny_hybrid, scheme, window_name):
    """The engine (paged K/V in the scheme, per-slot recurrent state) gives each of three
    concurrent requests the tokens the single-sequence caches give it alone."""
    from tests.test_engine_core import drive, greedy, make_core, random_prompts

    window = WINDOWS[window_name]
    options = CacheOptions(scheme=scheme, max_context=512, window=window)
    prompts, max_tokens = random_prompts([70, 5, 23], seed=13), [12, 9, 14]
    with uncompiled():
        core = make_core(loaded_hybrid(tiny_hybrid), scheme=scheme, window=window, max_context=512)
        arrivals = {2 * i: [Request(f"r{i}", p, SamplingParams(max_tokens=n))]
                    for i, (p, n) in enumerate(zip(prompts, max_tokens))}
        results = drive(core, arrivals)
        for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
            assert results[f"r{i}"]["tokens"] == greedy(tiny_hybrid, options, prompt, n), f"r{i}"


# Floors on the default model, 512 Lee-corpus tokens in chunks of 128 (a shorter run than the
# acceptance eval's 2048 in 256s): (max mean KL, min top-1), about 1.3x the measured KL and 2-3
# points under the measured top-1 (measured, mlx 0.32.4 CPU: affine8 0.00055 / 99.4%, affine4
# 0.0757 / 87.9%, aura8v8 0.00019 / 99.4%, aura8v4 0.0084 / 96.3%, aura4v4 0.0547 / 89.8%,
# aura4v2 0.178 / 78.5%, aura5v3 0.0425 / 90.6%).
QUALITY_FLOORS = {
    "affine8": (0.0008, 0.97),
    "affine4": (0.095, 0.85),
    "aura8v8": (0.0004, 0.97),
    "aura8v4": (0.011, 0.94),
    "aura4v4": (0.07, 0.87),
    "aura4v2": (0.22, 0.76),
    "aura5v3": (0.055, 0.88),
}
QUALITY_TOKENS, QUALITY_CHUNK = 512, 128


@pytest.fixture(scope="module")
def quality(default_model):
    """Teacher-forced quality per scheme against raw logits computed once (memoised)."""
    model = default_model.model
    ids = corpus_token_ids(default_model.tokenizer, QUALITY_TOKENS + 1)
    targets = np.array(ids[1:])
    raw = make_layer_caches(model, CacheOptions(max_context=QUALITY_TOKENS))
    reference = list(logprob_chunks(model, raw, ids[:-1], chunk=QUALITY_CHUNK))
    memo = {}

    def measure(scheme: str):
        if scheme not in memo:
            caches = make_layer_caches(model, CacheOptions(scheme=scheme, max_context=QUALITY_TOKENS))
            chunks = logprob_chunks(model, caches, ids[:-1], chunk=QUALITY_CHUNK)
            memo[scheme] = score_chunks(chunks, reference, targets)
        return memo[scheme]

    return measure


@pytest.mark.model
@pytest.mark.parametrize("scheme", list(QUALITY_FLOORS))
def test_quality_floor_on_default_model(quality, scheme):
    max_kl, min_top1 = QUALITY_FLOORS[scheme]
    result = quality(scheme)
    assert result.mean_kl <= max_kl and result.top1_agreement >= min_top1, result


@pytest.mark.model
def test_aura5v3_beats_aura4v4(quality):
    """One bit moved from values to keys helps: keys are the more sensitive half (CACHES.md)."""
    assert quality("aura5v3").mean_kl < quality("aura4v4").mean_kl
