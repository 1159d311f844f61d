"""`calibrate-kv` results: a JSON-ready dict, a markdown report, and the affine comparison."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kernels.aura import parse_aura_scheme

from .calibrate import Calibration, CalibrationConfig, Measured
from .sensitivity import PARTNER_BITS, Sensitivity


@dataclass(frozen=True, slots=True)
class AffineComparison:
    """A calibrated allocation against an affine scheme it spends no more bytes than."""

    affine: str
    affine_bits: float  # bits per element
    affine_kl: float  # held-out mean KL (nats per token)
    calibrated_bits: float
    calibrated_kl: float

    @property
    def is_better(self) -> bool:
        return self.calibrated_bits <= self.affine_bits and self.calibrated_kl < self.affine_kl


def affine_comparisons(calibration: Calibration) -> list[AffineComparison]:
    """Per affine reference: the lowest-KL calibrated point at equal or fewer bits (if any)."""
    out = []
    for ref in calibration.references:
        fitting = [p.heldout for p in calibration.points if p.heldout.bits_per_element <= ref.bits_per_element + 1e-9]
        if ref.scheme.startswith("affine") and fitting:
            best = min(fitting, key=lambda m: m.quality.mean_kl)
            out.append(AffineComparison(ref.scheme, ref.bits_per_element, ref.quality.mean_kl,
                                        best.bits_per_element, best.quality.mean_kl))
    return out


def results_dict(calibration: Calibration, config: CalibrationConfig, *, model: str, dtype: str, text: str) -> dict:
    """Everything measured, plus the run's settings (JSON-serialisable)."""
    return {
        "model": model, "dtype": dtype, "text": text, "settings": asdict(config),
        "overhead_bits": calibration.overhead_bits,
        "sensitivity": calibration.sensitivity.to_dict(),
        "references": [asdict(r) for r in calibration.references],
        "calibrated": [asdict(p) for p in calibration.points],
        "affine_comparisons": [asdict(c) | {"is_better": c.is_better} for c in affine_comparisons(calibration)],
    }


def markdown_report(calibration: Calibration) -> str:
    """Tables: every scheme by bits, the affine comparison, the specs, per-layer widths, sensitivities."""
    return "\n".join([_summary(calibration), _comparison(calibration), _specs(calibration),
                      _widths(calibration), _sensitivity(calibration.sensitivity)])


def _summary(calibration: Calibration) -> str:
    lines = ["| scheme | bits/elem | predicted KL | KL, calibration half | KL, held-out half | top-1 agreement "
             "| ppl change |", "|---|---:|---:|---:|---:|---:|---:|"]
    rows = [(r.bits_per_element, r.scheme, "", "", r) for r in calibration.references]
    rows += [(p.heldout.bits_per_element, f"calibrated ≤ {p.allocation.target_bits:g}",
              f"{p.allocation.predicted_kl:.5f}", f"{p.calibration_kl:.5f}", p.heldout) for p in calibration.points]
    for bits, name, predicted, calibration_kl, measured in sorted(rows, key=lambda r: r[0]):
        lines.append(f"| {name} | {bits:.4g} | {predicted} | {calibration_kl} | {_quality(measured)} |")
    return "\n".join(lines) + "\n"


def _quality(measured: Measured) -> str:
    q = measured.quality
    return f"{q.mean_kl:.5f} | {100 * q.top1_agreement:.2f}% | {100 * measured.perplexity_change:+.2f}%"


def _comparison(calibration: Calibration) -> str:
    lines = ["| affine scheme | its bits | its KL | calibrated bits | calibrated KL | calibrated better |",
             "|---|---:|---:|---:|---:|---|"]
    for c in affine_comparisons(calibration):
        lines.append(f"| {c.affine} | {c.affine_bits:.4g} | {c.affine_kl:.5f} | {c.calibrated_bits:.4g} | "
                     f"{c.calibrated_kl:.5f} | {'yes' if c.is_better else 'NO'} |")
    return "\n".join(lines) + "\n"


def _specs(calibration: Calibration) -> str:
    lines = ["`--kv-cache` specs by budget (bits/element):", ""]
    lines += [f"- {p.allocation.target_bits:g}: `{p.allocation.spec}`" for p in calibration.points]
    return "\n".join(lines) + "\n"


def _widths(calibration: Calibration) -> str:
    points = calibration.points
    lines = ["| layer | " + " | ".join(f"K/V at {p.allocation.target_bits:g}" for p in points) + " |",
             "|---:|" + "---|" * len(points)]
    for i, layer in enumerate(calibration.sensitivity.layers):
        cells = [_widths_cell(p.allocation.schemes[i]) for p in points]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _widths_cell(scheme: str) -> str:
    try:
        return "{}/{}".format(*parse_aura_scheme(scheme))
    except ValueError:  # a whole-layer scheme (affine8, raw)
        return scheme


def _sensitivity(sensitivity: Sensitivity) -> str:
    """Per layer: KL (x1e3) with only its K at w bits (V at 8), only its V at w (K at 8), whole-layer schemes."""
    widths = sorted(set(sensitivity.widths) | {PARTNER_BITS})
    whole = [s for s in (sensitivity.whole_kl[0] if sensitivity.whole_kl else {}) if s != "raw"]
    lines = ["Mean KL x 1000 with one layer compressed (K at w: V at 8 bits; V at w: K at 8; "
             f"{sensitivity.num_tokens} calibration tokens):", "",
             "| layer | " + " | ".join(f"K{w}" for w in widths) + " | " +
             " | ".join([f"V{w}" for w in widths if w != PARTNER_BITS] + whole) + " |",
             "|---:|" + "---:|" * (2 * len(widths) - 1 + len(whole))]
    for i, layer in enumerate(sensitivity.layers):
        cells = [f"{1e3 * sensitivity.key_kl[i][w]:.3f}" for w in widths]
        cells += [f"{1e3 * sensitivity.value_kl[i][w]:.3f}" for w in widths if w != PARTNER_BITS]
        cells += [f"{1e3 * sensitivity.whole_kl[i][s]:.3f}" for s in whole]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
