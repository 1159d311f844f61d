"""Typed errors shared by every service, one subclass per stable wire code that is raised.

A `ButtermilkError` raised anywhere in a request's path becomes an
`error {id, code, message}` frame on the wire (see docs/protocol.md); anything
else becomes `internal`. `retryable` tells a client whether the same request
may succeed later. `cancelled` has no subclass: nothing raises it; the gateway and controller
build that `error` message directly when a lease, session or connection ends.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum


class ErrorCode(StrEnum):
    """Stable error codes; the values are the wire strings."""

    BAD_REQUEST = "bad_request"
    CONTEXT_OVERFLOW = "context_overflow"
    OVERLOADED = "overloaded"
    QUEUE_TIMEOUT = "queue_timeout"
    LEASE_EXPIRED = "lease_expired"
    ENGINE_FAILED = "engine_failed"
    CANCELLED = "cancelled"
    UNAVAILABLE = "unavailable"
    CAPACITY = "capacity"
    STALE_SLOT = "stale_slot"
    MODEL_NOT_FOUND = "model_not_found"
    INTERNAL = "internal"


class ButtermilkError(Exception):
    """Base class of every error a user or client may see."""

    code: ErrorCode = ErrorCode.INTERNAL
    retryable: bool = False

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(ButtermilkError):
    """Malformed or invalid input (wrong type, out-of-range option, unknown field value)."""

    code = ErrorCode.BAD_REQUEST


class ContextOverflow(ButtermilkError):
    """A sequence would exceed the advertised context (`--max-context`), in tokens."""

    code = ErrorCode.CONTEXT_OVERFLOW

    def __init__(self, num_tokens: int, max_context: int, what: str = "prompt"):
        super().__init__(
            f"{what} needs {num_tokens} tokens but the context is capped at "
            f"{max_context} tokens (--max-context)"
        )
        self.num_tokens = num_tokens
        self.max_context = max_context

    @classmethod
    def no_room(cls, prompt_tokens: int, max_context: int, what: str = "prompt") -> ContextOverflow:
        """A prompt of `prompt_tokens` tokens that leaves no room for one generated token."""
        return cls(prompt_tokens + 1, max_context, f"{what} ({prompt_tokens} tokens) plus one generated token")


class Overloaded(ButtermilkError):
    """The server cannot queue more work now; retry after `retry_after_ms` milliseconds."""

    code = ErrorCode.OVERLOADED
    retryable = True

    def __init__(self, message: str, retry_after_ms: int):
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class QueueTimeout(ButtermilkError):
    """A queued request waited longer than the queue timeout (seconds) before starting."""

    code = ErrorCode.QUEUE_TIMEOUT
    retryable = True


class LeaseExpired(ButtermilkError):
    """The client's lease expired or was closed; its work was released."""

    code = ErrorCode.LEASE_EXPIRED


class SessionEnded(ButtermilkError):
    """A turn on a session the server ended: evicted while idle between turns to make room for another
    request (its slot or KV tokens), its lease closed, or a turn lost to a drain or a reservation timeout.
    Not the client's fault; start the session again (`new_session`) with its full history."""

    code = ErrorCode.CANCELLED


class EngineFailed(ButtermilkError):
    """The engine serving the request died; its reservations were dropped."""

    code = ErrorCode.ENGINE_FAILED
    retryable = True


class Unavailable(ButtermilkError):
    """The server is shutting down, or a service it needs did not answer in time; retry later."""

    code = ErrorCode.UNAVAILABLE
    retryable = True


class CapacityExhausted(ButtermilkError):
    """A cache allocation would exceed its token capacity; nothing was written."""

    code = ErrorCode.CAPACITY
    retryable = True


class StaleSlot(ButtermilkError):
    """A slot view was used after its slot was released or reused (generation mismatch)."""

    code = ErrorCode.STALE_SLOT


class ModelNotFound(ButtermilkError):
    """`--model` names no usable model (missing path, malformed folder or GGUF file)."""

    code = ErrorCode.MODEL_NOT_FOUND


def one_line(exc: Exception, label: Callable[[str], str] | None = None) -> str:
    """A pydantic ValidationError as `field: message; ...` (other errors: `str(exc)`); `label` renames a
    field as the user knows it (a command-line flag, an environment variable)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    parts = []
    for err in errors():
        head, *rest = err.get("loc", ()) or ("",)  # a field, then indices into it (`kv_raw_layers[0]`)
        loc = (label(str(head)) if label and head != "" else str(head)) + "".join(
            f"[{p}]" if isinstance(p, int) else f".{p}" for p in rest)
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)
