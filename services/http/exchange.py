"""One HTTP request's conversation with the gateway core, and the end of it however it comes.

An `Exchange` opens a local mailbox (`services/gateway/local.py`), hands the core a message
through `GatewayPort.submit`, and reads the replies while watching the ASGI channel for the
client's disconnect. `close()` is the one cleanup path: if the generate has not ended, it
sends the core a `cancel` (exactly what a ZeroMQ client's cancel does: a queued request leaves
the queue, a running one is aborted on its engine, and its reservation, slot and pool place
return), then forgets the mailbox.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from starlette.types import Receive

from services.gateway.core import GatewayCore
from services.gateway.local import LocalClients
from shared.protocol import Cancel, Done, Error, Generate, Message


class GatewayPort(Protocol):
    """What the HTTP layer needs from the gateway service (`GatewayService` provides it)."""

    core: GatewayCore
    local: LocalClients

    @property
    def is_serving(self) -> bool: ...

    async def submit(self, identity: bytes, msg: Message) -> None: ...


class Exchange:
    """A mailbox on the gateway plus the client's disconnect.

    Args:
        port (GatewayPort): the gateway.
        receive (Receive | None): the request's ASGI receive channel, watched for
            `http.disconnect` (its body must have been read already); None: not watched.
        caller (str | None): who sends the request; its requests share one turn at the gateway's
            tokenizer (`LocalClients.open`).
    """

    _cleanups: set[asyncio.Task] = set()  # cancels in flight (a task needs a live reference)

    def __init__(self, port: GatewayPort, receive: Receive | None = None, caller: str | None = None):
        self.port = port
        self.identity, self._box = port.local.open(caller)
        self._request_id: str | None = None
        self._ended = False
        self._gone = asyncio.ensure_future(_disconnected(receive)) if receive is not None else None

    async def start(self, generate: Generate) -> None:
        """Hand the core a generate; `close` cancels it unless its terminal message was read."""
        self._request_id = generate.id
        await self.port.submit(self.identity, generate)

    async def send(self, msg: Message) -> None:
        """Hand the core any other client message (stats, session close)."""
        await self.port.submit(self.identity, msg)

    async def next(self, timeout_s: float | None = None) -> Message | None:
        """The next reply; None when the client disconnected (or `timeout_s` passed)."""
        get = asyncio.ensure_future(self._box.get())
        waits = {get} if self._gone is None else {get, self._gone}
        done, _ = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if get not in done:
            get.cancel()
            return None
        msg = get.result()
        if isinstance(msg, (Done, Error)) and getattr(msg, "id", None) == self._request_id:
            self._ended = True
        return msg

    @property
    def disconnected(self) -> bool:
        return self._gone is not None and self._gone.done()

    def close(self) -> None:
        """Cancel an unfinished generate, forget the mailbox, stop watching (idempotent).

        Synchronous, so it runs even in a cancelled task: the cancel is a task of its own.
        """
        self.port.local.close(self.identity)
        if self._gone is not None:
            self._gone.cancel()
        if self._request_id is None or self._ended:
            return
        self._ended = True
        task = asyncio.ensure_future(self.port.submit(self.identity, Cancel(id=self._request_id)))
        Exchange._cleanups.add(task)
        task.add_done_callback(_forget)


def _forget(task: asyncio.Task) -> None:
    Exchange._cleanups.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved, not raised: it fails only while the gateway closes, freeing everything


async def _disconnected(receive: Receive) -> None:
    """Return when the client goes away (ASGI `http.disconnect`)."""
    while (await receive())["type"] != "http.disconnect":
        pass
