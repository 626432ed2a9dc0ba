"""cffi build script of the CPU kernels (``engine.ops.cpu._kernels``); setup.py runs it.

Kept free of engine imports: it runs inside pip's isolated build environment.
"""

from __future__ import annotations

from pathlib import Path

import cffi

HERE = Path(__file__).resolve().parent

CDEF = """
int eng_rms_norm(int dtype, void *out, void *x, int64_t x_stride, const void *res,
                 int64_t res_stride, const void *w, int64_t rows, int64_t n, float eps,
                 int nthreads);
int eng_rope(int dtype, void *x, int64_t token_stride, int64_t heads, int64_t d, int64_t rd,
             const int64_t *positions, int64_t tokens, const void *cos_sin, int64_t max_pos,
             int nthreads);
int eng_silu_mul(int dtype, void *out, const void *x, int64_t rows, int64_t n, int nthreads);
int eng_gemma_norm(int dtype, void *out, const void *x, int64_t x_stride, const float *w, int64_t rows,
                   int64_t n, float eps, int nthreads);
int eng_gelu_tanh_mul(int dtype, void *out, const void *x, int64_t rows, int64_t n, int nthreads);
int eng_paged_decode(int dtype, void *out, const void *q, int64_t q_stride,
                     const void *k_cache, const void *v_cache, int kv_dtype,
                     const float *k_scale, const float *v_scale, int64_t num_blocks,
                     const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, int64_t batch, int64_t heads,
                     int64_t kv_heads, int64_t d, int64_t block_size, float scale,
                     int64_t window, float softcap, const float *sinks, int nthreads);
int eng_kv_write_i8(int dtype, const void *x, int64_t x_stride, int64_t tokens, int64_t heads,
                    int64_t d, int8_t *codes, float *scales, const int64_t *slots,
                    int64_t num_slots, int nthreads);
int eng_apply_bitmask(float *logits, int64_t stride, int64_t batch, int64_t vocab,
                      const int32_t *mask, int64_t words, const int64_t *rows, int64_t n,
                      int nthreads);
int eng_greedy(const float *logits, int64_t stride, int64_t rows, int64_t vocab, int64_t *ids,
               float *lp, int nthreads);
int eng_lora_sgmv(int dtype, int wdtype, void *out, const void *x, int64_t T, int64_t K, int64_t N, int64_t R,
                  int64_t S, const void *a, const void *b, const int32_t *order, const int32_t *bounds,
                  const int32_t *gslots, int64_t G, int64_t nslices, const int64_t *slice_cols, int b_pairs,
                  int nthreads);
int eng_lora_pairs(void);
int eng_encoder_attention(int dtype, void *out, const void *qkv, const int64_t *starts, int64_t nseq,
                          int64_t heads, int64_t d, float scale, int nthreads);
int eng_delta_rule_decode(float *state, const float *q, const float *k, const float *v, const float *g,
                          const float *beta, float *out, int64_t n, int64_t hv, int64_t hk, int64_t dk,
                          int64_t dv, int tiled, int nthreads);
int eng_conv_decode(int dtype, void *conv, const void *x, int64_t x_stride, const float *weight, const float *bias,
                    float *out, int64_t n, int64_t c, int64_t w, int nthreads);
int eng_selective_decode(float *state, const float *u, const float *dt, const float *a, const float *B,
                         const float *C, const float *d, float *y, int64_t n, int64_t dch, int64_t ds, int nthreads);
int eng_ssd_decode(float *state, const float *x, const float *B, const float *C, const float *dt, const float *a,
                   const float *d, float *y, int64_t n, int64_t h, int64_t g, int64_t p, int64_t ds, int nthreads);
int eng_mamba1_decode(int dtype, float *state, const void *u, const void *dt_raw, const void *B, const void *C,
                      int64_t bc_stride, const void *z, int64_t z_stride, const float *dt_bias, const float *a,
                      const float *d, void *out, float *scratch, int64_t n, int64_t dch, int64_t ds, int nthreads);
int eng_mamba2_decode(int dtype, const void *zx, int64_t x_stride, void *conv, float *state, const float *conv_w,
                      const float *conv_b, const float *dt_bias, const float *a, const float *d, const float *w,
                      float dt_min, float dt_max, float eps, int flags, int64_t n, int64_t d_inner, int64_t conv_dim,
                      int64_t cw, int64_t h, int64_t g, int64_t ds, float *scratch, void *out, int nthreads);
"""

