"""Python side of the CUDA KV kernels: build once, pick template arguments, launch.

`is_available()` says whether they can run here (MLX's CUDA backend is the default device).
Constant inputs (codebooks, the encoder's search tables, rotation signs, scalar parameters) are built once per
value and reused, so a traced decode step holds no per-step host data beyond its indices.

Source: `kernels.cuda_source` (kernel bodies and their design).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from kernels.aura import GAINS, aura_codebook
from kernels.cuda_mma import MMA_HEADER, PARTIAL_MMA
from kernels.cuda_source import COMBINE, ENCODE, PARTIAL, compact, kernel_header
from kernels.kv_format import AFFINE, AURA, RAW, LayerFormat, PartFormat
from kernels.lloyd_max import lloyd_max_thresholds
from shared.paths import data_dir, private_folder

MODES = {RAW: 0, AFFINE: 1, AURA: 2}
NUM_SMS = 132  # H200; only sizes the split count
_LOG2E = math.log2(math.e)
_STATIC_SHARED_BYTES = 48 * 1024  # a kernel's static shared memory at most (CUDA)
_ENCODE_WARPS = 4  # warps per block of the encoder (`encode_warps` a vector part; `EW` in its source)
_COMBINE_THREADS = 512  # the combine kernel's block at most (`NT` in its source)
_MAX_SPLIT_PAGES = 256  # pages one split walks at most (its page ids sit in shared memory: `MAXPG`)
SHAPE_PARTS = ("_shape", "_strides", "_ndim")  # what MLX looks for in a kernel's source, after an input's name
_ONE_SPLIT_TOKENS, _ONE_SPLIT_BYTES = 768, 128 * 1024  # a few rows' short page tables: one split (`default_tuning`)


def is_available() -> bool:
    """Whether the CUDA kernels can run: MLX's CUDA backend is present and the default device is the GPU."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def encode_warps(head_dim: int) -> int:
    """Warps that split the dims of one part (K or V) of a head_dim-wide vector (`encode_warps` in
    `kernels.cuda_source`)."""
    per_lane = head_dim // 32
    return 1 if head_dim < 64 else 4 if per_lane % 4 == 0 else 2 if per_lane % 2 == 0 else 1


def decode_encode_warps(fmt: LayerFormat, head_dim: int) -> tuple[int, int]:
    """(WD, WG) of the decode step's coding (`kernels.qkv_rope`): `encode_warps` split a lane's dims, as in
    `ENCODE` (so both sum a gain's products in one order and code alike, bit for bit), and WG = 3 warps
    split an AURA part's 9 gains: a lone vector's gain search is latency, not throughput (H200, the launch a
    layer in the engine, llama-1b aura8v4 6.9 -> 5.2 us against raw's store 3.5, qwen3-1.7b 6.3 -> 5.8,
    `ops/results/encode_warps_gpu_2026-12-03.json`)."""
    return encode_warps(head_dim), 3 if AURA in (fmt.key.kind, fmt.value.kind) else 1


def custom_kernel(name: str, source: str, header: str = "", **io):
    """`mx.fast.cuda_kernel` with only the `HEADER` helpers `source` (and `header`) call, both compacted
    (`kernels.cuda_source.kernel_header`, `compact`) and handed to MLX as `#include` lines of files
    (`source_file`). MLX hashes the source it is handed at every launch to name its module
    (`CustomKernel::eval_gpu`): inline, ~0.45 MB a one-row llama-1b decode step, an estimated ~60 us of the
    host's time a step at the 7.3 GB/s `std::hash` runs on an EPYC core; as include lines, a few hundred
    bytes a kernel (its signature and MLX's default header remain). NVRTC reads the files once, at the compile.
    Each `<input>_shape` / `_strides` / `_ndim` the body holds is also listed in a comment of the source:
    MLX passes those to a kernel whose source text holds them (a substring search of that text only).
    `io`: the other keyword arguments of `mx.fast.cuda_kernel` (input and output names, ...).

    Raises:
        ValueError: a source `compact` cannot strip, or a helper `kernel_header` cannot name.
    """
    body = compact(source)
    helpers = kernel_header(header + source) + compact(header)
    used = [n + part for n in io.get("input_names", ()) for part in SHAPE_PARTS if n + part in body]
    listed = f"// {' '.join(used)}\n" if used else ""
    return mx.fast.cuda_kernel(name=name, source=source_file(body) + listed, header=source_file(helpers), **io)


