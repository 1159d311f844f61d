"""Wire protocol: round-trips of every message, and every malformed frame is a ProtocolError."""

from __future__ import annotations

import math
import pathlib

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import protocol as p
from shared.errors import (
    BadRequest,
    ButtermilkError,
    ContextOverflow,
    EngineFailed,
    ErrorCode,
    LeaseExpired,
    Overloaded,
    QueueTimeout,
)

USAGE = p.Usage(prompt_tokens=12, completion_tokens=3, cached_tokens=8)
GEOMETRY = p.Geometry(
    slots=8, capacity_tokens=65536, bytes_per_token=9216, kv_cache="aura4v2", max_context=8192
)
EXAMPLES: list[p.Message] = [
    p.Generate(id="r1", prompt="Hello"),
    p.Generate(
        id="L/s/r2",
        messages=[p.ChatMessage(role="system", content="be brief"), p.ChatMessage(role="user", content="hi")],
        max_tokens=32, temperature=0.7, top_p=0.9, top_k=40, seed=7, stop=["\n\n"],
        session_id="s", new_session=True, lease_id="L", stream=False,
    ),
    p.Generate(id="r3", token_ids=[1, 2, 3]),
    p.Cancel(id="r1"),
    p.LeaseOpen(ttl_s=10.0), p.LeaseOpen(id="c1", ttl_s=2.5),
    p.LeaseRenew(lease_id="L"), p.LeaseClose(id="c2", lease_id="L"),
    p.SessionClose(session_id="s"), p.SessionClose(session_id="s", lease_id="L"), p.Health(), p.Stats(id="c3"),
    p.Keepalive(), p.GatewayHeartbeat(gateway_id="gw-1"),
    p.Token(id="r1", text="Hel", token_ids=[5, 6], index=0),
    p.Done(id="r1", finish_reason=p.FinishReason.LENGTH, usage=USAGE),
    p.Error(id="r1", code=ErrorCode.OVERLOADED, message="busy", retry_after_ms=250),
    p.Error(code=ErrorCode.BAD_REQUEST, message="no id"),
    p.LeaseGranted(lease_id="L", ttl_s=30.0), p.LeaseClosed(lease_id="L"),
    p.SessionClosed(id="c4", session_id="s"),
    p.HealthOk(status="ok", engines_live=2),
    p.StatsReply(
        pool=p.PoolUsage(active=1, queued=2, max_active=4, max_queue=8),
        engines=[p.EngineUsage(engine_id="e0", epoch=3, capacity_tokens=100, reserved_tokens=40,
                               held_tokens=10, free_tokens=50, bytes_per_token=64)],
        num_reservations=1, num_leases=1, num_sessions=1,
    ),
    p.Hello(engine_id="e0", epoch=2, geometry=GEOMETRY, model="SmolLM2-135M"),
    p.EngineGenerate(
        id="r1", resv_id="resv-1", epoch=2, token_ids=[1, 2],
        sampling=p.SamplingParams(max_tokens=5, temperature=0.5, seed=1), session_id="s", session_tokens=12,
    ),
    p.EngineTokens(engine_id="e0", epoch=2, chunks=[p.TokenChunk(id="r1", token_ids=[9], index=4)]),
    p.EngineFinished(engine_id="e0", epoch=2, id="r1", reason="stop", usage=USAGE, tokens_held=15),
    p.EngineAbort(ids=["r1", "r2"]), p.EngineSessionClose(session_ids=["s"]),
    p.Heartbeat(engine_id="e0", epoch=2, tokens_used=20, used_slots=1, capacity_tokens=64),
    p.Reserve(request_id="r1", tokens=300, lease_id="L", session_id="s", engine_id="e0"),
    p.Reserved(request_id="r1", resv_id="resv-1", engine_id="e0", epoch=2),
    p.Reconcile(resv_id="resv-1", tokens_observed=120),
    p.Release(resv_id="resv-1", keep_session_tokens=120), p.Release(resv_id="resv-2"),
    p.EngineDead(engine_id="e0", epoch=2),
    p.Revoked(code=ErrorCode.LEASE_EXPIRED, request_ids=["r1"], session_ids=["s"]),
]  # fmt: skip


def frame(**fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def assert_rejected(data: bytes, *words: str) -> p.ProtocolError:
    with pytest.raises(p.ProtocolError) as info:
        p.decode(data)
    err = info.value
    assert isinstance(err, BadRequest) and err.code == ErrorCode.BAD_REQUEST
    for word in words:
        assert word in err.message, err.message
    return err


# ---- well-formed messages ---------------------------------------------------------------


def test_examples_cover_every_message_type():
    assert {type(m).TYPE for m in EXAMPLES} == set(p.MessageType) == set(p.MODELS)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).TYPE.value)
