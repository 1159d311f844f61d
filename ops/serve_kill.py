"""`kill -9` of one engine under load (issue 17): only its requests fail, the other keeps serving.

With every stream generating (each has its first token), the controller's `stats` say how many
requests each engine holds (`reserved_tokens` / (prompt + max_tokens): every request reserves
exactly that). One engine's process is then SIGKILLed; the check records

- the in-flight outcome: how many failed and with which wire code (expected: exactly the
  victim's count, all `engine_failed`) and how many completed with `length` (the survivor's);
- a wave sent right after the kill, while the victim restarts (expected: all served);
- the restart: the victim back at epoch+1 within the timeout, on the same device
  (`device` and `cuda_visible_devices` in `stats`), with a new pid;
- a wave after the restart at 2 streams per engine slot share (expected: all served, both
  engines holding requests at some point).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from ops.serve_load import RequestRecord, Workload, finish_record, wire_request
from ops.serving import engine_table

KILL_WAVE = 8  # requests sent while the killed engine restarts


async def _stats(client):
    return await client.stats(timeout_s=2.0)


async def _first_tokens(streams, timeout_s: float) -> list:
    """Wait for each stream's first token; returns [(stream, record)] with the record started."""
    started = []
    for stream, record in streams:
        token = await asyncio.wait_for(stream.__anext__(), timeout=timeout_s)
        record.token_times_s += [time.monotonic()] * len(token.token_ids)
        started.append((stream, record))
    return started


def _outcomes(records: list[RequestRecord]) -> dict:
    counts: dict[str, int] = {}
    for r in records:
        key = r.finish_reason or r.error_code or "unknown"
        counts[key] = counts.get(key, 0) + 1
    return counts


async def _wave(client, workload: Workload, count: int, first_client: int, max_tokens: int, sample=None) -> dict:
    tasks = [asyncio.create_task(wire_request(client, workload, first_client + i, 0, max_tokens=max_tokens))
             for i in range(count)]  # fmt: skip
    busy: set[str] = set()
    while sample is not None and not all(t.done() for t in tasks):
        busy |= {e.engine_id for e in (await _stats(client)).engines if e.reserved_tokens > 0}
        await asyncio.sleep(0.1)
    records = await asyncio.gather(*tasks)
    return {"requests": count, "outcomes": _outcomes(records), "engines_busy": sorted(busy),
            "all_served": all(r.finish_reason == "length" for r in records)}  # fmt: skip


async def kill_check(address: str, workload: Workload, *, streams: int, victim_id: str | None = None,
                     restart_timeout_s: float = 120.0) -> dict:  # fmt: skip
    """Run the check against a live server with at least two engines; see the module docstring.

    Args:
        address (str): the gateway's client address.
        workload (Workload): prompts; `max_tokens` should keep streams running for seconds.
        streams (int): concurrent requests in flight at the kill.
        victim_id (str | None): the engine to kill. Default: the one holding most of the streams.
        restart_timeout_s (float): longest wait for the victim's next epoch, seconds.

    Returns:
        dict: the facts listed in the module docstring, and `ok` (all expectations held).
    """
    from shared.client import AsyncClient

    per_request = workload.prompt_tokens + workload.max_tokens
    async with AsyncClient(address) as client:
        before = engine_table(await _stats(client))
        pending = []
        for i in range(streams):
            record = RequestRecord(i, time.monotonic())
            stream = await client.stream(token_ids=workload.prompt(i, 0), temperature=0.0,
                                         max_tokens=workload.max_tokens, timeout_s=workload.timeout_s)  # fmt: skip
            pending.append((stream, record))
        started = await _first_tokens(pending, workload.timeout_s)
        held = {e.engine_id: e.reserved_tokens // per_request for e in (await _stats(client)).engines}
        victim_id = victim_id or max(sorted(held, reverse=True), key=held.get)  # the busiest engine
        victim = next(e for e in before if e["engine_id"] == victim_id)
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        finishing = asyncio.gather(*(finish_record(s, r) for s, r in started))
        dead_s = await _wait_engines(client, lambda t: _epoch_of(t, victim_id) != victim["epoch"],
                                     killed_at, restart_timeout_s)  # fmt: skip
        during = await _wave(client, workload, KILL_WAVE, streams, max_tokens=16)
        records = await finishing
        restart_s = await _wait_engines(client, lambda t: (_epoch_of(t, victim_id) or -1) > victim["epoch"],
                                        killed_at, restart_timeout_s)  # fmt: skip
        after = engine_table(await _stats(client))
        restarted = next((e for e in after if e["engine_id"] == victim_id), None)
        later = await _wave(client, workload, streams, streams + KILL_WAVE, workload.max_tokens, sample=True)
    failed = [r for r in records if r.error_code is not None]
    on_victim, on_others = held.get(victim_id, 0), sum(n for e, n in held.items() if e != victim_id)
    same_device = restarted is not None and (restarted["device"], restarted["cuda_visible_devices"]) == (
        victim["device"], victim["cuda_visible_devices"])  # fmt: skip
    in_flight = {
        "streams": streams, "held_per_engine": held, "outcomes": _outcomes(records),
        "failed_seconds_after_kill": round(max((r.end_s for r in failed), default=killed_at) - killed_at, 3),
        "error_sample": failed[0].error_message if failed else None,
    }  # fmt: skip
    checks = {
        "only_victims_requests_failed": len(failed) == on_victim and on_victim > 0,
        "failures_are_engine_failed": all(r.error_code == "engine_failed" for r in failed),
        "survivors_completed": _outcomes(records).get("length", 0) == on_others,
        "served_while_restarting": during["all_served"],
        "restarted_same_device": same_device and restarted["epoch"] == victim["epoch"] + 1
        and restarted["pid"] != victim["pid"],
        "served_after_restart": later["all_served"],
    }
    return {"victim": victim, "engines_before": before, "in_flight": in_flight, "during_restart": during,
            "restart": {"dead_seconds_after_kill": dead_s, "live_seconds_after_kill": restart_s,
                        "engines_after": after},
            "after_restart": later,
            "checks": checks, "ok": all(checks.values())}  # fmt: skip


def _epoch_of(table: list[dict], engine_id: str) -> int | None:
    return next((e["epoch"] for e in table if e["engine_id"] == engine_id), None)


async def _wait_engines(client, predicate, since: float, timeout_s: float) -> float | None:
    """Poll stats until `predicate(engine_table)` holds; seconds from `since`, or None on timeout."""
    while True:
        if predicate(engine_table(await _stats(client))):
            return round(time.monotonic() - since, 3)
        if time.monotonic() - since > timeout_s:
            return None
        await asyncio.sleep(0.05)
