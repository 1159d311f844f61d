"""The gateway core's counters: facts for logs, tests and the soak; never reset."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Counters:
    orphan_engine_messages: int = 0  # tokens or finishes for requests no longer here
    orphan_controller_replies: int = 0
    controller_timeouts: int = 0
    engines_lost: int = 0
    clients_gone: int = 0  # connections found closed with work in flight
    late_leases_closed: int = 0  # leases opened after their lease_open was answered `internal`
    streams_ended: dict[str, int] = field(default_factory=dict)  # by finish reason or code

    def ended(self, key: str) -> None:
        self.streams_ended[key] = self.streams_ended.get(key, 0) + 1
