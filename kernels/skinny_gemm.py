"""Projections of a few rows (2 to 32) on the tensor cores, in one cheap launch.

At batched decode every projection multiplies a handful of rows by a weight matrix. MLX's CUDA
backend sends such a product to cuBLASLt, whose evaluation, at every call, builds descriptors,
queries the algorithm heuristic and captures a stream into the step's graph: ~20 µs of host time
more than a custom kernel's launch (measured: with 65 projections a llama-1b step, 32 rows spent
2.55 ms of host time a step through cuBLASLt, 1.23 ms through this kernel). One row keeps MLX's
gemv; 2 to 32 rows (`MAX_ROWS`) take this kernel where MLX's CUDA backend is the default device;
more keep cuBLASLt, whose kernels were faster there (`ops/results/skinny_gemm_gpu_h100_2026-12-06.json`).

The kernel streams the weight once. Block (x, y) takes 16 R weight rows and the y-th of KS slices of
K; its W warps split the slice, and each warp runs `mma.sync` m16n8k16 with weight tiles as A (16 rows
x 16 k) and the activations as B (16 k x 8 rows, MT tiles of 8 rows), float32 accumulators; the
warps' sums meet in shared memory. Within each 32-wide chunk of K the order of the products is
permuted so that a lane's fragments of two steps come from one 16-byte load per row (a warp reads
whole 32-byte sectors): a dot product's order is free, so the result is the same sum in another
order (float32, then rounded to the activations' dtype once; cuBLAS sums in its own order, so the
two may differ in the last bit).

A warp's load latency is what bounds it past 8 rows: with the next chunks' loads in flight during
this chunk's products (`prefetch`) one 16-row tile a block reaches cuBLASLt's kernel time at 16 rows
and comes within 6% at 32. Wider blocks (R > 1: fewer re-reads of the activations from L2) measured
slower, and so did K split over blocks except for the down projection at 17 to 32 rows; where KS > 1
each block writes float32 partials, and the last block of a weight tile to finish (an atomic count per
tile, which that block sets back to 0; the pattern of CUDA's threadFenceReduction sample) sums them
into the output.

Sources: PTX ISA, "Matrix fragments for mma.m16n8k16" (the operand layouts); serial split-K
reduction as in CUTLASS's "split-K serial" GEMM.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from kernels import cuda_kv
from kernels.cuda_mma import MMA_HEADER

MAX_ROWS = 32  # rows the dispatch sends here; more keep cuBLAS
KERNEL_ROWS = 64  # rows the kernel takes (8 tiles of 8)

_BODY = r"""
  // out[m, n] = sum_k x[m, k] * w[n, k]. Block (bx, by): weight rows n0 = 16 R bx .. n0 + 16 R, K slice
  // [by KB, by KB + KB); warp: [by KB + warp KW, + KW). Lane (g, t) = (lane / 4, lane % 4) loads 16 bytes
  // at k = 8t of each 32-wide chunk of weight rows n0 + 16r + g and + 8 and of activation row 8j + g;
  // step s of the chunk takes words 2s, 2s + 1 of them.
  static_assert(sizeof(T) == 2 && K % (KS * W * 32 * U) == 0, "fp16/bf16, K in whole chunks");
  constexpr int KB = K / KS, KW = KB / W;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int M = x_shape[0];
  const int N = gridDim.x * 16 * R;
  const int n0 = blockIdx.x * 16 * R, kb = blockIdx.y * KB + warp * KW;
  const uint4* wr[R][2];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      wr[r][h] = reinterpret_cast<const uint4*>(w + (size_t)(n0 + 16 * r + 8 * h + g) * K + kb) + t;
  float acc[R][MT][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < MT; ++j) acc[r][j][0] = acc[r][j][1] = acc[r][j][2] = acc[r][j][3] = 0.f;
  // Loads of U chunks from chunk c: weight fragments into a, activation fragments into b.
  auto load = [&](int c, uint4 (&a)[R][2][U], uint4 (&b)[MT][U]) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        a[r][0][u] = __ldg(wr[r][0] + 4 * (c + u));
        a[r][1][u] = __ldg(wr[r][1] + 4 * (c + u));
      }
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      const int m = 8 * j + g;
      const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)m * K + kb) + t;
