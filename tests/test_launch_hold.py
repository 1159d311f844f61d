"""`LaunchHold`: the wait before a decode window is launched ahead, fitted to the read-back's wait for the GPU.
Every figure below is worked by hand from the rule in `services/engine/launch_hold.py`."""

from __future__ import annotations

import pytest

from services.engine.launch_hold import LaunchHold


def test_the_hold_grows_until_the_read_back_waits_a_margin():
    # A GPU-bound 16-step window of 40 ms whose launch takes 16 ms: held h, the read-back waits 40 - 16 - h ms.
    # The margin is 10% of the window (4 ms), so the hold settles at 40 - 16 - 4 = 20 ms, growing to at most
    # twice the last hold plus 1 ms a window on the way: 1, 3, 7, 15, then 20.
    hold, seen = LaunchHold(), []
    assert hold.hold_s(16) == 0.0  # nothing measured: launch at once
    for _ in range(6):
        held = hold.hold_s(16)
        hold.observe(16, held_s=held, launch_s=0.016, blocked_s=0.040 - 0.016 - held)
        seen.append(round(hold.hold_s(16), 6))
    assert seen == [0.001, 0.003, 0.007, 0.015, 0.020, 0.020]
    assert hold.hold_s(8) == pytest.approx(0.010)  # per step: a window of 8 steps holds half as long


def test_a_read_back_that_did_not_wait_halves_the_hold():
    hold = LaunchHold()
    hold.per_step_s = 0.020 / 16
    # Waited 0.5 ms of a 36.5-ms window, under half its 3.65-ms margin: the GPU may have waited for the launch.
    hold.observe(16, held_s=0.020, launch_s=0.016, blocked_s=0.0005)
    assert hold.hold_s(16) == pytest.approx(0.010)


def test_where_the_host_sets_the_pace_windows_launch_at_once():
    hold = LaunchHold()
    hold.observe(16, held_s=0.0, launch_s=0.040, blocked_s=0.0002)  # the window was done before its read-back
    assert hold.hold_s(16) == 0.0


def test_one_slow_read_back_cannot_set_a_long_hold():
    hold = LaunchHold()
    # Held 20 ms, then the read-back waited 300 ms (a pause): 20 + 300 - 33.6 = 286.4 ms and 80% of the 336-ms
    # window (268.8) are both above twice the last hold plus 1 ms: 41 ms.
    hold.observe(16, held_s=0.020, launch_s=0.016, blocked_s=0.300)
    assert hold.hold_s(16) == pytest.approx(0.041)


def test_the_hold_is_capped_and_can_be_turned_off():
    hold = LaunchHold()
    # Held 90 ms of a 191-ms window that then waited 100 ms: 90 + 100 - 19.1 = 170.9 ms and twice 90 + 1 = 181,
    # capped at 80% of the window: 152.8 ms.
    hold.observe(1, held_s=0.090, launch_s=0.001, blocked_s=0.100)
    assert hold.hold_s(1) == pytest.approx(0.1528)
    off = LaunchHold(enabled=False)
    off.observe(16, held_s=0.0, launch_s=0.016, blocked_s=0.024)
    assert off.hold_s(16) == 0.0
