"""Attention that reads a layer's page pools in their stored format: the one place that chooses how.

Every cache of ours (single-sequence `KVCache`, paged `BatchedKVCache`) stores a layer as
pools of rows (`kernels.kv_format`) addressed through page tables, and calls one of:

- `decode_attention`: one query per row over all of the row's live slots. CUDA: the fused
  split-K kernels (`kernels.cuda_kv`), no gather, no dequantized copy. Elsewhere (the CPU,
  and Metal until a Metal twin can be run and tested) the same algorithm in MLX ops over
  chunks of pages with an online softmax, so temporary memory is O(chunk), not O(context).
- `prefill_attention`: a chunk of L queries over the history (pages, chunked the same way)
  plus the chunk's own keys; masks come from token positions, never from a [L, T] array
  built on the host.
- `contiguous_attention`: a raw single-sequence cache whose pages are contiguous: plain
  `mx.fast.scaled_dot_product_attention` over views (bitwise mlx-lm's own path).
- layers whose attention runs on operands the model derives from what the cache returns (MLA)
  are not attended here: `kernels.latent_attention` hands the model their decoded slots.

Keys and values may have different widths (queries `[..., Dk]`, outputs `[..., Dv]`).

Masked slots are never multiplied in: their values are zeroed before `p @ V`, so storage
outside a row's live slots (padding, another sequence's leftovers, NaN) changes no output.

Source: Milakov & Gimelshein, "Online normalizer calculation for softmax" (arXiv 1805.02867);
Dao et al., Flash-Decoding (2023); CACHES.md "AURA encode / decode" (rotated domain).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from kernels import cuda_kv
from kernels.cpu_exp import softmax_exp
from kernels.kv_format import AFFINE, LayerFormat

CHUNK_TOKENS = 4096  # history slots decoded at once by the MLX-ops path
PARALLEL_MIN_TOKENS = 512  # CPU: history slots per chunk below which chunks are not split further for threads
_MAX_CPU_STREAMS = 8
_PACKED_MAX_ROWS = 16  # query rows (G * L) up to which affine chunks use quantized_matmul on the CPU
_NEG = -1e30  # floor of running maxima (a fully masked chunk must not give exp(-inf + inf))


@dataclass(frozen=True, slots=True)
class PoolRef:
    """One layer's pools and how their rows are addressed.

    Attributes:
        fmt (LayerFormat): Row format.
        pools (tuple[mx.array, ...]): Each `[n_kv_heads * num_pages * page_size, width]`; row
            `(h * num_pages + page) * page_size + slot` holds kv head h of one token.
        n_kv_heads (int): H.
        page_size (int): P, token slots per page.
        tails (tuple[mx.array, ...] | None): Pools of extra pages (same format) that page ids
            `>= num_pages` name (decode windows write there), or None.
    """

    fmt: LayerFormat
    pools: tuple[mx.array, ...]
    n_kv_heads: int
    page_size: int
    tails: tuple[mx.array, ...] | None = None

    @property
    def num_pages(self) -> int:
        return self.pools[0].shape[0] // (self.n_kv_heads * self.page_size)

    def gather(self, pages: mx.array) -> tuple[mx.array, ...]:
        """Rows of whole pages: int32 `[B, n]` page ids -> per pool `[B, H, n * P, width]`."""
        heads = mx.arange(self.n_kv_heads, dtype=mx.int32)[None, :, None]
        out = []
        for i, pool in enumerate(self.pools):
            out.append(_gather_blocks(pool, pages, heads, self.num_pages, self.page_size))
            if self.tails is not None:
                tail = self.tails[i]
                tail_pages = tail.shape[0] // (self.n_kv_heads * self.page_size)
                in_tail = (pages >= self.num_pages)[:, None, :, None]
                local = mx.clip(pages - self.num_pages, 0, tail_pages - 1)
                from_tail = _gather_blocks(tail, local, heads, tail_pages, self.page_size)
                in_tail = mx.repeat(in_tail, self.page_size, axis=2)
                out[-1] = mx.where(in_tail, from_tail, out[-1])
        return tuple(out)


def _gather_blocks(pool: mx.array, pages: mx.array, heads: mx.array, num_pages: int, page_size: int) -> mx.array:
    batch, n = pages.shape
    blocks = heads * num_pages + mx.clip(pages, 0, num_pages - 1)[:, None, :]  # [B, H, n]
    rows = mx.take(pool.reshape(-1, page_size, pool.shape[-1]), blocks.reshape(-1), axis=0)
    return rows.reshape(batch, heads.shape[1], n * page_size, pool.shape[-1])


# -- decode ------------------------------------------------------------------------------


def decode_attention(
    queries: mx.array, ref: PoolRef, page_table: mx.array, lengths: mx.array, *, scale: float,
    sinks: mx.array | None = None,
    flat: bool = False,
) -> mx.array:
    """Attention of one query per row over every live slot of the row.

    Args:
        queries (mx.array): [B, n_heads, 1, Dk], RoPE applied.
        ref (PoolRef): The layer's pools.
        page_table (mx.array): int32 [B, NP]: slot t of row b lives in page `page_table[b, t // P]`.
        lengths (mx.array): int32 [B], live slots per row (all attended).
        scale (float): Score scale.
        sinks (mx.array | None): [n_heads] learned attention-sink logits.
        flat (bool): Return [B, n_heads * Dv] (the output projection's input; on CUDA without a reshape).

    Returns:
        mx.array: [B, n_heads, 1, Dv] (flat: [B, n_heads * Dv]) in the queries' dtype.
    """
    if uses_cuda(ref.fmt):
        return cuda_kv.decode_attention(queries, ref.fmt, ref.pools, ref.tails, page_table, lengths, flat=flat,
                                        n_kv_heads=ref.n_kv_heads, page_size=ref.page_size, scale=scale, sinks=sinks)
    out = _attend_chunks(queries, ref, History(lengths, page_table), None, None, scale=scale, sinks=sinks)
    return out.reshape(out.shape[0], -1) if flat else out


def uses_cuda(fmt: LayerFormat) -> bool:
    """Whether the fused CUDA kernels serve this format here.

    They take one power-of-two head_dim from 8 to 256 for keys and values, codes in whole words,
    affine groups that divide it, Sylvester rotations and AURA codes of 2..8 bits
    (`LayerFormat.is_regular`); other geometries (head_dim 80, 96, 192, keys wider than values, tail
    groups) and 9- or 10-bit AURA codes take the MLX-ops path.
    """
    if not fmt.is_regular:
        return False
    d = fmt.key_dim
    return cuda_kv.is_available() and 8 <= d <= 256 and d & (d - 1) == 0


# -- prefill -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class History:
    """The stored slots a forward attends: slots `0 .. length-1` of each row.

    Attributes:
        lengths (mx.array): int32 [B], slots per row.
        page_table (mx.array | None): int32 [B, NP], pages of the rows (read through `PoolRef`).
        rows (tuple[mx.array, ...] | None): Or the slots already gathered, per pool
            [B, H, T, width] (a chunk that wraps a window reads the ring before writing it).
        positions (mx.array | None): int32 [B, >= T], absolute position held by each slot (a
            wrapped window ring), or None when slot t holds position t.
    """

    lengths: mx.array
    page_table: mx.array | None = None
    rows: tuple[mx.array, ...] | None = None
    positions: mx.array | None = None

    def num_slots(self, page_size: int) -> int:
        """History slots read per row (pages read times `page_size`, or the gathered rows)."""
        return self.rows[0].shape[2] if self.rows is not None else self.page_table.shape[1] * page_size

    def chunks(self, ref: PoolRef, ways: int = 1, gate=None):
        """Yield (first slot, rows per pool [B, H, C, width]) over the history, C <= CHUNK_TOKENS.

        `ways` > 1 asks for at least that many chunks (whole pages, each >= PARALLEL_MIN_TOKENS
        slots) so they can run on that many threads. Each chunk's reads are built when it is
        yielded, so they land on the stream current at that moment. `gate` (a function of a list
        of arrays returning them, or None) is applied to what a chunk reads from (page-table slice
        or row slices) just before the read: `_attend_chunks` makes it wait on earlier chunks there.
        """
        unit = 1 if self.rows is not None else ref.page_size  # slots per chunk step
        total = self.rows[0].shape[2] if self.rows is not None else self.page_table.shape[1]
        count = max(-(-total * unit // CHUNK_TOKENS), min(ways, total * unit // PARALLEL_MIN_TOKENS), 1)
        step = max(1, -(-total // count))
        gate = gate or (lambda arrays: arrays)
        for first in range(0, total, step):
            if self.rows is not None:
                yield first, tuple(gate([r[:, :, first : first + step] for r in self.rows]))
            else:
                yield first * unit, ref.gather(gate([self.page_table[:, first : first + step]])[0])


@dataclass(frozen=True, slots=True)
class WindowRule:
    """Sliding window with sinks: key k is visible to query q iff `k < keep or k > q - ring`."""

    keep: int
    ring: int


def prefill_attention(
    queries: mx.array,
    ref: PoolRef,
    history: History | None,
    new_keys: mx.array,
    new_values: mx.array,
    query_positions: mx.array,
    *,
    window: WindowRule | None,
    scale: float,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention of L queries per row over its history slots plus the chunk's own keys.

    Args:
        queries (mx.array): [B, n_heads, L, Dk], RoPE applied.
        ref (PoolRef): The layer's pools (history is read from them, chunk by chunk).
        history (History | None): What the chunk sees besides itself (None: nothing).
        new_keys, new_values (mx.array): [B, n_kv_heads, L, Dk] and [B, n_kv_heads, L, Dv] of
            the chunk, in the attention domain (`LayerFormat.decode` of their encoding: exactly
            what is stored).
        query_positions (mx.array): int32 [B, L], absolute positions of the chunk's tokens.
        window (WindowRule | None): The layer's window.
        scale (float): Score scale.
        sinks (mx.array | None): [n_heads] learned attention-sink logits.

    Returns:
        mx.array: [B, n_heads, L, Dv] in the queries' dtype.
    """
    qpos = query_positions[:, None, :, None]  # [B, 1, L, 1]
    extra = (new_keys, new_values, new_visible(query_positions, window))
    rule = None if window is None else (qpos, window)
    return _attend_chunks(queries, ref, history, extra, rule, scale=scale, sinks=sinks)


def _in_window(keys: mx.array, queries: mx.array, window: WindowRule) -> mx.array:
    return (keys < window.keep) | (keys > queries - window.ring)


def new_visible(query_positions: mx.array, window: WindowRule | None) -> mx.array:
    """[B, 1, L, L]: may the chunk's query i see the chunk's key j (causal, the window rule)."""
    qpos, kpos = query_positions[:, None, :, None], query_positions[:, None, None, :]
    visible = kpos <= qpos
    return visible if window is None else visible & _in_window(kpos, qpos, window)


# -- the MLX-ops path ----------------------------------------------------------------------


def _attend_chunks(queries, ref, history, extra, rule, *, scale, sinks):
    """Online softmax over history chunks of pages, then the chunk's own keys (`extra`).

    Queries are grouped per kv head as [B, H, G * L, D] (G query heads per kv head), so every
    product is a plain batched matmul; scores are float32 [B, H, G * L, C].
    """
    fmt = ref.fmt
    batch, n_heads, length, head_dim = queries.shape
    heads = ref.n_kv_heads
    group = n_heads // heads
    q = (fmt.rotate_query(queries.astype(mx.float32)) * scale).reshape(batch, heads, group * length, head_dim)

    def grouped(mask):  # [B, 1, L, C] -> [B, 1, G * L, C]
        return mx.broadcast_to(mask[:, :, None], (batch, 1, group, *mask.shape[2:])).reshape(batch, 1, -1, mask.shape[-1])

    # Decode of compressed rows: chunks on one CPU thread each (their gathers dominate). Raw chunks
    # are copies and BLAS, prompt chunks big matmuls: one stream (threads measured slower, and
    # concurrent chunks would raise prefill's peak memory).
    streams = _cpu_streams() if length == 1 and not fmt.is_raw else (None,)
    slots = 0 if history is None else history.num_slots(ref.page_size)
    # CPU decode always takes the chunks: from 4,096 scores their softmax exp (`softmax_exp`) is ~5x
    # faster than the one inside SDPA's CPU fallback. One layer of the default model: 1 row x 4000 slots
    # 2.96 -> 2.43 ms (raw); 32 rows x ~100 slots 3.5 -> 2.1 (raw), 6.0 -> 2.1 (aura4v4); 1 row x 300
    # (mx.exp either way) 0.32 -> 0.30 (raw), 0.51 -> 0.39 (aura4v4).
    cpu_decode = length == 1 and mx.default_device() == mx.cpu
    if slots <= CHUNK_TOKENS and not cpu_decode and not _packed(fmt, group * length):
        chunks = list(history.chunks(ref)) if history is not None else []
        return _single_pass(queries, fmt, history, chunks, extra, rule, scale=scale, sinks=sinks)
    # MLX runs a graph in breadth-first order, so unchained chunks would all be read and decoded
    # before the merges that free them (temporaries O(context)): each chunk waits on an earlier merge.
    state, merged = None, collections.deque(maxlen=len(streams))  # the last merges' states

    def after_earlier_chunks(arrays):  # chunk i is read once chunk i - len(streams) is merged
        return arrays if len(merged) < len(streams) else mx.depends(arrays, list(merged[0]))

    chunks = history.chunks(ref, ways=len(streams), gate=after_earlier_chunks) if history is not None else ()
    for first, rows in _spread(chunks, streams):
        valid, visible = history_masks(history, first, rows[0].shape[2], rule)
        if visible.shape[2] != 1:
            visible = grouped(visible)
        state = _merge(state, _chunk_scores(q, fmt, rows, visible, valid))
        merged.append(state)
    if extra is not None:
        keys, values, visible = extra
        scores = q @ keys.astype(mx.float32).swapaxes(-1, -2)
        state = _merge(state, _softmax_part(scores, grouped(visible), None, values.astype(mx.float32)))
    m, l, o = state
    if sinks is not None:
        sink = mx.repeat(sinks.astype(mx.float32).reshape(1, heads, group, 1), length, axis=2).reshape(1, heads, -1, 1)
        top = mx.maximum(m, sink)
        l, o = l * softmax_exp(m - top) + softmax_exp(sink - top), o * softmax_exp(m - top)
    out = (o / l).reshape(batch, n_heads, length, fmt.value_dim)
    return fmt.unrotate_output(out).astype(queries.dtype)


@functools.cache
def _thread_streams(count: int) -> tuple:
    return tuple(mx.new_stream(mx.cpu) for _ in range(count))


def _cpu_streams() -> tuple:
    """CPU streams compressed history chunks are spread over, one per core (at most 8).

    MLX's CPU ops of one stream (the codebook and unpack lookups, the dequantizing matmuls)
    run on that stream's thread, so chunks on separate streams decode in parallel: one 8K-token
    affine4 layer of the default model on the 2-core CI machine, 4.9 ms on one stream, 2.7 on two.
    Elsewhere (Metal) `(None,)`: the default stream.
    """
    if mx.default_device() != mx.cpu:
        return (None,)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return _thread_streams(max(1, min(cores, _MAX_CPU_STREAMS)))


def _spread(chunks, streams: tuple):
    """Yield `chunks`' items, chunk i built and consumed while stream `i % n` is the default.

    The generator is suspended inside the `with`, so the caller's loop body (the chunk's
    decode, scores and partial softmax) lands on the same stream as the chunk's reads.
    """
    items = iter(chunks)
    for i in itertools.count():
        stream = streams[i % len(streams)]
        with contextlib.nullcontext() if stream is None else mx.stream(stream):
            item = next(items, None)
            if item is None:
                return
            yield item


def history_masks(history: History, first: int, size: int, rule) -> tuple[mx.array, mx.array]:
    """(valid [B, 1, 1, C], visible [B, 1, 1 or L, C]) of history slots `first .. first+size-1`."""
    slots = first + mx.arange(size, dtype=mx.int32)
    valid = (slots[None, :] < history.lengths[:, None])[:, None, None, :]
    if rule is None:
        return valid, valid
    qpos, window = rule
    keys = slots[None, :] if history.positions is None else history.positions[:, first : first + size]
    return valid, valid & _in_window(keys[:, None, None, :], qpos, window)


def _single_pass(queries, fmt: LayerFormat, history, chunks, extra, rule, *, scale, sinks):
    """History that fits one chunk: decode it and run `mx.fast` SDPA once with an explicit mask.

    Serves prompt chunks, and decode off the CPU (Metal). Values outside a row's live slots are zeroed
    (0 * NaN would reach the output). Keys there are left as stored on the CPU, whose SDPA applies a
    boolean mask by selecting -inf for masked scores (a NaN score never survives it): that skips a copy
    of the keys. Elsewhere (Metal) they are zeroed too.
    """
    keys, values, masks = [], [], []
    zero_keys = mx.default_device() != mx.cpu
    for first, rows in chunks:
        valid, visible = history_masks(history, first, rows[0].shape[2], rule)
        k, v = fmt.decode(rows)
        slot_valid = valid.swapaxes(-1, -2)
        keys.append(mx.where(slot_valid, k, 0) if zero_keys else k)
        values.append(mx.where(slot_valid, v, 0))
        masks.append(visible)
    if extra is not None:
        keys.append(extra[0]), values.append(extra[1]), masks.append(extra[2])
    dtype = mx.float32  # as the chunked path: scores and sums in float32 whatever the storage
    k, v = (_joined([x.astype(dtype) for x in parts]) for parts in (keys, values))
    length = queries.shape[2]
    mask = _joined([mx.broadcast_to(m, (m.shape[0], 1, length, m.shape[-1])) for m in masks], axis=-1)
    q = fmt.rotate_query(queries.astype(dtype))
    sinks = None if sinks is None else sinks.astype(dtype)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
    return fmt.unrotate_output(out).astype(queries.dtype)


def _joined(parts: list[mx.array], axis: int = 2) -> mx.array:
    """`parts` concatenated along `axis` (one part as it is: no copy)."""
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis)


