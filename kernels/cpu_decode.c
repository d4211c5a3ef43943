/* The cpu backend's native decode step: one call runs one new token for each of 1-64 batch rows
 * through every layer (each row over its own groups, a group's weights read once per step).
 *
 * Why: the PyTorch decode path issues ~700 small ops per token; on SmolLM2-135M that overhead, not
 * weight traffic, set the speed (about 30 ms per token with int8 weights whose GEMVs take ~4 ms).
 * Here a token costs one call: the embedding row, per layer the routers, RMSNorm, the routed Q
 * rows and all K/V rows, RoPE, the KV-cache write, attention over the active heads only, the
 * routed O columns, the routed FFN groups, stand-ins and residual adds; then the final norm and
 * the LM head. A skipped head group or FFN group reads none of its weight bytes.
 *
 * The math is the one of runtime/engine.py (DESIGN.md section 1: a group executes iff its folded
 * router logit w.x + b >= 0), in fp32 with the weights converted on load into registers. When the
 * compute dtype is bf16 the values the PyTorch path rounds to bf16 (residual stream, norm outputs,
 * projection outputs, RoPE tables, the K/V written to the cache) are rounded here too, so both
 * paths stay close; they are not bitwise equal (different summation order). Gemma 3's layer is
 * the same step with per-layer switches (WLayer): output norms on each block (ln_attn_out,
 * ln_ffn_out: a row that executes no group of the block skips its post-norm and stand-ins, adding
 * nothing), GELU-tanh gating, its own RoPE table and query scale; and per model the embedding
 * scale and Gemma's norm rounding (norm_fp32).
 *
 * Weight layouts are the cpu backend's Proj layouts (runtime/cpu_proj.py): axis-n projections
 * (QKV, gate/up, LM head) as rows [N, K]; axis-k projections (O, down) as w_t [K, N] for float
 * formats and, for int8, one block q [N, g] per routed group (bf16 O / down may be given in that
 * blocked form too). int8 has one fp32 scale per row and block of 32 reduction channels
 * (wide_cli/quant.py), its bytes pair-interleaved (I8_LAYOUT): y[n] = sum_b s[n, b] sum_{k in b}
 * q[n, k] x[k]; where the CPU has AVX512-VNNI, x is itself rounded to int8 per block of 32 (Vec) and
 * the products are int8 x int8, as llama.cpp's Q8_0 does (AVX2: vpmaddubsw); without either,
 * x stays fp32. int4 (FMT_I4) is llama.cpp's Q4_0 block (16 bytes per 32 channels, low nibbles
 * the first 16, values q - 8) with one bf16 scale per row and block; its int4 x int8 kernel runs
 * wherever AVX2 does.
 *
 * State: every entry point takes a context (WCtx, from wide_ctx_new) holding the thread pool and
 * the prepared-vector buffers; the file keeps no other mutable state than a fork counter.
 * Threads: a step may split every projection's rows (and the attention heads) between the calling
 * thread and nthreads - 1 workers. Built with -fopenmp (the default) the workers are the OpenMP
 * team of the process: the libgomp.so.1 PyTorch has loaded, so PyTorch's ops and these kernels share
 * one set of threads. A pool of its own beside PyTorch's would spin against it: on two cores a
 * routed prefill, which alternates PyTorch ops and these GEMMs, ran slower at 2 threads than at 1.
 * Without OpenMP the context holds a pthread pool whose workers spin briefly, then sleep.
 *
 * Built by wide_cli/runtime/cpu_native.py with the system C compiler (-O3 -march=native -fopenmp); the
 * AVX-512 paths are used when the compiler targets them, their 8-lane AVX2 + FMA twins on CPUs
 * without AVX-512, portable C otherwise.
 */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define WIDE_AVX512 1
#if defined(__AVX512VNNI__)
#define WIDE_VNNI 1 /* int8 x int8 dot products (vpdpbusd): 64 multiply-adds per instruction */
#endif
#if defined(__AVX512BF16__)
#define WIDE_BF16DP 1 /* bf16 pair dot products (vdpbf16ps): 32 multiply-adds per instruction */
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define WIDE_AVX2 1 /* 8-lane twins of the AVX-512 kernels (int8 with fp32 activations, bf16 widened) */
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define WIDE_I4_SIMD 1 /* the int4 x int8 kernel (32-byte vectors; vpdpbusd where AVX512-VNNI/VL is) */
#endif

#define WIDE_DECODE_ABI 14

enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_I8 = 2, FMT_I4 = 3 };
/* The step's counters (cnt[]): executed weight, attention and router multiply-adds, weight bytes
 * read (int8 scales included); runtime/cpu_native.py reads them in this order. */
enum { CNT_MACS = 0, CNT_ATTN_MACS = 1, CNT_ROUTER_MACS = 2, CNT_WEIGHT_BYTES = 3, CNT_COUNT = 4 };

typedef struct {
    int64_t H, Hkv, d, ag, GA, fg, GF, window; /* window 0: none; ag: heads per attention group */
    int64_t blocked;                           /* bf16 o / down given as [GROUPS, D, g] blocks */
    const void *qkv;  const void *qkv_s;      /* [(H + 2 Hkv) d, D]; int8: fp32 scales [N, D / 32] (int4: bf16) */
    const void *o;    const void *o_s;        /* float: w_t [H d, D] or blocked; int8: q [GA, D, ag d], s [GA, D, ag d / 32] */
    const void *gu;   const void *gu_s;       /* [GF 2 fg, D] group-major gate | up */
    const void *down; const void *down_s;     /* float: w_t [GF fg, D]; int8: q [GF, D, fg], s [GF, D, fg / 32]; int4 bytes g / 2 */
    const float *bqkv, *bo;                    /* fp32 biases or NULL */
    const float *ln_attn, *ln_ffn, *q_norm, *k_norm; /* fp32; q/k norms [d] or NULL */
    const float *ra_w, *ra_b, *rf_w, *rf_b;    /* folded routers [G, D], [G] or NULL */
    const float *sa, *sf;                      /* stand-ins [G, D] or NULL */
    const float *sa_in, *sa_out, *sf_in, *sf_out; /* low-rank stand-in maps [G, R, D] or NULL */
    int64_t sa_r, sf_r;                        /* their ranks R, per module (0: none) */
    const uint8_t *keep_a, *keep_f;            /* static execute masks [G] or NULL */
    void *k_cache, *v_cache;                   /* [B, Hkv, S_max, d] in the compute dtype */
    int64_t keep_a_stride, keep_f_stride;      /* bytes between batch rows' keep masks (0: one for all) */
    const float *ln_attn_out, *ln_ffn_out;     /* fp32 norms of the block outputs [D] (Gemma 3's sandwich
                                                * norms) or NULL: a row that executes no group of the
                                                * block adds nothing then */
    const float *inv_freq;                     /* this layer's RoPE frequencies [d / 2] */
    int64_t gelu;                              /* FFN gating: 0 silu (SwiGLU), 1 GELU, tanh approximation */
    float rope_scale, attn_scale;              /* RoPE attention scaling; softmax scale of the scores */
} WLayer;

typedef struct {
    int64_t L, D, V, max_len, wfmt, act_bf16, head_fmt, routing, nthreads;
    int64_t norm_fp32;              /* RMSNorms as Gemma 3's: fp32 weight times the fp32 normalised value,
                                     * one rounding (else Llama's: the normalised value rounded first) */
    float eps, embed_scale;         /* embed_scale: embeddings times it (1 or, Gemma 3, sqrt(D) in the compute dtype) */
    const void *embed;              /* [V, D] in the compute dtype */
    const float *final_norm;        /* [D] */
    const void *head; const void *head_s;     /* [V, D] in head_fmt */
    WLayer *layers;
    double *stat_skipped, *stat_decisions;    /* [L, 2] float64 (SparsityStats) or NULL */
} WModel;

/* ------------------------------------------------------------------------------------------ */
/* scalar helpers */

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even (no NaN inputs here) */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static inline float load_act(const void *p, int64_t i, int64_t bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* ------------------------------------------------------------------------------------------ */
/* GEMV kernels: y[r] = sum_k W[r, k] x[k] for n rows of width K (row stride K) */

/* The vector primitives of each ISA (vf: VW fp32 lanes), so that one generic kernel body serves
 * AVX-512 and AVX2 + FMA (the ggml-cpu way); ISA-only kernels (VNNI, BF16 pairs, AVX2 int8) use
 * the intrinsics directly. Without either ISA VW is undefined and the portable twins run. */
#ifdef WIDE_AVX512
#define VW 16
typedef __m512 vf;
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline float vf_sum(vf v) { return _mm512_reduce_add_ps(v); }
static inline __m512 ld_f32(const float *w) { return _mm512_loadu_ps(w); }
static inline __m512 ld_bf16(const uint16_t *w) {
    __m256i v = _mm256_loadu_si256((const __m256i *)w);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
static inline __m512 ld_i8(const int8_t *w) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
}
#endif
#if defined(WIDE_AVX2)
#define VW 8
typedef __m256 vf;
static inline float hsum8(__m256 v);
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline float vf_sum(vf v) { return hsum8(v); }
static inline __m256 ld_f32(const float *w) { return _mm256_loadu_ps(w); }
static inline __m256 ld_bf16(const uint16_t *w) {
    __m128i v = _mm_loadu_si128((const __m128i *)w);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
#endif
#ifdef WIDE_I4_SIMD
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The order in which three horizontal adds (hadd(hadd(d0, d1), hadd(d2, d3))) leave the 8 blocks
 * of 4 block pairs whose int32 lanes are [first block x4 | second block x4]: the scales of
 * dot_i8_q_avx2 / dot_i4_q are laid out in it. */
static const int BLOCK_ORDER8[8] = {0, 2, 4, 6, 1, 3, 5, 7};
#endif
static inline float cv_f32(const float *w, int64_t k) { return w[k]; }
static inline float cv_bf16(const uint16_t *w, int64_t k) { return bf16_to_f32(w[k]); }
static inline float cv_i8(const int8_t *w, int64_t k) { return (float)w[k]; }

#ifdef VW
/* Software prefetch of the rows 8 ahead of the 4 being read, once per cache line: a decode step
 * streams many small matrices, and the hardware prefetcher alone reached ~20 GB/s of the ~35 GB/s
 * one core reads on an AVX-512 EPYC (SmolLM2-135M int8 decode 84 -> 117 tokens/s with it, 1
 * thread, measured A/B). */
#define PREFETCH_ROWS(p, K)                                                                          \
    do {                                                                                             \
        _mm_prefetch((const char *)((p) + 8 * (K)), _MM_HINT_T0);                                    \
        _mm_prefetch((const char *)((p) + 9 * (K)), _MM_HINT_T0);                                    \
        _mm_prefetch((const char *)((p) + 10 * (K)), _MM_HINT_T0);                                   \
        _mm_prefetch((const char *)((p) + 11 * (K)), _MM_HINT_T0);                                   \
    } while (0)
#define DOT_BODY(T, LD, CV)                                                                          \
    int64_t r = 0;                                                                                   \
    for (; r + 4 <= n; r += 4) {                                                                     \
        const T *w0 = W + r * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;                           \
        vf a0 = vf_zero(), a1 = a0, a2 = a0, a3 = a0;                                                \
        int64_t k = 0;                                                                               \
        for (; k + VW <= K; k += VW) {                                                               \
            vf xv = vf_load(x + k);                                                                  \
            if ((k * (int64_t)sizeof(T)) % 64 == 0) PREFETCH_ROWS(w0 + k, K);                        \
            a0 = vf_fma(LD(w0 + k), xv, a0);                                                         \
            a1 = vf_fma(LD(w1 + k), xv, a1);                                                         \
            a2 = vf_fma(LD(w2 + k), xv, a2);                                                         \
            a3 = vf_fma(LD(w3 + k), xv, a3);                                                         \
        }                                                                                            \
        float s0 = vf_sum(a0), s1 = vf_sum(a1), s2 = vf_sum(a2), s3 = vf_sum(a3);                    \
        for (; k < K; k++) {                                                                         \
            s0 += CV(w0, k) * x[k]; s1 += CV(w1, k) * x[k];                                          \
            s2 += CV(w2, k) * x[k]; s3 += CV(w3, k) * x[k];                                          \
        }                                                                                            \
        y[r] = s0; y[r + 1] = s1; y[r + 2] = s2; y[r + 3] = s3;                                      \
    }                                                                                                \
    for (; r < n; r++) {                                                                             \
        const T *w0 = W + r * K;                                                                     \
        vf a0 = vf_zero();                                                                           \
        int64_t k = 0;                                                                               \
        for (; k + VW <= K; k += VW) a0 = vf_fma(LD(w0 + k), vf_load(x + k), a0);                    \
        float s0 = vf_sum(a0);                                                                       \
        for (; k < K; k++) s0 += CV(w0, k) * x[k];                                                   \
        y[r] = s0;                                                                                   \
    }
#else
#define DOT_BODY(T, LD, CV)                                                                          \
    for (int64_t r = 0; r < n; r++) {                                                                \
        const T *w0 = W + r * K;                                                                     \
        float s0 = 0.f;                                                                              \
        for (int64_t k = 0; k < K; k++) s0 += CV(w0, k) * x[k];                                      \
        y[r] = s0;                                                                                   \
    }
#endif

static void dot_bf16(const uint16_t *W, int64_t K, int64_t n, const float *x, float *y) { DOT_BODY(uint16_t, ld_bf16, cv_bf16) }

#ifdef VW
/* fp32 rows against nb <= 4 activation vectors: ys[b][r] = W[r] . xs[b] for r in [0, n). One
 * weight row at a time, so the n rows are read as one forward stream that the hardware prefetcher
 * follows (DOT_BODY's four rows at a time are four streams): on a 2-core AVX-512 EPYC, 1 thread,
 * 26 SmolLM2-135M gate|up projections took 11-12 ms this way against 15-18 ms in blocks of four
 * rows, at 1 and at 4 batch rows (about the 16 GB/s one core streams). Each (row, batch row) pair
 * sums in DOT_BODY's order, so the result is bit for bit the same. */
static inline __attribute__((always_inline)) void dot_f32_nb(const float *W, int64_t K, int64_t n,
                                                             const float *const *xs, float *const *ys, const int nb) {
    for (int64_t r = 0; r < n; r++) {
        const float *w = W + r * K;
        vf a[4];
        for (int b = 0; b < nb; b++) a[b] = vf_zero();
        int64_t k = 0;
        for (; k + VW <= K; k += VW) {
            const vf v = ld_f32(w + k);
            for (int b = 0; b < nb; b++) a[b] = vf_fma(v, vf_load(xs[b] + k), a[b]);
        }
        for (int b = 0; b < nb; b++) {
            float s0 = vf_sum(a[b]);
            for (int64_t kk = k; kk < K; kk++) s0 += w[kk] * xs[b][kk];
            ys[b][r] = s0;
        }
    }
}

static void dot_f32(const float *W, int64_t K, int64_t n, const float *x, float *y) { dot_f32_nb(W, K, n, &x, &y, 1); }
#else
static void dot_f32(const float *W, int64_t K, int64_t n, const float *x, float *y) { DOT_BODY(float, ld_f32, cv_f32) }
#endif

#ifdef VW
static void dot_f32_rows(const float *W, int64_t K, int64_t n, const float *const *xs, float *const *ys, int nb) {
    switch (nb) {
    case 1: dot_f32(W, K, n, xs[0], ys[0]); break;
    case 2: dot_f32_nb(W, K, n, xs, ys, 2); break;
    case 3: dot_f32_nb(W, K, n, xs, ys, 3); break;
    default: dot_f32_nb(W, K, n, xs, ys, 4); break;
    }
}

#endif

/* I8_LAYOUT: an int8 row of K bytes is cut into chunks of 64 (two blocks of 32); inside a chunk
 * the 4-byte groups alternate between the blocks: bytes 8k..8k+3 are the first block's 4k..4k+3,
 * bytes 8k+4..8k+7 the second block's. vpdpbusd sums 4 adjacent bytes per int32 lane, so its 16
 * lanes alternate between the two blocks and one broadcast pair [s0 s1 s0 s1 ...] scales them.
 * When K / 32 is odd the last block stays in natural order (32 bytes). Built by
 * runtime/cpu_proj.py (Proj, int8). Scales: fp32, one per (row, block). */
static inline int64_t i8_pos(int64_t k, int64_t K) { /* byte offset of reduction channel k */
    int64_t c = k / 64;
    if (64 * c + 64 > K) return k; /* trailing half chunk: natural order */
    int64_t i = k % 64, blk = i / 32, j = i % 32;
    return 64 * c + 8 * (j / 4) + 4 * blk + j % 4;
}

/* int8 rows with one fp32 scale per (row, block of 32): y[r] = sum_b S[r, b] sum_{k in b} W[r, k] x[k]
 * (the fp32-activation path, for CPUs without VNNI: portable, not fast). */
static void dot_i8_blocks(const int8_t *W, const float *S, int64_t K, int64_t n, const float *x, float *y) {
    const int64_t nb = K / 32;
    for (int64_t r = 0; r < n; r++) {
        const int8_t *w = W + r * K;
        float acc = 0.f;
        for (int64_t b = 0; b < nb; b++) {
            float sb = 0.f;
            for (int64_t k = 32 * b; k < 32 * b + 32; k++) sb += (float)w[i8_pos(k, K)] * x[k];
            acc += sb * S[r * nb + b];
        }
        y[r] = acc;
    }
}


/* An input vector of a projection with the forms the fast kernels read, prepared once per vector:
 * - int8 weights (VNNI): x quantized per block of QBLOCK values, symmetric, scale max|x| / 127 (as
 *   llama.cpp quantizes activations for Q8_0 dot products): q as int8 in natural order (qa) and
 *   the block scales (qs). The int8 x int8 products are exact in int32; the error
 *   is the activation rounding, at most half a step of its block.
 * - bf16 weights (AVX512-BF16): x as bf16 (xb); exact when x is already bf16-valued, which it is
 *   whenever the compute dtype is bf16 (the PyTorch path feeds bf16 activations to its GEMMs).
 * Both need K to be a multiple of the block; otherwise the fp32 kernels above run. */
#define QBLOCK 32 /* activation block = weight scale block (wide_cli/quant.py INT8_BLOCK) */
#ifdef WIDE_AVX2
#define I8_QUANT_ACT 1 /* the AVX2 int8 kernel reads rounded activations (AVX-512 without VNNI: fp32) */
#else
#define I8_QUANT_ACT 0
#endif

typedef struct {
    const float *x;
    int64_t K;
    const int8_t *qa;
    const float *qs;
    const uint16_t *xb;
} Vec;

/* The buffers prepare_vec writes (one context's; see WCtx). */
typedef struct {
    int8_t *qa;
    float *qs;
    uint16_t *xb;
    int64_t cap;
} VecBuf;

static int vec_reserve(VecBuf *b, int64_t K) {
    if (K <= b->cap) return 0;
    free(b->qa); free(b->qs); free(b->xb);
    b->qa = aligned_alloc(64, (size_t)((K + 63) / 64 * 64));
    b->qs = malloc((size_t)(K / QBLOCK + 1) * sizeof(float));
    b->xb = malloc((size_t)K * sizeof(uint16_t));
    if (!b->qa || !b->qs || !b->xb) { b->cap = 0; return -1; }
    b->cap = K;
    return 0;
}

static Vec prepare_vec(VecBuf *vb, int64_t fmt, const float *x, int64_t K) {
    Vec v = {x, K, NULL, NULL, NULL};
#ifdef WIDE_VNNI
    if ((fmt == FMT_I8 || fmt == FMT_I4) && K % QBLOCK == 0 && K <= vb->cap) {
        const __m512 lim = _mm512_set1_ps(127.f);
        for (int64_t b = 0; b < K / QBLOCK; b++) {
            const __m512 x0 = _mm512_loadu_ps(x + b * QBLOCK), x1 = _mm512_loadu_ps(x + b * QBLOCK + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
            const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.0f / amax : 0.f);
            /* round to nearest even (the default rounding mode), then |q| <= 127 */
            const __m512 nlim = _mm512_set1_ps(-127.f);
            __m512 q0 = _mm512_roundscale_ps(_mm512_mul_ps(x0, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512 q1 = _mm512_roundscale_ps(_mm512_mul_ps(x1, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q0 = _mm512_max_ps(_mm512_min_ps(q0, lim), nlim);
            q1 = _mm512_max_ps(_mm512_min_ps(q1, lim), nlim);
            _mm_storeu_si128((__m128i *)(vb->qa + b * QBLOCK), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q0)));
            _mm_storeu_si128((__m128i *)(vb->qa + b * QBLOCK + 16), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q1)));
            vb->qs[b] = amax / 127.0f;
        }
        v.qa = vb->qa; v.qs = vb->qs;
    }
#elif defined(WIDE_I4_SIMD)
    if ((fmt == FMT_I4 || (fmt == FMT_I8 && I8_QUANT_ACT)) && K % QBLOCK == 0 && K <= vb->cap) { /* the same rounding, 8 lanes */
        const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), lim = _mm256_set1_ps(127.f);
        const __m256i unzip = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* packs interleave 128-bit halves */
        for (int64_t b = 0; b < K / QBLOCK; b++) {
            const float *xb = x + b * QBLOCK;
            __m256 xv[4], m = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) { xv[i] = _mm256_loadu_ps(xb + 8 * i); m = _mm256_max_ps(m, _mm256_and_ps(xv[i], absm)); }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
            const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.0f / amax : 0.f);
            __m256i qi[4];
            for (int i = 0; i < 4; i++) { /* round to nearest even, then |q| <= 127 */
                const __m256 q = _mm256_round_ps(_mm256_mul_ps(xv[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                qi[i] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(q, lim), _mm256_sub_ps(_mm256_setzero_ps(), lim)));
            }
            const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
            _mm256_storeu_si256((__m256i *)(vb->qa + b * QBLOCK), _mm256_permutevar8x32_epi32(p16, unzip));
            vb->qs[b] = amax / 127.0f;
        }
        v.qa = vb->qa; v.qs = vb->qs;
    }
#endif
#ifdef WIDE_BF16DP
    if (fmt == FMT_BF16 && K % 32 == 0 && K <= vb->cap) {
        for (int64_t i = 0; i < K; i++) vb->xb[i] = f32_to_bf16(x[i]);
        v.xb = vb->xb;
    }
#endif
    (void)fmt;
    return v;
}