def source_file(text: str) -> str:
    """An `#include` line of a file holding `text`, named by its content's hash (a changed text is another
    file, so another source, and MLX compiles it anew); `text` itself where no folder of `source_dir` serves
    or the file cannot be written. A file already there is read back and rewritten unless it holds `text`.
    Empty text: empty."""
    folder = source_dir()
    if not text or folder is None:
        return text
    path = folder / f"bm_{hashlib.sha256(text.encode()).hexdigest()[:32]}.cuh"
    try:
        if not (path.is_file() and path.read_text() == text):
            fd, temp = tempfile.mkstemp(dir=folder, prefix=path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                os.replace(temp, path)  # whole or absent: other engines may read it meanwhile
            finally:
                if os.path.exists(temp):
                    os.unlink(temp)
    except (OSError, UnicodeDecodeError):
        return text
    return f'#include "{path}"\n'


@functools.cache
def source_dir() -> Path | None:
    """Where `source_file` writes: `cuda` in buttermilk's data folder (`shared.paths.data_dir`), else
    `buttermilk-cuda-<uid>` in the temporary directory: the first that can be created and written, is owned by
    this user and writable by no one else (a kernel's text is code), and whose absolute path an `#include`
    line can quote and MLX's shape search cannot misread. None: none serves (kernels then carry their text
    inline)."""
    for folder in _source_dir_candidates():
        text = str(folder)
        if any(c in text for c in '"\\\n') or any(part in text for part in SHAPE_PARTS):
            continue
        if private_folder(folder):
            return folder
    return None


def _source_dir_candidates() -> list[Path]:
    folders = []
    try:
        folders.append((data_dir() / "cuda").absolute())
    except RuntimeError:  # no $HOME and no passwd entry (a container's arbitrary user)
        pass
    return folders + [Path(tempfile.gettempdir()).absolute() / f"buttermilk-cuda-{os.getuid()}"]


@functools.cache
def _kernels() -> dict:
    return {
        "encode": custom_kernel("bm_kv_encode", ENCODE, input_names=["k", "v", "codec", "kmean"],
                                output_names=["out"], ensure_row_contiguous=False),
        "combine": custom_kernel("bm_paged_decode_combine", COMBINE,
                                 input_names=["o_part", "ml_part", "sinks", "vsign"], output_names=["out"]),
    }


# The partial kernels' last statement: their block's softmax states into the split's partials.
_MERGE_PARTS = re.compile(r"merge_states<D, G, (\w+)>\((.*), S, split, o_part, ml_part\);")


@functools.cache
def _partial_kernel(mma: bool, coded: bool, final: bool = False):
    """A partial kernel (`PARTIAL`, or `PARTIAL_MMA` on the tensor cores). Coded: one pool and one tail pool
    (K and V share a row), the other inputs as raw's: every input costs host time at each launch. Final: the
    one-split launch, writing the attention output (`merge_final`) where the combine kernel would have."""
    name, source, header = ("bm_paged_decode_mma", PARTIAL_MMA, MMA_HEADER) if mma else ("bm_paged_decode_partial",
                                                                                          PARTIAL, "")
    pools = ["kp", "kt"] if coded else ["kp", "vp", "kt", "vt"]
    if coded:  # values are read from the keys' rows
        name, source = name + "_coded", "const RT* vp = kp;\nconst RT* vt = kt;\n" + source
    outputs = ["o_part", "ml_part"]
    if final:
        name, source, outputs = name + "_final", final_source(source), ["out"]
    return custom_kernel(name, source, header, input_names=["q", *pools, "pt", "lens", "cb"], output_names=outputs)


def final_source(source: str) -> str:
    """A partial kernel's source (`PARTIAL`, `PARTIAL_MMA`) as its one-split launch: `merge_final` writes `out`
    (the values' rotation signs at `cb + 512 + D`) where `merge_states` wrote the split's partials.

    Raises:
        ValueError: a source without exactly one `merge_states` call of the partial kernels' form.
    """
    out, count = _MERGE_PARTS.subn(r"merge_final<T, D, G, \1, UNROTATE>(\2, cb + 512 + D, out);", source)
    if count != 1:
        raise ValueError(f"a partial kernel ends in one merge_states call; found {count}")
    return out


@functools.cache
def _constant(values: tuple, dtype: mx.Dtype) -> mx.array:
    return mx.array(np.array(values), dtype=dtype)


@functools.cache
def _attention_constants(fmt: LayerFormat, head_dim: int) -> mx.array:
    """The partial kernels' constants, float32 [512 + 2 * head_dim]: AURA centroids (keys at 0, values at 256,
    zeros where unused), then the keys' rotation signs and the values' (ones where a part is not AURA)."""
    cb = np.zeros(512 + 2 * head_dim, np.float32)
    for offset, part in ((0, fmt.key), (256, fmt.value)):
        if part.kind == AURA:
            cb[offset : offset + (1 << part.bits)] = np.array(aura_codebook(part.bits))
    cb[512 : 512 + head_dim] = _sign_vector(fmt.key, head_dim)
    cb[512 + head_dim :] = _sign_vector(fmt.value, head_dim)
    return mx.array(cb)


def search_table(bits: int) -> np.ndarray:
    """An AURA part's table for the encoder's gain search (`encode_part` in `kernels.cuda_source`), float32
    [2 * 2^bits + len(GAINS)]: the 2^bits - 1 Lloyd-Max thresholds in breadth-first (Eytzinger) order at
    1 .. 2^bits - 1 (node i's children at 2i, 2i + 1; slot 0 holds +inf, never probed), the 2^bits centroids,
    the gains (`kernels.aura.GAINS`, as float32).

    Breadth-first, the 2^d nodes of depth d are consecutive words, so a warp's probes of one depth meet at
    most 2^(d - 5) words a shared-memory bank (none before depth 6); sorted, the probes of depth d sit on the
    addresses `2^(bits - d - 1) (2k + 1) - 1`, 8 words a bank for 8-bit codes from depth 3 on.
    Source: Khuong & Morin, "Array Layouts for Comparison-Based Searching" (2017), section 3.
    """
    n = 1 << bits
    thresholds = np.array(lloyd_max_thresholds(bits), np.float32)
    tree = np.full(n, np.inf, np.float32)
    for depth in range(bits):  # node 2^depth + k splits sorted index (2k + 1) * 2^(bits - depth - 1) - 1
        k = np.arange(1 << depth)
        tree[(1 << depth) + k] = thresholds[(2 * k + 1) * (n >> (depth + 1)) - 1]
    return np.concatenate([tree, np.array(aura_codebook(bits), np.float32), np.array(GAINS, np.float32)])


@functools.cache
def codec_constants(fmt: LayerFormat, head_dim: int) -> mx.array:
    """The encoder's constants of a layer, float32 [2 * head_dim + KT + VT]: the key's rotation signs, the
    value's (ones where a part is not AURA), then each AURA part's `search_table` (KT, VT floats: none for
    an affine part)."""
    parts = [_sign_vector(fmt.key, head_dim), _sign_vector(fmt.value, head_dim)]
    parts += [search_table(p.bits) for p in (fmt.key, fmt.value) if p.kind == AURA]
    return mx.array(np.concatenate(parts))


def _sign_vector(part: PartFormat, head_dim: int) -> np.ndarray:
    """float32 [head_dim]: an AURA part's rotation signs, ones for any other part (the constant arrays' rule)."""
    return np.array(_signs(part, head_dim), np.float32) if part.kind == AURA else np.ones(head_dim, np.float32)


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
        grid=(-(-2 * encode_warps(head_dim) * batch * heads * length // _ENCODE_WARPS) * 32 * _ENCODE_WARPS, 1, 1),
        threadgroup=(32 * _ENCODE_WARPS, 1, 1),
        output_shapes=[(batch, heads, length, fmt.row_words)],
        output_dtypes=[mx.uint32],
    )
    return rows


def encoder_args(fmt: LayerFormat, head_dim: int, key_mean: mx.array | None) -> tuple[list, list]:
    """The inputs after K and V (`codec_constants`, the key mean or a placeholder) and the template arguments
    after `T` (widths, the row layout) of a kernel that codes K/V rows with `encode_part` (`ENCODE`, and
    `kernels.qkv_rope`'s fused kernel)."""
    odd = (fmt.key_meta_halves + fmt.value_meta_halves) % 2
    inputs = [codec_constants(fmt, head_dim), _constant((0.0,), mx.float32) if key_mean is None else key_mean]
    template = [("D", head_dim), *_part_args("K", fmt.key), *_part_args("V", fmt.value), *_layout_args(fmt),
                ("PADMETA", bool(odd)), ("CENTER", key_mean is not None), ("NG", len(GAINS))]
    return inputs, template


@dataclass(frozen=True, slots=True)
class Tuning:
    """Launch shape of the partial kernel.

    Attributes:
        dims_per_lane (int): Head dims one lane holds (8: one 16-byte load of fp16/bf16 per K row).
        unroll (int): Tokens a lane works on at once (loads in flight, or math between barriers).
        warps (int): Warps per block (each keeps `32 * dims_per_lane / D` softmax states).
        waves (int): Blocks launched per SM (sizes the split count).
        query_in_registers (bool): Lanes hold their query slices in registers (else read shared memory).
        prefetch (bool): Without stages: issue the next tile's loads before this tile's math.
        stages (int): 0: K/V rows are loaded straight into registers; n >= 2: the block copies tiles of
            rows into a ring of n stages in shared memory (`cp.async`), n - 1 tiles ahead of the math.
        stage_bytes (int): Bytes of one stage at most (sets the tile's tokens).
        mma (bool): Scores and value sums on the tensor cores (`kernels.cuda_mma`; fp16/bf16 queries,
            head_dim 64 or 128, at most 16 query heads a kv head): a tile is
            `16 * warps * unroll` tokens in a ring of `stages` (at least 2); else the lanes' FMAs.
        one_split_tokens (int): A page table of this many token slots or fewer is one split; 0: splits fill
            the GPU at every width. Any launch of one split and no attention sink (this, or many rows
            whose fill needs one) writes the output itself, no combine kernel.
        slabs (int): Tensor-core kernel: 16-token slabs a warp takes at once (one softmax update for all,
            their products independent), the tile a multiple of `16 * slabs` tokens.
        register_tables (bool): Tensor-core kernel, AURA codes: a 4-bit codebook held in registers and looked up
            four codes at a time by byte permutes, not one shared-memory load a code; an 8-bit key's table address
            formed by one OR, not an add (`kernels.cuda_mma`). Same centroids, fewer instructions.
        page_copies (bool): Tensor-core kernel: where a tile is whole pages and the block's threads split evenly
            over them, a group of threads copies each page, its pool row found once (one shared load, one select),
            then copies at fixed strides, not a pool row looked up for every 16-byte copy (`kernels.cuda_mma`);
            the last live page is copied whole. Same output, fewer instructions.
    """

    dims_per_lane: int = 8
    unroll: int = 1
    warps: int = 4
    waves: int = 4
    query_in_registers: bool = True
    prefetch: bool = False
    stages: int = 0
    stage_bytes: int = 8192
    mma: bool = False
    one_split_tokens: int = 0
    slabs: int = 1
    register_tables: bool = False
    page_copies: bool = True


def _split_plan(max_tokens: int, batch: int, n_kv_heads: int, page_size: int, waves: int,
                one_split_tokens: int = 0) -> tuple[int, int]:
    """(tokens per split, splits) of a row's `max_tokens` slots (tokens, whole pages per split).

    One split where `max_tokens <= one_split_tokens` (and `_MAX_SPLIT_PAGES` pages hold it). Otherwise
    enough blocks (`batch * n_kv_heads * splits`) to fill the GPU `waves` times over, each split at most
    `_MAX_SPLIT_PAGES` pages. Where that cap asks for more splits than the fill does, the slots are shared
    out equally (whole pages) over a multiple of the fill's count: a cap that left two full splits and a
    sliver (8,448 slots of a bucketed page table: 4,096 + 4,096 + 256) put a third of the blocks late in
    the launch, and the full ones behind them ran in a second round
    (`ops/results/kernel_sweep_gpu_split_plan.json`: 32 rows at 8,214 tokens, split 4,096 + 4,096 + 32,
    affine4 3.08 ms against 2.55 at 8,192; 2.63 in four equal splits).
    """
    if max_tokens <= min(one_split_tokens, _MAX_SPLIT_PAGES * page_size):
        return max(page_size, -(-max_tokens // page_size) * page_size), 1
    target = max(1, math.ceil(waves * NUM_SMS / (batch * n_kv_heads)))
    needed = math.ceil(max_tokens / (_MAX_SPLIT_PAGES * page_size))  # the cap's minimum
    splits = target if needed <= target else target * math.ceil(needed / target)
    per_split = max(page_size, math.ceil(math.ceil(max_tokens / splits) / page_size) * page_size)
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
    flat: bool = False,
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
        flat (bool): Return [B, n_heads * D], the output projection's input, the same memory without a reshape.

    Returns:
        mx.array: [B, n_heads, 1, D] (flat: [B, n_heads * D]) in the queries' dtype and the model's domain.

    Raises:
        ValueError: a format the kernels do not take (`LayerFormat.is_regular` is false).
    """
    batch, n_heads, _, head_dim = queries.shape
    group = n_heads // n_kv_heads
    if tails is None:  # a placeholder row: no page id names it (ids past the pool's pages name tail pages)
        tails = tuple(_dummy(p.dtype, p.shape[1]) for p in pools)
    if not fmt.is_regular:
        raise ValueError(f"the CUDA kernels take regular formats only (kernels.paged_attention.uses_cuda), got {fmt}")
    tuning = tuning or default_tuning(fmt, batch * n_kv_heads, tensor_cores=_mma_serves(fmt, queries.dtype, group))
    per_split, splits = _split_plan(page_table.shape[1] * page_size, batch, n_kv_heads, page_size, tuning.waves,
                                    tuning.one_split_tokens)
    assert per_split <= _MAX_SPLIT_PAGES * page_size, "the partial kernel holds a split's page ids in shared memory"
    assert page_table.shape[1] == 0 or per_split == page_size * -(-page_table.shape[1] // splits), \
        "the kernels derive a split's width from the page table and the grid"
    rotate = fmt.key.kind == AURA
    q_scale = scale * _LOG2E / (math.sqrt(head_dim) if rotate else 1.0)
    raw_dtype = fmt.key.dtype if fmt.is_raw else mx.uint32
    common = [("T", queries.dtype), ("RT", raw_dtype), ("D", head_dim), ("G", group), ("P", page_size),
              ("MAXPG", _MAX_SPLIT_PAGES), *_part_args("K", fmt.key), *_part_args("V", fmt.value),
              *_layout_args(fmt), ("ROTATE", rotate), ("QSCALE", _float_bits(q_scale))]
    mma = _mma_staging(fmt, queries.dtype, group, page_size, per_split, tuning) if tuning.mma else None
    if mma is not None:
        template, warps = common + mma, tuning.warps
    else:
        lanes, warps = _lanes_and_warps(fmt, group, tuning)
        staging = _staging(fmt, group, page_size, per_split, warps * (32 // lanes) * tuning.unroll, tuning)
        template = common + [("LPT", lanes), ("W", warps), ("U", tuning.unroll), ("QREG", tuning.query_in_registers),
                             ("PREFETCH", tuning.prefetch), *staging]
    pool_inputs = [pools[0], pools[1], tails[0], tails[1]] if fmt.is_raw else [pools[0], tails[0]]
    launch = dict(inputs=[queries, *pool_inputs, page_table, lengths, _attention_constants(fmt, head_dim)],
                  grid=(splits * 32 * warps, n_kv_heads, batch), threadgroup=(32 * warps, 1, 1))
    out_shape = (batch, n_heads * head_dim) if flat else (batch, n_heads, 1, head_dim)
    has_sink, unrotate = sinks is not None, ("UNROTATE", fmt.value.kind == AURA)
    if splits == 1 and not has_sink:  # one launch: the partial kernel writes the output
        (out,) = _partial_kernel(mma is not None, not fmt.is_raw, True)(
            template=[*template, unrotate], output_shapes=[out_shape], output_dtypes=[queries.dtype], **launch)
        return out
    o_part, ml_part = _partial_kernel(mma is not None, not fmt.is_raw)(
        template=template,
        output_shapes=[(batch, n_heads, splits, head_dim), (batch, n_heads, splits, 2)],
        output_dtypes=[mx.float32, mx.float32], **launch)
    merge = min(_COMBINE_THREADS // head_dim, 1 << (splits - 1).bit_length())  # splits merged side by side
    (out,) = _kernels()["combine"](
        inputs=[o_part, ml_part, sinks.astype(mx.float32) if has_sink else _constant((0.0,), mx.float32),
                _signs(fmt.value, head_dim)],
        template=[("T", queries.dtype), ("D", head_dim), ("HAS_SINK", has_sink), unrotate],
        grid=(head_dim * merge, n_heads, batch),
        threadgroup=(head_dim * merge, 1, 1),
        output_shapes=[out_shape],
        output_dtypes=[queries.dtype],
    )
    return out


def _float_bits(x: float) -> int:
    """A float32's bits as a signed int: a template constant the kernels read back with `__int_as_float`."""
    return int(np.array(x, np.float32).view(np.int32))


def _lanes_and_warps(fmt: LayerFormat, group: int, tuning: Tuning) -> tuple[int, int]:
    """The FMA kernel's lanes a token (`LPT`) and warps a block: the tuning's, cut so the static shared
    memory fits: the fixed arrays (`_fixed_shared_bytes`) and per softmax state (32 / lanes a warp) the merge
    rows `sm_acc[G][D]` plus `sm_m[G]`, `sm_l[G]`, 4 bytes each. Where even one warp's rows do not fit
    (many query heads a kv head), a token takes all 32 lanes (one state a warp)."""
    room = _STATIC_SHARED_BYTES - _fixed_shared_bytes(fmt, group)
    per_warp = lambda lanes: 4 * (32 // lanes) * group * (fmt.head_dim + 2)  # noqa: E731  (merge rows, bytes)
    lanes = fmt.head_dim // _dims_per_lane(fmt, tuning.dims_per_lane)
    if per_warp(lanes) > room:
        lanes = fmt.head_dim // _dims_per_lane(fmt, 1)
    return lanes, max(1, min(tuning.warps, room // per_warp(lanes)))


def _fixed_shared_bytes(fmt: LayerFormat, group: int) -> int:
    """The partial kernel's shared memory besides its stages and merge rows (bytes): the query `qs[G*D]`
    floats, codebooks `cbs` (AURA: at most 512 entries, floats in the FMA kernel, 16-bit in the
    tensor-core kernel; 4 bytes each reserved), page ids `pids[MAXPG]` ints and the row's length `live`
    (16 bytes with its alignment)."""
    cents = 512 if AURA in (fmt.key.kind, fmt.value.kind) else 1
    return 4 * (group * fmt.head_dim + cents + _MAX_SPLIT_PAGES) + 16


def _ring_budget(fmt: LayerFormat, group: int) -> int:
    """Bytes a partial kernel's ring of stages may take: what the fixed arrays leave of 48 KB (less 64 for alignment)."""
    return _STATIC_SHARED_BYTES - _fixed_shared_bytes(fmt, group) - 64


def _copy_geometry(row_bytes: int, page_size: int) -> list:
    """RG (rows a copy group: whole 16-byte copies that never straddle a page) and CG (bytes a copy: 16, or
    4 with one-row groups where page_size is not a multiple of the rows that fill 16 bytes)."""
    group_rows = 16 // math.gcd(row_bytes, 16)
    return [("RG", group_rows), ("CG", 16)] if page_size % group_rows == 0 else [("RG", 1), ("CG", 4)]


_NO_STAGES = [("NS", 0), ("TT", 4), ("RG", 1), ("CG", 4)]  # loads straight into registers (TT, RG, CG unused)


def _staging(fmt: LayerFormat, group: int, page_size: int, per_split: int, step: int, tuning: Tuning) -> list:
    """Template arguments of the partial kernel's stages: NS (stages, 0: none), TT (tokens a tile), RG and CG
    (`_copy_geometry`). TT is a multiple of the block's `step` (tokens
    it works on at once) and of 4, at most a split's tokens (rounded up), and the stages fit the shared
    memory left beside the fixed arrays."""
    if tuning.stages == 0:
        return _NO_STAGES
    parts = 2 if fmt.is_raw else 1
    row_bytes = fmt.head_dim * fmt.key.dtype.size if fmt.is_raw else 4 * fmt.row_words
    unit = step * 4 // math.gcd(step, 4)
    budget = _ring_budget(fmt, group)
    tile = min(tuning.stage_bytes, budget // tuning.stages) // (parts * row_bytes) // unit * unit
    tile = max(unit, min(tile, -(-per_split // unit) * unit))
    stages = min(tuning.stages, budget // (parts * row_bytes * tile))
    if stages < 2:  # not even two tiles of the block's step fit: loads straight into registers
        return _NO_STAGES
    return [("NS", stages), ("TT", tile), *_copy_geometry(row_bytes, page_size)]


def _mma_staging(fmt: LayerFormat, dtype: mx.Dtype, group: int, page_size: int, per_split: int,
                 tuning: Tuning) -> list | None:
    """Template arguments of the tensor-core kernel's ring (`kernels.cuda_mma`): W (warps), TT (tokens a
    tile: `16 * warps * unroll`, at most a split's tokens, in multiples of `16 * slabs`), NS (stages), CH
    (`slabs`), RG and CG
    (compressed rows' copies, `_copy_geometry`); stages, then tile tokens, are cut until the ring fits
    beside the fixed arrays. None where the kernel does not serve the layer (dtype, head_dim, group, a
    lane's codes not whole words: `_whole_lane_words`) or even two 16-token stages do not fit."""
    if not _mma_serves(fmt, dtype, group):
        return None
    d = fmt.head_dim
    row_bytes = 2 * d if fmt.is_raw else 4 * fmt.row_words
    token_bytes = 2 * (d + 8) * 2 if fmt.is_raw else row_bytes  # raw: K and V rows padded to d + 8
    budget = _ring_budget(fmt, group)
    warps, stages, unit = tuning.warps, max(2, tuning.stages), 16 * tuning.slabs
    tile = max(unit, min(16 * warps * tuning.unroll // unit * unit, -(-per_split // unit) * unit))
    while stages * tile * token_bytes > budget or 4 * warps * group * (d + 2) > budget:
        if stages > 2:
            stages -= 1
        elif tile > unit:
            tile -= unit
        else:
            return None
    return [("W", warps), ("TT", tile), ("NS", stages), ("CH", tuning.slabs), ("LUT", tuning.register_tables),
            ("PGC", tuning.page_copies), *_copy_geometry(row_bytes, page_size)]


def _mma_serves(fmt: LayerFormat, dtype: mx.Dtype, group: int) -> bool:
    """Whether the tensor-core kernel takes the layer: fp16/bf16 queries (raw K/V of the same dtype), head_dim 64
    or 128 (the shapes run on the H200), at most 16 query heads a kv head, a lane's codes whole words."""
    if dtype not in (mx.float16, mx.bfloat16) or fmt.head_dim not in (64, 128) or group > 16:
        return False
    return fmt.key.dtype == dtype if fmt.is_raw else _whole_lane_words(fmt)


def _whole_lane_words(fmt: LayerFormat) -> bool:
    """Whether the tensor-core kernel's lanes hold whole words of a compressed row: a lane decodes
    head_dim / 4 contiguous dims of every key and head_dim / 8 of every value, each span inside one
    affine group (`kernels.cuda_mma`). Not so, e.g., for 2-bit values at head_dim 64 (16 bits a lane)."""
    spans = ((fmt.key, fmt.head_dim // 4), (fmt.value, fmt.head_dim // 8))
    return all(span * part.bits % 32 == 0 and (part.kind != AFFINE or part.group_size % span == 0)
               for part, span in spans)


def _dims_per_lane(fmt: LayerFormat, wanted: int) -> int:
    """`wanted`, cut so a lane's dims stay within the head, one affine group, and 32 lanes cover the head."""
    groups = [p.group_size for p in (fmt.key, fmt.value) if p.kind == AFFINE]
    return max(fmt.head_dim // 32, min(wanted, fmt.head_dim, *groups))


def default_tuning(fmt: LayerFormat, rows: int, tensor_cores: bool = True) -> Tuning:
    """The launch shape measured best on the H200 (`ops/kernel_sweep.py --gpu-time`,
    `ops/results/kernel_sweep_gpu_cupti_mma.json`: each model layer's partial + combine kernels, chained).

    Args:
        fmt (LayerFormat): The layer's format.
        rows (int): Sequences times kv heads of the launch (one block walks one of them per split).
        tensor_cores (bool): Whether the tensor-core kernel takes the layer (`_mma_serves`); where it does not,
            compressed rows keep the FMA kernel's ring of four stages.

    The tensor-core kernel wherever it serves the layer. At 32 streams x 8K (llama shape, 16 layers) it took
    2.65 ms over raw K/V (best FMA kernel 3.38), 2.63 over affine4 (3.33) and 2.36 over aura4v4 (2.99); at 1 x
    32K 0.49 over raw (FMA 1.25) and 0.50 over aura4v4 (0.65). Over affine4 at 1 x 32K the FMA kernel was faster
    (0.66 against 0.84 ms), at 1 x 8K slower (0.56 against 0.30): in the engine, where a single stream's step is
    bound by the host, affine4 on the tensor cores ran at 1.15 / 1.02 of raw at 8K / 32K, so it stays there.
    Four warps at head_dim 64, two at 128 (the padded tiles of raw K/V must fit 48 KB; over AURA keys of 4 bits
    or fewer four won on an earlier kernel, `ops/results/kernel_sweep_gpu_cupti_hd128_tiles.json`, and lost on
    this one: an H100, qwen3 32 x 8K aura4v4 5.20 ms with two warps and two stages against 5.43 with four and
    two, 5.41 with four and four, `ops/results/stages_gpu_h100_2026-12-07.json`); tiles of `16 * warps` tokens,
    twice that for compressed K/V (each warp takes two 16-token chunks between barriers): over many rows at head_dim 64
    aura4v4 2.36 against 2.55 ms, affine4 2.63 against 2.74, at 128 aura8v4 8.08 against 8.39, affine4 6.99
    against 7.21-7.46; at 1 x 32K (`ops/results/gpu_time_*_32k_long_tiles.json`, the engine's launches) aura8v4
    25.9 against 27.5 us a layer and aura4v4 23.9 against 24.7 at head_dim 64, 44.0 against 45.1 and 39.3
    against 41.0 at 128 (raw 24.5 and 47.3). Compressed K/V: a warp takes its two 16-token slabs at once (`slabs`:
    one softmax update, twice the independent products and code lookups in flight; the kernel is bound by
    latency, not bytes) and, over few rows, two warps a block (`ops/results/slabs_gpu_2026-12-04.json`, CUPTI,
    16 / 28 layers' partial + combine, ms, new against old default): llama 1 x 32K affine8 0.360 / 0.365, affine4
    0.315 / 0.325, aura8v4 0.424 / 0.433, aura4v4 0.368 / 0.391 (raw 0.402); 1 x 8K 0.177 / 0.194, 0.166 /
    0.176, 0.203 / 0.217, 0.185 / 0.198 (raw 0.197); 32 x 8K (four warps) 1.83 / 1.93, 1.59 / 1.62, 2.29 /
    2.31, 2.08 / 2.08 (raw 2.32); qwen3 1 x 32K 0.956 / 1.002, 0.825 / 0.911, 1.214 / 1.284, 1.018 / 1.078
    (raw 1.373). Raw K/V gained nothing from two slabs. AURA codebooks are looked up with `register_tables`
    (an H100, `ops/results/kernel_sweep_gpu_h100_2026-12-07_register_tables.json`, llama 1 x 32K, ms a step:
    aura8v4 0.435 against 0.456, aura4v4 0.378 against 0.404); more waves (6, 8) were slower there for raw,
    aura8v4 and aura4v4, and four warps a block for the AURA schemes
    (`kernel_sweep_gpu_h100_2026-12-07_waves_half_table.json`). Every tensor-core launch copies its tiles page by
    page (`page_copies`; an H200, `ops/results/page_copies_gpu_h200_2026-12-07.json`, llama 1 x 32K, ms a step:
    aura8v4 0.406 against 0.417, aura4v4 0.347 against 0.376, affine4 0.290 against 0.315, raw 0.386 against
    0.394; four warps a block still slower than two for the compressed schemes). Compressed K/V on the tensor
    cores: a ring of two stages (one tile copied ahead of the math), not four (the FMA kernel keeps four, not
    measured with two); two were as fast or faster at every shape measured with these warps (an
    H100, `ops/results/stages_gpu_h100_2026-12-07.json`, CUPTI, partial + combine a step, ms, two against four
    stages): llama 1 x 32K affine8 0.343 / 0.381, affine4 0.289 / 0.306, aura8v4 0.384 / 0.423, aura4v4 0.346
    / 0.361 (three: 0.397, 0.345; six slower still); 1 x 8K 0.185 / 0.193, 0.170 / 0.175, 0.195 / 0.204, 0.187
    / 0.188; 32 x 8K affine4 1.31 / 1.39, aura8v4 2.02 / 2.08, aura4v4 1.755 / 1.756; qwen3 1 x 32K 0.959 /
    0.959, 0.740 / 0.842, 1.115 / 1.170, 0.921 / 1.007. Raw K/V keeps four: its time did not move with its
    stages at llama 1 x 32K (0.462 / 0.461 ms), and at 1 x 8K one sweep read 0.205 / 0.213. Few rows
    (`rows < NUM_SMS`): four waves of blocks (short splits across every SM), but a short page table (up to 768
    slots, 128 KiB of a kv head's K/V) is one split and no combine (`ops/results/split_ab_gpu.json`, engines stepped
    in turn at a 512-token context, tables of 528-768 slots: llama raw 1.05-1.09x, aura4v4 1.03x, qwen3 aura4v4
    1.11x; qwen3 raw, 384 KiB, 0.93x). The byte cap is 128 KiB since
    `ops/results/one_split_bytes_gpu_2026-12-03.json` (two A/B pairs, 3 runs each, one host): llama raw at a
    512-token context (768 slots, 192 KiB) split to fill the GPU ran 806-836 tok/s against 754-791 as one split
    (1.05x), aura4v4 (52 KiB) within noise, and one split stayed ahead at a 64-token context. Many rows: two
    waves, each block walking a long row. Elsewhere (float32 queries, head_dims other
    than 64 and 128, more than 16 query heads a kv head, a lane's codes not whole words) the FMA kernel, its
    rows staged by `cp.async` (at 32 x 8K 3.0-3.8 ms against 3.6-4.4 loading straight to registers). GPUs before
    compute capability 8.0 have neither `cp.async` nor `mma.m16n8k16`: they load straight into registers, the
    next tile prefetched for many rows. Single-stream figures at 1 x 8K moved up to 2x between runs of one shape
    on the lent hosts (clocks): the shapes were chosen on the 32K and 32 x 8K cases.
    """
    wide = 16 if fmt.head_dim > 64 else 8
    many = rows >= NUM_SMS
    waves = 2 if many else 4
    if _compute_capability() < 8:
        return Tuning(dims_per_lane=wide, unroll=1, warps=4, waves=waves, prefetch=many)
    one_split = 0 if many else min(_ONE_SPLIT_TOKENS, _ONE_SPLIT_BYTES // fmt.bytes_per_row)
    if fmt.is_raw:
        return Tuning(dims_per_lane=wide, unroll=1, warps=4 if fmt.head_dim <= 64 else 2, waves=waves, stages=4,
                      mma=True, one_split_tokens=one_split)
    return Tuning(dims_per_lane=wide, unroll=2, warps=4 if many and fmt.head_dim <= 64 else 2, waves=waves,
                  stages=2 if tensor_cores else 4, mma=True, one_split_tokens=one_split, slabs=2, register_tables=True)


@functools.cache
def _compute_capability() -> int:
    """The default GPU's compute capability (major); 8 where MLX does not report it (its CUDA backend does)."""
    return int(mx.device_info().get("compute_capability_major", 8))


@functools.cache
def _dummy(dtype: mx.Dtype, width: int) -> mx.array:
    return mx.zeros((1, width), dtype)
