"""CUDA source of the tensor-core partial kernel (`PARTIAL_MMA`): split-K paged decode attention
whose scores and value sums run on the tensor cores (`mma.sync` m16n8k16, fp16/bf16 in, float32
accumulators).

One block per (split, kv head, row), as `kernels.cuda_source.PARTIAL`, with the same inputs,
outputs and helpers (`HEADER`). The G query heads of a kv head are the rows of the A operand
(padded to 16), so a K/V element is read once for all of them. Tiles of TT tokens are copied
into a ring of NS stages in shared memory (`cp.async`, NS - 1 tiles ahead): raw rows into
16-bit K and V tiles whose rows are padded to D + 8 elements (a warp's fragment loads then hit 32
distinct banks), compressed rows as they are stored. Each warp takes 16-token chunks of a tile:
S = Q K^T (D / 16 k-steps x two n-blocks of 8 tokens), the online softmax on the accumulator
fragments (a row's four lanes reduce by two shuffles), then O += P V with P's accumulators
reused as the A operand (FlashAttention-2's register trick) and V as the B operand. A compressed
element is decoded by the one lane whose fragment holds it, so every code of a tile is unpacked
once: an affine one to `scale * q + bias`; an AURA one to its unit centroid, looked up in a 16-bit
table, with the vector's scale applied outside the products (keys' to the scores, values' to P).
The kernel is bound by instruction issue, not bytes (ncu: warps selected or waiting on fixed
latency), so lookups are counted in instructions (`Tuning.register_tables`, on by default): a 4-bit
codebook lives in registers as byte planes and four codes are looked up at once by byte permutes
(`lut16_pairs`, after `nibble_groups` gathers a value dim's codes of four tokens), no shared-memory
load; an 8-bit key's table address is one OR onto the 512-byte-aligned table (`lds_u16`), where
indexing `cbs` adds the base to every code. Either way the tensor cores get the same centroids. At
llama's shape (head_dim 64, 4 query heads a kv head) a warp's 32-token step took 919 instructions
over aura8v4 and 922 over aura4v4; 765 and 738 with them (NVRTC, sm_90a, SASS counted). The
accumulators are rescaled only when some row's running max moved (a warp vote), exact as before.
A tile's copies go page by page (`Tuning.page_copies`, on by default): a group of threads takes a page,
finds its pool row once and issues its 16-byte copies at fixed strides, where each copy looked up its
own pool row (a shared load, a select, 64-bit address math); at llama's shape a thread's share of a
64-token tile took ~290 instructions (aura8v4; raw ~340) and takes ~60.
Affine codes go to the tensor cores in fp16 whatever the model's dtype (the query, or P, too): a
code q becomes the half 1024 + q by masking its word (`0x6400 | q`, two codes a register), then
`scale * q + bias` in one fp16 rounding (scale and bias are stored as fp16): a pair of codes takes a
mask (and a shift or a byte permute) and two half2 operations, where each code took an extract, two
float operations and a conversion (`ops/results/affine_fp16_gpu_2026-12-03.json`: the keys' A/B).
fp16 keeps three more significant bits than bf16; its range bounds the scaled query (|q| * scale
under 65504), as the stored fp16 scale and bias already bound the keys.
Since a product's contraction order is free, compressed dims are permuted per lane (below: KSPAN,
VSPAN) so that a lane's codes are whole words. The warps' states merge in shared memory
(`merge_states`; in a one-split launch, `merge_final` writes the output).

Slots past a split's end score -inf and their V elements are zeros (a NaN left in storage never
reaches an output: 0 * NaN would).

Sources: Dao, "FlashAttention-2" (2023), section 3 (online softmax, P kept in registers); Ye et
al., "FlashInfer" (2025), GQA decode on tensor cores; PTX ISA, "Matrix fragments for mma.m16n8k16";
Frantar et al., "MARLIN" (2024) (integer codes to fp16 through the exponent bits, no conversion);
llama.cpp, `ggml/src/ggml-cuda/vecdotq.cuh` `get_int_from_table_16` (a 16-entry table by byte permutes).
"""

