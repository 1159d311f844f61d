"""Evaluate cache schemes against the raw cache on the Lee corpus (the core of `eval-kv`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.nn as nn
import numpy as np

from services.engine.cache import CacheOptions, make_layer_caches, model_dtype
from services.engine.cache.centering import KeyMeans
from services.engine.cache.report import bits_per_element

from .corpus import corpus_token_ids, prompt_token_ids
from .metrics import Quality, QualityAccumulator, greedy_tokens, logprob_chunks, matching_prefix
from .recall import RecallPrompt, RecallResult, check_window, recall, recall_prompts


@dataclass(frozen=True, slots=True)
class EvalConfig:
    """What to run: schemes, teacher-forced span and free-running prompts."""

    schemes: tuple[str, ...]  # scheme names, compared with "raw" (always run first)
    num_tokens: int = 2048  # teacher-forced predictions (tokens)
    chunk: int = 256  # tokens per forward, teacher-forced and prefill
    num_prompts: int = 4  # free-running prompts
    prompt_tokens: int = 32  # tokens per prompt
    max_new: int = 48  # most greedy tokens per prompt
    raw_layers: frozenset[int] = field(default_factory=frozenset)  # layers kept raw in every scheme
    recall_keys: int = 5  # passkey prompts (0: no recall check)
    recall_filler_tokens: int = 1500  # filler between a fact and its question (tokens)
    recall_window: int = 256  # window of the windowed recall answers (tokens, sinks included)
    recall_max_new: int = 8  # most answer tokens (a five-digit key is six: a space and one token per digit)
    key_means: KeyMeans | None = None  # compressed layers' keys centered on these (`cache.centering`), or stored as they come


@dataclass(frozen=True, slots=True)
class SchemeResult:
    """One scheme's measurements against the raw cache."""

    scheme: str
    bits_per_element: float  # stored bits per K/V element, all layers, metadata included
    ratio_to_raw: float  # bytes against a raw cache in the model dtype
    quality: Quality  # teacher-forced
    perplexity_change: float  # relative to raw: ppl / ppl_raw - 1
    divergence_tokens: tuple[int, ...]  # per prompt: greedy tokens equal to raw's before the first difference
    recall: RecallResult | None  # prompt-recall answers (None when the check is off)


@dataclass(frozen=True, slots=True)
class Reference:
    """What every scheme is compared with: the inputs and the raw cache's outputs on them."""

    token_ids: list[int]  # teacher-forced inputs (tokens)
    targets: np.ndarray  # int [num_tokens], the next token at each input position
    logprobs: list[np.ndarray]  # raw cache, per chunk: float32 [chunk, vocab]
    prompts: list[list[int]]  # free-running prompts
    greedy: list[list[int]]  # raw cache's greedy continuation of each prompt
    recall_prompts: list[RecallPrompt]  # empty when the recall check is off
    recall: RecallResult | None  # the raw cache's recall answers


def evaluate(model: nn.Module, tokenizer, config: EvalConfig,
             on_run: Callable[[str], None] | None = None) -> list[SchemeResult]:
    """Run the raw cache, then every scheme, over the same corpus tokens and prompts.

    Per scheme: teacher-forced quality and size, free-running agreement, and (unless
    `config.recall_keys` is 0) the prompt-recall answers, full and windowed (`recall.py`).

    Args:
        model (nn.Module): mlx-lm model (the default model for the acceptance numbers).
        tokenizer: Its tokenizer.
        config (EvalConfig): Schemes and sizes.
        on_run (Callable[[str], None] | None): Called with each scheme's name (`raw` first) once its
            result is in (a progress bar).

    Returns:
        list[SchemeResult]: `raw` first, then `config.schemes` in order (a `raw` there is skipped).

    Raises:
        ValueError: an unknown scheme, or a corpus shorter than `num_tokens + 1` tokens.
    """
    reference = raw_reference(model, tokenizer, config)
    raw_bits = 8.0 * model_dtype(model).size
    raw = SchemeResult("raw", raw_bits, 1.0, score_chunks(reference.logprobs, reference.logprobs, reference.targets),
                       0.0, tuple(len(g) for g in reference.greedy), reference.recall)
    on_run = on_run or (lambda scheme: None)
    on_run("raw")
    results = [raw]
    for scheme in (s for s in config.schemes if s != "raw"):
        results.append(scheme_result(model, tokenizer, scheme, config, reference, raw))
        on_run(scheme)
    return results


