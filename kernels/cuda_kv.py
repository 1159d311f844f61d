"""Python side of the CUDA KV kernels: build once, pick template arguments, launch.

`is_available()` says whether they can run here (MLX's CUDA backend is the default device).
Constant inputs (codebooks, gain cells, rotation signs, scalar parameters) are built once per
value and reused, so a traced decode step holds no per-step host data beyond its indices.

Source: `kernels.cuda_source` (kernel bodies and their design).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kernels.aura import GAINS, aura_codebook, gain_cells
from kernels.cuda_source import COMBINE, ENCODE, HEADER, PARTIAL
from kernels.kv_format import AFFINE, AURA, RAW, LayerFormat, PartFormat

MODES = {RAW: 0, AFFINE: 1, AURA: 2}
NUM_SMS = 132  # H200; only sizes the split count
_LOG2E = math.log2(math.e)
_STATIC_SHARED_BYTES = 48 * 1024  # a kernel's static shared memory at most (CUDA)
_ENCODE_WARPS = 4  # warps per block of the encoder (one per vector part; `EW` in its source)
_COMBINE_THREADS = 512  # the combine kernel's block at most (`NT` in its source)
_MAX_SPLIT_PAGES = 256  # pages one split walks at most (its page ids sit in shared memory: `MAXPG`)


def is_available() -> bool:
    """Whether the CUDA kernels can run: MLX's CUDA backend is present and the default device is the GPU."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


@functools.cache
def _kernels() -> dict:
    kernel = functools.partial(mx.fast.cuda_kernel, header=HEADER)
    return {
        "encode": kernel(name="bm_kv_encode", input_names=["k", "v", "ksign", "vsign", "kedges", "kcents", "kindex",
                                                                 "vedges", "vcents", "vindex", "kmean"],
                         output_names=["out"], source=ENCODE, ensure_row_contiguous=False),
        "partial": kernel(name="bm_paged_decode_partial",
                          input_names=["q", "kp", "vp", "kt", "vt", "pt", "lens", "cb", "qsign", "params", "fparams"],
                          output_names=["o_part", "ml_part"], source=PARTIAL),
        "combine": kernel(name="bm_paged_decode_combine", input_names=["o_part", "ml_part", "sinks", "vsign"],
                          output_names=["out"], source=COMBINE),
    }


@functools.cache
def _constant(values: tuple, dtype: mx.Dtype) -> mx.array:
    return mx.array(np.array(values), dtype=dtype)


@functools.cache
def _codebooks(fmt: LayerFormat) -> mx.array:
    """AURA centroids, float32 [512]: keys at 0, values at 256 (zeros where unused)."""
    cb = np.zeros(512, np.float32)
    for offset, part in ((0, fmt.key), (256, fmt.value)):
        if part.kind == AURA:
            cb[offset : offset + (1 << part.bits)] = np.array(aura_codebook(part.bits))
    return mx.array(cb)


def _cells(part: PartFormat) -> tuple[mx.array, mx.array, mx.array]:
    """The encoder's gain cells of an AURA part (`kernels.aura.gain_cells`); placeholders otherwise."""
    if part.kind == AURA:
        return gain_cells(part.bits)
    return _constant((0.0,), mx.float32), _constant((0.0,), mx.float32), _constant((0,), mx.uint32)


def _signs(part: PartFormat, head_dim: int) -> mx.array:
    rotation = part.rotation(head_dim)
    return rotation.signs if rotation is not None else _constant((1.0,), mx.float32)


def _part_args(prefix: str, part: PartFormat) -> list[tuple[str, object]]:
    return [(f"{prefix}MODE", MODES[part.kind]), (f"{prefix}BITS", max(part.bits, 1) if part.kind != RAW else 1),
            (f"{prefix}GS", part.group_size or 1)]


def _layout_args(fmt: LayerFormat) -> list[tuple[str, object]]:
    return [("ROWW", fmt.row_words if not fmt.is_raw else fmt.head_dim), ("MOFF", fmt.meta_offset),
            ("KWORDS", fmt.key_words), ("KMH", fmt.key_meta_halves), ("VMH", fmt.value_meta_halves)]


