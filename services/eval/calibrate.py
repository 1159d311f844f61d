"""Calibrate per-layer K/V widths on one half of a text and measure them on the other (`calibrate-kv`).

1. Split the text at its middle line (`corpus.split_halves`): the first half calibrates, the
   second is held out.
2. Measure each layer's sensitivity on the first `calibration_tokens` of the first half: per
   AURA width, and per whole-layer scheme above 8 bits (`affine8`; `raw` costs nothing).
3. Per budget, allocate widths (`allocate.allocate`) and measure the resulting spec: mean KL on
   the calibration tokens (the additive model's own error) and on the first `heldout_tokens`
   of the second half, next to the uniform reference schemes on the same held-out tokens.
   Compressed keys are centered on means measured on the first `CALIBRATION_TOKENS` calibration
   tokens (`cache.centering`; `center_keys`), in every run: sensitivity, calibration and held out.
   Every affine reference also adds its own bits/element as a budget, so each calibrated
   allocation can be compared with affine at equal bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from services.engine.cache import CacheOptions, make_layer_caches
from services.engine.cache.centering import CALIBRATION_TOKENS, KeyMeans
from services.engine.cache.report import bits_per_element

from .allocate import Allocation, allocate
from .corpus import split_halves, text_token_ids
from .kv_eval import score_chunks
from .metrics import KLReference, Quality, logprob_chunks
from .sensitivity import (WHOLE_SCHEMES, WIDTHS, OneLayerRuns, Sensitivity, attention_layers, check_widths, measure_sensitivity,
                          measure_whole)

DEFAULT_BUDGETS = (3.25, 4.25, 6.25, 8.25)  # bits/element of aura4v2, aura4v4, aura8v4, aura8v8


@dataclass(frozen=True, slots=True)
class CalibrationConfig:
    """Budgets, reference schemes and token counts of one calibration."""

    budgets: tuple[float, ...] = DEFAULT_BUDGETS  # target average bits per K/V element
    reference_schemes: tuple[str, ...] = ()  # uniform schemes measured on the held-out half
    calibration_tokens: int = 512  # from the first half (tokens)
    heldout_tokens: int = 2048  # from the second half (tokens)
    chunk: int = 256  # tokens per forward
    widths: tuple[int, ...] = WIDTHS  # candidate AURA widths (bits)
    whole_schemes: tuple[str, ...] = WHOLE_SCHEMES  # whole-layer candidates above AURA's 8 bits
    center_keys: bool = True  # center compressed keys on means from the calibration tokens (`cache.centering`)


@dataclass(frozen=True, slots=True)
class Measured:
    """One scheme spec on the held-out tokens, against the raw cache there."""

    scheme: str
    bits_per_element: float  # stored bits per K/V element over all layers, metadata included
    quality: Quality
    perplexity_change: float  # ppl / ppl_raw - 1


@dataclass(frozen=True, slots=True)
class CalibratedPoint:
    """One budget's allocation and what it measured."""

    allocation: Allocation
    calibration_kl: float  # mean KL on the calibration tokens (nats per token)
    heldout: Measured


@dataclass(frozen=True, slots=True)
class Calibration:
    """Everything `calibrate` measured."""

    sensitivity: Sensitivity
    overhead_bits: float  # AURA metadata per element (bits)
    references: list[Measured]  # raw first, then the reference schemes
    points: list[CalibratedPoint]  # by budget, ascending


@dataclass(frozen=True, slots=True)
class _Split:
    calibration: list[int]  # tokens from the first half
    heldout: list[int]  # num_heldout + 1 tokens from the second half (the last is only a target)


def calibrate(
    model: nn.Module, tokenizer, text: str, config: CalibrationConfig, *,
    sensitivity: Sensitivity | None = None, on_run: Callable[[str], None] | None = None,
) -> Calibration:
    """Measure sensitivities (unless given), allocate every budget, measure everything held out.

    Args:
        model (nn.Module): mlx-lm model.
        tokenizer: Its tokenizer.
        text (str): Calibration text (UTF-8 decoded); split in halves.
        config (CalibrationConfig): Budgets, references and sizes.
        sensitivity (Sensitivity | None): A table measured before on the same text and model.
        on_run (Callable[[str], None] | None): Called with each scheme spec after its run.

    Returns:
        Calibration: Its points sorted by budget.

    Raises:
        ValueError: a half too short for its token count, a budget below the narrowest
            allocation, or a bad reference scheme.
    """
    overhead = check_config(model, config)
    split = _split(tokenizer, text, config)
    means = KeyMeans.measure(model, split.calibration[:CALIBRATION_TOKENS]) if config.center_keys else None
    if sensitivity is None:
        sensitivity = measure_sensitivity(model, split.calibration, chunk=config.chunk, widths=config.widths,
                                          whole=config.whole_schemes, on_run=on_run, key_means=means)
    elif sensitivity.layers != attention_layers(model):
        raise ValueError(f"the sensitivity table covers layers {list(sensitivity.layers)}, not this model's")
    elif any(s not in row for s in config.whole_schemes for row in sensitivity.whole_kl or [{}]):
        runs = OneLayerRuns(model, split.calibration, chunk=config.chunk, key_means=means)
        sensitivity = measure_whole(model, sensitivity, config.whole_schemes, runs=runs, on_run=on_run)
    whole_bits = {s: scheme_bits(model, s) for s in config.whole_schemes}
    heldout = _HeldOut(model, split.heldout, config.chunk, on_run, means)
    references = [heldout.raw] + [heldout.measure(s) for s in config.reference_schemes if s != "raw"]
    budgets = sorted(set(config.budgets) | {round(r.bits_per_element, 6) for r in references
                                            if r.scheme.startswith("affine")})
    allocations = [allocate(sensitivity, target_bits=b, overhead_bits=overhead, whole_bits=whole_bits)
                   for b in budgets]
    calibration_reference = [KLReference.from_logprobs(lp) for lp in logprob_chunks(
        model, _caches(model, "raw", len(split.calibration)), split.calibration, chunk=config.chunk)]
    points = [CalibratedPoint(a, _mean_kl(model, a.spec, split.calibration, calibration_reference, config.chunk, means),
                              heldout.measure(a.spec)) for a in allocations]
    return Calibration(sensitivity, overhead, references, points)


