/* The elementwise pieces of a bf16 prefill layer, one call per piece for all tokens: RMSNorm, RoPE
 * and the residual add with the stand-ins of the skipped groups. Part of the native library,
 * included by cpu_decode.c (its thread pool, split(), bf16 helpers).
 *
 * Why: PyTorch runs each of these as 4-6 full-width bf16 ops with fp32 round trips; on SmolLM2-135M
 * (1,024-token prefill, 1 thread) the norms, RoPE and stand-in adds took about a third of a routed
 * prefill once its projections ran on AMX tiles. Each function computes what runtime/engine.py
 * computes, with the same bf16 roundings at the same places (the sums of the norm statistics and
 * of the stand-ins run in another order: results can differ by one bf16 step where a value sits
 * on a rounding boundary). AVX-512 where the build has it, the same arithmetic in scalar C elsewhere.
 */

typedef struct {
    int64_t M, D, ldx, ldo, f32w, heads, d, G, ldm, lde;
    float eps;
    const uint16_t *x, *y, *cos, *sin;
    const float *w, *st;
    const uint8_t *ex;
    uint16_t *out;
} RowsJob;

#ifdef WIDE_AVX512
static inline __m512 ld16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* fp32 -> bf16, round to nearest even (f32_to_bf16's arithmetic; no NaN inputs here). */
static inline __m256i st16_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                                        _mm512_set1_epi32(1))));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

static inline __m512 rnd16(__m512 v) { /* round to bf16 and back */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(st16_bf16(v)), 16));
}
#endif

