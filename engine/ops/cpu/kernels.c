/*
 * CPU kernels for the small, latency-bound ops of a decode step, called through cffi.
 *
 * torch runs each of these as a chain of 5-10 dispatched ops (upcast, pow, mean, rsqrt,
 * mul, downcast, ...), ~20-40 us per call at decode sizes, most of it dispatch; the model
 * calls them ~5 times per layer. Here each is one call over raw pointers.
 *
 * Numerics follow the torch reference (engine/ops/reference.py) and Hugging Face:
 * activations are read in their storage dtype (fp32 or bf16) and computed in fp32, and a
 * bf16 result is rounded (to nearest even, as torch does) at the same points where HF's
 * bf16 module rounds it. Only summation order differs (fp32 last-bit noise).
 *
 * Each kernel does one unit of work (a row, a token, a request x KV head) in a function
 * compiled three times (AVX-512, AVX2, baseline x86-64; picked at load time by the CPU),
 * and an entry point spreads the units over OpenMP threads. The extension is linked
 * against libgomp by SONAME, so in a process that imported torch first it shares torch's
 * OpenMP runtime and thread pool instead of starting a second one on the same cores.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif
#define INLINE static inline __attribute__((always_inline))

enum { DT_F32 = 0, DT_BF16 = 1, DT_I8 = 2 };

/* Attention limits of the stack buffers below; larger shapes fall back to torch. A KV
 * head's group of more than MAX_GROUP query heads is attended in pieces of at most that. */
#define MAX_GROUP 16  /* query heads of one decode item */
#define MAX_DIM 576   /* head_dim: DeepSeek's latent (512) and its rotated part (64) */
#define FAST_DIM 128  /* the widest head_dim of the AVX-512 decode item */
#define TILE 64       /* keys scored before one softmax rescale */

/* Work (in multiply-adds) below which a call stays on the calling thread: waking the
 * other OpenMP thread costs a few microseconds, more than a small op takes. */
#define PARALLEL_MIN_WORK 32768

/* ---- storage types ---------------------------------------------------------------- */

INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    /* Round to nearest even; NaN stays a quiet NaN (torch gives 0x7FC0). */
    uint16_t rounded = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? (uint16_t)0x7FC0 : rounded;
}

/* `bf` is a compile-time constant at every call site below, so these fold away. */
INLINE float ld(const void *p, int64_t i, int bf) {
    return bf ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void st(void *p, int64_t i, float v, int bf) {
    if (bf)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* The value a store then a load would give: rounding to the storage precision. */
INLINE float rnd(float v, int bf) { return bf ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* exp(x) for x <= 0, to ~2 ulp: x = k ln2 + r with |r| <= ln2 / 2, a degree-6
 * polynomial for e^r (the classic Cephes expf coefficients), 2^k built in the exponent
 * bits. Branch-free so loops over it vectorize; below -87 it returns 0. */
INLINE float exp_nonpos(float x) {
    float xc = x < -87.0f ? -87.0f : x;
    float k = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : p * scale;
}

/* ---- RMSNorm, optionally after a residual add --------------------------------------- */

/* out[row] = rms_norm(x[row]) * w. With `res`, x[row] += res[row] first (in place, rounded
 * to the storage dtype) and the norm is taken of that sum, as torch's add_ then rms_norm. */
INLINE void rms_norm_row(void *out, void *x, int64_t xs, const void *res, int64_t rs,
                         const void *w, int64_t row, int64_t n, float eps, int bf) {
    int64_t xo = row * xs, oo = row * n;
    float ss = 0.0f;
    if (res) {
        int64_t ro = row * rs;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) {
            float s = rnd(ld(x, xo + i, bf) + ld(res, ro + i, bf), bf);
            st(x, xo + i, s, bf);
            ss += s * s;
        }
    } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) {
            float v = ld(x, xo + i, bf);
            ss += v * v;
        }
    }
    /* torch: rsqrt(mean(x^2) + eps); x * rstd rounded to the dtype, then times weight. */
    float rstd = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        st(out, oo + i, rnd(ld(x, xo + i, bf) * rstd, bf) * ld(w, i, bf), bf);
}

CLONES void eng_rms_norm_row_f32(void *out, void *x, int64_t xs, const void *res, int64_t rs,
                                 const void *w, int64_t row, int64_t n, float eps) {
    rms_norm_row(out, x, xs, res, rs, w, row, n, eps, 0);
}

CLONES void eng_rms_norm_row_bf16(void *out, void *x, int64_t xs, const void *res, int64_t rs,
                                  const void *w, int64_t row, int64_t n, float eps) {
    rms_norm_row(out, x, xs, res, rs, w, row, n, eps, 1);
}

int eng_rms_norm(int dtype, void *out, void *x, int64_t x_stride, const void *res,
                 int64_t res_stride, const void *w, int64_t rows, int64_t n, float eps,
                 int nthreads) {
    if (dtype != DT_F32 && dtype != DT_BF16)
        return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads) \
    if (nthreads > 1 && rows * n >= PARALLEL_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) {
        if (dtype == DT_BF16)
            eng_rms_norm_row_bf16(out, x, x_stride, res, res_stride, w, r, n, eps);
        else
            eng_rms_norm_row_f32(out, x, x_stride, res, res_stride, w, r, n, eps);
    }
    return 0;
}

/* x[0:n] *= s in place, each product rounded to the dtype (Granite's residual_multiplier
 * on a block's output, as torch's `hidden * multiplier`). */
CLONES void eng_scale_row_f32(void *x, int64_t n, float s) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        st(x, i, ld(x, i, 0) * s, 0);
}

CLONES void eng_scale_row_bf16(void *x, int64_t n, float s) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        st(x, i, ld(x, i, 1) * s, 1);
}

/* ---- RoPE (rotate-half), in place --------------------------------------------------- */

/* Token t's `heads` heads of `d` values each (heads contiguous, tokens `ts` apart) have
 * their first `rd` values (all `d`, or a partial rotary's share) rotated by the cos/sin
 * row of its position: cs[pos] = cos[0:rd/2] | sin[0:rd/2]; the rest pass as they are. As
 * in HF, each product is rounded to the dtype before the sum is. */
INLINE void rope_token(void *x, int64_t ts, int64_t heads, int64_t d, int64_t rd, const int64_t *pos,
                       const void *cs, int64_t t, int bf) {
    int64_t half = rd / 2, c0 = pos[t] * rd;
    for (int64_t h = 0; h < heads; h++) {
        int64_t base = t * ts + h * d;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            float c = ld(cs, c0 + i, bf), s = ld(cs, c0 + half + i, bf);
            float a = ld(x, base + i, bf), b = ld(x, base + half + i, bf);
            st(x, base + i, rnd(a * c, bf) - rnd(b * s, bf), bf);
            st(x, base + half + i, rnd(b * c, bf) + rnd(a * s, bf), bf);
        }
    }
}

CLONES void eng_rope_token_f32(void *x, int64_t ts, int64_t heads, int64_t d, int64_t rd,
                               const int64_t *pos, const void *cs, int64_t t) {
    rope_token(x, ts, heads, d, rd, pos, cs, t, 0);
}

CLONES void eng_rope_token_bf16(void *x, int64_t ts, int64_t heads, int64_t d, int64_t rd,
                                const int64_t *pos, const void *cs, int64_t t) {
    rope_token(x, ts, heads, d, rd, pos, cs, t, 1);
}

int eng_rope(int dtype, void *x, int64_t token_stride, int64_t heads, int64_t d, int64_t rd,
             const int64_t *positions, int64_t tokens, const void *cos_sin, int64_t max_pos,
             int nthreads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || rd % 2 || rd < 2 || rd > d)
        return -1;
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_pos)
            return -2;
#pragma omp parallel for schedule(static) num_threads(nthreads) \
    if (nthreads > 1 && tokens * heads * d >= PARALLEL_MIN_WORK)
    for (int64_t t = 0; t < tokens; t++) {
        if (dtype == DT_BF16)
            eng_rope_token_bf16(x, token_stride, heads, d, rd, positions, cos_sin, t);
        else
            eng_rope_token_f32(x, token_stride, heads, d, rd, positions, cos_sin, t);
    }
    return 0;
}

/* ---- SiLU-and-mul, GeGLU ------------------------------------------------------------------ */

/* out[row] = act(x[row, :n]) * x[row, n:2n] with act SiLU, or Gemma's gelu-tanh written as
 * g * sigmoid(2u) (no cancellation, unlike 0.5 g (1 + tanh(u))). act is rounded to the
 * dtype before the product is, as HF's act_fn(gate) * up does in bf16. sigmoid from
 * exp(-|z|) <= 1, so the one exp is always of a non-positive argument. */
INLINE void act_mul_row(void *out, const void *x, int64_t row, int64_t n, int64_t i0, int64_t i1, int bf,
                        int gelu) {
    int64_t xo = row * 2 * n, oo = row * n;
#pragma omp simd
    for (int64_t i = i0; i < i1; i++) {
        float g = ld(x, xo + i, bf);
        /* silu(g) = g sigmoid(g); gelu_tanh(g) = g sigmoid(2u), u = sqrt(2 / pi) (g + c g^3) */
        float z = gelu ? 1.5957691216057308f * (g + 0.044715f * g * g * g) : g;
        float e = exp_nonpos(z < 0.0f ? z : -z);
        float sig = (z < 0.0f ? e : 1.0f) / (1.0f + e);
        st(out, oo + i, rnd(g * sig, bf) * ld(x, xo + n + i, bf), bf);
    }
}

/* gpt-oss's clamped SwiGLU of row `row` of x [rows, 2n] (gate, then up) into out [rows, n]:
 * (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit), rounded to
 * the dtype after each operation as the torch reference's bf16 ops round. */
INLINE void clamp_swiglu_row(void *out, const void *x, int64_t row, int64_t n, float alpha, float limit, int bf) {
    int64_t xo = row * 2 * n, oo = row * n;
    for (int64_t i = 0; i < n; i++) {
        float g = ld(x, xo + i, bf), u = ld(x, xo + n + i, bf);
        g = g > limit ? limit : g;
        u = u > limit ? limit : (u < -limit ? -limit : u);
        float z = rnd(g * alpha, bf);
        float e = exp_nonpos(z < 0.0f ? z : -z);
        float sig = rnd((z < 0.0f ? e : 1.0f) / (1.0f + e), bf);
        st(out, oo + i, rnd(u + 1.0f, bf) * rnd(g * sig, bf), bf);
    }
}

void eng_clamp_swiglu_row(void *out, const void *x, int64_t row, int64_t n, float alpha, float limit, int bf) {
    clamp_swiglu_row(out, x, row, n, alpha, limit, bf);
}

/* Columns [i0, i1) of row `row` (the fused step gives each thread a slice of one row). */
CLONES void eng_silu_mul_row_f32(void *out, const void *x, int64_t row, int64_t n, int64_t i0, int64_t i1) {
    act_mul_row(out, x, row, n, i0, i1, 0, 0);
}

CLONES void eng_silu_mul_row_bf16(void *out, const void *x, int64_t row, int64_t n, int64_t i0, int64_t i1) {
    act_mul_row(out, x, row, n, i0, i1, 1, 0);
}

CLONES void eng_gelu_tanh_mul_row_f32(void *out, const void *x, int64_t row, int64_t n, int64_t i0, int64_t i1) {
    act_mul_row(out, x, row, n, i0, i1, 0, 1);
}

CLONES void eng_gelu_tanh_mul_row_bf16(void *out, const void *x, int64_t row, int64_t n, int64_t i0, int64_t i1) {
    act_mul_row(out, x, row, n, i0, i1, 1, 1);
}

static int act_mul(int dtype, int gelu, void *out, const void *x, int64_t rows, int64_t n, int nthreads) {
    if (dtype != DT_F32 && dtype != DT_BF16)
        return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads) \
    if (nthreads > 1 && rows * n >= PARALLEL_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) {
        if (gelu)
            (dtype == DT_BF16 ? eng_gelu_tanh_mul_row_bf16 : eng_gelu_tanh_mul_row_f32)(out, x, r, n, 0, n);
        else
            (dtype == DT_BF16 ? eng_silu_mul_row_bf16 : eng_silu_mul_row_f32)(out, x, r, n, 0, n);
    }
    return 0;
}

int eng_silu_mul(int dtype, void *out, const void *x, int64_t rows, int64_t n, int nthreads) {
    return act_mul(dtype, 0, out, x, rows, n, nthreads);
}

int eng_gelu_tanh_mul(int dtype, void *out, const void *x, int64_t rows, int64_t n, int nthreads) {
    return act_mul(dtype, 1, out, x, rows, n, nthreads);
}


/* ---- Gemma's RMSNorm -------------------------------------------------------------- */

/* Gemma's norm, as transformers computes it: x / rms(x) * w in fp32 with w = 1 + weight
 * kept in fp32 (fused.py and GemmaModel store it so), rounded to the dtype once. In fp32
 * it is the same arithmetic as rms_norm_row's. In place (out == x) is fine: every x is
 * read before its out is written. */
INLINE float rms_rstd(const void *x, int64_t n, float eps, int bf) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) {
        float v = ld(x, i, bf);
        ss += v * v;
    }
    return 1.0f / sqrtf(ss / (float)n + eps);
}

