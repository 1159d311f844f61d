"""Quality against size: mean KL (log scale) over bits per element, one point per scheme."""

from __future__ import annotations

from pathlib import Path

from .kv_eval import SchemeResult


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    raw = next((r for r in results if r.scheme == "raw"), None)
    points = [r for r in results if r.scheme != "raw"]
    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=120)
    colors = plt.get_cmap("tab20").colors
    for i, r in enumerate(points):
        ax.scatter(r.bits_per_element, r.quality.mean_kl, s=40, color=colors[i % len(colors)],
                   marker="D" if "+" in r.scheme else "o", edgecolors="black", linewidths=0.4,
                   label=f"{r.scheme}: {r.bits_per_element:.3g} bits, top-1 {100 * r.quality.top1_agreement:.1f}%")
    ax.set_yscale("log")
    ax.set_xlabel("stored bits per K/V element (metadata included)")
    ax.set_ylabel("mean KL(raw ‖ scheme), nats per token")
    raw_note = f"; raw = {raw.bits_per_element:g} bits" if raw else ""
    ax.set_title(title + raw_note, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
