"""Engine side of issue 11: a session's history is cut to what its client was told (item 5), a
request waiting for a slot has a deadline (item 1), and a stopping engine ends every request
it accepted (item 2). The engine service is driven without sockets (frames are captured)."""

from __future__ import annotations

import contextlib
import threading
import time
from unittest import mock

import mlx.core as mx
import pytest

from kernels import cuda_kv
from services.engine.cache import CacheOptions, Window
from services.engine.request import Request
from shared.protocol import SamplingParams
from services.engine.service import EngineAddresses, EngineService, Stop
from shared import protocol as p
from shared.errors import BadRequest, ErrorCode, Unavailable
from tests.test_engine_core import drive, greedy, make_core, random_prompts, tiny_loaded


def two_turns(tiny_llama, said_kept: int, *, window=None, max_tokens=8):
    """Turn 1 generates `max_tokens`; turn 2 says the client was told only `said_kept` of them."""
    options = CacheOptions(max_context=4096, window=window)
    first, second = random_prompts([11, 5], seed=21)
    core = make_core(tiny_loaded(tiny_llama), window=window)
    said = drive(core, {0: [Request("t1", first, SamplingParams(max_tokens=max_tokens), session_id="s")]})["t1"]["tokens"]
    turn = Request("t2", second, SamplingParams(max_tokens=6), session_id="s", session_tokens=len(first) + said_kept)
    return core, options, first, said, second, turn


@pytest.mark.parametrize("kept", [8, 7, 3, 0], ids=["all", "tail-cut", "kv-cut", "prompt-only"])
def test_a_turn_continues_exactly_the_history_its_client_was_told(tiny_llama, kept):
    core, options, first, said, second, turn = two_turns(tiny_llama, kept)
    result = drive(core, {0: [turn]})["t2"]
    assert result["tokens"] == greedy(tiny_llama, options, first + said[:kept] + second, 6)
    assert result["outputs"][-1].num_prompt_tokens == len(first) + kept + len(second)


def test_a_history_shorter_than_claimed_is_refused_and_the_session_closed(tiny_llama):
    core, _, first, said, second, _ = two_turns(tiny_llama, 8)
    with pytest.raises(BadRequest, match="holds 19 tokens"):
        core.add_request(Request("t2", second, SamplingParams(), session_id="s", session_tokens=25))
    assert core.stats().sessions == {}
    with pytest.raises(BadRequest, match="holds 0 tokens"):  # a turn for a session the engine lost
        core.add_request(Request("t3", second, SamplingParams(), session_id="gone", session_tokens=4))


@pytest.mark.parametrize("kept", [7, 3], ids=["tail-cut", "kv-cut"])
def test_a_wrapped_window_is_cut_by_computing_the_conversation_again(tiny_llama, kept):
    window = Window(8, 2)  # 11 + 8 tokens have wrapped it: an exact K/V cut is impossible
    core, options, first, said, second, turn = two_turns(tiny_llama, kept, window=window)
    result = drive(core, {0: [turn]})["t2"]
    assert result["tokens"] == greedy(tiny_llama, options, first + said[:kept] + second, 6)


# ---- the engine service without sockets ---------------------------------------------------


class Captured:
    """Stands in for a PUSH socket: keeps the decoded messages sent."""

    def __init__(self):
        self.messages = []

    def send(self, frame: bytes) -> None:
        self.messages.append(p.decode(frame))


def service(tiny_llama, slots: int = 1, *, tail: bool | None = None, **kwargs) -> EngineService:
    """An engine service over the tiny model; `tail`: build its cache on the GPU's path (a tail pool: windows
    launched ahead) or the CPU's (steps read back before the next launch) whatever device runs the test."""
    device = mx.Device(mx.gpu if tail else mx.cpu, 0)
    with mock.patch.object(mx, "default_device", lambda: device) if tail is not None else contextlib.nullcontext():
        core = make_core(tiny_loaded(tiny_llama), max_slots=slots, step_token_budget=32)
    if tail and not cuda_kv.is_available():  # MLX's scatters move the tail pages here, ordered by their data
        core.runner.can_run_ahead = True
    geometry = p.Geometry(slots=slots, capacity_tokens=2048, bytes_per_token=1, kv_cache="raw", max_context=4096)
    hello = p.Hello(engine_id="e0", epoch=0, geometry=geometry)
    return EngineService(core, hello, EngineAddresses("inproc://a", "inproc://b", "inproc://c"), **kwargs)


