"""Wire messages of every buttermilk socket, and their msgpack codec.

Every frame is one msgpack map `{"v": 1, "type": <MessageType>, ...fields}` with string keys.
Unknown keys are ignored; a missing or mistyped field is a `ProtocolError` (a `BadRequest`).
This module owns no state: `encode`/`decode` are pure, and never pickle. The full reference,
with defaults, limits and lifecycles, is docs/protocol.md; keep the two in step.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, ClassVar, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shared.errors import BadRequest, ButtermilkError, ErrorCode

SCHEMA_VERSION = 1
MAX_FRAME_BYTES = 4 * 1024 * 1024  # a larger frame is rejected before it is unpacked
MAX_PROMPT_CHARS = 1024 * 1024  # prompt, or all message contents together, in characters
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
    ENGINE_SESSION_CLOSE = "engine_session_close"  # gateway or controller → engine
    HEARTBEAT = "heartbeat"  # engine → controller
    RESERVE = "reserve"  # gateway → controller
    RESERVED = "reserved"  # controller → gateway
    RECONCILE = "reconcile"  # engine → controller
    RELEASE = "release"  # engine → controller
    ENGINE_DEAD = "engine_dead"  # supervisor or gateway → controller
    REVOKED = "revoked"  # controller → gateway


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
Reason = Annotated[FinishReason, Field(strict=False)]  # strict mode would demand an enum object
Code = Annotated[ErrorCode, Field(strict=False)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class _Message(_Model):
    TYPE: ClassVar[MessageType]


# ---- client → gateway -------------------------------------------------------------------


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


ChatMessages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]


class Generate(_Message):
    """Start a generation; exactly one of `prompt`, `messages`, `token_ids`."""

    TYPE = MessageType.GENERATE
    id: Id
    prompt: Prompt | None = None
    messages: ChatMessages | None = None
    token_ids: PromptTokens | None = None
    max_tokens: MaxTokens = DEFAULT_MAX_TOKENS
    temperature: Temperature = 0.0  # 0 is greedy
    top_p: TopP = 1.0
    top_k: TopK | None = None  # None disables top-k
    seed: Seed | None = None
    stop: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] = []
    session_id: Id | None = None  # multi-turn: the prompt is only this turn's new input
    new_session: bool = False  # True starts `session_id`; False continues a live one
    lease_id: Id | None = None
    stream: bool = True

    @model_validator(mode="after")
    def _check_inputs(self) -> Generate:
        given = [n for n in ("prompt", "messages", "token_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"exactly one of prompt, messages, token_ids is required, got {given}")
        if self.messages and sum(len(m.content) for m in self.messages) > MAX_PROMPT_CHARS:
            raise ValueError(f"messages hold more than {MAX_PROMPT_CHARS} characters")
        if self.new_session and self.session_id is None:
            raise ValueError("new_session=true needs a session_id")
        return self


class Cancel(_Message):
    TYPE = MessageType.CANCEL
    id: Id


class LeaseOpen(_Message):
    TYPE = MessageType.LEASE_OPEN
    id: Id | None = None  # correlation id, echoed in the reply
    ttl_s: TtlS = DEFAULT_LEASE_TTL_S


class LeaseRenew(_Message):
    TYPE = MessageType.LEASE_RENEW
    id: Id | None = None
    lease_id: Id


class LeaseClose(_Message):
    TYPE = MessageType.LEASE_CLOSE
    id: Id | None = None
    lease_id: Id


class SessionClose(_Message):
    TYPE = MessageType.SESSION_CLOSE
    id: Id | None = None
    session_id: Id


class Health(_Message):
    TYPE = MessageType.HEALTH
    id: Id | None = None


class Stats(_Message):
    TYPE = MessageType.STATS
    id: Id | None = None


# ---- gateway → client -------------------------------------------------------------------


class Usage(_Model):
    prompt_tokens: Count  # the whole context before decoding, cached tokens included
    completion_tokens: Count
    cached_tokens: Count = 0  # prompt tokens reused from the session's KV, not recomputed


class Token(_Message):
    """A chunk of output; `index` is the position of `token_ids[0]` in the completion."""

    TYPE = MessageType.TOKEN
    id: Id
    text: str
    token_ids: Annotated[list[TokenId], Field(max_length=MAX_TOKENS_LIMIT)]
    index: Count


class Done(_Message):
    TYPE = MessageType.DONE
    id: Id
    finish_reason: Reason
    usage: Usage


class Error(_Message):
    TYPE = MessageType.ERROR
    id: Id | None = None  # None when the failing frame had no readable id
    code: Code
    message: Annotated[str, Field(max_length=MAX_ERROR_CHARS)]
    retry_after_ms: Count | None = None


class Lease(_Message):
    """Reply to lease_open and lease_renew."""

    TYPE = MessageType.LEASE
    id: Id | None = None
    lease_id: Id
    ttl_s: TtlS


class LeaseClosed(_Message):
    TYPE = MessageType.LEASE_CLOSED
    id: Id | None = None
    lease_id: Id


class SessionClosed(_Message):
    TYPE = MessageType.SESSION_CLOSED
    id: Id | None = None
    session_id: Id


class HealthOk(_Message):
    TYPE = MessageType.HEALTH_OK
    id: Id | None = None
    status: Literal["ok", "degraded"]  # degraded: no live engine
    engines_live: Count


class PoolUsage(_Model):
    active: Count
    queued: Count
    max_active: Count
    max_queue: Count


class EngineUsage(_Model):
    engine_id: Id
    epoch: Epoch
    capacity_tokens: Count
    reserved_tokens: Count
    held_tokens: Count  # KV kept for multi-turn sessions
    free_tokens: Count
    bytes_per_token: Count


class StatsReply(_Message):
    TYPE = MessageType.STATS_REPLY
    id: Id | None = None
    pool: PoolUsage | None = None  # filled in by the gateway
    engines: Annotated[list[EngineUsage], Field(max_length=MAX_LIST_ITEMS)] = []
    num_reservations: Count = 0
    num_leases: Count = 0
    num_sessions: Count = 0


# ---- engine, gateway and controller (internal) ------------------------------------------


class Geometry(_Model):
    slots: Annotated[int, Field(ge=1)]
    capacity_tokens: Annotated[int, Field(ge=1)]
    bytes_per_token: Count  # all layers, K and V, metadata included
    kv_cache: Annotated[str, Field(min_length=1, max_length=32)]  # raw, affine8, aura4v2, ...
    max_context: Annotated[int, Field(ge=1)]


class Hello(_Message):
    TYPE = MessageType.HELLO
    engine_id: Id
    epoch: Epoch  # +1 on every restart of this engine
    geometry: Geometry
    model: Annotated[str, Field(max_length=1024)] | None = None


class SamplingParams(_Model):
    max_tokens: MaxTokens  # already capped by the gateway
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: TopK | None = None
    seed: Seed | None = None


class EngineGenerate(_Message):
    """Run a request on the engine chosen by the controller (stop strings stay at the gateway)."""

    TYPE = MessageType.ENGINE_GENERATE
    id: Id
    resv_id: Id
    epoch: Epoch  # the engine drops it when this is not its own epoch
    token_ids: PromptTokens
    sampling: SamplingParams
    session_id: Id | None = None  # keep the KV after finishing; positions continue


class TokenChunk(_Model):
    id: Id
    token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_LIST_ITEMS)]
    index: Count  # position of token_ids[0] in the completion


class EngineTokens(_Message):
    TYPE = MessageType.ENGINE_TOKENS
    engine_id: Id
    epoch: Epoch
    chunks: Annotated[list[TokenChunk], Field(max_length=MAX_LIST_ITEMS)]


class EngineFinished(_Message):
    TYPE = MessageType.ENGINE_FINISHED
    engine_id: Id
    epoch: Epoch
    id: Id
    reason: Reason
    usage: Usage
    tokens_held: Count = 0  # KV kept for the session after this request, in tokens
    bytes_held: Count = 0
    message: Annotated[str, Field(max_length=MAX_ERROR_CHARS)] | None = None  # when reason=error


class EngineAbort(_Message):
    TYPE = MessageType.ENGINE_ABORT
    ids: Ids


class EngineSessionClose(_Message):
    TYPE = MessageType.ENGINE_SESSION_CLOSE
    session_ids: Ids


class Heartbeat(_Message):
    TYPE = MessageType.HEARTBEAT
    engine_id: Id
    epoch: Epoch
    num_running: Count = 0
    num_waiting: Count = 0
    tokens_used: Count = 0
    bytes_used: Count = 0


class Reserve(_Message):
    TYPE = MessageType.RESERVE
    request_id: Id
    tokens: Annotated[int, Field(ge=1)]  # prompt + capped max_tokens
    lease_id: Id | None = None
    session_id: Id | None = None
    engine_id: Id | None = None  # a hint; a session is always placed on its own engine


class Reserved(_Message):
    TYPE = MessageType.RESERVED
    request_id: Id
    resv_id: Id
    engine_id: Id
    epoch: Epoch


class Reconcile(_Message):
    TYPE = MessageType.RECONCILE
    resv_id: Id
    tokens_observed: Count  # KV tokens this request added on its engine so far


class Release(_Message):
    TYPE = MessageType.RELEASE
    resv_id: Id
    keep_session_tokens: Count | None = None  # the session's whole KV after this turn


class EngineDead(_Message):
    TYPE = MessageType.ENGINE_DEAD
    engine_id: Id
    epoch: Epoch


class Revoked(_Message):
    """The controller dropped these requests and sessions; end them with `error {code}`."""

    TYPE = MessageType.REVOKED
    code: Code  # lease_expired, engine_failed, or cancelled (lease or session closed)
    request_ids: Ids = []
    session_ids: Ids = []


Message = (
    Generate | Cancel | LeaseOpen | LeaseRenew | LeaseClose | SessionClose | Health | Stats
    | Token | Done | Error | Lease | LeaseClosed | SessionClosed | HealthOk | StatsReply
    | Hello | EngineGenerate | EngineTokens | EngineFinished | EngineAbort | EngineSessionClose
    | Heartbeat | Reserve | Reserved | Reconcile | Release | EngineDead | Revoked
)  # fmt: skip
MODELS: dict[MessageType, type[_Message]] = {cls.TYPE: cls for cls in Message.__args__}
CLIENT_TYPES = frozenset(
    {MessageType.GENERATE, MessageType.CANCEL, MessageType.LEASE_OPEN, MessageType.LEASE_RENEW,
     MessageType.LEASE_CLOSE, MessageType.SESSION_CLOSE, MessageType.HEALTH, MessageType.STATS}
)  # fmt: skip


def encode(msg: Message) -> bytes:
    """Serialize a message to one msgpack frame; optional fields left at None are omitted."""
    body = msg.model_dump(mode="json", exclude_none=True)
    return msgpack.packb({"v": SCHEMA_VERSION, "type": msg.TYPE.value, **body}, use_bin_type=True)


def decode(frame: bytes, allowed: frozenset[MessageType] | None = None) -> Message:
    """Parse and validate one frame.

    Args:
        frame (bytes): one msgpack map, at most `MAX_FRAME_BYTES` bytes.
        allowed (frozenset[MessageType] | None): types this socket accepts, e.g.
            `CLIENT_TYPES` on the client ROUTER. Default: every type.

    Returns:
        Message: a new frozen model; the caller owns it.

    Raises:
        ProtocolError: oversized frame, not msgpack, not a map, missing or unsupported `v`,
            unknown or disallowed `type`, or a field that fails validation (named in the message).
    """
    payload = _unpack_map(frame)
    request_id = _valid_id(payload.get("id"))
    version = payload.get("v")
    if type(version) is not int:  # bool is an int subclass, so not isinstance
        raise ProtocolError("missing or non-integer schema version 'v'", request_id)
    if version != SCHEMA_VERSION:
        message = f"unsupported schema version v={version}; this server speaks v={SCHEMA_VERSION}"
        raise ProtocolError(message, request_id)
    cls = _model_for(payload.get("type"), allowed, request_id)
    try:
        return cls.model_validate(payload)
    except ValidationError as exc:
        raise ProtocolError(_describe(cls.TYPE, exc), request_id) from None


def error_reply(exc: BaseException, request_id: str | None) -> Error:
    """Map an exception to the `error` message that ends `request_id`.

    Args:
        exc (BaseException): a `ButtermilkError` keeps its code, message and `retry_after_ms`;
            anything else becomes `internal` with only the exception's class name (log it).
        request_id (str | None): the failing request's id; dropped if not a valid id.

    Returns:
        Error: the reply to encode and send.
    """
    rid = _valid_id(request_id)
    if not isinstance(exc, ButtermilkError):
        message = f"internal error ({type(exc).__name__})"
        return Error(id=rid, code=ErrorCode.INTERNAL, message=message)
    retry_after_ms = getattr(exc, "retry_after_ms", None)
    if type(retry_after_ms) is not int or retry_after_ms < 0:
        retry_after_ms = None
    message = str(exc.message)[:MAX_ERROR_CHARS]
    return Error(id=rid, code=exc.code, message=message, retry_after_ms=retry_after_ms)


def _unpack_map(frame: bytes) -> dict:
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES} bytes")
    try:
        payload = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"frame is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(payload, dict):
        raise ProtocolError(f"frame must be a msgpack map, got {type(payload).__name__}")
    return payload


def _valid_id(value: object) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS else None


def _model_for(
    name: object, allowed: frozenset[MessageType] | None, request_id: str | None
) -> type[_Message]:
    if not isinstance(name, str) or name not in MODELS:
        raise ProtocolError(f"unknown message type {str(name)[:64]!r}", request_id)
    if allowed is not None and name not in allowed:
        raise ProtocolError(f"message type {name!r} is not accepted on this socket", request_id)
    return MODELS[MessageType(name)]


def _describe(kind: MessageType, exc: ValidationError) -> str:
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    field = ".".join(str(part) for part in first["loc"]) or "(message)"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"invalid {kind.value}: field {field}: {first['msg']}{more}"
