"""Soak: many clients, random cancels, client `kill -9`s and engine `kill -9`s; then count.

Clients run in worker processes (a few asyncio clients each, one connection per client) so a
client can really be killed. Every request is greedy on a fixed prompt set whose reference
completions are taken from the server first, one at a time, so every output can be checked:
token ids a prefix of the reference, text equal to the reference text of that many tokens, a
`stop` string cutting the text where the reference has it, and a session's second turn
counting exactly the history its client was told. The kinds of request: plain, streamed and
cancelled after a few tokens, `stream: false`, a `stop` string, a two-turn session (closed or
left to the connection's end), and each kind sometimes under a lease.

Meanwhile the soak `kill -9`s random worker processes (and starts new ones) and random engines
(the supervisor restarts them). At the end it stops the workers, waits for leases to lapse and
checks the server is idle: no reservation, lease, session, queued or active request, reserved
or held token, or slot left.

    python -m ops.soak                                   # long form: 18 clients, 300 s
    python -m ops.soak --duration-s 20 --clients 6 ...   # short form (the CI test's)
    python -m ops.soak --address tcp://127.0.0.1:5555    # a server already running

Loopback only; bounded by `--duration-s` plus the drain and idle waits. Prints a table and
writes JSON to `ops/results/soak_cpu.json` (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ops.serving import ServeProcess, engines_live, is_alive
from shared.client import AsyncClient, ServerError

RESULTS = Path(__file__).parent / "results"
PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "The largest planet in our solar system is",
    "To make a cup of tea, first",
]
MAX_TOKENS = 16
REQUEST_TIMEOUT_S = 120.0
LEASE_TTL_S = 3.0
UNEXPECTED_CODES = {"bad_request", "internal", "stale_slot"}  # a valid request never gets these
SERVE_FLAGS = ["--max-context", "256", "--capacity-tokens", "4096", "--max-slots", "8",
               "--step-token-budget", "256", "--max-active-requests", "8"]  # fmt: skip


# ---- references ---------------------------------------------------------------------------


def reference_texts(prompt: str, ids: list[int]) -> list[str]:
    """The text the gateway streams for each prefix of `ids` (index k: the first k tokens)."""
    from mlx_lm.utils import load_config, load_tokenizer

    from services.engine.model.paths import resolve_model
    from shared.detok import IncrementalDetokenizer

    path = resolve_model("default", dtype="float32")
    tokenizer = load_tokenizer(path, eos_token_ids=load_config(path).get("eos_token_id"))
    prompt_ids = list(tokenizer.encode(prompt, add_special_tokens=True))
    texts = []
    for k in range(len(ids) + 1):
        detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        texts.append("".join(detok.add(t) for t in ids[:k]) + detok.flush())
    return texts


async def references(address: str, prompts: list[str]) -> list[dict]:
    """Each prompt's greedy completion of MAX_TOKENS, one request at a time."""
    refs = []
    async with AsyncClient(address) as client:
        for prompt in prompts:
            got = await client.generate(prompt=prompt, max_tokens=MAX_TOKENS, timeout_s=REQUEST_TIMEOUT_S)
            refs.append({"prompt": prompt, "ids": got.token_ids, "text": got.text,
                         "finish_reason": got.finish_reason, "texts": reference_texts(prompt, got.token_ids)})  # fmt: skip
    return refs


# ---- a worker process: a few clients ------------------------------------------------------


def check(ref: dict, text: str, ids: list[int], finish: str, max_tokens: int, stop: str | None) -> str | None:
    """Why an output is wrong, or None when it is what the reference says."""
    n = len(ids)
    if ids != ref["ids"][:n]:
        return f"token ids {ids} are not a prefix of {ref['ids']}"
    reachable = ref["texts"][min(max_tokens, len(ref["ids"]))]  # the text max_tokens allows
    if stop is not None and stop in reachable:
        expected = reachable[: reachable.find(stop)]
        if finish != "stop" or text != expected:
            return f"stop {stop!r}: got {finish} {text!r}, expected {expected!r}"
        return None
    if text != ref["texts"][n]:
        return f"text {text!r} != reference of {n} tokens {ref['texts'][n]!r}"
    if finish == "length" and n != max_tokens:
        return f"length after {n} tokens, max_tokens {max_tokens}"
    if finish == "stop" and not (n < len(ref["ids"]) or ref["finish_reason"] == "stop"):
        return "stopped where the reference does not"
    return None


