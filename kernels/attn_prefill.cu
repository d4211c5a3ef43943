// wide: routed causal attention for a block of T query tokens (prefill), GQA, per (token, head)
// execute mask; FlashAttention-2 style on mma.sync tensor cores with an online softmax.
//
// Co-design (DESIGN.md §3): `order[b, h, :]` lists the tokens that execute head h first
// (ascending; count counts[b, h]), from the reorder kernel. A block owns BM consecutive *sorted*
// positions for one (batch row, query head):
//   - block-level skipping: a tile past counts[b, h] loads nothing; it writes zeros for its
//     (skipped) rows when zero_skipped, else retires at once;
//   - intra-block skipping: the Q rows of skipped tokens are never loaded, their outputs are
//     zeros or not stored. Because executing tokens are sorted, the tile's causal key range
//     ends at the slot of its last row, and a warp skips key blocks entirely in its rows' future.
// Visibility (ops.key_visibility): key slot j is visible to the query at slot q = q_offset + t iff
// j <= q, key_valid[b, j] (when given) and, with a window w > 0, q - j < w. Queries that see
// no key produce zeros (as in the reference).
//
// Layouts (element strides; the head dim is contiguous, row starts 16-byte aligned):
//   Q [B, T, H, D], K/V [B, S, Hkv, D] (any b/s/h strides: a transposed cache view is fine),
//   key_valid u8 [B, S], order int32 [B, H, T], counts int32 [B, H], out [B, T, H, D].
// grid (ceil(T / BM), H, B), block 128 (4 warps x 16 query rows), dynamic smem =
//   (BM + 4 * BN) * (D + 8) * 2 + 2 * BN bytes.
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef BN
#define BN (HEAD_DIM > 128 ? 32 : 64)
#endif

#define D HEAD_DIM
#define BM 64
#define NT 128
#define LDQ (D + 8)  // smem pitch (elements): odd multiple of 16 bytes, ldmatrix conflict-free
#define NF (BN / 8)  // score n-fragments per key block
#define DF (D / 8)   // output n-fragments over the head dim
static_assert(D % 16 == 0 && D <= 256, "head dim must be a multiple of 16, at most 256");
static_assert(BN % 16 == 0, "key block must be a multiple of 16");

