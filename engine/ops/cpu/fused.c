/*
 * The fused CPU decode step: every decoder layer of a Llama-family or Gemma model over
 * quantized weights (quant.c's panels) or dense ones (quant.c's small-batch dense kernel),
 * for a few query rows, in one C call (a mixture-of-experts layer's MLP runs outside it:
 * see EngFusedState). Each row is attended as
 * a decode row: its own block table row and sequence length (fused.py gives the rows of a
 * speculative verification chunk their request's table and a length ending at their own
 * position). Every row's K/V is written, in the loop before attention's, before any row
 * attends, so a chunk's rows see the rows before them.
 *
 * The unfused path (engine/models/llama.py over CpuOps) makes ~15 Python-level calls per
 * layer, each allocating its output tensor, and every C kernel opens and joins its own
 * OpenMP parallel region. Here one parallel region runs the whole step: the threads share
 * each phase out with a worksharing loop (per token, per (token, KV head), per weight
 * panel) and meet at the loop's barrier, and every intermediate lives in scratch buffers
 * the Python side allocated once (EngFusedModel). The phases are the same kernels the
 * unfused path calls (kernels.c's RMSNorm, RoPE, KV write, paged attention, SiLU-and-mul;
 * quant.c's matmul micro-kernels), in the same order with the same roundings, so the
 * fused step's result equals the unfused one's (tests/test_fused_decode.py).
 *
 * Per layer: RMSNorm (after the residual add) -> quantize -> q/k/v matmul -> bias,
 * per-head q/k RMSNorm (Qwen3), RoPE, KV write -> paged attention -> quantize -> o_proj
 * -> residual add + RMSNorm -> quantize -> gate/up matmul -> SiLU-and-mul -> quantize ->
 * down matmul. The residual stream alternates between two buffers (no copies). With LoRA
 * adapters in the step (EngFusedModel's lora_* fields), each targeted projection's delta is
 * added right after it by kernels.c's eng_lora_team, as LoraLinear adds it unfused.
 *
 * Gemma (m->gemma): the same phases with Gemma's layer around them. Its norms are
 * x / rms(x) * (1 + w) in fp32 (kernels.c's gemma_norm_row), four a layer in Gemma 2/3:
 * the attention and MLP outputs are normed before they are added to the residual stream,
 * which stays in `hidden` (Gemma 1 has no such post-norms: NULL, a plain add); the MLP is
 * GeGLU (gelu-tanh-and-mul); Gemma 2 soft-caps attention scores. OLMo 2/3 run in this mode
 * too: the weights as stored multiply in fp32 as Gemma's 1 + w do, its blocks read the
 * stream unnormed (input and pre-FFN norms NULL: a copy), its MLP is SwiGLU (m->gelu 0)
 * and its q/k norms span all the heads (m->qk_norm_full).
 * The caller scales the embeddings by sqrt(hidden) and soft-caps the logits.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "fused.h"

/* kernels.c (the same extension) */
void eng_rms_norm_row_f32(void *, void *, int64_t, const void *, int64_t, const void *, int64_t, int64_t, float);
void eng_rms_norm_row_bf16(void *, void *, int64_t, const void *, int64_t, const void *, int64_t, int64_t, float);
void eng_rope_token_f32(void *, int64_t, int64_t, int64_t, int64_t, const int64_t *, const void *, int64_t);
void eng_scale_row_f32(void *, int64_t, float);
void eng_scale_row_bf16(void *, int64_t, float);
void eng_rope_token_bf16(void *, int64_t, int64_t, int64_t, int64_t, const int64_t *, const void *, int64_t);
void eng_silu_mul_row_f32(void *, const void *, int64_t, int64_t, int64_t, int64_t);
void eng_silu_mul_row_bf16(void *, const void *, int64_t, int64_t, int64_t, int64_t);
void eng_gelu_tanh_mul_row_f32(void *, const void *, int64_t, int64_t, int64_t, int64_t);
void eng_gelu_tanh_mul_row_bf16(void *, const void *, int64_t, int64_t, int64_t, int64_t);
void eng_gemma_norm_row_f32(void *, const void *, int64_t, const float *, float);
void eng_gemma_norm_row_bf16(void *, const void *, int64_t, const float *, float);
void eng_gemma_add_norm_row_f32(void *, const void *, const float *, void *, const float *, int64_t, float);
void eng_gemma_add_norm_row_bf16(void *, const void *, const float *, void *, const float *, int64_t, float);
void eng_kv_write_i8_token(int, const void *, int64_t, int64_t, int64_t, int8_t *, float *, int64_t);
int64_t eng_decode_split(int64_t, int64_t, int);
int eng_lora_check(int, int, int64_t, int64_t, int64_t, const int32_t *, const int32_t *, const int32_t *, int64_t,
                   int64_t, const int64_t *, int);
