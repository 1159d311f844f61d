"""Frame fuzzer: malformed and hostile client frames; each gets its one answer, nothing breaks.

Frames come from several families: random bytes, random msgpack values, valid messages of
every client type with fields mutated (wrong types, out-of-range and boundary numbers,
huge strings, invalid UTF-8 inside strings, non-string map keys in unknown fields, missing
or extra fields, wrong `v` or `type`), truncated frames, internal message types, multi-part
messages, and a few frames over the size limit (sent on their own connection, which the
server closes unread). Valid generates among them are tiny (max_tokens 1-3).

The expected answer of each frame is computed with the protocol's own decoder: a frame the
server rejects gets `error` carrying the frame's `id` whenever that id is readable (else an
`error` without id); a valid generate ends with exactly one `done` or `error`; every other
valid request gets its reply. The report counts frames by family, answers by type and code,
frames left unanswered (hung), errors that lost a readable id, and whether the server is
still healthy and, after leases it granted are closed and connections closed, idle.

    python -m ops.fuzz_frames --frames 40000              # long form (starts a server)
    python -m ops.fuzz_frames --frames 2000 --address A   # short form against a running one

Loopback only; bounded by `--frames` and `--timeout-s`. Writes `ops/results/fuzz_frames_cpu.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path

import msgpack
import zmq
import zmq.asyncio

from ops.serving import ServeProcess
from ops.soak import SERVE_FLAGS, leftovers, wait_idle
from shared.client import AsyncClient
from shared.protocol import CLIENT_TYPES, MAX_FRAME_BYTES, MessageType, ProtocolError, decode

RESULTS = Path(__file__).parent / "results"
SOCKETS = 16  # client connections the frames are spread over
WINDOW = 256  # frames awaiting their answer at once
INVALID_UTF8 = b"\xff\xfe\xc3\x28\xa0\xa1\xe2\x28\xa1\xf0"  # 10 bytes no UTF-8 decoder accepts
_PLACEHOLDER = "\u00b5" * 5  # 10 bytes of UTF-8, swapped for INVALID_UTF8 after packing

BOUNDARY = [0, -1, 1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), 1e-39, 1e-45, 5e-324, -0.0,
            1e308, float("nan"), float("inf"), 0.5, 100.0, 100.0001, True, False, None]  # fmt: skip


class Bad:
    """A value that packs as a string holding invalid UTF-8."""


def _value(rng: random.Random, depth: int = 0):
    pick = rng.random()
    if pick < 0.3:
        return rng.choice(BOUNDARY)
    if pick < 0.45:
        return rng.choice(["", "x", "é" * rng.randint(1, 50), "a" * rng.choice([255, 256, 257, 5000]), Bad()])
    if pick < 0.55:
        return rng.randbytes(rng.randint(0, 20))
    if pick < 0.7 and depth < 2:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if pick < 0.85 and depth < 2:
        keys = [rng.choice([rng.randint(-5, 5), "k", b"bin", 1.5, "role", "content"]) for _ in range(rng.randint(0, 3))]
        return {k: _value(rng, depth + 1) for k in keys}
    return rng.randint(-(2**63), 2**64 - 1) if rng.random() < 0.5 else rng.random() * 10 ** rng.randint(-40, 40)


def _valid(rng: random.Random, n: int) -> dict:
    kind = rng.choice(["generate"] * 2 + ["cancel", "lease_open", "lease_renew", "lease_close",
                                          "session_close", "health", "stats"])  # fmt: skip
    base = {"v": 1, "type": kind, "id": f"f{n}"}
    if kind == "generate":
        base |= rng.choice([{"prompt": "Hi"}, {"token_ids": [1, 2, 3]},
                            {"messages": [{"role": "user", "content": "Hi"}]}])  # fmt: skip
        base |= {"max_tokens": rng.randint(1, 2)}
        for key, value in (("temperature", 0.7), ("top_p", 0.5), ("top_k", 5), ("seed", 3), ("stop", ["x"]),
                           ("stream", False), ("session_id", f"fs{n}")):  # fmt: skip
            if rng.random() < 0.2:
                base[key] = value
        if "session_id" in base and rng.random() < 0.5:
            base["new_session"] = True
    elif kind in ("lease_renew", "lease_close"):
        base["lease_id"] = rng.choice(["lease-0", "x"])
    elif kind == "lease_open":
        base["ttl_s"] = rng.choice([1.0, 2.0])
    elif kind == "session_close":
        base["session_id"] = f"fs{rng.randint(0, n)}"
    return base


def _pack(payload) -> bytes:
    """msgpack, with every `Bad` as a string of invalid UTF-8."""

    def swap(value):
        if isinstance(value, Bad):
            return _PLACEHOLDER
        if isinstance(value, list):
            return [swap(v) for v in value]
        if isinstance(value, dict):
            return {swap(k): swap(v) for k, v in value.items()}
        return value

    frame = msgpack.packb(swap(payload), use_bin_type=True, strict_types=False)
    return frame.replace(_PLACEHOLDER.encode(), INVALID_UTF8)


def make_frame(rng: random.Random, n: int) -> tuple[str, list[bytes]]:
    """One fuzzed message: (family, frames)."""
    family = rng.choices(["bytes", "msgpack", "mutated", "truncated", "internal", "multipart", "valid"],
                         weights=[5, 5, 55, 10, 5, 2, 18])[0]  # fmt: skip
    if family == "bytes":
        return family, [rng.randbytes(rng.randint(0, 200))]
    if family == "msgpack":
        return family, [_pack(_value(rng))]
    if family == "internal":
        kind = rng.choice([t.value for t in MessageType if t not in CLIENT_TYPES])
        return family, [_pack({"v": 1, "type": kind, "id": f"f{n}", "request_id": "r", "tokens": 5})]
    payload = _valid(rng, n)
    if family == "valid":
        return family, [_pack(payload)]
    if family == "multipart":
        return family, [_pack(payload), b"extra"]
    if family == "truncated":
        frame = _pack(payload)
        return family, [frame[: rng.randint(0, len(frame) - 1)]]
    for _ in range(rng.randint(1, 3)):
        _mutate(rng, payload)
    frame = _pack(payload)
    if expectation([frame])[0] == "generate" and decode(frame).max_tokens > 2:
        payload["max_tokens"] = 2  # still valid: keep it short (the default is 256 tokens)
        frame = _pack(payload)
    return family, [frame]


def _mutate(rng: random.Random, payload: dict) -> None:
    op = rng.random()
    keys = list(payload)
    if op < 0.5:
        payload[rng.choice(keys)] = _value(rng)
    elif op < 0.65:
        payload.pop(rng.choice(keys), None)
    elif op < 0.85:
        payload[rng.choice(["extra", "x" * 300, "ümlaut", "prompt", "messages", "lease_id"])] = _value(rng)
    else:
        payload[rng.choice(["big", "prompt"])] = "y" * rng.choice([2**16, 2**20 + 1])


def expectation(frames: list[bytes]) -> tuple[str, str | None]:
    """What the server must answer: ("reject" | "generate" | "reply" | "none", id or None)."""
    if len(frames) != 1:
        return "reject", None
    try:
        msg = decode(frames[0], allowed=CLIENT_TYPES)
    except ProtocolError as exc:
        return "reject", exc.request_id
    if msg.TYPE is MessageType.GENERATE:
        return "generate", msg.id
    if msg.TYPE is MessageType.CANCEL:
        return "none", None
    return "reply", msg.id


class Conn:
    """One DEALER and the answers it is owed."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.owed: dict[str, list[str]] = {}  # id -> kinds owed ("reject" | "generate" | "reply")
        self.owed_anonymous = 0  # answers without id still to come
        self.leases: list[str] = []  # leases granted to this connection

    @property
    def num_owed(self) -> int:
        return sum(map(len, self.owed.values())) + self.owed_anonymous

    def settle(self, rid: str, is_error: bool) -> str:
        """Take the answer owed for `rid` (an error settles a rejection first); returns its kind."""
        kinds = self.owed[rid]
        kind = "reject" if is_error and "reject" in kinds else kinds[0]
        kinds.remove(kind)
        if not kinds:
            del self.owed[rid]
        return kind


