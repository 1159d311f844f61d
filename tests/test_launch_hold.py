"""`LaunchHold`: the wait before a decode window is launched ahead, fitted to the read-back's blocked time.
Every figure below is worked by hand from the rule in `services/engine/launch_hold.py`."""

from __future__ import annotations

import pytest

from services.engine.launch_hold import LaunchHold


def test_the_hold_keeps_the_read_back_blocked_for_a_margin():
    hold = LaunchHold()
    assert hold.hold_s(16) == 0.0  # nothing measured: launch at once
    # A 16-step window: launched at once (held 0), the launch took 16 ms and the read-back then waited 24 ms:
    # the window took ~40 ms, the margin is 10% of it (4 ms), so 24 - 4 = 20 ms could have been held.
    hold.observe(16, held_s=0.0, launch_s=0.016, blocked_s=0.024)
    assert hold.hold_s(16) == pytest.approx(0.020) and hold.hold_s(8) == pytest.approx(0.010)  # per step
    hold.observe(16, held_s=0.020, launch_s=0.016, blocked_s=0.004)  # held 20 ms, blocked by the margin
    assert hold.hold_s(16) == pytest.approx(0.020)  # steady


def test_a_read_back_that_did_not_block_halves_the_hold():
    hold = LaunchHold()
    hold.per_step_s = 0.020 / 16
    # Blocked 0.5 ms of a 36.5-ms window, under half its 3.65-ms margin: the GPU may have waited for the launch.
    hold.observe(16, held_s=0.020, launch_s=0.016, blocked_s=0.0005)
    assert hold.hold_s(16) == pytest.approx(0.010)


def test_where_the_host_sets_the_pace_windows_launch_at_once():
    hold = LaunchHold()
    hold.observe(16, held_s=0.0, launch_s=0.040, blocked_s=0.0002)  # the window was done before its read-back
    assert hold.hold_s(16) == 0.0


def test_the_hold_is_capped_and_can_be_turned_off():
    hold = LaunchHold()
    # A 101-ms window that blocked 100 ms: 100 - 10.1 = 89.9 ms, capped at 80% of the window (80.8 ms).
    hold.observe(1, held_s=0.0, launch_s=0.001, blocked_s=0.100)
    assert hold.hold_s(1) == pytest.approx(0.0808)
    off = LaunchHold(enabled=False)
    off.observe(16, held_s=0.0, launch_s=0.016, blocked_s=0.024)
    assert off.hold_s(16) == 0.0
