"""Attention over page pools (kernels.paged_attention) against a float64 NumPy reference.

The reference decodes the stored rows with the independent bit-stream and codebook code of
`kernels.reference` and computes softmax attention in float64 (GQA by head repetition,
attention sinks as an extra logit with a zero value). Pools start filled with NaN, so any
slot outside a row's live ones that were read and multiplied would poison the output.

On a CUDA machine every case runs the fused kernels and the MLX-ops path; elsewhere the MLX-ops
path (what CI runs). Decode covers every scheme x head_dim {64, 128, 256} x group {1, 4, 8} over
ragged batches of 3, 4 and 17 rows at page edges, every AURA width pair, and rows of 4,095 /
4,097 / 33,000 slots; `BM_ATTENTION_FULL=1` adds a 33,000-slot row to every scheme x head_dim x
group (12 minutes on 2 CPU cores; the H200 run uses it).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
import sys

import mlx.core as mx
import numpy as np
import pytest

from kernels import cuda_kv
from kernels import paged_attention as pa
from kernels import reference as ref
from kernels.aura import aura_codebook
from kernels.kv_format import AFFINE, AURA, RAW, LayerFormat, PartFormat
from kernels.latent_attention import latent_mask, latent_operands
from kernels.rotation import hadamard_signs

FULL = os.environ.get("BM_ATTENTION_FULL") == "1"
ON_CUDA = cuda_kv.is_available()
PAGE = 16
SCHEMES = {
    "raw": lambda dt: (PartFormat(RAW, 8 * dt.size, dtype=dt),) * 2,
    "affine8": lambda dt: (PartFormat(AFFINE, 8, 64, dtype=dt),) * 2,
    "affine4": lambda dt: (PartFormat(AFFINE, 4, 32, dtype=dt),) * 2,
    "affine6": lambda dt: (PartFormat(AFFINE, 6, 64, dtype=dt),) * 2,
    "affine2": lambda dt: (PartFormat(AFFINE, 2, 32, dtype=dt),) * 2,
    "aura8v4": lambda dt: (PartFormat(AURA, 8, seed=11, dtype=dt), PartFormat(AURA, 4, seed=12, dtype=dt)),
    "aura4v4": lambda dt: (PartFormat(AURA, 4, seed=21, dtype=dt), PartFormat(AURA, 4, seed=22, dtype=dt)),
    "aura4v2": lambda dt: (PartFormat(AURA, 4, seed=31, dtype=dt), PartFormat(AURA, 2, seed=32, dtype=dt)),
    "aura3v5": lambda dt: (PartFormat(AURA, 3, seed=41, dtype=dt), PartFormat(AURA, 5, seed=42, dtype=dt)),
    "aura9v10": lambda dt: (PartFormat(AURA, 9, seed=51, dtype=dt), PartFormat(AURA, 10, seed=52, dtype=dt)),
}
DTYPE = mx.bfloat16 if ON_CUDA else mx.float32


def decode_part_ref(part: PartFormat, codes: np.ndarray, meta: np.ndarray, head_dim: int) -> np.ndarray:
    """float64 vectors [..., D] of one part, from its codes [..., words] and float16 meta [..., m]."""
    if part.kind == AFFINE:
        groups = -(-head_dim // part.group_size)  # a tail group when group_size does not divide head_dim
        return ref.affine_dequantize_ref(codes, meta[..., :groups], meta[..., groups:], part.bits, part.group_size,
                                         head_dim)
    index = ref.unpack_bits_ref(codes, part.bits, head_dim)
    codebook = np.array(aura_codebook(part.bits), np.float64)
    return ref.aura_decode_ref(index, meta[..., :1].astype(np.float64), hadamard_signs(head_dim, part.seed), codebook)


def decode_rows_ref(fmt: LayerFormat, pools: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
    """K, V float64 [..., D] (model domain) of rows [..., width], independently of kv_format."""
    if fmt.is_raw:
        return pools[0].astype(np.float64), pools[1].astype(np.float64)
    rows = pools[0]
    meta = rows[..., fmt.meta_offset :].copy().view(np.float16).astype(np.float64)
    keys = decode_part_ref(fmt.key, rows[..., : fmt.key_words], meta[..., : fmt.key_meta_halves], fmt.key_dim)
    values = decode_part_ref(fmt.value, rows[..., fmt.key_words : fmt.meta_offset],
                             meta[..., fmt.key_meta_halves : fmt.key_meta_halves + fmt.value_meta_halves],
                             fmt.value_dim)
    return keys, values


def attention_ref(q, keys, values, scale, visible, sinks=None):
    """float64 softmax attention of q [Hq, L, Dk] over keys [H, T, Dk] and values [H, T, Dv]; visible [L, T]."""
    reps = q.shape[0] // keys.shape[0]
    k, v = np.repeat(keys, reps, axis=0), np.repeat(values, reps, axis=0)
    scores = np.where(visible[None], scale * q @ k.swapaxes(-1, -2), -np.inf)
    top = scores.max(-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, sinks[:, None, None])
    weights = np.exp(scores - top)
    total = weights.sum(-1, keepdims=True) + (0 if sinks is None else np.exp(sinks[:, None, None] - top))
    return (weights / total) @ v


def as_np(a: mx.array) -> np.ndarray:
    if a.dtype in (mx.float16, mx.bfloat16, mx.float32):
        return np.array(a.astype(mx.float32))
    return np.array(a)


class Store:
    """A NaN-filled pool with random pages given to B rows of ragged lengths (tables padded with a NaN page)."""

    def __init__(self, fmt: LayerFormat, lengths, n_kv_heads: int, seed: int):
        self.fmt, self.lengths, self.heads = fmt, list(lengths), n_kv_heads
        rng = np.random.default_rng(seed)
        pages_per_row = [max(1, -(-n // PAGE)) for n in lengths]
        self.num_pages = sum(pages_per_row) + 3
        order = rng.permutation(self.num_pages)
        self.tables, used = [], 0
        for n in pages_per_row:
            self.tables.append(order[used : used + n])
            used += n
        rows = n_kv_heads * self.num_pages * PAGE
        self.pools = [_nan_pool(rows, width, dtype) for width, dtype in fmt.pool_specs()]
        self.stored = []  # per row, the pool rows [H, T, width] as numpy
        for b, n in enumerate(lengths):
            shape = (1, n_kv_heads, n)
            k = mx.array(rng.standard_normal((*shape, fmt.key_dim)).astype(np.float32) * 2).astype(DTYPE)
            v = mx.array(rng.standard_normal((*shape, fmt.value_dim)).astype(np.float32)).astype(DTYPE)
            new = fmt.encode(k, v)
            slots = np.arange(n)
            flat = (np.arange(n_kv_heads)[:, None] * self.num_pages + self.tables[b][slots // PAGE][None]) * PAGE
            flat = mx.array((flat + slots % PAGE).reshape(-1).astype(np.int32))
            for i, x in enumerate(new):
                self.pools[i][flat] = x.reshape(-1, x.shape[-1])
            self.stored.append(tuple(as_np(x[0]) for x in new))
        width = max(map(len, self.tables))
        spare = order[used]  # a page no row owns: NaN, so reading a table's padding would show
        self.page_table = np.stack([np.pad(t, (0, width - len(t)), constant_values=spare) for t in self.tables])

    def ref(self) -> pa.PoolRef:
        return pa.PoolRef(self.fmt, tuple(self.pools), self.heads, PAGE, None if self.tails is None else tuple(self.tails))

    tails = None

    def move_last_pages_to_tail(self) -> None:
        """Copy each row's last page into a NaN-filled tail pool (page b of it) and point the table there,
        as a decode window does; the main copy is then poisoned with NaN to prove it is not read."""
        rows = len(self.tables)
        self.tails = [_nan_pool(self.heads * (rows + 1) * PAGE, p.shape[1], p.dtype) for p in self.pools]
        for b, table in enumerate(self.tables):
            last = len(table) - 1
            main = (np.arange(self.heads)[:, None] * self.num_pages + table[last]) * PAGE + np.arange(PAGE)
            tail = (np.arange(self.heads)[:, None] * (rows + 1) + b) * PAGE + np.arange(PAGE)
            main, tail = mx.array(main.reshape(-1).astype(np.int32)), mx.array(tail.reshape(-1).astype(np.int32))
            for i, pool in enumerate(self.pools):
                self.tails[i][tail] = pool[main]
                pool[main] = _nan_pool(main.size, pool.shape[1], pool.dtype)
            self.page_table[b, last] = self.num_pages + b


def _nan_pool(rows: int, width: int, dtype: mx.Dtype) -> mx.array:
    if dtype == mx.uint32:  # NaN float16 meta in every half, garbage codes
        return mx.full((rows, width), 0x7E007E00, dtype=mx.uint32)
    return mx.full((rows, width), float("nan"), dtype=dtype)


IMPLEMENTATIONS = ("mlx-ops", "cuda") if ON_CUDA else ("mlx-ops",)


def implementations(fmt: LayerFormat) -> tuple[str, ...]:
    """The paths that serve `fmt` here (the CUDA kernels take regular formats only)."""
    return tuple(i for i in IMPLEMENTATIONS if i != "cuda" or fmt.is_regular)


def run_decode(store: Store, q: mx.array, scale: float, sinks, impl: str):
    table, lengths = mx.array(store.page_table.astype(np.int32)), mx.array(np.array(store.lengths, np.int32))
    if impl == "cuda":
        tails = None if store.tails is None else tuple(store.tails)
        return cuda_kv.decode_attention(q, store.fmt, tuple(store.pools), tails, table, lengths,
                                        n_kv_heads=store.heads, page_size=PAGE, scale=scale, sinks=sinks)
    return pa._attend_chunks(q, store.ref(), pa.History(lengths, table), None, None, scale=scale, sinks=sinks)


def tolerance() -> float:
    return 2e-2 if DTYPE == mx.bfloat16 else 1e-5


def relative() -> float:
    """Relative tolerance on top of `tolerance()`: a bf16 output keeps 8 significant bits (half an ulp is
    2^-8 of it), and the tensor-core kernel feeds P to its products in bf16 (one more 2^-9 a term);
    2^-7 of an output of 3.27 is one bf16 ulp more than the absolute 0.02 allows (seen at head_dim 128,
    8 query heads a kv head, 2-bit values)."""
    return 2.0**-7 if DTYPE == mx.bfloat16 else 1e-7


def layer_format(scheme: str, dims) -> LayerFormat:
    """`scheme`: a name of `SCHEMES`, or any `aura{K}v{V}`; `dims`: head_dim, or (key width, value width)."""
    key_dim, value_dim = dims if isinstance(dims, tuple) else (dims, dims)
    if scheme in SCHEMES:
        return LayerFormat(*SCHEMES[scheme](DTYPE), key_dim, value_dim)
    key_bits, value_bits = map(int, re.fullmatch(r"aura(\d+)v(\d+)", scheme).groups())
    return LayerFormat(PartFormat(AURA, key_bits, seed=60 + key_bits, dtype=DTYPE),
                       PartFormat(AURA, value_bits, seed=70 + value_bits, dtype=DTYPE), key_dim, value_dim)


DECODE_CASES = [
    # scheme, head_dim (or key and value widths), group (query heads per kv head), lengths, sinks
    ("raw", 64, 4, (1, 15, 16, 17, 33), False),
    ("affine8", 64, 1, (31, 32, 100), True),
    ("affine4", 128, 4, (1, 47, 300), False),
    ("affine6", 64, 8, (5, 64, 65), False),
    ("affine2", 64, 4, (1, 33, 300), True),  # four codes a byte, two groups a head
    ("affine8", 128, 8, (1, 129), False),  # one code a byte, two groups a head
    ("aura8v4", 64, 4, (16, 17), False),
    ("aura4v4", 128, 8, (1, 2, 700), True),
    ("aura4v2", 64, 1, (3, 33, 129), False),
    ("aura3v5", 256, 4, (1, 200), False),
    ("aura9v10", 64, 4, (1, 17, 33), True),  # codebooks over 256 centroids: the MLX-ops path everywhere
    # more than 8 query heads a kv head: the tensor-core kernel keeps both halves of its 16-row tiles
    ("affine4", 64, 16, (1, 40, 300), False),
    ("aura4v4", 128, 12, (17, 300), True),
    # beyond llama's geometry: Hadamard orders 20 * 4 and 12 * 8, codes padded to whole words
    # (80 x 3 bits), affine tail groups (80 at 32 and 64: 16; 96 at 64: 32), keys wider than values
    ("aura4v4", 80, 4, (1, 17, 40), True),
    ("aura3v5", 80, 2, (9, 100), False),
    ("aura4v2", 96, 1, (3, 33), False),
    ("affine4", 80, 2, (5, 33), False),
    ("affine8", 96, 4, (1, 70), True),
    ("raw", (192, 128), 4, (1, 30), True),
    ("aura8v4", (192, 128), 1, (16, 50), False),
    ("affine6", (192, 128), 2, (3, 65), False),
]
# Every scheme x head_dim {64, 128, 256} x group {1, 4, 8}, over ragged rows at page edges (batches of 4, 3, 17)
LENGTH_SETS = (((1, 15, 16, 17), False), ((31, 33, 1000), True), (tuple((1 + 37 * i) % 300 + 1 for i in range(17)), True))
DECODE_CASES += [(s, d, g, lengths, sinks) for s, d, g in itertools.product(SCHEMES, (64, 128, 256), (1, 4, 8))
                 for lengths, sinks in LENGTH_SETS]
# Every AURA key x value width, one row, and rows longer than the MLX-ops path's chunk (4,096 slots)
DECODE_CASES += [(f"aura{k}v{v}", 64, 4, (1, 17, 33), True) for k, v in itertools.product(range(2, 9), repeat=2)]
DECODE_CASES += [(s, 64, 4, (33,), True) for s in ("raw", "affine4", "aura4v4")]  # one row
DECODE_CASES += [(s, 64, 4, (4095, 4097, 33000), True) for s in ("raw", "affine4", "aura4v4")]  # 9 chunks, some masked
if FULL:
    DECODE_CASES += [(s, d, g, (33000,), False) for s, d, g in itertools.product(SCHEMES, (64, 128, 256), (1, 4, 8))]


@pytest.mark.parametrize("scheme, head_dim, group, lengths, with_sinks", DECODE_CASES)
def test_decode_matches_float64_reference(scheme, head_dim, group, lengths, with_sinks):
    fmt = layer_format(scheme, head_dim)
    heads = 2
    store = Store(fmt, lengths, heads, seed=fmt.key_dim + group + len(lengths))
    rng = np.random.default_rng(7)
    q = mx.array(rng.standard_normal((len(lengths), heads * group, 1, fmt.key_dim)).astype(np.float32)).astype(DTYPE)
    sinks = mx.array(rng.standard_normal(heads * group).astype(np.float32)) if with_sinks else None
    scale = 1 / math.sqrt(fmt.key_dim)
    for impl in implementations(fmt):
        got = as_np(run_decode(store, q, scale, sinks, impl))
        assert np.isfinite(got).all(), impl
        for b, n in enumerate(lengths):
            keys, values = decode_rows_ref(fmt, store.stored[b])
            want = attention_ref(as_np(q[b]).astype(np.float64), keys, values, scale,
                                 np.ones((1, n), bool), None if sinks is None else as_np(sinks).astype(np.float64))
            np.testing.assert_allclose(got[b], want, atol=tolerance(), rtol=relative(), err_msg=f"{impl} row {b}")


TUNINGS = [cuda_kv.Tuning(), cuda_kv.Tuning(8, 2, 4, 2, False), cuda_kv.Tuning(16, 1, 4, 2, True),
           cuda_kv.Tuning(16, 2, 4, 8, False), cuda_kv.Tuning(8, 4, 8, 1, False),
           cuda_kv.Tuning(8, 1, 4, 2, True, True), cuda_kv.Tuning(16, 1, 4, 2, True, True),
           cuda_kv.Tuning(8, 2, 4, 8, False, True),
           cuda_kv.Tuning(8, 1, 4, 4, True, stages=4), cuda_kv.Tuning(16, 2, 4, 2, False, stages=3, stage_bytes=4096),
           cuda_kv.Tuning(8, 2, 8, 8, True, stages=2, stage_bytes=1024),
           cuda_kv.Tuning(8, 1, 4, 1, True, stages=4, stage_bytes=1 << 16),
           cuda_kv.Tuning(warps=4, stages=4, mma=True), cuda_kv.Tuning(unroll=2, warps=2, waves=16, stages=2, mma=True),
           cuda_kv.Tuning(warps=1, stages=3, mma=True), cuda_kv.Tuning(unroll=2, warps=4, stages=4, mma=True, slabs=2),
           cuda_kv.Tuning(unroll=1, warps=2, waves=16, stages=3, mma=True, slabs=2),
           cuda_kv.Tuning(unroll=2, warps=4, stages=4, mma=True, slabs=2, register_tables=True),
           cuda_kv.Tuning(warps=2, stages=3, mma=True, register_tables=True),
           cuda_kv.Tuning(unroll=2, warps=2, stages=4, mma=True, slabs=2, register_tables=True, page_copies=False)]


def tuning_id(t: cuda_kv.Tuning) -> str:
    shape = f"d{t.dims_per_lane}u{t.unroll}w{t.warps}v{t.waves}q{int(t.query_in_registers)}"
    if t.mma:
        return (f"mma-u{t.unroll}w{t.warps}v{t.waves}s{t.stages}c{t.slabs}" + "-regs" * t.register_tables
                + "-rowcopies" * (not t.page_copies))
    return f"staged-{shape}s{t.stages}b{t.stage_bytes}" if t.stages else f"direct-{shape}p{int(t.prefetch)}"


@pytest.mark.skipif(not ON_CUDA, reason="launch shapes exist only for the CUDA kernel, which needs MLX's CUDA backend (the H200 run covers it)")
@pytest.mark.parametrize("tuning", TUNINGS, ids=tuning_id)
@pytest.mark.parametrize("scheme, head_dim, group", [("raw", 64, 4), ("affine4", 128, 2), ("aura4v4", 64, 4),
                                                     ("aura8v4", 128, 8), ("affine6", 256, 1)])
def test_every_launch_shape_matches_float64_reference(tuning, scheme, head_dim, group):
    """Unrolled tokens, wide lanes, many splits (the combine merging them in parallel): same attention."""
    fmt = layer_format(scheme, head_dim)
    lengths = (1, 17, 300, 2049)
    store = Store(fmt, lengths, 2, seed=head_dim + group)
    rng = np.random.default_rng(11)
    q = mx.array(rng.standard_normal((len(lengths), 2 * group, 1, head_dim)).astype(np.float32)).astype(DTYPE)
    sinks = mx.array(rng.standard_normal(2 * group).astype(np.float32))
    scale = 1 / math.sqrt(head_dim)
    table, lens = mx.array(store.page_table.astype(np.int32)), mx.array(np.array(lengths, np.int32))
    got = as_np(cuda_kv.decode_attention(q, fmt, tuple(store.pools), None, table, lens, n_kv_heads=2, page_size=PAGE,
                                         scale=scale, sinks=sinks, tuning=tuning))
    for b, n in enumerate(lengths):
        keys, values = decode_rows_ref(fmt, store.stored[b])
        want = attention_ref(as_np(q[b]).astype(np.float64), keys, values, scale, np.ones((1, n), bool),
                             as_np(sinks).astype(np.float64))
        np.testing.assert_allclose(got[b], want, atol=tolerance(), rtol=relative(), err_msg=f"row {b}")


def assert_launches_equal(scheme: str, head_dim: int, group: int, before: cuda_kv.Tuning, after: cuda_kv.Tuning,
                          seed: int) -> None:
    """Two launch shapes of the tensor-core kernel give the same output bit for bit, and `after`'s is within the
    float64 reference's tolerance: rows of 1 to 2,049 tokens (ending mid-page) over NaN-filled pools."""
    fmt = layer_format(scheme, head_dim)
    lengths = (1, 17, 300, 2049)
    store = Store(fmt, lengths, 2, seed=head_dim + group)
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((len(lengths), 2 * group, 1, head_dim)).astype(np.float32)).astype(DTYPE)
    table, lens = mx.array(store.page_table.astype(np.int32)), mx.array(np.array(lengths, np.int32))
    scale = 1 / math.sqrt(head_dim)
    old, new = (as_np(cuda_kv.decode_attention(q, fmt, tuple(store.pools), None, table, lens, n_kv_heads=2,
                                               page_size=PAGE, scale=scale, tuning=t)) for t in (before, after))
    np.testing.assert_array_equal(new, old)
    for b, n in enumerate(lengths):
        keys, values = decode_rows_ref(fmt, store.stored[b])
        want = attention_ref(as_np(q[b]).astype(np.float64), keys, values, scale, np.ones((1, n), bool))
        np.testing.assert_allclose(new[b], want, atol=tolerance(), rtol=relative(), err_msg=f"row {b}")


