"""One row times a weight matrix (`x @ weight.T`, x of one row) in one launch, for decode's projections.

A single-stream decode step reads every weight once, so its projections should stream at the
GPU's memory bandwidth. MLX's gemv gives each weight row one warp and 8-byte loads; at one row of
llama-1b's shapes on the H200 (CUPTI, `ops/results/index_slices_gpu_2026-12-04.json`) the o
projection (8 MB) took 4.3 µs and down (34 MB) 12.1 µs: 2.0 and 2.8 TB/s of the 4.8 the chip
can read. Here a warp dots `R` weight rows with x, each lane reading 16-byte words of a row
(a warp reads 512 contiguous bytes a row a step) with `U` steps of every row in flight; the `S`
warps of a group split K and their sums meet in shared memory, so a short output (2,048 rows)
still puts enough warps on every SM. float32 sums, rounded to the dtype once: MLX's gemv sums in
another order, so an output may differ from `x @ weight.T` in its last bit.

Source: the PTX ISA's `ld.global.nc` (read-only loads) and `cp.async` (copies to shared memory that stay in
flight until waited on, CUDA C++ Programming Guide, "Asynchronous Data Copies"); the structure of MLX's
`mlx/backend/cuda/gemms/gemv.cu` (a warp a row, a butterfly across the warp).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import mlx.core as mx

from kernels import cuda_kv
from kernels.norm_gemv import PACKED_DOT

SHARED_BYTES = 48 * 1024  # static shared memory a block may hold
STEP = 256  # columns a warp reads of each row per step: 32 lanes x 8 fp16/bf16 values (16 bytes)

_SOURCE = r"""
  // out[0, n] = sum_k x[0, k] * w[n, k]. Block: W warps in W / S groups; group: rows n0 .. n0 + R - 1;
  // warp s of a group: columns [s K / S, (s + 1) K / S), in chunks of U 256-column steps; lane l takes word l
  // of each step. P = 0: a chunk's words load into registers; P > 0: into the warp's shared-memory ring of P
  // chunks by cp.async, P - 1 chunks ahead (ptxas interleaves register loads with their FMAs, keeping few
  // in flight; copies to shared memory stay in flight until the wait).
  static_assert(sizeof(T) == 2 && W % S == 0 && K % (256 * S * U) == 0, "fp16/bf16, K in whole chunks");
  constexpr int KS = K / S, CHUNKS = KS / (256 * U);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, s = warp % S;
  const int n0 = (blockIdx.x * (W / S) + warp / S) * R;
  const uint4* xv = reinterpret_cast<const uint4*>(x + s * KS) + lane;
  const uint4* wv = reinterpret_cast<const uint4*>(w + (size_t)n0 * K + s * KS) + lane;
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  if constexpr (P == 0) {
#pragma unroll 1
    for (int c = 0; c < CHUNKS; ++c) {
      uint4 a[R][U], b[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < R; ++r) a[r][u] = __ldg(wv + (size_t)r * (K / 8) + 32 * (c * U + u));
#pragma unroll
      for (int u = 0; u < U; ++u) b[u] = __ldg(xv + 32 * (c * U + u));
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = dot8<T>(a[r][u], b[u], acc[r]);
    }
  } else {
    constexpr int PS = P > 0 ? P : 1;  // the discarded branch still declares the ring
    __shared__ uint4 ring[W][PS][R][U][32];
    auto issue = [&](int c) {
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < R; ++r)
          cp_async<16>(&ring[warp][c % PS][r][u][lane], wv + (size_t)r * (K / 8) + 32 * (c * U + u));
    };
#pragma unroll
    for (int c = 0; c < P - 1; ++c) {
      if (c < CHUNKS) issue(c);
      cp_async_commit();
    }
