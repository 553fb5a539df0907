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
 *     Q5_0 / Q5_1: the same 16 bytes, the high nibbles shifted down in their lanes (a masked shift)
 *                  and the 64 fifth bits of both blocks added as 16 under one byte mask (kmov from
 *                  the two 32-bit qh words: bit i is byte i of the register);
 *     Q8_0:        the 32 quant bytes of each block, made unsigned (xor 0x80);
 *     Q4_K:        blocks 2c, 2c + 1 of a 256-block are the low and high nibbles of one 32-byte chunk,
 *                  so a register pairs blocks b, b + 2 (b = 0, 1, 4, 5): the 64 bytes of chunks c,
 *                  c + 1 in one plain load, masked 0x0F (b even) or 0xF0 (odd: x16, shifted out after
 *                  the sum); the four block sums then go into the float part in block order (n <= 2
 *                  only, whole panels);
 *     Q5_K:        as Q4_K, the high nibbles shifted down, the fifth bits added as 16 under a
 *                  byte mask (vptestmb of the 32 qh bytes against the blocks' bits);
 *     Q6_K:        the 64 low-bit bytes of two blocks and their high bits, q + 32 (n <= 2, whole
 *                  panels: the sub-scales of 16 rows come in one transposed load per 256-block); its
 *                  half-block dots are reduced apart and multiplied by their int8 sub-scales;
 *     IQ4_NL / IQ4_XS: Q5_0's nibbles (the high ones shifted down) looked up as q + 127 (0..240) by
 *                  one vpshufb; IQ4_XS's blocks are the 16-byte sub-blocks of its 256-blocks, their
 *                  scales d * (ls - 32) computed from the 16 rows' first two dwords once per 256-block
 *                  (n <= 2, any panel); MXFP4 the same with its own table (q + 12, 0..24) and its
 *                  E8M0 scale bytes widened to 2^(e - 128) (fs_e8m0_half512);
 *     Q3_K:        as Q6_K (fs_fused_qs_avx512): the 32 low-bit bytes of its chunk broadcast to both
 *                  blocks' halves, shifted apart, + 4 under the hmask bits' byte mask (q + 4, 0..7);
 *                  its 6-bit sub-scales unpacked to Q6_K's int8 layout (fs_fused_subscales);
 *     Q2_K:        Q3_K's low bits alone (q in 0..3, no offset), its 4-bit scales in that layout, and
 *                  after each block's isum step its halves' offsets (fs_fused_halves, kind QSM's order);
 *   activations: the 64 quantized inputs of blocks b, b+1 (one load, reused by 16 rows), their
 *   dwords doubled (0, 0, 1, 1 and 2, 2, 3, 3 per 128-bit lane);
 *   the weights of two rows interleaved by dwords (unpack lo / hi) and two vpdpbusd then leave 8
 *   partial dots per row (two rows per register, 8 inputs each), and a transpose-reduce (unpack
 *   qwords, shuffle 128-bit lanes: 2 steps of add) sums the partials of every (row, block) into one
 *   vector per block whose lane l is row l's exact isum. The offset of the unsigned
 *   weights (8 for Q4_0, 16 for Q5_0, 128 for Q8_0, 127 for IQ4) leaves as isum -= offset * sum(q_x): exact
 *   integers, so the float part below (the staged kernels' operations in their order) gives the
 *   same bits.
 *
 * AVX2 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; IQ4_NL and IQ4_XS at n = 1, their nibbles looked up as int8 q and
 * multiplied as Q8_0's; MXFP4 at n <= 2, its nibbles looked up as q + 12 and multiplied as Q4_0's): the same in 8-row
 * halves, one block per register (see there);
 * Q4_K, Q5_K, Q6_K, Q3_K and Q2_K (whole panels) likewise from their 256-blocks, at n <= 4
 * (fs_kq_half_avx2: the dots of each half block kept apart for the sub-scales of Q6_K, Q3_K and Q2_K),
 * so that no K-quant panel is staged at small n.
 *
 * Prefetch: the next panel's rows in even slices, one per step (fs_prefetcher: one division per
 * panel), a few lines at a time: a 256-block's share in one burst left Q6_K at ~60 % of the read
 * bandwidth (the loads wait behind the prefetches); on AVX2 the K-quants step once per pair of
 * blocks (a step is ~15 scalar instructions: per block it was an eighth of Q4_K's loop); the type
 * is a constant in each kernel instance (a switch outside the block loop).
 *
 * Scales: the 16 rows' first dword of each block (f16 d, and m for Q4_1 / Q5_1) copied by scalar loads, then
 * widened with vcvtph2ps (exact), as the staging decoders do.
 */
#ifndef FASTSERVE_MATMUL_FUSED_H
#define FASTSERVE_MATMUL_FUSED_H

#define FS_FUSED_MAX_N 4        /* at more rows the staged kernels' weight reuse wins */
#define FS_FUSED_MAX_N_K 2      /* the same for Q4_K */
#define FS_FUSED_MAX_N_IQ4 2    /* IQ4_NL / IQ4_XS / MXFP4 on AVX-512 (measured for IQ4: fused wins at n <= 2; on
                                 * AVX2 IQ4 at n = 1, MXFP4 at n <= 2) */

/* CALL(R) for the job's n = R (1..4) activation rows, R a constant in each case. */
#define FS_FUSED_BY_N(CALL)                                              \
    switch (j->n) {                                                      \
    case 1: CALL(1); break;                                              \
    case 2: CALL(2); break;                                              \
    case 3: CALL(3); break;                                              \
    default: CALL(4); break;                                             \
    }

/* The K-quants whose fused kernels keep each half block's dot apart for two integer sub-scales. */
#define FS_KQ_SUB(type) ((type) == FS_T_Q6_K || (type) == FS_T_Q3_K || (type) == FS_T_Q2_K)

/* Bytes per stored block of a kernel type (fs_type's table; once per panel, not per block). */
static inline int fs_fused_block_bytes(int type)
{
    fs_type_info t;
    return fs_type(type, &t) == 0 ? t.block_bytes : 0;
}

#if defined(FS_HAVE_AVX512VNNI) && defined(FS_HAVE_STAGE_AVX512)
#define FS_HAVE_FUSED_AVX512 1
#define FS_FUSED512 __attribute__((target("avx512f,avx512bw,avx512vnni,f16c")))

/* Transpose-reduce steps (the first, dwords of two rows, is fs_fused_quad's). */
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

/* Q6_K: row p's blocks jj, jj + 1 (jj even) of 256-block sb as unsigned 6-bit values q + 32: the
 * 64 low-bit bytes of chunk jj / 4 hold both (their low nibbles for jj % 4 = 0, high for 2), and
 * its 32 high-bit bytes, broadcast to both halves, bits jj % 4 * 2 (and + 2) for each, moved to
 * bits 4..5 by one variable shift of words (left 4 and 2, or right 0 and 2) and merged in one
 * ternary logic op. */
FS_FUSED512 FS_INLINE __m512i fs_fused_q6k_weights(const uint8_t *p, int64_t sb, int jj)
{
    const uint8_t *blk = p + sb * 210;
    const int c = jj >> 2, t = jj & 3;
    __m512i ql = _mm512_loadu_si512((const void *)(blk + 64 * c));
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * c)));
    __m512i hb;
    if (t) {
        ql = _mm512_srli_epi16(ql, 4);
        hb = _mm512_srlv_epi16(qh, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1));
    } else {
        hb = _mm512_sllv_epi16(qh, _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1));
    }
    hb = _mm512_and_si512(hb, _mm512_set1_epi8(0x30));
    return _mm512_ternarylogic_epi32(ql, _mm512_set1_epi8(15), hb, 0xEA);     /* (ql & 15) | hb */
}

/* The 2-bit quants of blocks jj, jj + 1 (jj even) of a 256-block whose 32-byte chunks start at qs
 * (Q3_K's low bits, Q2_K's q): the 32 bytes of chunk jj / 4 broadcast to both halves, shifted by
 * 2 * (jj % 4) and 2 more in the upper one, & 3. */
FS_FUSED512 FS_INLINE __m512i fs_fused_2bit_weights(const uint8_t *qs, int jj)
{
    const int t = jj & 3;
    const __m512i ql = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * (jj >> 2))));
    const __m512i sh = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * t)), _mm256_set1_epi16((short)(2 * t + 2)), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(ql, sh), _mm512_set1_epi8(3));
}

/* Q3_K: row p's blocks jj, jj + 1 (jj even) of 256-block sb as q + 4 (0..7): the low bits
 * (fs_fused_2bit_weights, chunks at byte 32) + 4 under the byte mask of hmask bits jj (lower half)
 * and jj + 1 (upper). */
