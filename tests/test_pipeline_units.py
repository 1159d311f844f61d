"""The serving cores without sockets: `GatewayCore` and `ControllerCore` driven message by message.

These pin the routing rules the process tests can only sample: every path ends a request with
exactly one terminal message, frees its pool place and releases its reservation.
"""

from __future__ import annotations

import pytest

from services.controller.ledger import Ledger
from services.controller.service import ControllerCore
from services.gateway.clients import ClientLimits
from services.gateway.control import ToClient, ToController, ToEngine, ToTokenizer
from services.gateway.core import GatewayCore
from services.gateway.engines import EngineTable
from services.gateway.local import LocalClients
from services.gateway.prompts import Prompter, chat_continuation
from services.gateway.pool import RequestPool
from shared import protocol as p
from shared.errors import BadRequest, ContextOverflow, ErrorCode
from tests.gateway_helpers import drive

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
    gateway = GatewayCore(prompter, RequestPool(1, 2, 5.0), EngineTable(3.0), control_timeout_s=2.0)
    gateway.on_engine_cmd(ENGINE, p.Hello(engine_id="e0", epoch=0, geometry=GEOMETRY), now=0.0)
    return gateway


def msgs(sends, kind):
    return [s.msg for s in sends if isinstance(s, kind)]


def client(core, msg, now=0.0, identity=CLIENT):
    return drive(core, core.on_client(identity, msg, now), now)


def start(core, request_id="r1", now=0.0, identity=CLIENT, **fields):
    """Submit a generate and, if it was admitted, grant its reservation; returns the sends."""
    if not {"prompt", "messages", "token_ids"} & set(fields):
        fields["prompt"] = "Hello"
    sends = client(core, p.Generate(id=request_id, **fields), now, identity)
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
    out = client(core, p.Cancel(id="b"), 0.3)
    assert [type(m) for m in msgs(out, ToClient)] == [p.Done] and msgs(out, ToClient)[0].finish_reason == "cancelled"
    out = core.on_engine_out(finished(first), 1.0)
    promoted = [m for m in msgs(out, ToController) if isinstance(m, p.Reserve)]
    assert len(promoted) == 1 and core._streams[promoted[0].request_id].client_id == "c"


def test_cancel_while_reserving_aborts_right_after_the_generate(core):
    sends = client(core, p.Generate(id="r1", prompt="Hi"), 0.0)
    rid = msgs(sends, ToController)[0].request_id
    assert client(core, p.Cancel(id="r1"), 0.1) == []
    out = core.on_controller(p.Reserved(request_id=rid, resv_id="v1", engine_id="e0", epoch=0), 0.2)
    assert [type(m) for m in msgs(out, ToEngine)] == [p.EngineGenerate, p.EngineAbort]
    out = core.on_engine_out(finished(rid, reason="cancelled", completion=0), 0.3)
    assert msgs(out, ToClient)[-1].finish_reason == "cancelled"


def test_cancel_while_tokenizing_is_answered_at_once_and_the_late_tokens_are_dropped(core):
    sends = core.on_client(CLIENT, p.Generate(id="r1", prompt="Hi"), 0.0)  # the tokenizer job is left pending
    (job,) = [s for s in sends if isinstance(s, ToTokenizer)]
    assert core.num_preparing == 1 and core.is_preparing(job.request_id)
    out = core.on_client(CLIENT, p.Cancel(id="r1"), 0.1)
    (done,) = msgs(out, ToClient)
    assert isinstance(done, p.Done) and done.id == "r1" and done.finish_reason == "cancelled"
    assert done.usage == p.Usage(prompt_tokens=0, completion_tokens=0)  # nothing was tokenized
    assert not core.is_preparing(job.request_id) and core.num_streams == 0  # the service skips the job...
    assert core.num_preparing == 1  # ...which holds its tokenizer place until it is back
    assert core.on_prepared(job.request_id, job.msg, None, 0.2) == [] and core.num_preparing == 0
    assert core.pool.stats().active == core.pool.stats().queued == 0


def test_tokenizing_is_bounded_by_the_pools_places_across_clients(tokenizer):
    """Many connections' prompts waiting for the one tokenizer thread could hold a request past its queue timeout
    (a victim waited 36.9 s behind 96 doomed 1M-character prompts): at most `max_active + max_queue` are tokenized
    at once, the next is `overloaded` at arrival, and a place frees as soon as one is tokenized."""
    core = make_core(tokenizer, active=1, queue=2)
    jobs = [s for i in range(3) for s in core.on_client(b"c%d" % i, p.Generate(id="g", prompt="Hi"), 0.0)]
    assert len(jobs) == 1 and isinstance(jobs[0], ToTokenizer) and core.num_preparing == 3  # one job on the thread
    (over,) = msgs(core.on_client(b"c9", p.Generate(id="late", prompt="Hi"), 0.1), ToClient)
    assert over.id == "late" and over.code == ErrorCode.OVERLOADED and "tokenizer" in over.message
    assert over.retry_after_ms > 0
    out = core.on_prepared(jobs[0].request_id, jobs[0].msg, core.prompter.prepare(jobs[0].msg, None), 0.2)
    assert core.num_preparing == 2 and len([s for s in out if isinstance(s, ToTokenizer)]) == 1  # c1's, next
    assert core.on_client(b"c9", p.Generate(id="now", prompt="Hi"), 0.3) == []  # waits behind c1's and c2's
    forwarded = msgs(client(core, p.Stats(id="q"), 0.4, b"c8"), ToController)[0]
    (reply,) = msgs(core.on_controller(p.StatsReply(id=forwarded.id), 0.5), ToClient)
    assert reply.pool.preparing == 3 and reply.pool.active == 1