/* The slice [k0, k0 + K) of a prepared vector (block-aligned where qa is used). */
static Vec vec_slice(const Vec *v, int64_t k0, int64_t K) {
    Vec s = {v->x + k0, K, NULL, NULL, NULL};
    if (v->qa && k0 % QBLOCK == 0 && K % QBLOCK == 0) {
        s.qa = v->qa + k0; s.qs = v->qs + k0 / QBLOCK;
    }
    if (v->xb && K % 32 == 0) s.xb = v->xb + k0;
    return s;
}

#ifdef WIDE_VNNI
/* Byte permutation that puts a natural-order 64-byte chunk of activations in I8_LAYOUT. */
static inline __m512i i8_layout_perm(void) {
    int8_t idx[64];
    for (int j = 0; j < 64; j++) idx[j] = (int8_t)((j % 8 < 4 ? 0 : 32) + 4 * (j / 8) + j % 4);
    return _mm512_loadu_si512(idx);
}

static inline __m512 bcast_pair(const float *p) { /* [p0 p1 p0 p1 ...] */
    double d;
    memcpy(&d, p, 8);
    return _mm512_castpd_ps(_mm512_set1_pd(d));
}

/* y[r] = sum_b S[r, b] qs[b] sum_{k in b} W[r, k] q[k] for n int8 rows in I8_LAYOUT: |q| times the
 * weights with the sign of q moved onto them (vpdpbusd multiplies unsigned by signed bytes). One
 * weight row at a time, so the n rows are one forward stream (as dot_f32_nb): on a 2-core AVX-512
 * EPYC (Zen 4 class, ~30 GB/s per core), 1 thread, a [3072, 576] matrix read 23.6 GB/s out of
 * cache this way against 10.1 GB/s in blocks of four rows with software prefetch, and 62 against
 * 54 GB/s in L2. Each row sums in the same order either way. */
static void dot_i8_vnni(const int8_t *W, const float *S, int64_t K, int64_t n, const Vec *v, float *y) {
    const int64_t nb = K / QBLOCK, nc = nb / 2;
    const __m512i z = _mm512_setzero_si512(), perm = i8_layout_perm();
    int64_t r = 0;
#define I8_ROW(acc, w, s)                                                                            \
    do {                                                                                             \
        __m512i x_ = _mm512_loadu_si512(w);                                                          \
        x_ = _mm512_dpbusd_epi32(z, qa, _mm512_mask_sub_epi8(x_, ng, z, x_));                        \
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(x_), _mm512_mul_ps(bcast_pair(s), sx), acc);         \
    } while (0)
    for (; r < n; r++) {
        __m512 a0 = _mm512_setzero_ps();
        for (int64_t c = 0; c < nc; c++) {
            const __m512i q = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(v->qa + 64 * c));
            const __m512i qa = _mm512_abs_epi8(q);
            const __mmask64 ng = _mm512_movepi8_mask(q);
            const __m512 sx = bcast_pair(v->qs + 2 * c);
            I8_ROW(a0, W + r * K + 64 * c, S + r * nb + 2 * c);
        }
        y[r] = _mm512_reduce_add_ps(a0);
    }
#undef I8_ROW
    if (nb % 2) { /* the trailing block, natural order, lanes 0-7 */
        const __mmask64 half = 0xFFFFFFFFull;
        const __m512i q = _mm512_maskz_loadu_epi8(half, v->qa + 64 * nc);
        const __m512i qa = _mm512_abs_epi8(q);
        const __mmask64 ng = _mm512_movepi8_mask(q);
        for (int64_t rr = 0; rr < n; rr++) {
            __m512i x = _mm512_maskz_loadu_epi8(half, W + rr * K + 64 * nc);
            x = _mm512_dpbusd_epi32(z, qa, _mm512_mask_sub_epi8(x, ng, z, x));
            y[rr] += _mm512_reduce_add_ps(_mm512_cvtepi32_ps(x)) * S[rr * nb + nb - 1] * v->qs[nb - 1];
        }
    }
}
#endif

#ifdef WIDE_BF16DP
/* y[r] = sum_k W[r, k] xb[k] for n bf16 rows, fp32 accumulation (vdpbf16ps), one row at a time
 * (dot_i8_vnni says why: here 20.1 against 11.5 GB/s out of cache, the same machine and shape). */
static void dot_bf16_dp(const uint16_t *W, int64_t K, int64_t n, const uint16_t *xb, float *y) {
    int64_t r = 0;
    for (; r < n; r++) {
        const uint16_t *w0 = W + r * K;
        __m512 a0 = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32)
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(xb + k), (__m512bh)_mm512_loadu_si512(w0 + k));
        y[r] = _mm512_reduce_add_ps(a0);
    }
}
#endif

#if defined(WIDE_AVX2)
/* int8 x int8 on AVX2 (vpmaddubsw + vpmaddwd, as llama.cpp's Q8_0 without VNNI): the activations
 * rounded to int8 per block (Vec.qa, qs), |q| times the weights with q's sign moved onto them. The
 * 32 bytes of half a chunk in I8_LAYOUT pair with [q0 4 | q1 4] groups (unpacklo/hi of the two
 * blocks' activations); the int32 lanes alternate between the two blocks, as in dot_i8_vnni. */
static inline __m256i i8_dot32(__m256i w, __m256i qa, __m256i qsgn) {
    const __m256i p16 = _mm256_maddubs_epi16(qa, _mm256_sign_epi8(w, qsgn)); /* |q| <= 127: no saturation */
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

#define I8_MAX_K 16384 /* widths dot_i8_q_avx2 regroups on its stack; wider ones run dot_i8_blocks */

/* Per chunk of 64 channels (two blocks), its activations as the two 32-byte halves of I8_LAYOUT
 * pair them, signed (X) and absolute (A): xr[128 c ..] = X0 A0 X1 A1. Per 8 blocks, their scales
 * in BLOCK_ORDER8 (zero past the paired blocks). */

static void i8_regroup(const int8_t *qx, const float *qs, int64_t npair, int8_t *xr, float *qsp) {
    for (int64_t c = 0; c < npair; c++) {
        const int8_t *q = qx + 64 * c;
        const __m128i b0l = _mm_loadu_si128((const __m128i *)q), b0h = _mm_loadu_si128((const __m128i *)(q + 16));
        const __m128i b1l = _mm_loadu_si128((const __m128i *)(q + 32)), b1h = _mm_loadu_si128((const __m128i *)(q + 48));
        const __m256i x0 = _mm256_set_m128i(_mm_unpackhi_epi32(b0l, b1l), _mm_unpacklo_epi32(b0l, b1l));
        const __m256i x1 = _mm256_set_m128i(_mm_unpackhi_epi32(b0h, b1h), _mm_unpacklo_epi32(b0h, b1h));
        _mm256_store_si256((__m256i *)(xr + 128 * c), x0);
        _mm256_store_si256((__m256i *)(xr + 128 * c + 32), _mm256_sign_epi8(x0, x0));
        _mm256_store_si256((__m256i *)(xr + 128 * c + 64), x1);
        _mm256_store_si256((__m256i *)(xr + 128 * c + 96), _mm256_sign_epi8(x1, x1));
    }
    for (int64_t g = 0; g < (npair + 3) / 4; g++)
        for (int k = 0; k < 8; k++) {
            const int64_t b = 8 * g + BLOCK_ORDER8[k];
            qsp[8 * g + k] = b < 2 * npair ? qs[b] : 0.f;
        }
}

/* int8 x int8 on AVX2 (vpmaddubsw + vpmaddwd, as llama.cpp's Q8_0 without VNNI): the activations
 * rounded to int8 per block (Vec.qa, qs), |q| times the weights with q's sign moved onto them. A
 * chunk's two 32-byte halves in I8_LAYOUT pair with [q0 4 | q1 4] groups of the two blocks'
 * activations (regrouped once per call), so the int32 lanes alternate between the blocks; one
 * permute per chunk gathers them into halves, and per 8 blocks three horizontal adds leave one sum
 * per block (the order of BLOCK_ORDER8) for one fma with the 8 scale products. S is read 8 at a
 * time: the scale tensor must have 8 readable values past its last row (runtime/cpu_proj.py pads
 * it); lanes past the paired blocks multiply zero. */
static void dot_i8_q_avx2(const int8_t *W, const float *S, int64_t K, int64_t n, const int8_t *qx, const float *qs, float *y) {
    const int64_t nb = K / QBLOCK, npair = nb / 2, ng = (npair + 3) / 4;
    _Alignas(32) int8_t xr[2 * I8_MAX_K];
    _Alignas(32) float qsp[I8_MAX_K / 32 + 8];
    i8_regroup(qx, qs, npair, xr, qsp);
    const __m256i ones = _mm256_set1_epi16(1), halves = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int64_t r = 0; r < n; r++) {
        const int8_t *w = W + r * K;
        const float *sr = S + r * nb;
        __m256 tot = _mm256_setzero_ps();
        for (int64_t g = 0; g < ng; g++) {
            __m256i d[4];
            for (int q = 0; q < 4; q++) {
                const int64_t c = 4 * g + q;
                if (c >= npair) { d[q] = _mm256_setzero_si256(); continue; }
                const int8_t *x = xr + 128 * c;
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + 64 * c));
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 64 * c + 32));
                /* |q| <= 127: each pair sum of vpmaddubsw fits int16 */
                const __m256i p0 = _mm256_maddubs_epi16(_mm256_load_si256((const __m256i *)(x + 32)),
                                                        _mm256_sign_epi8(w0, _mm256_load_si256((const __m256i *)x)));
                const __m256i p1 = _mm256_maddubs_epi16(_mm256_load_si256((const __m256i *)(x + 96)),
                                                        _mm256_sign_epi8(w1, _mm256_load_si256((const __m256i *)(x + 64))));
                const __m256i dc = _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones));
                d[q] = _mm256_permutevar8x32_epi32(dc, halves); /* [block 2c x4 | block 2c+1 x4] */
            }
            const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
            const __m256 sw = _mm256_permutevar8x32_ps(_mm256_loadu_ps(sr + 8 * g), halves);
            tot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(sw, _mm256_load_ps(qsp + 8 * g)), tot);
        }
        if (nb % 2) { /* the trailing block of 32, natural order */
            const __m256i x = _mm256_loadu_si256((const __m256i *)(qx + 64 * npair)), a = _mm256_sign_epi8(x, x);
            const __m256i acc = i8_dot32(_mm256_loadu_si256((const __m256i *)(w + 64 * npair)), a, x);
            tot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(sr[nb - 1] * qs[nb - 1]), tot);
        }
        y[r] = hsum8(tot);
    }
}
#endif

