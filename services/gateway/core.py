"""The gateway's routing logic with no sockets: decoded messages in, addressed messages out.

`GatewayCore` owns every request's `Stream`, the `RequestPool`, the engine table,
the session table, the per-client table and the relay of control requests to the controller
(`control.py`). Each `on_*` method takes one decoded message (and `now`, monotonic seconds)
and returns the messages to send, in order. The service (`service.py`) only moves frames,
and runs the tokenizer off its event loop for `ToTokenizer` sends.

A generate's path: client `generate` → tokenize (`ToTokenizer` → `on_prepared`) → pool
(FIFO, bounded, per-client caps) → controller `reserve` → `reserved` → engine
`engine_generate` → `engine_tokens`… → `engine_finished` → client `done` and controller
`release`. Every phase has a bound: at most the pool's places (`max_active + max_queue`) of
tokenizer jobs are outstanding at once, handed to the one tokenizer thread by deficit round robin
across callers (a connection; over HTTP a user, else a client address: `tokenizer_queue.py`,
`local.tokenizer_key`; a full queue makes the caller holding the most give way), each finite
(one whose request ended meanwhile is dropped or skipped), the queue has `queue_timeout_s`, the
reservation `control_timeout_s`, the engine its liveness (and its own wait timeout).
Every path ends the stream through `_end`, which sends the one terminal message, frees the
pool place and promotes the queue. A connection that goes away (`on_client_gone`) has its
requests cancelled and its own sessions closed.
"""

from __future__ import annotations

import secrets

from shared.detok import IncrementalDetokenizer
from shared.errors import (
    BadRequest,
    ButtermilkError,
    ContextOverflow,
    EngineFailed,
    ErrorCode,
    Overloaded,
    QueueTimeout,
    Unavailable,
)
from shared.protocol import (
    HEARTBEAT_S,
    Cancel,
    Done,
    EngineAbort,
    EngineDead,
    EngineFinished,
    EngineGenerate,
    EngineTokens,
    Error,
    FinishReason,
    GatewayHeartbeat,
    Generate,
    Health,
    HealthOk,
    Heartbeat,
    Hello,
    Keepalive,
    Message,
    PoolUsage,
    Release,
    Reserve,
    Reserved,
    Revoked,
    SamplingParams,
    SessionClose,
    SessionClosed,
    Usage,
    error_reply,
)
from shared.text_stream import TextStream

from .clients import ClientLimits, ClientTable
from .control import ControlRelay, Send, ToClient, ToController, ToEngine, ToTokenizer
from .counters import Counters
from .desk import ControlDesk
from .engines import EngineTable
from .local import tokenizer_key
from .outcome import done_message, emit, session_outcome
from .observer import NullObserver, StreamObserver
from .pool import Admitted, RequestPool
from .prompts import Prompt, Prompter, Turn
from .session_table import SessionTable, session_owner
from .streams import Phase, Stream
from .tokenizer_queue import TokenizerQueue

KEEPALIVE_S = 0.5  # a connection with requests in flight hears something at least this often
SESSION_PROBE_S = 2.0  # a connection holding sessions between turns gets a keepalive this often
_WAITING = (Phase.PREPARING, Phase.QUEUED, Phase.RESERVING)  # not on an engine yet