TWO_LAUNCHES = ("compares two launches of the CUDA tensor-core kernel, which exists only under MLX's CUDA backend "
                "and CI has no GPU; these passed on GPU hosts (gpu_tests in ops/results/"
                "kernel_sweep_gpu_h100_2026-12-07_register_tables.json and page_copies_gpu_h200_2026-12-07.json)")


@pytest.mark.skipif(not ON_CUDA, reason=TWO_LAUNCHES)
@pytest.mark.parametrize("scheme, head_dim, group", [("aura8v4", 64, 4), ("aura4v4", 64, 4), ("aura8v8", 128, 8),
                                                     ("aura4v4", 128, 16), ("aura4v8", 64, 1), ("aura8v4", 128, 2)])
def test_register_table_lookups_equal_the_shared_table(scheme, head_dim, group):
    """`Tuning.register_tables` (4-bit codebooks in registers, picked by byte permutes; 8-bit keys at an address
    formed by one OR) hands the tensor cores the same centroids as a load from the shared-memory table."""
    shared = cuda_kv.Tuning(unroll=2, warps=2, stages=4, mma=True, slabs=2)
    assert_launches_equal(scheme, head_dim, group, shared, dataclasses.replace(shared, register_tables=True), seed=13)


@pytest.mark.skipif(not ON_CUDA, reason=TWO_LAUNCHES)
@pytest.mark.parametrize("tuning", [cuda_kv.Tuning(unroll=2, warps=2, stages=4, mma=True, slabs=2),
                                    cuda_kv.Tuning(warps=4, stages=3, mma=True)], ids=["tile64w2", "tile64w4"])