def tokenize_in_turn(core, sends, now=1.0):
    """Run the tokenizer thread's jobs one at a time, as the service does; the (connection, client id) order."""
    order = []
    jobs = [s for s in sends if isinstance(s, ToTokenizer)]
    while jobs:
        (job,) = jobs
        order.append((core._streams[job.request_id].client, job.msg.id))
        out = core.on_prepared(job.request_id, job.msg, core.prompter.prepare(job.msg, None), now)
        jobs = [s for s in out if isinstance(s, ToTokenizer)]
    return order


def test_the_tokenizer_thread_serves_connections_round_robin(tokenizer):
    """A connection with one prompt waits behind one job of each other connection, not behind all of them: A sends
    five while its first is on the thread, then B two and C one; FIFO would give a1..a5 b1 b2 c1."""
    core = make_core(tokenizer, active=1, queue=20)
    sends = []
    for identity, ids in ((b"A", "a1 a2 a3 a4 a5"), (b"B", "b1 b2"), (b"C", "c1")):
        for request_id in ids.split():
            sends += core.on_client(identity, p.Generate(id=request_id, prompt="Hi"), 0.0)
    assert core.num_preparing == 8
    order = tokenize_in_turn(core, sends)
    assert order == [(b"A", "a1"), (b"A", "a2"), (b"B", "b1"), (b"C", "c1"), (b"A", "a3"), (b"B", "b2"),
                     (b"A", "a4"), (b"A", "a5")]  # fmt: skip
    assert core.num_preparing == 0 and core.num_streams == 8


def test_a_full_tokenizer_makes_the_connection_holding_the_most_give_way(tokenizer):
    """A flood from one connection cannot lock the others out of the tokenizer: at the bound (4 places here) a
    newcomer takes the place of the heaviest connection's newest waiting prompt, which ends `overloaded`, until
    the two hold as many; the job on the thread is never the one to go."""
    core = make_core(tokenizer, active=1, queue=3)
    sends = [s for i in range(1, 5) for s in core.on_client(b"A", p.Generate(id=f"a{i}", prompt="Hi"), 0.0)]
    assert core.num_preparing == 4
    out = core.on_client(b"B", p.Generate(id="b1", prompt="Hi"), 0.1)
    (gone,) = msgs(out, ToClient)
    assert (gone.id, gone.code) == ("a4", ErrorCode.OVERLOADED) and "made way" in gone.message
    assert gone.retry_after_ms > 0 and core.num_preparing == 4
    assert errors_by_id(core.on_client(b"B", p.Generate(id="b2", prompt="Hi"), 0.2)) == {"a3": ErrorCode.OVERLOADED}
    (refused,) = msgs(core.on_client(b"B", p.Generate(id="b3", prompt="Hi"), 0.3), ToClient)  # A 2, B 2: even
    assert (refused.id, refused.code) == ("b3", ErrorCode.OVERLOADED) and "waiting for the tokenizer" in refused.message
    assert tokenize_in_turn(core, sends) == [(b"A", "a1"), (b"A", "a2"), (b"B", "b1"), (b"B", "b2")]
    assert core.num_preparing == 0 and core.num_streams == 4 and core.pool.stats().active == 1


def test_local_clients_of_one_caller_give_way_together_and_those_of_none_each_alone(tokenizer):
    """Each HTTP request is a connection of its own (a local identity); those opened for the same caller (an OpenAI
    `user`, or a client address) are one key at the tokenizer. Four without a caller at a 4-place bound each hold
    one, so a fifth is refused; four of caller A hold four, so caller B's first takes the place of A's newest, as
    one connection's flood would."""
    local = LocalClients()
    for caller, refused in ((None, "n"), ("user/A", "A4")):
        core = make_core(tokenizer, active=1, queue=3)
        senders, tag = [local.open(caller)[0] for _ in range(4)], "A" if caller else "n"
        sends = [s for i, ident in enumerate(senders, 1)
                 for s in core.on_client(ident, p.Generate(id=f"{tag}{i}", prompt="Hi"), 0.0)]  # fmt: skip
        newcomer = local.open("peer/10.0.0.2")[0]
        assert errors_by_id(core.on_client(newcomer, p.Generate(id="n", prompt="Hi"), 0.1)) == {
            refused: ErrorCode.OVERLOADED}
        assert core.num_preparing == 4 and len(tokenize_in_turn(core, sends)) == 4


def test_a_waiting_job_whose_request_ended_frees_its_place_at_once_and_is_never_tokenized(core):
    sends = core.on_client(CLIENT, p.Generate(id="r1", prompt="Hi"), 0.0)
    assert core.on_client(CLIENT, p.Generate(id="r2", prompt="Hi"), 0.0) == []  # waits behind r1
    (done,) = msgs(core.on_client(CLIENT, p.Cancel(id="r2"), 0.1), ToClient)
    assert done.finish_reason == "cancelled" and core.num_preparing == 1
    assert tokenize_in_turn(core, sends) == [(CLIENT, "r1")] and core.num_preparing == 0


