/*
 * Matrix products with block-quantized weights (GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K,
 * Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS),
 * called through cffi; the layout and the formats' meaning are in engine/ops/quant.py.
 *
 *   out[t, n] = sum_k x[t, k] * w[n, k],   w[n, k] = code * scale(group) + min(group)
 *
 * The activations are quantized first, per token and per 32 columns, to int8 with one fp32
 * step dx (symmetric, amax / 127, round to nearest), as llama.cpp does for its Q8 dot
 * products. A group of 32 columns then costs eight int8 x uint8 dot-product instructions
 * (AVX-512 VNNI vpdpbusd: 16 weight rows x 4 columns each) for each token, and one fp32
 * fused multiply-add of the integer sum by scale * dx, plus one for the min:
 *
 *   sum_k x w  ~=  sum_g  dx_g * scale_g * sum_{k in g} xq_k code_k  +  min_g * dx_g * sum_{k in g} xq_k
 *
 * The weights of a panel (16 rows) are unpacked to bytes once per group and reused for
 * up to TILE tokens, so a batched step reads each weight once per TILE tokens. Measured on
 * the 2-core AVX-512 dev machine this beat dequantizing to bf16 and multiplying with
 * vdpbf16ps (one fp32 conversion per 32 products instead of per 2).
 *
 * Paths: AVX-512 (F, BW, VL, VNNI, F16C) with intrinsics; AVX2 (with FMA, F16C) with
 * intrinsics for CPUs without AVX-512; a portable C path for every other x86-64 CPU (compiled for x86-64-v3 and the baseline through target_clones, so the
 * compiler vectorizes it where it can). `isa` 1 forces the portable path (tests).
 * Threads: OpenMP over (token block, panel) pairs, on torch's libgomp pool (see kernels.c).
 */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define QCLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#define HAVE_AVX512_PATH 1
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")))
#define AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c,amx-tile,amx-int8")))
#else
#define QCLONES
#define HAVE_AVX512_PATH 0
#endif
#define QINLINE static inline __attribute__((always_inline))

enum { F_Q4_0 = 0, F_Q4_1 = 1, F_Q8_0 = 2, F_Q4_K = 3, F_Q5_K = 4, F_Q6_K = 5, F_Q5_0 = 6, F_Q5_1 = 7, F_Q3_K = 8,
       F_Q2_K = 9, F_IQ4_NL = 10, F_IQ4_XS = 11, F_COUNT = 12 };

/* What a format's panels hold (engine/ops/quant.py has the table). Each kernel is
 * specialized per format, so these fold to constants inside its loops. */
#define Q_SUPER(f) \
    ((f) == F_Q4_K || (f) == F_Q5_K || (f) == F_Q6_K || (f) == F_Q3_K || (f) == F_Q2_K || (f) == F_IQ4_XS) /* d per 256 */
#define Q_DMIN(f) ((f) == F_Q4_K || (f) == F_Q5_K || (f) == F_Q2_K) /* m holds dmin per 256 columns */
#define Q_PER16(f) ((f) == F_Q6_K || (f) == F_Q3_K || (f) == F_Q2_K) /* a scale per 16 columns */
#define Q_HI1(f) ((f) == F_Q5_K || (f) == F_Q5_0 || (f) == F_Q5_1 || (f) == F_Q3_K) /* hi: one bit a code */
#define Q_HI1_BIT(f) ((f) == F_Q3_K ? 2 : 4)                                           /* ... which bit */
#define Q_CODES2(f) ((f) == F_Q2_K || (f) == F_Q3_K) /* codes: the low 2 bits, four to a byte */
#define Q_GROUP_BYTES(f) ((f) == F_Q8_0 ? 512 : Q_CODES2(f) ? 128 : 256) /* code bytes of a panel's group */
#define Q_PER32_D(f) ((f) == F_Q4_0 || (f) == F_Q4_1 || (f) == F_Q8_0 || (f) == F_Q5_0 || (f) == F_Q5_1 || (f) == F_IQ4_NL)
/* The 4-bit code indexes Q_IQ4_U8 (llama.cpp's kvalues_iq4nl + 128, unsigned for vpdpbusd;
 * the min is -128 * scale, as Q8_0's). */
#define Q_LUT(f) ((f) == F_IQ4_NL || (f) == F_IQ4_XS)
static const uint8_t Q_IQ4_U8[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

/* Columns and bytes of a GGUF block, by format code. */
static const int64_t q_block_cols[F_COUNT] = {32, 32, 32, 256, 256, 256, 32, 32, 256, 256, 32, 256};
static const int64_t q_block_bytes[F_COUNT] = {18, 20, 34, 144, 176, 210, 22, 24, 110, 84, 18, 136};
/* QDT_BF16_F32: bf16 activations, fp32 results holding the bf16-rounded values (a bf16
 * model's logits, widened without a second pass). eng_qmatmul only. */
enum { QDT_F32 = 0, QDT_BF16 = 1, QDT_BF16_F32 = 2 };
enum { Q_OK = 0, Q_BAD_ARGS = 1, Q_NO_MEMORY = 2, Q_BAD_INDEX = 3 };

#define PANEL 16
#define TILE 4          /* tokens per micro-kernel call (AVX2, portable) */
#ifndef TILE512
/* Tokens per AVX-512 micro-kernel call: 8 unpacked + 8 fp32 accumulator zmm, the int32
 * sums in the rest. A speculative verification step (5 rows at k = 4) unpacks each group
 * once rather than twice (4 + 1): measured 1.6x faster at 5 rows than tiles of 4. */
#define TILE512 8
#endif
#define TOKEN_BLOCK 64  /* tokens whose int8 activations stay in L2 while panels stream */
#ifndef Q_PREFETCH_GROUPS
#define Q_PREFETCH_GROUPS 4 /* groups ahead the AVX-512 micro-kernel prefetches (measured: 4 beat 2, 6, 8, 16) */
#endif

/* Work (multiply-adds) below which one thread does it all: waking the second OpenMP
 * thread costs microseconds, more than a small product takes. */
#define QPARALLEL_MIN_WORK 65536

/* ---- scalars ---------------------------------------------------------------------- */

QINLINE float q_f16_to_f32(uint16_t h) {
    /* IEEE half -> float without F16C (the portable path), subnormals included. */
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {
            float f = (float)man * 5.9604644775390625e-8f; /* 2^-24 */
            memcpy(&u, &f, sizeof u);
            u |= sign;
        }
    } else if (exp == 31) {
        u = sign | 0x7F800000u | (man << 13);
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

QINLINE float q_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

QINLINE uint16_t q_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint16_t rounded = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? (uint16_t)0x7FC0 : rounded;
}

/* Rows n0 .. n0+rows-1 of output token t from fp32 v (defined with the entry points). */
static void q_store(void *out, int dtype, int64_t out_stride, int64_t t, int64_t n0, int64_t rows, const float *v);

/* ---- the weight's fields ---------------------------------------------------------- */

typedef struct {
    int fmt;
    int64_t K, N, P, G;      /* columns, rows, panels, groups of 32 columns */
    const uint8_t *codes;    /* codes4 [P,G,4,64] | codes8 [P,G,8,64] | codes2 [P,G,2,64] (Q2_K/Q3_K) */
    const uint8_t *hi;       /* hi1 [P,G,8] uint64 (Q5_*, Q3_K) | hi2 [P,G,2,64] (Q6_K) */
    const uint16_t *d;       /* fp16 [P,G,16] (32-column formats) | [P,K/256,16] (K-quants) */
    const uint16_t *m;       /* fp16: m [P,G,16] (Q4_1/Q5_1) | dmin [P,K/256,16] (Q4_K/Q5_K/Q2_K) */
    const uint8_t *sc;       /* uint8 [P,G,16] (Q4_K/Q5_K) | int8 [P,2G,16] (Q6_K/Q3_K) |
                                uint8 [P,2G,16] scale | min << 4 (Q2_K) */
    const uint8_t *mn;       /* uint8 [P,G,16] (Q4_K/Q5_K) */
} QWeight;

/* Scale and min of row r (0..15) of panel p for 16-column half h (0, 1) of group g. */
QINLINE void q_scale_min(const QWeight *w, int64_t p, int64_t g, int r, int h, float *scale, float *mn) {
    int64_t pg = (p * w->G + g) * PANEL + r;
    int64_t ps = (p * (w->G / 8) + g / 8) * PANEL + r;
    switch (w->fmt) {
    case F_Q4_0: *scale = q_f16_to_f32(w->d[pg]); *mn = -8.0f * *scale; break;
    case F_Q5_0: *scale = q_f16_to_f32(w->d[pg]); *mn = -16.0f * *scale; break;
    case F_Q4_1:
    case F_Q5_1: *scale = q_f16_to_f32(w->d[pg]); *mn = q_f16_to_f32(w->m[pg]); break;
    case F_Q8_0:
    case F_IQ4_NL: *scale = q_f16_to_f32(w->d[pg]); *mn = -128.0f * *scale; break;
    case F_IQ4_XS: *scale = q_f16_to_f32(w->d[ps]) * (float)(int8_t)w->sc[pg]; *mn = -128.0f * *scale; break;
    case F_Q4_K:
    case F_Q5_K:
        *scale = q_f16_to_f32(w->d[ps]) * (float)w->sc[pg];
        *mn = -(q_f16_to_f32(w->m[ps]) * (float)w->mn[pg]);
        break;
    case F_Q2_K: {
        const uint8_t b = w->sc[(p * 2 * w->G + 2 * g + h) * PANEL + r];
        *scale = q_f16_to_f32(w->d[ps]) * (float)(b & 15);
        *mn = -(q_f16_to_f32(w->m[ps]) * (float)(b >> 4));
        break;
    }
    default: { /* Q6_K, Q3_K */
        int64_t p16 = (p * 2 * w->G + 2 * g + h) * PANEL + r;
        *scale = q_f16_to_f32(w->d[ps]) * (float)(int8_t)w->sc[p16];
        *mn = (w->fmt == F_Q6_K ? -32.0f : -4.0f) * *scale;
    }
    }
}

/* Code of row r, column 4q + j of group g in panel p. */
QINLINE int q_code(const QWeight *w, int64_t p, int64_t g, int q, int r, int j) {
    int64_t b = 4 * r + j, pg = p * w->G + g;
    int c;
    if (w->fmt == F_Q8_0)
        return w->codes[(pg * 8 + q) * 64 + b];
    if (Q_CODES2(w->fmt)) {
        c = (w->codes[(pg * 2 + q / 4) * 64 + b] >> (2 * (q & 3))) & 3;
    } else {
        c = w->codes[(pg * 4 + q / 2) * 64 + b];
        c = q & 1 ? c >> 4 : c & 15;
    }
    if (Q_HI1(w->fmt)) {
        uint64_t mask;
        memcpy(&mask, w->hi + (pg * 8 + q) * 8, 8);
        c |= (int)((mask >> b) & 1) << Q_HI1_BIT(w->fmt);
    } else if (w->fmt == F_Q6_K) {
        c |= ((w->hi[(pg * 2 + q / 4) * 64 + b] >> (2 * (q & 3))) & 3) << 4;
    }
    return Q_LUT(w->fmt) ? Q_IQ4_U8[c] : c;
}

/* ---- activations: int8 per 32 columns ---------------------------------------------- */

typedef struct {
    int8_t *xq;  /* [M, K] */
    float *dx;   /* [M, K/32]: step of each block */
    float *xs;   /* [M, K/16]: dx * (sum of the block's 16-column half of xq) */
} QActs;

QCLONES static void q_quantize_row_c(const void *x, int bf, int64_t K, int8_t *xq, float *dx, float *xs) {
    for (int64_t b = 0; b < K / 32; b++) {
        float v[32], amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            v[i] = bf ? q_bf16_to_f32(((const uint16_t *)x)[32 * b + i]) : ((const float *)x)[32 * b + i];
            float a = fabsf(v[i]);
            amax = a > amax ? a : amax;
        }
        float step = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int s0 = 0, s1 = 0;
        for (int i = 0; i < 32; i++) {
            float r = rintf(v[i] * inv);
            r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
            int q = (int)r;
            xq[32 * b + i] = (int8_t)q;
            if (i < 16)
                s0 += q;
            else
                s1 += q;
        }
        dx[b] = step;
        xs[2 * b] = step * (float)s0;
        xs[2 * b + 1] = step * (float)s1;
    }
}

/* ---- the portable micro-kernel ----------------------------------------------------- */

QCLONES static void q_panel_portable(const QWeight *w, int64_t p, const QActs *a, int64_t t0, int64_t nt,
                                     float *acc /* [nt][16] */) {
    int64_t K = w->K;
    for (int64_t i = 0; i < nt * PANEL; i++)
        acc[i] = 0.0f;
    for (int64_t g = 0; g < w->G; g++) {
        uint8_t codes[PANEL][32];
        float scale[PANEL][2], mn[PANEL][2];
        for (int r = 0; r < PANEL; r++) {
            for (int q = 0; q < 8; q++)
                for (int j = 0; j < 4; j++)
                    codes[r][4 * q + j] = (uint8_t)q_code(w, p, g, q, r, j);
            for (int h = 0; h < 2; h++)
                q_scale_min(w, p, g, r, h, &scale[r][h], &mn[r][h]);
        }
        for (int64_t t = 0; t < nt; t++) {
            const int8_t *xq = a->xq + (t0 + t) * K + 32 * g;
            float dx = a->dx[(t0 + t) * (K / 32) + g];
            const float *xs = a->xs + (t0 + t) * (K / 16) + 2 * g;
            for (int r = 0; r < PANEL; r++) {
                int32_t s0 = 0, s1 = 0;
                for (int i = 0; i < 16; i++) {
                    s0 += (int32_t)codes[r][i] * xq[i];
                    s1 += (int32_t)codes[r][16 + i] * xq[16 + i];
                }
                float v;
                if (Q_PER16(w->fmt))
                    v = (float)s0 * (scale[r][0] * dx) + mn[r][0] * xs[0] + (float)s1 * (scale[r][1] * dx) +
                        mn[r][1] * xs[1];
                else
                    v = (float)(s0 + s1) * (scale[r][0] * dx) + mn[r][0] * (xs[0] + xs[1]);
                acc[t * PANEL + r] += v;
            }
        }
    }
}