FS_FUSED512 FS_INLINE __m512i fs_fused_q3k_weights(const uint8_t *p, int64_t sb, int jj)
{
    const uint8_t *blk = p + sb * 110;
    const __m512i w = fs_fused_2bit_weights(blk + 32, jj);
    const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)blk));
    const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << jj)), _mm256_set1_epi8((char)(2 << jj)), 1);
    return _mm512_mask_add_epi8(w, _mm512_test_epi8_mask(hm, bit), w, _mm512_set1_epi8(4));
}

/* Row p's weights of blocks b, b1 (b1 = b + 1, or b for an odd last block; Q4_K and Q5_K: b1 = b + 2)
 * as unsigned bytes, laid out [b: inputs 0..15 | 16..31 | b1: 0..15 | 16..31]; the nibble types'
 * high nibbles stay x16: Q4_0 / Q4_1 in the second and fourth 128-bit lanes, Q4_K for odd b. */
FS_FUSED512 FS_INLINE __m512i fs_fused_weights(const int type, const uint8_t *p, int64_t b, int64_t b1)
{
    if (FS_TABLE_TYPE(type)) {
        /* Q5_0's nibbles, the high ones shifted down in lanes 1, 3, then looked up as q + fs_q_offset
         * (IQ4: q + 127, 0..240; MXFP4: q + 12, 0..24) */
        __m512i w = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p + fs_table_qat(type, b))));
        w = _mm512_mask_broadcast_i32x4(w, 0xFF00, _mm_loadu_si128((const __m128i *)(p + fs_table_qat(type, b1))));
        w = _mm512_and_si512(_mm512_mask_srli_epi16(w, 0xFF00FF00u, w, 4), _mm512_set1_epi8(15));
        return _mm512_shuffle_epi8(fs_table512(type, fs_q_offset(type)), w);
    }
    if (type == FS_T_Q8_0) {
        __m512i w = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + b * 34 + 2)));
        w = _mm512_inserti64x4(w, _mm256_loadu_si256((const __m256i *)(p + b1 * 34 + 2)), 1);
        return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
    }
    if (type == FS_T_Q6_K)
        return fs_fused_q6k_weights(p, b >> 3, (int)(b & 7));
    if (type == FS_T_Q3_K)
        return fs_fused_q3k_weights(p, b >> 3, (int)(b & 7));
    if (type == FS_T_Q2_K)      /* Q3_K's low bits alone (q in 0..3), its chunks at byte 16 */
        return fs_fused_2bit_weights(p + (b >> 3) * 84 + 16, (int)(b & 7));
    if (type == FS_T_Q5_K) {
        /* blocks b, b + 2: the low (b even) or high nibbles of chunks (b % 8) / 2 and the next, one
         * plain 64-byte load, shifted down (a fifth bit leaves no room for x16); then bits b % 8
         * (lower half) and b % 8 + 2 (upper) of the 32 qh bytes add 16 */
        const uint8_t *blk = p + (b >> 3) * 176;
        const int jj = (int)(b & 7);
        __m512i w = _mm512_loadu_si512((const void *)(blk + 48 + 32 * (jj >> 1)));
        if (jj & 1)
            w = _mm512_srli_epi16(w, 4);
        w = _mm512_and_si512(w, _mm512_set1_epi8(15));
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)));
        const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << jj)), _mm256_set1_epi8((char)(4 << jj)), 1);
        return _mm512_mask_add_epi8(w, _mm512_test_epi8_mask(qh, bit), w, _mm512_set1_epi8(16));
    }
    if (type == FS_T_Q4_K) {
        /* blocks b, b + 2: the low nibbles (b even) or the high ones, x16, of chunks (b % 8) / 2 and
         * the next: one plain 64-byte load, no broadcast */
        const __m512i w = _mm512_loadu_si512((const void *)(p + (b >> 3) * 144 + 16 + 32 * ((b & 7) >> 1)));
        return _mm512_and_si512(w, _mm512_set1_epi8((char)(b & 1 ? 0xF0 : 0x0F)));
    }
    if (type == FS_T_Q5_0 || type == FS_T_Q5_1) {
        /* nibbles shifted down in the high-input lanes (1, 3: words 8..15, 24..31), then the 64 fifth
         * bits of b, b1 (bit i: input i, byte i of the register) added as 16 under a byte mask */
        const int bb = type == FS_T_Q5_1 ? 24 : 22, hoff = type == FS_T_Q5_1 ? 4 : 2;
        __m512i w = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p + b * bb + hoff + 4)));
        w = _mm512_mask_broadcast_i32x4(w, 0xFF00, _mm_loadu_si128((const __m128i *)(p + b1 * bb + hoff + 4)));
        w = _mm512_and_si512(_mm512_mask_srli_epi16(w, 0xFF00FF00u, w, 4), _mm512_set1_epi8(15));
        uint32_t h0, h1;
        memcpy(&h0, p + b * bb + hoff, 4);
        memcpy(&h1, p + b1 * bb + hoff, 4);
        return _mm512_mask_add_epi8(w, (__mmask64)((uint64_t)h1 << 32 | h0), w, _mm512_set1_epi8(16));
    }
    const int bb = type == FS_T_Q4_1 ? 20 : 18, qoff = type == FS_T_Q4_1 ? 4 : 2;
    const __m512i nib = _mm512_set_epi64((long long)0xF0F0F0F0F0F0F0F0ull, (long long)0xF0F0F0F0F0F0F0F0ull,
                                         0x0F0F0F0F0F0F0F0Fll, 0x0F0F0F0F0F0F0F0Fll,
                                         (long long)0xF0F0F0F0F0F0F0F0ull, (long long)0xF0F0F0F0F0F0F0F0ull,
                                         0x0F0F0F0F0F0F0F0Fll, 0x0F0F0F0F0F0F0F0Fll);
    __m512i w = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p + b * bb + qoff)));
    w = _mm512_mask_broadcast_i32x4(w, 0xFF00, _mm_loadu_si128((const __m128i *)(p + b1 * bb + qoff)));
    return _mm512_and_si512(w, nib);
}

/* Rows rp[0..3]'s dots of blocks b, b1 with the R activation rows (xv: fs_fused_acts), two reduce
 * steps in: e[r], per 128-bit lane (half a block) the 4 rows' sums. The first step comes before the
 * products: the dwords of rows 2t, 2t + 1 interleaved (once for all R) against the activations'
 * dwords doubled, the two halves summed by vpdpbusd's own accumulation. */
FS_FUSED512 FS_INLINE void fs_fused_quad(const int type, const uint8_t *const *rp, int64_t b, int64_t b1,
                                         const __m512i *xv, const int R, __m512i *e)
{
    __m512i c[2][FS_FUSED_MAX_N];
#pragma GCC unroll 2
    for (int t = 0; t < 2; t++) {
        const __m512i w0 = fs_fused_weights(type, rp[2 * t], b, b1), w1 = fs_fused_weights(type, rp[2 * t + 1], b, b1);
        const __m512i lo = _mm512_unpacklo_epi32(w0, w1), hi = _mm512_unpackhi_epi32(w0, w1);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            c[t][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xv[r]), hi, xv[FS_FUSED_MAX_N + r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        e[r] = fs_fold64(c[0][r], c[1][r]);
}

/* The raw integer dots of blocks b, b1 of the 16 rows rp with the R activation rows xv (their 64
 * quantized inputs of b, b1): is0[r], is1[r], lane l = row l (before the weights' offset). */
FS_FUSED512 FS_INLINE void fs_fused_isums(const int type, const uint8_t *const rp[16], int64_t b, int64_t b1,
                                          const __m512i *xv, const int R, __m512i *is0, __m512i *is1)
{
    const int lane_nibbles = type == FS_T_Q4_0 || type == FS_T_Q4_1;
    __m512i e[4][FS_FUSED_MAX_N];
#pragma GCC unroll 4
    for (int u = 0; u < 4; u++)
        fs_fused_quad(type, rp + 4 * u, b, b1, xv, R, e[u]);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const __m512i f0 = fs_fold128(e[0][r], e[1][r], lane_nibbles), f1 = fs_fold128(e[2][r], e[3][r], lane_nibbles);
        is0[r] = _mm512_shuffle_i64x2(f0, f1, 0x88);
        is1[r] = _mm512_shuffle_i64x2(f0, f1, 0xDD);
        if (type == FS_T_Q4_K && (b & 1)) {
            is0[r] = _mm512_srai_epi32(is0[r], 4);
            is1[r] = _mm512_srai_epi32(is1[r], 4);
        }
    }
}

/* acc += (float)isum * (d * d_x)  [then acc += m * s_x]: block o of the row's activations. */
FS_FUSED512 FS_INLINE __m512 fs_fused_float(const fs_job *j, __m512 acc, __m512i isum, __m512 d, __m512 m,
                                            const int has_m, int64_t o)
{
    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(j->dx[o]))));
    if (has_m)
        acc = _mm512_add_ps(acc, _mm512_mul_ps(m, _mm512_set1_ps(j->sx[o])));
    return acc;
}