def test_cancelled_prompts_do_not_pile_up_at_the_tokenizer(tokenizer):
    """Generate + cancel in a loop while the tokenizer is busy must not pile up jobs (each holds its prompt, up to
    5 MiB): a cancelled request's waiting job is dropped at once; the one on the thread counts until it is back."""
    core = make_core(tokenizer, active=1, queue=2, max_queued=1)
    refused = []
    for i in range(10):
        sends = core.on_client(CLIENT, p.Generate(id=f"g{i}", prompt="Hi"), 0.0)
        refused += [m.code for m in msgs(sends, ToClient)]
        core.on_client(CLIENT, p.Cancel(id=f"g{i}"), 0.0)
    assert core.num_preparing == 1 and refused == [] and core.num_streams == 0


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
    out = client(core, p.LeaseOpen(id="mine", ttl_s=5.0), 0.0)
    forwarded = msgs(out, ToController)[0]
    assert forwarded.id != "mine"
    reply = core.on_controller(p.LeaseGranted(id=forwarded.id, lease_id="L1", ttl_s=5.0), 0.1)
    assert msgs(reply, ToClient) == [p.LeaseGranted(id="mine", lease_id="L1", ttl_s=5.0)]
    asked = msgs(client(core, p.Stats(id="t"), 0.5), ToController)[0]
    [stats] = msgs(core.on_controller(p.StatsReply(id=asked.id, num_leases=1), 0.6), ToClient)
    # The gateway adds its pool and limits: the core fixture's Prompter (max_context 256, cap 64), RequestPool(1, 2).
    assert (stats.id, stats.num_leases, stats.max_context, stats.max_tokens_cap) == ("t", 1, 256, 64)
    assert (stats.pool.max_active, stats.pool.max_queue) == (1, 2)
    client(core, p.Stats(id="s"), 1.0)
    late = core.tick(now=4.0)  # the controller never answered
    assert [(m.id, m.code) for m in msgs(late, ToClient)] == [("s", ErrorCode.INTERNAL)]


def test_duplicate_ids_and_bad_sessions_are_bad_requests(core):
    start(core, "r1")
    again = msgs(client(core, p.Generate(id="r1", prompt="x"), 0.1), ToClient)
    unknown = msgs(client(core, p.Generate(id="r2", prompt="x", session_id="s"), 0.1), ToClient)
    assert [m.code for m in again + unknown] == [ErrorCode.BAD_REQUEST] * 2
    # The duplicate's error has no id: "r1" in flight keeps its one terminal message.
    assert again[0].id is None and "'r1' is already in flight" in again[0].message and unknown[0].id == "r2"


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


# ---- issue 11: every accepted request ends, every resource has an owner -----------------

OTHER = b"client-2"


def make_core(tokenizer, *, active=2, queue=2, **limits):
    prompter = Prompter(tokenizer, vocab_size=49152, max_context=256, max_tokens_cap=64)
    pool = RequestPool(active, queue, 5.0, client_max_active=limits.get("max_active", active),
                                 client_max_queued=limits.get("max_queued", queue))  # fmt: skip
    gateway = GatewayCore(prompter, pool, EngineTable(3.0), control_timeout_s=2.0, limits=ClientLimits(**limits))
    gateway.on_engine_cmd(ENGINE, p.Hello(engine_id="e0", epoch=0, geometry=GEOMETRY), now=0.0)
    return gateway


def errors_by_id(sends) -> dict[str, ErrorCode]:
    return {m.id: m.code for m in msgs(sends, ToClient) if isinstance(m, p.Error)}


def first_turn(core, session_id="s", request_id="t1", identity=CLIENT, **fields):
    """Start a session and finish its first turn (5 tokens of history); returns the session's internal id."""
    sends = start(core, request_id, identity=identity, session_id=session_id, new_session=True, **fields)
    generate = next(m for m in msgs(sends, ToEngine) if isinstance(m, p.EngineGenerate))
    core.on_engine_out(finished(generate.id, tokens_held=5), 1.0)
    return generate.session_id


def test_a_queued_session_turn_fails_like_its_engine_item3(core):
    first_turn(core)
    start(core, "busy", now=2.0)  # takes the only place
    assert not msgs(start(core, "t2", now=2.0, token_ids=[5], session_id="s"), ToClient)  # queued
    out = core.on_controller(p.EngineDead(engine_id="e0", epoch=0), 3.0)
    assert errors_by_id(out) == {"busy": ErrorCode.ENGINE_FAILED, "t2": ErrorCode.ENGINE_FAILED}


def test_an_evicted_sessions_waiting_turn_is_cancelled(core):
    internal = first_turn(core)
    start(core, "busy", now=2.0)
    start(core, "t2", now=2.0, token_ids=[5], session_id="s")
    out = core.on_controller(p.Revoked(code=ErrorCode.CANCELLED, session_ids=[internal]), 3.0)
    assert errors_by_id(out) == {"t2": ErrorCode.CANCELLED}
    again = msgs(client(core, p.Generate(id="t3", token_ids=[5], session_id="s"), 4.0), ToClient)
    assert again[0].code == ErrorCode.CANCELLED and "evicted" in again[0].message  # not the client's fault


def test_a_turn_on_a_session_its_owner_closed_is_a_bad_request_and_an_evicted_ones_is_cancelled(core):
    first_turn(core)
    first_turn(core, session_id="kept", request_id="k1")
    msgs(client(core, p.SessionClose(id="c", session_id="s"), 2.0), ToClient)
    evicted = core.sessions.get(f"conn:{CLIENT.hex()}", "kept").session_id
    core.on_controller(p.Revoked(code=ErrorCode.CANCELLED, session_ids=[evicted]), 2.5)
    closed = msgs(client(core, p.Generate(id="t2", token_ids=[5], session_id="s"), 3.0), ToClient)
    gone = msgs(client(core, p.Generate(id="t3", token_ids=[5], session_id="kept"), 3.0), ToClient)
    assert (closed[0].code, gone[0].code) == (ErrorCode.BAD_REQUEST, ErrorCode.CANCELLED)


def test_a_turn_on_an_expired_session_gets_lease_expired(core):
    internal = first_turn(core)
    core.on_controller(p.Revoked(code=ErrorCode.LEASE_EXPIRED, session_ids=[internal]), 2.0)
    again = msgs(client(core, p.Generate(id="t2", token_ids=[5], session_id="s"), 3.0), ToClient)
    assert again[0].code == ErrorCode.LEASE_EXPIRED and "expired" in again[0].message
    other = msgs(client(core, p.Generate(id="x", token_ids=[5], session_id="s"), 3.0, OTHER), ToClient)
    assert other[0].code == ErrorCode.BAD_REQUEST  # another client learns nothing of it