/* int4 rows (FMT_I4: per block of 32 channels 16 bytes, byte j = (q[j] + 8) | (q[16 + j] + 8) << 4,
 * one bf16 scale per (row, block)): y[r] = sum_b S[r, b] sum_{k in b} q[r, k] x[k], fp32 x
 * (portable). */
static void dot_i4_blocks(const uint8_t *W, const uint16_t *S, int64_t K, int64_t n, const float *x, float *y) {
    const int64_t nb = K / 32;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *w = W + r * (K / 2);
        float acc = 0.f;
        for (int64_t b = 0; b < nb; b++) {
            float sb = 0.f;
            for (int64_t j = 0; j < 16; j++) {
                const uint8_t u = w[16 * b + j];
                sb += (float)((int)(u & 15) - 8) * x[32 * b + j] + (float)((int)(u >> 4) - 8) * x[32 * b + 16 + j];
            }
            acc += sb * bf16_to_f32(S[r * nb + b]);
        }
        y[r] = acc;
    }
}

#ifdef WIDE_I4_SIMD
/* 32 int4 weights of one block (16 bytes) as signed bytes -8..7 in channel order. */
static inline __m256i i4_block(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), m4 = _mm_set1_epi8(15);
    const __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m4), _mm_and_si128(b, m4));
    return _mm256_sub_epi8(u, _mm256_set1_epi8(8));
}

/* Sum of the 32 products w * q as 8 int32 lanes: |q| times w with q's sign moved onto it (as
 * llama.cpp's Q4_0 x Q8_0 on AVX2; vpdpbusd in one instruction where AVX512-VNNI/VL exist). */
static inline __m256i i4_dot32(__m256i w, __m256i qa, __m256i qsgn) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), qa, _mm256_sign_epi8(w, qsgn));
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(qa, _mm256_sign_epi8(w, qsgn)), _mm256_set1_epi16(1));
#endif
}

#define I4_MAX_K 16384 /* widths dot_i4_q regroups on its stack; wider ones run dot_i4_blocks */

/* int4 x int8: the activations rounded to int8 per block of 32 (Vec.qa natural order, qs). Per pair
 * of blocks the 32 weight bytes are one load: low nibbles are channels 0-15 of both blocks, high
 * nibbles channels 16-31, so the activations are regrouped the same way once per call (xr), and
 * the unsigned nibbles u = q + 8 multiply them directly (vpmaddubsw; vpdpbusd with AVX512-VNNI/VL).
 * Per 8 blocks, three horizontal adds turn the 4 pairs' int32 lanes into one sum per block, minus
 * 8 x the block's activation sum (the -8 offset, exact in int32, as llama.cpp folds it), then one
 * fma with the 8 scale products. S is read 8 bf16 at a time: the scale tensor must have 8 readable
 * values past its last row (runtime/cpu_proj.py pads it); lanes past nb multiply zero. */
static void dot_i4_q(const uint8_t *W, const uint16_t *S, int64_t K, int64_t n, const int8_t *qx, const float *qs, float *y) {
    const int64_t nb = K / QBLOCK, rb = K / 2, npair = nb / 2, nch = (nb + 7) / 8;
    _Alignas(32) int8_t xr[I4_MAX_K];
    _Alignas(32) float qsp[I4_MAX_K / 32 + 8];
    _Alignas(32) int32_t crp[I4_MAX_K / 32 + 8];
    /* the activations regrouped per pair, and per 8 blocks their scales and offsets in the order the
     * horizontal adds leave the blocks in: 0 2 4 6 1 3 5 7 */
    for (int64_t p = 0; p < npair; p++) {
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(qx + 64 * p));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(qx + 64 * p + 32));
        _mm256_store_si256((__m256i *)(xr + 64 * p), _mm256_permute2x128_si256(x0, x1, 0x20));
        _mm256_store_si256((__m256i *)(xr + 64 * p + 32), _mm256_permute2x128_si256(x0, x1, 0x31));
    }
    for (int64_t c = 0; c < nch; c++)
        for (int k = 0; k < 8; k++) {
            const int64_t b = 8 * c + BLOCK_ORDER8[k];
            int32_t sum = 0;
            if (b < 2 * npair)
                for (int64_t e = 0; e < QBLOCK; e++) sum += qx[b * QBLOCK + e];
            crp[8 * c + k] = 8 * sum;
            qsp[8 * c + k] = b < 2 * npair ? qs[b] : 0.f;
        }
    const __m256i m4 = _mm256_set1_epi8(15), order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *w = W + r * rb;
        const uint16_t *sr = S + r * nb;
        __m256 tot = _mm256_setzero_ps();
        _mm_prefetch((const char *)(sr + nb), _MM_HINT_T0);
        for (int64_t c = 0; c < nch; c++) {
            __m256i d[4];
            for (int q = 0; q < 4; q++) {
                const int64_t p = 4 * c + q;
                if (p >= npair) { d[q] = _mm256_setzero_si256(); continue; }
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 32 * p));
                const __m256i lo = _mm256_and_si256(wv, m4), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), m4);
                const __m256i xl = _mm256_load_si256((const __m256i *)(xr + 64 * p));
                const __m256i xh = _mm256_load_si256((const __m256i *)(xr + 64 * p + 32));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                d[q] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xl), hi, xh);
#else
                /* u <= 15 times |x| <= 127: each pair sum <= 3810, two of them fit int16 */
                d[q] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)), ones);
#endif
            }
            const __m256i h = _mm256_sub_epi32(_mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3])),
                                               _mm256_load_si256((const __m256i *)(crp + 8 * c)));
            const __m256i s16 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(sr + 8 * c)));
            const __m256 sw = _mm256_permutevar8x32_ps(_mm256_castsi256_ps(_mm256_slli_epi32(s16, 16)), order);
            tot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(sw, _mm256_load_ps(qsp + 8 * c)), tot);
        }
        if (nb % 2) { /* the trailing block, signed values (no offset to remove) */
            const int64_t b = nb - 1;
            const __m256i x = _mm256_loadu_si256((const __m256i *)(qx + 32 * b)), a = _mm256_sign_epi8(x, x);
            const __m256i acc = i4_dot32(i4_block(w + 16 * b), a, x);
            tot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(bf16_to_f32(sr[b]) * qs[b]), tot);
        }
        y[r] = hsum8(tot);
    }
}
#endif

/* y[i] = W[r0 + i] . v for rows [r0, r1) of an axis-n projection (int8: S [N, K / 32] fp32
 * scales; int4: bf16). */
static void rows_dot(int64_t fmt, const void *W, const void *S, int64_t K, int64_t r0, int64_t r1,
                     const Vec *v, float *y) {
    int64_t n = r1 - r0;
    if (n <= 0) return;
    if (fmt == FMT_F32) dot_f32((const float *)W + r0 * K, K, n, v->x, y);
    else if (fmt == FMT_BF16) {
#ifdef WIDE_BF16DP
        if (v->xb) { dot_bf16_dp((const uint16_t *)W + r0 * K, K, n, v->xb, y); return; }
#endif
        dot_bf16((const uint16_t *)W + r0 * K, K, n, v->x, y);
    } else if (fmt == FMT_I4) {
        const uint8_t *Wq = (const uint8_t *)W + r0 * (K / 2);
        const uint16_t *Sr = (const uint16_t *)S + r0 * (K / QBLOCK);
#ifdef WIDE_I4_SIMD
        if (v->qa && K <= I4_MAX_K) { dot_i4_q(Wq, Sr, K, n, v->qa, v->qs, y); return; }
#endif
        dot_i4_blocks(Wq, Sr, K, n, v->x, y);
    } else {
        const int8_t *Wq = (const int8_t *)W + r0 * K;
        const float *Sr = (const float *)S + r0 * (K / QBLOCK);
#ifdef WIDE_VNNI
        if (v->qa) dot_i8_vnni(Wq, Sr, K, n, v, y);
        else
#endif
#if defined(WIDE_AVX2)
        if (v->qa && K <= I8_MAX_K) dot_i8_q_avx2(Wq, Sr, K, n, v->qa, v->qs, y);
        else
#endif
        dot_i8_blocks(Wq, Sr, K, n, v->x, y);
    }
}

/* y[0:N] += sum_c a[c] w_t[c, 0:N] over C rows of a float w_t with row stride ld (ld = N: one
 * contiguous stream; a thread's column slice: ld > N). */
#ifdef VW
#define AXPY_BODY(T, LD, CV)                                                                         \
    int64_t c = 0;                                                                                   \
    for (; c + 4 <= C; c += 4) {                                                                     \
        const T *w0 = Wt + c * ld, *w1 = w0 + ld, *w2 = w1 + ld, *w3 = w2 + ld;                      \
        vf b0 = vf_set1(a[c]), b1 = vf_set1(a[c + 1]), b2 = vf_set1(a[c + 2]), b3 = vf_set1(a[c + 3]); \
        int64_t i = 0;                                                                               \
        for (; i + VW <= N; i += VW) {                                                               \
            vf acc = vf_load(y + i);                                                                 \
            acc = vf_fma(LD(w0 + i), b0, acc);                                                       \
            acc = vf_fma(LD(w1 + i), b1, acc);                                                       \
            acc = vf_fma(LD(w2 + i), b2, acc);                                                       \
            acc = vf_fma(LD(w3 + i), b3, acc);                                                       \
            vf_store(y + i, acc);                                                                    \
        }                                                                                            \
        for (; i < N; i++)                                                                           \
            y[i] += CV(w0, i) * a[c] + CV(w1, i) * a[c + 1] + CV(w2, i) * a[c + 2] + CV(w3, i) * a[c + 3]; \
    }                                                                                                \
    for (; c < C; c++) {                                                                             \
        const T *w0 = Wt + c * ld;                                                                   \
        for (int64_t i = 0; i < N; i++) y[i] += CV(w0, i) * a[c];                                    \
    }
#else
#define AXPY_BODY(T, LD, CV)                                                                         \
    for (int64_t c = 0; c < C; c++) {                                                                \
        const T *w0 = Wt + c * ld;                                                                   \
        for (int64_t i = 0; i < N; i++) y[i] += CV(w0, i) * a[c];                                    \
    }
#endif

static void axpy_f32(const float *Wt, int64_t ld, int64_t N, int64_t C, const float *a, float *y) { AXPY_BODY(float, ld_f32, cv_f32) }
static void axpy_bf16(const uint16_t *Wt, int64_t ld, int64_t N, int64_t C, const float *a, float *y) { AXPY_BODY(uint16_t, ld_bf16, cv_bf16) }

#ifdef VW
/* The axis-k twin for nb = 2..4 batch rows: ys[b][0:N] += sum_c as[b][c] w_t[c, 0:N] over C rows
 * of stride ld, one w_t row at a time across all N columns (one forward stream; the outputs stay
 * in L1). On a 2-core AVX-512 EPYC, 1 thread, 26 SmolLM2-135M down projections at 4 batch rows:
 * 7.4-8.7 ms this way, 8.8-14 ms with 64-column tiles over all rows (strided reads); at one row
 * AXPY_BODY's four rows at a time stay faster (8.1 against 12 ms), so axpy_f32 keeps them. Every
 * output adds its terms in AXPY_BODY's order, so each batch row's result is bit for bit what
 * axpy_f32 alone gives. */
static inline __attribute__((always_inline)) void axpy_f32_nb(const float *Wt, int64_t ld, int64_t N, int64_t C,
                                                              const float *const *as, float *const *ys, const int nb) {
    const int64_t NV = N / VW * VW, C4 = C / 4 * 4;
    for (int64_t c = 0; c < C4; c++) {
        const float *w = Wt + c * ld;
        vf s[4];
        for (int b = 0; b < nb; b++) s[b] = vf_set1(as[b][c]);
        for (int64_t i = 0; i < NV; i += VW) {
            const vf v = ld_f32(w + i);
            for (int b = 0; b < nb; b++) vf_store(ys[b] + i, vf_fma(v, s[b], vf_load(ys[b] + i)));
        }
    }
    for (int b = 0; b < nb; b++) {
        if (NV < N) axpy_f32(Wt + NV, ld, N - NV, C4, as[b], ys[b] + NV);
        if (C4 < C) axpy_f32(Wt + C4 * ld, ld, N, C - C4, as[b] + C4, ys[b]);
    }
}

static void axpy_f32_rows(const float *Wt, int64_t ld, int64_t N, int64_t C, const float *const *as,
                          float *const *ys, int nb) {
    switch (nb) {
    case 1: axpy_f32(Wt, ld, N, C, as[0], ys[0]); break;
    case 2: axpy_f32_nb(Wt, ld, N, C, as, ys, 2); break;
    case 3: axpy_f32_nb(Wt, ld, N, C, as, ys, 3); break;
    default: axpy_f32_nb(Wt, ld, N, C, as, ys, 4); break;
    }
}
#endif

