/* The fused decode step's descriptors (fused.c), shared with quant.c and the cffi cdef
 * (engine/ops/cpu/_build.py reads this file: keep it to declarations cffi can parse). */
#ifndef ENG_FUSED_H
#define ENG_FUSED_H
#include <stdint.h>

#define ENG_MAX_PARTS 3

/* One weight of a projection in its panels (quant.c's fields), writing output columns
 * [col, col + N). */
typedef struct {
    int fmt;
    int64_t N, col;
    const uint8_t *codes, *hi;
    const uint16_t *d, *m;
    const uint8_t *sc, *mn;
} EngQPart;

/* y = x @ W.T (+ bias): W the parts side by side (out features N), K input features; or,
 * with `dense`, W [N, K] dense in the activation dtype (no parts). */
typedef struct {
    int nparts;
    int64_t K, N;
    EngQPart parts[ENG_MAX_PARTS];
    const void *bias;  /* [N] in the activation dtype, or NULL */
    const void *dense; /* NULL for quantized parts */
} EngQLinear;

/* One projection's LoRA adapter slots (engine/models/layers/lora.py's pools): A [S, R, K]
 * and B transposed [S, R, N] (or as row pairs [S, R / 2, N, 2], pairs = 1), R the slices'
 * padded ranks side by side, B block diagonal over the nslices column bounds `cols`. wdtype
 * as the activations' codes (0 fp32, 1 bf16). a NULL: the projection has no slots. */
typedef struct {
    const void *a, *b;
    int64_t R, S, nslices;
    const int64_t *cols;
    int wdtype, pairs;
} EngLoraProj;

typedef struct {
    /* Llama: input_norm before attention, post_norm before the MLP, in the activation dtype.
     * Gemma: input_norm and post_norm around attention, pre_ffn_norm and post_ffn_norm
     * around the MLP, each 1 + w in fp32 (q_norm and k_norm too); Gemma 1 has no post_norm
     * nor post_ffn_norm (NULL). */
    const void *input_norm, *post_norm, *q_norm, *k_norm; /* q_norm, k_norm: NULL unless qk-norm */
    const void *pre_ffn_norm, *post_ffn_norm;             /* Gemma only */
    int external_mlp; /* a mixture-of-experts MLP: the step stops before it (see EngFusedState) */
    EngQLinear qkv, o, gate_up, down;
    void *k_cache, *v_cache;   /* [num_blocks, block_size, kv_heads, d]: activation dtype or int8 */
    float *k_scale, *v_scale;  /* int8 cache: [num_blocks, block_size, kv_heads]; else NULL */
    const void *rope;          /* [max_pos, rope_dim] cos | sin in the activation dtype; NULL: no RoPE (NoPE layer) */
    int64_t rope_dim;          /* the rotated share of each head: d, or less (partial rotary) */
    int64_t max_pos, window;
    const float *sinks;        /* [heads] attention sinks (gpt-oss), fp32; NULL: none */
    EngLoraProj lora_qkv, lora_o, lora_gate_up, lora_down; /* a NULL where LoRA is not enabled */
} EngFusedLayer;

typedef struct {
    int dtype;    /* 0 fp32, 1 bf16 (activations, norms, biases, RoPE tables) */
    int kv_int8;  /* the caches hold int8 codes with fp32 scales */
    int gemma;    /* Gemma's layer: fp32 "1 + w" norms (four a layer, or Gemma 1's two), a soft-cap; OLMo's */
    int gelu;     /* the MLP is GeGLU (Gemma), else SwiGLU */
    int qk_norm_full; /* q_norm / k_norm span all of q's / k's heads (OLMo), else one head each */
    int quantized; /* some projection has quantized parts (its inputs are quantized for it) */
    float softcap; /* attention score soft-cap (Gemma 2), 0 for none */
    float residual_scale; /* a block's output times this before it joins the stream (Granite); 1: none */
    int64_t n_layers, hidden, heads, kv_heads, head_dim, inter, num_blocks, block_size, max_tokens;
    float eps, scale;
    const EngFusedLayer *layers;
    /* Set per call, or NULL: one cos | sin table [rope_step_rows, d] every layer reads
     * instead of its own (Qwen-VL's M-RoPE: a row per token of the step). */
    const void *rope_step;
    int64_t rope_step_rows;
    const void *final_norm;
    /* Set per call: the step's LoRA groups (LoraSegments' order, group bounds and slots,
     * lora_groups 0 for none), and scratch for the shrunk rows (max_tokens * lora_max_rank
     * floats, and as many bf16 halves). A slot must be below every pool's S. */
    const int32_t *lora_order, *lora_bounds, *lora_slots;
    int64_t lora_groups, lora_max_rank;
    float *lora_tmp;
    uint32_t *lora_tp;
    /* scratch, in the activation dtype unless said: each sized for max_tokens rows */
    void *delta, *x, *qkv, *attn, *gate_up, *act; /* [T, hidden], [T, hidden], [T, qkv.N], [T, H*d], [T, 2I], [T, I] */
    int8_t *xq;   /* [T, max K] */
    float *dx, *xs; /* [T, max K / 32], [T, max K / 16] */
} EngFusedModel;

/* Where a step stands: the residual stream R and the block output D buffers (each
 * [T, hidden], in the activation dtype), and the layer to start from. A step that reaches
 * a layer with an external MLP stops after that layer's post-attention norm (its MLP
 * input in EngFusedModel.x) with `layer` set to it; the caller writes the MLP's output to
 * D, sets `layer` to the next one and calls again. */
typedef struct {
    void *R, *D;
    int64_t layer;
} EngFusedState;

void eng_q_quantize_row(const void *x, int bf, int64_t K, int8_t *xq, float *dx, float *xs);
void eng_dense_team_matmul(const void *w, const void *bias, int64_t K, int64_t N, int dtype, const void *x,
                           void *out, int64_t out_stride, int64_t M);
void eng_q_team_matmul(const EngQPart *parts, int nparts, int64_t K, int dtype, void *out, int64_t out_stride,
                       int8_t *xq, float *dx, float *xs, int64_t M);
#endif
