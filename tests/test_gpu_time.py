"""ops/gpu_time.py's busy time: the union of kernel intervals, overlaps counted once (hand-derived)."""

import dataclasses

import pytest

from ops.gpu_time import busy_us


def test_busy_time_counts_overlapping_kernels_once():
    # [0, 4) and [2, 5) overlap into [0, 5); [7, 8) is apart; [7.5, 7.75) lies inside it: 5 + 1.
    assert busy_us([(7.0, 8.0), (2.0, 5.0), (0.0, 4.0), (7.5, 7.75)]) == 6.0
    assert busy_us([]) == 0.0


def test_idle_gaps_are_bucketed_by_length_after_merging_overlaps():
    from ops.gpu_time import idle_gaps

    # Merged busy spans: [0, 5), [6, 8) (with [6.5, 7) inside), [11, 12), [40, 41), [300, 301).
    # Gaps: 1 (<2), 3 (2-5), 28 (20-100), 259 (>=100); none in 5-20.
    spans = [(300.0, 301.0), (0.0, 4.0), (2.0, 5.0), (6.0, 8.0), (6.5, 7.0), (11.0, 12.0), (40.0, 41.0)]
    assert idle_gaps(spans) == {"<2": [1, 1.0], "2-5": [1, 3.0], "5-20": [0, 0.0], "20-100": [1, 28.0],
                                ">=100": [1, 259.0]}


def test_tuning_override_names_launch_shape_fields_and_refuses_others():
    from ops.gpu_time import tuning_override

    assert tuning_override("waves=2,warps=1") == {"waves": 2, "warps": 1}
    assert tuning_override("") == {}
    for bad in ("waves", "waves=two", "lanes=8", "waves=-1", "waves=--1", "waves=2,waves=4"):
        with pytest.raises(ValueError, match="FIELD=INT"):
            tuning_override(bad)


def test_applied_override_replaces_only_its_fields_in_every_later_default(monkeypatch):
    import mlx.core as mx

    from kernels import cuda_kv
    from ops.gpu_time import apply_tuning_override
    from services.engine.cache.schemes import layer_format

    monkeypatch.setattr(cuda_kv, "default_tuning", cuda_kv.default_tuning)  # restored after the test
    fmt, before = layer_format("aura8v4", layer=0, dtype=mx.bfloat16, head_dim=64), cuda_kv.default_tuning
    assert apply_tuning_override("") == {} and cuda_kv.default_tuning is before
    assert apply_tuning_override("waves=2,slabs=1") == {"waves": 2, "slabs": 1}
    for rows in (1, 8, 512):  # few rows (four waves) and many (two)
        want = before(fmt, rows)
        assert want.slabs == 2  # a compressed layer's default: the override changes it
        assert cuda_kv.default_tuning(fmt, rows) == dataclasses.replace(want, waves=2, slabs=1)


def test_gap_neighbours_names_the_kernels_around_each_long_gap():
    from ops.gpu_time import gap_neighbours, short_name

    kernels = [(0.0, 4.0, "a"), (2.0, 9.0, "b"), (10.0, 12.0, "c"), (30.0, 31.0, "a"), (40.0, 41.0, "b"),
               (100.0, 101.0, "a"), (200.0, 201.0, "b")]
    # gaps >= 5 µs: b(ends 9) -> c starts 10 is 1 µs (not counted); c -> a 18; a -> b 9; b -> a 59; a -> b 99
    assert gap_neighbours(kernels) == [{"before": "a", "after": "b", "count": 2, "us": 108.0},
                                       {"before": "b", "after": "a", "count": 1, "us": 59.0},
                                       {"before": "c", "after": "a", "count": 1, "us": 18.0}]
    assert short_name("void mlx::core::cu::gemv_single<__nv_bfloat16, 8, 4>(x, y)") == "gemv_single<__nv_bfloat16, 8, 4>"
    assert short_name("mlx::core::cu::custom_kernel_bm_argmax_rows_float(x)") == "bm_argmax_rows_float"


def test_host_during_gaps_sums_each_host_event_inside_the_long_gaps_only():
    from ops.gpu_time import host_during_gaps

    kernels = [(0.0, 10.0), (5.0, 20.0), (150.0, 160.0), (170.0, 180.0), (400.0, 410.0)]
    # idle: 20-150 (130 µs, long), 160-170 (10, short), 180-400 (220, long)
    host = [(0.0, 30.0, "launch"),  # 10 µs inside 20-150
            (100.0, 200.0, "sync"),  # 50 inside 20-150, 20 inside 180-400 (not the short gap)
            (250.0, 260.0, "launch"),  # 10
            (162.0, 168.0, "free"),  # only inside the short gap
            (300.0, 450.0, "sync")]  # 100 (to 400)
    assert host_during_gaps(kernels, host) == [{"name": "sync", "count": 2, "us": 170.0},
                                               {"name": "launch", "count": 2, "us": 20.0}]
