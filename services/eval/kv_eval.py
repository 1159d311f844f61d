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


@dataclass(frozen=True, slots=True)
class Reference:
    """What every scheme is compared with: the inputs and the raw cache's outputs on them."""

    token_ids: list[int]  # teacher-forced inputs (tokens)
    targets: np.ndarray  # int [num_tokens], the next token at each input position
    logprobs: list[np.ndarray]  # raw cache, per chunk: float32 [chunk, vocab]
    prompts: list[list[int]]  # free-running prompts
    greedy: list[list[int]]  # raw cache's greedy continuation of each prompt


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
    reference = raw_reference(model, tokenizer, config)
    raw_bits = 8.0 * model_dtype(model).size
    raw = SchemeResult("raw", raw_bits, 1.0, score_chunks(reference.logprobs, reference.logprobs, reference.targets),
                       0.0, tuple(len(g) for g in reference.greedy))
    schemes = [s for s in config.schemes if s != "raw"]
    return [raw] + [scheme_result(model, scheme, config, reference, raw) for scheme in schemes]


def raw_reference(model: nn.Module, tokenizer, config: EvalConfig) -> Reference:
    """Teacher-forced log-probabilities and greedy continuations of the raw cache."""
    ids = corpus_token_ids(tokenizer, config.num_tokens + 1)
    prompts = prompt_token_ids(tokenizer, config.num_prompts, config.prompt_tokens)
    logprobs = list(logprob_chunks(model, _caches(model, "raw", config), ids[:-1], chunk=config.chunk))
    greedy = [greedy_tokens(model, _caches(model, "raw", config), p, max_new=config.max_new, chunk=config.chunk)
              for p in prompts]
    return Reference(ids[:-1], np.array(ids[1:]), logprobs, prompts, greedy)


def scheme_result(model: nn.Module, scheme: str, config: EvalConfig, reference: Reference,
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
                        tuple(matching_prefix(g, r) for g, r in zip(reference.greedy, runs)))


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
    return make_layer_caches(model, CacheOptions(scheme=scheme, max_context=context, raw_layers=config.raw_layers))