def _packed(fmt: LayerFormat, rows: int) -> bool:
    """Whether affine chunks run `quantized_matmul` on the codes (CPU, a few query rows, no tail groups)."""
    return (fmt.key.kind == AFFINE and rows <= _PACKED_MAX_ROWS and mx.default_device() == mx.cpu
            and fmt.key.is_regular(fmt.key_dim) and fmt.value.is_regular(fmt.value_dim))


def _chunk_scores(q, fmt: LayerFormat, rows: tuple[mx.array, ...], visible: mx.array, valid: mx.array):
    """(max, sum-exp, acc) of one history chunk; rows [B, H, C, width] per pool; valid [B, 1, 1, C]."""
    if _packed(fmt, q.shape[2]):
        return _affine_chunk(q, fmt, rows[0], visible, valid)
    (keys, k_scale), (values, v_scale) = fmt.decode_factored(rows)
    scores = q @ keys.astype(mx.float32).swapaxes(-1, -2)
    if k_scale is not None:  # AURA: one scale per key, applied to its scores, not its D elements
        scores = scores * k_scale.swapaxes(-1, -2)
    return _softmax_part(scores, visible, valid, values.astype(mx.float32), v_scale)


def _softmax_part(scores: mx.array, visible: mx.array, valid: mx.array | None, values: mx.array,
                  v_scale: mx.array | None = None):
    """Masked partial softmax; values at slots outside `valid` are zeroed, so NaN there cannot leak.

    `v_scale` [B, H, C, 1]: per-value factors (AURA) folded into the probabilities; zeroed outside
    `valid` too (the unit centroids they scale are always finite).
    """
    scores = mx.where(visible, scores, -mx.inf)
    m = mx.maximum(scores.max(axis=-1, keepdims=True), _NEG)
    p = softmax_exp(scores - m)
    weights = p
    if v_scale is not None:
        weights = p * (v_scale if valid is None else mx.where(valid.swapaxes(-1, -2), v_scale, 0.0)).swapaxes(-1, -2)
    elif valid is not None:
        values = mx.where(valid.swapaxes(-1, -2), values, 0.0)  # [B, 1, C, 1]
    return m, p.sum(axis=-1, keepdims=True), weights @ values


