"""CUDA sources of the KV kernels (compiled at first use by `mx.fast.cuda_kernel`, NVRTC).

Three kernels, all reading and writing the row format of `kernels.kv_format`:
- `ENCODE`: K and V vectors of one (token, head) -> one compressed row (AURA: rotate with a
  shared-memory fast Walsh-Hadamard transform, Lloyd-Max search, pack, norm-corrected scale;
  affine: MLX's CPU `mx.quantize` rule exactly: min/max, edge snapped to the grid, `rint`).
- `PARTIAL`: split-K decode attention ("flash-decoding"): one block per (split, kv head, row)
  walks its tokens through the row's page table, reads each K/V row once for all G query
  heads of its kv head (GQA), unpacks codes in registers (bit widths 2..8), and writes
  (acc, max, sum-exp) per split. AURA queries are rotated in shared memory first.
- `COMBINE`: merges the splits (and a learned attention sink), divides, and un-rotates AURA
  values in shared memory.

Addressing: token slot t of row b, kv head h lives in pool row
`(h * pages + page) * P + t % P` with `page = page_table[b, t / P]`; page ids >= `pages`
name pages of the tail pool (`page - pages`, same layout), which decode windows write.

Source: the measured prototype `shared/reference/fused-paged-decode/fused.py`; Dao et al.,
"Flash-Decoding for long-context inference" (2023); CACHES.md "AURA encode / decode".
"""

HEADER = r"""
template <int BITS>
__device__ __forceinline__ uint32_t bm_extract(const uint32_t* w, int bit) {
  const int wi = bit >> 5, off = bit & 31;
  uint32_t x = w[wi] >> off;
  if (off + BITS > 32) x |= w[wi + 1] << (32 - off);
  return x & ((1u << BITS) - 1u);
}

// Codes of dims [d0, d0 + DPL) of one little-endian bit stream (mx.quantize layout).
template <int BITS, int DPL>
__device__ __forceinline__ void unpack_slice(const uint32_t* codes, int d0, uint32_t (&idx)[DPL]) {
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  if constexpr ((32 % BITS) == 0 && ((DPL * BITS) % 32) == 0) {
    constexpr int NW = DPL * BITS / 32, PER = 32 / BITS;
    const uint32_t* w = codes + (d0 * BITS) / 32;
#pragma unroll
    for (int j = 0; j < NW; ++j) {
      const uint32_t x = w[j];
#pragma unroll
      for (int k = 0; k < PER; ++k) idx[j * PER + k] = (x >> (k * BITS)) & MASK;
    }
  } else if constexpr ((32 % BITS) == 0) {
    const int bit = d0 * BITS;
    const uint32_t x = codes[bit >> 5] >> (bit & 31);
#pragma unroll
    for (int k = 0; k < DPL; ++k) idx[k] = (x >> (k * BITS)) & MASK;
  } else {
#pragma unroll
    for (int k = 0; k < DPL; ++k) idx[k] = bm_extract<BITS>(codes, (d0 + k) * BITS);
  }
}

// Dims [d0, d0 + DPL) of one part of one row, as floats; returns the per-vector factor.
// MODE 0: raw RT [D] at `raw`; 1: affine codes at `codes`, scales/biases at meta[0..2*D/GS);
// 2: AURA codes at `codes`, unit centroids from `cb`, scale at meta[0].
template <int MODE, int BITS, int GS, int D, int DPL, typename RT>
__device__ __forceinline__ float load_slice(
    const RT* raw, const uint32_t* codes, const __half* meta, const float* cb, int d0, float (&x)[DPL]) {
  if constexpr (MODE == 0) {
    static_assert((DPL * sizeof(RT)) % 16 == 0, "raw slices are whole 16-byte loads");
    constexpr int NV = DPL * sizeof(RT) / 16;
    alignas(16) RT tmp[DPL];
#pragma unroll
    for (int v = 0; v < NV; ++v)
      reinterpret_cast<uint4*>(tmp)[v] = reinterpret_cast<const uint4*>(raw + d0)[v];
#pragma unroll
    for (int i = 0; i < DPL; ++i) x[i] = static_cast<float>(tmp[i]);
    return 1.0f;
  } else if constexpr (MODE == 1) {
    uint32_t idx[DPL];
    unpack_slice<BITS, DPL>(codes, d0, idx);
    const float s = __half2float(meta[d0 / GS]);
    const float b = __half2float(meta[D / GS + d0 / GS]);
#pragma unroll
    for (int i = 0; i < DPL; ++i) x[i] = fmaf(s, static_cast<float>(idx[i]), b);
    return 1.0f;
  } else {
    uint32_t idx[DPL];
    unpack_slice<BITS, DPL>(codes, d0, idx);
#pragma unroll
    for (int i = 0; i < DPL; ++i) x[i] = cb[idx[i]];
    return __half2float(meta[0]);
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
"""