INLINE void gemma_norm_row(void *out, const void *x, int64_t n, const float *w, float eps, int bf) {
    const float rstd = rms_rstd(x, n, eps, bf);
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        st(out, i, ld(x, i, bf) * rstd * w[i], bf);
}

/* Gemma's sandwich step on one row: with `d`, r += norm(d) * w_post (each rounded to the
 * dtype, as transformers' `hidden + post_norm(x)`), then out = norm(r) * w_next. Without
 * `d`, only the second norm (the first layer's input norm). Without `w_post` (Gemma 1,
 * no norm after attention or the MLP), r += d. Without `w_next` (OLMo, no norm before a
 * block), out = r. */
INLINE void gemma_add_norm_row(void *r, const void *d, const float *w_post, void *out, const float *w_next,
                               int64_t n, float eps, int bf) {
    if (d && !w_post) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            st(r, i, ld(r, i, bf) + ld(d, i, bf), bf);
    } else if (d) {
        const float rstd = rms_rstd(d, n, eps, bf);
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            st(r, i, ld(r, i, bf) + rnd(ld(d, i, bf) * rstd * w_post[i], bf), bf);
    }
    if (w_next)
        gemma_norm_row(out, r, n, w_next, eps, bf);
    else
        memcpy(out, r, (size_t)n * (bf ? 2 : 4));
}

CLONES void eng_gemma_norm_row_f32(void *out, const void *x, int64_t n, const float *w, float eps) {
    gemma_norm_row(out, x, n, w, eps, 0);
}

CLONES void eng_gemma_norm_row_bf16(void *out, const void *x, int64_t n, const float *w, float eps) {
    gemma_norm_row(out, x, n, w, eps, 1);
}

CLONES void eng_gemma_add_norm_row_f32(void *r, const void *d, const float *w_post, void *out,
                                       const float *w_next, int64_t n, float eps) {
    gemma_add_norm_row(r, d, w_post, out, w_next, n, eps, 0);
}

CLONES void eng_gemma_add_norm_row_bf16(void *r, const void *d, const float *w_post, void *out,
                                        const float *w_next, int64_t n, float eps) {
    gemma_add_norm_row(r, d, w_post, out, w_next, n, eps, 1);
}

int eng_gemma_norm(int dtype, void *out, const void *x, int64_t x_stride, const float *w, int64_t rows,
                   int64_t n, float eps, int nthreads) {
    if (dtype != DT_F32 && dtype != DT_BF16)
        return -1;
    const int es = dtype == DT_BF16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(nthreads) \
    if (nthreads > 1 && rows * n >= PARALLEL_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) {
        void *o = (char *)out + (size_t)(r * n) * es;
        const void *xr = (const char *)x + (size_t)(r * x_stride) * es;
        if (dtype == DT_BF16)
            eng_gemma_norm_row_bf16(o, xr, n, w, eps);
        else
            eng_gemma_norm_row_f32(o, xr, n, w, eps);
    }
    return 0;
}


/* ---- paged decode attention ----------------------------------------------------------- */

/* One cache row (d values of one token and KV head at element offset o) as fp32. An int8
 * cache (q8, a compile-time constant at every call) holds codes and one fp32 scale per
 * row, at index o / d of the scale array [num_blocks, block_size, kv_heads]; the value is
 * code * scale, the same product the torch reference's dequantize_kv forms. */
INLINE void load_kv_row(float *dst, const void *c, const float *sc, int64_t o, int64_t d,
                        int q8, int bf) {
    if (q8) {
        const int8_t *p = (const int8_t *)c + o;
        const float s = sc[o / d];
#pragma omp simd
        for (int64_t i = 0; i < d; i++)
            dst[i] = (float)p[i] * s;
    } else {
#pragma omp simd
        for (int64_t i = 0; i < d; i++)
            dst[i] = ld(c, o + i, bf);
    }
}

/* One head's online-softmax step over a tile of n scores: the running max *mx and sum
 * *sum move to the tile's, the scores become exp(score - max), and the factor the head's
 * accumulators must be scaled by comes back (0 on the first tile, whose *mx is -inf). */
INLINE float softmax_tile(float *sc, int64_t n, float *mx, float *sum) {
    float m = *mx;
#pragma omp simd reduction(max : m)
    for (int64_t k = 0; k < n; k++)
        m = sc[k] > m ? sc[k] : m;
    const float alpha = exp_nonpos(*mx - m);
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < n; k++) {
        const float p = exp_nonpos(sc[k] - m);
        sc[k] = p;
        s += p;
    }
    *sum = *sum * alpha + s;
    *mx = m;
    return alpha;
}

/* One request's one query token, for query heads j0 .. j0 + nj - 1 of the `group` that
 * share KV head `g` (each head's scores, softmax and sum are its own, so a head's result
 * does not depend on which others share its call):
 * online softmax over its seq_len keys read through the block table, TILE keys at a time
 * (scores of a tile first, one rescale of the accumulators per tile). Cache layout
 * [num_blocks, block_size, kv_heads, d]; see engine/ops/__init__.py. */
INLINE void decode_item(void *out, const void *q, int64_t qs, const void *kc, const void *vc,
                        const float *ksc, const float *vsc, int q8, const int32_t *bt,
                        int64_t bts, const int32_t *lens, int64_t b,
                        int64_t g, int64_t j0, int64_t nj, int64_t heads, int64_t kv_heads,
                        int64_t d, int64_t bs, float scale, int64_t window, float softcap,
                        const float *sinks, int bf) {
    const int64_t group = heads / kv_heads, len = lens[b], h0 = g * group + j0;
    /* A sliding window sees only the last `window` keys: i - j < window for query i. */
    const int64_t first = window > 0 && len > window ? len - window : 0;
    const int32_t *table = bt + b * bts;
    float qf[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], kf[MAX_DIM];
    float sc[MAX_GROUP][TILE], mx[MAX_GROUP], sum[MAX_GROUP];
    int64_t rows[TILE]; /* cache element offset of each key of the tile */
    for (int64_t j = 0; j < nj; j++) {
        int64_t qo = b * qs + (h0 + j) * d;
        for (int64_t i = 0; i < d; i++) {
            qf[j][i] = ld(q, qo + i, bf);
            acc[j][i] = 0.0f;
        }
        /* An attention sink (gpt-oss) is one more score with no value: the softmax starts
         * from it, its exp(sink - sink) = 1 in the sum and nothing in the accumulators. */
        mx[j] = sinks ? sinks[h0 + j] : -INFINITY;
        sum[j] = sinks ? 1.0f : 0.0f;
    }
    /* Walk the block table with a running (block, offset) pair: no division per key. */
    int64_t blk = first / bs, off = first % bs;
    for (int64_t t0 = first; t0 < len; t0 += TILE) {
        int64_t n = len - t0 < TILE ? len - t0 : TILE;
        for (int64_t k = 0; k < n; k++) {
            rows[k] = (((int64_t)table[blk] * bs + off) * kv_heads + g) * d;
            if (++off == bs) {
                off = 0;
                blk++;
            }
        }
        for (int64_t k = 0; k < n; k++) {
            load_kv_row(kf, kc, ksc, rows[k], d, q8, bf);
            for (int64_t j = 0; j < nj; j++) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < d; i++)
                    dot = fmaf(qf[j][i], kf[i], dot);
                /* Gemma 2's logit soft-capping: cap * tanh(s / cap) on the scaled score. */
                sc[j][k] = softcap > 0.0f ? softcap * tanhf(dot * scale / softcap) : dot * scale;
            }
        }
        for (int64_t j = 0; j < nj; j++) {
            const float alpha = softmax_tile(sc[j], n, &mx[j], &sum[j]);
#pragma omp simd
            for (int64_t i = 0; i < d; i++)
                acc[j][i] *= alpha;
        }
        for (int64_t k = 0; k < n; k++) {
            load_kv_row(kf, vc, vsc, rows[k], d, q8, bf);
            for (int64_t j = 0; j < nj; j++) {
                float p = sc[j][k];
#pragma omp simd
                for (int64_t i = 0; i < d; i++)
                    acc[j][i] = fmaf(p, kf[i], acc[j][i]);
            }
        }
    }
    for (int64_t j = 0; j < nj; j++) {
        float inv = 1.0f / sum[j];
        int64_t oo = (b * heads + h0 + j) * d;
#pragma omp simd
        for (int64_t i = 0; i < d; i++)
            st(out, oo + i, acc[j][i] * inv, bf);
    }
}


#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

#include "simd.h"
#define HAVE_ATTN_AVX512 1
#define AVX512K __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))

/* 16 values of a cache row from element offset o as fp32. */
AVX512K INLINE __m512 ld16(const void *c, const float *sc, int64_t o, int64_t d, int q8, int bf) {
    if (q8)
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)c + o)))),
                             _mm512_set1_ps(sc[o / d]));
    if (bf)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)c + o))), 16));
    return _mm512_loadu_ps((const float *)c + o);
}

/* decode_item for head_dim D (64 or 128, a compile-time constant) with AVX-512: each tile's
 * keys are converted to fp32 once and scored 16 at a time (one transposing reduction per
 * 16 scores), and each head's output accumulates in registers over the tile's values. The
 * same online softmax as decode_item; each head's arithmetic is its own, so a head's
 * result does not depend on nj. */
AVX512K INLINE void decode_item_avx512(void *out, const void *q, int64_t qs, const void *kc, const void *vc,
                                       const float *ksc, const float *vsc, int q8, const int32_t *bt,
                                       int64_t bts, const int32_t *lens, int64_t b, int64_t g, int64_t j0,
                                       int64_t nj, int64_t heads, int64_t kv_heads, const int64_t D, int64_t bs,
                                       float scale, int64_t window, float softcap, const float *sinks, int bf) {
    enum { C_MAX = 8 }; /* 16-lane chunks of a row: D / 16 */
    const int64_t C = D / 16, group = heads / kv_heads, len = lens[b], h0 = g * group + j0;
    const int64_t first = window > 0 && len > window ? len - window : 0;
    const int32_t *table = bt + b * bts;
    float kv[TILE][FAST_DIM] __attribute__((aligned(64)));
    float acc[MAX_GROUP][FAST_DIM] __attribute__((aligned(64)));
    float sc[MAX_GROUP][TILE] __attribute__((aligned(64))), mx[MAX_GROUP], sum[MAX_GROUP];
    int64_t rows[TILE];
    for (int64_t j = 0; j < nj; j++) {
        for (int64_t i = 0; i < D; i++)
            acc[j][i] = 0.0f;
        mx[j] = sinks ? sinks[h0 + j] : -INFINITY; /* as decode_item */
        sum[j] = sinks ? 1.0f : 0.0f;
    }
    int64_t blk = first / bs, off = first % bs;
    for (int64_t t0 = first; t0 < len; t0 += TILE) {
        const int64_t n = len - t0 < TILE ? len - t0 : TILE;
        for (int64_t k = 0; k < n; k++) {
            rows[k] = (((int64_t)table[blk] * bs + off) * kv_heads + g) * D;
            if (++off == bs) {
                off = 0;
                blk++;
            }
        }
        /* The tile's value rows are fetched while its keys are converted and scored: a
         * decode step comes back to a layer's cache after streaming the model's weights,
         * so both come from memory. */
        const int64_t vbytes = D * (q8 ? 1 : bf ? 2 : 4);
        for (int64_t k = 0; k < n; k++) {
            for (int64_t o = 0; o < vbytes; o += 64)
                _mm_prefetch((const char *)vc + rows[k] / D * vbytes + o, _MM_HINT_T0);
            for (int64_t c = 0; c < C; c++)
                _mm512_store_ps(kv[k] + 16 * c, ld16(kc, ksc, rows[k] + 16 * c, D, q8, bf));
        }
        for (int64_t k = n; k < (n + 15) / 16 * 16; k++) /* the last block's padding keys */
            for (int64_t c = 0; c < C; c++)
                _mm512_store_ps(kv[k] + 16 * c, _mm512_setzero_ps());
        for (int64_t j = 0; j < nj; j++) {
            __m512 qv[C_MAX];
            for (int64_t c = 0; c < C; c++)
                qv[c] = ld16(q, NULL, b * qs + (h0 + j) * D + 16 * c, D, 0, bf);
            for (int64_t k0 = 0; k0 < n; k0 += 16) {
                __m512 p[16];
                for (int kk = 0; kk < 16; kk++) {
                    p[kk] = _mm512_mul_ps(qv[0], _mm512_load_ps(kv[k0 + kk]));
                    for (int64_t c = 1; c < C; c++)
                        p[kk] = _mm512_fmadd_ps(qv[c], _mm512_load_ps(kv[k0 + kk] + 16 * c), p[kk]);
                }
                _mm512_store_ps(sc[j] + k0, _mm512_mul_ps(eng_hsum16(p), _mm512_set1_ps(scale)));
            }
            if (softcap > 0.0f)
                for (int64_t k = 0; k < n; k++)
                    sc[j][k] = softcap * tanhf(sc[j][k] / softcap);
            const float alpha = softmax_tile(sc[j], n, &mx[j], &sum[j]);
            for (int64_t c = 0; c < C; c++)
                _mm512_store_ps(acc[j] + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc[j] + 16 * c), _mm512_set1_ps(alpha)));
        }
        for (int64_t k = 0; k < n; k++)
            for (int64_t c = 0; c < C; c++)
                _mm512_store_ps(kv[k] + 16 * c, ld16(vc, vsc, rows[k] + 16 * c, D, q8, bf));
        for (int64_t j = 0; j < nj; j++) {
            __m512 a[C_MAX];
            for (int64_t c = 0; c < C; c++)
                a[c] = _mm512_load_ps(acc[j] + 16 * c);
            for (int64_t k = 0; k < n; k++) {
                const __m512 pk = _mm512_set1_ps(sc[j][k]);
                for (int64_t c = 0; c < C; c++)
                    a[c] = _mm512_fmadd_ps(pk, _mm512_load_ps(kv[k] + 16 * c), a[c]);
            }
            for (int64_t c = 0; c < C; c++)
                _mm512_store_ps(acc[j] + 16 * c, a[c]);
        }
    }
    for (int64_t j = 0; j < nj; j++) {
        const float inv = 1.0f / sum[j];
        const int64_t oo = (b * heads + h0 + j) * D;
        for (int64_t i = 0; i < D; i++)
            st(out, oo + i, acc[j][i] * inv, bf);
    }
}

