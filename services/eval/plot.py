"""Quality against size: mean KL (log scale) over bits per element, one point per scheme."""

from __future__ import annotations

from pathlib import Path

from .calibrate import Calibration
from .kv_eval import SchemeResult

_X_LABEL = "stored bits per K/V element (metadata included)"
_Y_LABEL = "mean KL(raw ‖ scheme), nats per token"


def plot_quality(results: list[SchemeResult], path: Path, *, title: str) -> Path:
    """Write a PNG of mean KL(raw || scheme) against stored bits per element.

    The raw cache (KL 0) cannot sit on a log axis; its width is given in the title. Schemes
    with layer overrides (`+1=aura8v8`) are drawn as diamonds; the legend names every point
    with its top-1 agreement.

    Args:
        results (list[SchemeResult]): `evaluate` output.
        path (Path): PNG file to write.
        title (str): Figure title.

    Returns:
        Path: `path`.
    """
    plt, fig, ax = _figure()
    raw = next((r for r in results if r.scheme == "raw"), None)
    points = [r for r in results if r.scheme != "raw"]
    colors = plt.get_cmap("tab20").colors
    for i, r in enumerate(points):
        ax.scatter(r.bits_per_element, r.quality.mean_kl, s=40, color=colors[i % len(colors)],
                   marker="D" if "+" in r.scheme else "o", edgecolors="black", linewidths=0.4,
                   label=f"{r.scheme}: {r.bits_per_element:.3g} bits, top-1 {100 * r.quality.top1_agreement:.1f}%")
    raw_note = f"; raw = {raw.bits_per_element:g} bits" if raw else ""
    return _finish(plt, fig, ax, path, title + raw_note)


def plot_calibration(calibration: Calibration, path: Path, *, title: str) -> Path:
    """Write a PNG of held-out mean KL against bits: every reference scheme and the calibrated points.

    Calibrated allocations are stars joined by a line; their predicted KL (the additive model
    on the calibration tokens) are hollow triangles at the same bits.

    Args:
        calibration (Calibration): `calibrate` output.
        path (Path): PNG file to write.
        title (str): Figure title.

    Returns:
        Path: `path`.
    """
    plt, fig, ax = _figure()
    colors = plt.get_cmap("tab20").colors
    references = [r for r in calibration.references if r.scheme != "raw"]
    for i, r in enumerate(references):
        ax.scatter(r.bits_per_element, r.quality.mean_kl, s=40, color=colors[i % len(colors)],
                   marker="s" if r.scheme.startswith("affine") else "o", edgecolors="black", linewidths=0.4,
                   label=f"{r.scheme}: {r.bits_per_element:.3g} bits, KL {r.quality.mean_kl:.4f}")
    points = calibration.points
    bits = [p.heldout.bits_per_element for p in points]
    kls = [p.heldout.quality.mean_kl for p in points]
    ax.plot(bits, kls, "-*", color="crimson", markersize=11, markeredgecolor="black", markeredgewidth=0.4,
            label="calibrated, held out")
    for x, kl in zip(bits, kls):
        ax.annotate(f"{kl:.2g}", (x, kl), textcoords="offset points", xytext=(6, 4), fontsize=7, color="crimson")
    ax.scatter(bits, [p.allocation.predicted_kl for p in points], s=30, marker="^", facecolors="none",
               edgecolors="crimson", label="calibrated, predicted (calibration half)")
    return _finish(plt, fig, ax, path, title)


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=120)
    return plt, fig, ax


def _finish(plt, fig, ax, path: Path, title: str) -> Path:
    ax.set_yscale("log")
    ax.set_xlabel(_X_LABEL)
    ax.set_ylabel(_Y_LABEL)
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