/* The R activation rows' quantized inputs of blocks b, b1 (32 each) as fs_fused_quad reads them:
 * xv[r] per 128-bit lane dwords 0, 0, 1, 1, xv[FS_FUSED_MAX_N + r] 2, 2, 3, 3. */
FS_FUSED512 FS_INLINE void fs_fused_acts(const fs_job *j, int64_t b, int64_t b1, const int R, __m512i *xv)
{
    const int64_t K = j->nb * FS_QK;
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const int8_t *xr = j->xq + r * K;
        const __m512i x = b1 == b + 1 ? _mm512_loadu_si512((const void *)(xr + b * FS_QK))
                                      : _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(xr + b * FS_QK))),
                                                           _mm256_loadu_si256((const __m256i *)(xr + b1 * FS_QK)), 1);
        xv[r] = _mm512_unpacklo_epi32(x, x);
        xv[FS_FUSED_MAX_N + r] = _mm512_unpackhi_epi32(x, x);
    }
}

/* The 16 rows' addresses (lanes >= valid repeat row 0 and are not stored) and zero sums. */
FS_FUSED512 FS_INLINE void fs_fused_begin(const fs_job *j, const uint8_t *rows, int64_t row_bytes,
                                          const uint8_t **rp, __m512 *f, const int R)
{
    for (int l = 0; l < 16; l++)
        rp[l] = rows + (l < j->valid ? l : 0) * row_bytes;
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        f[r] = _mm512_setzero_ps();
}

FS_FUSED512 FS_INLINE void fs_fused_store(const fs_job *j, const __m512 *f, const int R)
{
    const __mmask16 msk = (__mmask16)(j->valid >= 16 ? 0xFFFF : (1u << j->valid) - 1u);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        _mm512_mask_storeu_ps(j->y + r * j->ldy, msk, f[r]);
}

/* Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL / IQ4_XS: 16 rows at rows (row_bytes apart; lanes >= valid repeat row 0 and are not
 * stored) times the job's R activation rows, into y as the staged kernel would; next: the rows to
 * prefetch meanwhile (16 * row_bytes bytes) or NULL. */
FS_FUSED512 FS_INLINE void fs_fused_q32_avx512(const fs_job *j, const int type, const uint8_t *rows, int64_t row_bytes,
                                               const uint8_t *next, const int R)
{
    const int64_t nb = j->nb;
    const int has_m = type == FS_T_Q4_1 || type == FS_T_Q5_1, bb = fs_fused_block_bytes(type);
    const int32_t offset = fs_q_offset(type);
    const uint8_t *rp[16];
    __m512 f[FS_FUSED_MAX_N];
    __m512i iq4xs_g = _mm512_setzero_si512(), iq4xs_sl = iq4xs_g;   /* IQ4_XS: the 256-block's scale dwords */
    __m512 iq4xs_d = _mm512_setzero_ps();
    fs_fused_begin(j, rows, row_bytes, rp, f, R);
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, (nb + 1) / 2);
    for (int64_t b = 0; b < nb; b += 2) {
        const int two = b + 1 < nb;
        const int64_t b1 = two ? b + 1 : b;          /* an odd last block: read twice, kept once */
        fs_prefetch_step(&pf);
        __m512i xv[2 * FS_FUSED_MAX_N], is0[FS_FUSED_MAX_N], is1[FS_FUSED_MAX_N];
        fs_fused_acts(j, b, b1, R, xv);
        fs_fused_isums(type, rp, b, b1, xv, R, is0, is1);
        __m512 d0, d1, m0, m1;
        if (type == FS_T_IQ4_XS) {      /* sub-blocks b, b + 1 of one 256-block: d * (ls - 32) */
            if ((b & 7) == 0) {
                iq4xs_g = fs_fused_scales(rp, (b >> 3) * 136);
                iq4xs_sl = fs_fused_scales(rp, (b >> 3) * 136 + 4);
                iq4xs_d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(iq4xs_g));
            }
            d0 = m0 = fs_iq4xs_scale512(iq4xs_g, iq4xs_sl, iq4xs_d, (int)(b & 7));
            d1 = m1 = fs_iq4xs_scale512(iq4xs_g, iq4xs_sl, iq4xs_d, (int)(b & 7) + 1);
        } else if (type == FS_T_MXFP4) {     /* the E8M0 byte: the low one of the block's first dword */
            const __m512i low8 = _mm512_set1_epi32(255);
            d0 = m0 = fs_e8m0_half512(_mm512_and_si512(fs_fused_scales(rp, b * bb), low8));
            d1 = m1 = fs_e8m0_half512(_mm512_and_si512(fs_fused_scales(rp, b1 * bb), low8));
        } else {
            const __m512i g0 = fs_fused_scales(rp, b * bb), g1 = fs_fused_scales(rp, b1 * bb);
            d0 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g0));
            d1 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g1));
            m0 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g0, 16)));
            m1 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g1, 16)));
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const int64_t o = r * nb + b;
            if (offset) {
                is0[r] = _mm512_sub_epi32(is0[r], _mm512_set1_epi32(offset * j->xs[o]));
                is1[r] = _mm512_sub_epi32(is1[r], _mm512_set1_epi32(offset * j->xs[two ? o + 1 : o]));
            }
            f[r] = fs_fused_float(j, f[r], is0[r], d0, m0, has_m, o);
            if (two)
                f[r] = fs_fused_float(j, f[r], is1[r], d1, m1, has_m, o + 1);
        }
    }
    fs_fused_store(j, f, R);
}

/* Q4_K, Q5_K (type; whole panels: the scales of 16 rows come as the staging decoder reads them). */
FS_FUSED512 FS_INLINE void fs_fused_k45_avx512(const fs_job *j, const int type, const uint8_t *rows, int64_t row_bytes,
                                               const uint8_t *next, const int R)
{
    const int64_t bb = fs_fused_block_bytes(type);
    const int64_t nb = j->nb;
    const uint8_t *rp[16];
    __m512 f[FS_FUSED_MAX_N];
    fs_fused_begin(j, rows, row_bytes, rp, f, R);
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, nb / 8);
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        fs_prefetch_step(&pf);
        __m512i h[4];
        __m512 dsc[8], mneg[8];
        fs_rows16x4(rows, row_bytes, sb * bb, h);
        fs_k45_scales(h, dsc, mneg);
        for (int c = 0; c < 4; c += 2) {     /* chunks c, c + 1: blocks b .. b + 3, low nibbles then high */
            const int64_t b = sb * 8 + 2 * c;
            __m512i xv[2 * FS_FUSED_MAX_N], is[4][FS_FUSED_MAX_N];     /* is[k]: block b + k */
#pragma GCC unroll 2
            for (int hi = 0; hi < 2; hi++) {
                fs_fused_acts(j, b + hi, b + hi + 2, R, xv);
                fs_fused_isums(type, rp, b + hi, b + hi + 2, xv, R, is[hi], is[hi + 2]);
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++)
                    f[r] = fs_fused_float(j, f[r], is[k][r], dsc[2 * c + k], mneg[2 * c + k], 1, r * nb + b + k);
        }
    }
    fs_fused_store(j, f, R);
}

/* The 16 sub-scales of 256-block sb of 16 rows as int8, 4 per dword: scs[k] lane l = the scales
 * 4k .. 4k + 3 of row l (Q6_K: as stored; Q3_K: 6-bit - 32, its 4 low bits in bytes 0..7 (high
 * nibbles for scales 8..15), 2 high bits at 2 * (i / 4) of byte 8 + i % 4; Q2_K: the low nibbles of
 * scales[16], and in mns the high ones, its mins, in the same layout). */
