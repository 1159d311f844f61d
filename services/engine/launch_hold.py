"""How long the engine loop may wait for new prompts before it launches the next decode window ahead.

With steps that run ahead of the host (a GPU), the engine launches decode window k+2 while k+1 runs, so the
GPU goes from window to window. Launched at once, right after window k's read-back, k+2 leaves a prompt
that arrives a moment later (a client's next request, or one the gateway promotes when a request ends)
waiting for all of k+1 and all of k+2 before its prefill starts. The host only has to finish k+2's launch
before k+1 ends, so the loop may instead wait on its inbox for part of k+1: a prompt that arrives
meanwhile joins the step launched after k+1's read-back, one window sooner.

`LaunchHold` learns that wait from the read-back's wait for the GPU after the launch (`EngineCore.read_back_s`:
the runner's wait and read alone, none of the host's bookkeeping): it keeps that wait near a margin. A
read-back that hardly waited means the GPU may have waited for the launch, and the hold halves; the hold
grows at most to twice the last one plus a millisecond a window, so one slow read-back (a pause of the
host or a shared GPU) cannot set a long hold at once. Where the host sets the pace the read-back finds
its window done and the hold stays 0: windows launch at once.
"""

from __future__ import annotations

MARGIN_S = 0.001  # least blocked time kept in the read-back, seconds
MARGIN_SHARE = 0.1  # ... or this share of the window's time, whichever is larger
MAX_SHARE = 0.8  # the hold never exceeds this share of the window's time
GROWTH_S = 0.001  # a hold grows to at most twice the last one plus this, seconds


class LaunchHold:
    """A per-step hold, in seconds, fitted to the read-back's blocked time (see the module docstring).

    Args:
        enabled (bool): False: `hold_s` is always 0 (launch ahead at once).
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.per_step_s = 0.0  # hold per decode step of the window in flight

    def hold_s(self, steps: int) -> float:
        """Seconds to wait for prompts before launching ahead of a window of `steps` decode steps in flight."""
        return self.per_step_s * steps if self.enabled else 0.0

    def observe(self, steps: int, held_s: float, launch_s: float, blocked_s: float) -> None:
        """Fit the hold after one hold → launch ahead → read-back of a window of `steps` steps.

        Args:
            steps (int): decode steps of the window that was in flight (and read back).
            held_s (float): seconds the loop waited before the launch.
            launch_s (float): seconds the launch took on the host.
            blocked_s (float): seconds the read-back waited for the window and read its tokens.
        """
        window_s = held_s + launch_s + blocked_s  # ~ the window's GPU time while the GPU sets the pace
        margin_s = max(MARGIN_S, MARGIN_SHARE * window_s)
        if blocked_s >= margin_s / 2:
            hold_s = min(held_s + blocked_s - margin_s, MAX_SHARE * window_s, 2 * held_s + GROWTH_S)
        else:  # the GPU may have idled before the launch: back off
            hold_s = held_s / 2
        self.per_step_s = max(0.0, hold_s) / max(1, steps)
