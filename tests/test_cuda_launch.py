"""Launch plans of the CUDA partial kernels (pure Python: runs without a GPU).

The kernels declare their shared memory statically, and CUDA refuses a block over 48 KB: every plan
the launcher picks must fit. The bytes are recomputed here from the kernel sources' own arrays
(`kernels.cuda_source.PARTIAL`, `kernels.cuda_mma.PARTIAL_MMA`), not from the launcher's helpers.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re

import mlx.core as mx
import numpy as np
import pytest

from kernels import cuda_kv, cuda_mma, cuda_source, qkv_rope
from kernels.kv_format import AFFINE, AURA, LayerFormat, PartFormat
from services.engine.cache.schemes import layer_format

SCHEMES = ["raw", "affine8", "affine4", "aura8v4", "aura4v4", "aura4v2", "aura8v8"]
LIMIT = 48 * 1024


def fixed_bytes(fmt, group: int, centroid_bytes: int = 4) -> int:
    """`qs[G*D]` floats, `cbs` (2^KBITS + 2^VBITS AURA centroids, or 1: floats, or 16-bit T in the
    tensor-core kernel), `pids[256]` ints, `live` (an int, 16 bytes with alignment)."""
    cents = sum(1 << p.bits for p in (fmt.key, fmt.value) if p.kind == AURA)
    return 4 * (group * fmt.head_dim + 256) + centroid_bytes * max(cents, 1) + 16


def lane_words_whole(fmt) -> bool:
    """A tensor-core lane decodes head_dim / 4 dims of a key and head_dim / 8 of a value: whole words of
    codes, inside one affine group."""
    return all(span * p.bits % 32 == 0 and (p.kind != AFFINE or p.group_size % span == 0)
               for p, span in ((fmt.key, fmt.head_dim // 4), (fmt.value, fmt.head_dim // 8)))


@pytest.mark.parametrize("scheme, head_dim, group", list(itertools.product(SCHEMES, [64, 128], [1, 4, 8, 16])))
@pytest.mark.parametrize("page", [16, 5])
def test_tensor_core_plans_fit_shared_memory(scheme, head_dim, group, page):
    fmt = layer_format(scheme, layer=0, dtype=mx.bfloat16, head_dim=head_dim)
    for tuning, per_split in itertools.product([cuda_kv.Tuning(warps=w, unroll=u, stages=s, mma=True, slabs=c)
                                                for w, u, s, c in itertools.product([1, 2, 4], [1, 2], [2, 4], [1, 2])],
                                               [page, 128 + page, 8192]):
        plan = cuda_kv._mma_staging(fmt, mx.bfloat16, group, page, per_split, tuning)
        if not fmt.is_raw and not lane_words_whole(fmt):
            assert plan is None  # aura4v2 at head_dim 64: a lane's 8 value dims are 16 bits
            continue
        assert plan is not None, (tuning, per_split)
        args = dict(plan)
        # a warp's slabs never reach past a tile: whole slabs of every warp
        assert args["TT"] % (16 * tuning.slabs) == 0 and args["NS"] >= 2 and args["W"] == tuning.warps
        assert args["CH"] == tuning.slabs
        token = 2 * (head_dim + 8) * 2 if fmt.is_raw else 4 * fmt.row_words
        ring = args["NS"] * args["TT"] * token
        merge = args["W"] * group * (head_dim + 2) * 4
        assert fixed_bytes(fmt, group, centroid_bytes=2) + max(ring, merge) <= LIMIT, (tuning, args)
        if args["CG"] == 16:  # whole 16-byte copies: row groups inside a page, 16-byte aligned
            assert page % args["RG"] == 0 and (args["RG"] * token) % 16 == 0 or fmt.is_raw


@pytest.mark.parametrize("scheme, head_dim, group", [c for c in itertools.product(SCHEMES, [8, 64, 128, 256], [1, 4, 8, 32])
                                                     if c[1] * c[2] < 8192])  # the query alone: 32 KB at 256 x 32
def test_fma_plans_fit_shared_memory(scheme, head_dim, group):
    fmt = layer_format(scheme, layer=0, dtype=mx.bfloat16, head_dim=head_dim)
    for dims, warps, unroll, stages in itertools.product([8, 16], [4, 8], [1, 2], [0, 2, 4]):
        tuning = cuda_kv.Tuning(dims_per_lane=dims, unroll=unroll, warps=warps, stages=stages)
        lanes, w = cuda_kv._lanes_and_warps(fmt, group, tuning)
        args = dict(cuda_kv._staging(fmt, group, 16, 512, w * (32 // lanes) * unroll, tuning))
        parts, row = (2, head_dim * 2) if fmt.is_raw else (1, 4 * fmt.row_words)
        ring = args["NS"] * parts * args["TT"] * row
        merge = w * (32 // lanes) * group * (head_dim + 2) * 4
        assert fixed_bytes(fmt, group) + max(ring, merge) <= LIMIT, (tuning, args)
        assert args["TT"] % 4 == 0


def test_tensor_cores_serve_16_bit_queries_of_head_dim_64_or_128_and_up_to_16_heads_a_group():
    fmt = layer_format("raw", layer=0, dtype=mx.bfloat16, head_dim=64)
    plan = lambda fmt, dtype=mx.bfloat16, group=4: cuda_kv._mma_staging(  # noqa: E731
        fmt, dtype, group, 16, 512, cuda_kv.Tuning(mma=True, stages=4))
    assert plan(fmt) is not None
    assert plan(fmt, dtype=mx.float32) is None
    assert plan(fmt, group=17) is None
    assert plan(layer_format("affine4", layer=0, dtype=mx.bfloat16, head_dim=256)) is None
    assert plan(layer_format("affine4", layer=0, dtype=mx.bfloat16, head_dim=32)) is None
    assert plan(layer_format("raw", layer=0, dtype=mx.float16, head_dim=64)) is None  # raw K/V of another dtype
    # A lane decodes head_dim / 8 dims of a value: 2-bit codes fill a word at head_dim 128, not at 64.
    assert plan(layer_format("aura4v2", layer=0, dtype=mx.bfloat16, head_dim=64)) is None
    assert plan(layer_format("aura4v2", layer=0, dtype=mx.bfloat16, head_dim=128)) is not None


def test_gpus_before_ampere_load_straight_into_registers(monkeypatch):
    fmt = layer_format("aura4v4", layer=0, dtype=mx.bfloat16, head_dim=64)
    monkeypatch.setattr(cuda_kv, "_compute_capability", lambda: 7)
    old = cuda_kv.default_tuning(fmt, 8)
    assert not old.mma and old.stages == 0
    monkeypatch.setattr(cuda_kv, "_compute_capability", lambda: 9)
    new = cuda_kv.default_tuning(fmt, 8)
    assert new.mma and new.stages >= 2


@pytest.mark.parametrize("max_tokens, batch, want", [
    (8192, 32, (4096, 2)),  # 2 splits fill 32 x 8 heads x 2 >= 2 waves of 132 SMs
    (8448, 32, (2112, 4)),  # the cap (256 pages of 16) asks 3; rounded up to 4 equal splits, not 4096 + 4096 + 256
    (32768, 1, (1008, 33)),  # one row: 33 splits of 63 pages fill 2 waves with 8 heads
    (16, 64, (16, 1)),
])
def test_split_plan_hand_derived(max_tokens, batch, want):
    assert cuda_kv._split_plan(max_tokens, batch, 8, 16, 2) == want


@pytest.mark.parametrize("scheme, head_dim, rows, want", [
    ("raw", 64, 8, 512),  # 256 bytes a token (K and V, bf16): 128 KiB at 512 slots
    ("raw", 128, 8, 256),  # 512 bytes a token: 128 KiB at 256
    ("aura4v4", 128, 8, 768),  # 64 + 64 code bytes and 4 of meta: 992 under 128 KiB, capped at 768
    ("raw", 64, 256, 0),  # many rows: splits fill the GPU at every width
])
def test_default_one_split_width_hand_derived(monkeypatch, scheme, head_dim, rows, want):
    monkeypatch.setattr(cuda_kv, "_compute_capability", lambda: 9)
    fmt = layer_format(scheme, layer=0, dtype=mx.bfloat16, head_dim=head_dim)
    assert cuda_kv.default_tuning(fmt, rows).one_split_tokens == want


@pytest.mark.parametrize("scheme, head_dim, rows, warps, unroll, slabs, stages", [
    ("raw", 64, 8, 4, 1, 1, 4),  # raw tiles of 16 * warps tokens, three copied ahead
    ("raw", 128, 256, 2, 1, 1, 4),  # raw K and V tiles padded to 136 elements: two warps fit 48 KB
    ("aura4v4", 64, 256, 4, 2, 2, 2),  # compressed: a warp's two 16-token slabs at once, one tile copied ahead
    ("aura4v4", 64, 8, 2, 2, 2, 2),  # few rows: two warps a block
    ("aura4v4", 128, 8, 2, 2, 2, 2),
    ("aura4v4", 128, 256, 2, 2, 2, 2),  # head_dim 128: two warps over many rows too
    ("aura8v4", 128, 256, 2, 2, 2, 2),
    ("affine4", 128, 256, 2, 2, 2, 2),
])
def test_default_tiles_hand_derived(monkeypatch, scheme, head_dim, rows, warps, unroll, slabs, stages):
    monkeypatch.setattr(cuda_kv, "_compute_capability", lambda: 9)
    fmt = layer_format(scheme, layer=0, dtype=mx.bfloat16, head_dim=head_dim)
    tuning = cuda_kv.default_tuning(fmt, rows)
    got = (tuning.warps, tuning.unroll, tuning.slabs, tuning.stages, tuning.mma)
    assert got == (warps, unroll, slabs, stages, True)


def test_compressed_rows_keep_four_stages_where_the_fma_kernel_takes_them(monkeypatch):
    monkeypatch.setattr(cuda_kv, "_compute_capability", lambda: 9)
    fmt = layer_format("aura4v4", layer=0, dtype=mx.bfloat16, head_dim=64)
    assert cuda_kv._mma_serves(fmt, mx.bfloat16, 4) and not cuda_kv._mma_serves(fmt, mx.float32, 4)
    assert cuda_kv.default_tuning(fmt, 8).stages == 2  # the tensor-core kernel's ring (measured best)
    assert cuda_kv.default_tuning(fmt, 8, tensor_cores=False).stages == 4  # the FMA kernel's, as measured there
    raw = layer_format("raw", layer=0, dtype=mx.bfloat16, head_dim=64)
    assert cuda_kv.default_tuning(raw, 8).stages == cuda_kv.default_tuning(raw, 8, tensor_cores=False).stages == 4


@pytest.mark.parametrize("max_tokens, one_split_tokens, want", [
    (528, 768, (528, 1)),  # a 512-token row's bucketed table: one split, no combine
    (768, 768, (768, 1)),
    (769, 768, (32, 25)),  # past it, the fill's plan: 2 waves over 8 heads ask 33 splits, 769 / 33 -> 2 pages
    (8192, 8192, (256, 32)),  # one split holds 256 pages at most (4096 slots): the fill's plan, 16 pages each
])
def test_one_split_plan_hand_derived(max_tokens, one_split_tokens, want):
    assert cuda_kv._split_plan(max_tokens, 1, 8, 16, 2, one_split_tokens) == want


@pytest.mark.parametrize("batch", [1, 3, 17, 32, 64])
@pytest.mark.parametrize("page", [16, 5, 1])
@pytest.mark.parametrize("waves", [2, 4])
def test_split_plans_cover_rows_in_equal_capped_splits(batch, page, waves):
    for max_tokens in range(page, 40_000, 997 * page):
        per_split, splits = cuda_kv._split_plan(max_tokens, batch, 8, page, waves)
        assert per_split % page == 0 and per_split <= cuda_kv._MAX_SPLIT_PAGES * page
        assert (splits - 1) * per_split < max_tokens <= splits * per_split  # every split holds slots
        last = max_tokens - (splits - 1) * per_split
        assert splits == 1 or last > per_split - splits * page  # no sliver: equal up to page rounding
        # the kernels read a split's width from the table's pages and the grid's splits, not from memory
        assert per_split == page * -(-(max_tokens // page) // splits)


@pytest.mark.parametrize("x, bits", [(1.0, 0x3F800000), (-2.0, -0x40000000), (0.5, 0x3F000000), (0.0, 0)])
def test_float_template_constants_are_float32_bits(x, bits):
    assert cuda_kv._float_bits(x) == bits  # IEEE 754 binary32, read back by `__int_as_float` in the kernels


def test_compact_drops_comments_and_indentation_but_not_strings_or_pragmas():
    source = '  // a comment\n#pragma unroll\n  for (int i = 0; i < 4; ++i) x += i;  // trailing\n\n' \
             '  asm volatile("mov.u32 %0, 1; // not a comment\\n" : "=r"(y));\n'
    assert cuda_source.compact(source) == ('#pragma unroll\nfor (int i = 0; i < 4; ++i) x += i;\n'
                                           'asm volatile("mov.u32 %0, 1; // not a comment\\n" : "=r"(y));\n')


@pytest.mark.parametrize("source", ["a /* b */ c;", "c = '\"';", "x; // y \\\nz;"])
def test_compact_refuses_what_a_line_scan_cannot_strip(source):
    with pytest.raises(ValueError):
        cuda_source.compact(source)


HELPER_SETS = [
    ("COMBINE", {"fwht_warp"}),  # its un-rotation of AURA values, within a warp
    ("ENCODE", {"encode_part", "encode_warps", "part_sync", "slice_dim", "fwht_warp", "table_floats"}),
    ("qkv", {"encode_part", "part_sync", "slice_dim", "fwht_warp", "table_floats"}),  # WD, WG: template arguments
    ("PARTIAL_MMA", {"cp_async", "cp_async_commit", "cp_async_wait", "fast_exp2", "fwht_warp",
                     "merge_at", "merge_states", "stage_block"}),  # not the FMA kernel's slices, encoder, combine's
    ("PARTIAL", {"Slice", "slice_words", "fetch_slice", "decode_slice", "code_float", "cp_async", "cp_async_commit",
                 "cp_async_wait", "fast_exp2", "fwht_warp", "merge_at", "merge_states", "stage_block"}),
    ("PARTIAL_final", {"Slice", "slice_words", "fetch_slice", "decode_slice", "code_float", "cp_async",
                       "cp_async_commit", "cp_async_wait", "fast_exp2", "fwht_warp", "fwht_shared", "merge_at",
                       "merge_final", "stage_block"}),  # one split: output un-rotated in place, no partials
]


@pytest.mark.parametrize("kernel, want", HELPER_SETS)
def test_each_kernel_gets_the_helpers_it_calls_and_their_callees(kernel, want):
    source = {"PARTIAL_MMA": cuda_mma.MMA_HEADER + cuda_mma.PARTIAL_MMA,
              "qkv": qkv_rope._source(qkv_rope._CODE) + qkv_rope._ENCODE,
              "PARTIAL_final": cuda_kv.final_source(cuda_source.PARTIAL)}.get(kernel) or getattr(cuda_source, kernel)
    header = cuda_source.kernel_header(source)
    every = set().union(*(w for _, w in HELPER_SETS))  # HEADER's helpers, by hand
    defined = {n for n in every if re.search(rf"^(struct |__\w+__ .*\b){n}\b", header, re.M)}
    called = {n for n in every if re.search(rf"\b{n}\s*[(<]", header + cuda_source.compact(source))}
    assert defined == want and called <= defined  # what it calls, and what those call, and nothing else


def test_final_source_swaps_the_one_partials_write_and_refuses_others():
    for source in (cuda_source.PARTIAL, cuda_mma.PARTIAL_MMA):
        final = cuda_kv.final_source(source)
        assert "merge_states" not in final and final.count("merge_final<T, D, G, ") == 1
        assert final.count("cb + 512 + D, out);") == 1
    with pytest.raises(ValueError, match="found 0"):
        cuda_kv.final_source(cuda_source.COMBINE)


@pytest.mark.parametrize("key_aura, value_aura", [(False, True), (True, False), (True, True), (False, False)])
def test_codec_constants_put_each_parts_table_where_the_kernels_read_it(key_aura, value_aura):
    """The encoder kernels read key signs at 0, value signs at D, the key's search table at 2 D and the
    value's at 2 D + KT, KT = (2 << bits) + 9 for an AURA key and 0 otherwise (`table_floats`): checked
    for every mix of AURA and affine parts against the parts' own signs and tables."""
    d = 64
    key = PartFormat(AURA, 8, seed=11) if key_aura else PartFormat(AFFINE, 8, 64)
    value = PartFormat(AURA, 4, seed=12) if value_aura else PartFormat(AFFINE, 4, 32)
    got = np.array(cuda_kv.codec_constants(LayerFormat(key, value, d, d), d))

    def signs(part):
        return np.array(part.rotation(d).signs) if part.kind == AURA else np.ones(d)

    kt = (2 << key.bits) + 9 if key_aura else 0
    vt = (2 << value.bits) + 9 if value_aura else 0
    assert got.shape == (2 * d + kt + vt,)
    np.testing.assert_array_equal(got[:d], signs(key))
    np.testing.assert_array_equal(got[d : 2 * d], signs(value))
    if key_aura:
        np.testing.assert_array_equal(got[2 * d : 2 * d + kt], cuda_kv.search_table(key.bits))
    if value_aura:
        np.testing.assert_array_equal(got[2 * d + kt :], cuda_kv.search_table(value.bits))


