"""The gateway's routing logic with no sockets: decoded messages in, addressed messages out.

`GatewayCore` owns every request's `Stream`, the `GenerationSessionPool`, the engine table,
the session table and the relay of control requests to the controller (`control.py`). Each `on_*` method
takes one decoded message (and `now`, monotonic seconds) and returns the messages to send,
in order. The service (`service.py`) only moves frames.

A generate's path: client `generate` → pool (FIFO, bounded) → controller `reserve` →
`reserved` → engine `engine_generate` → `engine_tokens`… → `engine_finished` → client `done`
and controller `release`. Every path ends the stream through `_end`, which sends the one
terminal message, frees the pool place and promotes the queue.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from shared.detok import IncrementalDetokenizer
from shared.errors import (
    BadRequest,
    ButtermilkError,
    EngineFailed,
    ErrorCode,
    QueueTimeout,
)
from shared.protocol import (
    Cancel,
    Done,
    EngineAbort,
    EngineDead,
    EngineFinished,
    EngineGenerate,
    EngineTokens,
    Error,
    FinishReason,
    Generate,
    Health,
    HealthOk,
    Heartbeat,
    Hello,
    Message,
    PoolUsage,
    Release,
    Reserve,
    Reserved,
    Revoked,
    SamplingParams,
    SessionClose,
    Token,
    Usage,
    error_reply,
)

from .control import ControlRelay, Send, ToClient, ToController, ToEngine
from .engines import EngineTable
from .prompts import Prompter, Turn
from .session_table import SessionTable
from .sessions import Admitted, GenerationSessionPool
from .streams import Phase, Stream, TextStream


@dataclass(slots=True)
class Counters:
    """Facts for logs and tests; never reset."""

    orphan_engine_messages: int = 0  # tokens or finishes for requests no longer here
    orphan_controller_replies: int = 0
    controller_timeouts: int = 0
    engines_lost: int = 0
    streams_ended: dict[str, int] = field(default_factory=dict)  # by finish reason or code


class GatewayCore:
    """Routes one gateway's traffic; see the module docstring.

    Args:
        prompter (Prompter): encodes inputs and caps `max_tokens`.
        pool (GenerationSessionPool): how many requests run at once, the FIFO queue.
        engines (EngineTable): live engines and their heartbeat timeout.
        control_timeout_s (float): longest wait for the controller's answer to a forwarded
            lease, session or stats request, seconds.
    """

    def __init__(
        self,
        prompter: Prompter,
        pool: GenerationSessionPool,
        engines: EngineTable,
        *,
        control_timeout_s: float = 5.0,
    ):
        self.prompter = prompter
        self.pool = pool
        self.engines = engines
        self.sessions = SessionTable()
        self.counters = Counters()
        self._prefix = secrets.token_hex(3)  # request ids stay unique across gateway restarts
        self._next_id = 0
        self._streams: dict[str, Stream] = {}
        self._by_client: dict[tuple[bytes, str], str] = {}
        self._control = ControlRelay(self._prefix, control_timeout_s)
        self._out: list[Send] = []

    # ---- entry points -------------------------------------------------------------------

    def on_client(self, identity: bytes, msg: Message, now: float) -> list[Send]:
        """Handle one decoded client message (a `CLIENT_TYPES` message)."""
        match msg:
            case Generate():
                self._generate(identity, msg, now)
            case Cancel():
                self._cancel(identity, msg.id, now)
            case Health():
                status = "ok" if self.engines.num_live else "degraded"
                self._out.append(ToClient(identity, HealthOk(
                    id=msg.id, status=status, engines_live=self.engines.num_live)))  # fmt: skip
            case SessionClose():
                self._close_session_locally(msg.session_id, now)
                self._out.append(self._control.forward(identity, msg, now))
            case _:
                self._out.append(self._control.forward(identity, msg, now))
        return self._flush()

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
                self._end_with_error(self._streams[msg.id], msg, now)
            case _:
                self._control_reply(msg)
        return self._flush()

    def on_engine_cmd(self, identity: bytes, msg: Hello | Heartbeat, now: float) -> list[Send]:
        """Handle an engine's HELLO or heartbeat."""
        if isinstance(msg, Hello):
            replaced = self.engines.register(msg, identity, now)
            if replaced is not None:
                self._engine_lost(replaced.engine_id, replaced.epoch, now, tell_controller=False)
        else:
            self.engines.heartbeat(msg.engine_id, msg.epoch, now)
        return self._flush()

    def on_engine_out(self, msg: EngineTokens | EngineFinished, now: float) -> list[Send]:
        """Handle an engine's token batch or a request's end."""
        if isinstance(msg, EngineTokens):
            for chunk in msg.chunks:
                self._tokens(msg.engine_id, msg.epoch, chunk.id, chunk.token_ids)
        else:
            self._finished(msg, now)
        return self._flush()

    def tick(self, now: float) -> list[Send]:
        """Expire queued requests, silent engines and unanswered control requests."""
        for request_id in self.pool.expire(now):
            waited = self.pool.queue_timeout_s
            exc = QueueTimeout(f"waited {waited:.1f} s in the queue without starting")
            self._end(self._streams[request_id], error_reply(exc, None), now)
        for lost in self.engines.expire(now):
            self._engine_lost(lost.engine_id, lost.epoch, now, tell_controller=True)
        late = self._control.expire(now)
        self.counters.controller_timeouts += len(late)
        self._out.extend(late)
        return self._flush()

    def client_error(self, identity: bytes, exc: ButtermilkError, request_id: str | None) -> list[Send]:
        """The reply to a client frame that could not be decoded."""
        return [ToClient(identity, error_reply(exc, request_id))]

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # ---- generate -----------------------------------------------------------------------

    def _generate(self, identity: bytes, msg: Generate, now: float) -> None:
        try:
            stream = self._new_stream(identity, msg)
            admitted = self.pool.submit(stream.request_id, now)
        except ButtermilkError as exc:
            self._out.append(ToClient(identity, error_reply(exc, msg.id)))
            return
        self._streams[stream.request_id] = stream
        self._by_client[(identity, msg.id)] = stream.request_id
        if msg.session_id is not None:
            self.sessions.begin_turn(msg.session_id, msg.lease_id, msg.new_session)
        if isinstance(admitted, Admitted):
            self._reserve(stream)

    def _new_stream(self, identity: bytes, msg: Generate) -> Stream:
        if (identity, msg.id) in self._by_client:
            raise BadRequest(f"request id {msg.id!r} is already in flight on this connection")
        turn = None
        if msg.session_id is not None:
            turn = self.sessions.check_turn(msg.session_id, msg.lease_id, msg.new_session)
        prompt = self.prompter.prepare(msg, turn)
        self._next_id += 1
        sampling = SamplingParams(
            max_tokens=prompt.max_tokens, temperature=msg.temperature, top_p=msg.top_p,
            top_k=msg.top_k, seed=msg.seed,
        )  # fmt: skip
        detok = IncrementalDetokenizer(self.prompter.tokenizer, prompt.token_ids)
        text = TextStream(detok, tuple(msg.stop), self.prompter.eos_token_ids)
        return Stream(
            request_id=f"{self._prefix}-{self._next_id}", client=identity, client_id=msg.id,
            token_ids=prompt.token_ids, context_tokens=prompt.context_tokens, sampling=sampling,
            text=text, stream=msg.stream, lease_id=msg.lease_id, session_id=msg.session_id,
            new_session=msg.new_session,
        )  # fmt: skip

    def _reserve(self, stream: Stream) -> None:
        stream.phase = Phase.RESERVING
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
            id=stream.request_id, resv_id=msg.resv_id, epoch=msg.epoch,
            token_ids=stream.token_ids, sampling=stream.sampling, session_id=stream.session_id,
        )))  # fmt: skip
        if stream.cancel_requested:  # cancelled while reserving: the engine ends it at once
            self._out.append(ToEngine(engine.identity, EngineAbort(ids=[stream.request_id])))

    # ---- engine output ------------------------------------------------------------------

    def _tokens(self, engine_id: str, epoch: int, request_id: str, token_ids: list[int]) -> None:
        stream = self._streams.get(request_id)
        if stream is None or not stream.on_engine(engine_id, epoch):
            self.counters.orphan_engine_messages += 1
            return
        if stream.text.closed:
            return
        index = stream.text.num_sent
        delta = stream.text.feed(token_ids)
        self._emit(stream, delta.text, delta.token_ids, index)
        if delta.stopped:
            self._abort_on_engine(stream)

    def _finished(self, msg: EngineFinished, now: float) -> None:
        stream = self._streams.get(msg.id)
        if stream is None or not stream.on_engine(msg.engine_id, msg.epoch):
            self.counters.orphan_engine_messages += 1
            return
        failed = msg.reason == FinishReason.ERROR
        keep, turn = self._session_outcome(stream, msg, failed)
        self._out.append(ToController(Release(resv_id=stream.resv_id, keep_session_tokens=keep)))
        if failed:
            code = msg.code or ErrorCode.INTERNAL
            terminal = Error(code=code, message=msg.message or "the engine failed the request")
        else:
            self._emit(stream, stream.text.finish(), [], stream.text.num_sent, final=True)
            terminal = self._done(stream, msg)
        self._end(stream, terminal, now, turn=turn)
        if stream.session_id is not None and keep is None:
            self.sessions.drop(stream.session_id, msg.code or ErrorCode.CANCELLED)

    def _session_outcome(
        self, stream: Stream, msg: EngineFinished, failed: bool
    ) -> tuple[int | None, Turn | None]:
        """What a session keeps after this turn: (KV tokens for the ledger, history for the gateway).

        `(None, None)` ends the session. A turn the engine refused before running leaves the
        session as it was (a refused first turn starts none); a turn that failed while running
        ends it, since the history the engine kept is then unknown here.
        """
        if stream.session_id is None or msg.tokens_held is None:
            return None, None
        if failed:
            record = self.sessions.get(stream.session_id)
            unchanged = msg.refused and record is not None and record.turn is not None
            return (msg.tokens_held, None) if unchanged else (None, None)
        context = msg.usage.prompt_tokens + msg.usage.completion_tokens
        return msg.tokens_held, Turn(context_tokens=context, ended_by_eos=stream.text.ended_by_eos)

    def _done(self, stream: Stream, msg: EngineFinished) -> Done:
        reason, completion = msg.reason, msg.usage.completion_tokens
        if stream.text.stopped:
            reason, completion = FinishReason.STOP, stream.text.num_consumed
        elif stream.cancel_requested:
            reason = FinishReason.CANCELLED
        usage = Usage(prompt_tokens=msg.usage.prompt_tokens, completion_tokens=completion,
                      cached_tokens=msg.usage.cached_tokens)  # fmt: skip
        return Done(id=stream.client_id, finish_reason=reason, usage=usage)

    def _emit(
        self, stream: Stream, text: str, token_ids: list[int], index: int, *, final: bool = False
    ) -> None:
        if not stream.stream:
            stream.held_text.append(text)
            stream.held_ids.extend(token_ids)
            text, token_ids, index = "".join(stream.held_text), stream.held_ids, 0
            if not final:
                return
        if text or token_ids:
            token = Token(id=stream.client_id, text=text, token_ids=token_ids, index=index)
            self._out.append(ToClient(stream.client, token))

    # ---- cancellation and endings -------------------------------------------------------

    def _cancel(self, identity: bytes, client_id: str, now: float) -> None:
        stream = self._streams.get(self._by_client.get((identity, client_id), ""))
        if stream is None or stream.cancel_requested:
            return
        stream.cancel_requested = True
        if stream.phase is Phase.QUEUED:
            usage = Usage(prompt_tokens=stream.context_tokens, completion_tokens=0)
            self._end(stream, Done(id=client_id, finish_reason=FinishReason.CANCELLED, usage=usage), now)
        elif stream.phase is Phase.RUNNING and not stream.text.stopped:
            self._abort_on_engine(stream)

    def _abort_on_engine(self, stream: Stream) -> None:
        engine = self.engines.get(stream.engine_id, stream.epoch)
        if engine is not None:
            self._out.append(ToEngine(engine.identity, EngineAbort(ids=[stream.request_id])))

    def _revoked(self, msg: Revoked, now: float) -> None:
        for request_id in msg.request_ids:
            if request_id in self._streams:
                self._end(self._streams[request_id], self._revoke_error(msg), now)
        ended = set(msg.lease_ids)
        waiting = (Phase.QUEUED, Phase.RESERVING)
        for stream in [s for s in self._streams.values() if s.lease_id in ended]:
            if stream.phase in waiting:
                self._end(stream, self._revoke_error(msg), now)
        for session_id in msg.session_ids:
            self.sessions.drop(session_id, msg.code)

    @staticmethod
    def _revoke_error(msg: Revoked) -> Error:
        reasons = {ErrorCode.LEASE_EXPIRED: "the lease expired", ErrorCode.ENGINE_FAILED:
                   "the engine failed", ErrorCode.CANCELLED: "the lease or session was closed"}
        return Error(code=msg.code, message=reasons.get(msg.code, f"revoked ({msg.code})"))

    def _engine_lost(self, engine_id: str, epoch: int, now: float, *, tell_controller: bool) -> None:
        self.counters.engines_lost += self.engines.drop(engine_id, epoch)
        lost = [s for s in self._streams.values()
                if s.phase is Phase.RUNNING and s.engine_id == engine_id and s.epoch <= epoch]  # fmt: skip
        for stream in lost:
            exc = EngineFailed(f"engine {engine_id} (epoch {epoch}) failed mid-request")
            self._end(stream, error_reply(exc, None), now)
        for session_id in self.sessions.on_engine(engine_id):
            self.sessions.drop(session_id, ErrorCode.ENGINE_FAILED)
        if tell_controller:
            self._out.append(ToController(EngineDead(engine_id=engine_id, epoch=epoch)))

    def _close_session_locally(self, session_id: str, now: float) -> None:
        waiting = [s for s in self._streams.values() if s.session_id == session_id
                   and s.phase in (Phase.QUEUED, Phase.RESERVING)]  # fmt: skip
        for stream in waiting:
            self._end(stream, Error(code=ErrorCode.CANCELLED, message="the session was closed"), now)
        if self.sessions.get(session_id) is not None:
            self.sessions.drop(session_id, ErrorCode.CANCELLED)

    def _end_with_error(self, stream: Stream, msg: Error, now: float) -> None:
        if stream.phase is Phase.RESERVING:  # the controller refused the reservation
            self._end(stream, msg, now)

    def _end(self, stream: Stream, terminal: Done | Error, now: float, *, turn: Turn | None = None) -> None:
        """Send the one terminal message, forget the stream, free its pool place."""
        if isinstance(terminal, Error):
            terminal = terminal.model_copy(update={"id": stream.client_id})
            key = terminal.code.value
        else:
            key = terminal.finish_reason.value
        self.counters.streams_ended[key] = self.counters.streams_ended.get(key, 0) + 1
        self._out.append(ToClient(stream.client, terminal))
        del self._streams[stream.request_id]
        del self._by_client[(stream.client, stream.client_id)]
        if stream.session_id is not None:
            self.sessions.end_turn(stream.session_id, turn)
        for request_id in self.pool.finish(stream.request_id, now):
            self._reserve(self._streams[request_id])

    # ---- control replies ----------------------------------------------------------------

    def _control_reply(self, msg: Message) -> None:
        s = self.pool.stats()
        pool = PoolUsage(active=s.active, queued=s.queued, max_active=s.max_active, max_queue=s.max_queue)
        reply = self._control.reply(msg, pool)
        if reply is None:
            self.counters.orphan_controller_replies += 1
        else:
            self._out.append(reply)

    def _flush(self) -> list[Send]:
        out, self._out = self._out, []
        return out
