"""Building blocks of the wire messages: limits, enums, field types and the message base class.

`shared/protocol.py` re-exports everything here; import from there. This module owns no state.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from shared.errors import BadRequest, ErrorCode

SCHEMA_VERSION = 1
MAX_PROMPT_CHARS = 1024 * 1024  # prompt, or all message contents together, in characters
# Every valid message fits: the largest is a prompt of MAX_PROMPT_CHARS 4-byte characters
# (4 MiB) with every other field at its limit (under 64 KiB). Larger frames are cut at the
# socket (ZMQ_MAXMSGSIZE) and, if they get that far, rejected before they are unpacked.
MAX_FRAME_BYTES = 5 * 1024 * 1024
MAX_PROMPT_TOKENS = 256 * 1024  # length of `token_ids` in a generate
MAX_MESSAGES = 1024  # chat messages in one generate
MAX_TOKENS_LIMIT = 1024 * 1024  # largest `max_tokens` accepted; the gateway caps it further
MAX_TOKEN_ID = 2**31 - 1
MAX_SEED = 2**63 - 1
MAX_ID_CHARS = 256  # request, lease, session, reservation and engine ids
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_ERROR_CHARS = 4096  # error messages are cut to this length by `error_reply`
MAX_LIST_ITEMS = 4096  # id lists and token batches in internal messages
DEFAULT_MAX_TOKENS = 256
DEFAULT_LEASE_TTL_S = 30.0
MIN_LEASE_TTL_S = 1.0
MAX_LEASE_TTL_S = 3600.0


class MessageType(StrEnum):
    """Every message type; the values are the wire strings."""

    GENERATE = "generate"  # client → gateway
    CANCEL = "cancel"
    LEASE_OPEN = "lease_open"
    LEASE_RENEW = "lease_renew"
    LEASE_CLOSE = "lease_close"
    SESSION_CLOSE = "session_close"
    HEALTH = "health"
    STATS = "stats"
    TOKEN = "token"  # gateway → client
    DONE = "done"
    ERROR = "error"
    LEASE = "lease"
    LEASE_CLOSED = "lease_closed"
    SESSION_CLOSED = "session_closed"
    HEALTH_OK = "health_ok"
    STATS_REPLY = "stats_reply"
    HELLO = "hello"  # engine → gateway and controller
    ENGINE_GENERATE = "engine_generate"  # gateway → engine
    ENGINE_TOKENS = "engine_tokens"  # engine → gateway
    ENGINE_FINISHED = "engine_finished"  # engine → gateway
    ENGINE_ABORT = "engine_abort"  # gateway or controller → engine
    ENGINE_SESSION_CLOSE = "engine_session_close"  # controller → engine
    HEARTBEAT = "heartbeat"  # engine → controller and gateway
    RESERVE = "reserve"  # gateway → controller
    RESERVED = "reserved"  # controller → gateway
    RECONCILE = "reconcile"  # engine → controller
    RELEASE = "release"  # gateway → controller
    ENGINE_DEAD = "engine_dead"  # supervisor, gateway, engine → controller; controller → gateway, engine
    REVOKED = "revoked"  # controller → gateway
    KEEPALIVE = "keepalive"  # gateway → client: nothing to say yet (detects a gone connection)
    GATEWAY_HEARTBEAT = "gateway_heartbeat"  # gateway → controller: which gateway instance is live


class FinishReason(StrEnum):
    """Why a generation ended; the values are the wire strings."""

    STOP = "stop"  # end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens (after capping) or the context limit
    CANCELLED = "cancelled"  # the client's cancel, or an abort
    ERROR = "error"  # the engine failed this request


class ProtocolError(BadRequest):
    """A frame that is not a valid message; `request_id` is the frame's `id` when readable."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
Count = Annotated[int, Field(ge=0)]
Epoch = Annotated[int, Field(ge=0)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Ids = Annotated[list[Id], Field(max_length=MAX_LIST_ITEMS)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
Temperature = Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=1)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
TtlS = Annotated[float, Field(ge=MIN_LEASE_TTL_S, le=MAX_LEASE_TTL_S, allow_inf_nan=False)]
Prompt = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
PromptTokens = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
ErrorText = Annotated[str, Field(max_length=MAX_ERROR_CHARS)]
Reason = Annotated[FinishReason, Field(strict=False)]  # strict mode would demand an enum object
Code = Annotated[ErrorCode, Field(strict=False)]
Pid = Annotated[int, Field(ge=1, le=2**31 - 1)]
DeviceText = Annotated[str, Field(max_length=256)]  # e.g. "gpu:0 (NVIDIA H200)", "cpu"


class Struct(BaseModel):
    """Base of every wire struct: strict types, unknown keys ignored, immutable."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class WireMessage(Struct):
    """Base of every top-level message; `TYPE` is its wire `type`."""

    TYPE: ClassVar[MessageType]


class Usage(Struct):
    prompt_tokens: Count  # the whole context before decoding, cached tokens included
    completion_tokens: Count
    cached_tokens: Count = 0  # prompt tokens reused (session KV or prefix cache), not recomputed


class PrefixCacheUsage(Struct):
    """An engine's prefix cache: what it holds now, and its activity since the engine started."""

    cached_tokens: Count = 0  # tokens of cached pages (K/V written), held by requests or not
    evictable_tokens: Count = 0  # of them, in pages no request holds (free to reclaim)
    query_tokens: Count = 0  # prompt tokens looked up at admission
    hit_tokens: Count = 0  # of them, tokens reused instead of computed (hit rate = hit / query)
    evicted_tokens: Count = 0  # tokens of cached pages reclaimed for new K/V