FS_FUSED512 FS_INLINE void fs_fused_subscales(const int type, const uint8_t *rows, int64_t row_bytes, int64_t sb,
                                              __m512i scs[4], __m512i mns[4])
{
    if (type == FS_T_Q6_K) {
        fs_rows16x4(rows, row_bytes, sb * 210 + 192, scs);
        return;
    }
    if (type == FS_T_Q2_K) {
        fs_rows16x4(rows, row_bytes, sb * 84, scs);
        for (int k = 0; k < 4; k++) {
            mns[k] = _mm512_and_si512(_mm512_srli_epi32(scs[k], 4), _mm512_set1_epi8(15));
            scs[k] = _mm512_and_si512(scs[k], _mm512_set1_epi8(15));
        }
        return;
    }
    __m512i sc[4];
    fs_rows16x4(rows, row_bytes, sb * 110 + 92, sc);      /* sc[1..3]: scales[0..3], [4..7], [8..11] */
    for (int k = 0; k < 4; k++) {
        const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(sc[1 + (k & 1)], 4 * (k >> 1)), _mm512_set1_epi8(15));
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(sc[3], 2 * k), _mm512_set1_epi8(3));
        scs[k] = _mm512_sub_epi8(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi8(32));
    }
}

/* Kind QSM's offsets of block o after its isum step: acc + m0 * (d_x * xh), then + m1 * (d_x * (xs - xh)). */
FS_FUSED512 FS_INLINE __m512 fs_fused_halves(const fs_job *j, __m512 acc, __m512 m0, __m512 m1, int64_t o)
{
    const float dx = j->dx[o], sl = dx * (float)j->xh[o], sh = dx * (float)(j->xs[o] - j->xh[o]);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(m0, _mm512_set1_ps(sl)));
    return _mm512_add_ps(acc, _mm512_mul_ps(m1, _mm512_set1_ps(sh)));
}

/* Q6_K, Q3_K, Q2_K (type): 16 rows at rows (a whole panel) times R activation rows. Per pair of blocks
 * the dots of each half block stay apart (two reduce steps, not three), lose the offset
 * fs_q_offset * sum(q_x) of their half, are multiplied by their int8 sub-scales, then summed:
 * isum = s0 * lo16 + s1 * hi16, exactly; Q2_K then adds its halves' offsets -(dmin * min). */
FS_FUSED512 FS_INLINE void fs_fused_qs_avx512(const fs_job *j, const int type, const uint8_t *rows, int64_t row_bytes,
                                              const uint8_t *next, const int R)
{
    const int64_t nb = j->nb, bb = fs_fused_block_bytes(type);
    const int32_t off = fs_q_offset(type);
    const int Q2 = type == FS_T_Q2_K;
    const uint8_t *rp[16];
    __m512 f[FS_FUSED_MAX_N];
    fs_fused_begin(j, rows, row_bytes, rp, f, R);
    /* per 128-bit lane k: byte k of each dword (the sub-scale of half k % 2 of block k / 2) */
    const __m512i to_top = _mm512_set_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24);
    const __m512i lane_of = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    /* the next panel a few lines per 4 rows (a burst per 256-block here left Q6_K at 60 % of the read bandwidth) */
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, nb / 8 * 16);
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        /* d: the block's last two bytes (read as the high half of the dword before them); Q2_K: d | dmin */
        const __m512i g = fs_fused_scales(rp, Q2 ? sb * bb + 80 : sb * bb + bb - 4);
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(Q2 ? g : _mm512_srli_epi32(g, 16)));
        const __m512 dmin = Q2 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16))) : d;
        __m512i scs[4], mns[4];            /* dword jj / 2: the sub-scales s0, s1 (mins) of blocks jj, jj + 1 */
        fs_fused_subscales(type, rows, row_bytes, sb, scs, mns);
        for (int jj = 0; jj < 8; jj += 2) {
            const int64_t b = sb * 8 + jj;
            __m512i xv[2 * FS_FUSED_MAX_N], e[4][FS_FUSED_MAX_N], corr[FS_FUSED_MAX_N];
            fs_fused_acts(j, b, b + 1, R, xv);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                /* off * [sum q_x of b lo, b hi, b+1 lo, b+1 hi], each in a 128-bit lane (as e[u]'s halves) */
                const int64_t o = r * nb + b;
                const __m128i h = _mm_loadl_epi64((const __m128i *)(j->xh + o)), t = _mm_loadl_epi64((const __m128i *)(j->xs + o));
                const __m128i c = _mm_mullo_epi32(_mm_unpacklo_epi32(h, _mm_sub_epi32(t, h)), _mm_set1_epi32(off));
                corr[r] = _mm512_permutexvar_epi32(lane_of, _mm512_castsi128_si512(c));
            }
            const __m512i sc = scs[jj >> 1];
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++) {
                fs_prefetch_step(&pf);
                fs_fused_quad(type, rp + 4 * u, b, b + 1, xv, R, e[u]);
                /* rows 4u..4u+3's sub-scales, laid out as e[u]: [s0 jj | s1 jj | s0 jj+1 | s1 jj+1] */
                const __m512i su = _mm512_srai_epi32(_mm512_sllv_epi32(_mm512_shuffle_i32x4(sc, sc, 0x55 * u), to_top), 24);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    e[u][r] = _mm512_mullo_epi32(_mm512_sub_epi32(e[u][r], corr[r]), su);
            }
            __m512 mneg[4];                /* Q2_K: -(dmin * min) of the half blocks b lo, b hi, b+1 lo, b+1 hi */
#pragma GCC unroll 4
            for (int e2 = 0; e2 < 4; e2++) {
                mneg[e2] = Q2 ? fs_neg_dmin_mn512(dmin, fs_byte(mns[jj >> 1], e2)) : _mm512_setzero_ps();     /* unused unless Q2 */
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m512i f0 = fs_fold128(e[0][r], e[1][r], 0), f1 = fs_fold128(e[2][r], e[3][r], 0);
                f[r] = fs_fused_float(j, f[r], _mm512_shuffle_i64x2(f0, f1, 0x88), d, d, 0, r * nb + b);
                if (Q2)
                    f[r] = fs_fused_halves(j, f[r], mneg[0], mneg[1], r * nb + b);
                f[r] = fs_fused_float(j, f[r], _mm512_shuffle_i64x2(f0, f1, 0xDD), d, d, 0, r * nb + b + 1);
                if (Q2)
                    f[r] = fs_fused_halves(j, f[r], mneg[2], mneg[3], r * nb + b + 1);
            }
        }
    }
    fs_fused_store(j, f, R);
}

FS_FUSED512 static void fs_fused_avx512(const fs_job *j, int type, const uint8_t *rows, int64_t row_bytes,
                                        const uint8_t *next)
{
#define FS_Q40(R) fs_fused_q32_avx512(j, FS_T_Q4_0, rows, row_bytes, next, R)
#define FS_Q41(R) fs_fused_q32_avx512(j, FS_T_Q4_1, rows, row_bytes, next, R)
#define FS_Q80(R) fs_fused_q32_avx512(j, FS_T_Q8_0, rows, row_bytes, next, R)
#define FS_Q50(R) fs_fused_q32_avx512(j, FS_T_Q5_0, rows, row_bytes, next, R)
#define FS_Q51(R) fs_fused_q32_avx512(j, FS_T_Q5_1, rows, row_bytes, next, R)
#define FS_Q4K(R) fs_fused_k45_avx512(j, FS_T_Q4_K, rows, row_bytes, next, R)
#define FS_Q5K(R) fs_fused_k45_avx512(j, FS_T_Q5_K, rows, row_bytes, next, R)
#define FS_Q6K(R) fs_fused_qs_avx512(j, FS_T_Q6_K, rows, row_bytes, next, R)
#define FS_IQ4NL(R) fs_fused_q32_avx512(j, FS_T_IQ4_NL, rows, row_bytes, next, R)
#define FS_IQ4XS(R) fs_fused_q32_avx512(j, FS_T_IQ4_XS, rows, row_bytes, next, R)
#define FS_MXFP4(R) fs_fused_q32_avx512(j, FS_T_MXFP4, rows, row_bytes, next, R)
#define FS_Q3K(R) fs_fused_qs_avx512(j, FS_T_Q3_K, rows, row_bytes, next, R)
#define FS_Q2K(R) fs_fused_qs_avx512(j, FS_T_Q2_K, rows, row_bytes, next, R)
    switch (type) {
    case FS_T_Q4_0: FS_FUSED_BY_N(FS_Q40); break;
    case FS_T_Q4_1: FS_FUSED_BY_N(FS_Q41); break;
    case FS_T_Q8_0: FS_FUSED_BY_N(FS_Q80); break;
    case FS_T_Q5_0: FS_FUSED_BY_N(FS_Q50); break;
    case FS_T_Q5_1: FS_FUSED_BY_N(FS_Q51); break;
    case FS_T_Q4_K: FS_FUSED_BY_N(FS_Q4K); break;
    case FS_T_Q5_K: FS_FUSED_BY_N(FS_Q5K); break;
    case FS_T_Q6_K: FS_FUSED_BY_N(FS_Q6K); break;
    case FS_T_IQ4_NL: FS_FUSED_BY_N(FS_IQ4NL); break;
    case FS_T_IQ4_XS: FS_FUSED_BY_N(FS_IQ4XS); break;
    case FS_T_MXFP4: FS_FUSED_BY_N(FS_MXFP4); break;
    case FS_T_Q3_K: FS_FUSED_BY_N(FS_Q3K); break;
    case FS_T_Q2_K: FS_FUSED_BY_N(FS_Q2K); break;
    default: break;
    }
#undef FS_Q40
#undef FS_Q41
#undef FS_Q80
#undef FS_Q50
#undef FS_Q51
#undef FS_Q4K
#undef FS_Q5K
#undef FS_Q6K
#undef FS_IQ4NL
#undef FS_IQ4XS
#undef FS_MXFP4
#undef FS_Q3K
#undef FS_Q2K
}
#endif /* FS_HAVE_FUSED_AVX512 */