#pragma unroll
      for (int u = 0; u < U; ++u) b[j][u] = m < M ? __ldg(xr + 4 * (c + u)) : make_uint4(0u, 0u, 0u, 0u);
    }
  };
  auto mma = [&](const uint4 (&a)[R][2][U], const uint4 (&b)[MT][U]) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint32_t s0[4] = {a[r][0][u].x, a[r][1][u].x, a[r][0][u].y, a[r][1][u].y};
        const uint32_t s1[4] = {a[r][0][u].z, a[r][1][u].z, a[r][0][u].w, a[r][1][u].w};
#pragma unroll
        for (int j = 0; j < MT; ++j) {
          mma16816<T>(acc[r][j], s0, b[j][u].x, b[j][u].y);
          mma16816<T>(acc[r][j], s1, b[j][u].z, b[j][u].w);
        }
      }
  };
  if constexpr (PF) {  // the next U chunks' loads in flight during this U's products
    uint4 a[R][2][U], b[MT][U];
    load(0, a, b);
    for (int c = 0; c < KW / 32; c += U) {
      uint4 an[R][2][U], bn[MT][U];
      if (c + U < KW / 32) load(c + U, an, bn);
      mma(a, b);
      if (c + U >= KW / 32) break;
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int r = 0; r < R; ++r) { a[r][0][u] = an[r][0][u]; a[r][1][u] = an[r][1][u]; }
#pragma unroll
        for (int j = 0; j < MT; ++j) b[j][u] = bn[j][u];
      }
    }
  } else {
    for (int c = 0; c < KW / 32; c += U) {
      uint4 a[R][2][U], b[MT][U];
      load(c, a, b);
      mma(a, b);
    }
  }
  __shared__ float red[W][MT][4][32];  // one weight tile's accumulators of every warp at a time
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r > 0) __syncthreads();  // the last tile's sums are read
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) red[warp][j][q][lane] = acc[r][j][q];
    __syncthreads();
    for (int e = threadIdx.x; e < MT * 128; e += blockDim.x) {  // e = (j, q, l): lane l's accumulator q of tile j
      const int j = e >> 7, q = (e >> 5) & 3, l = e & 31;
      const int m = 8 * j + 2 * (l & 3) + (q & 1), n = n0 + 16 * r + (l >> 2) + (q >> 1) * 8;
      if (m < M) {
        float s = 0.f;
#pragma unroll
        for (int v = 0; v < W; ++v) s += red[v][j][q][l];
        STORE
      }
    }
  }
"""

_STORE_OUT = "out[(size_t)m * N + n] = static_cast<T>(s);"
_STORE_PART = "part[((size_t)blockIdx.y * M + m) * N + n] = s;"

# KS > 1: the last block of weight tile bx to finish sums the KS partials (`part` float32 [KS, M, N]) into
# `out`; `cnt` int32 [>= gridDim.x] is 0 before and after every launch (launches of one weight must not overlap).
_SPLIT_TAIL = r"""
  __shared__ int last;
  __threadfence();  // this block's partials are visible device-wide before it is counted
  __syncthreads();
  // atomicInc wraps at KS - 1: the KS-th arrival reads KS - 1 and leaves 0, in the same atomic operation
  unsigned* count = reinterpret_cast<unsigned*>(const_cast<int*>(cnt)) + blockIdx.x;
  if (threadIdx.x == 0) last = atomicInc(count, KS - 1) == KS - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int e = threadIdx.x; e < M * 16 * R; e += blockDim.x) {
    const int m = e / (16 * R), n = n0 + e % (16 * R);
    float s = 0.f;
#pragma unroll
    for (int y = 0; y < KS; ++y) s += __ldcg(part + ((size_t)y * M + m) * N + n);  // L2: other blocks' writes
    out[(size_t)m * N + n] = static_cast<T>(s);
  }