#define ATTN_FAST(NAME, D, BF, Q8)                                                                             \
    AVX512K static void NAME(void *out, const void *q, int64_t qs, const void *kc, const void *vc,             \
                             const float *ksc, const float *vsc, const int32_t *bt, int64_t bts,               \
                             const int32_t *lens, int64_t b, int64_t g, int64_t j0, int64_t nj, int64_t heads, \
                             int64_t kv_heads, int64_t bs, float scale, int64_t window, float softcap,         \
                             const float *sinks) {                                                             \
        decode_item_avx512(out, q, qs, kc, vc, ksc, vsc, Q8, bt, bts, lens, b, g, j0, nj, heads, kv_heads, D,  \
                           bs, scale, window, softcap, sinks, BF);                                             \
    }
ATTN_FAST(attn64_f32, 64, 0, 0)
ATTN_FAST(attn64_bf16, 64, 1, 0)
ATTN_FAST(attn64_f32_q8, 64, 0, 1)
ATTN_FAST(attn64_bf16_q8, 64, 1, 1)
ATTN_FAST(attn128_f32, 128, 0, 0)
ATTN_FAST(attn128_bf16, 128, 1, 0)
ATTN_FAST(attn128_f32_q8, 128, 0, 1)
ATTN_FAST(attn128_bf16_q8, 128, 1, 1)

static int attn_avx512(void) {
    static int state = -1;
    if (state < 0) {
        __builtin_cpu_init();
        state = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    }
    return state;
}
#else
#define HAVE_ATTN_AVX512 0
#endif

#if HAVE_ATTN_AVX512
#define ATTN_DISPATCH(SUFFIX)                                                                                \
    if (d == 64 && attn_avx512()) {                                                                           \
        attn64_##SUFFIX(out, q, qs, kc, vc, ksc, vsc, bt, bts, lens, b, g, j0, nj, heads, kv_heads, bs, scale, \
                        window, softcap, sinks);                                                              \
        return;                                                                                               \
    }                                                                                                         \
    if (d == 128 && attn_avx512()) {                                                                          \
        attn128_##SUFFIX(out, q, qs, kc, vc, ksc, vsc, bt, bts, lens, b, g, j0, nj, heads, kv_heads, bs,      \
                         scale, window, softcap, sinks);                                                      \
        return;                                                                                               \
    }
#else
#define ATTN_DISPATCH(SUFFIX)
#endif

/* head_dim 64 and 128 take the AVX-512 item where the CPU has it, or loops of a known
 * length the compiler unrolls; other sizes take the generic loop. */
#define DECODE_ITEM(SUFFIX, BF, Q8)                                                         \
    CLONES void eng_decode_item_##SUFFIX(void *out, const void *q, int64_t qs, const void *kc, \
                                         const void *vc, const float *ksc, const float *vsc,  \
                                         const int32_t *bt, int64_t bts,                      \
                                         const int32_t *lens, int64_t b, int64_t g,           \
                                         int64_t j0, int64_t nj,                              \
                                         int64_t heads, int64_t kv_heads, int64_t d,          \
                                         int64_t bs, float scale, int64_t window,             \
                                         float softcap, const float *sinks) {                 \
        ATTN_DISPATCH(SUFFIX)                                                                 \
        if (d == 64)                                                                          \
            decode_item(out, q, qs, kc, vc, ksc, vsc, Q8, bt, bts, lens, b, g, j0, nj, heads, \
                        kv_heads, 64, bs, scale, window, softcap, sinks, BF);                 \
        else if (d == 128)                                                                    \
            decode_item(out, q, qs, kc, vc, ksc, vsc, Q8, bt, bts, lens, b, g, j0, nj, heads, \
                        kv_heads, 128, bs, scale, window, softcap, sinks, BF);                \
        else                                                                                  \
            decode_item(out, q, qs, kc, vc, ksc, vsc, Q8, bt, bts, lens, b, g, j0, nj, heads, \
                        kv_heads, d, bs, scale, window, softcap, sinks, BF);                  \
    }

DECODE_ITEM(f32, 0, 0)
DECODE_ITEM(bf16, 1, 0)
DECODE_ITEM(f32_q8, 0, 1)
DECODE_ITEM(bf16_q8, 1, 1)

typedef void (*decode_item_fn)(void *, const void *, int64_t, const void *, const void *,
                               const float *, const float *, const int32_t *, int64_t,
                               const int32_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                               int64_t, int64_t, int64_t, float, int64_t, float, const float *);

/* Pieces each KV head's query heads are attended in: the fewest that give every thread
 * two items or more (where (request, KV head) pairs are fewer) and hold at most MAX_GROUP
 * heads each, a divisor of the group. A piece reads its keys and values once for all of
 * its heads, so a wide group in few pieces (latent attention's one KV head at one stream)
 * reads the context a few times, not once a head. Each head's result is the same for any
 * split (decode_item), so the split is free to follow the batch. */
int64_t eng_decode_split(int64_t pairs, int64_t group, int nthreads) {
    const int64_t busy = (2 * (int64_t)nthreads + pairs - 1) / pairs, narrow = (group + MAX_GROUP - 1) / MAX_GROUP;
    int64_t split = busy > narrow ? busy : narrow;
    if (split > group)
        split = group;
    while (group % split)
        split++;
    return split;
}

/* kv_dtype: DT_I8 for an int8 cache with scales (k_scale, v_scale), else the query's
 * dtype (the scales are then unused). */
int eng_paged_decode(int dtype, void *out, const void *q, int64_t q_stride, const void *k_cache,
                     const void *v_cache, int kv_dtype, const float *k_scale,
                     const float *v_scale, int64_t num_blocks, const int32_t *block_tables,
                     int64_t bt_stride, const int32_t *seq_lens, int64_t batch, int64_t heads,
                     int64_t kv_heads, int64_t d, int64_t block_size, float scale,
                     int64_t window, float softcap, const float *sinks, int nthreads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || (kv_dtype != dtype && kv_dtype != DT_I8) ||
        (kv_dtype == DT_I8 && (!k_scale || !v_scale)) || kv_heads < 1 || heads % kv_heads ||
        d > MAX_DIM || block_size < 1)
        return -1;
    /* Every block a request will read must exist: a bad table is an error, not a read
     * out of bounds. */
    int64_t work = 0;
    for (int64_t b = 0; b < batch; b++) {
        int64_t len = seq_lens[b], used = (len + block_size - 1) / block_size;
        if (len < 1 || used > bt_stride)
            return -2;
        for (int64_t i = 0; i < used; i++)
            if (block_tables[b * bt_stride + i] < 0 || block_tables[b * bt_stride + i] >= num_blocks)
                return -2;
        work += (window > 0 && len > window ? window : len) * heads * d * 2;
    }
    /* An item is a (request, KV head) pair, or with fewer such pairs than two per thread
     * (one stream) a (request, query head) pair, so both threads have work. */
    const int64_t group = heads / kv_heads, split = eng_decode_split(batch * kv_heads, group, nthreads);
    const int64_t items = batch * kv_heads * split, nj = group / split;
    const int q8 = kv_dtype == DT_I8;
    decode_item_fn item = dtype == DT_BF16 ? (q8 ? eng_decode_item_bf16_q8 : eng_decode_item_bf16)
                                           : (q8 ? eng_decode_item_f32_q8 : eng_decode_item_f32);
    /* Dynamic: requests of different lengths make items of different cost. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) \
    if (nthreads > 1 && items > 1 && work >= PARALLEL_MIN_WORK)
    for (int64_t it = 0; it < items; it++) {
        int64_t b = it / (kv_heads * split), g = it / split % kv_heads, j0 = it % split * nj;
        item(out, q, q_stride, k_cache, v_cache, k_scale, v_scale, block_tables, bt_stride,
             seq_lens, b, g, j0, nj, heads, kv_heads, d, block_size, scale, window, softcap, sinks);
    }
    return 0;
}

/* ---- An encoder's attention: each sequence over all of its own rows ------------------- */

/* One (sequence, head) item of eng_encoder_attention: the sequence's n rows as queries
 * against its n rows as keys, no mask (an encoder attends both ways). K is first copied
 * transposed and V as it is, into fp32 scratch padded with zeros to whole vectors of 16
 * (kt [d][np], v [n][dp]), so every inner loop is 16 wide with a fixed trip count. Then,
 * ENC_QB queries at a time: their scaled scores against 16 keys at a time (each key vector
 * read once for all of them, ENC_QB independent sums so the FMAs' latency is hidden), each
 * query's softmax taken whole over its n scores, and their outputs 16 columns at a time as
 * the weighted sums of V's rows, divided by the weights' sums. qkv rows are [3, heads, d]
 * (one projection's output), out rows [heads, d]. `scratch` holds ENC_SCRATCH(n, d)
 * floats. */
#define ENC_QB 8
#define ENC_PAD(x) (((x) + 15) / 16 * 16)
#define ENC_SCRATCH(n, d) (ENC_PAD(n) * ENC_PAD(d) * 2 + ENC_QB * ENC_PAD(n) + ENC_QB * ENC_PAD(d))

typedef struct {
    int64_t stride, qo, n, np, dp, row0;
    float *kt, *v, *sc, *qf;
} EncItem;

INLINE EncItem encoder_load(const void *qkv, int64_t row0, int64_t n, int64_t h, int64_t heads, int64_t d,
                            float *scratch, int bf) {
    EncItem e = {3 * heads * d, h * d, n, ENC_PAD(n), ENC_PAD(d), row0, scratch, NULL, NULL, NULL};
    e.v = e.kt + e.dp * e.np;
    e.sc = e.v + e.np * e.dp;
    e.qf = e.sc + ENC_QB * e.np;
    const int64_t ko = (heads + h) * d, vo = (2 * heads + h) * d;
    memset(e.kt, 0, (size_t)(2 * e.dp * e.np) * sizeof(float));
    for (int64_t j = 0; j < n; j++) {
        const int64_t r = (row0 + j) * e.stride;
        for (int64_t c = 0; c < d; c++) {
            e.kt[c * e.np + j] = ld(qkv, r + ko + c, bf);
            e.v[j * e.dp + c] = ld(qkv, r + vo + c, bf);
        }
    }
    return e;
}

/* Queries i0 .. i0 + nq - 1, times `scale`, into qf (ENC_QB rows of dp; the rest zero). */
INLINE void encoder_queries(const EncItem *e, const void *qkv, int64_t i0, int64_t nq, int64_t d, float scale,
                            int bf) {
    for (int64_t q = 0; q < ENC_QB; q++)
        for (int64_t c = 0; c < d; c++)
            e->qf[q * e->dp + c] = q < nq ? ld(qkv, (e->row0 + i0 + q) * e->stride + e->qo + c, bf) * scale : 0.0f;
}

/* The scores of sc's first nq rows to softmax weights (unnormalised), their sums' inverses
 * in inv; the padding rows' weights zero. The loops run over the padded width np, a
 * multiple of 16 (no scalar remainder): the padding keys' scores are set to -inf first,
 * and exp_nonpos gives them weight 0. */
INLINE void encoder_softmax(const EncItem *e, int64_t nq, float *inv) {
    for (int64_t q = 0; q < ENC_QB; q++) {
        float *row = e->sc + q * e->np, m = -INFINITY, s = 0.0f;
        if (q >= nq) {
            for (int64_t j = 0; j < e->np; j++)
                row[j] = 0.0f;
            inv[q] = 0.0f;
            continue;
        }
        for (int64_t j = e->n; j < e->np; j++)
            row[j] = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < e->np; j++)
            m = row[j] > m ? row[j] : m;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < e->np; j++) {
            const float p = exp_nonpos(row[j] - m);
            row[j] = p;
            s += p;
        }
        inv[q] = 1.0f / s;
    }
}

