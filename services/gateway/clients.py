"""Per-client accounting at the gateway: limits, and what each connection holds. Pure.

A client is one connection (the ROUTER identity of its DEALER socket). Its requests in
flight, the sessions it started, the leases it opened and its control requests waiting for
the controller are each capped (`ClientLimits`); a request over a cap gets `overloaded` with
the cap named. The pool (`pool.py`) caps its running and queued requests.

Caps are per connection: a client can open more connections, so the server-wide bounds
(`max_queue`, the controller's `max_leases`, slots with idle-session eviction) still apply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.errors import Overloaded

RETRY_AFTER_MS = 1000  # hint with a per-client refusal: the client's own work must end first


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """Caps per connection (settings `client_max_*`)."""

    max_active: int = 4  # requests generating at once
    max_queued: int = 16  # requests waiting (being tokenized or queued for a place)
    max_sessions: int = 8  # live sessions it started
    max_leases: int = 4  # live leases it opened (and lease_opens in flight)
    max_pending_control: int = 16  # lease, session and stats requests waiting for the controller

    def __post_init__(self):
        if min(self.max_active, self.max_queued + 1, self.max_sessions + 1, self.max_leases + 1,
               self.max_pending_control) < 1:  # fmt: skip
            raise ValueError(f"client limits need max_active, max_pending_control >= 1 and others >= 0: {self}")


@dataclass(slots=True)
class ClientState:
    requests: set[str] = field(default_factory=set)  # gateway request ids not ended
    leases: set[str] = field(default_factory=set)  # live leases it opened
    num_lease_opens: int = 0  # lease_open requests waiting for the controller
    last_sent: float = 0.0  # monotonic seconds of the latest message sent to it

    @property
    def is_empty(self) -> bool:
        return not (self.requests or self.leases or self.num_lease_opens)


class ClientTable:
    """What each connection holds; entries vanish when they hold nothing.

    Args:
        limits (ClientLimits): the caps.
    """

    def __init__(self, limits: ClientLimits):
        self.limits = limits
        self._clients: dict[bytes, ClientState] = {}
        self._lease_owner: dict[str, bytes] = {}

    def check_request(self, identity: bytes) -> None:
        """Raises Overloaded when the connection has its most requests in flight."""
        cap = self.limits.max_active + self.limits.max_queued
        held = len(self._get(identity).requests)
        if held >= cap:
            raise Overloaded(f"this connection has {held} requests in flight (client_max_active "
                             f"{self.limits.max_active} + client_max_queued {self.limits.max_queued})",
                             RETRY_AFTER_MS)  # fmt: skip

    def check_sessions(self, num_started: int) -> None:
        """Raises Overloaded when a connection that started `num_started` live sessions may not start one more."""
        if num_started >= self.limits.max_sessions:
            raise Overloaded(f"this connection holds {num_started} live sessions (client_max_sessions "
                             f"{self.limits.max_sessions}); close one first", RETRY_AFTER_MS)  # fmt: skip

    def check_lease_open(self, identity: bytes) -> None:
        state = self._get(identity)
        held = len(state.leases) + state.num_lease_opens
        if held >= self.limits.max_leases:
            raise Overloaded(f"this connection holds {held} leases (client_max_leases "
                             f"{self.limits.max_leases}); close one first", RETRY_AFTER_MS)  # fmt: skip

    def check_control(self, num_pending: int) -> None:
        if num_pending >= self.limits.max_pending_control:
            raise Overloaded(f"this connection has {num_pending} control requests waiting "
                             f"(client_max_pending_control {self.limits.max_pending_control})",
                             RETRY_AFTER_MS)  # fmt: skip

    def add_request(self, identity: bytes, request_id: str, now: float) -> None:
        state = self._get(identity)
        if not state.requests:
            state.last_sent = now  # quiet time counts from its first request
        state.requests.add(request_id)

    def end_request(self, identity: bytes, request_id: str) -> None:
        self._get(identity).requests.discard(request_id)
        self._prune(identity)

    def lease_open_sent(self, identity: bytes) -> None:
        self._get(identity).num_lease_opens += 1

    def lease_open_answered(self, identity: bytes, lease_id: str | None) -> None:
        """A lease_open got its answer (`lease_id`; None: an error or no answer)."""
        state = self._get(identity)
        state.num_lease_opens = max(0, state.num_lease_opens - 1)
        if lease_id is not None:
            state.leases.add(lease_id)
            self._lease_owner[lease_id] = identity
        self._prune(identity)

    def lease_ended(self, lease_id: str) -> None:
        identity = self._lease_owner.pop(lease_id, None)
        if identity is not None:
            self._get(identity).leases.discard(lease_id)
            self._prune(identity)

    def sent(self, identity: bytes, now: float) -> None:
        if identity in self._clients:
            self._clients[identity].last_sent = now

    def quiet(self, now: float, after_s: float) -> list[bytes]:
        """Connections with requests in flight that were sent nothing for `after_s` seconds."""
        return [i for i, s in self._clients.items() if s.requests and now - s.last_sent >= after_s]

    def requests_of(self, identity: bytes) -> list[str]:
        state = self._clients.get(identity)
        return sorted(state.requests) if state else []

    def __len__(self) -> int:
        return len(self._clients)

    def _get(self, identity: bytes) -> ClientState:
        return self._clients.setdefault(identity, ClientState())

    def _prune(self, identity: bytes) -> None:
        state = self._clients.get(identity)
        if state is not None and state.is_empty:
            del self._clients[identity]
