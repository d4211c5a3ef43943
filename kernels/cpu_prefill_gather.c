/* Routed prefill in bf16 (bf16 x bf16 -> fp32) on Intel AMX tiles or AVX512-BF16 dot products:
 * part of the native library, included by cpu_decode.c (one translation unit: it runs on the same
 * thread pool, WCtx, and split()).
 *
 * Why: with bf16 matrix hardware PyTorch's oneDNN runs a dense bf16 GEMM near peak (about 490 G
 * multiply-adds/s on one Sapphire Rapids core with AMX, about 100 G on one Zen 4 core with
 * vdpbf16ps; SmolLM2-135M FFN shapes), and the cpu backend's routed path, one PyTorch GEMM per
 * group plus gathers, scatters and SwiGLU ops between them, ran slower than dense at half the
 * groups skipped (0.61x on AMX). Here a routed module is one call: per group, the tokens that
 * execute it are gathered 32 at a time into a tile-shaped buffer, multiplied with the group's
 * weights (packed once at load), and their outputs written or scatter-added; the FFN keeps a
 * block's intermediate activations in L1 between its gate/up and down products. Cost follows the
 * executed (token, group) pairs, up to 31 padding rows per group on the tiles (7 on vdpbf16ps).
 *
 * Two ISAs run the same jobs (the `isa` argument, ISA_AMX or ISA_VDP): the tiles (amx_block,
 * amx_down_block) or vdpbf16ps (vdp_block, vdp_down_block, below them); only the block products
 * differ.
 *
 * Tile use: every tile is 16 rows x 64 bytes. Tiles 0-3 accumulate a 32 x 32 fp32 output block
 * (2 x 2 tiles of 16 x 16), tiles 4-5 hold 32 token rows of 32 reduction channels (bf16), tiles 6-7
 * two 16-column weight blocks of the same 32 channels in the VNNI pair layout TDPBF16PS reads.
 *
 * Packed weights (runtime/cpu_gather.py packs them): for a product y[n] = sum_k x[k] W[n][k],
 * P[nb][kb][kp][c][p] = W[16 nb + c][32 kb + 2 kp + p] (nb < N / 16, kb < K / 32, kp, c < 16,
 * p < 2): one 1 KiB tile per (nb, kb), the tiles of one output block contiguous over kb. Axis-k
 * projections (O, down) are packed per reduction group: group j's [N, gsz] slice is its own P.
 *
 * The tiles require the kernel's permission to use the tile data (arch_prctl ARCH_REQ_XCOMP_PERM,
 * asked for once by wide_amx_ready) and the CPU flags AMX-TILE, AMX-BF16, AVX512-BF16; vdpbf16ps
 * the flag AVX512-BF16 (wide_vdp_ready). The functions carry their target ISA as attributes, so the
 * library builds on any x86-64 compiler with AVX-512 (gcc >= 11, clang >= 12); elsewhere both
 * return 0 and the runtime keeps its other paths.
 */

#if defined(WIDE_AVX512) && defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 11)
#define WIDE_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
#define AMX_ROWS 32 /* token rows of one block (two A tiles) */
enum { ISA_VDP = 1, ISA_AMX = 2, ISA_F32 = 3 }; /* what runs the block products: vdpbf16ps, the tiles, or fp32 FMAs */
#ifndef AMX_CHUNK
#define AMX_CHUNK 100000
#endif

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

AMX_TARGET static void amx_configure(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
    _tile_loadconfig(&cfg);
}

/* exp(x) for fp32 lanes: Cephes' polynomial after the reduction x = n ln 2 + r (relative error
 * about 2e-7 on [-87, 88]; inputs outside are clamped). */
AMX_TARGET static inline __m512 amx_exp(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365478515625f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(y, n);
}

/* 1 / d for d >= 1 (one Newton step after the 14-bit estimate: about 2e-8 relative). */
AMX_TARGET static inline __m512 amx_recip(__m512 d) {
    __m512 r = _mm512_rcp14_ps(d);
    return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
}

/* The FFN's gating act(gate) * up: silu(g) = g / (1 + e^-g); GELU, tanh approximation, written as
 * g * sigmoid(2u) with u = sqrt(2 / pi) (g + 0.044715 g^3) (= 0.5 g (1 + tanh u)). */
AMX_TARGET static inline __m512 amx_gate(__m512 g, __m512 up, int64_t gelu) {
    __m512 z = g;
    if (gelu) {
        __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
        z = _mm512_mul_ps(_mm512_set1_ps(2.f * 0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g3, g));
    }
    __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), amx_exp(_mm512_sub_ps(_mm512_setzero_ps(), z)));
    return _mm512_mul_ps(_mm512_mul_ps(g, amx_recip(den)), up);
}

/* C[32][32] (fp32, row stride 32) = A[32][K] . B-block, where A rows are `lda` elements apart and
 * P0 / P1 are the packed tiles (kb = 0..K/32-1, 1 KiB each) of two 16-column output blocks; with
 * P1 NULL only the first 16 columns are computed (C's other half is left as is). */