INLINE void encoder_store(void *out, const EncItem *e, int64_t i0, int64_t q, int64_t h, int64_t heads,
                          int64_t d, int64_t c0, const float *o, float inv, int bf) {
    const int64_t oo = ((e->row0 + i0 + q) * heads + h) * d + c0;
    for (int64_t cc = 0; cc < 16 && c0 + cc < d; cc++)
        st(out, oo + cc, o[cc] * inv, bf);
}

/* acc[q][0 .. 15] = the sum over i < len of w[q * ws + i] * v[i * vs + 0 .. 15], for the
 * ENC_QB rows q: both products of an item (the scores: w the queries, v K's transposed
 * rows; the outputs: w the softmax weights, v V's rows). Each v vector is read once for all
 * the rows, and their ENC_QB sums, kept apart, hide the multiply-adds' latency. */
INLINE void encoder_products(float acc[ENC_QB][16], const float *w, int64_t ws, const float *v, int64_t vs,
                             int64_t len) {
    for (int64_t q = 0; q < ENC_QB; q++)
        for (int jj = 0; jj < 16; jj++)
            acc[q][jj] = 0.0f;
    for (int64_t i = 0; i < len; i++) {
        const float *vi = v + i * vs;
        for (int64_t q = 0; q < ENC_QB; q++) {
            const float wq = w[q * ws + i];
#pragma omp simd
            for (int jj = 0; jj < 16; jj++)
                acc[q][jj] = fmaf(wq, vi[jj], acc[q][jj]);
        }
    }
}

INLINE void encoder_item(void *out, const void *qkv, int64_t row0, int64_t n, int64_t h,
                         int64_t heads, int64_t d, float scale, float *scratch, int bf) {
    const EncItem e = encoder_load(qkv, row0, n, h, heads, d, scratch, bf);
    for (int64_t i0 = 0; i0 < n; i0 += ENC_QB) {
        const int64_t nq = n - i0 < ENC_QB ? n - i0 : ENC_QB;
        float inv[ENC_QB], acc[ENC_QB][16];
        encoder_queries(&e, qkv, i0, nq, d, scale, bf);
        for (int64_t j0 = 0; j0 < e.np; j0 += 16) {
            encoder_products(acc, e.qf, e.dp, e.kt + j0, e.np, d);
            for (int64_t q = 0; q < ENC_QB; q++)
                for (int jj = 0; jj < 16; jj++)
                    e.sc[q * e.np + j0 + jj] = acc[q][jj];
        }
        encoder_softmax(&e, nq, inv);
        for (int64_t c0 = 0; c0 < e.dp; c0 += 16) {
            encoder_products(acc, e.sc, e.np, e.v + c0, e.dp, n);
            for (int64_t q = 0; q < nq; q++)
                encoder_store(out, &e, i0, q, h, heads, d, c0, acc[q], inv[q], bf);
        }
    }
}

CLONES static void encoder_item_f32(void *out, const void *qkv, int64_t row0, int64_t n, int64_t h,
                                    int64_t heads, int64_t d, float scale, float *scratch) {
    encoder_item(out, qkv, row0, n, h, heads, d, scale, scratch, 0);
}

CLONES static void encoder_item_bf16(void *out, const void *qkv, int64_t row0, int64_t n, int64_t h,
                                     int64_t heads, int64_t d, float scale, float *scratch) {
    encoder_item(out, qkv, row0, n, h, heads, d, scale, scratch, 1);
}

typedef void (*encoder_item_fn)(void *, const void *, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                                float *);

/* An encoder layer's attention over a packed batch: sequence s owns rows starts[s] ..
 * starts[s + 1] - 1 of qkv ([rows, 3 * heads * d], contiguous) and of out ([rows, heads *
 * d]). Items are (sequence, head) pairs, shared dynamically (lengths differ). Returns -1
 * for a dtype or shape it does not take, -2 (writing nothing) if the starts do not rise
 * from 0, -3 if a thread's scratch could not be allocated. */
int eng_encoder_attention(int dtype, void *out, const void *qkv, const int64_t *starts, int64_t nseq,
                          int64_t heads, int64_t d, float scale, int nthreads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || heads < 1 || d < 1 || nseq < 0)
        return -1;
    if (nseq == 0)
        return 0;
    int64_t longest = 0, work = 0;
    if (starts[0] != 0)
        return -2;
    for (int64_t s = 0; s < nseq; s++) {
        const int64_t n = starts[s + 1] - starts[s];
        if (n < 1)
            return -2;
        longest = n > longest ? n : longest;
        work += n * n * heads * d * 2;
    }
    const int64_t items = nseq * heads;
    encoder_item_fn item = dtype == DT_BF16 ? encoder_item_bf16 : encoder_item_f32;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && items > 1 && work >= PARALLEL_MIN_WORK)
    {
        float *scratch = malloc((size_t)ENC_SCRATCH(longest, d) * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!scratch) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const int64_t s = it / heads;
            item(out, qkv, starts[s], starts[s + 1] - starts[s], it % heads, heads, d, scale, scratch);
        }
        free(scratch);
    }
    return failed ? -3 : 0;
}

/* ---- Gated DeltaNet: one decode step of the delta rule ---------------------------------- */

/* One value head of one request: S [dk, dv] (row i: key coordinate i), with q and k of its
 * key head (dk each), v and out (dv each), decay d = exp(g) and beta. Two passes over S
 * where the torch reference makes four: the first reads S^T k and S^T q together, the
 * second writes S' = d S + k delta^T with delta = beta (v - d S^T k); the output is
 * S'^T q = d S^T q + delta (k . q). a and c are dv floats of scratch. */
CLONES void eng_delta_rule_item(float *S, const float *q, const float *k, const float *v, float d, float b,
                         float *out, int64_t dk, int64_t dv, float *a, float *c) {
    for (int64_t j = 0; j < dv; j++)
        a[j] = c[j] = 0.0f;
    float kq = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        const float ki = k[i], qi = q[i];
        const float *row = S + i * dv;
        for (int64_t j = 0; j < dv; j++) {
            a[j] += row[j] * ki;
            c[j] += row[j] * qi;
        }
        kq += ki * qi;
    }
    for (int64_t j = 0; j < dv; j++) {
        const float delta = b * (v[j] - d * a[j]);
        out[j] = d * c[j] + delta * kq;
        a[j] = delta;
    }
    for (int64_t i = 0; i < dk; i++) {
        const float ki = k[i];
        float *row = S + i * dv;
        for (int64_t j = 0; j < dv; j++)
            row[j] = d * row[j] + ki * a[j];
    }
}

/* One decode token for each of n requests, every value head: state [n, hv, dk, dv], q and
 * k [n, hk, dk] (a key head's, shared by hv / hk value heads: head h reads key head h / (hv
 * / hk), or h % hk when tiled), v and out [n, hv, dv], g (log decay) and beta [n, hv]; all
 * fp32 and contiguous. The state is updated in place. Returns -1 for a shape it does not
 * take (dv above MAX_DIM, or hk not dividing hv). */
int eng_delta_rule_decode(float *state, const float *q, const float *k, const float *v, const float *g,
                          const float *beta, float *out, int64_t n, int64_t hv, int64_t hk, int64_t dk,
                          int64_t dv, int tiled, int nthreads) {
    if (n < 0 || hv < 1 || hk < 1 || hv % hk || dk < 1 || dv < 1 || dv > MAX_DIM)
        return -1;
    const int64_t items = n * hv, per = hv / hk;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && items > 1 && items * dk * dv >= PARALLEL_MIN_WORK)
    for (int64_t it = 0; it < items; it++) {
        float a[MAX_DIM], c[MAX_DIM];
        const int64_t r = it / hv, h = it % hv, kh = r * hk + (tiled ? h % hk : h / per);
        eng_delta_rule_item(state + it * dk * dv, q + kh * dk, k + kh * dk, v + it * dv, expf(g[it]), beta[it],
                        out + it * dv, dk, dv, a, c);
    }
    return 0;
}

/* ---- a recurrent layer's causal convolution, one decode token ---------------------------- */

/* Row `ro`: each channel's window . weight (then x's tap, then the bias: the reference's
 * order), the window shifted on by x, then SiLU over the row. The dot products run in
 * lanes (the taps a short inner loop, unrolled at the usual width) and the shift is
 * element copies, not two libc calls a channel. SiLU keeps libm's expf: exp_nonpos's
 * 2 ulp, fed back through a recurrence, moved Qwen3.5's logprobs against transformers'
 * past their bound. */
INLINE void copy_element(int bf, void *dst, int64_t i, const void *src, int64_t j) {
    if (bf)
        ((uint16_t *)dst)[i] = ((const uint16_t *)src)[j];
    else
        ((float *)dst)[i] = ((const float *)src)[j];
}

INLINE void conv_decode_row(int bf, void *conv, const void *x, int64_t xo, const float *weight, const float *bias,
                            float *out, int64_t c, int64_t w, int64_t ro) {
    float *o = out + ro * c;
    const int64_t base = ro * c * w;
#pragma omp simd
    for (int64_t ch = 0; ch < c; ch++) {
        const float *wt = weight + ch * (w + 1);
        float acc = 0.0f;
        for (int64_t k = 0; k < w; k++)
            acc += ld(conv, base + ch * w + k, bf) * wt[k];
        const float xv = ld(x, xo + ch, bf);
        acc += xv * wt[w];
        if (bias)
            acc += bias[ch];
        o[ch] = acc;
    }
    for (int64_t ch = 0; ch < c; ch++) {  /* (bf a constant here: each copy one element's bits) */
        for (int64_t k = 0; k + 1 < w; k++)
            copy_element(bf, conv, base + ch * w + k, conv, base + ch * w + k + 1);
        copy_element(bf, conv, base + ch * w + w - 1, x, xo + ch);
    }
    for (int64_t ch = 0; ch < c; ch++) {
        const float z = o[ch];
        o[ch] = z / (1.0f + expf(-z));
    }
}

CLONES void eng_conv_decode_row(int bf, void *conv, const void *x, int64_t xo, const float *weight, const float *bias,
                                float *out, int64_t c, int64_t w, int64_t ro) {
    /* (w a constant where it is the released models' 3, d_conv 4: the taps unrolled) */
    if (bf)
        w == 3 ? conv_decode_row(1, conv, x, xo, weight, bias, out, c, 3, ro)
               : conv_decode_row(1, conv, x, xo, weight, bias, out, c, w, ro);
    else
        w == 3 ? conv_decode_row(0, conv, x, xo, weight, bias, out, c, 3, ro)
               : conv_decode_row(0, conv, x, xo, weight, bias, out, c, w, ro);
}

/* One token a row through a depthwise causal convolution: conv [n, c, w] (the last w
 * inputs of each channel, fp32 or bf16, contiguous) and x (n rows of c, x_stride elements
 * apart, the same dtype), weight [c, w + 1] and bias [c] (or NULL) fp32. Writes out [n, c]
 * fp32 = SiLU(window . weight + bias) over the window [conv | x], and shifts x into conv.
 * Returns -1 for a dtype or shape it does not take. */
int eng_conv_decode(int dtype, void *conv, const void *x, int64_t x_stride, const float *weight, const float *bias,
                    float *out, int64_t n, int64_t c, int64_t w, int nthreads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || n < 0 || c < 1 || w < 1)
        return -1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && n > 1 && n * c * w >= PARALLEL_MIN_WORK)
    for (int64_t r = 0; r < n; r++)
        eng_conv_decode_row(dtype == DT_BF16, conv, x, r * x_stride, weight, bias, out, c, w, r);
    return 0;
}

/* ---- Mamba-2: one decode step of the state-space model ---------------------------------- */

/* One head of one request: state [p, ds] (row i: the head's i-th channel), x (p), its
 * group's B and C (ds each), dt, the head's decay rate a and skip d. One pass over the
 * state where the torch reference makes three: each row decays by exp(dt a), takes dt x_i
 * B, and is read against C at once: y_i = row . C + d x_i. */
CLONES void eng_ssd_item(float *S, const float *x, const float *B, const float *C, float dt, float a, float d,
                         float *y, int64_t p, int64_t ds) {
    const float decay = expf(dt * a);
    for (int64_t i = 0; i < p; i++) {
        const float u = dt * x[i];
        float *row = S + i * ds;
        float acc = 0.0f;
        /* Vectorized, the read against C summed in lanes (its order is not the reference's
         * matmul's either). */
#pragma omp simd reduction(+ : acc)
        for (int64_t j = 0; j < ds; j++) {
            const float v = decay * row[j] + u * B[j];
            row[j] = v;
            acc += v * C[j];
        }
        y[i] = acc + d * x[i];
    }
}

/* One decode token for each of n requests, every head: state [n, h, p, ds], x and y [n,
 * h, p], B and C [n, g, ds] (head k reads group k / (h / g)), dt [n, h] (after softplus
 * and clamp), a and d [h]; all fp32 and contiguous. The state is updated in place. Returns
 * -1 for a shape it does not take (g not dividing h). */
int eng_ssd_decode(float *state, const float *x, const float *B, const float *C, const float *dt, const float *a,
                   const float *d, float *y, int64_t n, int64_t h, int64_t g, int64_t p, int64_t ds, int nthreads) {
    if (n < 0 || h < 1 || g < 1 || h % g || p < 1 || ds < 1)
        return -1;
    const int64_t items = n * h, per = h / g;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && items > 1 && items * p * ds >= PARALLEL_MIN_WORK)
    for (int64_t it = 0; it < items; it++) {
        const int64_t r = it / h, k = it % h, grp = r * g + k / per;
        eng_ssd_item(state + it * p * ds, x + it * p, B + grp * ds, C + grp * ds, dt[it], a[k], d[k], y + it * p, p,
                     ds);
    }
    return 0;
}