def test_the_history_is_what_the_client_was_told_after_a_stop_string_item5(core, tokenizer):
    prompt_ids = list(tokenizer.encode("1, 2, 3, 4, 5,"))
    sends = start(core, "t1", prompt="1, 2, 3, 4, 5,", stop=[" 9, 10"], session_id="s", new_session=True)
    rid = engine_request_id(sends)
    ran = list(tokenizer.encode(" 6, 7, 8, 9, 10, 11, 12", add_special_tokens=False))  # past the stop
    chunk = p.TokenChunk(id=rid, token_ids=ran, index=0)
    core.on_engine_out(p.EngineTokens(engine_id="e0", epoch=0, chunks=[chunk]), 1.0)
    usage = p.Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(ran))
    fin = p.EngineFinished(engine_id="e0", epoch=0, id=rid, reason="cancelled", usage=usage,
                           tokens_held=len(prompt_ids) + len(ran) - 1)  # fmt: skip
    done = msgs(core.on_engine_out(fin, 1.1), ToClient)[-1]
    assert done.finish_reason == "stop" and done.usage.completion_tokens < len(ran)
    turn2 = next(m for m in msgs(start(core, "t2", now=2.0, token_ids=[198], max_tokens=2, session_id="s"), ToEngine))
    assert turn2.session_tokens == done.usage.prompt_tokens + done.usage.completion_tokens


def test_sessions_belong_to_their_owner_and_others_learn_nothing_item7(core):
    first_turn(core)
    theirs = msgs(client(core, p.Generate(id="x", prompt="hi", session_id="s"), 2.0, OTHER), ToClient)
    never = msgs(client(core, p.Generate(id="y", prompt="hi", session_id="never"), 2.0, OTHER), ToClient)
    assert theirs[0].code == never[0].code == ErrorCode.BAD_REQUEST
    assert theirs[0].message.replace("'s'", "'never'") == never[0].message  # one error, whatever exists
    closed = client(core, p.SessionClose(id="c", session_id="s"), 2.0, OTHER)
    assert msgs(closed, ToClient) == [p.SessionClosed(id="c", session_id="s")] and not msgs(closed, ToController)
    owner_turn = start(core, "t2", now=3.0, token_ids=[5], session_id="s")  # still the owner's, and live
    assert [type(m) for m in msgs(owner_turn, ToEngine)] == [p.EngineGenerate]


def test_same_session_id_for_two_owners_and_a_lease_owned_session(tokenizer):
    core = make_core(tokenizer)
    mine = first_turn(core)
    theirs = first_turn(core, request_id="o1", identity=OTHER)  # its own "s"
    leased = first_turn(core, session_id="ls", request_id="l1", lease_id="L")
    assert len({mine, theirs, leased}) == 3
    no_lease = msgs(client(core, p.Generate(id="n", token_ids=[5], session_id="ls"), 2.0), ToClient)
    assert no_lease[0].code == ErrorCode.BAD_REQUEST
    other_conn = start(core, "l2", now=2.0, identity=OTHER, token_ids=[5], session_id="ls", lease_id="L")
    assert next(m for m in msgs(other_conn, ToEngine)).session_id == leased  # the lease owns it


def test_per_client_caps_are_overloaded_with_a_reason_item8(tokenizer):
    core = make_core(tokenizer, active=4, queue=8, max_active=1, max_queued=1, max_sessions=1, max_leases=1,
                     max_pending_control=2)  # fmt: skip
    start(core, "a")
    start(core, "b")  # queued: this client runs one at a time
    over = msgs(client(core, p.Generate(id="c", prompt="hi"), 0.1), ToClient)[0]
    assert over.code == ErrorCode.OVERLOADED and "client_max_active 1 + client_max_queued 1" in over.message
    assert engine_request_id(start(core, "o", identity=OTHER))  # another client still runs at once
    first_turn(core, request_id="s1", identity=b"c3")
    over = msgs(client(core, p.Generate(id="s2", prompt="hi", session_id="z", new_session=True), 2.0, b"c3"), ToClient)[0]
    assert over.code == ErrorCode.OVERLOADED and "client_max_sessions" in over.message
    forwarded = msgs(client(core, p.LeaseOpen(id="l1"), 3.0, b"c4"), ToController)[0]
    over = msgs(client(core, p.LeaseOpen(id="l2"), 3.0, b"c4"), ToClient)[0]  # the first is in flight
    assert over.code == ErrorCode.OVERLOADED and "client_max_leases" in over.message
    core.on_controller(p.LeaseGranted(id=forwarded.id, lease_id="L1", ttl_s=30.0), 3.1)
    closing = msgs(client(core, p.LeaseClose(id="x", lease_id="L1"), 3.2, b"c4"), ToController)[0]
    core.on_controller(p.LeaseClosed(id=closing.id, lease_id="L1"), 3.3)
    assert msgs(client(core, p.LeaseOpen(id="l3"), 3.4, b"c4"), ToController)  # room again
    client(core, p.Stats(id="q1"), 4.0, b"c5")
    client(core, p.Stats(id="q2"), 4.0, b"c5")
    over = msgs(client(core, p.Stats(id="q3"), 4.0, b"c5"), ToClient)[0]
    assert over.code == ErrorCode.OVERLOADED and "client_max_pending_control" in over.message


def test_a_lease_opened_after_its_client_was_told_internal_is_closed(core):
    forwarded = msgs(client(core, p.LeaseOpen(id="l1"), 0.0), ToController)[0]
    late = core.tick(5.0)  # control timeout 2 s
    assert errors_by_id(late) == {"l1": ErrorCode.INTERNAL}
    out = core.on_controller(p.LeaseGranted(id=forwarded.id, lease_id="L9", ttl_s=30.0), 6.0)
    assert msgs(out, ToController) == [p.LeaseClose(lease_id="L9")] and not msgs(out, ToClient)