/* ---- the AVX-512 VNNI micro-kernel ------------------------------------------------- */

#if HAVE_AVX512_PATH
AVX512 QINLINE __m512 q_ld_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

AVX512 QINLINE __m512 q_ld_u8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

AVX512 QINLINE __m512 q_ld_i8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* The 8 quads (16 rows x 4 columns of uint8 codes each) of group g of panel p. */
AVX512 QINLINE void q_unpack(const QWeight *w, int fmt, int64_t pg, __m512i *c) {
    if (fmt == F_Q8_0) {
        const __m512i *src = (const __m512i *)(w->codes + pg * 512);
        for (int q = 0; q < 8; q++)
            c[q] = _mm512_loadu_si512(src + q);
        return;
    }
    if (Q_CODES2(fmt)) {
        const __m512i low2 = _mm512_set1_epi8(3);
        for (int v = 0; v < 2; v++) {
            __m512i b = _mm512_loadu_si512((const void *)(w->codes + pg * 128 + 64 * v));
            for (int i = 0; i < 4; i++)
                c[4 * v + i] = _mm512_and_si512(_mm512_srli_epi16(b, 2 * i), low2);
        }
    } else {
        const __m512i low4 = _mm512_set1_epi8(15);
        const uint8_t *src = w->codes + pg * 256;
        for (int v = 0; v < 4; v++) {
            __m512i b = _mm512_loadu_si512((const void *)(src + 64 * v));
            c[2 * v] = _mm512_and_si512(b, low4);
            c[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
        }
        if (Q_LUT(fmt)) { /* each 128-bit lane looks its nibbles up in the table */
            const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)Q_IQ4_U8));
            for (int q = 0; q < 8; q++)
                c[q] = _mm512_shuffle_epi8(lut, c[q]);
        }
    }
    if (Q_HI1(fmt)) {
        const __m512i bit4 = _mm512_set1_epi8(1 << Q_HI1_BIT(fmt));
        const uint64_t *masks = (const uint64_t *)(w->hi + pg * 64);
        for (int q = 0; q < 8; q++) {
            uint64_t mk;
            memcpy(&mk, masks + q, 8);
            c[q] = _mm512_or_si512(c[q], _mm512_maskz_mov_epi8((__mmask64)mk, bit4));
        }
    } else if (fmt == F_Q6_K) {
        const __m512i low2 = _mm512_set1_epi8(3);
        for (int h = 0; h < 2; h++) {
            __m512i b = _mm512_loadu_si512((const void *)(w->hi + (pg * 2 + h) * 64));
            for (int i = 0; i < 4; i++) {
                __m512i bits = _mm512_and_si512(_mm512_srli_epi16(b, 2 * i), low2);
                c[4 * h + i] = _mm512_or_si512(c[4 * h + i], _mm512_slli_epi16(bits, 4));
            }
        }
    }
}

/* Scale and min of a group's 16 rows, for a format with one scale per 32 columns: o is
 * the group's offset pg * PANEL; D, Dm the super-block's d and dmin (Q4_K, Q5_K). */
AVX512 QINLINE void q_sm32(const QWeight *w, const int fmt, int64_t o, __m512 D, __m512 Dm, __m512 *S, __m512 *Mn) {
    switch (fmt) {
    case F_Q4_0: *S = q_ld_f16(w->d + o); *Mn = _mm512_mul_ps(*S, _mm512_set1_ps(-8.0f)); break;
    case F_Q5_0: *S = q_ld_f16(w->d + o); *Mn = _mm512_mul_ps(*S, _mm512_set1_ps(-16.0f)); break;
    case F_Q4_1:
    case F_Q5_1: *S = q_ld_f16(w->d + o); *Mn = q_ld_f16(w->m + o); break;
    case F_Q8_0:
    case F_IQ4_NL: *S = q_ld_f16(w->d + o); *Mn = _mm512_mul_ps(*S, _mm512_set1_ps(-128.0f)); break;
    case F_IQ4_XS: *S = _mm512_mul_ps(D, q_ld_i8(w->sc + o)); *Mn = _mm512_mul_ps(*S, _mm512_set1_ps(-128.0f)); break;
    default: /* Q4_K, Q5_K: -(dmin * mn) as the portable path rounds it */
        *S = _mm512_mul_ps(D, q_ld_u8(w->sc + o));
        *Mn = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(Dm, q_ld_u8(w->mn + o)));
    }
}

/* The same for the two 16-column halves of a group (Q6_K, Q3_K, Q2_K): p16 is the offset
 * (p * 2G + 2g) * PANEL of the group's first half in sc. */
AVX512 QINLINE void q_sm16(const QWeight *w, const int fmt, int64_t p16, __m512 D, __m512 Dm, __m512 *S,
                           __m512 *Mn) {
    for (int h = 0; h < 2; h++) {
        const uint8_t *sc = w->sc + p16 + h * PANEL;
        if (fmt == F_Q2_K) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sc));
            S[h] = _mm512_mul_ps(D, _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))));
            Mn[h] = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(Dm, _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4))));
        } else {
            S[h] = _mm512_mul_ps(D, q_ld_i8(sc));
            Mn[h] = _mm512_mul_ps(S[h], _mm512_set1_ps(fmt == F_Q6_K ? -32.0f : -4.0f));
        }
    }
}

/* One 16-column half (quads 4h .. 4h+3) or a whole group: int32 dot of 16 rows with xq. */
AVX512 QINLINE __m512i q_dot(const __m512i *c, const int8_t *xq, int q0, int nq) {
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    for (int q = q0; q < q0 + nq; q += 2) {
        int32_t x0, x1;
        memcpy(&x0, xq + 4 * q, 4);
        memcpy(&x1, xq + 4 * q + 4, 4);
        s0 = _mm512_dpbusd_epi32(s0, c[q], _mm512_set1_epi32(x0));
        s1 = _mm512_dpbusd_epi32(s1, c[q + 1], _mm512_set1_epi32(x1));
    }
    return _mm512_add_epi32(s0, s1);
}

AVX512 QINLINE void q_panel_avx512_fmt(const QWeight *w, const int fmt, int64_t p, const QActs *a, int64_t t0,
                                             const int64_t nt, __m512 *acc) {
    const int64_t K = w->K, G = w->G;
    for (int t = 0; t < nt; t++)
        acc[t] = _mm512_setzero_ps();
    __m512 D = _mm512_setzero_ps(), Dm = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int64_t pg = p * G + g;
        /* Software prefetch of the group Q_PREFETCH_GROUPS ahead (its codes, and the fp16
         * fields' line every other group): the model's weights are about the size of the
         * last-level cache, so each step streams most of them, and the hardware prefetcher
         * alone left the one-token step at ~30 GB/s where the machine reads ~50. Past the
         * panel's end it touches the next panel's first groups (or harmlessly beyond). */
        {
            const char *cp = (const char *)(w->codes + (pg + Q_PREFETCH_GROUPS) * Q_GROUP_BYTES(fmt));
            for (int l = 0; l < Q_GROUP_BYTES(fmt) / 64; l++)
                _mm_prefetch(cp + 64 * l, _MM_HINT_T0);
            if ((g & 1) == 0 && Q_PER32_D(fmt)) {
                _mm_prefetch((const char *)(w->d + (pg + Q_PREFETCH_GROUPS) * PANEL), _MM_HINT_T0);
                if (fmt == F_Q4_1 || fmt == F_Q5_1)
                    _mm_prefetch((const char *)(w->m + (pg + Q_PREFETCH_GROUPS) * PANEL), _MM_HINT_T0);
            }
        }
        __m512i c[8];
        q_unpack(w, fmt, pg, c);
        if (Q_SUPER(fmt) && g % 8 == 0) {
            const int64_t ps = (p * (G / 8) + g / 8) * PANEL;
            D = q_ld_f16(w->d + ps);
            if (Q_DMIN(fmt))
                Dm = q_ld_f16(w->m + ps);
        }
        if (Q_PER16(fmt)) {
            __m512 S16[2], M16[2];
            q_sm16(w, fmt, (p * 2 * G + 2 * g) * PANEL, D, Dm, S16, M16);
            const __m512 S0 = S16[0], S1 = S16[1], M0 = M16[0], M1 = M16[1];
            for (int t = 0; t < nt; t++) {
                const int8_t *xq = a->xq + (t0 + t) * K + 32 * g;
                const float dx = a->dx[(t0 + t) * (K / 32) + g];
                const float *xs = a->xs + (t0 + t) * (K / 16) + 2 * g;
                __m512 v0 = _mm512_cvtepi32_ps(q_dot(c, xq, 0, 4));
                __m512 v1 = _mm512_cvtepi32_ps(q_dot(c, xq, 4, 4));
                acc[t] = _mm512_fmadd_ps(v0, _mm512_mul_ps(S0, _mm512_set1_ps(dx)), acc[t]);
                acc[t] = _mm512_fmadd_ps(M0, _mm512_set1_ps(xs[0]), acc[t]);
                acc[t] = _mm512_fmadd_ps(v1, _mm512_mul_ps(S1, _mm512_set1_ps(dx)), acc[t]);
                acc[t] = _mm512_fmadd_ps(M1, _mm512_set1_ps(xs[1]), acc[t]);
            }
            continue;
        }
        __m512 S, Mn;
        q_sm32(w, fmt, pg * PANEL, D, Dm, &S, &Mn);
        for (int t = 0; t < nt; t++) {
            const int8_t *xq = a->xq + (t0 + t) * K + 32 * g;
            const float dx = a->dx[(t0 + t) * (K / 32) + g];
            const float *xs = a->xs + (t0 + t) * (K / 16) + 2 * g;
            __m512 v = _mm512_cvtepi32_ps(q_dot(c, xq, 0, 8));
            acc[t] = _mm512_fmadd_ps(v, _mm512_mul_ps(S, _mm512_set1_ps(dx)), acc[t]);
            acc[t] = _mm512_fmadd_ps(Mn, _mm512_set1_ps(xs[0] + xs[1]), acc[t]);
        }
    }
}

/* One specialization per format, so the format tests fold away inside the loops. */
AVX512 static void q_panel_avx512(const QWeight *w, int64_t p, const QActs *a, int64_t t0, int64_t nt, float *out) {
    __m512 acc[TILE512];
    /* Constant tile sizes let the compiler keep acc[] and the unpacked codes in registers:
     * a full tile, one stream, and a verification chunk at k = 4 (5 rows). */
#define Q_TILES(F)                                                        \
    if (nt == TILE512)                                                    \
        q_panel_avx512_fmt(w, F, p, a, t0, TILE512, acc);                 \
    else if (nt == 1)                                                     \
        q_panel_avx512_fmt(w, F, p, a, t0, 1, acc);                       \
    else if (nt == 5)                                                     \
        q_panel_avx512_fmt(w, F, p, a, t0, 5, acc);                       \
    else                                                                  \
        q_panel_avx512_fmt(w, F, p, a, t0, nt, acc);
    switch (w->fmt) {
    case F_Q4_0: Q_TILES(F_Q4_0) break;
    case F_Q4_1: Q_TILES(F_Q4_1) break;
    case F_Q8_0: Q_TILES(F_Q8_0) break;
    case F_Q4_K: Q_TILES(F_Q4_K) break;
    case F_Q5_K: Q_TILES(F_Q5_K) break;
    case F_Q6_K: Q_TILES(F_Q6_K) break;
    case F_Q5_0: Q_TILES(F_Q5_0) break;
    case F_Q5_1: Q_TILES(F_Q5_1) break;
    case F_Q3_K: Q_TILES(F_Q3_K) break;
    case F_Q2_K: Q_TILES(F_Q2_K) break;
    case F_IQ4_NL: Q_TILES(F_IQ4_NL) break;
    default: Q_TILES(F_IQ4_XS)
    }
#undef Q_TILES
    for (int t = 0; t < nt; t++)
        _mm512_storeu_ps(out + t * PANEL, acc[t]);
}

static int q_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
}

/* q_quantize_row_c with AVX-512, value for value: the same amax (a max is exact in any
 * order), the same step and inverse, the same products rounded to nearest even (rintf in
 * the default rounding mode, as the conversion rounds), the same clamp, and integer sums. */
AVX512 static void q_quantize_row_avx512(const void *x, int bf, int64_t K, int8_t *xq, float *dx, float *xs) {
    const __m512 lim = _mm512_set1_ps(127.0f), nlim = _mm512_set1_ps(-127.0f);
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int64_t b = 0; b < K / 32; b++) {
        __m512 v0, v1;
        if (bf) {
            const uint16_t *p = (const uint16_t *)x + 32 * b;
            v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
            v1 = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 16))), 16));
        } else {
            v0 = _mm512_loadu_ps((const float *)x + 32 * b);
            v1 = _mm512_loadu_ps((const float *)x + 32 * b + 16);
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, sign), _mm512_and_ps(v1, sign)));
        const float step = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512 vi = _mm512_set1_ps(inv);
        __m512i q0 = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(v0, vi), lim), nlim));
        __m512i q1 = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(v1, vi), lim), nlim));
        _mm_storeu_si128((__m128i *)(xq + 32 * b), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(xq + 32 * b + 16), _mm512_cvtepi32_epi8(q1));
        dx[b] = step;
        xs[2 * b] = step * (float)_mm512_reduce_add_epi32(q0);
        xs[2 * b + 1] = step * (float)_mm512_reduce_add_epi32(q1);
    }
}

