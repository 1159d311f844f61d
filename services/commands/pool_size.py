"""Size a KV pool: bytes per token, capacity and maximum concurrency per scheme for a memory budget.

Bytes per token come from the scheme registry the caches allocate with (`services/engine/sizing.py`),
for the model's geometry (read from its config; no weights are loaded) or one given by flags. The
capacity is what an engine started with the same `--kv-memory-gib` / `--kv-memory-fraction`
allocates and reports. A workload is described by prompt and output token counts, each a
number, a `LO-HI` range or a comma-separated sample:

    buttermilk pool-size --memory-gib 8 --prompt-tokens 200-2000 --output-tokens 256 --concurrency 32
    buttermilk pool-size --memory-fraction 0.5 --device gpu --schemes raw,aura4v4 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

from services.commands.options import layer_list

DEFAULT_CONTEXT = 4096


@dataclass(frozen=True, slots=True)
class TokenCounts:
    """A token-count distribution reduced to what sizing needs (tokens)."""

    mean: float
    max: int

    @classmethod
    def parse(cls, spec: str) -> TokenCounts:
        """`"512"`, `"128-2048"` (uniform) or `"100,250,4000"` (a sample).

        Raises:
            ValueError: not one of those forms, or a count below 0.
        """
        try:
            if "-" in spec:
                lo, hi = (int(x) for x in spec.split("-", 1))
                values = [lo, hi]
            else:
                values = [int(x) for x in spec.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"token counts {spec!r}: expected N, LO-HI or N1,N2,...") from None
        if not values or min(values) < 0 or ("-" in spec and values[0] > values[1]):
            raise ValueError(f"token counts {spec!r}: expected counts >= 0 (and LO <= HI)")
        return cls(mean=sum(values) / len(values), max=max(values))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--memory-gib", type=float, help="memory given to the KV pool, GiB")
    budget.add_argument("--memory-fraction", type=float, help="share of the device's memory given to the KV pool, (0, 1]")
    parser.add_argument("--model", default="default", help="model whose config gives the geometry (weights are not loaded)")
    parser.add_argument("--n-layers", type=int, help="geometry without a model: layers (with --n-kv-heads, --head-dim)")
    parser.add_argument("--n-kv-heads", type=int)
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"],
                        help="decides the `auto` dtype and the device memory (auto: gpu if there is one, as serve)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                        help="model dtype, which raw K/V use (auto: float32 on cpu, float16 on gpu)")
    parser.add_argument("--schemes", help="comma-separated --kv-cache values (default: every named scheme)")
    parser.add_argument("--kv-raw-layers", type=layer_list, default=(), help="comma-separated layers kept raw, e.g. 0,29")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (engine --page-size)")
    parser.add_argument("--context", type=int,
                        help=f"tokens per request for vLLM's line (default: the model's, else {DEFAULT_CONTEXT})")
    parser.add_argument("--window", type=int, help="sliding window per request, tokens (--kv-window-size)")
    parser.add_argument("--prompt-tokens", default="0", help="workload prompt tokens: N, LO-HI or N1,N2,...")
    parser.add_argument("--output-tokens", default="0", help="workload output tokens: N, LO-HI or N1,N2,...")
    parser.add_argument("--concurrency", type=int, default=0, help="requests the workload runs at once")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from services.engine.cache.schemes import SCHEMES

    report = build_report(args, schemes=(args.schemes or ",".join(SCHEMES)).split(","))
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def build_report(args: argparse.Namespace, *, schemes: list[str]) -> dict:
    """Every figure the command prints, as plain data.

    Raises:
        ValueError: a bad budget, scheme, geometry or token count (a one-line message).
    """
    import mlx.core as mx

    from services.engine import sizing
    from services.engine.cache.schemes import check_layer_numbers

    if args.device == "auto":
        args.device = "gpu" if mx.is_available(mx.gpu) else "cpu"
    geometry, context = _geometry(args)
    memory = sizing.budget_bytes(memory_gib=args.memory_gib, memory_fraction=args.memory_fraction,
                                 device_memory=_device_memory(args) if args.memory_fraction else None)  # fmt: skip
    prompt, output = TokenCounts.parse(args.prompt_tokens), TokenCounts.parse(args.output_tokens)
    if prompt.max >= context:
        raise ValueError(f"a prompt of {prompt.max} tokens leaves no room to generate in the context of "
                         f"{context} tokens (--context): the server refuses it")  # fmt: skip
    if args.concurrency < 0:
        raise ValueError(f"--concurrency {args.concurrency}: expected requests >= 0")
    lengths = {"context": context}
    if prompt.max + output.max > 0:  # a workload was given; the server caps output at the context
        worst = min(context, prompt.max + output.max)
        lengths |= {"mean": min(worst, max(1, round(prompt.mean + output.mean))), "worst": worst}
    worst = lengths.get("worst", context)
    raw_layers = frozenset(args.kv_raw_layers)
    for scheme in schemes:
        check_layer_numbers(scheme, raw_layers, geometry.n_layers, scheme_option="--schemes")
    page, window = args.page_size, args.window
    rows = []
    for scheme in schemes:
        per_token = sizing.bytes_per_token(scheme, geometry, raw_layers=raw_layers)
        capacity = sizing.capacity_tokens(memory, per_token, page_size=page)
        worst_slots = sizing.tokens_per_request(worst, page_size=page, window=window)
        rows.append({
            "scheme": scheme, "bytes_per_token": per_token, "capacity_tokens": capacity,
            "kv_bytes": capacity * per_token,
            "max_concurrency": {name: round(sizing.max_concurrency(capacity, n, page_size=page, window=window), 2)
                                for name, n in lengths.items()},
            "bytes_for_concurrency": args.concurrency * worst_slots * per_token,
            "fits_concurrency": args.concurrency * worst_slots <= capacity,
        })  # fmt: skip
    return {
        "memory_bytes": memory, "page_size": page, "window": window,
        "geometry": {"n_layers": geometry.n_layers, "n_kv_heads": geometry.n_kv_heads, "head_dim": geometry.head_dim,
                     "dtype": str(geometry.dtype).removeprefix("mlx.core.")},
        "workload": {"prompt_tokens": asdict(prompt), "output_tokens": asdict(output),
                     "concurrency": args.concurrency, "tokens_per_request": lengths},
        "rows": rows,
    }  # fmt: skip


def render(report: dict) -> str:
    """The report as an aligned table plus vLLM-worded concurrency lines."""
    from services.engine.sizing import GIB, concurrency_line

    g, w = report["geometry"], report["workload"]
    lengths = w["tokens_per_request"]
    lines = [
        f"KV pool: {report['memory_bytes'] / GIB:.2f} GiB; {g['n_layers']} layers x {g['n_kv_heads']} KV heads x "
        f"head_dim {g['head_dim']}, {g['dtype']}; pages of {report['page_size']} tokens"
        + (f"; window {report['window']} tokens" if report["window"] else ""),
        f"workload: {lengths.get('mean', '-')} tokens per request on average, {lengths.get('worst', '-')} at most, "
        f"concurrency {w['concurrency']}",
        "",
        f"{'scheme':<20}{'bytes/token':>12}{'capacity (tokens)':>19}{'KV GiB':>8}"
        f"{'conc@' + str(lengths['context']):>12}{'conc@mean':>11}{'conc@worst':>12}{'fits':>6}",
    ]
    for r in report["rows"]:
        c = {name: f"{x:.2f}x" for name, x in r["max_concurrency"].items()}
        lines.append(f"{r['scheme']:<20}{r['bytes_per_token']:>12,}{r['capacity_tokens']:>19,}{r['kv_bytes'] / GIB:>8.2f}"
                     f"{c['context']:>12}{c.get('mean', '-'):>11}{c.get('worst', '-'):>12}"
                     f"{'yes' if r['fits_concurrency'] else 'NO':>6}")  # fmt: skip
    lines.append("")
    for r in report["rows"]:
        lines.append(f"{r['scheme']}: KV cache {r['capacity_tokens']:,} tokens; "
                     f"{concurrency_line(lengths['context'], r['max_concurrency']['context'])}")  # fmt: skip
    return "\n".join(lines)


def _geometry(args: argparse.Namespace):
    """(KVGeometry, context tokens) from explicit flags or the model's config."""
    from services.engine.dtypes import DTYPES
    from services.engine.sizing import KVGeometry

    device_dtype = "float32" if args.device == "cpu" else "float16"  # what `auto` means on the device
    dtype = device_dtype if args.dtype == "auto" else args.dtype
    explicit = (args.n_layers, args.n_kv_heads, args.head_dim)
    if all(v is not None for v in explicit):
        if min(explicit) < 1:
            raise ValueError("--n-layers, --n-kv-heads and --head-dim must be >= 1")
        return KVGeometry(*explicit, DTYPES[dtype]), args.context or DEFAULT_CONTEXT
    if any(v is not None for v in explicit):
        raise ValueError("give all of --n-layers, --n-kv-heads and --head-dim, or none (to read --model)")
    config = _model_config(args.model, device_dtype)  # the conversion the engine would load (configs agree)
    cfg = config.get("text_config", config)
    context = args.context or int(cfg.get("max_position_embeddings") or DEFAULT_CONTEXT)
    return KVGeometry.from_config(config, DTYPES[dtype]), context


def _model_config(spec: str, dtype: str) -> dict:
    from mlx_lm.utils import load_config

    from services.engine.model.paths import resolve_model

    return load_config(resolve_model(spec, dtype=dtype))


def _device_memory(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from services.engine.sizing import device_memory_bytes

    if args.device == "cpu":
        return device_memory_bytes(mx.Device(mx.cpu))
    if not mx.is_available(mx.gpu):
        raise ValueError("--device gpu: no GPU on this machine; give --memory-gib instead")
    return device_memory_bytes(mx.Device(mx.gpu, 0))


def main(argv: list[str] | None = None) -> int:
    """`python -m ops.size_pool`: the same command outside the `buttermilk` entry point."""
    parser = argparse.ArgumentParser(prog="size_pool", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except ValueError as exc:
        print(f"size_pool: error: {exc}", file=sys.stderr)
        return 2