def test_a_gone_connection_has_its_work_cancelled_and_sessions_closed_item4(tokenizer):
    core = make_core(tokenizer, active=2, queue=4)
    internal = first_turn(core)
    runs = [engine_request_id(start(core, rid, now=2.0)) for rid in ("run1", "run2")]
    start(core, "waiting", now=2.0)
    out = core.on_client_gone(CLIENT, 3.0)
    assert not msgs(out, ToClient)  # nobody to tell
    assert sorted(m.ids[0] for m in msgs(out, ToEngine)) == sorted(runs)
    assert p.SessionClose(session_id=internal) in msgs(out, ToController)
    assert core.pool.stats().queued == 0
    for client_id, rid in zip(("run1", "run2"), runs):
        out = core.on_engine_out(finished(rid, reason="cancelled"), 4.0)
        assert not msgs(out, ToClient) and msgs(out, ToController) == [p.Release(resv_id=f"v-{client_id}")]
    assert core.num_streams == 0 and len(core.clients) == 0 and len(core.sessions) == 0


def test_quiet_connections_get_keepalives(tokenizer):
    core = make_core(tokenizer, active=1, queue=2)
    first_turn(core, request_id="t", identity=b"holder")  # holds a session between turns
    start(core, "run", now=1.0)
    start(core, "waits", now=1.0, identity=OTHER)  # queued
    assert not [s for s in core.tick(1.2) if isinstance(s, ToClient) and s.identity != b"holder"]
    keep = [s.identity for s in core.tick(1.6) if isinstance(s, ToClient) and isinstance(s.msg, p.Keepalive)]
    assert sorted(keep) == sorted([CLIENT, OTHER])
    probes = [s.identity for s in core.tick(3.5, check_engines=False) if isinstance(s, ToClient)
              and s.identity == b"holder"]  # fmt: skip
    assert probes == [b"holder"]


def test_shutdown_drains_then_ends_everything_unavailable_item2(core, tokenizer):
    rid = engine_request_id(start(core, "run"))
    start(core, "waits")
    out = core.begin_drain(1.0)
    assert errors_by_id(out) == {"waits": ErrorCode.UNAVAILABLE}
    assert errors_by_id(client(core, p.Generate(id="new", prompt="hi"), 1.1)) == {"new": ErrorCode.UNAVAILABLE}
    chunk = p.TokenChunk(id=rid, token_ids=list(tokenizer.encode(" yes")), index=0)
    assert msgs(core.on_engine_out(p.EngineTokens(engine_id="e0", epoch=0, chunks=[chunk]), 1.2), ToClient)
    out = core.end_all(2.0)
    assert errors_by_id(out) == {"run": ErrorCode.UNAVAILABLE}
    assert msgs(out, ToEngine) == [p.EngineAbort(ids=[rid])] and msgs(out, ToController) == [p.Release(resv_id="v-run")]
    assert core.num_streams == 0


def test_a_reservation_the_controller_never_answers_ends_unavailable(core):
    reserve = msgs(client(core, p.Generate(id="r", prompt="hi"), 0.0), ToController)[-1]
    assert errors_by_id(core.tick(1.9)) == {}
    assert errors_by_id(core.tick(2.0)) == {"r": ErrorCode.UNAVAILABLE}
    late = core.on_controller(p.Reserved(request_id=reserve.request_id, resv_id="v", engine_id="e0", epoch=0), 3.0)
    assert msgs(late, ToController) == [p.Release(resv_id="v")]


def test_engines_are_not_judged_while_the_loop_was_stalled_item9(core):
    assert core.tick(10.0, check_engines=False) and core.engines.num_live == 1
    assert core.tick(10.1) and core.engines.num_live == 0


def test_top_k_at_or_above_the_vocabulary_disables_it_item11(core):
    big = next(m for m in msgs(start(core, "a", top_k=49152), ToEngine))
    core.on_engine_out(finished(big.id), 1.0)
    small = next(m for m in msgs(start(core, "b", now=1.0, top_k=49151), ToEngine))
    assert (big.sampling.top_k, small.sampling.top_k) == (None, 49151)


def test_a_restarted_gateway_instance_loses_the_old_ones_reservations_item6():
    core = ControllerCore(Ledger())
    core.handle(ENGINE, p.Hello(engine_id="e0", epoch=0, geometry=GEOMETRY), 0.0)
    gw = p.GATEWAY_ROUTING_ID
    core.handle(gw, p.GatewayHeartbeat(gateway_id="old"), 0.0)
    for i in range(4):
        core.handle(gw, p.Reserve(request_id=f"r{i}", tokens=10), 0.0)
    core.handle(gw, p.LeaseOpen(id="c", ttl_s=30.0), 0.0)
    assert core.handle(gw, p.GatewayHeartbeat(gateway_id="old"), 0.5) == []  # same instance: nothing
    out = core.handle(gw, p.GatewayHeartbeat(gateway_id="new"), 1.0)  # kill -9, restart
    assert out == [(ENGINE, p.EngineAbort(ids=["r0", "r1", "r2", "r3"]))]
    stats = core.ledger.stats()
    assert (stats.num_reservations, stats.num_leases, stats.engines[0].reserved_tokens) == (0, 0, 0)