def encode_rows(fmt: LayerFormat, keys: mx.array, values: mx.array, key_mean: mx.array | None = None) -> mx.array:
    """Encode K and V [B, H, L, D] (any strides) into compressed rows uint32 [B, H, L, row_words].

    `key_mean` (float32 [H, 1, D], row-contiguous, or None): subtracted from every key in float32 before
    it is encoded (`services.engine.cache.centering`), with no launch of its own.

    Same codes as `LayerFormat.encode` (affine: identical; AURA: identical up to float rounding
    of the rotation, which can move a coordinate that sits on a threshold to its neighbour cell,
    or flip the gain of a vector that two gains code within rounding alike).

    Raises:
        ValueError: a raw layer (raw layers store K and V as they come), or a format the kernels do not
            take (`LayerFormat.is_regular` is false).
    """
    if fmt.is_raw:
        raise ValueError("raw layers have no encoder")
    if not fmt.is_regular:
        raise ValueError(f"the CUDA kernels take regular formats only (kernels.paged_attention.uses_cuda), got {fmt}")
    batch, heads, length, head_dim = keys.shape
    inputs, template = encoder_args(fmt, head_dim, key_mean)
    (rows,) = _kernels()["encode"](
        inputs=[keys, values, *inputs],
        template=[("T", keys.dtype), *template, ("EW", _ENCODE_WARPS)],
        grid=(-(-2 * batch * heads * length // _ENCODE_WARPS) * 32 * _ENCODE_WARPS, 1, 1),
        threadgroup=(32 * _ENCODE_WARPS, 1, 1),
        output_shapes=[(batch, heads, length, fmt.row_words)],
        output_dtypes=[mx.uint32],
    )
    return rows


def encoder_args(fmt: LayerFormat, head_dim: int, key_mean: mx.array | None) -> tuple[list, list]:
    """The constant inputs (after K and V) and template arguments (after `T`) of a kernel that codes K/V rows
    with `encode_part` (`ENCODE`, and `kernels.qkv_rope`'s fused kernel): rotation signs, gain cells, the key
    mean (or a placeholder), widths and the row layout."""
    k_cells, v_cells = _cells(fmt.key), _cells(fmt.value)
    odd = (fmt.key_meta_halves + fmt.value_meta_halves) % 2
    inputs = [_signs(fmt.key, head_dim), _signs(fmt.value, head_dim), *k_cells, *v_cells,
              _constant((0.0,), mx.float32) if key_mean is None else key_mean]
    template = [("D", head_dim), *_part_args("K", fmt.key), *_part_args("V", fmt.value), *_layout_args(fmt),
                ("PADMETA", bool(odd)), ("CENTER", key_mean is not None), ("NG", len(GAINS)),
                ("KNE", k_cells[0].size), ("VNE", v_cells[0].size)]
    return inputs, template


@dataclass(frozen=True, slots=True)
class Tuning:
    """Launch shape of the partial kernel.

    Attributes:
        dims_per_lane (int): Head dims one lane holds (8: one 16-byte load of fp16/bf16 per K row).
        unroll (int): Tokens a lane loads before any math (memory-level parallelism).
        warps (int): Warps per block (each keeps `32 * dims_per_lane / D` softmax states).
        waves (int): Blocks launched per SM (sizes the split count).
        query_in_registers (bool): Lanes hold their query slices in registers (else read shared memory).
        prefetch (bool): Issue the next tile's loads before this tile's math (two tiles in flight).
    """

    dims_per_lane: int = 8
    unroll: int = 1
    warps: int = 4
    waves: int = 4
    query_in_registers: bool = True
    prefetch: bool = False


def _split_plan(max_tokens: int, batch: int, n_kv_heads: int, page_size: int, waves: int) -> tuple[int, int]:
    """(tokens per split, splits): enough blocks to fill the GPU `waves` times over, each split at most
    `_MAX_SPLIT_PAGES` pages."""
    target = max(1, math.ceil(waves * NUM_SMS / (batch * n_kv_heads)))
    per_split = max(page_size, math.ceil(math.ceil(max_tokens / target) / page_size) * page_size)
    per_split = min(per_split, _MAX_SPLIT_PAGES * page_size)
    return per_split, max(1, math.ceil(max_tokens / per_split))


def decode_attention(
    queries: mx.array,
    fmt: LayerFormat,
    pools: tuple[mx.array, ...],
    tails: tuple[mx.array, ...] | None,
    page_table: mx.array,
    lengths: mx.array,
    *,
    n_kv_heads: int,
    page_size: int,
    scale: float,
    sinks: mx.array | None = None,
    tuning: Tuning | None = None,
) -> mx.array:
    """Fused paged decode attention: one query per row over its live token slots.

    Args:
        queries (mx.array): [B, n_heads, 1, D], RoPE applied, model dtype.
        fmt (LayerFormat): The layer's storage format.
        pools (tuple[mx.array, ...]): raw (K, V) [n_kv_heads * pages * P, D], or (rows,) uint32.
        tails (tuple | None): Tail pools of the same format (pages numbered after `pools`'), or None.
        page_table (mx.array): int32 [B, NP]; slots t < NP * P of row b live in page `page_table[b, t // P]`.
        lengths (mx.array): int32 [B], live slots of each row (every one is attended).
        n_kv_heads (int): KV heads (pool rows are head-major: `(h * pages + page) * P + slot`).
        page_size (int): P.
        scale (float): Score scale.
        sinks (mx.array | None): [n_heads] learned attention-sink logits, or None.
        tuning (Tuning | None): Launch shape; None picks `default_tuning`.

    Returns:
        mx.array: [B, n_heads, 1, D] in the queries' dtype and the model's domain.

    Raises:
        ValueError: a format the kernels do not take (`LayerFormat.is_regular` is false).
    """
    batch, n_heads, _, head_dim = queries.shape
    group = n_heads // n_kv_heads
    pages = pools[0].shape[0] // (n_kv_heads * page_size)
    if tails is None:
        tails, tail_pages = tuple(_dummy(p.dtype, p.shape[1]) for p in pools), 0
    else:
        tail_pages = tails[0].shape[0] // (n_kv_heads * page_size)
    kp, vp = (pools[0], pools[1]) if fmt.is_raw else (pools[0], pools[0])
    kt, vt = (tails[0], tails[1]) if fmt.is_raw else (tails[0], tails[0])
    if not fmt.is_regular:
        raise ValueError(f"the CUDA kernels take regular formats only (kernels.paged_attention.uses_cuda), got {fmt}")
    tuning = tuning or default_tuning(fmt, batch * n_kv_heads)
    lanes = head_dim // _dims_per_lane(fmt, tuning.dims_per_lane)
    per_split, splits = _split_plan(page_table.shape[1] * page_size, batch, n_kv_heads, page_size, tuning.waves)
    warps = _partial_warps(fmt, group, lanes, tuning.warps)
    assert per_split <= _MAX_SPLIT_PAGES * page_size, "the partial kernel holds a split's page ids in shared memory"
    rotate = fmt.key.kind == AURA
    q_scale = scale * _LOG2E / (math.sqrt(head_dim) if rotate else 1.0)
    cb = _codebooks(fmt)
    raw_dtype = fmt.key.dtype if fmt.is_raw else mx.uint32
    o_part, ml_part = _kernels()["partial"](
        inputs=[queries, kp, vp, kt, vt, page_table, lengths, cb, _signs(fmt.key, head_dim),
                _constant((per_split, pages, tail_pages, 0), mx.int32), _constant((q_scale,), mx.float32)],
        template=[("T", queries.dtype), ("RT", raw_dtype), ("D", head_dim), ("G", group), ("P", page_size),
                  ("LPT", lanes), ("W", warps), ("U", tuning.unroll), ("MAXPG", _MAX_SPLIT_PAGES), *_part_args("K", fmt.key), *_part_args("V", fmt.value),
                  *_layout_args(fmt), ("ROTATE", rotate), ("QREG", tuning.query_in_registers),
                  ("PREFETCH", tuning.prefetch)],
        grid=(splits * 32 * warps, n_kv_heads, batch),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(batch, n_heads, splits, head_dim), (batch, n_heads, splits, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    has_sink = sinks is not None
    merge = min(_COMBINE_THREADS // head_dim, 1 << (splits - 1).bit_length())  # splits merged side by side
    (out,) = _kernels()["combine"](
        inputs=[o_part, ml_part, sinks.astype(mx.float32) if has_sink else _constant((0.0,), mx.float32),
                _signs(fmt.value, head_dim)],
        template=[("T", queries.dtype), ("D", head_dim), ("HAS_SINK", has_sink),
                  ("UNROTATE", fmt.value.kind == AURA)],
        grid=(head_dim * merge, n_heads, batch),
        threadgroup=(head_dim * merge, 1, 1),
        output_shapes=[(batch, n_heads, 1, head_dim)],
        output_dtypes=[queries.dtype],
    )
    return out


def _partial_warps(fmt: LayerFormat, group: int, lanes: int, wanted: int) -> int:
    """`wanted`, cut so the partial kernel's static shared memory fits (`PARTIAL`'s arrays): the query
    `qs[G*D]`, codebooks `cbs` (AURA: at most 512), page ids `pids[MAXPG]`, and per softmax state (32 / lanes a
    warp) the merge rows `sm_acc[G][D]` plus `sm_m[G]`, `sm_l[G]`, all 4 bytes each."""
    fixed = 4 * (group * fmt.head_dim + (512 if AURA in (fmt.key.kind, fmt.value.kind) else 1) + _MAX_SPLIT_PAGES)
    per_warp = 4 * (32 // lanes) * group * (fmt.head_dim + 2)
    return max(1, min(wanted, (_STATIC_SHARED_BYTES - fixed) // per_warp))


def _dims_per_lane(fmt: LayerFormat, wanted: int) -> int:
    """`wanted`, cut so a lane's dims stay within the head, one affine group, and 32 lanes cover the head."""
    groups = [p.group_size for p in (fmt.key, fmt.value) if p.kind == AFFINE]
    return max(fmt.head_dim // 32, min(wanted, fmt.head_dim, *groups))


def default_tuning(fmt: LayerFormat, rows: int) -> Tuning:
    """The launch shape measured best on the H200 (`ops/kernel_sweep.py`, `ops/results/kernel_sweep_gpu.json`).

    Args:
        fmt (LayerFormat): The layer's format.
        rows (int): Sequences times kv heads of the launch (one block walks one of them per split).

    Few rows (`rows < NUM_SMS`, e.g. one stream at 32K): the history is split across every SM four
    times over, loops are short, and loads right before their math measured best; head_dim 64 (GQA 4)
    wants two tokens in flight per lane and the query in shared memory, head_dim 128 (GQA 2) 16 dims
    per lane, one token at a time, the query in registers. Four waves of blocks rather than two: a
    CUPTI sweep of 1 x 8K and 1 x 32K (`ops/results/kernel_sweep_gpu_cupti.json`) had four ahead in all
    14 cases, but it timed independent chains the GPU overlapped; the engine's own profile agrees
    (attention at 1 x 8K llama, raw: 627 us a step at two waves, 513 at four with the staging changes,
    `ops/results/gpu_time_llama-1b_8k_prologue.json`). Many rows (32 streams x 8K): each block
    walks a long row and load latency bounds it, so the next tile is prefetched, one token per lane
    at a time, the query in registers; 8 dims per lane at head_dim 64, 16 at 128 (through the
    engine, raw qwen3 32 x 8K decoded 2536 tok/s with 8, 3346 with 16).
    Neighbouring shapes measured within ~10% of each other (and of run-to-run noise).
    """
    if rows < NUM_SMS:
        if fmt.head_dim <= 64:
            return Tuning(dims_per_lane=8, unroll=2, warps=4, waves=4, query_in_registers=False)
        return Tuning(dims_per_lane=16, unroll=1, warps=4, waves=4, query_in_registers=True)
    wide = 16 if fmt.head_dim > 64 else 8
    return Tuning(dims_per_lane=wide, unroll=1, warps=4, waves=2, query_in_registers=True, prefetch=True)


@functools.cache
def _dummy(dtype: mx.Dtype, width: int) -> mx.array:
    return mx.zeros((1, width), dtype)