AMX_TARGET static void amx_block(const uint16_t *A, int64_t lda, const uint16_t *P0, const uint16_t *P1, int64_t KB,
                                 float *C) {
    _tile_zero(0);
    _tile_zero(2);
    if (P1) {
        _tile_zero(1);
        _tile_zero(3);
    }
    const int64_t sa = lda * 2;
    for (int64_t kb = 0; kb < KB; kb++) {
        _tile_loadd(4, A + kb * 32, sa);
        _tile_loadd(5, A + 16 * lda + kb * 32, sa);
        _tile_loadd(6, P0 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (P1) {
            _tile_loadd(7, P1 + kb * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, C, 128);
    _tile_stored(2, C + 16 * 32, 128);
    if (P1) {
        _tile_stored(1, C + 16, 128);
        _tile_stored(3, C + 16 * 32 + 16, 128);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* The same products on AVX512-BF16 (vdpbf16ps), for CPUs without AMX (AMD Zen 4 and later, Intel
 * Cooper Lake): the packed tile layout is already vdpbf16ps's operand order (one 64-byte row of a
 * packed tile = 16 output columns x one pair of reduction channels), so the jobs above run
 * unchanged and only their block products differ. A block of 8 token rows x 32 columns is held in
 * 16 zmm accumulators; per pair of reduction channels it loads two weight rows, broadcasts each
 * token's pair and issues 16 vdpbf16ps (32 multiply-adds each). Rows past `nrows` (rounded up to
 * 8) are not computed. */

#define VDP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define VDP_MR 8

/* The bf16 pair at p as one 32-bit lane (memcpy: no aliasing of the uint16_t data). */
static inline int32_t vdp_pair(const uint16_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* acc0/acc1[r] += A[r][32 kb + 2 kp + p] x P0/P1 over kb < KB (P1 NULL: acc1 untouched). */
VDP_TARGET static inline __attribute__((always_inline)) void vdp_rows(const uint16_t *A, int64_t lda,
                                                                      const uint16_t *P0, const uint16_t *P1,
                                                                      int64_t KB, __m512 *acc0, __m512 *acc1) {
    for (int64_t kb = 0; kb < KB; kb++) {
        const uint16_t *a = A + kb * 32, *p0 = P0 + kb * 512, *p1 = P1 ? P1 + kb * 512 : NULL;
        if (p1) {
            for (int64_t kp = 0; kp < 16; kp++) {
                const __m512bh w0 = (__m512bh)_mm512_loadu_si512(p0 + kp * 32);
                const __m512bh w1 = (__m512bh)_mm512_loadu_si512(p1 + kp * 32);
#pragma GCC unroll 8
                for (int r = 0; r < VDP_MR; r++) {
                    const __m512bh x = (__m512bh)_mm512_set1_epi32(vdp_pair(a + r * lda + 2 * kp));
                    acc0[r] = _mm512_dpbf16_ps(acc0[r], x, w0);
                    acc1[r] = _mm512_dpbf16_ps(acc1[r], x, w1);
                }
            }
        } else {
            for (int64_t kp = 0; kp < 16; kp++) {
                const __m512bh w0 = (__m512bh)_mm512_loadu_si512(p0 + kp * 32);
#pragma GCC unroll 8
                for (int r = 0; r < VDP_MR; r++) {
                    const __m512bh x = (__m512bh)_mm512_set1_epi32(vdp_pair(a + r * lda + 2 * kp));
                    acc0[r] = _mm512_dpbf16_ps(acc0[r], x, w0);
                }
            }
        }
    }
}

/* The fp32 products (ISA_F32: AVX-512 FMA, any AVX-512 CPU) on fp32 weights packed in 1 KiB
 * tiles of 16 columns x 16 reduction channels, P[nb][kb][k][c] = W[16 nb + c][16 kb + k], and fp32
 * activations: the jobs count activations and tiles in 16-bit units, so an fp32 row of K values
 * is 2 K units and a tile 32 of them, as for bf16. Per reduction channel: two weight rows, each
 * token's value broadcast, 16 FMAs (16 multiply-adds each). */
VDP_TARGET static inline __attribute__((always_inline)) void fma_rows(const float *A, int64_t lda, const float *P0,
                                                                      const float *P1, int64_t KB, __m512 *acc0,
                                                                      __m512 *acc1) {
    for (int64_t kb = 0; kb < KB; kb++) {
        const float *a = A + kb * 16, *p0 = P0 + kb * 256, *p1 = P1 ? P1 + kb * 256 : NULL;
        for (int64_t k = 0; k < 16; k++) {
            const __m512 w0 = _mm512_loadu_ps(p0 + k * 16);
            if (p1) {
                const __m512 w1 = _mm512_loadu_ps(p1 + k * 16);
#pragma GCC unroll 8
                for (int r = 0; r < VDP_MR; r++) {
                    const __m512 x = _mm512_set1_ps(a[r * lda + k]);
                    acc0[r] = _mm512_fmadd_ps(x, w0, acc0[r]);
                    acc1[r] = _mm512_fmadd_ps(x, w1, acc1[r]);
                }
            } else {
#pragma GCC unroll 8
                for (int r = 0; r < VDP_MR; r++) acc0[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r * lda + k]), w0, acc0[r]);
            }
        }
    }
}

/* amx_block on vdpbf16ps (f32 = 0) or fp32 FMAs (f32 = 1; A then fp32 rows lda values apart, KB
 * tiles of 16 channels): C[r][0..32) (row stride ldc) = A[r] . [P0 | P1] for r < nrows rounded up
 * to VDP_MR (A must hold those rows); with P1 NULL only columns 0..16 are written. */
VDP_TARGET static void vdp_block(int f32, const uint16_t *A, int64_t lda, const uint16_t *P0, const uint16_t *P1,
                                 int64_t KB, float *C, int64_t ldc, int64_t nrows) {
    for (int64_t r0 = 0; r0 < nrows; r0 += VDP_MR) {
        __m512 acc0[VDP_MR], acc1[VDP_MR];
        for (int r = 0; r < VDP_MR; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
        if (f32) fma_rows((const float *)A + r0 * lda, lda, (const float *)P0, (const float *)P1, KB, acc0, acc1);
        else vdp_rows(A + r0 * lda, lda, P0, P1, KB, acc0, acc1);
        for (int r = 0; r < VDP_MR; r++) {
            _mm512_storeu_ps(C + (r0 + r) * ldc, acc0[r]);
            if (P1) _mm512_storeu_ps(C + (r0 + r) * ldc + 16, acc1[r]);
        }
    }
}

/* amx_down_block on vdpbf16ps or fp32 FMAs (f32 as vdp_block; H in elements of that dtype, ldh
 * of them per row; rows < nrows rounded up to VDP_MR). */
VDP_TARGET static void vdp_down_block(int f32, const uint16_t *H, int64_t ldh, const uint16_t *Pd, int64_t D,
                                      int64_t g, const int64_t *live, int64_t nl, int64_t c, int two, float *C,
                                      int64_t ldc, int64_t nrows) {
    const int64_t HB = g / (f32 ? 16 : 32), per = (D / 16) * HB * 512;
    for (int64_t r0 = 0; r0 < nrows; r0 += VDP_MR) {
        __m512 acc0[VDP_MR], acc1[VDP_MR];
        for (int r = 0; r < VDP_MR; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < nl; i++) {
            const uint16_t *P0 = Pd + live[i] * per + (c / 16) * HB * 512, *P1 = two ? P0 + HB * 512 : NULL;
            if (f32) fma_rows((const float *)H + r0 * ldh + live[i] * g, ldh, (const float *)P0, (const float *)P1, HB, acc0, acc1);
            else vdp_rows(H + r0 * ldh + live[i] * g, ldh, P0, P1, HB, acc0, acc1);
        }
        for (int r = 0; r < VDP_MR; r++) {
            _mm512_storeu_ps(C + (r0 + r) * ldc, acc0[r]);
            if (two) _mm512_storeu_ps(C + (r0 + r) * ldc + 16, acc1[r]);
        }
    }
}

/* One block product of the jobs on their ISA: C (row stride ldc) = A . [P0 | P1], A in 16-bit
 * units (lda of them per row), KB tiles. */
AMX_TARGET static inline void job_block(int64_t isa, const uint16_t *A, int64_t lda, const uint16_t *P0,
                                        const uint16_t *P1, int64_t KB, float *C, int64_t ldc, int64_t nrows) {
    if (isa == ISA_AMX) amx_block(A, lda, P0, P1, KB, C); /* ldc is 32 there */
    else vdp_block(isa == ISA_F32, A, isa == ISA_F32 ? lda / 2 : lda, P0, P1, KB, C, ldc, nrows);
}

AMX_TARGET static void amx_down_block(const uint16_t *H, int64_t ldh, const uint16_t *Pd, int64_t D, int64_t g,
                                      const int64_t *live, int64_t nl, int64_t c, int two, float *C, int64_t ldc);

/* The FFN's down product of one block on the jobs' ISA (H in elements of the ISA's dtype, ldh of
 * them per row). */
AMX_TARGET static inline void job_down_block(int64_t isa, const uint16_t *H, int64_t ldh, const uint16_t *Pd,
                                             int64_t D, int64_t g, const int64_t *live, int64_t nl, int64_t c, int two,
                                             float *C, int64_t ldc, int64_t nrows) {
    if (isa == ISA_AMX) amx_down_block(H, ldh, Pd, D, g, live, nl, c, two, C, ldc);
    else vdp_down_block(isa == ISA_F32, H, ldh, Pd, D, g, live, nl, c, two, C, ldc, nrows);
}

/* Per-part scratch of the AMX jobs. */
typedef struct {
    uint16_t *a; /* [AMX_ROWS][K] gathered token rows, bf16 */
    uint16_t *h; /* [AMX_ROWS][g] the FFN's gated activations, bf16 */
    int64_t *rows;
} AmxScratch;

static int amx_scratch(AmxScratch *s, int64_t K, int64_t g, int64_t M) {
    s->a = (uint16_t *)aligned_alloc(64, (size_t)((AMX_ROWS * K * 2 + 63) / 64 * 64));
    s->h = (uint16_t *)aligned_alloc(64, (size_t)((AMX_ROWS * (g > 0 ? g : 1) * 2 + 63) / 64 * 64));
    s->rows = (int64_t *)malloc(sizeof(int64_t) * (size_t)(M > 0 ? M : 1));
    return s->a && s->h && s->rows;
}

static void amx_scratch_free(AmxScratch *s) {
    free(s->a);
    free(s->h);
    free(s->rows);
}

/* Gather n <= AMX_ROWS rows (row indices rows[0..n-1]) of width K into dst. The rows past n keep
 * what they held: a product's output row depends on its own input row only, and the outputs of
 * padding rows are never written out. */
static void amx_gather(const uint16_t *X, int64_t ldx, const int64_t *rows, int64_t n, int64_t K, uint16_t *dst) {
    for (int64_t r = 0; r < n; r++) memcpy(dst + r * K, X + rows[r] * ldx, (size_t)K * 2);
}

/* The tokens of [lo, hi) that execute group j (all when mask is NULL), into rows; returns the count. */
static int64_t amx_tokens(const uint8_t *mask, int64_t mstride, int64_t j, int64_t lo, int64_t hi, int64_t *rows) {
    int64_t n = 0;
    for (int64_t t = lo; t < hi; t++)
        if (!mask || mask[t * mstride + j]) rows[n++] = t;
    return n;
}

typedef struct {
    int64_t mode, N, K, G, gsz, M, mstride, ldx, ldo, ofmt, gelu, D;
    const uint16_t *P, *P2; /* proj: P; ffn: gate/up, down */
    const uint16_t *X;
    const uint8_t *mask;
    const float *bias;
    void *out;
    int64_t *macs; /* the FFN: multiply-adds executed, added atomically by every part */
    int err;
    int64_t isa; /* ISA_AMX: the tiles; ISA_VDP: vdpbf16ps */
} AmxJob;

/* Write (mode 0) or scatter-add (mode 1, and the FFN's down product) a 32 x 32 fp32 block C of
 * which `n` token rows are real into out rows rows[0..n-1], columns [c0, c0 + w). */
AMX_TARGET static void amx_emit(const AmxJob *j, const float *C, const int64_t *rows, int64_t n, int64_t c0,
                                int64_t w, int64_t add) {
    const __mmask16 m0 = w >= 16 ? 0xffff : (__mmask16)((1u << w) - 1);
    const __mmask16 m1 = w >= 32 ? 0xffff : w > 16 ? (__mmask16)((1u << (w - 16)) - 1) : 0;
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (j->bias) {
        b0 = _mm512_maskz_loadu_ps(m0, j->bias + c0);
        if (m1) b1 = _mm512_maskz_loadu_ps(m1, j->bias + c0 + 16);
    }
    for (int64_t r = 0; r < n; r++) {
        __m512 v0 = _mm512_add_ps(_mm512_load_ps(C + r * 32), b0), v1 = _mm512_add_ps(_mm512_load_ps(C + r * 32 + 16), b1);
        if (j->ofmt == FMT_F32) {
            float *o = (float *)j->out + rows[r] * j->ldo + c0;
            if (add) {
                v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, o));
                if (m1) v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, o + 16));
            }
            _mm512_mask_storeu_ps(o, m0, v0);
            if (m1) _mm512_mask_storeu_ps(o + 16, m1, v1);
        } else {
            uint16_t *o = (uint16_t *)j->out + rows[r] * j->ldo + c0;
            _mm256_mask_storeu_epi16(o, m0, (__m256i)_mm512_cvtneps_pbh(v0));
            if (m1) _mm256_mask_storeu_epi16(o + 16, m1, (__m256i)_mm512_cvtneps_pbh(v1));
        }
    }
}