def raw_reference(model: nn.Module, tokenizer, config: EvalConfig) -> Reference:
    """Teacher-forced log-probabilities and greedy continuations of the raw cache."""
    facts = recall_prompts(tokenizer, config.recall_keys, config.recall_filler_tokens) if config.recall_keys else []
    check_window(facts, config.recall_window)
    ids = corpus_token_ids(tokenizer, config.num_tokens + 1)
    prompts = prompt_token_ids(tokenizer, config.num_prompts, config.prompt_tokens)
    logprobs = list(logprob_chunks(model, _caches(model, "raw", config), ids[:-1], chunk=config.chunk))
    greedy = [greedy_tokens(model, _caches(model, "raw", config), p, max_new=config.max_new, chunk=config.chunk)
              for p in prompts]
    raw_recall = _recall(model, tokenizer, "raw", config, facts, None)
    return Reference(ids[:-1], np.array(ids[1:]), logprobs, prompts, greedy, facts, raw_recall)


def scheme_result(model: nn.Module, tokenizer, scheme: str, config: EvalConfig, reference: Reference,
                  raw: SchemeResult) -> SchemeResult:
    """Teacher-forced quality, size and free-running agreement of one scheme against `reference`."""
    caches = _caches(model, scheme, config)
    chunks = logprob_chunks(model, caches, reference.token_ids, chunk=config.chunk)
    quality = score_chunks(chunks, reference.logprobs, reference.targets)
    bits = bits_per_element(caches)
    runs = [greedy_tokens(model, _caches(model, scheme, config), prompt, max_new=config.max_new, chunk=config.chunk,
                          follow=greedy) for prompt, greedy in zip(reference.prompts, reference.greedy)]
    return SchemeResult(scheme, bits, bits / raw.bits_per_element, quality,
                        quality.perplexity / raw.quality.perplexity - 1.0,
                        tuple(matching_prefix(g, r) for g, r in zip(reference.greedy, runs)),
                        _recall(model, tokenizer, scheme, config, reference.recall_prompts, reference.recall))


def _recall(model: nn.Module, tokenizer, scheme: str, config: EvalConfig, prompts: list[RecallPrompt],
            raw: RecallResult | None) -> RecallResult | None:
    if not prompts:
        return None
    raw_answers = None if raw is None else [a.token_ids for a in raw.full]
    return recall(model, tokenizer, prompts, scheme, window_size=config.recall_window, max_new=config.recall_max_new,
                  chunk=config.chunk, raw_layers=config.raw_layers, raw_answers=raw_answers, key_means=config.key_means)


def score_chunks(chunks, reference: list[np.ndarray], targets: np.ndarray) -> Quality:
    """Accumulate `Quality` over paired chunks of scheme and reference log-probabilities.

    Args:
        chunks: Iterable of float32 [n_i, vocab] log-probabilities under the scheme.
        reference (list[np.ndarray]): The raw cache's, chunk for chunk.
        targets (np.ndarray): int [sum n_i], the next tokens.

    Returns:
        Quality: Means over every position.
    """
    accumulator, start = QualityAccumulator(), 0
    for logprobs, ref in zip(chunks, reference):
        accumulator.add(logprobs, ref, targets[start : start + len(ref)])
        start += len(ref)
    return accumulator.result()


def _caches(model: nn.Module, scheme: str, config: EvalConfig) -> list:
    context = max(config.num_tokens, config.prompt_tokens + config.max_new)
    return make_layer_caches(model, CacheOptions(scheme=scheme, max_context=context, raw_layers=config.raw_layers,
                                                 key_means=config.key_means))
