/* The AVX2 staging decoders of _gguf_blocks.h (included at its end): the AVX-512 ones' work over two halves
 * of 8 rows, writing q + fs_stage_bias(1, type) for the AVX2 tile. */
#ifndef FASTSERVE_STAGE_AVX2_H
#define FASTSERVE_STAGE_AVX2_H
/* ---- AVX2 staging (x86 without AVX-512): the same decoders over two halves of 8 rows ----------- */
#if defined(__x86_64__) || defined(__i386__)
#define FS_HAVE_STAGE_AVX2 1
#define FS_STAGE256 __attribute__((target("avx2,f16c")))
#define FS_STAGE_INLINE static inline __attribute__((always_inline))

/* z[g] (g < 8) = [16 bytes a of row g | 16 bytes b of row g] -> out[k] = dword k of rows 0..7. */
FS_STAGE256 static inline void fs_transpose8x8_avx2(const __m256i z[8], __m256i out[8])
{
    __m256i u[8];
    for (int h = 0; h < 2; h++) {
        const __m256i *zz = z + 4 * h;
        __m256i t0 = _mm256_unpacklo_epi32(zz[0], zz[1]), t1 = _mm256_unpackhi_epi32(zz[0], zz[1]);
        __m256i t2 = _mm256_unpacklo_epi32(zz[2], zz[3]), t3 = _mm256_unpackhi_epi32(zz[2], zz[3]);
        u[4 * h + 0] = _mm256_unpacklo_epi64(t0, t2);
        u[4 * h + 1] = _mm256_unpackhi_epi64(t0, t2);
        u[4 * h + 2] = _mm256_unpacklo_epi64(t1, t3);
        u[4 * h + 3] = _mm256_unpackhi_epi64(t1, t3);
    }
    for (int k = 0; k < 4; k++) {
        out[k] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x20);
        out[k + 4] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x31);
    }
}

FS_STAGE256 static inline __m256i fs_load2x16(const uint8_t *a, const uint8_t *b)
{
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                   _mm_loadu_si128((const __m128i *)b), 1);
}

/* The f16 at byte `at` of block-relative position of each of 16 rows -> 16 floats at dst. */
FS_STAGE256 static inline void fs_f16x16_avx2(const uint8_t *rows, int64_t row_bytes, int64_t at, uint8_t *dst)
{
    uint16_t h[16];
    for (int l = 0; l < 16; l++)
        memcpy(&h[l], rows + l * row_bytes + at, 2);
    _mm256_storeu_ps((float *)dst, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)));
    _mm256_storeu_ps((float *)dst + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8))));
}

/* Bit 4 of byte j of each dword = bit 4k + j of that dword of qh (the fifth bits of the inputs
 * 4k..4k+3 of staged row k, k < 8): the byte holding them copied into the dword's 4 bytes, each
 * tested for its bit. */
FS_STAGE256 static inline __m256i fs_fifth_bits_avx2(__m256i qh, int k)
{
    const __m256i at = _mm256_add_epi8(_mm256_set1_epi8((char)(k >> 1)),
                                       _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C, 0, 0x04040404, 0x08080808, 0x0C0C0C0C));
    const __m256i bit = _mm256_set1_epi32(0x08040201 << (4 * (k & 1)));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, at), bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

/* The f16 d at byte `at` of each of 16 rows -> 16 floats at dst, and the f16 m after it -> dst_m unless NULL
 * (Q4_1, Q5_1): the dword at `at` of each row (in bounds: the blocks that start with d are longer than 4
 * bytes), its low and high halves. 16 scalar loads, not two gathers: a Zen 2 gather is some 20 ops, and the
 * panels of Q4_1 / Q8_0 staged 27 % faster (576 inputs: 533 -> 389 ns a panel, one core). */