def generate(request_id: str, max_tokens: int = 40) -> p.EngineGenerate:
    return p.EngineGenerate(id=request_id, resv_id=f"v-{request_id}", epoch=0, token_ids=[1, 2, 3],
                            sampling=p.SamplingParams(max_tokens=max_tokens))  # fmt: skip


def finishes(out: Captured) -> dict[str, p.EngineFinished]:
    return {m.id: m for m in out.messages if isinstance(m, p.EngineFinished)}


def test_a_request_waiting_for_a_slot_past_its_deadline_ends_queue_timeout(tiny_llama):
    svc, out, relay = service(tiny_llama, wait_timeout_s=0.0), Captured(), Captured()
    svc._add(generate("a"), out)
    svc._add(generate("b"), out)  # one slot: b waits
    svc._publish(svc.core.step(), out, relay)
    svc._expire_waiting(time.monotonic())
    for _ in range(3):
        svc._publish(svc.core.step(), out, relay)
    ended = finishes(out)
    assert list(ended) == ["b"]  # a runs on; b never got its slot
    assert (ended["b"].reason, ended["b"].code, ended["b"].refused) == ("error", ErrorCode.QUEUE_TIMEOUT, True)
    assert "b" not in svc.running and "a" in svc.running


def test_a_stopping_engine_refuses_new_work_and_ends_what_it_accepted(tiny_llama):
    svc, out, relay = service(tiny_llama), Captured(), Captured()
    svc._add(generate("a"), out)
    svc._add(generate("b"), out)
    svc._publish(svc.core.step(), out, relay)
    svc._draining = Stop(0, "test")
    svc._add(generate("c"), out)
    svc._fail_all(Unavailable("stopping"), out, relay)
    ended = finishes(out)
    assert {k: (m.reason, m.code) for k, m in ended.items()} == {
        rid: ("error", ErrorCode.UNAVAILABLE) for rid in ("a", "b", "c")
    }
    assert (ended["a"].refused, ended["b"].refused, ended["c"].refused) == (False, True, True)
    assert not svc.running and not svc.core.scheduler.requests


class _IO:
    snapshot = None


def loop_with_arrivals(tiny_llama, arrivals: list, slots: int = 1) -> tuple[Stop, Captured, list[set[str]]]:
    """Run the service's main loop on request "a"; put `arrivals` in its inbox just after the second read-back.

    The engine reads each step back before the next launch (no windows ahead), on any device. Returns the
    loop's Stop, the engine-out messages, and the requests each launch scheduled."""
    svc, out, relay = service(tiny_llama, slots, tail=False), Captured(), Captured()
    core, launched, reads = svc.core, [], []
    collect, launch = core.collect, core.launch

    def collect_then_arrive():
        outputs = collect()
        reads.append(1)
        if len(reads) == 2:
            for item in arrivals:
                svc.inbox.put(item)
        return outputs

    def recorded_launch():
        outputs = launch()
        plan = core._in_flight[-1][0] if core._in_flight else None
        launched.append({r.request_id for r in plan.sampling} if plan else set())
        return outputs

    core.collect, core.launch = collect_then_arrive, recorded_launch
    svc.inbox.put(generate("a", max_tokens=200))
    return svc._loop(out, relay, _IO()), out, launched


def test_an_abort_that_arrives_during_a_step_is_not_launched_again(tiny_llama):
    stop, out, launched = loop_with_arrivals(tiny_llama, [p.EngineAbort(ids=["a"]), Stop(0, "test")])
    assert stop.status == 0 and launched == [{"a"}, set()]  # a's prefill; the launch after the abort schedules nothing
    assert (finishes(out)["a"].reason, finishes(out)["a"].code) == ("cancelled", None)


def test_a_fatal_stop_that_arrives_during_a_step_launches_nothing_more(tiny_llama):
    stop, out, launched = loop_with_arrivals(tiny_llama, [Stop(75, "stale epoch")])
    assert stop.status == 75 and launched == [{"a"}]  # nothing launched after the second read-back


def test_a_request_that_arrives_during_a_step_joins_the_next_launch(tiny_llama):
    """Taken in only before a read-back, it would wait for the launch after (measured on an H200: a window)."""
    stop, out, launched = loop_with_arrivals(tiny_llama, [generate("b", max_tokens=4), Stop(0, "test")], slots=2)
    assert stop.status == 0 and launched[:2] == [{"a"}, {"a", "b"}]
    assert finishes(out)["b"].reason == "length"


