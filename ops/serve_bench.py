"""The serving pipeline measured: `buttermilk serve` against `EngineCore` in process, same load.

Phases (`--phases`, in this order, each writing its part of `--out` as soon as it ends, so a
timeout still leaves data):

- `core`: the engine's own `EngineCore` (built by `services.commands.engine.build_service`
  with the serve settings) driven in this process, no sockets, at each concurrency;
- `serve`: `buttermilk serve --engines E` (real processes, 127.0.0.1), the same closed-loop
  token-id load through the gateway, each engine's device from `stats`;
- `kill` (E ≥ 2): `ops.serve_kill`, one engine SIGKILLed under load;
- `paired`: the engine core in this process and `serve --engines 1` both alive, each level run
  `--rounds` times on each, alternating which goes first and with fresh prompts every round, so a
  host that drifts slows both alike: `paired` gives the cost per token of every round and their
  median (the core and serve phases run one after the other, on a host whose pace may have
  moved between them; a 512-token prompt's prefill is most of a closed-loop level, so their
  levels swing by ±20% between calls).

Per level: TTFT, inter-token latency (ITL) and time per output token (TPOT) p50/p95 in ms,
aggregate completion tok/s; through `serve`, also each process's CPU time over the level (gateway,
controller, each engine: seconds, cores busy, µs per completion token), which tells a gateway that
caps the aggregate from engines that do. With both `core` and `serve` in `--out`, `overhead` gives the
pipeline's cost per token over the engine core at each level: `(core tok/s / serve tok/s − 1)`
in percent, and the TPOT p50 difference in ms. Levels run while `--deadline-s` allows.

    python -m ops.random_model --shape tiny --out /tmp/tiny --dtype float32
    python -m ops.serve_bench --model /tmp/tiny --device cpu --dtype float32 --concurrency 1,4 \\
        --prompt-tokens 64 --max-tokens 16 --phases core,serve --out /tmp/pipeline.json
    python -m ops.serve_bench --model /tmp/llama --engines 2 --phases serve,kill --out ...   # GPU
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

from ops.serve_kill import KILL_WAVE
from ops.serve_load import Workload, summarize
from ops.serving import cpu_seconds, engine_table, serve_roles


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model folder (e.g. from ops.random_model)")
    parser.add_argument("--out", type=Path, required=True, help="JSON file; phases add their keys to it")
    parser.add_argument("--phases", default="core,serve", help="comma-separated: core, serve, kill, paired")
    parser.add_argument("--rounds", type=lambda v: max(1, int(v)), default=3, help="paired: runs per level on each side (at least 1)")
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--device", default="auto", help="serve's --device (auto: one engine per GPU)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", default="1,8,16,32,64", type=lambda s: [int(x) for x in s.split(",") if x])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    parser.add_argument("--step-token-budget", type=int, default=512, help="engine tokens per step")
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--decode-window", type=int, default=None, help="engine decode steps per host sync (default: the engine's)")
    parser.add_argument("--launch-hold", action="store_true", help="serve's engines launch each decode window ahead as late as the GPU allows")
    parser.add_argument("--kill-streams", type=int, default=16, help="requests in flight at the kill")
    parser.add_argument("--kill-max-tokens", type=int, default=512, help="their length (keeps them running)")
    parser.add_argument("--ready-timeout-s", type=float, default=180.0)
    parser.add_argument("--deadline-s", type=float, default=400.0, help="no new level starts after this")
    parser.add_argument("--no-warmup", action="store_true", help="skip the short warm-up pass per level")
    parser.add_argument("--label", default="", help="key suffix in --out, e.g. '_shared' (E engines on one GPU)")
    return parser.parse_args(argv)


def sizes(args) -> dict:
    """Engine sizes that hold every client's request at once (tokens, slots).

    The kill check needs room on one engine for its streams and the wave sent during the restart.
    """
    most = max(args.concurrency + [args.kill_streams + KILL_WAVE])
    per_request = args.prompt_tokens + max(args.max_tokens, args.kill_max_tokens)
    found = {"capacity_tokens": most * (per_request + 16) + 1024, "max_slots": most,
             "step_token_budget": args.step_token_budget, "max_context": args.max_context}  # fmt: skip
    if args.decode_window is not None:
        found["decode_window"] = args.decode_window
    return found


class Report:
    """The `--out` JSON, re-written whole after every change (a killed run keeps what it had)."""

    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.is_file() else {}

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.data["overhead"] = overhead(self.data)
        self.data["scaling"] = scaling(self.data)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n")
        os.replace(tmp, self.path)


def overhead(data: dict) -> list[dict]:
    """Per concurrency in both `core` and `serve_e1` levels: the pipeline's cost per token."""
    core = {lvl["concurrency"]: lvl for lvl in data.get("core", {}).get("levels", [])}
    rows = []
    for lvl in data.get("serve_e1", {}).get("levels", []):
        base = core.get(lvl["concurrency"])
        if base and lvl.get("throughput_tok_s") and base.get("throughput_tok_s"):
            tpot = (lvl["tpot_ms"]["p50"], base["tpot_ms"]["p50"])
            rows.append({"concurrency": lvl["concurrency"], "serve_tok_s": lvl["throughput_tok_s"],
                         "core_tok_s": base["throughput_tok_s"],
                         "cost_per_token_pct": round((base["throughput_tok_s"] / lvl["throughput_tok_s"] - 1) * 100, 2),
                         "tpot_p50_ms_over_core": round(tpot[0] - tpot[1], 3) if None not in tpot else None})  # fmt: skip
    return rows