void eng_lora_team(int, int, void *, const void *, int64_t, int64_t, int64_t, const void *, const void *,
                   const int32_t *, const int32_t *, const int32_t *, int64_t, int64_t, const int64_t *, int, float *,
                   uint32_t *);
/* One (row, KV head) attention item over query heads j0 .. j0 + nj - 1 of the group. */
typedef void eng_decode_item_t(void *out, const void *q, int64_t qs, const void *kc, const void *vc,
                               const float *ksc, const float *vsc, const int32_t *bt, int64_t bts,
                               const int32_t *lens, int64_t b, int64_t g, int64_t j0, int64_t nj, int64_t heads,
                               int64_t kv_heads, int64_t d, int64_t bs, float scale, int64_t window, float softcap,
                               const float *sinks);
eng_decode_item_t eng_decode_item_f32, eng_decode_item_bf16, eng_decode_item_f32_q8, eng_decode_item_bf16_q8;

/* Built with -DENG_FUSED_PROFILE (CFLAGS=-DENG_FUSED_PROFILE setup.py build_ext), the step
 * times its phases on thread 0 (each ends at its loop's barrier) and prints their mean per
 * step, summed over the layers, at exit: the profile docs/benchmarks.md quotes. */
#ifdef ENG_FUSED_PROFILE
#include <stdio.h>
static const char *const prof_names[] = {"norm+quantize", "qkv matmul", "rope, kv write", "attention",
                                         "quantize", "o matmul", "norm+quantize", "gate/up matmul",
                                         "silu+quantize", "down matmul", "final norm"};
static double prof_sum[11];
static long prof_steps;
#define PROF_START double prof_t = omp_get_wtime(); if (omp_get_thread_num() == 0) prof_steps++
#define PROF(i) do { if (omp_get_thread_num() == 0) { double n_ = omp_get_wtime(); prof_sum[i] += n_ - prof_t; prof_t = n_; } } while (0)
__attribute__((destructor)) static void prof_print(void) {
    for (int i = 0; prof_steps && i < 11; i++)
        fprintf(stderr, "fused step %-15s %8.1f us\n", prof_names[i], prof_sum[i] / prof_steps * 1e6);
}
#else
#define PROF_START
#define PROF(i)
#endif

#define ROW(p, i, n, es) ((void *)((char *)(p) + (size_t)((i) * (n)) * (size_t)(es)))

static void norm_row(int bf, void *out, void *x, int64_t n, const void *res, const void *w, int64_t t, float eps) {
    if (bf)
        eng_rms_norm_row_bf16(out, x, n, res, n, w, t, n, eps);
    else
        eng_rms_norm_row_f32(out, x, n, res, n, w, t, n, eps);
}

/* Row t of a block's output d times the model's residual_scale (Granite's residual_multiplier),
 * rounded to the dtype as transformers' `hidden * multiplier`; nothing at 1. */
static void scale_block_row(const EngFusedModel *m, void *d, int64_t t, int64_t n) {
    if (m->residual_scale == 1.0f)
        return;
    char *row = (char *)d + (size_t)(t * n) * (m->dtype == 1 ? 2 : 4);
    if (m->dtype == 1)
        eng_scale_row_bf16(row, n, m->residual_scale);
    else
        eng_scale_row_f32(row, n, m->residual_scale);
}