# Inputs: k, v [..., D] (strided), ksign, vsign float [D], cb float [512] (K centroids at 0,
# V at 256), thr float [512] (thresholds, same split). Output rows uint32 [N, ROWW].
# One block of D threads per vector pair; vector n = ((b * H) + h) * L + l.
ENCODE = r"""
  const int n = blockIdx.x, d = threadIdx.x;
  const int H = k_shape[1], L = k_shape[2];
  const int b = n / (H * L), h = (n / L) % H, l = n % L;
  __shared__ float sx[D];
  __shared__ float red[D];
  __shared__ uint32_t sidx[D];
  uint32_t* row = out + (size_t)n * ROWW;
  __half* meta = reinterpret_cast<__half*>(row + MOFF);
#pragma unroll
  for (int part = 0; part < 2; ++part) {
    const int MODE = part == 0 ? KMODE : VMODE;
    const int BITS = part == 0 ? KBITS : VBITS;
    const int GS = part == 0 ? KGS : VGS;
    const T* src = part == 0 ? k : v;
    const int64_t* st = part == 0 ? k_strides.data() : v_strides.data();
    const float x = static_cast<float>(src[b * st[0] + h * st[1] + l * st[2] + d * st[3]]);
    uint32_t* codes = row + (part == 0 ? 0 : KWORDS);
    __half* pmeta = meta + (part == 0 ? 0 : KMH);
    uint32_t q;
    if (MODE == 2) {  // AURA
      const float* sign = part == 0 ? ksign : vsign;
      sx[d] = x * sign[d];
      red[d] = x * x;
      fwht_shared<D>(sx, 1);
      for (int s = D / 2; s > 0; s >>= 1) {  // norm^2 (fwht_shared ended with a barrier)
        if (d < s) red[d] += red[d + s];
        __syncthreads();
      }
      const float norm = sqrtf(red[0]);
      const float u = norm > 0.f ? sx[d] / norm : 0.f;  // sqrt(D) * (H s x / sqrt(D)) / |x|
      const float* th = thr + part * 256;
      int lo = 0, hi = (1 << BITS) - 1;  // count of thresholds < u (ties go to the lower cell)
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (th[mid] < u) lo = mid + 1; else hi = mid;
      }
      q = lo;
      const float c = cb[part * 256 + q];
      __syncthreads();
      red[d] = c * c;
      __syncthreads();
      for (int s = D / 2; s > 0; s >>= 1) {
        if (d < s) red[d] += red[d + s];
        __syncthreads();
      }
      if (d == 0) pmeta[0] = __float2half(norm / sqrtf(red[0]));
    } else {  // affine, MLX's CPU rule (mlx/backend/cpu/quantized.cpp `quantize`)
      sx[d] = x;
      __syncthreads();
      const int g0 = (d / GS) * GS;
      float lo = INFINITY, hi = -INFINITY;
      for (int j = 0; j < GS; ++j) { lo = fminf(lo, sx[g0 + j]); hi = fmaxf(hi, sx[g0 + j]); }
      const float n_bins = (float)((1 << BITS) - 1);
      const bool side = fabsf(lo) > fabsf(hi);
      float scale = fmaxf((hi - lo) / n_bins, 1e-7f);
      scale = side ? scale : -scale;
      const float edge = side ? lo : hi;
      const float q0 = rintf(edge / scale);
      float bias = 0.f;
      if (q0 != 0.f) { scale = edge / q0; bias = edge; }
      q = (uint32_t)fminf(fmaxf(rintf((x - bias) / scale), 0.f), n_bins);
      if (d == g0) {
        pmeta[d / GS] = __float2half(scale);
        pmeta[D / GS + d / GS] = __float2half(bias);
      }
    }
    sidx[d] = q;
    __syncthreads();
    if (d < D * BITS / 32) {  // word d of the bit stream
      uint32_t word = 0;
      const int first = (32 * d) / BITS, last = (32 * d + 31) / BITS;
      for (int i = first; i <= last && i < D; ++i) {
        const int shift = i * BITS - 32 * d;
        word |= shift >= 0 ? (sidx[i] << shift) : (sidx[i] >> (-shift));
      }
      codes[d] = word;
    }
    __syncthreads();
  }
  if (PADMETA && d == 0) meta[KMH + VMH] = __float2half(0.f);
"""