/* ---- the AMX-INT8 micro-kernel (batched steps) -------------------------------------- *
 *
 * The panel layout is AMX's B-tile layout: a quad vector (16 rows x 4 columns) is one
 * 64-byte tile row. Per group of 32 columns one TDPBSUD multiplies 16 tokens' int8
 * activations (A: 16 x 32 bytes, read in place with the row stride K) by the group's
 * 8 quads (B: 8 x 64 bytes) into 16 x 16 int32 sums, which the epilogue scales into fp32
 * as the VNNI kernel does. Q6_K's 16-column scales take two 16-column products. */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} QTileConfig;

/* Tile numbers: the _tile_* macros paste them into register names, so literals. */
#define T_C0 0
#define T_C1 1
#define T_A32 2
#define T_B32 3
#define T_A16 4
#define T_B16 5
#define T_A32B 6
#define T_B32B 7

/* GCC does not model the tile loads and stores as memory accesses (see q_tile_config):
 * a compiler barrier keeps the vector stores they read and the loads of what they wrote. */
#define Q_MEMORY_BARRIER() __asm__ __volatile__("" ::: "memory")

static int q_amx_state = -1; /* -1 unknown, 0 no, 1 usable */

/* AMX needs the CPU bits and the kernel's permission for the tile state (Linux asks each
 * process to request it; oneDNN does the same). Called before any parallel region. */
static int q_has_amx(void) {
    if (q_amx_state >= 0)
        return q_amx_state;
    unsigned a, b, c, d;
    int ok = q_has_avx512() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24)) && (d & (1u << 25));
#ifdef SYS_arch_prctl
    ok = ok && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
    ok = 0;
#endif
    q_amx_state = ok;
    return ok;
}

/* Static data rather than a stack struct: GCC 12 does not see _tile_loadconfig read its
 * argument and dropped the stores that filled a local one (the CPU then faulted on it). */
static const QTileConfig q_tile_config = {
    .palette = 1,
    .colsb = {[T_C0] = 64, [T_C1] = 64, [T_A32] = 32, [T_B32] = 64, [T_A16] = 16, [T_B16] = 64,
              [T_A32B] = 32, [T_B32B] = 64},
    .rows = {[T_C0] = 16, [T_C1] = 16, [T_A32] = 16, [T_B32] = 8, [T_A16] = 16, [T_B16] = 4,
             [T_A32B] = 16, [T_B32B] = 8},
};

AMX static void q_amx_configure(void) { _tile_loadconfig(&q_tile_config); }

AMX static void q_amx_release(void) { _tile_release(); }

/* acc[t] += the scaled int32 sums of group g for tokens t0 .. t0+nt-1. */
AMX QINLINE void q_amx_epilogue(const QActs *a, int64_t K, int64_t t0, int64_t nt, int64_t g, const int32_t *c,
                                __m512 S, __m512 Mn, __m512 *acc) {
    for (int t = 0; t < nt; t++) {
        const float dx = a->dx[(t0 + t) * (K / 32) + g];
        const float *xs = a->xs + (t0 + t) * (K / 16) + 2 * g;
        __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c + 16 * t)));
        acc[t] = _mm512_fmadd_ps(v, _mm512_mul_ps(S, _mm512_set1_ps(dx)), acc[t]);
        acc[t] = _mm512_fmadd_ps(Mn, _mm512_set1_ps(xs[0] + xs[1]), acc[t]);
    }
}

/* Tokens t0 .. t0+15 must be readable in a->xq (the buffer is padded to 16 tokens);
 * results for the first nt go to out[t * 16 + r]. */
AMX QINLINE void q_panel_amx_fmt(const QWeight *w, const int fmt, int64_t p, const QActs *a, int64_t t0, int64_t nt,
                                 float *out) {
    const int64_t K = w->K, G = w->G;
    __m512 acc[16];
    _Alignas(64) uint8_t bbuf[512];
    _Alignas(64) int32_t cbuf[2][256];
    for (int t = 0; t < 16; t++)
        acc[t] = _mm512_setzero_ps();
    __m512 D = _mm512_setzero_ps(), Dm = _mm512_setzero_ps();
    __m512 Sprev = _mm512_setzero_ps(), Mprev = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int64_t pg = p * G + g;
        const uint8_t *B;
        if (fmt == F_Q8_0) {
            B = w->codes + pg * 512;
        } else {
            __m512i c[8];
            q_unpack(w, fmt, pg, c);
            for (int q = 0; q < 8; q++)
                _mm512_store_si512((void *)(bbuf + 64 * q), c[q]);
            Q_MEMORY_BARRIER(); /* the tile load below reads bbuf */
            B = bbuf;
        }
        const int8_t *A = a->xq + t0 * K + 32 * g;
        if (Q_SUPER(fmt) && g % 8 == 0) {
            const int64_t ps = (p * (G / 8) + g / 8) * PANEL;
            D = q_ld_f16(w->d + ps);
            if (Q_DMIN(fmt))
                Dm = q_ld_f16(w->m + ps);
        }
        if (Q_PER16(fmt)) {
            _tile_zero(T_C0);
            _tile_zero(T_C1);
            _tile_loadd(T_A16, A, K);
            _tile_loadd(T_B16, B, 64);
            _tile_dpbsud(T_C0, T_A16, T_B16);
            _tile_loadd(T_A16, A + 16, K);
            _tile_loadd(T_B16, B + 256, 64);
            _tile_dpbsud(T_C1, T_A16, T_B16);
            _tile_stored(T_C0, cbuf[0], 64);
            _tile_stored(T_C1, cbuf[1], 64);
            Q_MEMORY_BARRIER();
            __m512 S16[2], M16[2];
            q_sm16(w, fmt, (p * 2 * G + 2 * g) * PANEL, D, Dm, S16, M16);
            const __m512 S0 = S16[0], S1 = S16[1], M0 = M16[0], M1 = M16[1];
            for (int t = 0; t < nt; t++) {
                const float dx = a->dx[(t0 + t) * (K / 32) + g];
                const float *xs = a->xs + (t0 + t) * (K / 16) + 2 * g;
                __m512 v0 = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(cbuf[0] + 16 * t)));
                __m512 v1 = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(cbuf[1] + 16 * t)));
                acc[t] = _mm512_fmadd_ps(v0, _mm512_mul_ps(S0, _mm512_set1_ps(dx)), acc[t]);
                acc[t] = _mm512_fmadd_ps(M0, _mm512_set1_ps(xs[0]), acc[t]);
                acc[t] = _mm512_fmadd_ps(v1, _mm512_mul_ps(S1, _mm512_set1_ps(dx)), acc[t]);
                acc[t] = _mm512_fmadd_ps(M1, _mm512_set1_ps(xs[1]), acc[t]);
            }
            continue;
        }
        /* Software pipeline: group g's product goes to C0 or C1 by parity, and the epilogue
         * of group g - 1 runs after g's tile instructions are issued, so the AMX unit and
         * the tile-store-to-vector-load latency overlap the fp32 work. */
        if (g % 2 == 0) {
            _tile_zero(T_C0);
            _tile_loadd(T_A32, A, K);
            _tile_loadd(T_B32, B, 64);
            _tile_dpbsud(T_C0, T_A32, T_B32);
            _tile_stored(T_C0, cbuf[0], 64);
        } else {
            _tile_zero(T_C1);
            _tile_loadd(T_A32B, A, K);
            _tile_loadd(T_B32B, B, 64);
            _tile_dpbsud(T_C1, T_A32B, T_B32B);
            _tile_stored(T_C1, cbuf[1], 64);
        }
        Q_MEMORY_BARRIER();
        __m512 S, Mn;
        q_sm32(w, fmt, pg * PANEL, D, Dm, &S, &Mn);
        if (g > 0)
            q_amx_epilogue(a, K, t0, nt, g - 1, cbuf[(g - 1) % 2], Sprev, Mprev, acc);
        Sprev = S, Mprev = Mn;
    }
    if (!Q_PER16(fmt))
        q_amx_epilogue(a, K, t0, nt, G - 1, cbuf[(G - 1) % 2], Sprev, Mprev, acc);
    for (int t = 0; t < nt; t++)
        _mm512_storeu_ps(out + t * PANEL, acc[t]);
}

AMX static void q_panel_amx(const QWeight *w, int64_t p, const QActs *a, int64_t t0, int64_t nt, float *out) {
    switch (w->fmt) {
    case F_Q4_0: q_panel_amx_fmt(w, F_Q4_0, p, a, t0, nt, out); break;
    case F_Q4_1: q_panel_amx_fmt(w, F_Q4_1, p, a, t0, nt, out); break;
    case F_Q8_0: q_panel_amx_fmt(w, F_Q8_0, p, a, t0, nt, out); break;
    case F_Q4_K: q_panel_amx_fmt(w, F_Q4_K, p, a, t0, nt, out); break;
    case F_Q5_K: q_panel_amx_fmt(w, F_Q5_K, p, a, t0, nt, out); break;
    case F_Q6_K: q_panel_amx_fmt(w, F_Q6_K, p, a, t0, nt, out); break;
    case F_Q5_0: q_panel_amx_fmt(w, F_Q5_0, p, a, t0, nt, out); break;
    case F_Q5_1: q_panel_amx_fmt(w, F_Q5_1, p, a, t0, nt, out); break;
    case F_Q3_K: q_panel_amx_fmt(w, F_Q3_K, p, a, t0, nt, out); break;
    case F_Q2_K: q_panel_amx_fmt(w, F_Q2_K, p, a, t0, nt, out); break;
    case F_IQ4_NL: q_panel_amx_fmt(w, F_IQ4_NL, p, a, t0, nt, out); break;
    default: q_panel_amx_fmt(w, F_IQ4_XS, p, a, t0, nt, out);
    }
}

/* ---- the AMX-BF16 path (large batches) ---------------------------------------------- *
 *
 * The int8 kernels pay an fp32 epilogue per token and per 32 columns (the group's scale);
 * at 32+ tokens that epilogue costs more than the products. Here each panel is instead
 * dequantized once per 64-token block into bf16 B tiles (16 column pairs x 16 rows), the
 * activations are rounded to bf16, and TDPBF16PS accumulates a 16 x 16 fp32 tile over the
 * whole K with no per-group work: the weight cost is paid once per 64 tokens. */

/* Tokens whose bf16 activations one dequantized panel serves before the next panel: the
 * panel's dequantization is paid once per block, so the longer the better, while the
 * block's activations (2K bytes a token) stay in L2 as the panels stream past them. As
 * many 64-token tiles as fit AMX_BF16_BLOCK_BYTES, from 1 to 4. Measured (2 threads, 512
 * tokens, Q4_K/Q8_0/Q3_K): 64 tokens 3.1-3.4 ms at K = 1,024 x N = 2,816, 128 tokens
 * 2.6-2.8, 256 tokens 2.3-2.7; at K = 2,816, 256 tokens (1.4 MB) ran slower than 128. */
#ifndef AMX_BF16_BLOCK_BYTES
#define AMX_BF16_BLOCK_BYTES (1 << 20)
#endif

static int64_t q_amx_bf16_token_block(int64_t K) {
    int64_t tiles = AMX_BF16_BLOCK_BYTES / (2 * K) / 64;
    return 64 * (tiles < 1 ? 1 : tiles > 4 ? 4 : tiles);
}

#define AMXBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx512bf16,avx2,fma,f16c,amx-tile,amx-int8,amx-bf16")))

/* Tiles 0, 3, 4, 5: fp32 sums (16 tokens x 16 rows); 1, 6, 7: bf16 activations (16 tokens
 * x 32 columns); 2: the panel's bf16 weights (16 column pairs x 16 rows). */
static const QTileConfig q_tile_config_bf16 = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

static int q_amx_bf16_state = -1;

static int q_has_amx_bf16(void) {
    if (q_amx_bf16_state < 0) {
        unsigned a, b, c, d;
        q_amx_bf16_state = q_has_amx() && __builtin_cpu_supports("avx512bf16") &&
                           __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22));
    }
    return q_amx_bf16_state;
}

/* Group g of panel p as one bf16 B tile at dst (1024 bytes): row i holds columns 2i, 2i+1
 * of the panel's 16 rows, w = code * scale + min rounded to bf16. */
AMXBF16 QINLINE void q_dequant_group_bf16(const QWeight *w, const int fmt, int64_t p, int64_t g, __m512 D,
                                          __m512 Dm, uint8_t *dst) {
    const int64_t G = w->G, pg = p * G + g, o = pg * PANEL;
    __m512i c[8];
    q_unpack(w, fmt, pg, c);
    __m512 S[2], Mn[2];
    if (Q_PER16(fmt)) {
        q_sm16(w, fmt, (p * 2 * G + 2 * g) * PANEL, D, Dm, S, Mn);
    } else {
        q_sm32(w, fmt, o, D, Dm, &S[0], &Mn[0]);
        S[1] = S[0], Mn[1] = Mn[0];
    }
    /* Lane l of 16-byte chunk k of a quad is row 4k + l/4, column j = l % 4. */
    __m512 Se[2][4], Me[2][4];
    for (int k = 0; k < 4; k++) {
        const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(4 * k),
                                             _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2));
        for (int h = 0; h < 2; h++) {
            Se[h][k] = _mm512_permutexvar_ps(idx, S[h]);
            Me[h][k] = _mm512_permutexvar_ps(idx, Mn[h]);
        }
    }
    /* 32-bit element e of a packed pair of chunks is row e/2 (of 8), columns (2(e%2), +1). */
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int q = 0; q < 8; q++) {
        const int h = Q_PER16(fmt) ? q / 4 : 0;
        __m512 f[4];
        for (int k = 0; k < 4; k++) {
            __m512i v = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(c[q], k));
            f[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), Se[h][k], Me[h][k]);
        }
        __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]); /* rows 0-7 */
        __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]); /* rows 8-15 */
        _mm512_store_si512((void *)(dst + (2 * q) * 64), _mm512_permutex2var_epi32(lo, even, hi));
        _mm512_store_si512((void *)(dst + (2 * q + 1) * 64), _mm512_permutex2var_epi32(lo, odd, hi));
    }
}

