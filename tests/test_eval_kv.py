"""`eval-kv`: the shipped corpus, the metrics against hand values, and the command end to end."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from services.engine.cache import CacheOptions, make_layer_caches
from services.eval.corpus import (LEE_CORPUS, LEE_SHA256, corpus_token_ids, lee_documents, prompt_token_ids,
                                  split_halves, text_token_ids)
from services.eval.kv_eval import EvalConfig, evaluate
from services.eval.metrics import QualityAccumulator, greedy_tokens, kl_divergence, matching_prefix
from services.eval.recall import INSTRUCTION, PASS_KEYS, answer_value, recall, recall_prompts


def test_corpus_is_the_documented_file():
    assert hashlib.sha256(LEE_CORPUS.read_bytes()).hexdigest() == LEE_SHA256
    readme = (LEE_CORPUS.parent / "README.md").read_text()
    assert LEE_SHA256 in readme and "LGPL-2.1" in readme and "Pincombe" in readme
    assert "GNU LESSER GENERAL PUBLIC LICENSE" in (LEE_CORPUS.parent / "LICENSE.gensim-LGPL-2.1").read_text()
    assert len(lee_documents()) == 300


def test_kl_divergence_matches_hand_value():
    p = np.log(np.array([[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]], dtype=np.float32))
    q = np.log(np.array([[0.25, 0.5, 0.25], [0.2, 0.3, 0.5]], dtype=np.float32))
    # 0.5 ln(0.5/0.25) + 0.25 ln(0.25/0.5) = 0.25 ln 2; identical rows give 0.
    np.testing.assert_allclose(kl_divergence(p, q), [0.25 * math.log(2), 0.0], atol=1e-7)
    assert kl_divergence(p, q).dtype == np.float64


def test_accumulator_over_chunks_equals_hand_computation():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 10, 6))
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    scheme, raw = logprobs[0].astype(np.float32), logprobs[1].astype(np.float32)
    targets = rng.integers(0, 6, 10)
    acc = QualityAccumulator()
    for start in (0, 4):
        stop = 4 if start == 0 else 10
        acc.add(scheme[start:stop], raw[start:stop], targets[start:stop])
    result = acc.result()
    p, q = np.exp(logprobs[1]), np.exp(logprobs[0])
    assert result.num_positions == 10
    assert result.perplexity == pytest.approx(math.exp(-np.mean(np.log(q[np.arange(10), targets]))), rel=1e-6)
    assert result.mean_kl == pytest.approx(np.mean(np.sum(p * np.log(p / q), -1)), rel=1e-5)
    assert result.top1_agreement == np.mean(q.argmax(-1) == p.argmax(-1))


@pytest.mark.parametrize("reference, tokens, expected", [
    ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 5], 1), ([1, 2, 3], [4], 0), ([1, 2], [1, 2, 9], 2),
])
def test_matching_prefix(reference, tokens, expected):
    assert matching_prefix(reference, tokens) == expected


def test_greedy_with_follow_stops_after_first_difference(tiny_llama):
    prompt = [3, 14, 15, 92, 65]

    def fresh():
        return make_layer_caches(tiny_llama, CacheOptions(max_context=64))

    free = greedy_tokens(tiny_llama, fresh(), prompt, max_new=8, chunk=2)
    assert greedy_tokens(tiny_llama, fresh(), prompt, max_new=8, chunk=4, follow=free) == free
    forked = free[:3] + [(free[3] + 1) % 128] + free[4:]
    assert greedy_tokens(tiny_llama, fresh(), prompt, max_new=8, chunk=4, follow=forked) == free[:4]


@pytest.mark.model
def test_corpus_tokens_are_a_prefix_of_the_whole_file(default_model):
    tokenizer = default_model.tokenizer
    whole = list(tokenizer.encode(LEE_CORPUS.read_text(encoding="utf-8")[:40000], add_special_tokens=False))
    assert corpus_token_ids(tokenizer, 2049) == whole[:2049]
    prompts = prompt_token_ids(tokenizer, 3, 16)
    assert [len(p) for p in prompts] == [16, 16, 16] and len({tuple(p) for p in prompts}) == 3


@pytest.mark.model
def test_evaluate_raw_row_matches_an_uncached_forward(default_model):
    """The raw row's perplexity equals one plain forward without any cache; AURA bits are exact."""
    model, tokenizer = default_model.model, default_model.tokenizer
    config = EvalConfig(schemes=("aura4v2",), num_tokens=48, chunk=16, num_prompts=1, prompt_tokens=8, max_new=3,
                        recall_keys=1, recall_filler_tokens=16, recall_window=64, recall_max_new=4)
    raw, aura = evaluate(model, tokenizer, config)
    assert raw.recall.full[0].matches_raw and len(aura.recall.full) == len(aura.recall.windowed) == 1
    ids = corpus_token_ids(tokenizer, 49)
    logits = model(mx.array(ids[:-1])[None])[0].astype(mx.float32)
    logprobs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True), dtype=np.float64)
    want = math.exp(-np.mean(logprobs[np.arange(48), ids[1:]]))
    assert raw.quality.perplexity == pytest.approx(want, rel=1e-4)
    assert (raw.quality.mean_kl, raw.quality.top1_agreement, raw.bits_per_element) == (0.0, 1.0, 32.0)
    assert aura.bits_per_element == (4 + 16 / 64 + 2 + 16 / 64) / 2 and aura.ratio_to_raw == 3.25 / 32
    assert aura.quality.mean_kl > 0
    assert aura.perplexity_change == pytest.approx(aura.quality.perplexity / raw.quality.perplexity - 1)
    assert 0 <= aura.divergence_tokens[0] <= 3 and raw.divergence_tokens == (3,)


