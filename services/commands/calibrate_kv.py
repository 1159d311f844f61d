"""Choose per-layer K and V cache widths for a bits/element budget, from each layer's measured sensitivity.

Calibrates on the first half of --text (the Lee corpus by default; any UTF-8 file): the mean
KL(raw || scheme) when only one layer's K, or only its V, is compressed at each AURA width
(--widths, 2..10 bits). Per --budgets target (average stored bits per K/V element, metadata included) it
picks the widths minimizing the summed KL (an exact knapsack) and writes them as a --kv-cache
spec. Then it measures every spec and the --schemes references on the held-out second half.
Writes calibrate_kv.json, calibrate_kv.md, calibrate_kv.png and one calibrated_{budget}.kvcache
per budget (the spec on one line: --kv-cache "$(cat FILE)") to --out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from services.commands.eval_kv import DEFAULT_SCHEMES
from services.commands.progress import RunProgress

DEFAULT_OUT = Path("ops/results/eval_kv")
DEFAULT_BUDGETS = "3.25,4.25,6.25,8.25"


def _numbers(kind):
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a local folder")
    parser.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                        help="weight dtype (auto: float32 on CPU); the raw reference stores K/V in it")
    parser.add_argument("--text", type=Path, help="UTF-8 calibration text (default: the Lee corpus)")
    parser.add_argument("--budgets", type=_numbers(float), default=_numbers(float)(DEFAULT_BUDGETS),
                        help=f"target bits/element, comma-separated (default {DEFAULT_BUDGETS}; each affine "
                             "reference's bits are added)")
    parser.add_argument("--schemes", default=DEFAULT_SCHEMES,
                        help=f"reference schemes measured held out (default {DEFAULT_SCHEMES})")
    parser.add_argument("--widths", type=_numbers(int), help="candidate AURA widths (default 2,3,...,10)")
    parser.add_argument("--calibration-tokens", type=int, default=512, help="tokens from the first half (default 512)")
    parser.add_argument("--heldout-tokens", type=int, default=2048, help="tokens from the second half (default 2048)")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per forward (default 256)")
    parser.add_argument("--sensitivity", type=Path,
                        help="reuse the sensitivities in a calibrate_kv.json from the same model, text and settings")
    parser.add_argument("--no-center-keys", dest="center_keys", action="store_false",
                        help="store compressed keys as they come (default: centered on their calibration means)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")


def run(args: argparse.Namespace) -> int:
    from kernels.aura import GAINS
    from services.engine.model.loader import load_model
    from services.eval.calibrate import CalibrationConfig, calibrate, check_config
    from services.eval.calibrate_report import markdown_report, results_dict
    from services.eval.corpus import LEE_CORPUS
    from services.eval.plot import plot_calibration
    from services.eval.sensitivity import WIDTHS, attention_layers, layer_runs

    text_path = args.text or LEE_CORPUS
    text = read_text(text_path)
    loaded = load_model(args.model, dtype=args.dtype)
    source = {"model": loaded.path.name, "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
              "calibration_tokens": args.calibration_tokens, "chunk": args.chunk, "center_keys": args.center_keys,
              "aura_gains": len(GAINS)}
    sensitivity = None if args.sensitivity is None else load_sensitivity(args.sensitivity, source)
    widths = (args.widths or WIDTHS) if sensitivity is None else sensitivity.widths
    config = CalibrationConfig(budgets=args.budgets, reference_schemes=tuple(s for s in args.schemes.split(",") if s),
                               calibration_tokens=args.calibration_tokens, heldout_tokens=args.heldout_tokens,
                               chunk=args.chunk, widths=widths, center_keys=args.center_keys)
    check_config(loaded.model, config)
    layers = len(attention_layers(loaded.model))
    runs = 0 if sensitivity else layers * len(layer_runs(widths))
    if sensitivity is None or not sensitivity.whole_kl:
        runs += layers * sum(s != "raw" for s in config.whole_schemes)
    affine = sum(s.startswith("affine") for s in config.reference_schemes)  # each adds its bits as a budget
    runs += len(config.reference_schemes) + len(config.budgets) + affine
    progress = RunProgress(runs, "calibrate-kv")
    try:
        calibration = calibrate(loaded.model, loaded.tokenizer, text, config, sensitivity=sensitivity,
                                on_run=progress.step)
    finally:
        progress.close()
    dtype = str(loaded.dtype).removeprefix("mlx.core.")
    args.out.mkdir(parents=True, exist_ok=True)
    report = results_dict(calibration, config, model=loaded.path.name, dtype=dtype, text=text_path.name)
    (args.out / "calibrate_kv.json").write_text(json.dumps(report | {"source": source}, indent=2) + "\n")
    markdown = markdown_report(calibration)
    (args.out / "calibrate_kv.md").write_text(markdown)
    for point in calibration.points:
        (args.out / f"calibrated_{point.allocation.target_bits:g}.kvcache").write_text(point.allocation.spec + "\n")
    title = (f"{loaded.path.name} ({dtype}): calibrated on {args.calibration_tokens} tokens of {text_path.name}'s\n"
             f"first half, measured on {args.heldout_tokens} of its second")
    plot_calibration(calibration, args.out / "calibrate_kv.png", title=title)
    print(markdown, end="")
    return 0


def read_text(path: Path) -> str:
    """The calibration text.

    Raises:
        ValueError: the file is not UTF-8.
        OSError: it cannot be read.
    """
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def load_sensitivity(path: Path, source: dict):
    """The sensitivity table of an earlier calibrate_kv.json, if measured under the same `source`.

    Raises:
        ValueError: not such a file, or measured with another model, text or settings.
        OSError: it cannot be read.
    """
    from services.eval.sensitivity import Sensitivity

    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        # older tables: keys as they came, AURA codes of the nearest centroids (one gain)
        saved, table = {"center_keys": False, "aura_gains": 1} | report["source"], report["sensitivity"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a calibrate_kv.json ({exc})") from None
    if saved != source:
        diff = {k: (saved.get(k), v) for k, v in source.items() if saved.get(k) != v}
        raise ValueError(f"{path} was measured under other settings (saved, now): {diff}")
    return Sensitivity.from_dict(table)
