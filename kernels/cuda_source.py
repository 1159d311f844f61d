"""CUDA sources of the KV kernels (compiled at first use by `mx.fast.cuda_kernel`, NVRTC).

Three kernels, all reading and writing the row format of `kernels.kv_format`:
- `ENCODE`: K and V vectors of one (token, head) -> one compressed row, `encode_warps(D)` warps a
  part (2 at head_dim 64, 4 from 128, where a lane's dims split evenly; 1 below 64) (`encode_part` in
  `HEADER`, which `kernels.qkv_rope`'s fused kernel shares. AURA: rotate with a fast Walsh-Hadamard
  transform in warp shuffles, Lloyd-Max search over the gains of `kernels.aura.GAINS`, pack,
  norm-corrected scale;
  affine: MLX's CPU `mx.quantize` rule exactly: min/max, edge snapped to the grid, `rint`).
- `PARTIAL`: split-K decode attention ("flash-decoding") on the lanes' FMAs: one block per
  (split, kv head, row) walks its tokens through the row's page table, reads each K/V row once
  for all G query heads of its kv head (GQA), unpacks codes in registers (bit widths 2..8), and
  writes (acc, max, sum-exp) per split. A block's prologue (`stage_block`) issues all its small
  reads at once: the row's length, the split's page ids, AURA centroids and the query (AURA
  queries rotated by warp shuffles, one warp a query head). A split's width, the pools' page
  counts and the query scale come from shapes and template constants, not from memory. With `NS` stages the
  block copies tiles of rows into a shared-memory ring (`cp.async`, `NS - 1` tiles ahead); with
  none (GPUs before compute capability 8.0) loads land in registers and are decoded at use, and
  `PREFETCH` issues the next tile's loads before this tile's math. The tensor-core twin that
  serves fp16/bf16 layers is `kernels.cuda_mma.PARTIAL_MMA` (same inputs, outputs and helpers).
- `COMBINE`: merges the splits (and a learned attention sink), divides, and un-rotates AURA
  values (warp shuffles, then shared memory). A launch of one split and no sink skips it: its partial
  kernel writes the output itself (`merge_final`, the same result up to float32 rounding).

Addressing: token slot t of row b, kv head h lives in pool row
`(h * pages + page) * P + t % P` with `page = page_table[b, t / P]`; page ids >= `pages`
name pages of the tail pool (`page - pages`, same layout), which decode windows write.

Source: the measured prototype `shared/reference/fused-paged-decode/fused.py`; Dao et al.,
"Flash-Decoding for long-context inference" (2023); CACHES.md "AURA encode / decode".
"""

from __future__ import annotations

import re