/* ---- Mamba-2: a mixer's whole decode token, between its two projections --------------- */

/* Row r's gated RMS norm (its groups of d_inner / g channels) of y (fp32) with the gate
 * silu(z), as the mixer's torch path computes it: flags & 1: normed at all (else y *
 * gate); flags & 2: y normed before the gate multiplies it (else after); flags & 4: the
 * weight's product rounded to the dtype as a model-dtype weight times the rounded row
 * (else the fp32 product). Written in the dtype. */
INLINE void mamba_gated_norm_row(int bf, const void *zx, int64_t zo, const float *y, const float *w, float eps,
                                 int flags, void *out, int64_t oo, int64_t d_inner, int64_t g, float *gate) {
#pragma omp simd
    for (int64_t i = 0; i < d_inner; i++) {
        const float z = ld(zx, zo + i, bf);
        const float e = exp_nonpos(z < 0.0f ? z : -z);
        gate[i] = z * ((z < 0.0f ? e : 1.0f) / (1.0f + e));
    }
    if (!(flags & 1)) {
        for (int64_t i = 0; i < d_inner; i++)
            st(out, oo + i, y[i] * gate[i], bf);
        return;
    }
    const int before = flags & 2, rounds = flags & 4;
    const int64_t per = d_inner / g;
    for (int64_t gi = 0; gi < g; gi++) {
        const int64_t lo = gi * per;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = lo; i < lo + per; i++) {
            const float v = before ? y[i] : y[i] * gate[i];
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)per + eps);
        for (int64_t i = lo; i < lo + per; i++) {
            const float v = (before ? y[i] : y[i] * gate[i]) * inv;
            float o = rounds ? rnd(w[i] * rnd(v, bf), bf) : w[i] * v;
            st(out, oo + i, before ? o * gate[i] : o, bf);
        }
    }
}

/* One decode token of a Mamba-2 mixer for n requests, from in_proj's rows zx [n, W] (fp32
 * or bf16, x_stride elements apart: z [d_inner], then x B C [conv_dim], then dt [h]) to
 * the gated norm's output [n, d_inner] in the same dtype, out_proj's input: dt =
 * clamp(softplus(dt + dt_bias)), the causal convolution (conv [n, conv_dim, w], the dtype,
 * moved on in place), the state-space step on state [n, h, p, ds] fp32 (in place), then
 * the gated norm (see mamba_gated_norm_row; w the norm's weight as fp32, d_inner of it).
 * One call where the torch path makes some twenty ops, each slow after the projections
 * have streamed their weights through the caches. scratch: n * (conv_dim + h + 2 d_inner)
 * floats. Returns -1 for a dtype or shape it does not take. */
int eng_mamba2_decode(int dtype, const void *zx, int64_t x_stride, void *conv, float *state, const float *conv_w,
                      const float *conv_b, const float *dt_bias, const float *a, const float *d, const float *w,
                      float dt_min, float dt_max, float eps, int flags, int64_t n, int64_t d_inner, int64_t conv_dim,
                      int64_t cw, int64_t h, int64_t g, int64_t ds, float *scratch, void *out, int nthreads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || n < 1 || h < 1 || g < 1 || h % g || d_inner % h || d_inner % g
        || conv_dim != d_inner + 2 * g * ds || cw < 1 || x_stride < d_inner + conv_dim + h)
        return -1;
    const int bf = dtype == DT_BF16;
    const int64_t p = d_inner / h, per = h / g;
    float *mixed = scratch, *dts = mixed + n * conv_dim, *y = dts + n * h, *gate = y + n * d_inner;
    for (int64_t r = 0; r < n; r++) {
        for (int64_t k = 0; k < h; k++) {  /* torch's softplus: the input itself above 20 */
            const float v = ld(zx, r * x_stride + d_inner + conv_dim + k, bf) + dt_bias[k];
            const float sp = v > 20.0f ? v : log1pf(expf(v));
            dts[r * h + k] = sp < dt_min ? dt_min : (sp > dt_max ? dt_max : sp);
        }
        eng_conv_decode_row(bf, conv, zx, r * x_stride + d_inner, conv_w, conv_b, mixed, conv_dim, cw, r);
    }
    const int64_t items = n * h;
    const int team = nthreads > 1 && items > 1 && items * p * ds >= PARALLEL_MIN_WORK ? nthreads : 1;
#pragma omp parallel num_threads(team)
    {
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            const int64_t r = it / h, k = it % h, grp = k / per;
            const float *m = mixed + r * conv_dim;
            eng_ssd_item(state + it * p * ds, m + k * p, m + d_inner + grp * ds, m + d_inner + g * ds + grp * ds,
                         dts[it], a[k], d[k], y + r * d_inner + k * p, p, ds);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++)
            mamba_gated_norm_row(bf, zx, r * x_stride, y + r * d_inner, w, eps, flags, out, r * d_inner, d_inner, g,
                                 gate + r * d_inner);
    }
    return 0;
}

/* ---- Mamba-1: one decode step of the selective scan ------------------------------------- */

/* One channel of one request: state row [ds], its input u and step dt, its decay rates a
 * [ds] and skip d, the request's B and C [ds]. Each value decays by exp(dt a_j) (dt >= 0
 * and a < 0: exp_nonpos, whose loop vectorizes) and takes dt u B_j; the row is then read
 * against C. Two short passes over a row in cache, where the torch reference makes four
 * over the whole [n, dch, ds] state and its temporaries. */
CLONES void eng_selective_item(float *row, float u, float dt, const float *a, const float *B, const float *C,
                               float d, float *y, int64_t ds) {
    const float du = dt * u;
    for (int64_t j = 0; j < ds; j++)
        row[j] = exp_nonpos(dt * a[j]) * row[j] + du * B[j];
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t j = 0; j < ds; j++)
        acc += row[j] * C[j];
    *y = acc + d * u;
}

/* One decode token for each of n requests, every channel: state [n, dch, ds], u, dt and y
 * [n, dch], a [dch, ds], B and C [n, ds], d [dch]; all fp32 and contiguous. The state is
 * updated in place. Returns -1 for a shape it does not take. */
int eng_selective_decode(float *state, const float *u, const float *dt, const float *a, const float *B,
                         const float *C, const float *d, float *y, int64_t n, int64_t dch, int64_t ds, int nthreads) {
    if (n < 0 || dch < 1 || ds < 1)
        return -1;
    const int64_t items = n * dch;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && items > 1 && items * ds >= PARALLEL_MIN_WORK)
    for (int64_t it = 0; it < items; it++) {
        const int64_t r = it / dch, k = it % dch;
        eng_selective_item(state + it * ds, u[it], dt[it], a + k * ds, B + r * ds, C + r * ds, d[k], y + it, ds);
    }
    return 0;
}

/* A Mamba-1 mixer's decode token after its dt projection, for n requests: dt =
 * softplus(dt_raw + dt_bias) (torch's: the input itself above 20), the selective scan's
 * step on state [n, dch, ds] fp32 (in place), then y * silu(z) written in the dtype. u and
 * dt_raw [n, dch] (the dtype, contiguous), B and C [n, ds] and z [n, dch] (the dtype, rows
 * b_stride / z_stride elements apart), dt_bias and d [dch], a [dch, ds] fp32. scratch: 2 n
 * ds floats (B and C as fp32). One call where the torch path makes some ten small ops. */
int eng_mamba1_decode(int dtype, float *state, const void *u, const void *dt_raw, const void *B, const void *C,
                      int64_t bc_stride, const void *z, int64_t z_stride, const float *dt_bias, const float *a,
                      const float *d, void *out, float *scratch, int64_t n, int64_t dch, int64_t ds, int nthreads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || n < 1 || dch < 1 || ds < 1 || bc_stride < ds || z_stride < dch)
        return -1;
    const int bf = dtype == DT_BF16;
    float *bf32 = scratch, *cf32 = scratch + n * ds;
    for (int64_t r = 0; r < n; r++)
        for (int64_t j = 0; j < ds; j++) {
            bf32[r * ds + j] = ld(B, r * bc_stride + j, bf);
            cf32[r * ds + j] = ld(C, r * bc_stride + j, bf);
        }
    const int64_t items = n * dch;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && items > 1 && items * ds >= PARALLEL_MIN_WORK)
    for (int64_t it = 0; it < items; it++) {
        const int64_t r = it / dch, k = it % dch;
        const float v = ld(dt_raw, it, bf) + dt_bias[k];
        const float dt = v > 20.0f ? v : log1pf(expf(v));
        float y;
        eng_selective_item(state + it * ds, ld(u, it, bf), dt, a + k * ds, bf32 + r * ds, cf32 + r * ds, d[k], &y,
                           ds);
        const float g = ld(z, r * z_stride + k, bf);
        st(out, it, y * (g / (1.0f + expf(-g))), bf);
    }
    return 0;
}

/* ---- int8 KV-cache write -------------------------------------------------------------- */

/* Quantize one token's row of d values (fp32 or bf16 at x) into int8 codes and a scale:
 * scale = max|x| / 127, code = nearbyint(x / scale) (half to even, as torch.round), an
 * all-zero row gets scale 0 and zero codes: the operations of the torch reference's
 * quantize_kv, in the same fp32 arithmetic, so the codes are equal. */
INLINE void quantize_row(int8_t *codes, float *scale, const void *x, int64_t xo, int64_t d,
                         int bf) {
    float amax = 0.0f;
    for (int64_t i = 0; i < d; i++) {
        float a = fabsf(ld(x, xo + i, bf));
        amax = a > amax ? a : amax;
    }
    float s = amax / 127.0f;
    *scale = s;
    for (int64_t i = 0; i < d; i++) {
        float y = s > 0.0f ? nearbyintf(ld(x, xo + i, bf) / s) : 0.0f;
        y = y > 127.0f ? 127.0f : (y < -127.0f ? -127.0f : y);
        codes[i] = (int8_t)y;
    }
}

CLONES void eng_kv_write_i8_token(int dtype, const void *x, int64_t xo, int64_t heads, int64_t d,
                                  int8_t *codes, float *scales, int64_t slot) {
    for (int64_t h = 0; h < heads; h++) {
        int64_t row = slot * heads + h;
        if (dtype == DT_BF16)
            quantize_row(codes + row * d, scales + row, x, xo + h * d, d, 1);
        else
            quantize_row(codes + row * d, scales + row, x, xo + h * d, d, 0);
    }
}

/* Scatter tokens x [tokens, heads, d] (rows x_stride elements apart, heads contiguous)
 * into an int8 cache at their slots: codes [num_slots, heads, d], scales [num_slots,
 * heads]. Returns -2 (and writes nothing) if a slot is outside [0, num_slots). */
int eng_kv_write_i8(int dtype, const void *x, int64_t x_stride, int64_t tokens, int64_t heads,
                    int64_t d, int8_t *codes, float *scales, const int64_t *slots,
                    int64_t num_slots, int nthreads) {
    if (dtype != DT_F32 && dtype != DT_BF16)
        return -1;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots)
            return -2;
#pragma omp parallel for schedule(static) num_threads(nthreads) \
    if (nthreads > 1 && tokens * heads * d >= PARALLEL_MIN_WORK)
    for (int64_t t = 0; t < tokens; t++)
        eng_kv_write_i8_token(dtype, x, t * x_stride, heads, d, codes, scales, slots[t]);
    return 0;
}

/* Structured output: forbid, in place, every token a grammar bitmask rules out. Row i of
 * `mask` ([n, words] int32, bit j of word w = token 32w + j allowed) applies to row
 * rows[i] of `logits` (fp32, rows `stride` floats apart, `vocab` wide); a forbidden token's
 * logit becomes -inf. Tokens past the mask's 32 * words are left alone, as xgrammar's
 * kernel leaves them. A grammar's mask is mostly whole words of 0 (nothing of that word
 * allowed) or of ~0, so those take a plain fill or nothing. Returns -2 (and writes
 * nothing) if a row index is outside [0, batch). */
int eng_apply_bitmask(float *logits, int64_t stride, int64_t batch, int64_t vocab,
                      const int32_t *mask, int64_t words, const int64_t *rows, int64_t n,
                      int nthreads) {
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= batch)
            return -2;
    const int64_t covered = words * 32 < vocab ? words * 32 : vocab;
#pragma omp parallel for schedule(static) num_threads(nthreads) \
    if (nthreads > 1 && n * covered >= PARALLEL_MIN_WORK)
    for (int64_t i = 0; i < n; i++) {
        float *row = logits + rows[i] * stride;
        const uint32_t *bits = (const uint32_t *)(mask + i * words);
        for (int64_t w = 0; w * 32 < covered; w++) {
            const uint32_t b = bits[w];
            if (b == 0xFFFFFFFFu)
                continue;
            const int64_t base = w * 32;
            const int64_t lim = covered - base < 32 ? covered - base : 32;
            if (b == 0) {
#pragma omp simd
                for (int64_t j = 0; j < lim; j++)
                    row[base + j] = -INFINITY;
            } else {
                for (int64_t j = 0; j < lim; j++)
                    if (!((b >> j) & 1u))
                        row[base + j] = -INFINITY;
            }
        }
    }
    return 0;
}

