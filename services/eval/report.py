"""`eval-kv` results as a JSON-ready dict and a markdown table."""

from __future__ import annotations

from dataclasses import asdict

from .kv_eval import EvalConfig, SchemeResult


def results_dict(results: list[SchemeResult], config: EvalConfig, *, model: str, dtype: str) -> dict:
    """Everything measured, plus the run's settings (JSON-serialisable)."""
    settings = asdict(config) | {"raw_layers": sorted(config.raw_layers), "schemes": list(config.schemes)}
    return {"model": model, "dtype": dtype, "corpus": "lee_background.cor", "settings": settings,
            "results": [_row(r) for r in results]}


def _row(result: SchemeResult) -> dict:
    return asdict(result) | {"divergence_tokens": list(result.divergence_tokens),
                             "mean_divergence_tokens": sum(result.divergence_tokens) / len(result.divergence_tokens)}


def markdown_table(results: list[SchemeResult]) -> str:
    """One row per scheme: bits/element, ratio to raw, KL, top-1, perplexity and its change, greedy match."""
    lines = [
        "| scheme | bits/elem | ratio to raw | mean KL(raw‖scheme) | top-1 agreement | perplexity | ppl change "
        "| greedy tokens before divergence (per prompt) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        q = r.quality
        lines.append(
            f"| {r.scheme} | {r.bits_per_element:.4g} | {r.ratio_to_raw:.4f} | {q.mean_kl:.5f} | "
            f"{100 * q.top1_agreement:.2f}% | {q.perplexity:.3f} | {100 * r.perplexity_change:+.2f}% | "
            f"{', '.join(map(str, r.divergence_tokens))} |"
        )
    return "\n".join(lines) + "\n"