async def one_request(client: AsyncClient, rng: random.Random, refs: list[dict], emit) -> None:
    """Issue one request of a random kind and report its outcome."""
    index = rng.randrange(len(refs))
    ref, kind = refs[index], rng.choice(["plain", "cancel", "no_stream", "stop", "session", "session"])
    max_tokens = rng.randint(2, MAX_TOKENS)
    emit({"event": "issued", "kind": kind})
    outcome = {"event": "ended", "kind": kind}
    try:
        outcome.update(await _run_kind(client, rng, ref, kind, max_tokens))
    except ServerError as exc:
        outcome.update(status="error", code=exc.code.value, message=exc.message[:200])
        if exc.retryable:  # a well-behaved client waits as told (with jitter) before retrying
            await asyncio.sleep((exc.retry_after_ms or 250) / 1000 * rng.uniform(1.0, 2.0))
    except TimeoutError as exc:
        outcome.update(status="hung", message=str(exc)[:200])
    emit(outcome)


async def _run_kind(client: AsyncClient, rng: random.Random, ref: dict, kind: str, max_tokens: int) -> dict:
    prompt, timeout = ref["prompt"], REQUEST_TIMEOUT_S
    if kind == "cancel":
        stream = await client.stream(prompt=prompt, max_tokens=MAX_TOKENS, timeout_s=timeout)
        texts, ids, after = [], [], rng.randint(0, 3)
        async for token in stream:
            texts.append(token.text)
            ids.extend(token.token_ids)
            if len(ids) >= after:
                await stream.cancel()
        done = stream.done
        wrong = None if ids == ref["ids"][: len(ids)] else f"cancelled ids {ids} not a prefix"
        return {"status": "done", "finish": done.finish_reason.value, "wrong": wrong}
    if kind == "stop":
        start = rng.randint(1, max(1, len(ref["text"]) - 4))
        stop = ref["text"][start : start + 3]
        got = await client.generate(prompt=prompt, max_tokens=MAX_TOKENS, stop=[stop], timeout_s=timeout)
        return {"status": "done", "finish": got.finish_reason,
                "wrong": check(ref, got.text, got.token_ids, got.finish_reason, MAX_TOKENS, stop)}  # fmt: skip
    if kind == "session":
        return await _session(client, rng, ref, max_tokens)
    got = await client.generate(prompt=prompt, max_tokens=max_tokens, stream=kind != "no_stream", timeout_s=timeout)
    return {"status": "done", "finish": got.finish_reason,
            "wrong": check(ref, got.text, got.token_ids, got.finish_reason, max_tokens, None)}  # fmt: skip


async def _session(client: AsyncClient, rng: random.Random, ref: dict, max_tokens: int) -> dict:
    """Two turns; the second must count exactly the history the first reported."""
    session_id = f"s{rng.getrandbits(40):x}"
    stop = [ref["text"][2:5]] if rng.random() < 0.5 and len(ref["text"]) > 6 else []
    one = await client.generate(prompt=ref["prompt"], max_tokens=max_tokens, session_id=session_id,
                                new_session=True, stop=stop, timeout_s=REQUEST_TIMEOUT_S)  # fmt: skip
    wrong = check(ref, one.text, one.token_ids, one.finish_reason, max_tokens, stop[0] if stop else None)
    two = await client.generate(token_ids=[198], max_tokens=2, session_id=session_id, timeout_s=REQUEST_TIMEOUT_S)
    history = one.usage.prompt_tokens + one.usage.completion_tokens
    if wrong is None and two.usage.prompt_tokens != history + 1:
        wrong = f"turn 2 prompt_tokens {two.usage.prompt_tokens} != history {history} + 1"
    if rng.random() < 0.5:
        await client.close_session(session_id)
    return {"status": "done", "finish": two.finish_reason, "wrong": wrong}


async def client_loop(address: str, seed: int, refs: list[dict], stop: asyncio.Event, emit) -> None:
    rng = random.Random(seed)
    async with AsyncClient(address) as client:
        if rng.random() < 0.3:
            try:
                await client.open_lease(ttl_s=LEASE_TTL_S)
            except (ServerError, TimeoutError) as exc:
                emit({"event": "lease_refused", "message": str(exc)[:200]})
        while not stop.is_set():
            await one_request(client, rng, refs, emit)


async def worker_main(address: str, clients: int, seed: int, refs_path: str) -> None:
    refs = json.loads(Path(refs_path).read_text())
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    lock = threading.Lock()

    def emit(record: dict) -> None:
        with lock:
            print(json.dumps(record), flush=True)

    await asyncio.gather(*(client_loop(address, seed * 1000 + i, refs, stop, emit) for i in range(clients)))


# ---- the parent ---------------------------------------------------------------------------


