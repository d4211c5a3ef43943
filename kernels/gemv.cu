// wide: routed GEMV paths for decode-sized batches (M <= MMAX <= 8 tokens).
//
// Decode is weight-bandwidth bound, so the win is not reading weights that no token needs.
// One warp owns R weight rows and streams them once with 16-byte loads, dotting each against
// the (at most MMAX) token rows that execute; the tokens' rows stay in L1/L2.
//
// wide_gemv_mn (output groups; SWIGLU=1 fuses silu(gate)*up, a warp then owns the gate and up
//   rows of one channel): a warp whose group no token executes reads no weights at all, and
//   writes zeros (zero_skipped) or nothing. grid ceil(N / (WARPS*ROWS_OUT)), block WARPS*32.
// wide_gemv_k (reduction groups): the block lists the groups executed by any token; warps
//   stream only those columns of their rows and each token accumulates only its own groups.
//   Every output row is written (dense result + bias). grid ceil(N / (WARPS*R)), block WARPS*32,
//   dynamic smem G*5 bytes.
// Host guarantees: K % 8 == 0, group_size % 8 == 0 (and % R == 0), lda/ldw % 8 == 0, aligned.
#include "common.cuh"

#ifndef MMAX
#define MMAX 8
#endif
#ifndef WARPS
#define WARPS 8
#endif
#ifndef SWIGLU
#define SWIGLU 0
#endif
#ifndef UNROLL
#define UNROLL 4
#endif

#define R 2  // weight rows per warp (SwiGLU: gate row + up row of one channel)
#define ROWS_OUT (SWIGLU ? 1 : R)
static_assert(MMAX >= 1 && MMAX <= 8, "GEMV path is for at most 8 tokens");

// Streaming 16-byte weight load: read once, do not keep in L1.
WIDE_DEVICE uint4 ld_stream(const elem_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}
// Activation load through the read-only cache (every warp of the block reads the same rows).
WIDE_DEVICE uint4 ld_ro(const elem_t* p) {
  uint4 v;
  asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 2)
    wide_gemv_mn(const elem_t* __restrict__ A, i64 lda, const elem_t* __restrict__ W,
                 const elem_t* __restrict__ W2, i64 ldw, const elem_t* __restrict__ bias, int has_bias,
                 const u8* __restrict__ mask, i64 mask_sm, i64 mask_sg, elem_t* __restrict__ out, i64 ldo,
                 int M, int N, int K, int group_size, int zero_skipped) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = (blockIdx.x * WARPS + warp) * ROWS_OUT;  // first output channel of this warp
  if (n >= N) return;
  const int j = n / group_size;

  // tokens executing this group (bit m), warp-uniform
  const bool mine = lane < M && mask[(i64)lane * mask_sm + (i64)j * mask_sg] != 0;
  const unsigned bits = __ballot_sync(0xffffffffu, mine);
  if (bits == 0u) {  // block/warp-level skipping: no weight byte of these rows is read
    if (zero_skipped && lane < M) {
#pragma unroll
      for (int r = 0; r < ROWS_OUT; ++r) out[(i64)lane * ldo + n + r] = 0;
    }
    return;
  }

  const elem_t* wrow[R];
#if SWIGLU
  wrow[0] = W + (i64)n * ldw;
  wrow[1] = W2 + (i64)n * ldw;
#else
  wrow[0] = W + (i64)n * ldw;
  wrow[1] = W + (i64)(n + 1 < N ? n + 1 : n) * ldw;
#endif

  float acc[MMAX][R];
#pragma unroll
  for (int m = 0; m < MMAX; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.f;

  for (int k = lane * 8; k < K; k += 32 * 8 * UNROLL) {
    uint4 wv[UNROLL][R];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int kk = k + u * 256;
#pragma unroll
      for (int r = 0; r < R; ++r) wv[u][r] = kk < K ? ld_stream(wrow[r] + kk) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int kk = k + u * 256;
      if (kk >= K) break;
#pragma unroll
      for (int m = 0; m < MMAX; ++m) {
        if (!((bits >> m) & 1u)) continue;  // intra-block skipping: skipped tokens not read
        const uint4 av = ld_ro(A + (i64)m * lda + kk);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] += dot8(av, wv[u][r]);
      }
    }
  }

