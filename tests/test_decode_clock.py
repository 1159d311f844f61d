"""`ops.decode_clock`: decode rates that count only tokens launched after the clock started.

A simulated engine on a fake clock: each call spends `launch` seconds launching a window of `window`
tokens per stream, and the GPU spends `gpu` seconds computing it. Run ahead, a call returns the previous
window's tokens; the true rate is tokens over the time their launches and computation took, derived
by hand for each case.
"""

from __future__ import annotations

import pytest

from ops.decode_clock import DecodeClock


class FakeEngine:
    """Windows of `window` tokens for `streams` streams; `total` windows; one GPU, one host, a fake clock."""

    def __init__(self, *, streams: int, window: int, total: int, launch: float, gpu: float, ahead: bool):
        self.streams, self.window, self.total, self.launch, self.gpu, self.ahead = (
            streams, window, total, launch, gpu, ahead)
        self.now = 0.0
        self.gpu_free = 0.0  # when the GPU finishes what it was given
        self.launched = 0
        self.pending: float | None = None  # when the window in flight is computed

    def clock(self) -> float:
        return self.now

    def sync(self) -> None:
        if self.pending is not None:
            self.now = max(self.now, self.pending)

    def _launch(self) -> None:
        self.now += self.launch
        self.gpu_free = max(self.gpu_free, self.now) + self.gpu
        self.pending = self.gpu_free
        self.launched += 1

    def _read(self) -> list[int]:
        self.now = max(self.now, self.pending)
        self.pending = None
        return [s for s in range(self.streams) for _ in range(self.window)]

    def step(self) -> list[int]:
        out = self._read() if self.pending is not None else []
        if self.launched < self.total:
            self._launch()
            if not self.ahead:
                out += self._read()
        return out

    def has_unfinished(self) -> bool:
        return self.launched < self.total or self.pending is not None


def measure(engine: FakeEngine, warmup: int) -> DecodeClock:
    clock = DecodeClock(engine.streams, warmup, clock=engine.clock, sync=engine.sync)
    while engine.has_unfinished():
        clock.record(engine.step(), ahead=engine.pending is not None)
    return clock


@pytest.mark.parametrize("launch, gpu", [(1.0, 0.25), (0.25, 1.0)])
def test_run_ahead_counts_only_windows_launched_after_the_start(launch, gpu):
    """Host-bound (launch 1.0 s, GPU 0.25 s a window) and GPU-bound (0.25 / 1.0). 6 windows of 4 tokens, 2 streams.

    The clock starts after the first window's tokens return (window 2 in flight): it waits for window 2 and
    skips its tokens, then times windows 3-6, launched after the start: 4 windows, 32 tokens. Each call waits
    for the window in flight, then launches the next (its input tokens are the previous window's), so a
    window costs its launch and its computation, 1.25 s either way: 32 / 5.0. Counting window 2's tokens as
    well, from its return, would have given 40 tokens in 6.0 s (host-bound)."""
    engine = FakeEngine(streams=2, window=4, total=6, launch=launch, gpu=gpu, ahead=True)
    clock = measure(engine, warmup=4)
    assert clock.tokens == 32
    assert clock.rate() == pytest.approx(32 / 5.0)


def test_without_run_ahead_every_window_after_the_start_counts():
    """A CPU engine computes and returns each window in its own call: nothing is in flight at the start, so
    windows 2-6 count (5 windows of 3 tokens), each taking its launch and its computation, 1.5 s: 15 / 7.5."""
    engine = FakeEngine(streams=1, window=3, total=6, launch=1.0, gpu=0.5, ahead=False)
    clock = measure(engine, warmup=3)
    assert clock.tokens == 15
    assert clock.rate() == pytest.approx(15 / 7.5)


def test_the_clock_waits_for_every_stream_and_the_warmup():
    """Tokens of calls before every stream has `warmup` tokens are not timed; nothing timed gives 0."""
    clock = DecodeClock(2, warmup=2, clock=iter([10.0, 11.0, 13.0]).__next__, sync=lambda: None)
    clock.record([0, 0, 0], ahead=False)  # stream 1 has none yet
    assert clock.start is None and clock.rate() == 0.0
    clock.record([1, 1], ahead=False)  # both have 2 or more: the clock starts at 10.0
    clock.record([0, 1], ahead=False)  # 11.0
    clock.record([0, 1, 0, 1], ahead=False)  # 13.0
    assert clock.start == 10.0 and clock.tokens == 6 and clock.rate() == pytest.approx(6 / 3.0)