@dataclass
class Tally:
    issued: int = 0
    ended: int = 0
    completed: int = 0
    wrong: list[str] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    messages: Counter = field(default_factory=Counter)  # (code, message with digits as N)
    hung: list[str] = field(default_factory=list)
    kinds: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, record: dict) -> None:
        with self.lock:
            if record.get("event") == "issued":
                self.issued += 1
                self.kinds[record["kind"]] += 1
            elif record.get("event") == "ended":
                self.ended += 1
                status = record["status"]
                if status == "done":
                    self.completed += 1
                    if record.get("wrong"):
                        self.wrong.append(f"{record['kind']}: {record['wrong']}")
                elif status == "error":
                    self.errors[record["code"]] += 1
                    shape = re.sub(r"[0-9]+", "N", re.sub(r"'[^']*'", "'…'", record.get("message", "")))  # ids and counts
                    self.messages[f"{record['code']}: {shape}"] += 1
                    if record["code"] in UNEXPECTED_CODES:
                        self.wrong.append(f"{record['kind']}: {record['code']}: {record.get('message')}")
                else:
                    self.hung.append(f"{record['kind']}: {record.get('message')}")


class Worker:
    """A worker process and the thread reading its outcome lines."""

    def __init__(self, address: str, clients: int, seed: int, refs_path: Path, tally: Tally):
        argv = [sys.executable, "-m", "ops.soak", "--worker", "--address", address, "--clients", str(clients),
                "--seed", str(seed), "--refs", str(refs_path)]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.issued = self.ended = 0
        self.thread = threading.Thread(target=self._read, args=(tally,), daemon=True)
        self.thread.start()

    def _read(self, tally: Tally) -> None:
        for line in self.proc.stdout:
            record = json.loads(line)
            self.issued += record.get("event") == "issued"
            self.ended += record.get("event") == "ended"
            tally.add(record)

    @property
    def in_flight(self) -> int:
        return self.issued - self.ended