PARTIAL = r"""
  constexpr int DPL = D / LPT;   // dims per lane
  constexpr int TPW = 32 / LPT;  // tokens a warp works on at once
  constexpr int E = W * TPW;     // independent softmax states per block
  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sg = lane / LPT, sub = lane % LPT, d0 = sub * DPL;
  const int Hkv = gridDim.y, S = gridDim.x, NP = pt_shape[1];
  const int tps = params[0], pages = params[1], tail_pages = params[2];
  const int t_begin = split * tps;
  const int t_end = min(t_begin + tps, lens[b]);

  __shared__ float cbs[512];
  __shared__ float qs[G * D];
  for (int i = threadIdx.x; i < 512; i += blockDim.x) cbs[i] = cb[i];
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
    const float x = static_cast<float>(q[((size_t)(b * Hkv + h) * G) * D + i]);
    qs[i] = ROTATE ? x * qsign[i % D] : x;
  }
  if (ROTATE) fwht_shared<D>(qs, G); else __syncthreads();

  float qv[G][DPL], acc[G][DPL], m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -1e30f; l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      qv[g][i] = qs[g * D + d0 + i] * fparams[0];
      acc[g][i] = 0.f;
    }
  }
  const int* table = pt + (size_t)b * NP;

  for (int base = t_begin; base < t_end; base += E * U) {
    float kx[U][DPL], vx[U][DPL], ks[U], vs[U];
    bool valid[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {  // issue every K and V load of U tokens before any math
      const int t = base + u * E + warp * TPW + sg;
      valid[u] = t < t_end;
      if (valid[u]) {
        const int page = table[t / P];
        const bool in_tail = page >= pages;
        const size_t r = ((size_t)h * (in_tail ? tail_pages : pages) + (in_tail ? page - pages : page)) * P + (t % P);
        if constexpr (KMODE == 0) {
          ks[u] = load_slice<0, 1, 1, D, DPL, RT>((in_tail ? kt : kp) + r * D, nullptr, nullptr, cbs, d0, kx[u]);
          vs[u] = load_slice<0, 1, 1, D, DPL, RT>((in_tail ? vt : vp) + r * D, nullptr, nullptr, cbs, d0, vx[u]);
        } else {
          const uint32_t* row = reinterpret_cast<const uint32_t*>(in_tail ? kt : kp) + r * ROWW;
          const __half* meta = reinterpret_cast<const __half*>(row + MOFF);
          ks[u] = load_slice<KMODE, KBITS, KGS, D, DPL, RT>(nullptr, row, meta, cbs, d0, kx[u]);
          vs[u] = load_slice<VMODE, VBITS, VGS, D, DPL, RT>(nullptr, row + KWORDS, meta + KMH, cbs + 256, d0, vx[u]);
        }
      } else {
        ks[u] = 0.f; vs[u] = 0.f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) { kx[u][i] = 0.f; vx[u][i] = 0.f; }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float s[G];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float x = 0.f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) x = fmaf(qv[g][i], kx[u][i], x);
#pragma unroll
        for (int off = LPT / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
        s[g] = x * ks[u];
      }
      if (valid[u]) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float mn = fmaxf(m[g], s[g]);
          const float a = exp2f(m[g] - mn), p = exp2f(s[g] - mn);
          l[g] = fmaf(l[g], a, p);
          const float pv = p * vs[u];
#pragma unroll
          for (int i = 0; i < DPL; ++i) acc[g][i] = fmaf(acc[g][i], a, pv * vx[u][i]);
          m[g] = mn;
        }
      }
    }
  }

  __shared__ float sm_m[E][G], sm_l[E][G], sm_acc[E][G][D];
  const int e = warp * TPW + sg;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (sub == 0) { sm_m[e][g] = m[g]; sm_l[e][g] = l[g]; }
#pragma unroll
    for (int i = 0; i < DPL; ++i) sm_acc[e][g][d0 + i] = acc[g][i];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    const int g = idx / D, d = idx % D;
    float M = -1e30f;
    for (int j = 0; j < E; ++j) M = fmaxf(M, sm_m[j][g]);
    float L = 0.f, O = 0.f;
    for (int j = 0; j < E; ++j) {
      const float f = exp2f(sm_m[j][g] - M);
      L = fmaf(sm_l[j][g], f, L);
      O = fmaf(sm_acc[j][g][d], f, O);
    }
    const size_t hq = (size_t)b * Hkv * G + (size_t)h * G + g;
    o_part[(hq * S + split) * D + d] = O;
    if (d == 0) { ml_part[(hq * S + split) * 2] = M; ml_part[(hq * S + split) * 2 + 1] = L; }
  }
"""

# One block of D threads per (query head, row). Sinks are in natural-log units; the merge
# works in log2 units (partial scores were scaled by log2(e)).
COMBINE = r"""
  const int d = threadIdx.x, hq = blockIdx.y, b = blockIdx.z;
  const int Hq = o_part_shape[1], S = o_part_shape[2];
  const size_t row = (size_t)b * Hq + hq;
  const float* mlp = ml_part + row * S * 2;
  const float sink = HAS_SINK ? static_cast<float>(sinks[hq]) * 1.4426950408889634f : -1e30f;
  float M = sink;
  for (int s = 0; s < S; ++s) M = fmaxf(M, mlp[2 * s]);
  float L = HAS_SINK ? exp2f(sink - M) : 0.f, O = 0.f;
  for (int s = 0; s < S; ++s) {
    const float f = exp2f(mlp[2 * s] - M);
    L = fmaf(mlp[2 * s + 1], f, L);
    O = fmaf(o_part[(row * S + s) * D + d], f, O);
  }
  float y = L > 0.f ? O / L : 0.f;
  if (UNROTATE) {
    __shared__ float v[D];
    v[d] = y;
    fwht_shared<D>(v, 1);
    y = v[d] * vsign[d] * rsqrtf((float)D);
  }
  out[row * D + d] = static_cast<T>(y);
"""