MMA_HEADER = r"""
template <typename A, typename B> struct same_type { static constexpr bool value = false; };
template <typename A> struct same_type<A, A> { static constexpr bool value = true; };
template <bool C, typename A, typename B> struct pick { using type = A; };
template <typename A, typename B> struct pick<false, A, B> { using type = B; };

// Two floats as one 32-bit register of two 16-bit T (a at the low half), rounded to nearest.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  uint32_t u;
  if constexpr (same_type<T, __half>::value) {
    const __half2 v = __floats2half2_rn(a, b);
    memcpy(&u, &v, 4);
  } else {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    memcpy(&u, &v, 4);
  }
  return u;
}

// Two 16-bit T as one register, lo at the low half.
template <typename T>
__device__ __forceinline__ uint32_t pair(T lo, T hi) {
  unsigned short a, b;
  memcpy(&a, &lo, 2);
  memcpy(&b, &hi, 2);
  return a | ((uint32_t)b << 16);
}

// Code i of the codes packed from bit 0 of the words `w` (i a compile-time constant once unrolled).
template <int BITS, int NW>
__device__ __forceinline__ uint32_t lane_code(const uint32_t (&w)[NW], int i) {
  const int bit = i * BITS, k = bit / 32, o = bit % 32;
  uint32_t q = w[k] >> o;
  if (32 % BITS != 0 && o + BITS > 32) q |= w[k + 1] << (32 - o);
  return q & ((1u << BITS) - 1u);
}

// scale * q + bias of the codes q at the low bits of x's two 16-bit halves, in fp16 with one rounding: the
// half 0x6400 | q is 1024 + q exactly, less 1024 exactly (`PARTIAL_MMA`'s affine keys and values).
__device__ __forceinline__ uint32_t affine_half2(uint32_t x, __half2 scale, __half2 bias) {
  x |= 0x64006400u;
  __half2 v;
  memcpy(&v, &x, 4);
  v = __hfma2(__hsub2(v, __float2half2_rn(1024.f)), scale, bias);
  memcpy(&x, &v, 4);
  return x;
}

// The 16-bit word at shared-memory address `addr` (`__cvta_generic_to_shared`; an address the caller formed by OR
// onto an aligned base, one instruction where indexing a `__shared__` array adds the base to every offset).
__device__ __forceinline__ uint32_t lds_u16(uint32_t addr) {
  unsigned short v;
  asm("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr));
  return v;
}

// A 16-entry codebook of 16-bit T in registers as byte planes: lo[r] holds the low bytes of entries 4r .. 4r + 3,
// hi[r] their high bytes (`lut16_pairs` looks up with byte permutes, no shared-memory load).
struct Lut16 {
  uint32_t lo[4], hi[4];
};

template <typename T>
__device__ __forceinline__ Lut16 make_lut16(const T* table) {
  Lut16 t;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    t.lo[r] = t.hi[r] = 0u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      unsigned short e;
      memcpy(&e, table + 4 * r + j, 2);
      t.lo[r] |= (uint32_t)(e & 0xffu) << (8 * j);
      t.hi[r] |= (uint32_t)(e >> 8) << (8 * j);
    }
    // through a shuffle: the same in every lane, but not uniform to the compiler, which otherwise keeps the planes in
    // uniform registers and copies each into a register before every permute
    t.lo[r] = __shfl_sync(0xffffffffu, t.lo[r], threadIdx.x % 32);
    t.hi[r] = __shfl_sync(0xffffffffu, t.hi[r], threadIdx.x % 32);
  }
  return t;
}

// The entries of the four 4-bit codes at bits 0-15 of g (code k at bits 4k .. 4k + 3) as two registers of two
// 16-bit T: (entry c0, entry c1), (entry c2, entry c3). Each permute picks four bytes by the codes' low 3 bits
// from entries 0-7 or 8-15, a third picks between them by bit 3 (as llama.cpp's `get_int_from_table_16`).
__device__ __forceinline__ void lut16_pairs(const Lut16& t, uint32_t g, uint32_t& r0, uint32_t& r1) {
  const uint32_t s = g & 0x7777u, m = ((g >> 1) & 0x4444u) | 0x3210u;
  const uint32_t lo = __byte_perm(__byte_perm(t.lo[0], t.lo[1], s), __byte_perm(t.lo[2], t.lo[3], s), m);
  const uint32_t hi = __byte_perm(__byte_perm(t.hi[0], t.hi[1], s), __byte_perm(t.hi[2], t.hi[3], s), m);
  r0 = __byte_perm(lo, hi, 0x5140);
  r1 = __byte_perm(lo, hi, 0x7362);
}

// Nibble n (n = 0..7) of four words w0..w3 gathered into one 16-bit group (w0's at bits 0-3, ..., w3's at 12-15):
// g[0] holds groups 0 (bits 0-15) and 2 (16-31), g[1] groups 4 and 6, g[2] 1 and 3, g[3] 5 and 7.
__device__ __forceinline__ void nibble_groups(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3, uint32_t (&g)[4]) {
  const uint32_t pe = (w0 & 0x0f0f0f0fu) | ((w1 << 4) & 0xf0f0f0f0u), po = ((w0 >> 4) & 0x0f0f0f0fu) | (w1 & 0xf0f0f0f0u);
  const uint32_t qe = (w2 & 0x0f0f0f0fu) | ((w3 << 4) & 0xf0f0f0f0u), qo = ((w2 >> 4) & 0x0f0f0f0fu) | (w3 & 0xf0f0f0f0u);
  g[0] = __byte_perm(pe, qe, 0x5140);
  g[1] = __byte_perm(pe, qe, 0x7362);
  g[2] = __byte_perm(po, qo, 0x5140);
  g[3] = __byte_perm(po, qo, 0x7362);
}

// c += A B: one m16n8k16 tensor-core product (A row-major 16 x 16, B col-major 16 x 8, float32 c).
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (same_type<T, __half>::value) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
"""