def scaling(data: dict) -> list[dict]:
    """Per concurrency: aggregate tok/s of each multi-engine run over the one-engine run.

    `ideal_ratio` is what E engines could reach at C clients if each served its C/E clients as
    one engine did (`E × tok/s(C/E) / tok/s(C)`, both from the one-engine run; present when C/E
    was a level): an engine whose step time barely grows from C/E to C rows gains little from
    splitting them, however well the pipeline balances.
    """
    one = {lvl["concurrency"]: lvl.get("throughput_tok_s") for lvl in data.get("serve_e1", {}).get("levels", [])}
    rows = []
    for key in sorted(k for k, v in data.items() if k.startswith("serve_e") and k != "serve_e1" and isinstance(v, dict)):
        engines = len(data[key].get("engines", [])) or int(key.removeprefix("serve_e").split("_")[0])
        for lvl in data[key].get("levels", []):
            c, base = lvl["concurrency"], one.get(lvl["concurrency"])
            if base and lvl.get("throughput_tok_s"):
                row = {"run": key, "concurrency": c, "tok_s": lvl["throughput_tok_s"], "e1_tok_s": base,
                       "ratio": round(lvl["throughput_tok_s"] / base, 3)}  # fmt: skip
                share = one.get(c // engines) if c % engines == 0 else None
                if share:
                    row["ideal_ratio"] = round(engines * share / base, 3)
                rows.append(row)
    return rows


def summary_lines(data: dict) -> list[str]:
    """A short human summary of a report (the run's last lines)."""
    lines = []
    for key, part in data.items():
        if key.endswith("_error"):
            lines.append(f"{key}: {part}")
        if not (key == "core" or key.startswith("serve_e")) or not isinstance(part, dict):
            continue
        devices = [e.get("device") for e in part.get("engines", [])] or [part.get("device")]
        lines.append(f"{key}: devices {devices}")
        for lvl in part.get("levels", []):
            if "skipped" in lvl:
                lines.append(f"  c={lvl['concurrency']}: skipped ({lvl['skipped']})")
                continue
            lines.append(f"  c={lvl['concurrency']}: {lvl['throughput_tok_s']} tok/s, TTFT p50/p95 "
                         f"{lvl['ttft_ms']['p50']}/{lvl['ttft_ms']['p95']} ms, TPOT p50/p95 "
                         f"{lvl['tpot_ms']['p50']}/{lvl['tpot_ms']['p95']} ms, ITL p95 {lvl['itl_ms']['p95']} ms, "
                         f"failed {lvl['failed']}")  # fmt: skip
            if lvl.get("cpu"):
                lines.append("    cpu: " + ", ".join(f"{role} {c['cores_busy']} cores, {c['us_per_token']} µs/token"
                                                    for role, c in lvl["cpu"].items()))  # fmt: skip
    lines += [f"overhead c={r['concurrency']}: {r['cost_per_token_pct']}% per token" for r in data.get("overhead", [])]
    lines += [f"paired c={lv['concurrency']}: core {lv['core_tok_s']} vs serve {lv['serve_tok_s']} tok/s, cost per "
              f"token {lv['rounds_pct']} %, median {lv['cost_per_token_pct']} %"
              for lv in data.get("paired", {}).get("levels", []) if "skipped" not in lv]  # fmt: skip
    lines += [f"scaling {r['run']} c={r['concurrency']}: x{r['ratio']}"
              + (f" (ideal x{r['ideal_ratio']})" if "ideal_ratio" in r else "") for r in data.get("scaling", [])]
    for key in [k for k, v in data.items() if k.startswith("kill") and isinstance(v, dict) and "checks" in v]:
        lines.append(f"{key}: ok={data[key]['ok']} {data[key]['checks']} in-flight {data[key]['in_flight']['outcomes']}")
    return lines


def run_levels(args, run_one, deadline: float, on_level) -> list[dict]:
    """Warm up and measure each concurrency while the deadline allows; `on_level` sees each result."""
    levels = []
    for concurrency in args.concurrency:
        if time.monotonic() > deadline:
            levels.append({"concurrency": concurrency, "skipped": "deadline"})
            continue
        if not args.no_warmup:
            run_one(workload(args, max_tokens=8, requests=1), concurrency)
        levels.append(summarize(run_one(workload(args), concurrency), concurrency))
        on_level(levels)
    return levels


def workload(args, **changes) -> Workload:
    config = json.loads((Path(args.model) / "config.json").read_text())
    base = Workload(vocab_size=config.get("text_config", config)["vocab_size"], prompt_tokens=args.prompt_tokens,
                    max_tokens=args.max_tokens, requests_per_client=args.requests)  # fmt: skip
    if "requests" in changes:
        changes["requests_per_client"] = changes.pop("requests")
    return dataclasses.replace(base, **changes)


def build_core(args):
    """`EngineCore` in this process on the device the first engine would get, and its description."""
    from services.commands.engine import build_service, describe_device, select_device
    from shared.settings import EngineSettings
    from services.commands.serve import engine_placement, resolve_device, visible_gpus

    gpus = visible_gpus()
    device, env = engine_placement(resolve_device(args.device, gpus), 0, gpus)
    os.environ.update(env)  # before MLX touches CUDA
    select_device(device)
    start = time.monotonic()
    settings = EngineSettings(model=args.model, dtype=args.dtype, device=device, **sizes(args))
    core = build_service(settings).core
    info = {"device": describe_device(device), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "load_s": round(time.monotonic() - start, 2), "settings": sizes(args)}  # fmt: skip
    return core, info


def phase_core(args, report: Report, deadline: float) -> None:
    """EngineCore in this process, on the device the first engine would get."""
    from ops.serve_load import core_level

    core, info = build_core(args)
    levels = run_levels(args, lambda w, c: core_level(core, w, c), deadline,
                        lambda lv: report.put("core", {**info, "levels": lv}))  # fmt: skip
    report.put("core", {**info, "levels": levels})
    del core
    import mlx.core as mx

    mx.clear_cache()  # a later phase's engines may share this GPU


def paired_costs(core_tok_s: list[float], serve_tok_s: list[float]) -> dict:
    """Each round's pipeline cost per token, `core / serve - 1` in percent, and their median.

    Args:
        core_tok_s, serve_tok_s: aggregate tok/s of the same rounds (equal lengths, > 0).

    Returns:
        `{"rounds_pct": [...], "cost_per_token_pct": median}` (the mean of the middle two for an
        even count), rounded to 0.01.
    """
    costs = [(c / s - 1) * 100 for c, s in zip(core_tok_s, serve_tok_s, strict=True)]
    return {"rounds_pct": [round(c, 2) for c in costs], "cost_per_token_pct": round(statistics.median(costs), 2)}


def phase_paired(args, report: Report, deadline: float, core, core_info: dict, server) -> None:
    """Each level `--rounds` times on the in-process core and through serve, alternating."""
    from ops.serve_load import WireLoad, core_level

    load = WireLoad(server.address, max(args.concurrency))
    sides = {"core": lambda w, c: core_level(core, w, c), "serve": load.run_level}
    levels = []

    def put() -> None:
        report.put("paired", {"core": core_info, "engines": engine_table(server.stats()),
                              "launch_hold": args.launch_hold, "levels": levels})  # fmt: skip

    try:
        for c in args.concurrency:
            if time.monotonic() > deadline:
                levels.append({"concurrency": c, "skipped": "deadline"})
                put()
                continue
            for side in sides.values() if not args.no_warmup else ():  # traces and allocator; prompts never measured
                side(workload(args, max_tokens=8, requests=1, seed=-1 - c), c)
            runs = {"core": [], "serve": []}
            for r in range(args.rounds):
                for name in ("core", "serve") if r % 2 == 0 else ("serve", "core"):
                    runs[name].append(summarize(sides[name](workload(args, seed=1000 * c + r), c), c))
            tok_s = {name: [lv["throughput_tok_s"] for lv in runs[name]] for name in runs}
            levels.append({"concurrency": c, "core_tok_s": tok_s["core"], "serve_tok_s": tok_s["serve"],
                           **paired_costs(tok_s["core"], tok_s["serve"]), "runs": runs})  # fmt: skip
            put()
    finally:
        load.close()


def serve_flags(args) -> list[str]:
    """serve's flags: sizes for every client at once; the kill check runs its streams on one connection."""
    most = str(max(args.concurrency + [args.kill_streams + KILL_WAVE]))
    flags = ["--model", args.model, "--engines", str(args.engines), "--device", args.device, "--dtype", args.dtype,
             "--max-active-requests", most, "--max-queue", "256", "--client-max-active", most,
             "--client-max-queued", most]  # fmt: skip
    for name, value in sizes(args).items():
        flags += ["--" + name.replace("_", "-"), str(value)]
    return flags + (["--launch-hold"] if args.launch_hold else [])


def phase_serve(args, report: Report, deadline: float, server) -> None:
    """Closed-loop levels through the gateway; each engine's peak slots per level."""
    from ops.serve_load import WireLoad

    key = f"serve_e{args.engines}{args.label}"
    info = {"engines": engine_table(server.stats()), "settings": sizes(args), "launch_hold": args.launch_hold,
            "ready_s": server.ready_s}  # fmt: skip
    load = WireLoad(server.address, max(args.concurrency))
    try:
        peaks: dict[str, int] = {}  # engine id -> most requests it held at once (sampled)
        per_request = args.prompt_tokens + args.max_tokens
        cpu: dict[str, tuple[float, float]] = {}  # role -> CPU seconds before and after the last run

        def sample() -> None:
            for e in server.stats().engines:
                peaks[e.engine_id] = max(peaks.get(e.engine_id, 0), e.reserved_tokens // per_request)

        def run_one(w, c):
            peaks.clear()
            roles = serve_roles(server.proc.pid)
            before = cpu_use(roles)
            records = load.run_level(w, c, on_wait=sample)
            after = cpu_use(roles)
            cpu.clear()
            cpu.update({role: (before[role], after[role]) for role in before.keys() & after.keys()})
            return records

        def on_level(levels):
            levels[-1]["peak_requests_per_engine"] = dict(peaks)
            levels[-1]["cpu"] = cpu_table(cpu, levels[-1]["wall_s"], levels[-1]["completion_tokens"])
            report.put(key, {**info, "levels": levels})

        levels = run_levels(args, run_one, deadline, on_level)
    finally:
        load.close()
    report.put(key, {**info, "levels": levels})


def cpu_use(roles: dict[str, int]) -> dict[str, float]:
    """CPU seconds used so far by each live process of `roles` (role -> pid); gone ones are left out."""
    used = {}
    for role, pid in roles.items():
        try:
            used[role] = cpu_seconds(pid)
        except OSError:
            continue
    return used


def cpu_table(cpu: dict[str, tuple[float, float]], wall_s: float, tokens: int) -> dict[str, dict]:
    """Per serve process over one level: CPU seconds, cores busy (CPU over wall time) and µs per token.

    Args:
        cpu: role -> CPU seconds (user + system) before and after the level.
        wall_s: the level's wall time, seconds.
        tokens: completion tokens the level streamed.
    """
    table = {}
    for role, (before, after) in sorted(cpu.items()):
        used = after - before
        table[role] = {"cpu_s": round(used, 3), "cores_busy": round(used / wall_s, 3) if wall_s > 0 else None,
                       "us_per_token": round(used * 1e6 / tokens, 1) if tokens else None}  # fmt: skip
    return table


def phase_kill(args, report: Report, server) -> None:
    from ops.serve_kill import kill_check

    w = workload(args, max_tokens=args.kill_max_tokens)
    report.put(f"kill{args.label}", asyncio.run(kill_check(server.address, w, streams=args.kill_streams)))


def run_server_phases(args, report: Report, deadline: float, server, phases: list[str]) -> None:
    label = f"e{args.engines}{args.label}"
    try:
        server.ready_s = round(server.wait_ready(args.ready_timeout_s), 2)
    except RuntimeError as exc:
        report.put(f"serve_{label}_error", str(exc))
        return
    if "serve" in phases:
        guarded(report, f"serve_{label}", lambda: phase_serve(args, report, deadline, server))
    if "kill" in phases and args.engines < 2:
        report.put(f"kill{args.label}", {"skipped": "needs --engines 2 or more"})
    elif "kill" in phases:
        guarded(report, f"kill{args.label}", lambda: phase_kill(args, report, server))


def run_paired(args, report: Report, deadline: float) -> None:
    """The `paired` phase: the core in this process, then `serve --engines 1` beside it."""
    from ops.serving import ServeProcess

    def phase() -> None:
        core, info = build_core(args)
        flags = serve_flags(argparse.Namespace(**{**vars(args), "engines": 1}))
        server = ServeProcess.launch(flags, engines=1, log_path=args.out.with_name(f"{args.out.stem}.paired.log"))
        try:
            server.wait_ready(args.ready_timeout_s)
            phase_paired(args, report, deadline, core, info, server)
        finally:
            server.stop()
            del core
            import mlx.core as mx

            mx.clear_cache()

    guarded(report, "paired", phase)


def guarded(report: Report, key: str, phase) -> None:
    """Run a phase; an exception is recorded under `<key>_error` and the next phase still runs."""
    try:
        phase()
    except Exception as exc:  # a benchmark reports what broke rather than losing later phases
        report.put(f"{key}_error", "".join(traceback.format_exception_only(exc)).strip()[-2000:])


def main(argv: list[str] | None = None) -> None:
    from ops.serving import ServeProcess

    args = parse_args(argv)
    # `timeout` sends SIGTERM: unwind through the `finally` blocks so serve and clients stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    deadline = time.monotonic() + args.deadline_s
    report = Report(args.out)
    phases = args.phases.split(",")
    if "core" in phases:
        guarded(report, "core", lambda: phase_core(args, report, deadline))
    if "paired" in phases:
        run_paired(args, report, deadline)
    if "serve" in phases or "kill" in phases:
        log = args.out.with_name(f"{args.out.stem}.serve_e{args.engines}{args.label}.log")
        server = ServeProcess.launch(serve_flags(args), engines=args.engines, log_path=log)
        try:
            run_server_phases(args, report, deadline, server, phases)
        finally:
            server.stop()
    print("\n".join(summary_lines(report.data)))


if __name__ == "__main__":
    main()
