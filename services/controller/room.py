"""Where a request fits: engine choice and the eviction of idle sessions. Pure functions.

A request needs `liability(tokens)` free KV tokens on one engine and, unless it is a turn of
a session that already holds one, a free slot. Sessions between turns hold both; when no
engine has room, the idle sessions of one engine are evicted, oldest idle first, until the
request fits (`eviction_plan`). The ledger (`ledger.py`) applies the plan.
"""

from __future__ import annotations

from collections.abc import Iterable

from .ledger_types import EngineRecord, HeldSession


def choose_engine(
    candidates: Iterable[EngineRecord], tokens: int, *, needs_slot: bool, hint: str | None
) -> EngineRecord | None:
    """The engine a request of `tokens` goes to now without evicting anything, or None.

    The hinted engine when it fits, else the fitting engine with the most free tokens (ties:
    the smallest id).
    """
    fitting = [e for e in candidates if e.fits(tokens, needs_slot=needs_slot)]
    preferred = [e for e in fitting if e.engine_id == hint]
    if preferred or not fitting:
        return preferred[0] if preferred else None
    return min(fitting, key=lambda e: (-e.free_tokens, e.engine_id))


def eviction_plan(
    candidates: Iterable[EngineRecord],
    idle: Iterable[HeldSession],
    tokens: int,
    *,
    needs_slot: bool,
) -> tuple[EngineRecord, list[HeldSession]] | None:
    """The engine and the fewest idle sessions to evict (oldest idle first) to fit a request.

    Args:
        candidates: engines the request may go to.
        idle: sessions without a turn in flight that may be evicted (any engine).
        tokens: the request's size, prompt + capped max_tokens.
        needs_slot: the request needs a slot of its own (it is not a continued session turn).

    Returns:
        (engine, sessions to evict), or None when evicting every idle session of every
        candidate is not enough. Ties go to the engine with the most free tokens.
    """
    by_engine: dict[str, list[HeldSession]] = {}
    for sess in sorted(idle, key=lambda s: (s.idle_expires_at, s.session_id)):
        by_engine.setdefault(sess.engine_id, []).append(sess)
    best: tuple[EngineRecord, list[HeldSession]] | None = None
    for engine in sorted(candidates, key=lambda e: (-e.free_tokens, e.engine_id)):
        victims = _victims(engine, by_engine.get(engine.engine_id, []), tokens, needs_slot)
        if victims is not None and (best is None or len(victims) < len(best[1])):
            best = (engine, victims)
    return best


def _victims(
    engine: EngineRecord, idle: list[HeldSession], tokens: int, needs_slot: bool
) -> list[HeldSession] | None:
    free_tokens = engine.capacity_tokens - engine.reserved_tokens - engine.held_tokens
    free_slots = engine.free_slots
    need_tokens = engine.liability(tokens)
    victims: list[HeldSession] = []
    for sess in idle:
        slot_ok = not needs_slot or free_slots is None or free_slots > 0
        if free_tokens >= need_tokens and slot_ok:
            break
        victims.append(sess)
        free_tokens += sess.tokens_held
        free_slots = None if free_slots is None else free_slots + 1
    slot_ok = not needs_slot or free_slots is None or free_slots > 0
    return victims if free_tokens >= need_tokens and slot_ok else None