AMXBF16 QINLINE void q_dequant_panel_bf16_fmt(const QWeight *w, const int fmt, int64_t p, uint8_t *dst) {
    __m512 D = _mm512_setzero_ps(), Dm = _mm512_setzero_ps();
    for (int64_t g = 0; g < w->G; g++) {
        if (Q_SUPER(fmt) && g % 8 == 0) {
            const int64_t ps = (p * (w->G / 8) + g / 8) * PANEL;
            D = q_ld_f16(w->d + ps);
            if (Q_DMIN(fmt))
                Dm = q_ld_f16(w->m + ps);
        }
        q_dequant_group_bf16(w, fmt, p, g, D, Dm, dst + g * 1024);
    }
}

AMXBF16 static void q_dequant_panel_bf16(const QWeight *w, int64_t p, uint8_t *dst) {
    switch (w->fmt) {
    case F_Q4_0: q_dequant_panel_bf16_fmt(w, F_Q4_0, p, dst); break;
    case F_Q4_1: q_dequant_panel_bf16_fmt(w, F_Q4_1, p, dst); break;
    case F_Q8_0: q_dequant_panel_bf16_fmt(w, F_Q8_0, p, dst); break;
    case F_Q4_K: q_dequant_panel_bf16_fmt(w, F_Q4_K, p, dst); break;
    case F_Q5_K: q_dequant_panel_bf16_fmt(w, F_Q5_K, p, dst); break;
    case F_Q6_K: q_dequant_panel_bf16_fmt(w, F_Q6_K, p, dst); break;
    case F_Q5_0: q_dequant_panel_bf16_fmt(w, F_Q5_0, p, dst); break;
    case F_Q5_1: q_dequant_panel_bf16_fmt(w, F_Q5_1, p, dst); break;
    case F_Q3_K: q_dequant_panel_bf16_fmt(w, F_Q3_K, p, dst); break;
    case F_Q2_K: q_dequant_panel_bf16_fmt(w, F_Q2_K, p, dst); break;
    case F_IQ4_NL: q_dequant_panel_bf16_fmt(w, F_IQ4_NL, p, dst); break;
    default: q_dequant_panel_bf16_fmt(w, F_IQ4_XS, p, dst);
    }
    Q_MEMORY_BARRIER(); /* the tile loads read dst */
}

AMXBF16 static void q_amx_bf16_configure(void) { _tile_loadconfig(&q_tile_config_bf16); }

/* out rows t0 .. t0+63 of panel p (64 tokens, 4 x 16): each group's weight tile is loaded
 * once for the four token tiles, and the four sums are independent, so the TDPBF16PS of
 * one tile does not wait for the one before it (a single running sum made each product
 * wait out the previous one's latency). Each sum takes the groups in the same order as
 * q_panel_amx_bf16's, so both give the same bits. */
AMXBF16 static void q_panel_amx_bf16_x4(const QWeight *w, const uint16_t *xb, const uint8_t *wb, int64_t t0,
                                        float *out /* [64][16] */) {
    const int64_t K = w->K;
    const uint16_t *x0 = xb + t0 * K;
    _tile_zero(0);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t g = 0; g < w->G; g++) {
        _tile_loadd(2, wb + g * 1024, 64);
        _tile_loadd(1, x0 + 32 * g, 2 * K);
        _tile_dpbf16ps(0, 1, 2);
        _tile_loadd(6, x0 + 16 * K + 32 * g, 2 * K);
        _tile_dpbf16ps(3, 6, 2);
        _tile_loadd(7, x0 + 32 * K + 32 * g, 2 * K);
        _tile_dpbf16ps(4, 7, 2);
        _tile_loadd(1, x0 + 48 * K + 32 * g, 2 * K);
        _tile_dpbf16ps(5, 1, 2);
    }
    _tile_stored(0, out, 64);
    _tile_stored(3, out + 256, 64);
    _tile_stored(4, out + 512, 64);
    _tile_stored(5, out + 768, 64);
    Q_MEMORY_BARRIER();
}

/* out rows t0 .. t0+nt-1 (nt <= 16) of panel p: xb is the bf16 activations [>= t0+16, K]. */
AMXBF16 static void q_panel_amx_bf16(const QWeight *w, const uint16_t *xb, const uint8_t *wb, int64_t t0,
                                     float *out) {
    const int64_t K = w->K;
    _tile_zero(0);
    for (int64_t g = 0; g < w->G; g++) {
        _tile_loadd(1, xb + t0 * K + 32 * g, 2 * K);
        _tile_loadd(2, wb + g * 1024, 64);
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, out, 64);
    Q_MEMORY_BARRIER();
}

static int q_matmul_amx_bf16(const QWeight *w, int dtype, void *out, int64_t out_stride, const void *x,
                             int64_t x_stride, int64_t M, int nthreads) {
    const int64_t K = w->K, N = w->N, Mpad = (M + 15) / 16 * 16;
    uint16_t *xb = aligned_alloc(64, (size_t)(Mpad * K * 2 + 63) / 64 * 64);
    uint8_t *wbufs = aligned_alloc(64, (size_t)nthreads * (size_t)w->G * 1024);
    if (!xb || !wbufs) {
        free(xb), free(wbufs);
        return Q_NO_MEMORY;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < M; t++) {
        if (dtype != QDT_F32) {
            memcpy(xb + t * K, (const uint16_t *)x + t * x_stride, (size_t)K * 2);
        } else {
            for (int64_t k = 0; k < K; k++)
                xb[t * K + k] = q_f32_to_bf16(((const float *)x)[t * x_stride + k]);
        }
    }
    memset(xb + M * K, 0, (size_t)((Mpad - M) * K * 2));
    const int64_t tblock = q_amx_bf16_token_block(K), nblocks = (M + tblock - 1) / tblock;
#pragma omp parallel num_threads(nthreads)
    {
        uint8_t *wb = wbufs + (size_t)omp_get_thread_num() * (size_t)w->G * 1024;
        q_amx_bf16_configure();
#pragma omp for collapse(2) schedule(static)
        for (int64_t tb = 0; tb < nblocks; tb++) {
            for (int64_t p = 0; p < w->P; p++) {
                _Alignas(64) float acc[64 * PANEL];
                const int64_t rows = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
                const int64_t tend = (tb + 1) * tblock < M ? (tb + 1) * tblock : M;
                q_dequant_panel_bf16(w, p, wb);
                for (int64_t t0 = tb * tblock; t0 < tend;) {
                    const int64_t nt = tend - t0 >= 64 ? 64 : tend - t0 < 16 ? tend - t0 : 16;
                    if (nt == 64)
                        q_panel_amx_bf16_x4(w, xb, wb, t0, acc);
                    else
                        q_panel_amx_bf16(w, xb, wb, t0, acc);
                    for (int64_t t = 0; t < nt; t++)
                        q_store(out, dtype, out_stride, t0 + t, p * PANEL, rows, acc + t * PANEL);
                    t0 += nt;
                }
            }
        }
        q_amx_release();
    }
    free(xb), free(wbufs);
    return Q_OK;
}
#endif

/* ---- the AVX2 micro-kernel ---------------------------------------------------------- *
 *
 * For x86-64 CPUs with AVX2, FMA and F16C but no AVX-512 (AMD Zen 2/3, most laptops).
 * AVX2 has no int8 dot product into int32 (AVX-VNNI is rarer still), so a quad of 4
 * columns takes vpmaddubsw (uint8 code x int8 activation, adjacent pairs summed to int16)
 * then vpmaddwd by ones (pairs of int16 summed to int32), as llama.cpp's AVX2 dot products
 * do. The int16 pair sum is at most 2 * 63 * 127 = 16002 for codes of up to 6 bits, so it
 * never saturates; Q8_0's 8-bit codes (up to 255) could, so they are split into nibbles,
 * each dotted alone and recombined as lo + 16 hi in int32.
 * A 64-byte quad vector (16 rows x 4 columns) is two 32-byte halves of 8 rows each. */

#if HAVE_AVX512_PATH
#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 QINLINE __m256 q2_ld_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

AVX2 QINLINE __m256 q2_ld_u8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

AVX2 QINLINE __m256 q2_ld_i8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* 32 bits of a hi1 mask -> 32 bytes, `value` where the bit is set (bit i -> byte i). */
AVX2 QINLINE __m256i q2_bits_to(uint32_t bits, char value) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    b = _mm256_cmpeq_epi8(_mm256_and_si256(b, select), select);
    return _mm256_and_si256(b, _mm256_set1_epi8(value));
}

/* Quads 0..7 of rows 8h .. 8h+7 of group pg (Q8_0: c[] holds the low nibbles, c[8 + q]
 * the high ones). */
AVX2 QINLINE void q2_unpack(const QWeight *w, int fmt, int64_t pg, int h, __m256i *c) {
    const __m256i low4 = _mm256_set1_epi8(15);
    if (fmt == F_Q8_0) {
        for (int q = 0; q < 8; q++) {
            __m256i b = _mm256_loadu_si256((const __m256i *)(w->codes + pg * 512 + 64 * q + 32 * h));
            c[q] = _mm256_and_si256(b, low4);
            c[8 + q] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
        }
        return;
    }
    if (Q_CODES2(fmt)) {
        const __m256i low2 = _mm256_set1_epi8(3);
        for (int v = 0; v < 2; v++) {
            __m256i b = _mm256_loadu_si256((const __m256i *)(w->codes + pg * 128 + 64 * v + 32 * h));
            for (int i = 0; i < 4; i++)
                c[4 * v + i] = _mm256_and_si256(_mm256_srli_epi16(b, 2 * i), low2);
        }
    } else {
        for (int v = 0; v < 4; v++) {
            __m256i b = _mm256_loadu_si256((const __m256i *)(w->codes + pg * 256 + 64 * v + 32 * h));
            c[2 * v] = _mm256_and_si256(b, low4);
            c[2 * v + 1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
        }
        if (Q_LUT(fmt)) { /* looked up, then split into nibbles as Q8_0's codes are */
            const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)Q_IQ4_U8));
            for (int q = 0; q < 8; q++) {
                const __m256i u = _mm256_shuffle_epi8(lut, c[q]);
                c[q] = _mm256_and_si256(u, low4);
                c[8 + q] = _mm256_and_si256(_mm256_srli_epi16(u, 4), low4);
            }
        }
    }
    if (Q_HI1(fmt)) {
        for (int q = 0; q < 8; q++) {
            uint64_t mk;
            memcpy(&mk, w->hi + (pg * 8 + q) * 8, 8);
            c[q] = _mm256_or_si256(c[q], q2_bits_to((uint32_t)(mk >> (32 * h)), (char)(1 << Q_HI1_BIT(fmt))));
        }
    } else if (fmt == F_Q6_K) {
        const __m256i low2 = _mm256_set1_epi8(3);
        for (int hh = 0; hh < 2; hh++) {
            __m256i b = _mm256_loadu_si256((const __m256i *)(w->hi + (pg * 2 + hh) * 64 + 32 * h));
            for (int i = 0; i < 4; i++) {
                __m256i bits = _mm256_and_si256(_mm256_srli_epi16(b, 2 * i), low2);
                c[4 * hh + i] = _mm256_or_si256(c[4 * hh + i], _mm256_slli_epi16(bits, 4));
            }
        }
    }
}

/* int32 dot of 8 rows with quads q0 .. q0+nq-1 of xq. */
AVX2 QINLINE __m256i q2_dot(const __m256i *c, const int8_t *xq, int q0, int nq) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s = _mm256_setzero_si256();
    for (int q = q0; q < q0 + nq; q++) {
        int32_t xv;
        memcpy(&xv, xq + 4 * q, 4);
        __m256i p16 = _mm256_maddubs_epi16(c[q], _mm256_set1_epi32(xv));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p16, ones));
    }
    return s;
}