PARTIAL_MMA = r"""
  static_assert(sizeof(T) == 2 && D % 16 == 0 && G <= 16 && TT % (16 * CH) == 0, "fp16/bf16, D % 16, G <= 16");
  constexpr bool RAW = KMODE == 0;
  constexpr int DP = D + 8;                    // padded row of a 16-bit tile (elements)
  constexpr int RB = RAW ? D * 2 : ROWW * 4;   // bytes of a token's row in one pool
  constexpr int SB = RAW ? 2 * TT * DP * 2 : TT * RB;  // bytes of one stage (raw: K and V tiles, padded rows)
  constexpr int RING = NS * SB;
  constexpr int EPI = W * G * (D + 2) * 4;
  constexpr int SMEM = RING > EPI ? RING : EPI;
  // PGC: a tile's copies page by page (tiles start at a split's first page; a page's P rows lie contiguous in
  // its pool), TPP threads a page, where the block's threads split evenly over the tile's pages
  constexpr int TPP = TT % P == 0 && 32 * W % (TT / P) == 0 ? 32 * W / (TT / P) : 0;
  constexpr bool PAGED = PGC && TPP > 0 && P * RB % 16 == 0 && (!RAW || TPP % (D * 2 / 16) == 0);
  constexpr int KSTEPS = D / 16, NBLK = D / 8, NB = 2 * CH;  // NB: 8-token blocks of a warp's CH slabs
  // Compressed rows: lane t = lane % 4 holds dims [t * KSPAN, + KSPAN) of every key (KLW whole words of
  // codes; the query's columns are permuted alike), lane group gid dims [gid * VSPAN, + VSPAN) of every
  // value (VLW words), so a lane loads its words once a row and every shift is a compile-time constant.
  constexpr int KSPAN = D / 4, VSPAN = D / 8;
  constexpr int KLW = RAW ? 1 : KSPAN * KBITS / 32, VLW = RAW ? 1 : VSPAN * VBITS / 32;
  // Affine keys go to the tensor cores as fp16 (the query too): a code q becomes the half 1024 + q by a mask
  // (0x6400 | q), then scale * q + bias in one rounding (HSUB2, HFMA2). Of 2, 4 or 8 bits (KPAIR), a B
  // register's two codes are C / 2 apart in one word (C = 32 / KBITS codes a word), so one shift and one
  // mask place both: k-step kk reads word kk / (C / 4), pairs j = 2 (kk % (C / 4)) + hf, hf = 0 (b0) or 1 (b1).
  constexpr bool KPAIR = KMODE == 1 && (KBITS == 2 || KBITS == 4 || KBITS == 8);
  constexpr int KC = 32 / KBITS, KHI = KPAIR ? KC / 2 : 1;  // codes a word; distance of a register's two codes
  using KO = typename pick<KMODE == 1, __half, T>::type;  // operands of the scores (affine: query, keys in fp16)
  using VO = typename pick<VMODE == 1, __half, T>::type;  // operands of the value sums (affine: P, values in fp16)
  static_assert(RAW || (KSPAN * KBITS % 32 == 0 && VSPAN * VBITS % 32 == 0), "a lane's codes are whole words");
  static_assert(KMODE != 1 || KGS % KSPAN == 0, "a lane's key dims lie in one affine group");
  static_assert(VMODE != 1 || VGS % VSPAN == 0, "a lane's value dims lie in one affine group");
  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gid = lane / 4, c0 = (lane % 4) * 2;  // fragment row group, column pair
  const int Hkv = gridDim.y, S = gridDim.x, NP = pt_shape[1];
  const int tps = P * ((NP + S - 1) / S);  // tokens a split (`kernels.cuda_kv._split_plan`)
  const int pages = kp_shape[0] / (Hkv * P), tail_pages = kt_shape[0] / (Hkv * P);
  const int t_begin = split * tps, pg0 = t_begin / P;

  constexpr int KCB = KMODE == 2 ? 1 << KBITS : 0, VCB = VMODE == 2 ? 1 << VBITS : 0;  // AURA centroids
  __shared__ __align__(512) T cbs[KCB + VCB > 0 ? KCB + VCB : 1];  // as T: a table entry is a B operand element
  __shared__ float qs[G * D];
  __shared__ int pids[MAXPG], live;
  __shared__ __align__(16) unsigned char smem[SMEM];
  // cb: AURA centroids [512], the keys' rotation signs [D], the values' [D] (`cuda_kv._attention_constants`)
  stage_block<T, T, D, G, KCB, VCB, MAXPG, 32 * W, ROTATE>(q + ((size_t)(b * Hkv + h) * G) * D, cb + 512,
                                                          __int_as_float(QSCALE), cb, pt + (size_t)b * NP + pg0,
                                                          min(tps / P, NP - pg0), lens + b, qs, cbs, pids, &live);
  __syncthreads();
  const int t_end = min(t_begin + tps, min(live, NP * P));  // never past the staged page ids
  // LUT: 4-bit AURA codebooks in registers, looked up four codes at a time by byte permutes (`lut16_pairs`); 8-bit
  // AURA keys at the shared address `cbase | 2 code` (cbs is 512-byte aligned), one OR where `cbs[code]` adds.
  constexpr bool KLUT = KMODE == 2 && KBITS == 4 && LUT, VLUT = VMODE == 2 && VBITS == 4 && LUT;
  constexpr bool KOR = KMODE == 2 && KBITS == 8 && LUT;
  const uint32_t cbase = static_cast<uint32_t>(__cvta_generic_to_shared(cbs));
  Lut16 klut, vlut;
  if constexpr (KLUT) klut = make_lut16<T>(cbs);
  if constexpr (VLUT) vlut = make_lut16<T>(cbs + KCB);

  auto pool_row = [&](int t, bool& in_tail) {
    const int page = pids[t / P - pg0];
    in_tail = page >= pages;
    return ((size_t)h * (in_tail ? tail_pages : pages) + (in_tail ? page - pages : page)) * P + (t % P);
  };
  const int ntiles = t_end > t_begin ? (t_end - t_begin + TT - 1) / TT : 0;
  auto issue = [&](int tile) {
    if (tile < ntiles) {
      const int tb = t_begin + tile * TT;
      const int rows = min(TT, t_end - tb);
      unsigned char* stage = smem + (tile % NS) * SB;
      if constexpr (PAGED) {  // thread group p copies page p: its pool row once, then 16-byte copies at fixed strides
        constexpr int CPR = D * 2 / 16, CPP = RAW ? P * CPR : P * RB / 16;  // copies a raw row; a page (a part)
        const int p = threadIdx.x / TPP, l = threadIdx.x % TPP;
        if (p * P < rows) {
          bool in_tail;
          const size_t r = pool_row(tb + p * P, in_tail);  // the page's first row: its rows follow it
#pragma unroll
          for (int part = 0; part < (RAW ? 2 : 1); ++part) {
            const RT* pool = part == 0 ? (in_tail ? kt : kp) : (in_tail ? vt : vp);
            // copy c = l + u TPP of the page: raw row c / CPR, bytes 16 (c % CPR); compressed bytes 16 c
            const unsigned char* src = reinterpret_cast<const unsigned char*>(pool) + r * RB +
                                       (RAW ? (l / CPR) * RB + (l % CPR) * 16 : l * 16);
            unsigned char* dst = stage + (RAW ? (part * TT + p * P + l / CPR) * DP * 2 + (l % CPR) * 16
                                              : p * P * RB + l * 16);
#pragma unroll
            for (int u = 0; u < (CPP + TPP - 1) / TPP; ++u) {
              if (CPP % TPP == 0 || l + u * TPP < CPP) {
                if constexpr (RAW) {  // TPP % CPR == 0: a thread's copies keep their column
                  cp_async<16>(dst + u * (TPP / CPR) * DP * 2, src + u * (TPP / CPR) * RB);
                } else {
                  cp_async<16>(dst + u * TPP * 16, src + u * TPP * 16);
                }
              }
            }
          }
        }
      } else if constexpr (RAW) {  // row by row into the padded tile: K rows, then V rows
        constexpr int CPR = D * 2 / 16;
#pragma unroll
        for (int part = 0; part < 2; ++part) {
          for (int c = threadIdx.x; c < rows * CPR; c += 32 * W) {
            const int j = c / CPR, k = c - j * CPR;
            bool in_tail;
            const size_t r = pool_row(tb + j, in_tail);
            const RT* pool = part == 0 ? (in_tail ? kt : kp) : (in_tail ? vt : vp);
            cp_async<16>(stage + ((part * TT + j) * DP) * 2 + k * 16,
                         reinterpret_cast<const unsigned char*>(pool) + r * RB + k * 16);
          }
        }
      } else {  // row groups of whole copies, contiguous as in the pool
        constexpr int CPG = RG * RB / CG;
        const int groups = (rows + RG - 1) / RG;
        for (int c = threadIdx.x; c < groups * CPG; c += 32 * W) {
          const int g = c / CPG, k = c - g * CPG;
          bool in_tail;
          const size_t r = pool_row(tb + g * RG, in_tail);
          cp_async<CG>(stage + g * RG * RB + k * CG,
                       reinterpret_cast<const unsigned char*>(in_tail ? kt : kp) + r * RB + k * CG);
        }
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < NS - 1; ++i) issue(i);
  uint32_t qa[KSTEPS][4];  // A fragments of the scaled query (rows >= G are zero)
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
    for (int f = 0; f < 4; ++f) {
      const int row = gid + (f & 1) * 8, hf = f >> 1;
      // the dims of this lane's B codes in k-step kk (compressed: lane-local code indices, `KPAIR`)
      const int lo = KPAIR ? KC * (kk / (KC / 4)) + 2 * (kk % (KC / 4)) + hf : 4 * kk + 2 * hf;
      const int col = RAW ? kk * 16 + c0 + hf * 8 : (lane % 4) * KSPAN + lo, hi = RAW ? col + 1 : col + KHI;
      qa[kk][f] = row >= G ? 0u : pack2<KO>(qs[row * D + col], qs[row * D + hi]);
    }
  }

  float acc[NBLK][4], m[2] = {-1e30f, -1e30f}, l[2] = {0.f, 0.f};  // rows gid and gid + 8
#pragma unroll
  for (int n = 0; n < NBLK; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  for (int i = 0; i < ntiles; ++i) {
    cp_async_wait<NS - 2>();
    __syncthreads();  // tile i landed for all; everyone is done with tile i - 1
    issue(i + NS - 1);
    const int tb = t_begin + i * TT;
    const int rows = min(TT, t_end - tb);
    const unsigned char* stage = smem + (i % NS) * SB;
    if constexpr (RAW) {
      if (rows < TT) {  // V rows past the end: zeros (storage there may hold NaN)
        T* vb = reinterpret_cast<T*>(const_cast<unsigned char*>(stage)) + TT * DP;
        for (int x = threadIdx.x; x < (TT - rows) * D; x += 32 * W) vb[(rows + x / D) * DP + x % D] = T(0.f);
        __syncthreads();
      }
    }
    for (int j0 = warp * 16 * CH; j0 < rows; j0 += 16 * CH * W) {  // this warp's CH 16-token slabs at once
      // AURA vector scales of this lane's accumulator columns, tokens j0 + 8 nb + c0 + x (the same tokens
      // its P fragment holds): keys' scale the scores, values' the probabilities (0 past the end).
      float ks[NB][2], vs[NB][2];
      if constexpr (KMODE == 2 || VMODE == 2) {
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
          for (int x = 0; x < 2; ++x) {
            const int jt = j0 + nb * 8 + c0 + x;
            const __half* meta = reinterpret_cast<const __half*>(reinterpret_cast<const uint32_t*>(stage) + jt * ROWW + MOFF);
            if constexpr (KMODE == 2 && VMODE == 2 && KMH == 1) {  // both scales in one word
              const float2 f = __half22float2(*reinterpret_cast<const __half2*>(meta));
              ks[nb][x] = f.x;
              vs[nb][x] = jt < rows ? f.y : 0.f;
            } else {
              ks[nb][x] = KMODE == 2 ? __half2float(meta[0]) : 1.f;
              vs[nb][x] = VMODE == 2 && jt < rows ? __half2float(meta[KMH]) : 0.f;
            }
          }
        }
      }
      float s[NB][4];
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {  // S = Q K^T for tokens j0 + 8 nb .. + 7; this lane's B column: token gid
        s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
        const int j = j0 + nb * 8 + gid;
        if constexpr (RAW) {
#pragma unroll
          for (int kk = 0; kk < KSTEPS; ++kk) {
            const T* krow = reinterpret_cast<const T*>(stage) + j * DP + kk * 16 + c0;
            mma16816<T>(s[nb], qa[kk], *reinterpret_cast<const uint32_t*>(krow), *reinterpret_cast<const uint32_t*>(krow + 8));
          }
        } else {  // codes decoded where they land: each element of the tile once, by one lane
          const uint32_t* row = reinterpret_cast<const uint32_t*>(stage) + j * ROWW;
          uint32_t kw[KLW];
#pragma unroll
          for (int v = 0; v < KLW; ++v) kw[v] = row[(lane % 4) * KLW + v];
          __half2 sc = __float2half2_rn(1.f), bi = __float2half2_rn(0.f);  // affine: the lane's group
          if constexpr (KMODE == 1) {
            const __half* meta = reinterpret_cast<const __half*>(row + MOFF);
            sc = __half2half2(meta[(lane % 4) * KSPAN / KGS]);
            bi = __half2half2(meta[D / KGS + (lane % 4) * KSPAN / KGS]);
          }
          auto b = [&](int kk, int hf) {  // B register hf of k-step kk (AURA: unit centroids, scaled below)
            if constexpr (KOR) {  // bytes 2 hf, 2 hf + 1 of word kk, times 2: byte offsets below 512
              const uint32_t w = kw[kk];
              return lds_u16(cbase | ((hf ? w >> 15 : w << 1) & 0x1feu)) | lds_u16(cbase | ((w >> (16 * hf + 7)) & 0x1feu)) << 16;
            } else if constexpr (KMODE == 2) {
              return pair<T>(cbs[lane_code<KBITS>(kw, 4 * kk + 2 * hf)], cbs[lane_code<KBITS>(kw, 4 * kk + 2 * hf + 1)]);
            } else {
              uint32_t x;  // the two codes at the low bits of its halves
              if constexpr (KPAIR) {
                x = (kw[kk / (KC / 4)] >> (KBITS * (2 * (kk % (KC / 4)) + hf))) & (((1u << KBITS) - 1u) * 0x10001u);
              } else {
                x = lane_code<KBITS>(kw, 4 * kk + 2 * hf) | lane_code<KBITS>(kw, 4 * kk + 2 * hf + 1) << 16;
              }
              return affine_half2(x, sc, bi);
            }
          };
#pragma unroll
          for (int kk = 0; kk < KSTEPS; ++kk) {
            if constexpr (KLUT) {  // codes 4 kk .. 4 kk + 3: bits 16 (kk % 2) of word kk / 2
              uint32_t r0, r1;
              lut16_pairs(klut, kw[kk / 2] >> (16 * (kk % 2)), r0, r1);
              mma16816<KO>(s[nb], qa[kk], r0, r1);
            } else {
              mma16816<KO>(s[nb], qa[kk], b(kk, 0), b(kk, 1));
            }
          }
          if constexpr (KMODE == 2) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nb][e] *= ks[nb][e & 1];
          }
        }
      }
      float mx[2] = {m[0], m[1]};
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (j0 + nb * 8 + c0 + (e & 1) >= rows) s[nb][e] = -INFINITY;  // past the split's end
          mx[e >> 1] = fmaxf(mx[e >> 1], s[nb][e]);
        }
      }
      float a[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        a[r] = fast_exp2(m[r] - mx[r]);
        l[r] *= a[r];
        m[r] = mx[r];
      }
      if (__any_sync(0xffffffffu, a[0] != 1.f || a[1] != 1.f)) {  // a row's max moved (else the sums stand as they are)
#pragma unroll
        for (int n = 0; n < NBLK; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[n][e] *= a[e >> 1];
        }
      }
      uint32_t pa[CH][4];  // P as A operands, slab c: tokens 16 c + c0, + 1 (+ 8) of rows gid (+ 8); AURA: times V's scales
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          p[e] = fast_exp2(s[nb][e] - m[e >> 1]);
          l[e >> 1] += p[e];
          if constexpr (VMODE == 2) p[e] *= vs[nb][e & 1];
        }
        pa[nb / 2][2 * (nb % 2)] = pack2<VO>(p[0], p[1]);
        pa[nb / 2][2 * (nb % 2) + 1] = pack2<VO>(p[2], p[3]);
      }
#pragma unroll
      for (int c = 0; c < CH; ++c) {  // O += P V, slab by slab (tokens jc .. jc + 15)
        const int jc = j0 + 16 * c;
        // this lane's B rows: tokens jc + c0 + {0, 1, 8, 9}, column: dim 8 n + gid.
        if constexpr (RAW) {
          const T* v0 = reinterpret_cast<const T*>(stage) + (TT + jc + c0) * DP + gid;
#pragma unroll
          for (int n = 0; n < NBLK; ++n) {
            const T* v = v0 + n * 8;
            mma16816<T>(acc[n], pa[c], pair<T>(v[0], v[DP]), pair<T>(v[8 * DP], v[9 * DP]));
          }
        } else {  // this lane's B rows: tokens jc + c0 + {0, 1, 8, 9}; its dims gid * VSPAN + n
          uint32_t vw[4][VLW];
          __half sc[4], bi[4];  // affine: the group of the lane's dims, 0 where the row is not live
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int j = jc + c0 + (e & 1) + (e >> 1) * 8;
            const uint32_t* row = reinterpret_cast<const uint32_t*>(stage) + j * ROWW;
#pragma unroll
            for (int v = 0; v < VLW; ++v) vw[e][v] = row[KWORDS + gid * VLW + v];
            if constexpr (VMODE == 1) {  // a zero, not 0 * NaN, where the row is not live
              const __half* meta = reinterpret_cast<const __half*>(row + MOFF) + KMH;
              sc[e] = j < rows ? meta[gid * VSPAN / VGS] : __float2half(0.f);
              bi[e] = j < rows ? meta[D / VGS + gid * VSPAN / VGS] : __float2half(0.f);
            }
          }
          if constexpr (VLUT) {  // dim n = 8 v + i of the four tokens: nibble i of their word v, one group
#pragma unroll
            for (int v = 0; v < VLW; ++v) {
              uint32_t g[4];
              nibble_groups(vw[0][v], vw[1][v], vw[2][v], vw[3][v], g);
#pragma unroll
              for (int i = 0; i < 8; ++i) {
                uint32_t r0, r1;
                lut16_pairs(vlut, g[(i % 2) * 2 + (i / 4)] >> (16 * ((i / 2) % 2)), r0, r1);
                mma16816<T>(acc[8 * v + i], pa[c], r0, r1);
              }
            }
          } else if constexpr (VMODE == 2) {  // AURA: centroids (finite whatever the bits; P carries the scales)
            auto x = [&](int e, int n) { return cbs[KCB + lane_code<VBITS>(vw[e], n)]; };
#pragma unroll
            for (int n = 0; n < NBLK; ++n) mma16816<T>(acc[n], pa[c], pair<T>(x(0, n), x(1, n)), pair<T>(x(2, n), x(3, n)));
          } else {  // affine, in fp16 as the keys: B register r holds dim n of tokens e = 2r, 2r + 1
            auto b = [&](int r, int n) {
              const uint32_t(&w0)[VLW] = vw[2 * r];
              const uint32_t(&w1)[VLW] = vw[2 * r + 1];
              uint32_t x;
              if constexpr (VBITS == 2 || VBITS == 4 || VBITS == 8) {  // the two words' 16-bit halves holding code n
                constexpr int VC = 32 / VBITS;
                const int ci = n % VC;
                x = (__byte_perm(w0[n / VC], w1[n / VC], ci * VBITS < 16 ? 0x5410 : 0x7632) >> (ci * VBITS % 16)) &
                    (((1u << VBITS) - 1u) * 0x10001u);
              } else {
                x = lane_code<VBITS>(w0, n) | lane_code<VBITS>(w1, n) << 16;
              }
              return affine_half2(x, __halves2half2(sc[2 * r], sc[2 * r + 1]), __halves2half2(bi[2 * r], bi[2 * r + 1]));
            };
#pragma unroll
            for (int n = 0; n < NBLK; ++n) mma16816<VO>(acc[n], pa[c], b(0, n), b(1, n));
          }
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the merge's rows reuse the ring

  float* sm_m = reinterpret_cast<float*>(smem);  // [W][G], then sm_l [W][G], then sm_acc [W][G][D]
  float* sm_l = sm_m + W * G;
  float* sm_acc = sm_l + W * G;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int g = gid + 8 * r;
    if (g < G) {
      if (c0 == 0) { sm_m[warp * G + g] = m[r]; sm_l[warp * G + g] = l[r]; }
#pragma unroll
      for (int n = 0; n < NBLK; ++n) {
        // output column c0 + x of n-block n: dim 8 n + c0 + x (raw), (c0 + x) * VSPAN + n (compressed)
        sm_acc[(warp * G + g) * D + (RAW ? n * 8 + c0 : c0 * VSPAN + n)] = acc[n][2 * r];
        sm_acc[(warp * G + g) * D + (RAW ? n * 8 + c0 + 1 : (c0 + 1) * VSPAN + n)] = acc[n][2 * r + 1];
      }
    }
  }
  __syncthreads();
  merge_states<D, G, W>(sm_m, sm_l, sm_acc, (size_t)b * Hkv * G + (size_t)h * G, S, split, o_part, ml_part);
"""
