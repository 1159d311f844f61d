"""`buttermilk serve`'s supervisor: start the controller, gateway and engines; keep engines alive.

Each child is a real OS process (`python -m services.cli <service> ...`) in its own process
group, started with `BUTTERMILK_PARENT_PID` so it asks the kernel to signal it if the
supervisor dies (`die_with_parent`), leaving no orphans even after `kill -9` of the
supervisor; a child whose stop hangs ends itself `OVERRUN_S` past its drain (`install_stop_handlers`), in place
of the SIGKILL the supervisor's grace would end in. The supervisor:
- restarts a dead engine at `epoch + 1` after telling the controller (`engine_dead`), with
  backoff, and gives up (exit 1) after `MAX_RESTARTS` within `RESTART_WINDOW_S`;
- treats the death of the controller or gateway as fatal (exit 1), and any child exiting
  with status 2 (a configuration error, e.g. an unusable model or context) too (exit 2): it
  stops everything first;
- on SIGINT/SIGTERM stops the gateway first (it drains: running requests get the plan's
  `drain_timeout_s`, and every open request gets its terminal message), then the engines and
  the controller; each child's process group gets SIGTERM, then SIGKILL after its grace; exit 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import zmq

from shared.errors import ButtermilkError
from shared.logging import get_logger
from shared.protocol import EngineDead, Health, HealthOk, decode, encode

PARENT_PID_ENV = "BUTTERMILK_PARENT_PID"
POLL_S = 0.1
STOP_GRACE_S = 10.0  # after SIGTERM, before SIGKILL (the gateway gets its drain time on top)
OVERRUN_S = 5.0  # a child still running this long past its drain after SIGINT/SIGTERM ends itself
OVERRUN_LOG_S = 0.5  # what its `stop_overrun` line may take
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
EXIT_USAGE = 2  # a child's configuration error (cli.main's user-error status)


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """How to start one service; engines get `--epoch` appended per start."""

    name: str  # "controller", "gateway" or an engine id
    argv: tuple[str, ...]  # arguments after `python -m services.cli`
    is_engine: bool = False
    env: tuple[tuple[str, str], ...] = ()  # extra environment (an engine's CUDA_VISIBLE_DEVICES)


@dataclass(slots=True)
class Child:
    spec: ChildSpec
    proc: subprocess.Popen
    epoch: int = 0
    restarts: deque = field(default_factory=deque)  # monotonic times of recent restarts
    restart_at: float | None = None  # monotonic seconds; set once its exit was handled


@dataclass(frozen=True, slots=True)
class SupervisorPlan:
    controller: ChildSpec
    gateway: ChildSpec
    engines: tuple[ChildSpec, ...]
    controller_address: str  # to send `engine_dead`
    client_address: str  # to probe health until ready
    drain_timeout_s: float = 5.0  # the gateway's drain grace at shutdown, seconds
    http_address: str | None = None  # HOST:PORT of the gateway's HTTP API, for the ready line


class Supervisor:
    """Runs a `SupervisorPlan` until a signal or a fatal child exit; see the module docstring."""

    def __init__(self, plan: SupervisorPlan):
        self.plan = plan
        self.log = get_logger("supervisor")
        self.children: dict[str, Child] = {}
        self._stop_signal: int | None = None
        self._ctx = zmq.Context()
        self._controller = self._dealer(plan.controller_address)

    def run(self) -> int:
        """Start everything and supervise; returns the exit status for `serve`."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            self._start(self.plan.controller)
            self._start(self.plan.gateway)
            for spec in self.plan.engines:
                self._start(spec)
            status = self._supervise()
        finally:
            self._stop_all()
            self._ctx.destroy(linger=0)  # closes every socket first: term() never blocks
        return status

    def _on_signal(self, signum: int, _frame) -> None:
        self._stop_signal = signum

    def _supervise(self) -> int:
        ready = False
        while self._stop_signal is None:
            for child in list(self.children.values()):
                if child.restart_at is not None:
                    self._restart_if_due(child)
                elif (status := child.proc.poll()) is not None:
                    fatal = self._on_exit(child, status)
                    if fatal is not None:
                        return fatal
            if not ready:
                ready = self._announce_ready()
            time.sleep(POLL_S)
        self.log.info("stopping", signal=signal.Signals(self._stop_signal).name)
        return 0

    def _on_exit(self, child: Child, status: int) -> int | None:
        """Handle a child's exit; returns an exit status when it is fatal for `serve`."""
        name = child.spec.name
        if status == EXIT_USAGE:
            self.log.error("config_error", service=name, status=status)
            return EXIT_USAGE
        if not child.spec.is_engine:
            self.log.error("service_died", service=name, status=status)
            return 1
        self.log.warning("engine_died", engine_id=name, epoch=child.epoch, status=status)
        self._send_engine_dead(name, child.epoch)
        now = time.monotonic()
        while child.restarts and now - child.restarts[0] > RESTART_WINDOW_S:
            child.restarts.popleft()
        if len(child.restarts) >= MAX_RESTARTS:
            self.log.error("engine_restart_limit", engine_id=name, restarts=len(child.restarts))
            return 1
        child.restart_at = now + min(0.25 * 2 ** len(child.restarts), 5.0)
        return None

    def _restart_if_due(self, child: Child) -> None:
        now = time.monotonic()
        if now >= child.restart_at:
            child.restarts.append(now)
            self._start(child.spec, epoch=child.epoch + 1, restarts=child.restarts)

    def _start(self, spec: ChildSpec, *, epoch: int = 0, restarts: deque | None = None) -> None:
        argv = [sys.executable, "-m", "services.cli", *spec.argv]
        if spec.is_engine:
            argv += ["--epoch", str(epoch)]
        env = dict(os.environ, **dict(spec.env), **{PARENT_PID_ENV: str(os.getpid())})
        proc = subprocess.Popen(argv, env=env, start_new_session=True)
        self.children[spec.name] = Child(spec, proc, epoch, restarts if restarts is not None else deque())
        self.log.info("started", service=spec.name, pid=proc.pid, epoch=epoch if spec.is_engine else None)

    def _stop_all(self) -> None:
        """Stop the gateway (it drains), then everything else; SIGKILL what outlives its grace."""
        gateway = [c for c in self.children.values() if c.spec is self.plan.gateway]
        self._stop_group(gateway, STOP_GRACE_S + self.plan.drain_timeout_s)
        self._stop_group([c for c in self.children.values() if c.spec is not self.plan.gateway], STOP_GRACE_S)
        for child in self.children.values():
            _signal_group(child.proc, signal.SIGKILL)  # stragglers in its group, if any
            child.proc.wait()

    def _stop_group(self, children: list[Child], grace_s: float) -> None:
        live = [c for c in children if c.proc.poll() is None]
        for child in live:
            _signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in live:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.log.warning("kill", service=child.spec.name, pid=child.proc.pid)
                _signal_group(child.proc, signal.SIGKILL)

    def _dealer(self, address: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(address)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    def _send_engine_dead(self, engine_id: str, epoch: int) -> None:
        try:
            self._controller.send(encode(EngineDead(engine_id=engine_id, epoch=epoch)), zmq.NOBLOCK)
        except zmq.Again:
            self.log.warning("engine_dead_not_sent", engine_id=engine_id)

    def _announce_ready(self) -> bool:
        """Probe the gateway's health once; log `ready` when every engine is live."""
        try:
            probe = self._dealer(probe_address(self.plan.client_address))
        except zmq.ZMQError as exc:  # checked by check_client_address before anything started
            self.log.warning("probe_failed", address=self.plan.client_address, error=str(exc))
            return False
        try:
            probe.send(encode(Health()))
            if not probe.poll(timeout=200):
                return False
            reply = decode(probe.recv())
        finally:
            probe.close(linger=0)
        if isinstance(reply, HealthOk) and reply.engines_live >= len(self.plan.engines):
            gateway = self.children.get(self.plan.gateway.name)
            if gateway is None or gateway.proc.poll() is not None:
                return False  # someone else answered (our gateway is gone): not ready
            self.log.info("ready", address=self.plan.client_address, engines=reply.engines_live)
            noun = "engine" if reply.engines_live == 1 else "engines"
            http = self.plan.http_address
            api = f"; OpenAI API on http://{http}/v1" if http and not http.endswith(":0") else ""
            print(f"buttermilk: serving on {self.plan.client_address} "
                  f"({reply.engines_live} {noun}){api}", file=sys.stderr, flush=True)  # fmt: skip
            return True
        return False


class AddressInUse(ButtermilkError):
    """Another process already listens on serve's `--address`."""


class BadAddress(ButtermilkError):
    """serve's `--address` is not an endpoint zmq can bind."""


def probe_address(address: str) -> str:
    """Where to connect to reach a bind address (`tcp://*:N` / `tcp://0.0.0.0:N` → loopback)."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if address.startswith(wildcard):
            return "tcp://127.0.0.1:" + address[len(wildcard):]
    return address


def check_client_address(address: str) -> None:
    """Check, before any child starts, that the gateway will be able to bind `address`.

    tcp: bind it once (and release it). ipc: zmq would silently take over the file of a
    running server, so a successful connect to an existing socket file means "in use".

    Raises:
        BadAddress: not a usable endpoint (e.g. no `tcp://`).
        AddressInUse: something already listens there.
    """
    import socket

    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        if path and not path.startswith("@") and os.path.exists(path):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                try:
                    sock.connect(path)
                except OSError:
                    return  # a stale file from a dead server: the gateway's bind replaces it
            raise AddressInUse(f"{address}: address already in use (is another buttermilk serve running?)")
        if path:
            return
    port = address.rpartition(":")[2]
    if address.startswith("tcp://") and port.isdigit() and int(port) > 65535:  # zmq would bind it modulo 65536
        raise BadAddress(f"invalid --address {address!r}: port {port} is past 65535")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EADDRINUSE:
            raise AddressInUse(f"{address}: address already in use (is another buttermilk serve running?)") from None
        raise BadAddress(f"invalid --address {address!r}: {exc.strerror} "
                         "(expected tcp://HOST:PORT or ipc://PATH)") from None  # fmt: skip
    finally:
        sock.close(linger=0)
        ctx.term()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def die_with_parent() -> None:
    """When started by the supervisor, have the kernel SIGTERM this process if it dies (Linux).

    Also exits at once if the supervisor is already gone (re-parented before the call).
    """
    parent = os.environ.get(PARENT_PID_ENV)
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        return  # no prctl here: the supervisor's own shutdown still stops us
    if os.getppid() != int(parent):
        sys.exit(1)


def install_stop_handlers(stop, deadline_s: float) -> None:
    """Call `stop()` on SIGINT and SIGTERM (on the running asyncio loop, if there is one), and end the
    process (`os._exit(1)`, logged `stop_overrun`) if it still runs `deadline_s` seconds after the first.

    After `kill -9` of the supervisor nobody sends the SIGKILL that would follow its grace, so a stop
    that hangs (a socket that will not close, a peer that is gone) would leave an orphan: the deadline
    stands in for that SIGKILL. Callers pass their drain time plus `OVERRUN_S`.
    """
    import asyncio

    def on_signal(*_) -> None:
        if not armed:
            armed.append(True)  # first: a signal landing in here (the main thread's handler) finds it armed
            timer = threading.Timer(deadline_s, _overrun, args=(deadline_s,))
            timer.daemon = True
            timer.start()
        stop()

    armed: list[bool] = []
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)


def _overrun(deadline_s: float) -> None:
    """Log `stop_overrun` and exit 1. The log gets half a second on a thread of its own: the output may be a
    full or broken pipe, or its lock held by the very thread that hangs."""

    def log() -> None:
        get_logger("process").error("stop_overrun", deadline_s=deadline_s, pid=os.getpid())
        sys.stdout.flush()
        sys.stderr.flush()

    writer = threading.Thread(target=log, daemon=True)
    writer.start()
    writer.join(OVERRUN_LOG_S)
    os._exit(1)
