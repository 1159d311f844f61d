"""Per-layer sensitivity to KV compression: mean KL when one layer's K (or V) alone is compressed.

A scheme spec cannot leave one of a layer's K and V raw, so each layer is measured with its
partner at `PARTNER_BITS`: `key_kl[w]` is the mean KL with the layer at `aura{w}v8` (every other
layer raw), `value_kl[w]` with it at `aura8v{w}`. Assuming the K and V contributions add, the
layer at `aura{k}v{v}` then costs `key_kl[k] + value_kl[v] - key_kl[8]`, since
`key_kl[8] = value_kl[8]` is the layer at aura8v8, whose K and V parts both appear twice.
Whole-layer schemes wider than AURA's 8 bits (`WHOLE_SCHEMES`) are measured the same way, one
layer at a time (`whole_kl`); raw costs nothing by definition and is not run.

Source: HAWQ-style per-layer sensitivity (arXiv 1905.03696) with KL as the measure, applied to
KV-cache widths as in KVQuant (arXiv 2401.18079).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import mlx.nn as nn
import numpy as np

from kernels.aura import SCHEME_MIN_BITS
from kernels.lloyd_max import MAX_BITS
from services.engine.cache import CacheOptions, KVCache, make_layer_caches
from services.engine.cache.centering import KeyMeans

from .metrics import KLReference, logprob_chunks
from .replay import RecordedRun

PARTNER_BITS = 8  # width of the half (K or V) not under test
WIDTHS = tuple(range(2, 11))  # candidate AURA widths (bits per element)
WHOLE_SCHEMES = ("affine8", "raw")  # registry schemes above AURA's widest: whole-layer candidates


def check_widths(widths) -> None:
    """Raises ValueError unless there are widths and each is an AURA scheme width (2..10 bits)."""
    if not widths or any(not SCHEME_MIN_BITS <= w <= MAX_BITS for w in widths):
        raise ValueError(f"AURA widths must lie in {SCHEME_MIN_BITS}..{MAX_BITS}, got {list(widths)}")


@dataclass(frozen=True, slots=True)
class Sensitivity:
    """Measured per-layer costs of compression, in mean KL(raw || scheme) nats per token."""

    layers: tuple[int, ...]  # attention layers measured (recurrent layers have no K/V)
    widths: tuple[int, ...]  # candidate widths (bits)
    key_kl: tuple[dict[int, float], ...]  # per layer: width -> KL with the layer at aura{w}v8
    value_kl: tuple[dict[int, float], ...]  # per layer: width -> KL with the layer at aura8v{w}
    num_tokens: int  # calibration tokens scored
    whole_kl: tuple[dict[str, float], ...] = ()  # per layer: whole-layer scheme -> KL (empty: not measured)

    def layer_kl(self, index: int, key_bits: int, value_bits: int) -> float:
        """Predicted KL of `layers[index]` at `aura{key_bits}v{value_bits}` (additive model)."""
        both = self.key_kl[index][PARTNER_BITS]
        return self.key_kl[index][key_bits] + self.value_kl[index][value_bits] - both

    def to_dict(self) -> dict:
        """JSON-ready: width keys become strings."""
        out = asdict(self)
        for name in ("key_kl", "value_kl"):
            out[name] = [{str(w): kl for w, kl in row.items()} for row in out[name]]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Sensitivity":
        """Inverse of `to_dict`.

        Raises:
            ValueError: a field is missing or a layer lacks a width.
        """
        try:
            rows = {name: tuple({int(w): float(kl) for w, kl in row.items()} for row in data[name])
                    for name in ("key_kl", "value_kl")}
            whole = tuple({name: float(kl) for name, kl in row.items()} for row in data.get("whole_kl", ()))
            result = cls(tuple(data["layers"]), tuple(data["widths"]), rows["key_kl"], rows["value_kl"],
                         int(data["num_tokens"]), whole)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a sensitivity table: {exc!r}") from exc
        wanted = set(result.widths) | {PARTNER_BITS}
        if any(set(row) != wanted for row in result.key_kl + result.value_kl):
            raise ValueError(f"a sensitivity row lacks one of the widths {sorted(wanted)}")
        return result


def attention_layers(model: nn.Module) -> tuple[int, ...]:
    """Indices of the layers whose cache holds K/V (the ones a scheme applies to)."""
    return tuple(i for i, c in enumerate(make_layer_caches(model, CacheOptions(max_context=1)))
                 if isinstance(c, KVCache))


def layer_runs(widths: tuple[int, ...]) -> list[tuple[int, int]]:
    """The (key_bits, value_bits) pairs measured per layer: each width against the 8-bit partner."""
    others = [w for w in widths if w != PARTNER_BITS]
    return [(w, PARTNER_BITS) for w in others] + [(PARTNER_BITS, w) for w in others] + [(PARTNER_BITS,) * 2]


class OneLayerRuns:
    """Teacher-forced runs with one layer compressed and every other raw, against the raw run.

    Each run starts at the compressed layer, replaying the raw run's outputs below it (exact:
    `replay.RecordedRun`).

    Args:
        model (nn.Module): mlx-lm model.
        token_ids (list[int]): Teacher-forced tokens; position i predicts token i+1.
        chunk (int): Tokens per forward (tokens).
    """

    def __init__(self, model: nn.Module, token_ids: list[int], *, chunk: int, key_means: KeyMeans | None = None):
        self.model, self.token_ids, self.chunk, self.key_means = model, token_ids, chunk, key_means
        self.run = RecordedRun(model, self._caches("raw"), token_ids, chunk=chunk)
        self.reference = [KLReference.from_logprobs(lp) for lp in self.run.logprobs]
        self.run.logprobs.clear()

    @staticmethod
    def spec(layer: int, scheme: str) -> str:
        """The spec of a run: `raw+{layer}={scheme}`."""
        return f"raw+{layer}={scheme}"

    def kl(self, layer: int, scheme: str) -> float:
        """Mean KL(raw || run) with only `layer` at `scheme` (nats per token)."""
        fresh = self._caches(self.spec(layer, scheme))  # built outside the replay: building probes the model
        with self.run.replaying(self.model, layer):
            return self._mean_kl(logprob_chunks(self.model, fresh, self.token_ids, chunk=self.chunk))

    def _caches(self, scheme: str) -> list:
        return make_layer_caches(self.model, CacheOptions(scheme=scheme, max_context=len(self.token_ids),
                                                          key_means=self.key_means))

    def _mean_kl(self, chunks) -> float:
        return sum(float(ref.kl(lp).sum()) for ref, lp in zip(self.reference, chunks)) / len(self.token_ids)


def measure_sensitivity(
    model: nn.Module, token_ids: list[int], *, chunk: int, widths: tuple[int, ...] = WIDTHS,
    whole: tuple[str, ...] = WHOLE_SCHEMES, on_run: Callable[[str], None] | None = None,
    key_means: KeyMeans | None = None,
) -> Sensitivity:
    """Compress one layer at a time and measure the mean KL against the raw cache.

    Costs `len(layer_runs(widths))` teacher-forced runs per attention layer (17 for the
    default widths 2..10), plus one per whole-layer scheme other than raw; each starts at the layer under test.

    Args:
        model (nn.Module): mlx-lm model.
        token_ids (list[int]): Calibration tokens; position i predicts token i+1.
        chunk (int): Tokens per forward (tokens).
        widths (tuple[int, ...]): Candidate widths, each in 2..10.
        whole (tuple[str, ...]): Whole-layer schemes to measure too (`measure_whole`).
        on_run (Callable[[str], None] | None): Called with each scheme spec after its run.
        key_means (KeyMeans | None): Center compressed layers' keys on these (`cache.centering`).

    Returns:
        Sensitivity: Over every attention layer.

    Raises:
        ValueError: a width outside 2..10, or an unknown whole-layer scheme.
    """
    check_widths(widths)
    runs = OneLayerRuns(model, token_ids, chunk=chunk, key_means=key_means)
    layers = attention_layers(model)
    key_kl, value_kl = [], []
    for layer in layers:
        measured = {}
        for key_bits, value_bits in layer_runs(widths):
            measured[key_bits, value_bits] = runs.kl(layer, f"aura{key_bits}v{value_bits}")
            if on_run is not None:
                on_run(runs.spec(layer, f"aura{key_bits}v{value_bits}"))
        key_kl.append({w: measured[w, PARTNER_BITS] for w in (*widths, PARTNER_BITS)})
        value_kl.append({w: measured[PARTNER_BITS, w] for w in (*widths, PARTNER_BITS)})
    table = Sensitivity(layers, tuple(widths), tuple(key_kl), tuple(value_kl), len(token_ids))
    return measure_whole(model, table, whole, runs=runs, on_run=on_run)


def measure_whole(model: nn.Module, table: Sensitivity, schemes: tuple[str, ...], *, runs: OneLayerRuns,
                  on_run: Callable[[str], None] | None = None) -> Sensitivity:
    """`table` with `whole_kl` for `schemes`: each layer alone at each scheme (raw: 0 by definition, not run).

    Args:
        model (nn.Module): The model `table` was measured on.
        table (Sensitivity): AURA sensitivities (its `whole_kl` entries are kept).
        schemes (tuple[str, ...]): Whole-layer scheme names, e.g. `("affine8", "raw")`.
        runs (OneLayerRuns): Raw-based runs over the calibration tokens `table` was measured on.
        on_run (Callable[[str], None] | None): Called with each scheme spec after its run.

    Raises:
        ValueError: an unknown scheme.
    """
    rows = [dict(row) for row in table.whole_kl] or [{} for _ in table.layers]
    for index, layer in enumerate(table.layers):
        for scheme in schemes:
            if scheme in rows[index]:
                continue
            rows[index][scheme] = 0.0 if scheme == "raw" else runs.kl(layer, scheme)
            if on_run is not None and scheme != "raw":
                on_run(runs.spec(layer, scheme))
    return replace(table, whole_kl=tuple(rows))


def predicted_kl(sensitivity: Sensitivity, key_bits: list[int], value_bits: list[int]) -> float:
    """Predicted mean KL of a whole allocation: the sum of its layers' costs (nats per token)."""
    return float(np.sum([sensitivity.layer_kl(i, k, v) for i, (k, v) in enumerate(zip(key_bits, value_bits))]))