HEADER = r"""
// Words one lane holds for dims [d0, d0 + DPL) of one part of one row (d0 a multiple of DPL):
// raw, the elements themselves; codes, every word the lane's bits touch at any lane's offset.
template <int MODE, int BITS, int D, int DPL, typename RT>
__host__ __device__ constexpr int slice_words() {
  if (MODE == 0) return DPL * (int)sizeof(RT) / 4;
  int most = 1;
  for (int d0 = 0; d0 < D; d0 += DPL) {
    const int n = ((d0 * BITS) % 32 + DPL * BITS + 31) / 32;
    most = n > most ? n : most;
  }
  return most;
}

// One part (K or V) of one token as a lane holds it between its load and its math: the raw
// words and the meta halves (affine: the lane's group scale and bias; AURA: the vector scale).
template <int MODE, int BITS, int D, int DPL, typename RT>
struct Slice {
  static constexpr int NW = slice_words<MODE, BITS, D, DPL, RT>();
  uint32_t w[NW];
  __half s, b;
};

// Issue the loads of one part of pool row `row` (raw: `RT[D]` at `raw`; codes: words at `codes`,
// meta halves at `meta`) into `x`. Loads only: nothing waits on them until `decode_slice`.
template <int MODE, int BITS, int GS, int D, int DPL, typename RT>
__device__ __forceinline__ void fetch_slice(
    const RT* raw, const uint32_t* codes, const __half* meta, int d0, Slice<MODE, BITS, D, DPL, RT>& x) {
  constexpr int NW = Slice<MODE, BITS, D, DPL, RT>::NW;
  if constexpr (MODE == 0) {
    static_assert(NW % 4 == 0, "raw slices are whole 16-byte loads");
#pragma unroll
    for (int v = 0; v < NW / 4; ++v) {
      const uint4 u = reinterpret_cast<const uint4*>(raw + d0)[v];
      x.w[4 * v] = u.x; x.w[4 * v + 1] = u.y; x.w[4 * v + 2] = u.z; x.w[4 * v + 3] = u.w;
    }
  } else {
    const uint32_t* w = codes + (d0 * BITS) / 32;
#pragma unroll
    for (int j = 0; j < NW; ++j) x.w[j] = w[j];
    if constexpr (MODE == 1) {
      x.s = meta[d0 / GS];
      x.b = meta[D / GS + d0 / GS];
    } else {
      x.s = meta[0];
    }
  }
}

// A code as a float, exactly (q < 2^23): its bits as a float's mantissa, less the float's 2^23.
__device__ __forceinline__ float code_float(uint32_t q) { return __uint_as_float(0x4B000000u | q) - 8388608.0f; }

// Dims [d0, d0 + DPL) of a fetched part as floats; returns the per-vector factor.
// MODE 0: raw; 1: affine `scale * q + bias`; 2: AURA unit centroids from `cb` (factor: the scale).
template <int MODE, int BITS, int GS, int D, int DPL, typename RT>
__device__ __forceinline__ float decode_slice(const Slice<MODE, BITS, D, DPL, RT>& x, int d0, const float* cb,
                                              float (&out)[DPL]) {
  constexpr int NW = Slice<MODE, BITS, D, DPL, RT>::NW;
  if constexpr (MODE == 0) {
    RT tmp[DPL];
    memcpy(tmp, x.w, sizeof(tmp));
#pragma unroll
    for (int i = 0; i < DPL; ++i) out[i] = static_cast<float>(tmp[i]);
    return 1.0f;
  } else {
    constexpr uint32_t MASK = (1u << BITS) - 1u;
    const float x_s = __half2float(x.s), x_b = MODE == 1 ? __half2float(x.b) : 0.f;  // AURA has no bias
    const int off = (d0 * BITS) % 32;  // the lane's first bit inside w[0]
    uint32_t a[NW];                     // the lane's bits from bit 0 on (indices below are compile-time)
#pragma unroll
    for (int j = 0; j < NW; ++j) a[j] = j + 1 < NW ? __funnelshift_r(x.w[j], x.w[j + 1 < NW ? j + 1 : j], off)
                                                   : x.w[j] >> off;
#pragma unroll
    for (int k = 0; k < DPL; ++k) {
      const int bit = k * BITS, wi = bit / 32, o = bit % 32;
      uint32_t q = a[wi] >> o;
      if (o + BITS > 32) q |= a[wi + 1 < NW ? wi + 1 : wi] << (32 - o);
      q &= MASK;
      // Affine: q as a float through its bits (2^23 + q, exact, minus 2^23): a logic op and an add at
      // full rate, where an int-to-float conversion (I2F) issues at 1/8 of it and bounds the loop.
      out[k] = MODE == 1 ? fmaf(x_s, code_float(q), x_b) : cb[q];
    }
    return MODE == 1 ? 1.0f : x_s;
  }
}

// Asynchronous copies global -> shared (sm_80+): N bytes (4, 8 or 16; 16 bypasses L1), then
// `cp_async_commit` closes a group and `cp_async_wait<N>` waits until at most N groups are pending.
template <int N>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if constexpr (N == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(src), "n"(N));
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx: 2 ulp, flushes subnormals to 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// In-place unnormalised Walsh-Hadamard transform (Sylvester order) of one vector of length
// LANES * E held by a warp, lane j holding dims [j * E, j * E + E): butterflies inside a lane
// (dims len < E apart), then across lanes by shuffles (dims off * E apart). Every lane of the
// warp must call it; lanes >= LANES (D < 32) pair among themselves and hold nothing of the vector.
template <int E, int LANES>
__device__ __forceinline__ void fwht_warp(float (&x)[E], int lane) {
#pragma unroll
  for (int len = 1; len < E; len <<= 1) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if ((e & len) == 0) {
        const float a0 = x[e], a1 = x[e + len];
        x[e] = a0 + a1;
        x[e + len] = a0 - a1;
      }
    }
  }
#pragma unroll
  for (int off = 1; off < LANES; off <<= 1) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float y = __shfl_xor_sync(0xffffffffu, x[e], off);
      x[e] = (lane & off) ? y - x[e] : x[e] + y;
    }
  }
}

// In-place unnormalised Walsh-Hadamard transform (Sylvester order) of `rows` vectors of
// length D in shared memory; every thread of the block must call it.
template <int D>
__device__ __forceinline__ void fwht_shared(float* v, int rows) {
  for (int len = 1; len < D; len <<= 1) {
    __syncthreads();
    for (int i = threadIdx.x; i < rows * D / 2; i += blockDim.x) {
      const int r = i / (D / 2), k = i % (D / 2);
      const int lo = (k / len) * 2 * len + (k % len), hi = lo + len;
      const float a = v[r * D + lo], b = v[r * D + hi];
      v[r * D + lo] = a + b;
      v[r * D + hi] = a - b;
    }
  }
  __syncthreads();
}

// The block's prologue: stages its G query heads of kv head h, scaled by `q_scale`, into `qs` [G * D]
// (for AURA keys first rotated: sign flips, then a Walsh-Hadamard transform in warp shuffles, one warp a
// query head), the AURA centroids (keys' 2^KB, then values' 2^VB, from `cb`: keys at 0, values at 256)
// into `cbs` (as `CT`: float, or the tensor-core kernel's 16-bit T), the split's `npages` page ids from
// `table` into `pids`, and the row's length `*len` into `*len_s` (read by one thread: every block of a
// row reads it, and a few thousand warps reading one word queue on one L2 slice). Every global read is
// issued before any is used, so the block waits one memory latency, not four in turn: at one stream
// and 32K tokens the serial reads held half of the kernel's warp time (ncu, H200). Every thread of the
// block (NT) calls it; the caller synchronizes before reading what it staged.
template <typename T, typename CT, int D, int G, int KCB, int VCB, int MAXPG, int NT, bool ROTATE>
__device__ __forceinline__ void stage_block(const T* qrow, const float* qsign, float q_scale, const float* cb,
                                            const int* table, int npages, const int* len, float* qs, CT* cbs,
                                            int* pids, int* len_s) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int NCB = (KCB + VCB + NT - 1) / NT, NPG = (MAXPG + NT - 1) / NT;
  constexpr int QE = ROTATE ? (D >= 32 ? D / 32 : 1) : 1, QL = D / QE;  // rotated: dims a lane, lanes holding dims
  constexpr int QH = ROTATE ? (G + NT / 32 - 1) / (NT / 32) : (G * D + NT - 1) / NT;  // heads a warp, or elements a thread
  float c[NCB > 0 ? NCB : 1], x[QH][QE];
  int p[NPG];
#pragma unroll
  for (int j = 0; j < NCB; ++j) {
    const int i = threadIdx.x + j * NT;
    c[j] = i < KCB + VCB ? cb[i < KCB ? i : 256 + i - KCB] : 0.f;
  }
#pragma unroll
  for (int j = 0; j < NPG; ++j) {
    const int i = threadIdx.x + j * NT;
    p[j] = i < npages ? table[i] : 0;
  }
  const int n = threadIdx.x == 0 ? *len : 0;
#pragma unroll
  for (int j = 0; j < QH; ++j) {
#pragma unroll
    for (int e = 0; e < QE; ++e) {
      if constexpr (ROTATE) {
        const int g = warp + j * (NT / 32), d = lane * QE + e;
        x[j][e] = g < G && lane < QL ? static_cast<float>(qrow[g * D + d]) * qsign[d] : 0.f;
      } else {
        const int i = threadIdx.x + j * NT;
        x[j][e] = i < G * D ? static_cast<float>(qrow[i]) : 0.f;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < NCB; ++j) {
    const int i = threadIdx.x + j * NT;
    if (i < KCB + VCB) cbs[i] = static_cast<CT>(c[j]);
  }
#pragma unroll
  for (int j = 0; j < NPG; ++j) {
    const int i = threadIdx.x + j * NT;
    if (i < npages) pids[i] = p[j];
  }
  if (threadIdx.x == 0) *len_s = n;
#pragma unroll
  for (int j = 0; j < QH; ++j) {
    if constexpr (ROTATE) {
      const int g = warp + j * (NT / 32);
      if (g < G) {  // warp-uniform: every lane takes part in the shuffles
        fwht_warp<QE, QL>(x[j], lane);
        if (lane < QL) {
#pragma unroll
          for (int e = 0; e < QE; ++e) qs[g * D + lane * QE + e] = x[j][e] * q_scale;
        }
      }
    } else {
      const int i = threadIdx.x + j * NT;
      if (i < G * D) qs[i] = x[j][0] * q_scale;
    }
  }
}

// The E softmax states of query head g merged at dim d (`sm_m`, `sm_l` [E][G], `sm_acc` [E][G][D], log2
// units): max M, sum-exp L, accumulator O.
template <int D, int G, int E>
__device__ __forceinline__ void merge_at(const float* sm_m, const float* sm_l, const float* sm_acc, int g, int d,
                                         float& M, float& L, float& O) {
  M = -1e30f;
  for (int j = 0; j < E; ++j) M = fmaxf(M, sm_m[j * G + g]);
  L = 0.f;
  O = 0.f;
  for (int j = 0; j < E; ++j) {
    const float f = exp2f(sm_m[j * G + g] - M);
    L = fmaf(sm_l[j * G + g], f, L);
    O = fmaf(sm_acc[(j * G + g) * D + d], f, O);
  }
}

// Merges a block's E softmax states of each of its G query heads (`merge_at`) into the split's partials:
// o_part [.., S, D] and ml_part [.., S, 2] (max, sum-exp) of query heads hq0 .. hq0 + G - 1. Every thread of
// the block calls it, after a barrier.
template <int D, int G, int E>
__device__ __forceinline__ void merge_states(const float* sm_m, const float* sm_l, const float* sm_acc, size_t hq0,
                                             int S, int split, float* o_part, float* ml_part) {
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    const int g = idx / D, d = idx % D;
    float M, L, O;
    merge_at<D, G, E>(sm_m, sm_l, sm_acc, g, d, M, L, O);
    const size_t hq = hq0 + g;
    o_part[(hq * S + split) * D + d] = O;
    if (d == 0) { ml_part[(hq * S + split) * 2] = M; ml_part[(hq * S + split) * 2 + 1] = L; }
  }
}

// The one-split launch (`kernels.cuda_kv.final_source`: the row's whole history in one split, no attention
// sink): merges as `merge_states` (`merge_at`) and writes the output itself, out [.., D] in T, as COMBINE
// would from this split's partials: O / L, AURA values (UNROTATE) taken back to the model's domain (a
// Walsh-Hadamard transform of the G heads' rows, left in place in `sm_acc`'s first G rows: a (g, d) entry
// there is read only by the thread that writes it; the value signs `vsign` [D]; 1 / sqrt(D)). Every thread
// of the block calls it, after a barrier.
template <typename T, int D, int G, int E, bool UNROTATE>
__device__ __forceinline__ void merge_final(const float* sm_m, const float* sm_l, float* sm_acc, size_t hq0,
                                            const float* vsign, T* out) {
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    const int g = idx / D, d = idx % D;
    float M, L, O;
    merge_at<D, G, E>(sm_m, sm_l, sm_acc, g, d, M, L, O);
    const float y = L > 0.f ? O / L : 0.f;
    if (UNROTATE) sm_acc[idx] = y; else out[(hq0 + g) * D + d] = static_cast<T>(y);
  }
  if constexpr (UNROTATE) {
    fwht_shared<D>(sm_acc, G);  // barriers before and after
    for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x)
      out[hq0 * D + idx] = static_cast<T>(sm_acc[idx] * vsign[idx % D] * rsqrtf((float)D));
  }
}

// Floats of a part's search table (`encode_part`): AURA, 2^BITS threshold slots and centroids, NG gains.
__host__ __device__ constexpr int table_floats(int mode, int bits, int ng) { return mode == 2 ? (2 << bits) + ng : 0; }

// Warps that split the dims of one part (K or V) of one vector: up to 4, each searching an equal slice of a
// lane's d / 32 dims (the gain search's cost grows with the dims a lane walks: at head_dim 128 one warp made a
// decode step's q/k/v launch take 8.9 us, 3.6 without coding, H200).
__host__ __device__ constexpr int encode_warps(int d) {
  return d < 64 ? 1 : (d / 32) % 4 == 0 ? 4 : (d / 32) % 2 == 0 ? 2 : 1;
}

// Element s of warp pw's slice of a lane's E dims (x[pw * ES + s]), by selects: a register index, not a
// local array.
template <int E, int ES>
__device__ __forceinline__ float slice_dim(const float (&x)[E], int pw, int s) {
  float v = x[s];
#pragma unroll
  for (int e = ES; e < E; ++e) v = e == pw * ES + s ? x[e] : v;
  return v;
}

// Barrier of the W warps that code one part (named barrier `id`, 1..15; one warp: __syncwarp).
template <int W>
__device__ __forceinline__ void part_sync(int id) {
  if constexpr (W == 1) __syncwarp();
  else asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(W * 32) : "memory");
}

// Codes one part (K or V) of one vector held by the W = WD * WG warps of a part, each warp holding the whole
// vector: lane j holds dims [j * E, j * E + E) of x (E = D / 32, or 1 with D lanes when D < 32; other lanes
// hold zeros). Warp pw searches the dims slice wd = pw % WD (ES = E / WD of a lane's dims) for the gains
// g = wg + WG * k of its gain slice wg = pw / WD. AURA: sign flips, a Walsh-Hadamard rotation (each warp the
// whole vector: shuffles, no barrier), then the gain search over the part's search table `tab` (in shared
// memory, `kernels.cuda_kv.search_table`: NC slots of thresholds in breadth-first order, NC centroids, NG
// gains), the per-gain sums met in `red`; affine: MLX's CPU rule (every warp the same values; the warps of
// gain slice 0 keep their dims). Writes the D * BITS / 32 code words and the meta halves (affine: D / GS
// scales, then D / GS biases; AURA: the scale). `sidx` [D], `red` [W * 2 * NG] (W * 2 * GW used): the part's
// scratch in shared memory. Every lane of the part's warps must call it once, `pw` its warp's index in the
// part, `bar` the part's barrier (`part_sync`). WG > 1 shortens a lone vector's search (a decode step's latency,
// `kernels.qkv_rope`); throughput (`ENCODE`) wants WG = 1.
template <int MODE, int BITS, int GS, int D, int NG, int WD, int WG>
__device__ __forceinline__ void encode_part(float (&x)[D >= 32 ? D / 32 : 1], int lane, int pw, int bar,
                                            const float* sign, const float* tab, uint32_t* sidx, float* red,
                                            uint32_t* codes, __half* meta) {
  constexpr int E = D >= 32 ? D / 32 : 1;  // dims per lane
  constexpr int LANES = D / E;              // lanes holding dims
  constexpr int W = WD * WG, ES = E / WD;   // warps of the part, dims a lane searches
  constexpr int GW = (NG + WG - 1) / WG;    // gains a warp searches at most
  static_assert(ES * WD == E, "each warp searches an equal slice of a lane's dims");
  const bool live = lane < LANES;
  const int wd = pw % WD, wg = pw / WD;
  uint32_t q[ES];
  bool keeps = wg == 0;  // this warp's codes are the vector's (AURA: its gain slice holds the best gain)
  if constexpr (MODE == 2) {  // AURA
    constexpr int NC = 1 << BITS;
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      ss = fmaf(x[e], x[e], ss);
      x[e] *= live ? sign[lane * E + e] : 0.f;
    }
    fwht_warp<E, LANES>(x, lane);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const float norm = sqrtf(ss);
    float u[ES];  // this warp's slice: dims lane * E + wd * ES + s
#pragma unroll
    for (int s = 0; s < ES; ++s) {
      u[s] = slice_dim<E, ES>(x, wd, s);
      u[s] = norm > 0.f ? u[s] / norm : 0.f;  // u = sqrt(D) * (H s x / sqrt(D)) / |x|
    }
    // Gain search (kernels.aura): gain g's code of u is the count of thresholds t with float32(t * g) < u
    // (ties go to the lower cell; the edges of `kernels.aura.gain_cells`), a branchless binary search of
    // BITS probes down the thresholds' breadth-first tree; a warp's searches are independent, so their
    // probes are in flight together. The vector keeps the gain whose codes are closest in angle to u (the
    // first on a tie); xor reductions, then the warps' sums in a fixed order, leave every lane the same sums,
    // so all lanes agree on the gain.
    uint32_t code[GW][ES];
    float cu[GW], cc[GW];
#pragma unroll
    for (int k = 0; k < GW; ++k) { cu[k] = 0.f; cc[k] = 0.f; }
#pragma unroll
    for (int s = 0; s < ES; ++s) {
#pragma unroll
      for (int k = 0; k < GW; ++k) {
        const int g = WG == 1 ? k : wg + WG * k;
        const float gain = tab[2 * NC + (g < NG ? g : 0)];
        // thresholds breadth-first: a depth's probes land in distinct banks through depth 5. The node is
        // kept as its byte offset (4 node): the next probe's address needs no separate computation.
        const char* tree = reinterpret_cast<const char*>(tab);
        int at = 4;
#pragma unroll
        for (int depth = 0; depth < BITS; ++depth)
          at = 2 * at + (*reinterpret_cast<const float*>(tree + at) * gain < u[s] ? 4 : 0);
        const int pos = at / 4 - NC;
        code[k][s] = pos;
        const float c = live ? tab[NC + pos] : 0.f;
        cu[k] = fmaf(c, u[s], cu[k]);
        cc[k] = fmaf(c, c, cc[k]);
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
      for (int k = 0; k < GW; ++k) {
        cu[k] += __shfl_xor_sync(0xffffffffu, cu[k], off);
        cc[k] += __shfl_xor_sync(0xffffffffu, cc[k], off);
      }
    }
    float tu[NG], tc[NG];  // every gain's sums over the whole vector
    if constexpr (W == 1) {
#pragma unroll
      for (int g = 0; g < NG; ++g) { tu[g] = cu[g]; tc[g] = cc[g]; }
    } else {
      if (lane == 0) {
#pragma unroll
        for (int k = 0; k < GW; ++k) { red[pw * 2 * GW + k] = cu[k]; red[pw * 2 * GW + GW + k] = cc[k]; }
      }
      part_sync<W>(bar);
#pragma unroll
      for (int g = 0; g < NG; ++g) {  // gain g's sums: warps (g % WG) * WD + 0 .. WD - 1, slot g / WG
        const float* r = red + (g % WG) * WD * 2 * GW + g / WG;
        tu[g] = r[0];
        tc[g] = r[GW];
#pragma unroll
        for (int w = 1; w < WD; ++w) { tu[g] += r[w * 2 * GW]; tc[g] += r[w * 2 * GW + GW]; }
      }
    }
    int best = 0;
    float best_score = tu[0] * fabsf(tu[0]) / tc[0], best_cc = tc[0];
#pragma unroll
    for (int g = 1; g < NG; ++g) {
      const float score = tu[g] * fabsf(tu[g]) / tc[g];
      if (score > best_score) { best = g; best_score = score; best_cc = tc[g]; }
    }
    keeps = best % WG == wg;
#pragma unroll
    for (int s = 0; s < ES; ++s) {
      q[s] = code[0][s];
#pragma unroll
      for (int k = 1; k < GW; ++k) q[s] = k == best / WG ? code[k][s] : q[s];  // registers, not a local array
    }
    if (lane == 0 && pw == 0) meta[0] = __float2half(norm / sqrtf(best_cc));
  } else {  // affine, MLX's CPU rule (mlx/backend/cpu/quantized.cpp `quantize`)
    float lo = INFINITY, hi = -INFINITY;
#pragma unroll
    for (int e = 0; e < E; ++e) { lo = fminf(lo, x[e]); hi = fmaxf(hi, x[e]); }
    for (int off = 1; off < GS / E && off < 32; off <<= 1) {  // the lanes of this lane's group
      lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, off));
      hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, off));
    }
    const float n_bins = (float)((1 << BITS) - 1);
    const bool side = fabsf(lo) > fabsf(hi);
    float scale = fmaxf((hi - lo) / n_bins, 1e-7f);
    scale = side ? scale : -scale;
    const float edge = side ? lo : hi;
    const float q0 = rintf(edge / scale);
    float bias = 0.f;
    if (q0 != 0.f) { scale = edge / q0; bias = edge; }
#pragma unroll
    for (int s = 0; s < ES; ++s)
      q[s] = (uint32_t)fminf(fmaxf(rintf((slice_dim<E, ES>(x, wd, s) - bias) / scale), 0.f), n_bins);
    const int d0 = lane * E;
    if (live && pw == 0 && d0 % GS == 0) {
      meta[d0 / GS] = __float2half(scale);
      meta[D / GS + d0 / GS] = __float2half(bias);
    }
  }
  if (live && keeps) {
#pragma unroll
    for (int s = 0; s < ES; ++s) sidx[lane * E + wd * ES + s] = q[s];
  }
  part_sync<W>(bar);
  for (int w = pw * 32 + lane; w < D * BITS / 32; w += 32 * W) {  // word w of the bit stream
    uint32_t word = 0;
    if constexpr (32 % BITS == 0) {  // whole codes a word: constant shifts, the loads issued together
      constexpr int C = 32 / BITS;
#pragma unroll
      for (int c = 0; c < C; ++c) word |= sidx[w * C + c] << (c * BITS);
    } else {
      const int first = (32 * w) / BITS, last = (32 * w + 31) / BITS;
      for (int i = first; i <= last && i < D; ++i) {
        const int shift = i * BITS - 32 * w;
        word |= shift >= 0 ? (sidx[i] << shift) : (sidx[i] >> (-shift));
      }
    }
    codes[w] = word;
  }
}
"""