/* One routed projection over this part's tokens (see wide_gather_proj). */
AMX_TARGET static void amx_proj_job(void *arg, int64_t part, int64_t parts) {
    AmxJob *j = (AmxJob *)arg;
    int64_t lo, hi;
    split(j->M, part, parts, 1, &lo, &hi);
    if (lo >= hi) return;
    const int64_t es = j->isa == ISA_F32 ? 2 : 1; /* 16-bit units per activation */
    const int64_t kg = (j->mode == 0 ? j->K : j->gsz) * es; /* reduction width of one group's product, units */
    AmxScratch s;
    if (!amx_scratch(&s, kg, 0, hi - lo)) {
        amx_scratch_free(&s);
        j->err = 1;
        return;
    }
    float C[32 * 32] __attribute__((aligned(64)));
    if (j->isa == ISA_AMX) amx_configure();
    const int64_t KB = kg / 32;
    for (int64_t g = 0; g < j->G; g++) {
        const int64_t n = amx_tokens(j->mask, j->mstride, g, lo, hi, s.rows);
        /* mode 0: the group's output rows [g gsz, (g + 1) gsz) of P; mode 1: its own P of N rows */
        const int64_t ncols = j->mode == 0 ? j->gsz : j->N, c00 = j->mode == 0 ? g * j->gsz : 0;
        const uint16_t *Pg = j->mode == 0 ? j->P + (g * j->gsz / 16) * KB * 512 : j->P + g * (j->N / 16) * KB * 512;
        const int64_t a0 = j->mode == 0 ? 0 : g * j->gsz; /* the group's first activation column */
        for (int64_t b = 0; b < n; b += AMX_ROWS) {
            const int64_t nb = n - b < AMX_ROWS ? n - b : AMX_ROWS;
            amx_gather(j->X + a0 * es, j->ldx * es, s.rows + b, nb, kg, s.a);
            for (int64_t c = 0; c < ncols; c += 32) {
                const int64_t w = ncols - c < 32 ? ncols - c : 32;
                const uint16_t *P0 = Pg + (c / 16) * KB * 512;
                job_block(j->isa, s.a, kg, P0, w > 16 ? P0 + KB * 512 : NULL, KB, C, 32, nb);
                amx_emit(j, C, s.rows + b, nb, c00 + c, w, j->mode == 1);
            }
        }
    }
    if (j->isa == ISA_AMX) _tile_release();
    amx_scratch_free(&s);
}