"""


@dataclass(frozen=True, slots=True)
class SkinnyTuning:
    """A launch shape of `skinny_matmul`: `tiles` 16-row weight tiles a block (R), `splits` slices of K over
    blocks (KS), `warps` a block (W, splitting its slice), `unroll` 32-wide chunks of K a warp loads at once
    (U), `prefetch` the next chunks' loads issued before this one's products (PF; twice the load registers)."""

    tiles: int = 1
    splits: int = 1
    warps: int = 8
    unroll: int = 4
    prefetch: bool = False

    def fits(self, rows: int, n: int, k: int) -> bool:
        """Whether this shape divides an [rows, k] @ [n, k].T product into whole tiles and chunks, with 1 to 8
        warps (the shared-memory sums of 8 take 32 KB at 64 rows), within the kernel's accumulator budget
        (tiles x 8-row activation tiles <= 16)."""
        if self.warps not in (1, 2, 4, 8) or min(self.tiles, self.splits, self.unroll) < 1:
            return False
        return (n % (16 * self.tiles) == 0 and k % (self.splits * self.warps * 32 * self.unroll) == 0
                and self.tiles * -(-rows // 8) <= 16)


@functools.cache
def default_tuning(rows: int, n: int, k: int) -> SkinnyTuning:
    """The launch shape for `rows` x [n, k], the fastest measured at llama-1b's projections on an H100
    (`ops/results/skinny_gemm_gpu_h100_2026-12-06.json`, round 2): one 16-row weight tile a block, K over its
    warps. Up to 8 rows: 8 warps, 4 chunks a load. 9 to 16: 4 warps, 4 chunks, the next ones' loads in flight
    (prefetch), but a long K (K >= 3 N: the down projection) over 8 warps, 2 chunks. 17 to 32: 2 chunks with
    prefetch, 4 warps for a wide weight (N >= 4 K: gate/up, the head), else 8, and a long K split over 2 blocks.
    Past 32 rows (MAX_ROWS) the dispatch keeps cuBLAS: at 64 rows every shape measured was slower than it."""
    long_k = k >= 3 * n
    if rows <= 8:
        wanted = SkinnyTuning(1, 1, 8, 4)
    elif rows <= 16:
        wanted = SkinnyTuning(1, 1, 8, 2, True) if long_k else SkinnyTuning(1, 1, 4, 4, True)
    else:
        wanted = SkinnyTuning(1, 2 if long_k else 1, 4 if n >= 4 * k else 8, 2, True)
    for splits in (wanted.splits, 1):  # fewer chunks a load first, then no split
        for unroll in (4, 2, 1):
            t = SkinnyTuning(1, splits, wanted.warps, unroll, wanted.prefetch)
            if unroll <= wanted.unroll and t.fits(rows, n, k):
                return t
    return SkinnyTuning(1, 1, 4, 1)  # K % 128 == 0 (`serves`: K % 256)


@functools.cache
def _kernel(split: bool):
    body = _BODY.replace("STORE", _STORE_PART if split else _STORE_OUT)
    if split:
        return cuda_kv.custom_kernel("bm_skinny_gemm_split", body + _SPLIT_TAIL, MMA_HEADER,
                                     input_names=["x", "w", "cnt"], output_names=["out", "part"])
    return cuda_kv.custom_kernel("bm_skinny_gemm", body, MMA_HEADER, input_names=["x", "w"], output_names=["out"])


@functools.cache
def _launch(dtype: mx.Dtype, rows: int, n: int, k: int, t: SkinnyTuning) -> tuple[int, dict]:
    """Weight tiles and the launch's template, grid and block (cached: a decode step launches 65 of them)."""
    template = [("T", dtype), ("K", k), ("MT", -(-rows // 8)), ("R", t.tiles), ("KS", t.splits), ("W", t.warps),
                ("U", t.unroll), ("PF", t.prefetch)]
    tiles = n // (16 * t.tiles)
    return tiles, dict(template=template, grid=(tiles * 32 * t.warps, t.splits, 1), threadgroup=(32 * t.warps, 1, 1))


_COUNTS: dict[tuple[int, int], mx.array] = {}


def _split_counts(weight: mx.array, tiles: int) -> mx.array:
    """int32 [max(tiles, 64)] zeros, one array per weight: the split launches of a weight run one after another (a
    decode step's projections are chained by their data), and each launch leaves the count at 0."""
    key = (id(weight), tiles)
    if key not in _COUNTS:  # at least 64: MLX keeps arrays of 8 bytes or fewer in host memory
        _COUNTS[key] = mx.zeros((max(tiles, 64),), mx.int32)
        mx.eval(_COUNTS[key])
    return _COUNTS[key]


def serves(x: mx.array, weight: mx.array, max_rows: int | None = None) -> bool:
    """Whether the dispatch sends `x @ weight.T` here: MLX's CUDA backend, 2 to `max_rows` (default MAX_ROWS;
    the kernel takes up to KERNEL_ROWS) rows, fp16/bf16 of one dtype, K a multiple of 256 and N of 16."""
    limit = MAX_ROWS if max_rows is None else max_rows
    if x.ndim != 2 or weight.ndim != 2 or not 2 <= x.shape[0] <= limit or x.shape[1] != weight.shape[1]:
        return False
    if x.dtype not in (mx.float16, mx.bfloat16) or weight.dtype != x.dtype:
        return False
    return x.shape[1] % 256 == 0 and weight.shape[0] % 16 == 0 and cuda_kv.is_available()


def skinny_matmul(x: mx.array, weight: mx.array, tuning: SkinnyTuning | None = None) -> mx.array:
    """`x @ weight.T` of a few rows, one launch (`serves` must hold).

    Args:
        x (mx.array): [M, K] activations, 2 <= M <= 64, float16/bfloat16, row-contiguous, on a 16-byte
            boundary (a whole array or a slice of whole rows).
        weight (mx.array): [N, K] (an `nn.Linear` weight as stored), x's dtype, row-contiguous, rows on
            16-byte boundaries (a whole array, not an offset view).
        tuning (SkinnyTuning | None): the launch shape (`default_tuning` when None). A split one (KS > 1)
            counts its blocks in one array per weight: two launches of one weight must not run at once (a
            decode step's projections are chained by their data, so they never do).

    Returns:
        mx.array: [M, N] in x's dtype (float32 sums, rounded once).

    Raises:
        ValueError: shapes, dtypes or a backend `serves` does not take, or a tuning that does not fit them.
    """
    if not serves(x, weight, KERNEL_ROWS):
        raise ValueError(f"skinny_matmul takes [2..{KERNEL_ROWS}, K] @ [N, K].T in fp16/bf16 on CUDA, K % 256 == 0 and "
                         f"N % 16 == 0; got {x.shape} {x.dtype} and {weight.shape} {weight.dtype}")
    if tuning is not None and not tuning.fits(x.shape[0], weight.shape[0], x.shape[1]):
        raise ValueError(f"{tuning} does not fit [{x.shape[0]}, {x.shape[1]}] @ [{weight.shape[0]}, {x.shape[1]}].T")
    return launch(x, weight, tuning)


def launch(x: mx.array, weight: mx.array, tuning: SkinnyTuning | None = None) -> mx.array:
    """`skinny_matmul` without its checks, for a caller that has `serves(x, weight)` (the decode step's
    projections, where each check is host time a step)."""
    rows, k = x.shape
    n = weight.shape[0]
    t = tuning or default_tuning(rows, n, k)
    tiles, launch_args = _launch(x.dtype, rows, n, k, t)
    if t.splits == 1:
        (out,) = _kernel(False)(inputs=[x, weight], output_shapes=[(rows, n)], output_dtypes=[x.dtype], **launch_args)
    else:
        out, _ = _kernel(True)(inputs=[x, weight, _split_counts(weight, tiles)],
                               output_shapes=[(rows, n), (t.splits, rows, n)], output_dtypes=[x.dtype, mx.float32],
                               **launch_args)
    return out
