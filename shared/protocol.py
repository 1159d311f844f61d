"""Wire messages of every buttermilk socket, and their msgpack codec.

Every frame is one msgpack map `{"v": 1, "type": <MessageType>, ...fields}` with string keys.
Unknown keys are ignored; a missing or mistyped field is a `ProtocolError` (a `BadRequest`).
This module owns no state: `encode`/`decode` are pure, and never pickle. The full reference,
with defaults, limits and lifecycles, is docs/protocol.md; keep the two in step.

Client messages live here; limits, enums and field types in `protocol_base`; messages between
buttermilk processes in `protocol_internal`. Everything is re-exported from this module.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgpack
from pydantic import Field, ValidationError, model_validator

from shared.errors import ButtermilkError, ErrorCode
from shared.protocol_base import (  # re-exported: this module is the one to import
    DEFAULT_LEASE_TTL_S,
    DEFAULT_MAX_TOKENS,
    MAX_ERROR_CHARS,
    MAX_FRAME_BYTES,
    MAX_ID_CHARS,
    MAX_LEASE_TTL_S,
    MAX_LIST_ITEMS,
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKEN_ID,
    MAX_TOKENS_LIMIT,
    MIN_LEASE_TTL_S,
    SCHEMA_VERSION,
    Code,
    Count,
    DeviceText,
    Epoch,
    ErrorText,
    FinishReason,
    Id,
    Ids,
    MaxTokens,
    MessageType,
    Pid,
    Prompt,
    PrefixCacheUsage,
    PromptTokens,
    ProtocolError,
    Reason,
    Seed,
    StopString,
    Struct,
    Temperature,
    TokenId,
    TopK,
    TopP,
    TtlS,
    Usage,
    WireMessage,
)
from shared.protocol_internal import (
    DEFAULT_ENGINE_TIMEOUT_S,
    GATEWAY_ROUTING_ID,
    HEARTBEAT_S,
    EngineAbort,
    EngineDead,
    EngineFinished,
    EngineGenerate,
    EngineSessionClose,
    EngineTokens,
    GatewayHeartbeat,
    Geometry,
    Heartbeat,
    Hello,
    Reconcile,
    Release,
    Reserve,
    Reserved,
    Revoked,
    SamplingParams,
    TokenChunk,
    is_silent,
)

# ---- client → gateway -------------------------------------------------------------------


class ChatMessage(Struct):
    role: Literal["system", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


ChatMessages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]


class Generate(WireMessage):
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
        if self.messages and self.prompt_chars > MAX_PROMPT_CHARS:
            raise ValueError(f"messages hold more than {MAX_PROMPT_CHARS} characters")
        if self.new_session and self.session_id is None:
            raise ValueError("new_session=true needs a session_id")
        return self

    @property
    def prompt_chars(self) -> int:
        """Characters of text input: the prompt's, or the messages' contents summed (0 for token ids)."""
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(m.content) for m in self.messages) if self.messages is not None else 0


class Cancel(WireMessage):
    TYPE = MessageType.CANCEL
    id: Id


class LeaseOpen(WireMessage):
    TYPE = MessageType.LEASE_OPEN
    id: Id | None = None  # correlation id, echoed in the reply
    ttl_s: TtlS = DEFAULT_LEASE_TTL_S


class LeaseRenew(WireMessage):
    TYPE = MessageType.LEASE_RENEW
    id: Id | None = None
    lease_id: Id


class LeaseClose(WireMessage):
    TYPE = MessageType.LEASE_CLOSE
    id: Id | None = None
    lease_id: Id


class SessionClose(WireMessage):
    TYPE = MessageType.SESSION_CLOSE
    id: Id | None = None
    session_id: Id
    lease_id: Id | None = None  # the session's lease; None: a session of this connection


class Keepalive(WireMessage):
    """Sent to a connection with requests in flight that heard nothing for a while; ignore it."""

    TYPE = MessageType.KEEPALIVE


class Health(WireMessage):
    TYPE = MessageType.HEALTH
    id: Id | None = None


class Stats(WireMessage):
    TYPE = MessageType.STATS
    id: Id | None = None


# ---- gateway → client -------------------------------------------------------------------


class Token(WireMessage):
    """A chunk of output; `index` is the position of `token_ids[0]` in the completion."""

    TYPE = MessageType.TOKEN
    id: Id
    text: str
    token_ids: Annotated[list[TokenId], Field(max_length=MAX_TOKENS_LIMIT)]
    index: Count


class Done(WireMessage):
    TYPE = MessageType.DONE
    id: Id
    finish_reason: Reason
    usage: Usage


class Error(WireMessage):
    TYPE = MessageType.ERROR
    id: Id | None = None  # None when the failing frame had no readable id
    code: Code
    message: ErrorText
    retry_after_ms: Count | None = None


class LeaseGranted(WireMessage):
    """Reply to lease_open and lease_renew (wire type `lease`); the lease itself is the controller's record."""

    TYPE = MessageType.LEASE
    id: Id | None = None
    lease_id: Id
    ttl_s: TtlS


