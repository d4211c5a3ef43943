// wide: routed GEMM over output groups (Q, and Gate/Up with a fused SwiGLU epilogue).
//
//   out[m, n] = a[m] . w[n] (+ bias[n])            if mask[m, n / group_size]
//   out[m, n] = silu(a[m].wg[n]) * (a[m].wu[n])     (SWIGLU=1)
//   out[m, n] = 0                                    otherwise (when zero_skipped)
//
// Co-design (DESIGN.md §3): `order[g, :]` lists the tokens executing group g first (count
// `counts[g]`), from the reorder kernel. A block owns BM consecutive *sorted* positions of one
// group x BN_OUT of that group's output channels:
//   - block-level skipping: a block whose first position is >= counts[g] does no loads and no
//     math; it only writes zeros for its (skipped) rows when zero_skipped, else retires at once;
//   - intra-block skipping: positions >= counts[g] inside a partly active tile are never loaded
//     (cp.async zero-fill, no global read) and their outputs are zeros or not stored.
// Math: bf16/fp16 tensor cores (mma.sync m16n8k16, fp32 accumulate) fed by ldmatrix from a
// STAGES-deep cp.async pipeline. Runs unchanged on sm_80 and sm_90 (no wgmma: see docs).
//
// Tile config (defines): BM, BN (weight rows per tile; SWIGLU tiles hold BN/2 gate + BN/2 up
// rows), WARPS_M x WARPS_N warps, STAGES. Host guarantees: group_size % BN_OUT == 0,
// K % 8 == 0, lda/ldw/ldo % 8 == 0, 16-byte aligned bases.
// grid (ceil(M / BM), N / BN_OUT), block WARPS_M*WARPS_N*32, dynamic smem STAGES*(BM+BN)*LDS*2.
// Token tiles are the fastest grid index: consecutive blocks share one weight tile (read from
// HBM once, then L2), and a group's live tiles come first, its empty ones retire right after.
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
#ifndef SWIGLU
#define SWIGLU 0
#endif

#define BK 32
#define LDS (BK + 8)  // smem row pitch in elements: 80 B, keeps ldmatrix phases bank-conflict free
#define NT (WARPS_M * WARPS_N * 32)
#define WTM (BM / WARPS_M)
#define WTN (BN / WARPS_N)
#define MI (WTM / 16)
#define NI (WTN / 8)
#define BN_OUT (SWIGLU ? BN / 2 : BN)

static_assert(WTM % 16 == 0, "warp tile rows must be a multiple of 16");
static_assert(WTN % 16 == 0, "warp tile cols must be a multiple of 16");
static_assert(!SWIGLU || (WTN / 2) % 16 == 0, "SwiGLU warp tile needs 16-col gate and up halves");
static_assert(STAGES >= 2, "need at least two pipeline stages");

// Weight-tile row of the warp's n-fragment `ni` (SwiGLU: first half gate rows, second half up).
WIDE_DEVICE int b_row(int wn, int ni) {
#if SWIGLU
  return ni < NI / 2 ? wn * (WTN / 2) + ni * 8 : BN / 2 + wn * (WTN / 2) + (ni - NI / 2) * 8;
#else
  return wn * WTN + ni * 8;
#endif
}

