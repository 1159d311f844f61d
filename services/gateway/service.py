"""The gateway process: sockets around `GatewayCore` on one asyncio loop (zmq.asyncio).

Sockets (see docs/protocol.md and ARCHITECTURE.md):
    client      ROUTER, bind: client DEALERs (one frame per message)
    engine-cmd  ROUTER, bind: engines' DEALERs say HELLO and heartbeat; generate/abort go out
    engine-out  PULL,   bind: engines' PUSH token batches and finishes
    controller  DEALER, connect (routing id "gateway"): reserve/release, leases, stats

Each socket has one receive task: decode → core → send what the core returned. A timer task
calls `core.tick(now)`. `GatewayResources.close()` is the single, idempotent cleanup path.
"""

from __future__ import annotations

import asyncio
import time
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
    Done,
    Error,
    Hello,
    ProtocolError,
    decode,
    encode,
)

from .control import Send, ToClient, ToController, ToEngine
from .core import GatewayCore

TICK_S = 0.1  # timer period: queue timeouts, engine liveness, control deadlines


@dataclass(frozen=True, slots=True)
class GatewayAddresses:
    client: str  # e.g. tcp://127.0.0.1:5555 or ipc:///tmp/bm/client
    engine_cmd: str
    engine_out: str
    controller: str


class GatewayResources:
    """Owns the context, the four sockets and the loop's tasks; `close()` is idempotent."""

    def __init__(self, addresses: GatewayAddresses):
        self.ctx = zmq.asyncio.Context()
        self.client = self._socket(zmq.ROUTER, bind=addresses.client)
        self.engine_cmd = self._socket(zmq.ROUTER, bind=addresses.engine_cmd)
        self.engine_out = self._socket(zmq.PULL, bind=addresses.engine_out)
        self.controller = self.ctx.socket(zmq.DEALER)
        self.controller.setsockopt(zmq.ROUTING_ID, GATEWAY_ROUTING_ID)
        self.controller.setsockopt(zmq.LINGER, 0)
        self.controller.connect(addresses.controller)
        self.tasks: list[asyncio.Task] = []
        self.closed = False

    def _socket(self, kind: int, *, bind: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(bind)
        return sock

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for task in self.tasks:
            task.cancel()
        for sock in (self.client, self.engine_cmd, self.engine_out, self.controller):
            sock.close(linger=0)
        self.ctx.term()


class GatewayService:
    """Moves frames between the sockets and the core.

    Args:
        core (GatewayCore): the routing logic (owned by this service from now on).
        addresses (GatewayAddresses): where to bind and connect.
    """

    def __init__(self, core: GatewayCore, addresses: GatewayAddresses):
        self.core = core
        self.addresses = addresses
        self.log = get_logger("gateway")
        self.res: GatewayResources | None = None
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        """Serve until `stop()` is called or a receive task fails; then close everything."""
        self.res = GatewayResources(self.addresses)
        loops = [self._client_loop(), self._engine_cmd_loop(), self._engine_out_loop(),
                 self._controller_loop(), self._tick_loop()]  # fmt: skip
        self.res.tasks = [asyncio.create_task(coro) for coro in loops]
        self.log.info("gateway_ready", address=self.addresses.client)
        stop = asyncio.create_task(self._stopping.wait())
        try:
            done, _ = await asyncio.wait([stop, *self.res.tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop and task.exception() is not None:
                    raise task.exception()
        finally:
            stop.cancel()
            self.res.close()

    def stop(self) -> None:
        self._stopping.set()

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
                self.log.info("client_frame_rejected", error=exc.message)
                await self._send(self.core.client_error(identity, exc, exc.request_id))
                continue
            await self._send(self._guarded(self.core.on_client, identity, msg, now))

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
        while True:
            await asyncio.sleep(TICK_S)
            await self._send(self._guarded(self.core.tick, time.monotonic()))

    # ---- helpers ------------------------------------------------------------------------

    def _decode_internal(self, frames: list[bytes], allowed: frozenset, source: str):
        try:
            if len(frames) != 1:
                raise ProtocolError(f"expected one frame, got {len(frames)}")
            return decode(frames[0], allowed=allowed)
        except ProtocolError as exc:
            self.log.warning("internal_frame_rejected", source=source, error=exc.message)
            return None

    def _guarded(self, handler, *args) -> list[Send]:
        """Run a core handler; a bug in it is logged with its stack, and serving goes on."""
        try:
            return handler(*args)
        except ButtermilkError as exc:
            self.log.warning("handler_refused", handler=handler.__name__, error=exc.message)
        except Exception:
            self.log.exception("handler_failed", handler=handler.__name__)
        return []

    async def _send(self, sends: list[Send]) -> None:
        for send in sends:
            frame = encode(send.msg)
            match send:
                case ToClient(identity=identity, msg=msg):
                    if isinstance(msg, (Done, Error)):
                        self._log_terminal(msg)
                    await self.res.client.send_multipart([identity, frame])
                case ToEngine(identity=identity):
                    await self.res.engine_cmd.send_multipart([identity, frame])
                case ToController():
                    await self.res.controller.send(frame)

    def _log_terminal(self, msg: Done | Error) -> None:
        if isinstance(msg, Done):
            self.log.debug("request_done", request_id=msg.id, finish_reason=msg.finish_reason.value,
                           completion_tokens=msg.usage.completion_tokens)  # fmt: skip
        else:
            self.log.info("request_error", request_id=msg.id, code=msg.code.value, message=msg.message)
