"""The controller's token-capacity ledger: engines, leases, reservations and held sessions.

Pure bookkeeping: no I/O, no threads, no clocks. Every time-dependent method takes `now`
(monotonic seconds). Capacity is counted in KV tokens per engine; bytes are derived from the
engine's `bytes_per_token`.

Accounting, per engine (checked by `check_invariants`):
    reserved_tokens = sum of `liability_tokens` of its live reservations
    held_tokens     = sum of `tokens_held` of its sessions
    free_tokens     = max(0, capacity_tokens - reserved_tokens - held_tokens)

A reservation's liability is `max(tokens_reserved, tokens_observed)`: it holds the prompt plus
the capped `max_tokens` until released, and grows only if the engine reports more KV than that.
A session turn reserves only its new tokens; the KV kept from earlier turns stays counted as
the session's `tokens_held`, and `release(..., keep_session_tokens=n)` replaces that hold with
the engine's own count `n` of KV tokens it keeps for the session. On an engine whose every
layer keeps a sliding window of `w` tokens, a request's liability is capped at `w`.

Slots: an engine holds `max_slots` sequences. Each session (between turns or not) and each
reservation without a session takes one; a continued session turn uses its session's. A
request fits an engine when both its tokens and, if it needs one, a slot are free. Sessions
between turns can be evicted, oldest idle first, to make room (`make_room`, `room.py`).

Owners: every reservation, lease and session belongs to the gateway instance that made it
(`gateway_id`); `drop_gateway` releases them all when that instance is replaced or falls
silent for `gateway_timeout_s` (`expire`).

Engine liveness: HELLO and heartbeats refresh `last_seen`; with `engine_timeout_s` set,
`expire(now)` declares an engine silent for that long dead, like `engine_dead`.
"""

from __future__ import annotations

import secrets
from dataclasses import replace

from shared.errors import BadRequest, LeaseExpired, Overloaded
from shared.protocol import EngineUsage, is_silent

from .room import choose_engine, eviction_plan
from .ledger_types import (
    EngineRecord,
    EngineRelease,
    EngineReport,
    HeldSession,
    Lease,
    LedgerStats,
    Released,
    Reservation,
)

__all__ = [
    "EngineRelease", "EngineReport", "HeldSession", "Lease", "Ledger",
    "LedgerStats", "Released", "Reservation",
]  # fmt: skip

DEFAULT_SESSION_IDLE_TTL_S = 300.0
DEFAULT_RETRY_AFTER_MS = 250
DEFAULT_MAX_LEASES = 10_000