def _included_text(line: str) -> str:
    """The text of the file an `#include "path"` line names."""
    match = re.fullmatch(r'#include "([^"]+)"\n', line)
    assert match, line
    with open(match.group(1)) as f:
        return f.read()


@pytest.fixture
def source_folder(monkeypatch, tmp_path):
    """`source_dir` fresh, choosing `tmp_path / "data" / "cuda"` (buttermilk's data folder) in this test."""
    monkeypatch.setenv("BUTTERMILK_DATA_DIR", str(tmp_path / "data"))
    cuda_kv.source_dir.cache_clear()
    yield tmp_path / "data" / "cuda"
    cuda_kv.source_dir.cache_clear()


def test_custom_kernel_hands_mlx_include_lines_of_the_compacted_text(monkeypatch, source_folder):
    seen = {}
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: seen.update(kw))
    body = "  // the row, not v_shape\n  int n = kp_shape[0] + q_ndim;  // lengths\n  out[0] = fwht_warp(n, 1);\n"
    header = "__device__ int extra(int x) { return x; }  // own helper, not q_strides\n"
    cuda_kv.custom_kernel("bm_probe", body, header, input_names=["q", "p", "kp", "v"], output_names=["out"])
    first, listed = seen["source"].split("\n", 1)
    digest = hashlib.sha256(cuda_source.compact(body).encode()).hexdigest()[:32]
    assert first == f'#include "{source_folder}/bm_{digest}.cuh"'
    assert _included_text(first + "\n") == cuda_source.compact(body)
    assert _included_text(seen["header"]) == cuda_source.kernel_header(header + body) + cuda_source.compact(header)
    # MLX passes an input's shape, strides or ndim where the source it is handed holds `<name>_shape` ...: the
    # compiled body's names (a substring search: p_shape is in kp_shape), not a comment's, not the header's
    compiled = cuda_source.compact(body)
    for name in ("q", "p", "kp", "v"):
        for part in ("_shape", "_strides", "_ndim"):
            assert (name + part in seen["source"]) == (name + part in compiled), name + part
    assert listed == "// q_ndim p_shape kp_shape\n"


