"""ops/ncu_time.py's parsing of Nsight Compute's CSV into per-call and per-case times (hand-derived)."""

import pytest

from ops.ncu_time import call_times, parse_case, summarize

# The columns `ncu --csv --print-units base --metrics gpu__time_duration.sum` prints (quoted, commas inside).
HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')


def row(i: int, kernel: str, ns: str, metric: str = "gpu__time_duration.sum") -> str:
    name = f"custom_kernel_bm_paged_decode_{kernel}(const __nv_bfloat16 *, array<int, 10>, float *)"
    return (f'"{i}","847","python3.12","127.0.0.1","{name}","1","14","(64, 1, 1)","(4096, 8, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","ns","{ns}"\n')


def test_a_partial_starts_a_call_and_a_combine_joins_it():
    text = ("==PROF== Connected to process 847\n" + HEADER + row(0, "mma_coded_x", "30,000") + row(1, "combine_y", "5000")
            + row(2, "mma_final_z", "12000") + row(3, "mma_coded_x", "7", metric="other__metric")
            + "program output\n" + HEADER + row(4, "partial_w", "20,000") + row(5, "combine_y", "4000"))
    assert call_times(text) == [(30000.0, 5000.0), (12000.0, 0.0), (20000.0, 4000.0)]
    assert call_times("no csv here\n") == []
    with pytest.raises(ValueError, match="combine kernel before any partial"):
        call_times(HEADER + row(0, "combine_y", "5000"))


def test_each_case_is_the_median_of_its_calls_after_the_first():
    manifest = [{"case": "a", "calls": 4}, {"case": "b", "calls": 2}]
    calls = [(99e3, 9e3), (20e3, 4e3), (30e3, 5e3), (10e3, 6e3), (99e3, 0.0), (11e3, 0.0)]
    # a: partials 20, 30, 10 -> 20; combines 4, 5, 6 -> 5; totals 24, 35, 16 -> 24. b: its one timed call.
    assert summarize(manifest, calls) == {
        "a": {"partial_us": 20.0, "combine_us": 5.0, "total_us": 24.0},
        "b": {"partial_us": 11.0, "combine_us": 0.0, "total_us": 11.0}}
    with pytest.raises(ValueError, match="manifest lists 6 calls, the profile 5"):
        summarize(manifest, calls[:5])


def test_cases_name_model_scheme_context_and_launch_shape():
    assert parse_case("qwen3-1.7b:affine4:8192") == ("qwen3-1.7b", "affine4", 8192, {})
    assert parse_case("llama-1b:raw:512:warps=4/unroll=1") == ("llama-1b", "raw", 512, {"warps": 4, "unroll": 1})
    assert parse_case("llama-1b:aura5v3:512") == ("llama-1b", "aura5v3", 512, {})  # any aura{K}v{V}
    for bad in ("llama-1b:raw", "llama-1b:raw:8k", "llama-1b:raw:0", "llama-1b:raw:512:lanes=8", "gpt2:raw:512",
                "llama-1b:int4:512"):
        with pytest.raises(ValueError):
            parse_case(bad)
