"""Gateway metrics and the engine status line, driven by messages with injected clocks.

Every figure is derived by hand from the scripted timeline (monotonic seconds).
"""

from __future__ import annotations

import pytest

from services.engine.core import RequestOutput
from services.engine.status import StatusMeter
from services.gateway.control import ToController, ToEngine
from services.gateway.core import GatewayCore
from services.gateway.engines import EngineTable
from services.gateway.metrics import GatewayMetrics
from services.gateway.prompts import Prompter
from services.gateway.pool import RequestPool
from shared import protocol as p
from shared.errors import ErrorCode
from tests.gateway_helpers import drive

ENGINE = b"e0:0"
GEOMETRY = p.Geometry(slots=4, capacity_tokens=1000, bytes_per_token=10, kv_cache="raw", max_context=64)


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.utils import load_config, load_tokenizer

    from services.engine.model.paths import resolve_model

    path = resolve_model("default", dtype="float32")
    return load_tokenizer(path, eos_token_ids=load_config(path).get("eos_token_id"))


@pytest.fixture
def gateway(tokenizer):
    metrics = GatewayMetrics()
    prompter = Prompter(tokenizer, vocab_size=49152, max_context=64, max_tokens_cap=32)
    core = GatewayCore(prompter, RequestPool(1, 1, 5.0), EngineTable(30.0), observer=metrics)
    core.on_engine_cmd(ENGINE, p.Hello(engine_id="e0", epoch=0, geometry=GEOMETRY), now=0.0)
    return core, metrics


