// wide: routed decode attention (one new query token per batch row) over a KV cache,
// split along the keys (flash-decoding) and combined in a second launch.
//
// Decode attention is cache-bandwidth bound. A block owns (batch row b, KV head hk, key chunk)
// and serves the HQ query heads that share hk:
//   - KV-head skipping: when every query head of hk is skipped for row b (KV-aligned head
//     groups), the block returns before reading a byte of that head's K/V cache;
//   - skipped query heads inside a live block cost no math and write nothing; the combine
//     kernel writes their exact zeros.
// Visibility (ops.attention_decode): the query sits at slot S-1; key slot j < S is visible iff
// key_valid[b, j] and, with a window w > 0, (S-1) - j < w. No visible key -> zeros.
//
// Split: grid (nsplit, Hkv, B), block 128; lanes split the head dim in 16-byte pieces
// (LP = D/8 lanes per key), so K and V rows are read with coalesced 16-byte loads.
//   partials: o_part f32 [B, H, nsplit, D] (unnormalised), ml_part f32 [B, H, nsplit, 2] (max in
//   log2 units, sum of exp2). dynamic smem = (HQ*chunk + 4*HQ*D + 2*HQ) * 4 bytes.
// Combine: grid (H, B), block max(D, 32).
// Layouts: q [B, H, D], caches [B, Hkv, S_max, D] (any b/h/s strides, head dim contiguous,
// 16-byte aligned rows), head_mask u8 [B, H], key_valid u8 [B, S], out [B, H, D].
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef HQ
#define HQ 4
#endif
#define D HEAD_DIM
#define NT 128
#define NWARP 4
#define LP (D / 8)        // lanes per key row
#define PPW (32 / LP)     // keys per warp step
#define U 4               // key rows in flight per lane
static_assert(D % 8 == 0 && D >= 16 && D <= 256 && (32 % (D / 8)) == 0, "head dim must be 16, 32, 64, 128 or 256");
static_assert(HQ >= 1 && HQ <= 16, "1..16 query heads per KV head");

extern "C" __global__ void __launch_bounds__(NT, 4)
    wide_attn_decode_split(const elem_t* __restrict__ Q, i64 q_sb, i64 q_sh, const elem_t* __restrict__ Kc,
                           i64 k_sb, i64 k_sh, i64 k_ss, const elem_t* __restrict__ Vc, i64 v_sb, i64 v_sh,
                           i64 v_ss, const u8* __restrict__ head_mask, i64 hm_sb, i64 hm_sh, int has_head_mask,
                           const u8* __restrict__ key_valid, i64 kv_sb, i64 kv_ss, float* __restrict__ o_part,
                           float* __restrict__ ml_part, int S, int H, int Hkv, int chunk, int nsplit,
                           float scale_log2, int window) {
  extern __shared__ __align__(16) float smem_f[];
  float* s_sc = smem_f;                 // [HQ][chunk] scores, then probabilities
  float* s_red = s_sc + HQ * chunk;     // [NWARP][HQ][D]
  float* s_m = s_red + NWARP * HQ * D;  // [HQ]
  float* s_l = s_m + HQ;                // [HQ]

  const int sp = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int h0 = hk * HQ;
  unsigned amask = 0u;
#pragma unroll
  for (int i = 0; i < HQ; ++i) {
    const bool on = !has_head_mask || head_mask[b * hm_sb + (i64)(h0 + i) * hm_sh] != 0;
    amask |= (on ? 1u : 0u) << i;
  }
  if (amask == 0u) return;  // KV-head skipping: no query head of hk runs -> no cache read

  const int lo = window > 0 ? max(0, S - window) : 0;
  const int p0 = max(sp * chunk, lo);
  const int p1 = min(S, (sp + 1) * chunk);
  i64 part = ((i64)b * H + h0) * nsplit + sp;  // (b, h0, sp); head i adds i*nsplit
  if (p0 >= p1) {  // nothing visible in this chunk (window): an empty partial
    if (threadIdx.x < HQ && ((amask >> threadIdx.x) & 1u)) {
      ml_part[(part + (i64)threadIdx.x * nsplit) * 2 + 0] = neg_inf();
      ml_part[(part + (i64)threadIdx.x * nsplit) * 2 + 1] = 0.f;
    }
    return;
  }
  const int n = p1 - p0;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int sub = lane % LP, pidx = lane / LP;
  const elem_t* kbase = Kc + b * k_sb + hk * k_sh + sub * 8;
  const elem_t* vbase = Vc + b * v_sb + hk * v_sh + sub * 8;
  const u8* kvrow = key_valid + b * kv_sb;

  float qv[HQ][8];
#pragma unroll
  for (int i = 0; i < HQ; ++i) {
    if ((amask >> i) & 1u) {
      const uint4 raw = *reinterpret_cast<const uint4*>(Q + b * q_sb + (i64)(h0 + i) * q_sh + sub * 8);
      unpack8(raw, qv[i]);
#pragma unroll
      for (int e = 0; e < 8; ++e) qv[i][e] *= scale_log2;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) qv[i][e] = 0.f;
    }
  }

  // Phase 1: scores (log2 units) of the live heads; -inf for invisible keys.
  for (int base = p0 + warp * PPW * U; base < p1; base += NWARP * PPW * U) {
    uint4 kr[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int p = base + u * PPW + pidx;
      ok[u] = p < p1 && kvrow[p * kv_ss] != 0;
      kr[u] = ok[u] ? *reinterpret_cast<const uint4*>(kbase + p * k_ss) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int p = base + u * PPW + pidx;
      float kf[8];
      unpack8(kr[u], kf);
#pragma unroll
      for (int i = 0; i < HQ; ++i) {
        if (!((amask >> i) & 1u)) continue;  // block-uniform
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) s = fmaf(qv[i][e], kf[e], s);
#pragma unroll
        for (int off = 1; off < LP; off <<= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (sub == 0 && p < p1) s_sc[i * chunk + (p - p0)] = ok[u] ? s : neg_inf();
      }
    }
  }
  __syncthreads();

  // Phase 2: per live head, max and sum of exp2 over the chunk (one warp per head).
  for (int i = warp; i < HQ; i += NWARP) {
    if (!((amask >> i) & 1u)) continue;
    float mx = neg_inf();
    for (int p = lane; p < n; p += 32) mx = fmaxf(mx, s_sc[i * chunk + p]);
    mx = warp_max(mx);
    float l = 0.f;
    for (int p = lane; p < n; p += 32) {
      const float e = mx == neg_inf() ? 0.f : exp2f(s_sc[i * chunk + p] - mx);
      s_sc[i * chunk + p] = e;
      l += e;
    }
    l = warp_sum(l);
    if (lane == 0) {
      s_m[i] = mx;
      s_l[i] = l;
    }
  }
  __syncthreads();

  // Phase 3: unnormalised P V for the live heads; invisible keys' V rows are not read.
  float acc[HQ][8];