# Inputs: k, v [..., D] (strided), codec float [2 D + KT + VT] (`kernels.cuda_kv.codec_constants`: key
# signs, value signs, then each AURA part's search table), kmean float [H * D] (with CENTER: subtracted
# from every key first, `services.engine.cache.centering`). Output rows uint32 [N, ROWW].
# W = encode_warps(D) warps per part (K or V) of vector n = ((b * H) + h) * L + l: warp group 2n codes the
# key, 2n + 1 the value, so the two searches run side by side (a decode step encodes a few vectors, and its
# latency is one part's, not two). Every warp of a group holds the whole vector, lane j dims
# [j * E, j * E + E) (E = D / 32, or 1 with D lanes when D < 32); reductions and the Walsh-Hadamard
# butterflies across lanes are warp shuffles, the group meets at its named barrier (1 + its index in the
# block); the one block barrier follows the staging of the search tables, before any group leaves.
ENCODE = r"""
  constexpr int E = D >= 32 ? D / 32 : 1;  // dims per lane
  constexpr int LANES = D / E;              // lanes holding dims
  constexpr int W = encode_warps(D), GB = EW / W;  // warps of a part, part groups a block
  static_assert(EW % W == 0 && GB <= 15, "a block holds whole part groups, each with a named barrier");
  constexpr int KT = table_floats(KMODE, KBITS, NG), VT = table_floats(VMODE, VBITS, NG);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, grp = warp / W;
  const int gg = blockIdx.x * GB + grp, n = gg / 2;
  const bool is_key = gg % 2 == 0;  // group-uniform: group 2n codes vector n's key, 2n + 1 its value
  const int H = k_shape[1], L = k_shape[2];
  // Both parts' search tables in shared memory: the binary searches below then wait on no global load.
  // Unrolled (EW warps a block), so a thread's loads are all in flight before its first store.
  __shared__ float stab[KT + VT > 0 ? KT + VT : 1];
#pragma unroll
  for (int j = 0; j < (KT + VT + 32 * EW - 1) / (32 * EW); ++j) {
    const int i = threadIdx.x + j * 32 * EW;
    if (i < KT + VT) stab[i] = codec[2 * D + i];
  }
  __syncthreads();
  if (n >= k_shape[0] * H * L) return;  // no block barrier follows: groups leave independently
  const int b = n / (H * L), h = (n / L) % H, l = n % L;
  const bool live = lane < LANES;
  __shared__ uint32_t sidx_all[GB][D];
  __shared__ float red_all[GB][W * 2 * NG];
  uint32_t* row = out + (size_t)n * ROWW;
  __half* meta = reinterpret_cast<__half*>(row + MOFF);
  const T* src = is_key ? k : v;
  const int64_t* st = is_key ? k_strides.data() : v_strides.data();
  float x[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int d = lane * E + e;
    x[e] = live ? static_cast<float>(src[b * st[0] + h * st[1] + l * st[2] + d * st[3]]) : 0.f;
    if (CENTER && is_key && live) x[e] -= kmean[h * D + d];
  }
  const int pw = warp % W;
  if (is_key) {
    encode_part<KMODE, KBITS, KGS, D, NG, W, 1>(x, lane, pw, 1 + grp, codec, stab, sidx_all[grp], red_all[grp], row,
                                                meta);
  } else {
    encode_part<VMODE, VBITS, VGS, D, NG, W, 1>(x, lane, pw, 1 + grp, codec + D, stab + KT, sidx_all[grp],
                                                red_all[grp], row + KWORDS, meta + KMH);
  }
  if (PADMETA && !is_key && lane == 0 && pw == 0) meta[KMH + VMH] = __float2half(0.f);
"""