#if defined(FS_HAVE_STAGE_AVX2)
#define FS_HAVE_FUSED_AVX2 1
#define FS_FUSED256 __attribute__((target("avx2,f16c")))

/* AVX2 (no VNNI), Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL / IQ4_XS: half a panel (8 rows, lanes) at a
 * time, one block per 256-bit register [inputs 0..15 | 16..31]: nibbles (with Q5's fifth bit) as u8
 * 0..31 (maddubs pairs <= 2 * 31 * 127),
 * Q8_0 as maddubs(|w|, sign(x, w)) (the staged AVX2 kernel's exact dot), IQ4's nibbles looked up as
 * int8 q and multiplied as Q8_0's, then madd with ones, and
 * the transpose-reduce of 8 rows' 8 partials: unpack dwords, unpack qwords, swap 128-bit lanes. */
/* The dword at byte `at` of each of the 8 rows rp (scalar loads: the load ports are idle meanwhile). */
FS_FUSED256 FS_INLINE __m256i fs_dword8_avx2(const uint8_t *const *rp, int64_t at)
{
    uint32_t w[8];
    for (int l = 0; l < 8; l++)
        memcpy(&w[l], rp[l] + at, 4);
    return _mm256_loadu_si256((const __m256i *)w);
}

/* The low 16 bits of each dword, packed (8 f16 for vcvtph2ps). */
FS_FUSED256 FS_INLINE __m128i fs_low16x8_avx2(__m256i v)
{
    v = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
    return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

FS_FUSED256 FS_INLINE __m256i fs_fold32_avx2(__m256i a, __m256i b)
{
    return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}

FS_FUSED256 FS_INLINE __m256i fs_fold64_avx2(__m256i c, __m256i d)
{
    return _mm256_add_epi32(_mm256_unpacklo_epi64(c, d), _mm256_unpackhi_epi64(c, d));
}

/* Row p's dot partials of block b with the activations xv (their 32 inputs of b). */
FS_FUSED256 FS_INLINE __m256i fs_fused_dot_avx2(const int type, const uint8_t *p, int64_t b, __m256i xv)
{
    const __m256i ones = _mm256_set1_epi16(1);
    if (type == FS_T_Q8_0) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(p + b * 34 + 2));
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w)), ones);
    }
    if (FS_TABLE_TYPE(type)) {
        /* the nibbles looked up as the staged AVX2 tile stores them: IQ4's int8 q, multiplied as Q8_0's;
         * MXFP4's q + 12 (0..24), as Q4_0's nibbles */
        const int G = fs_avx2_group(type);
        const __m128i q = _mm_loadu_si128((const __m128i *)(p + fs_table_qat(type, b)));
        const __m256i w = _mm256_shuffle_epi8(fs_table256(type, fs_stage_bias(1, type)),
                                              _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15)));
        return _mm256_madd_epi16(G ? _mm256_maddubs_epi16(w, xv) : _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w)),
                                 ones);
    }
    const int five = type == FS_T_Q5_0 || type == FS_T_Q5_1, bb = fs_fused_block_bytes(type);
    const int qoff = (type == FS_T_Q4_1 || type == FS_T_Q5_1 ? 4 : 2) + (five ? 4 : 0);
    const __m128i q = _mm_loadu_si128((const __m128i *)(p + b * bb + qoff)), m = _mm_set1_epi8(15);
    __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
    if (five) {     /* byte i |= 16 where bit i of the 32 fifth bits: byte i / 8 of them, bit i % 8 */
        uint32_t qh;
        memcpy(&qh, p + b * bb + qoff - 4, 4);
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
        const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                                   _mm256_set_epi64x(0x0303030303030303ll, 0x0202020202020202ll,
                                                                     0x0101010101010101ll, 0));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        w = _mm256_or_si256(w, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
}

FS_FUSED256 FS_INLINE void fs_fused_half_avx2(const fs_job *j, const int type, const uint8_t *const *rp, int h,
                                              fs_prefetcher *pf, const int R)
{
    const int64_t nb = j->nb, K = nb * FS_QK;
    const int has_m = type == FS_T_Q4_1 || type == FS_T_Q5_1, bb = fs_fused_block_bytes(type);
    const int32_t offset = fs_avx2_group(type) ? fs_q_offset(type) : 0;     /* Q8_0, IQ4: signed q */
    __m256i iq4xs_g = _mm256_setzero_si256(), iq4xs_sl = iq4xs_g;    /* IQ4_XS: the 256-block's scale dwords */
    __m256 iq4xs_d = _mm256_setzero_ps();
    __m256 f[FS_FUSED_MAX_N];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        f[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        fs_prefetch_step(pf);
        __m256i xv[FS_FUSED_MAX_N], e[2][FS_FUSED_MAX_N];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            xv[r] = _mm256_loadu_si256((const __m256i *)(j->xq + r * K + b * FS_QK));
#pragma GCC unroll 2
        for (int u = 0; u < 2; u++) {
            __m256i c[2][FS_FUSED_MAX_N];
#pragma GCC unroll 2
            for (int t = 0; t < 2; t++) {
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    c[t][r] = fs_fold32_avx2(fs_fused_dot_avx2(type, rp[4 * u + 2 * t], b, xv[r]),
                                             fs_fused_dot_avx2(type, rp[4 * u + 2 * t + 1], b, xv[r]));
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                e[u][r] = fs_fold64_avx2(c[0][r], c[1][r]);
        }
        __m256 d, m;
        if (type == FS_T_IQ4_XS) {
            if ((b & 7) == 0) {
                iq4xs_g = fs_dword8_avx2(rp, (b >> 3) * 136);
                iq4xs_sl = fs_dword8_avx2(rp, (b >> 3) * 136 + 4);
                iq4xs_d = _mm256_cvtph_ps(fs_low16x8_avx2(iq4xs_g));
            }
            d = m = fs_iq4xs_scale_avx2(iq4xs_g, iq4xs_sl, iq4xs_d, (int)(b & 7));
        } else {
            const __m256i g = fs_dword8_avx2(rp, b * bb);              /* d | m << 16 of each row; MXFP4: e */
            d = type == FS_T_MXFP4 ? fs_e8m0_half_avx2(_mm256_and_si256(g, _mm256_set1_epi32(255)))
                                   : _mm256_cvtph_ps(fs_low16x8_avx2(g));
            m = has_m ? _mm256_cvtph_ps(fs_low16x8_avx2(_mm256_srli_epi32(g, 16))) : d;
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const int64_t o = r * nb + b;
            __m256i is = _mm256_add_epi32(_mm256_permute2x128_si256(e[0][r], e[1][r], 0x20),
                                          _mm256_permute2x128_si256(e[0][r], e[1][r], 0x31));
            if (offset)
                is = _mm256_sub_epi32(is, _mm256_set1_epi32(offset * j->xs[o]));
            f[r] = _mm256_add_ps(f[r], _mm256_mul_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(d, _mm256_set1_ps(j->dx[o]))));
            if (has_m)
                f[r] = _mm256_add_ps(f[r], _mm256_mul_ps(m, _mm256_set1_ps(j->sx[o])));
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        fs_store_half_avx2(j, h, r, f[r]);
}

/* The start of a half panel: its 8 rows' pointers (from r8, row_bytes apart) and R zero sums. */
FS_FUSED256 FS_INLINE void fs_half_start_avx2(const uint8_t *r8, int64_t row_bytes, const int R,
                                              const uint8_t **rp, __m256 *f)
{
    for (int l = 0; l < 8; l++)
        rp[l] = r8 + l * row_bytes;
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        f[r] = _mm256_setzero_ps();
}

/* Q4_K / Q5_K / Q6_K / Q3_K / Q2_K on AVX2, read straight from the file's 256-blocks (whole panels;
 *   half h = rows 8h..8h+7): block jj (32 inputs) of row l as 32 unsigned bytes in one register: Q4_K
 *   the low (jj even) or high nibbles of its 32-byte chunk jj / 2; Q5_K the same | bit jj of its qh
 *   bytes as 16 (both: fs_k45_pair_dots_avx2, two blocks from one chunk); Q6_K q + 32 = the 4 low bits
 *   of ql (chunk, nibble as the decoder says) | the 2 bits of qh moved to bits 4..5 (0..63); Q3_K
 *   q + 4 = the 2 bits of its chunk jj / 4 at 2 * (jj % 4) | 4 where hmask bit jj (0..7); Q2_K q =
 *   those 2 bits alone (0..3, no offset);
 *   maddubs (pairs <= 2 * 63 * 127 < 2^15) on two rows interleaved by dwords, a transpose-reduce
 *   (fs_kq_dots_avx2) that keeps the two 128-bit halves apart, so one lane swap gives per row the
 *   dots of inputs 0..15 (lo) and 16..31 (hi):
 *     Q4_K, Q5_K: isum = lo + hi;
 *     Q6_K, Q3_K, Q2_K: isum = s0 * (lo - off * h_x) + s1 * (hi - off * (sum_x - h_x)), h_x the sum of
 *           the block's first 16 quantized inputs, off = fs_q_offset (32, 4, 0: taken back per half,
 *           then the int8 sub-scales);
 *   exact integers, then the staged kernels' float steps in their order (d * sc_j, -(dmin * mn_j) for
 *   Q4_K / Q5_K, d for Q6_K / Q3_K / Q2_K, then for Q2_K its half blocks' offsets -(dmin * mn) times
 *   d_x * h_x and d_x * (sum_x - h_x), from the 8 rows' scale bytes transposed as the staging decoder
 *   does). Q6_K / Q3_K / Q2_K here (fs_kq_half_avx2), Q4_K / Q5_K in pairs of blocks (fs_k45_half_avx2). */
FS_FUSED256 FS_INLINE __m256i fs_kq_weights_avx2(const int type, const uint8_t *blk, const int jj)
{
    const __m256i lo4 = _mm256_set1_epi8(15);
    if (type == FS_T_Q2_K) {     /* q: 2 bits of chunk jj / 4 at 2 * (jj % 4) */
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * (jj >> 2)));
        return _mm256_and_si256(_mm256_srli_epi16(ql, 2 * (jj & 3)), _mm256_set1_epi8(3));
    }
    if (type == FS_T_Q3_K) {     /* q + 4: 2 low bits of chunk jj / 4 at 2 * (jj % 4), + 4 where hmask bit jj */
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * (jj >> 2)));
        const __m256i bit = _mm256_set1_epi8((char)(1 << jj)), hm = _mm256_loadu_si256((const __m256i *)blk);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
        return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql, 2 * (jj & 3)), _mm256_set1_epi8(3)),
                               _mm256_and_si256(set, _mm256_set1_epi8(4)));
    }
    const int c = jj >> 2, t = jj & 3;
    __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * c + 32 * (t & 1)));
    __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * c));
    ql = _mm256_and_si256(t >> 1 ? _mm256_srli_epi16(ql, 4) : ql, lo4);
    /* bits 2t, 2t + 1 of each qh byte to bits 4, 5 (the bits shifted in from the neighbour byte are masked) */
    qh = t == 0 ? _mm256_slli_epi16(qh, 4) : t == 1 ? _mm256_slli_epi16(qh, 2) : t == 3 ? _mm256_srli_epi16(qh, 2) : qh;
    return _mm256_or_si256(ql, _mm256_and_si256(qh, _mm256_set1_epi8(0x30)));
}