FS_STAGE256 static inline void fs_dm16_avx2(const uint8_t *rows, int64_t row_bytes, int64_t at, uint8_t *dst,
                                            uint8_t *dst_m)
{
    const __m256i low = _mm256_set1_epi32(0xFFFF);
    int32_t w[16];
    for (int g = 0; g < 16; g++)
        memcpy(&w[g], rows + g * row_bytes + at, 4);
    const __m256i v0 = _mm256_setr_epi32(w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]);
    const __m256i v1 = _mm256_setr_epi32(w[8], w[9], w[10], w[11], w[12], w[13], w[14], w[15]);
    for (int half = 0; half < (dst_m ? 2 : 1); half++) {
        const __m256i a = half ? _mm256_srli_epi32(v0, 16) : _mm256_and_si256(v0, low);
        const __m256i b = half ? _mm256_srli_epi32(v1, 16) : _mm256_and_si256(v1, low);
        const __m256i h16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);     /* rows 0..15 in order */
        float *o = (float *)(half ? dst_m : dst);
        _mm256_storeu_ps(o, _mm256_cvtph_ps(_mm256_castsi256_si128(h16)));
        _mm256_storeu_ps(o + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h16, 1)));
    }
}

/* Q4_0 / Q4_1 / Q5_0 / Q5_1 (two blocks per transpose; Q5's 32 fifth bits before the quants) and
 * Q8_0 (one); type a constant (fs_stage_q48_avx2): no test of it per block. */
FS_STAGE256 FS_STAGE_INLINE void fs_stage_q48_type_avx2(const int type, const uint8_t *rows, int64_t row_bytes, int64_t nb,
                                                        uint8_t *stage, const uint8_t *next)
{
    const int q8 = type == FS_T_Q8_0, has_m = type == FS_T_Q4_1 || type == FS_T_Q5_1;
    const int five = type == FS_T_Q5_0 || type == FS_T_Q5_1;
    const int bb = q8 ? 34 : (has_m ? 20 : 18) + (five ? 4 : 0), qoff = (has_m ? 4 : 2) + (five ? 4 : 0), step = q8 ? 1 : 2;
    const int64_t pbb = has_m ? FS_STAGE_QM : FS_STAGE_Q;
    const __m256i low = _mm256_set1_epi8(15);
    /* stored as q + fs_stage_bias(1, type): the file's own nibbles and 5-bit values, Q8_0's int8 */
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, (nb + step - 1) / step);
    for (int64_t b = 0; b < nb; b += step) {
        const int64_t b1 = b + 1 < nb ? b + 1 : b;
        fs_prefetch_step(&pf);
        for (int h = 0; h < 2; h++) {
            __m256i z[8], t[8];
            for (int g = 0; g < 8; g++) {
                const uint8_t *r = rows + (8 * h + g) * row_bytes;
                z[g] = q8 ? fs_load2x16(r + b * bb + 2, r + b * bb + 18) : fs_load2x16(r + b * bb + qoff, r + b1 * bb + qoff);
            }
            fs_transpose8x8_avx2(z, t);
            if (q8) {
                for (int k = 0; k < 8; k++)
                    _mm256_storeu_si256((__m256i *)(stage + b * pbb + k * 64 + h * 32), t[k]);
                continue;
            }
            for (int e = 0; e < 2 && b + e < nb; e++) {
                uint8_t *pb = stage + (b + e) * pbb + h * 32;
                __m256i qh = _mm256_setzero_si256();
                if (five) {
                    uint32_t w[8];
                    for (int g = 0; g < 8; g++)
                        memcpy(&w[g], rows + (8 * h + g) * row_bytes + (b + e) * bb + qoff - 4, 4);
                    qh = _mm256_loadu_si256((const __m256i *)w);
                }
                for (int k = 0; k < 4; k++) {
                    __m256i v = t[4 * e + k];
                    __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    if (five) {
                        lo = _mm256_or_si256(lo, fs_fifth_bits_avx2(qh, k));
                        hi = _mm256_or_si256(hi, fs_fifth_bits_avx2(qh, k + 4));
                    }
                    _mm256_storeu_si256((__m256i *)(pb + k * 64), lo);
                    _mm256_storeu_si256((__m256i *)(pb + (k + 4) * 64), hi);
                }
            }
        }
        for (int e = 0; e < step && b + e < nb; e++) {
            uint8_t *pb = stage + (b + e) * pbb;
            fs_dm16_avx2(rows, row_bytes, (b + e) * bb, pb + 512, has_m ? pb + 576 : NULL);
        }
    }
}

