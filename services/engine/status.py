"""The engine's periodic one-line status, worded like vLLM's: throughput, queue, KV usage, cache hits.

Pure: `StatusMeter.record` is fed each step's outputs and `StatusMeter.line` (with `now`,
monotonic seconds) closes an interval. Prompt tokens count when a request first shows up in
the outputs (its prefill is done): those computed, `num_prompt_tokens - num_cached_tokens`,
for throughput; all of them as session-cache queries and the cached part as hits (tokens).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .core import RequestOutput


@dataclass(frozen=True, slots=True)
class StatusLine:
    """One interval's figures."""

    prompt_tokens_per_s: float  # prompt tokens computed (not taken from a session's cache)
    generation_tokens_per_s: float
    num_running: int  # requests holding a slot
    num_waiting: int  # requests waiting for a slot or pages
    kv_usage: float  # token positions in use / capacity, 0..1
    session_hit_rate: float | None  # cached / prompt tokens of the requests seen; None: none seen

    @property
    def message(self) -> str:
        hits = "n/a" if self.session_hit_rate is None else f"{100 * self.session_hit_rate:.1f}%"
        return (f"Avg prompt throughput: {self.prompt_tokens_per_s:.1f} tokens/s, "
                f"Avg generation throughput: {self.generation_tokens_per_s:.1f} tokens/s, "
                f"Running: {self.num_running} reqs, Waiting: {self.num_waiting} reqs, "
                f"KV cache usage: {100 * self.kv_usage:.1f}%, Session cache hit rate: {hits}")  # fmt: skip


class StatusMeter:
    """Accumulates step outputs between status lines.

    Args:
        interval_s (float): seconds between lines; 0 disables them.
        now (float): monotonic seconds at start.
    """

    def __init__(self, interval_s: float, now: float):
        self.interval_s = interval_s
        self._started = now
        self._seen: set[str] = set()  # unfinished requests whose prompt was counted
        self._prompt = self._generated = self._queried = self._hits = 0
        self._last: tuple | None = None

    def record(self, outputs: Iterable[RequestOutput]) -> None:
        """Count one step's outputs."""
        for o in outputs:
            self._generated += len(o.new_token_ids)
            if o.request_id not in self._seen:
                self._seen.add(o.request_id)
                self._prompt += o.num_prompt_tokens - o.num_cached_tokens
                self._queried += o.num_prompt_tokens
                self._hits += o.num_cached_tokens
            if o.finish_reason is not None:
                self._seen.discard(o.request_id)

    def is_due(self, now: float) -> bool:
        return self.interval_s > 0 and now - self._started >= self.interval_s

    def line(self, now: float, *, num_running: int, num_waiting: int, kv_usage: float) -> StatusLine | None:
        """Close the interval; None when nothing happened and nothing changed since the last line."""
        elapsed = max(now - self._started, 1e-9)
        line = StatusLine(
            prompt_tokens_per_s=self._prompt / elapsed, generation_tokens_per_s=self._generated / elapsed,
            num_running=num_running, num_waiting=num_waiting, kv_usage=kv_usage,
            session_hit_rate=self._hits / self._queried if self._queried else None,
        )  # fmt: skip
        self._started = now
        self._prompt = self._generated = self._queried = self._hits = 0
        state = (num_running, num_waiting, round(kv_usage, 4))
        idle = line.prompt_tokens_per_s == line.generation_tokens_per_s == 0 and state == self._last
        self._last = state
        return None if idle else line