AVX2 QINLINE void q_panel_avx2_fmt(const QWeight *w, const int fmt, int64_t p, const QActs *a, int64_t t0,
                                   const int64_t nt, float *out) {
    const int64_t K = w->K, G = w->G;
    for (int h = 0; h < 2; h++) {
        __m256 acc[TILE];
        for (int t = 0; t < TILE; t++)
            acc[t] = _mm256_setzero_ps();
        __m256 D = _mm256_setzero_ps(), Dm = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            const int64_t pg = p * G + g;
            __m256i c[16];
            q2_unpack(w, fmt, pg, h, c);
            if (Q_SUPER(fmt) && g % 8 == 0) {
                const int64_t ps = (p * (G / 8) + g / 8) * PANEL + 8 * h;
                D = q2_ld_f16(w->d + ps);
                if (Q_DMIN(fmt))
                    Dm = q2_ld_f16(w->m + ps);
            }
            if (Q_PER16(fmt)) {
                const int64_t p16 = (p * 2 * G + 2 * g) * PANEL + 8 * h;
                __m256 S0, S1, M0, M1;
                if (fmt == F_Q2_K) {
                    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w->sc + p16)));
                    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w->sc + p16 + PANEL)));
                    const __m256i low = _mm256_set1_epi32(15);
                    S0 = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_and_si256(b0, low)));
                    S1 = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_and_si256(b1, low)));
                    M0 = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(Dm, _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4))));
                    M1 = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(Dm, _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4))));
                } else {
                    const __m256 off = _mm256_set1_ps(fmt == F_Q6_K ? -32.0f : -4.0f);
                    S0 = _mm256_mul_ps(D, q2_ld_i8(w->sc + p16));
                    S1 = _mm256_mul_ps(D, q2_ld_i8(w->sc + p16 + PANEL));
                    M0 = _mm256_mul_ps(S0, off);
                    M1 = _mm256_mul_ps(S1, off);
                }
                for (int t = 0; t < nt; t++) {
                    const int8_t *xq = a->xq + (t0 + t) * K + 32 * g;
                    const float dx = a->dx[(t0 + t) * (K / 32) + g];
                    const float *xs = a->xs + (t0 + t) * (K / 16) + 2 * g;
                    __m256 v0 = _mm256_cvtepi32_ps(q2_dot(c, xq, 0, 4));
                    __m256 v1 = _mm256_cvtepi32_ps(q2_dot(c, xq, 4, 4));
                    acc[t] = _mm256_fmadd_ps(v0, _mm256_mul_ps(S0, _mm256_set1_ps(dx)), acc[t]);
                    acc[t] = _mm256_fmadd_ps(M0, _mm256_set1_ps(xs[0]), acc[t]);
                    acc[t] = _mm256_fmadd_ps(v1, _mm256_mul_ps(S1, _mm256_set1_ps(dx)), acc[t]);
                    acc[t] = _mm256_fmadd_ps(M1, _mm256_set1_ps(xs[1]), acc[t]);
                }
                continue;
            }
            __m256 S, Mn;
            const int64_t o = pg * PANEL + 8 * h;
            switch (fmt) {
            case F_Q4_0: S = q2_ld_f16(w->d + o); Mn = _mm256_mul_ps(S, _mm256_set1_ps(-8.0f)); break;
            case F_Q5_0: S = q2_ld_f16(w->d + o); Mn = _mm256_mul_ps(S, _mm256_set1_ps(-16.0f)); break;
            case F_Q4_1:
            case F_Q5_1: S = q2_ld_f16(w->d + o); Mn = q2_ld_f16(w->m + o); break;
            case F_Q8_0:
            case F_IQ4_NL: S = q2_ld_f16(w->d + o); Mn = _mm256_mul_ps(S, _mm256_set1_ps(-128.0f)); break;
            case F_IQ4_XS:
                S = _mm256_mul_ps(D, q2_ld_i8(w->sc + o));
                Mn = _mm256_mul_ps(S, _mm256_set1_ps(-128.0f));
                break;
            default: /* Q4_K, Q5_K: -(dmin * mn) as the portable path rounds it */
                S = _mm256_mul_ps(D, q2_ld_u8(w->sc + o));
                Mn = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(Dm, q2_ld_u8(w->mn + o)));
            }
            for (int t = 0; t < nt; t++) {
                const int8_t *xq = a->xq + (t0 + t) * K + 32 * g;
                const float dx = a->dx[(t0 + t) * (K / 32) + g];
                const float *xs = a->xs + (t0 + t) * (K / 16) + 2 * g;
                __m256i si = q2_dot(c, xq, 0, 8);
                if (fmt == F_Q8_0 || Q_LUT(fmt)) /* lo + 16 hi: exact in int32 */
                    si = _mm256_add_epi32(si, _mm256_slli_epi32(q2_dot(c + 8, xq, 0, 8), 4));
                __m256 v = _mm256_cvtepi32_ps(si);
                acc[t] = _mm256_fmadd_ps(v, _mm256_mul_ps(S, _mm256_set1_ps(dx)), acc[t]);
                acc[t] = _mm256_fmadd_ps(Mn, _mm256_set1_ps(xs[0] + xs[1]), acc[t]);
            }
        }
        for (int t = 0; t < nt; t++)
            _mm256_storeu_ps(out + t * PANEL + 8 * h, acc[t]);
    }
}

AVX2 static void q_panel_avx2(const QWeight *w, int64_t p, const QActs *a, int64_t t0, int64_t nt, float *out) {
#define Q_TILES(F)                                          \
    if (nt == TILE)                                         \
        q_panel_avx2_fmt(w, F, p, a, t0, TILE, out);        \
    else if (nt == 1)                                       \
        q_panel_avx2_fmt(w, F, p, a, t0, 1, out);           \
    else                                                    \
        q_panel_avx2_fmt(w, F, p, a, t0, nt, out);
    switch (w->fmt) {
    case F_Q4_0: Q_TILES(F_Q4_0) break;
    case F_Q4_1: Q_TILES(F_Q4_1) break;
    case F_Q8_0: Q_TILES(F_Q8_0) break;
    case F_Q4_K: Q_TILES(F_Q4_K) break;
    case F_Q5_K: Q_TILES(F_Q5_K) break;
    case F_Q6_K: Q_TILES(F_Q6_K) break;
    case F_Q5_0: Q_TILES(F_Q5_0) break;
    case F_Q5_1: Q_TILES(F_Q5_1) break;
    case F_Q3_K: Q_TILES(F_Q3_K) break;
    case F_Q2_K: Q_TILES(F_Q2_K) break;
    case F_IQ4_NL: Q_TILES(F_IQ4_NL) break;
    default: Q_TILES(F_IQ4_XS)
    }
#undef Q_TILES
}

static int q_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#endif

/* Activations quantized per 32 columns (q_quantize_row_c), with AVX-512 where the CPU has it:
 * ~0.3 ns a value against ~2 for the compiled C, whose per-block reductions do not vectorize
 * (the fused step quantizes ~3,300 values a layer on one stream). */
static void q_quantize_row(const void *x, int bf, int64_t K, int8_t *xq, float *dx, float *xs) {
#if HAVE_AVX512_PATH
    static int avx512 = -1;
    if (avx512 < 0)
        avx512 = q_has_avx512();
    if (avx512) {
        q_quantize_row_avx512(x, bf, K, xq, dx, xs);
        return;
    }
#endif
    q_quantize_row_c(x, bf, K, xq, dx, xs);
}

/* ---- entry points ------------------------------------------------------------------- */

static int q_check(int fmt, int64_t K, int64_t N) {
    if (fmt < 0 || fmt >= F_COUNT || K <= 0 || N <= 0)
        return Q_BAD_ARGS;
    return K % q_block_cols[fmt] ? Q_BAD_ARGS : Q_OK;
}

/* Whether this CPU runs the AVX2 path (isa 5). */
int eng_q_has_avx2(void) {
#if HAVE_AVX512_PATH
    return q_has_avx2();
#else
    return 0;
#endif
}

/* The paths this CPU has: 0 only the portable C, 1 + AVX-512 VNNI, 2 + AMX-INT8,
 * 3 + AMX-BF16. */
int eng_q_isa(void) {
#if HAVE_AVX512_PATH
    return q_has_avx512() ? 1 + q_has_amx() + q_has_amx_bf16() : 0;
#else
    return 0;
#endif
}

static void q_store(void *out, int dtype, int64_t out_stride, int64_t t, int64_t n0, int64_t rows, const float *v) {
    if (dtype == QDT_BF16) {
        uint16_t *o = (uint16_t *)out + t * out_stride + n0;
        for (int64_t r = 0; r < rows; r++)
            o[r] = q_f32_to_bf16(v[r]);
    } else if (dtype == QDT_BF16_F32) {
        float *o = (float *)out + t * out_stride + n0;
        for (int64_t r = 0; r < rows; r++)
            o[r] = q_bf16_to_f32(q_f32_to_bf16(v[r]));
    } else {
        float *o = (float *)out + t * out_stride + n0;
        for (int64_t r = 0; r < rows; r++)
            o[r] = v[r];
    }
}

/* Tokens from which "auto" takes the AMX-BF16 path (dequantize each panel once per 64
 * tokens, no per-group epilogue). Measured on the dev machine (1 thread, SmolLM2 shapes):
 * at 1-8 tokens AVX-512 VNNI is fastest (its weight reads are 4-bit), at 32 AMX-BF16 runs
 * 1.6-1.8x faster than either int8 path. AMX-INT8 measured no faster than VNNI at any
 * batch (its per-group fp32 epilogue dominates), so "auto" never picks it.
 * Steps of up to 48 rows run in the fused decode step (fused.c, engine/ops/cpu/fused.py's
 * MAX_TOKENS), whose int8 micro-kernels with one C call a step outrun the unfused layers
 * with AMX-BF16 matmuls up to there (docs/benchmarks.md, "Eighth pass"); the unfused path
 * takes the same int8 kernels to the same row count, so both give the same bits, and
 * AMX-BF16 from the next row. */
#define AMX_BF16_MIN_TOKENS 49

/* out[t, n] (row stride out_stride elements) = x[t, :] . w[n, :] for t < M, n < N. x rows
 * have stride x_stride; x and out are fp32 (dtype 0) or bf16 (1), or x bf16 and out fp32 (2). `isa`: 0 the best path
 * for M, 1 portable C, 2 AVX-512 VNNI, 3 AMX-INT8, 4 AMX-BF16, 5 AVX2 (each falls back to
 * the int8 paths below it where the CPU lacks it: AVX-512, then AVX2, then portable). Returns Q_OK, or Q_BAD_ARGS / Q_NO_MEMORY without touching out. */
int eng_qmatmul(int fmt, int isa, int dtype, void *out, int64_t out_stride, const void *x, int64_t x_stride,
                int64_t M, int64_t K, int64_t N, const uint8_t *codes, const uint8_t *hi, const uint16_t *d,
                const uint16_t *m, const uint8_t *sc, const uint8_t *mn, int nthreads) {
    if (q_check(fmt, K, N) || M < 0 || (dtype != QDT_F32 && dtype != QDT_BF16 && dtype != QDT_BF16_F32) || !codes ||
        !d)
        return Q_BAD_ARGS;
    if (M == 0)
        return Q_OK;
    QWeight w = {fmt, K, N, (N + PANEL - 1) / PANEL, K / 32, codes, hi, d, m, sc, mn};
    if ((double)M * (double)K * (double)N < QPARALLEL_MIN_WORK)
        nthreads = 1;
#if HAVE_AVX512_PATH
    if ((isa == 4 || (isa == 0 && M >= AMX_BF16_MIN_TOKENS)) && q_has_amx_bf16())
        return q_matmul_amx_bf16(&w, dtype, out, out_stride, x, x_stride, M, nthreads);
#endif
    QActs a;
    const int64_t Mpad = (M + 15) / 16 * 16; /* AMX tiles read 16 token rows */
    a.xq = aligned_alloc(64, (size_t)((Mpad * K + 63) / 64 * 64));
    a.dx = malloc(sizeof(float) * (size_t)(M * (K / 32)));
    a.xs = malloc(sizeof(float) * (size_t)(M * (K / 16)));
    if (!a.xq || !a.dx || !a.xs) {
        free(a.xq), free(a.dx), free(a.xs);
        return Q_NO_MEMORY;
    }
    int use_avx512 = 0, use_amx = 0, use_avx2 = 0;
#if HAVE_AVX512_PATH
    use_avx512 = isa != 1 && isa != 5 && q_has_avx512();
    use_amx = use_avx512 && isa == 3 && q_has_amx();
    use_avx2 = isa != 1 && !use_avx512 && q_has_avx2();
#endif
    memset(a.xq + M * K, 0, (size_t)((Mpad - M) * K));
    const int esize = dtype != QDT_F32 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K >= 65536)
    for (int64_t t = 0; t < M; t++)
        q_quantize_row((const char *)x + t * x_stride * esize, dtype != QDT_F32, K, a.xq + t * K,
                       a.dx + t * (K / 32), a.xs + t * (K / 16));
    const int64_t nblocks = (M + TOKEN_BLOCK - 1) / TOKEN_BLOCK;
    const int64_t tile = use_amx ? 16 : use_avx512 ? TILE512 : TILE;
#pragma omp parallel num_threads(nthreads)
    {
#if HAVE_AVX512_PATH
        if (use_amx) /* tile configuration is per thread */
            q_amx_configure();
#endif
#pragma omp for collapse(2) schedule(static)
        for (int64_t tb = 0; tb < nblocks; tb++) {
            for (int64_t p = 0; p < w.P; p++) {
                float acc[16 * PANEL];
                const int64_t rows = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
                const int64_t tend = (tb + 1) * TOKEN_BLOCK < M ? (tb + 1) * TOKEN_BLOCK : M;
                for (int64_t t0 = tb * TOKEN_BLOCK; t0 < tend; t0 += tile) {
                    const int64_t nt = tend - t0 < tile ? tend - t0 : tile;
#if HAVE_AVX512_PATH
                    if (use_amx)
                        q_panel_amx(&w, p, &a, t0, nt, acc);
                    else if (use_avx512)
                        q_panel_avx512(&w, p, &a, t0, nt, acc);
                    else if (use_avx2)
                        q_panel_avx2(&w, p, &a, t0, nt, acc);
                    else
#endif
                        q_panel_portable(&w, p, &a, t0, nt, acc);
                    for (int64_t t = 0; t < nt; t++)
                        q_store(out, dtype, out_stride, t0 + t, p * PANEL, rows, acc + t * PANEL);
                }
            }
        }
#if HAVE_AVX512_PATH
        if (use_amx)
            q_amx_release();
#endif
    }
    free(a.xq), free(a.dx), free(a.xs);
    return Q_OK;
}

/* out[i, :] = w[ids[i], :] dequantized (a quantized embedding table read row by row).
 * Returns Q_BAD_INDEX, with out untouched, when an id is outside [0, N). */