FS_STAGE256 static void fs_stage_q48_avx2(int type, const uint8_t *rows, int64_t row_bytes, int64_t nb, uint8_t *stage,
                                          const uint8_t *next)
{
    switch (type) {
    case FS_T_Q4_0: fs_stage_q48_type_avx2(FS_T_Q4_0, rows, row_bytes, nb, stage, next); return;
    case FS_T_Q4_1: fs_stage_q48_type_avx2(FS_T_Q4_1, rows, row_bytes, nb, stage, next); return;
    case FS_T_Q5_0: fs_stage_q48_type_avx2(FS_T_Q5_0, rows, row_bytes, nb, stage, next); return;
    case FS_T_Q5_1: fs_stage_q48_type_avx2(FS_T_Q5_1, rows, row_bytes, nb, stage, next); return;
    default: fs_stage_q48_type_avx2(FS_T_Q8_0, rows, row_bytes, nb, stage, next); return;
    }
}

/* 32 bytes at byte `at` of rows 0..7 (from `rows`) -> out[k] = dword k of each; a16: only 16 bytes. */
FS_STAGE256 static inline void fs_rows8_avx2(const uint8_t *rows, int64_t row_bytes, int64_t at, int a16, __m256i out[8])
{
    __m256i z[8];
    for (int g = 0; g < 8; g++) {
        const uint8_t *r = rows + g * row_bytes + at;
        z[g] = fs_load2x16(r, a16 ? r : r + 16);
    }
    fs_transpose8x8_avx2(z, out);
}

FS_STAGE256 static inline __m256i fs_byte256(__m256i v, int byte)
{
    return _mm256_and_si256(_mm256_srli_epi32(v, 8 * byte), _mm256_set1_epi32(0xFF));
}

/* fs_neg_dmin_mn512 for 8 lanes. */
FS_STAGE256 static inline __m256 fs_neg_dmin_mn256(__m256 dmin, __m256i mn)
{
    const __m256i m = _mm256_castps_si256(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn)));
    return _mm256_castsi256_ps(_mm256_xor_si256(m, _mm256_set1_epi32((int)0x80000000u)));
}

FS_STAGE256 static inline __m256i fs_bytes_srl256(__m256i v, int s, int mask)
{
    return _mm256_and_si256(_mm256_srli_epi16(v, s), _mm256_set1_epi8((char)mask));
}

/* Byte k (0..3) of each dword of v, as a dword (one vpshufb instead of a shift and a mask). */
FS_STAGE256 static inline __m256i fs_dword_byte256(__m256i v, int k)
{
    const int z = (int)0x80808000;      /* the dword's other three bytes: zero */
    return _mm256_shuffle_epi8(v, _mm256_setr_epi32(z | k, z | (4 + k), z | (8 + k), z | (12 + k),
                                                    z | k, z | (4 + k), z | (8 + k), z | (12 + k)));
}

/* Q4_K / Q5_K: the 8 scales d * sc_j and offsets -(dmin * mn_j) of a 256-block of 8 rows from hs
 * (fs_rows8_avx2 of its first 16 bytes: d | dmin, scales[0..3], [4..7], [8..11]) and d, dmin. The
 * 6-bit values of all four j of a dword are unpacked at once, byte-wise (the bits 6, 7 of scales[0..7]
 * are the high bits of j = 4..7), then each byte widened by one vpshufb. */
FS_STAGE256 static inline void fs_k45_scales_avx2(const __m256i hs[4], __m256 d, __m256 dmin, __m256 dsc[8],
                                                  __m256 mneg[8])
{
    const __m256i m63 = _mm256_set1_epi8(63), m15 = _mm256_set1_epi8(15), m48 = _mm256_set1_epi8(48);
    const __m256i sc03 = _mm256_and_si256(hs[1], m63), mn03 = _mm256_and_si256(hs[2], m63);
    const __m256i sc47 = _mm256_or_si256(_mm256_and_si256(hs[3], m15), _mm256_and_si256(_mm256_srli_epi32(hs[1], 2), m48));
    const __m256i mn47 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(hs[3], 4), m15),
                                         _mm256_and_si256(_mm256_srli_epi32(hs[2], 2), m48));
    for (int j = 0; j < 8; j++) {
        const __m256i sc = fs_dword_byte256(j < 4 ? sc03 : sc47, j & 3), mn = fs_dword_byte256(j < 4 ? mn03 : mn47, j & 3);
        dsc[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
        mneg[j] = fs_neg_dmin_mn256(dmin, mn);
    }
}

