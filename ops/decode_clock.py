"""Decode tokens per second that count only what the clock saw computed.

An engine that runs ahead (ours on a GPU: a call returns the previous decode window's tokens and
has already launched the next; mlx-lm's generators: one step ahead) has work in flight when a
clock starts. Counting the tokens of that work, launched and paid for before the clock, inflates
the rate by up to one window: with 16-step windows, 64 tokens a stream and a host-bound step, by
about 4/3. So when the clock starts with a step in flight it waits for it (`mx.synchronize`) and
does not count the tokens the next call returns; every token counted was launched after the start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import mlx.core as mx


class DecodeClock:
    """Aggregate decode rate of `num_streams` streams once each has `warmup` tokens.

    Feed it, after every call of the engine, the streams of the tokens that call returned (one entry
    per token) and whether a step is left in flight (`ahead`).

    Args:
        num_streams (int): Streams decoding.
        warmup (int): Tokens every stream must have before the clock starts (1: time after the first token).
        clock (Callable[[], float]): Seconds (default `time.perf_counter`).
        sync (Callable[[], None]): Waits for launched work (default `mx.synchronize`).
    """

    def __init__(self, num_streams: int, warmup: int = 1, *, clock: Callable[[], float] = time.perf_counter,
                 sync: Callable[[], None] = mx.synchronize):
        self.num_streams, self.warmup, self._clock, self._sync = num_streams, warmup, clock, sync
        self._counts: dict = {}
        self.start: float | None = None
        self.end: float | None = None
        self.tokens = 0
        self._skip = False

    def record(self, streams: Iterable, ahead: bool) -> None:
        """One call's tokens (`streams`: a stream id per token); `ahead`: a step is still in flight after it."""
        streams = list(streams)
        if self.start is None:
            for s in streams:
                self._counts[s] = self._counts.get(s, 0) + 1
            if len(self._counts) == self.num_streams and min(self._counts.values()) >= self.warmup:
                if ahead:  # launched before the clock: let it finish off the clock, count none of its tokens
                    self._sync()
                    self._skip = True
                self.start = self._clock()
            return
        self.end = self._clock()
        if self._skip:
            self._skip = False
            return
        self.tokens += len(streams)

    @property
    def seconds(self) -> float:
        """Seconds from the start to the last call's return (0 before any timed call)."""
        return 0.0 if self.start is None or self.end is None else self.end - self.start

    def rate(self) -> float:
        """Counted tokens per second (0.0 when nothing was counted)."""
        return self.tokens / self.seconds if self.tokens and self.seconds > 0 else 0.0
