"""Per-layer cache schemes that minimize predicted KL under an average bits/element budget.

Every attention layer takes one choice: an AURA pair `aura{k}v{v}` (its cost from the layer's
K and V sensitivities, `Sensitivity.layer_kl`) or a whole-layer scheme wider than AURA's 8 bits
(`raw`, `affine8`: `Sensitivity.whole_kl`). Minimizing the summed costs with the average
bits/element at or under the budget is a multiple-choice knapsack, solved exactly by dynamic
programming over the budget in 1/`UNITS_PER_BIT` bits (layers x budget units x choices: 30 x
16k x 51 steps at 8.5 bits on the default model, tens of milliseconds). Greedy marginal
allocation (repeatedly buy the bit with the largest KL drop) is optimal only when every
KL-vs-width curve is convex, and measured curves are not always (near 8 bits they flatten into
measurement noise), so the exact solution is used.

Source: multiple-choice knapsack by dynamic programming (Kellerer, Pferschy & Pisinger,
"Knapsack Problems", 2004, ch. 11); per-layer bit allocation as in HAWQ-V3 (arXiv 2011.10680).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from .sensitivity import Sensitivity

UNITS_PER_BIT = 64  # budget resolution: exact for metadata of 16 bits per 64-element vector or group


@dataclass(frozen=True, slots=True)
class Choice:
    """One scheme a layer may take: its stored bits per element and its predicted KL cost."""

    scheme: str  # e.g. "aura5v3", "raw"
    bits: float  # bits per K/V element of the layer, metadata included
    kl: float  # predicted KL contribution (nats per token)


@dataclass(frozen=True, slots=True)
class Allocation:
    """Schemes chosen for one budget, with the spec that applies them."""

    target_bits: float  # the budget: average stored bits per K/V element, metadata included
    bits_per_element: float  # what the choices cost (<= target_bits), metadata included
    schemes: tuple[str, ...]  # per attention layer (Sensitivity.layers order): "aura5v3", "raw", ...
    predicted_kl: float  # sum of the layers' predicted costs, nats per token
    spec: str  # `--kv-cache` value, e.g. "aura4v4+1=aura8v8+3=aura5v3"


def aura_choices(sensitivity: Sensitivity, index: int, overhead_bits: float) -> list[Choice]:
    """Every `aura{k}v{v}` of the measured widths for `sensitivity.layers[index]` (additive model)."""
    widths = sensitivity.widths
    return [Choice(f"aura{k}v{v}", (k + v) / 2 + overhead_bits, sensitivity.layer_kl(index, k, v))
            for k in widths for v in widths]


def allocate(sensitivity: Sensitivity, *, target_bits: float, overhead_bits: float,
             whole_bits: dict[str, float] | None = None) -> Allocation:
    """Choose each layer's scheme to minimize the predicted KL within `target_bits`.

    Args:
        sensitivity (Sensitivity): Measured per-layer costs.
        target_bits (float): Average stored bits per K/V element over the layers.
        overhead_bits (float): Per-element metadata of an AURA layer (16 / head_dim: the fp16
            scale per vector), measured by the caller.
        whole_bits (dict[str, float] | None): Bits per element of the whole-layer schemes that
            may be chosen (e.g. `{"raw": 32.0, "affine8": 8.5}`); each needs its per-layer
            KL in `sensitivity.whole_kl`. None: AURA pairs only.

    Returns:
        Allocation: The optimum (ties go to the fewer bits).

    Raises:
        ValueError: the budget is below every layer at the narrowest choice, or a whole-layer
            scheme has no measured KL.
    """
    whole_bits = whole_bits or {}
    missing = [s for s in whole_bits if any(s not in row for row in sensitivity.whole_kl) or not sensitivity.whole_kl]
    if missing:
        raise ValueError(f"no per-layer KL measured for {missing}")
    choices = [aura_choices(sensitivity, i, overhead_bits)
               + [Choice(s, bits, sensitivity.whole_kl[i][s]) for s, bits in whole_bits.items()]
               for i in range(len(sensitivity.layers))]
    return allocate_choices(choices, sensitivity.layers, target_bits=target_bits)


def allocate_choices(choices: list[list[Choice]], layers: tuple[int, ...], *, target_bits: float) -> Allocation:
    """The exact optimum of a multiple-choice knapsack: one `Choice` per layer, mean bits <= `target_bits`.

    Raises:
        ValueError: the budget is below every layer at its narrowest choice.
    """
    n_layers = len(choices)
    floor_bits = sum(min(c.bits for c in row) for row in choices) / n_layers
    if target_bits < floor_bits - 1e-9:
        raise ValueError(f"target {target_bits} bits/element is below the narrowest allocation ({floor_bits:g})")
    budget = math.floor(n_layers * target_bits * UNITS_PER_BIT + 1e-6)
    picked = _knapsack([[(_units(c.bits), c.kl) for c in row] for row in choices], budget)
    chosen = [row[i] for row, i in zip(choices, picked)]
    names = tuple(c.scheme for c in chosen)
    return Allocation(target_bits, sum(c.bits for c in chosen) / n_layers, names,
                      float(np.sum([c.kl for c in chosen])), scheme_spec(layers, names))


def _units(bits: float) -> int:
    return math.ceil(bits * UNITS_PER_BIT - 1e-6)


def _knapsack(items: list[list[tuple[int, float]]], budget: int) -> list[int]:
    """Exact multiple-choice knapsack: one (cost, value) per item, costs summing to at most `budget`.

    Returns:
        list[int]: The index of the chosen pair of each item, minimizing the summed values.
    """
    best = np.zeros(budget + 1)  # best[b]: least value of the items so far within b units
    picks = []
    for pairs in items:
        new, pick = np.full(budget + 1, np.inf), np.zeros(budget + 1, dtype=np.int64)
        for index in sorted(range(len(pairs)), key=lambda i: pairs[i][0]):  # cheap first: ties keep it
            cost, value = pairs[index]
            if cost > budget:
                continue
            candidate = np.full(budget + 1, np.inf)
            candidate[cost:] = best[: budget + 1 - cost] + value
            better = candidate < new
            new[better], pick[better] = candidate[better], index
        best = new
        picks.append(pick)
    chosen, left = [], int(np.argmin(best))
    for pairs, pick in zip(reversed(items), reversed(picks)):
        chosen.append(int(pick[left]))
        left -= pairs[chosen[-1]][0]
    return chosen[::-1]


def scheme_spec(layers: tuple[int, ...], names: tuple[str, ...]) -> str:
    """The `--kv-cache` spec: the most common layer scheme as base, `+{layer}={scheme}` for the rest.

    Layers not in `layers` (recurrent ones) take the base scheme, which does not apply to them.
    """
    base = Counter(names).most_common(1)[0][0]
    return base + "".join(f"+{layer}={name}" for layer, name in zip(layers, names) if name != base)
