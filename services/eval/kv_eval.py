"""Evaluate cache schemes against the raw cache on the Lee corpus (the core of `eval-kv`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.nn as nn
import numpy as np

from services.engine.cache import CacheOptions, make_layer_caches, model_dtype
from services.engine.cache.report import bits_per_element

from .corpus import corpus_token_ids, prompt_token_ids
from .metrics import Quality, QualityAccumulator, greedy_tokens, logprob_chunks, matching_prefix


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


@dataclass(frozen=True, slots=True)
class SchemeResult:
    """One scheme's measurements against the raw cache."""

    scheme: str
    bits_per_element: float  # stored bits per K/V element, all layers, metadata included
    ratio_to_raw: float  # bytes against a raw cache in the model dtype
    quality: Quality  # teacher-forced
    perplexity_change: float  # relative to raw: ppl / ppl_raw - 1
    divergence_tokens: tuple[int, ...]  # per prompt: greedy tokens equal to raw's before the first difference


def evaluate(model: nn.Module, tokenizer, config: EvalConfig) -> list[SchemeResult]:
    """Run the raw cache, then every scheme, over the same corpus tokens and prompts.

    Args:
        model (nn.Module): mlx-lm model (the default model for the acceptance numbers).
        tokenizer: Its tokenizer.
        config (EvalConfig): Schemes and sizes.

    Returns:
        list[SchemeResult]: `raw` first, then `config.schemes` in order (a `raw` there is skipped).

    Raises:
        ValueError: an unknown scheme, or a corpus shorter than `num_tokens + 1` tokens.
    """
    ids = corpus_token_ids(tokenizer, config.num_tokens + 1)
    targets = np.array(ids[1:])
    prompts = prompt_token_ids(tokenizer, config.num_prompts, config.prompt_tokens)
    context = max(config.num_tokens, config.prompt_tokens + config.max_new)

    def caches(scheme: str) -> list:
        return make_layer_caches(model, CacheOptions(scheme=scheme, max_context=context, raw_layers=config.raw_layers))

    raw_caches = caches("raw")
    reference = list(logprob_chunks(model, raw_caches, ids[:-1], chunk=config.chunk))
    raw_bits = 8.0 * model_dtype(model).size
    greedy = [greedy_tokens(model, caches("raw"), p, max_new=config.max_new, chunk=config.chunk) for p in prompts]
    results = [_raw_result(reference, targets, raw_bits, greedy)]
    for scheme in (s for s in config.schemes if s != "raw"):
        scheme_caches = caches(scheme)
        quality = score_chunks(logprob_chunks(model, scheme_caches, ids[:-1], chunk=config.chunk), reference, targets)
        bits = bits_per_element(scheme_caches)
        runs = [greedy_tokens(model, caches(scheme), p, max_new=config.max_new, chunk=config.chunk, follow=g)
                for p, g in zip(prompts, greedy)]
        results.append(SchemeResult(
            scheme, bits, bits / raw_bits, quality, quality.perplexity / results[0].quality.perplexity - 1.0,
            tuple(matching_prefix(g, r) for g, r in zip(greedy, runs)),
        ))
    return results


def _raw_result(reference: list[np.ndarray], targets: np.ndarray, raw_bits: float, greedy: list) -> SchemeResult:
    quality = score_chunks(reference, reference, targets)
    return SchemeResult("raw", raw_bits, 1.0, quality, 0.0, tuple(len(g) for g in greedy))


def score_chunks(chunks, reference: list[np.ndarray], targets: np.ndarray) -> Quality:
    """Accumulate `Quality` over paired chunks of scheme and reference log-probabilities."""
    accumulator, start = QualityAccumulator(), 0
    for logprobs, ref in zip(chunks, reference):
        accumulator.add(logprobs, ref, targets[start : start + len(ref)])
        start += len(ref)
    return accumulator.result()