/* Q4_K / Q5_K, as fs_stage_k45_avx512 over two halves of 8 rows, q stored as it is (fs_stage_bias(1, type) = 0). */
FS_STAGE256 static void fs_stage_k45_avx2(int five, const uint8_t *rows, int64_t row_bytes, int64_t nb,
                                          uint8_t *stage, const uint8_t *next)
{
    const int bb = five ? 176 : 144, qoff = five ? 48 : 16;
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, nb / 8);
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        fs_prefetch_step(&pf);
        float dd[16], dm[16];
        fs_f16x16_avx2(rows, row_bytes, sb * bb, (uint8_t *)dd);
        fs_f16x16_avx2(rows, row_bytes, sb * bb + 2, (uint8_t *)dm);
        for (int h = 0; h < 2; h++) {
            const uint8_t *r8 = rows + 8 * h * row_bytes;
            __m256i hs[8], qh[8];
            fs_rows8_avx2(r8, row_bytes, sb * bb, 1, hs);      /* d | dmin, scales[0..3], [4..7], [8..11] */
            __m256 dsc[8], mneg[8];
            fs_k45_scales_avx2(hs, _mm256_loadu_ps(dd + 8 * h), _mm256_loadu_ps(dm + 8 * h), dsc, mneg);
            for (int j = 0; j < 8; j++) {
                uint8_t *pb = stage + (sb * 8 + j) * FS_STAGE_QM + h * 32;
                _mm256_storeu_ps((float *)(pb + 512), dsc[j]);
                _mm256_storeu_ps((float *)(pb + 576), mneg[j]);
            }
            if (five)
                fs_rows8_avx2(r8, row_bytes, sb * bb + 16, 0, qh);
            for (int c = 0; c < 4; c++) {
                __m256i t[8];
                fs_rows8_avx2(r8, row_bytes, sb * bb + qoff + 32 * c, 0, t);
                uint8_t *p0 = stage + (sb * 8 + 2 * c) * FS_STAGE_QM + h * 32, *p1 = p0 + FS_STAGE_QM;
                for (int k = 0; k < 8; k++) {
                    __m256i lo = _mm256_and_si256(t[k], _mm256_set1_epi8(15)), hi = fs_bytes_srl256(t[k], 4, 15);
                    if (five) {
                        lo = _mm256_or_si256(lo, _mm256_slli_epi16(fs_bytes_srl256(qh[k], 2 * c, 1), 4));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi16(fs_bytes_srl256(qh[k], 2 * c + 1, 1), 4));
                    }
                    _mm256_storeu_si256((__m256i *)(p0 + k * 64), lo);
                    _mm256_storeu_si256((__m256i *)(p1 + k * 64), hi);
                }
            }
        }
    }
}

/* IQ4_XS: fs_iq4xs_scale512 for 8 rows. */
FS_STAGE256 static inline __m256 fs_iq4xs_scale_avx2(__m256i g, __m256i sl, __m256 d, int j)
{
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(sl, 4 * j), _mm256_set1_epi32(15));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(g, 16 + 2 * j), _mm256_set1_epi32(3));
    const __m256i ls = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 4));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
}

/* A table type's 16 values plus add, in both 128-bit lanes (the vpshufb table of its nibbles). */
FS_STAGE256 static inline __m256i fs_table256(int type, int add)
{
    const __m128i v = _mm_add_epi8(_mm_loadu_si128((const __m128i *)fs_table_values(type)), _mm_set1_epi8((char)add));
    return _mm256_broadcastsi128_si256(v);
}

/* MXFP4: fs_e8m0_half of 8 E8M0 bytes e (one per dword): (e - 1) << 23, or the denormal 0x00200000 << e
 * for e < 2. */
