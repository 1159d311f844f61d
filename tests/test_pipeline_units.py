"""The serving cores without sockets: `GatewayCore` and `ControllerCore` driven message by message.

These pin the routing rules the process tests can only sample: every path ends a request with
exactly one terminal message, frees its pool place and releases its reservation.
"""

from __future__ import annotations

import pytest

from services.controller.ledger import Ledger
from services.controller.service import ControllerCore
from services.gateway.control import ToClient, ToController, ToEngine
from services.gateway.core import GatewayCore
from services.gateway.engines import EngineTable
from services.gateway.prompts import Prompter, chat_continuation
from services.gateway.sessions import GenerationSessionPool
from shared import protocol as p
from shared.errors import ErrorCode

CLIENT, ENGINE = b"client-1", b"e0:0"
GEOMETRY = p.Geometry(slots=4, capacity_tokens=1000, bytes_per_token=10, kv_cache="raw", max_context=256)


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.utils import load_config, load_tokenizer

    from services.engine.model.paths import resolve_model

    path = resolve_model("default", dtype="float32")
    return load_tokenizer(path, eos_token_ids=load_config(path).get("eos_token_id"))


@pytest.fixture
def core(tokenizer):
    prompter = Prompter(tokenizer, vocab_size=49152, max_context=256, max_tokens_cap=64)
    gateway = GatewayCore(prompter, GenerationSessionPool(1, 2, 5.0), EngineTable(3.0), control_timeout_s=2.0)
    gateway.on_engine_cmd(ENGINE, p.Hello(engine_id="e0", epoch=0, geometry=GEOMETRY), now=0.0)
    return gateway


def msgs(sends, kind):
    return [s.msg for s in sends if isinstance(s, kind)]


def start(core, request_id="r1", now=0.0, **fields):
    """Submit a generate and, if it was admitted, grant its reservation; returns the sends."""
    sends = core.on_client(CLIENT, p.Generate(id=request_id, **{"prompt": "Hello", **fields}), now)
    reserves = [m for m in msgs(sends, ToController) if isinstance(m, p.Reserve)]
    for reserve in reserves:
        sends += core.on_controller(p.Reserved(request_id=reserve.request_id, resv_id=f"v-{request_id}",
                                               engine_id="e0", epoch=0), now)  # fmt: skip
    return sends


def engine_request_id(sends) -> str:
    return next(m.id for m in msgs(sends, ToEngine) if isinstance(m, p.EngineGenerate))


def finished(rid, reason="length", completion=2, **extra):
    usage = p.Usage(prompt_tokens=3, completion_tokens=completion)
    return p.EngineFinished(engine_id="e0", epoch=0, id=rid, reason=reason, usage=usage, **extra)


def test_generate_streams_text_then_done_and_release(core, tokenizer):
    sends = start(core, max_tokens=500)
    reserve = next(m for m in msgs(sends, ToController) if isinstance(m, p.Reserve))
    assert reserve.tokens == 1 + 64  # prompt + max_tokens capped by max_tokens_cap
    rid = engine_request_id(sends)
    ids = list(tokenizer.encode(" world, how are you"))
    out = core.on_engine_out(p.EngineTokens(engine_id="e0", epoch=0, chunks=[p.TokenChunk(id=rid, token_ids=ids, index=0)]), 1.0)
    out += core.on_engine_out(finished(rid, completion=len(ids)), 1.0)
    to_client = msgs(out, ToClient)
    assert "".join(m.text for m in to_client if isinstance(m, p.Token)) == " world, how are you"
    assert isinstance(to_client[-1], p.Done) and to_client[-1].id == "r1"
    assert msgs(out, ToController) == [p.Release(resv_id="v-r1")]
    assert core.num_streams == 0 and core.pool.stats().active == 0


def test_queue_is_fifo_and_cancel_of_a_queued_request_is_immediate(core):
    first = engine_request_id(start(core, "a"))
    assert start(core, "b", now=0.1) == [] and start(core, "c", now=0.2) == []
    out = core.on_client(CLIENT, p.Cancel(id="b"), 0.3)
    assert [type(m) for m in msgs(out, ToClient)] == [p.Done] and msgs(out, ToClient)[0].finish_reason == "cancelled"
    out = core.on_engine_out(finished(first), 1.0)
    promoted = [m for m in msgs(out, ToController) if isinstance(m, p.Reserve)]
    assert len(promoted) == 1 and core._streams[promoted[0].request_id].client_id == "c"


def test_cancel_while_reserving_aborts_right_after_the_generate(core):
    sends = core.on_client(CLIENT, p.Generate(id="r1", prompt="Hi"), 0.0)
    rid = msgs(sends, ToController)[0].request_id
    assert core.on_client(CLIENT, p.Cancel(id="r1"), 0.1) == []
    out = core.on_controller(p.Reserved(request_id=rid, resv_id="v1", engine_id="e0", epoch=0), 0.2)
    assert [type(m) for m in msgs(out, ToEngine)] == [p.EngineGenerate, p.EngineAbort]
    out = core.on_engine_out(finished(rid, reason="cancelled", completion=0), 0.3)
    assert msgs(out, ToClient)[-1].finish_reason == "cancelled"