async def fuzz(address: str, *, frames: int, seed: int, timeout_s: float, oversized: int = 2, log=None) -> dict:
    rng = random.Random(seed)
    ctx = zmq.asyncio.Context()
    conns = [Conn(ctx, address) for _ in range(SOCKETS)]
    families, answers, problems = Counter(), Counter(), Counter()
    examples: list[str] = []
    settled = asyncio.Event()

    def note(problem: str, detail: str) -> None:
        problems[problem] += 1
        if len(examples) < 10:
            examples.append(f"{problem}: {detail}")

    async def receive(conn: Conn) -> None:
        while True:
            msg = decode(await conn.sock.recv())
            answers[f"{msg.TYPE.value}:{getattr(msg, 'code', '')}"] += 1
            rid = getattr(msg, "id", None)
            if msg.TYPE in (MessageType.KEEPALIVE, MessageType.TOKEN):
                continue
            if msg.TYPE is MessageType.LEASE:
                conn.leases.append(msg.lease_id)
            if rid is None or rid not in conn.owed:
                if rid is None and conn.owed_anonymous > 0:
                    conn.owed_anonymous -= 1
                    settled.set()
                else:
                    note("unexpected_answer", f"{msg!r}"[:200])
                continue
            expected = conn.settle(rid, msg.TYPE is MessageType.ERROR)
            if expected == "reject" and msg.TYPE is not MessageType.ERROR:
                note("rejected_frame_not_an_error", f"{msg!r}"[:200])
            settled.set()

    tasks = [asyncio.create_task(receive(c)) for c in conns]
    started = time.monotonic()
    for n in range(frames):
        if log is not None and n % 5000 == 0:
            log(f"[{time.monotonic() - started:6.1f} s] {n} frames sent, {sum(c.num_owed for c in conns)} owed")
        conn = conns[n % SOCKETS]
        family, parts = make_frame(rng, n)
        families[family] += 1
        kind, rid = expectation(parts)
        if kind != "none":
            if rid is None:
                conn.owed_anonymous += 1
            else:
                conn.owed.setdefault(rid, []).append(kind)  # a mutation can repeat an id
        await conn.sock.send_multipart(parts)
        for task in tasks:  # a fuzzer bug must not pass for a server that stopped answering
            if task.done():
                task.result()
        while sum(c.num_owed for c in conns) >= WINDOW:
            settled.clear()
            try:
                await asyncio.wait_for(settled.wait(), timeout=timeout_s)
            except TimeoutError:
                break
    deadline = time.monotonic() + timeout_s
    while any(c.num_owed for c in conns) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    hung = sum(c.num_owed for c in conns)
    for conn in conns:
        for rid, kinds in list(conn.owed.items())[:3]:
            note("hung", f"{rid} ({kinds})")
    for task in tasks:
        task.cancel()
    found = dict(problems)
    memory = await _oversized(ctx, address, oversized)
    async with AsyncClient(address) as client:  # leases it was granted: close them, one by one
        for lease_id in dict.fromkeys(lease for c in conns for lease in c.leases):
            client.lease_id = lease_id
            await client.close_lease()
        health = await client.health()
    for conn in conns:
        conn.sock.close(0)
    ctx.term()
    return {
        "frames": frames, "seconds": round(time.monotonic() - started, 1), "families": dict(families),
        "answers": dict(sorted(answers.items())), "hung": hung, "problems": found,
        "examples": examples, "health_after": health.status, "oversized": memory,
    }  # fmt: skip