/* Gemma: with d, r += norm(d) * w_post; then out = norm(r) * w_next (row t of each). */
static void gemma_add_norm(int bf, void *r, const void *d, const void *w_post, void *out, const void *w_next,
                           int64_t t, int64_t n, float eps) {
    const int es = bf ? 2 : 4;
    void *rt = ROW(r, t, n, es), *ot = ROW(out, t, n, es);
    const void *dt = d ? ROW(d, t, n, es) : NULL;
    if (bf)
        eng_gemma_add_norm_row_bf16(rt, dt, (const float *)w_post, ot, (const float *)w_next, n, eps);
    else
        eng_gemma_add_norm_row_f32(rt, dt, (const float *)w_post, ot, (const float *)w_next, n, eps);
}

/* OLMo's q or k norm in place: over all `n` values of the row's heads, Gemma's arithmetic
 * (the fp32 weight as stored). */
static void full_norm(const EngFusedModel *m, void *x, int64_t n, const void *w) {
    if (m->dtype == 1)
        eng_gemma_norm_row_bf16(x, x, n, (const float *)w, m->eps);
    else
        eng_gemma_norm_row_f32(x, x, n, (const float *)w, m->eps);
}

/* A per-head q or k norm in place: Llama's (Qwen3) or Gemma's (Gemma 3). */
static void head_norm(const EngFusedModel *m, void *x, const void *w) {
    const int64_t d = m->head_dim;
    if (!m->gemma)
        norm_row(m->dtype == 1, x, x, d, NULL, w, 0, m->eps);
    else if (m->dtype == 1)
        eng_gemma_norm_row_bf16(x, x, d, (const float *)w, m->eps);
    else
        eng_gemma_norm_row_f32(x, x, d, (const float *)w, m->eps);
}

/* out = src @ W.T: from src itself over dense weights (with the bias, rounded once, as
 * Linear), else from its quantized copy (xq, dx, xs). */
static void linear(const EngFusedModel *m, const EngQLinear *l, const void *src, void *out, int64_t T) {
    if (l->dense)
        eng_dense_team_matmul(l->dense, l->bias, l->K, l->N, m->dtype, src, out, l->N, T);
    else
        eng_q_team_matmul(l->parts, l->nparts, l->K, m->dtype, out, l->N, m->xq, m->dx, m->xs, T);
}

/* out [T, N] += this step's LoRA deltas of projection p over src [T, K] (kernels.c's
 * eng_lora_team, its phases shared out like the step's), after the base matmul and its
 * bias, as LoraLinear adds them. Every thread of the region calls it. */
static void lora(const EngFusedModel *m, const EngLoraProj *p, const void *src, void *out, int64_t K, int64_t N) {
    if (!m->lora_groups || !p->a)
        return;
    eng_lora_team(m->dtype, p->wdtype, out, src, K, N, p->R, p->a, p->b, m->lora_order, m->lora_bounds,
                  m->lora_slots, m->lora_groups, p->nslices, p->cols, p->pairs, m->lora_tmp, m->lora_tp);
}

/* row[i] += bias[i] for i in [i0, i1), in the activation dtype (bf16 rounded to nearest
 * even, as torch's add). */
static void add_bias(int bf, char *row, const void *bias, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
        if (bf) {
            uint16_t *o = (uint16_t *)row;
            const uint16_t *b = (const uint16_t *)bias;
            uint32_t ua = (uint32_t)o[i] << 16, ub = (uint32_t)b[i] << 16, us;
            float fa, fb;
            memcpy(&fa, &ua, 4), memcpy(&fb, &ub, 4);
            float sum = fa + fb;
            memcpy(&us, &sum, 4);
            o[i] = sum != sum ? (uint16_t)0x7FC0 : (uint16_t)((us + 0x7FFFu + ((us >> 16) & 1u)) >> 16);
        } else {
            ((float *)row)[i] += ((const float *)bias)[i];
        }
    }
}

/* The step's LoRA groups against one projection's slots: 0 where they fit, else
 * eng_lora_check's code (-2: a slot or token out of range). */
static int lora_ok(const EngFusedModel *m, const EngLoraProj *p, int64_t T, int64_t N) {
    if (!p->a)
        return 0;
    if (p->R > m->lora_max_rank || p->cols[p->nslices] != N)
        return -1;
    return eng_lora_check(m->dtype, p->wdtype, T, p->R, p->S, m->lora_order, m->lora_bounds, m->lora_slots,
                          m->lora_groups, p->nslices, p->cols, p->pairs);
}

