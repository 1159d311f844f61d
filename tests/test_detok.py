"""Streaming detokenization: deltas concatenate to the full decode, leading spaces kept."""

from __future__ import annotations

import pytest

from shared.detok import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return default_model.tokenizer


@pytest.mark.model
@pytest.mark.parametrize("text", [
    " Paris is the capital of France.",
    "naïve café — 東京 🍓🥛 emoji split across byte tokens",
    "line one\n\n  indented 12345",
])
def test_deltas_concatenate_to_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Answer:")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.model
def test_incomplete_character_is_held_back(tokenizer):
    ids = tokenizer.encode("🥛")
    assert len(ids) > 1  # a byte-level split: the point of this test
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1]) == "🥛"