PARTIAL = r"""
  constexpr int DPL = D / LPT;   // dims per lane
  constexpr int TPW = 32 / LPT;  // tokens a warp works on at once
  constexpr int E = W * TPW;     // independent softmax states per block
  constexpr int PARTS = KMODE == 0 ? 2 : 1;                       // pools a token is read from (raw: K and V)
  constexpr int RB = KMODE == 0 ? D * (int)sizeof(RT) : ROWW * 4;  // bytes of a token's row in one pool
  constexpr int SB = PARTS * TT * RB;                              // bytes of one stage (NS > 0)
  constexpr int EPI = E * G * (D + 2) * 4;                         // the merge's rows (after the loop)
  constexpr int SMEM = NS * SB > EPI ? NS * SB : EPI;
  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sg = lane / LPT, sub = lane % LPT, d0 = sub * DPL;
  const int Hkv = gridDim.y, S = gridDim.x, NP = pt_shape[1];
  const int tps = P * ((NP + S - 1) / S);  // tokens a split (`kernels.cuda_kv._split_plan`)
  const int pages = kp_shape[0] / (Hkv * P), tail_pages = kt_shape[0] / (Hkv * P);
  const int t_begin = split * tps, pg0 = t_begin / P;

  constexpr int KCB = KMODE == 2 ? 1 << KBITS : 0, VCB = VMODE == 2 ? 1 << VBITS : 0;  // AURA centroids
  __shared__ float cbs[KCB + VCB > 0 ? KCB + VCB : 1];
  __shared__ float qs[G * D];
  __shared__ int pids[MAXPG], live;  // the split's page ids: a K/V load then waits on no global read
  __shared__ __align__(16) unsigned char smem[SMEM];  // NS stages of K/V rows, then the merge's rows
  // cb: AURA centroids [512], the keys' rotation signs [D], the values' [D] (`cuda_kv._attention_constants`)
  stage_block<T, float, D, G, KCB, VCB, MAXPG, 32 * W, ROTATE>(q + ((size_t)(b * Hkv + h) * G) * D, cb + 512,
                                                              __int_as_float(QSCALE), cb, pt + (size_t)b * NP + pg0,
                                                              min(tps / P, NP - pg0), lens + b, qs, cbs, pids, &live);
  __syncthreads();
  const int t_end = min(t_begin + tps, min(live, NP * P));  // never past the staged page ids

  using KS = Slice<KMODE, KBITS, D, DPL, RT>;
  using VS = Slice<VMODE, VBITS, D, DPL, RT>;
  // Pool row of token t (page table, then the main or the tail pool), and the reads of one token's
  // slices from K/V rows at kb / vb (global pools, or a stage in shared memory).
  auto pool_row = [&](int t, bool& in_tail) {
    const int page = pids[t / P - pg0];
    in_tail = page >= pages;
    return ((size_t)h * (in_tail ? tail_pages : pages) + (in_tail ? page - pages : page)) * P + (t % P);
  };
  auto read = [&](const RT* kb, const RT* vb, size_t r, KS& ks, VS& vs) {
    if constexpr (KMODE == 0) {
      fetch_slice<KMODE, KBITS, KGS, D, DPL, RT>(kb + r * D, nullptr, nullptr, d0, ks);
      fetch_slice<VMODE, VBITS, VGS, D, DPL, RT>(vb + r * D, nullptr, nullptr, d0, vs);
    } else {
      const uint32_t* row = reinterpret_cast<const uint32_t*>(kb) + r * ROWW;
      const __half* meta = reinterpret_cast<const __half*>(row + MOFF);
      fetch_slice<KMODE, KBITS, KGS, D, DPL, RT>(nullptr, row, meta, d0, ks);
      fetch_slice<VMODE, VBITS, VGS, D, DPL, RT>(nullptr, row + KWORDS, meta + KMH, d0, vs);
    }
  };
  // NS > 0: tiles of TT tokens are copied into a ring of NS stages by the whole block (cp.async,
  // CG bytes a copy, row groups of RG rows that share a page), NS - 1 tiles ahead of the math: the
  // bytes in flight no longer depend on the registers a lane can spare.
  const int ntiles = t_end > t_begin ? (t_end - t_begin + TT - 1) / TT : 0;
  auto issue = [&](int tile) {
    if (tile < ntiles) {
      constexpr int CPG = RG * RB / CG;  // copies a row group
      const int tb = t_begin + tile * TT;
      const int groups = (min(TT, t_end - tb) + RG - 1) / RG;
      unsigned char* stage = smem + (NS > 0 ? tile % NS : 0) * SB;
#pragma unroll
      for (int part = 0; part < PARTS; ++part) {
        for (int c = threadIdx.x; c < groups * CPG; c += 32 * W) {
          const int g = c / CPG, k = c - g * CPG;
          bool in_tail;
          const size_t r = pool_row(tb + g * RG, in_tail);
          const RT* pool = part == 0 ? (in_tail ? kt : kp) : (in_tail ? vt : vp);
          cp_async<CG>(stage + (part * TT + g * RG) * RB + k * CG,
                       reinterpret_cast<const unsigned char*>(pool) + r * RB + k * CG);
        }
      }
    }
    cp_async_commit();  // every thread, every call: the group counts stay uniform
  };
  // NS == 0: tiles of U tokens a lane group are loaded straight into registers. PREFETCH: tile
  // i + 1's loads are issued before tile i's math; else each tile's loads follow the last math.
  auto token = [&](int base, int u) { return base + u * E + warp * TPW + sg; };  // this lane group's u-th token
  auto fetch = [&](int base, KS (&ks)[U], VS (&vs)[U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = token(base, u);
      if (t < t_end) {
        bool in_tail;
        const size_t r = pool_row(t, in_tail);
        read(in_tail ? kt : kp, in_tail ? vt : vp, r, ks[u], vs[u]);
      }
    }
  };
  KS kcur[U];
  VS vcur[U];
  if constexpr (NS > 0) {
#pragma unroll
    for (int i = 0; i < NS - 1; ++i) issue(i);
  } else {
    fetch(t_begin, kcur, vcur);
  }

  // QREG: each lane keeps its query slices in registers; else it reads them from shared memory
  // (fewer registers, more resident warps).
  float qv[QREG ? G : 1][QREG ? DPL : 1], acc[G][DPL], m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -1e30f; l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      if constexpr (QREG) qv[g][i] = qs[g * D + d0 + i];
      acc[g][i] = 0.f;
    }
  }
  // The math of U tokens a lane group (`valid`: the token is one of the split's live slots).
  auto attend = [&](const KS (&ks)[U], const VS (&vs)[U], const bool (&valid)[U]) {
    float kx[U][DPL], vx[U][DPL], kf[U], vf[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      kf[u] = decode_slice<KMODE, KBITS, KGS, D, DPL, RT>(ks[u], d0, cbs, kx[u]);
      vf[u] = decode_slice<VMODE, VBITS, VGS, D, DPL, RT>(vs[u], d0, cbs + KCB, vx[u]);
    }
    float s[U][G];  // scores of the U tokens, then one max and one rescale for all of them
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float x = 0.f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) x = fmaf(QREG ? qv[g][QREG ? i : 0] : qs[g * D + d0 + i], kx[u][i], x);
#pragma unroll
        for (int off = LPT / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
        s[u][g] = x * kf[u];
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mn = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) mn = valid[u] ? fmaxf(mn, s[u][g]) : mn;
      if (mn > m[g]) {  // the running max moved: rescale (rare once a row's largest scores are seen)
        const float a = fast_exp2(m[g] - mn);
        l[g] *= a;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[g][i] *= a;
        m[g] = mn;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (!valid[u]) continue;  // not a live slot of this split: its registers hold no row of it
        const float p = fast_exp2(s[u][g] - mn);
        l[g] += p;
        const float pv = p * vf[u];
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[g][i] = fmaf(pv, vx[u][i], acc[g][i]);
      }
    }
  };
  if constexpr (NS > 0) {
    for (int i = 0; i < ntiles; ++i) {
      cp_async_wait<NS - 2>();  // this thread's copies of tile i have landed
      __syncthreads();          // everyone's have, and everyone is done with tile i - 1's stage
      issue(i + NS - 1);        // into tile i - 1's stage
      const unsigned char* stage = smem + (i % NS) * SB;
      const RT* kb = reinterpret_cast<const RT*>(stage);
      const int tb = t_begin + i * TT;
      for (int j0 = 0; j0 < TT; j0 += E * U) {
        bool valid[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int j = j0 + u * E + warp * TPW + sg;
          valid[u] = j < TT && tb + j < t_end;
          if (valid[u]) read(kb, kb + TT * D, j, kcur[u], vcur[u]);
        }
        attend(kcur, vcur, valid);
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the merge's rows reuse the stages
  } else {
    for (int base = t_begin; base < t_end; base += E * U) {
      const int next = base + E * U;
      KS knext[U];
      VS vnext[U];
      if constexpr (PREFETCH) {
        if (next < t_end) fetch(next, knext, vnext);
      }
      bool valid[U];
#pragma unroll
      for (int u = 0; u < U; ++u) valid[u] = token(base, u) < t_end;
      attend(kcur, vcur, valid);
      if constexpr (PREFETCH) {
#pragma unroll
        for (int u = 0; u < U; ++u) { kcur[u] = knext[u]; vcur[u] = vnext[u]; }
      } else if (next < t_end) {
        fetch(next, kcur, vcur);
      }
    }
  }

  float* sm_m = reinterpret_cast<float*>(smem);  // [E][G], then sm_l [E][G], then sm_acc [E][G][D]
  float* sm_l = sm_m + E * G;
  float* sm_acc = sm_l + E * G;
  const int e = warp * TPW + sg;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (sub == 0) { sm_m[e * G + g] = m[g]; sm_l[e * G + g] = l[g]; }
#pragma unroll
    for (int i = 0; i < DPL; ++i) sm_acc[(e * G + g) * D + d0 + i] = acc[g][i];
  }
  __syncthreads();
  merge_states<D, G, E>(sm_m, sm_l, sm_acc, (size_t)b * Hkv * G + (size_t)h * G, S, split, o_part, ml_part);
"""

