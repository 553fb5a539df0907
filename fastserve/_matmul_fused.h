/* Fused small-batch products: n <= 4 activation rows times 16 weight rows computed straight from the
 * file's blocks, with no staging round trip (included by _matmul_kernels.h, whose numbers it keeps
 * bit for bit: see there).
 *
 * Why: at batch 1 decoding a panel into the staging layout costs 2.5-3x the kernel that reads it,
 * while the kernel's weight reuse (up to 8 activation rows per staged byte) buys nothing. Here each
 * of the 16 rows (lanes of the result) is read as it is stored, two blocks per 512-bit register:
 *
 *   weights of row l, blocks b, b+1:  128-bit lanes [b: inputs 0..15 | b: 16..31 | b+1: 0..15 | b+1: 16..31]
 *     Q4_0 / Q4_1: the 16 nibble bytes of each block broadcast into two lanes, masked with 0x0F and
 *                  0xF0 (the high nibbles stay multiplied by 16: shifted out exactly after the sum);
 *     Q8_0:        the 32 quant bytes of each block, made unsigned (xor 0x80);
 *   activations: the 64 quantized inputs of blocks b, b+1 as they lie (one load, reused by 16 rows);
 *   vpdpbusd then leaves 16 partial dots (4 inputs each) per row, and a transpose-reduce (unpack
 *   dwords, unpack qwords, shuffle 128-bit lanes: 3 steps of add) sums the 8 partials of every (row,
 *   block) into one vector per block whose lane l is row l's exact isum. The offset of the unsigned
 *   weights (8 for Q4_0, 128 for Q8_0) leaves as isum -= offset * sum(q_x): exact integers, so the
 *   float part below (the staged kernels' operations in their order) gives the same bits.
 *
 * Scales: the 16 rows' first dword of each block (f16 d, and m for Q4_1) copied by scalar loads, then
 * widened with vcvtph2ps (exact), as the staging decoders do.
 */
#ifndef FASTSERVE_MATMUL_FUSED_H
#define FASTSERVE_MATMUL_FUSED_H

#define FS_FUSED_MAX_N 4        /* at more rows the staged kernels' weight reuse wins */

#if defined(FS_HAVE_AVX512VNNI) && defined(FS_HAVE_STAGE_AVX512)
#define FS_HAVE_FUSED_AVX512 1
#define FS_FUSED512 __attribute__((target("avx512f,avx512bw,avx512vnni,f16c")))

/* Transpose-reduce steps: a[s] holds row s's partials. */
FS_FUSED512 FS_INLINE __m512i fs_fold32(__m512i a, __m512i b)
{
    /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
    return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}

FS_FUSED512 FS_INLINE __m512i fs_fold64(__m512i c, __m512i d)
{
    /* per 128-bit lane: the 4 rows of c (2) and d (2), each the sum of its lane's 4 dwords */
    return _mm512_add_epi32(_mm512_unpacklo_epi64(c, d), _mm512_unpackhi_epi64(c, d));
}

/* e0, e1: 4 rows each per 128-bit lane, lanes [b lo | b hi | b+1 lo | b+1 hi] -> [b: e0's rows |
 * b+1: e0's | b: e1's | b+1: e1's], the high halves shifted down by 4 bits first when nibble. */
FS_FUSED512 FS_INLINE __m512i fs_fold128(__m512i e0, __m512i e1, const int nibble)
{
    __m512i lo = _mm512_shuffle_i64x2(e0, e1, 0x88), hi = _mm512_shuffle_i64x2(e0, e1, 0xDD);
    return _mm512_add_epi32(lo, nibble ? _mm512_srai_epi32(hi, 4) : hi);
}

/* The first dword of block b of 16 rows: f16 d (low half) and, Q4_1, f16 m (high half). */
FS_FUSED512 FS_INLINE __m512i fs_fused_scales(const uint8_t *const rp[16], int64_t at)
{
    uint32_t w[16];
    for (int l = 0; l < 16; l++)
        memcpy(&w[l], rp[l] + at, 4);
    return _mm512_loadu_si512((const void *)w);
}

/* Q4_0 / Q4_1 / Q8_0: 16 rows at rows (row_bytes apart; lanes >= valid repeat row 0 and are not
 * stored) times the job's R activation rows, into y as the staged kernel would; next: the rows to
 * prefetch meanwhile (16 * row_bytes bytes) or NULL. */
