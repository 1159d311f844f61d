"""Addressed messages the gateway core emits, and the relay of client control requests.

Lease verbs, `session_close` and `stats` are answered by the controller. `ControlRelay` gives
each forwarded request its own correlation id, restores the client's id in the reply and
answers `internal` when the controller stays silent past the deadline. Pure, `now` injected.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import ErrorCode
from shared.protocol import Error, Message, PoolUsage, StatsReply


@dataclass(frozen=True, slots=True)
class ToClient:
    identity: bytes  # ROUTER identity of the client connection
    msg: Message


@dataclass(frozen=True, slots=True)
class ToController:
    msg: Message


@dataclass(frozen=True, slots=True)
class ToEngine:
    identity: bytes  # ROUTER identity of the engine's engine-cmd DEALER
    msg: Message


Send = ToClient | ToController | ToEngine


@dataclass(frozen=True, slots=True)
class PendingControl:
    identity: bytes
    client_id: str | None  # the client's correlation id, restored in the reply
    deadline: float  # monotonic seconds; past it the client gets `internal`


class ControlRelay:
    """Control requests waiting for the controller, by correlation id.

    Args:
        prefix (str): correlation ids are `<prefix>-c<n>`, distinct from request ids.
        timeout_s (float): longest wait for the controller's answer, seconds.
    """

    def __init__(self, prefix: str, timeout_s: float):
        self._prefix, self._timeout_s = prefix, timeout_s
        self._next = 0
        self._pending: dict[str, PendingControl] = {}

    def forward(self, identity: bytes, msg: Message, now: float) -> ToController:
        """The message to send the controller in place of a client's `msg`."""
        self._next += 1
        corr = f"{self._prefix}-c{self._next}"
        self._pending[corr] = PendingControl(identity, msg.id, now + self._timeout_s)
        return ToController(msg.model_copy(update={"id": corr}))

    def reply(self, msg: Message, pool: PoolUsage) -> ToClient | None:
        """The controller's answer addressed to its client (a stats reply gains `pool`); None
        when no request waits for it."""
        pending = self._pending.pop(getattr(msg, "id", None) or "", None)
        if pending is None:
            return None
        update: dict = {"id": pending.client_id}
        if isinstance(msg, StatsReply):
            update["pool"] = pool
        return ToClient(pending.identity, msg.model_copy(update=update))

    def expire(self, now: float) -> list[ToClient]:
        """`internal` errors for the requests whose deadline passed."""
        late = [c for c, p in self._pending.items() if p.deadline <= now]
        replies = []
        for corr in late:
            pending = self._pending.pop(corr)
            error = Error(id=pending.client_id, code=ErrorCode.INTERNAL,
                          message="the controller did not answer in time")  # fmt: skip
            replies.append(ToClient(pending.identity, error))
        return replies
