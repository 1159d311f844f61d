"""Addressed messages the gateway core emits, and the relay of client control requests.

Lease verbs, `session_close` and `stats` are answered by the controller. `ControlRelay` gives
each forwarded request its own correlation id, restores the client's ids in the reply and
answers `internal` when the controller stays silent past the deadline. A lease the
controller opens after that deadline has no owner (its client got `internal`), so the relay
closes it when the late answer arrives. Pure, `now` injected.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from shared.errors import ErrorCode
from shared.protocol import Error, Generate, LeaseClose, LeaseGranted, Message, MessageType, StatsReply

from .prompts import Turn

MAX_ABANDONED = 4096  # lease_opens answered `internal` whose late lease is closed on arrival


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


@dataclass(frozen=True, slots=True)
class ToTokenizer:
    """Encode a generate off the event loop; the result goes to `GatewayCore.on_prepared`."""

    request_id: str  # the gateway's request id
    msg: Generate
    turn: Turn | None  # the session history it continues, if any


Send = ToClient | ToController | ToEngine | ToTokenizer


@dataclass(frozen=True, slots=True)
class PendingControl:
    identity: bytes
    client_id: str | None  # the client's correlation id, restored in the reply
    deadline: float  # monotonic seconds; past it the client gets `internal`
    kind: MessageType  # the forwarded request's type
    session_id: str | None = None  # session_close: the client's session id, restored in the reply


@dataclass(frozen=True, slots=True)
class Answer:
    pending: PendingControl
    send: ToClient


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
        self._abandoned: OrderedDict[str, None] = OrderedDict()  # lease_open correlation ids

    def forward(self, identity: bytes, msg: Message, now: float, *, session_id: str | None = None) -> ToController:
        """The message to send the controller in place of a client's `msg`.

        Args:
            session_id: the client's session id when `msg` names the internal one instead.
        """
        self._next += 1
        corr = f"{self._prefix}-c{self._next}"
        self._pending[corr] = PendingControl(identity, msg.id, now + self._timeout_s, msg.TYPE, session_id)
        return ToController(msg.model_copy(update={"id": corr}))

    def reply(self, msg: Message, gateway_stats: dict) -> Answer | ToController | None:
        """The controller's answer addressed to its client (a stats reply gains the gateway's
        fields, `gateway_stats`: its pool and limits); a `lease_close` for a lease opened too
        late; None when nothing waits for it."""
        corr = getattr(msg, "id", None) or ""
        pending = self._pending.pop(corr, None)
        if pending is None:
            abandoned = self._abandoned.pop(corr, 0) is None  # its client was answered `internal`
            return ToController(LeaseClose(lease_id=msg.lease_id)) if abandoned and isinstance(msg, LeaseGranted) else None
        update: dict = {"id": pending.client_id}
        if isinstance(msg, StatsReply):
            update |= gateway_stats
        if pending.session_id is not None and hasattr(msg, "session_id"):
            update["session_id"] = pending.session_id
        return Answer(pending, ToClient(pending.identity, msg.model_copy(update=update)))

    def expire(self, now: float) -> list[Answer]:
        """`internal` errors for the requests whose deadline passed."""
        late = [c for c, p in self._pending.items() if p.deadline <= now]
        answers = []
        for corr in late:
            pending = self._pending.pop(corr)
            if pending.kind is MessageType.LEASE_OPEN:
                self._abandoned[corr] = None
                while len(self._abandoned) > MAX_ABANDONED:
                    self._abandoned.popitem(last=False)
            error = Error(id=pending.client_id, code=ErrorCode.INTERNAL,
                          message="the controller did not answer in time")  # fmt: skip
            answers.append(Answer(pending, ToClient(pending.identity, error)))
        return answers

    def num_pending(self, identity: bytes) -> int:
        return sum(1 for p in self._pending.values() if p.identity == identity)
