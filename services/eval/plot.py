"""Quality against size: mean KL (log scale) over bits per element, one point per scheme."""

from __future__ import annotations

from pathlib import Path

from .kv_eval import SchemeResult


def plot_quality(results: list[SchemeResult], path: Path, *, title: str) -> Path:
    """Write a PNG of mean KL(raw || scheme) against stored bits per element.

    The raw cache (KL 0) cannot sit on a log axis; its width is drawn as a vertical line.

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

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for r in results:
        if r.scheme == "raw":
            ax.axvline(r.bits_per_element, color="grey", linestyle=":", label=f"raw ({r.bits_per_element:g} bits)")
            continue
        ax.scatter(r.bits_per_element, r.quality.mean_kl, color="tab:orange" if r.scheme.startswith("aura") else "tab:blue")
        ax.annotate(f"{r.scheme}\n{100 * r.quality.top1_agreement:.1f}%", (r.bits_per_element, r.quality.mean_kl),
                    textcoords="offset points", xytext=(6, 2), fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("stored bits per K/V element (metadata included)")
    ax.set_ylabel("mean KL(raw ‖ scheme), nats per token")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
