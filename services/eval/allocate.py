"""Per-layer K and V widths that minimize predicted KL under an average bits/element budget.

The choice is a multiple-choice knapsack: every layer's K and every layer's V is an item that
takes one width w (cost w bits per element, value its measured KL), and the widths' sum is
bounded. It is solved exactly by dynamic programming over the integer budget (items x budget x
widths: 60 x 480 x 7 steps for the default model, milliseconds). Greedy marginal allocation
(repeatedly buy the bit with the largest KL drop) is optimal only when every KL-vs-width curve is
convex, and measured curves are not always (near 8 bits they flatten into measurement noise), so
the exact solution is used.

Source: multiple-choice knapsack by dynamic programming (Kellerer, Pferschy & Pisinger,
"Knapsack Problems", 2004, ch. 11); per-layer bit allocation as in HAWQ-V3 (arXiv 2011.10680).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from .sensitivity import PARTNER_BITS, Sensitivity, predicted_kl


@dataclass(frozen=True, slots=True)
class Allocation:
    """Widths chosen for one budget, with the scheme spec that applies them."""

    target_bits: float  # the budget: average stored bits per K/V element, metadata included
    bits_per_element: float  # what the widths cost (<= target_bits), metadata included
    key_bits: tuple[int, ...]  # per attention layer (Sensitivity.layers order)
    value_bits: tuple[int, ...]
    predicted_kl: float  # sum of the layers' measured costs, nats per token
    spec: str  # `--kv-cache` value, e.g. "aura4v4+1=aura8v8+3=aura5v3"


def allocate(sensitivity: Sensitivity, *, target_bits: float, overhead_bits: float) -> Allocation:
    """Choose each layer's K and V width to minimize the predicted KL within `target_bits`.

    A layer at `aura{k}v{v}` stores `(k + v) / 2 + overhead_bits` bits per element, so the
    budget bounds the sum of all widths by `2 * n_layers * (target_bits - overhead_bits)`.

    Args:
        sensitivity (Sensitivity): Measured per-layer costs.
        target_bits (float): Average stored bits per K/V element over the layers.
        overhead_bits (float): Per-element metadata of an AURA layer (16 / head_dim: the fp16
            scale per vector), measured by the caller.

    Returns:
        Allocation: The optimum (ties go to the fewer bits); all layers at the widest width
        when the budget exceeds it.

    Raises:
        ValueError: the budget is below every layer at the narrowest width.
    """
    n_layers, widths = len(sensitivity.layers), sorted(sensitivity.widths)
    budget = math.floor(2 * n_layers * (target_bits - overhead_bits) + 1e-9)
    if budget < 2 * n_layers * widths[0]:
        floor_bits = widths[0] + overhead_bits
        raise ValueError(f"target {target_bits} bits/element is below the narrowest allocation ({floor_bits:g})")
    budget = min(budget, 2 * n_layers * widths[-1])
    both = [row[PARTNER_BITS] for row in sensitivity.key_kl]
    # Items: each layer's K (cost key_kl[w] - the 8/8 run) then its V (value_kl[w]); see Sensitivity.
    items = [{w: sensitivity.key_kl[i][w] - both[i] for w in widths} for i in range(n_layers)]
    items += [{w: sensitivity.value_kl[i][w] for w in widths} for i in range(n_layers)]
    chosen = _knapsack(items, budget)
    key_bits, value_bits = tuple(chosen[:n_layers]), tuple(chosen[n_layers:])
    bits = sum(chosen) / (2 * n_layers) + overhead_bits
    return Allocation(target_bits, bits, key_bits, value_bits, predicted_kl(sensitivity, key_bits, value_bits),
                      scheme_spec(sensitivity.layers, key_bits, value_bits))


def _knapsack(items: list[dict[int, float]], budget: int) -> list[int]:
    """Exact multiple-choice knapsack: one width per item, widths summing to at most `budget`.

    Returns:
        list[int]: The chosen width of each item, minimizing the summed costs.
    """
    best = np.zeros(budget + 1)  # best[b]: least cost of the items so far within b bits
    picks = []
    for costs in items:
        new, pick = np.full(budget + 1, np.inf), np.zeros(budget + 1, dtype=np.int64)
        for w, cost in sorted(costs.items()):  # narrow first: on ties the cheaper width stays
            candidate = np.full(budget + 1, np.inf)
            candidate[w:] = best[: budget + 1 - w] + cost
            better = candidate < new
            new[better], pick[better] = candidate[better], w
        best = new
        picks.append(pick)
    chosen, left = [], int(np.argmin(best))
    for pick in reversed(picks):
        chosen.append(int(pick[left]))
        left -= chosen[-1]
    return chosen[::-1]


def scheme_spec(layers: tuple[int, ...], key_bits: tuple[int, ...], value_bits: tuple[int, ...]) -> str:
    """The `--kv-cache` spec: the most common layer scheme as base, `+{layer}={scheme}` for the rest.

    Layers not in `layers` (recurrent ones) take the base scheme, which does not apply to them.
    """
    names = [f"aura{k}v{v}" for k, v in zip(key_bits, value_bits)]
    base = Counter(names).most_common(1)[0][0]
    return base + "".join(f"+{layer}={name}" for layer, name in zip(layers, names) if name != base)
