// wide: mask reordering (DESIGN.md §3, step 1) in one launch.
//
// For every (batch b, group g): a stable partition of the token indices 0..M-1 so that the
// tokens that execute group g come first (increasing order), then the skipped ones
// (increasing order); plus the count of executing tokens. Same result as
// `wide_cli.runtime.schedule.reorder_mask` and `ops.group_token_lists`.
//
//   mask   : u8 (torch.bool) element (b, m, g) at  mask[b*s_b + m*s_m + g*s_g], nonzero = execute
//   order  : int32 [B, G, M]   (row (b, g) is the partition)
//   counts : int32 [B, G]
// grid (G, B), block REORDER_THREADS. Two passes over the column: count, then scatter.
//
// wide_pack_mask: the same mask [M, G] as bits for gemm_k, packed[w, g] bit r = mask[32w + r, g]
// (rows >= M are 0). grid (ceil(G / 128), ceil(M / 32)), block 128.
#include "common.cuh"

#ifndef REORDER_THREADS
#define REORDER_THREADS 256
#endif
#define REORDER_ITEMS 8  // consecutive tokens per thread per chunk
#define REORDER_CHUNK (REORDER_THREADS * REORDER_ITEMS)

// Block-wide exclusive scan of one int per thread; returns the prefix, writes the total.
WIDE_DEVICE int block_exclusive_scan(int v, int* s_warp, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) s_warp[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < (REORDER_THREADS / 32) ? s_warp[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    if (lane < (REORDER_THREADS / 32)) s_warp[lane] = w;  // inclusive warp prefix
  }
  __syncthreads();
  int before = (warp > 0 ? s_warp[warp - 1] : 0) + x - v;
  total = s_warp[REORDER_THREADS / 32 - 1];
  __syncthreads();  // s_warp is reused by the next call
  return before;
}

extern "C" __global__ void __launch_bounds__(REORDER_THREADS, 1)
    wide_reorder(const u8* __restrict__ mask, i64 s_b, i64 s_m, i64 s_g, int M, int G, int* __restrict__ order,
                 int* __restrict__ counts) {
  __shared__ int s_warp[REORDER_THREADS / 32];
  const int g = blockIdx.x, b = blockIdx.y;
  const u8* col = mask + b * s_b + g * s_g;
  int* out = order + ((i64)b * G + g) * M;

  // pass 1: number of executing tokens
  int mine = 0;
  for (int m = threadIdx.x; m < M; m += REORDER_THREADS) mine += col[m * s_m] != 0;
  int total;
  block_exclusive_scan(mine, s_warp, total);
  const int c = total;
  if (threadIdx.x == 0) counts[(i64)b * G + g] = c;

  // pass 2: scatter, chunk by chunk, keeping both classes in increasing token order
  int base_e = 0, base_s = 0;
  for (int chunk = 0; chunk < M; chunk += REORDER_CHUNK) {
    const int first = chunk + threadIdx.x * REORDER_ITEMS;
    unsigned ex = 0, val = 0;  // bit i: token first+i executes / exists (no local arrays)
#pragma unroll
    for (int i = 0; i < REORDER_ITEMS; ++i) {
      const int m = first + i;
      if (m < M) {
        val |= 1u << i;
        if (col[m * s_m] != 0) ex |= 1u << i;
      }
    }
    const int e = __popc(ex);
    int chunk_e;
    const int pe = block_exclusive_scan(e, s_warp, chunk_e);
    // skipped tokens before this thread in the chunk = tokens before it - executing before it
    const int valid_before = min(max(M - chunk, 0), threadIdx.x * REORDER_ITEMS);
    int ie = base_e + pe, is = c + base_s + (valid_before - pe);
#pragma unroll
    for (int i = 0; i < REORDER_ITEMS; ++i) {
      if ((ex >> i) & 1u) out[ie++] = first + i;
      else if ((val >> i) & 1u) out[is++] = first + i;
    }
    const int chunk_valid = min(M - chunk, REORDER_CHUNK);
    base_e += chunk_e;
    base_s += chunk_valid - chunk_e;
  }
}

extern "C" __global__ void __launch_bounds__(128)
    wide_pack_mask(const u8* __restrict__ mask, i64 s_m, i64 s_g, int M, int G, unsigned* __restrict__ packed) {
  const int g = blockIdx.x * 128 + threadIdx.x;
  const int w = blockIdx.y;
  if (g >= G) return;
  unsigned bits = 0u;
  const int rows = min(32, M - 32 * w);
  const u8* p = mask + (i64)32 * w * s_m + g * s_g;
  for (int r = 0; r < rows; ++r) bits |= (p[r * s_m] != 0 ? 1u : 0u) << r;
  packed[(i64)w * G + g] = bits;
}
