"""The engine process: a socket thread feeding a queue, and the main thread stepping `EngineCore`.

MLX steps block, so (as in vLLM's `EngineCoreProc`) the sockets live on their own thread:
`EngineIO` decodes what the gateway and the controller send into a `queue.SimpleQueue`, sends HELLO
and heartbeats on its own schedule (so a long step never looks like death), and relays the
main thread's controller-bound frames. The main thread owns the engine-out PUSH socket and the
`EngineCore`: drain the inbox → with `launch_hold`, wait on it for part of the window in flight
(`LaunchHold`) → `launch_ahead()` (the next decode window of the same streams, where no prompt waits:
the GPU goes from window to window) → `collect()` (read back the oldest step in flight) → publish
its tokens and finishes → drain again → `launch()` the next step if none runs.
Otherwise between the read-back and the launch the GPU has nothing to do anyway, so the tokens leave
a launch sooner (launching a decode window takes the host milliseconds) and a request that arrived
while the step ran joins the next one (taken in only before the read-back, it waited a whole step
more than in process: measured on an H200, `ops/results/pipeline_trace_gpu_2026-12-04.json`); while
windows run ahead it joins after the window launched ahead too (with `launch_hold`, after the window in
flight if it came during the hold).

Every accepted request ends: one still waiting for a slot or pages after `wait_timeout_s`
ends with `queue_timeout` (refused: a session is unchanged). `stop()` drains: new requests
are refused with `unavailable`, running ones get `drain_timeout_s` to finish, the rest end
with `unavailable`, and the engine tells the controller its epoch is gone before it exits.

Sockets:
    engine-cmd  DEALER → gateway ROUTER: HELLO, heartbeats; receives generate and abort
    controller  DEALER → controller ROUTER: HELLO, heartbeats, reconcile; receives abort,
                session close and `engine_dead` (this epoch is stale: exit for a restart)
    engine-out  PUSH   → gateway PULL (main thread): token batches and finishes
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import zmq

from shared.errors import BadRequest, ButtermilkError, EngineFailed, QueueTimeout, Unavailable
from shared.logging import get_logger
from shared.protocol import (
    HEARTBEAT_S,
    ENGINE_TYPES,
    MAX_ERROR_CHARS,
    EngineAbort,
    EngineDead,
    EngineFinished,
    EngineGenerate,
    EngineSessionClose,
    EngineTokens,
    Error,
    FinishReason,
    Heartbeat,
    Hello,
    PrefixCacheUsage,
    ProtocolError,
    Reconcile,
    TokenChunk,
    Usage,
    decode,
    encode,
)

from .core import EngineCore, RequestOutput
from .launch_hold import LaunchHold
from .request import Request, RequestStatus
from .status import StatusMeter

HELLO_EVERY_S = 5.0  # HELLO is repeated so a restarted gateway or controller learns us again
IDLE_WAIT_S = 0.1  # longest block on the inbox while there is nothing to step
SNAPSHOT_EVERY_S = 0.2  # how often the heartbeat's figures are refreshed from core.stats()
RECONCILE_EVERY_TOKENS = 64  # report a request's KV growth each time it grows this much
RELAY_ADDRESS = "inproc://engine-relay"
EXIT_STALE = 75  # exit status when the controller says this epoch is dead (restart me)


@dataclass(frozen=True, slots=True)
class EngineAddresses:
    gateway_cmd: str  # the gateway's engine-cmd ROUTER
    gateway_out: str  # the gateway's engine-out PULL
    controller: str  # the controller's ROUTER


@dataclass(frozen=True, slots=True)
class Stop:
    """Inbox sentinel: leave the main loop with this exit status."""

    status: int
    reason: str


@dataclass(slots=True)
class Snapshot:
    """What heartbeats and the status line report; replaced whole by the main thread, read by the socket thread."""

    num_running: int = 0  # requests not finished (waiting or running); for the status line
    num_waiting: int = 0  # of those, waiting for a slot; for the status line
    tokens_used: int = 0
    capacity_tokens: int = 0
    used_slots: int = 0
    prefix_cache: PrefixCacheUsage | None = None


class EngineIO(threading.Thread):
    """The socket thread: inbound frames → `inbox`, HELLO and heartbeats, relayed frames out.

    Args:
        ctx (zmq.Context): shared with the main thread (contexts are thread-safe).
        addresses (EngineAddresses): where the gateway and controller listen.
        hello (Hello): this engine's HELLO.
        inbox (queue.SimpleQueue): receives decoded messages and `Stop`.
    """

    def __init__(self, ctx: zmq.Context, addresses: EngineAddresses, hello: Hello, inbox: queue.SimpleQueue):
        super().__init__(name="engine-io", daemon=True)
        self.ctx, self.addresses, self.hello, self.inbox = ctx, addresses, hello, inbox
        self.snapshot = Snapshot()
        self.stopping = threading.Event()
        self.log = get_logger("engine_io", engine_id=hello.engine_id, epoch=hello.epoch)
        # Bound here, before the main thread connects its end.
        self._relay = ctx.socket(zmq.PULL)
        self._relay.setsockopt(zmq.LINGER, 0)
        self._relay.bind(RELAY_ADDRESS)

    def run(self) -> None:
        routing_id = f"{self.hello.engine_id}:{self.hello.epoch}".encode()
        cmd = self._dealer(self.addresses.gateway_cmd, routing_id)
        ctl = self._dealer(self.addresses.controller, routing_id)
        poller = zmq.Poller()
        for sock in (cmd, ctl, self._relay):
            poller.register(sock, zmq.POLLIN)
        next_beat = next_hello = 0.0
        try:
            while not self.stopping.is_set():
                now = time.monotonic()
                if now >= next_hello:
                    self._send_both(cmd, ctl, encode(self.hello))
                    next_hello = now + HELLO_EVERY_S
                if now >= next_beat:
                    self._send_both(cmd, ctl, encode(self._heartbeat()))
                    next_beat = now + HEARTBEAT_S
                ready = dict(poller.poll(timeout=max(1, round((next_beat - now) * 1000))))
                self._pump(ready, cmd, ctl)
        finally:
            for sock in (cmd, ctl, self._relay):
                sock.close(linger=0)

    def _dealer(self, address: str, routing_id: bytes) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        return sock

    @staticmethod
    def _send_both(cmd: zmq.Socket, ctl: zmq.Socket, frame: bytes) -> None:
        for sock in (cmd, ctl):
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                pass  # peer not connected yet; the next beat retries

    def _pump(self, ready: dict, cmd: zmq.Socket, ctl: zmq.Socket) -> None:
        for sock, source in ((cmd, "gateway"), (ctl, "controller")):
            while sock in ready and sock.poll(0):
                self._inbound(sock.recv_multipart(), source)
        while self._relay in ready and self._relay.poll(0):
            frame = self._relay.recv()
            try:
                ctl.send(frame, zmq.NOBLOCK)
            except zmq.Again:  # the controller is gone long enough to fill the queue
                self.log.warning("controller_unreachable_dropped_report")

    def _inbound(self, frames: list[bytes], source: str) -> None:
        try:
            if len(frames) != 1:
                raise ProtocolError(f"expected one frame, got {len(frames)}")
            msg = decode(frames[0], allowed=ENGINE_TYPES)
        except ProtocolError as exc:
            self.log.warning("frame_rejected", source=source, error=exc.message)
            return
        if isinstance(msg, EngineDead):
            self.inbox.put(Stop(EXIT_STALE, f"the controller declared epoch {msg.epoch} dead"))
        elif isinstance(msg, Error):
            self.log.warning("peer_error", source=source, code=msg.code.value, message=msg.message)
        else:
            self.inbox.put(msg)

    def _heartbeat(self) -> Heartbeat:
        s = self.snapshot
        return Heartbeat(
            engine_id=self.hello.engine_id, epoch=self.hello.epoch, tokens_used=s.tokens_used,
            used_slots=s.used_slots, capacity_tokens=s.capacity_tokens, prefix_cache=s.prefix_cache,
        )  # fmt: skip


@dataclass(slots=True)
class Running:
    """The engine service's record of one request it accepted."""

    resv_id: str
    session_id: str | None
    accepted_at: float  # monotonic seconds
    num_generated: int = 0  # tokens sent so far (the next chunk's index)
    tokens_reported: int = 0  # KV growth last sent in a reconcile
    fail_with: ButtermilkError | None = None  # aborted by the service: end with this error
    never_ran: bool = False  # aborted while waiting: report it refused