@pytest.mark.parametrize("scheme, head_dim, group", [("raw", 64, 4), ("raw", 128, 2), ("aura8v4", 64, 4),
                                                     ("aura4v4", 128, 8), ("affine4", 64, 1), ("affine8", 128, 4)])
def test_page_copies_equal_row_group_copies(tuning, scheme, head_dim, group):
    """`Tuning.page_copies` (a thread group a page, the pool row found once a page, the last live page copied whole)
    stages the same live rows as copies that look up a pool row each (the rows past a row's end that a whole page
    brings in are masked)."""
    assert_launches_equal(scheme, head_dim, group, dataclasses.replace(tuning, page_copies=False),
                          dataclasses.replace(tuning, page_copies=True), seed=17)


@pytest.mark.skipif(not ON_CUDA, reason="the staged copies exist only in the CUDA kernels, which need MLX's CUDA backend; run on the H200")
@pytest.mark.parametrize("page", [5, 16])
@pytest.mark.parametrize("scheme", ["raw", "aura4v4", "affine4"])
def test_staged_copies_match_float64_reference(monkeypatch, scheme, page):
    """Stages filled by row groups of whole 16-byte copies (page 16), or 4-byte copies where a page does not
    hold whole groups (page 5, 68-byte AURA rows); the last page of each row in the tail pool."""
    monkeypatch.setattr(sys.modules[__name__], "PAGE", page)
    fmt = layer_format(scheme, 64)
    lengths = (1, 4, 5, 6, 161, 700)
    store = Store(fmt, lengths, 2, seed=page)
    store.move_last_pages_to_tail()
    rng = np.random.default_rng(5)
    q = mx.array(rng.standard_normal((len(lengths), 8, 1, 64)).astype(np.float32)).astype(DTYPE)
    table, lens = mx.array(store.page_table.astype(np.int32)), mx.array(np.array(lengths, np.int32))
    for tuning in (cuda_kv.Tuning(stages=4, stage_bytes=2048), cuda_kv.Tuning(8, 2, 4, 16, False, stages=2),
                   cuda_kv.Tuning(warps=2, stages=3, mma=True)):
        got = as_np(cuda_kv.decode_attention(q, fmt, tuple(store.pools), tuple(store.tails), table, lens,
                                             n_kv_heads=2, page_size=page, scale=0.125, tuning=tuning))
        for b, n in enumerate(lengths):
            keys, values = decode_rows_ref(fmt, store.stored[b])
            want = attention_ref(as_np(q[b]).astype(np.float64), keys, values, 0.125, np.ones((1, n), bool))
            np.testing.assert_allclose(got[b], want, atol=tolerance(), rtol=relative(), err_msg=f"{tuning} row {b}")