/* ------------------------------------------------------------------------------------------ */
/* thread pool: the caller is thread 0; workers 1..n-1 run the same job on their share */

typedef void (*job_fn)(void *arg, int64_t part, int64_t parts);

struct Pool;
typedef struct {
    struct Pool *pool;
    int64_t me;
} WorkerArg;

typedef struct Pool {
    pthread_t tid[15];
    int64_t n;                /* threads including the caller */
    long fork_gen;            /* g_fork_gen when the workers were started */
    atomic_long epoch;        /* bumped per job */
    atomic_long done;         /* workers finished with the current epoch */
    atomic_int stop;
    job_fn fn;
    void *arg;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    WorkerArg wa[15];
} Pool;

/* Forks seen (bumped in the child): a pool whose workers were started before the latest fork has
 * none in this process. With OpenMP any fork after the library is loaded counts: GNU OpenMP's team does
 * not survive fork (a child's next parallel region waits for threads that do not exist), and the
 * parent's PyTorch may have started one, so a forked child runs every call on its own thread. The
 * library's only mutable file-level state besides the handler flag. */
static atomic_long g_fork_gen;

static void pool_after_fork_child(void) { atomic_fetch_add(&g_fork_gen, 1); }

/* Registered when the library is loaded, so that a fork before the first context counts too. */
__attribute__((constructor)) static void register_fork_handler(void) { pthread_atfork(NULL, NULL, pool_after_fork_child); }

#ifndef _OPENMP
static void *worker(void *arg) {
    Pool *p = ((WorkerArg *)arg)->pool;
    const int64_t me = ((WorkerArg *)arg)->me;
    long seen = 0;
    for (;;) {
        long e;
        int spins = 0;
        while ((e = atomic_load_explicit(&p->epoch, memory_order_acquire)) == seen) {
            if (atomic_load(&p->stop)) return NULL;
            if (++spins < 20000) {
#if defined(WIDE_AVX512) || defined(WIDE_AVX2)
                _mm_pause();
#endif
                continue;
            }
            pthread_mutex_lock(&p->mu); /* idle between tokens: sleep, do not burn the core */
            while (atomic_load_explicit(&p->epoch, memory_order_acquire) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->cv, &p->mu);
            pthread_mutex_unlock(&p->mu);
            spins = 0;
        }
        seen = e;
        p->fn(p->arg, me, p->n);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
    }
}

/* A forked child has none of the parent's workers: its pools run single-threaded until resized. */
static void pool_check_fork(Pool *p) {
    if (p->n > 1 && p->fork_gen != atomic_load(&g_fork_gen)) {
        p->n = 1;
        pthread_mutex_init(&p->mu, NULL);
        pthread_cond_init(&p->cv, NULL);
    }
}

#endif

static void pool_init(Pool *p) {
    memset(p, 0, sizeof(*p));
    p->n = 1;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
}

static void pool_resize(Pool *p, int64_t n) {
    if (n < 1) n = 1;
    if (n > 16) n = 16;
#ifdef _OPENMP
    p->n = n; /* the OpenMP runtime owns the threads */
#else
    pool_check_fork(p);
    if (n == p->n) return;
    if (p->n > 1) { /* stop the old workers */
        pthread_mutex_lock(&p->mu);
        atomic_store(&p->stop, 1);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        for (int64_t i = 0; i < p->n - 1; i++) pthread_join(p->tid[i], NULL);
    }
    atomic_store(&p->stop, 0);
    atomic_store(&p->epoch, 0);
    p->n = n;
    p->fork_gen = atomic_load(&g_fork_gen);
    for (int64_t i = 0; i < n - 1; i++) {
        p->wa[i] = (WorkerArg){p, i + 1};
        pthread_create(&p->tid[i], NULL, worker, &p->wa[i]);
    }
#endif
}

/* Run fn on parts 0..n-1 (part 0 on the caller) and wait for all. With OpenMP the parts are the
 * threads of one parallel region (fewer than n if the runtime gives fewer; every job splits its work
 * by the parts it is told). */
static void pool_run(Pool *p, job_fn fn, void *arg) {
#ifdef _OPENMP
    if (p->n <= 1 || atomic_load(&g_fork_gen)) {
        fn(arg, 0, 1);
        return;
    }
#pragma omp parallel num_threads(p->n)
    fn(arg, omp_get_thread_num(), omp_get_num_threads());
#else
    pool_check_fork(p);
    if (p->n <= 1) {
        fn(arg, 0, 1);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add_explicit(&p->epoch, 1, memory_order_release);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    fn(arg, 0, p->n);
    while (atomic_load_explicit(&p->done, memory_order_acquire) < p->n - 1) {
#if defined(WIDE_AVX512) || defined(WIDE_AVX2)
        _mm_pause();
#endif
    }
#endif
}

/* What a call mutates besides its outputs: the thread pool and the prepared-vector buffers. One
 * per caller (wide_ctx_new; runtime/cpu_native.py keeps one per process), used by one thread at a
 * time. */
#define WIDE_MAX_BATCH 64 /* rows of one batched step: a group's rows are one uint64_t bit set */

typedef struct {
    Pool pool;
    VecBuf vec[WIDE_MAX_BATCH]; /* one per batch row */
    uint8_t *masks;             /* the batch's execute decisions of one layer (see layer_step) */
    int64_t masks_cap;
} WCtx;

/* Weight bytes (int8 / int4: with their scales) of `rows` rows of width K: what a projection reads. */
static inline int64_t wbytes(int64_t fmt, int64_t rows, int64_t K) {
    if (fmt == FMT_I8) return rows * K + rows * (K / QBLOCK) * 4;
    if (fmt == FMT_I4) return rows * (K / 2) + rows * (K / QBLOCK) * 2;
    return rows * K * (fmt == FMT_F32 ? 4 : 2);
}

/* Weight rows of width K whose bytes fill about 16 KiB (a multiple of 8, 8..256): in a batch, every
 * row that executes a group multiplies such a chunk while it sits in L1/L2, so the group's weights
 * come from memory once per step. */
static inline int64_t chunk_rows(int64_t fmt, int64_t K) {
    int64_t n = 16384 / wbytes(fmt, 1, K) / 8 * 8;
    return n < 8 ? 8 : n > 256 ? 256 : n;
}

/* ys[b][r] = W[r] . xs[b] for the rows r in [r0, r1) and every batch row b in `set` (bit b). */
static void rows_dot_set(int64_t fmt, const void *W, const void *S, int64_t K, int64_t r0, int64_t r1,
                         uint64_t set, const Vec *xs, float *const *ys) {
    if (!set) return;
    if (!(set & (set - 1))) { /* one row: one call over the whole range */
        const int b = __builtin_ctzll(set);
        rows_dot(fmt, W, S, K, r0, r1, &xs[b], ys[b] + r0);
        return;
    }
#ifdef VW
    if (fmt == FMT_F32) { /* up to 4 batch rows per pass over a block of W (dot_f32_rows) */
        int bs[WIDE_MAX_BATCH], nbs = 0;
        for (uint64_t t = set; t; t &= t - 1) bs[nbs++] = __builtin_ctzll(t);
        /* more than 4 rows: blocks of W small enough to stay in L1 between the passes */
        const int64_t ch = nbs <= 4 ? r1 - r0 : chunk_rows(fmt, K);
        for (int64_t a = r0; a < r1; a += ch) {
            const int64_t e = a + ch < r1 ? a + ch : r1;
            for (int i = 0; i < nbs; i += 4) {
                const int nb = nbs - i < 4 ? nbs - i : 4;
                const float *xp[4];
                float *yp[4];
                for (int q = 0; q < nb; q++) { xp[q] = xs[bs[i + q]].x; yp[q] = ys[bs[i + q]] + a; }
                dot_f32_rows((const float *)W + a * K, K, e - a, xp, yp, nb);
            }
        }
        return;
    }
#endif
    const int64_t ch = chunk_rows(fmt, K);
    for (int64_t a = r0; a < r1; a += ch) {
        const int64_t e = a + ch < r1 ? a + ch : r1;
        for (uint64_t t = set; t; t &= t - 1) {
            const int b = __builtin_ctzll(t);
            rows_dot(fmt, W, S, K, a, e, &xs[b], ys[b] + a);
        }
    }
}

/* A projection job over the rows of a batch, each run of weight rows or groups multiplied by the
 * batch rows that execute it (sets[r], bit b = batch row b):
 * kind 0: rows [r0, r1) of an axis-n projection, ys[b] indexed by weight row, split by rows;
 * kind 1: float axis-k accumulate ys[b][0:N] += xs[b][groups] @ w_t[groups], split by columns;
 * kind 2: axis-k in per-group blocks [GROUPS, N, g] (int8, int4, or bf16 so laid out), split by rows. */
typedef struct {
    int64_t kind, fmt, K, N, g, nruns;
    const void *W;
    const void *S;         /* scales: fp32 (int8), bf16 (int4) or NULL */
    const Vec *xs;         /* [B] kind 0: the input; kind 1, 2: the activations of the whole reduction axis */
    float *const *ys;      /* [B] */
    const int64_t *runs;   /* [nruns][2]: kind 0 row ranges, kind 1, 2 group ranges [j0, j1) */
    const uint64_t *sets;  /* [nruns] */
} ProjJob;

static void split(int64_t n, int64_t part, int64_t parts, int64_t align, int64_t *lo, int64_t *hi) {
    int64_t per = (n + parts - 1) / parts;
    per = (per + align - 1) / align * align;
    *lo = part * per < n ? part * per : n;
    *hi = (part + 1) * per < n ? (part + 1) * per : n;
}

static void proj_job(void *arg, int64_t part, int64_t parts) {
    ProjJob *j = (ProjJob *)arg;
    int64_t lo, hi;
    if (j->kind == 0) { /* rows of the ranges, concatenated, split evenly */
        int64_t total = 0;
        for (int64_t r = 0; r < j->nruns; r++) total += j->runs[2 * r + 1] - j->runs[2 * r];
        split(total, part, parts, 16, &lo, &hi);
        int64_t at = 0;
        for (int64_t r = 0; r < j->nruns && at < hi; r++) {
            int64_t r0 = j->runs[2 * r], n = j->runs[2 * r + 1] - r0;
            int64_t a = lo > at ? lo - at : 0, b = hi - at < n ? hi - at : n;
            if (b > a) rows_dot_set(j->fmt, j->W, j->S, j->K, r0 + a, r0 + b, j->sets[r], j->xs, j->ys);
            at += n;
        }
        return;
    }
    split(j->N, part, parts, 16, &lo, &hi); /* output columns (float) or rows (blocks) of this part */
    if (hi <= lo) return;
    for (int64_t r = 0; r < j->nruns; r++) {
        const int64_t j0 = j->runs[2 * r], j1 = j->runs[2 * r + 1];
        const uint64_t set = j->sets[r];
        const int one = !(set & (set - 1));
        if (j->kind == 1) {
            /* w_t [K, N]: rows [j0 g, j1 g); this part's columns [lo, hi) of each row. Several batch
             * rows take the w_t rows in chunks of a multiple of 4 (AXPY_BODY's step), which leaves
             * every output's sum in the order of the one-call form. */
            const int64_t c0 = j0 * j->g, C = (j1 - j0) * j->g, esz = j->fmt == FMT_F32 ? 4 : 2;
#ifdef VW
            if (j->fmt == FMT_F32 && !one) { /* up to 4 batch rows per pass (axpy_f32_rows) */
                int bs[WIDE_MAX_BATCH], nbs = 0;
                for (uint64_t t = set; t; t &= t - 1) bs[nbs++] = __builtin_ctzll(t);
                /* more than 4 rows: blocks of w_t rows that stay in L2 between the passes */
                int64_t chk = nbs <= 4 ? C : 131072 / ((hi - lo) * esz) / 4 * 4;
                if (chk < 4) chk = 4;
                for (int64_t cc = 0; cc < C; cc += chk) {
                    const int64_t n = cc + chk < C ? chk : C - cc;
                    for (int i = 0; i < nbs; i += 4) {
                        const int nb = nbs - i < 4 ? nbs - i : 4;
                        const float *ap[4];
                        float *yp[4];
                        for (int q = 0; q < nb; q++) { ap[q] = j->xs[bs[i + q]].x + c0 + cc; yp[q] = j->ys[bs[i + q]] + lo; }
                        axpy_f32_rows((const float *)j->W + (c0 + cc) * j->N + lo, j->N, hi - lo, n, ap, yp, nb);
                    }
                }
                continue;
            }
#endif
            int64_t ch = one ? C : 16384 / ((hi - lo) * esz) / 4 * 4;
            if (ch < 4) ch = 4;
            for (int64_t cc = 0; cc < C; cc += ch) {
                const int64_t n = cc + ch < C ? ch : C - cc;
                for (uint64_t t = set; t; t &= t - 1) {
                    const int b = __builtin_ctzll(t);
                    const float *a = j->xs[b].x + c0 + cc;
                    float *y = j->ys[b] + lo;
                    if (j->fmt == FMT_F32) axpy_f32((const float *)j->W + (c0 + cc) * j->N + lo, j->N, hi - lo, n, a, y);
                    else axpy_bf16((const uint16_t *)j->W + (c0 + cc) * j->N + lo, j->N, hi - lo, n, a, y);
                }
            }
        } else {
            /* blocks [GROUPS, N, g] (int8 / int4 with scales s [GROUPS, N, g / 32], or bf16): rows
             * [lo, hi) of each active block */
            float tmp[256];
            const size_t rowb = j->fmt == FMT_I8 ? (size_t)j->g : j->fmt == FMT_I4 ? (size_t)j->g / 2 : 2 * (size_t)j->g;
            const int64_t ch = one ? 256 : chunk_rows(j->fmt, j->g);
            for (int64_t jj = j0; jj < j1; jj++) {
                const void *q = (const char *)j->W + (size_t)(jj * j->N) * rowb;
                const size_t soff = (size_t)(jj * j->N * (j->g / QBLOCK)) * (j->fmt == FMT_I4 ? 2 : 4);
                const void *s = j->S ? (const char *)j->S + soff : NULL; /* [N, g / 32] */
                for (int64_t r0 = lo; r0 < hi; r0 += ch) {
                    const int64_t r1 = r0 + ch < hi ? r0 + ch : hi;
                    for (uint64_t t = set; t; t &= t - 1) {
                        const int b = __builtin_ctzll(t);
                        Vec vj = vec_slice(&j->xs[b], jj * j->g, j->g);
                        rows_dot(j->fmt, q, s, j->g, r0, r1, &vj, tmp);
                        float *y = j->ys[b];
                        for (int64_t i = 0; i < r1 - r0; i++) y[r0 + i] += tmp[i];
                    }
                }
            }
        }
    }
}

/* ys[b][r] = W[r] . xs[b] for the rows r of the ranges [runs[2i], runs[2i+1]) and the batch rows
 * of sets[i]: one dispatch to the pool for all of them. */
static void run_rows_sets(Pool *p, int64_t fmt, const void *W, const void *S, int64_t K, const int64_t *runs,
                          const uint64_t *sets, int64_t nruns, const Vec *xs, float *const *ys) {
    int64_t total = 0;
    for (int64_t r = 0; r < nruns; r++) total += runs[2 * r + 1] - runs[2 * r];
    if (total <= 0) return;
    ProjJob j = {0, fmt, K, 0, 0, nruns, W, S, xs, ys, runs, sets};
    if (p->n > 1 && total >= 64) pool_run(p, proj_job, &j);
    else proj_job(&j, 0, 1);
}

/* ys[b][0:N] += xs[b][groups] @ W[groups] for the runs of groups [j0, j1) and the batch rows of
 * sets (axis-k projection); blocked: W is [GROUPS, N, g] (always for int8 / int4; bf16 when the
 * caller laid it out so), else w_t [K, N]. */
static void run_k_sets(Pool *p, int64_t fmt, int64_t blocked, const void *W, const void *S, int64_t N, int64_t g,
                       const int64_t *runs, const uint64_t *sets, int64_t nruns, const Vec *xs, float *const *ys) {
    if (nruns == 0) return;
    ProjJob j = {blocked || fmt == FMT_I8 || fmt == FMT_I4 ? 2 : 1, fmt, 0, N, g, nruns, W, S, xs, ys, runs, sets};
    if (p->n > 1) pool_run(p, proj_job, &j);
    else proj_job(&j, 0, 1);
}

/* ------------------------------------------------------------------------------------------ */
/* layer pieces */

/* HF LlamaRMSNorm: statistics in fp32; with bf16 compute the normalised value is rounded to bf16
 * before the (bf16) weight multiply, as torch does; f32w: Gemma3RMSNorm (w = 1 + its weight, fp32),
 * the fp32 product rounded once. */
static void rms_norm(const float *x, const float *w, int64_t n, float eps, int64_t bf16, int64_t f32w, float *out) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float r = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    if (bf16 && f32w) for (int64_t i = 0; i < n; i++) out[i] = round_bf16(x[i] * r * w[i]);
    else if (bf16) for (int64_t i = 0; i < n; i++) out[i] = round_bf16(w[i] * round_bf16(x[i] * r));
    else for (int64_t i = 0; i < n; i++) out[i] = x[i] * (r * w[i]);
}