class GatewayCore:
    """Routes one gateway's traffic; see the module docstring.

    Args:
        prompter (Prompter): encodes inputs and caps `max_tokens`.
        pool (RequestPool): how many requests run at once, the FIFO queue.
        engines (EngineTable): live engines and their heartbeat timeout.
        control_timeout_s (float): longest wait for the controller's answer to a forwarded
            control request or a reservation, seconds.
        limits (ClientLimits): per-connection caps (sessions, leases, control requests, requests
            in flight); the pool holds the caps on running and queued requests.
        observer (StreamObserver | None): told every request and engine fact (metrics).
    """

    def __init__(
        self,
        prompter: Prompter,
        pool: RequestPool,
        engines: EngineTable,
        *,
        control_timeout_s: float = 5.0,
        limits: ClientLimits | None = None,
        observer: StreamObserver | None = None,
    ):
        self.prompter = prompter
        self.pool = pool
        self.engines = engines
        self.gateway_id = f"gw-{secrets.token_hex(8)}"  # this instance; owns its controller state
        self._prefix = secrets.token_hex(3)  # request ids stay unique across gateway restarts
        self.sessions = SessionTable(self._prefix)
        self.clients = ClientTable(limits or ClientLimits())
        self.counters = Counters()
        self.observer = observer or NullObserver()
        self.control_timeout_s = control_timeout_s
        self.draining = False
        self._next_id = 0
        self._next_beat = 0.0
        self._probed: dict[bytes, float] = {}  # session-holding connection -> last probe, monotonic s
        self._streams: dict[str, Stream] = {}
        self._tokenizer = TokenizerQueue()  # `ToTokenizer` jobs waiting, and the one on the thread
        self._by_client: dict[tuple[bytes, str], str] = {}
        self.desk = ControlDesk(ControlRelay(self._prefix, control_timeout_s), self.clients, self.counters)
        self._out: list[Send] = []

    # ---- entry points -------------------------------------------------------------------

    def on_client(self, identity: bytes, msg: Message, now: float) -> list[Send]:
        """Handle one decoded client message (a `CLIENT_TYPES` message)."""
        match msg:
            case Generate():
                self._generate(identity, msg, now)
            case Cancel():
                stream = self._streams.get(self._by_client.get((identity, msg.id), ""))
                if stream is not None:
                    self._cancel(stream, now)
            case Health():
                status = "ok" if self.engines.num_live else "degraded"
                self._out.append(ToClient(identity, HealthOk(
                    id=msg.id, status=status, engines_live=self.engines.num_live)))  # fmt: skip
            case SessionClose():
                self._session_close(identity, msg, now)
            case _:
                self._forward(identity, msg, now)
        return self._flush(now)

    def on_prepared(self, request_id: str, msg: Generate, result: Prompt | ButtermilkError | None,
                    now: float) -> list[Send]:
        """A `ToTokenizer` job is back (every one must come back, None where the service skipped it because its
        request had ended): queue the request, or end it with the error."""
        # Only work that reached the encoder times it: a template's refusal comes back at once, however long.
        self._tokenizer.done(request_id, now, encoded=isinstance(result, (Prompt, ContextOverflow)))
        stream = self._streams.get(request_id)
        try:
            if stream is not None and stream.phase is Phase.PREPARING:  # else ended meanwhile (cancel, shutdown…)
                if isinstance(result, ButtermilkError):
                    self._end(stream, error_reply(result, None), now)
                else:
                    self._queue(stream, msg, result, now)
        except Exception:  # a bug: the request ends `internal` rather than wait in PREPARING forever
            if stream is not None and self._streams.get(request_id) is stream:
                self._end(stream, error_reply(ButtermilkError("internal error while queueing the prompt"), None), now)
            raise
        finally:
            self._dispatch(now)  # whatever this request met, the thread's next job goes out (on the next flush)
        return self._flush(now)

    def on_client_gone(self, identity: bytes, now: float) -> list[Send]:
        """The connection is closed: cancel its requests and close the sessions it owns."""
        for request_id in self.clients.requests_of(identity):
            stream = self._streams.get(request_id)
            if stream is not None and not stream.client_gone:
                stream.client_gone = True
                self._cancel(stream, now)
        for record in self.sessions.of_connection(identity):
            self._drop_session(record.session_id, Error(code=ErrorCode.CANCELLED, message="the client went away"), now)
            self._out.append(ToController(SessionClose(session_id=record.session_id)))
        self.counters.clients_gone += 1
        return self._flush(now)

    def on_controller(self, msg: Message, now: float) -> list[Send]:
        """Handle a reply or notice from the controller."""
        match msg:
            case Reserved():
                self._reserved(msg, now)
            case Revoked():
                self._revoked(msg, now)
            case EngineDead():
                self._engine_lost(msg.engine_id, msg.epoch, now, tell_controller=False)
            case Error() if msg.id in self._streams:
                if self._streams[msg.id].phase is Phase.RESERVING:  # the controller refused it
                    self._end(self._streams[msg.id], msg, now)
            case _:
                self._control_reply(msg)
        return self._flush(now)

    def on_engine_cmd(self, identity: bytes, msg: Hello | Heartbeat, now: float) -> list[Send]:
        """Handle an engine's HELLO or heartbeat."""
        self.observer.engine_message(msg, now)
        if isinstance(msg, Hello):
            replaced = self.engines.register(msg, identity, now)
            if replaced is not None:
                self._engine_lost(replaced.engine_id, replaced.epoch, now, tell_controller=False)
        else:
            self.engines.heartbeat(msg.engine_id, msg.epoch, now)
        return self._flush(now)

    def on_engine_out(self, msg: EngineTokens | EngineFinished, now: float) -> list[Send]:
        """Handle an engine's token batch or a request's end."""
        if isinstance(msg, EngineTokens):
            for chunk in msg.chunks:
                self._tokens(msg.engine_id, msg.epoch, chunk.id, chunk.token_ids, now)
        else:
            self._finished(msg, now)
        return self._flush(now)

    def tick(self, now: float, *, check_engines: bool = True) -> list[Send]:
        """Expire what waited too long; heartbeat the controller; keep quiet connections alive.

        Args:
            check_engines: False skips engine liveness this time (the service's loop was
                stalled, so heartbeats that arrived meanwhile are not read yet).
        """
        for request_id in self.pool.expire(now):
            exc = QueueTimeout(f"waited {self.pool.queue_timeout_s:.1f} s in the queue without starting")
            self._end(self._streams[request_id], error_reply(exc, None), now)
        for stream in [s for s in self._streams.values() if s.phase is Phase.RESERVING and s.deadline <= now]:
            self._reservation_timed_out(stream, now)
        if check_engines:
            for lost in self.engines.expire(now):
                self._engine_lost(lost.engine_id, lost.epoch, now, tell_controller=True)
        self._out += self.desk.expire(now)
        if now >= self._next_beat:
            self._next_beat = now + HEARTBEAT_S
            self._out.append(ToController(GatewayHeartbeat(gateway_id=self.gateway_id)))
        for identity in self.clients.quiet(now, KEEPALIVE_S):
            self._out.append(ToClient(identity, Keepalive()))
        self._probe_session_holders(now)
        return self._flush(now)

    def begin_drain(self, now: float) -> list[Send]:
        """Shutting down: refuse new work, end what has not started; running requests go on."""
        self.draining = True
        exc = Unavailable("the server is shutting down; retry once it is back")
        for stream in [s for s in self._streams.values() if s.phase in (Phase.PREPARING, Phase.QUEUED)]:
            self._end(stream, error_reply(exc, None), now)
        return self._flush(now)

    def end_all(self, now: float) -> list[Send]:
        """The drain grace is over: abort and end every request left, releasing its reservation."""
        exc = Unavailable("the server shut down before the request finished; retry once it is back")
        for stream in list(self._streams.values()):
            if stream.phase is Phase.RUNNING:
                self._abort_on_engine(stream)
                self._out.append(ToController(Release(resv_id=stream.resv_id)))
            self._end(stream, error_reply(exc, None), now)
        return self._flush(now)

    def client_error(self, identity: bytes, exc: ButtermilkError, request_id: str | None) -> list[Send]:
        """The reply to a client frame that could not be decoded."""
        return [ToClient(identity, error_reply(exc, request_id))]

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    @property
    def num_preparing(self) -> int:
        """Tokenizer jobs outstanding: requests waiting for the tokenizer thread, and the one it has (counted
        until it is back, even where its request ended meanwhile)."""
        return len(self._tokenizer)

    def is_preparing(self, request_id: str) -> bool:
        """Whether the request still waits for its tokens (false once it ended); safe from the tokenizer thread."""
        stream = self._streams.get(request_id)
        return stream is not None and stream.phase is Phase.PREPARING

    # ---- generate -----------------------------------------------------------------------

    def _generate(self, identity: bytes, msg: Generate, now: float) -> None:
        self.observer.received(now)
        owner, key = session_owner(identity, msg.lease_id), tokenizer_key(identity)
        reply_id: str | None = msg.id
        try:
            if self.draining:
                raise Unavailable("the server is shutting down; retry once it is back")
            if (identity, msg.id) in self._by_client:
                reply_id = None  # the request in flight under that id keeps its one terminal message
                raise BadRequest(f"request id {msg.id!r} is already in flight on this connection; this one is refused")
            self.clients.check_request(identity)
            turn = None
            if msg.session_id is not None:
                turn = self.sessions.check_turn(owner, msg.session_id, msg.new_session)
                if msg.new_session:
                    self.clients.check_sessions(self.sessions.num_started_by(identity))
            self._make_tokenizer_room(key, now)
        except ButtermilkError as exc:
            self.observer.refused(exc.code.value, now)
            self._out.append(ToClient(identity, error_reply(exc, reply_id)))
            return
        record = None
        if msg.session_id is not None:
            record = self.sessions.begin_turn(owner, msg.session_id, lease_id=msg.lease_id, creator=identity,
                                              new_session=msg.new_session)  # fmt: skip
        self._next_id += 1
        stream = Stream(
            request_id=f"{self._prefix}-{self._next_id}", client=identity, client_id=msg.id, stream=msg.stream,
            lease_id=msg.lease_id, session_id=record.session_id if record else None,
            new_session=msg.new_session, session_tokens=turn.context_tokens if turn else None, arrived_at=now,
        )  # fmt: skip
        self._streams[stream.request_id] = stream
        self._by_client[(identity, msg.id)] = stream.request_id
        self.clients.add_request(identity, stream.request_id, now)
        self._tokenizer.add(key, ToTokenizer(stream.request_id, msg, turn))
        self._dispatch(now)

    def _make_tokenizer_room(self, key: bytes, now: float) -> None:
        """Raises Overloaded when the tokenizer's jobs are at the pool's places (a flood of long prompts must not
        hold the one thread) and no caller (`tokenizer_key`) holds two more than `key`; else, at the bound, that
        caller's newest waiting prompt ends `overloaded` to make room. Either is told to retry when the prompt on
        the thread should be done."""
        places = self.pool.max_active + self.pool.max_queue
        if self.num_preparing < places:
            return
        retry_ms = self.pool.retry_ms(self._tokenizer.free_in_s(now))  # when the thread's job is done
        victim = self._tokenizer.victim_for(key)
        if victim is None:
            raise Overloaded(f"{self.num_preparing} prompts are waiting for the tokenizer, as many as the pool has "
                             f"places (max_active + max_queue)", retry_after_ms=retry_ms)
        stream = self._streams[victim]
        held = self._tokenizer.held_by(tokenizer_key(stream.client))
        exc = Overloaded(f"the tokenizer's {places} places are full and this prompt's caller (connection, HTTP user or "
                         f"address) held {held} of them, the most: its newest prompt made way for another caller's",
                         retry_after_ms=retry_ms)  # fmt: skip
        self._end(stream, error_reply(exc, None), now)

    def _dispatch(self, now: float) -> None:
        """Hand the tokenizer thread its next job (at `now`, seconds) if it has none, by deficit round robin."""
        job = self._tokenizer.next(now)
        if job is not None:
            self._out.append(job)

    def _queue(self, stream: Stream, msg: Generate, prompt: Prompt, now: float) -> None:
        """Tokenized: set the stream's input and ask the pool for a place."""
        top_k = msg.top_k if msg.top_k is not None and msg.top_k < self.prompter.vocab_size else None
        sampling = SamplingParams(max_tokens=prompt.max_tokens, temperature=msg.temperature, top_p=msg.top_p,
                                  top_k=top_k, seed=msg.seed)  # fmt: skip
        detok = IncrementalDetokenizer(self.prompter.tokenizer, prompt.token_ids)
        text = TextStream(detok, tuple(msg.stop), self.prompter.eos_token_ids)
        stream.prepared(prompt.token_ids, prompt.context_tokens, sampling, text)
        try:
            if self.draining:
                raise Unavailable("the server is shutting down; retry once it is back")
            admitted = self.pool.submit(stream.request_id, now, stream.client)
        except ButtermilkError as exc:
            self._end(stream, error_reply(exc, None), now)
            return
        if isinstance(admitted, Admitted):
            self._reserve(stream, now)

    def _reserve(self, stream: Stream, now: float) -> None:
        self.observer.started(stream, now)
        stream.phase, stream.deadline = Phase.RESERVING, now + self.control_timeout_s
        new_session = stream.new_session if stream.session_id is not None else None
        self._out.append(ToController(Reserve(
            request_id=stream.request_id, tokens=stream.num_reserved_tokens,
            lease_id=stream.lease_id, session_id=stream.session_id, new_session=new_session,
        )))  # fmt: skip

    def _reserved(self, msg: Reserved, now: float) -> None:
        stream = self._streams.get(msg.request_id)
        if stream is None or stream.phase is not Phase.RESERVING:
            self.counters.orphan_controller_replies += 1
            self._out.append(ToController(Release(resv_id=msg.resv_id)))
            return
        engine = self.engines.get(msg.engine_id, msg.epoch)
        if engine is None:
            self._out.append(ToController(Release(resv_id=msg.resv_id)))
            exc = EngineFailed(f"engine {msg.engine_id} epoch {msg.epoch} is not live")
            self._end(stream, error_reply(exc, None), now)
            return
        stream.phase, stream.resv_id = Phase.RUNNING, msg.resv_id
        stream.engine_id, stream.epoch = msg.engine_id, msg.epoch
        if stream.session_id is not None:
            self.sessions.place(stream.session_id, msg.engine_id)
        self._out.append(ToEngine(engine.identity, EngineGenerate(
            id=stream.request_id, resv_id=msg.resv_id, epoch=msg.epoch, token_ids=stream.token_ids,
            sampling=stream.sampling, session_id=stream.session_id, session_tokens=stream.session_tokens,
        )))  # fmt: skip
        if stream.cancel_requested:  # cancelled while reserving: the engine ends it at once
            self._out.append(ToEngine(engine.identity, EngineAbort(ids=[stream.request_id])))

    def _reservation_timed_out(self, stream: Stream, now: float) -> None:
        """The controller did not answer: end the request; a session turn ends its session
        too (whether the controller started the turn is unknown), and the controller is told."""
        if stream.session_id is not None:
            session_id = stream.session_id
            exc = Unavailable("the controller did not answer the reservation in time; the session ended")
            self._drop_session(session_id, error_reply(exc, None), now)
            self._out.append(ToController(SessionClose(session_id=session_id)))
        else:
            exc = Unavailable("the controller did not answer the reservation in time")
            self._end(stream, error_reply(exc, None), now)

    # ---- engine output ------------------------------------------------------------------

    def _tokens(self, engine_id: str, epoch: int, request_id: str, token_ids: list[int], now: float) -> None:
        stream = self._streams.get(request_id)
        if stream is None or not stream.on_engine(engine_id, epoch):
            self.counters.orphan_engine_messages += 1
            return
        if stream.text.closed:
            return
        self.observer.tokens(stream, len(token_ids), now)
        index = stream.text.num_sent
        delta = stream.text.feed(token_ids)
        self._out.extend(emit(stream, delta.text, delta.token_ids, index))
        if delta.stopped:
            self._abort_on_engine(stream)

    def _finished(self, msg: EngineFinished, now: float) -> None:
        stream = self._streams.get(msg.id)
        if stream is None or not stream.on_engine(msg.engine_id, msg.epoch):
            self.counters.orphan_engine_messages += 1
            return
        failed = msg.reason == FinishReason.ERROR
        record = self.sessions.by_id(stream.session_id) if stream.session_id else None
        keep, turn = session_outcome(stream, msg, record, failed)
        self._out.append(ToController(Release(resv_id=stream.resv_id, keep_session_tokens=keep)))
        if failed:
            code = msg.code or ErrorCode.INTERNAL
            terminal = Error(code=code, message=msg.message or "the engine failed the request")
        else:
            self._out.extend(emit(stream, stream.text.finish(), [], stream.text.num_sent, final=True))
            terminal = done_message(stream, msg)
        self._end(stream, terminal, now, turn=turn)
        if stream.session_id is not None and keep is None:
            self.sessions.drop(stream.session_id, msg.code or ErrorCode.CANCELLED)

    # ---- cancellation and endings -------------------------------------------------------

    def _cancel(self, stream: Stream, now: float) -> None:
        if stream.cancel_requested:
            return
        stream.cancel_requested = True
        if stream.phase in (Phase.PREPARING, Phase.QUEUED):  # PREPARING: context_tokens still 0, the job skipped
            usage = Usage(prompt_tokens=stream.context_tokens, completion_tokens=0)
            self._end(stream, Done(id=stream.client_id, finish_reason=FinishReason.CANCELLED, usage=usage), now)
        elif stream.phase is Phase.RUNNING and not stream.text.stopped:
            self._abort_on_engine(stream)

    def _abort_on_engine(self, stream: Stream) -> None:
        engine = self.engines.get(stream.engine_id, stream.epoch)
        if engine is not None:
            self._out.append(ToEngine(engine.identity, EngineAbort(ids=[stream.request_id])))

    def _revoked(self, msg: Revoked, now: float) -> None:
        self.observer.revoked(msg)
        error = _revoke_error(msg)
        for request_id in msg.request_ids:
            if request_id in self._streams:
                self._end(self._streams[request_id], error, now)
        ended = set(msg.lease_ids)
        for lease_id in ended:
            self.clients.lease_ended(lease_id)
        for stream in [s for s in self._streams.values() if s.lease_id in ended and s.phase in _WAITING]:
            self._end(stream, error, now)
        for session_id in msg.session_ids:
            self._drop_session(session_id, error, now)

    def _engine_lost(self, engine_id: str, epoch: int, now: float, *, tell_controller: bool) -> None:
        self.counters.engines_lost += self.engines.drop(engine_id, epoch)
        lost = [s for s in self._streams.values()
                if s.phase is Phase.RUNNING and s.engine_id == engine_id and s.epoch <= epoch]  # fmt: skip
        for stream in lost:
            exc = EngineFailed(f"engine {engine_id} (epoch {epoch}) failed mid-request")
            self._end(stream, error_reply(exc, None), now)
        for record in self.sessions.on_engine(engine_id):
            exc = EngineFailed(f"engine {engine_id} (epoch {epoch}) failed; the session was lost with it")
            self._drop_session(record.session_id, error_reply(exc, None), now)
        if tell_controller:
            self._out.append(ToController(EngineDead(engine_id=engine_id, epoch=epoch)))

    def _probe_session_holders(self, now: float) -> None:
        """Keepalives to connections owning sessions, so a closed one's sessions close too."""
        holders = self.sessions.connection_owners()
        self._probed = {i: t for i, t in self._probed.items() if i in holders}
        for identity in holders:
            if now - self._probed.get(identity, 0.0) >= SESSION_PROBE_S:
                self._probed[identity] = now
                self._out.append(ToClient(identity, Keepalive()))

    def _drop_session(self, session_id: str, error: Error, now: float, *, by_owner: bool = False) -> None:
        """A session ended: its turn waiting for a place or a reservation ends with `error`; a later turn
        learns why (`SessionTable.check_turn`), unless its owner closed it (`by_owner`)."""
        for stream in [s for s in self._streams.values() if s.session_id == session_id and s.phase in _WAITING]:
            self._end(stream, error, now)
        self.sessions.drop(session_id, None if by_owner else error.code)

    def _session_close(self, identity: bytes, msg: SessionClose, now: float) -> None:
        record = self.sessions.get(session_owner(identity, msg.lease_id), msg.session_id)
        if record is None:  # unknown, ended or someone else's: the same answer
            self._out.append(ToClient(identity, SessionClosed(id=msg.id, session_id=msg.session_id)))
            return
        try:
            self.desk.check(identity, msg)
        except ButtermilkError as exc:
            self._out.append(ToClient(identity, error_reply(exc, msg.id)))
            return
        closed = Error(code=ErrorCode.CANCELLED, message="the session was closed")
        self._drop_session(record.session_id, closed, now, by_owner=True)
        internal = msg.model_copy(update={"session_id": record.session_id, "lease_id": None})
        self._out.append(self.desk.forward(identity, internal, now, session_id=msg.session_id))

    def _end(self, stream: Stream, terminal: Done | Error, now: float, *, turn: Turn | None = None) -> None:
        """Send the one terminal message, forget the stream, free its pool place."""
        if isinstance(terminal, Error):
            terminal = terminal.model_copy(update={"id": stream.client_id})
            self.counters.ended(terminal.code.value)
        else:
            self.counters.ended(terminal.finish_reason.value)
        self.observer.ended(stream, terminal, now)
        if not stream.client_gone:
            self._out.append(ToClient(stream.client, terminal))
        if stream.phase is Phase.PREPARING:
            self._tokenizer.remove(stream.request_id)  # a waiting job goes; the thread's comes back and is dropped
        del self._streams[stream.request_id]
        del self._by_client[(stream.client, stream.client_id)]
        self.clients.end_request(stream.client, stream.request_id)
        if stream.session_id is not None:
            self.sessions.end_turn(stream.session_id, turn)
        for request_id in self.pool.finish(stream.request_id, now):
            self._reserve(self._streams[request_id], now)

    # ---- control requests ---------------------------------------------------------------

    def _forward(self, identity: bytes, msg: Message, now: float) -> None:
        """Relay a lease verb or stats to the controller, within the connection's caps."""
        try:
            self.desk.check(identity, msg)
        except ButtermilkError as exc:
            self._out.append(ToClient(identity, error_reply(exc, msg.id)))
            return
        self._out.append(self.desk.forward(identity, msg, now))

    def _control_reply(self, msg: Message) -> None:
        s = self.pool.stats()
        pool = PoolUsage(active=s.active, queued=s.queued, max_active=s.max_active, max_queue=s.max_queue,
                         preparing=self.num_preparing)
        limits = {"max_context": self.prompter.max_context, "max_tokens_cap": self.prompter.max_tokens_cap}
        self._out += self.desk.reply(msg, {"pool": pool, **limits})

    def _flush(self, now: float) -> list[Send]:
        out, self._out = self._out, []
        for send in out:
            if isinstance(send, ToClient):
                self.clients.sent(send.identity, now)
        return out


def _revoke_error(msg: Revoked) -> Error:
    reasons = {ErrorCode.LEASE_EXPIRED: "the lease expired", ErrorCode.ENGINE_FAILED: "the engine failed",
               ErrorCode.CANCELLED: "the lease or session was closed, or the idle session was evicted"}  # fmt: skip
    return Error(code=msg.code, message=reasons.get(msg.code, f"revoked ({msg.code})"))