int eng_qrows(int fmt, int dtype, void *out, const int64_t *ids, int64_t n_ids, int64_t K, int64_t N,
              const uint8_t *codes, const uint8_t *hi, const uint16_t *d, const uint16_t *m, const uint8_t *sc,
              const uint8_t *mn, int nthreads) {
    if (q_check(fmt, K, N) || n_ids < 0 || (dtype != QDT_F32 && dtype != QDT_BF16) || !codes || !d)
        return Q_BAD_ARGS;
    for (int64_t i = 0; i < n_ids; i++)
        if (ids[i] < 0 || ids[i] >= N)
            return Q_BAD_INDEX;
    QWeight w = {fmt, K, N, (N + PANEL - 1) / PANEL, K / 32, codes, hi, d, m, sc, mn};
#pragma omp parallel for schedule(static) num_threads(nthreads) if (n_ids * K >= 65536)
    for (int64_t i = 0; i < n_ids; i++) {
        int64_t p = ids[i] / PANEL;
        int r = (int)(ids[i] % PANEL);
        float row[32];
        for (int64_t g = 0; g < w.G; g++) {
            float scale[2], mnv[2];
            q_scale_min(&w, p, g, r, 0, &scale[0], &mnv[0]);
            q_scale_min(&w, p, g, r, 1, &scale[1], &mnv[1]);
            for (int q = 0; q < 8; q++)
                for (int j = 0; j < 4; j++) {
                    int h = Q_PER16(w.fmt) ? q / 4 : 0, c = q_code(&w, p, g, q, r, j);
                    /* a table format: the table's signed value times the scale, as gguf */
                    row[4 * q + j] = Q_LUT(w.fmt) ? (float)(c - 128) * scale[h] : (float)c * scale[h] + mnv[h];
                }
            q_store(out, dtype, K, i, 32 * g, 32, row);
        }
    }
    return Q_OK;
}

/* ---- repacking GGUF blocks into panels (load time) ---------------------------------- */

QINLINE uint16_t q_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the block's 12 scale bytes. */
QINLINE void q_k_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
        *mn = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* Decode group g (32 columns) of GGUF row `row` into codes, and write its scale fields. */
static void q_pack_group(const QWeight *w, const uint8_t *row, int64_t p, int64_t g, int r, uint8_t *code,
                         uint16_t *d, uint16_t *m, uint8_t *sc, uint8_t *mn) {
    const int64_t pg = (p * w->G + g) * PANEL + r, ps = (p * (w->G / 8) + g / 8) * PANEL + r;
    const int s = (int)(g % 8); /* sub-block of a 256-column super-block */
    switch (w->fmt) {
    case F_Q4_0:
    case F_IQ4_NL:
    case F_Q4_1: {
        const uint8_t *b = row + g * (w->fmt == F_Q4_1 ? 20 : 18);
        const uint8_t *qs = b + (w->fmt == F_Q4_1 ? 4 : 2);
        d[pg] = q_u16(b);
        if (w->fmt == F_Q4_1)
            m[pg] = q_u16(b + 2);
        for (int l = 0; l < 16; l++)
            code[l] = qs[l] & 15, code[l + 16] = qs[l] >> 4;
        break;
    }
    case F_Q5_0:
    case F_Q5_1: {
        const uint8_t *b = row + g * (w->fmt == F_Q5_0 ? 22 : 24);
        const uint8_t *qh = b + (w->fmt == F_Q5_0 ? 2 : 4), *qs = qh + 4;
        d[pg] = q_u16(b);
        if (w->fmt == F_Q5_1)
            m[pg] = q_u16(b + 2);
        for (int l = 0; l < 32; l++) /* bit l of the little-endian qh is element l's bit 4 */
            code[l] = (uint8_t)((l < 16 ? qs[l] & 15 : qs[l - 16] >> 4) | (((qh[l / 8] >> (l % 8)) & 1) << 4));
        break;
    }
    case F_Q8_0: {
        const uint8_t *b = row + g * 34;
        d[pg] = q_u16(b);
        for (int l = 0; l < 32; l++)
            code[l] = b[2 + l] ^ 0x80;
        break;
    }
    case F_IQ4_XS: {
        /* d, the sub-blocks' 6-bit scales (bits 0..3 in the nibbles of bytes 4..7, bits
         * 4..5 in pairs of the uint16 at 2), 16 bytes of codes a sub-block. */
        const uint8_t *b = row + (g / 8) * 136, *qs = b + 8 + 16 * s;
        const int ls = ((b[4 + s / 2] >> (4 * (s % 2))) & 15) | (((q_u16(b + 2) >> (2 * s)) & 3) << 4);
        d[ps] = q_u16(b);
        sc[pg] = (uint8_t)(int8_t)(ls - 32);
        for (int l = 0; l < 16; l++)
            code[l] = qs[l] & 15, code[l + 16] = qs[l] >> 4;
        break;
    }
    case F_Q2_K:
    case F_Q3_K: {
        /* Element 128n + 32j + l of a super-block: bits 2j..2j+1 of qs[32n + l]; Q3_K's
         * bit 2 is bit 4n + j of hmask[l]. Group g is sub-block s = 4n + j. */
        const int two = w->fmt == F_Q2_K;
        const uint8_t *b = row + (g / 8) * (two ? 84 : 110);
        const uint8_t *qs = b + (two ? 16 : 32) + 32 * (s / 4);
        const int64_t p16 = (p * 2 * w->G + 2 * g) * PANEL + r;
        for (int l = 0; l < 32; l++) {
            code[l] = (uint8_t)((qs[l] >> (2 * (s % 4))) & 3);
            if (!two)
                code[l] |= (uint8_t)(((b[l] >> s) & 1) << 2);
        }
        if (two) {
            d[ps] = q_u16(b + 80);
            m[ps] = q_u16(b + 82);
            sc[p16] = b[2 * s];
            sc[p16 + PANEL] = b[2 * s + 1];
        } else {
            /* 16 six-bit scales: bits 0..3 in the nibbles of bytes 0..7 (scales 0..7 low,
             * 8..15 high), bits 4..5 in bytes 8..11 (scale j: byte 8 + j % 4, pair j / 4). */
            const uint8_t *sb = b + 96;
            d[ps] = q_u16(b + 108);
            for (int i = 0; i < 2; i++) {
                const int j = 2 * s + i;
                const int lo = j < 8 ? sb[j] & 15 : sb[j - 8] >> 4, hi2 = (sb[8 + j % 4] >> (2 * (j / 4))) & 3;
                sc[p16 + i * PANEL] = (uint8_t)(int8_t)((lo | (hi2 << 4)) - 32);
            }
        }
        break;
    }
    case F_Q4_K:
    case F_Q5_K: {
        const int five = w->fmt == F_Q5_K;
        const uint8_t *b = row + (g / 8) * (five ? 176 : 144);
        const uint8_t *qs = b + (five ? 48 : 16) + 32 * (s / 2);
        d[ps] = q_u16(b);
        m[ps] = q_u16(b + 2);
        q_k_scale_min(b + 4, s, &sc[pg], &mn[pg]);
        for (int l = 0; l < 32; l++) {
            code[l] = s & 1 ? qs[l] >> 4 : qs[l] & 15;
            if (five)
                code[l] |= ((b[16 + l] >> s) & 1) << 4;
        }
        break;
    }
    default: { /* Q6_K */
        const uint8_t *b = row + (g / 8) * 210;
        const int h = s / 4, qq = s % 4; /* 128-column half, 32-column quarter */
        const uint8_t *ql = b + 64 * h + (qq & 1) * 32, *qh = b + 128 + 32 * h;
        d[ps] = q_u16(b + 208);
        int64_t p16 = (p * 2 * w->G + 2 * g) * PANEL + r;
        sc[p16] = b[192 + 2 * s];
        sc[p16 + PANEL] = b[192 + 2 * s + 1];
        for (int l = 0; l < 32; l++)
            code[l] = (uint8_t)((qq >= 2 ? ql[l] >> 4 : ql[l] & 15) | (((qh[l] >> (2 * qq)) & 3) << 4));
    }
    }
}

/* Repack raw GGUF rows [N, K / block * block_bytes] into the panel layout. The outputs
 * are sized and zeroed by the caller (padding rows stay zero). */
int eng_qpack(int fmt, const uint8_t *raw, int64_t N, int64_t K, uint8_t *codes, uint8_t *hi, uint16_t *d,
              uint16_t *m, uint8_t *sc, uint8_t *mn, int nthreads) {
    if (q_check(fmt, K, N) || !raw || !codes || !d)
        return Q_BAD_ARGS;
    if ((fmt == F_Q4_1 || fmt == F_Q5_1 || Q_DMIN(fmt)) && !m)
        return Q_BAD_ARGS;
    if ((Q_SUPER(fmt) && !sc) || ((fmt == F_Q4_K || fmt == F_Q5_K) && !mn) || ((Q_HI1(fmt) || fmt == F_Q6_K) && !hi))
        return Q_BAD_ARGS;
    QWeight w = {fmt, K, N, (N + PANEL - 1) / PANEL, K / 32, codes, hi, d, m, sc, mn};
    const int64_t row_bytes = K / q_block_cols[fmt] * q_block_bytes[fmt];
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t p = 0; p < w.P; p++) {
        for (int r = 0; r < PANEL && p * PANEL + r < N; r++) {
            const uint8_t *row = raw + (p * PANEL + r) * row_bytes;
            for (int64_t g = 0; g < w.G; g++) {
                uint8_t code[32];
                const int64_t pg = p * w.G + g;
                q_pack_group(&w, row, p, g, r, code, d, m, sc, mn);
                for (int q = 0; q < 8; q++)
                    for (int j = 0; j < 4; j++) {
                        const int c = code[4 * q + j], b = 4 * r + j;
                        if (fmt == F_Q8_0) {
                            codes[(pg * 8 + q) * 64 + b] = (uint8_t)c;
                            continue;
                        }
                        if (Q_CODES2(fmt))
                            codes[(pg * 2 + q / 4) * 64 + b] |= (uint8_t)((c & 3) << (2 * (q & 3)));
                        else
                            codes[(pg * 4 + q / 2) * 64 + b] |= (uint8_t)((c & 15) << (4 * (q & 1)));
                        if (Q_HI1(fmt))
                            ((uint64_t *)hi)[pg * 8 + q] |= (uint64_t)((c >> Q_HI1_BIT(fmt)) & 1) << b;
                        else if (fmt == F_Q6_K)
                            hi[(pg * 2 + q / 4) * 64 + b] |= (uint8_t)(((c >> 4) & 3) << (2 * (q & 3)));
                    }
            }
        }
    }
    return Q_OK;
}

/* ---- the fused decode step's matmul (see fused.c) ------------------------------------ */

#include "fused.h"
#include "simd.h"

/* One row of activations quantized as eng_qmatmul quantizes it (int8 per 32 columns). */
void eng_q_quantize_row(const void *x, int bf, int64_t K, int8_t *xq, float *dx, float *xs) {
    q_quantize_row(x, bf, K, xq, dx, xs);
}

/* Called by every thread of an OpenMP team (an orphaned worksharing loop): for each part,
 * out[t, part.col + n] = x[t, :] . part[n, :] for t < M, from activations quantized by
 * eng_q_quantize_row (xq [M, K], dx [M, K/32], xs [M, K/16]). The panels of all parts are
 * one index space shared out statically; the loop's barrier ends it. Each output value is
 * computed by the same micro-kernel, tile by tile, as eng_qmatmul's int8 paths compute it
 * for M < AMX_BF16_MIN_TOKENS, so the two agree bit for bit. */
void eng_q_team_matmul(const EngQPart *parts, int nparts, int64_t K, int dtype, void *out, int64_t out_stride,
                       int8_t *xq, float *dx, float *xs, int64_t M) {
    QActs a = {xq, dx, xs};
    int64_t total = 0, starts[ENG_MAX_PARTS + 1];
    for (int i = 0; i < nparts; i++) {
        starts[i] = total;
        total += (parts[i].N + PANEL - 1) / PANEL;
    }
    starts[nparts] = total;
    int use_avx512 = 0, use_avx2 = 0;
#if HAVE_AVX512_PATH
    use_avx512 = q_has_avx512();
    use_avx2 = !use_avx512 && q_has_avx2();
#endif
    (void)use_avx2;
#pragma omp for schedule(static)
    for (int64_t idx = 0; idx < total; idx++) {
        int i = 0;
        while (idx >= starts[i + 1])
            i++;
        const EngQPart *pt = parts + i;
        const QWeight w = {pt->fmt, K, pt->N, (pt->N + PANEL - 1) / PANEL, K / 32, pt->codes, pt->hi, pt->d,
                           pt->m, pt->sc, pt->mn};
        const int64_t p = idx - starts[i];
        const int64_t rows = w.N - p * PANEL < PANEL ? w.N - p * PANEL : PANEL;
        float acc[TILE512 * PANEL];
        const int64_t tile = use_avx512 ? TILE512 : TILE;
        for (int64_t t0 = 0; t0 < M; t0 += tile) { /* M <= TOKEN_BLOCK: one token block */
            const int64_t nt = M - t0 < tile ? M - t0 : tile;
#if HAVE_AVX512_PATH
            if (use_avx512)
                q_panel_avx512(&w, p, &a, t0, nt, acc);
            else if (use_avx2)
                q_panel_avx2(&w, p, &a, t0, nt, acc);
            else
#endif
                q_panel_portable(&w, p, &a, t0, nt, acc);
            for (int64_t t = 0; t < nt; t++)
                q_store(out, dtype, out_stride, t0 + t, pt->col + p * PANEL, rows, acc + t * PANEL);
        }
    }
}

