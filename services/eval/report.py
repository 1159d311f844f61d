"""`eval-kv` results as a JSON-ready dict and markdown tables."""

from __future__ import annotations

from dataclasses import asdict, replace

from .kv_eval import EvalConfig, SchemeResult
from .recall import FACTS, RecallAnswer, RecallResult


def results_dict(results: list[SchemeResult], config: EvalConfig, *, model: str, dtype: str) -> dict:
    """Everything measured, plus the run's settings (JSON-serialisable)."""
    settings = asdict(replace(config, key_means=None))
    del settings["key_means"]
    settings |= {"raw_layers": sorted(config.raw_layers), "schemes": list(config.schemes),
                 "center_keys": config.key_means is not None}
    facts = [asdict(f) for f in FACTS[: config.recall_keys]]
    return {"model": model, "dtype": dtype, "corpus": "lee_background.cor", "settings": settings,
            "recall_keys": facts, "results": [_row(r) for r in results]}


def _row(result: SchemeResult) -> dict:
    return asdict(result) | {"divergence_tokens": list(result.divergence_tokens),
                             "mean_divergence_tokens": sum(result.divergence_tokens) / len(result.divergence_tokens)}


def markdown_table(results: list[SchemeResult]) -> str:
    """One row per scheme: bits/element, ratio to raw, KL, top-1, perplexity and its change, greedy match.

    With the recall check on, a last column counts the answers equal to the raw full cache's,
    with the full cache and under the window; `recall_table` lists the answers.
    """
    has_recall = any(r.recall for r in results)
    lines = [
        "| scheme | bits/elem | ratio to raw | mean KL(raw‖scheme) | top-1 agreement | perplexity | ppl change "
        "| greedy tokens before divergence (per prompt) |" + (" recall = raw (full; window) |" if has_recall else ""),
        "|---|---:|---:|---:|---:|---:|---:|---|" + ("---|" if has_recall else ""),
    ]
    for r in results:
        q = r.quality
        lines.append(
            f"| {r.scheme} | {r.bits_per_element:.4g} | {r.ratio_to_raw:.4f} | {q.mean_kl:.5f} | "
            f"{100 * q.top1_agreement:.2f}% | {q.perplexity:.3f} | {100 * r.perplexity_change:+.2f}% | "
            f"{', '.join(map(str, r.divergence_tokens))} |" + (f" {_recall_counts(r.recall)} |" if has_recall else "")
        )
    return "\n".join(lines) + "\n"


def recall_table(results: list[SchemeResult]) -> str:
    """Per scheme and pass key: the answer's value, full cache and under the window; `*` marks one unlike raw's."""
    first = next((r.recall for r in results if r.recall), None)
    if first is None:
        return ""
    facts = range(len(first.full))
    lines = [f"Passkey retrieval (the digits after \"The pass key is\"; window {first.window_size} tokens with the "
             "key in its sinks; * = differs from raw's full-cache answer):", "",
             "| scheme | " + " | ".join(f"key {i + 1}: full | key {i + 1}: window" for i in facts) + " |",
             "|---|" + "---|---|" * len(first.full)]
    for r in results:
        cells = [_answer(a) for i in facts for a in (r.recall.full[i], r.recall.windowed[i])]
        lines.append(f"| {r.scheme} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _recall_counts(recall: RecallResult | None) -> str:
    if recall is None:
        return ""
    total = len(recall.full)
    full, windowed = sum(a.matches_raw for a in recall.full), sum(a.matches_raw for a in recall.windowed)
    return f"{full}/{total}; {windowed}/{total}"


def _answer(answer: RecallAnswer) -> str:
    shown = answer.value or answer.text.replace("|", "\\|").replace("\n", " ").strip()
    return f"{'' if answer.matches_raw else '* '}{shown}"
