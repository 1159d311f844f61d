"""The gateway process: sockets around `GatewayCore` on one asyncio loop (zmq.asyncio).

Sockets (see docs/protocol.md and ARCHITECTURE.md):
    client      ROUTER, bind: client DEALERs (one frame per message)
    engine-cmd  ROUTER, bind: engines' DEALERs say HELLO and heartbeat; generate/abort go out
    engine-out  PULL,   bind: engines' PUSH token batches and finishes
    controller  DEALER, connect (routing id "gateway"): heartbeat, reserve/release, leases, stats

Each socket has one receive task: decode → core → send what the core returned. Tokenizing
(`ToTokenizer`) runs on one worker thread, so a huge prompt never stalls the loop (the fast
tokenizer releases the GIL); the core hands it one job at a time, by deficit round robin across
connections. A timer task calls `core.tick(now)`; when the loop itself was late, engine
liveness is not judged that round, since heartbeats that arrived meanwhile are still unread.
Client frames are capped at the socket (`ZMQ_MAXMSGSIZE`), and sends to a closed connection
fail (`ZMQ_ROUTER_MANDATORY`), which cancels its work (`core.on_client_gone`).

`stop()` drains: new work is refused, running requests get `drain_timeout_s` to finish, the
rest end with `unavailable`, and every terminal message is flushed before the sockets close.
`GatewayResources.close()` is the single, idempotent cleanup path.
In-process clients (the HTTP adapter, `services/http`) hand messages in through `submit` and
get the core's replies in their `LocalClients` mailbox instead of a socket.
"""

from __future__ import annotations

import asyncio
import errno
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zmq
import zmq.asyncio

from shared.errors import ButtermilkError
from shared.logging import get_logger
from shared.protocol import (
    CLIENT_TYPES,
    ENGINE_CMD_TYPES,
    ENGINE_OUT_TYPES,
    FROM_CONTROLLER_TYPES,
    GATEWAY_ROUTING_ID,
    MAX_FRAME_BYTES,
    Done,
    Error,
    Hello,
    Message,
    ProtocolError,
    decode,
    encode,
)

from .control import Send, ToClient, ToController, ToEngine, ToTokenizer
from .core import GatewayCore
from .local import LocalClients

TICK_S = 0.1  # timer period: queue timeouts, engine liveness, control deadlines, keepalives
STALL_S = 0.5  # a tick this late means the loop was stalled: skip engine liveness once
FLUSH_LINGER_MS = 1000  # at shutdown, how long queued client messages may take to leave


@dataclass(frozen=True, slots=True)
class GatewayAddresses:
    client: str  # e.g. tcp://127.0.0.1:5555 or ipc:///tmp/bm/client
    engine_cmd: str
    engine_out: str
    controller: str