def test_source_files_are_named_by_content_and_inline_where_no_folder_serves(monkeypatch, tmp_path):
    monkeypatch.setattr(cuda_kv, "source_dir", lambda: tmp_path)
    a, b = cuda_kv.source_file("int a;\n"), cuda_kv.source_file("int b;\n")
    assert a != b and cuda_kv.source_file("int a;\n") == a and _included_text(b) == "int b;\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(re.findall(r"bm_\w+\.cuh", a + b))  # no temporaries
    assert cuda_kv.source_file("") == ""
    path = re.search(r'"(.+)"', a).group(1)
    with open(path, "w") as f:
        f.write("int a")  # cut short (a crash before a rename would not do it, a full disk may)
    assert cuda_kv.source_file("int a;\n") == a and _included_text(a) == "int a;\n"  # found wrong, rewritten
    monkeypatch.setattr(cuda_kv, "source_dir", lambda: None)
    assert cuda_kv.source_file("int a;\n") == "int a;\n"


def test_source_file_falls_back_to_inline_text_when_its_write_fails(monkeypatch, tmp_path):
    monkeypatch.setattr(cuda_kv, "source_dir", lambda: tmp_path / "gone")  # removed after it was chosen
    assert cuda_kv.source_file("int a;\n") == "int a;\n"


