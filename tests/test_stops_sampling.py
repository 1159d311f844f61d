"""Stop strings across token boundaries, and per-request sampling."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.sampling import RequestSampler
from shared.protocol import SamplingParams
from shared.text_stream import StopMatcher


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="ab\nX", max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet="ab\nX", min_size=1, max_size=3), max_size=3),
)
def test_stream_equals_cut_at_first_stop(pieces, stops):
    matcher = StopMatcher(tuple(stops))
    out = "".join(matcher.feed(p) for p in pieces) + matcher.flush()
    full = "".join(pieces)
    first = min((i for i in (full.find(s) for s in stops) if i >= 0), default=len(full))
    assert out == full[:first]
    assert matcher.stopped == (first < len(full))


def test_stop_spanning_tokens_is_held_back_then_cut():
    matcher = StopMatcher(("<|end|>",))
    assert matcher.feed("Hello <|") == "Hello "
    assert matcher.feed("en") == ""
    assert matcher.feed("d|> tail") == ""
    assert matcher.stopped


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    logits = mx.array(np.random.default_rng(0).normal(size=64).astype(np.float32))

    def draw(seed):
        sampler = RequestSampler(SamplingParams(temperature=1.0, seed=seed))
        return [int(sampler(logits).item()) for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_k_one_is_greedy():
    logits = mx.array(np.random.default_rng(1).normal(size=64).astype(np.float32))
    sampler = RequestSampler(SamplingParams(temperature=2.0, top_k=1, seed=3))
    assert all(int(sampler(logits).item()) == int(np.argmax(np.array(logits))) for _ in range(10))


def test_sampling_frequencies_follow_softmax():
    logits = mx.array([0.0, 1.0, 2.0], dtype=mx.float32)
    sampler = RequestSampler(SamplingParams(temperature=1.0, seed=11))
    counts = np.bincount([int(sampler(logits).item()) for _ in range(3000)], minlength=3) / 3000
    expected = np.exp([0.0, 1.0, 2.0]) / np.exp([0.0, 1.0, 2.0]).sum()
    np.testing.assert_allclose(counts, expected, atol=0.03)


# ---- issue 11 item 11: every accepted sampling value samples correctly ---------------------


def logit_rows(n: int = 40, vocab: int = 256) -> list[mx.array]:
    rng = np.random.default_rng(5)
    return [mx.array((rng.normal(size=vocab) * 4).astype(np.float32)) for _ in range(n)]


def draws(params: SamplingParams, rows: list[mx.array]) -> list[int]:
    sampler = RequestSampler(params)
    return [int(sampler(row).item()) for row in rows]


def argmaxes(rows: list[mx.array]) -> list[int]:
    return [int(np.argmax(np.array(row))) for row in rows]


def test_tiny_temperatures_are_greedy_where_1_over_t_overflows_float32():
    rows = logit_rows()
    for temperature in (1e-39, 1e-45, 5e-324, 1e-6, 9.99e-6):  # accepted values down to the smallest float
        assert draws(SamplingParams(temperature=temperature, seed=1), rows) == argmaxes(rows), temperature


def test_small_temperatures_sample_near_ties_in_proportion():
    # Two logits 1e-5 apart at T = 1e-5: exp(-1) odds, computed from the shifted log-probs.
    logits = mx.array([0.0, -1e-5, -50.0], dtype=mx.float32)
    counts = np.bincount(draws(SamplingParams(temperature=1e-5, seed=2), [logits] * 2000), minlength=3) / 2000
    gap = float(np.float32(0.0) - np.float32(-1e-5))  # the gap float32 actually holds
    expected = np.array([1.0, np.exp(-gap / 1e-5), 0.0]) / (1.0 + np.exp(-gap / 1e-5))
    np.testing.assert_allclose(counts, expected, atol=0.04)


def test_the_largest_temperature_is_nearly_uniform_and_finite():
    logits = mx.array([0.0, 1.0, 2.0], dtype=mx.float32)
    counts = np.bincount(draws(SamplingParams(temperature=100.0, seed=4), [logits] * 3000), minlength=3) / 3000
    expected = np.exp(np.array([0.0, 1.0, 2.0]) / 100.0)
    np.testing.assert_allclose(counts, expected / expected.sum(), atol=0.03)


def test_tiny_top_p_keeps_only_the_top_token_and_large_top_k_keeps_all():
    rows = logit_rows()
    for top_p in (1e-300, 5e-324, 1e-12):
        assert draws(SamplingParams(temperature=1.0, top_p=top_p, seed=3), rows) == argmaxes(rows), top_p
    every = draws(SamplingParams(temperature=1.0, top_k=10**9, seed=6), rows)
    assert every == draws(SamplingParams(temperature=1.0, seed=6), rows)  # top_k >= vocab: disabled


def test_the_largest_seed_is_usable_and_reproducible():
    rows = logit_rows(10)
    top = 2**63 - 1
    assert draws(SamplingParams(temperature=1.0, seed=top), rows) == draws(SamplingParams(temperature=1.0, seed=top), rows)