def test_round_trip(msg):
    data = p.encode(msg)
    assert len(data) <= p.MAX_FRAME_BYTES
    raw = msgpack.unpackb(data, raw=False)
    assert raw["v"] == 1 and raw["type"] == type(msg).TYPE.value
    assert all(isinstance(k, str) for k in raw)
    assert p.decode(data) == msg


def test_defaults_and_unknown_keys_are_ignored():
    msg = p.decode(frame(v=1, type="generate", id="r", prompt="x", future_field={"a": 1}))
    assert isinstance(msg, p.Generate)
    assert (msg.max_tokens, msg.temperature, msg.top_p, msg.top_k, msg.seed) == (
        256,
        0.0,
        1.0,
        None,
        None,
    )
    assert msg.stop == [] and msg.stream is True and msg.session_id is None and not msg.new_session


def test_integer_is_accepted_for_float_fields():
    # JavaScript encoders write 1.0 as the integer 1.
    msg = p.decode(frame(v=1, type="generate", id="r", prompt="x", temperature=1, top_p=1))
    assert msg.temperature == 1.0 and msg.top_p == 1.0


def test_optional_none_fields_are_omitted_on_the_wire():
    raw = msgpack.unpackb(p.encode(p.Generate(id="r", prompt="x")), raw=False)
    assert "seed" not in raw and "messages" not in raw and "token_ids" not in raw


def test_allowed_types_filter():
    data = p.encode(p.Reserve(request_id="r1", tokens=3))
    assert_rejected_with = pytest.raises(p.ProtocolError, match="not accepted")
    with assert_rejected_with:
        p.decode(data, allowed=p.CLIENT_TYPES)
    assert isinstance(p.decode(p.encode(p.Cancel(id="r")), allowed=p.CLIENT_TYPES), p.Cancel)


DOC = pathlib.Path(__file__).parents[1] / "docs" / "protocol.md"
DOC_EXAMPLE_HEX = (
    "85 a1 76 01 a4 74 79 70 65 a8 67 65 6e 65 72 61 74 65 a2 69 64 a2 72 31 a6 70 72 6f 6d 70 74"
    " a2 48 69 aa 6d 61 78 5f 74 6f 6b 65 6e 73 08"
)


def test_documented_example_frame_decodes():
    assert DOC_EXAMPLE_HEX in DOC.read_text()
    data = bytes.fromhex(DOC_EXAMPLE_HEX)
    assert len(data) == 46
    assert p.decode(data) == p.Generate(id="r1", prompt="Hi", max_tokens=8)


def all_error_classes(cls=ButtermilkError):
    yield cls
    for sub in cls.__subclasses__():
        yield from all_error_classes(sub)


def test_documented_error_table_matches_error_classes():
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 3 and cells[1] in {"yes", "no"} and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1] == "yes"
    assert set(rows) == {c.value for c in ErrorCode}
    for cls in all_error_classes():
        assert rows[cls.code.value] == cls.retryable, cls


# ---- generated well-formed generates ----------------------------------------------------

ids = st.text(min_size=1, max_size=40)
finite = dict(allow_nan=False, allow_infinity=False)


@st.composite
def generates(draw):
    kind = draw(st.sampled_from(["prompt", "messages", "token_ids"]))
    source = {
        "prompt": st.text(min_size=1, max_size=200),
        "messages": st.lists(
            st.builds(p.ChatMessage, role=st.sampled_from(["system", "user", "assistant"]),
                      content=st.text(max_size=50)),
            min_size=1, max_size=4,
        ),
        "token_ids": st.lists(st.integers(0, p.MAX_TOKEN_ID), min_size=1, max_size=50),
    }[kind]  # fmt: skip
    return p.Generate(
        id=draw(ids),
        **{kind: draw(source)},
        max_tokens=draw(st.integers(1, p.MAX_TOKENS_LIMIT)),
        temperature=draw(st.floats(0.0, 100.0, **finite)),
        top_p=draw(st.floats(0.0, 1.0, exclude_min=True, **finite)),
        top_k=draw(st.none() | st.integers(1, 1000)),
        seed=draw(st.none() | st.integers(0, p.MAX_SEED)),
        stop=draw(st.lists(st.text(min_size=1, max_size=10), max_size=p.MAX_STOP_STRINGS)),
        session_id=(session := draw(st.none() | ids)),
        new_session=session is not None and draw(st.booleans()),
        lease_id=draw(st.none() | ids),
        stream=draw(st.booleans()),
    )