def test_source_file_from_many_threads_at_once(monkeypatch, tmp_path):
    import concurrent.futures

    monkeypatch.setattr(cuda_kv, "source_dir", lambda: tmp_path)
    texts = [f"int x{i % 4};\n" for i in range(64)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        lines = list(pool.map(cuda_kv.source_file, texts))
    assert all(_included_text(line) == text for line, text in zip(lines, texts))
    assert len(list(tmp_path.iterdir())) == 4


def test_source_dir_takes_the_first_folder_that_serves(monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where a folder would be: mkdir fails
    shared = tmp_path / "shared"
    (shared / "cuda").mkdir(parents=True)
    (shared / "cuda").chmod(0o777)  # others may write there: a planted file would be compiled
    temp = tmp_path / "tmp"
    fallback = temp / f"buttermilk-cuda-{os.getuid()}"
    monkeypatch.setattr(cuda_kv.tempfile, "gettempdir", lambda: str(temp))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cases = [  # $BUTTERMILK_DATA_DIR -> chosen
        (str(tmp_path / "data"), tmp_path / "data" / "cuda"),
        (None, tmp_path / "home" / ".cache" / "buttermilk" / "cuda"),
        ("", tmp_path / "home" / ".cache" / "buttermilk" / "cuda"),
        (str(blocked / "sub"), fallback),
        (str(tmp_path / 'a"b'), fallback),  # a quote: no include line can name it
        (str(tmp_path / "k_shape"), fallback),  # MLX would pass k's shape to every kernel with an input k
        (str(shared), fallback),
    ]
    for env, want in cases:
        if env is None:
            monkeypatch.delenv("BUTTERMILK_DATA_DIR", raising=False)
        else:
            monkeypatch.setenv("BUTTERMILK_DATA_DIR", env)
        cuda_kv.source_dir.cache_clear()
        try:
            assert cuda_kv.source_dir() == want, env
        finally:
            cuda_kv.source_dir.cache_clear()
    assert fallback.stat().st_mode & 0o077 == 0  # made for this user alone


def test_source_dir_without_a_home(monkeypatch, tmp_path):
    monkeypatch.delenv("BUTTERMILK_DATA_DIR", raising=False)
    monkeypatch.setattr(cuda_kv.Path, "expanduser", lambda self: (_ for _ in ()).throw(RuntimeError("no home")))
    monkeypatch.setattr(cuda_kv.tempfile, "gettempdir", lambda: str(tmp_path))
    cuda_kv.source_dir.cache_clear()
    try:
        assert cuda_kv.source_dir() == tmp_path / f"buttermilk-cuda-{os.getuid()}"
    finally:
        cuda_kv.source_dir.cache_clear()