/* ---- greedy sampling ------------------------------------------------------------------ */

/* Row r of logits (fp32, `vocab` wide, rows `stride` apart): ids[r] = the first index of
 * its maximum (torch.argmax's choice on a tie) and lp[r] = that token's log-softmax,
 * -log(sum_j exp(x_j - max)) (x_max - max is exactly 0). Returns -1, with nothing
 * promised, where a row holds NaN or has no finite maximum: the caller's general path
 * reports such rows. */
CLONES static int greedy_row(const float *x, int64_t vocab, int64_t *id, float *lp) {
    float m = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t i = 0; i < vocab; i++) {
        m = x[i] > m ? x[i] : m;
        nan |= x[i] != x[i];
    }
    if (nan || !isfinite(m))
        return -1;
    int64_t at = -1;
    for (int64_t c = 0; c < vocab && at < 0; c += 64) { /* the first 64-wide chunk holding m */
        const int64_t n = vocab - c < 64 ? vocab - c : 64;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = 0; i < n; i++)
            hit |= x[c + i] == m;
        for (int64_t i = 0; hit && i < n; i++)
            if (x[c + i] == m) {
                at = c + i;
                break;
            }
    }
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < vocab; i++)
        s += exp_nonpos(x[i] - m);
    *id = at;
    *lp = -logf(s);
    return 0;
}

int eng_greedy(const float *logits, int64_t stride, int64_t rows, int64_t vocab, int64_t *ids, float *lp,
               int nthreads) {
    int bad = 0;
    if (vocab < 1)
        return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(| : bad) \
    if (nthreads > 1 && rows > 1 && rows * vocab >= 4 * PARALLEL_MIN_WORK)
    for (int64_t r = 0; r < rows; r++)
        bad |= greedy_row(logits + r * stride, vocab, ids + r, lp + r) != 0;
    return bad ? -1 : 0;
}


/* ---- LoRA (SGMV): per group of tokens sharing a slot, shrink then expand ------------ */

/* The caller groups the step's adapter tokens by slot once per step (LoraSegments: order,
 * group_bounds, group_slots) and every projection of every layer reuses that: a group
 * reads its slot's A and B once for all its tokens, where going token by token read them
 * once per token (32 decode tokens over 4 adapters: 8x fewer reads, and A and B, ~1 MB
 * per layer at rank 16, are what a LoRA step spends its time loading).
 *
 * Work is split in two phases inside one parallel region: the shrink over (group, block of
 * LORA_RB rows of A), the expand over (group, tile of LORA_TILE output columns), so each
 * byte of A and B is read by one thread; the barrier between them is the one the shrunk
 * rows need. Within an item, tokens go LORA_TB at a time (a register block): each row of
 * A or B loaded once serves LORA_TB tokens. */
#define LORA_TB 4    /* tokens per block: 4 fp32 sums per loaded weight */
#define LORA_RB 8    /* rows of A per shrink item: a 16-rank projection gives 2 per group */
#define LORA_TILE 128 /* output columns per expand item: 4 x 128 fp32 sums (2 KB) stay in L1 */
/* The largest R the AVX-512 expand takes (its per-row flags live on the stack); a larger
 * one (no configuration reaches it: 3 slices x --max-lora-rank 512) runs the portable loops. */
#define LORA_LIVE_MAX 4096

/* tmp[i * R + r] = x[tok[i]] . A[r] for the nb (a constant at each call site) tokens of a
 * block and rows r0 .. r1 of A (whose first element is at ao). */
INLINE void lora_shrink_block(float *tmp, const void *x, const void *a, int64_t ao, const int32_t *tok,
                              int64_t K, int64_t R, int64_t r0, int64_t r1, const int nb, int bx, int bw) {
    const int64_t x0 = (int64_t)tok[0] * K, x1 = (int64_t)tok[nb > 1 ? 1 : 0] * K;
    const int64_t x2 = (int64_t)tok[nb > 2 ? 2 : 0] * K, x3 = (int64_t)tok[nb > 3 ? 3 : 0] * K;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t row = ao + r * K;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t k = 0; k < K; k++) {
            const float w = ld(a, row + k, bw);
            s0 += ld(x, x0 + k, bx) * w;
            if (nb > 1)
                s1 += ld(x, x1 + k, bx) * w;
            if (nb > 2)
                s2 += ld(x, x2 + k, bx) * w;
            if (nb > 3)
                s3 += ld(x, x3 + k, bx) * w;
        }
        tmp[r] = s0;
        if (nb > 1)
            tmp[R + r] = s1;
        if (nb > 2)
            tmp[2 * R + r] = s2;
        if (nb > 3)
            tmp[3 * R + r] = s3;
    }
}

INLINE void lora_shrink(float *tmp, const void *x, const void *a, int64_t ao, const int32_t *tok, int64_t m,
                        int64_t K, int64_t R, int64_t r0, int64_t r1, int bx, int bw) {
    for (int64_t i = 0; i < m; i += LORA_TB) {
        switch (m - i < LORA_TB ? m - i : LORA_TB) {
        case 1: lora_shrink_block(tmp + i * R, x, a, ao, tok + i, K, R, r0, r1, 1, bx, bw); break;
        case 2: lora_shrink_block(tmp + i * R, x, a, ao, tok + i, K, R, r0, r1, 2, bx, bw); break;
        case 3: lora_shrink_block(tmp + i * R, x, a, ao, tok + i, K, R, r0, r1, 3, bx, bw); break;
        default: lora_shrink_block(tmp + i * R, x, a, ao, tok + i, K, R, r0, r1, 4, bx, bw); break;
        }
    }
}

/* out[tok[i], n0 .. n0 + w] += tmp[i] @ Bt[:, n0 .. n0 + w] for the nb tokens of a block,
 * summed in fp32 and rounded once into out (the reference's order of rounding:
 * engine/ops/reference.py lora_add_reference). Bt's rows come in nsl equal groups, group
 * j nonzero only in columns cols[j] .. cols[j + 1]: the others are skipped, as are rows
 * whose shrunk values are all zero (the rank padding of a smaller adapter). */
INLINE void lora_expand_block(void *out, const float *tmp, const void *b, int64_t bo, const int32_t *tok,
                              int64_t N, int64_t R, int64_t n0, int64_t w, int64_t nsl, const int64_t *cols,
                              const int nb, int bx, int bw) {
    float acc[LORA_TB][LORA_TILE];
    for (int i = 0; i < nb; i++)
        for (int64_t c = 0; c < w; c++)
            acc[i][c] = 0.0f;
    const int64_t per = R / nsl;
    for (int64_t j = 0; j < nsl; j++) {
        if (cols[j] >= n0 + w || cols[j + 1] <= n0)
            continue;
        const int64_t lo = cols[j] > n0 ? cols[j] - n0 : 0;
        const int64_t hi = cols[j + 1] < n0 + w ? cols[j + 1] - n0 : w;
        for (int64_t r = j * per; r < (j + 1) * per; r++) {
            const float s0 = tmp[r], s1 = nb > 1 ? tmp[R + r] : 0.0f;
            const float s2 = nb > 2 ? tmp[2 * R + r] : 0.0f, s3 = nb > 3 ? tmp[3 * R + r] : 0.0f;
            if (s0 == 0.0f && s1 == 0.0f && s2 == 0.0f && s3 == 0.0f)
                continue;
            const int64_t row = bo + r * N + n0;
#pragma omp simd
            for (int64_t c = lo; c < hi; c++) {
                const float v = ld(b, row + c, bw);
                acc[0][c] += s0 * v;
                if (nb > 1)
                    acc[1][c] += s1 * v;
                if (nb > 2)
                    acc[2][c] += s2 * v;
                if (nb > 3)
                    acc[3][c] += s3 * v;
            }
        }
    }
    for (int i = 0; i < nb; i++) {
        const int64_t o = (int64_t)tok[i] * N + n0;
#pragma omp simd
        for (int64_t c = 0; c < w; c++)
            st(out, o + c, ld(out, o + c, bx) + acc[i][c], bx);
    }
}

INLINE void lora_expand(void *out, const float *tmp, const void *b, int64_t bo, const int32_t *tok, int64_t m,
                        int64_t N, int64_t R, int64_t n0, int64_t w, int64_t nsl, const int64_t *cols, int bx,
                        int bw) {
    for (int64_t i = 0; i < m; i += LORA_TB) {
        const float *t = tmp + i * R;
        switch (m - i < LORA_TB ? m - i : LORA_TB) {
        case 1: lora_expand_block(out, t, b, bo, tok + i, N, R, n0, w, nsl, cols, 1, bx, bw); break;
        case 2: lora_expand_block(out, t, b, bo, tok + i, N, R, n0, w, nsl, cols, 2, bx, bw); break;
        case 3: lora_expand_block(out, t, b, bo, tok + i, N, R, n0, w, nsl, cols, 3, bx, bw); break;
        default: lora_expand_block(out, t, b, bo, tok + i, N, R, n0, w, nsl, cols, 4, bx, bw); break;
        }
    }
}

/* One clone per (activation dtype, adapter dtype): f = fp32, b = bf16. */
#define LORA_CLONES(sfx, bx, bw)                                                                               \
    CLONES void eng_lora_shrink_##sfx(float *tmp, const void *x, const void *a, int64_t ao, const int32_t *tok, \
                                      int64_t m, int64_t K, int64_t R, int64_t r0, int64_t r1) {              \
        lora_shrink(tmp, x, a, ao, tok, m, K, R, r0, r1, bx, bw);                                              \
    }                                                                                                          \
    CLONES void eng_lora_expand_##sfx(void *out, const float *tmp, const void *b, int64_t bo, const int32_t *tok, \
                                      int64_t m, int64_t N, int64_t R, int64_t n0, int64_t w, int64_t nsl,    \
                                      const int64_t *cols) {                                                   \
        lora_expand(out, tmp, b, bo, tok, m, N, R, n0, w, nsl, cols, bx, bw);                                  \
    }
LORA_CLONES(ff, 0, 0)
LORA_CLONES(fb, 0, 1)
LORA_CLONES(bf, 1, 0)
LORA_CLONES(bb, 1, 1)

#if HAVE_ATTN_AVX512
/* The expand with AVX-512, its sums held in registers (the portable loop above keeps them
 * in an L1 array and is bound by those loads and stores: ~2x slower). Products rounded
 * then added, as the portable loops under -ffp-contract=off. The shrink below likewise
 * (4 rows of A x 4 tokens in registers), or with AVX512-BF16 dot products for bf16 on
 * both sides; either sums in another order than the portable loop, which tiny random
 * models whose adapters outweigh their base weights (rsLoRA scale 8, A and B drawn at 0.1)
 * amplify to ~5e-5 in logits: tests/test_lora.py draws those adapters smaller. */

/* The first lanes of 16 values at element offset o (mask m; the rest zero), as fp32. */
AVX512K INLINE __m512 lora_ld16(const void *p, int64_t o, __mmask16 m, int bf) {
    if (bf)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + o)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)p + o);
}

INLINE __mmask16 lora_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* 16 lanes of out (mask m) += v, rounded once into out's dtype (for bf16 to nearest even,
 * a NaN to 0x7FC0, as f32_to_bf16). */
AVX512K INLINE void lora_add16(void *out, int64_t o, __mmask16 m, __m512 v, int bx) {
    v = _mm512_add_ps(lora_ld16(out, o, m, bx), v);
    if (!bx) {
        _mm512_mask_storeu_ps((float *)out + o, m, v);
        return;
    }
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_mask_storeu_epi16((uint16_t *)out + o, m, _mm512_cvtepi32_epi16(r));
}

/* The nb tokens of a block x 64 columns per pass over B's rows: up to 16 sums in
 * registers, each loaded B vector used nb times and each broadcast shrunk value 4 times,
 * added into out from there. A slice's rows are read over the whole 64 columns where its
 * bounds cut them: B is zero outside the slice (the block-diagonal promise), so that adds
 * zeros. */