async def kill_an_engine(address: str, rng: random.Random) -> tuple[str, int] | None:
    """SIGKILL one live engine (when all are live); returns (engine_id, epoch) or None."""
    async with AsyncClient(address) as client:
        stats = await client.stats()
    live = [e for e in stats.engines if e.pid]
    if not live or (await engines_live(address)) < len(live):
        return None
    victim = rng.choice(live)
    try:
        os.kill(victim.pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    return victim.engine_id, victim.epoch


async def leftovers(address: str) -> dict:
    """Nonzero counters of an idle server's stats (an empty dict: nothing leaked)."""
    async with AsyncClient(address) as client:
        stats = await client.stats()
    found = {k: getattr(stats, k) for k in ("num_reservations", "num_leases", "num_sessions") if getattr(stats, k)}
    found |= {f"pool_{k}": getattr(stats.pool, k) for k in ("active", "queued") if getattr(stats.pool, k)}
    for e in stats.engines:
        for key in ("reserved_tokens", "held_tokens", "used_slots", "reserved_slots", "engine_tokens"):
            if getattr(e, key):
                found[f"{e.engine_id}.{key}"] = getattr(e, key)
    return found


async def wait_idle(address: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = await leftovers(address)
        except (TimeoutError, ServerError) as exc:
            found = {"stats_failed": str(exc)}
        if not found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.5)


def run_soak(address: str, *, duration_s: float, clients: int, workers: int, engine_kills: int, client_kills: int,
             seed: int, server_pids: list[int] | None = None, num_prompts: int = len(PROMPTS),
             log=print) -> dict:  # fmt: skip
    """Run the soak against a live server; returns the report (see the module docstring).

    Args:
        address (str): the gateway's endpoint (loopback).
        duration_s (float): how long clients issue requests, seconds (then they finish theirs).
        clients (int), workers (int): client connections, spread over this many processes.
        engine_kills (int), client_kills (int): `kill -9`s, at random times within the run.
        seed (int): every random choice follows it.
        server_pids (list[int] | None): the server's processes; any that dies (engines aside,
            which the soak kills itself) is an unexpected death.
        num_prompts (int): how many of PROMPTS to use (each costs a reference request first).
        log: where kill events are reported.
    """
    rng = random.Random(seed)
    refs = asyncio.run(references(address, PROMPTS[:num_prompts]))
    refs_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"buttermilk-soak-refs-{os.getpid()}.json"
    refs_path.write_text(json.dumps(refs))
    first = asyncio.run(_stats(address))
    epochs_before = {e.engine_id: e.epoch for e in first.engines}
    watched = [pid for pid in server_pids or [] if pid not in {e.pid for e in first.engines}]
    tally, per_worker = Tally(), [clients // workers + (i < clients % workers) for i in range(workers)]
    pool = [Worker(address, n, seed + i, refs_path, tally) for i, n in enumerate(per_worker) if n]
    started = time.monotonic()
    events = sorted([(rng.uniform(0.15, 0.85) * duration_s, "engine") for _ in range(engine_kills)]
                    + [(rng.uniform(0.1, 0.9) * duration_s, "client") for _ in range(client_kills)])  # fmt: skip
    kills, killed_in_flight, next_seed = Counter(), 0, seed + len(pool)
    for at, what in events:
        time.sleep(max(0.0, started + at - time.monotonic()))
        if what == "engine" and (victim := asyncio.run(kill_an_engine(address, rng))) is not None:
            kills["engine"] += 1
            log(f"[{time.monotonic() - started:6.1f} s] kill -9 engine {victim[0]} epoch {victim[1]}")
        elif what == "client":
            index = rng.randrange(len(pool))
            worker = pool[index]
            worker.proc.kill()
            worker.proc.wait()
            worker.thread.join(timeout=5)
            killed_in_flight += worker.in_flight
            kills["client"] += 1
            pool[index] = Worker(address, per_worker[index], next_seed, refs_path, tally)
            next_seed += 1
            log(f"[{time.monotonic() - started:6.1f} s] kill -9 client process ({worker.in_flight} requests in flight)")
    time.sleep(max(0.0, started + duration_s - time.monotonic()))
    for worker in pool:
        worker.proc.send_signal(signal.SIGTERM)  # finish the request in hand, then exit
    for worker in pool:
        try:
            worker.proc.wait(timeout=REQUEST_TIMEOUT_S + 30)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            worker.proc.wait()
            killed_in_flight += worker.in_flight
        worker.thread.join(timeout=5)
    asyncio.run(_wait_live(address, len(epochs_before)))
    leaks = asyncio.run(wait_idle(address, LEASE_TTL_S + 20))
    epochs_after = {e.engine_id: e.epoch for e in asyncio.run(_stats(address)).engines}
    restarts = sum(epochs_after.get(e, 0) - v for e, v in epochs_before.items())
    dead = [p for p in watched if not is_alive(p)]  # the supervisor, gateway, controller
    refs_path.unlink(missing_ok=True)
    return {
        "duration_s": round(time.monotonic() - started, 1), "clients": clients, "workers": workers,
        "issued": tally.issued, "completed": tally.completed, "wrong": len(tally.wrong),
        "errors_by_code": dict(tally.errors), "error_messages": dict(tally.messages.most_common(12)),
        "hung": len(tally.hung),
        "killed_in_flight": killed_in_flight, "unanswered": tally.issued - tally.ended - killed_in_flight,
        "engine_kills": kills["engine"], "client_kills": kills["client"], "engine_restarts": restarts,
        "unexpected_deaths": max(0, restarts - kills["engine"]) + len(dead), "leaks": leaks,
        "kinds": dict(tally.kinds), "wrong_examples": tally.wrong[:10], "hung_examples": tally.hung[:10],
    }  # fmt: skip


async def _stats(address: str):
    async with AsyncClient(address) as client:
        return await client.stats()


async def _wait_live(address: str, engines: int, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await engines_live(address) < engines and time.monotonic() < deadline:
        await asyncio.sleep(0.5)


def print_table(report: dict) -> None:
    rows = [("issued", report["issued"]), ("completed", report["completed"]), ("wrong", report["wrong"])]
    rows += [(f"error {code}", n) for code, n in sorted(report["errors_by_code"].items())]
    rows += [("hung", report["hung"]), ("in flight in killed clients", report["killed_in_flight"]),
             ("unanswered", report["unanswered"]), ("engine kill -9s / restarts",
             f"{report['engine_kills']} / {report['engine_restarts']}"), ("client kill -9s", report["client_kills"]),
             ("unexpected deaths", report["unexpected_deaths"]), ("leaks", report["leaks"] or 0)]  # fmt: skip
    for name, value in rows:
        print(f"| {name:<30} | {value!s:>12} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="a running server (default: start one on loopback)")
    parser.add_argument("--duration-s", type=float, default=300.0)
    parser.add_argument("--clients", type=int, default=18)
    parser.add_argument("--workers", type=int, default=6, help="client processes (kill -9 targets)")
    parser.add_argument("--engines", type=int, default=2, help="engines of a server this script starts")
    parser.add_argument("--engine-kills", type=int, default=9)
    parser.add_argument("--client-kills", type=int, default=21)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "soak_cpu.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--refs", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(worker_main(args.address, args.clients, args.seed, args.refs))
        return
    server = None if args.address else ServeProcess.start(SERVE_FLAGS, engines=args.engines)
    address = args.address or server.address
    try:
        pids = server.children() if server else []
        report = run_soak(address, duration_s=args.duration_s, clients=args.clients, workers=args.workers,
                          engine_kills=args.engine_kills, client_kills=args.client_kills, seed=args.seed,
                          server_pids=[*pids, server.proc.pid] if server else [])  # fmt: skip
    finally:
        status = server.stop() if server else None
    report["serve_exit_status"] = status
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