/* GELU with the tanh approximation (torch's gelu(approximate="tanh"), Gemma 3's gelu_pytorch_tanh). */
static inline float gelu_tanh(float x) {
    const float k = 0.7978845608028654f; /* sqrt(2 / pi) */
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

/* Execute decisions of one module into ex[G] (1 = execute); returns the number executed.
 * Counts router multiply-adds and the module's decisions in the sparsity statistics. */
static int64_t decide(const WModel *m, int64_t li, int64_t mod, const float *rw, const float *rb,
                      const uint8_t *keep, int64_t G, const float *x, uint8_t *ex, float *tmp, int64_t *cnt, int live) {
    int64_t n = G;
    if (!live) { /* a padding token (a finished row riding along): executes nothing, decides nothing */
        memset(ex, 0, (size_t)G);
        return 0;
    }
    if (!m->routing || (rw == NULL && keep == NULL)) {
        memset(ex, 1, (size_t)G);
        return G;
    }
    if (keep != NULL) { /* a static mask, or decisions forced for this step, replace the router */
        n = 0;
        for (int64_t j = 0; j < G; j++) n += ex[j] = keep[j] != 0;
    } else {
        dot_f32(rw, m->D, G, x, tmp);
        cnt[CNT_ROUTER_MACS] += G * m->D;
        n = 0;
        for (int64_t j = 0; j < G; j++) n += ex[j] = (tmp[j] + rb[j]) >= 0.0f;
    }
    if (m->stat_decisions != NULL) {
        m->stat_decisions[li * 2 + mod] += (double)G;
        m->stat_skipped[li * 2 + mod] += (double)(G - n);
    }
    return n;
}

/* Runs [j0, j1) of adjacent groups that the same nonempty set of batch rows executes (ex [B][G],
 * sets[r] bit b = batch row b); returns how many runs. */
static int64_t set_runs(const uint8_t *ex, int64_t B, int64_t G, int64_t *runs, uint64_t *sets) {
    int64_t nr = 0;
    for (int64_t j = 0; j < G; j++) {
        uint64_t t = 0;
        for (int64_t b = 0; b < B; b++) t |= (uint64_t)(ex[b * G + j] != 0) << b;
        if (!t) continue;
        if (nr > 0 && runs[2 * nr - 1] == j && sets[nr - 1] == t) {
            runs[2 * nr - 1] = j + 1;
        } else {
            runs[2 * nr] = j;
            runs[2 * nr + 1] = j + 1;
            sets[nr++] = t;
        }
    }
    return nr;
}

/* x += sum over skipped groups j of standin[j] + (h . si[j][r]) so[j][r] summed over r < R (fp32
 * sums, rounded like the torch path). si / so [G][R][D] are the low-rank stand-in maps of the
 * module's normed input h [D] (NULL: constant stand-ins only). Returns the maps' multiply-adds. */
static int64_t add_standins(const float *st, const float *si, const float *so, int64_t R, const uint8_t *ex,
                            int64_t G, int64_t D, int64_t bf16, const float *h, float *x, float *tmp) {
    if (st == NULL) return 0;
    int any = 0;
    for (int64_t j = 0; j < G; j++) any |= !ex[j];
    if (!any) return 0;
    int64_t macs = 0;
    memset(tmp, 0, (size_t)D * sizeof(float));
    for (int64_t j = 0; j < G; j++) {
        if (ex[j]) continue;
        for (int64_t i = 0; i < D; i++) tmp[i] += st[j * D + i];
        if (si == NULL) continue;
        float z[64];
        for (int64_t r0 = 0; r0 < R; r0 += 64) {
            int64_t n = R - r0 < 64 ? R - r0 : 64;
            dot_f32(si + (j * R + r0) * D, D, n, h, z);
            for (int64_t r = 0; r < n; r++) {
                const float *u = so + (j * R + r0 + r) * D;
                for (int64_t i = 0; i < D; i++) tmp[i] += z[r] * u[i];
            }
        }
        macs += 2 * R * D;
    }
    for (int64_t i = 0; i < D; i++) x[i] = bf16 ? round_bf16(x[i] + round_bf16(tmp[i])) : x[i] + tmp[i];
    return macs;
}

/* A sandwich-norm block's contribution (Gemma 3; routing/layer.py's sublayer_output): x += norm(y +
 * the stand-ins of the skipped groups), norm with the block's output weights w. y [D]: the block
 * output (fp32 sums, rounded to bf16 first with bf16 activations: the projection's output dtype),
 * overwritten; h: the block's normed input (low-rank maps); tmp [D]. The caller skips a row that
 * executes no group (it adds nothing). Returns the stand-in maps' multiply-adds. */
static int64_t add_normed_block(const WModel *m, const float *w, const float *st, const float *si, const float *so,
                                int64_t R, const uint8_t *ex, int64_t G, const float *h, float *y, float *x, float *tmp) {
    const int64_t D = m->D, bf = m->act_bf16;
    if (bf) for (int64_t i = 0; i < D; i++) y[i] = round_bf16(y[i]);
    int64_t macs = add_standins(st, si, so, R, ex, G, D, bf, h, y, tmp);
    rms_norm(y, w, D, m->eps, bf, m->norm_fp32, tmp);
    for (int64_t i = 0; i < D; i++) x[i] = bf ? round_bf16(x[i] + tmp[i]) : x[i] + tmp[i];
    return macs;
}

/* Bytes of the low-rank stand-in maps (fp32 [R][D] in and out per group) one step reads: those of
 * every group that some live row of the batch skips, once for all of them. */
static int64_t standin_map_bytes(int64_t R, const uint8_t *ex, int64_t B, uint64_t live, int64_t G, int64_t D) {
    if (R == 0) return 0;
    int64_t n = 0;
    for (int64_t j = 0; j < G; j++) {
        int skipped = 0;
        for (int64_t b = 0; b < B && !skipped; b++) skipped = (live >> b & 1) && !ex[b * G + j];
        n += skipped;
    }
    return n * 2 * R * D * (int64_t)sizeof(float);
}

/* HF rotate_half RoPE on one head x[d] with tables cs, sn [d / 2]. */
static void rope(float *x, int64_t d, const float *cs, const float *sn, int64_t bf16) {
    int64_t h = d / 2;
    for (int64_t i = 0; i < h; i++) {
        float a = x[i], b = x[i + h];
        float ra = a * cs[i] - b * sn[i], rb = b * cs[i] + a * sn[i];
        x[i] = bf16 ? round_bf16(ra) : ra;
        x[i + h] = bf16 ? round_bf16(rb) : rb;
    }
}

/* q . k for one cached key (fp32 or bf16 cache), and o += p v for one cached value. */
static inline float dot_head(const float *q, const void *k, int64_t d, int64_t bf) {
#ifdef VW
    if (d % VW == 0) {
        vf a = vf_zero();
        for (int64_t i = 0; i < d; i += VW)
            a = vf_fma(vf_load(q + i), bf ? ld_bf16((const uint16_t *)k + i) : ld_f32((const float *)k + i), a);
        return vf_sum(a);
    }
#endif
    float s = 0.f;
    for (int64_t i = 0; i < d; i++) s += q[i] * load_act(k, i, bf);
    return s;
}

static inline void axpy_head(float *o, float p, const void *v, int64_t d, int64_t bf) {
#ifdef VW
    if (d % VW == 0) {
        const vf pv = vf_set1(p);
        for (int64_t i = 0; i < d; i += VW)
            vf_store(o + i, vf_fma(bf ? ld_bf16((const uint16_t *)v + i) : ld_f32((const float *)v + i), pv, vf_load(o + i)));
        return;
    }
#endif
    for (int64_t i = 0; i < d; i++) o[i] += p * load_act(v, i, bf);
}

typedef struct {
    const WModel *m;
    const WLayer *L;
    int64_t B, lo, S, smax;  /* keys in slots [lo, S) */
    float *const *q;         /* [B] -> [H d] */
    float *const *out;       /* [B] -> [H d] */
    const uint8_t *hx;       /* [B][H] head executes */
    const uint8_t *kvalid;   /* [B][max_len] slot holds a real token, or NULL: every slot does */
    int64_t kv_row;          /* elements between two batch rows' caches: Hkv max_len d */
    float *scores;           /* [parts][smax] */
    float scale;
} AttnJob;

static void attn_job(void *arg, int64_t part, int64_t parts) {
    AttnJob *a = (AttnJob *)arg;
    const WLayer *L = a->L;
    const int64_t H = L->H, d = L->d, hpk = L->H / L->Hkv, ml = a->m->max_len;
    const int64_t bf = a->m->act_bf16;
    const size_t esz = bf ? 2 : 4;
    float *sc = a->scores + part * a->smax;
    int64_t lo, hi;
    split(a->B * H, part, parts, 1, &lo, &hi); /* (row, head) pairs */
    for (int64_t bh = lo; bh < hi; bh++) {
        const int64_t b = bh / H, h = bh % H;
        float *o = a->out[b] + h * d;
        if (!a->hx[bh]) { memset(o, 0, (size_t)d * sizeof(float)); continue; }
        const float *q = a->q[b] + h * d;
        const uint8_t *kv_ok = a->kvalid ? a->kvalid + b * ml : NULL;
        const size_t base = (size_t)(b * a->kv_row + (h / hpk) * ml * d);
        const char *kc = (const char *)L->k_cache + base * esz, *vc = (const char *)L->v_cache + base * esz;
        float mx = -INFINITY; /* finite: the step's own slot is always a real token */
        for (int64_t t = a->lo; t < a->S; t++) {
            if (kv_ok && !kv_ok[t]) continue;
            float s = dot_head(q, kc + (size_t)(t * d) * esz, d, bf) * a->scale;
            sc[t] = s;
            if (s > mx) mx = s;
        }
        float sum = 0.f;
        for (int64_t t = a->lo; t < a->S; t++) {
            if (kv_ok && !kv_ok[t]) continue;
            sc[t] = expf(sc[t] - mx);
            sum += sc[t];
        }
        float inv = 1.0f / sum;
        for (int64_t i = 0; i < d; i++) o[i] = 0.f;
        for (int64_t t = a->lo; t < a->S; t++)
            if (!kv_ok || kv_ok[t]) axpy_head(o, sc[t] * inv, vc + (size_t)(t * d) * esz, d, bf);
        if (bf) for (int64_t i = 0; i < d; i++) o[i] = round_bf16(o[i]);
    }
}

/* The routed O projection of B rows: ys[b][0:N] += att[b][groups] @ W[groups] over the head groups
 * row b executes (ex [B][G], groups of `cols` channels). cnt: the rows' multiply-adds and the bytes
 * of the union of their groups. */
static void out_sets(WCtx *c, int64_t fmt, int64_t blocked, const void *W, const void *S, int64_t N, int64_t cols,
                     int64_t G, int64_t B, float *const *att, const uint8_t *ex, float *const *ys, int64_t *cnt) {
    int64_t runs[2 * 4096];
    uint64_t sets[4096];
    Vec vs[WIDE_MAX_BATCH];
    for (int64_t b = 0; b < B; b++) vs[b] = prepare_vec(&c->vec[b], fmt, att[b], G * cols);
    const int64_t nr = set_runs(ex, B, G, runs, sets);
    run_k_sets(&c->pool, fmt, blocked, W, S, N, cols, runs, sets, nr, vs, ys);
    for (int64_t r = 0; r < nr; r++) {
        const int64_t ng = runs[2 * r + 1] - runs[2 * r];
        cnt[CNT_MACS] += __builtin_popcountll(sets[r]) * ng * cols * N;
        cnt[CNT_WEIGHT_BYTES] += ng * wbytes(fmt, N, cols);
    }
}

/* The routed gated FFN of B rows: ys[b][0:D] += down(act(gate h[b]) * up h[b]) over the groups
 * row b executes (ex [B][GF], groups of fg channels), act silu (SwiGLU) or, with gelu, GELU-tanh;
 * gu: [GF 2 fg, D] group-major gate | up rows; hid[b]: scratch of GF fg 3 floats; bf: round like the
 * bf16 PyTorch path. cnt as out_sets. */
static void ffn_sets(WCtx *c, int64_t fmt, int64_t blocked, const void *gu, const void *gu_s, const void *down,
                     const void *down_s, int64_t D, int64_t GF, int64_t fg, int64_t bf, int64_t gelu, int64_t B,
                     float *const *h, const uint8_t *ex, float *const *hid, float *const *ys, int64_t *cnt) {
    int64_t runs[2 * 4096], rows[2 * 4096];
    uint64_t sets[4096];
    Vec vs[WIDE_MAX_BATCH];
    for (int64_t b = 0; b < B; b++) vs[b] = prepare_vec(&c->vec[b], fmt, h[b], D);
    const int64_t nr = set_runs(ex, B, GF, runs, sets);
    /* gate|up rows of each run land group-major in hid: [j][gate fg | up fg] */
    for (int64_t r = 0; r < 2 * nr; r++) rows[r] = runs[r] * 2 * fg;
    run_rows_sets(&c->pool, fmt, gu, gu_s, D, rows, sets, nr, vs, hid);
    for (int64_t r = 0; r < nr; r++) {
        const int64_t ng = runs[2 * r + 1] - runs[2 * r];
        cnt[CNT_MACS] += __builtin_popcountll(sets[r]) * ng * 3 * fg * D;
        cnt[CNT_WEIGHT_BYTES] += wbytes(fmt, ng * 2 * fg, D) + ng * wbytes(fmt, D, fg);
    }
    /* act(gate) * up into act [GF fg] (the reduction axis of down), each row's active groups only */
    for (int64_t b = 0; b < B; b++) {
        float *act = hid[b] + GF * 2 * fg;
        for (int64_t j = 0; j < GF; j++) {
            if (!ex[b * GF + j]) continue;
            const float *g = hid[b] + j * 2 * fg, *u = g + fg;
            float *o = act + j * fg;
            for (int64_t i = 0; i < fg; i++) {
                float gv = bf ? round_bf16(g[i]) : g[i], uv = bf ? round_bf16(u[i]) : u[i];
                float sv = gelu ? gelu_tanh(gv) : gv / (1.0f + expf(-gv));
                o[i] = bf ? round_bf16(round_bf16(sv) * uv) : sv * uv;
            }
        }
        vs[b] = prepare_vec(&c->vec[b], fmt, act, GF * fg);
    }
    run_k_sets(&c->pool, fmt, blocked, down, down_s, D, fg, runs, sets, nr, vs, ys);
}

/* Floats of one batch row's layer scratch (see layer_step). */
static int64_t row_scratch_floats(const WModel *m) {
    int64_t mx = 0;
    for (int64_t l = 0; l < m->L; l++) {
        const WLayer *L = &m->layers[l];
        int64_t need = (L->H + 2 * L->Hkv) * L->d + L->H * L->d + L->GF * L->fg * 3 + L->d + 32;
        if (need > mx) mx = need;
    }
    return 3 * m->D + mx;
}

/* Scratch floats a step of B rows needs (wide_decode_batch's `scratch`). */
int64_t wide_decode_scratch_floats(const WModel *m, int64_t B) {
    return B * (m->D + row_scratch_floats(m)) + 16 * m->max_len + 16;
}

/* One layer for the B rows of a batch, one new token each: xs [B][D] (the residual streams, fp32)
 * updated in place. Each row executes its own groups; a group's weights are read once for all the
 * rows that execute it (ProjJob). Row b's token sits at RoPE position pos[b] in cache slot `slot`
 * of its cache (rows kv_row elements apart); kvalid [B][max_len] marks the slots holding real
 * tokens (NULL: all). rs: B row scratches of rstride floats; scores: the attention's [16][max_len].
 * cnt: executed multiply-adds of every row; weight bytes of the union of the rows' groups. */
static void layer_step(WCtx *c, const WModel *m, int64_t li, int64_t B, float *xs, const int64_t *pos, int64_t slot,
                       const uint8_t *kvalid, uint64_t live, float *rs, int64_t rstride, float *scores, int64_t *cnt) {
    const WLayer *L = &m->layers[li];
    const int64_t D = m->D, H = L->H, Hkv = L->Hkv, d = L->d, bf = m->act_bf16, fmt = m->wfmt;
    const int64_t cols = L->ag * d, Nq = H * d, Nkv = Hkv * d, fg = L->fg, GA = L->GA, GF = L->GF;
    const int64_t kv_row = Hkv * m->max_len * d;
    uint8_t *exa = c->masks, *exf = exa + B * GA, *hx = exf + B * GF; /* [B][GA], [B][GF], [B][H] */
    int64_t runs[2 * 4096 + 2], rows[2 * 4096 + 2];
    uint64_t sets[4096 + 1];
    Vec vs[WIDE_MAX_BATCH];
    float *ys[WIDE_MAX_BATCH], *qs[WIDE_MAX_BATCH], *atts[WIDE_MAX_BATCH];
    int64_t nex[WIDE_MAX_BATCH]; /* groups row b executes in the current block */
    /* row b's scratch: h [D], y [D], tmpD [D], qkv [Nq + 2 Nkv], att [Nq], hid [GF fg 3], cs, sn [d / 2] */
#define X(b) (xs + (b) * D)
#define H_(b) (rs + (b) * rstride)
#define Y(b) (H_(b) + D)
#define TMP(b) (H_(b) + 2 * D)
#define QKV(b) (H_(b) + 3 * D)
#define ATT(b) (QKV(b) + Nq + 2 * Nkv)
#define HID(b) (ATT(b) + Nq)
#define CS(b) (HID(b) + GF * fg * 3)
#define SN(b) (CS(b) + d / 2)

    /* attention: routers on the residual streams entering the layer (att holds their logits) */
    for (int64_t b = 0; b < B; b++) {
        const int lv = (int)(live >> b & 1);
        const uint8_t *keep = L->keep_a ? L->keep_a + b * L->keep_a_stride : NULL;
        int64_t na = nex[b] = decide(m, li, 0, L->ra_w, L->ra_b, keep, GA, X(b), exa + b * GA, ATT(b), cnt, lv);
        rms_norm(X(b), L->ln_attn, D, m->eps, bf, m->norm_fp32, H_(b));
        vs[b] = prepare_vec(&c->vec[b], fmt, H_(b), D);
        ys[b] = qs[b] = QKV(b);
        atts[b] = ATT(b);
        cnt[CNT_MACS] += (na * cols + (lv ? 2 * Nkv : 0)) * D;
    }
    int64_t nr = set_runs(exa, B, GA, runs, sets);
    {   /* Q rows of the active head groups and every token's K/V rows: one dispatch */
        int64_t nrows = 2 * Nkv;
        for (int64_t r = 0; r < nr; r++) {
            rows[2 * r] = runs[2 * r] * cols;
            rows[2 * r + 1] = runs[2 * r + 1] * cols;
            nrows += rows[2 * r + 1] - rows[2 * r];
        }
        rows[2 * nr] = Nq;
        rows[2 * nr + 1] = Nq + 2 * Nkv;
        sets[nr] = live;
        run_rows_sets(&c->pool, fmt, L->qkv, L->qkv_s, D, rows, sets, nr + 1, vs, ys);
        cnt[CNT_WEIGHT_BYTES] += wbytes(fmt, nrows, D);
    }
    int64_t active_heads = 0;
    for (int64_t b = 0; b < B; b++) {
        uint8_t *hxb = hx + b * H;
        if (!(live >> b & 1)) { memset(hxb, 0, (size_t)H); continue; }
        float *qkv = QKV(b), *cs = CS(b), *sn = SN(b);
        for (int64_t j = 0; j < GA; j++)
            for (int64_t hh = j * L->ag; hh < (j + 1) * L->ag; hh++) active_heads += hxb[hh] = exa[b * GA + j];
        for (int64_t i = 0; i < Nq + 2 * Nkv; i++) {
            if (i < Nq && !hxb[i / d]) continue;
            float v = qkv[i];
            if (L->bqkv) v = bf ? round_bf16(v) + L->bqkv[i] : v + L->bqkv[i];
            qkv[i] = bf ? round_bf16(v) : v;
        }
        /* RoPE tables as HF computes them: fp32 angle, cos/sin times the attention scaling */
        for (int64_t i = 0; i < d / 2; i++) {
            float ang = (float)pos[b] * L->inv_freq[i];
            float cv = cosf(ang) * L->rope_scale, sv = sinf(ang) * L->rope_scale;
            cs[i] = bf ? round_bf16(cv) : cv;
            sn[i] = bf ? round_bf16(sv) : sv;
        }
        for (int64_t hh = 0; hh < H + Hkv; hh++) {
            if (hh < H && !hxb[hh]) continue;
            float *v = qkv + hh * d;
            if (L->q_norm) rms_norm(v, hh < H ? L->q_norm : L->k_norm, d, m->eps, bf, m->norm_fp32, v);
            rope(v, d, cs, sn, bf);
        }
        /* the cache: every token's K and V, whatever its routing */
        for (int64_t kv = 0; kv < Hkv; kv++) {
            int64_t base = b * kv_row + (kv * m->max_len + slot) * d;
            const float *k = qkv + Nq + kv * d, *v = qkv + Nq + Nkv + kv * d;
            if (bf) {
                uint16_t *kc = (uint16_t *)L->k_cache + base, *vc = (uint16_t *)L->v_cache + base;
                for (int64_t i = 0; i < d; i++) { kc[i] = f32_to_bf16(k[i]); vc[i] = f32_to_bf16(v[i]); }
            } else {
                memcpy((float *)L->k_cache + base, k, (size_t)d * sizeof(float));
                memcpy((float *)L->v_cache + base, v, (size_t)d * sizeof(float));
            }
        }
    }
    int64_t S = slot + 1, lo = 0;
    if (L->window > 0 && S - L->window > 0) lo = S - L->window;
    AttnJob aj = {m, L, B, lo, S, m->max_len, qs, atts, hx, kvalid, kv_row, scores, L->attn_scale};
    if (c->pool.n > 1 && active_heads > L->ag) pool_run(&c->pool, attn_job, &aj);
    else attn_job(&aj, 0, 1);
    cnt[CNT_ATTN_MACS] += active_heads * d * 2 * (S - lo);
    /* O projection over each row's active head groups, then the residual add */
    for (int64_t b = 0; b < B; b++) {
        if (L->bo) for (int64_t i = 0; i < D; i++) Y(b)[i] = L->bo[i];
        else memset(Y(b), 0, (size_t)D * sizeof(float));
        ys[b] = Y(b);
    }
    out_sets(c, fmt, L->blocked, L->o, L->o_s, D, cols, GA, B, atts, exa, ys, cnt);
    uint64_t adds = live; /* rows whose block output reaches the residual stream */
    for (int64_t b = 0; b < B; b++) {
        if (!(live >> b & 1)) continue;
        float *x = X(b), *y = Y(b);
        if (L->ln_attn_out != NULL) {
            if (nex[b] == 0) { adds &= ~(1ull << b); continue; } /* nothing to add: no post-norm, no stand-ins */
            cnt[CNT_MACS] += add_normed_block(m, L->ln_attn_out, L->sa, L->sa_in, L->sa_out, L->sa_r, exa + b * GA,
                                              GA, H_(b), y, x, TMP(b));
            continue;
        }
        for (int64_t i = 0; i < D; i++) x[i] = bf ? round_bf16(x[i] + round_bf16(y[i])) : x[i] + y[i];
        cnt[CNT_MACS] += add_standins(L->sa, L->sa_in, L->sa_out, L->sa_r, exa + b * GA, GA, D, bf, H_(b), x,
                                      TMP(b));
    }
    cnt[CNT_WEIGHT_BYTES] += standin_map_bytes(L->sa_in ? L->sa_r : 0, exa, B, adds, GA, D);

    /* FFN: routers on the residual streams after the attention add (hid holds their logits) */
    float *hs[WIDE_MAX_BATCH], *hids[WIDE_MAX_BATCH];
    for (int64_t b = 0; b < B; b++) {
        const uint8_t *keep = L->keep_f ? L->keep_f + b * L->keep_f_stride : NULL;
        nex[b] = decide(m, li, 1, L->rf_w, L->rf_b, keep, GF, X(b), exf + b * GF, HID(b), cnt, (int)(live >> b & 1));
        rms_norm(X(b), L->ln_ffn, D, m->eps, bf, m->norm_fp32, H_(b));
        hs[b] = H_(b);
        hids[b] = HID(b);
        memset(Y(b), 0, (size_t)D * sizeof(float));
        ys[b] = Y(b);
    }
    ffn_sets(c, fmt, L->blocked, L->gu, L->gu_s, L->down, L->down_s, D, GF, fg, bf, L->gelu, B, hs, exf, hids, ys,
             cnt);
    adds = live;
    for (int64_t b = 0; b < B; b++) {
        if (!(live >> b & 1)) continue;
        float *x = X(b), *y = Y(b);
        if (L->ln_ffn_out != NULL) {
            if (nex[b] == 0) { adds &= ~(1ull << b); continue; }
            cnt[CNT_MACS] += add_normed_block(m, L->ln_ffn_out, L->sf, L->sf_in, L->sf_out, L->sf_r, exf + b * GF,
                                              GF, H_(b), y, x, TMP(b));
            continue;
        }
        for (int64_t i = 0; i < D; i++) x[i] = bf ? round_bf16(x[i] + round_bf16(y[i])) : x[i] + y[i];
        cnt[CNT_MACS] += add_standins(L->sf, L->sf_in, L->sf_out, L->sf_r, exf + b * GF, GF, D, bf, H_(b), x,
                                      TMP(b));
    }
    cnt[CNT_WEIGHT_BYTES] += standin_map_bytes(L->sf_in ? L->sf_r : 0, exf, B, adds, GF, D);
#undef X
#undef H_
#undef Y
#undef TMP
#undef QKV
#undef ATT
#undef HID
#undef CS
#undef SN
}

/* ------------------------------------------------------------------------------------------ */
/* Prefill GEMM: out[orow(i), n] (+)= sum_k A[arow(i), k] B(n, k) for i < M, n < N.
 *
 * Why: prefill and batched calls are compute-bound, and the PyTorch CPU build runs bf16 GEMMs far
 * below its fp32 rate (~7 against ~55 GFLOP/s, 1 thread, on an EPYC with AVX512-BF16): the
 * runtime's bf16 and int8 prefill paid ~10x for their format. This kernel runs both formats at the
 * FMA rate (bf16 with AVX512-BF16: vdpbf16ps, twice the multiply-adds per instruction), and gathers
 * the rows a routed group executes (arows) and scatters its outputs (orows) itself, so a
 * mixture-of-groups layer needs no index_select / index_add copies.
 *
 * B is either rows [N, K] (axis-n projections) or w_t [K, N] (axis-k), row stride ldb elements.
 * Per thread, a panel of GEMM_NR output columns is packed k-major once (fp32; bf16 as k-pairs
 * [K/2][NR][2], the operand order of vdpbf16ps, where AVX-512 runs it, else widened to fp32) and
 * swept by all M rows in tiles of GEMM_MR x GEMM_NR held in registers (the outer-product kernel of
 * BLIS / GotoBLAS, without their cache blocking of K: K <= a few thousand here, a panel stays in
 * L2). Threads split the panels. Without AVX-512, bf16
 * activations are widened to fp32 once per call. */

#if defined(WIDE_AVX512)
#define GEMM_NR 32
#define GEMM_MR 8
#define GEMM_BF16_PAIRS 1
#elif defined(WIDE_AVX2)
#define GEMM_NR 16
#define GEMM_MR 6
#define GEMM_BF16_PAIRS 0
#else
#define GEMM_NR 16
#define GEMM_MR 4
#define GEMM_BF16_PAIRS 0
#endif

typedef struct {
    int64_t afmt, bfmt, ofmt, layout, N, K, M, lda, ldb, ldo, accumulate;
    const void *A, *B;
    const int64_t *arows, *orows;
    void *out;
    int64_t err;
} GemmJob;

static inline const void *gemm_arow(const GemmJob *j, int64_t i) {
    int64_t r = j->arows ? j->arows[i] : i;
    return (const char *)j->A + r * j->lda * (j->afmt == FMT_BF16 ? 2 : 4);
}

static inline void *gemm_orow(const GemmJob *j, int64_t i) {
    int64_t r = j->orows ? j->orows[i] : i;
    return (char *)j->out + r * j->ldo * (j->ofmt == FMT_BF16 ? 2 : 4);
}

static inline float gemm_b(const GemmJob *j, int64_t idx) {
    return j->bfmt == FMT_BF16 ? bf16_to_f32(((const uint16_t *)j->B)[idx]) : ((const float *)j->B)[idx];
}

/* Pack columns [n0, n0 + nc) (nc <= GEMM_NR; the rest zero) k-major into P. */
static void gemm_pack(const GemmJob *j, int64_t n0, int64_t nc, void *P) {
    const int64_t K = j->K, ldb = j->ldb;
    if (j->bfmt == FMT_BF16 && GEMM_BF16_PAIRS) {
        const uint16_t *B = (const uint16_t *)j->B;
        uint16_t *p = (uint16_t *)P;
        if (nc < GEMM_NR) memset(p, 0, 2 * K * GEMM_NR);
        if (j->layout == 0) {
            for (int64_t c = 0; c < nc; c++) {
                const uint16_t *b = B + (n0 + c) * ldb;
                for (int64_t k = 0; k < K; k += 2) memcpy(p + k * GEMM_NR + 2 * c, b + k, 4);
            }
        } else {
            for (int64_t k = 0; k < K; k += 2)
                for (int64_t c = 0; c < nc; c++) {
                    p[k * GEMM_NR + 2 * c] = B[k * ldb + n0 + c];
                    p[k * GEMM_NR + 2 * c + 1] = B[(k + 1) * ldb + n0 + c];
                }
        }
        return;
    }
    float *p = (float *)P;
    if (nc < GEMM_NR) memset(p, 0, sizeof(float) * K * GEMM_NR);
    /* one loop per format and layout, branch-free inside, so the compiler vectorizes them */
    if (j->bfmt == FMT_BF16) {
        const uint16_t *B = (const uint16_t *)j->B;
        if (j->layout == 0)
            for (int64_t c = 0; c < nc; c++)
                for (int64_t k = 0; k < K; k++) p[k * GEMM_NR + c] = bf16_to_f32(B[(n0 + c) * ldb + k]);
        else
            for (int64_t k = 0; k < K; k++)
                for (int64_t c = 0; c < nc; c++) p[k * GEMM_NR + c] = bf16_to_f32(B[k * ldb + n0 + c]);
    } else {
        const float *B = (const float *)j->B;
        if (j->layout == 0)
            for (int64_t c = 0; c < nc; c++)
                for (int64_t k = 0; k < K; k++) p[k * GEMM_NR + c] = B[(n0 + c) * ldb + k];
        else
            for (int64_t k = 0; k < K; k++) memcpy(p + k * GEMM_NR, B + k * ldb + n0, sizeof(float) * nc);
    }
}

/* Write one tile row's nc sums s[] to output row i at column n0 (fp32 or bf16, += if accumulate). */
static inline void gemm_store_row(const GemmJob *j, int64_t i, int64_t n0, int64_t nc, const float *s) {
    void *o = gemm_orow(j, i);
    if (j->ofmt == FMT_BF16) {
        uint16_t *ob = (uint16_t *)o + n0;
        for (int64_t c = 0; c < nc; c++) ob[c] = f32_to_bf16(j->accumulate ? bf16_to_f32(ob[c]) + s[c] : s[c]);
    } else {
        float *of = (float *)o + n0;
        if (j->accumulate)
            for (int64_t c = 0; c < nc; c++) of[c] += s[c];
        else
            memcpy(of, s, sizeof(float) * nc);
    }
}

/* One tile: rows [i0, i0 + mr) x the panel's nc columns (j->out already offset to the panel's
 * first column). P: the packed panel. Rows past mr recompute row i0 (not stored), so the kernel
 * has one shape. */
static void gemm_tile(const GemmJob *j, int64_t i0, int64_t mr, const void *P, int64_t nc) {
    const int64_t ps = GEMM_NR;
    const int64_t K = j->K;
    const void *a[GEMM_MR];
    for (int r = 0; r < GEMM_MR; r++) a[r] = gemm_arow(j, i0 + (r < mr ? r : 0));
    float s[GEMM_MR][GEMM_NR];
#if defined(WIDE_AVX512)
    __m512 c[GEMM_MR][2];
    for (int r = 0; r < GEMM_MR; r++) c[r][0] = c[r][1] = _mm512_setzero_ps();
    if (j->afmt == FMT_F32) {
        const float *p = (const float *)P;
        for (int64_t k = 0; k < K; k++) {
            __m512 b0 = _mm512_loadu_ps(p + k * ps), b1 = _mm512_loadu_ps(p + k * ps + 16);
#pragma GCC unroll 8
            for (int r = 0; r < GEMM_MR; r++) {
                __m512 x = _mm512_set1_ps(((const float *)a[r])[k]);
                c[r][0] = _mm512_fmadd_ps(x, b0, c[r][0]);
                c[r][1] = _mm512_fmadd_ps(x, b1, c[r][1]);
            }
        }
    } else {
        const uint16_t *p = (const uint16_t *)P;
        for (int64_t k = 0; k < K; k += 2) {
#ifdef WIDE_BF16DP
            __m512bh b0 = (__m512bh)_mm512_loadu_si512(p + k * GEMM_NR), b1 = (__m512bh)_mm512_loadu_si512(p + k * GEMM_NR + 32);
#pragma GCC unroll 8
            for (int r = 0; r < GEMM_MR; r++) {
                uint32_t pair;
                memcpy(&pair, (const uint16_t *)a[r] + k, 4);
                __m512bh x = (__m512bh)_mm512_set1_epi32((int)pair);
                c[r][0] = _mm512_dpbf16_ps(c[r][0], x, b0);
                c[r][1] = _mm512_dpbf16_ps(c[r][1], x, b1);
            }
#else
            const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000);
            __m512i w0 = _mm512_loadu_si512(p + k * GEMM_NR), w1 = _mm512_loadu_si512(p + k * GEMM_NR + 32);
            __m512 lo0 = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16)), hi0 = _mm512_castsi512_ps(_mm512_and_si512(w0, hi));
            __m512 lo1 = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16)), hi1 = _mm512_castsi512_ps(_mm512_and_si512(w1, hi));
            for (int r = 0; r < GEMM_MR; r++) {
                const uint16_t *ar = (const uint16_t *)a[r];
                __m512 x0 = _mm512_set1_ps(bf16_to_f32(ar[k])), x1 = _mm512_set1_ps(bf16_to_f32(ar[k + 1]));
                c[r][0] = _mm512_fmadd_ps(x1, hi0, _mm512_fmadd_ps(x0, lo0, c[r][0]));
                c[r][1] = _mm512_fmadd_ps(x1, hi1, _mm512_fmadd_ps(x0, lo1, c[r][1]));
            }