extern "C" __global__ void __launch_bounds__(NT)
    wide_gemm_mn(const elem_t* __restrict__ A, i64 lda, const elem_t* __restrict__ W,
                 const elem_t* __restrict__ W2, i64 ldw, const elem_t* __restrict__ bias, int has_bias,
                 const int* __restrict__ order, const int* __restrict__ counts, elem_t* __restrict__ out,
                 i64 ldo, int M, int N, int K, int group_size, int zero_skipped) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  elem_t* As = reinterpret_cast<elem_t*>(smem_raw);  // [STAGES][BM][LDS]
  elem_t* Bs = As + STAGES * BM * LDS;                // [STAGES][BN][LDS]
  __shared__ int s_tok[BM];

  const int n0 = blockIdx.y * BN_OUT;
  const int g = n0 / group_size;
  const int m0 = blockIdx.x * BM;
  const int c = counts[g];
  const int* ord = order + (i64)g * M;

  // Block-level skipping: nothing of this tile executes.
  if (m0 >= c) {
    if (!zero_skipped) return;
    for (int i = threadIdx.x; i < BM * (BN_OUT / 8); i += NT) {
      const int r = i / (BN_OUT / 8), ch = i % (BN_OUT / 8);
      if (m0 + r < M) {
        *reinterpret_cast<uint4*>(out + (i64)ord[m0 + r] * ldo + n0 + ch * 8) = make_uint4(0, 0, 0, 0);
      }
    }
    return;
  }

  for (int r = threadIdx.x; r < BM; r += NT) s_tok[r] = (m0 + r < M) ? ord[m0 + r] : -1;
  __syncthreads();

  auto load_stage = [&](int stage, int kt) {
    const int k0 = kt * BK;
    elem_t* as = As + stage * BM * LDS;
    elem_t* bs = Bs + stage * BN * LDS;
#pragma unroll
    for (int i = threadIdx.x; i < BM * (BK / 8); i += NT) {
      const int r = i >> 2, ch = i & 3, k = k0 + ch * 8;
      const bool ok = (m0 + r < c) && (k < K);  // intra-block skipping: skipped rows never read
      const elem_t* src = ok ? A + (i64)s_tok[r] * lda + k : A;
      cp_async16(as + r * LDS + ch * 8, src, ok);
    }
#pragma unroll
    for (int i = threadIdx.x; i < BN * (BK / 8); i += NT) {
      const int r = i >> 2, ch = i & 3, k = k0 + ch * 8;
#if SWIGLU
      const elem_t* base = r < BN / 2 ? W : W2;
      const int n = n0 + (r < BN / 2 ? r : r - BN / 2);
#else
      const elem_t* base = W;
      const int n = n0 + r;
#endif
      const bool ok = k < K;
      cp_async16(bs + r * LDS + ch * 8, ok ? base + (i64)n * ldw + k : base, ok);
    }
  };

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp / WARPS_N, wn = warp % WARPS_N;

  float acc[MI][NI][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  const int ktiles = (K + BK - 1) / BK;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s, s);
    cp_async_commit();
  }

  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage kt landed for everyone; stage (kt-1) is free to overwrite
    const int nk = kt + STAGES - 1;
    if (nk < ktiles) load_stage(nk % STAGES, nk);
    cp_async_commit();

    const elem_t* as = As + (kt % STAGES) * BM * LDS;
    const elem_t* bs = Bs + (kt % STAGES) * BN * LDS;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned af[MI][4], bf[NI][2];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        const elem_t* p = as + (wm * WTM + mi * 16 + (lane & 15)) * LDS + kk + (lane >> 4) * 8;
        ldmatrix_x4(af[mi][0], af[mi][1], af[mi][2], af[mi][3], p);
      }
#pragma unroll
      for (int np = 0; np < NI / 2; ++np) {
        const int row = b_row(wn, 2 * np) + (lane & 7) + ((lane >> 4) << 3);
        const elem_t* p = bs + row * LDS + kk + ((lane >> 3) & 1) * 8;
        ldmatrix_x4(bf[2 * np][0], bf[2 * np][1], bf[2 * np + 1][0], bf[2 * np + 1][1], p);
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
          mma16816(acc[mi][ni], af[mi][0], af[mi][1], af[mi][2], af[mi][3], bf[ni][0], bf[ni][1]);
    }
  }
  cp_async_wait<0>();

  // Epilogue: executing rows get the result; skipped rows of a partly active tile get zeros.
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wm * WTM + mi * 16 + (lane >> 2) + h * 8;
      const int pos = m0 + r;
      if (pos >= M) continue;
      const bool active = pos < c;
      if (!active && !zero_skipped) continue;
      elem_t* orow = out + (i64)s_tok[r] * ldo;
#if SWIGLU
#pragma unroll
      for (int ni = 0; ni < NI / 2; ++ni) {
        const int col = n0 + wn * (WTN / 2) + ni * 8 + (lane & 3) * 2;
        float v0 = 0.f, v1 = 0.f;
        if (active) {
          v0 = silu(acc[mi][ni][2 * h]) * acc[mi][ni + NI / 2][2 * h];
          v1 = silu(acc[mi][ni][2 * h + 1]) * acc[mi][ni + NI / 2][2 * h + 1];
        }
        store2(orow + col, v0, v1);
      }
#else
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        const int col = n0 + wn * WTN + ni * 8 + (lane & 3) * 2;
        float v0 = 0.f, v1 = 0.f;
        if (active) {
          v0 = acc[mi][ni][2 * h];
          v1 = acc[mi][ni][2 * h + 1];
          if (has_bias) {
            v0 += to_float(bias[col]);
            v1 += to_float(bias[col + 1]);
          }
        }
        store2(orow + col, v0, v1);
      }
#endif
    }
  }
}
