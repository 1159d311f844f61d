"""The gateway's view of its engines: socket identity, epoch, geometry and liveness.

Pure bookkeeping with `now` (monotonic seconds) injected. An engine is live from its HELLO
until it is declared dead: by the controller, by a newer epoch's HELLO, or by `expire`
after `timeout_s` seconds without a HELLO or heartbeat.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import Geometry, Hello, is_silent


@dataclass(slots=True)
class EngineEntry:
    engine_id: str
    epoch: int
    identity: bytes  # ROUTER identity of its engine-cmd DEALER
    geometry: Geometry
    last_seen: float  # monotonic seconds of its latest HELLO or heartbeat


@dataclass(frozen=True, slots=True)
class EngineEpoch:
    engine_id: str
    epoch: int


class EngineTable:
    """Live engines by id.

    Args:
        timeout_s (float): silence after which `expire` declares an engine dead, seconds.
    """

    def __init__(self, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._live: dict[str, EngineEntry] = {}
        self._dead: dict[str, int] = {}  # engine_id -> highest epoch known dead

    def register(self, hello: Hello, identity: bytes, now: float) -> EngineEpoch | None:
        """Record a HELLO; returns the older epoch it replaces (now dead), if any.

        A HELLO of a dead or older epoch is ignored (returns None).
        """
        live = self._live.get(hello.engine_id)
        if self.is_stale(hello.engine_id, hello.epoch):
            return None
        replaced = None
        if live is not None and live.epoch < hello.epoch:
            replaced = EngineEpoch(live.engine_id, live.epoch)
            self._dead[live.engine_id] = live.epoch
        self._live[hello.engine_id] = EngineEntry(
            hello.engine_id, hello.epoch, identity, hello.geometry, now
        )
        return replaced

    def heartbeat(self, engine_id: str, epoch: int, now: float) -> bool:
        """Refresh liveness; False when that engine epoch is not live here."""
        live = self._live.get(engine_id)
        if live is None or live.epoch != epoch:
            return False
        live.last_seen = now
        return True

    def drop(self, engine_id: str, epoch: int) -> bool:
        """Declare `epoch` (and older) dead; True if that removed the live entry."""
        self._dead[engine_id] = max(epoch, self._dead.get(engine_id, epoch))
        live = self._live.get(engine_id)
        if live is None or live.epoch > epoch:
            return False
        del self._live[engine_id]
        return True

    def expire(self, now: float) -> list[EngineEpoch]:
        """Drop engines silent for `timeout_s`; returns them."""
        silent = [e for e in self._live.values() if is_silent(e.last_seen, now, self.timeout_s)]
        for entry in silent:
            self.drop(entry.engine_id, entry.epoch)
        return [EngineEpoch(e.engine_id, e.epoch) for e in silent]

    def is_stale(self, engine_id: str, epoch: int) -> bool:
        live = self._live.get(engine_id)
        dead = self._dead.get(engine_id)
        return (dead is not None and epoch <= dead) or (live is not None and epoch < live.epoch)

    def get(self, engine_id: str, epoch: int | None = None) -> EngineEntry | None:
        """The live entry (of that epoch, when given), or None."""
        live = self._live.get(engine_id)
        if live is None or (epoch is not None and live.epoch != epoch):
            return None
        return live

    @property
    def num_live(self) -> int:
        return len(self._live)