#endif
        }
    }
    for (int r = 0; r < GEMM_MR; r++) {
        _mm512_storeu_ps(s[r], c[r][0]);
        _mm512_storeu_ps(s[r] + 16, c[r][1]);
    }
#elif defined(WIDE_AVX2)
    __m256 c[GEMM_MR][2];
    for (int r = 0; r < GEMM_MR; r++) c[r][0] = c[r][1] = _mm256_setzero_ps();
    const float *p = (const float *)P; /* A is fp32 here: bf16 activations were widened up front */
    for (int64_t k = 0; k < K; k++) {
        __m256 b0 = _mm256_loadu_ps(p + k * ps), b1 = _mm256_loadu_ps(p + k * ps + 8);
#pragma GCC unroll 6
        for (int r = 0; r < GEMM_MR; r++) {
            __m256 x = _mm256_broadcast_ss((const float *)a[r] + k);
            c[r][0] = _mm256_fmadd_ps(x, b0, c[r][0]);
            c[r][1] = _mm256_fmadd_ps(x, b1, c[r][1]);
        }
    }
    for (int r = 0; r < GEMM_MR; r++) {
        _mm256_storeu_ps(s[r], c[r][0]);
        _mm256_storeu_ps(s[r] + 8, c[r][1]);
    }
#else
    const float *p = (const float *)P;
    for (int r = 0; r < GEMM_MR; r++)
        for (int c = 0; c < GEMM_NR; c++) s[r][c] = 0.f;
    for (int64_t k = 0; k < K; k++)
        for (int r = 0; r < GEMM_MR; r++) {
            float x = ((const float *)a[r])[k];
            for (int c = 0; c < GEMM_NR; c++) s[r][c] += x * p[k * ps + c];
        }