class _HeldOut:
    """The held-out tokens, the raw cache's log-probabilities on them, and `measure(scheme)`."""

    def __init__(self, model: nn.Module, token_ids: list[int], chunk: int, on_run: Callable[[str], None] | None,
                 key_means: KeyMeans | None):
        self.model, self.chunk, self.on_run, self.key_means = model, chunk, on_run, key_means
        self.ids, self.targets = token_ids[:-1], np.array(token_ids[1:])
        caches = _caches(model, "raw", len(self.ids))
        self.logprobs = list(logprob_chunks(model, caches, self.ids, chunk=chunk))
        quality = score_chunks(self.logprobs, self.logprobs, self.targets)
        self.raw = Measured("raw", bits_per_element(caches), quality, 0.0)

    def measure(self, scheme: str) -> Measured:
        caches = _caches(self.model, scheme, len(self.ids), self.key_means)
        chunks = logprob_chunks(self.model, caches, self.ids, chunk=self.chunk)
        quality = score_chunks(chunks, self.logprobs, self.targets)
        if self.on_run is not None:
            self.on_run(scheme)
        return Measured(scheme, bits_per_element(caches), quality, quality.perplexity / self.raw.quality.perplexity - 1)


def aura_overhead_bits(model: nn.Module) -> float:
    """Metadata bits per K/V element of an AURA layer, read off a one-token aura8v8 cache."""
    return scheme_bits(model, "aura8v8") - 8


def scheme_bits(model: nn.Module, scheme: str) -> float:
    """Stored bits per K/V element of `scheme` on every layer, read off a one-token cache.

    Raises:
        ValueError: an unknown scheme.
    """
    caches = _caches(model, scheme, 1)
    mx.eval(model(mx.array([[0]], dtype=mx.uint32), cache=caches))
    return bits_per_element(caches)


def check_config(model: nn.Module, config: CalibrationConfig) -> float:
    """Reject bad settings before the long measurement starts.

    Returns:
        float: The model's AURA metadata bits per element (`aura_overhead_bits`).

    Raises:
        ValueError: a count below 1, a width outside 2..10, a budget below every layer at the
            narrowest width, or an unknown reference scheme.
    """
    overhead_bits = aura_overhead_bits(model)
    for name, value in (("calibration_tokens", config.calibration_tokens),
                        ("heldout_tokens", config.heldout_tokens), ("chunk", config.chunk)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    check_widths(config.widths)
    floor_bits = min(config.widths) + overhead_bits
    if not config.budgets or min(config.budgets) < floor_bits:
        raise ValueError(f"budgets must be at least {floor_bits:g} bits/element (every layer at "
                         f"aura{min(config.widths)}v{min(config.widths)}), got {list(config.budgets)}")
    for scheme in (*config.reference_schemes, *config.whole_schemes):
        _caches(model, scheme, 1)  # raises ValueError for an unknown scheme
    return overhead_bits


def _split(tokenizer, text: str, config: CalibrationConfig) -> _Split:
    first, second = split_halves(text)
    return _Split(text_token_ids(tokenizer, first, config.calibration_tokens, what="the text's first half"),
                  text_token_ids(tokenizer, second, config.heldout_tokens + 1, what="the text's second half"))


def _caches(model: nn.Module, scheme: str, num_tokens: int, key_means: KeyMeans | None = None) -> list:
    return make_layer_caches(model, CacheOptions(scheme=scheme, max_context=num_tokens, key_means=key_means))


def _mean_kl(model, scheme: str, ids: list[int], reference: list[KLReference], chunk: int,
             key_means: KeyMeans | None) -> float:
    chunks = logprob_chunks(model, _caches(model, scheme, len(ids), key_means), ids, chunk=chunk)
    return sum(float(ref.kl(lp).sum()) for ref, lp in zip(reference, chunks)) / len(ids)