/* Quantize row t of x [T, K] for the next matmul (the buffers hold one row per token). */
static void quantize(const EngFusedModel *m, const void *x, int64_t K, int64_t t, int es) {
    if (m->quantized)
        eng_q_quantize_row(ROW(x, t, K, es), m->dtype == 1, K, m->xq + t * K, m->dx + t * (K / 32), m->xs + t * (K / 16));
}

/* Columns [32 b0, 32 b1) of that row (32-column blocks are quantized independently). */
static void quantize_part(const EngFusedModel *m, const void *x, int64_t K, int64_t t, int es, int64_t b0,
                          int64_t b1) {
    if (m->quantized)
        eng_q_quantize_row((char *)x + (size_t)(t * K + 32 * b0) * es, m->dtype == 1, 32 * (b1 - b0),
                       m->xq + t * K + 32 * b0, m->dx + t * (K / 32) + b0, m->xs + t * (K / 16) + 2 * b0);
}

/* Runs layers st->layer .. on: returns 0 with `out` [T, hidden] holding the final normed
 * hidden states, 1 where it stopped before a layer's external MLP (EngFusedState says
 * how to go on), -1 for arguments the step does not take, -2 for a position, slot,
 * sequence length or block id out of range (nothing is written then). On the first call
 * st->R holds the token embeddings; both of st's buffers are scratch. */
int eng_fused_decode(const EngFusedModel *m, EngFusedState *st, int64_t T, void *out, const int64_t *positions,
                     const int64_t *slots, const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                     int nthreads) {
    if (T < 1 || T > m->max_tokens || (m->dtype != 0 && m->dtype != 1) || st->layer < 0
        || st->layer > m->n_layers) /* n_layers: only the final norm is left (the last layer's MLP was external) */
        return -1;
    const int64_t num_slots = m->num_blocks * m->block_size;
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0 || slots[t] >= num_slots || positions[t] < 0)
            return -2;
        for (int64_t l = 0; l < m->n_layers; l++)
            if (positions[t] >= (m->rope_step ? m->rope_step_rows : m->layers[l].max_pos))
                return -2;
        const int64_t len = seq_lens[t], used = (len + m->block_size - 1) / m->block_size;
        if (len < 1 || used > bt_stride)
            return -2;
        for (int64_t i = 0; i < used; i++)
            if (block_tables[t * bt_stride + i] < 0 || block_tables[t * bt_stride + i] >= m->num_blocks)
                return -2;
    }
    const int bf = m->dtype == 1, es = bf ? 2 : 4;
    const int64_t H = m->hidden, h = m->heads, hkv = m->kv_heads, d = m->head_dim, I = m->inter;
    const int64_t HD = h * d;
    if (m->lora_groups) { /* every projection's slots against the step's groups, before anything is written */
        if (m->lora_groups < 0 || !m->lora_tmp || !m->lora_tp)
            return -1;
        if (m->lora_bounds[m->lora_groups] > T) /* more adapter rows than the step's: the scratch holds T */
            return -2;
        for (int64_t l = st->layer; l < m->n_layers; l++) {
            const EngFusedLayer *L = m->layers + l;
            const int rc[4] = {lora_ok(m, &L->lora_qkv, T, L->qkv.N), lora_ok(m, &L->lora_o, T, H),
                               L->external_mlp ? 0 : lora_ok(m, &L->lora_gate_up, T, 2 * I),
                               L->external_mlp ? 0 : lora_ok(m, &L->lora_down, T, H)};
            for (int i = 0; i < 4; i++)
                if (rc[i])
                    return rc[i];
        }
    }
    eng_decode_item_t *item = bf ? (m->kv_int8 ? eng_decode_item_bf16_q8 : eng_decode_item_bf16)
                                 : (m->kv_int8 ? eng_decode_item_f32_q8 : eng_decode_item_f32);
    const int64_t group = h / hkv, split = eng_decode_split(T * hkv, group, nthreads), nj = group / split;
    const int64_t l0 = st->layer;
    int64_t stop = -1; /* the layer whose external MLP ends this call */