def _affine_chunk(q, fmt: LayerFormat, rows: mx.array, visible: mx.array, valid: mx.array):
    """Affine chunk on the CPU at decode, computed on the codes (no dequantized K/V).

    With codes c, scales s and biases b per group g, a score is `sum_g s_g (q_g . c_g) + b_g sum(q_g)` and an
    output `sum_t (p_t s_tg) c_tg + sum_t p_t b_tg`: plain matmuls over the codes as float32. Codes of 2, 4 or 8
    bits are read a byte at a time (`_code_lanes`) and multiplied as stored; other widths go through
    `mx.quantized_matmul`. One 4096-token chunk of the default model's layer (3 kv heads x 3 queries, compiled,
    2 cores), the whole chunk: affine4 1.5 ms, affine8 1.3; head_dim 128: 3.5 and 2.8 (each group's codes copied
    out for a matmul of its own first: 2.4, 1.4, 6.1, 5.6). Both beat dequantize + matmul for a few query rows;
    prompt chunks take that path (`_chunk_scores`), and on CUDA the fused kernels serve.
    """
    key, value = fmt.key, fmt.value
    meta = mx.view(mx.contiguous(rows[..., fmt.meta_offset :]), mx.float16).astype(mx.float32)
    kg, vg = fmt.key_meta_halves // 2, fmt.value_meta_halves // 2
    k_scale, k_bias = meta[..., :kg], meta[..., kg : 2 * kg]  # [B, H, C, groups]
    v_meta = mx.where(valid.swapaxes(-1, -2), meta[..., 2 * kg : 2 * kg + 2 * vg], 0.0)  # NaN outside: no output
    v_scale, v_bias = v_meta[..., :vg], v_meta[..., vg:]
    k_codes, v_codes = rows[..., : fmt.key_words], rows[..., fmt.key_words : fmt.meta_offset]
    if _bytewise(key.bits, fmt.key_dim):
        scores = _code_scores(q, _code_lanes(k_codes, key.bits), k_scale, k_bias, kg)
    else:
        scores = mx.quantized_matmul(q, mx.contiguous(k_codes), k_scale, k_bias, transpose=True,
                                     group_size=key.group_size, bits=key.bits)
    scores = mx.where(visible, scores, -mx.inf)
    m = mx.maximum(scores.max(axis=-1, keepdims=True), _NEG)
    p = softmax_exp(scores - m)
    if _bytewise(value.bits, fmt.value_dim):
        acc = _code_outputs(p, _code_lanes(v_codes, value.bits), v_scale, v_bias, vg)
    else:
        acc = mx.quantized_matmul(p, mx.contiguous(v_codes), v_scale, v_bias, transpose=False,
                                  group_size=value.group_size, bits=value.bits)
    return m, p.sum(axis=-1, keepdims=True), acc