# One block of D * R threads per (query head, row): thread (r, d) merges dim d of splits r, r + R, ... online
# (their loads in flight together, U at a time), then the R states meet in shared memory: one barrier, where
# a global max first and tree sums took a memory latency and a dozen barriers more (R need not be a power of
# two). AURA values are taken back to the model's domain by a Walsh-Hadamard transform of the D outputs:
# strides below 32 by `fwht_warp`, wider ones through shared memory (the stages of `fwht_shared`, in its
# order). Sinks are in natural-log units; the merge works in log2 units (partial scores were scaled by log2(e)).
COMBINE = r"""
  constexpr int NT = 512, U = 16;  // threads per block at most (D * R, D >= 8); a thread's splits in flight
  const int d = threadIdx.x % D, r = threadIdx.x / D, R = blockDim.x / D;
  const int hq = blockIdx.y, b = blockIdx.z;
  const int Hq = o_part_shape[1], S = o_part_shape[2];
  const size_t row = (size_t)b * Hq + hq;
  const float2* mlp = reinterpret_cast<const float2*>(ml_part) + row * S;  // (max, sum-exp) of each split
  const float* op = o_part + row * S * D + d;
  float m = -1e30f, l = 0.f, o = 0.f;
  for (int s0 = r; s0 < S; s0 += U * R) {
    float2 ml[U];
    float os[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = s0 + u * R;
      ml[u] = s < S ? mlp[s] : make_float2(-1e30f, 0.f);
      os[u] = s < S ? op[(size_t)s * D] : 0.f;
    }
    float mn = m;
#pragma unroll
    for (int u = 0; u < U; ++u) mn = fmaxf(mn, ml[u].x);
    const float a = exp2f(m - mn);
    l *= a;
    o *= a;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float f = exp2f(ml[u].x - mn);
      l = fmaf(ml[u].y, f, l);
      o = fmaf(os[u], f, o);
    }
    m = mn;
  }
  __shared__ float sm_m[NT / 8], sm_l[NT / 8], red_o[NT];
  if (d == 0) { sm_m[r] = m; sm_l[r] = l; }  // the same for every d of r
  red_o[threadIdx.x] = o;
  __syncthreads();
  const float sink = HAS_SINK ? static_cast<float>(sinks[hq]) * 1.4426950408889634f : -1e30f;
  float M = sink;
  for (int j = 0; j < R; ++j) M = fmaxf(M, sm_m[j]);
  float L = HAS_SINK ? exp2f(sink - M) : 0.f, O = 0.f;
  for (int j = 0; j < R; ++j) {
    const float f = exp2f(sm_m[j] - M);
    L = fmaf(sm_l[j], f, L);
    O = fmaf(red_o[j * D + d], f, O);
  }
  float y = L > 0.f ? O / L : 0.f;  // every r holds dim d's output: all take part in the transform
  if (UNROTATE) {
    float yv[1] = {y};
    fwht_warp<1, (D < 32 ? D : 32)>(yv, threadIdx.x % 32);  // strides below 32: D-aligned groups of lanes
    y = yv[0];
    for (int off = 32; off < D; off <<= 1) {
      __syncthreads();  // red_o's last reads are done
      red_o[threadIdx.x] = y;
      __syncthreads();
      const float p = red_o[threadIdx.x ^ off];
      y = (d & off) ? p - y : y + p;
    }
    y = y * vsign[d] * rsqrtf((float)D);
  }
  if (r == 0) out[row * D + d] = static_cast<T>(y);
"""