def test_the_controller_evicts_an_idle_session_for_a_request_that_needs_its_slot_item1():
    core = ControllerCore(Ledger())
    geometry = GEOMETRY.model_copy(update={"slots": 2})
    core.handle(ENGINE, p.Hello(engine_id="e0", epoch=0, geometry=geometry), 0.0)
    gw = p.GATEWAY_ROUTING_ID
    for i in range(2):
        [(_, resv)] = core.handle(gw, p.Reserve(request_id=f"s{i}", tokens=3, session_id=f"S{i}", new_session=True), i)
        core.handle(gw, p.Release(resv_id=resv.resv_id, keep_session_tokens=2), i)
    out = core.handle(gw, p.Reserve(request_id="r", tokens=8), 5.0)
    assert (ENGINE, p.EngineSessionClose(session_ids=["S0"])) in out
    revoked = next(m for _, m in out if isinstance(m, p.Revoked))
    assert (revoked.code, revoked.session_ids) == (ErrorCode.CANCELLED, ["S0"])
    assert isinstance(out[-1][1], p.Reserved)


def test_controller_stats_show_each_engines_device_through_heartbeats_and_restarts():
    core = ControllerCore(Ledger(engine_timeout_s=3.0))
    gw = p.GATEWAY_ROUTING_ID
    hello = p.Hello(engine_id="e0", epoch=0, geometry=GEOMETRY, pid=11, device="gpu:0 (NVIDIA H200)",
                    cuda_visible_devices="1")  # fmt: skip
    core.handle(ENGINE, hello, 0.0)
    core.handle(b"e1:0", p.Hello(engine_id="e1", epoch=0, geometry=GEOMETRY, device="cpu"), 0.0)
    core.handle(ENGINE, p.Heartbeat(engine_id="e0", epoch=0, used_slots=2), 0.5)  # carries no device
    [(_, stats)] = core.handle(gw, p.Stats(id="s1"), 1.0)
    seen = {e.engine_id: (e.device, e.cuda_visible_devices, e.pid, e.used_slots) for e in stats.engines}
    assert seen == {"e0": ("gpu:0 (NVIDIA H200)", "1", 11, 2), "e1": ("cpu", None, None, 0)}
    core.handle(b"e0:1", hello.model_copy(update={"epoch": 1, "pid": 12}), 2.0)  # restarted, same GPU
    [(_, stats)] = core.handle(gw, p.Stats(id="s2"), 2.0)
    e0 = next(e for e in stats.engines if e.engine_id == "e0")
    assert (e0.epoch, e0.pid, e0.device, e0.cuda_visible_devices) == (1, 12, "gpu:0 (NVIDIA H200)", "1")
    assert p.decode(p.encode(stats)) == stats  # the fields survive the wire


def test_controller_warns_of_an_engine_death_only_when_it_released_work():
    from structlog.testing import capture_logs

    core = ControllerCore(Ledger(engine_timeout_s=3.0))
    core.handle(ENGINE, p.Hello(engine_id="e0", epoch=0, geometry=GEOMETRY), 0.0)
    with capture_logs() as logs:
        core.handle(ENGINE, p.EngineDead(engine_id="e0", epoch=0), 1.0)  # a drained stop: nothing held
        core.handle(ENGINE, p.Hello(engine_id="e0", epoch=1, geometry=GEOMETRY), 2.0)
        core.handle(p.GATEWAY_ROUTING_ID, p.Reserve(request_id="r1", tokens=10), 2.0)
        core.handle(ENGINE, p.EngineDead(engine_id="e0", epoch=1), 3.0)  # a crash with r1 in flight
    deaths = [(e["log_level"], e["epoch"], e["requests"]) for e in logs if e["event"] == "engine_dead"]
    assert deaths == [("info", 0, 0), ("warning", 1, 1)]


def test_a_session_turn_cancelled_while_tokenizing_leaves_the_session_usable(core):
    internal = first_turn(core)
    sends = core.on_client(CLIENT, p.Generate(id="t2", prompt="And then?", session_id="s"), 2.0)
    assert [type(s) for s in sends] == [ToTokenizer]
    (done,) = msgs(core.on_client(CLIENT, p.Cancel(id="t2"), 2.1), ToClient)
    assert done.finish_reason == "cancelled" and done.usage.completion_tokens == 0
    (job,) = sends
    assert core.on_prepared(job.request_id, job.msg, None, 2.2) == []  # the thread skipped it
    generate = next(m for m in msgs(start(core, "t3", now=3.0, prompt="Go on", session_id="s"), ToEngine)
                    if isinstance(m, p.EngineGenerate))
    assert generate.session_id == internal  # the session took its next turn


