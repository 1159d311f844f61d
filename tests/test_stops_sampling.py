"""Stop strings across token boundaries, and per-request sampling."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.sampling import RequestSampler, SamplingParams
from services.engine.stops import StopMatcher


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