static void rms_rows_job(void *arg, int64_t part, int64_t parts) {
    const RowsJob *j = (const RowsJob *)arg;
    int64_t lo, hi;
    split(j->M, part, parts, 1, &lo, &hi);
    const int64_t D = j->D;
    for (int64_t t = lo; t < hi; t++) {
        const uint16_t *x = j->x + t * j->ldx;
        uint16_t *o = j->out + t * j->ldo;
        int64_t i = 0;
        float ss = 0.f;
#ifdef WIDE_AVX512
        __m512 acc = _mm512_setzero_ps();
        for (; i + 16 <= D; i += 16) {
            __m512 v = ld16_bf16(x + i);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        ss = _mm512_reduce_add_ps(acc);
#endif
        for (; i < D; i++) ss += bf16_to_f32(x[i]) * bf16_to_f32(x[i]);
        const float r = 1.0f / sqrtf(ss / (float)D + j->eps);
        i = 0;
#ifdef WIDE_AVX512
        const __m512 vr = _mm512_set1_ps(r);
        for (; i + 16 <= D; i += 16) {
            __m512 v = _mm512_mul_ps(ld16_bf16(x + i), vr), w = _mm512_loadu_ps(j->w + i);
            v = j->f32w ? _mm512_mul_ps(v, w) : _mm512_mul_ps(w, rnd16(v));
            _mm256_storeu_si256((__m256i *)(o + i), st16_bf16(v));
        }
#endif
        for (; i < D; i++) {
            const float v = bf16_to_f32(x[i]) * r;
            o[i] = f32_to_bf16(j->f32w ? v * j->w[i] : j->w[i] * round_bf16(v));
        }
    }
}

/* out[t] = RMSNorm(x[t]) for M rows of D bf16 values (rows ldx / ldo elements apart): statistics in
 * fp32; w fp32 [D]. f32w 0: Llama's (the normalised value rounded to bf16, times w holding bf16
 * values, rounded); 1: Gemma 3's (w = 1 + its weight in fp32, the fp32 product rounded once).
 * Returns 0, or -1 for bad sizes. */
int64_t wide_rms_norm_rows(WCtx *c, const uint16_t *x, int64_t ldx, int64_t M, int64_t D, const float *w,
                           int64_t f32w, float eps, uint16_t *out, int64_t ldo, int64_t nthreads) {
    if (M <= 0 || D <= 0) return -1;
    if (nthreads != c->pool.n) pool_resize(&c->pool, nthreads);
    RowsJob j = {M, D, ldx, ldo, f32w, 0, 0, 0, 0, 0, eps, x, NULL, NULL, NULL, w, NULL, NULL, out};
    pool_run(&c->pool, rms_rows_job, &j);
    return 0;
}

static void rope_rows_job(void *arg, int64_t part, int64_t parts) {
    const RowsJob *j = (const RowsJob *)arg;
    int64_t lo, hi;
    split(j->M, part, parts, 1, &lo, &hi);
    const int64_t d = j->d, half = d / 2;
    for (int64_t t = lo; t < hi; t++) {
        const uint16_t *cs = j->cos + t * d, *sn = j->sin + t * d;
        for (int64_t h = 0; h < j->heads; h++) {
            uint16_t *x = j->out + t * j->ldx + h * d;
            uint16_t tmp[512];
            memcpy(tmp, x, (size_t)d * 2);
            int64_t i = 0;
#ifdef WIDE_AVX512
            for (; i + 16 <= d && (i + 16 <= half || i >= half); i += 16) {
                const int64_t r = i < half ? i + half : i - half; /* torch.roll by d / 2 */
                __m512 a = rnd16(_mm512_mul_ps(ld16_bf16(tmp + i), ld16_bf16(cs + i)));
                __m512 b = rnd16(_mm512_mul_ps(ld16_bf16(tmp + r), ld16_bf16(sn + i)));
                _mm256_storeu_si256((__m256i *)(x + i), st16_bf16(_mm512_add_ps(a, b)));
            }
#endif
            for (; i < d; i++) {
                const int64_t r = i < half ? i + half : i - half;
                const float a = round_bf16(bf16_to_f32(tmp[i]) * bf16_to_f32(cs[i]));
                const float b = round_bf16(bf16_to_f32(tmp[r]) * bf16_to_f32(sn[i]));
                x[i] = f32_to_bf16(a + b);
            }
        }
    }
}

/* RoPE in place on x [M][heads][d] bf16 (token rows ldx elements apart, heads contiguous): x =
 * x cos + roll(x, d / 2) sin_signed, each product rounded to bf16 and their sum rounded
 * (runtime/engine.py's apply_rope in bf16); cos, sin_signed bf16 [M][d]. d even, at most 512.
 * Returns 0, or -1 for bad sizes. */
int64_t wide_rope_rows(WCtx *c, uint16_t *x, int64_t ldx, int64_t M, int64_t heads, int64_t d, const uint16_t *cos,
                       const uint16_t *sin_signed, int64_t nthreads) {
    if (M <= 0 || heads <= 0 || d <= 0 || d % 2 || d > 512) return -1;
    if (nthreads != c->pool.n) pool_resize(&c->pool, nthreads);
    RowsJob j = {M, 0, ldx, 0, 0, heads, d, 0, 0, 0, 0.f, NULL, NULL, cos, sin_signed, NULL, NULL, NULL, x};
    pool_run(&c->pool, rope_rows_job, &j);
    return 0;
}

static void residual_rows_job(void *arg, int64_t part, int64_t parts) {
    const RowsJob *j = (const RowsJob *)arg;
    int64_t lo, hi;
    split(j->M, part, parts, 1, &lo, &hi);
    const int64_t D = j->D;
    float add[8192];
    for (int64_t t = lo; t < hi; t++) {
        const uint16_t *x = j->x + t * j->ldx, *y = j->y + t * j->ldo;
        uint16_t *o = j->out + t * j->ldo;
        const uint8_t *ex = j->ex ? j->ex + t * j->lde : NULL;
        int64_t nskip = 0;
        if (ex) {
            memset(add, 0, sizeof(float) * (size_t)D);
            for (int64_t g = 0; g < j->G; g++) {
                if (ex[g]) continue;
                nskip++;
                const float *s = j->st + g * D;
                for (int64_t i = 0; i < D; i++) add[i] += s[i];
            }
        }
        for (int64_t i = 0; i < D; i++) {
            const float v = round_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
            o[i] = f32_to_bf16(nskip ? v + round_bf16(add[i]) : v);
        }
    }
}

/* out[t] = x[t] + y[t], plus the stand-ins of the groups token t skips: x + y rounded to bf16, then
 * the fp32 sum of standin[g] over the skipped groups g (ex[t lde + g] == 0), rounded to bf16, added
 * and rounded (runtime/engine.py's _add_standin with routing/router.py's apply_standin). ex NULL:
 * no stand-ins (the plain residual add). x [M][ldx], y and out [M][ldo] bf16 (out may be y);
 * standin fp32 [G][D]; D at most 8192. Returns 0, or -1 for bad sizes. */
int64_t wide_residual_rows(WCtx *c, const uint16_t *x, int64_t ldx, const uint16_t *y, uint16_t *out, int64_t ldo,
                           int64_t M, int64_t D, const uint8_t *ex, int64_t lde, int64_t G, const float *standin,
                           int64_t nthreads) {
    if (M <= 0 || D <= 0 || D > 8192 || (ex && (!standin || G <= 0))) return -1;
    if (nthreads != c->pool.n) pool_resize(&c->pool, nthreads);
    RowsJob j = {M, D, ldx, ldo, 0, 0, 0, G, 0, lde, 0.f, x, y, NULL, NULL, NULL, standin, ex, out};
    pool_run(&c->pool, residual_rows_job, &j);
    return 0;
}

/* The routers of a prefill step: mask[t][j] = rw[j] . x[t] + rb[j] >= 0 in fp32 (rw [G][D], the
 * folded router of runtime/engine.py's _decide), x bf16 or fp32 rows ldx elements apart. The
 * products are the decode step's (route_rows: dot_f32), so a token gets the same decisions in
 * prefill and decode; PyTorch's fp32 GEMM sums in another order (a logit within rounding of 0 can
 * land on the other side). PyTorch ran these [M, D] x [D, G] products with G of 3-12 at about a
 * quarter of its GEMM rate (SmolLM2-135M shapes, Zen 4, 1 thread). */
typedef struct {
    int64_t M, D, G, ldx, f32x;
    const void *x;
    const float *rw, *rb;
    uint8_t *mask;
    int err;
} RouterJob;

static void router_rows_job(void *arg, int64_t part, int64_t parts) {
    RouterJob *j = (RouterJob *)arg;
    int64_t lo, hi;
    split(j->M, part, parts, 1, &lo, &hi);
    const int64_t D = j->D, G = j->G;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(4 * D + 4 * G));
    if (buf == NULL) {
        j->err = 1;
        return;
    }
    for (int64_t t0 = lo; t0 < hi; t0 += 4) {
        const int nb = hi - t0 < 4 ? (int)(hi - t0) : 4;
        const float *xs[4];
        float *ys[4];
        for (int b = 0; b < nb; b++) {
            float *xf = buf + b * D;
            if (j->f32x) {
                xs[b] = (const float *)j->x + (t0 + b) * j->ldx;
            } else {
                const uint16_t *xb = (const uint16_t *)j->x + (t0 + b) * j->ldx;
                for (int64_t i = 0; i < D; i++) xf[i] = bf16_to_f32(xb[i]);
                xs[b] = xf;
            }
            ys[b] = buf + 4 * D + b * G;
        }
#ifdef VW
        dot_f32_rows(j->rw, D, G, xs, ys, nb);
#else
        for (int b = 0; b < nb; b++) dot_f32(j->rw, D, G, xs[b], ys[b]);
#endif
        for (int b = 0; b < nb; b++)
            for (int64_t g = 0; g < G; g++) j->mask[(t0 + b) * G + g] = (ys[b][g] + j->rb[g]) >= 0.0f;
    }
    free(buf);
}

int64_t wide_router_rows(WCtx *c, const void *x, int64_t ldx, int64_t M, int64_t D, int64_t f32x, const float *rw,
                         const float *rb, int64_t G, uint8_t *mask, int64_t nthreads) {
    if (M <= 0 || D <= 0 || G <= 0 || ldx < D) return -1;
    if (nthreads != c->pool.n) pool_resize(&c->pool, nthreads);
    RouterJob j = {M, D, G, ldx, f32x, x, rw, rb, mask, 0};
    pool_run(&c->pool, router_rows_job, &j);
    return j.err ? -1 : 0;
}