FS_FUSED512 FS_INLINE void fs_fused_q48_avx512(const fs_job *j, int type, const uint8_t *rows, int64_t row_bytes,
                                               const uint8_t *next, const int R)
{
    const int64_t nb = j->nb, K = nb * FS_QK;
    const int q8 = type == FS_T_Q8_0, has_m = type == FS_T_Q4_1;
    const int bb = q8 ? 34 : has_m ? 20 : 18, qoff = has_m ? 4 : 2;
    const int32_t offset = q8 ? 128 : type == FS_T_Q4_0 ? 8 : 0;
    const __m512i nib = _mm512_set_epi64((long long)0xF0F0F0F0F0F0F0F0ull, (long long)0xF0F0F0F0F0F0F0F0ull,
                                         0x0F0F0F0F0F0F0F0Fll, 0x0F0F0F0F0F0F0F0Fll,
                                         (long long)0xF0F0F0F0F0F0F0F0ull, (long long)0xF0F0F0F0F0F0F0F0ull,
                                         0x0F0F0F0F0F0F0F0Fll, 0x0F0F0F0F0F0F0F0Fll);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const uint8_t *rp[16];
    for (int l = 0; l < 16; l++)
        rp[l] = rows + (l < j->valid ? l : 0) * row_bytes;
    __m512 f[FS_FUSED_MAX_N];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        f[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 2) {
        const int two = b + 1 < nb;
        const int64_t b1 = two ? b + 1 : b;          /* an odd last block: read twice, kept once */
        fs_prefetch_range(next, 16 * row_bytes * b / nb, 16 * row_bytes * (b + 2) / nb);
        __m512i xv[FS_FUSED_MAX_N];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            xv[r] = _mm512_maskz_loadu_epi8(two ? ~0ull : 0xFFFFFFFFull, j->xq + r * K + b * FS_QK);
        __m512i e[4][FS_FUSED_MAX_N];
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) {
            __m512i c[2][FS_FUSED_MAX_N];
#pragma GCC unroll 2
            for (int t = 0; t < 2; t++) {
                __m512i a[2][FS_FUSED_MAX_N];
#pragma GCC unroll 2
                for (int s = 0; s < 2; s++) {
                    const uint8_t *p = rp[4 * u + 2 * t + s];
                    __m512i w;
                    if (q8) {
                        w = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + b * bb + 2)));
                        w = _mm512_inserti64x4(w, _mm256_loadu_si256((const __m256i *)(p + b1 * bb + 2)), 1);
                        w = _mm512_xor_si512(w, flip);
                    } else {
                        w = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p + b * bb + qoff)));
                        w = _mm512_mask_broadcast_i32x4(w, 0xFF00, _mm_loadu_si128((const __m128i *)(p + b1 * bb + qoff)));
                        w = _mm512_and_si512(w, nib);
                    }
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++)
                        a[s][r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv[r]);
                }
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    c[t][r] = fs_fold32(a[0][r], a[1][r]);
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                e[u][r] = fs_fold64(c[0][r], c[1][r]);
        }
        const __m512i g0 = fs_fused_scales(rp, b * bb), g1 = fs_fused_scales(rp, b1 * bb);
        const __m512 d0 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g0)), d1 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g1));
        const __m512 m0 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g0, 16)));
        const __m512 m1 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g1, 16)));
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m512i f0 = fs_fold128(e[0][r], e[1][r], !q8), f1 = fs_fold128(e[2][r], e[3][r], !q8);
            const int64_t o = r * nb + b;
            __m512i is0 = _mm512_shuffle_i64x2(f0, f1, 0x88), is1 = _mm512_shuffle_i64x2(f0, f1, 0xDD);
            if (offset) {
                is0 = _mm512_sub_epi32(is0, _mm512_set1_epi32(offset * j->xs[o]));
                is1 = _mm512_sub_epi32(is1, _mm512_set1_epi32(offset * j->xs[two ? o + 1 : o]));
            }
            /* the float part in the contract's order, block b then b + 1 */
            f[r] = _mm512_add_ps(f[r], _mm512_mul_ps(_mm512_cvtepi32_ps(is0), _mm512_mul_ps(d0, _mm512_set1_ps(j->dx[o]))));
            if (has_m)
                f[r] = _mm512_add_ps(f[r], _mm512_mul_ps(m0, _mm512_set1_ps(j->sx[o])));
            if (two) {
                f[r] = _mm512_add_ps(f[r], _mm512_mul_ps(_mm512_cvtepi32_ps(is1), _mm512_mul_ps(d1, _mm512_set1_ps(j->dx[o + 1]))));
                if (has_m)
                    f[r] = _mm512_add_ps(f[r], _mm512_mul_ps(m1, _mm512_set1_ps(j->sx[o + 1])));
            }
        }
    }
    const __mmask16 msk = (__mmask16)(j->valid >= 16 ? 0xFFFF : (1u << j->valid) - 1u);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        _mm512_mask_storeu_ps(j->y + r * j->ldy, msk, f[r]);
}

FS_FUSED512 static void fs_fused_avx512(const fs_job *j, int type, const uint8_t *rows, int64_t row_bytes,
                                        const uint8_t *next)
{
    switch (j->n) {
    case 1: fs_fused_q48_avx512(j, type, rows, row_bytes, next, 1); break;
    case 2: fs_fused_q48_avx512(j, type, rows, row_bytes, next, 2); break;
    case 3: fs_fused_q48_avx512(j, type, rows, row_bytes, next, 3); break;
    default: fs_fused_q48_avx512(j, type, rows, row_bytes, next, 4); break;
    }
}
#endif /* FS_HAVE_FUSED_AVX512 */

/* Whether the fused kernel computes a panel of this type at n activation rows with this isa. */
static inline int fs_fused_ok(int isa, int type, int64_t n)
{
#if defined(FS_HAVE_FUSED_AVX512)
    if (isa == FS_ISA_AVX512VNNI && n >= 1 && n <= FS_FUSED_MAX_N &&
        (type == FS_T_Q4_0 || type == FS_T_Q4_1 || type == FS_T_Q8_0))
        return 1;
#endif
    (void)isa; (void)type; (void)n;
    return 0;
}

/* A panel's product by the fused kernel (fs_fused_ok said yes). */
static void fs_fused_panel(int isa, int type, const fs_job *j, const uint8_t *rows, int64_t row_bytes,
                           const uint8_t *next)
{
#if defined(FS_HAVE_FUSED_AVX512)
    if (isa == FS_ISA_AVX512VNNI) {
        fs_fused_avx512(j, type, rows, row_bytes, next);
        return;
    }
#endif
    (void)isa; (void)type; (void)j; (void)rows; (void)row_bytes; (void)next;
}

#endif /* FASTSERVE_MATMUL_FUSED_H */
