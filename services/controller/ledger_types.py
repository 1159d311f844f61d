"""Value types of the controller's ledger: what it holds and what its verbs return.

`services.controller.ledger` re-exports these; the `Ledger` class is the only writer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.protocol import EngineUsage, PrefixCacheUsage


@dataclass(frozen=True, slots=True)
class EngineReport:
    """What an engine last said about itself (HELLO and heartbeats); for stats only."""

    pid: int | None = None  # the engine's OS process id
    device: str | None = None  # its device ("cpu", "gpu:0 (NVIDIA H200)"), from its HELLO
    cuda_visible_devices: str | None = None  # its CUDA_VISIBLE_DEVICES, from its HELLO
    max_slots: int = 0  # sequences it can hold at once
    used_slots: int = 0  # slots held now, sessions between turns included
    engine_tokens: int = 0  # KV tokens its cache holds now
    prefix_cache: PrefixCacheUsage | None = None  # its prefix cache figures, relayed as is


@dataclass(slots=True)
class EngineRecord:
    """One live engine epoch (mutable; owned by the ledger)."""

    engine_id: str
    epoch: int  # the live epoch; older epochs have no state here
    capacity_tokens: int
    bytes_per_token: int
    window_tokens: int | None = None  # sliding window on every layer: most KV tokens kept
    max_slots: int | None = None  # sequences it holds at once; None: slots are not counted
    last_seen: float = 0.0  # monotonic seconds of its HELLO or latest heartbeat
    report: EngineReport = field(default_factory=EngineReport)
    reserved_tokens: int = 0  # sum of reservation liabilities
    held_tokens: int = 0  # sum of session holds
    reserved_slots: int = 0  # sessions (between turns or not) + reservations without a session

    @property
    def free_tokens(self) -> int:
        return max(0, self.capacity_tokens - self.reserved_tokens - self.held_tokens)

    @property
    def free_slots(self) -> int | None:
        return None if self.max_slots is None else max(0, self.max_slots - self.reserved_slots)

    def fits(self, tokens: int, *, needs_slot: bool) -> bool:
        """Whether a request of `tokens` (and a new slot, if `needs_slot`) fits now."""
        has_slot = not needs_slot or self.free_slots is None or self.free_slots > 0
        return has_slot and self.free_tokens >= self.liability(tokens)

    def liability(self, tokens: int) -> int:
        """Tokens a request of `tokens` (prompt + max_tokens) can occupy here at most."""
        return tokens if self.window_tokens is None else min(tokens, self.window_tokens)


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    ttl_s: float  # renewal extends expiry to now + ttl_s, seconds
    expires_at: float  # monotonic seconds
    gateway_id: str | None = None  # the gateway instance that opened it; ends with it


@dataclass(frozen=True, slots=True)
class Reservation:
    resv_id: str
    lease_id: str | None
    session_id: str | None
    request_id: str
    engine_id: str
    epoch: int
    tokens_reserved: int  # prompt (new tokens only for a session turn) + capped max_tokens
    tokens_observed: int = 0  # KV tokens the engine reports this request has added
    gateway_id: str | None = None  # the gateway instance that made it; released with it

    @property
    def liability_tokens(self) -> int:
        return max(self.tokens_reserved, self.tokens_observed)


@dataclass(frozen=True, slots=True)
class HeldSession:
    session_id: str
    engine_id: str
    epoch: int
    lease_id: str | None  # the session ends with its lease; None: only idle expiry or close
    tokens_held: int  # KV tokens kept on the engine between turns
    idle_expires_at: float  # monotonic seconds; ignored while a turn is in flight
    resv_id: str | None = None  # the turn in flight, if any
    gateway_id: str | None = None  # the gateway instance that started it; ends with it


@dataclass(slots=True)
class EngineRelease:
    epoch: int
    resv_ids: list[str] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)  # abort these on the engine
    session_ids: list[str] = field(default_factory=list)  # drop these sessions' KV
    engine_dead: bool = False  # True: freed because this engine epoch died


@dataclass(slots=True)
class Released:
    """What a verb freed, per engine, so the service can tell engines and the gateway."""

    engines: dict[str, EngineRelease] = field(default_factory=dict)
    lease_ids: list[str] = field(default_factory=list)  # leases that ended

    @property
    def request_ids(self) -> list[str]:
        return [rid for part in self.engines.values() for rid in part.request_ids]

    @property
    def session_ids(self) -> list[str]:
        return [sid for part in self.engines.values() for sid in part.session_ids]

    @property
    def is_empty(self) -> bool:
        return not self.engines and not self.lease_ids

    def part(self, engine_id: str, epoch: int) -> EngineRelease:
        """The entry of one engine epoch, created empty on first use."""
        return self.engines.setdefault(engine_id, EngineRelease(epoch=epoch))


@dataclass(frozen=True, slots=True)
class LedgerStats:
    engines: list[EngineUsage]  # the wire's per-engine figures, by engine id
    num_reservations: int
    num_leases: int
    num_sessions: int