#pragma omp parallel num_threads(nthreads)
    {
        /* Rows per thread below one: RoPE and the cache write split q from k/v, and the
         * SiLU-and-mul and its quantization share each row out in slices of whole 32-column
         * blocks. */
        const int64_t S = T < omp_get_num_threads() ? omp_get_num_threads() : 1;
        void *R = st->R, *D = st->D; /* the residual stream, and the block output added to it */
        PROF_START;
        for (int64_t li = l0; li < m->n_layers; li++) {
            const EngFusedLayer *L = m->layers + li;
            const int64_t NQ = L->qkv.N;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                if (m->gemma) /* R += norm(D) (the last layer's MLP out); x = norm(R) */
                    gemma_add_norm(bf, R, li ? D : NULL, li ? L[-1].post_ffn_norm : NULL, m->x, L->input_norm, t,
                                   H, m->eps);
                else if (li == 0)
                    norm_row(bf, m->x, R, H, NULL, L->input_norm, t, m->eps);
                else {
                    scale_block_row(m, D, t, H);
                    norm_row(bf, m->x, D, H, R, L->input_norm, t, m->eps); /* D += R */
                }
                quantize(m, m->x, H, t, es);
            }
            PROF(0);
            if (li > 0 && !m->gemma) {
                void *s = R;
                R = D, D = s;
            }
            linear(m, &L->qkv, m->x, m->qkv, T);
            /* With an adapter on q/k/v its delta goes on after a quantized matmul's bias, as
             * LoraLinear adds it to QuantLinear's output: the bias first, here. */
            const int lora_qkv = m->lora_groups && L->lora_qkv.a;
            if (lora_qkv && L->qkv.bias && !L->qkv.dense) {
#pragma omp for schedule(static)
                for (int64_t t = 0; t < T; t++)
                    add_bias(bf, (char *)m->qkv + (size_t)(t * NQ) * es, L->qkv.bias, 0, NQ);
            }
            if (lora_qkv)
                lora(m, &L->lora_qkv, m->x, m->qkv, H, NQ);
            PROF(1);
            /* One stream: q (part 0) and k/v with the cache write (part 1) on two threads. */
#pragma omp for schedule(static)
            for (int64_t it = 0; it < T * S; it++) {
                const int64_t t = it / S;
                const int do_q = S == 1 || it % S == 0, do_kv = S == 1 || it % S == 1;
                if (!do_q && !do_kv)
                    continue;
                char *row = (char *)m->qkv + (size_t)(t * NQ) * es;
                if (L->qkv.bias && !L->qkv.dense && !lora_qkv) /* a dense matmul added it */
                    add_bias(bf, row, L->qkv.bias, do_q ? 0 : HD, do_kv ? NQ : HD);
                if (L->q_norm && m->qk_norm_full) { /* OLMo: q across its heads, k across its own */
                    if (do_q)
                        full_norm(m, row, h * d, L->q_norm);
                    if (do_kv)
                        full_norm(m, row + HD * es, hkv * d, L->k_norm);
                } else if (L->q_norm) {
                    for (int64_t j = 0; do_q && j < h; j++)
                        head_norm(m, row + j * d * es, L->q_norm);
                    for (int64_t j = 0; do_kv && j < hkv; j++)
                        head_norm(m, row + (HD + j * d) * es, L->k_norm);
                }
                /* q and k are adjacent: their heads are rotated in one pass where one thread
                 * has both, else each part its own (each head is rotated on its own) */
                void *first = do_q ? m->qkv : (char *)m->qkv + HD * es;
                const int64_t heads = (do_q ? h : 0) + (do_kv ? hkv : 0);
                if (!L->rope) /* a NoPE layer (SmolLM3): q and k as projected */
                    ;
                else if (bf)
                    eng_rope_token_bf16(first, NQ, heads, d, m->rope_step ? d : L->rope_dim, positions,
                                        m->rope_step ? m->rope_step : L->rope, t);
                else
                    eng_rope_token_f32(first, NQ, heads, d, m->rope_step ? d : L->rope_dim, positions,
                                       m->rope_step ? m->rope_step : L->rope, t);
                if (!do_kv)
                    continue;
                const int64_t slot = slots[t];
                if (m->kv_int8) {
                    eng_kv_write_i8_token(m->dtype, m->qkv, t * NQ + HD, hkv, d, (int8_t *)L->k_cache, L->k_scale,
                                          slot);
                    eng_kv_write_i8_token(m->dtype, m->qkv, t * NQ + HD + hkv * d, hkv, d, (int8_t *)L->v_cache,
                                          L->v_scale, slot);
                } else {
                    const size_t n = (size_t)(hkv * d) * es;
                    memcpy((char *)L->k_cache + slot * n, row + HD * es, n);
                    memcpy((char *)L->v_cache + slot * n, row + (HD + hkv * d) * es, n);
                }
            }
            PROF(2);
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < T * hkv * split; it++) {
                const int64_t t = it / (hkv * split), g = it / split % hkv, j0 = it % split * nj;
                item(m->attn, m->qkv, NQ, L->k_cache, L->v_cache, L->k_scale, L->v_scale, block_tables, bt_stride,
                     seq_lens, t, g, j0, nj, h, hkv, d, m->block_size, m->scale, L->window, m->softcap, L->sinks);
                if (d % 32 == 0) /* the item's heads are whole 32-column blocks: quantized here */
                    quantize_part(m, m->attn, HD, t, es, (g * group + j0) * d / 32, (g * group + j0 + nj) * d / 32);
            }
            PROF(3);
            if (d % 32) {
#pragma omp for schedule(static)
                for (int64_t it = 0; it < T * S; it++)
                    quantize_part(m, m->attn, HD, it / S, es, HD / 32 * (it % S) / S, HD / 32 * (it % S + 1) / S);
            }
            PROF(4);
            linear(m, &L->o, m->attn, D, T);
            lora(m, &L->lora_o, m->attn, D, HD, H);
            PROF(5);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                if (m->gemma) /* R += norm(D); x = norm(R) */
                    gemma_add_norm(bf, R, D, L->post_norm, m->x, L->pre_ffn_norm, t, H, m->eps);
                else {
                    scale_block_row(m, D, t, H);
                    norm_row(bf, m->x, D, H, R, L->post_norm, t, m->eps); /* D += R */
                }
                quantize(m, m->x, H, t, es);
            }
            PROF(6);
            if (!m->gemma) {
                void *s = R;
                R = D, D = s;
            }
            if (L->external_mlp) { /* every thread leaves here: the same test on shared data */
#pragma omp single
                st->R = R, st->D = D, stop = li;
                break;
            }
            linear(m, &L->gate_up, m->x, m->gate_up, T);
            lora(m, &L->lora_gate_up, m->x, m->gate_up, H, 2 * I);
            PROF(7);