/* ---- dense matmul at decode sizes ---------------------------------------------------------
 *
 * out[t, n] = x[t, :] . w[n, :] (+ bias[n]) for a few rows t of activations, with w dense
 * in the activations' dtype (fp32, or bf16 with fp32 accumulation and one rounding of the
 * biased sum, as torch's bf16 linear). The fused step's projections over dense weights,
 * and Linear's at up to a few rows (so both paths give the same bits). Each output value
 * is one accumulation over K in a fixed order whatever M or the thread count, so a row's
 * result does not depend on its batch. Weight rows are read 4 or 8 at a time and each is
 * used for up to 4 tokens from registers (DENSE_ROWS_FN below). */

#define DENSE_BLOCK 16 /* weight rows per work item of a team */

static float d_ld(const void *p, int64_t i, int bf) {
    return bf ? q_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static void d_st(void *out, int64_t i, float v, int bf) {
    if (bf)
        ((uint16_t *)out)[i] = q_f32_to_bf16(v);
    else
        ((float *)out)[i] = v;
}

static void dense_rows_portable(int bf, const void *w, const void *bias, const void *x, void *out, int64_t os,
                                int64_t K, int64_t M, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t t = 0; t < M; t++) {
            float acc[16] = {0};
            int64_t k = 0;
            for (; k + 16 <= K; k += 16)
                for (int i = 0; i < 16; i++)
                    acc[i] += d_ld(x, t * K + k + i, bf) * d_ld(w, n * K + k + i, bf);
            for (int i = 0; k + i < K; i++)
                acc[i] += d_ld(x, t * K + k + i, bf) * d_ld(w, n * K + k + i, bf);
            float s = 0.0f;
            for (int i = 0; i < 16; i++)
                s += acc[i];
            if (bias)
                s += d_ld(bias, n, bf);
            d_st(out, t * os + n, s, bf);
        }
}

#if HAVE_AVX512_PATH
#define DENSEBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx512bf16,avx2,fma,f16c")))

/* 16 values from element k of a row (fewer where the mask says: a row's tail) as fp32. */
AVX512 QINLINE __m512 d_load16(const void *p, int64_t o, __mmask16 mk, int bf) {
    if (bf)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, (const uint16_t *)p + o)), 16));
    return _mm512_maskz_loadu_ps(mk, (const float *)p + o);
}

/* Bytes ahead of the weight row being read that each step prefetches (the rows of a tile
 * are contiguous, so this runs on into the next rows). */
#ifndef DENSE_PREFETCH
#define DENSE_PREFETCH 8192
#endif

/* res[r * TT + t] = the sum of acc[r][t]'s lanes (acc rows are 4 wide): one transposing
 * reduction for up to 16 sums, the same tree for each whatever the tile. */
AVX512 QINLINE void d_reduce(const __m512 *acc, const int R, const int TT, float *res) {
    __m512 v[16];
    for (int i = 0; i < 16; i++)
        v[i] = i < R * TT ? acc[i / TT * 4 + i % TT] : _mm512_setzero_ps();
    _mm512_storeu_ps(res, eng_hsum16(v));
}

/* One tile: rows n .. n + R - 1 of w against tokens t0 .. t0 + TT - 1 (R, TT compile-time
 * constants at every call, so the accumulators stay in registers; R * TT >= 8 keeps
 * enough independent accumulations in flight for the FMA or dot-product latency). fp32
 * products and FMAs: fp32 activations, or bf16 ones where the CPU lacks AVX512-BF16. */
AVX512 QINLINE void d_tile_f32(const int bf, const void *w, const void *x, int64_t K, int64_t n, int64_t t0,
                               const int R, const int TT, float *res) {
    __m512 acc[8][4];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TT; t++)
            acc[r][t] = _mm512_setzero_ps();
    const char *pf = (const char *)w + (size_t)(n * K) * (bf ? 2 : 4);
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mk = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
        __m512 xv[4];
        for (int t = 0; t < TT; t++)
            xv[t] = d_load16(x, (t0 + t) * K + k, mk, bf);
        for (int r = 0; r < R; r++) {
            _mm_prefetch(pf + (size_t)(r * K + k) * (bf ? 2 : 4) + DENSE_PREFETCH, _MM_HINT_T0);
            const __m512 wv = d_load16(w, (n + r) * K + k, mk, bf);
            for (int t = 0; t < TT; t++)
                acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
        }
    }
    d_reduce(&acc[0][0], R, TT, res);
}

/* The same with AVX512-BF16 for bf16: each dot-product instruction multiplies 32 pairs
 * exactly and adds them into 16 fp32 lanes. */
DENSEBF16 QINLINE void d_tile_bf16dp(const uint16_t *w, const uint16_t *x, int64_t K, int64_t n, int64_t t0,
                                     const int R, const int TT, float *res) {
    __m512 acc[8][4];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TT; t++)
            acc[r][t] = _mm512_setzero_ps();
    const char *pf = (const char *)(w + n * K);
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mk = K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1);
        __m512i xv[4];
        for (int t = 0; t < TT; t++)
            xv[t] = _mm512_maskz_loadu_epi16(mk, x + (t0 + t) * K + k);
        for (int r = 0; r < R; r++) {
            _mm_prefetch(pf + (size_t)(r * K + k) * 2 + DENSE_PREFETCH, _MM_HINT_T0);
            const __m512i wv = _mm512_maskz_loadu_epi16(mk, w + (n + r) * K + k);
            for (int t = 0; t < TT; t++)
                acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wv, (__m512bh)xv[t]);
        }
    }
    d_reduce(&acc[0][0], R, TT, res);
}

/* Rows [n0, n1) for every token: tiles of 8 rows x 1 token or 4 rows x 2-4 tokens, and
 * single rows for the rest. Which tile computes an output changes nothing in its
 * arithmetic (one accumulation over K, lane by lane, then the same reduction). */
#define DENSE_ROWS_FN(NAME, ATTR, TILE, WT)                                                                   \
    ATTR static void NAME(int bf, const void *w, const void *bias, const void *x, void *out, int64_t os,       \
                          int64_t K, int64_t M, int64_t n0, int64_t n1) {                                     \
        float res[16];                                                                                        \
        for (int64_t t0 = 0; t0 < M;) {                                                                       \
            const int64_t TT = M - t0 >= 4 ? 4 : M - t0, R = TT == 1 ? 8 : 4;                                 \
            int64_t n = n0;                                                                                   \
            for (; n + R <= n1; n += R) {                                                                     \
                if (TT == 1)                                                                                  \
                    TILE((WT)w, (WT)x, K, n, t0, 8, 1, res);                                                  \
                else if (TT == 2)                                                                             \
                    TILE((WT)w, (WT)x, K, n, t0, 4, 2, res);                                                  \
                else if (TT == 3)                                                                             \
                    TILE((WT)w, (WT)x, K, n, t0, 4, 3, res);                                                  \
                else                                                                                          \
                    TILE((WT)w, (WT)x, K, n, t0, 4, 4, res);                                                  \
                for (int64_t r = 0; r < R; r++)                                                               \
                    for (int64_t t = 0; t < TT; t++)                                                          \
                        d_st(out, (t0 + t) * os + n + r,                                                      \
                             res[r * TT + t] + (bias ? d_ld(bias, n + r, bf) : 0.0f), bf);                     \
            }                                                                                                 \
            for (; n < n1; n++)                                                                               \
                for (int64_t t = 0; t < TT; t++) {                                                            \
                    TILE((WT)w, (WT)x, K, n, t0 + t, 1, 1, res);                                              \
                    d_st(out, (t0 + t) * os + n, res[0] + (bias ? d_ld(bias, n, bf) : 0.0f), bf);             \
                }                                                                                             \
            t0 += TT;                                                                                         \
        }                                                                                                     \
    }

#define D_TILE_F32(w, x, K, n, t0, R, TT, res) d_tile_f32(0, w, x, K, n, t0, R, TT, res)
#define D_TILE_BF16(w, x, K, n, t0, R, TT, res) d_tile_f32(1, w, x, K, n, t0, R, TT, res)
DENSE_ROWS_FN(dense_rows_f32, AVX512, D_TILE_F32, const void *)
DENSE_ROWS_FN(dense_rows_bf16, AVX512, D_TILE_BF16, const void *)
DENSE_ROWS_FN(dense_rows_bf16dp, DENSEBF16, d_tile_bf16dp, const uint16_t *)

static int d_has_bf16dp(void) {
    static int state = -1;
    if (state < 0)
        state = q_has_avx512() && __builtin_cpu_supports("avx512bf16");
    return state;
}
#endif

/* Rows [n0, n1) of w for the M rows of x, on the best path this CPU has. */
static void dense_block(int bf, const void *w, const void *bias, const void *x, void *out, int64_t os, int64_t K,
                        int64_t M, int64_t n0, int64_t n1) {
#if HAVE_AVX512_PATH
    if (bf && d_has_bf16dp())
        dense_rows_bf16dp(1, w, bias, x, out, os, K, M, n0, n1);
    else if (bf && q_has_avx512())
        dense_rows_bf16(1, w, bias, x, out, os, K, M, n0, n1);
    else if (q_has_avx512())
        dense_rows_f32(0, w, bias, x, out, os, K, M, n0, n1);
    else
#endif
        dense_rows_portable(bf, w, bias, x, out, os, K, M, n0, n1);
}

/* Called by every thread of an OpenMP team (an orphaned worksharing loop, as
 * eng_q_team_matmul): x [M, K] contiguous, out rows out_stride apart. dtype 0 fp32, 1 bf16. */
void eng_dense_team_matmul(const void *w, const void *bias, int64_t K, int64_t N, int dtype, const void *x,
                           void *out, int64_t out_stride, int64_t M) {
    const int64_t blocks = (N + DENSE_BLOCK - 1) / DENSE_BLOCK;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * DENSE_BLOCK, n1 = n0 + DENSE_BLOCK < N ? n0 + DENSE_BLOCK : N;
        dense_block(dtype == 1, w, bias, x, out, out_stride, K, M, n0, n1);
    }
}

/* The dense kernel's path on this CPU: 0 portable C, 1 AVX-512 (fp32 FMAs), 2 AVX-512 with
 * BF16 dot products. Linear takes the kernel only from 1 (the portable loops trail
 * oneDNN's AVX2 GEMM). */
int eng_dense_isa(void) {
#if HAVE_AVX512_PATH
    return q_has_avx512() ? 1 + d_has_bf16dp() : 0;
#else
    return 0;
#endif
}

int eng_dense_matmul(int dtype, void *out, const void *x, int64_t M, int64_t K, int64_t N, const void *w,
                     const void *bias, int nthreads) {
    if ((dtype != 0 && dtype != 1) || M < 0 || K < 1 || N < 0)
        return -1;
    if (nthreads > 1 && N * K >= 65536) {
#pragma omp parallel num_threads(nthreads)
        eng_dense_team_matmul(w, bias, K, N, dtype, x, out, N, M);
    } else {
#pragma omp parallel num_threads(1)
        eng_dense_team_matmul(w, bias, K, N, dtype, x, out, N, M);
    }
    return 0;
}

/* ---- the routed experts of a mixture-of-experts MLP at decode sizes ------------------------
 *
 * ops/moe.py's fused_moe for a few tokens, in one call: the T * k (token, slot) pairs sorted
 * by expert (stable), each expert's rows through its gate/up rows of w13 [E, 2I, H] and its
 * w2 [E, H, I] with the dense kernel above (outputs rounded to the dtype, as F.linear), the
 * SiLU-and-mul between (kernels.c's, rounded as transformers' act(gate) * up), then each
 * token's k outputs scaled by their routing weights and summed in fp32, rounded once. The
 * torch reference runs ~30 dispatched ops for this at decode sizes. Work items of all
 * experts share each phase's worksharing loop. Scratch (the caller's): xg [T*k, H],
 * h [T*k, 2I], a [T*k, I], y [T*k, H] in the dtype. gpt-oss's experts (limit > 0): the
 * gate/up biases bias13 [E, 2I] (the dtype's) added in the first matmul, and the clamped
 * SwiGLU of that limit and gain instead of the SiLU-and-mul. Returns -1 for arguments it
 * does not take, -2 for an expert id out of range (nothing written). */
void eng_silu_mul_row_f32(void *, const void *, int64_t, int64_t, int64_t, int64_t);
void eng_silu_mul_row_bf16(void *, const void *, int64_t, int64_t, int64_t, int64_t);
void eng_clamp_swiglu_row(void *, const void *, int64_t, int64_t, float, float, int);

#define MOE_MAX_PAIRS 256

/* Nemotron 3's expert activation on pair row i: relu(up)^2, rounded once as torch's
 * square rounds (h and a [pairs, I] in the dtype). */
static void moe_relu2_row(void *a, const void *h, int64_t i, int64_t I, int bf) {
    for (int64_t c = 0; c < I; c++) {
        float v = d_ld(h, i * I + c, bf);
        v = v > 0.0f ? v : 0.0f;
        d_st(a, i * I + c, v * v, bf);
    }
}

/* Token t's output: its k pair rows of y [pairs, H] (at where[t * k + j]) weighted by
 * topw and summed in fp32, in the dtype. */
static void moe_combine_row(void *out, const void *y, const int64_t *where, const float *topw, int64_t t,
                            int64_t k, int64_t H, int bf) {
    for (int64_t c = 0; c < H; c++) {
        float s = 0.0f;
        for (int64_t j = 0; j < k; j++)
            s += d_ld(y, where[t * k + j] * H + c, bf) * topw[t * k + j];
        d_st(out, t * H + c, s, bf);
    }
}

/* gated: w13 holds each expert's gate rows then up rows (2 I of them) and the activation
 * is SiLU-gated (gpt-oss's clamped form where limit > 0); else w13 holds the up rows alone
 * (I of them) and the activation is Nemotron 3's relu(up)^2. */