#pragma unroll
  for (int m = 0; m < MMAX; ++m) {
    if (m >= M) break;
    const bool on = (bits >> m) & 1u;
    float v[R];
#pragma unroll
    for (int r = 0; r < R; ++r) v[r] = on ? warp_sum(acc[m][r]) : 0.f;  // `on` is warp-uniform
    if (lane == 0 && (on || zero_skipped)) {
#if SWIGLU
      out[(i64)m * ldo + n] = from_float(on ? silu(v[0]) * v[1] : 0.f);
#else
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (n + r < N) {
          float x = v[r];
          if (on && has_bias) x += to_float(bias[n + r]);
          out[(i64)m * ldo + n + r] = from_float(on ? x : 0.f);
        }
      }
#endif
    }
  }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 2)
    wide_gemv_k(const elem_t* __restrict__ A, i64 lda, const elem_t* __restrict__ W, i64 ldw,
                const elem_t* __restrict__ bias, int has_bias, const u8* __restrict__ mask, i64 mask_sm,
                i64 mask_sg, elem_t* __restrict__ out, i64 ldo, int M, int N, int K, int group_size) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int G = K / group_size;
  int* s_glist = reinterpret_cast<int*>(smem_raw);            // [G] groups some token executes
  u8* s_gbits = reinterpret_cast<u8*>(s_glist + G);           // [G] bit m: token m executes
  __shared__ int s_ng;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  for (int j = threadIdx.x; j < G; j += WARPS * 32) {
    unsigned b = 0u;
    for (int m = 0; m < M; ++m) b |= (mask[(i64)m * mask_sm + (i64)j * mask_sg] != 0 ? 1u : 0u) << m;
    s_gbits[j] = (u8)b;
  }
  __syncthreads();
  if (warp == 0) {  // block-level skipping: compact the executed groups, in order
    int running = 0;
    for (int j0 = 0; j0 < G; j0 += 32) {
      const int j = j0 + lane;
      const bool any = j < G && s_gbits[j] != 0;
      const unsigned bal = __ballot_sync(0xffffffffu, any);
      if (any) s_glist[running + __popc(bal & ((1u << lane) - 1u))] = j;
      running += __popc(bal);
    }
    if (lane == 0) s_ng = running;
  }
  __syncthreads();

  const int n = (blockIdx.x * WARPS + warp) * R;
  if (n >= N) return;
  const int cpg = group_size / 8;   // 16-byte chunks per group
  const int nchunks = s_ng * cpg;   // chunks of the executed columns of one row
  const elem_t* wrow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) wrow[r] = W + (i64)(n + r < N ? n + r : n) * ldw;

  float acc[MMAX][R];
#pragma unroll
  for (int m = 0; m < MMAX; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.f;

  for (int c0 = lane; c0 < nchunks; c0 += 32 * UNROLL) {
    uint4 wv[UNROLL][R];
    int kk[UNROLL];
    unsigned gb[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = c0 + u * 32;
      kk[u] = -1;
      gb[u] = 0u;
      if (c < nchunks) {
        const int j = s_glist[c / cpg];
        kk[u] = j * group_size + (c % cpg) * 8;
        gb[u] = s_gbits[j];
#pragma unroll
        for (int r = 0; r < R; ++r) wv[u][r] = ld_stream(wrow[r] + kk[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (kk[u] < 0) break;
#pragma unroll
      for (int m = 0; m < MMAX; ++m) {
        if (!((gb[u] >> m) & 1u)) continue;  // this token skips this group: not read
        const uint4 av = ld_ro(A + (i64)m * lda + kk[u]);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] += dot8(av, wv[u][r]);
      }
    }
  }

#pragma unroll
  for (int m = 0; m < MMAX; ++m) {
    if (m >= M) break;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float v = warp_sum(acc[m][r]);
      if (lane == 0 && n + r < N) {
        out[(i64)m * ldo + n + r] = from_float(v + (has_bias ? to_float(bias[n + r]) : 0.f));
      }
    }
  }
}