#pragma omp for schedule(static)
            for (int64_t it = 0; it < T * S; it++) {
                const int64_t t = it / S, b0 = I / 32 * (it % S) / S, b1 = I / 32 * (it % S + 1) / S;
                if (m->gelu && bf)
                    eng_gelu_tanh_mul_row_bf16(m->act, m->gate_up, t, I, 32 * b0, 32 * b1);
                else if (m->gelu)
                    eng_gelu_tanh_mul_row_f32(m->act, m->gate_up, t, I, 32 * b0, 32 * b1);
                else if (bf)
                    eng_silu_mul_row_bf16(m->act, m->gate_up, t, I, 32 * b0, 32 * b1);
                else
                    eng_silu_mul_row_f32(m->act, m->gate_up, t, I, 32 * b0, 32 * b1);
                quantize_part(m, m->act, I, t, es, b0, b1);
            }
            PROF(8);
            linear(m, &L->down, m->act, D, T);
            lora(m, &L->lora_down, m->act, D, I, H);
            PROF(9);
        }
        if (stop < 0) {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (m->gemma)
                gemma_add_norm(bf, R, D, m->layers[m->n_layers - 1].post_ffn_norm, out, m->final_norm, t, H,
                               m->eps);
            else {
                scale_block_row(m, D, t, H);
                norm_row(bf, out, D, H, R, m->final_norm, t, m->eps);
            }
        }
        }
        PROF(10);
    }
    if (stop >= 0) {
        st->layer = stop;
        return 1;
    }
    return 0;
}
