"""The gateway's Prometheus metrics: its own timings plus the controller's and engines' reports.

Names are `buttermilk:` + vLLM's suffixes where vLLM has one (`num_requests_running`,
`request_success_total`, `time_to_first_token_seconds`, `kv_cache_usage_perc`, ...). Every
generate that reaches the gateway core counts once in `request_received_total` and, when it
ends, once in exactly one of `request_success_total{finished_reason}` (stop, length),
`request_cancelled_total` or `request_failure_total{code}`, so with nothing in flight
received = success + cancelled + failure. Token counters add the usage each `done` reported.

`GatewayMetrics` is the core's `StreamObserver` (counters and histograms as facts arrive);
gauges are set at scrape time by `refresh` from the request pool, the engines' latest HELLO
and heartbeat (KV usage = `tokens_used / capacity_tokens`, slots) and the controller's
`stats` reply (tokens reserved and held, leases, sessions).
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from shared.errors import ErrorCode
from shared.protocol import Done, Error, FinishReason, Geometry, Heartbeat, Hello, Revoked, StatsReply

from .engines import EngineTable
from .pool import PoolStats
from .streams import Phase, Stream

PREFIX = "buttermilk:"
# Bucket bounds (seconds) as vLLM's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
SUCCESS_REASONS = (FinishReason.STOP, FinishReason.LENGTH)


class GatewayMetrics:
    """One gateway's series, in a registry of their own (several gateways can share a process).

    Args:
        registry (CollectorRegistry | None): where to register. Default: a new one.
    """

    def __init__(self, registry: CollectorRegistry | None = None):
        disable_created_metrics()  # no `_created` series (process-wide), as vLLM
        self.registry = r = registry or CollectorRegistry()
        by_engine = ("engine_id",)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Requests admitted by the request pool (reserving or generating).")
        self.waiting = gauge("num_requests_waiting", "Requests waiting in the FIFO queue.")
        self.preparing = gauge("num_requests_preparing", "Prompts being tokenized or waiting for the tokenizer.")
        self.engines_live = gauge("num_engines_live", "Engines live at the gateway.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV tokens in use / capacity, 0..1 (engine).", by_engine)
        self.kv_capacity = gauge("kv_cache_capacity_tokens", "KV tokens of the engine's cache.", by_engine)
        self.kv_reserved = gauge("kv_tokens_reserved", "KV tokens reserved for running requests (controller).",
                                 by_engine)  # fmt: skip
        self.kv_held = gauge("kv_tokens_held", "KV tokens held by sessions between turns (controller).", by_engine)
        self.slots_used = gauge("slots_used", "Cache slots held, sessions included (engine-reported).", by_engine)
        self.slots_max = gauge("slots_max", "Cache slots of the engine.", by_engine)
        self.leases = gauge("num_leases", "Client leases open (controller).")
        self.sessions = gauge("num_sessions", "Multi-turn sessions live (controller).")
        self.requests_received = counter("request_received", "Generate requests that reached the gateway core.")
        self.success = counter("request_success", "Requests that finished, by finish reason.", ("finished_reason",))
        self.cancelled = counter("request_cancelled", "Requests cancelled by their client (or its session closing).")
        self.failure = counter("request_failure", "Requests that ended with an error, by error code.", ("code",))
        self.admission = counter("admission_rejections", "Requests refused before they ran, by reason.", ("reason",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests (usage).")
        self.generation_tokens = counter("generation_tokens", "Completion tokens of finished requests (usage).")
        self.cache_queries = counter("session_cache_queries", "Prompt tokens looked up in session caches (usage).")
        self.cache_hits = counter("session_cache_hits", "Prompt tokens reused from a session's KV, not recomputed.")
        self.lease_expirations = counter("lease_expirations", "Leases the controller expired.")
        self.engine_restarts = counter("engine_restarts", "Engines that came back at a newer epoch.", by_engine)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to the first token from the engine.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens of a request.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the terminal message.", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to leaving the FIFO queue.", REQUEST_BUCKETS)
        for reason in SUCCESS_REASONS:
            self.success.labels(reason.value)  # exported at 0 before the first one
        self._last_token: dict[str, float] = {}  # request_id -> monotonic seconds of its latest chunk
        self._epochs: dict[str, int] = {}  # engine_id -> newest epoch seen
        self._geometry: dict[str, Geometry] = {}
        self._heartbeats: dict[str, Heartbeat] = {}
        self._engine_labels: set[str] = set()

    # ---- StreamObserver -----------------------------------------------------------------

    def received(self, now: float) -> None:
        self.requests_received.inc()

    def refused(self, code: str, now: float) -> None:
        self.failure.labels(code).inc()
        self.admission.labels(code).inc()

    def started(self, stream: Stream, now: float) -> None:
        self.queue_time.observe(now - stream.arrived_at)

    def tokens(self, stream: Stream, num_tokens: int, now: float) -> None:
        last = self._last_token.get(stream.request_id)
        if last is None:
            self.ttft.observe(now - stream.arrived_at)
        else:
            for _ in range(num_tokens):  # a chunk of several tokens shares the interval
                self.itl.observe((now - last) / num_tokens)
        self._last_token[stream.request_id] = now

    def ended(self, stream: Stream, terminal: Done | Error, now: float) -> None:
        self._last_token.pop(stream.request_id, None)
        if isinstance(terminal, Done):  # as vLLM: latency of requests that ran to an end
            self.e2e.observe(now - stream.arrived_at)
            if terminal.finish_reason in SUCCESS_REASONS:
                self.success.labels(terminal.finish_reason.value).inc()
            else:
                self.cancelled.inc()
            usage = terminal.usage
            self.prompt_tokens.inc(usage.prompt_tokens)
            self.generation_tokens.inc(usage.completion_tokens)
            self.cache_queries.inc(usage.prompt_tokens)
            self.cache_hits.inc(usage.cached_tokens)
        elif terminal.code == ErrorCode.CANCELLED:
            self.cancelled.inc()
        else:
            self.failure.labels(terminal.code.value).inc()
            if stream.phase is not Phase.RUNNING:
                self.admission.labels(terminal.code.value).inc()

    def engine_message(self, msg: Hello | Heartbeat, now: float) -> None:
        known = self._epochs.get(msg.engine_id)
        if known is not None and msg.epoch < known:
            return  # a stale epoch's late message
        if isinstance(msg, Hello):
            if known is not None and msg.epoch > known:
                self.engine_restarts.labels(msg.engine_id).inc()
                self._heartbeats.pop(msg.engine_id, None)
            self._epochs[msg.engine_id] = msg.epoch
            self._geometry[msg.engine_id] = msg.geometry
        elif known == msg.epoch:
            self._heartbeats[msg.engine_id] = msg

    def revoked(self, msg: Revoked) -> None:
        if msg.code == ErrorCode.LEASE_EXPIRED:
            self.lease_expirations.inc(len(msg.lease_ids))

    # ---- scrape -------------------------------------------------------------------------

    def refresh(self, *, pool: PoolStats, preparing: int, engines: EngineTable, stats: StatsReply | None) -> None:
        """Set the gauges from the pool, the live engines' reports and the controller's stats.

        Args:
            pool (PoolStats): the request pool now.
            preparing (int): tokenizer jobs outstanding (`GatewayCore.num_preparing`).
            engines (EngineTable): which engines are live (series of the others are removed).
            stats (StatsReply | None): the controller's answer; None keeps its last figures.
        """
        self.running.set(pool.active)
        self.waiting.set(pool.queued)
        self.preparing.set(preparing)
        self.engines_live.set(engines.num_live)
        live = {e for e in self._epochs if engines.get(e, self._epochs[e]) is not None}
        for engine_id in self._engine_labels - live:
            for g in (self.kv_usage, self.kv_capacity, self.kv_reserved, self.kv_held, self.slots_used, self.slots_max):
                try:
                    g.remove(engine_id)
                except KeyError:
                    pass  # never set for that engine
        self._engine_labels = live
        for engine_id in live:
            self.slots_max.labels(engine_id).set(self._geometry[engine_id].slots)
            beat = self._heartbeats.get(engine_id)
            if beat is not None and beat.capacity_tokens:
                self.kv_capacity.labels(engine_id).set(beat.capacity_tokens)
                self.kv_usage.labels(engine_id).set(beat.tokens_used / beat.capacity_tokens)
                self.slots_used.labels(engine_id).set(beat.used_slots)
        if stats is not None:
            self.leases.set(stats.num_leases)
            self.sessions.set(stats.num_sessions)
            for usage in stats.engines:
                if usage.engine_id in live:
                    self.kv_reserved.labels(usage.engine_id).set(usage.reserved_tokens)
                    self.kv_held.labels(usage.engine_id).set(usage.held_tokens)

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