class LeaseClosed(WireMessage):
    TYPE = MessageType.LEASE_CLOSED
    id: Id | None = None
    lease_id: Id


class SessionClosed(WireMessage):
    TYPE = MessageType.SESSION_CLOSED
    id: Id | None = None
    session_id: Id


class HealthOk(WireMessage):
    TYPE = MessageType.HEALTH_OK
    id: Id | None = None
    status: Literal["ok", "degraded"]  # degraded: no live engine
    engines_live: Count


class PoolUsage(Struct):
    active: Count
    queued: Count
    max_active: Count
    max_queue: Count
    preparing: Count = 0  # prompts being tokenized or waiting for the tokenizer


class EngineUsage(Struct):
    engine_id: Id
    epoch: Epoch
    capacity_tokens: Count
    reserved_tokens: Count
    held_tokens: Count  # KV kept for multi-turn sessions
    free_tokens: Count
    bytes_per_token: Count
    used_slots: Count = 0  # engine-reported (latest heartbeat): slots held, sessions included
    max_slots: Count = 0
    reserved_slots: Count = 0  # the controller's count: sessions + requests without one
    engine_tokens: Count = 0  # engine-reported: KV tokens its cache holds now
    pid: Pid | None = None  # the engine's OS process id
    prefix_cache: PrefixCacheUsage | None = None  # engine-reported (latest heartbeat)
    device: DeviceText | None = None  # the engine's device, as its HELLO says
    cuda_visible_devices: DeviceText | None = None  # the engine's CUDA_VISIBLE_DEVICES; None: unset


class StatsReply(WireMessage):
    TYPE = MessageType.STATS_REPLY
    id: Id | None = None
    pool: PoolUsage | None = None  # filled in by the gateway
    max_context: Count | None = None  # the gateway's: most tokens a sequence may hold (--max-context)
    max_tokens_cap: Count | None = None  # the gateway's: most tokens one request may generate
    engines: Annotated[list[EngineUsage], Field(max_length=MAX_LIST_ITEMS)] = []
    num_reservations: Count = 0
    num_leases: Count = 0
    num_sessions: Count = 0


