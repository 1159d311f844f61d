"""In-process clients of the gateway (the HTTP adapter): one mailbox per request, no socket.

A local client gets an identity the ZeroMQ ROUTER can never hand out (ROUTER identities are
5 bytes, or chosen by the peer and never starting with a zero byte), so the core treats it like
any connection: same admission, pool, leases and cancellation. The service delivers what the
core addresses to a local identity into its mailbox; after `close`, it is dropped.

An HTTP request is a connection of its own, so the tokenizer's round robin (`tokenizer_queue.py`)
would serve HTTP requests first come, first served. A request that names an OpenAI `user` carries
it in its identity (`\x00local-<n>/<user>`), and `tokenizer_key` folds every request of one user
into one turn of the round robin: one user's flood of prompts waits behind another's single one.
"""

from __future__ import annotations

import asyncio
import itertools

from shared.protocol import Message

PREFIX = b"\x00local-"
USER_KEY = PREFIX + b"user/"  # a tokenizer key: no request number is empty


def is_local(identity: bytes) -> bool:
    """Whether `identity` is an in-process client's (never a ZeroMQ peer's)."""
    return identity.startswith(PREFIX)


def tokenizer_key(identity: bytes) -> bytes:
    """Whose turn a prompt of `identity` takes at the tokenizer: its connection's, or its HTTP user's.

    A ZeroMQ connection and an HTTP request without a `user` are each their own key; HTTP requests
    naming the same `user` share one.
    """
    if not is_local(identity):
        return identity
    _, named, user = identity.partition(b"/")
    return USER_KEY + user if named else identity


class LocalClients:
    """Mailboxes of in-process clients, by identity."""

    def __init__(self):
        self._boxes: dict[bytes, asyncio.Queue[Message]] = {}
        self._ids = itertools.count(1)

    def open(self, user: str | None = None) -> tuple[bytes, asyncio.Queue[Message]]:
        """A new identity and the unbounded queue its messages arrive on.

        Args:
            user: the OpenAI `user` the request names (any string), or None; see `tokenizer_key`.
        """
        identity = PREFIX + str(next(self._ids)).encode()
        if user is not None:
            identity += b"/" + user.encode()
        self._boxes[identity] = box = asyncio.Queue()
        return identity, box

    def close(self, identity: bytes) -> None:
        """Forget a mailbox (idempotent); later messages for it are dropped."""
        self._boxes.pop(identity, None)

    @staticmethod
    def owns(identity: bytes) -> bool:
        return is_local(identity)

    def deliver(self, identity: bytes, msg: Message) -> bool:
        """Put `msg` in the identity's mailbox; False when it was closed."""
        box = self._boxes.get(identity)
        if box is None:
            return False
        box.put_nowait(msg)
        return True

    def __len__(self) -> int:
        return len(self._boxes)