# Quantized-weight matmuls (quant.c, a translation unit of its own; see engine/ops/quant.py).
QUANT_CDEF = """
int eng_q_isa(void);
int eng_q_has_avx2(void);
int eng_qmatmul(int fmt, int isa, int dtype, void *out, int64_t out_stride, const void *x,
                int64_t x_stride, int64_t M, int64_t K, int64_t N, const uint8_t *codes,
                const uint8_t *hi, const uint16_t *d, const uint16_t *m, const uint8_t *sc,
                const uint8_t *mn, int nthreads);
int eng_qrows(int fmt, int dtype, void *out, const int64_t *ids, int64_t n_ids, int64_t K,
              int64_t N, const uint8_t *codes, const uint8_t *hi, const uint16_t *d,
              const uint16_t *m, const uint8_t *sc, const uint8_t *mn, int nthreads);
int eng_dense_isa(void);
int eng_dense_matmul(int dtype, void *out, const void *x, int64_t M, int64_t K, int64_t N, const void *w,
                     const void *bias, int nthreads);
int eng_moe_small(int dtype, void *out, const void *x, int64_t T, int64_t H, int64_t I, int64_t k, int64_t E,
                  const void *w13, const void *w2, const void *b13, float alpha, float limit, int gated,
                  const float *topw, const int64_t *topi, void *xg, void *h, void *a, void *y, int nthreads);
int eng_qpack(int fmt, const uint8_t *raw, int64_t N, int64_t K, uint8_t *codes, uint8_t *hi,
              uint16_t *d, uint16_t *m, uint8_t *sc, uint8_t *mn, int nthreads);
"""

# The routed experts kept in their blocks (quant.c), over fused.h's EngQPart: declared
# after it, in the cdef and in the wrapper's source alike.
QMOE_CDEF = """
int eng_qmoe(int dtype, void *out, const void *x, int64_t T, int64_t H, int64_t I, int64_t k, int64_t E,
             const EngQPart *w13, int n13, const EngQPart *w2, int gated, const float *topw, const int64_t *topi,
             int nthreads);
"""

# The fused decode step (fused.c): fused.h's declarations, read from the header itself
# (its include guard and #include lines dropped: cffi's cdef takes declarations and integer
# #defines only), and the entry point.
FUSED_CDEF = "\n".join(
    line for line in (HERE / "fused.h").read_text().splitlines()
    if not line.startswith(("#ifndef", "#endif", "#include", "#define ENG_FUSED_H"))
) + """
int eng_fused_decode(const EngFusedModel *m, EngFusedState *st, int64_t T, void *out, const int64_t *positions,
                     const int64_t *slots, const int32_t *block_tables, int64_t bt_stride,
                     const int32_t *seq_lens, int nthreads);
""" + QMOE_CDEF

# -ffp-contract=off: no fused multiply-adds the source does not spell, so fp32 results
# round where torch's separate ops round. -fno-math-errno and -fno-trapping-math let
# floorf/sqrtf and branch-free selects vectorize; neither changes a result.
COMPILE_ARGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-std=c11"]

ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF + QUANT_CDEF + FUSED_CDEF)
ffibuilder.set_source(
    "engine.ops.cpu._kernels",
    # quant.c's prototypes, and fused.c's header, for the wrappers
    (HERE / "kernels.c").read_text() + QUANT_CDEF + '#include "fused.h"\n'
    "int eng_fused_decode(const EngFusedModel *, EngFusedState *, int64_t, void *, const int64_t *, const int64_t *,"
    " const int32_t *, int64_t, const int32_t *, int);\n" + QMOE_CDEF,
    # Relative to the repository root, where setup.py and the by-hand build below run.
    sources=["engine/ops/cpu/quant.c", "engine/ops/cpu/fused.c"],
    include_dirs=["engine/ops/cpu"],
    depends=["engine/ops/cpu/fused.h"],
    extra_compile_args=COMPILE_ARGS,
    extra_link_args=["-fopenmp"],
)

if __name__ == "__main__":
    # A build by hand, next to this file: python engine/ops/cpu/_build.py
    import os

    os.chdir(HERE.parents[2])
    ffibuilder.compile(tmpdir=".", verbose=True)