int eng_moe_small(int dtype, void *out, const void *x, int64_t T, int64_t H, int64_t I, int64_t k, int64_t E,
                  const void *w13, const void *w2, const void *bias13, float alpha, float limit, int gated,
                  const float *topw, const int64_t *topi, void *xg, void *h, void *a, void *y, int nthreads) {
    const int64_t P = T * k, R = gated ? 2 * I : I;
    if ((dtype != 0 && dtype != 1) || T < 1 || k < 1 || P > MOE_MAX_PAIRS || H < 1 || I < 1 || E < 1)
        return -1;
    for (int64_t p = 0; p < P; p++)
        if (topi[p] < 0 || topi[p] >= E)
            return -2;
    const int bf = dtype == 1;
    const size_t es = bf ? 2 : 4;
    /* pairs by expert, stable: order[i] = the pair at sorted position i; where[p] = its position */
    int64_t order[MOE_MAX_PAIRS], where[MOE_MAX_PAIRS], gstart[MOE_MAX_PAIRS + 1], gexp[MOE_MAX_PAIRS];
    int64_t n = 0, groups = 0;
    {
        /* the distinct experts, ascending as torch's sort puts them (E may be large: only
         * the few ids seen are sorted) */
        int64_t ids[MOE_MAX_PAIRS];
        int64_t m = 0;
        for (int64_t p = 0; p < P; p++) {
            int64_t e = topi[p], i = m;
            int dup = 0;
            for (int64_t j = 0; j < m; j++)
                dup |= ids[j] == e;
            if (dup)
                continue;
            while (i > 0 && ids[i - 1] > e) {
                ids[i] = ids[i - 1];
                i--;
            }
            ids[i] = e;
            m++;
        }
        for (int64_t g = 0; g < m; g++) {
            gstart[g] = n;
            gexp[g] = ids[g];
            for (int64_t p = 0; p < P; p++)
                if (topi[p] == ids[g]) {
                    where[p] = n;
                    order[n++] = p;
                }
        }
        gstart[m] = n;
        groups = m;
    }
    for (int64_t i = 0; i < P; i++)
        memcpy((char *)xg + (size_t)(i * H) * es, (const char *)x + (size_t)(order[i] / k * H) * es, (size_t)H * es);
    const int64_t b13 = (R + DENSE_BLOCK - 1) / DENSE_BLOCK, b2 = (H + DENSE_BLOCK - 1) / DENSE_BLOCK;
    const int team = nthreads > 1 && P * I * H >= 32768 ? nthreads : 1;
#pragma omp parallel num_threads(team)
    {
#pragma omp for schedule(static)
        for (int64_t it = 0; it < groups * b13; it++) {
            const int64_t g = it / b13, n0 = it % b13 * DENSE_BLOCK, n1 = n0 + DENSE_BLOCK < R ? n0 + DENSE_BLOCK : R;
            dense_block(bf, (const char *)w13 + (size_t)(gexp[g] * R * H) * es,
                        bias13 ? (const char *)bias13 + (size_t)(gexp[g] * R) * es : NULL,
                        (const char *)xg + (size_t)(gstart[g] * H) * es, (char *)h + (size_t)(gstart[g] * R) * es,
                        R, H, gstart[g + 1] - gstart[g], n0, n1);
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < P; i++) {
            if (!gated)
                moe_relu2_row(a, h, i, I, bf);
            else if (limit > 0.0f) /* gpt-oss's experts */
                eng_clamp_swiglu_row(a, h, i, I, alpha, limit, bf);
            else if (bf)
                eng_silu_mul_row_bf16(a, h, i, I, 0, I);
            else
                eng_silu_mul_row_f32(a, h, i, I, 0, I);
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < groups * b2; it++) {
            const int64_t g = it / b2, n0 = it % b2 * DENSE_BLOCK, n1 = n0 + DENSE_BLOCK < H ? n0 + DENSE_BLOCK : H;
            dense_block(bf, (const char *)w2 + (size_t)(gexp[g] * H * I) * es, NULL,
                        (const char *)a + (size_t)(gstart[g] * I) * es, (char *)y + (size_t)(gstart[g] * H) * es, H, I,
                        gstart[g + 1] - gstart[g], n0, n1);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            moe_combine_row(out, y, where, topw, t, k, H, bf);
    }
    return 0;
}

/* ---- routed experts kept in their blocks ---------------------------------------------------
 *
 * eng_moe_small's computation where the experts' matrices stay in GGUF blocks (a GGUF's
 * ffn_*_exps stacks, panel-packed): the (token, slot) pairs sorted by expert, each routed
 * expert's first projection over its group of pairs, the activation, its down projection,
 * and a token's k outputs summed with their routing weights in fp32. A part (EngQPart)
 * holds E experts' [N, K] weights one after another, each expert's N rows padded to whole
 * panels, so expert e's panel p is the stack's panel e * ceil(N / 16) + p. w13's parts
 * write columns [col, col + N) of the first projection's [pairs, n13 * I] output: the gate
 * at 0 and the up at I (gated), or the up rows alone (Nemotron 3's relu(up)^2 experts).
 * w2 is the down stack (N = H, K = I).
 *
 * The matmuls are eng_qmatmul's int8 micro-kernels over activations quantized as it
 * quantizes them, and every intermediate is rounded to the activations' dtype where the
 * quantized Linear path rounds it, so each pair's output is, value for value, what a dense
 * model's MLP kept in blocks computes for one token (two eng_qmatmul calls around the
 * activation). Any number of tokens; scratch is allocated here. Returns 0; -1 for
 * arguments it does not take, -2 for an expert id out of range, -3 out of memory (out is
 * written only on 0). */

/* The group of a work item: the last g with start[g] <= item (start ascending). */
static int64_t qmoe_group(const int64_t *start, int64_t groups, int64_t item) {
    int64_t lo = 0, hi = groups - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (start[mid] <= item)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Tokens [gs + t0, gs + t1) of one group through panel p of an expert's part, stored at
 * columns col + 16 p of rows gs + t of out (row stride ostride). */
static void qmoe_panel(const EngQPart *pt, int64_t K, int64_t e, int64_t p, const QActs *acts, int64_t gs, int64_t t0,
                       int64_t t1, int dtype, void *out, int64_t ostride, int use_avx512, int use_avx2) {
    const int64_t pe = (pt->N + PANEL - 1) / PANEL;
    const QWeight w = {pt->fmt, K, pe * PANEL * (e + 1), pe * (e + 1), K / 32, pt->codes, pt->hi, pt->d,
                       pt->m, pt->sc, pt->mn};
    const QActs a = {acts->xq + gs * K, acts->dx + gs * (K / 32), acts->xs + gs * (K / 16)};
    const int64_t rows = pt->N - p * PANEL < PANEL ? pt->N - p * PANEL : PANEL;
    const int64_t tile = use_avx512 ? TILE512 : TILE;
    float acc[TILE512 * PANEL];
    (void)use_avx2;
    for (int64_t s = t0; s < t1; s += tile) {
        const int64_t nt = t1 - s < tile ? t1 - s : tile;
#if HAVE_AVX512_PATH
        if (use_avx512)
            q_panel_avx512(&w, e * pe + p, &a, s, nt, acc);
        else if (use_avx2)
            q_panel_avx2(&w, e * pe + p, &a, s, nt, acc);
        else
#endif
            q_panel_portable(&w, e * pe + p, &a, s, nt, acc);
        for (int64_t t = 0; t < nt; t++)
            q_store(out, dtype, ostride, gs + s + t, pt->col + p * PANEL, rows, acc + t * PANEL);
    }
}

int eng_qmoe(int dtype, void *out, const void *x, int64_t T, int64_t H, int64_t I, int64_t k, int64_t E,
             const EngQPart *w13, int n13, const EngQPart *w2, int gated, const float *topw, const int64_t *topi,
             int nthreads) {
    if ((dtype != QDT_F32 && dtype != QDT_BF16) || T < 1 || k < 1 || E < 1 || n13 != (gated ? 2 : 1) || !w2 ||
        !topw || !topi)
        return -1;
    for (int i = 0; i < n13; i++)
        if (q_check(w13[i].fmt, H, w13[i].N) || w13[i].N != I || w13[i].col != i * I || !w13[i].codes || !w13[i].d)
            return -1;
    if (q_check(w2->fmt, I, w2->N) || w2->N != H || !w2->codes || !w2->d)
        return -1;
    const int64_t P = T * k, R = n13 * I;
    for (int64_t p = 0; p < P; p++)
        if (topi[p] < 0 || topi[p] >= E)
            return -2;
    const int bf = dtype == QDT_BF16;
    const size_t es = bf ? 2 : 4;
    int64_t *count = calloc((size_t)E, sizeof(int64_t)), *order = malloc(sizeof(int64_t) * (size_t)P);
    int64_t *where = malloc(sizeof(int64_t) * (size_t)P), *gexp = malloc(sizeof(int64_t) * (size_t)(P + 1));
    int64_t *gstart = malloc(sizeof(int64_t) * (size_t)(P + 1));
    int64_t *item13 = malloc(sizeof(int64_t) * (size_t)(P + 1)), *item2 = malloc(sizeof(int64_t) * (size_t)(P + 1));
    int8_t *xq = malloc((size_t)(P * H)), *aq = malloc((size_t)(P * I));
    float *dx = malloc(sizeof(float) * (size_t)(P * (H / 32))), *xs = malloc(sizeof(float) * (size_t)(P * (H / 16)));
    float *adx = malloc(sizeof(float) * (size_t)(P * (I / 32))), *axs = malloc(sizeof(float) * (size_t)(P * (I / 16)));
    void *h = malloc(es * (size_t)(P * R)), *act = malloc(es * (size_t)(P * I)), *y = malloc(es * (size_t)(P * H));
    int status = 0;
    if (!count || !order || !where || !gexp || !gstart || !item13 || !item2 || !xq || !aq || !dx || !xs || !adx ||
        !axs || !h || !act || !y) {
        status = -3;
        goto done;
    }
    /* Pairs sorted by expert, stably (a counting sort): groups in ascending expert order. */
    int64_t groups = 0;
    for (int64_t p = 0; p < P; p++)
        count[topi[p]]++;
    {
        int64_t n = 0;
        for (int64_t e = 0; e < E; e++)
            if (count[e]) {
                gexp[groups] = e;
                gstart[groups++] = n;
                n += count[e];
                count[e] = gstart[groups - 1]; /* now the next free position of the group */
            }
        gstart[groups] = n;
        for (int64_t p = 0; p < P; p++) {
            where[p] = count[topi[p]]++;
            order[where[p]] = p;
        }
    }
    /* Work items: for each group, its token blocks times the panels of its parts. */
    int64_t pe13 = 0;
    for (int i = 0; i < n13; i++)
        pe13 += (I + PANEL - 1) / PANEL;
    const int64_t pe2 = (H + PANEL - 1) / PANEL;
    item13[0] = item2[0] = 0;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t blocks = (gstart[g + 1] - gstart[g] + TOKEN_BLOCK - 1) / TOKEN_BLOCK;
        item13[g + 1] = item13[g] + blocks * pe13;
        item2[g + 1] = item2[g] + blocks * pe2;
    }
    int use_avx512 = 0, use_avx2 = 0;
#if HAVE_AVX512_PATH
    use_avx512 = q_has_avx512();
    use_avx2 = !use_avx512 && q_has_avx2();
#endif
    const QActs xa = {xq, dx, xs}, aa = {aq, adx, axs};
    const int team = nthreads > 1 && (double)P * (double)I * (double)H >= QPARALLEL_MIN_WORK ? nthreads : 1;
#pragma omp parallel num_threads(team)
    {
        /* Each pair's row of activations, quantized in the pairs' sorted order. */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < P; i++)
            q_quantize_row((const char *)x + (size_t)(order[i] / k * H) * es, bf, H, xq + i * H, dx + i * (H / 32),
                           xs + i * (H / 16));
#pragma omp for schedule(static)
        for (int64_t it = 0; it < item13[groups]; it++) {
            const int64_t g = qmoe_group(item13, groups, it), local = it - item13[g];
            const int64_t tb = local / pe13, pp = local % pe13, per = (I + PANEL - 1) / PANEL;
            const int part = (int)(pp / per);
            const int64_t n = gstart[g + 1] - gstart[g], t0 = tb * TOKEN_BLOCK;
            qmoe_panel(w13 + part, H, gexp[g], pp % per, &xa, gstart[g], t0, t0 + TOKEN_BLOCK < n ? t0 + TOKEN_BLOCK : n,
                       dtype, h, R, use_avx512, use_avx2);
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < P; i++) {
            if (!gated)
                moe_relu2_row(act, h, i, I, bf);
            else if (bf)
                eng_silu_mul_row_bf16(act, h, i, I, 0, I);
            else
                eng_silu_mul_row_f32(act, h, i, I, 0, I);
            q_quantize_row((const char *)act + (size_t)(i * I) * es, bf, I, aq + i * I, adx + i * (I / 32),
                           axs + i * (I / 16));
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < item2[groups]; it++) {
            const int64_t g = qmoe_group(item2, groups, it), local = it - item2[g];
            const int64_t tb = local / pe2, n = gstart[g + 1] - gstart[g], t0 = tb * TOKEN_BLOCK;
            qmoe_panel(w2, I, gexp[g], local % pe2, &aa, gstart[g], t0, t0 + TOKEN_BLOCK < n ? t0 + TOKEN_BLOCK : n,
                       dtype, y, H, use_avx512, use_avx2);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            moe_combine_row(out, y, where, topw, t, k, H, bf);
    }
done:
    free(count), free(order), free(where), free(gexp), free(gstart), free(item13), free(item2);
    free(xq), free(aq), free(dx), free(xs), free(adx), free(axs), free(h), free(act), free(y);
    return status;
}
