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
int eng_rope(int dtype, void *x, int64_t token_stride, int64_t heads, int64_t d,
             const int64_t *positions, int64_t tokens, const void *cos_sin, int64_t max_pos,
             int nthreads);
int eng_silu_mul(int dtype, void *out, const void *x, int64_t rows, int64_t n, int nthreads);
int eng_paged_decode(int dtype, void *out, const void *q, int64_t q_stride,
                     const void *k_cache, const void *v_cache, int64_t num_blocks,
                     const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, int64_t batch, int64_t heads,
                     int64_t kv_heads, int64_t d, int64_t block_size, float scale,
                     int nthreads);
"""

# -ffp-contract=off: no fused multiply-adds the source does not spell, so fp32 results
# round where torch's separate ops round. -fno-math-errno and -fno-trapping-math let
# floorf/sqrtf and branch-free selects vectorize; neither changes a result.
COMPILE_ARGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-std=c11"]

ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "engine.ops.cpu._kernels",
    (HERE / "kernels.c").read_text(),
    extra_compile_args=COMPILE_ARGS,
    extra_link_args=["-fopenmp"],
)

if __name__ == "__main__":
    # A build by hand, next to this file: python engine/ops/cpu/_build.py
    ffibuilder.compile(tmpdir=str(HERE.parents[2]), verbose=True)