class GatewayResources:
    """Owns the context, the four sockets, the tokenizer thread and the loop's tasks;
    `close()` is idempotent."""

    def __init__(self, addresses: GatewayAddresses):
        self.ctx = zmq.asyncio.Context()
        self.client = self._socket(zmq.ROUTER, bind=addresses.client)
        self.client.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a closed connection raises
        self.engine_cmd = self._socket(zmq.ROUTER, bind=addresses.engine_cmd)
        self.engine_out = self._socket(zmq.PULL, bind=addresses.engine_out)
        self.controller = self.ctx.socket(zmq.DEALER)
        self.controller.setsockopt(zmq.ROUTING_ID, GATEWAY_ROUTING_ID)
        self.controller.setsockopt(zmq.LINGER, 0)
        self.controller.connect(addresses.controller)
        self.tokenizer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self.tasks: list[asyncio.Task] = []
        self.closed = False

    def _socket(self, kind: int, *, bind: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # larger frames are cut unread
        sock.bind(bind)
        return sock

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for task in self.tasks:
            task.cancel()
        self.tokenizer.shutdown(wait=False, cancel_futures=True)
        self.client.close(linger=FLUSH_LINGER_MS)
        for sock in (self.engine_cmd, self.engine_out, self.controller):
            sock.close(linger=0)
        self.ctx.term()


class GatewayService:
    """Moves frames between the sockets and the core.

    Args:
        core (GatewayCore): the routing logic (owned by this service from now on).
        addresses (GatewayAddresses): where to bind and connect.
        drain_timeout_s (float): on `stop()`, how long running requests may go on, seconds.
    """

    def __init__(self, core: GatewayCore, addresses: GatewayAddresses, *, drain_timeout_s: float = 5.0):
        self.core = core
        self.addresses = addresses
        self.drain_timeout_s = drain_timeout_s
        self.log = get_logger("gateway")
        self.res: GatewayResources | None = None
        self.num_dropped = 0  # client messages dropped: the connection was not reading
        self.local = LocalClients()
        self._stopping = asyncio.Event()
        self._jobs: set[asyncio.Task] = set()

    async def run(self) -> None:
        """Serve until `stop()` is called or a receive task fails; drain; close everything."""
        self.res = GatewayResources(self.addresses)
        await self._send(self.core.tick(time.monotonic()))  # the controller hears who we are first
        loops = [self._client_loop(), self._engine_cmd_loop(), self._engine_out_loop(),
                 self._controller_loop(), self._tick_loop()]  # fmt: skip
        self.res.tasks = [asyncio.create_task(coro) for coro in loops]
        self.log.info("gateway_ready", address=self.addresses.client, gateway_id=self.core.gateway_id)
        stop = asyncio.create_task(self._stopping.wait())
        try:
            done, _ = await asyncio.wait([stop, *self.res.tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop and task.exception() is not None:
                    raise task.exception()
            await self._drain()
        finally:
            stop.cancel()
            self.res.close()

    def stop(self) -> None:
        self._stopping.set()

    async def _drain(self) -> None:
        """Refuse new work, let running requests finish within the grace, end the rest."""
        self.log.info("draining", streams=self.core.num_streams, grace_s=self.drain_timeout_s)
        await self._send(self.core.begin_drain(time.monotonic()))
        deadline = time.monotonic() + self.drain_timeout_s
        while self.core.num_streams and time.monotonic() < deadline:
            await asyncio.sleep(TICK_S)
        left = self.core.num_streams
        await self._send(self.core.end_all(time.monotonic()))
        self.log.info("drained", cut_short=left)

    @property
    def is_serving(self) -> bool:
        return self.res is not None and not self.res.closed

    async def submit(self, identity: bytes, msg: Message) -> None:
        """Hand an in-process client's message to the core, as `_client_loop` does for frames."""
        await self._send(self._guarded(self.core.on_client, identity, msg, time.monotonic()))

    # ---- receive loops ------------------------------------------------------------------

    async def _client_loop(self) -> None:
        while True:
            frames = await self.res.client.recv_multipart()
            identity, now = frames[0], time.monotonic()
            try:
                if len(frames) != 2:
                    raise ProtocolError(f"expected one frame per message, got {len(frames) - 1}")
                msg = decode(frames[1], allowed=CLIENT_TYPES)
            except ProtocolError as exc:
                self.log.info("client_frame_rejected", error=exc.message, request_id=exc.request_id)
                await self._send(self.core.client_error(identity, exc, exc.request_id))
            else:
                await self._send(self._guarded(self.core.on_client, identity, msg, now))
            # A ready socket's receive does not yield: a flood of frames must not starve the engines' token relay,
            # the heartbeats and the ticks.
            await asyncio.sleep(0)

    async def _engine_cmd_loop(self) -> None:
        while True:
            identity, *rest = await self.res.engine_cmd.recv_multipart()
            msg = self._decode_internal(rest, ENGINE_CMD_TYPES, "engine_cmd")
            if msg is not None:
                if isinstance(msg, Hello) and self.core.engines.get(msg.engine_id, msg.epoch) is None:
                    self.log.info("engine_hello", engine_id=msg.engine_id, epoch=msg.epoch)
                await self._send(self._guarded(self.core.on_engine_cmd, identity, msg, time.monotonic()))

    async def _engine_out_loop(self) -> None:
        while True:
            msg = self._decode_internal(await self.res.engine_out.recv_multipart(), ENGINE_OUT_TYPES, "engine_out")
            if msg is not None:
                await self._send(self._guarded(self.core.on_engine_out, msg, time.monotonic()))

    async def _controller_loop(self) -> None:
        while True:
            msg = self._decode_internal(await self.res.controller.recv_multipart(), FROM_CONTROLLER_TYPES, "controller")
            if msg is not None:
                await self._send(self._guarded(self.core.on_controller, msg, time.monotonic()))

    async def _tick_loop(self) -> None:
        last = time.monotonic()
        while True:
            now = time.monotonic()
            stalled = now - last > TICK_S + STALL_S
            if stalled:
                self.log.warning("loop_stalled", late_s=round(now - last - TICK_S, 3))
            last = now
            await self._send(self._guarded(self.core.tick, now, check_engines=not stalled))
            await asyncio.sleep(TICK_S)

    async def _prepare(self, job: ToTokenizer) -> None:
        """Tokenize on the worker thread, then hand the result to the core; a request that ended while its job
        waited for the thread (cancelled, its client gone) is not tokenized, and the core hears None."""
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(self.res.tokenizer, self._tokenize, job)
        except ButtermilkError as exc:
            result = exc
        except Exception as exc:  # a tokenizer bug ends the request as `internal`
            self.log.exception("tokenize_failed", request_id=job.request_id)
            result = ButtermilkError(f"internal error ({type(exc).__name__})")
        await self._send(self._guarded(self.core.on_prepared, job.request_id, job.msg, result, time.monotonic()))

    def _tokenize(self, job: ToTokenizer):
        """On the tokenizer thread: the job's `Prompt`, or None where its request has ended."""
        return self.core.prompter.prepare(job.msg, job.turn) if self.core.is_preparing(job.request_id) else None

    # ---- helpers ------------------------------------------------------------------------

    def _decode_internal(self, frames: list[bytes], allowed: frozenset, source: str):
        try:
            if len(frames) != 1:
                raise ProtocolError(f"expected one frame, got {len(frames)}")
            return decode(frames[0], allowed=allowed)
        except ProtocolError as exc:
            self.log.warning("internal_frame_rejected", source=source, error=exc.message)
            return None

    def _guarded(self, handler, *args, **kwargs) -> list[Send]:
        """Run a core handler; a bug in it is logged with its stack, and serving goes on."""
        try:
            return handler(*args, **kwargs)
        except ButtermilkError as exc:
            self.log.warning("handler_refused", handler=handler.__name__, error=exc.message)
        except Exception:
            self.log.exception("handler_failed", handler=handler.__name__)
        return []

    async def _send(self, sends: list[Send]) -> None:
        gone: list[bytes] = []
        for send in sends:
            if isinstance(send, ToClient) and self.local.owns(send.identity):
                if isinstance(send.msg, (Done, Error)):
                    self._log_terminal(send.msg)
                self.local.deliver(send.identity, send.msg)
                continue
            match send:
                case ToClient(identity=identity, msg=msg):
                    if isinstance(msg, (Done, Error)):
                        self._log_terminal(msg)
                    if not await self._send_client(identity, encode(msg)):
                        gone.append(identity)
                case ToEngine(identity=identity):
                    await self.res.engine_cmd.send_multipart([identity, encode(send.msg)])
                case ToController():
                    await self.res.controller.send(encode(send.msg))
                case ToTokenizer():
                    task = asyncio.get_running_loop().create_task(self._prepare(send))
                    self._jobs.add(task)  # a strong reference until it is done
                    task.add_done_callback(self._jobs.discard)
        for identity in dict.fromkeys(gone):
            self.log.info("client_gone", identity=identity.hex())
            await self._send(self._guarded(self.core.on_client_gone, identity, time.monotonic()))

    async def _send_client(self, identity: bytes, frame: bytes) -> bool:
        """Send without blocking; False when the connection is closed."""
        try:
            await self.res.client.send_multipart([identity, frame], flags=zmq.NOBLOCK)
        except zmq.Again:  # not reading: dropped, as docs/protocol.md warns
            self.num_dropped += 1
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            return False
        return True

    def _log_terminal(self, msg: Done | Error) -> None:
        if isinstance(msg, Done):
            self.log.debug("request_done", request_id=msg.id, finish_reason=msg.finish_reason.value,
                           completion_tokens=msg.usage.completion_tokens)  # fmt: skip
        else:
            self.log.info("request_error", request_id=msg.id, code=msg.code.value, message=msg.message)