def test_the_loop_launches_windows_ahead_and_publishes_every_token_in_order(tiny_llama):
    """On the GPU's path the loop launches the next window before the last is read back; a request that
    arrives meanwhile joins after the window in flight; every token reaches engine-out once, in order."""
    svc, out, relay = service(tiny_llama, 2, tail=True), Captured(), Captured()
    core, ahead, reads = svc.core, [], []
    run, collect = core.runner.run, core.collect

    def counted(plan, ahead_of=None):
        ahead.append(ahead_of is not None)
        return run(plan, ahead_of)

    def collect_then_arrive():
        outputs = collect()
        reads.append(1)
        if len(reads) in (3, 6):
            svc.inbox.put(generate("b", max_tokens=20) if len(reads) == 3 else Stop(0, "test"))
        return outputs

    core.runner.run, core.collect = counted, collect_then_arrive
    svc.inbox.put(generate("a", max_tokens=40))
    assert svc._loop(out, relay, _IO()).status == 0
    said = {"a": [], "b": []}
    for message in out.messages:
        for chunk in getattr(message, "chunks", []):
            assert chunk.index == len(said[chunk.id])
            said[chunk.id] += chunk.token_ids
    options = core.options
    assert said == {"a": greedy(tiny_llama, options, [1, 2, 3], 40), "b": greedy(tiny_llama, options, [1, 2, 3], 20)}
    assert {k: m.reason for k, m in finishes(out).items()} == {"a": "length", "b": "length"}
    assert sum(ahead) >= 2 and not svc.running


class OneHold:
    """Stands in for `LaunchHold`: holds the first launch ahead 5 s and puts `arrival` in the inbox 0.2 s into it;
    records what `observe` is given."""

    enabled = True

    def __init__(self, svc: EngineService, arrival):
        self.svc, self.arrival, self.held_at, self.observed = svc, arrival, None, []

    def hold_s(self, steps: int) -> float:
        if self.held_at is not None:
            return 0.0
        self.held_at = time.monotonic()
        threading.Timer(0.2, self.svc.inbox.put, [self.arrival]).start()
        return 5.0

    def observe(self, steps: int, held_s: float, launch_s: float, blocked_s: float) -> None:
        self.observed.append((steps, held_s, launch_s, blocked_s))


def test_a_request_that_arrives_while_the_launch_ahead_is_held_joins_the_next_launch(tiny_llama):
    """The loop waits for prompts before it launches a window ahead (`LaunchHold`): one that arrives then
    is taken in at once, and the launch after the window in flight computes its prefill (no window between)."""
    svc, out, relay = service(tiny_llama, 2, tail=True), Captured(), Captured()
    core, launches, reads = svc.core, [], []
    run, collect = core.runner.run, core.collect

    svc.hold = OneHold(svc, generate("b", max_tokens=4))

    def recorded(plan, ahead_of=None):
        launches.append((time.monotonic(), ahead_of is not None, {r.request_id for r in plan.sampling}))
        return run(plan, ahead_of)

    def collect_then_stop():
        outputs = collect()
        reads.append(1)
        if len(reads) == 6:
            svc.inbox.put(Stop(0, "test"))
        return outputs

    core.runner.run, core.collect = recorded, collect_then_stop
    svc.inbox.put(generate("a", max_tokens=40))
    assert svc._loop(out, relay, _IO()).status == 0
    after = [(at, ahead, ids) for at, ahead, ids in launches if at > svc.hold.held_at]
    at, ahead, ids = after[0]
    assert "b" in ids and not ahead and at - svc.hold.held_at < 2.0  # the next launch, long before 5 s
    said = {"a": [], "b": []}
    for message in out.messages:
        for chunk in getattr(message, "chunks", []):
            said[chunk.id] += chunk.token_ids
    assert said == {"a": greedy(tiny_llama, core.options, [1, 2, 3], 40), "b": greedy(tiny_llama, core.options, [1, 2, 3], 4)}
    # every launch ahead was fitted from: the window's steps, then held, launch and read-back seconds
    assert svc.hold.observed and all(steps >= 1 and min(times) >= 0 for steps, *times in svc.hold.observed)


def test_a_stop_that_arrives_while_the_launch_ahead_is_held_ends_the_loop(tiny_llama):
    svc, out, relay = service(tiny_llama, 2, tail=True), Captured(), Captured()
    svc.hold = OneHold(svc, Stop(0, "test"))
    svc.inbox.put(generate("a", max_tokens=40))
    watchdog = threading.Timer(20.0, svc.inbox.put, [Stop(99, "watchdog")])  # a lost Stop would idle the loop
    watchdog.start()
    try:
        stop = svc._loop(out, relay, _IO())
    finally:
        watchdog.cancel()
    assert svc.hold.held_at is not None and (stop.status, stop.reason) == (0, "test")
    assert finishes(out)["a"].reason == "length"  # a drain: the running request still ran to its end