@pytest.mark.model
def test_eval_kv_command_writes_json_table_and_plot(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "eval-kv", "--schemes", "affine8,aura4v4", "--tokens", "32",
         "--chunk", "16", "--prompts", "1", "--max-new", "2", "--recall-keys", "1", "--recall-filler", "24",
         "--recall-window", "64", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "eval_kv.json").read_text())
    assert [r["scheme"] for r in report["results"]] == ["raw", "affine8", "aura4v4"]
    assert report["settings"]["num_tokens"] == 32 and report["dtype"] == "float32"
    bits = {r["scheme"]: r["bits_per_element"] for r in report["results"]}
    assert bits == {"raw": 32.0, "affine8": 8.5, "aura4v4": 4.25}
    assert report["recall_keys"][0]["value"] == "68127" and report["results"][0]["recall"]["window_size"] == 64
    table = (tmp_path / "eval_kv.md").read_text()
    assert table.count("\n") == 5 + 1 + 7 and "| aura4v4 | 4.25 |" in table and table in proc.stdout
    assert "recall = raw (full; window) |" in table and "| raw | 68127 | 68127 |" in table
    assert (tmp_path / "eval_kv.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "eval-kv: 100%" in proc.stderr and "3/3" in proc.stderr  # a bar on stderr, a run per scheme (raw too)


@pytest.mark.model
def test_eval_kv_refuses_layers_past_the_model_before_any_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "services.cli", "eval-kv", "--schemes", "affine8,aura4v4+30=raw",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--schemes: layer 30 is not a layer of this model, which has 30" in proc.stderr
    assert "eval-kv:" not in proc.stderr and not (tmp_path / "eval_kv.json").exists()  # no run began


@pytest.mark.model
def test_recall_prompt_layout(default_model):
    """Instruction and key, then exactly the corpus's second-half tokens as filler, then question and answer prefix."""
    tokenizer = default_model.tokenizer
    filler = text_token_ids(tokenizer, split_halves(LEE_CORPUS.read_text(encoding="utf-8"))[1], 40)
    prompts = recall_prompts(tokenizer, len(PASS_KEYS), 40)
    assert [p.fact.value for p in prompts] == list(PASS_KEYS)
    for prompt, key in zip(prompts, PASS_KEYS):
        head = tokenizer.decode(prompt.token_ids[: prompt.fact_tokens])
        assert head == f"{INSTRUCTION}The pass key is {key}. Remember it. {key} is the pass key.\n"
        assert prompt.token_ids[prompt.fact_tokens : prompt.fact_tokens + 40] == filler
        tail = tokenizer.decode(prompt.token_ids[prompt.fact_tokens + 40 :])
        assert tail == "\nWhat is the pass key? The pass key is"
    with pytest.raises(ValueError, match="recall facts must be 1..5"):
        recall_prompts(tokenizer, 6, 40)


@pytest.mark.parametrize("text, value", [(" 68127.\n", "68127"), (" 681222. 5", "681222"), (" the passkey.", ""),
                                         ("4 0913", "4")])
def test_answer_value_is_the_first_run_of_digits(text, value):
    assert answer_value(text) == value


@pytest.mark.model
def test_recall_answers_against_raw(default_model):
    model, tokenizer = default_model.model, default_model.tokenizer
    prompts = recall_prompts(tokenizer, 1, 64)
    window = prompts[0].fact_tokens + 16
    assert len(prompts[0].token_ids) > window + 40  # the window evicts most of the filler
    raw = recall(model, tokenizer, prompts, "raw", window_size=window, max_new=7, chunk=64)
    answer = raw.full[0]
    assert answer.matches_raw and answer.recalled and answer.value == PASS_KEYS[0]
    assert tokenizer.decode(answer.token_ids).startswith(f" {PASS_KEYS[0]}")
    assert not set(answer.token_ids) & set(tokenizer.eos_token_ids)  # cut before EOS
    aura = recall(model, tokenizer, prompts, "aura2v2", window_size=window, max_new=7, chunk=64,
                  raw_answers=[answer.token_ids])
    for got in (aura.full[0], aura.windowed[0], raw.windowed[0]):
        assert got.value == answer_value(tokenizer.decode(got.token_ids))
        assert got.matches_raw == (got.value == answer.value) and got.recalled == (got.value == PASS_KEYS[0])
    with pytest.raises(ValueError, match="must exceed the"):
        recall(model, tokenizer, prompts, "raw", window_size=prompts[0].fact_tokens, max_new=6, chunk=64)


@pytest.mark.model
@pytest.mark.slow
def test_raw_retrieves_every_pass_key_through_the_full_filler(default_model):
    """The check's premise: with the raw cache the default model copies each key across 1,500 filler tokens."""
    model, tokenizer = default_model.model, default_model.tokenizer
    prompts = recall_prompts(tokenizer, len(PASS_KEYS), 1500)
    raw = recall(model, tokenizer, prompts, "raw", window_size=256, max_new=7, chunk=512)
    assert [a.value for a in raw.full] == [a.value for a in raw.windowed] == list(PASS_KEYS)