def test_the_tokenizer_thread_skips_a_job_whose_request_ended_and_the_core_hears_it_back(core):
    """A cancelled or gone request waiting for the tokenizer costs no tokenizing (1M-character prompts from clients
    that left kept the thread busy for a minute), and its place at the tokenizer frees when the job is back."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from services.gateway.service import GatewayService

    (job,) = [s for s in core.on_client(CLIENT, p.Generate(id="r1", prompt="Hi"), 0.0) if isinstance(s, ToTokenizer)]
    core.on_client(CLIENT, p.Cancel(id="r1"), 0.1)
    calls, prepare = [], core.prompter.prepare
    core.prompter.prepare = lambda msg, turn: calls.append(msg) or prepare(msg, turn)
    service = GatewayService(core, addresses=None)
    with ThreadPoolExecutor(max_workers=1) as pool:
        service.res = SimpleNamespace(tokenizer=pool)
        asyncio.run(service._prepare(job))
    assert calls == [] and core.num_preparing == 0 and core.num_streams == 0


def test_the_tokenizer_queue_refuses_a_second_job_for_a_request_and_a_stray_done():
    from services.gateway.tokenizer_queue import TokenizerQueue

    queue, job = TokenizerQueue(), ToTokenizer("r1", p.Generate(id="g", prompt="Hi"), None)
    queue.add(b"A", job)
    with pytest.raises(ValueError, match="r1"):
        queue.add(b"B", job)
    assert queue.next(0.0) is job and queue.next(0.0) is None and queue.remove("r1") is False  # on the thread
    with pytest.raises(KeyError, match="r2"):
        queue.done("r2", 0.1, encoded=True)
    queue.done("r1", 0.1, encoded=True)
    assert len(queue) == 0 and queue.held_by(b"A") == 0


def test_the_tokenizer_queue_gives_a_long_prompt_a_turn_per_quantum_of_its_characters():
    """Deficit round robin, a turn adding 65,536 characters of credit and a job costing its characters (at least
    that): A's first 200,000-character prompt takes the idle thread (A, left with nothing waiting, forfeits the
    62,144 its turns left over); a2 and a3 queue after it, so A's credit reaches 65,536, 131,072 and 196,608 while
    B's and C's short prompts (a quantum each) go one a turn, and 262,144 at A's fourth turn for a2 (62,144 left),
    258,752 three turns later for a3. Round robin by jobs would give a1 a2 b1 c1 a3 b2."""
    from services.gateway.tokenizer_queue import TokenizerQueue

    queue = TokenizerQueue()
    for identity, request_id, chars in ((b"A", "a1", 200_000), (b"A", "a2", 200_000), (b"A", "a3", 200_000),
                                        (b"B", "b1", 10), (b"B", "b2", 65_536), (b"C", "c1", 0)):  # fmt: skip
        msg = p.Generate(id=request_id, prompt="x" * chars) if chars else p.Generate(id=request_id, token_ids=[1])
        queue.add(identity, ToTokenizer(request_id, msg, None))
        if request_id == "a1":
            order = [queue.next(0.0).request_id]  # the idle thread takes it at once, as the gateway hands it over
    queue.done("a1", 0.0, encoded=False)
    while (job := queue.next(0.0)) is not None:
        order.append(job.request_id)
        queue.done(job.request_id, 0.0, encoded=False)
    assert order == ["a1", "b1", "c1", "b2", "a2", "a3"] and len(queue) == 0


@pytest.mark.parametrize(
    ("jobs", "order"),
    [  # (connection, request id, characters) in arrival order, c0 or a1 taking the idle thread; the order served
        # a1 takes 2 turns (131,072) and leaves 65,535, forfeited as A's queue empties: a2 needs 2 turns again, after b1
        ([(b"A", "a1", 65_537), (b"B", "b1", 131_072), (b"A", "a2", 131_071)], ["a1", "b1", "a2"]),
        # a one-character prompt costs a whole quantum, so a2 starts from none and needs 2 turns, after b1
        ([(b"C", "c0", 1), (b"A", "a1", 1), (b"A", "a2", 131_071), (b"B", "b1", 131_072)], ["c0", "a1", "b1", "a2"]),
        # a1 leaves 65,535 with a2 still waiting, kept: A's next turn reaches 131,071, a2's cost, before B's third
        ([(b"C", "c0", 1), (b"A", "a1", 65_537), (b"A", "a2", 131_071), (b"B", "b1", 196_608)],
         ["c0", "a1", "a2", "b1"]),
    ],
)
def test_the_tokenizer_queue_keeps_credit_left_over_while_jobs_wait(jobs, order):
    """Credit left after a job is kept while the connection has more waiting, forfeited when none is left, and a
    short prompt costs a quantum (65,536): each case fails if one of the three rules goes (hand-derived orders)."""
    from services.gateway.tokenizer_queue import TokenizerQueue

    queue, served = TokenizerQueue(), []
    for identity, request_id, chars in jobs:
        queue.add(identity, ToTokenizer(request_id, p.Generate(id=request_id, prompt="x" * chars), None))
        if not served:
            served.append(queue.next(0.0).request_id)  # the idle thread takes the first at once
    queue.done(served[0], 0.0, encoded=False)
    while (job := queue.next(0.0)) is not None:
        served.append(job.request_id)
        queue.done(job.request_id, 0.0, encoded=False)
    assert served == order


def test_a_connection_whose_queue_empties_forfeits_its_credit():
    """B's 250,000-character prompt, waiting with 3 turns of credit banked (196,608), is cancelled; B's next one
    starts from none, so A's last two short prompts go first, as before any newcomer's long one (had B kept its
    credit, its first turn would reach 262,144 and b2 would go before a5)."""
    from services.gateway.tokenizer_queue import TokenizerQueue

    queue, order = TokenizerQueue(), []
    queue.add(b"A", ToTokenizer("a0", p.Generate(id="a0", prompt="x"), None))
    assert queue.next(0.0).request_id == "a0"  # on the thread while B and A queue
    queue.add(b"B", ToTokenizer("b1", p.Generate(id="b1", prompt="x" * 250_000), None))
    for i in range(1, 6):
        queue.add(b"A", ToTokenizer(f"a{i}", p.Generate(id=f"a{i}", prompt="x"), None))
    queue.done("a0", 0.0, encoded=False)
    for _ in range(3):  # B's turn, short of its 250,000 (3 quanta: 196,608), then an A prompt
        order.append(queue.next(0.0).request_id)
        queue.done(order[-1], 0.0, encoded=False)
    assert order == ["a1", "a2", "a3"] and queue.remove("b1")
    queue.add(b"B", ToTokenizer("b2", p.Generate(id="b2", prompt="x" * 250_000), None))
    while (job := queue.next(0.0)) is not None:
        order.append(job.request_id)
        queue.done(job.request_id, 0.0, encoded=False)
    assert order == ["a1", "a2", "a3", "a4", "a5", "b2"]


def test_the_tokenizer_queue_estimates_when_its_job_on_the_thread_is_done():
    """The rate is an exponential moving average (weight 0.3) over long prompts encoded, a prior until the first:
    100,000 characters in 0.5 s, then in 0.25 s: 0.3 * 400,000 + 0.7 * 200,000 = 260,000 a second; short, skipped
    and token-id jobs do not move it. A 130,000-character job 0.1 s on the thread has 130,000 / 260,000 - 0.1 =
    0.4 s to go."""
    from services.gateway.tokenizer_queue import PRIOR_CHARS_PER_S, TokenizerQueue

    queue, t = TokenizerQueue(), 0.0
    assert queue.chars_per_s == PRIOR_CHARS_PER_S and queue.free_in_s(t) == 0.0  # nothing on the thread
    jobs = [("long", "x" * 100_000, True), ("short", "x" * 1_000, True), ("long2", "x" * 100_000, True),
            ("skipped", "x" * 100_000, False), ("ids", None, True)]  # fmt: skip
    for (request_id, text, encoded), took in zip(jobs, (0.5, 0.001, 0.25, 0.001, 0.001), strict=True):
        msg = p.Generate(id=request_id, prompt=text) if text else p.Generate(id=request_id, token_ids=[1, 2])
        queue.add(b"A", ToTokenizer(request_id, msg, None))
        assert queue.next(t).request_id == request_id
        queue.done(request_id, t + took, encoded=encoded)
        t += 1.0
    assert queue.chars_per_s == pytest.approx(260_000.0)
    queue.add(b"A", ToTokenizer("big", p.Generate(id="big", prompt="x" * 130_000), None))
    assert queue.next(10.0).request_id == "big"
    assert queue.free_in_s(10.1) == pytest.approx(0.4) and queue.free_in_s(11.0) == 0.0  # overdue: any moment


def test_only_prompts_that_reached_the_encoder_time_the_tokenizer(tokenizer):
    """A chat template that refuses 1 MB of messages answers in a millisecond; counted, it would make the rate
    ~1e9 characters a second and every hint 50 ms. A prompt over the context was encoded first, so it counts."""
    from services.gateway.tokenizer_queue import PRIOR_CHARS_PER_S

    core, big = make_core(tokenizer, active=1, queue=1), "milk " * 20_000
    for i, (result, took) in enumerate(((BadRequest("the chat template rejected the messages"), 0.001),
                                        (ContextOverflow(20_000, 256), 0.4))):  # fmt: skip
        (job,) = [s for s in core.on_client(b"A", p.Generate(id=f"a{i}", prompt=big), i) if isinstance(s, ToTokenizer)]
        core.on_prepared(job.request_id, job.msg, result, i + took)
        assert core._tokenizer.chars_per_s == pytest.approx((PRIOR_CHARS_PER_S, 100_000 / 0.4)[i])


def test_a_full_tokenizer_says_when_its_next_place_frees(tokenizer):
    """At the bound, `retry_after_ms` is when the job on the thread should be done (its characters over the rate),
    not the pool's estimate: 100,000 characters took 0.5 s, so the next 100,000 on the thread since 1.0 s frees
    its place at 1.5 s: 300 ms for the prompt that makes way at 1.2 s, 200 ms for one refused at 1.3 s."""
    core = make_core(tokenizer, active=1, queue=1)  # two places
    big = "milk " * 20_000
    (job,) = [s for s in core.on_client(b"A", p.Generate(id="a1", prompt=big), 0.0) if isinstance(s, ToTokenizer)]
    core.on_prepared(job.request_id, job.msg, ContextOverflow(20_000, 256), 0.5)
    core.on_client(b"A", p.Generate(id="a2", prompt=big), 1.0)
    core.on_client(b"A", p.Generate(id="a3", prompt=big), 1.0)
    (gone,) = msgs(core.on_client(b"B", p.Generate(id="b1", prompt="Hi"), 1.2), ToClient)
    (refused,) = msgs(core.on_client(b"C", p.Generate(id="c1", prompt="Hi"), 1.3), ToClient)
    assert (gone.id, gone.retry_after_ms) == ("a3", 300) and (refused.id, refused.retry_after_ms) == ("c1", 200)


def test_a_handler_bug_on_one_prompt_does_not_stall_the_tokenizer(core, monkeypatch):
    """The service logs a core handler's exception and goes on: the request ends `internal` (not left waiting for
    its tokens forever, holding its place) and the thread's next job still goes out."""
    (job,) = core.on_client(CLIENT, p.Generate(id="r1", prompt="Hi"), 0.0)
    assert core.on_client(CLIENT, p.Generate(id="r2", prompt="Hi"), 0.0) == []

    def bug(*args):
        raise RuntimeError("bug")

    monkeypatch.setattr(core, "_queue", bug)
    with pytest.raises(RuntimeError):
        core.on_prepared(job.request_id, job.msg, core.prompter.prepare(job.msg, None), 0.1)
    sends = core.tick(0.2)  # the sends are flushed with the next handler's
    (nxt,) = [s for s in sends if isinstance(s, ToTokenizer)]
    assert nxt.msg.id == "r2" and errors_by_id(sends) == {"r1": ErrorCode.INTERNAL} and core.num_streams == 1


def test_an_ended_prompt_on_the_thread_counts_for_no_connection_when_one_must_give_way(tokenizer):
    """A's a1 is cancelled while the thread has it: A's one live prompt (a2) is as many as B's will be, so B's
    newcomer is refused rather than take A's last place."""
    core = make_core(tokenizer, active=1, queue=2)
    for identity, request_id in ((b"A", "a1"), (b"A", "a2"), (b"C", "c1")):
        core.on_client(identity, p.Generate(id=request_id, prompt="Hi"), 0.0)
    core.on_client(b"A", p.Cancel(id="a1"), 0.0)
    assert core.num_preparing == 3  # a1 holds its place until the thread is back with it
    assert errors_by_id(core.on_client(b"B", p.Generate(id="b1", prompt="Hi"), 0.1)) == {"b1": ErrorCode.OVERLOADED}