#pragma unroll 1
    for (int c = 0; c < CHUNKS; ++c) {
      if (c + P - 1 < CHUNKS) issue(c + P - 1);
      cp_async_commit();  // possibly empty: the wait counts groups
      uint4 b[U];
#pragma unroll
      for (int u = 0; u < U; ++u) b[u] = __ldg(xv + 32 * (c * U + u));
      cp_async_wait<P - 1>();
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = dot8<T>(ring[warp][c % PS][r][u][lane], b[u], acc[r]);
      __syncwarp();  // this chunk's reads before its slot is refilled
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
  if constexpr (S == 1) {
    if (lane == 0)
#pragma unroll
      for (int r = 0; r < R; ++r) out[n0 + r] = static_cast<T>(acc[r]);
  } else {
    __shared__ float part[W][R];
    if (lane == 0)
#pragma unroll
      for (int r = 0; r < R; ++r) part[warp][r] = acc[r];
    __syncthreads();
    if (s == 0 && lane < R) {
      float t = 0.f;
#pragma unroll
      for (int v = 0; v < S; ++v) t += part[warp + v][lane];
      out[n0 + lane] = static_cast<T>(t);
    }
  }
"""


@dataclass(frozen=True, slots=True)
class RowTuning:
    """A `row_gemv` launch shape: `warps` a block, `split` warps sharing rows (splitting K), `rows` weight
    rows a warp, `unroll` 256-column steps of each row a chunk (at most; the largest divisor of the warp's
    steps up to it is taken), `stages` chunks of the shared-memory ring (0: registers)."""

    warps: int = 8
    split: int = 1
    rows: int = 1
    unroll: int = 8
    stages: int = 0


def default_tuning(n: int, k: int) -> RowTuning:
    """The launch shape for an [N, K] weight, as measured at one row of llama-1b and qwen3-1.7b's o and down
    shapes (CUPTI on an H100, `ops/gemv_bench.py`, `ops/results/row_gemv_gpu_2026-12-05.json`): o ([2048, 2048]) 4.58 µs against
    MLX's gemv 5.20 with 8 warps, K split 4 ways, a 2-chunk ring; down ([2048, 8192]) 12.90 against 14.93
    and qwen3's ([2048, 6144]) 10.08 against 11.76 with K split 2 ways, 2 rows a warp, a 1-chunk ring. The
    split halves until K (in 256-column steps) divides by it."""
    long = k >= 4096
    split = 2 if long else 4
    while split > 1 and k % (STEP * split):
        split //= 2
    return RowTuning(warps=8, split=split, rows=2 if long else 1, unroll=4, stages=1 if long else 2)


@functools.cache
def _kernel():
    return cuda_kv.custom_kernel("bm_row_gemv", _SOURCE, PACKED_DOT, input_names=["x", "w"], output_names=["out"])


def launch_for(weight: mx.array, tuning: RowTuning | None = None) -> RowTuning | None:
    """The launch `row_gemv` would make for `weight` (its `unroll` resolved to the chunk it takes), or None where
    it takes none: MLX's CUDA backend, an [N, K] fp16/bf16 weight, K a multiple of 256 (times the tuning's split),
    N of the rows a block covers, the ring within the static shared memory. A projection resolves it once and
    launches with `launch` every step."""
    if weight.ndim != 2 or weight.dtype not in (mx.float16, mx.bfloat16):
        return None
    n, k = weight.shape
    t = tuning or default_tuning(n, k)
    if k % (STEP * t.split) or n % (t.warps // t.split * t.rows) or t.warps % t.split:
        return None
    steps = k // t.split // STEP
    t = replace(t, unroll=max(u for u in range(1, min(steps, t.unroll) + 1) if steps % u == 0))
    ring = t.warps * t.stages * t.rows * t.unroll * 32 * 16  # bytes
    return t if ring <= SHARED_BYTES and cuda_kv.is_available() else None


def serves(x: mx.array, weight: mx.array, tuning: RowTuning | None = None) -> bool:
    """Whether `row_gemv` takes `x @ weight.T`: one row of the weight's dtype and a launch (`launch_for`)."""
    one_row = x.ndim == 2 and x.shape[0] == 1 and weight.ndim == 2 and x.shape[1] == weight.shape[1]
    return one_row and x.dtype == weight.dtype and launch_for(weight, tuning) is not None


def row_gemv(x: mx.array, weight: mx.array, tuning: RowTuning | None = None) -> mx.array:
    """`x @ weight.T` for one row, one launch (`serves` must hold).

    Args:
        x (mx.array): [1, K] activations, float16/bfloat16, contiguous on a 16-byte boundary.
        weight (mx.array): [N, K] (an `nn.Linear` weight as stored), x's dtype, a whole row-contiguous array.
        tuning (RowTuning | None): The launch shape; None: `default_tuning(N, K)`.

    Returns:
        mx.array: [1, N] in x's dtype (float32 sums, rounded once).

    Raises:
        ValueError: shapes, dtypes, a tuning or a backend `serves` does not take.
    """
    if not serves(x, weight, tuning):
        raise ValueError(f"row_gemv takes [1, K] @ [N, K].T in fp16/bf16 on CUDA, K a multiple of {STEP} times the "
                         f"split and N of the rows a block covers; got {x.shape} {x.dtype} and {weight.shape} "
                         f"{weight.dtype} ({tuning})")
    return launch(x, weight, launch_for(weight, tuning))


def launch(x: mx.array, weight: mx.array, t: RowTuning) -> mx.array:
    """`row_gemv` without its checks, for a caller that resolved `t = launch_for(weight)` once: x must be [1, K]
    of the weight's dtype. Returns [1, N] in that dtype."""
    n, k = weight.shape
    (out,) = _kernel()(inputs=[x, weight],
                       template=[("T", x.dtype), ("K", k), ("W", t.warps), ("S", t.split), ("R", t.rows), ("U", t.unroll),
                                 ("P", t.stages)],
                       grid=(n // t.rows * t.split * 32, 1, 1), threadgroup=(32 * t.warps, 1, 1),
                       output_shapes=[(1, n)], output_dtypes=[x.dtype])
    return out
