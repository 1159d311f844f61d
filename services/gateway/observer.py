"""What the gateway core reports as it routes: request lifecycle facts and engine reports.

The core calls a `StreamObserver` at each fact (with `now`, monotonic seconds) and never
reads anything back, so it stays pure; `metrics.GatewayMetrics` turns the facts into
Prometheus series. `NullObserver` is the default.
"""

from __future__ import annotations

from typing import Protocol

from shared.protocol import Done, Error, Heartbeat, Hello, Revoked

from .streams import Stream


class StreamObserver(Protocol):
    def received(self, now: float) -> None:
        """A generate reached the core (it will end with exactly one `done` or `error`)."""

    def refused(self, code: str, now: float) -> None:
        """A received generate was refused before it had a stream (an `ErrorCode` value)."""

    def started(self, stream: Stream, now: float) -> None:
        """The stream left the FIFO queue: its reservation is requested now."""

    def tokens(self, stream: Stream, num_tokens: int, now: float) -> None:
        """An engine chunk of `num_tokens` tokens arrived for an open stream."""

    def ended(self, stream: Stream, terminal: Done | Error, now: float) -> None:
        """The stream's one terminal message is being sent."""

    def engine_message(self, msg: Hello | Heartbeat, now: float) -> None:
        """An engine's HELLO or heartbeat (geometry, KV and slot use)."""

    def revoked(self, msg: Revoked) -> None:
        """The controller dropped work (lease expiry, engine death, closes)."""


class NullObserver:
    """Observes nothing."""

    def received(self, now: float) -> None: ...
    def refused(self, code: str, now: float) -> None: ...
    def started(self, stream: Stream, now: float) -> None: ...
    def tokens(self, stream: Stream, num_tokens: int, now: float) -> None: ...
    def ended(self, stream: Stream, terminal: Done | Error, now: float) -> None: ...
    def engine_message(self, msg: Hello | Heartbeat, now: float) -> None: ...
    def revoked(self, msg: Revoked) -> None: ...
