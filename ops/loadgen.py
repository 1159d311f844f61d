"""Load generator: N concurrent streams through the real pipeline, against in-process baselines.

For each concurrency level N, N clients each send `--requests` greedy generates one after the
other (the same prompt, at most `--max-tokens` tokens) and the generator records, per request,
the time to first token (TTFT) and the gap between consecutive token messages (inter-token
latency, ITL; an engine step sends each stream one token). Throughput is completion tokens
over the level's wall time.

Baselines, measured first in this process with the server not yet started (so they do not
compete for the CPU): single-sequence `services.engine.generate.generate` and the batching
`EngineCore` driven directly (no sockets) with one request. The pipeline's per-token overhead
is its median ITL at N=1 minus each baseline's median per-token decode time.

    python -m ops.loadgen --start --concurrency 1,4,8          # starts `buttermilk serve` itself
    python -m ops.loadgen --address tcp://127.0.0.1:5555       # a server already running
    python -m ops.loadgen --workload prefix --schemes all      # shared system prompt (ops/prefix_workload.py)
    python -m ops.loadgen --workload flood --start             # one prompt through a flood (ops/flood_workload.py)
    python -m ops.loadgen --workload flood --start --flood-via http   # the same over HTTP, with and without `user`

Prints JSON and writes it to `ops/results/loadgen_<device>.json` (the other workloads:
`loadgen_<workload>_<device>.json`; a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from shared.blas import active_blas, reexec_with_blas
from shared.client import AsyncClient, Completion

RESULTS = Path(__file__).parent / "results"
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def percentiles(values: list[float]) -> dict:
    """p50 and p95 in milliseconds (nearest rank) of values in seconds."""
    if not values:
        return {"p50": None, "p95": None}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]

    return {"p50": round(rank(0.50) * 1000, 2), "p95": round(rank(0.95) * 1000, 2)}


def gaps(times_s: list[float]) -> list[float]:
    return [b - a for a, b in zip(times_s, times_s[1:])]


# ---- in-process baselines -----------------------------------------------------------------


def baseline_generate(loaded, ids: list[int], max_tokens: int) -> dict:
    """Single-sequence in-process generation: TTFT and per-token decode time, seconds."""
    from services.engine.cache import CacheOptions, make_layer_caches
    from services.engine.generate import GenerationStats, generate
    from shared.protocol import SamplingParams

    stats = GenerationStats()
    caches = make_layer_caches(loaded.model, CacheOptions(max_context=4096))
    for _ in generate(loaded.model, loaded.tokenizer, ids, caches, SamplingParams(max_tokens=max_tokens),
                      max_context=4096, stats=stats):  # fmt: skip
        pass
    per_token = stats.decode_s / max(1, stats.generated_tokens - 1)
    return {"ttft_ms": round(stats.prefill_s * 1000, 2), "per_token_ms": round(per_token * 1000, 2),
            "tokens": stats.generated_tokens}  # fmt: skip


def baseline_engine_core(loaded, ids: list[int], max_tokens: int) -> dict:
    """One request through `EngineCore.step()` in process (batching code, no sockets)."""
    from services.engine.cache import CacheOptions
    from services.engine.core import EngineCore
    from services.engine.request import Request
    from shared.protocol import SamplingParams

    core = EngineCore(loaded, CacheOptions(max_context=4096), capacity_tokens=4096, max_slots=8,
                      step_token_budget=256)  # fmt: skip
    start, times = time.perf_counter(), []
    core.add_request(Request("baseline", ids, SamplingParams(max_tokens=max_tokens)))
    while core.has_unfinished():
        for out in core.step():
            times += [time.perf_counter() - start] * len(out.new_token_ids)
    return {"ttft_ms": round(times[0] * 1000, 2), "per_token_ms": round(statistics.median(gaps(times)) * 1000, 2),
            "tokens": len(times)}  # fmt: skip


def baselines(model: str, max_tokens: int) -> tuple[dict, int]:
    from services.engine.model.loader import load_model

    loaded = load_model(model)
    ids = list(loaded.tokenizer.encode(PROMPT))
    baseline_generate(loaded, ids, 4)  # warm-up: first-call compilation and allocation
    result = {"generate": baseline_generate(loaded, ids, max_tokens),
              "engine_core": baseline_engine_core(loaded, ids, max_tokens)}  # fmt: skip
    return result, len(ids)


# ---- the pipeline -------------------------------------------------------------------------


async def stream_client(address: str, requests: int, max_tokens: int) -> list[Completion]:
    async with AsyncClient(address) as client:
        return [await client.generate(prompt=PROMPT, max_tokens=max_tokens, timeout_s=600) for _ in range(requests)]


async def run_level(address: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    start = time.perf_counter()
    results = await asyncio.gather(*(stream_client(address, requests, max_tokens) for _ in range(concurrency)))
    wall_s = time.perf_counter() - start
    done = [c for per_client in results for c in per_client]
    tokens = sum(c.usage.completion_tokens for c in done)
    itl = [g for c in done for g in gaps(c.token_times_s)]
    return {
        "concurrency": concurrency,
        "requests": len(done),
        "completion_tokens": tokens,
        "wall_s": round(wall_s, 2),
        "throughput_tok_s": round(tokens / wall_s, 2),
        "ttft_ms": percentiles([c.first_token_s for c in done if c.first_token_s is not None]),
        "itl_ms": percentiles(itl),
    }


def start_server(model: str, engines: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    argv = [sys.executable, "-m", "services.cli", "serve", "--model", model, "--address", address,
            "--engines", str(engines), "--http-address", "off", *extra]  # fmt: skip
    proc = subprocess.Popen(argv, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"buttermilk serve exited with {proc.returncode}")
        try:
            health = asyncio.run(_health(address))
            if health.engines_live == engines:
                return proc, address
        except TimeoutError:
            pass
        time.sleep(0.5)
    raise SystemExit("buttermilk serve did not become ready in 300 s")


async def _health(address: str):
    async with AsyncClient(address) as client:
        return await client.health(timeout_s=1.0)


def stop_server(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)


def main() -> None:
    reexec_with_blas("ops.loadgen")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="a running server (else --start)")
    parser.add_argument("--start", action="store_true", help="start `buttermilk serve` for the run")
    parser.add_argument("--model", default="default")
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--concurrency", default="1,4,8", help="comma-separated stream counts")
    parser.add_argument("--requests", type=int, default=2, help="requests per stream, one after another")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-baseline", action="store_true", help="skip the in-process baselines")
    parser.add_argument("--workload", choices=["streams", "prefix", "flood"], default="streams",
                        help="streams: N streams of one prompt; prefix: clients sharing a system prompt; "
                             "flood: one short prompt among connections flooding the tokenizer")  # fmt: skip
    parser.add_argument("--schemes", default="raw", help="prefix workload: comma-separated schemes, or all")
    parser.add_argument("--clients", type=int, help="prefix: concurrent clients (16); flood: flooding connections (4)")
    parser.add_argument("--system-tokens", type=int, default=1000, help="prefix workload: shared prompt tokens")
    parser.add_argument("--rounds", type=int, default=2, help="prefix workload: rounds of all clients at once")
    parser.add_argument("--flood-chars", type=int, default=1_000_000, help="flood workload: characters a prompt")
    parser.add_argument("--flood-head-start-s", type=float, default=1.0,
                        help="flood workload: seconds before the probe")
    parser.add_argument("--flood-via", choices=["zmq", "http"], default="zmq",
                        help="flood workload: the clients' transport (http: anonymous, then named users)")
    args = parser.parse_args()
    if args.workload != "streams":
        from ops import flood_workload, prefix_workload

        workload = {"prefix": prefix_workload, "flood": flood_workload}[args.workload]
        args.clients = args.clients or {"prefix": 16, "flood": 4}[args.workload]
        via = "_http" if args.workload == "flood" and args.flood_via == "http" else ""
        write_report(workload.run(args), f"loadgen_{args.workload}{via}_{args.device.replace(':', '')}.json")
        return
    if not args.address and not args.start:
        parser.error("give --address or --start")

    report = {"device": args.device, "blas": active_blas(), "model": args.model, "engines": args.engines,
              "max_tokens": args.max_tokens, "requests_per_stream": args.requests}  # fmt: skip
    if not args.no_baseline:
        report["in_process"], report["prompt_tokens"] = baselines(args.model, args.max_tokens)
    proc, address = (None, args.address)
    if args.start:
        flags = ["--device", args.device, "--max-active-requests", str(max(8, *map(int, args.concurrency.split(","))))]
        proc, address = start_server(args.model, args.engines, flags)
    try:
        asyncio.run(run_level(address, 1, 1, 4))  # warm-up
        report["pipeline"] = [asyncio.run(run_level(address, int(n), args.requests, args.max_tokens))
                              for n in args.concurrency.split(",")]  # fmt: skip
    finally:
        if proc is not None:
            stop_server(proc)
    if "in_process" in report:
        single = next((lvl for lvl in report["pipeline"] if lvl["concurrency"] == 1), None)
        if single and single["itl_ms"]["p50"] is not None:
            report["overhead_per_token_ms"] = {
                name: round(single["itl_ms"]["p50"] - base["per_token_ms"], 2)
                for name, base in report["in_process"].items()
            }
    write_report(report, f"loadgen_{args.device.replace(':', '')}.json")


def write_report(report: dict, name: str) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / name).write_text(text + "\n")


if __name__ == "__main__":
    main()