def test_stop_string_aborts_the_engine_and_reports_stop(core, tokenizer):
    rid = engine_request_id(start(core, stop=["how"]))
    ids = list(tokenizer.encode(" world, how are you"))
    out = core.on_engine_out(p.EngineTokens(engine_id="e0", epoch=0, chunks=[p.TokenChunk(id=rid, token_ids=ids, index=0)]), 1.0)
    assert any(isinstance(m, p.EngineAbort) for m in msgs(out, ToEngine))
    out += core.on_engine_out(finished(rid, reason="cancelled", completion=len(ids)), 1.1)
    texts = [m.text for m in msgs(out, ToClient) if isinstance(m, p.Token)]
    done = msgs(out, ToClient)[-1]
    assert "".join(texts) == " world, " and done.finish_reason == "stop"
    assert done.usage.completion_tokens < len(ids)


def test_non_streaming_sends_one_token_message(core, tokenizer):
    rid = engine_request_id(start(core, stream=False))
    for word in (" one", " two"):
        chunk = p.TokenChunk(id=rid, token_ids=list(tokenizer.encode(word)), index=0)
        assert msgs(core.on_engine_out(p.EngineTokens(engine_id="e0", epoch=0, chunks=[chunk]), 1.0), ToClient) == []
    out = msgs(core.on_engine_out(finished(rid), 1.0), ToClient)
    assert [type(m) for m in out] == [p.Token, p.Done] and out[0].text == " one two" and out[0].index == 0


def test_engine_loss_fails_its_streams_and_tells_the_controller(core):
    start(core)
    out = core.tick(now=10.0)  # no heartbeat for 10 s > 3 s
    errors = [m for m in msgs(out, ToClient) if isinstance(m, p.Error)]
    assert [e.code for e in errors] == [ErrorCode.ENGINE_FAILED]
    assert p.EngineDead(engine_id="e0", epoch=0) in msgs(out, ToController)
    assert core.engines.num_live == 0


def test_revoked_lease_ends_running_and_queued_requests(core):
    running = engine_request_id(start(core, "a", lease_id="L"))
    start(core, "b", lease_id="L")
    out = core.on_controller(p.Revoked(code=ErrorCode.LEASE_EXPIRED, request_ids=[running], lease_ids=["L"]), 1.0)
    errors = msgs(out, ToClient)
    assert sorted(e.id for e in errors) == ["a", "b"] and {e.code for e in errors} == {ErrorCode.LEASE_EXPIRED}
    assert core.num_streams == 0


def test_control_requests_are_forwarded_and_replies_restore_the_client_id(core):
    out = core.on_client(CLIENT, p.LeaseOpen(id="mine", ttl_s=5.0), 0.0)
    forwarded = msgs(out, ToController)[0]
    assert forwarded.id != "mine"
    reply = core.on_controller(p.Lease(id=forwarded.id, lease_id="L1", ttl_s=5.0), 0.1)
    assert msgs(reply, ToClient) == [p.Lease(id="mine", lease_id="L1", ttl_s=5.0)]
    core.on_client(CLIENT, p.Stats(id="s"), 1.0)
    late = core.tick(now=4.0)  # the controller never answered
    assert [(m.id, m.code) for m in msgs(late, ToClient)] == [("s", ErrorCode.INTERNAL)]


def test_duplicate_ids_and_bad_sessions_are_bad_requests(core):
    start(core, "r1")
    again = msgs(core.on_client(CLIENT, p.Generate(id="r1", prompt="x"), 0.1), ToClient)
    unknown = msgs(core.on_client(CLIENT, p.Generate(id="r2", prompt="x", session_id="s"), 0.1), ToClient)
    assert [m.code for m in again + unknown] == [ErrorCode.BAD_REQUEST] * 2


def test_chat_continuation_renders_like_the_whole_conversation(tokenizer):
    first = [{"role": "user", "content": "Hi there"}]
    second = [{"role": "user", "content": "And now?"}]

    def render(messages, generation=True):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)

    answer = "Hello!"
    history = render(first) + answer + tokenizer.eos_token  # the completion ended with EOS
    whole = render([*first, {"role": "assistant", "content": answer}, *second])
    assert history + chat_continuation(render, second, tokenizer.eos_token, True) == whole
    cut = render(first) + answer  # ended by length: the template's closing is added
    assert cut + chat_continuation(render, second, tokenizer.eos_token, False) == whole


def test_controller_reserves_releases_and_announces_engine_death():
    core = ControllerCore(Ledger(engine_timeout_s=3.0))
    core.handle(ENGINE, p.Hello(engine_id="e0", epoch=0, geometry=GEOMETRY), 0.0)
    gw = p.GATEWAY_ROUTING_ID
    [(to, reserved)] = core.handle(gw, p.Reserve(request_id="r1", tokens=10, session_id="s", new_session=True), 0.0)
    assert (to, reserved.engine_id) == (gw, "e0")
    [(to, close)] = core.handle(gw, p.Release(resv_id=reserved.resv_id), 1.0)  # session kept nothing
    assert (to, close) == (ENGINE, p.EngineSessionClose(session_ids=["s"]))
    core.handle(gw, p.Reserve(request_id="r2", tokens=10), 1.0)
    out = core.tick(now=5.0)  # silent for 5 s > 3 s
    assert (gw, p.EngineDead(engine_id="e0", epoch=0)) in out
    revoked = next(m for _, m in out if isinstance(m, p.Revoked))
    assert revoked.code == ErrorCode.ENGINE_FAILED and revoked.request_ids == ["r2"]
    [(to, stale)] = core.handle(ENGINE, p.Heartbeat(engine_id="e0", epoch=0), 6.0)
    assert (to, stale) == (ENGINE, p.EngineDead(engine_id="e0", epoch=0))
    [(_, refused)] = core.handle(gw, p.Reserve(request_id="r3", tokens=10), 6.0)
    assert refused.code == ErrorCode.OVERLOADED and refused.id == "r3"