extern "C" __global__ void __launch_bounds__(NT, 1)
    wide_attn_prefill(const elem_t* __restrict__ Q, i64 q_sb, i64 q_st, i64 q_sh, const elem_t* __restrict__ Kp,
                      i64 k_sb, i64 k_ss, i64 k_sh, const elem_t* __restrict__ Vp, i64 v_sb, i64 v_ss, i64 v_sh,
                      const u8* __restrict__ key_valid, i64 kv_sb, int has_key_valid,
                      const int* __restrict__ order, const int* __restrict__ counts, elem_t* __restrict__ out,
                      i64 o_sb, i64 o_st, i64 o_sh, int T, int S, int H, int Hkv, int q_offset,
                      float scale_log2, int window, int zero_skipped) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  elem_t* Qs = reinterpret_cast<elem_t*>(smem_raw);  // [BM][LDQ]
  elem_t* Ks = Qs + BM * LDQ;                         // [2][BN][LDQ]
  elem_t* Vs = Ks + 2 * BN * LDQ;                     // [2][BN][LDQ]
  u8* s_valid = reinterpret_cast<u8*>(Vs + 2 * BN * LDQ);  // [2][BN]
  __shared__ int s_tok[BM];

  const int b = blockIdx.z, h = blockIdx.y, m0 = blockIdx.x * BM;
  const int hk = h / (H / Hkv);
  const int c = counts[(i64)b * H + h];
  const int* ord = order + ((i64)b * H + h) * T;

  if (m0 >= c) {  // block-level skipping
    if (!zero_skipped) return;
    for (int i = threadIdx.x; i < BM * (D / 8); i += NT) {
      const int r = i / (D / 8), ch = i % (D / 8);
      if (m0 + r < T) {
        *reinterpret_cast<uint4*>(out + b * o_sb + (i64)ord[m0 + r] * o_st + h * o_sh + ch * 8) =
            make_uint4(0, 0, 0, 0);
      }
    }
    return;
  }
  const int nvalid = min(BM, c - m0);
  // Rows past the executing ones repeat the last executing token (finite math, never stored).
  for (int r = threadIdx.x; r < BM; r += NT) s_tok[r] = ord[m0 + min(r, nvalid - 1)];
  __syncthreads();

  const int first_slot = q_offset + s_tok[0];
  const int last_slot = q_offset + s_tok[nvalid - 1];
  const int kv_begin = window > 0 ? max(0, first_slot - window + 1) : 0;
  const int kb_begin = kv_begin / BN;
  const int kb_end = (min(last_slot + 1, S) + BN - 1) / BN;

  const elem_t* qbase = Q + b * q_sb + h * q_sh;
  const elem_t* kbase = Kp + b * k_sb + hk * k_sh;
  const elem_t* vbase = Vp + b * v_sb + hk * v_sh;

  // Q tile: only the executing tokens' rows are read (the repeats hit the same row again).
  for (int i = threadIdx.x; i < BM * (D / 8); i += NT) {
    const int r = i / (D / 8), ch = i % (D / 8);
    cp_async16(Qs + r * LDQ + ch * 8, qbase + (i64)s_tok[r] * q_st + ch * 8, true);
  }
  auto load_kv = [&](int st, int kb) {
    elem_t* ks = Ks + st * BN * LDQ;
    elem_t* vs = Vs + st * BN * LDQ;
    for (int i = threadIdx.x; i < BN * (D / 8); i += NT) {
      const int r = i / (D / 8), ch = i % (D / 8);
      const int s = kb * BN + r;
      const bool ok = s < S;
      cp_async16(ks + r * LDQ + ch * 8, ok ? kbase + (i64)s * k_ss + ch * 8 : kbase, ok);
      cp_async16(vs + r * LDQ + ch * 8, ok ? vbase + (i64)s * v_ss + ch * 8 : vbase, ok);
    }
    for (int r = threadIdx.x; r < BN; r += NT) {
      const int s = kb * BN + r;
      s_valid[st * BN + r] = (s < S) && (!has_key_valid || key_valid[b * kv_sb + s] != 0);
    }
  };

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r_lo = warp * 16 + (lane >> 2), r_hi = r_lo + 8;
  const int slot_lo = q_offset + s_tok[r_lo], slot_hi = q_offset + s_tok[r_hi];
  const int warp_first = q_offset + s_tok[warp * 16], warp_last = q_offset + s_tok[warp * 16 + 15];

  unsigned qf[D / 16][4];
  float o[DF][4];