FS_STAGE256 static inline __m256 fs_e8m0_half_avx2(__m256i e)
{
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

/* MXFP4: the scales of 16 rows from their E8M0 bytes at `at`, as fs_f16x16_avx2 widens f16 ones. */
FS_STAGE256 static inline void fs_e8m0x16_avx2(const uint8_t *rows, int64_t row_bytes, int64_t at, uint8_t *dst)
{
    int32_t e[16];
    for (int l = 0; l < 16; l++)
        e[l] = rows[l * row_bytes + at];
    for (int h = 0; h < 2; h++)
        _mm256_storeu_ps((float *)dst + 8 * h, fs_e8m0_half_avx2(_mm256_loadu_si256((const __m256i *)(e + 8 * h))));
}

/* IQ4_NL / IQ4_XS / MXFP4 (the table types), as fs_stage_iq4_avx512 over two halves of 8 rows, q stored as
 * the plain int8 value (fs_stage_bias(1, IQ4) = 0: the tile's sign trick, as Q8_0) or MXFP4's q + 12. */
FS_STAGE256 static void fs_stage_iq4_avx2(int type, const uint8_t *rows, int64_t row_bytes, int64_t nb, uint8_t *stage,
                                          const uint8_t *next)
{
    const __m256i low = _mm256_set1_epi8(15), tab = fs_table256(type, fs_stage_bias(1, type));
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, (nb + 1) / 2);
    for (int64_t b = 0; b < nb; b += 2) {
        const int64_t b1 = b + 1 < nb ? b + 1 : b;
        const int64_t a0 = fs_table_qat(type, b), a1 = fs_table_qat(type, b1);
        fs_prefetch_step(&pf);
        for (int h = 0; h < 2; h++) {
            __m256i z[8], t[8];
            for (int g = 0; g < 8; g++) {
                const uint8_t *r = rows + (8 * h + g) * row_bytes;
                z[g] = fs_load2x16(r + a0, r + a1);
            }
            fs_transpose8x8_avx2(z, t);
            for (int e = 0; e < 2 && b + e < nb; e++) {
                uint8_t *pb = stage + (b + e) * FS_STAGE_Q + h * 32;
                for (int k = 0; k < 4; k++) {
                    const __m256i v = t[4 * e + k];
                    _mm256_storeu_si256((__m256i *)(pb + k * 64), _mm256_shuffle_epi8(tab, _mm256_and_si256(v, low)));
                    _mm256_storeu_si256((__m256i *)(pb + (k + 4) * 64), _mm256_shuffle_epi8(tab, fs_bytes_srl256(v, 4, 15)));
                }
            }
        }
        if (type == FS_T_IQ4_NL) {
            for (int e = 0; e < 2 && b + e < nb; e++)
                fs_f16x16_avx2(rows, row_bytes, (b + e) * 18, stage + (b + e) * FS_STAGE_Q + 512);
        } else if (type == FS_T_MXFP4) {
            for (int e = 0; e < 2 && b + e < nb; e++)
                fs_e8m0x16_avx2(rows, row_bytes, (b + e) * 17, stage + (b + e) * FS_STAGE_Q + 512);
        } else if ((b & 7) == 0) {
            uint32_t w[2][16];
            float d[16];
            fs_copy_dwords(rows, row_bytes, (b >> 3) * 136, (uint8_t *)w[0]);
            fs_copy_dwords(rows, row_bytes, (b >> 3) * 136 + 4, (uint8_t *)w[1]);
            fs_f16x16_avx2(rows, row_bytes, (b >> 3) * 136, (uint8_t *)d);
            for (int h = 0; h < 2; h++) {
                const __m256i g = _mm256_loadu_si256((const __m256i *)(w[0] + 8 * h));
                const __m256i sl = _mm256_loadu_si256((const __m256i *)(w[1] + 8 * h));
                for (int j = 0; j < 8; j++)
                    _mm256_storeu_ps((float *)(stage + (b + j) * FS_STAGE_Q + 512) + 8 * h,
                                     fs_iq4xs_scale_avx2(g, sl, _mm256_loadu_ps(d + 8 * h), j));
            }
        }
    }
}

/* Sub-block i's (0..15) signed sub-scales of 8 rows from sc (fs_rows8_avx2 of the scale bytes): Q6_K's int8
 * scales (sc[0..3]: scales[0..15]), or Q3_K's 6-bit scales - 32 (sc[1..3]: scales[0..3], [4..7], [8..11]). */
FS_STAGE256 static inline __m256i fs_subscale_avx2(const int type, const __m256i *sc, int i)
{
    if (type == FS_T_Q6_K)
        return _mm256_srai_epi32(_mm256_slli_epi32(sc[i >> 2], 24 - 8 * (i & 3)), 24);
    __m256i lo = _mm256_srli_epi32(fs_byte256(sc[1 + ((i & 7) >> 2)], i & 3), 4 * (i >> 3));
    __m256i hi = _mm256_srli_epi32(fs_byte256(sc[3], i & 3), 2 * (i >> 2));
    __m256i v = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(15)),
                                _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(3)), 4));
    return _mm256_sub_epi32(v, _mm256_set1_epi32(32));
}