AVX512K INLINE void lora_expand512_block(void *out, const float *tmp, const void *b, int64_t bo,
                                         const int32_t *tok, int64_t N, int64_t R, int64_t n0, int64_t w,
                                         int64_t nsl, const int64_t *cols, const unsigned char *live, const int nb,
                                         int bx, int bw) {
    const int64_t per = R / nsl;
    /* Vectors of columns per pass: 4 (64 columns); 2 for bf16 B, whose widening temporaries
     * otherwise push GCC to spill the sums inside the loop. */
    const int nv = bw ? 2 : 4;
    for (int64_t c0 = 0; c0 < w; c0 += 16 * nv) {
        __mmask16 mc[4];
        for (int c = 0; c < nv; c++)
            mc[c] = lora_mask(w - c0 - 16 * c);
        __m512 acc[16];
        for (int v = 0; v < 16; v++)
            acc[v] = _mm512_setzero_ps();
        for (int64_t j = 0; j < nsl; j++) {
            if (cols[j] >= n0 + c0 + 16 * nv || cols[j + 1] <= n0 + c0 || cols[j] == cols[j + 1])
                continue;
            for (int64_t r = j * per; r < (j + 1) * per; r++) {
                if (!live[r])
                    continue;
                const int64_t row = bo + r * N + n0 + c0;
                __m512 bv[4];
                for (int c = 0; c < nv; c++)
                    bv[c] = lora_ld16(b, row + 16 * c, mc[c], bw);
                for (int i = 0; i < nb; i++) {
                    const __m512 sv = _mm512_set1_ps(tmp[i * R + r]);
                    for (int c = 0; c < nv; c++)
                        acc[nv * i + c] = _mm512_add_ps(acc[nv * i + c], _mm512_mul_ps(sv, bv[c]));
                }
            }
        }
        for (int i = 0; i < nb; i++) {
            const int64_t o = (int64_t)tok[i] * N + n0 + c0;
            for (int c = 0; c < nv; c++)
                if (mc[c])
                    lora_add16(out, o + 16 * c, mc[c], acc[nv * i + c], bx);
        }
    }
}

AVX512K INLINE void lora_expand512(void *out, const float *tmp, const void *b, int64_t bo, const int32_t *tok,
                                   int64_t m, int64_t N, int64_t R, int64_t n0, int64_t w, int64_t nsl,
                                   const int64_t *cols, int bx, int bw) {
    unsigned char live[LORA_LIVE_MAX]; /* B's rows some token of the block shrank to nonzero */
    for (int64_t i = 0; i < m; i += 4) {
        const int64_t nb = m - i < 4 ? m - i : 4;
        const float *t = tmp + i * R;
        /* Token by token over all rows (vectorized), not row by row over the tokens: this
         * runs for every column tile, and the scalar form cost as much as the FMAs. */
        for (int64_t r = 0; r < R; r++)
            live[r] = 0; /* stays zero: a padded rank row */
        for (int64_t q = 0; q < nb; q++) {
#pragma omp simd
            for (int64_t r = 0; r < R; r++)
                live[r] |= (unsigned char)(t[q * R + r] != 0.0f);
        }
        switch (nb) {
        case 1: lora_expand512_block(out, t, b, bo, tok + i, N, R, n0, w, nsl, cols, live, 1, bx, bw); break;
        case 2: lora_expand512_block(out, t, b, bo, tok + i, N, R, n0, w, nsl, cols, live, 2, bx, bw); break;
        case 3: lora_expand512_block(out, t, b, bo, tok + i, N, R, n0, w, nsl, cols, live, 3, bx, bw); break;
        default: lora_expand512_block(out, t, b, bo, tok + i, N, R, n0, w, nsl, cols, live, 4, bx, bw); break;
        }
    }
}

/* The shrink with AVX-512: a tile of RR (<= 4) rows of A against the nb (<= 4) tokens of a
 * block, RR x nb sums in registers (each loaded row vector of A used nb times, each x
 * vector RR times), then one transposing reduction of the sums (eng_hsum16, whose tree
 * for one sum does not depend on the others). Lanes past K are masked to zero on both
 * sides. tmp[t * R + r] for token t of the block and row r of A. */
AVX512K INLINE void lora_shrink512_store(float *tmp, int64_t R, int64_t r, const __m512 (*acc)[4], const int RR,
                                         const int nb) {
    __m512 v[16];
    for (int i = 0; i < 16; i++)
        v[i] = i < RR * nb ? acc[i / nb][i % nb] : _mm512_setzero_ps();
    float res[16];
    _mm512_storeu_ps(res, eng_hsum16(v));
    for (int i = 0; i < RR; i++)
        for (int t = 0; t < nb; t++)
            tmp[t * R + r + i] = res[i * nb + t];
}

AVX512K INLINE void lora_shrink512_tile(float *tmp, const void *x, const void *a, int64_t ao, const int32_t *tok,
                                        int64_t K, int64_t R, int64_t r, const int RR, const int nb, int bx,
                                        int bw) {
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int t = 0; t < 4; t++)
            acc[i][t] = _mm512_setzero_ps();
    int64_t xo[4];
    for (int t = 0; t < nb; t++)
        xo[t] = (int64_t)tok[t] * K;
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = lora_mask(K - k);
        __m512 xv[4];
        for (int t = 0; t < nb; t++)
            xv[t] = lora_ld16(x, xo[t] + k, m, bx);
        for (int i = 0; i < RR; i++) {
            const __m512 w = lora_ld16(a, ao + (r + i) * K + k, m, bw);
            for (int t = 0; t < nb; t++)  /* products rounded, then added: as the portable loop */
                acc[i][t] = _mm512_add_ps(acc[i][t], _mm512_mul_ps(w, xv[t]));
        }
    }
    lora_shrink512_store(tmp, R, r, (const __m512(*)[4])acc, RR, nb);
}

/* Every (RR, nb) pair as compile-time constants, so the sums stay in registers. */
#define LORA_SHRINK_TILES(TILE, ...)                                                                          \
    switch (RR * 8 + nb) {                                                                                    \
    case 9: TILE(__VA_ARGS__, 1, 1); break;                                                                   \
    case 10: TILE(__VA_ARGS__, 1, 2); break;                                                                  \
    case 11: TILE(__VA_ARGS__, 1, 3); break;                                                                  \
    case 12: TILE(__VA_ARGS__, 1, 4); break;                                                                  \
    case 17: TILE(__VA_ARGS__, 2, 1); break;                                                                  \
    case 18: TILE(__VA_ARGS__, 2, 2); break;                                                                  \
    case 19: TILE(__VA_ARGS__, 2, 3); break;                                                                  \
    case 20: TILE(__VA_ARGS__, 2, 4); break;                                                                  \
    case 25: TILE(__VA_ARGS__, 3, 1); break;                                                                  \
    case 26: TILE(__VA_ARGS__, 3, 2); break;                                                                  \
    case 27: TILE(__VA_ARGS__, 3, 3); break;                                                                  \
    case 28: TILE(__VA_ARGS__, 3, 4); break;                                                                  \
    case 33: TILE(__VA_ARGS__, 4, 1); break;                                                                  \
    case 34: TILE(__VA_ARGS__, 4, 2); break;                                                                  \
    case 35: TILE(__VA_ARGS__, 4, 3); break;                                                                  \
    default: TILE(__VA_ARGS__, 4, 4); break;                                                                  \
    }

#define LORA_SHRINK_F32(tmp, x, a, ao, tok, K, R, r, bx, bw, RR_, NB_)                                       \
    lora_shrink512_tile(tmp, x, a, ao, tok, K, R, r, RR_, NB_, bx, bw)

AVX512K INLINE void lora_shrink512(float *tmp, const void *x, const void *a, int64_t ao, const int32_t *tok,
                                   int64_t m, int64_t K, int64_t R, int64_t r0, int64_t r1, int bx, int bw) {
    for (int64_t i = 0; i < m; i += 4) {
        const int nb = m - i < 4 ? (int)(m - i) : 4;
        for (int64_t r = r0; r < r1; r += 4) {
            const int RR = r1 - r < 4 ? (int)(r1 - r) : 4;
            LORA_SHRINK_TILES(LORA_SHRINK_F32, tmp + i * R, x, a, ao, tok + i, K, R, r, bx, bw)
        }
    }
}

/* bf16 activations and bf16 A with AVX512-BF16: each dot-product instruction multiplies 32
 * pairs exactly and adds them into 16 fp32 lanes (half the instructions of widening
 * both sides to fp32, and no widening). */
#define LORA_BF16DP __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")))
LORA_BF16DP INLINE void lora_shrink512dp_tile(float *tmp, const uint16_t *x, const uint16_t *a, int64_t ao,
                                              const int32_t *tok, int64_t K, int64_t R, int64_t r, const int RR,
                                              const int nb) {
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int t = 0; t < 4; t++)
            acc[i][t] = _mm512_setzero_ps();
    const uint16_t *xr[4];
    for (int t = 0; t < nb; t++)
        xr[t] = x + (int64_t)tok[t] * K;
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 m = K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1);
        __m512i xv[4];
        for (int t = 0; t < nb; t++)
            xv[t] = _mm512_maskz_loadu_epi16(m, xr[t] + k);
        for (int i = 0; i < RR; i++) {
            const __m512i w = _mm512_maskz_loadu_epi16(m, a + ao + (r + i) * K + k);
            for (int t = 0; t < nb; t++)
                acc[i][t] = _mm512_dpbf16_ps(acc[i][t], (__m512bh)w, (__m512bh)xv[t]);
        }
    }
    lora_shrink512_store(tmp, R, r, (const __m512(*)[4])acc, RR, nb);
}

#define LORA_SHRINK_DP(tmp, x, a, ao, tok, K, R, r, RR_, NB_) lora_shrink512dp_tile(tmp, x, a, ao, tok, K, R, r, RR_, NB_)

LORA_BF16DP static void eng_lora_shrink512dp_bb(float *tmp, const void *x, const void *a, int64_t ao,
                                                const int32_t *tok, int64_t m, int64_t K, int64_t R, int64_t r0,
                                                int64_t r1) {
    for (int64_t i = 0; i < m; i += 4) {
        const int nb = m - i < 4 ? (int)(m - i) : 4;
        for (int64_t r = r0; r < r1; r += 4) {
            const int RR = r1 - r < 4 ? (int)(r1 - r) : 4;
            LORA_SHRINK_TILES(LORA_SHRINK_DP, tmp + i * R, (const uint16_t *)x, (const uint16_t *)a, ao, tok + i, K,
                              R, r)
        }
    }
}

/* The expand for bf16 out and bf16 B with AVX512-BF16 dot products: each instruction takes
 * two of B's rows (r, r + 1) over 16 columns, interleaved on the fly into (B[r][n],
 * B[r + 1][n]) pairs, against the token's two shrunk values rounded to bf16 (as vLLM's
 * expand casts them to B's dtype) and broadcast as one pair: two rows a product with no
 * widening of B, against the fp32 path's widen, multiply and add per row. tp[t * R / 2 + j]
 * holds token t's shrunk rows 2j (low half) and 2j + 1 (high half) as bf16. A slice's rows
 * per slice are even (checked by the caller), so a pair never straddles two slices. */
LORA_BF16DP INLINE __m512i lora_pair16(const uint16_t *b, int64_t row, int64_t N, __mmask16 m) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, b + row));
    const __m512i hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, b + row + N));
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

/* 16 lanes of bf16 out (mask m) += v, rounded to nearest even by the BF16 extension's one
 * instruction (as lora_add16; a NaN stays a NaN, its payload quieted rather than 0x7FC0). */
LORA_BF16DP INLINE void lora_add16dp(uint16_t *out, int64_t o, __mmask16 m, __m512 v) {
    const __m512 old = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, out + o)), 16));
    const __m256bh r = _mm512_cvtneps_pbh(_mm512_add_ps(old, v));
    _mm256_mask_storeu_epi16(out + o, m, (__m256i)r);
}

LORA_BF16DP INLINE void lora_expand512dp_block(uint16_t *out, const uint32_t *tp, const uint16_t *b, int64_t bo,
                                               const int32_t *tok, int64_t N, int64_t R, int64_t n0, int64_t w,
                                               int64_t nsl, const int64_t *cols, const unsigned char *live,
                                               const int nb, const int nv, const int pairs) {
    const int64_t per = R / nsl, R2 = R / 2;
    for (int64_t c0 = 0; c0 < w; c0 += 16 * nv) {
        __mmask16 mc[4];
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++)
            mc[c] = lora_mask(w - c0 - 16 * c);
        __m512 acc[16];
#pragma GCC unroll 16
        for (int v = 0; v < 16; v++)
            acc[v] = _mm512_setzero_ps();
        for (int64_t j = 0; j < nsl; j++) {
            if (cols[j] >= n0 + c0 + 16 * nv || cols[j + 1] <= n0 + c0 || cols[j] == cols[j + 1])
                continue;
            for (int64_t r = j * per; r < (j + 1) * per; r += 2) {
                if (!live[r / 2])
                    continue;
                const int64_t row = bo + r * N + n0 + c0;
                __m512i bv[4];
#pragma GCC unroll 4
                for (int c = 0; c < nv; c++)
                    bv[c] = pairs ? _mm512_maskz_loadu_epi32(mc[c], (const uint32_t *)b + (bo + r * N) / 2 + n0 + c0 + 16 * c)
                                  : lora_pair16(b, row + 16 * c, N, mc[c]);
#pragma GCC unroll 8
                for (int i = 0; i < nb; i++) {
                    const __m512i sv = _mm512_set1_epi32((int)tp[i * R2 + r / 2]);
#pragma GCC unroll 4
                    for (int c = 0; c < nv; c++)
                        acc[nv * i + c] = _mm512_dpbf16_ps(acc[nv * i + c], (__m512bh)bv[c], (__m512bh)sv);
                }
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < nb; i++) {
            const int64_t o = (int64_t)tok[i] * N + n0 + c0;
#pragma GCC unroll 4
            for (int c = 0; c < nv; c++)
                if (mc[c])
                    lora_add16dp(out, o + 16 * c, mc[c], acc[nv * i + c]);
        }
    }
}

