"""Decode-attention kernel time under Nsight Compute: one layer's launches, at locked clocks, per case.

CUPTI timings of single-stream launches (`ops/kernel_sweep.py --gpu-time`) moved up to 15% between
rounds of one shape (boost clocks); `ncu` locks the SM clock at base (1.41 GHz on the H200) and
flushes the caches before every profiled launch (against ~1.98 GHz boost: times up to 1.4x the engine's), which makes
A/B comparisons of launch shapes, or of two trees' kernels, repeatable to a few percent. Each case builds
one layer of random pools (`ops.kernel_sweep`), launches `kernels.cuda_kv.decode_attention` once to
compile, then `--launches` times; the report is the median partial, combine and total time (us).

    python -m ops.ncu_time --cases qwen3-1.7b:affine4:8192,qwen3-1.7b:affine4:8192:warps=4/unroll=1
    python -m ops.ncu_time --cases llama-1b:raw:32768 --out /tmp/ab.json   # run again in another tree to A/B
    python -m ops.ncu_time --cases llama-1b:raw:8192 --ncu "sudo -E ncu"    # where counters need privileges

Needs `ncu` (CUDA toolkit) and MLX's CUDA backend; writes JSON (not a test).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

METRIC = "gpu__time_duration.sum"


def parse_case(text: str) -> tuple[str, str, int, dict[str, int]]:
    """`MODEL:SCHEME:CONTEXT[:FIELD=INT/...]` as (model, scheme, context tokens, `Tuning` overrides).

    Raises:
        ValueError: fewer than three fields, a model `ops.kernel_sweep` has no shape for, a scheme
            `services.engine.cache.schemes.layer_format` refuses, a context that is not a positive integer, or a
            bad override.
    """
    import mlx.core as mx

    from ops.gpu_time import tuning_override
    from ops.kernel_sweep import SHAPES
    from services.engine.cache.schemes import layer_format

    parts = text.split(":")
    if len(parts) not in (3, 4) or not parts[2].isdigit() or int(parts[2]) < 1:
        raise ValueError(f"a case is MODEL:SCHEME:CONTEXT[:FIELD=INT/...], got {text!r}")
    if parts[0] not in SHAPES:
        raise ValueError(f"{text!r}: models are {sorted(SHAPES)}")
    layer_format(parts[1], layer=0, dtype=mx.bfloat16, head_dim=SHAPES[parts[0]][3])  # raises for a bad scheme
    return parts[0], parts[1], int(parts[2]), tuning_override(parts[3].replace("/", ",") if len(parts) == 4 else "")


def launch(cases: list[str], launches: int, manifest: Path) -> None:
    """The profiled child: each case's decode attention 1 + `launches` times; the manifest lists the calls."""
    import dataclasses

    import mlx.core as mx

    from kernels import cuda_kv
    from ops.kernel_sweep import PAGE, SHAPES, decode_inputs
    from services.engine.cache.schemes import layer_format

    out = []
    for case in cases:
        model, scheme, context, overrides = parse_case(case)
        _, _, n_kv, head_dim = SHAPES[model]
        fmt = layer_format(scheme, layer=0, dtype=mx.bfloat16, head_dim=head_dim)
        tuning = dataclasses.replace(cuda_kv.default_tuning(fmt, n_kv), **overrides)
        (pools,), table, lengths, q = decode_inputs(fmt, SHAPES[model], 1, context, layers=1)
        for _ in range(launches + 1):
            q = cuda_kv.decode_attention(q, fmt, pools, None, table, lengths, n_kv_heads=n_kv, page_size=PAGE,
                                         scale=head_dim**-0.5, tuning=tuning)
            mx.eval(q)
        out.append({"case": case, "calls": launches + 1})
        del pools
        mx.clear_cache()
    manifest.write_text(json.dumps(out))


def call_times(csv_text: str) -> list[tuple[float, float]]:
    """(partial, combine) ns of each decode-attention call, in launch order, from `ncu --csv --print-units base
    --metrics gpu__time_duration.sum` output: a partial kernel starts a call, a combine kernel joins the last one
    (a one-split launch has none: 0). Lines that are not CSV (the program's, ncu's notes) and repeated headers
    are skipped.

    Raises:
        ValueError: a combine kernel before any partial kernel.
    """
    rows = list(csv.reader(io.StringIO("".join(line for line in csv_text.splitlines(True) if line.startswith('"')))))
    if not rows:
        return []
    header, calls = rows[0], []
    name, metric, value = header.index("Kernel Name"), header.index("Metric Name"), header.index("Metric Value")
    for row in rows[1:]:
        if row[metric] != METRIC:
            continue
        ns = float(row[value].replace(",", ""))
        if "combine" in row[name]:
            if not calls:
                raise ValueError(f"a combine kernel before any partial kernel: {row[name]!r}")
            calls[-1][1] += ns
        else:
            calls.append([ns, 0.0])
    return [tuple(c) for c in calls]


def summarize(manifest: list[dict], calls: list[tuple[float, float]]) -> dict[str, dict[str, float]]:
    """Median partial, combine and total us per case over its calls after the first (which compiles).

    Raises:
        ValueError: the profile holds a different number of calls than the manifest lists.
    """
    if sum(m["calls"] for m in manifest) != len(calls):
        raise ValueError(f"the manifest lists {sum(m['calls'] for m in manifest)} calls, the profile {len(calls)}")
    out, i = {}, 0
    for m in manifest:
        timed, i = calls[i + 1 : i + m["calls"]], i + m["calls"]
        out[m["case"]] = {key: round(statistics.median(f(c) for c in timed) / 1e3, 2) for key, f in
                          (("partial_us", lambda c: c[0]), ("combine_us", lambda c: c[1]),
                           ("total_us", lambda c: c[0] + c[1]))}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", required=True, help="MODEL:SCHEME:CONTEXT[:FIELD=INT/...], comma-separated")
    parser.add_argument("--launches", type=int, default=5, help="timed launches per case (after one that compiles)")
    parser.add_argument("--ncu", default="ncu", help="the command that runs Nsight Compute (e.g. \"sudo -E ncu\")")
    parser.add_argument("--out", type=Path, help="JSON path (default: print only)")
    parser.add_argument("--launch-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--manifest", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    if args.launches < 1:
        parser.error("--launches is at least 1")
    for case in cases:  # refuse a bad case before starting ncu
        try:
            parse_case(case)
        except ValueError as exc:
            parser.error(str(exc))
    if args.launch_child:
        launch(cases, args.launches, args.manifest)
        return
    ncu = shlex.split(args.ncu)
    if not ncu or shutil.which(ncu[-1]) is None:
        parser.error(f"Nsight Compute ({args.ncu!r}) is not on this machine (--ncu names it)")
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / "manifest.json"
        profile = subprocess.run([*ncu, "--csv", "--print-units", "base", "--metrics", METRIC, "-k",
                                  "regex:paged_decode", sys.executable, "-m", "ops.ncu_time", "--launch-child",
                                  "--cases", args.cases, "--launches", str(args.launches), "--manifest", str(manifest)],
                                 capture_output=True, text=True)
        notes = "".join(line for line in profile.stdout.splitlines(True) if not line.startswith('"'))
        try:
            if profile.returncode != 0 or not manifest.exists():
                raise ValueError(f"exit {profile.returncode}")
            result = summarize(json.loads(manifest.read_text()), call_times(profile.stdout))
        except ValueError as exc:  # ncu's own messages (e.g. ERR_NVGPUCTRPERM) go to its stdout
            sys.exit(f"ncu_time: the profiled run failed ({exc}):\n{(notes + profile.stderr)[-3000:]}")
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