def value(metrics: GatewayMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value("buttermilk:" + name, labels) or 0.0


def submit(core, client_id, now, **fields):
    """Send a generate; grant a reservation it asks for; returns the engine request id, if any."""
    sends = drive(core, core.on_client(b"c", p.Generate(id=client_id, **{"prompt": "Hello", **fields}), now), now)
    return grant(core, sends, now)


def grant(core, sends, now):
    for m in [s.msg for s in sends if isinstance(s, ToController) and isinstance(s.msg, p.Reserve)]:
        out = core.on_controller(p.Reserved(request_id=m.request_id, resv_id="v-" + m.request_id, engine_id="e0",
                                            epoch=0), now)  # fmt: skip
        return next(s.msg.id for s in out if isinstance(s, ToEngine))
    return None


def tokens(core, rid, ids, now):
    chunk = p.TokenChunk(id=rid, token_ids=ids, index=0)
    return core.on_engine_out(p.EngineTokens(engine_id="e0", epoch=0, chunks=[chunk]), now)


def finish(core, rid, now, reason="length", completion=3, cached=0):
    usage = p.Usage(prompt_tokens=2, completion_tokens=completion, cached_tokens=cached)
    return core.on_engine_out(p.EngineFinished(engine_id="e0", epoch=0, id=rid, reason=reason, usage=usage), now)


def test_request_counters_and_latencies_follow_the_timeline(gateway):
    core, m = gateway
    r1 = submit(core, "a", 0.0)  # admitted at once (queue time 0)
    assert submit(core, "b", 0.5) is None  # queued behind a
    assert submit(core, "c", 0.6) is None  # queue full (max_queue 1): refused, no stream
    drive(core, core.on_client(b"c", p.Generate(id="d", prompt="word " * 80), 0.7), 0.7)  # over the 64-token context
    tokens(core, r1, [1000], 1.0)  # first token: TTFT 1.0
    tokens(core, r1, [1001], 1.5)  # ITL 0.5
    tokens(core, r1, [1002, 1003], 2.5)  # two tokens in 1.0 s: ITL 0.5 twice
    r2 = grant(core, finish(core, r1, 3.0, completion=4, cached=1), 3.0)  # a: e2e 3.0; b promoted, queued 2.5 s
    core.on_client(b"c", p.Cancel(id="b"), 3.2)
    finish(core, r2, 3.5, reason="cancelled", completion=0)  # b: cancelled, e2e 3.0

    assert value(m, "request_received_total") == 4
    assert value(m, "request_success_total", finished_reason="length") == 1
    assert value(m, "request_cancelled_total") == 1
    assert value(m, "request_failure_total", code="overloaded") == 1
    assert value(m, "request_failure_total", code="context_overflow") == 1
    assert value(m, "admission_rejections_total", reason="overloaded") == 1
    assert value(m, "admission_rejections_total", reason="context_overflow") == 1
    assert value(m, "prompt_tokens_total") == 4 and value(m, "generation_tokens_total") == 4
    assert value(m, "session_cache_queries_total") == 4 and value(m, "session_cache_hits_total") == 1
    assert value(m, "time_to_first_token_seconds_count") == 1 and value(m, "time_to_first_token_seconds_sum") == 1.0
    assert value(m, "inter_token_latency_seconds_count") == 3 and value(m, "inter_token_latency_seconds_sum") == 1.5
    assert value(m, "request_queue_time_seconds_count") == 2 and value(m, "request_queue_time_seconds_sum") == 2.5
    assert value(m, "e2e_request_latency_seconds_count") == 2 and value(m, "e2e_request_latency_seconds_sum") == 6.0
    received = value(m, "request_received_total")
    ended = (value(m, "request_success_total", finished_reason="stop") + value(m, "request_success_total",
             finished_reason="length") + value(m, "request_cancelled_total")
             + value(m, "request_failure_total", code="overloaded")
             + value(m, "request_failure_total", code="context_overflow"))  # fmt: skip
    assert received == ended


def test_engine_reports_controller_stats_and_revocations(gateway):
    core, m = gateway
    beat = p.Heartbeat(engine_id="e0", epoch=0, tokens_used=48, capacity_tokens=1024, used_slots=2)
    core.on_engine_cmd(ENGINE, beat, 1.0)
    stats = p.StatsReply(num_leases=3, num_sessions=1, engines=[p.EngineUsage(
        engine_id="e0", epoch=0, capacity_tokens=1000, reserved_tokens=70, held_tokens=30, free_tokens=900,
        bytes_per_token=10)])  # fmt: skip
    core.on_client(b"c9", p.Generate(id="t", prompt="Hi"), 1.0)  # its tokenizer job left pending
    m.refresh(pool=core.pool.stats(), preparing=core.num_preparing, engines=core.engines, stats=stats)
    assert value(m, "num_requests_preparing") == 1
    assert value(m, "kv_cache_usage_perc", engine_id="e0") == 48 / 1024
    assert value(m, "kv_cache_capacity_tokens", engine_id="e0") == 1024
    assert value(m, "slots_used", engine_id="e0") == 2 and value(m, "slots_max", engine_id="e0") == 4
    assert value(m, "kv_tokens_reserved", engine_id="e0") == 70 and value(m, "kv_tokens_held", engine_id="e0") == 30
    assert value(m, "num_leases") == 3 and value(m, "num_sessions") == 1 and value(m, "num_engines_live") == 1

    core.on_controller(p.Revoked(code=ErrorCode.LEASE_EXPIRED, lease_ids=["l1", "l2"]), 2.0)
    core.on_controller(p.Revoked(code=ErrorCode.CANCELLED, lease_ids=["l3"]), 2.0)  # closed, not expired
    assert value(m, "lease_expirations_total") == 2

    core.on_engine_cmd(ENGINE, p.Hello(engine_id="e0", epoch=0, geometry=GEOMETRY), 2.5)  # periodic repeat
    core.on_engine_cmd(b"e0:1", p.Hello(engine_id="e0", epoch=1, geometry=GEOMETRY), 3.0)  # restarted
    core.on_engine_cmd(ENGINE, p.Heartbeat(engine_id="e0", epoch=0, tokens_used=999, capacity_tokens=1024), 3.1)
    assert value(m, "engine_restarts_total", engine_id="e0") == 1
    m.refresh(pool=core.pool.stats(), preparing=core.num_preparing, engines=core.engines, stats=None)
    assert value(m, "kv_tokens_reserved", engine_id="e0") == 70  # no answer: the last figures stay
    assert m.registry.get_sample_value("buttermilk:kv_cache_usage_perc", {"engine_id": "e0"}) == 48 / 1024

    core.engines.drop("e0", 1)
    m.refresh(pool=core.pool.stats(), preparing=core.num_preparing, engines=core.engines, stats=None)
    assert m.registry.get_sample_value("buttermilk:kv_cache_usage_perc", {"engine_id": "e0"}) is None
    assert value(m, "num_engines_live") == 0


def output(rid, new, prompt=0, cached=0, reason=None):
    return RequestOutput(request_id=rid, new_token_ids=new, finish_reason=reason, num_prompt_tokens=prompt,
                         num_cached_tokens=cached, tokens_held=0, bytes_held=0)  # fmt: skip


def test_engine_status_line_figures():
    meter = StatusMeter(10.0, now=0.0)
    meter.record([output("a", [1], prompt=100), output("b", [2], prompt=60, cached=40)])
    meter.record([output("a", [3]), output("b", [4, 5], reason="stop")])
    meter.record([output("a", [6], reason="length")])
    assert not meter.is_due(9.9) and meter.is_due(10.0)
    line = meter.line(10.0, num_running=1, num_waiting=2, kv_usage=0.125)
    # prompt computed: 100 + (60 - 40) = 120 tokens in 10 s; generated: 6 tokens; hits 40 of 160.
    assert (line.prompt_tokens_per_s, line.generation_tokens_per_s, line.session_hit_rate) == (12.0, 0.6, 0.25)
    assert line.message == ("Avg prompt throughput: 12.0 tokens/s, Avg generation throughput: 0.6 tokens/s, "
                            "Running: 1 reqs, Waiting: 2 reqs, KV cache usage: 12.5%, Session cache hit rate: 25.0%")
    assert meter.line(20.0, num_running=0, num_waiting=0, kv_usage=0.0) is not None  # state changed
    assert meter.line(30.0, num_running=0, num_waiting=0, kv_usage=0.0) is None  # idle and unchanged