async def _oversized(ctx: zmq.asyncio.Context, address: str, count: int) -> dict:
    """Frames over MAX_FRAME_BYTES, each on its own connection: cut unread, nothing answers."""
    answered = 0
    for _ in range(count):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        await sock.send(b"\x00" * (MAX_FRAME_BYTES + 1024))
        answered += bool(await sock.poll(timeout=500))
        sock.close(0)
    return {"sent": count, "bytes_each": MAX_FRAME_BYTES + 1024, "answered": answered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="a running server (default: start one on loopback)")
    parser.add_argument("--frames", type=int, default=40_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=90.0, help="longest wait for owed answers (above the 60 s queue timeout)")
    parser.add_argument("--out", type=Path, default=RESULTS / "fuzz_frames_cpu.json")
    args = parser.parse_args()
    server = None if args.address else ServeProcess.start(SERVE_FLAGS, engines=1)
    address = args.address or server.address
    try:
        report = asyncio.run(fuzz(address, frames=args.frames, seed=args.seed, timeout_s=args.timeout_s,
                                  log=lambda line: print(line, flush=True)))  # fmt: skip
        report["leaks"] = asyncio.run(wait_idle(address, 30.0))
        report["alive"] = server is None or server.proc.poll() is None
    finally:
        if server is not None:
            server.stop()
    for key in ("frames", "seconds", "families", "answers", "hung", "problems", "oversized", "health_after",
                "alive", "leaks"):  # fmt: skip
        print(f"{key:>14}: {report[key]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()


__all__ = ["fuzz", "leftovers", "make_frame"]