def _bytewise(bits: int, dim: int) -> bool:
    """Whether `_code_lanes` reads these codes: a width that never straddles a byte, and whole words (no padding)."""
    return bits in (2, 4, 8) and dim * bits % 32 == 0


def _code_lanes(words: mx.array, bits: int) -> list[mx.array]:
    """`mx.quantize` codes [B, H, C, words] as float32 lanes: lane j [B, H, C, dim / n] holds elements j, j + n, ...
    (n = 8 / bits codes a byte; a word packs its elements from the least significant bit, little-endian bytes)."""
    data = mx.view(mx.contiguous(words), mx.uint8)
    if bits == 8:
        return [data.astype(mx.float32)]
    mask, last = (1 << bits) - 1, 8 // bits - 1
    lanes = [data & mask] + [(data >> (j * bits)) & mask for j in range(1, last)] + [data >> (last * bits)]
    return [lane.astype(mx.float32) for lane in lanes]


@functools.cache
def _group_mask(groups: int, lane_width: int, dim: int) -> mx.array:
    """float32 [groups, lane_width]: 1 where a lane's element i (vector element i * n + j) is in group g."""
    n = dim // lane_width
    member = np.arange(lane_width) * n // (dim // groups)
    return mx.array(member[None, :] == np.arange(groups)[:, None], dtype=mx.float32)