#pragma unroll
  for (int i = 0; i < HQ; ++i)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[i][e] = 0.f;
  for (int base = p0 + warp * PPW * U; base < p1; base += NWARP * PPW * U) {
    uint4 vr[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int p = base + u * PPW + pidx;
      ok[u] = p < p1 && kvrow[p * kv_ss] != 0;
      vr[u] = ok[u] ? *reinterpret_cast<const uint4*>(vbase + p * v_ss) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!ok[u]) continue;
      const int p = base + u * PPW + pidx;
      float vf[8];
      unpack8(vr[u], vf);
#pragma unroll
      for (int i = 0; i < HQ; ++i) {
        if (!((amask >> i) & 1u)) continue;
        const float w = s_sc[i * chunk + (p - p0)];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[i][e] = fmaf(w, vf[e], acc[i][e]);
      }
    }
  }
  // reduce over the PPW key slots of the warp, then over warps through shared memory
#pragma unroll
  for (int i = 0; i < HQ; ++i) {
    if (!((amask >> i) & 1u)) continue;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float x = acc[i][e];
#pragma unroll
      for (int off = LP; off < 32; off <<= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
      if (pidx == 0) s_red[(warp * HQ + i) * D + sub * 8 + e] = x;
    }
  }
  __syncthreads();
  for (int t = threadIdx.x; t < HQ * D; t += NT) {
    const int i = t / D, d = t % D;
    if (!((amask >> i) & 1u)) continue;
    float x = 0.f;
#pragma unroll
    for (int w = 0; w < NWARP; ++w) x += s_red[(w * HQ + i) * D + d];
    o_part[(part + (i64)i * nsplit) * D + d] = x;
  }
  if (threadIdx.x < HQ && ((amask >> threadIdx.x) & 1u)) {
    ml_part[(part + (i64)threadIdx.x * nsplit) * 2 + 0] = s_m[threadIdx.x];
    ml_part[(part + (i64)threadIdx.x * nsplit) * 2 + 1] = s_l[threadIdx.x];
  }
}

extern "C" __global__ void __launch_bounds__(D >= 32 ? D : 32)
    wide_attn_decode_combine(const float* __restrict__ o_part, const float* __restrict__ ml_part,
                             const u8* __restrict__ head_mask, i64 hm_sb, i64 hm_sh, int has_head_mask,
                             elem_t* __restrict__ out, i64 o_sb, i64 o_sh, int H, int nsplit) {
  const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
  if (d >= D) return;
  elem_t* o = out + b * o_sb + h * o_sh;
  const bool on = !has_head_mask || head_mask[b * hm_sb + (i64)h * hm_sh] != 0;
  if (!on) {  // skipped head: exact zero
    o[d] = 0;
    return;
  }
  const i64 base = ((i64)b * H + h) * nsplit;
  float mx = neg_inf();
  for (int s = 0; s < nsplit; ++s) mx = fmaxf(mx, ml_part[(base + s) * 2]);
  float l = 0.f, x = 0.f;
  if (mx != neg_inf()) {
    for (int s = 0; s < nsplit; ++s) {
      const float ms = ml_part[(base + s) * 2];
      if (ms == neg_inf()) continue;  // empty chunk: its o_part was never written
      const float w = exp2f(ms - mx);
      l += w * ml_part[(base + s) * 2 + 1];
      x += w * o_part[(base + s) * D + d];
    }
  }
  o[d] = from_float(l > 0.f ? x / l : 0.f);
}
