// wide: routed GEMM over reduction groups (O and Down projections).
//
//   out[m, n] = sum over groups j with mask[m, j] of a[m, Kj] . w[n, Kj]  (+ bias[n])
//
// The reduction mixes groups, so a block owns BM *consecutive* tokens x BN output channels
// and walks only the groups that some token of its tile executes:
//   - block-level skipping: groups no token of the tile executes are dropped from the k-loop
//     (neither activations nor weights are loaded for them); a tile with no executing group
//     only writes the bias / zeros;
//   - intra-block skipping: activation rows of (token, group) pairs that are skipped are never
//     read (cp.async zero-fill), so `a` may hold anything there; a warp skips the MMAs of a
//     16-row fragment in which no token executes the current group.
// The per-(32-token word, group) execute bits come from `wide_pack_mask` (reorder.cu).
// Math: mma.sync m16n8k16, fp32 accumulate, ldmatrix, STAGES-deep cp.async pipeline.
//
// Host guarantees: group_size % 32 == 0, K % 8 == 0, N % 8 == 0, lda/ldw/ldo % 8 == 0, aligned
// bases. grid (ceil(M / BM) * ceil(N / BN)) in GROUP_M-swizzled order (blocks in flight share
// GROUP_M token tiles and a run of weight tiles, so both operands are mostly L2 hits),
// block WARPS_M*WARPS_N*32, dynamic smem = STAGES*(BM+BN)*LDS*2 + G*WORDS*4 + G*4 bytes.
#include "common.cuh"

#ifndef BM
#define BM 128
#endif
#ifndef BN
#define BN 128
#endif
#ifndef WARPS_M
#define WARPS_M 2
#endif
#ifndef WARPS_N
#define WARPS_N 2
#endif
#ifndef STAGES
#define STAGES 4
#endif

#define BK 32
#define LDS (BK + 8)
#define NT (WARPS_M * WARPS_N * 32)
#define NWARPS (WARPS_M * WARPS_N)
#define WTM (BM / WARPS_M)
#define WTN (BN / WARPS_N)
#define MI (WTM / 16)
#define NI (WTN / 8)
#define WORDS (BM >= 32 ? BM / 32 : 1)
#ifndef GROUP_M
#define GROUP_M 8
#endif

static_assert(BM == 16 || BM % 32 == 0, "BM must be 16 or a multiple of 32");
static_assert(WTM % 16 == 0 && WTN % 16 == 0, "warp tile must be a multiple of 16x16");
static_assert(STAGES >= 2, "need at least two pipeline stages");

// Execute bits of tile rows [r, r+16) for group j (r a multiple of 16).
WIDE_DEVICE unsigned rows16(const unsigned* s_bits, int j, int r) {
  return (s_bits[j * WORDS + (r >> 5)] >> (r & 31)) & 0xffffu;
}