/* Q6_K / Q3_K / Q2_K: rows rp[0..7]'s exact dots of block jj of 256-block sb with the R activation
 * rows (xd: their 32 inputs' dwords doubled, xd[r] = 0, 0, 1, 1 | 4, 4, 5, 5 and xd[FS_FUSED_MAX_N + r]
 * = 2, 2, 3, 3 | 6, 6, 7, 7): two rows' weights interleaved by dwords, so that two maddubs and one
 * 16-bit add leave both rows' partials (one row per dword, as fs_fold32_avx2 would), 16-bit while
 * they fit (Q6_K: 2 * 2 * 63 * 127 < 2^15, Q3_K: 2 * 2 * 7 * 127, Q2_K: 2 * 2 * 3 * 127), then madd;
 * lo[r], hi[r] = the dots of inputs 0..15 and 16..31 (lane l: row l). Q4_K and Q5_K do the same in
 * fs_k45_pair_dots_avx2, summing 16-bit up to the whole block (Q4_K: 8 * 2 * 15 * 127 < 2^15). */
FS_FUSED256 FS_INLINE void fs_kq_dots_avx2(const int type, const uint8_t *const *rp, int64_t at, const int jj,
                                           const __m256i *xd, const int R, __m256i *lo, __m256i *hi)
{
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i e[2][FS_FUSED_MAX_N];
#pragma GCC unroll 2
    for (int u = 0; u < 2; u++) {
        __m256i c[2][FS_FUSED_MAX_N];
#pragma GCC unroll 2
        for (int t = 0; t < 2; t++) {
            const __m256i w0 = fs_kq_weights_avx2(type, rp[4 * u + 2 * t] + at, jj);
            const __m256i w1 = fs_kq_weights_avx2(type, rp[4 * u + 2 * t + 1] + at, jj);
            const __m256i wl = _mm256_unpacklo_epi32(w0, w1), wh = _mm256_unpackhi_epi32(w0, w1);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                c[t][r] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(wl, xd[r]),
                                                             _mm256_maddubs_epi16(wh, xd[FS_FUSED_MAX_N + r])), ones);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            e[u][r] = fs_fold64_avx2(c[0][r], c[1][r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        lo[r] = _mm256_permute2x128_si256(e[0][r], e[1][r], 0x20);
        hi[r] = _mm256_permute2x128_si256(e[0][r], e[1][r], 0x31);
    }
}

FS_FUSED256 FS_INLINE void fs_kq_half_avx2(const fs_job *j, const int type, const uint8_t *rows, int64_t row_bytes,
                                           int h, fs_prefetcher *pf, const int R)
{
    const int64_t nb = j->nb, K = nb * FS_QK;
    const int64_t bb = fs_fused_block_bytes(type);
    const int32_t off = fs_q_offset(type);
    const uint8_t *r8 = rows + 8 * h * row_bytes, *rp[8];
    __m256 f[FS_FUSED_MAX_N];
    fs_half_start_avx2(r8, row_bytes, R, rp, f);
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        const int64_t at = sb * bb;
        __m256i hs[8];
        __m256 d6 = _mm256_setzero_ps(), dmin = d6;
        __m256i mns[4];
        if (type == FS_T_Q6_K) {
            fs_rows8_avx2(r8, row_bytes, at + 192, 1, hs);  /* the 16 int8 sub-scales, 4 per dword */
        } else if (type == FS_T_Q2_K) {                     /* scales (low nibbles) and mins (high) */
            fs_rows8_avx2(r8, row_bytes, at, 1, hs);
            for (int k = 0; k < 4; k++) {
                mns[k] = _mm256_and_si256(_mm256_srli_epi32(hs[k], 4), _mm256_set1_epi8(15));
                hs[k] = _mm256_and_si256(hs[k], _mm256_set1_epi8(15));
            }
        } else {                                            /* Q3_K's, as fs_fused_subscales makes them */
            __m256i sc[8];
            fs_rows8_avx2(r8, row_bytes, at + 92, 1, sc);
            for (int k = 0; k < 4; k++) {
                const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(sc[1 + (k & 1)], 4 * (k >> 1)), _mm256_set1_epi8(15));
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(sc[3], 2 * k), _mm256_set1_epi8(3));
                hs[k] = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi8(32));
            }
        }
        if (type == FS_T_Q2_K) {
            const __m256i g = fs_dword8_avx2(rp, at + 80);       /* d | dmin << 16 */
            d6 = _mm256_cvtph_ps(fs_low16x8_avx2(g));
            dmin = _mm256_cvtph_ps(fs_low16x8_avx2(_mm256_srli_epi32(g, 16)));
        } else {
            d6 = _mm256_cvtph_ps(fs_low16x8_avx2(_mm256_srli_epi32(fs_dword8_avx2(rp, at + bb - 4), 16)));
        }
