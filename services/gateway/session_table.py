"""The gateway's multi-turn sessions: who owns each, whether a turn is in flight, and history.

Pure bookkeeping. A session belongs to its owner: its lease when started with a `lease_id`,
else the connection that started it. Session ids are the client's and scoped by owner, so
two clients may both use "chat-1", and nothing a client sends can reach, or learn of,
another's session. The controller and engines know each session by an internal id that the
gateway assigns. The controller's ledger is the authority on a session's capacity and life;
this table keeps what the gateway needs to encode and cap the next turn.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from shared.errors import BadRequest, ButtermilkError, EngineFailed, ErrorCode, LeaseExpired, SessionEnded

from .local import is_local
from .prompts import Turn

MAX_ENDED_REMEMBERED = 4096  # ended sessions whose end reason is kept for later turns

Owner = str  # "lease:<lease_id>", "conn:<identity hex>" or HTTP_OWNER
HTTP_OWNER = "http"  # the HTTP API's sessions, whichever request started them


@dataclass(slots=True)
class SessionRecord:
    owner: Owner
    client_session_id: str  # the id the client chose
    session_id: str  # the internal id the controller and engines use
    lease_id: str | None
    creator: bytes  # the connection that started it (for its per-client cap)
    turn: Turn | None = None  # None until the first turn finished on an engine
    busy: bool = True  # a turn is in flight (being prepared, queued or running)
    engine_id: str | None = None  # where its KV lives, once placed


def session_owner(identity: bytes, lease_id: str | None) -> Owner:
    """Who owns a session named in a request from `identity` carrying `lease_id`.

    A lease owns the sessions started under it; otherwise the connection does. The HTTP API
    opens one in-process connection per request, so it owns its sessions as one client ("http").
    """
    if lease_id is not None:
        return f"lease:{lease_id}"
    return HTTP_OWNER if is_local(identity) else f"conn:{identity.hex()}"


class SessionTable:
    """Live sessions by (owner, client session id) and by internal id.

    Args:
        prefix (str): internal ids are `<prefix>-s<n>` (unique in this gateway instance).
    """

    def __init__(self, prefix: str):
        self._prefix = prefix
        self._next = 0
        self._live: dict[tuple[Owner, str], SessionRecord] = {}
        self._by_id: dict[str, SessionRecord] = {}
        self._ended: OrderedDict[tuple[Owner, str], ErrorCode] = OrderedDict()

    def check_turn(self, owner: Owner, session_id: str, new_session: bool) -> Turn | None:
        """The history a turn would continue (None for a new session); changes nothing.

        Raises:
            BadRequest: a new session whose id is live for this owner, or a turn on a session
                this owner has no live session of (never started, or closed by its owner), that
                is busy, or whose first turn has not finished.
            LeaseExpired: the owner's session expired (idle past the server's timeout, or its lease expired).
            SessionEnded: the server ended the owner's session otherwise (evicted, its lease closed, a drain).
            EngineFailed: the owner's session ended because its engine died.
        """
        record = self._live.get((owner, session_id))
        if new_session:
            if record is not None:
                raise BadRequest(f"session {session_id!r} is already live; close it or pick another id")
            return None
        if record is None:
            raise self._not_live(owner, session_id)
        if record.turn is None:
            raise BadRequest(f"session {session_id!r} has not finished its first turn yet")
        if record.busy:
            raise BadRequest(f"session {session_id!r} already has a turn in flight")
        return record.turn

    def begin_turn(
        self, owner: Owner, session_id: str, *, lease_id: str | None, creator: bytes, new_session: bool
    ) -> SessionRecord:
        """Mark a turn in flight (after `check_turn` passed); a new session is created."""
        key = (owner, session_id)
        if not new_session:
            self._live[key].busy = True
            return self._live[key]
        self._next += 1
        record = SessionRecord(owner, session_id, f"{self._prefix}-s{self._next}", lease_id, creator)
        self._live[key] = self._by_id[record.session_id] = record
        self._ended.pop(key, None)
        return record

    def get(self, owner: Owner, session_id: str) -> SessionRecord | None:
        return self._live.get((owner, session_id))

    def by_id(self, session_id: str) -> SessionRecord | None:
        """The live session with this internal id."""
        return self._by_id.get(session_id)

    def place(self, session_id: str, engine_id: str) -> None:
        """Record the engine a session's turn runs on (the same for every turn)."""
        record = self._by_id.get(session_id)
        if record is not None:
            record.engine_id = engine_id

    def on_engine(self, engine_id: str) -> list[SessionRecord]:
        """The live sessions placed on that engine."""
        return [s for s in self._by_id.values() if s.engine_id == engine_id]

    def of_connection(self, identity: bytes) -> list[SessionRecord]:
        """The live sessions owned by a connection (started without a lease)."""
        owner = session_owner(identity, None)
        return [s for s in self._by_id.values() if s.owner == owner]

    def connection_owners(self) -> set[bytes]:
        """Connections that own live sessions (sessions started without a lease)."""
        return {s.creator for s in self._by_id.values() if s.lease_id is None and not is_local(s.creator)}

    def num_started_by(self, identity: bytes) -> int:
        return sum(1 for s in self._by_id.values() if s.creator == identity)

    def end_turn(self, session_id: str, turn: Turn | None) -> None:
        """A turn ended; `turn` is the history the engine now holds (None: unchanged)."""
        record = self._by_id.get(session_id)
        if record is None:
            return
        record.busy = False
        if turn is not None:
            record.turn = turn
        elif record.turn is None:
            self._forget(record)  # a first turn that kept nothing: no session

    def drop(self, session_id: str, code: ErrorCode | None) -> SessionRecord | None:
        """The session ended; remember why for its owner's next turn (`check_turn`).

        `code`: `ENGINE_FAILED` (its engine died), `LEASE_EXPIRED` (it or its lease expired), `CANCELLED`
        (evicted, or its lease closed), another code (a turn failed), or None (its owner closed it).
        """
        record = self._by_id.get(session_id)
        if record is None:
            return None
        self._forget(record)
        key = (record.owner, record.client_session_id)
        self._ended[key] = code
        while len(self._ended) > MAX_ENDED_REMEMBERED:
            self._ended.popitem(last=False)
        return record

    def __len__(self) -> int:
        return len(self._by_id)

    def _forget(self, record: SessionRecord) -> None:
        del self._by_id[record.session_id]
        del self._live[(record.owner, record.client_session_id)]

    def _not_live(self, owner: Owner, session_id: str) -> ButtermilkError:
        ended = self._ended.get((owner, session_id))
        if ended == ErrorCode.ENGINE_FAILED:
            return EngineFailed(f"session {session_id!r} was lost with its engine; start it again")
        if ended == ErrorCode.LEASE_EXPIRED:
            return LeaseExpired(f"session {session_id!r} expired (idle past the server's timeout, or its lease "
                                "expired); start it again with new_session and its history")  # fmt: skip
        if ended is not None:
            cancelled = ended == ErrorCode.CANCELLED
            why = "evicted between turns to make room, or its lease closed" if cancelled else f"a turn failed: {ended}"
            return SessionEnded(f"session {session_id!r} was ended by the server ({why}); start it again with "
                                "new_session and its history")  # fmt: skip
        return BadRequest(f"session {session_id!r} is not live for this client (never started, or closed); "
                          "start it with new_session")  # fmt: skip