extern "C" __global__ void __launch_bounds__(NT)
    wide_gemm_k(const elem_t* __restrict__ A, i64 lda, const elem_t* __restrict__ W, i64 ldw,
                const elem_t* __restrict__ bias, int has_bias, const unsigned* __restrict__ packed, int mwords,
                elem_t* __restrict__ out, i64 ldo, int M, int N, int K, int group_size) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int G = K / group_size;
  elem_t* As = reinterpret_cast<elem_t*>(smem_raw);                // [STAGES][BM][LDS]
  elem_t* Bs = As + STAGES * BM * LDS;                              // [STAGES][BN][LDS]
  unsigned* s_bits = reinterpret_cast<unsigned*>(Bs + STAGES * BN * LDS);  // [G][WORDS]
  int* s_glist = reinterpret_cast<int*>(s_bits + G * WORDS);        // [G] executed groups
  __shared__ int s_ng;

  // GROUP_M swizzle of the 1-D grid: walk GROUP_M token tiles down, then the next weight tile
  const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  const int per_group = GROUP_M * tiles_n;
  const int pid = blockIdx.x, first_m = (pid / per_group) * GROUP_M;
  const int rows_m = min(tiles_m - first_m, GROUP_M);
  const int m0 = (first_m + (pid % per_group) % rows_m) * BM;
  const int n0 = ((pid % per_group) / rows_m) * BN;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  // Execute bits of this tile's rows, per group (rows past M are 0 in `packed`, words past it too).
  for (int i = threadIdx.x; i < G * WORDS; i += NT) {
    const int j = i / WORDS, w = i % WORDS;
    const int word = m0 / 32 + w;
    unsigned bits = word < mwords ? packed[(i64)word * G + j] : 0u;
#if BM < 32
    bits = (bits >> (m0 & 31)) & ((1u << BM) - 1u);
#endif
    s_bits[i] = bits;
  }
  __syncthreads();
  // Block-level skipping: compact the groups some row of the tile executes (order kept).
  if (warp == 0) {
    int running = 0;
    for (int j0 = 0; j0 < G; j0 += 32) {
      const int j = j0 + lane;
      bool any = false;
      if (j < G) {
#pragma unroll
        for (int w = 0; w < WORDS; ++w) any |= s_bits[j * WORDS + w] != 0u;
      }
      const unsigned bal = __ballot_sync(0xffffffffu, any);
      if (any) s_glist[running + __popc(bal & ((1u << lane) - 1u))] = j;
      running += __popc(bal);
    }
    if (lane == 0) s_ng = running;
  }
  __syncthreads();
  const int ng = s_ng;
  const int kpg = group_size / BK;
  const int ktiles = ng * kpg;

  auto load_stage = [&](int stage, int kt) {
    const int j = s_glist[kt / kpg];
    const int k0 = j * group_size + (kt % kpg) * BK;
    elem_t* as = As + stage * BM * LDS;
    elem_t* bs = Bs + stage * BN * LDS;
#pragma unroll
    for (int i = threadIdx.x; i < BM * (BK / 8); i += NT) {
      const int r = i >> 2, ch = i & 3;
      const bool ok = (s_bits[j * WORDS + (r >> 5)] >> (r & 31)) & 1u;  // intra-block skipping
      const elem_t* src = ok ? A + (i64)(m0 + r) * lda + k0 + ch * 8 : A;
      cp_async16(as + r * LDS + ch * 8, src, ok);
    }
#pragma unroll
    for (int i = threadIdx.x; i < BN * (BK / 8); i += NT) {
      const int r = i >> 2, ch = i & 3;
      const bool ok = n0 + r < N;
      cp_async16(bs + r * LDS + ch * 8, ok ? W + (i64)(n0 + r) * ldw + k0 + ch * 8 : W, ok);
    }
  };

  const int wm = warp / WARPS_N, wn = warp % WARPS_N;
  float acc[MI][NI][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s, s);
    cp_async_commit();
  }

  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    const int nk = kt + STAGES - 1;
    if (nk < ktiles) load_stage(nk % STAGES, nk);
    cp_async_commit();

    const int j = s_glist[kt / kpg];
    const elem_t* as = As + (kt % STAGES) * BM * LDS;
    const elem_t* bs = Bs + (kt % STAGES) * BN * LDS;
    unsigned live[MI];  // fragment-level skipping: does any row of this 16-row fragment execute j?
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) live[mi] = rows16(s_bits, j, wm * WTM + mi * 16);
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned af[MI][4], bf[NI][2];
#pragma unroll
      for (int np = 0; np < NI / 2; ++np) {
        const int row = wn * WTN + np * 16 + (lane & 7) + ((lane >> 4) << 3);
        const elem_t* p = bs + row * LDS + kk + ((lane >> 3) & 1) * 8;
        ldmatrix_x4(bf[2 * np][0], bf[2 * np][1], bf[2 * np + 1][0], bf[2 * np + 1][1], p);
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        if (!live[mi]) continue;  // warp-uniform
        const elem_t* p = as + (wm * WTM + mi * 16 + (lane & 15)) * LDS + kk + (lane >> 4) * 8;
        ldmatrix_x4(af[mi][0], af[mi][1], af[mi][2], af[mi][3], p);
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
          mma16816(acc[mi][ni], af[mi][0], af[mi][1], af[mi][2], af[mi][3], bf[ni][0], bf[ni][1]);
      }
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + wm * WTM + mi * 16 + (lane >> 2) + h * 8;
      if (m >= M) continue;
      elem_t* orow = out + (i64)m * ldo;
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        const int col = n0 + wn * WTN + ni * 8 + (lane & 3) * 2;
        if (col >= N) continue;
        float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
        if (has_bias) {
          v0 += to_float(bias[col]);
          v1 += to_float(bias[col + 1]);
        }
        store2(orow + col, v0, v1);
      }
    }
  }
}