#pragma GCC unroll 8
        for (int jj = 0; jj < 8; jj++) {
            const int64_t b = sb * 8 + jj;
            if ((jj & 1) == 0)
                fs_prefetch_step(pf);
            __m256i xd[2 * FS_FUSED_MAX_N], lo[FS_FUSED_MAX_N], hi[FS_FUSED_MAX_N];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(j->xq + r * K + b * FS_QK));
                xd[r] = _mm256_unpacklo_epi32(x, x);
                xd[FS_FUSED_MAX_N + r] = _mm256_unpackhi_epi32(x, x);
            }
            /* the rows' bytes loaded again for each block, not kept from the block before (a chunk
             * serves two to four blocks): held across the unrolled blocks they spilled 182 registers
             * a 256-block; the offset, opaque to the compiler, keeps it from reusing them */
            int64_t at_b = at;
            __asm__("" : "+r"(at_b));
            fs_kq_dots_avx2(type, rp, at_b, jj, xd, R, lo, hi);
            const int i0 = 2 * jj, i1 = 2 * jj + 1;     /* the half blocks' int8 sub-scales */
            const __m256i s0 = _mm256_srai_epi32(_mm256_slli_epi32(hs[i0 >> 2], 24 - 8 * (i0 & 3)), 24);
            const __m256i s1 = _mm256_srai_epi32(_mm256_slli_epi32(hs[i1 >> 2], 24 - 8 * (i1 & 3)), 24);
            __m256 m0 = d6, m1 = d6;
            if (type == FS_T_Q2_K) {     /* the halves' offsets -(dmin * min) */
                m0 = fs_neg_dmin_mn256(dmin, fs_byte256(mns[jj >> 1], (2 * jj) & 3));
                m1 = fs_neg_dmin_mn256(dmin, fs_byte256(mns[jj >> 1], (2 * jj + 1) & 3));
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const int64_t o = r * nb + b;
                const int32_t xh = j->xh[o], xs = j->xs[o];
                const __m256i is = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_sub_epi32(lo[r], _mm256_set1_epi32(off * xh)), s0),
                                                    _mm256_mullo_epi32(_mm256_sub_epi32(hi[r], _mm256_set1_epi32(off * (xs - xh))), s1));
                f[r] = _mm256_add_ps(f[r], _mm256_mul_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(d6, _mm256_set1_ps(j->dx[o]))));
                if (type == FS_T_Q2_K) {
                    const float dx = j->dx[o], sl = dx * (float)xh, sh = dx * (float)(xs - xh);
                    f[r] = _mm256_add_ps(f[r], _mm256_mul_ps(m0, _mm256_set1_ps(sl)));
                    f[r] = _mm256_add_ps(f[r], _mm256_mul_ps(m1, _mm256_set1_ps(sh)));
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        fs_store_half_avx2(j, h, r, f[r]);
}

/* Bit `bit` (0..7) of each byte of v moved to bit 4 (16), the other bits cleared: 16-bit shifts, so
 * the bits that cross from the neighbour byte are masked away. */
FS_FUSED256 FS_INLINE __m256i fs_bit_to16_avx2(__m256i v, const int bit)
{
    const __m256i m = bit <= 4 ? _mm256_slli_epi16(v, 4 - bit) : _mm256_srli_epi16(v, bit - 4);
    return _mm256_and_si256(m, _mm256_set1_epi8(0x10));
}

/* Q4_K / Q5_K, blocks 2c and 2c + 1 of 256-block `at` together: they are the low and high nibbles
 * of one 32-byte chunk (Q5_K: | bits 2c and 2c + 1 of its 32 qh bytes as 16), so each pair of rows
 * is loaded and interleaved by dwords once for both blocks (nibble and bit moves commute with dword
 * moves); then, per block, fs_kq_dots_avx2's maddubs and transpose-reduce: lane l of is[k] is row
 * l's exact isum of block 2c + k. x[k]: block 2c + k's activations, dwords doubled (xd). */
FS_FUSED256 FS_INLINE void fs_k45_pair_dots_avx2(const int type, const uint8_t *const *rp, int64_t at, const int c,
                                                 const __m256i *const x[2], const int R, __m256i *const is[2])
{
    const int five = type == FS_T_Q5_K;
    const __m256i ones = _mm256_set1_epi16(1), lo4 = _mm256_set1_epi8(15);
    __m256i e[2][2][FS_FUSED_MAX_N];        /* [block k][rows 0..3 | 4..7][activation row] */
#pragma GCC unroll 2
    for (int u = 0; u < 2; u++) {
        __m256i cs[2][2][FS_FUSED_MAX_N];   /* [block k][row pair t][activation row] */
#pragma GCC unroll 2
        for (int t = 0; t < 2; t++) {
            const uint8_t *p0 = rp[4 * u + 2 * t] + at, *p1 = rp[4 * u + 2 * t + 1] + at;
            const int qs = (five ? 48 : 16) + 32 * c;
            const __m256i q0 = _mm256_loadu_si256((const __m256i *)(p0 + qs)), q1 = _mm256_loadu_si256((const __m256i *)(p1 + qs));
            const __m256i wl = _mm256_unpacklo_epi32(q0, q1), wh = _mm256_unpackhi_epi32(q0, q1);
            __m256i hl = wl, hh = wh;
            if (five) {
                const __m256i h0 = _mm256_loadu_si256((const __m256i *)(p0 + 16)), h1 = _mm256_loadu_si256((const __m256i *)(p1 + 16));
                hl = _mm256_unpacklo_epi32(h0, h1);
                hh = _mm256_unpackhi_epi32(h0, h1);
            }
#pragma GCC unroll 2
            for (int k = 0; k < 2; k++) {   /* block 2c + k: the low (k = 0) or high nibbles, Q5_K's bit 2c + k */
                __m256i w0 = _mm256_and_si256(k ? _mm256_srli_epi16(wl, 4) : wl, lo4);
                __m256i w1 = _mm256_and_si256(k ? _mm256_srli_epi16(wh, 4) : wh, lo4);
                if (five) {
                    w0 = _mm256_or_si256(w0, fs_bit_to16_avx2(hl, 2 * c + k));
                    w1 = _mm256_or_si256(w1, fs_bit_to16_avx2(hh, 2 * c + k));
                }
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    cs[k][t][r] = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x[k][r]),
                                                   _mm256_maddubs_epi16(w1, x[k][FS_FUSED_MAX_N + r]));
            }
        }
#pragma GCC unroll 2
        for (int k = 0; k < 2; k++)
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                e[k][u][r] = _mm256_add_epi16(_mm256_unpacklo_epi64(cs[k][0][r], cs[k][1][r]),
                                              _mm256_unpackhi_epi64(cs[k][0][r], cs[k][1][r]));
    }
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256i lo = _mm256_permute2x128_si256(e[k][0][r], e[k][1][r], 0x20);
            const __m256i hi = _mm256_permute2x128_si256(e[k][0][r], e[k][1][r], 0x31);
            /* Q5_K: 16 products of up to 31 * 127 no longer fit 16 bits: widen first */
            is[k][r] = five ? _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones))
                            : _mm256_madd_epi16(_mm256_add_epi16(lo, hi), ones);
        }
}

/* Q4_K / Q5_K on AVX2: isum of each block (fs_k45_pair_dots_avx2), then the staged kernels' float steps
 * in block order (d * sc_j, -(dmin * mn_j)); the prefetch steps once per pair of blocks. */
FS_FUSED256 FS_INLINE void fs_k45_half_avx2(const fs_job *j, const int type, const uint8_t *rows, int64_t row_bytes,
                                            int h, fs_prefetcher *pf, const int R)
{
    const int64_t nb = j->nb, K = nb * FS_QK, bb = fs_fused_block_bytes(type);
    const uint8_t *r8 = rows + 8 * h * row_bytes, *rp[8];
    __m256 f[FS_FUSED_MAX_N];
    fs_half_start_avx2(r8, row_bytes, R, rp, f);
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        const int64_t at = sb * bb;
        __m256i hs[8];
        __m256 dsc[8], mneg[8];
        fs_rows8_avx2(r8, row_bytes, at, 1, hs);       /* d | dmin, scales[0..3], [4..7], [8..11] */
        fs_k45_scales_avx2(hs, _mm256_cvtph_ps(fs_low16x8_avx2(hs[0])),
                           _mm256_cvtph_ps(fs_low16x8_avx2(_mm256_srli_epi32(hs[0], 16))), dsc, mneg);
#pragma GCC unroll 1
        for (int c = 0; c < 4; c++) {
            const int64_t b = sb * 8 + 2 * c;
            fs_prefetch_step(pf);
            __m256i xd[2][2 * FS_FUSED_MAX_N], is[2][FS_FUSED_MAX_N];
#pragma GCC unroll 2
            for (int k = 0; k < 2; k++)
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(j->xq + r * K + (b + k) * FS_QK));
                    xd[k][r] = _mm256_unpacklo_epi32(x, x);
                    xd[k][FS_FUSED_MAX_N + r] = _mm256_unpackhi_epi32(x, x);
                }
            fs_k45_pair_dots_avx2(type, rp, at, c, (const __m256i *const[2]){xd[0], xd[1]}, R,
                                  (__m256i *const[2]){is[0], is[1]});