class EngineService:
    """Runs an `EngineCore` behind the engine's sockets; see the module docstring.

    Args:
        core (EngineCore): the batching engine (owned by this service from now on).
        hello (Hello): identity, epoch and geometry to announce.
        addresses (EngineAddresses): where the gateway and controller listen.
        wait_timeout_s (float): longest wait of an accepted request for a slot, seconds.
        drain_timeout_s (float): on `stop()`, how long running requests may finish, seconds.
        status_interval_s (float): seconds between status log lines (0: none). Default: 10.
        launch_hold (bool): launch a decode window ahead as late as the GPU allows (`LaunchHold`), not at once.
            Default: False.
    """

    def __init__(
        self, core: EngineCore, hello: Hello, addresses: EngineAddresses, *,
        wait_timeout_s: float = 60.0, drain_timeout_s: float = 5.0, status_interval_s: float = 10.0,
        launch_hold: bool = False,
    ):  # fmt: skip
        self.core, self.hello, self.addresses = core, hello, addresses
        self.wait_timeout_s, self.drain_timeout_s = wait_timeout_s, drain_timeout_s
        self.meter = StatusMeter(status_interval_s, time.monotonic())
        # SimpleQueue: `stop()` puts from a signal handler on the main thread, which may be inside `get`;
        # `queue.Queue`'s lock would deadlock there, SimpleQueue's `put` is reentrant.
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.running: dict[str, Running] = {}
        self.log = get_logger("engine", engine_id=hello.engine_id, epoch=hello.epoch)
        self._next_snapshot = 0.0
        self._needs_fence = False  # a session was closed: step once even when idle
        self._draining: Stop | None = None  # set by `stop()`: finish what runs, then exit
        self.hold = LaunchHold(launch_hold)

    def run(self) -> int:
        """Serve until a `Stop` arrives; returns the process exit status."""
        ctx = zmq.Context()
        io = EngineIO(ctx, self.addresses, self.hello, self.inbox)
        out, relay = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
        for sock, address in ((out, self.addresses.gateway_out), (relay, RELAY_ADDRESS)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        io.start()
        self.log.info("engine_ready", pid=self.hello.pid, decode_window=self.core.scheduler.decode_window,
                      launch_hold=self.hold.enabled, **self.hello.geometry.model_dump())  # fmt: skip
        try:
            stop = self._loop(out, relay, io)
            self.log.info("engine_stopping", status=stop.status, reason=stop.reason)
            if stop.status == 0:  # a drained stop: the controller frees this epoch at once
                relay.send(encode(EngineDead(engine_id=self.hello.engine_id, epoch=self.hello.epoch)))
                time.sleep(0.2)  # let the socket thread relay it before everything closes
            return stop.status
        except Exception:
            self.log.exception("engine_fatal")
            relay.send(encode(EngineDead(engine_id=self.hello.engine_id, epoch=self.hello.epoch)))
            time.sleep(0.2)  # let the socket thread relay it before everything closes
            return 1
        finally:
            io.stopping.set()
            io.join(timeout=2.0)
            out.close(linger=0)
            relay.close(linger=0)
            ctx.term()

    def stop(self, reason: str = "signal") -> None:
        """Ask the main loop to drain and exit 0 (safe from a signal handler)."""
        self.inbox.put(Stop(0, reason))

    def _loop(self, out: zmq.Socket, relay: zmq.Socket, io: EngineIO) -> Stop:
        drain_until, held = 0.0, None  # held: a Stop met between a step's read-back and the next launch
        while True:
            stop = held if held is not None else self._drain(out, 0.0 if self.core.has_unfinished() else IDLE_WAIT_S)
            held = None
            if stop is not None and (stop.status != 0 or not self.running):
                return stop
            if stop is not None and self._draining is None:
                self._draining, drain_until = stop, time.monotonic() + self.drain_timeout_s
                self.log.info("draining", running=len(self.running), grace_s=self.drain_timeout_s)
            if self._draining is not None and (not self.running or time.monotonic() >= drain_until):
                self._fail_all(Unavailable("the engine shut down before the request finished"), out, relay)
                return self._draining
            self._expire_waiting(time.monotonic())
            if self.core.has_unfinished() or self._needs_fence:
                # An idle step passes the cache's fence, so a closed session's pages return now.
                self._needs_fence = False
                # A decode window of the same streams launches before the read-back (the GPU goes on; with
                # `launch_hold` as late as the GPU allows, so a prompt that arrives meanwhile joins the next
                # step); else tokens go out before the next launch (the host's launch of a decode window takes
                # milliseconds), and requests that arrived while the GPU ran the last step join the next.
                if self.hold.enabled:
                    if held := self._held_launch_ahead(out, relay):
                        continue  # a Stop met during the hold: handled at the top
                else:
                    self._publish(self.core.launch_ahead(), out, relay)
                    self._publish(self.core.collect(), out, relay)
                held = self._drain(out)
                if not self.core.in_flight and (held is None or (held.status == 0 and self.running)):
                    self._publish(self.core.launch(), out, relay)
            if time.monotonic() >= self._next_snapshot:
                io.snapshot = self._snapshot()
                self._next_snapshot = time.monotonic() + SNAPSHOT_EVERY_S
                self._log_status(io.snapshot)

    def _held_launch_ahead(self, out: zmq.Socket, relay: zmq.Socket) -> Stop | None:
        """`launch_ahead()` once the hold is over, then `collect()`; fit the hold to the read-back's wait.

        While the next window may launch ahead, what arrives during the hold is applied as it comes.
        Returns the `Stop` that ended the hold, if one did (then nothing was launched or read back)."""
        steps, started = self.core.steps_in_flight, time.monotonic()
        until = started + self.hold.hold_s(steps) if self.core.can_launch_ahead else started
        while self.core.can_launch_ahead and (wait_s := until - time.monotonic()) > 0:
            if (stop := self._drain(out, wait_s)) is not None:
                return stop
        launching = time.monotonic()
        self._publish(self.core.launch_ahead(), out, relay)
        launched_s, ahead = time.monotonic() - launching, self.core.windows_in_flight == 2
        self._publish(self.core.collect(), out, relay)
        if ahead:
            self.hold.observe(steps, launching - started, launched_s, self.core.read_back_s)
        return None

    def _drain(self, out: zmq.Socket, wait_s: float = 0.0) -> Stop | None:
        """Apply every queued message, waiting up to `wait_s` seconds for the first; return a `Stop` met."""
        try:
            item = self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return None
        while True:
            if isinstance(item, Stop):
                return item
            self._apply(item, out)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return None

    def _apply(self, msg, out: zmq.Socket) -> None:
        match msg:
            case EngineGenerate():
                self._add(msg, out)
            case EngineAbort():
                self.core.abort([i for i in msg.ids if i in self.running])
            case EngineSessionClose():
                for session_id in msg.session_ids:
                    self.core.close_session(session_id)
                self._needs_fence = True

    def _expire_waiting(self, now: float) -> None:
        """End requests that waited past `wait_timeout_s` without getting a slot."""
        late = [rid for rid, run in self.running.items() if run.fail_with is None
                and now - run.accepted_at >= self.wait_timeout_s and self._is_waiting(rid)]  # fmt: skip
        for request_id in late:
            run = self.running[request_id]
            run.fail_with = QueueTimeout(f"waited {self.wait_timeout_s:.0f} s on the engine without a slot")
            run.never_ran = True
        self.core.abort(late)

    def _is_waiting(self, request_id: str) -> bool:
        request = self.core.scheduler.requests.get(request_id)
        return request is not None and request.status is RequestStatus.WAITING

    def _fail_all(self, error: ButtermilkError, out: zmq.Socket, relay: zmq.Socket) -> None:
        """Abort every request and publish each one's end as `error` (a few steps at most)."""
        for request_id, run in self.running.items():
            run.fail_with = run.fail_with or error
            run.never_ran = run.never_ran or self._is_waiting(request_id)
        self.core.abort(list(self.running))
        for _ in range(8):  # aborts apply at the next step; pipelining adds at most one
            if not self.running:
                return
            self._publish(self.core.step(), out, relay)
        self.log.warning("requests_not_ended", ids=list(self.running))

    def _add(self, msg: EngineGenerate, out: zmq.Socket) -> None:
        try:
            if self._draining is not None:
                raise Unavailable("the engine is shutting down; retry once it is back")
            if msg.epoch != self.hello.epoch:
                raise EngineFailed(f"request for epoch {msg.epoch}; this engine is epoch {self.hello.epoch}")
            if msg.id in self.running:
                raise BadRequest(f"request id {msg.id} is already running")
            self.core.add_request(Request(msg.id, list(msg.token_ids), msg.sampling, session_id=msg.session_id,
                                          session_tokens=msg.session_tokens))  # fmt: skip
        except ButtermilkError as exc:
            self.log.info("request_refused", request_id=msg.id, code=exc.code.value, error=exc.message)
            usage = Usage(prompt_tokens=len(msg.token_ids), completion_tokens=0)
            out.send(encode(self._finish_message(msg.id, FinishReason.ERROR, usage, msg.session_id, exc, refused=True)))
            return
        self.running[msg.id] = Running(msg.resv_id, msg.session_id, accepted_at=time.monotonic())

    def _publish(self, outputs: list[RequestOutput], out: zmq.Socket, relay: zmq.Socket) -> None:
        """Count a step's outputs; send its tokens as one batch, then each finish, then KV growth reports."""
        self.meter.record(outputs)
        chunks = []
        for o in outputs:
            run = self.running.get(o.request_id)
            if run is not None and o.new_token_ids:
                chunks.append(TokenChunk(id=o.request_id, token_ids=o.new_token_ids, index=run.num_generated))
                run.num_generated += len(o.new_token_ids)
        if chunks:
            out.send(encode(EngineTokens(engine_id=self.hello.engine_id, epoch=self.hello.epoch, chunks=chunks)))
        for o in outputs:
            run = self.running.get(o.request_id)
            if run is None:
                continue
            if o.finish_reason is not None:
                del self.running[o.request_id]
                usage = Usage(prompt_tokens=o.num_prompt_tokens, completion_tokens=run.num_generated,
                              cached_tokens=o.num_cached_tokens)  # fmt: skip
                reason, error = o.finish_reason, o.error
                if run.fail_with is not None and reason is FinishReason.CANCELLED:
                    reason, error = FinishReason.ERROR, run.fail_with
                out.send(encode(self._finish_message(o.request_id, reason, usage, run.session_id, error,
                                                     refused=run.never_ran)))  # fmt: skip
            elif (grown := max(0, o.tokens_held - o.num_cached_tokens)) >= run.tokens_reported + RECONCILE_EVERY_TOKENS:
                run.tokens_reported = grown
                relay.send(encode(Reconcile(resv_id=run.resv_id, tokens_observed=grown)))

    def _finish_message(
        self, request_id: str, reason: FinishReason, usage: Usage, session_id: str | None,
        error: ButtermilkError | None, *, refused: bool = False,
    ) -> EngineFinished:  # fmt: skip
        stats = self.core.stats() if session_id is not None else None
        held = stats.sessions.get(session_id) if stats is not None else None
        failed = reason is FinishReason.ERROR
        if failed and error is None:
            error = ButtermilkError("the engine failed the request")
        return EngineFinished(
            engine_id=self.hello.engine_id, epoch=self.hello.epoch, id=request_id, reason=reason,
            usage=usage, tokens_held=held,
            code=error.code if failed else None,
            message=error.message[:MAX_ERROR_CHARS] if failed else None, refused=refused,
        )  # fmt: skip

    def _snapshot(self) -> Snapshot:
        stats = self.core.stats()
        used = stats.capacity_tokens - stats.free_tokens  # unreferenced cached pages count as free
        page = self.core.cache.page_size
        prefix = PrefixCacheUsage(
            cached_tokens=stats.cached_pages * page, evictable_tokens=stats.evictable_pages * page,
            query_tokens=stats.prefix_query_tokens, hit_tokens=stats.prefix_hit_tokens,
            evicted_tokens=stats.evicted_pages * page,
        ) if self.core.has_prefix_cache else None  # fmt: skip
        return Snapshot(
            num_running=len(self.running), num_waiting=len(self.core.scheduler.waiting), tokens_used=used,
            capacity_tokens=stats.capacity_tokens, used_slots=stats.used_slots, prefix_cache=prefix,
        )  # fmt: skip

    def _log_status(self, s: Snapshot) -> None:
        now = time.monotonic()
        if not self.meter.is_due(now):
            return
        line = self.meter.line(now, num_running=s.num_running - s.num_waiting, num_waiting=s.num_waiting,
                               kv_usage=s.tokens_used / s.capacity_tokens)  # fmt: skip
        if line is not None:
            runner = self.core.runner
            self.log.info("engine_status", message=line.message, kv_usage=round(line.kv_usage, 4),
                          num_running=line.num_running, num_waiting=line.num_waiting,
                          decode_traces=runner.traces, decode_trace_s=round(runner.trace_s, 3))  # fmt: skip

