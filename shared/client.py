"""Python client for the buttermilk gateway (docs/protocol.md): asyncio first, with a sync wrapper.

One DEALER socket carries every request. A receiver task routes each reply by `id` to that
request's own `asyncio.Queue`; replies for ids nobody waits for are counted in `num_orphans`.
Every wait is bounded by one monotonic deadline. With a lease open, a heartbeat task renews it
every `ttl_s / 3` seconds and every generate carries it.

    async with AsyncClient("tcp://127.0.0.1:5555") as client:
        stream = await client.stream(prompt="Hello", max_tokens=16)
        async for token in stream:
            print(token.text, end="")
        print(stream.done.usage)

    with Client("tcp://127.0.0.1:5555") as client:        # no event loop needed
        print(client.generate(prompt="Hello", max_tokens=16).text)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from shared.errors import ButtermilkError, ErrorCode, one_line
from shared.protocol import (
    CLIENT_REPLY_TYPES,
    Cancel,
    ChatMessage,
    Done,
    Error,
    Generate,
    Health,
    HealthOk,
    Keepalive,
    LeaseGranted,
    LeaseClose,
    LeaseOpen,
    LeaseRenew,
    Message,
    ProtocolError,
    SessionClose,
    Stats,
    StatsReply,
    Token,
    Usage,
    decode,
    encode,
)

DEFAULT_TIMEOUT_S = 300.0  # per generate, from send to its terminal message
CONTROL_TIMEOUT_S = 10.0  # per lease, session, health or stats request
CANCEL_GRACE_S = 10.0  # after a timeout's cancel, how long to wait for the terminal message


class AddressError(ButtermilkError, ValueError):
    """An endpoint zmq cannot use (e.g. `127.0.0.1:5555` without `tcp://`)."""


def validate_address(address: str) -> None:
    """Check that `address` is an endpoint a client can connect to.

    Raises:
        AddressError: it is not (one-line message naming the address).
    """
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(address)
    except zmq.ZMQError as exc:
        raise AddressError(f"invalid address {address!r}: {exc.strerror} "
                           "(expected tcp://HOST:PORT or ipc://PATH)") from None  # fmt: skip
    finally:
        sock.close(linger=0)
        ctx.term()


class ServerError(ButtermilkError):
    """An `error` message from the server; `code` is its stable wire code."""

    def __init__(self, code: ErrorCode, message: str, *, retry_after_ms: int | None = None,
                 request_id: str | None = None):  # fmt: skip
        super().__init__(message)
        self.code = code
        self.retryable = code in {ErrorCode.OVERLOADED, ErrorCode.QUEUE_TIMEOUT, ErrorCode.ENGINE_FAILED,
                                  ErrorCode.CAPACITY, ErrorCode.UNAVAILABLE}  # fmt: skip
        self.retry_after_ms = retry_after_ms
        self.request_id = request_id

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"

    @classmethod
    def from_message(cls, msg: Error) -> ServerError:
        return cls(msg.code, msg.message, retry_after_ms=msg.retry_after_ms, request_id=msg.id)


@dataclass(slots=True)
class Completion:
    """A finished generate: the text (stop string and end-of-sequence excluded) and usage."""

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    first_token_s: float | None = None  # send → first token message, seconds
    token_times_s: list[float] = field(default_factory=list)  # send → each token message


class GenerationStream:
    """Async iterator over one generate's `token` messages; `done` is set when it ends.

    Raises (from iteration):
        ServerError: the request ended with an `error` message.
        TimeoutError: its deadline passed; it was cancelled and ended (or the grace ran out).
    """

    def __init__(self, client: AsyncClient, request_id: str, queue: asyncio.Queue, deadline: float):
        self.client, self.request_id = client, request_id
        self._queue, self._deadline = queue, deadline
        self.done: Done | None = None
        self._timed_out = False

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> Token:
        if self.done is not None:
            raise StopAsyncIteration
        msg = await self._next()
        if isinstance(msg, Token):
            return msg
        self.client._forget(self.request_id)
        if isinstance(msg, Error):
            raise ServerError.from_message(msg)
        self.done = msg
        if self._timed_out:
            raise TimeoutError(f"request {self.request_id} passed its deadline and was cancelled")
        raise StopAsyncIteration

    async def cancel(self) -> None:
        """Ask the server to end this request; iteration then ends with `cancelled`."""
        await self.client.cancel(self.request_id)

    async def collect(self) -> Completion:
        """Read the stream to its end."""
        start = time.monotonic()
        texts, ids, times = [], [], []
        async for token in self:
            times.append(time.monotonic() - start)
            texts.append(token.text)
            ids.extend(token.token_ids)
        return Completion("".join(texts), ids, self.done.finish_reason.value, self.done.usage,
                          times[0] if times else None, times)  # fmt: skip

    async def _next(self) -> Message:
        while True:
            remaining = self._deadline - time.monotonic()
            if remaining <= 0 and not self._timed_out:
                self._timed_out = True
                self._deadline = time.monotonic() + CANCEL_GRACE_S
                await self.client.cancel(self.request_id)
                continue
            if remaining <= 0:
                self.client._forget(self.request_id)
                raise TimeoutError(f"request {self.request_id}: no terminal message after cancel")
            try:
                # Seconds stay seconds here: asyncio takes them as is.
                return await asyncio.wait_for(self._queue.get(), timeout=remaining)
            except TimeoutError:
                continue


class AsyncClient:
    """One connection to the gateway; see the module docstring.

    Args:
        address (str): the gateway's endpoint, e.g. tcp://127.0.0.1:5555 or ipc:///tmp/bm.
        context (zmq.asyncio.Context | None): shared context. Default: a new one (terminated
            by `close`).
    """

    def __init__(self, address: str, *, context: zmq.asyncio.Context | None = None):
        self.address = address
        self._own_ctx = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.connect(address)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            if self._own_ctx:
                self._ctx.term()
            raise AddressError(f"invalid address {address!r}: {exc.strerror} "
                               "(expected tcp://HOST:PORT or ipc://PATH)") from None  # fmt: skip
        self._queues: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count(1)
        self._prefix = secrets.token_hex(4)
        self._receiver: asyncio.Task | None = None
        self._heartbeat: asyncio.Task | None = None
        self.lease_id: str | None = None
        self.lease_error: ServerError | None = None  # set when a renewal was refused
        self.num_orphans = 0  # replies whose id no request was waiting for
        self._closed = False

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- generation ---------------------------------------------------------------------

    async def stream(self, *, prompt: str | None = None, messages: list[dict] | None = None,
                     token_ids: list[int] | None = None, request_id: str | None = None,
                     timeout_s: float = DEFAULT_TIMEOUT_S, **options) -> GenerationStream:  # fmt: skip
        """Send a generate and return its stream of `token` messages.

        Args:
            prompt, messages, token_ids: exactly one input (docs/protocol.md section 4).
            request_id (str | None): default: a fresh unique id.
            timeout_s (float): deadline for the whole request, seconds.
            **options: other `generate` fields (max_tokens, temperature, stop, session_id,
                new_session, seed, ...). `lease_id` defaults to the open lease.

        Raises:
            ProtocolError: invalid fields (checked locally before sending).
        """
        request_id = request_id or self._next_id()
        if self.lease_id is not None:
            options.setdefault("lease_id", self.lease_id)
        msg = self.build_generate(request_id=request_id, prompt=prompt, messages=messages,
                                  token_ids=token_ids, **options)  # fmt: skip
        queue = self._register(request_id)
        await self._send(msg)
        return GenerationStream(self, request_id, queue, time.monotonic() + timeout_s)

    @staticmethod
    def build_generate(*, request_id: str, prompt: str | None = None, messages: list[dict] | None = None,
                       token_ids: list[int] | None = None, **options) -> Generate:  # fmt: skip
        """The `generate` message `stream` would send, validated locally.

        Raises:
            ProtocolError: invalid fields, as one line (`max_tokens: ...; temperature: ...`).
        """
        try:
            chat = [ChatMessage(**m) for m in messages] if messages is not None else None
            return Generate(id=request_id, prompt=prompt, messages=chat, token_ids=token_ids, **options)
        except ValueError as exc:
            raise ProtocolError(f"invalid generate: {one_line(exc)}", request_id) from None

    async def generate(self, **kwargs) -> Completion:
        """`stream(**kwargs)` read to its end."""
        return await (await self.stream(**kwargs)).collect()

    async def cancel(self, request_id: str) -> None:
        """Cancel a generate; its stream ends with `done {finish_reason: cancelled}`."""
        await self._send(Cancel(id=request_id))

    # ---- leases, sessions, health -------------------------------------------------------

    async def open_lease(self, ttl_s: float = 30.0, *, heartbeat: bool = True) -> str:
        """Open a lease (renewed every ttl_s / 3 by a heartbeat task); later generates carry it."""
        reply = await self._control(LeaseOpen(ttl_s=ttl_s))
        self.lease_id, self.lease_error = reply.lease_id, None
        if heartbeat:
            self._heartbeat = asyncio.create_task(self._renew_forever(reply.lease_id, ttl_s / 3))
        return reply.lease_id

    async def renew_lease(self) -> LeaseGranted:
        return await self._control(LeaseRenew(lease_id=self._require_lease()))

    async def close_lease(self) -> None:
        """Stop the heartbeat and close the lease (its requests end `cancelled`)."""
        lease_id = self._require_lease()
        await self._stop_heartbeat()
        self.lease_id = None
        await self._control(LeaseClose(lease_id=lease_id))

    async def close_session(self, session_id: str, *, lease_id: str | None = None) -> None:
        """Close a session; `lease_id` defaults to the open lease (its owner, if it has one)."""
        await self._control(SessionClose(session_id=session_id, lease_id=lease_id or self.lease_id))

    async def health(self, timeout_s: float = CONTROL_TIMEOUT_S) -> HealthOk:
        return await self._control(Health(), timeout_s)

    async def stats(self, timeout_s: float = CONTROL_TIMEOUT_S) -> StatsReply:
        return await self._control(Stats(), timeout_s)

    async def send_raw(self, frame: bytes) -> None:
        """Send one arbitrary frame (for tests of malformed input)."""
        self._ensure_receiver()
        await self._sock.send(frame)

    async def close(self) -> None:
        """Stop the tasks and close the socket; idempotent. A lease is left to expire."""
        if self._closed:
            return
        self._closed = True
        await self._stop_heartbeat()
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
        self._sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    # ---- internals ----------------------------------------------------------------------

    def _next_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def _register(self, request_id: str) -> asyncio.Queue:
        if request_id in self._queues:
            raise ProtocolError(f"request id {request_id!r} is already in flight", request_id)
        self._queues[request_id] = asyncio.Queue()
        return self._queues[request_id]

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def _require_lease(self) -> str:
        if self.lease_id is None:
            raise ProtocolError("no lease is open")
        return self.lease_id

    async def _send(self, msg: Message) -> None:
        self._ensure_receiver()
        await self._sock.send(encode(msg))

    async def _control(self, msg: Message, timeout_s: float = CONTROL_TIMEOUT_S):
        corr = self._next_id()
        queue = self._register(corr)
        try:
            await self._send(msg.model_copy(update={"id": corr}))
            reply = await asyncio.wait_for(queue.get(), timeout=timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no reply to {msg.TYPE.value} within {timeout_s} s") from None
        finally:
            self._forget(corr)
        if isinstance(reply, Error):
            raise ServerError.from_message(reply)
        return reply

    def _ensure_receiver(self) -> None:
        if self._receiver is None:
            self._receiver = asyncio.create_task(self._receive_forever())

    async def _receive_forever(self) -> None:
        while True:
            frame = await self._sock.recv()
            try:
                msg = decode(frame, allowed=CLIENT_REPLY_TYPES)
            except ProtocolError:
                self.num_orphans += 1
                continue
            if isinstance(msg, Keepalive):  # the gateway checking that we are still here
                continue
            queue = self._queues.get(getattr(msg, "id", None) or "")
            if queue is None:
                self.num_orphans += 1
            else:
                queue.put_nowait(msg)

    async def _renew_forever(self, lease_id: str, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await self._control(LeaseRenew(lease_id=lease_id))
            except ServerError as exc:  # expired: stop renewing, keep the reason
                self.lease_error = exc
                return
            except TimeoutError:
                continue  # one lost renewal is tolerated by design (ttl_s / 3)

    async def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None


class Client:
    """Blocking wrapper: an `AsyncClient` on an event loop in a background thread.

    Args:
        address (str): the gateway's endpoint.
    """

    def __init__(self, address: str):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="buttermilk-client", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._client: AsyncClient = self._call(self._make(address))
        except BaseException:
            self._closed = True
            self._stop_loop()
            raise

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, **kwargs) -> Completion:
        return self._call(self._client.generate(**kwargs))

    def stream(self, **kwargs) -> Iterator[Token]:
        """Yield `token` messages as they arrive; the `done` message is returned at the end."""
        stream = self._call(self._client.stream(**kwargs))
        while True:
            try:
                yield self._call(stream.__anext__())
            except StopAsyncIteration:
                return stream.done

    def cancel(self, request_id: str) -> None:
        self._call(self._client.cancel(request_id))

    def open_lease(self, ttl_s: float = 30.0) -> str:
        return self._call(self._client.open_lease(ttl_s))

    def close_lease(self) -> None:
        self._call(self._client.close_lease())

    def close_session(self, session_id: str) -> None:
        self._call(self._client.close_session(session_id))

    def health(self, timeout_s: float = CONTROL_TIMEOUT_S) -> HealthOk:
        return self._call(self._client.health(timeout_s))

    def stats(self) -> StatsReply:
        return self._call(self._client.stats())

    def close(self) -> None:
        """Close the connection and stop the loop thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._call(self._client.close())
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    @staticmethod
    async def _make(address: str) -> AsyncClient:
        return AsyncClient(address)  # created on the loop thread: zmq.asyncio binds to it

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

