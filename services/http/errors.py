"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every buttermilk error code has one HTTP status, OpenAI error type and `code` string (our
stable wire code; `context_overflow` is OpenAI's `context_length_exceeded`). Retryable codes
(429, 503) carry `x-should-retry: true` and, when known, `retry-after-ms` (the official
clients honour both); codes where a retry cannot help carry `x-should-retry: false`.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.responses import JSONResponse

from shared.errors import ErrorCode
from shared.protocol import Error

NOT_READY = "not_ready"  # no engine is live (HTTP only; the ZeroMQ path answers overloaded)


@dataclass(frozen=True, slots=True)
class Kind:
    status: int
    type: str  # OpenAI's error type
    should_retry: bool | None  # None: no x-should-retry header (the client decides)


KINDS: dict[str, Kind] = {
    ErrorCode.BAD_REQUEST: Kind(400, "invalid_request_error", False),
    ErrorCode.CONTEXT_OVERFLOW: Kind(400, "invalid_request_error", False),
    ErrorCode.LEASE_EXPIRED: Kind(400, "invalid_request_error", False),
    ErrorCode.MODEL_NOT_FOUND: Kind(404, "invalid_request_error", False),
    ErrorCode.CANCELLED: Kind(409, "invalid_request_error", False),
    ErrorCode.OVERLOADED: Kind(429, "rate_limit_error", True),
    ErrorCode.QUEUE_TIMEOUT: Kind(429, "rate_limit_error", True),
    ErrorCode.CAPACITY: Kind(429, "rate_limit_error", True),
    ErrorCode.ENGINE_FAILED: Kind(503, "server_error", True),
    ErrorCode.UNAVAILABLE: Kind(503, "server_error", True),
    NOT_READY: Kind(503, "server_error", True),
    ErrorCode.STALE_SLOT: Kind(500, "server_error", False),
    ErrorCode.INTERNAL: Kind(500, "server_error", None),
}
OPENAI_CODES = {ErrorCode.CONTEXT_OVERFLOW: "context_length_exceeded"}


class ApiError(Exception):
    """An HTTP error response in OpenAI's shape.

    Args:
        code (str): a buttermilk `ErrorCode` value, `not_ready`, or an HTTP-only code
            (`not_found`, `method_not_allowed`, `request_too_large`) with `status` given.
        message (str): for the user; one line.
        param (str | None): the request field at fault (OpenAI's `param`).
        retry_after_ms (int | None): when a retry may succeed, milliseconds.
        status (int | None): overrides the status of `code`.
    """

    def __init__(self, code: str, message: str, *, param: str | None = None, retry_after_ms: int | None = None,
                 status: int | None = None):  # fmt: skip
        super().__init__(message)
        kind = KINDS.get(code, KINDS[ErrorCode.INTERNAL])
        if status is not None and status != kind.status:
            kind = Kind(status, "invalid_request_error" if status < 500 else "server_error", False if status < 500 else None)
        self.kind, self.code, self.message = kind, str(code), message
        self.param, self.retry_after_ms = param, retry_after_ms

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> ApiError:
        return cls(ErrorCode.BAD_REQUEST, message, param=param)

    @classmethod
    def from_wire(cls, msg: Error, *, param: str | None = None) -> ApiError:
        """The HTTP form of the gateway's `error` message; `param` names the input field when
        the error is about the input (context overflow)."""
        blame = param if msg.code == ErrorCode.CONTEXT_OVERFLOW else None
        return cls(msg.code, msg.message, param=blame, retry_after_ms=msg.retry_after_ms)

    @property
    def status(self) -> int:
        return self.kind.status

    def body(self) -> dict:
        code = OPENAI_CODES.get(self.code, self.code)
        return {"error": {"message": self.message, "type": self.kind.type, "param": self.param, "code": code}}

    def headers(self) -> dict[str, str]:
        headers = {}
        if self.kind.should_retry is not None:
            headers["x-should-retry"] = "true" if self.kind.should_retry else "false"
        if self.retry_after_ms is not None:
            headers["retry-after-ms"] = str(self.retry_after_ms)
            headers["retry-after"] = str(max(1, -(-self.retry_after_ms // 1000)))  # whole seconds, rounded up
        return headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())