Message = (
    Generate | Cancel | LeaseOpen | LeaseRenew | LeaseClose | SessionClose | Health | Stats
    | Token | Done | Error | LeaseGranted | LeaseClosed | SessionClosed | HealthOk | StatsReply
    | Hello | EngineGenerate | EngineTokens | EngineFinished | EngineAbort | EngineSessionClose
    | Heartbeat | Reserve | Reserved | Reconcile | Release | EngineDead | Revoked | Keepalive
    | GatewayHeartbeat
)  # fmt: skip
MODELS: dict[MessageType, type[WireMessage]] = {cls.TYPE: cls for cls in Message.__args__}
T = MessageType
# What each socket accepts (the `allowed` argument of `decode`).
CLIENT_TYPES = frozenset(
    {T.GENERATE, T.CANCEL, T.LEASE_OPEN, T.LEASE_RENEW, T.LEASE_CLOSE, T.SESSION_CLOSE, T.HEALTH,
     T.STATS}
)  # fmt: skip
CLIENT_REPLY_TYPES = frozenset(
    {T.TOKEN, T.DONE, T.ERROR, T.LEASE, T.LEASE_CLOSED, T.SESSION_CLOSED, T.HEALTH_OK,
     T.STATS_REPLY, T.KEEPALIVE}
)  # fmt: skip
ENGINE_CMD_TYPES = frozenset({T.HELLO, T.HEARTBEAT})  # engines → gateway "engine-cmd"
ENGINE_OUT_TYPES = frozenset({T.ENGINE_TOKENS, T.ENGINE_FINISHED})  # engines → gateway "engine-out"
ENGINE_TYPES = frozenset(  # what engines accept from the gateway and the controller
    {T.ENGINE_GENERATE, T.ENGINE_ABORT, T.ENGINE_SESSION_CLOSE, T.ENGINE_DEAD, T.ERROR}
)
CONTROLLER_TYPES = frozenset(
    {T.HELLO, T.HEARTBEAT, T.RECONCILE, T.RESERVE, T.RELEASE, T.LEASE_OPEN, T.LEASE_RENEW,
     T.LEASE_CLOSE, T.SESSION_CLOSE, T.STATS, T.ENGINE_DEAD, T.GATEWAY_HEARTBEAT}
)  # fmt: skip
FROM_CONTROLLER_TYPES = frozenset(
    {T.RESERVED, T.ERROR, T.LEASE, T.LEASE_CLOSED, T.SESSION_CLOSED, T.STATS_REPLY, T.REVOKED,
     T.ENGINE_DEAD}
)  # fmt: skip
del T


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
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES} bytes")
    try:
        payload = _unpack_map(frame)
    except ProtocolError as exc:
        exc.request_id = readable_id(frame)
        raise
    request_id = _valid_id(payload.get("id"))
    version = payload.get("v")
    if type(version) is not int:  # bool is an int subclass, so not isinstance
        raise ProtocolError("missing or non-integer schema version 'v'", request_id)
    if version != SCHEMA_VERSION:
        message = f"unsupported schema version v={version}; this server speaks v={SCHEMA_VERSION}"
        raise ProtocolError(message, request_id)
    if "type" not in payload:
        raise ProtocolError("missing field 'type' (the message type, e.g. 'generate')", request_id)
    cls = _model_for(payload["type"], allowed, request_id)
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


def readable_id(frame: bytes) -> str | None:
    """The top-level `id` of a frame that does not decode strictly, when it can still be read.

    Reads the top map's entries in order, leniently (invalid UTF-8 and non-string keys
    allowed elsewhere), until `id` or the first unreadable entry; a truncated frame keeps the
    entries before the cut.
    """
    unpacker = msgpack.Unpacker(raw=False, unicode_errors="surrogateescape", strict_map_key=False,
                                max_buffer_size=len(frame) + 1)  # fmt: skip
    unpacker.feed(frame)
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key == "id":
                value = unpacker.unpack()
                value.encode("utf-8")  # an id with invalid UTF-8 (surrogates here) is unreadable
                return _valid_id(value)
            unpacker.skip()
    except Exception:  # msgpack raises several unrelated types; any of them means "unreadable"
        return None
    return None


class _ExtType(ValueError):
    """A msgpack ext type in a frame (the protocol has none)."""


def _refuse_ext(code: int, data: bytes):
    raise _ExtType(f"msgpack ext type {code} is not part of the protocol")


def _unpack_map(frame: bytes) -> dict:
    try:
        payload = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True, ext_hook=_refuse_ext)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        detail = str(exc) if isinstance(exc, _ExtType) else type(exc).__name__
        raise ProtocolError(f"frame is not valid msgpack ({detail})") from None
    if not isinstance(payload, dict):
        raise ProtocolError(f"frame must be a msgpack map, got {type(payload).__name__}")
    return payload


def _valid_id(value: object) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS else None


def _model_for(
    name: object, allowed: frozenset[MessageType] | None, request_id: str | None
) -> type[WireMessage]:
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