/* The down product of one 32-token block: C[32][32] (row stride ldc floats) = sum over the groups
 * in live[0..nl-1] of H[:, grp g : (grp + 1) g] . down_grp, columns [c, c + 32) (c + 16 only
 * with two = 0); H rows are ldh elements apart. */
AMX_TARGET static void amx_down_block(const uint16_t *H, int64_t ldh, const uint16_t *Pd, int64_t D, int64_t g,
                                      const int64_t *live, int64_t nl, int64_t c, int two, float *C, int64_t ldc) {
    const int64_t HB = g / 32, sa = ldh * 2, per = (D / 16) * HB * 512;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t i = 0; i < nl; i++) {
        const int64_t grp = live[i];
        const uint16_t *A = H + grp * g, *P0 = Pd + grp * per + (c / 16) * HB * 512;
        for (int64_t kb = 0; kb < HB; kb++) {
            _tile_loadd(4, A + kb * 32, sa);
            _tile_loadd(5, A + 16 * ldh + kb * 32, sa);
            _tile_loadd(6, P0 + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (two) {
                _tile_loadd(7, P0 + HB * 512 + kb * 512, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
    }
    _tile_stored(0, C, ldc * 4);
    _tile_stored(2, C + 16 * ldc, ldc * 4);
    if (two) {
        _tile_stored(1, C + 16, ldc * 4);
        _tile_stored(3, C + 16 * ldc + 16, ldc * 4);
    }
}

#define AMX_WIN 256 /* tokens whose gated activations [AMX_WIN][G g] bf16 sit in L2 between the products */

/* Per (token, rank) key of the down product's token order: a window's tokens sorted so that those
 * skipping the same groups sit in the same rows of H, ranked by how many of the window's tokens
 * skip each group (the most-skipped group decides first). Measured on SmolLM2-135M prefill of
 * 1,024 WikiText-2 tokens: the down product's live (token, group) pairs in rows of 8 fell from
 * 0.99 to 0.93 of the pairs on the demo export (0.89 executed) and from 0.57 to 0.42 on a cost-0.5
 * export (0.37 executed). */
typedef struct {
    uint64_t key;
    int64_t t;
} FfnOrder;

static int ffn_order_cmp(const void *a, const void *b) {
    const FfnOrder *x = (const FfnOrder *)a, *y = (const FfnOrder *)b;
    if (x->key != y->key) return x->key > y->key ? -1 : 1;
    return x->t < y->t ? -1 : x->t > y->t;
}

/* The window [w0, w0 + nw)'s down-product order: perm[p] = the token (offset from w0) at row p of
 * H, pos its inverse. Returns 0 (and leaves both unset) where every token executes every group,
 * or there is no mask: rows then follow the tokens. */
static int ffn_window_order(const uint8_t *mask, int64_t mstride, int64_t G, int64_t w0, int64_t nw, int64_t *cnt,
                            int64_t *rank, FfnOrder *ord, int64_t *perm, int64_t *pos) {
    if (!mask) return 0;
    int64_t skipped = 0;
    for (int64_t grp = 0; grp < G; grp++) cnt[grp] = 0;
    for (int64_t t = 0; t < nw; t++)
        for (int64_t grp = 0; grp < G; grp++) cnt[grp] += !mask[(w0 + t) * mstride + grp];
    for (int64_t grp = 0; grp < G; grp++) skipped += cnt[grp];
    if (!skipped) return 0;
    /* rank[grp]: the group's place by skip count (0 = most skipped); only the first 64 enter the key */
    for (int64_t grp = 0; grp < G; grp++) {
        int64_t r = 0;
        for (int64_t o = 0; o < G; o++) r += cnt[o] > cnt[grp] || (cnt[o] == cnt[grp] && o < grp);
        rank[grp] = r;
    }
    for (int64_t t = 0; t < nw; t++) {
        uint64_t key = 0;
        for (int64_t grp = 0; grp < G; grp++)
            if (rank[grp] < 64 && !mask[(w0 + t) * mstride + grp]) key |= (uint64_t)1 << (63 - rank[grp]);
        ord[t].key = key, ord[t].t = t;
    }
    qsort(ord, (size_t)nw, sizeof(FfnOrder), ffn_order_cmp);
    for (int64_t p = 0; p < nw; p++) perm[p] = ord[p].t, pos[ord[p].t] = p;
    return 1;
}

/* The routed gated FFN over this part's tokens (see wide_gather_ffn), a window of AMX_WIN tokens at a
 * time. Gate/up: per group, the window's tokens that execute it, gathered 32 at a time; their gated
 * activations go to the window's rows of H (a token's skipped groups hold zeros). Down: per block
 * of LB rows of H (32 on the tiles, VDP_MR = 8 on vdpbf16ps and fp32 FMAs), one accumulation over
 * the groups that any token of the block executes. Where a token skips a group, H's rows are the
 * window's tokens sorted by the groups they skip (ffn_window_order), so that a block's tokens
 * share their skipped groups, and the products are copied to their tokens' output rows; else
 * rows follow the tokens and full blocks are stored straight into the output. The down product
 * therefore multiplies the zeros of a block's skipped pairs in its live groups: a gathered down
 * product reaches K = g per output tile (4 tile products per store at g = 128, and a scatter-add
 * of every output row per group), and measured at a third of the tile rate, slower than the
 * dense-over-live-groups form down to about a quarter of the pairs executed. */
AMX_TARGET static void amx_ffn_job(void *arg, int64_t part, int64_t parts) {
    AmxJob *j = (AmxJob *)arg;
    int64_t lo, hi;
    split(j->M, part, parts, 1, &lo, &hi);
    if (lo >= hi) return;
    const int64_t es = j->isa == ISA_F32 ? 2 : 1; /* 16-bit units per activation */
    const int64_t D = j->D, g = j->gsz, G = j->G, F = G * g, KB = D * es / 32;
    const int64_t LB = j->isa == ISA_AMX ? 32 : VDP_MR; /* rows of H per live-group list */
    AmxScratch s;
    int ok = amx_scratch(&s, D * es, 0, AMX_WIN);
    uint16_t *H = (uint16_t *)aligned_alloc(64, (size_t)AMX_WIN * F * 2 * es); /* gated activations, bf16 or fp32 */
    uint8_t *live = (uint8_t *)malloc((size_t)(AMX_WIN / VDP_MR) * G);
    int64_t *lg = (int64_t *)malloc(sizeof(int64_t) * (size_t)G * (32 / VDP_MR + 2));
    int64_t *perm = (int64_t *)malloc(sizeof(int64_t) * AMX_WIN * 2);
    FfnOrder *ord = (FfnOrder *)malloc(sizeof(FfnOrder) * AMX_WIN);
    if (!ok || !H || !live || !lg || !perm || !ord) {
        amx_scratch_free(&s);
        free(H), free(live), free(lg), free(perm), free(ord);
        j->err = 1;
        return;
    }
    int64_t *pos = perm + AMX_WIN;
    float C[32 * 32] __attribute__((aligned(64)));
    float *out = (float *)j->out;
    int64_t macs = 0;
    if (j->isa == ISA_AMX) amx_configure();
    for (int64_t w0 = lo; w0 < hi; w0 += AMX_WIN) {
        const int64_t w1 = w0 + AMX_WIN < hi ? w0 + AMX_WIN : hi, nw = w1 - w0, nblk = (nw + LB - 1) / LB;
        const int sorted = ffn_window_order(j->mask, j->mstride, G, w0, nw, lg, lg + G, ord, perm, pos); /* lg as scratch */
#define ROW_OF(t) (sorted ? pos[(t) - w0] : (t) - w0) /* the row of H of window token t */
        memset(live, 0, (size_t)nblk * G);
        for (int64_t grp = 0; grp < G; grp++) {
            const int64_t n = amx_tokens(j->mask, j->mstride, grp, w0, w1, s.rows);
            if (n == 0) continue;
            const uint16_t *Pgu = j->P + grp * (2 * g / 16) * KB * 512; /* gate rows then up rows */
            macs += n * 2 * g * D;
            if (n < nw) { /* zeros for the skipped pairs of the blocks that run this group */
                for (int64_t i = 0; i < n; i++) live[ROW_OF(s.rows[i]) / LB * G + grp] = 1;
                for (int64_t t = w0, i = 0; t < w1; t++) {
                    if (i < n && s.rows[i] == t) {
                        i++;
                        continue;
                    }
                    const int64_t r = ROW_OF(t);
                    if (live[r / LB * G + grp]) memset(H + (r * F + grp * g) * es, 0, (size_t)(g * 2 * es));
                }
            } else {
                for (int64_t b = 0; b < nblk; b++) live[b * G + grp] = 1;
            }
            for (int64_t b = 0; b < n; b += AMX_ROWS) {
                const int64_t nb = n - b < AMX_ROWS ? n - b : AMX_ROWS;
                amx_gather(j->X, j->ldx * es, s.rows + b, nb, D * es, s.a);
                for (int64_t c = 0; c < g; c += 16) { /* 16 channels: gate and up side by side in C */
                    const uint16_t *Pg = Pgu + (c / 16) * KB * 512, *Pu = Pgu + ((g + c) / 16) * KB * 512;
                    job_block(j->isa, s.a, D * es, Pg, Pu, KB, C, 32, nb);
                    for (int64_t r = 0; r < nb; r++) {
                        __m512 h = amx_gate(_mm512_load_ps(C + r * 32), _mm512_load_ps(C + r * 32 + 16), j->gelu);
                        const int64_t at = ROW_OF(s.rows[b + r]) * F + grp * g + c;
                        if (es == 2) _mm512_storeu_ps((float *)H + at, h); /* fp32: no rounding between the products */
                        else _mm256_storeu_si256((__m256i *)(H + at), (__m256i)_mm512_cvtneps_pbh(h));
                    }
                }
            }
        }
#undef ROW_OF
        /* 32 rows of H at a time: each column block's weights are read once for the 32 rows'
         * LB-row blocks, each with its own live groups (lists at lg + sb G) */
        for (int64_t r0 = 0; r0 < nw; r0 += 32) {
            const int64_t nb32 = nw - r0 < 32 ? nw - r0 : 32, nsub = (nb32 + LB - 1) / LB;
            int64_t nls[32 / VDP_MR];
            for (int64_t sb = 0; sb < nsub; sb++) {
                const int64_t b = r0 / LB + sb, nr = nb32 - sb * LB < LB ? nb32 - sb * LB : LB;
                int64_t *l = lg + sb * G, nl = 0;
                for (int64_t grp = 0; grp < G; grp++)
                    if (live[b * G + grp]) l[nl++] = grp;
                nls[sb] = nl;
                macs += nr * nl * g * D;
            }
            for (int64_t c = 0; c < D; c += 32) {
                const int two = D - c > 16;
                for (int64_t sb = 0; sb < nsub; sb++) {
                    const int64_t p0 = r0 + sb * LB, nr = nb32 - sb * LB < LB ? nb32 - sb * LB : LB;
                    const uint16_t *Hb = H + p0 * F * es;
                    if (!sorted && nr == LB) { /* rows follow the tokens: straight to the output rows */
                        job_down_block(j->isa, Hb, F, j->P2, D, g, lg + sb * G, nls[sb], c, two, out + (w0 + p0) * D + c,
                                       D, LB);
                    } else {
                        job_down_block(j->isa, Hb, F, j->P2, D, g, lg + sb * G, nls[sb], c, two, C, 32, nr);
                        for (int64_t r = 0; r < nr; r++) {
                            const int64_t t = w0 + (sorted ? perm[p0 + r] : p0 + r);
                            memcpy(out + t * D + c, C + r * 32, (size_t)(two ? 32 : 16) * 4);
                        }
                    }
                }
            }
        }
    }
    if (j->isa == ISA_AMX) _tile_release();
    amx_scratch_free(&s);
    free(H), free(live), free(lg), free(perm), free(ord);
    __atomic_fetch_add(j->macs, macs, __ATOMIC_RELAXED);
}

/* ------------------------------------------------------------------------------------------ */
/* Routed causal attention of prefill: per (row, query head), the query tokens that execute the
 * head, 32 at a time, against the keys each may see; flash-style (online softmax over blocks of 32
 * keys), Q K^T and P V on the tiles, the softmax in fp32 lanes. */

typedef struct {
    int64_t B, T, H, Hkv, d, S, Sp, q_offset, window, ldq, kb, ks, kh, lkv;
    float scale;
    const uint16_t *q, *k, *v;
    const uint8_t *key_valid, *hmask;
    uint16_t *kp, *vp; /* per (row, KV head): K packed by 16 keys x 32 dims, V by 32 keys x 16 dims */
    uint16_t *out;
    int64_t nitems;
    const int64_t *items; /* [nitems][3]: row, head, first index into that (row, head)'s token list */
    const int64_t *tok;   /* per (row, head) its executing tokens, at tok_off[b H + h] */
    const int64_t *tok_off;
    int64_t *pairs;       /* (query, key) pairs computed, added atomically */
    int err;
    int64_t isa;
} AmxAttnJob;

/* Pack the keys [0, S) of (row b, KV head h): kp tile (key block kb, dim chunk dc) [kp][n][p] =
 * K[16 kb + n][32 dc + 2 kp + p]; vp tile (key chunk kc, dim block db) [kp][n][p] =
 * V[32 kc + 2 kp + p][16 db + n]; keys from S to Sp (a multiple of 32) are zeros. */
static void amx_attn_pack_job(void *arg, int64_t part, int64_t parts) {
    AmxAttnJob *j = (AmxAttnJob *)arg;
    const int64_t d = j->d, Sp = j->Sp, DC = d / 32, DB = d / 16;
    for (int64_t bh = part; bh < j->B * j->Hkv; bh += parts) {
        const int64_t b = bh / j->Hkv, h = bh % j->Hkv;
        const uint16_t *K = j->k + b * j->kb + h * j->kh, *V = j->v + b * j->kb + h * j->kh;
        uint32_t *kp = (uint32_t *)(j->kp + bh * j->lkv); /* a tile is 256 dwords (bf16 pairs) */
        uint16_t *vp = j->vp + bh * j->lkv;
        for (int64_t k0 = 0; k0 < Sp; k0 += 16) /* K: tile[kp][n] = the pair (2 kp, 2 kp + 1) of key k0 + n */
            for (int64_t n = 0; n < 16; n++) {
                const int64_t key = k0 + n;
                for (int64_t dc = 0; dc < DC; dc++) {
                    uint32_t *tile = kp + ((k0 / 16) * DC + dc) * 256;
                    if (key < j->S) {
                        const uint32_t *kr = (const uint32_t *)(K + key * j->ks + dc * 32);
                        for (int64_t pr = 0; pr < 16; pr++) tile[pr * 16 + n] = kr[pr];
                    } else {
                        for (int64_t pr = 0; pr < 16; pr++) tile[pr * 16 + n] = 0;
                    }
                }
            }
        for (int64_t k0 = 0; k0 < Sp; k0 += 2) /* V: tile[kp][n][p] = V[32 kc + 2 kp + p][16 db + n] */
            for (int64_t db = 0; db < DB; db++) {
                uint16_t *tile = vp + ((k0 / 32) * DB + db) * 512 + ((k0 % 32) / 2) * 32;
                const uint16_t *v0 = V + k0 * j->ks + db * 16, *v1 = v0 + j->ks;
                for (int64_t n = 0; n < 16; n++) {
                    tile[2 * n] = k0 < j->S ? v0[n] : 0;
                    tile[2 * n + 1] = k0 + 1 < j->S ? v1[n] : 0;
                }
            }
    }
}

/* Bits c of the keys k0 + c with lo <= key < hi (c < 32). */
static inline uint32_t key_range_bits(int64_t k0, int64_t lo, int64_t hi) {
    int64_t a = lo - k0, b = hi - k0;
    a = a < 0 ? 0 : a > 32 ? 32 : a;
    b = b < 0 ? 0 : b > 32 ? 32 : b;
    if (b <= a) return 0;
    const uint64_t m = ((b == 32 ? 0xffffffffull : ((1ull << b) - 1)) >> a) << a;
    return (uint32_t)m;
}

AMX_TARGET static void amx_attn_job(void *arg, int64_t part, int64_t parts) {
    AmxAttnJob *j = (AmxAttnJob *)arg;
    const int64_t d = j->d, DC = d / 32, DB = d / 16, hpk = j->H / j->Hkv;
    uint16_t qa[32 * 256] __attribute__((aligned(64)));  /* gathered queries [32][d] */
    uint16_t pa[32 * 32] __attribute__((aligned(64)));   /* probabilities [32][32 keys] bf16 */
    float sc[32 * 32] __attribute__((aligned(64)));      /* scores */
    float pv[32 * 32] __attribute__((aligned(64)));
    float o[32 * 256] __attribute__((aligned(64)));      /* output accumulator [32][d] */
    float mx[32], l[32];
    int64_t pos[32], pairs = 0;
    if (j->isa == ISA_AMX) amx_configure();
    for (int64_t it = part; it < j->nitems; it += parts) {
        const int64_t b = j->items[it * 3], h = j->items[it * 3 + 1], i0 = j->items[it * 3 + 2];
        const int64_t *tok = j->tok + j->tok_off[b * j->H + h];
        const int64_t ntok = j->tok_off[b * j->H + h + 1] - j->tok_off[b * j->H + h];
        const int64_t nq = ntok - i0 < 32 ? ntok - i0 : 32;
        /* the rows computed: the tiles take 32, vdpbf16ps blocks of VDP_MR (padding rows repeat
         * the last query) */
        const int64_t nrow = j->isa == ISA_AMX ? 32 : (nq + VDP_MR - 1) / VDP_MR * VDP_MR;
        for (int64_t r = 0; r < 32; r++) {
            const int64_t t = tok[i0 + (r < nq ? r : nq - 1)];
            memcpy(qa + r * d, j->q + (b * j->T + t) * j->ldq + h * d, (size_t)d * 2);
            pos[r] = j->q_offset + t;
            mx[r] = -INFINITY;
            l[r] = 0.f;
        }
        memset(o, 0, sizeof(float) * 32 * (size_t)d);
        const int64_t kvh = h / hpk, bh = b * j->Hkv + kvh;
        const uint16_t *kp = j->kp + bh * j->lkv, *vp = j->vp + bh * j->lkv;
        const uint8_t *kval = j->key_valid ? j->key_valid + b * j->S : NULL;
        const int64_t last = pos[nq - 1]; /* tokens ascend: the block's last query sees the most keys */
        int64_t first = 0;
        if (j->window > 0 && pos[0] - j->window + 1 > 0) first = (pos[0] - j->window + 1) / 32 * 32;
        for (int64_t k0 = first; k0 <= last && k0 < j->S; k0 += 32) {
            /* scores [32 q][32 keys] = Q K^T (the key tiles of the block: packed weights of 16 keys) */
            const uint16_t *k0p = kp + (k0 / 16) * DC * 512;
            if (j->isa == ISA_AMX) amx_block(qa, d, k0p, k0p + DC * 512, DC, sc);
            else vdp_block(0, qa, d, k0p, k0p + DC * 512, DC, sc, 32, nrow);
            /* visibility of the block's keys per query row: causal, window, valid slots */
            uint32_t valid = 0xffffffffu;
            if (kval) {
                valid = 0;
                for (int64_t c = 0; c < 32 && k0 + c < j->S; c++) valid |= (uint32_t)(kval[k0 + c] != 0) << c;
            }
            for (int64_t r = 0; r < nrow; r++) {
                const int64_t hi = pos[r] + 1 < j->S ? pos[r] + 1 : j->S;
                const uint32_t vis = key_range_bits(k0, j->window > 0 ? pos[r] - j->window + 1 : 0, hi) & valid;
                if (r < nq) pairs += __builtin_popcount(vis);
                const __mmask16 v0 = (__mmask16)(vis & 0xffff), v1 = (__mmask16)(vis >> 16);
                const __m512 ninf = _mm512_set1_ps(-INFINITY), s = _mm512_set1_ps(j->scale);
                __m512 a = _mm512_mask_mul_ps(ninf, v0, _mm512_load_ps(sc + r * 32), s);
                __m512 bb = _mm512_mask_mul_ps(ninf, v1, _mm512_load_ps(sc + r * 32 + 16), s);
                const float bm = _mm512_reduce_max_ps(_mm512_max_ps(a, bb));
                const float mnew = bm > mx[r] ? bm : mx[r];
                if (mnew == -INFINITY) { /* nothing visible yet for this row */
                    memset(pa + r * 32, 0, 64);
                    continue;
                }
                const float alpha = mx[r] == -INFINITY ? 0.f : expf(mx[r] - mnew);
                mx[r] = mnew;
                const __m512 vm = _mm512_set1_ps(mnew);
                __m512 pa0 = _mm512_maskz_mov_ps(v0, amx_exp(_mm512_sub_ps(a, vm)));
                __m512 pa1 = _mm512_maskz_mov_ps(v1, amx_exp(_mm512_sub_ps(bb, vm)));
                /* the PV product reads P in bf16: the normaliser sums the same rounded values */
                pa0 = rnd16(pa0);
                pa1 = rnd16(pa1);
                l[r] = l[r] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(pa0, pa1));
                _mm256_store_si256((__m256i *)(pa + r * 32), st16_bf16(pa0));
                _mm256_store_si256((__m256i *)(pa + r * 32 + 16), st16_bf16(pa1));
                if (alpha != 1.f) {
                    const __m512 va = _mm512_set1_ps(alpha);
                    for (int64_t e = 0; e < d; e += 16) _mm512_store_ps(o + r * d + e, _mm512_mul_ps(_mm512_load_ps(o + r * d + e), va));
                }
            }
            /* o += P V, 32 dims at a time */
            for (int64_t db = 0; db < DB; db += 2) {
                const uint16_t *v0p = vp + ((k0 / 32) * DB + db) * 512;
                if (j->isa == ISA_AMX) amx_block(pa, 32, v0p, v0p + 512, 1, pv);
                else vdp_block(0, pa, 32, v0p, v0p + 512, 1, pv, 32, nrow);
                for (int64_t r = 0; r < nrow; r++) {
                    float *orow = o + r * d + db * 16;
                    _mm512_store_ps(orow, _mm512_add_ps(_mm512_load_ps(orow), _mm512_load_ps(pv + r * 32)));
                    _mm512_store_ps(orow + 16, _mm512_add_ps(_mm512_load_ps(orow + 16), _mm512_load_ps(pv + r * 32 + 16)));
                }
            }
        }
        for (int64_t r = 0; r < nq; r++) {
            uint16_t *dst = j->out + ((b * j->T + tok[i0 + r]) * j->H + h) * d;
            const __m512 inv = _mm512_set1_ps(l[r] > 0.f ? 1.f / l[r] : 0.f);
            for (int64_t e = 0; e < d; e += 16)
                _mm256_storeu_si256((__m256i *)(dst + e), st16_bf16(_mm512_mul_ps(_mm512_load_ps(o + r * d + e), inv)));
        }
    }
    if (j->isa == ISA_AMX) _tile_release();
    __atomic_fetch_add(j->pairs, pairs, __ATOMIC_RELAXED);
}

/* 1: the fp32 products (ISA_F32) run wherever this file is compiled (AVX-512 F). */
int64_t wide_f32_ready(void) { return 1; }

/* 1 when this CPU runs AVX512-BF16 (vdpbf16ps), the other bf16 ISA of the kernels of this file. */
int64_t wide_vdp_ready(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
}

/* 1 when this process can run the AMX kernels: the CPU has AMX-TILE, AMX-BF16 and AVX512-BF16 and
 * the kernel granted the tile data permission (asked for here, once per process; idempotent). */
int64_t wide_amx_ready(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return 0;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return 0; /* AVX512-BF16 */
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

/* Whether `isa` may run here (the tile permission is asked for once, by the first call). */
static int isa_ok(int64_t isa) {
    static int amx = -1;
    if (isa == ISA_F32) return 1; /* AVX-512 F: what this file is compiled for */
    if (isa == ISA_VDP) return (int)wide_vdp_ready();
    if (isa != ISA_AMX) return 0;
    if (amx < 0) amx = (int)wide_amx_ready();
    return amx;
}
#endif

/* A routed projection of M tokens on packed weights P (the file comment's layout), bf16 in, out
 * fp32 or bf16 (ofmt), on nthreads threads split by tokens.
 * mode 0 (axis n: Q, gate/up, K/V, any dense rows): K = the reduction width (a multiple of 32);
 *   G groups of gsz output rows (a multiple of 16), N = G gsz: out[t][g gsz + c] = X[t] . W[g gsz
 *   + c] (+ bias) for every token t that executes group g (mask[t mstride + g] != 0; mask NULL:
 *   every token); other entries of out are not written.
 * mode 1 (axis k: O, down): G groups of gsz reduction channels (a multiple of 32), K = G gsz, N
 *   output columns (a multiple of 16), P = G packed [N, gsz] slices: out[t][:N] += X[t][g gsz :
 *   (g + 1) gsz] . W_g for every executing pair; out fp32; bias must be NULL.
 * X [M][ldx] bf16 (ISA_F32: fp32, P packed in fp32 tiles), out [M][ldo]. Returns 0, or -1 for arguments it does not take (nothing written
 * then): no AMX here, a shape off the tile multiples, an allocation failure. */
int64_t wide_gather_proj(WCtx *c, int64_t mode, const uint16_t *P, int64_t N, int64_t K, int64_t G, int64_t gsz,
                      const uint16_t *X, int64_t ldx, int64_t M, const uint8_t *mask, int64_t mstride, void *out,
                      int64_t ldo, int64_t ofmt, const float *bias, int64_t isa, int64_t nthreads) {
#ifdef WIDE_AMX
    if (!isa_ok(isa)) return -1;
    if (M <= 0 || G <= 0 || gsz <= 0 || N != (mode == 0 ? G * gsz : N) || K <= 0) return -1;
    if (mode == 0 && (K % 32 || gsz % 16)) return -1;
    if (mode == 1 && (gsz % 32 || N % 16 || K != G * gsz || ofmt != FMT_F32 || bias)) return -1;
    if ((mode != 0 && mode != 1) || (ofmt != FMT_F32 && ofmt != FMT_BF16)) return -1;
    if (nthreads != c->pool.n) pool_resize(&c->pool, nthreads);
    AmxJob j = {mode, N, K, G, gsz, M, mstride, ldx, ldo, ofmt, 0, 0, P, NULL, X, mask, bias, out, NULL, 0, isa};
    pool_run(&c->pool, amx_proj_job, &j);
    return j.err ? -1 : 0;
#else
    (void)c, (void)mode, (void)P, (void)N, (void)K, (void)G, (void)gsz, (void)X, (void)ldx, (void)M, (void)mask;
    (void)mstride, (void)out, (void)ldo, (void)ofmt, (void)bias, (void)isa, (void)nthreads;
    return -1;
#endif
}

/* The routed gated FFN of M tokens: out[t][:D] = sum over the groups g that token t executes of
 * act(X[t] . gate_g) * (X[t] . up_g) . down_g (act silu, or GELU-tanh with gelu = 1), the gated
 * activations rounded to bf16 between the products. Pgu: the grouped gate/up rows (per group g
 * gate rows then g up rows, cpu_proj.grouped_gate_up) packed with K = D; Pd: the down projection
 * packed per group (mode 1 of wide_gather_proj, N = D). D a multiple of 32, g a multiple of 32. X [M][ldx]
 * bf16 (ISA_F32: fp32 X and packed weights, the gated activations kept in fp32), out [M][D] fp32
 * contiguous, every row written (zeros for a token that executes no group).
 * *macs += the multiply-adds executed: the gate/up products of the executed pairs, and the down
 * products of every token row of a 32-token block for each group some token of the block executes
 * (see amx_ffn_job). Returns 0, or -1 as wide_gather_proj. */
int64_t wide_gather_ffn(WCtx *c, const uint16_t *Pgu, const uint16_t *Pd, int64_t D, int64_t G, int64_t g,
                     const uint16_t *X, int64_t ldx, int64_t M, const uint8_t *mask, int64_t mstride, int64_t gelu,
                     float *out, int64_t *macs, int64_t isa, int64_t nthreads) {
#ifdef WIDE_AMX
    if (!isa_ok(isa)) return -1;
    if (M <= 0 || G <= 0 || D <= 0 || g <= 0 || D % 32 || g % 32) return -1;
    if (nthreads != c->pool.n) pool_resize(&c->pool, nthreads);
    AmxJob j = {0, D, D, G, g, M, mstride, ldx, D, FMT_F32, gelu, D, Pgu, Pd, X, mask, NULL, out, macs, 0, isa};
    pool_run(&c->pool, amx_ffn_job, &j);
    return j.err ? -1 : 0;
#else
    (void)c, (void)Pgu, (void)Pd, (void)D, (void)G, (void)g, (void)X, (void)ldx, (void)M, (void)mask, (void)mstride;
    (void)gelu, (void)out, (void)macs, (void)isa, (void)nthreads;
    return -1;
#endif
}

/* Routed causal attention of a prefill step on the tiles. q [B][T][H][d] bf16 (token rows ldq
 * elements apart, heads contiguous; scaled by `scale` in the scores); k, v: the cache's keys and
 * values of slots [0, S), element (b, slot, kv head, e) at b kb + slot ks + kvh kh + e (bf16);
 * queries sit at slots q_offset + t; a query sees the slots at or before its own, within `window`
 * of it (0: no window), that key_valid [B][S] marks (NULL: all). hmask [B][T][H] (NULL: every
 * head): the (token, head) pairs to compute; out [B][T][H][d] bf16 gets them and zeros elsewhere
 * (and for a query that sees no key). d a multiple of 32, at most 256; H a multiple of Hkv.
 * *pairs += the (query, key) pairs computed. Returns 0, or -1 (nothing written) for arguments it
 * does not take: no AMX here, sizes, an allocation failure. */
int64_t wide_gather_attention(WCtx *c, const uint16_t *q, int64_t ldq, int64_t B, int64_t T, int64_t H, int64_t Hkv,
                           int64_t d, const uint16_t *k, const uint16_t *v, int64_t kb, int64_t ks, int64_t kh,
                           int64_t S, int64_t q_offset, int64_t window, const uint8_t *key_valid, float scale,
                           const uint8_t *hmask, uint16_t *out, int64_t *pairs, int64_t isa, int64_t nthreads) {
#ifdef WIDE_AMX
    if (isa == ISA_F32 || !isa_ok(isa)) return -1; /* bf16 only */
    if (B <= 0 || T <= 0 || H <= 0 || Hkv <= 0 || H % Hkv || d % 32 || d > 256 || S <= 0 || q_offset + T > S) return -1;
    if (nthreads != c->pool.n) pool_resize(&c->pool, nthreads);
    const int64_t Sp = (S + 31) / 32 * 32;
    int64_t *off = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B * H + 1));
    int64_t *tok = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B * H * T));
    int64_t *items = (int64_t *)malloc(sizeof(int64_t) * 3 * (size_t)(B * H * ((T + 31) / 32)));
    uint16_t *kp = (uint16_t *)aligned_alloc(64, (size_t)(B * Hkv * Sp * d * 2));
    uint16_t *vp = (uint16_t *)aligned_alloc(64, (size_t)(B * Hkv * Sp * d * 2));
    int rc = -1;
    if (off && tok && items && kp && vp) {
        int64_t n = 0, ni = 0;
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++) {
                off[b * H + h] = n;
                const int64_t n0 = n;
                for (int64_t t = 0; t < T; t++)
                    if (!hmask || hmask[(b * T + t) * H + h]) tok[n++] = t;
                for (int64_t i = n0; i < n; i += 32) items[ni * 3] = b, items[ni * 3 + 1] = h, items[ni * 3 + 2] = i - n0, ni++;
            }
        off[B * H] = n;
        memset(out, 0, (size_t)(B * T * H * d * 2));
        AmxAttnJob j = {B, T, H, Hkv, d, S, Sp, q_offset, window, ldq, kb, ks, kh, Sp * d, scale, q, k, v, key_valid,
                     hmask, kp, vp, out, ni, items, tok, off, pairs, 0, isa};
        if (ni) {
            pool_run(&c->pool, amx_attn_pack_job, &j);
            pool_run(&c->pool, amx_attn_job, &j);
        }
        rc = j.err ? -1 : 0;
    }
    free(off), free(tok), free(items), free(kp), free(vp);
    return rc;
#else
    (void)c, (void)q, (void)ldq, (void)B, (void)T, (void)H, (void)Hkv, (void)d, (void)k, (void)v, (void)kb, (void)ks;
    (void)kh, (void)S, (void)q_offset, (void)window, (void)key_valid, (void)scale, (void)hmask, (void)out, (void)pairs;
    (void)isa, (void)nthreads;
    return -1;
#endif
}

#ifndef WIDE_AMX
int64_t wide_amx_ready(void) { return 0; }
int64_t wide_vdp_ready(void) { return 0; }
int64_t wide_f32_ready(void) { return 0; }
#endif
