"""In-process clients of the gateway (the HTTP adapter): one mailbox per request, no socket.

A local client gets an identity the ZeroMQ ROUTER can never hand out (ROUTER identities are
5 bytes, or chosen by the peer and never starting with a zero byte), so the core treats it like
any connection: same admission, pool, leases and cancellation. The service delivers what the
core addresses to a local identity into its mailbox; after `close`, it is dropped.

An HTTP request is a connection of its own, so the tokenizer's (deficit) round robin (`tokenizer_queue.py`)
would give every request a turn: one caller's burst of long prompts would be served first come,
first served, and could never be made to give way. So a request carries its caller in its
identity (`\x00local-<n>/<caller>`; the HTTP adapter's callers are `user/<OpenAI user>`, else
`peer/<client address>`), and `tokenizer_key` folds one caller's requests into one turn.
"""

from __future__ import annotations

import asyncio
import itertools

from shared.protocol import Message

PREFIX = b"\x00local-"


def is_local(identity: bytes) -> bool:
    """Whether `identity` is an in-process client's (never a ZeroMQ peer's)."""
    return identity.startswith(PREFIX)


def tokenizer_key(identity: bytes) -> bytes:
    """Whose turn a prompt of `identity` takes at the tokenizer: its connection's, or its caller's.

    A ZeroMQ connection, and a local client opened without a caller, is its own key; local clients
    opened with the same caller share one (`PREFIX/caller`: no request number is empty).
    """
    if not is_local(identity):
        return identity
    _, tagged, caller = identity.partition(b"/")
    return PREFIX + b"/" + caller if tagged else identity


class LocalClients:
    """Mailboxes of in-process clients, by identity."""

    def __init__(self):
        self._boxes: dict[bytes, asyncio.Queue[Message]] = {}
        self._ids = itertools.count(1)

    def open(self, caller: str | None = None) -> tuple[bytes, asyncio.Queue[Message]]:
        """A new identity and the unbounded queue its messages arrive on.

        Args:
            caller: who sends the request (any string), whose turn it takes at the tokenizer
                (`tokenizer_key`); None: a turn of its own.
        """
        identity = PREFIX + str(next(self._ids)).encode()
        if caller is not None:
            identity += b"/" + caller.encode()
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