#pragma unroll
  for (int i = 0; i < DF; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[i][e] = 0.f;
  float m_lo = neg_inf(), m_hi = neg_inf(), l_lo = 0.f, l_hi = 0.f;

  if (kb_begin < kb_end) load_kv(0, kb_begin);
  cp_async_commit();  // group: Q + first key block

  for (int kb = kb_begin; kb < kb_end; ++kb) {
    const int st = (kb - kb_begin) & 1;
    if (kb + 1 < kb_end) load_kv(st ^ 1, kb + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (kb == kb_begin) {
#pragma unroll
      for (int kd = 0; kd < D / 16; ++kd) {
        const elem_t* p = Qs + (warp * 16 + (lane & 15)) * LDQ + kd * 16 + (lane >> 4) * 8;
        ldmatrix_x4(qf[kd][0], qf[kd][1], qf[kd][2], qf[kd][3], p);
      }
    }
    // Warp-level skipping of key blocks wholly in the future of (or before the window of) all
    // 16 rows of this warp. Warp-uniform; the barriers below are still reached by everyone.
    const bool live = kb * BN <= warp_last && (window <= 0 || (kb + 1) * BN - 1 > warp_first - window);
    if (live) {
      const elem_t* ks = Ks + st * BN * LDQ;
      const elem_t* vs = Vs + st * BN * LDQ;
      const u8* valid = s_valid + st * BN;
      float sc[NF][4];
#pragma unroll
      for (int i = 0; i < NF; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[i][e] = 0.f;
#pragma unroll
      for (int kd = 0; kd < D / 16; ++kd) {
#pragma unroll
        for (int np = 0; np < NF / 2; ++np) {
          unsigned b0, b1, b2, b3;
          const elem_t* p = ks + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDQ + kd * 16 + ((lane >> 3) & 1) * 8;
          ldmatrix_x4(b0, b1, b2, b3, p);
          mma16816(sc[2 * np], qf[kd][0], qf[kd][1], qf[kd][2], qf[kd][3], b0, b1);
          mma16816(sc[2 * np + 1], qf[kd][0], qf[kd][1], qf[kd][2], qf[kd][3], b2, b3);
        }
      }
      // visibility, scale (log2 domain), running max
      float mx_lo = neg_inf(), mx_hi = neg_inf();
#pragma unroll
      for (int nf = 0; nf < NF; ++nf) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = nf * 8 + (lane & 3) * 2 + (e & 1);
          const int ks_slot = kb * BN + col;
          const int qs = e < 2 ? slot_lo : slot_hi;
          const bool vis = ks_slot <= qs && valid[col] && (window <= 0 || qs - ks_slot < window);
          const float x = vis ? sc[nf][e] * scale_log2 : neg_inf();
          sc[nf][e] = x;
          if (e < 2) mx_lo = fmaxf(mx_lo, x);
          else mx_hi = fmaxf(mx_hi, x);
        }
      }
#pragma unroll
      for (int off = 1; off <= 2; off <<= 1) {
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, off));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, off));
      }
      const float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);
      const float use_lo = mn_lo == neg_inf() ? 0.f : mn_lo;  // no visible key yet: keep exp2 finite
      const float use_hi = mn_hi == neg_inf() ? 0.f : mn_hi;
      const float a_lo = exp2f(m_lo - use_lo), a_hi = exp2f(m_hi - use_hi);
      m_lo = mn_lo;
      m_hi = mn_hi;
      float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
      for (int nf = 0; nf < NF; ++nf) {
        sc[nf][0] = exp2f(sc[nf][0] - use_lo);
        sc[nf][1] = exp2f(sc[nf][1] - use_lo);
        sc[nf][2] = exp2f(sc[nf][2] - use_hi);
        sc[nf][3] = exp2f(sc[nf][3] - use_hi);
        sum_lo += sc[nf][0] + sc[nf][1];
        sum_hi += sc[nf][2] + sc[nf][3];
      }
      l_lo = l_lo * a_lo + sum_lo;
      l_hi = l_hi * a_hi + sum_hi;
#pragma unroll
      for (int df = 0; df < DF; ++df) {
        o[df][0] *= a_lo;
        o[df][1] *= a_lo;
        o[df][2] *= a_hi;
        o[df][3] *= a_hi;
      }
      // O += P V: the score accumulators are re-used as A fragments (16 rows x 16 keys).
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        const unsigned a0 = pack2(sc[2 * kk][0], sc[2 * kk][1]);
        const unsigned a1 = pack2(sc[2 * kk][2], sc[2 * kk][3]);
        const unsigned a2 = pack2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
        const unsigned a3 = pack2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          unsigned b0, b1, b2, b3;
          const elem_t* p = vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDQ + dp * 16 + (lane >> 4) * 8;
          ldmatrix_x4_trans(b0, b1, b2, b3, p);
          mma16816(o[2 * dp], a0, a1, a2, a3, b0, b1);
          mma16816(o[2 * dp + 1], a0, a1, a2, a3, b2, b3);
        }
      }
    }
    __syncthreads();  // this stage is overwritten by the load issued next iteration
  }
  cp_async_wait<0>();

#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, off);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, off);
  }
  const float inv_lo = l_lo > 0.f ? 1.f / l_lo : 0.f;  // no visible key -> zeros
  const float inv_hi = l_hi > 0.f ? 1.f / l_hi : 0.f;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = hh ? r_hi : r_lo;
    const int pos = m0 + r;
    if (pos >= T) continue;
    const bool active = pos < c;
    if (!active && !zero_skipped) continue;
    const int tok = active ? s_tok[r] : ord[pos];
    elem_t* orow = out + b * o_sb + (i64)tok * o_st + h * o_sh;
    const float inv = hh ? inv_hi : inv_lo;
#pragma unroll
    for (int df = 0; df < DF; ++df) {
      const int d = df * 8 + (lane & 3) * 2;
      const float v0 = active ? o[df][2 * hh] * inv : 0.f;
      const float v1 = active ? o[df][2 * hh + 1] * inv : 0.f;
      store2(orow + d, v0, v1);
    }
  }
}