@pytest.mark.skipif(not ON_CUDA, reason="split plans exist only in the CUDA kernels, which need MLX's CUDA backend; run on the H200")
@pytest.mark.parametrize("scheme", ["raw", "affine4", "aura4v4"])
def test_capped_splits_match_float64_reference(monkeypatch, scheme):
    """Splits capped at one page (the kernels' page-id buffer shrunk to match): more splits than the GPU's
    fill asks for (`cuda_kv._split_plan`), rows of 1 to 1,000 tokens."""
    monkeypatch.setattr(cuda_kv, "_MAX_SPLIT_PAGES", 1)
    fmt = layer_format(scheme, 64)
    lengths = (1, 15, 16, 17, 250, 1000)
    store = Store(fmt, lengths, 2, seed=3)
    rng = np.random.default_rng(6)
    q = mx.array(rng.standard_normal((len(lengths), 8, 1, 64)).astype(np.float32)).astype(DTYPE)
    table, lens = mx.array(store.page_table.astype(np.int32)), mx.array(np.array(lengths, np.int32))
    for tuning in (cuda_kv.Tuning(stages=4), cuda_kv.Tuning(warps=4, stages=4, mma=True)):
        per_split, splits = cuda_kv._split_plan(table.shape[1] * PAGE, len(lengths), 2, PAGE, tuning.waves)
        assert (per_split, splits) == (PAGE, table.shape[1])  # 63 splits: the fill asks for 44
        got = as_np(cuda_kv.decode_attention(q, fmt, tuple(store.pools), None, table, lens,
                                             n_kv_heads=2, page_size=PAGE, scale=0.125, tuning=tuning))
        for b, n in enumerate(lengths):
            keys, values = decode_rows_ref(fmt, store.stored[b])
            want = attention_ref(as_np(q[b]).astype(np.float64), keys, values, 0.125, np.ones((1, n), bool))
            np.testing.assert_allclose(got[b], want, atol=tolerance(), rtol=relative(), err_msg=f"{tuning} row {b}")