class Ledger:
    """Owns engine capacity, leases, reservations and held sessions; see the module docstring.

    Args:
        session_idle_ttl_s (float): a session with no turn in flight is dropped this many
            seconds after its last turn. Default: DEFAULT_SESSION_IDLE_TTL_S.
        retry_after_ms (int): hint sent with `Overloaded`; the ledger cannot know when
            capacity frees, so this is a fixed, configured value. Default: 250 ms.
        engine_timeout_s (float | None): `expire` declares an engine dead after this many
            seconds without a HELLO or heartbeat. None: never (only `engine_dead`).
        gateway_timeout_s (float | None): `expire` releases everything of a gateway instance
            silent this many seconds. None: only `drop_gateway` does.
        max_leases (int): leases open at once, all clients together; more is `Overloaded`.

    Raises:
        ValueError: a non-positive TTL, timeout or lease cap, or a negative `retry_after_ms`.
    """

    def __init__(
        self,
        *,
        session_idle_ttl_s: float = DEFAULT_SESSION_IDLE_TTL_S,
        retry_after_ms: int = DEFAULT_RETRY_AFTER_MS,
        engine_timeout_s: float | None = None,
        gateway_timeout_s: float | None = None,
        max_leases: int = DEFAULT_MAX_LEASES,
    ):
        if not session_idle_ttl_s > 0 or retry_after_ms < 0 or max_leases < 1:
            raise ValueError("session_idle_ttl_s must be > 0, retry_after_ms >= 0, max_leases >= 1")
        for name, value in (("engine_timeout_s", engine_timeout_s), ("gateway_timeout_s", gateway_timeout_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self._session_idle_ttl_s = session_idle_ttl_s
        self._retry_after_ms = retry_after_ms
        self._engine_timeout_s = engine_timeout_s
        self._gateway_timeout_s = gateway_timeout_s
        self._max_leases = max_leases
        self._gateways: dict[str, float] = {}  # gateway_id -> last_seen, monotonic seconds
        self._engines: dict[str, EngineRecord] = {}
        self._dead_epochs: dict[str, int] = {}  # engine_id -> highest epoch declared dead
        self._leases: dict[str, Lease] = {}
        self._reservations: dict[str, Reservation] = {}
        self._sessions: dict[str, HeldSession] = {}
        self._next_resv = 0

    # ---- engines ------------------------------------------------------------------------

    def register_engine(
        self,
        engine_id: str,
        epoch: int,
        capacity_tokens: int,
        bytes_per_token: int,
        *,
        window_tokens: int | None = None,
        max_slots: int | None = None,
        now: float = 0.0,
        report: EngineReport | None = None,
    ) -> Released:
        """Add an engine, or replace an older epoch of it (dropping and returning all its state).

        A repeated HELLO of the live epoch only updates the geometry and `last_seen`.

        Args:
            engine_id (str), epoch (int): the engine and its restart count.
            capacity_tokens (int): KV tokens its cache holds, all slots together.
            bytes_per_token (int): bytes one KV token costs, all layers.
            window_tokens (int | None): sliding window on every layer, tokens; caps liability.
            max_slots (int | None): sequences it holds at once; None: slots are not counted.
            now (float): monotonic seconds; starts the liveness timer.
            report (EngineReport | None): pid and slots, for stats.

        Raises:
            BadRequest: non-positive capacity or window, negative bytes, or an epoch not newer
                than one already declared dead or live.
        """
        if capacity_tokens < 1 or bytes_per_token < 0 or epoch < 0:
            raise BadRequest("engine geometry needs capacity_tokens >= 1, bytes_per_token >= 0")
        if window_tokens is not None and window_tokens < 1:
            raise BadRequest(f"window_tokens must be >= 1, got {window_tokens}")
        if max_slots is not None and max_slots < 1:
            raise BadRequest(f"max_slots must be >= 1, got {max_slots}")
        if self.is_stale(engine_id, epoch):
            raise BadRequest(f"engine {engine_id} epoch {epoch} is stale")
        live = self._engines.get(engine_id)
        if live and live.epoch == epoch:
            live.capacity_tokens, live.bytes_per_token = capacity_tokens, bytes_per_token
            live.window_tokens, live.last_seen = window_tokens, now
            live.max_slots, live.report = max_slots, report or live.report
            return Released()
        released = self.engine_dead(engine_id, live.epoch) if live else Released()
        self._engines[engine_id] = EngineRecord(
            engine_id, epoch, capacity_tokens, bytes_per_token, window_tokens=window_tokens,
            max_slots=max_slots, last_seen=now, report=report or EngineReport(),
        )  # fmt: skip
        return released

    def heartbeat(
        self, engine_id: str, epoch: int, now: float, report: EngineReport | None = None
    ) -> bool:
        """Refresh a live engine's `last_seen` (and its report); False if not live at `epoch`."""
        live = self._engines.get(engine_id)
        if live is None or live.epoch != epoch:
            return False
        live.last_seen = now
        if report is not None:
            live.report = replace(report, pid=report.pid or live.report.pid)
        return True

    def is_stale(self, engine_id: str, epoch: int) -> bool:
        """Whether `epoch` was declared dead or is older than the live epoch (it must restart)."""
        live = self._engines.get(engine_id)
        dead = self._dead_epochs.get(engine_id)
        return (dead is not None and epoch <= dead) or (live is not None and epoch < live.epoch)

    def engine_dead(self, engine_id: str, epoch: int) -> Released:
        """Drop every reservation and session of that engine's live epoch if it is <= `epoch`.

        A report about an epoch older than the live one changes nothing (a late message); any
        epoch <= `epoch` can never register again.
        """
        self._dead_epochs[engine_id] = max(epoch, self._dead_epochs.get(engine_id, epoch))
        live = self._engines.get(engine_id)
        released = Released()
        if live is None or live.epoch > epoch:
            return released
        released.part(engine_id, live.epoch).engine_dead = True
        for resv in [r for r in self._reservations.values() if r.engine_id == engine_id]:
            self._drop_reservation(resv, released)
        for sess in [s for s in self._sessions.values() if s.engine_id == engine_id]:
            self._drop_session(sess, released)
        del self._engines[engine_id]
        return released

    # ---- leases -------------------------------------------------------------------------

    def open_lease(self, ttl_s: float, now: float, *, gateway_id: str | None = None) -> Lease:
        """Open a lease that expires `ttl_s` seconds after `now` unless renewed.

        Raises:
            BadRequest: `ttl_s` is not a positive finite number of seconds.
            Overloaded: `max_leases` leases are open.
        """
        if not 0 < ttl_s < float("inf"):
            raise BadRequest(f"ttl_s must be a positive number of seconds, got {ttl_s}")
        if len(self._leases) >= self._max_leases:
            raise Overloaded(f"{len(self._leases)} leases are open (max_leases)", self._retry_after_ms)
        lease_id = f"lease-{secrets.token_hex(8)}"
        self._leases[lease_id] = Lease(lease_id, ttl_s, now + ttl_s, gateway_id=gateway_id)
        return self._leases[lease_id]

    def renew(self, lease_id: str, now: float) -> Lease:
        """Extend a live lease to `now + ttl_s`.

        Raises:
            LeaseExpired: the lease is unknown, closed, or already past its expiry.
        """
        lease = self._live_lease(lease_id, now)
        self._leases[lease_id] = replace(lease, expires_at=now + lease.ttl_s)
        return self._leases[lease_id]

    def close_lease(self, lease_id: str) -> Released:
        """End a lease with all its reservations and sessions; unknown ids release nothing."""
        released = Released()
        if lease_id in self._leases:
            self._end_lease(lease_id, released)
        return released

    def expire(self, now: float) -> Released:
        """End silent engines, leases past expiry (with their items) and idle sessions.

        Engines silent for `engine_timeout_s` go first, so their items are reported in parts
        marked `engine_dead`.
        """
        released = Released()
        if self._gateway_timeout_s is not None:
            timeout_s = self._gateway_timeout_s
            for gateway_id in [g for g, seen in self._gateways.items() if is_silent(seen, now, timeout_s)]:
                self._merge(released, self.drop_gateway(gateway_id))
        if self._engine_timeout_s is not None:
            timeout_s = self._engine_timeout_s
            for engine in [e for e in self._engines.values() if is_silent(e.last_seen, now, timeout_s)]:
                self._merge(released, self.engine_dead(engine.engine_id, engine.epoch))
        for lease in [x for x in self._leases.values() if x.expires_at <= now]:
            self._end_lease(lease.lease_id, released)
        for sess in list(self._sessions.values()):
            if sess.resv_id is None and sess.idle_expires_at <= now:
                self._drop_session(sess, released)
        return released

    # ---- gateways -----------------------------------------------------------------------

    def gateway_seen(self, gateway_id: str, now: float) -> None:
        """Record that a gateway instance is live (its heartbeat)."""
        self._gateways[gateway_id] = now

    def drop_gateway(self, gateway_id: str) -> Released:
        """Release every reservation, lease and session the gateway instance made."""
        released = Released()
        self._gateways.pop(gateway_id, None)
        for resv in [r for r in self._reservations.values() if r.gateway_id == gateway_id]:
            self._drop_reservation(resv, released)
        for lease in [x for x in self._leases.values() if x.gateway_id == gateway_id]:
            self._end_lease(lease.lease_id, released)
        for sess in [s for s in self._sessions.values() if s.gateway_id == gateway_id]:
            self._drop_session(sess, released)
        return released

    # ---- reservations -------------------------------------------------------------------

    def can_reserve(
        self, tokens: int, *, engine_id: str | None = None, session_id: str | None = None
    ) -> bool:
        """Whether `reserve` would succeed now for that size (leases are not checked)."""
        session = self._sessions.get(session_id) if session_id else None
        if tokens < 1 or (session and session.resv_id):
            return False
        return self._choose(tokens, engine_id, session) is not None

    def make_room(
        self,
        tokens: int,
        *,
        now: float,
        lease_id: str | None = None,
        session_id: str | None = None,
        new_session: bool | None = None,
    ) -> Released:
        """Evict idle sessions, oldest idle first, so that `reserve` of this request fits.

        Changes nothing when the request fits already, is invalid, or would not fit even
        after evicting every idle session of its candidate engines. Never evicts the
        request's own session.

        Returns:
            Released: the evicted sessions (tell their engines and the gateway).
        """
        released = Released()
        try:
            if tokens < 1:
                return released
            if lease_id is not None:
                self._live_lease(lease_id, now)
            session = self._usable_session(session_id, lease_id, new_session)
        except (BadRequest, LeaseExpired):
            return released
        if self._choose(tokens, None, session) is not None:
            return released
        candidates = [self._engines[session.engine_id]] if session else list(self._engines.values())
        idle = [s for s in self._sessions.values() if s.resv_id is None and s.session_id != session_id]
        plan = eviction_plan(candidates, idle, tokens, needs_slot=session is None)
        for victim in plan[1] if plan else []:
            self._drop_session(victim, released)
        return released

    def reserve(
        self,
        request_id: str,
        tokens: int,
        *,
        now: float,
        lease_id: str | None = None,
        session_id: str | None = None,
        new_session: bool | None = None,
        engine_id: str | None = None,
        gateway_id: str | None = None,
    ) -> Reservation:
        """Hold `tokens` of KV capacity on the live engine with the most free tokens.

        A reservation under a lease renews it, like `renew`.

        Args:
            request_id (str): the gateway's request id, returned in `Released.request_ids`.
            tokens (int): prompt tokens (a session turn: only its new tokens) + capped max_tokens.
            now (float): monotonic seconds.
            lease_id (str | None): the client's lease; the reservation ends with it.
            session_id (str | None): a known session pins the engine; an unknown one is created.
            new_session (bool | None): True: `session_id` must not be live; False: it must be
                live; None: either.
            engine_id (str | None): preferred engine, used when the request fits there.
            gateway_id (str | None): the gateway instance asking; the reservation (and a
                session it starts) is released with it.

        Returns:
            Reservation: the new reservation (frozen; the ledger keeps its own reference).

        Raises:
            LeaseExpired: `lease_id` is unknown or expired.
            BadRequest: tokens < 1, the session has a turn in flight or another lease, is live
                but `new_session` is True or unknown but `new_session` is False, or the request
                can never fit any candidate engine's capacity.
            Overloaded: no live engine, or no engine has the tokens and, unless it is a
                continued session turn, a slot free now (`retry_after_ms` set).
        """
        if tokens < 1:
            raise BadRequest(f"a reservation needs at least 1 token, got {tokens}")
        if lease_id is not None:
            self._live_lease(lease_id, now)
        session = self._usable_session(session_id, lease_id, new_session)
        self._check_can_ever_fit(tokens, session)
        engine = self._choose(tokens, engine_id, session)
        if engine is None:
            slot = " and a free slot" if session is None else ""
            raise Overloaded(f"no engine has {tokens} free tokens{slot} now", self._retry_after_ms)
        if lease_id is not None:
            self.renew(lease_id, now)
        tokens = engine.liability(tokens)
        self._next_resv += 1
        resv = Reservation(
            resv_id=f"resv-{self._next_resv}",
            lease_id=lease_id,
            session_id=session_id,
            request_id=request_id,
            engine_id=engine.engine_id,
            epoch=engine.epoch,
            tokens_reserved=tokens,
            gateway_id=gateway_id,
        )
        self._reservations[resv.resv_id] = resv
        engine.reserved_tokens += tokens
        engine.reserved_slots += session_id is None
        if session_id is not None:
            self._start_turn(session, session_id, resv, now)
        return resv

    def reconcile(self, resv_id: str, tokens_observed: int) -> Reservation | None:
        """Record the engine's latest count of KV tokens the request added; None if released."""
        if tokens_observed < 0:
            raise BadRequest(f"tokens_observed must be >= 0, got {tokens_observed}")
        old = self._reservations.get(resv_id)
        if old is None:
            return None
        new = replace(old, tokens_observed=tokens_observed)
        self._reservations[resv_id] = new
        self._engines[old.engine_id].reserved_tokens += new.liability_tokens - old.liability_tokens
        return new

    def release(
        self, resv_id: str, *, now: float, keep_session_tokens: int | None = None
    ) -> Reservation | None:
        """Free a finished request's reservation; idempotent (None if already released).

        Args:
            resv_id (str): the reservation.
            now (float): monotonic seconds; restarts the session's idle timer.
            keep_session_tokens (int | None): the engine's count of KV tokens it keeps for the
                reservation's session after this turn; it replaces the session's hold. None:
                nothing is kept and the session, if any, ends.
        """
        if keep_session_tokens is not None and keep_session_tokens < 0:
            raise BadRequest(f"keep_session_tokens must be >= 0, got {keep_session_tokens}")
        resv = self._reservations.pop(resv_id, None)
        if resv is None:
            return None
        self._engines[resv.engine_id].reserved_tokens -= resv.liability_tokens
        self._engines[resv.engine_id].reserved_slots -= resv.session_id is None
        session = self._sessions.get(resv.session_id) if resv.session_id else None
        if session is not None and session.resv_id == resv_id:
            if keep_session_tokens is None:
                self._drop_session(session, Released())
            else:
                self._end_turn(session, keep_session_tokens, now)
        return resv

    # ---- sessions -----------------------------------------------------------------------

    def close_session(self, session_id: str) -> Released:
        """End a session: free its hold and abort its turn in flight, if any."""
        released = Released()
        session = self._sessions.get(session_id)
        if session is not None:
            if session.resv_id is not None:
                self._drop_reservation(self._reservations[session.resv_id], released)
            self._drop_session(self._sessions[session_id], released)
        return released

    # ---- queries ------------------------------------------------------------------------

    def reservation(self, resv_id: str) -> Reservation | None:
        return self._reservations.get(resv_id)

    def session(self, session_id: str) -> HeldSession | None:
        return self._sessions.get(session_id)

    def lease(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def stats(self) -> LedgerStats:
        """Per-engine token usage and counts of live items (a snapshot)."""
        engines = [
            EngineUsage(
                engine_id=e.engine_id, epoch=e.epoch, capacity_tokens=e.capacity_tokens,
                reserved_tokens=e.reserved_tokens, held_tokens=e.held_tokens, free_tokens=e.free_tokens,
                bytes_per_token=e.bytes_per_token, used_slots=e.report.used_slots, max_slots=e.report.max_slots,
                reserved_slots=e.reserved_slots, engine_tokens=e.report.engine_tokens, pid=e.report.pid,
                prefix_cache=e.report.prefix_cache, device=e.report.device,
                cuda_visible_devices=e.report.cuda_visible_devices,
            )
            for e in sorted(self._engines.values(), key=lambda e: e.engine_id)
        ]  # fmt: skip
        return LedgerStats(engines, len(self._reservations), len(self._leases), len(self._sessions))

    def check_invariants(self) -> None:
        """Raise AssertionError if any counter disagrees with the items (for tests and debug)."""
        for engine in self._engines.values():
            mine = engine.engine_id
            reserved = sum(
                r.liability_tokens for r in self._reservations.values() if r.engine_id == mine
            )
            held = sum(s.tokens_held for s in self._sessions.values() if s.engine_id == mine)
            slots = sum(1 for s in self._sessions.values() if s.engine_id == mine) + sum(
                1 for r in self._reservations.values() if r.engine_id == mine and r.session_id is None
            )
            if (reserved, held, slots) != (engine.reserved_tokens, engine.held_tokens, engine.reserved_slots):
                raise AssertionError(f"{engine.engine_id}: counters {engine} != {reserved}, {held}, {slots}")
            if engine.max_slots is not None and engine.reserved_slots > engine.max_slots:
                raise AssertionError(f"{engine.engine_id}: {engine.reserved_slots} slots of {engine.max_slots}")
        for item in [*self._reservations.values(), *self._sessions.values()]:
            live = self._engines.get(item.engine_id)
            if live is None or live.epoch != item.epoch:
                raise AssertionError(f"{item} outlived its engine epoch")
            if item.lease_id is not None and item.lease_id not in self._leases:
                raise AssertionError(f"{item} outlived its lease")
        for sess in self._sessions.values():
            turn = self._reservations.get(sess.resv_id) if sess.resv_id else None
            if sess.resv_id is not None and (turn is None or turn.session_id != sess.session_id):
                raise AssertionError(f"{sess} points at a missing turn")

    # ---- private ------------------------------------------------------------------------

    def _live_lease(self, lease_id: str, now: float) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None or lease.expires_at <= now:
            raise LeaseExpired(f"lease {lease_id} is unknown or expired")
        return lease

    def _usable_session(
        self, session_id: str | None, lease_id: str | None, new_session: bool | None
    ) -> HeldSession | None:
        session = self._sessions.get(session_id) if session_id else None
        if session_id is not None and new_session is True and session is not None:
            raise BadRequest(f"session {session_id} is already live")
        if session_id is not None and new_session is False and session is None:
            raise BadRequest(f"session {session_id} is unknown or ended; start it again")
        if session is not None and session.resv_id is not None:
            raise BadRequest(f"session {session_id} already has a request in flight")
        if session is not None and session.lease_id != lease_id:
            raise BadRequest(f"session {session_id} belongs to another lease")
        return session

    def _check_can_ever_fit(self, tokens: int, session: HeldSession | None) -> None:
        if session is not None:
            engine = self._engines[session.engine_id]
            if session.tokens_held + engine.liability(tokens) > engine.capacity_tokens:
                raise BadRequest(
                    f"session {session.session_id} would need {session.tokens_held + tokens} "
                    f"tokens but engine {engine.engine_id} holds {engine.capacity_tokens}"
                )
            return
        if not self._engines:
            raise Overloaded("no live engine", self._retry_after_ms)
        if not any(e.liability(tokens) <= e.capacity_tokens for e in self._engines.values()):
            largest = max(e.capacity_tokens for e in self._engines.values())
            raise BadRequest(
                f"request needs {tokens} tokens but the largest engine holds {largest}"
            )

    def _choose(
        self, tokens: int, engine_id: str | None, session: HeldSession | None
    ) -> EngineRecord | None:
        if session is not None:
            return choose_engine([self._engines[session.engine_id]], tokens, needs_slot=False, hint=engine_id)
        return choose_engine(self._engines.values(), tokens, needs_slot=True, hint=engine_id)

    def _start_turn(
        self, session: HeldSession | None, session_id: str, resv: Reservation, now: float
    ) -> None:
        if session is None:
            session = HeldSession(
                session_id=session_id,
                engine_id=resv.engine_id,
                epoch=resv.epoch,
                lease_id=resv.lease_id,
                tokens_held=0,
                idle_expires_at=now + self._session_idle_ttl_s,
                gateway_id=resv.gateway_id,
            )
            self._engines[resv.engine_id].reserved_slots += 1
        self._sessions[session_id] = replace(session, resv_id=resv.resv_id)

    def _end_turn(self, session: HeldSession, tokens_held: int, now: float) -> None:
        self._engines[session.engine_id].held_tokens += tokens_held - session.tokens_held
        idle_expires_at = now + self._session_idle_ttl_s
        self._sessions[session.session_id] = replace(
            session, tokens_held=tokens_held, resv_id=None, idle_expires_at=idle_expires_at
        )

    @staticmethod
    def _merge(into: Released, other: Released) -> None:
        for engine_id, part in other.engines.items():
            mine = into.part(engine_id, part.epoch)
            mine.resv_ids += part.resv_ids
            mine.request_ids += part.request_ids
            mine.session_ids += part.session_ids
            mine.engine_dead |= part.engine_dead
        into.lease_ids.extend(other.lease_ids)

    def _end_lease(self, lease_id: str, released: Released) -> None:
        for resv in [r for r in self._reservations.values() if r.lease_id == lease_id]:
            self._drop_reservation(resv, released)
        for sess in [s for s in self._sessions.values() if s.lease_id == lease_id]:
            self._drop_session(sess, released)
        del self._leases[lease_id]
        released.lease_ids.append(lease_id)

    def _drop_reservation(self, resv: Reservation, released: Released) -> None:
        del self._reservations[resv.resv_id]
        self._engines[resv.engine_id].reserved_tokens -= resv.liability_tokens
        self._engines[resv.engine_id].reserved_slots -= resv.session_id is None
        part = released.part(resv.engine_id, resv.epoch)
        part.resv_ids.append(resv.resv_id)
        part.request_ids.append(resv.request_id)
        session = self._sessions.get(resv.session_id) if resv.session_id else None
        if session is not None and session.resv_id == resv.resv_id:
            self._sessions[session.session_id] = replace(session, resv_id=None)

    def _drop_session(self, session: HeldSession, released: Released) -> None:
        del self._sessions[session.session_id]
        self._engines[session.engine_id].held_tokens -= session.tokens_held
        self._engines[session.engine_id].reserved_slots -= 1
        released.part(session.engine_id, session.epoch).session_ids.append(session.session_id)
