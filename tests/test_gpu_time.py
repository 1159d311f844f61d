"""ops/gpu_time.py's busy time: the union of kernel intervals, overlaps counted once (hand-derived)."""

from ops.gpu_time import busy_us


def test_busy_time_counts_overlapping_kernels_once():
    # [0, 4) and [2, 5) overlap into [0, 5); [7, 8) is apart; [7.5, 7.75) lies inside it: 5 + 1.
    assert busy_us([(7.0, 8.0), (2.0, 5.0), (0.0, 4.0), (7.5, 7.75)]) == 6.0
    assert busy_us([]) == 0.0
