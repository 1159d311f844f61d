"""The gateway's multi-turn sessions: who owns each, whether a turn is in flight, and history.

Pure bookkeeping. The controller's ledger is the authority on a session's capacity and life;
this table keeps what the gateway needs to encode and cap the next turn and to answer a turn
on an ended session with the reason it ended.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from shared.errors import BadRequest, ButtermilkError, EngineFailed, ErrorCode

from .prompts import Turn

MAX_ENDED_REMEMBERED = 4096  # ended sessions whose end reason is kept for later turns


@dataclass(slots=True)
class SessionRecord:
    session_id: str
    lease_id: str | None
    turn: Turn | None = None  # None until the first turn finished on an engine
    busy: bool = True  # a turn is queued or running
    engine_id: str | None = None  # where its KV lives, once placed


class SessionTable:
    """Sessions by client-chosen id (one namespace for all clients)."""

    def __init__(self):
        self._live: dict[str, SessionRecord] = {}
        self._ended: OrderedDict[str, ErrorCode] = OrderedDict()

    def check_turn(self, session_id: str, lease_id: str | None, new_session: bool) -> Turn | None:
        """The history a turn would continue (None for a new session); changes nothing.

        Raises:
            BadRequest: a new session whose id is live, a turn on an unknown, busy or
                other lease's session.
            EngineFailed: the session ended because its engine died.
        """
        record = self._live.get(session_id)
        if new_session:
            if record is not None:
                raise BadRequest(f"session {session_id!r} is already live")
            return None
        if record is None or record.turn is None:
            raise self._unknown(session_id, record)
        if record.busy:
            raise BadRequest(f"session {session_id!r} already has a turn in flight")
        if record.lease_id != lease_id:
            raise BadRequest(f"session {session_id!r} belongs to another lease")
        return record.turn

    def begin_turn(self, session_id: str, lease_id: str | None, new_session: bool) -> None:
        """Mark a turn in flight (after `check_turn` passed); a new session is created."""
        if new_session:
            self._live[session_id] = SessionRecord(session_id, lease_id)
            self._ended.pop(session_id, None)
        else:
            self._live[session_id].busy = True

    def place(self, session_id: str, engine_id: str) -> None:
        """Record the engine a session's turn runs on (the same for every turn)."""
        record = self._live.get(session_id)
        if record is not None:
            record.engine_id = engine_id

    def on_engine(self, engine_id: str) -> list[str]:
        """Ids of the live sessions placed on that engine."""
        return [s.session_id for s in self._live.values() if s.engine_id == engine_id]

    def end_turn(self, session_id: str, turn: Turn | None) -> None:
        """A turn ended; `turn` is the history the engine now holds (None: nothing kept)."""
        record = self._live.get(session_id)
        if record is None:
            return
        record.busy = False
        if turn is not None:
            record.turn = turn
        elif record.turn is None:
            del self._live[session_id]  # a first turn that kept nothing: no session

    def drop(self, session_id: str, code: ErrorCode) -> None:
        """The session ended (closed, expired, engine death); remember why."""
        self._live.pop(session_id, None)
        self._ended[session_id] = code
        while len(self._ended) > MAX_ENDED_REMEMBERED:
            self._ended.popitem(last=False)

    def get(self, session_id: str) -> SessionRecord | None:
        return self._live.get(session_id)

    def __len__(self) -> int:
        return len(self._live)

    def _unknown(self, session_id: str, record: SessionRecord | None) -> ButtermilkError:
        if record is not None:
            return BadRequest(f"session {session_id!r} has not finished its first turn yet")
        if self._ended.get(session_id) == ErrorCode.ENGINE_FAILED:
            return EngineFailed(f"session {session_id!r} was lost with its engine; start it again")
        return BadRequest(f"session {session_id!r} is unknown or ended; start it with new_session")
