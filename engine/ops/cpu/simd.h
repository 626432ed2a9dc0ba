/* SIMD helpers shared by kernels.c and quant.c. */
#ifndef ENG_SIMD_H
#define ENG_SIMD_H
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

/* Lane k of the result = the sum of v[k]'s 16 lanes: a transposing tree of unpacks and
 * shuffles (45 operations for 16 sums, against ~8 each for separate reductions). Every
 * vector's lanes are added in the same tree whatever its position, and only with each
 * other, so a sum does not depend on what the other 15 vectors hold. */
static inline __attribute__((always_inline, target("avx512f"))) __m512 eng_hsum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* pairs: 128-bit lane = [x0+x2, y0+y2, x1+x3, y1+y3] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* quads: 128-bit lane = the lane's sums of 4 vectors */
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
#endif
#endif