/* Kind QS's scales of one half panel's 256-block (pb: its block 0, this half): d and the sub-scales s_0, s_1
 * of each of its 8 blocks. */
FS_STAGE256 static inline void fs_stage_qs_scales_avx2(const int type, const __m256i *sc, __m256 d, uint8_t *pb)
{
    for (int j = 0; j < 8; j++, pb += FS_STAGE_QS) {
        _mm256_storeu_ps((float *)(pb + 512), d);
        for (int e = 0; e < 2; e++)
            _mm256_storeu_si256((__m256i *)(pb + 576 + 64 * e), fs_subscale_avx2(type, sc, 2 * j + e));
    }
}

/* Q6_K, as fs_stage_q6k_avx512 over two halves of 8 rows, q stored as q + 32 (fs_stage_bias(1, Q6_K)): the
 * file's 6-bit values. */
FS_STAGE256 static void fs_stage_q6k_avx2(const uint8_t *rows, int64_t row_bytes, int64_t nb, uint8_t *stage,
                                          const uint8_t *next)
{
    const __m256i lo15 = _mm256_set1_epi8(15);
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, nb / 8);
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        fs_prefetch_step(&pf);
        const int64_t at = sb * 210;
        float dd[16];
        fs_f16x16_avx2(rows, row_bytes, at + 208, (uint8_t *)dd);
        for (int h = 0; h < 2; h++) {
            const uint8_t *r8 = rows + 8 * h * row_bytes;
            __m256i sc[8];
            fs_rows8_avx2(r8, row_bytes, at + 192, 1, sc);
            fs_stage_qs_scales_avx2(FS_T_Q6_K, sc, _mm256_loadu_ps(dd + 8 * h), stage + sb * 8 * FS_STAGE_QS + h * 32);
            for (int c = 0; c < 2; c++) {
                __m256i l0[8], l1[8], qh[8];
                fs_rows8_avx2(r8, row_bytes, at + 64 * c, 0, l0);
                fs_rows8_avx2(r8, row_bytes, at + 64 * c + 32, 0, l1);
                fs_rows8_avx2(r8, row_bytes, at + 128 + 32 * c, 0, qh);
                uint8_t *pb = stage + (sb * 8 + 4 * c) * FS_STAGE_QS + h * 32;
                for (int k = 0; k < 8; k++) {
                    __m256i v0 = _mm256_or_si256(_mm256_and_si256(l0[k], lo15), _mm256_slli_epi16(fs_bytes_srl256(qh[k], 0, 3), 4));
                    __m256i v1 = _mm256_or_si256(_mm256_and_si256(l1[k], lo15), _mm256_slli_epi16(fs_bytes_srl256(qh[k], 2, 3), 4));
                    __m256i v2 = _mm256_or_si256(fs_bytes_srl256(l0[k], 4, 15), _mm256_slli_epi16(fs_bytes_srl256(qh[k], 4, 3), 4));
                    __m256i v3 = _mm256_or_si256(fs_bytes_srl256(l1[k], 4, 15), _mm256_slli_epi16(fs_bytes_srl256(qh[k], 6, 3), 4));
                    _mm256_storeu_si256((__m256i *)(pb + 0 * FS_STAGE_QS + k * 64), v0);
                    _mm256_storeu_si256((__m256i *)(pb + 1 * FS_STAGE_QS + k * 64), v1);
                    _mm256_storeu_si256((__m256i *)(pb + 2 * FS_STAGE_QS + k * 64), v2);
                    _mm256_storeu_si256((__m256i *)(pb + 3 * FS_STAGE_QS + k * 64), v3);
                }
            }
        }
    }
}

/* Q3_K, as fs_stage_q3k_avx512 over two halves of 8 rows, q stored as q + 4 (fs_stage_bias(1, Q3_K)): the
 * low bits, + 4 where the hmask bit is set. */