@pytest.mark.skipif(not ON_CUDA, reason="the one-split launch is the CUDA kernels' (the MLX-ops path has no "
                    "splits); needs MLX's CUDA backend; run on the H200")
@pytest.mark.parametrize("tuning", [cuda_kv.Tuning(stages=4), cuda_kv.Tuning(warps=2, stages=4, mma=True),
                                    cuda_kv.Tuning(unroll=2, warps=2, stages=4, mma=True, slabs=2)],
                         ids=["fma", "mma", "mma-slabs2"])
@pytest.mark.parametrize("scheme, head_dim, group", [("raw", 64, 4), ("affine4", 128, 2), ("aura4v4", 64, 4),
                                                     ("aura8v4", 128, 2), ("aura4v2", 128, 8)])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sink", "sink"])
def test_one_split_matches_float64_reference(tuning, scheme, head_dim, group, with_sinks):
    """A page table no wider than `one_split_tokens` is one split: without a sink its launch writes the output
    itself (`merge_final`, AURA values rotated back in the block), with one the combine kernel still runs;
    rows of 1 to 700 tokens over NaN-filled pools, like the split launches."""
    fmt = layer_format(scheme, head_dim)
    lengths = (1, 16, 17, 300, 700)
    store = Store(fmt, lengths, 2, seed=head_dim + group)
    rng = np.random.default_rng(12)
    q = mx.array(rng.standard_normal((len(lengths), 2 * group, 1, head_dim)).astype(np.float32)).astype(DTYPE)
    sinks = mx.array(rng.standard_normal(2 * group).astype(np.float32)) if with_sinks else None
    table, lens = mx.array(store.page_table.astype(np.int32)), mx.array(np.array(lengths, np.int32))
    tuning = dataclasses.replace(tuning, one_split_tokens=table.shape[1] * PAGE)
    assert cuda_kv._split_plan(table.shape[1] * PAGE, len(lengths), 2, PAGE, tuning.waves,
                               tuning.one_split_tokens)[1] == 1
    scale = 1 / math.sqrt(head_dim)
    got = as_np(cuda_kv.decode_attention(q, fmt, tuple(store.pools), None, table, lens, n_kv_heads=2, page_size=PAGE,
                                         scale=scale, sinks=sinks, tuning=tuning))
    for b, n in enumerate(lengths):
        keys, values = decode_rows_ref(fmt, store.stored[b])
        want = attention_ref(as_np(q[b]).astype(np.float64), keys, values, scale, np.ones((1, n), bool),
                             None if sinks is None else as_np(sinks).astype(np.float64))
        np.testing.assert_allclose(got[b], want, atol=tolerance(), rtol=relative(), err_msg=f"row {b}")


@pytest.mark.parametrize("scheme", ["raw", "affine8", "aura4v2"])
@pytest.mark.parametrize("dims", [64, (192, 128)], ids=str)
def test_decode_reads_tail_pages(scheme, dims):
    """Page ids >= num_pages name the tail pool (a decode window's pages): read there, not in the main pool."""
    fmt = layer_format(scheme, dims)
    store = Store(fmt, (1, 16, 17, 40), 2, seed=9)
    store.move_last_pages_to_tail()
    q = mx.array(np.random.default_rng(4).standard_normal((4, 8, 1, fmt.key_dim)).astype(np.float32)).astype(DTYPE)
    for impl in implementations(fmt):
        got = as_np(run_decode(store, q, 0.125, None, impl))
        for b, n in enumerate(store.lengths):
            keys, values = decode_rows_ref(fmt, store.stored[b])
            want = attention_ref(as_np(q[b]).astype(np.float64), keys, values, 0.125, np.ones((1, n), bool))
            np.testing.assert_allclose(got[b], want, atol=tolerance(), rtol=relative(), err_msg=f"{impl} row {b}")


