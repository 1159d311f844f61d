"""The gateway's desk for control requests: lease verbs, `session_close` and `stats`.

It relays them to the controller (`ControlRelay`) within each connection's caps (`ClientTable`:
control requests waiting, leases held), keeps the per-connection lease count in step with the
controller's answers, and closes a lease that was opened after its client got `internal`. Pure.
"""

from __future__ import annotations

from shared.protocol import LeaseClosed, LeaseGranted, LeaseOpen, Message

from .clients import ClientTable
from .control import Answer, ControlRelay, Send, ToController
from .counters import Counters


class ControlDesk:
    """Args:
    relay (ControlRelay): correlation and deadlines of forwarded requests.
    clients (ClientTable): the per-connection caps and lease counts (shared with the core).
    counters (Counters): the core's counters (orphans, timeouts, late leases).
    """

    def __init__(self, relay: ControlRelay, clients: ClientTable, counters: Counters):
        self.relay, self.clients, self.counters = relay, clients, counters

    def check(self, identity: bytes, msg: Message) -> None:
        """Raises Overloaded when the connection may not send this control request now."""
        self.clients.check_control(self.relay.num_pending(identity))
        if isinstance(msg, LeaseOpen):
            self.clients.check_lease_open(identity)

    def forward(self, identity: bytes, msg: Message, now: float, *, session_id: str | None = None) -> ToController:
        """The message for the controller (after `check` passed)."""
        if isinstance(msg, LeaseOpen):
            self.clients.lease_open_sent(identity)
        return self.relay.forward(identity, msg, now, session_id=session_id)

    def reply(self, msg: Message, gateway_stats: dict) -> list[Send]:
        """What the controller's answer becomes: the client's reply (a stats reply with
        `gateway_stats`' fields), a late lease's close, or nothing."""
        reply = self.relay.reply(msg, gateway_stats)
        if isinstance(reply, Answer):
            return self._answered(reply, msg)
        if isinstance(reply, ToController):  # a lease opened after its client was answered `internal`
            self.counters.late_leases_closed += 1
            return [reply]
        self.counters.orphan_controller_replies += 1
        return []

    def expire(self, now: float) -> list[Send]:
        """`internal` for the requests the controller left unanswered past their deadline."""
        sends: list[Send] = []
        for answer in self.relay.expire(now):
            self.counters.controller_timeouts += 1
            sends += self._answered(answer, None)
        return sends

    def _answered(self, answer: Answer, msg: Message | None) -> list[Send]:
        if answer.pending.kind.value == "lease_open":
            self.clients.lease_open_answered(answer.pending.identity, msg.lease_id if isinstance(msg, LeaseGranted) else None)
        elif isinstance(msg, LeaseClosed):
            self.clients.lease_ended(msg.lease_id)
        return [answer.send]