def compact(source: str) -> str:
    """CUDA `source` without `//` comments (outside string literals), indentation or blank lines.

    Comments are a third of a kernel's text; `kernels.cuda_kv.custom_kernel` writes the compacted text to
    the file it includes (MLX hashes what it is handed at every launch, so it is handed an `#include` line).
    Line structure stays (a `#pragma` keeps its own line); the compiled code is the same.

    Raises:
        ValueError: a form the line scan cannot strip faithfully: a block comment, a quote character
            literal, or a `//` comment ending in a backslash (C++ continues it onto the next line).
    """
    if "/*" in source or "'\"'" in source or re.search(r"//[^\n]*\\\n", source):
        raise ValueError("compact takes // comments only, no quote character literals or continued comments")
    lines = []
    for line in source.splitlines():
        in_string, cut = False, len(line)
        for i, ch in enumerate(line):
            if ch == '"' and (i == 0 or line[i - 1] != "\\"):
                in_string = not in_string
            elif not in_string and line.startswith("//", i):
                cut = i
                break
        text = line[:cut].strip()
        if text:
            lines.append(text)
    return "".join(line + "\n" for line in lines)


_DEFINED = re.compile(r"^(?:__host__ |__device__ )[^(]*?\b(\w+)\(|^struct (\w+)", re.M)


def kernel_header(source: str, header: str = HEADER) -> str:
    """The helpers of `header` that `source` uses, with those they use in turn, in order and `compact`.

    A helper is a blank-line-separated chunk of `header`; it is used where one of the names it defines
    (functions, structs) appears as a word. Every kernel gets only its own helpers: the combine kernel
    needs one of HEADER's twelve chunks.

    Raises:
        ValueError: a chunk whose definitions the scan does not name (one would be dropped unseen).
    """
    chunks = [compact(c) for c in header.strip("\n").split("\n\n")]
    names = [{a or b for a, b in _DEFINED.findall(c)} for c in chunks]
    if not all(names):
        raise ValueError(f"a helper chunk defines no name kernel_header can see: {chunks[names.index(set())][:80]!r}")
    used, texts = [False] * len(chunks), [compact(source)]
    grew = True
    while grew:
        grew = False
        for i, chunk in enumerate(chunks):
            if not used[i] and any(re.search(rf"\b{n}\b", t) for n in names[i] for t in texts):
                used[i], grew = True, True
                texts.append(chunk)
    return "".join(c for c, u in zip(chunks, used) if u)