#pragma GCC unroll 2
            for (int k = 0; k < 2; k++)     /* blocks b, b + 1 in order */
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const int64_t o = r * nb + b + k;
                    f[r] = _mm256_add_ps(f[r], _mm256_mul_ps(_mm256_cvtepi32_ps(is[k][r]),
                                                             _mm256_mul_ps(dsc[2 * c + k], _mm256_set1_ps(j->dx[o]))));
                    f[r] = _mm256_add_ps(f[r], _mm256_mul_ps(mneg[2 * c + k], _mm256_set1_ps(j->sx[o])));
                }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        fs_store_half_avx2(j, h, r, f[r]);
}

FS_FUSED256 static void fs_fused_avx2(const fs_job *j, int type, const uint8_t *rows, int64_t row_bytes,
                                      const uint8_t *next)
{
    const int kq = type == FS_T_Q4_K || type == FS_T_Q5_K || FS_KQ_SUB(type);
    /* a few lines per pair of blocks of each half panel (K-quants), per block (the others) */
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, kq ? j->nb : 2 * j->nb);
    if (kq) {
        for (int h = 0; h < 2; h++) {
#define FS_Q4K(R) fs_k45_half_avx2(j, FS_T_Q4_K, rows, row_bytes, h, &pf, R)
#define FS_Q5K(R) fs_k45_half_avx2(j, FS_T_Q5_K, rows, row_bytes, h, &pf, R)
#define FS_Q6K(R) fs_kq_half_avx2(j, FS_T_Q6_K, rows, row_bytes, h, &pf, R)
#define FS_Q3K(R) fs_kq_half_avx2(j, FS_T_Q3_K, rows, row_bytes, h, &pf, R)
#define FS_Q2K(R) fs_kq_half_avx2(j, FS_T_Q2_K, rows, row_bytes, h, &pf, R)
            if (type == FS_T_Q4_K) {
                FS_FUSED_BY_N(FS_Q4K);
            } else if (type == FS_T_Q5_K) {
                FS_FUSED_BY_N(FS_Q5K);
            } else if (type == FS_T_Q3_K) {
                FS_FUSED_BY_N(FS_Q3K);
            } else if (type == FS_T_Q2_K) {
                FS_FUSED_BY_N(FS_Q2K);
            } else {
                FS_FUSED_BY_N(FS_Q6K);
            }
#undef FS_Q4K
#undef FS_Q5K
#undef FS_Q6K
#undef FS_Q3K
#undef FS_Q2K
        }
        return;
    }
    const uint8_t *rp[16];
    for (int l = 0; l < 16; l++)
        rp[l] = rows + (l < j->valid ? l : 0) * row_bytes;
    for (int h = 0; h < 2 && h * 8 < j->valid; h++) {
        /* one instance per type: no type test inside the block loop */
#define FS_HALF(T, R) fs_fused_half_avx2(j, T, rp + 8 * h, h, &pf, R)
#define FS_Q40(R) FS_HALF(FS_T_Q4_0, R)
#define FS_Q41(R) FS_HALF(FS_T_Q4_1, R)
#define FS_Q50(R) FS_HALF(FS_T_Q5_0, R)
#define FS_Q51(R) FS_HALF(FS_T_Q5_1, R)
#define FS_Q80(R) FS_HALF(FS_T_Q8_0, R)
#define FS_IQ4NL(R) FS_HALF(FS_T_IQ4_NL, R)
#define FS_IQ4XS(R) FS_HALF(FS_T_IQ4_XS, R)
#define FS_MXFP4(R) FS_HALF(FS_T_MXFP4, R)
        switch (type) {
        case FS_T_Q4_0: FS_FUSED_BY_N(FS_Q40); break;
        case FS_T_Q4_1: FS_FUSED_BY_N(FS_Q41); break;
        case FS_T_Q5_0: FS_FUSED_BY_N(FS_Q50); break;
        case FS_T_Q5_1: FS_FUSED_BY_N(FS_Q51); break;
        case FS_T_IQ4_NL: FS_FUSED_BY_N(FS_IQ4NL); break;
        case FS_T_IQ4_XS: FS_FUSED_BY_N(FS_IQ4XS); break;
        case FS_T_MXFP4: FS_FUSED_BY_N(FS_MXFP4); break;
        default: FS_FUSED_BY_N(FS_Q80); break;
        }
#undef FS_Q40
#undef FS_Q41
#undef FS_Q50
#undef FS_Q51
#undef FS_Q80
#undef FS_IQ4NL
#undef FS_IQ4XS
#undef FS_MXFP4
#undef FS_HALF
    }
}
#endif /* FS_HAVE_STAGE_AVX2 */

/* Whether the fused kernel computes a panel of valid rows of this type at n activation rows with
 * this isa (valid < 16: only the 32-input types and IQ4_XS; a K-quant's last partial panel stages). On AVX-512
 * Q6_K, Q3_K and Q2_K stop at FS_FUSED_MAX_N_K as Q4_K does (not measured apart for them). Q4_K
 * stops at FS_FUSED_MAX_N_K rows: its staging decoder is cheaper per byte than the 32-input types',
 * so the fused kernel's per-row reduction wins only below that (measured: 1.34x at n = 1, 1.04x at 2,
 * 0.87x at 4, 1 thread, 2048x2048). On AVX2 the direct K-quant kernels win at every n <= 4 (the 1 B
 * shape's Q4_K_M products, 2 threads: 2.7x at n = 1, 1.4x at 2, 1.3x at 4). IQ4_NL / IQ4_XS (any panel):
 * n <= 2 on AVX-512 (2048x2048, 1 thread, fused / staged: 1.3-1.6x at n = 1, 1.05-1.3x at 2, 0.9x at
 * 4), n = 1 on AVX2, whose signed lookup costs a vpsignb per activation row (1.2-1.25x at 1, 0.9-1.0x
 * at 2). MXFP4: as IQ4 on AVX-512 (not measured there); on AVX2, whose unsigned lookup (q + 12) needs no
 * vpsignb, n <= 2 (2048x2048, 1 thread, fused / staged, Zen 2: 1.56x at n = 1, 1.31x at 2, 1.05x at 3,
 * 0.86x at 4). */
static inline int fs_fused_ok(int isa, int type, int64_t n, int valid)
{
#if defined(FS_HAVE_FUSED_AVX512)
    if (isa == FS_ISA_AVX512VNNI && n >= 1 && n <= FS_FUSED_MAX_N &&
        (type == FS_T_Q4_0 || type == FS_T_Q4_1 || type == FS_T_Q5_0 || type == FS_T_Q5_1 || type == FS_T_Q8_0 ||
         (FS_TABLE_TYPE(type) && n <= FS_FUSED_MAX_N_IQ4) ||
         ((type == FS_T_Q4_K || type == FS_T_Q5_K || FS_KQ_SUB(type)) && valid == FS_LANES && n <= FS_FUSED_MAX_N_K)))
        return 1;
#endif
#if defined(FS_HAVE_FUSED_AVX2)
    if (isa == FS_ISA_AVX2 && n >= 1 && n <= FS_FUSED_MAX_N &&
        (type == FS_T_Q4_0 || type == FS_T_Q4_1 || type == FS_T_Q5_0 || type == FS_T_Q5_1 || type == FS_T_Q8_0 ||
         (type == FS_T_MXFP4 && n <= FS_FUSED_MAX_N_IQ4) || ((type == FS_T_IQ4_NL || type == FS_T_IQ4_XS) && n == 1) ||
         ((type == FS_T_Q4_K || type == FS_T_Q5_K || FS_KQ_SUB(type)) && valid == FS_LANES)))
        return 1;
#endif
    (void)isa; (void)type; (void)n; (void)valid;
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
#if defined(FS_HAVE_FUSED_AVX2)
    if (isa == FS_ISA_AVX2) {
        fs_fused_avx2(j, type, rows, row_bytes, next);
        return;
    }
#endif
    (void)isa; (void)type; (void)j; (void)rows; (void)row_bytes; (void)next;
}

#endif /* FASTSERVE_MATMUL_FUSED_H */