#endif
    for (int r = 0; r < mr; r++) gemm_store_row(j, i0 + r, 0, nc, s[r]);
}

static void gemm_job(void *arg, int64_t part, int64_t parts) {
    GemmJob *j = (GemmJob *)arg;
    int64_t lo, hi;
    split(j->N, part, parts, GEMM_NR, &lo, &hi);
    if (lo >= hi) return;
    const int64_t es = j->bfmt == FMT_BF16 && GEMM_BF16_PAIRS ? 2 : 4;
    void *P = NULL;
    for (int64_t n0 = lo; n0 < hi; n0 += GEMM_NR) {
        int64_t nc = hi - n0 < GEMM_NR ? hi - n0 : GEMM_NR;
        /* Packed even where fp32 w_t rows could be read in place: strided panel rows ran at
         * ~2/3 of the packed rate (1024 x 3072 x 576, AVX2, 1 thread). */
        if (!P && !(P = aligned_alloc(64, (size_t)(j->K * GEMM_NR * es + 63) / 64 * 64))) {
            j->err = 1;
            return;
        }
        gemm_pack(j, n0, nc, P);
        /* the output column offset n0 goes into the row pointers via a shifted view of out */
        GemmJob jt = *j;
        jt.out = (char *)j->out + n0 * (j->ofmt == FMT_BF16 ? 2 : 4);
        for (int64_t i0 = 0; i0 < j->M; i0 += GEMM_MR)
            gemm_tile(&jt, i0, j->M - i0 < GEMM_MR ? j->M - i0 : GEMM_MR, P, nc);
    }
    free(P);
}

/* Few rows (batched decode): out[i, n] = dot(A[i], B[n]) over rows-layout B, no packing. The calls
 * are bound by reading B once; packing a panel would read it twice and write it once. A is fp32
 * here (widened up front), B fp32 or bf16 (widened on load). Each pair of B rows is read from
 * memory once and reused from L1 by all M rows, four at a time. */
#define GEMM_DOT_M 16

static inline float gemm_dot_tail(const GemmJob *j, const float *a, int64_t n, int64_t k0) {
    float s = 0.f;
    for (int64_t k = k0; k < j->K; k++) s += a[k] * gemm_b(j, n * j->ldb + k);
    return s;
}

#ifdef VW
static inline vf gemm_ldb(const GemmJob *j, int64_t idx) {
    return j->bfmt == FMT_BF16 ? ld_bf16((const uint16_t *)j->B + idx) : ld_f32((const float *)j->B + idx);
}
#endif

static void gemm_dot_job(void *arg, int64_t part, int64_t parts) {
    const GemmJob *j = (const GemmJob *)arg;
    int64_t lo, hi;
    split(j->N, part, parts, 2, &lo, &hi);
    float s[4][2];
    for (int64_t n = lo; n < hi; n += 2) {
        const int64_t nn = hi - n < 2 ? 1 : 2, n1 = n + nn - 1; /* a lone last row is computed twice */
        for (int64_t i0 = 0; i0 < j->M; i0 += 4) {
            const int64_t mr = j->M - i0 < 4 ? j->M - i0 : 4;
            const float *a[4];
            for (int r = 0; r < 4; r++) a[r] = (const float *)gemm_arow(j, i0 + (r < mr ? r : 0));
            int64_t k = 0;
#ifdef VW
            vf c[4][2];
            for (int r = 0; r < 4; r++) c[r][0] = c[r][1] = vf_zero();
            for (; k + VW <= j->K; k += VW) {
                vf b0 = gemm_ldb(j, n * j->ldb + k), b1 = gemm_ldb(j, n1 * j->ldb + k);
                for (int r = 0; r < 4; r++) {
                    vf x = vf_load(a[r] + k);
                    c[r][0] = vf_fma(x, b0, c[r][0]);
                    c[r][1] = vf_fma(x, b1, c[r][1]);
                }
            }
            for (int r = 0; r < 4; r++) s[r][0] = vf_sum(c[r][0]), s[r][1] = vf_sum(c[r][1]);
#else
            for (int r = 0; r < 4; r++) s[r][0] = s[r][1] = 0.f;
#endif
            for (int r = 0; r < mr; r++) {
                float v[2] = {s[r][0] + gemm_dot_tail(j, a[r], n, k), s[r][1] + gemm_dot_tail(j, a[r], n1, k)};
                gemm_store_row(j, i0 + r, n, nn, v);
            }
        }
    }
}

/* Widen bf16 activation rows (gathered by arows) to a dense fp32 [M, K] buffer. */
typedef struct {
    const GemmJob *j;
    float *dst;
} WidenJob;

static void widen_job(void *arg, int64_t part, int64_t parts) {
    WidenJob *w = (WidenJob *)arg;
    int64_t lo, hi;
    split(w->j->M, part, parts, 1, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) {
        const uint16_t *a = (const uint16_t *)gemm_arow(w->j, i);
        for (int64_t k = 0; k < w->j->K; k++) w->dst[i * w->j->K + k] = bf16_to_f32(a[k]);
    }
}

/* out[orows[i], :N] (+)= A[arows[i], :K] @ B^T for i < M (see the section comment). fmt: A and B
 * (FMT_F32 or FMT_BF16); ofmt: out (fp32, or bf16 rounded to nearest even); layout 0: B [N, K],
 * 1: B [K, N]; lda / ldb / ldo: row strides in elements; arows / orows: row indices or NULL
 * (identity); accumulate: add to out instead of overwriting. Rows of orows must be distinct.
 * Returns 0, or -1 for arguments it does not take (nothing written then): an int8 or unknown
 * format, an odd K with bf16, non-positive sizes, an allocation failure. */
int64_t wide_gemm(WCtx *c, int64_t fmt, int64_t ofmt, int64_t layout, const void *B, int64_t ldb, int64_t N,
                  int64_t K, const void *A, int64_t lda, const int64_t *arows, int64_t M, void *out, int64_t ldo,
                  const int64_t *orows, int64_t accumulate, int64_t nthreads) {
    if ((fmt != FMT_F32 && fmt != FMT_BF16) || (ofmt != FMT_F32 && ofmt != FMT_BF16) || (layout != 0 && layout != 1))
        return -1;
    if (N <= 0 || K <= 0 || M <= 0 || (fmt == FMT_BF16 && K % 2)) return -1;
    if (nthreads != c->pool.n) pool_resize(&c->pool, nthreads);
    GemmJob j = {fmt, fmt, ofmt, layout, N, K, M, lda, ldb, ldo, accumulate, A, B, arows, orows, out, 0};
    float *wide = NULL;
    const int64_t dot = layout == 0 && M <= GEMM_DOT_M;
    if (fmt == FMT_BF16 && (dot || !GEMM_BF16_PAIRS)) {
        if (!(wide = (float *)malloc(sizeof(float) * M * K))) return -1;
        WidenJob w = {&j, wide};
        pool_run(&c->pool, widen_job, &w);
        j.afmt = FMT_F32;
        j.A = wide;
        j.arows = NULL;
        j.lda = K;
    }
    pool_run(&c->pool, dot ? gemm_dot_job : gemm_job, &j);
    free(wide);
    return j.err ? -1 : 0;
}