FS_STAGE256 static void fs_stage_q3k_avx2(const uint8_t *rows, int64_t row_bytes, int64_t nb, uint8_t *stage,
                                          const uint8_t *next)
{
    const __m256i four = _mm256_set1_epi8(4);
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, nb / 8);
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        fs_prefetch_step(&pf);
        const int64_t at = sb * 110;
        float dd[16];
        fs_f16x16_avx2(rows, row_bytes, at + 108, (uint8_t *)dd);
        for (int h = 0; h < 2; h++) {
            const uint8_t *r8 = rows + 8 * h * row_bytes;
            __m256i sc[8], hm[8];
            fs_rows8_avx2(r8, row_bytes, at + 92, 1, sc);     /* sc[1..3]: scales[0..3], [4..7], [8..11] */
            fs_stage_qs_scales_avx2(FS_T_Q3_K, sc, _mm256_loadu_ps(dd + 8 * h), stage + sb * 8 * FS_STAGE_QS + h * 32);
            fs_rows8_avx2(r8, row_bytes, at, 0, hm);
            for (int c = 0; c < 2; c++) {
                __m256i ql[8];
                fs_rows8_avx2(r8, row_bytes, at + 32 + 32 * c, 0, ql);
                for (int t = 0; t < 4; t++) {
                    const int j = 4 * c + t;
                    const __m256i bit = _mm256_set1_epi8((char)(1 << j));
                    uint8_t *pb = stage + (sb * 8 + j) * FS_STAGE_QS + h * 32;
                    for (int k = 0; k < 8; k++) {
                        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hm[k], bit), bit);
                        __m256i v = _mm256_add_epi8(fs_bytes_srl256(ql[k], 2 * t, 3),
                                                    _mm256_and_si256(set, four));
                        _mm256_storeu_si256((__m256i *)(pb + k * 64), v);
                    }
                }
            }
        }
    }
}

/* Q2_K, as fs_stage_q2k_avx512 over two halves of 8 rows, q (0..3) stored as it is (fs_stage_bias(1, Q2_K) = 0). */
FS_STAGE256 static void fs_stage_q2k_avx2(const uint8_t *rows, int64_t row_bytes, int64_t nb, uint8_t *stage,
                                          const uint8_t *next)
{
    const __m256i m15 = _mm256_set1_epi32(15);
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, nb / 8);
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        fs_prefetch_step(&pf);
        const int64_t at = sb * 84;
        float dd[16], dm[16];
        fs_f16x16_avx2(rows, row_bytes, at + 80, (uint8_t *)dd);
        fs_f16x16_avx2(rows, row_bytes, at + 82, (uint8_t *)dm);
        for (int h = 0; h < 2; h++) {
            const uint8_t *r8 = rows + 8 * h * row_bytes;
            __m256i sc[8];
            fs_rows8_avx2(r8, row_bytes, at, 1, sc);          /* scales[4k .. 4k + 3] in sc[k] */
            const __m256 d = _mm256_loadu_ps(dd + 8 * h), dmin = _mm256_loadu_ps(dm + 8 * h);
            for (int j = 0; j < 8; j++) {
                uint8_t *pb = stage + (sb * 8 + j) * FS_STAGE_QSM + h * 32;
                _mm256_storeu_ps((float *)(pb + 512), d);
                for (int e = 0; e < 2; e++) {
                    const int i = 2 * j + e;
                    const __m256i byte = fs_byte256(sc[i >> 2], i & 3);
                    _mm256_storeu_si256((__m256i *)(pb + 576 + 64 * e), _mm256_and_si256(byte, m15));
                    _mm256_storeu_ps((float *)(pb + 704 + 64 * e), fs_neg_dmin_mn256(dmin, _mm256_srli_epi32(byte, 4)));
                }
            }
            for (int c = 0; c < 2; c++) {
                __m256i ql[8];
                fs_rows8_avx2(r8, row_bytes, at + 16 + 32 * c, 0, ql);
                for (int t = 0; t < 4; t++) {
                    uint8_t *pb = stage + (sb * 8 + 4 * c + t) * FS_STAGE_QSM + h * 32;
                    for (int k = 0; k < 8; k++)
                        _mm256_storeu_si256((__m256i *)(pb + k * 64), fs_bytes_srl256(ql[k], 2 * t, 3));
                }
            }
        }
    }
}
#endif

#endif /* FASTSERVE_STAGE_AVX2_H */