def _per_group(meta: mx.array) -> mx.array:
    """Scales or biases [B, H, C, G] as [B, H, G, 1, C]: one row of C a group, broadcast over query rows."""
    return meta.swapaxes(-1, -2)[:, :, :, None]


def _code_scores(q, lanes, scale, bias, groups: int):
    """Scores [B, H, R, C] of q [B, H, R, D] against affine keys as `_code_lanes`, scale/bias [B, H, C, groups].

    Each lane is one matmul against its codes as stored ([C, D / n] read transposed, no copy): the query's
    lane is spread over `groups` block-diagonal rows [G * R, D / n], so the product holds every group's dot
    products [G, R, C] at once, and the scales weight them after.
    """
    b, h, r, d = q.shape
    n = len(lanes)
    width = d // n
    q_lanes = q.reshape(b, h, 1, r, width, n)
    mask = _group_mask(groups, width, d)[:, None, :]  # [G, 1, D / n]
    dots = None
    for j, lane in enumerate(lanes):
        rows = (q_lanes[..., j] * mask).reshape(b, h, groups * r, width)
        part = rows @ lane.swapaxes(-1, -2)
        dots = part if dots is None else dots + part
    dots = dots.reshape(b, h, groups, r, -1)  # [B, H, G, R, C]
    q_sum = q.reshape(b, h, r, groups, d // groups).sum(axis=-1).swapaxes(-1, -2)[..., None]  # [B, H, G, R, 1]
    return (dots * _per_group(scale) + q_sum * _per_group(bias)).sum(axis=2)


def _code_outputs(p, lanes, scale, bias, groups: int):
    """Outputs [B, H, R, D] of weights p [B, H, R, C] over affine values as `_code_lanes`.

    The weights times each group's scales [G * R, C] multiply every lane as stored ([C, D / n], no copy);
    of the product [G, R, D / n] each element keeps its own group's row.
    """
    b, h, r, c = p.shape
    n, width = len(lanes), lanes[0].shape[-1]
    d = n * width
    scaled = (p[:, :, None] * _per_group(scale)).reshape(b, h, groups * r, c)
    parts = [scaled @ lane for lane in lanes]  # each [B, H, G * R, D / n]
    acc = (parts[0][..., None] if n == 1 else mx.stack(parts, axis=-1)).reshape(b, h, groups, r, width, n)
    acc = (acc * _group_mask(groups, width, d)[:, None, :, None]).sum(axis=2)  # element i * n + j at [i, j]
    return acc.reshape(b, h, r, d) + mx.repeat(p @ bias, d // groups, axis=-1)


def _merge(state, part):
    if state is None:
        return part
    (m1, l1, o1), (m2, l2, o2) = state, part
    m = mx.maximum(m1, m2)
    a, b = softmax_exp(m1 - m), softmax_exp(m2 - m)
    return m, l1 * a + l2 * b, o1 * a + o2 * b


# -- contiguous raw ------------------------------------------------------------------------


def contiguous_attention(queries, keys, values, *, scale: float, mask, sinks=None) -> mx.array:
    """`mx.fast.scaled_dot_product_attention` over K/V [B, H, T, Dk | Dv] (mlx-lm's path)."""
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
