"""The controller process: one ROUTER socket around the `Ledger`, on zmq.asyncio.

Peers connect DEALERs to the ROUTER: the gateway (routing id `gateway`: its heartbeat naming
its instance, reservations, releases, leases, sessions, stats), every engine (HELLO, heartbeats, reconcile; it receives
aborts and session closes) and the supervisor (`engine_dead`). `ControllerCore` maps each
decoded message to ledger verbs and returns `(identity, message)` pairs to send; a timer calls
`ledger.expire(now)` and tells engines and the gateway what that released. What a gateway
instance made belongs to it: when another instance takes over its connection, or it falls
silent, its reservations, leases and sessions are released and their engines told.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from shared.errors import ButtermilkError, ErrorCode
from shared.logging import get_logger
from shared.protocol import (
    CONTROLLER_TYPES,
    GATEWAY_ROUTING_ID,
    EngineAbort,
    EngineDead,
    EngineSessionClose,
    GatewayHeartbeat,
    Heartbeat,
    Hello,
    LeaseGranted,
    LeaseClose,
    LeaseClosed,
    LeaseOpen,
    LeaseRenew,
    Message,
    ProtocolError,
    Reconcile,
    Release,
    Reserve,
    Reserved,
    Revoked,
    SessionClose,
    SessionClosed,
    Stats,
    StatsReply,
    MAX_FRAME_BYTES,
    decode,
    encode,
    error_reply,
)

from .ledger import EngineReport, Ledger, Released

TICK_S = 0.2  # how often leases, idle sessions and engine liveness are checked

Outgoing = list[tuple[bytes, Message]]


@dataclass(slots=True)
class EnginePeer:
    epoch: int
    identity: bytes  # ROUTER identity of the engine's controller DEALER
    max_slots: int
    pid: int | None
    device: str | None = None  # from HELLO, for stats
    cuda_visible_devices: str | None = None


class ControllerCore:
    """Ledger verbs per message; no sockets. Every handler returns what to send, in order.

    Args:
        ledger (Ledger): the accounting (owned by this core from now on).
    """

    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self.engines: dict[str, EnginePeer] = {}
        self.gateways: dict[bytes, str] = {}  # routing identity -> live gateway instance on it
        self.log = get_logger("controller")

    def handle(self, identity: bytes, msg: Message, now: float) -> Outgoing:
        """Apply one message; a refused request becomes an `error` reply to its sender."""
        try:
            return self._dispatch(identity, msg, now)
        except ButtermilkError as exc:
            request_id = getattr(msg, "request_id", None) or getattr(msg, "id", None)
            return [(identity, error_reply(exc, request_id))]

    def tick(self, now: float) -> Outgoing:
        """Expire silent engines, leases and idle sessions; tell engines and the gateway."""
        released = self.ledger.expire(now)
        if not released.is_empty:
            self.log.info("expired", leases=len(released.lease_ids),
                          requests=len(released.request_ids), sessions=len(released.session_ids))  # fmt: skip
        return self._announce(released, ErrorCode.LEASE_EXPIRED)

    def _dispatch(self, identity: bytes, msg: Message, now: float) -> Outgoing:
        ledger = self.ledger
        match msg:
            case Reserve():
                return self._reserve(identity, msg, now)
            case GatewayHeartbeat():
                return self._gateway_heartbeat(identity, msg, now)
            case Release():
                return self._release(msg, now)
            case Reconcile():
                ledger.reconcile(msg.resv_id, msg.tokens_observed)
                return []
            case Heartbeat():
                return self._heartbeat(identity, msg, now)
            case Hello():
                return self._hello(identity, msg, now)
            case EngineDead():
                released = ledger.engine_dead(msg.engine_id, msg.epoch)
                requests, sessions = released.request_ids, released.session_ids
                (self.log.warning if requests or sessions else self.log.info)(  # a drained stop held nothing
                    "engine_dead", engine_id=msg.engine_id, epoch=msg.epoch, requests=len(requests),
                    sessions=len(sessions))
                return self._announce(released, ErrorCode.ENGINE_FAILED)
            case _:
                return self._client_verb(identity, msg, now)

    def _client_verb(self, identity: bytes, msg: Message, now: float) -> Outgoing:
        ledger = self.ledger
        match msg:
            case LeaseOpen():
                lease = ledger.open_lease(msg.ttl_s, now, gateway_id=self.gateways.get(identity))
                return [(identity, LeaseGranted(id=msg.id, lease_id=lease.lease_id, ttl_s=lease.ttl_s))]
            case LeaseRenew():
                lease = ledger.renew(msg.lease_id, now)
                return [(identity, LeaseGranted(id=msg.id, lease_id=lease.lease_id, ttl_s=lease.ttl_s))]
            case LeaseClose():
                released = ledger.close_lease(msg.lease_id)
                reply = (identity, LeaseClosed(id=msg.id, lease_id=msg.lease_id))
                return [*self._announce(released, ErrorCode.CANCELLED), reply]
            case SessionClose():
                released = ledger.close_session(msg.session_id)
                reply = (identity, SessionClosed(id=msg.id, session_id=msg.session_id))
                return [*self._announce(released, ErrorCode.CANCELLED), reply]
            case Stats():
                return [(identity, self._stats(msg.id))]
        raise ProtocolError(f"message type {msg.TYPE.value!r} is not handled by the controller")

    def _reserve(self, identity: bytes, msg: Reserve, now: float) -> Outgoing:
        """Evict idle sessions if that makes room, then reserve (or refuse)."""
        ledger = self.ledger
        evicted = ledger.make_room(msg.tokens, now=now, lease_id=msg.lease_id,
                                   session_id=msg.session_id, new_session=msg.new_session)  # fmt: skip
        out = self._announce(evicted, ErrorCode.CANCELLED)
        if evicted.session_ids:
            self.log.info("sessions_evicted", sessions=len(evicted.session_ids), for_request=msg.request_id)
        resv = ledger.reserve(
            msg.request_id, msg.tokens, now=now, lease_id=msg.lease_id, session_id=msg.session_id,
            new_session=msg.new_session, engine_id=msg.engine_id, gateway_id=self.gateways.get(identity),
        )  # fmt: skip
        reply = Reserved(request_id=msg.request_id, resv_id=resv.resv_id, engine_id=resv.engine_id,
                         epoch=resv.epoch)  # fmt: skip
        return [*out, (identity, reply)]

    def _gateway_heartbeat(self, identity: bytes, msg: GatewayHeartbeat, now: float) -> Outgoing:
        """Note the live gateway instance; a new one on a known connection replaces the old."""
        previous = self.gateways.get(identity)
        self.gateways[identity] = msg.gateway_id
        self.ledger.gateway_seen(msg.gateway_id, now)
        if previous is None or previous == msg.gateway_id:
            return []
        released = self.ledger.drop_gateway(previous)
        self.log.warning("gateway_replaced", old=previous, new=msg.gateway_id,
                         requests=len(released.request_ids), sessions=len(released.session_ids),
                         leases=len(released.lease_ids))  # fmt: skip
        return self._announce(released, ErrorCode.CANCELLED, tell_gateway=False)

    def _release(self, msg: Release, now: float) -> Outgoing:
        resv = self.ledger.release(msg.resv_id, now=now, keep_session_tokens=msg.keep_session_tokens)
        peer = self.engines.get(resv.engine_id) if resv else None
        if resv is None or resv.session_id is None or msg.keep_session_tokens is not None or peer is None:
            return []
        # The session ended with this turn: make sure its engine frees the KV too.
        return [(peer.identity, EngineSessionClose(session_ids=[resv.session_id]))]

    def _hello(self, identity: bytes, msg: Hello, now: float) -> Outgoing:
        if self.ledger.is_stale(msg.engine_id, msg.epoch):
            return [(identity, EngineDead(engine_id=msg.engine_id, epoch=msg.epoch))]
        geo = msg.geometry
        known = self.engines.get(msg.engine_id)
        if known is None or known.epoch != msg.epoch:
            self.log.info("engine_registered", engine_id=msg.engine_id, epoch=msg.epoch,
                          capacity_tokens=geo.capacity_tokens, pid=msg.pid)  # fmt: skip
        self.engines[msg.engine_id] = EnginePeer(msg.epoch, identity, geo.slots, msg.pid, msg.device,
                                                 msg.cuda_visible_devices)  # fmt: skip
        report = EngineReport(pid=msg.pid, max_slots=geo.slots, device=msg.device,
                              cuda_visible_devices=msg.cuda_visible_devices)  # fmt: skip
        released = self.ledger.register_engine(
            msg.engine_id, msg.epoch, geo.capacity_tokens, geo.bytes_per_token,
            window_tokens=geo.window_tokens, max_slots=geo.slots, now=now, report=report,
        )  # fmt: skip
        return self._announce(released, ErrorCode.ENGINE_FAILED)

    def _heartbeat(self, identity: bytes, msg: Heartbeat, now: float) -> Outgoing:
        peer = self.engines.get(msg.engine_id)
        report = EngineReport(pid=peer.pid if peer else None, max_slots=peer.max_slots if peer else 0,
                              used_slots=msg.used_slots, engine_tokens=msg.tokens_used,
                              prefix_cache=msg.prefix_cache,
                              device=peer.device if peer else None,
                              cuda_visible_devices=peer.cuda_visible_devices if peer else None)  # fmt: skip
        if self.ledger.heartbeat(msg.engine_id, msg.epoch, now, report):
            return []
        if self.ledger.is_stale(msg.engine_id, msg.epoch):  # declared dead: it must restart
            return [(identity, EngineDead(engine_id=msg.engine_id, epoch=msg.epoch))]
        return []  # unknown (e.g. this controller restarted): its next HELLO registers it

    def _announce(self, released: Released, code: ErrorCode, *, tell_gateway: bool = True) -> Outgoing:
        """Abort released work on live engines; tell the gateway what ended, and why."""
        out: Outgoing = []
        dead = {e: p for e, p in released.engines.items() if p.engine_dead}
        alive = {e: p for e, p in released.engines.items() if not p.engine_dead}
        for engine_id, part in alive.items():
            peer = self.engines.get(engine_id)
            if peer is None or peer.epoch != part.epoch:
                continue
            if part.request_ids:
                out.append((peer.identity, EngineAbort(ids=part.request_ids)))
            if part.session_ids:
                out.append((peer.identity, EngineSessionClose(session_ids=part.session_ids)))
        if not tell_gateway:
            return out
        for engine_id, part in dead.items():
            out.append((GATEWAY_ROUTING_ID, EngineDead(engine_id=engine_id, epoch=part.epoch)))
        if dead:
            out.append((GATEWAY_ROUTING_ID, _revoked(ErrorCode.ENGINE_FAILED, dead.values(), [])))
        if alive or released.lease_ids:
            out.append((GATEWAY_ROUTING_ID, _revoked(code, alive.values(), released.lease_ids)))
        return out

    def _stats(self, correlation_id: str | None) -> StatsReply:
        stats = self.ledger.stats()
        return StatsReply(id=correlation_id, engines=stats.engines, num_reservations=stats.num_reservations,
                          num_leases=stats.num_leases, num_sessions=stats.num_sessions)  # fmt: skip


def _revoked(code: ErrorCode, parts, lease_ids: list[str]) -> Revoked:
    parts = list(parts)
    return Revoked(
        code=code,
        request_ids=[r for p in parts for r in p.request_ids],
        session_ids=[s for p in parts for s in p.session_ids],
        lease_ids=lease_ids,
    )


class ControllerService:
    """The ROUTER loop and the expiry timer around a `ControllerCore`.

    Args:
        core (ControllerCore): the ledger logic.
        address (str): where to bind the ROUTER, e.g. tcp://127.0.0.1:5557 or ipc:///tmp/x.
    """

    def __init__(self, core: ControllerCore, address: str):
        self.core = core
        self.address = address
        self.log = get_logger("controller")
        self._stopping = asyncio.Event()
        self._closed = False
        self.ctx: zmq.asyncio.Context | None = None
        self.sock: zmq.asyncio.Socket | None = None

    async def run(self) -> None:
        """Serve until `stop()`; then close the socket and context (also on errors)."""
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # larger frames are cut unread
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted gateway takes its routing id over
        self.sock.bind(self.address)
        self.log.info("controller_ready", address=self.address)
        tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._tick_loop())]
        stop = asyncio.create_task(self._stopping.wait())
        try:
            done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop and task.exception() is not None:
                    raise task.exception()
        finally:
            for task in [stop, *tasks]:
                task.cancel()
            self.close()

    def stop(self) -> None:
        self._stopping.set()

    def close(self) -> None:
        if self._closed or self.ctx is None:
            return
        self._closed = True
        self.sock.close(linger=0)
        self.ctx.term()

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            identity = frames[0]
            try:
                if len(frames) != 2:
                    raise ProtocolError(f"expected one frame per message, got {len(frames) - 1}")
                msg = decode(frames[1], allowed=CONTROLLER_TYPES)
            except ProtocolError as exc:
                self.log.warning("frame_rejected", error=exc.message)
                await self._send([(identity, error_reply(exc, exc.request_id))])
                continue
            await self._send(self._guarded(self.core.handle, identity, msg, time.monotonic()))

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            await self._send(self._guarded(self.core.tick, time.monotonic()))

    def _guarded(self, handler, *args) -> Outgoing:
        try:
            return handler(*args)
        except Exception:  # a bug must not take the ledger down with it
            self.log.exception("handler_failed", handler=handler.__name__)
            return []

    async def _send(self, out: Outgoing) -> None:
        for identity, msg in out:
            await self.sock.send_multipart([identity, encode(msg)])