/* Blocks of 8 tokens x 32 columns (each pair of B's rows used by 8 tokens), the last
 * block's 1-7 tokens x 64 columns (4 x 4) or fewer. ``pairs``: B is held as row pairs
 * ([S, R / 2, N, 2]: B[r][n] at ((r / 2) * N + n) * 2 + r % 2), loaded as they are;
 * otherwise [S, R, N], each two rows interleaved on the fly. */
#define LORA_DP_BLOCKS(P)                                                                                      \
    switch (nb) {                                                                                              \
    case 1: lora_expand512dp_block(o, t, bb, bo, tok + i, N, R, n0, w, nsl, cols, live, 1, 4, P); break;     \
    case 2: lora_expand512dp_block(o, t, bb, bo, tok + i, N, R, n0, w, nsl, cols, live, 2, 4, P); break;     \
    case 3: lora_expand512dp_block(o, t, bb, bo, tok + i, N, R, n0, w, nsl, cols, live, 3, 4, P); break;     \
    case 4: lora_expand512dp_block(o, t, bb, bo, tok + i, N, R, n0, w, nsl, cols, live, 4, 4, P); break;     \
    default: lora_expand512dp_block(o, t, bb, bo, tok + i, N, R, n0, w, nsl, cols, live, 8, 2, P); break;    \
    }

LORA_BF16DP static void eng_lora_expand512dp_bb(void *out, const uint32_t *tp, const void *b, int64_t bo,
                                                const int32_t *tok, int64_t m, int64_t N, int64_t R, int64_t n0,
                                                int64_t w, int64_t nsl, const int64_t *cols, int pairs) {
    unsigned char live[LORA_LIVE_MAX / 2]; /* row pairs some token of the block shrank to nonzero */
    const int64_t R2 = R / 2;
    uint16_t *o = (uint16_t *)out;
    const uint16_t *bb = (const uint16_t *)b;
    for (int64_t i = 0; i < m;) {
        const int64_t nb = m - i >= 8 ? 8 : m - i < 4 ? m - i : 4;
        const uint32_t *t = tp + i * R2;
        for (int64_t r = 0; r < R2; r++) {
            uint32_t any = 0;
            for (int64_t q = 0; q < nb; q++)
                any |= t[q * R2 + r] & 0x7FFF7FFFu;
            live[r] = any != 0;
        }
        if (pairs)
            LORA_DP_BLOCKS(1)
        else
            LORA_DP_BLOCKS(0)
        i += nb;
    }
}

static int lora_has_bf16dp(void) {
    static int state = -1;
    if (state < 0)
        state = attn_avx512() && __builtin_cpu_supports("avx512bf16");
    return state;
}

#define LORA_AVX512(sfx, bx, bw)                                                                               \
    AVX512K static void eng_lora_expand512_##sfx(void *out, const float *tmp, const void *b, int64_t bo,        \
                                                 const int32_t *tok, int64_t m, int64_t N, int64_t R,          \
                                                 int64_t n0, int64_t w, int64_t nsl, const int64_t *cols) {    \
        lora_expand512(out, tmp, b, bo, tok, m, N, R, n0, w, nsl, cols, bx, bw);                               \
    }                                                                                                          \
    AVX512K static void eng_lora_shrink512_##sfx(float *tmp, const void *x, const void *a, int64_t ao,         \
                                                 const int32_t *tok, int64_t m, int64_t K, int64_t R,          \
                                                 int64_t r0, int64_t r1) {                                     \
        lora_shrink512(tmp, x, a, ao, tok, m, K, R, r0, r1, bx, bw);                                           \
    }
LORA_AVX512(ff, 0, 0)
LORA_AVX512(fb, 0, 1)
LORA_AVX512(bf, 1, 0)
LORA_AVX512(bb, 1, 1)
#endif

/* Whether eng_lora_sgmv takes B as row pairs (b_pairs) for bf16 activations and weights:
 * where AVX512-BF16 dot products run. */
int eng_lora_pairs(void) {
#if HAVE_ATTN_AVX512
    return lora_has_bf16dp();
#else
    return 0;
#endif
}

/* Whether the bf16 dot-product expand runs for these dtypes, rank and slices: it takes
 * the shrunk rows as bf16 pairs (lora_team's tp) and, with b_pairs, B as row pairs. */
static int lora_dp(int dtype, int wdtype, int64_t R, int64_t nslices) {
#if HAVE_ATTN_AVX512
    return attn_avx512() && R <= LORA_LIVE_MAX && dtype == DT_BF16 && wdtype == DT_BF16 && lora_has_bf16dp()
           && R % (2 * nslices) == 0;
#else
    (void)dtype, (void)wdtype, (void)R, (void)nslices;
    return 0;
#endif
}

/* The arguments eng_lora_sgmv documents, checked: 0, -1 (not taken) or -2 (out of range). */
static int lora_check(int dtype, int wdtype, int64_t T, int64_t R, int64_t S, const int32_t *order,
                      const int32_t *bounds, const int32_t *gslots, int64_t G, int64_t nslices,
                      const int64_t *slice_cols, int b_pairs) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || (wdtype != DT_F32 && wdtype != DT_BF16) || R < 1
        || nslices < 1 || R % nslices != 0 || slice_cols[0] != 0 || G < 0 || (G > 0 && bounds[0] != 0))
        return -1;
    if (b_pairs && !lora_dp(dtype, wdtype, R, nslices)) /* row pairs are the dot-product expand's layout only */
        return -1;
    for (int64_t j = 0; j < nslices; j++)
        if (slice_cols[j] > slice_cols[j + 1])
            return -1;
    for (int64_t g = 0; g < G; g++)
        if (bounds[g] > bounds[g + 1] || gslots[g] < 0 || gslots[g] >= S)
            return -2;
    const int64_t M = G > 0 ? bounds[G] : 0;
    for (int64_t i = 0; i < M; i++)
        if (order[i] < 0 || order[i] >= T)
            return -2;
    return 0;
}

/* lora_check for other translation units (fused.c). */
int eng_lora_check(int dtype, int wdtype, int64_t T, int64_t R, int64_t S, const int32_t *order,
                   const int32_t *bounds, const int32_t *gslots, int64_t G, int64_t nslices, const int64_t *slice_cols,
                   int b_pairs) {
    return lora_check(dtype, wdtype, T, R, S, order, bounds, gslots, G, nslices, slice_cols, b_pairs);
}

/* eng_lora_sgmv's two phases as worksharing loops: called by every thread of a parallel
 * region (the fused decode step's, or eng_lora_sgmv's own), or by one thread outside any.
 * tmp: M * R floats; tp: M * R / 2 words where lora_dp() holds (else unused). The
 * arguments are lora_check's, already checked. */
void eng_lora_team(int dtype, int wdtype, void *out, const void *x, int64_t K, int64_t N, int64_t R,
                   const void *a, const void *b, const int32_t *order, const int32_t *bounds, const int32_t *gslots,
                   int64_t G, int64_t nslices, const int64_t *slice_cols, int b_pairs, float *tmp, uint32_t *tp) {
    void (*shrink)(float *, const void *, const void *, int64_t, const int32_t *, int64_t, int64_t, int64_t,
                   int64_t, int64_t) =
        dtype == DT_F32 ? (wdtype == DT_F32 ? eng_lora_shrink_ff : eng_lora_shrink_fb)
                        : (wdtype == DT_F32 ? eng_lora_shrink_bf : eng_lora_shrink_bb);
    void (*expand)(void *, const float *, const void *, int64_t, const int32_t *, int64_t, int64_t, int64_t,
                   int64_t, int64_t, int64_t, const int64_t *) =
        dtype == DT_F32 ? (wdtype == DT_F32 ? eng_lora_expand_ff : eng_lora_expand_fb)
                        : (wdtype == DT_F32 ? eng_lora_expand_bf : eng_lora_expand_bb);
    const int dp = lora_dp(dtype, wdtype, R, nslices);
    if (!dp)
        tp = NULL;
#if HAVE_ATTN_AVX512
    if (attn_avx512() && R <= LORA_LIVE_MAX) {
        expand = dtype == DT_F32 ? (wdtype == DT_F32 ? eng_lora_expand512_ff : eng_lora_expand512_fb)
                                 : (wdtype == DT_F32 ? eng_lora_expand512_bf : eng_lora_expand512_bb);
        shrink = dtype == DT_F32 ? (wdtype == DT_F32 ? eng_lora_shrink512_ff : eng_lora_shrink512_fb)
                                 : (wdtype == DT_F32 ? eng_lora_shrink512_bf
                                                     : lora_has_bf16dp() ? eng_lora_shrink512dp_bb
                                                                         : eng_lora_shrink512_bb);
    }
#endif
    const int64_t nrb = (R + LORA_RB - 1) / LORA_RB;
    /* Column tiles: the dot-product expand takes wide ones (a group's rows of B read in long
     * runs, which the prefetchers follow), as many as keep every thread busy. */
    int64_t tile = LORA_TILE;
    if (tp) {
        const int64_t want = (2 * (int64_t)omp_get_num_threads() + G - 1) / (G > 0 ? G : 1);
        tile = ((N + want - 1) / want + 63) / 64 * 64;
        if (tile < LORA_TILE)
            tile = LORA_TILE;
    }
    const int64_t ntile = (N + tile - 1) / tile;
    /* dynamic: groups differ in size (a prefill's hundreds of tokens beside decodes' one). */
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < G * nrb; it++) {
        const int64_t g = it / nrb, r0 = it % nrb * LORA_RB, r1 = r0 + LORA_RB < R ? r0 + LORA_RB : R;
        const int64_t s = bounds[g], e = bounds[g + 1];
        if (e <= s)
            continue;
        shrink(tmp + s * R, x, a, (int64_t)gslots[g] * R * K, order + s, e - s, K, R, r0, r1);
        if (tp) /* the item's rows as bf16 pairs too (r0 and R are even): no pass of its own */
            for (int64_t i = s; i < e; i++)
                for (int64_t r = r0; r < r1; r += 2)
                    tp[(i * R + r) / 2] = (uint32_t)f32_to_bf16(tmp[i * R + r])
                                          | (uint32_t)f32_to_bf16(tmp[i * R + r + 1]) << 16;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < G * ntile; it++) {
        const int64_t g = it / ntile, n0 = it % ntile * tile;
        const int64_t w = N - n0 < tile ? N - n0 : tile;
        const int64_t s = bounds[g], e = bounds[g + 1];
        if (e <= s)
            continue;
#if HAVE_ATTN_AVX512
        if (tp) {
            eng_lora_expand512dp_bb(out, tp + s * R / 2, b, (int64_t)gslots[g] * R * N, order + s, e - s, N, R, n0,
                                    w, nslices, slice_cols, b_pairs);
            continue;
        }
#endif
        expand(out, tmp + s * R, b, (int64_t)gslots[g] * R * N, order + s, e - s, N, R, n0, w, nslices, slice_cols);
    }
}

/* out[t] += (A[s] @ x[t]) @ Bt[s] for every token t = order[i] of group g (i in
 * bounds[g] .. bounds[g + 1], s = gslots[g]); tokens in no group (the base model's) are
 * left as they are. x [T, K] and out [T, N] contiguous, A [S, R, K] and Bt [S, R, N]
 * contiguous. A fused projection's Bt is block diagonal: its R rows in nslices equal
 * groups, group j nonzero only in columns slice_cols[j] .. slice_cols[j + 1] (nslices 1,
 * bounds {0, N}: no such structure). b_pairs: Bt is held as row pairs ([S, R / 2, N, 2],
 * for bf16 on both sides where eng_lora_pairs() says the dot-product expand runs; -1
 * otherwise). Returns -1 for a dtype, rank or bounds it does not
 * take (or no memory for the shrunk rows), -2 for a slot outside [0, S) or a token
 * outside [0, T). */
int eng_lora_sgmv(int dtype, int wdtype, void *out, const void *x, int64_t T, int64_t K, int64_t N, int64_t R,
                  int64_t S, const void *a, const void *b, const int32_t *order, const int32_t *bounds,
                  const int32_t *gslots, int64_t G, int64_t nslices, const int64_t *slice_cols, int b_pairs,
                  int nthreads) {
    const int rc = lora_check(dtype, wdtype, T, R, S, order, bounds, gslots, G, nslices, slice_cols, b_pairs);
    if (rc || slice_cols[nslices] != N)
        return rc ? rc : -1;
    const int64_t M = G > 0 ? bounds[G] : 0;
    if (M == 0)
        return 0;
    float *tmp = malloc((size_t)(M * R) * sizeof(float)); /* shrunk rows, in order's order */
    uint32_t *tp = lora_dp(dtype, wdtype, R, nslices) ? malloc((size_t)(M * R / 2) * sizeof(uint32_t)) : NULL;
    if (!tmp || (lora_dp(dtype, wdtype, R, nslices) && !tp)) {
        free(tmp), free(tp);
        return -1;
    }
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && M * R * (K + N) >= PARALLEL_MIN_WORK)
    eng_lora_team(dtype, wdtype, out, x, K, N, R, a, b, order, bounds, gslots, G, nslices, slice_cols, b_pairs, tmp,
                  tp);
    free(tp);
    free(tmp);
    return 0;
}