/* The elementwise pieces of a bf16 prefill layer (wide_rms_norm_rows, wide_rope_rows, wide_residual_rows). */
#include "cpu_prefill_ops.c"
/* Routed prefill on AMX tiles (wide_amx_ready, wide_gather_proj, wide_gather_ffn, wide_gather_attention). */
#include "cpu_prefill_gather.c"

/* Which vector code wide_gemm runs here: 2 AVX-512, 1 AVX2 + FMA, 0 the portable C twin. */
int64_t wide_gemm_simd(void) {
#if defined(WIDE_AVX512)
    return 2;
#elif defined(WIDE_AVX2)
    return 1;
#else
    return 0;
#endif
}

int64_t wide_decode_abi(void) { return WIDE_DECODE_ABI; }

/* The struct layouts the caller's mirror must match (runtime/cpu_native.py checks them at load):
 * out = [sizeof(WLayer), sizeof(WModel), then each field's offset, WLayer's then WModel's, in
 * declaration order]. Returns the number of values written (at most cap). */
int64_t wide_decode_layout(int64_t *out, int64_t cap) {
#define WL(f) offsetof(WLayer, f)
#define WM(f) offsetof(WModel, f)
    const int64_t v[] = {
        sizeof(WLayer), sizeof(WModel),
        WL(H), WL(Hkv), WL(d), WL(ag), WL(GA), WL(fg), WL(GF), WL(window), WL(blocked), WL(qkv), WL(qkv_s), WL(o),
        WL(o_s), WL(gu), WL(gu_s), WL(down), WL(down_s), WL(bqkv), WL(bo), WL(ln_attn), WL(ln_ffn), WL(q_norm),
        WL(k_norm), WL(ra_w), WL(ra_b), WL(rf_w), WL(rf_b), WL(sa), WL(sf), WL(sa_in), WL(sa_out),
        WL(sf_in), WL(sf_out), WL(sa_r), WL(sf_r), WL(keep_a), WL(keep_f), WL(k_cache),
        WL(v_cache), WL(keep_a_stride), WL(keep_f_stride), WL(ln_attn_out), WL(ln_ffn_out), WL(inv_freq), WL(gelu),
        WL(rope_scale), WL(attn_scale),
        WM(L), WM(D), WM(V), WM(max_len), WM(wfmt), WM(act_bf16), WM(head_fmt), WM(routing), WM(nthreads),
        WM(norm_fp32), WM(eps), WM(embed_scale), WM(embed), WM(final_norm), WM(head), WM(head_s), WM(layers),
        WM(stat_skipped), WM(stat_decisions),
    };
#undef WL
#undef WM
    int64_t n = (int64_t)(sizeof(v) / sizeof(v[0]));
    for (int64_t i = 0; i < n && i < cap; i++) out[i] = v[i];
    return n;
}

/* A new context (its pool single-threaded until a call asks for more threads), or NULL. */
WCtx *wide_ctx_new(void) {
    WCtx *c = (WCtx *)calloc(1, sizeof(WCtx));
    if (c) pool_init(&c->pool);
    return c;
}

/* Stop a context's workers and free it (NULL: nothing). */
void wide_ctx_free(WCtx *c) {
    if (!c) return;
    pool_resize(&c->pool, 1);
    for (int b = 0; b < WIDE_MAX_BATCH; b++) { free(c->vec[b].qa); free(c->vec[b].qs); free(c->vec[b].xb); }
    free(c->masks);
    free(c);
}

/* Run one new token per batch row through every layer: row b's token tokens[b] at RoPE position
 * pos[b] into cache slot `slot` of its cache (slots 0..slot-1 hold the context; the layers' caches
 * are [B, Hkv, max_len, d]); kvalid [B][max_len] marks the cache slots that hold real tokens (NULL:
 * every slot does; left padding of shorter prompts is not); write fp32 logits [B][V]. cnt[0..3] +=
 * the rows' executed weight, attention and router multiply-adds, and the weight bytes read (each
 * group once per step however many rows execute it; int8 / int4 scales included). scratch:
 * wide_decode_scratch_floats(m, B) floats. Returns 0, or -1 for bad arguments (nothing written then). */
int64_t wide_decode_batch(WCtx *c, const WModel *m, int64_t B, const int64_t *tokens, const int64_t *pos, int64_t slot,
                          const uint8_t *kvalid, float *logits, int64_t *cnt, float *scratch) {
    if (B < 1 || B > WIDE_MAX_BATCH || slot < 0 || slot >= m->max_len) return -1;
    for (int64_t b = 0; b < B; b++)
        if (tokens[b] < 0 || tokens[b] >= m->V || pos[b] < 0) return -1;
    int64_t gmax = 0;
    for (int64_t l = 0; l < m->L; l++) {
        const WLayer *L = &m->layers[l];
        if (L->GA > 4096 || L->GF > 4096 || L->H > 4096) return -1;
        if (L->GA + L->GF + L->H > gmax) gmax = L->GA + L->GF + L->H;
    }
    if (m->nthreads != c->pool.n) pool_resize(&c->pool, m->nthreads);
    int64_t kmax = m->D;
    for (int64_t l = 0; l < m->L; l++) {
        const WLayer *L = &m->layers[l];
        if (L->H * L->d > kmax) kmax = L->H * L->d;
        if (L->GF * L->fg > kmax) kmax = L->GF * L->fg;
    }
    for (int64_t b = 0; b < B; b++)
        if (vec_reserve(&c->vec[b], kmax) != 0) return -1;
    if (B * gmax > c->masks_cap) {
        free(c->masks);
        c->masks = malloc((size_t)(B * gmax));
        c->masks_cap = c->masks ? B * gmax : 0;
        if (!c->masks) return -1;
    }
    uint64_t live = 0; /* rows whose token is real (its slot valid) */
    for (int64_t b = 0; b < B; b++) live |= (uint64_t)(!kvalid || kvalid[b * m->max_len + slot]) << b;
    const int64_t D = m->D, V = m->V, rstride = row_scratch_floats(m);
    if (!live) { /* every row is padding: nothing to compute */
        memset(logits, 0, (size_t)(B * V) * sizeof(float));
        return 0;
    }
    float *xs = scratch, *rs = xs + B * D, *scores = rs + B * rstride;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < D; i++) {
            const float e = load_act(m->embed, tokens[b] * D + i, m->act_bf16) * m->embed_scale;
            xs[b * D + i] = m->act_bf16 ? round_bf16(e) : e;
        }
    for (int64_t l = 0; l < m->L; l++) layer_step(c, m, l, B, xs, pos, slot, kvalid, live, rs, rstride, scores, cnt);
    Vec vs[WIDE_MAX_BATCH];
    float *ys[WIDE_MAX_BATCH];
    for (int64_t b = 0; b < B; b++) {
        float *h = rs + b * rstride;
        rms_norm(xs + b * D, m->final_norm, D, m->eps, m->act_bf16, m->norm_fp32, h);
        vs[b] = prepare_vec(&c->vec[b], m->head_fmt, h, D);
        ys[b] = logits + b * V;
        if (!(live >> b & 1)) memset(ys[b], 0, (size_t)V * sizeof(float));
    }
    if (live) {
        const int64_t range[2] = {0, V};
        run_rows_sets(&c->pool, m->head_fmt, m->head, m->head_s, D, range, &live, 1, vs, ys);
        cnt[CNT_MACS] += __builtin_popcountll(live) * V * D;
        cnt[CNT_WEIGHT_BYTES] += wbytes(m->head_fmt, V, D);
    }
    return 0;
}

/* Reserve the context for B rows of reduction width up to K; sets the pool's thread count. */
static int64_t ctx_rows(WCtx *c, int64_t nthreads, int64_t B, int64_t K) {
    if (B < 1 || B > WIDE_MAX_BATCH) return -1;
    if (nthreads != c->pool.n) pool_resize(&c->pool, nthreads);
    for (int64_t b = 0; b < B; b++)
        if (vec_reserve(&c->vec[b], K) != 0) return -1;
    return 0;
}

/* The module's decisions for M tokens, as decide(): mask[b][j] = 1 when force, else
 * rw[j] . r[b] + rb[j] >= 0 (fp32; rw [G][D], the folded router). rw NULL: mask is the caller's. */
static void route_rows(const float *rw, const float *rb, int64_t force, int64_t G, int64_t D, int64_t M,
                       const float *r, uint8_t *mask, int64_t *cnt) {
    if (rw == NULL) return;
    float tmp[4096];
    for (int64_t b = 0; b < M; b++) {
        if (force) {
            memset(mask + b * G, 1, (size_t)G);
            continue;
        }
        dot_f32(rw, D, G, r + b * D, tmp);
        cnt[CNT_ROUTER_MACS] += G * D;
        for (int64_t j = 0; j < G; j++) mask[b * G + j] = (tmp[j] + rb[j]) >= 0.0f;
    }
}

/* y[b] += the stand-ins of the groups row b skips (st [G][N] fp32, NULL: none), as the PyTorch
 * path: with bf16 activations the row is rounded to bf16 first (the projection's output dtype). */
static int64_t standin_rows(const float *st, const uint8_t *mask, int64_t G, int64_t N, int64_t M, int64_t bf,
                            float *y) {
    if (st == NULL) return 0;
    float *tmp = NULL;
    for (int64_t b = 0; b < M; b++) {
        int any = 0;
        for (int64_t j = 0; j < G; j++) any |= !mask[b * G + j];
        if (!any) continue;
        if (tmp == NULL && (tmp = malloc((size_t)N * sizeof(float))) == NULL) return -1;
        if (bf) for (int64_t i = 0; i < N; i++) y[b * N + i] = round_bf16(y[b * N + i]);
        add_standins(st, NULL, NULL, 0, mask + b * G, G, N, bf, NULL, y + b * N, tmp);
    }
    free(tmp);
    return 0;
}

/* The router of one module for M <= 64 tokens whose projections run elsewhere (the vLLM plugin's
 * larger steps): mask [M][G] as route_rows (rw NULL: the caller's mask is kept); with stand-ins
 * (st [G][N] fp32) sums [M][N] = each token's skipped groups' stand-ins summed (fp32, zeros when
 * it skips none). info[0] = groups some token executes, info[1] = executed (token, group) pairs.
 * Returns 0, or -1 for bad arguments. */
int64_t wide_route_rows(const float *rw, const float *rb, int64_t force, const float *st, int64_t G, int64_t D,
                        int64_t N, int64_t M, const float *r, uint8_t *mask, float *sums, int64_t *info,
                        int64_t *cnt) {
    if (G > 4096 || M < 1 || M > WIDE_MAX_BATCH) return -1;
    route_rows(rw, rb, force, G, D, M, r, mask, cnt);
    int64_t uni = 0, pairs = 0;
    for (int64_t j = 0; j < G; j++) {
        int any = 0;
        for (int64_t b = 0; b < M; b++) any |= mask[b * G + j] != 0;
        uni += any;
    }
    for (int64_t b = 0; b < M; b++) {
        float *y = sums ? sums + b * N : NULL;
        if (y) memset(y, 0, (size_t)N * sizeof(float));
        for (int64_t j = 0; j < G; j++) {
            if (mask[b * G + j]) {
                pairs++;
            } else if (st != NULL && y != NULL) {
                for (int64_t i = 0; i < N; i++) y[i] += st[j * N + i];
            }
        }
    }
    info[0] = uni;
    info[1] = pairs;
    return 0;
}

/* One routed SwiGLU FFN for M <= 64 tokens outside a decode step (the vLLM plugin's decode
 * steps): y [M][D] = the FFN of x [M][D] (fp32) over the groups each token executes (mask
 * [M][GF], 1 = execute), layouts and formats of layer_step (gu rows, down w_t or blocked), each
 * group's weights read once for all tokens that execute it. With a router (rw [GF][D], rb [GF]
 * fp32, force) the call first writes mask from r [M][D] (the residual stream the router reads);
 * with stand-ins (st [GF][D] fp32) it adds each token's skipped groups' stand-ins to y. bf: the
 * activations are bf16 (rounding as the PyTorch path). scratch: M GF fg 3 floats; cnt[0..3] as
 * wide_decode_batch. Returns 0, or -1 for bad arguments or no memory. */
int64_t wide_ffn_rows(WCtx *c, int64_t nthreads, int64_t fmt, int64_t blocked, int64_t bf, const void *gu,
                      const void *gu_s, const void *down, const void *down_s, int64_t D, int64_t GF, int64_t fg,
                      int64_t M, const float *x, const float *r, const float *rw, const float *rb, int64_t force,
                      const float *st, uint8_t *mask, float *y, float *scratch, int64_t *cnt) {
    if (GF > 4096 || ctx_rows(c, nthreads, M, D > GF * fg ? D : GF * fg) != 0) return -1;
    route_rows(rw, rb, force, GF, D, M, r, mask, cnt);
    float *hs[WIDE_MAX_BATCH], *hids[WIDE_MAX_BATCH], *ys[WIDE_MAX_BATCH];
    for (int64_t b = 0; b < M; b++) {
        hs[b] = (float *)x + b * D;
        hids[b] = scratch + b * GF * fg * 3;
        ys[b] = y + b * D;
        memset(ys[b], 0, (size_t)D * sizeof(float));
    }
    ffn_sets(c, fmt, blocked, gu, gu_s, down, down_s, D, GF, fg, bf, 0, M, hs, mask, hids, ys, cnt);
    return standin_rows(st, mask, GF, D, M, bf, y);
}

/* One routed O projection for M <= 64 tokens: y [M][N] = a [M][G cols] (fp32) times the O
 * weights over the head groups each token executes (mask [M][G]). Router (r [M][N], rw [G][N],
 * rb, force), stand-ins (st [G][N]) and bf as wide_ffn_rows; cnt as wide_decode_batch. Returns 0,
 * or -1 for bad arguments or no memory. */
int64_t wide_out_rows(WCtx *c, int64_t nthreads, int64_t fmt, int64_t blocked, int64_t bf, const void *o,
                      const void *o_s, int64_t N, int64_t cols, int64_t G, int64_t M, const float *a, const float *r,
                      const float *rw, const float *rb, int64_t force, const float *st, uint8_t *mask, float *y,
                      int64_t *cnt) {
    if (G > 4096 || ctx_rows(c, nthreads, M, G * cols) != 0) return -1;
    route_rows(rw, rb, force, G, N, M, r, mask, cnt);
    float *as[WIDE_MAX_BATCH], *ys[WIDE_MAX_BATCH];
    for (int64_t b = 0; b < M; b++) {
        as[b] = (float *)a + b * G * cols;
        ys[b] = y + b * N;
        memset(ys[b], 0, (size_t)N * sizeof(float));
    }
    out_sets(c, fmt, blocked, o, o_s, N, cols, G, M, as, mask, ys, cnt);
    return standin_rows(st, mask, G, N, M, bf, y);
}