PREFILL_DIMS = [64, 80, (192, 128)]


@pytest.mark.parametrize("scheme", ["raw", "affine4", "aura4v2"])
@pytest.mark.parametrize("window", [None, (24, 3)])
@pytest.mark.parametrize("history", [0, 15, 40])
@pytest.mark.parametrize("dims", PREFILL_DIMS, ids=str)
@pytest.mark.parametrize("chunked", [False, True], ids=["one-pass", "chunks-of-a-page"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sink", "sink"])
def test_prefill_matches_float64_reference(monkeypatch, scheme, window, history, dims, chunked, with_sinks):
    """A chunk of 9 queries over `history` stored slots (a wrapped ring when windowed) plus itself.

    Chunked: a history is read a page a chunk by the online softmax's loop (merges, ring positions cut
    per chunk): one chunk at 15 slots, 3 at 40 (2 windowed).
    """
    heads, group, length = 2, 3, 9
    if chunked:
        monkeypatch.setattr(pa, "CHUNK_TOKENS", PAGE // 2)
    fmt = layer_format(scheme, dims)
    key_dim, value_dim = fmt.key_dim, fmt.value_dim
    rule = None if window is None else pa.WindowRule(window[1], window[0] - window[1])
    live = history if window is None else min(history, window[0])
    store = Store(fmt, (max(live, 1),), heads, seed=history)
    start = history
    rng = np.random.default_rng(3)
    positions = np.arange(live)
    if window is not None and history > window[0]:  # a wrapped ring: slot s holds a later position
        positions = np.concatenate([np.arange(rule.keep), history - 1 - np.arange(live - rule.keep)[::-1]])
        positions = np.concatenate([positions[: rule.keep], rng.permutation(positions[rule.keep :])])
    new_k = mx.array(rng.standard_normal((1, heads, length, key_dim)).astype(np.float32)).astype(DTYPE)
    new_v = mx.array(rng.standard_normal((1, heads, length, value_dim)).astype(np.float32)).astype(DTYPE)
    new_rows = fmt.encode(new_k, new_v)
    dk, dv = fmt.decode(new_rows)
    q = mx.array(rng.standard_normal((1, heads * group, length, key_dim)).astype(np.float32)).astype(DTYPE)
    sinks = mx.array(rng.standard_normal(heads * group).astype(np.float32)) if with_sinks else None
    qpos = mx.array(np.arange(start, start + length, dtype=np.int32)[None])
    hist = pa.History(mx.array(np.array([live], np.int32)), mx.array(store.page_table.astype(np.int32)),
                      positions=mx.array(np.pad(positions, (0, PAGE * store.page_table.shape[1] - live))[None]
                                         .astype(np.int32)))
    got = as_np(pa.prefill_attention(q, store.ref(), hist, dk, dv, qpos, window=rule, scale=0.125, sinks=sinks))
    keys, values = decode_rows_ref(fmt, store.stored[0])
    new_keys, new_values = decode_rows_ref(fmt, tuple(as_np(x[0]) for x in new_rows))
    all_k = np.concatenate([keys[:, :live], new_keys], axis=1)
    all_v = np.concatenate([values[:, :live], new_values], axis=1)
    key_pos = np.concatenate([positions, np.arange(start, start + length)])
    qp = np.arange(start, start + length)[:, None]
    visible = key_pos[None] <= qp
    if rule is not None:
        visible &= (key_pos[None] < rule.keep) | (key_pos[None] > qp - rule.ring)
    want = attention_ref(as_np(q[0]).astype(np.float64), all_k, all_v, 0.125, visible,
                         None if sinks is None else as_np(sinks).astype(np.float64))
    np.testing.assert_allclose(got[0], want, atol=tolerance(), rtol=relative())


@pytest.mark.parametrize("scheme", ["raw", "affine8", "aura4v2"])
@pytest.mark.parametrize("window", [None, (24, 3)])
def test_latent_operands_and_mask_match_reference(scheme, window):
    """MLA: every slot a chunk sees (history, then its own), decoded to the model's domain, zeros past
    a row's length (storage there is NaN), and the visibility of each to each query."""
    fmt = layer_format(scheme, (96, 32))  # a latent of 96 and its RoPE part of 32, one kv "head"
    lengths, length = (5, 24, 17), 4
    store = Store(fmt, lengths, 1, seed=9)
    rng = np.random.default_rng(4)
    width = PAGE * store.page_table.shape[1]
    positions = np.stack([np.pad(rng.permutation(40)[:n] if window else np.arange(n), (0, width - n))
                          for n in lengths]).astype(np.int32)  # a ring holds some earlier positions
    hist = pa.History(mx.array(np.array(lengths, np.int32)), mx.array(store.page_table.astype(np.int32)),
                      positions=mx.array(positions) if window else None)
    new_k = mx.array(rng.standard_normal((3, 1, length, 96)).astype(np.float32)).astype(DTYPE)
    new_v = mx.array(rng.standard_normal((3, 1, length, 32)).astype(np.float32)).astype(DTYPE)
    new_rows = fmt.encode(new_k, new_v)
    qpos = np.array([[40 + 3 * b + i for i in range(length)] for b in range(3)], np.int32)
    rule = None if window is None else pa.WindowRule(window[1], window[0] - window[1])
    keys, values = latent_operands(store.ref(), hist, new_rows, mx.float32)
    mask = np.array(latent_mask(hist, width, mx.array(qpos), rule))
    assert keys.shape == (3, 1, width + length, 96) and values.shape == (3, 1, width + length, 32)
    assert mask.shape == (3, 1, length, width + length)
    for b, n in enumerate(lengths):
        want_k, want_v = decode_rows_ref(fmt, store.stored[b])
        new_want_k, new_want_v = decode_rows_ref(fmt, tuple(as_np(x[b]) for x in new_rows))
        for got, hist_want, new_want in ((keys, want_k, new_want_k), (values, want_v, new_want_v)):
            got = as_np(got[b, 0])
            np.testing.assert_allclose(got[:n], hist_want[0], atol=tolerance(), rtol=relative() * np.abs(hist_want).max())
            assert np.all(got[n:width] == 0)
            np.testing.assert_allclose(got[width:], new_want[0], atol=tolerance(), rtol=relative() * np.abs(new_want).max())
        key_pos = np.concatenate([positions[b], qpos[b]])
        q = qpos[b][:, None]
        visible = (key_pos[None] <= q) & (np.arange(width + length) >= width) | (np.arange(width + length) < n)
        if rule is not None:
            visible &= (key_pos[None] < rule.keep) | (key_pos[None] > q - rule.ring)
        np.testing.assert_array_equal(mask[b, 0], visible)
    decode_mask = np.array(latent_mask(hist, width, None, rule))  # a decode step: every live slot
    np.testing.assert_array_equal(decode_mask[:, 0, 0], np.arange(width)[None] < np.array(lengths)[:, None])


def read_history(store: Store, read: str) -> pa.History:
    """The store's rows as a `History` read through page tables ("pages") or handed over gathered ("rows",
    as a chunk that wraps a window reads its ring)."""
    lengths, table = mx.array(np.array(store.lengths, np.int32)), mx.array(store.page_table.astype(np.int32))
    return pa.History(lengths, table) if read == "pages" else pa.History(lengths, rows=store.ref().gather(table))


@pytest.mark.parametrize("scheme, dims", [("aura4v4", 64), ("aura3v5", 80), ("aura8v4", (192, 128)), ("affine4", 64),
                                          ("raw", 64)])
@pytest.mark.parametrize("read", ["pages", "rows"])
def test_chunked_history_equals_one_chunk(monkeypatch, scheme, dims, read):
    """The online softmax over many chunks (each chained to an earlier one's merge) equals one pass."""
    fmt = layer_format(scheme, dims)
    store = Store(fmt, (70, 3, 129), 2, seed=5)
    q = mx.array(np.random.default_rng(1).standard_normal((3, 4, 1, fmt.key_dim)).astype(np.float32)).astype(DTYPE)

    def attend():
        return as_np(pa._attend_chunks(q, store.ref(), read_history(store, read), None, None, scale=0.125, sinks=None))

    one = attend()
    monkeypatch.setattr(pa, "CHUNK_TOKENS", PAGE)
    many = attend()
    np.testing.assert_allclose(many, one, atol=1e-5 if DTYPE == mx.float32 else 8e-3)  # bf16 output: 2 ulp


@pytest.mark.parametrize("scheme", ["aura4v2", "affine8"])
def test_history_split_over_cpu_threads_equals_one_pass(monkeypatch, scheme):
    """Three CPU streams, chunks of whole pages cut for them: same attention as one pass (NaN outside rows).

    Runs on the CPU on every machine (the threads are CPU streams; on a GPU machine too).
    """
    fmt = layer_format(scheme, 64)
    store = Store(fmt, (70, 3, 129), 2, seed=6)
    q = mx.array(np.random.default_rng(2).standard_normal((3, 4, 1, 64)).astype(np.float32)).astype(DTYPE)
    monkeypatch.setattr(pa, "_cpu_streams", lambda: (None,))
    with mx.stream(mx.cpu):
        one = as_np(run_decode(store, q, 0.125, None, "mlx-ops"))
    monkeypatch.setattr(pa, "_cpu_streams", lambda: pa._thread_streams(3))
    monkeypatch.setattr(pa, "PARALLEL_MIN_TOKENS", PAGE)
    chunks = list(pa.History(mx.array(store.lengths), mx.array(store.page_table)).chunks(store.ref(), ways=3))
    assert len(chunks) == 3 and sum(rows[0].shape[2] for _, rows in chunks) == store.page_table.shape[1] * PAGE
    with mx.stream(mx.cpu):
        split = as_np(run_decode(store, q, 0.125, None, "mlx-ops"))
    np.testing.assert_allclose(split, one, atol=1e-5 if DTYPE == mx.float32 else 8e-3)


def attention_peak_bytes(fmt: LayerFormat, slots: int, length: int, read: str) -> int:
    """Peak bytes allocated above the pools (and gathered rows) while the MLX-ops path attends `length`
    queries over `slots` (`read_history`)."""
    heads, group = 2, 4
    store = Store(fmt, (slots,), heads, seed=slots + length)
    history = read_history(store, read)
    rng = np.random.default_rng(length)
    q, k, v = (mx.array(rng.standard_normal((1, n, length, d)).astype(np.float32)).astype(DTYPE)
               for n, d in ((heads * group, fmt.key_dim), (heads, fmt.key_dim), (heads, fmt.value_dim)))
    positions = mx.arange(slots, slots + length, dtype=mx.int32)[None]
    mx.eval(store.pools, [a for a in (history.lengths, history.page_table, history.rows) if a is not None], q, k, v,
            positions)
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    if length == 1:
        out = pa._attend_chunks(q, store.ref(), history, None, None, scale=0.125, sinks=None)
    else:
        out = pa.prefill_attention(q, store.ref(), history, k, v, positions, window=None, scale=0.125)
    mx.eval(out)
    return mx.get_peak_memory() - base


@pytest.mark.parametrize("scheme", ["raw", "affine4", "aura4v4"])
@pytest.mark.parametrize("length", [1, 32], ids=["decode", "prefill"])
@pytest.mark.parametrize("read", ["pages", "rows"])
def test_temporary_memory_does_not_grow_with_history(monkeypatch, scheme, length, read):
    """16x the history (2,048 -> 32,768 slots in chunks of 256) raises the peak by under 0.5 MiB (a GPU: 2 MiB).

    One chunk's temporaries are ~0.25 MiB a kind (its float32 scores [1, 2, 128, 256], its decoded K/V);
    the whole float32 history at 32K is 32 MiB. MLX runs a lazy graph breadth-first, so without the
    chaining of chunks (`_attend_chunks`) every chunk was read before the merges freed any: the peak grew
    2.3x (raw decode, one stream) to 15x (affine4 decode, two threads); prefill 6 -> 73 MB. On a GPU prefill
    grew 0.5-1.1 MB (an H100, 2026-12-05; its allocator and schedule differ), so the bound there is 2 MiB.
    """
    fmt = layer_format(scheme, 64)
    monkeypatch.setattr(pa, "CHUNK_TOKENS", 256)
    short, long = (attention_peak_bytes(fmt, slots, length, read) for slots in (2048, 32768))
    assert long - short <= (2**21 if mx.default_device() == mx.gpu else 2**19), (short, long)


def angle_gap(x: np.ndarray, decoded: np.ndarray) -> np.ndarray:
    """1 - cos(x, decoded) per vector [...]: an AURA code's error in angle (its scale keeps the norm)."""
    return 1 - np.sum(x * decoded, -1) / np.linalg.norm(x, axis=-1) / np.linalg.norm(decoded, axis=-1)


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA encoder kernel needs MLX's CUDA backend; run on the H200")
@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s not in ("raw", "aura9v10")])  # what the kernels take
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("centered", [False, True], ids=["as-is", "centered"])
def test_cuda_encoder_matches_mlx_ops_encoder(scheme, head_dim, centered):
    """Affine rows are bit-identical to `mx.quantize`'s (CPU rule). AURA codes agree except at
    thresholds and where two gains code a vector alike within rounding (the rotation sums in another
    order), so the kernel's codes lie as close in angle to each vector, and decode to the same
    vectors closely. Centered: the kernel's own subtraction of a key mean equals encoding `keys - mean`."""
    fmt = LayerFormat(*SCHEMES[scheme](mx.float32), head_dim)
    mean = mx.array(np.random.default_rng(2).standard_normal((3, 1, head_dim)).astype(np.float32)) if centered else None
    assert_encoder_matches_mlx_ops(fmt, batch=2, tokens=40, heads=3, mean=mean)


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA encoder kernel needs MLX's CUDA backend; run on the H200")
@pytest.mark.parametrize("scheme", ["affine4", "aura4v4", "aura8v4"])
@pytest.mark.parametrize("heads", [1, 3])
def test_cuda_encoder_codes_one_decode_token(scheme, heads):
    """A decode step's launch: one token of `heads` kv heads, 2 * heads warps, so the last block
    has idle warps (they stage the search tables and leave): the rows equal the MLX-ops encoder's."""
    # a handful of words: one coordinate on a threshold is a larger share of them
    assert_encoder_matches_mlx_ops(LayerFormat(*SCHEMES[scheme](mx.float32), 64), batch=1, tokens=1, heads=heads,
                                   equal_share=0.75)


def assert_encoder_matches_mlx_ops(fmt: LayerFormat, *, batch: int, tokens: int, heads: int, mean=None,
                                   equal_share: float = 0.99) -> None:
    """`cuda_kv.encode_rows` against `LayerFormat.encode` on the CPU (see the test above for the bounds)."""
    head_dim = fmt.key_dim
    # strided inputs, as the model hands them over: [B, L, H, D] transposed to [B, H, L, D]
    x = mx.array(np.random.default_rng(head_dim).standard_normal((batch, tokens, heads, head_dim)).astype(np.float32) * 3)
    y = mx.array(np.random.default_rng(1).standard_normal((batch, tokens, heads, head_dim)).astype(np.float32))
    x, y = x.transpose(0, 2, 1, 3), y.transpose(0, 2, 1, 3)
    got = np.array(cuda_kv.encode_rows(fmt, x, y, mean))
    with mx.stream(mx.cpu):
        (want,) = fmt.encode(x if mean is None else x - mean, y)
    want = np.array(want)
    if fmt.key.kind == AFFINE:
        np.testing.assert_array_equal(got, want)
        return
    got_k, got_v = decode_rows_ref(fmt, (got,))
    want_k, want_v = decode_rows_ref(fmt, (want,))
    parts = ((fmt.key, slice(0, fmt.key_words), x if mean is None else x - mean, got_k, want_k),
             (fmt.value, slice(fmt.key_words, fmt.meta_offset), y, got_v, want_v))
    for part, words, source, got_part, want_part in parts:
        if part.bits < 8:  # at 8 bits two gains often tie within rounding: whole vectors differ
            assert np.mean(got[..., words] == want[..., words]) >= equal_share
        source = np.array(source, dtype=np.float64)
        gap, want_gap = angle_gap(source, got_part), angle_gap(source, want_part)
        np.testing.assert_array_less(gap, want_gap * 1.02 + 1e-7)  # 1e-7: near-tied gains at 8 bits
        assert gap.mean() <= want_gap.mean() * 1.005
        np.testing.assert_allclose(got_part, want_part, atol=0.05 * np.abs(want_part).max())


def test_partial_kernel_warps_fit_static_shared_memory():
    """aura4v4, head_dim 256, GQA 5, 16 dims per lane (16 lanes, 2 states a warp): 4 warps would need
    40960 (sm_acc) + 5120 (qs) + 2048 (cbs) + 1024 (pids) + 320 (sm_m, sm_l) = 49472 bytes > 48 KiB,
    3 warps 39152. raw, head_dim 64, GQA 32, 16 dims per lane (8 states a warp): one warp's merge rows
    alone, 8 * 32 * 66 * 4 = 67584 bytes, exceed the 39932 left beside qs, pids and cbs, so a token
    takes 32 lanes (one state a warp: 8448 bytes), and 4 warps fit. llama's and qwen3's shapes keep 4."""
    lanes_and_warps = lambda scheme, d, g, dims: cuda_kv._lanes_and_warps(  # noqa: E731
        layer_format(scheme, d), g, cuda_kv.Tuning(dims_per_lane=dims, warps=4))
    assert lanes_and_warps("aura4v4", 256, 5, 16) == (16, 3)
    assert lanes_and_warps("raw", 64, 32, 16) == (32, 4)
    assert lanes_and_warps("raw", 64, 4, 8) == (8, 4)
    assert lanes_and_warps("affine4", 128, 2, 8) == (16, 4)