@given(generates())
@settings(max_examples=150, deadline=None)
def test_generate_round_trip_property(msg):
    assert p.decode(p.encode(msg)) == msg


# ---- malformed frames -------------------------------------------------------------------

GOOD = dict(v=1, type="generate", id="r9", prompt="hello")

MALFORMED = {
    "not msgpack": (b"\xc1", ["msgpack"]),
    "empty frame": (b"", ["msgpack"]),
    "truncated map": (frame(**GOOD)[:-3], ["msgpack"]),
    "trailing bytes": (frame(**GOOD) + b"\x00", ["msgpack"]),
    "invalid utf-8 string": (b"\x81\xa1v\xa2\xff\xfe", ["msgpack"]),
    "msgpack list": (msgpack.packb([1, "generate"]), ["map", "list"]),
    "msgpack int": (msgpack.packb(7), ["map"]),
    "msgpack string": (msgpack.packb("generate"), ["map"]),
    "non-string key": (msgpack.packb({1: 2}), ["msgpack"]),
    "deeply nested": (b"\x91" * 100_000 + b"\x01", ["msgpack"]),
    "missing v": (frame(type="generate", id="r9", prompt="x"), ["'v'"]),
    "v as bool": (frame(**{**GOOD, "v": True}), ["'v'"]),
    "v as string": (frame(**{**GOOD, "v": "1"}), ["'v'"]),
    "unsupported v": (frame(**{**GOOD, "v": 2}), ["unsupported", "v=2"]),
    "missing type": (frame(v=1, id="r9"), ["missing field 'type'"]),
    "unknown type": (frame(**{**GOOD, "type": "generat"}), ["unknown message type", "generat"]),
    "type as int": (frame(**{**GOOD, "type": 3}), ["unknown message type"]),
    "type as bytes": (frame(**{**GOOD, "type": b"generate"}), ["unknown message type"]),
    "missing id": (frame(v=1, type="generate", prompt="x"), ["field id", "required"]),
    "id as int": (frame(**{**GOOD, "id": 5}), ["field id"]),
    "id as bytes": (frame(**{**GOOD, "id": b"r9"}), ["field id"]),
    "empty id": (frame(**{**GOOD, "id": ""}), ["field id"]),
    "long id": (frame(**{**GOOD, "id": "x" * (p.MAX_ID_CHARS + 1)}), ["field id"]),
    "max_tokens as string": (frame(**GOOD, max_tokens="8"), ["field max_tokens"]),
    "max_tokens as float": (frame(**GOOD, max_tokens=8.0), ["field max_tokens"]),
    "max_tokens as bool": (frame(**GOOD, max_tokens=True), ["field max_tokens"]),
    "max_tokens zero": (frame(**GOOD, max_tokens=0), ["field max_tokens"]),
    "max_tokens huge": (frame(**GOOD, max_tokens=p.MAX_TOKENS_LIMIT + 1), ["field max_tokens"]),
    "temperature as string": (frame(**GOOD, temperature="hot"), ["field temperature"]),
    "temperature nan": (frame(**GOOD, temperature=math.nan), ["field temperature"]),
    "temperature negative": (frame(**GOOD, temperature=-0.1), ["field temperature"]),
    "top_p zero": (frame(**GOOD, top_p=0.0), ["field top_p"]),
    "top_k zero": (frame(**GOOD, top_k=0), ["field top_k"]),
    "seed negative": (frame(**GOOD, seed=-1), ["field seed"]),
    "stream as int": (frame(**GOOD, stream=1), ["field stream"]),
    "stop as string": (frame(**GOOD, stop="\n"), ["field stop"]),
    "stop item empty": (frame(**GOOD, stop=[""]), ["field stop.0"]),
    "too many stops": (frame(**GOOD, stop=["x"] * (p.MAX_STOP_STRINGS + 1)), ["field stop"]),
    "huge prompt": (frame(**{**GOOD, "prompt": "a" * (p.MAX_PROMPT_CHARS + 1)}), ["field prompt"]),
    "huge messages": (
        frame(v=1, type="generate", id="r9",
              messages=[{"role": "user", "content": "a" * (p.MAX_PROMPT_CHARS // 2 + 1)}] * 2),
        ["messages"],
    ),
    "bad role": (frame(v=1, type="generate", id="r9", messages=[{"role": "x", "content": "y"}]),
                 ["field messages.0.role"]),
    "message not a map": (frame(v=1, type="generate", id="r9", messages=["hi"]), ["field messages.0"]),
    "no input": (frame(v=1, type="generate", id="r9"), ["exactly one"]),
    "new session without id": (frame(**GOOD, new_session=True), ["needs a session_id"]),
    "two inputs": (frame(**GOOD, token_ids=[1]), ["exactly one"]),
    "negative token id": (frame(v=1, type="generate", id="r9", token_ids=[1, -2]), ["field token_ids.1"]),
    "token id as float": (frame(v=1, type="generate", id="r9", token_ids=[1.5]), ["field token_ids.0"]),
    "too many token ids": (
        frame(v=1, type="generate", id="r9", token_ids=[1] * (p.MAX_PROMPT_TOKENS + 1)),
        ["field token_ids"],
    ),
    "ext type value": (frame(**{**GOOD, "prompt": msgpack.ExtType(1, b"ab")}), ["ext type 1 is not part"]),
    "ext type under an unknown key": (frame(**GOOD, z=msgpack.ExtType(1, b"a")), ["ext type 1 is not part"]),
    "timestamp value": (frame(**{**GOOD, "prompt": msgpack.Timestamp(1, 0)}), ["field prompt"]),
    "ext type frame": (msgpack.packb(msgpack.ExtType(3, b"\x00")), ["ext type 3 is not part"]),
    "empty token ids": (frame(v=1, type="generate", id="r9", token_ids=[]), ["field token_ids"]),
    "ttl too small": (frame(v=1, type="lease_open", ttl_s=0.5), ["field ttl_s"]),
    "ttl infinite": (frame(v=1, type="lease_open", ttl_s=math.inf), ["field ttl_s"]),
    "bad finish reason": (frame(v=1, type="done", id="r", finish_reason="eos",
                                usage={"prompt_tokens": 1, "completion_tokens": 1}), ["finish_reason"]),
    "usage as list": (frame(v=1, type="done", id="r", finish_reason="stop", usage=[1, 2]), ["field usage"]),
    "bad error code": (frame(v=1, type="error", code="oops", message="x"), ["field code"]),
    "geometry missing": (frame(v=1, type="hello", engine_id="e", epoch=0), ["field geometry"]),
    "oversized frame": (b"\x00" * (p.MAX_FRAME_BYTES + 1), ["exceeds"]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_frame_is_protocol_error(name):
    data, words = MALFORMED[name]
    assert_rejected(data, *words)


def test_protocol_error_carries_readable_request_id():
    assert assert_rejected(frame(**GOOD, max_tokens="x")).request_id == "r9"
    assert assert_rejected(frame(**{**GOOD, "v": 9})).request_id == "r9"
    assert assert_rejected(frame(**{**GOOD, "id": 5})).request_id is None
    assert assert_rejected(frame(**GOOD, z=msgpack.ExtType(1, b"a"))).request_id == "r9"
    reply = p.error_reply(assert_rejected(frame(**GOOD, stream="yes")), "r9")
    assert reply.code == ErrorCode.BAD_REQUEST and "stream" in reply.message


def test_oversized_frame_is_rejected_before_unpacking():
    big = frame(**{**GOOD, "prompt": "é" * (p.MAX_FRAME_BYTES // 2)})  # 2 bytes per char
    assert len(big) > p.MAX_FRAME_BYTES
    assert_rejected(big, "exceeds")


def test_frame_is_never_pickled():
    import pickle

    assert_rejected(pickle.dumps({"v": 1, "type": "health"}))


@given(st.binary(max_size=512))
@settings(max_examples=500, deadline=None)
def test_random_bytes_never_raise_anything_else(data):
    try:
        msg = p.decode(data)
    except p.ProtocolError as err:
        assert err.code == ErrorCode.BAD_REQUEST
    else:
        assert type(msg).TYPE in p.MODELS


scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20)
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)
field_names = st.sampled_from(
    ["id", "prompt", "messages", "token_ids", "max_tokens", "temperature", "top_p", "top_k",
     "seed", "stop", "stream", "ttl_s", "lease_id", "session_id", "usage", "finish_reason",
     "code", "message", "engine_id", "epoch", "geometry", "tokens", "resv_id", "ids", "chunks"]
)  # fmt: skip


@given(
    st.sampled_from([t.value for t in p.MessageType]),
    st.dictionaries(field_names, values, max_size=8),
)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_maps_with_valid_header_are_message_or_protocol_error(kind, fields):
    data = msgpack.packb({**fields, "v": 1, "type": kind}, use_bin_type=True)
    try:
        msg = p.decode(data)
    except p.ProtocolError as err:
        assert err.message.startswith(f"invalid {kind}: field ")
    else:
        assert type(msg).TYPE == kind
        assert p.decode(p.encode(msg)) == msg


@given(values)
@settings(max_examples=300, deadline=None)
def test_random_msgpack_values_never_raise_anything_else(value):
    try:
        p.decode(msgpack.packb(value, use_bin_type=True))
    except p.ProtocolError:
        pass


# ---- error replies ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "exc, code, retry",
    [
        (BadRequest("bad"), ErrorCode.BAD_REQUEST, None),
        (ContextOverflow(9000, 8192), ErrorCode.CONTEXT_OVERFLOW, None),
        (Overloaded("busy", retry_after_ms=120), ErrorCode.OVERLOADED, 120),
        (QueueTimeout("waited"), ErrorCode.QUEUE_TIMEOUT, None),
        (LeaseExpired("gone"), ErrorCode.LEASE_EXPIRED, None),
        (EngineFailed("dead"), ErrorCode.ENGINE_FAILED, None),
        (p.ProtocolError("frame"), ErrorCode.BAD_REQUEST, None),
        (ValueError("secret detail"), ErrorCode.INTERNAL, None),
        (KeyError("k"), ErrorCode.INTERNAL, None),
    ],
)
def test_error_reply_maps_codes(exc, code, retry):
    reply = p.error_reply(exc, "r1")
    assert (reply.id, reply.code, reply.retry_after_ms) == ("r1", code, retry)
    if not isinstance(exc, ButtermilkError):
        assert "secret" not in reply.message
    assert p.decode(p.encode(reply)) == reply


def test_error_reply_tolerates_bad_inputs():
    reply = p.error_reply(ButtermilkError("x" * 10_000), "y" * 1000)
    assert reply.id is None and len(reply.message) == p.MAX_ERROR_CHARS
    assert p.error_reply(BadRequest("b"), None).id is None


# ---- issue 11 item 10: ids of undecodable frames, and sizes that agree ----------------------

INVALID_UTF8 = b"\xff\xfe"


def packed_with_invalid_prompt() -> bytes:
    """{"v": 1, "type": "generate", "id": "r7", "prompt": <2 bytes of invalid UTF-8>}."""
    data = frame(v=1, type="generate", id="r7", prompt="zz")
    return data.replace(b"\xa2zz", b"\xa2" + INVALID_UTF8)


@pytest.mark.parametrize(
    "data, expected",
    [
        (packed_with_invalid_prompt(), "r7"),  # invalid UTF-8 in a string
        (frame(v=1, type="generate", id="r8", prompt="x", extra={1: "int key"}), "r8"),  # an int map key
        (msgpack.packb({"v": 1, "id": "r9", "type": "generate", "prompt": "hello"})[:-3], "r9"),  # truncated
        (msgpack.packb({1: 2, "id": "r10"}), "r10"),
        (msgpack.packb({"v": 1, "id": b"bin", "type": "generate"}), None),  # a bin is not a string id
        (msgpack.packb({"v": 1, "type": "generate", "prompt": "x"})[:-1], None),  # no id at all
        (frame(v=1, type="generate", prompt="x") + b"\xa2id", None),
        (b"\x92\xa2id\xa2r1", None),  # an array, not a map
    ],
)
def test_an_undecodable_frame_keeps_its_readable_id(data, expected):
    assert assert_rejected(data).request_id == expected


def test_every_valid_message_fits_in_a_frame():
    """The largest generate the limits allow: four-byte characters everywhere, every field full."""
    widest = "\U0001f600"  # four bytes of UTF-8
    longest_id = widest * p.MAX_ID_CHARS
    msg = p.Generate(
        id=longest_id, prompt=widest * p.MAX_PROMPT_CHARS, max_tokens=p.MAX_TOKENS_LIMIT, temperature=0.5,
        top_p=0.5, top_k=2**63, seed=p.MAX_SEED, stop=[widest * p.MAX_STOP_CHARS] * p.MAX_STOP_STRINGS,
        session_id=longest_id, new_session=True, lease_id=longest_id, stream=False,
    )  # fmt: skip
    data = p.encode(msg)
    assert 4 * p.MAX_PROMPT_CHARS < len(data) <= p.MAX_FRAME_BYTES
    assert p.decode(data) == msg
    content = widest * (p.MAX_PROMPT_CHARS // p.MAX_MESSAGES)
    chat = p.Generate(id="c", messages=[p.ChatMessage(role="assistant", content=content)] * p.MAX_MESSAGES)
    assert len(p.encode(chat)) <= p.MAX_FRAME_BYTES
    tokens = p.Generate(id="t", token_ids=[p.MAX_TOKEN_ID] * p.MAX_PROMPT_TOKENS)
    assert len(p.encode(tokens)) <= p.MAX_FRAME_BYTES
