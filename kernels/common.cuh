// wide: shared device helpers for the routed kernels (DESIGN.md §3).
//
// Header-free on purpose: NVRTC from the `nvidia-cuda-nvrtc` wheel ships no CUDA headers
// (no cuda_fp16.h / cuda_bf16.h), so 16-bit floats are raw `unsigned short` bits and every
// conversion / matrix instruction is inline PTX. Everything here exists on sm_80 and sm_90.
//
// The element type is chosen per compile by one define: -DWIDE_BF16 or -DWIDE_FP16.
// The Python loader pastes this file in place of `#include "common.cuh"`, so CuPy's
// on-disk cache key (the full source text + options) covers it.
#ifndef WIDE_COMMON_CUH
#define WIDE_COMMON_CUH

#if !defined(WIDE_BF16) && !defined(WIDE_FP16)
#error "define WIDE_BF16 or WIDE_FP16"
#endif

typedef unsigned short elem_t;  // raw bf16 / fp16 bits
typedef unsigned char u8;
typedef long long i64;

#define WIDE_DEVICE __device__ __forceinline__

WIDE_DEVICE float neg_inf() { return __int_as_float(0xff800000); }

// ---- scalar / packed conversions (fp32 <-> 16-bit) ----------------------------------------

WIDE_DEVICE float to_float(elem_t x) {
#ifdef WIDE_BF16
  return __uint_as_float(((unsigned)x) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
#endif
}

WIDE_DEVICE elem_t from_float(float f) {
  elem_t h;
#ifdef WIDE_BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
  return h;
}

// Two floats -> one 32-bit register holding (lo, hi) as 16-bit values; `lo` is the element at
// the lower address. PTX packs its *first* source into the upper half, hence (hi, lo).
WIDE_DEVICE unsigned pack2(float lo, float hi) {
  unsigned r;
#ifdef WIDE_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}

WIDE_DEVICE float lo_float(unsigned u) { return to_float((elem_t)(u & 0xffffu)); }
WIDE_DEVICE float hi_float(unsigned u) { return to_float((elem_t)(u >> 16)); }

// 16 bytes = 8 elements -> 8 floats.
WIDE_DEVICE void unpack8(const uint4& v, float* f) {
  f[0] = lo_float(v.x); f[1] = hi_float(v.x);
  f[2] = lo_float(v.y); f[3] = hi_float(v.y);
  f[4] = lo_float(v.z); f[5] = hi_float(v.z);
  f[6] = lo_float(v.w); f[7] = hi_float(v.w);
}

WIDE_DEVICE float dot8(const uint4& a, const uint4& b) {
  float fa[8], fb[8];
  unpack8(a, fa);
  unpack8(b, fb);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s = fmaf(fa[i], fb[i], s);
  return s;
}

WIDE_DEVICE float silu(float x) { return x / (1.f + __expf(-x)); }

// ---- warp helpers ------------------------------------------------------------------------

WIDE_DEVICE float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

WIDE_DEVICE float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ---- shared memory, async copies, ldmatrix, mma ------------------------------------------

WIDE_DEVICE unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// 16-byte global->shared copy; when !pred nothing is read and the 16 bytes are zero-filled
// (src-size 0). `gmem` must still be a valid-looking address: callers pass the tensor base.
WIDE_DEVICE void cp_async16(void* smem, const void* gmem, bool pred) {
  int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(n)
               : "memory");
}
WIDE_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
WIDE_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

WIDE_DEVICE void ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_addr(p))
               : "memory");
}

WIDE_DEVICE void ldmatrix_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_addr(p))
               : "memory");
}

// D = A(16x16, row) * B(16x8, col) + D, fp32 accumulate. Fragment layouts (lane = 4*gid + tig):
//   a0:(gid, 2tig..+1) a1:(gid+8, 2tig..) a2:(gid, 2tig+8..) a3:(gid+8, 2tig+8..)
//   b0:(k=2tig..+1, n=gid) b1:(k=2tig+8.., n=gid)
//   c0,c1:(gid, 2tig..+1) c2,c3:(gid+8, 2tig..+1)
WIDE_DEVICE void mma16816(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                          unsigned b1) {
#ifdef WIDE_BF16
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// 32-bit store of two adjacent output elements (column must be even, row start 4-byte aligned).
WIDE_DEVICE void store2(elem_t* p, float lo, float hi) { *reinterpret_cast<unsigned*>(p) = pack2(lo, hi); }

#endif  // WIDE_COMMON_CUH
