/* The AVX-512BW staging decoders of _gguf_blocks.h (included at its end, after the portable decoders and
 * the prefetch helpers they use): 16 rows of a panel read as they are stored and written in the staged
 * layout that file describes, with the same bytes as fs_stage_panel_scalar. */
#ifndef FASTSERVE_STAGE_AVX512_H
#define FASTSERVE_STAGE_AVX512_H
/* ---- AVX-512BW staging ------------------------------------------------------------------------ */
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 8))
#define FS_HAVE_STAGE_AVX512 1
#define FS_STAGE512 __attribute__((target("avx512f,avx512bw,f16c")))

/* z[g] (g < 8) = [a of lane g | b of lane g | a of lane g+8 | b of lane g+8] (16 bytes each) -> out[k]
 * (k < 8) = dword k of every lane: lane l's 16 dwords a0..a3 b0..b3 transposed, 16 lanes x 8 dwords,
 * out[k] dword l = dword k of lane l. */
FS_STAGE512 static inline void fs_transpose16x8(__m512i z[8], __m512i out[8])
{
    const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int h = 0; h < 2; h++) {
        __m512i *zz = z + 4 * h;
        __m512i t0 = _mm512_unpacklo_epi32(zz[0], zz[1]), t1 = _mm512_unpackhi_epi32(zz[0], zz[1]);
        __m512i t2 = _mm512_unpacklo_epi32(zz[2], zz[3]), t3 = _mm512_unpackhi_epi32(zz[2], zz[3]);
        zz[0] = _mm512_unpacklo_epi64(t0, t2);     /* per 128-bit lane: dword 0 of the 4 lanes */
        zz[1] = _mm512_unpackhi_epi64(t0, t2);
        zz[2] = _mm512_unpacklo_epi64(t1, t3);
        zz[3] = _mm512_unpackhi_epi64(t1, t3);
    }
    for (int i = 0; i < 4; i++) {
        out[i] = _mm512_permutex2var_epi64(z[i], lo, z[4 + i]);
        out[4 + i] = _mm512_permutex2var_epi64(z[i], hi, z[4 + i]);
    }
}

FS_STAGE512 static inline __m512i fs_load4x16(const uint8_t *p0, const uint8_t *p1, const uint8_t *p2, const uint8_t *p3)
{
    /* broadcast loads merged under masks: load-port work, no shuffles */
    __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p0));
    z = _mm512_mask_broadcast_i32x4(z, 0x00F0, _mm_loadu_si128((const __m128i *)p1));
    z = _mm512_mask_broadcast_i32x4(z, 0x0F00, _mm_loadu_si128((const __m128i *)p2));
    return _mm512_mask_broadcast_i32x4(z, 0xF000, _mm_loadu_si128((const __m128i *)p3));
}

/* 16 words of two f16 each (low: d, high: m) at pb + 512 -> d float32 at pb + 512 (and m at pb + 576). */
FS_STAGE512 static inline void fs_widen_scales(uint8_t *pb, int has_m)
{
    __m512i g = _mm512_loadu_si512((const void *)(pb + 512));
    _mm512_storeu_ps((void *)(pb + 512), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)));
    if (has_m)
        _mm512_storeu_ps((void *)(pb + 576), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16))));
}

/* Byte j of dword l set where bit 4k + j of dword l of qh is (the fifth bits of the inputs
 * 4k..4k+3 of staged row k, k < 8): the byte holding them copied into the dword's 4 bytes, each
 * tested for its bit. */
FS_STAGE512 static inline __mmask64 fs_fifth_bits_mask(__m512i qh, int k)
{
    const __m512i at = _mm512_add_epi8(_mm512_set1_epi8((char)(k >> 1)),
                                       _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C)));
    return _mm512_test_epi8_mask(_mm512_shuffle_epi8(qh, at), _mm512_set1_epi32(0x08040201 << (4 * (k & 1))));
}

/* Q4_0 / Q4_1 / Q5_0 / Q5_1: two blocks per pass; the 16 quant bytes of block b sit at qoff in it,
 * Q5's 32 fifth bits (bit i: input i) before them. */
FS_STAGE512 static void fs_stage_q45_avx512(int type, const uint8_t *rows, int64_t row_bytes, int64_t nb, uint8_t *stage,
                                            const uint8_t *next)
{
    const int has_m = type == FS_T_Q4_1 || type == FS_T_Q5_1, five = type == FS_T_Q5_0 || type == FS_T_Q5_1;
    const int bb = (has_m ? 20 : 18) + (five ? 4 : 0), qoff = (has_m ? 4 : 2) + (five ? 4 : 0);
    const int64_t pbb = has_m ? FS_STAGE_QM : FS_STAGE_Q;
    const __m512i low = _mm512_set1_epi8(15);
    /* u8 = q + 128: value | 0x80 (Q4_1, Q5_1), nibble + 120 (Q4_0: q = nibble - 8), value + 112 (Q5_0) */
    const __m512i add = _mm512_set1_epi8(has_m ? (char)0x80 : five ? (char)112 : (char)120);
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, (nb + 1) / 2);
    for (int64_t b = 0; b < nb; b += 2) {
        const int64_t b1 = b + 1 < nb ? b + 1 : b;        /* an odd last block: decoded twice, kept once */
        __m512i z[8], t[8];
        fs_prefetch_step(&pf);
        for (int g = 0; g < 8; g++) {
            const uint8_t *r0 = rows + g * row_bytes, *r1 = rows + (g + 8) * row_bytes;
            z[g] = fs_load4x16(r0 + b * bb + qoff, r0 + b1 * bb + qoff, r1 + b * bb + qoff, r1 + b1 * bb + qoff);
        }
        fs_transpose16x8(z, t);
        for (int h = 0; h < 2 && b + h < nb; h++) {
            uint8_t *pb = stage + (b + h) * pbb;
            __m512i qh = _mm512_setzero_si512();
            if (five) {
                uint8_t w[64];
                fs_copy_dwords(rows, row_bytes, (b + h) * bb + qoff - 4, w);
                qh = _mm512_loadu_si512((const void *)w);
            }
            for (int k = 0; k < 8; k++) {
                __m512i v = t[4 * h + (k & 3)];
                v = _mm512_add_epi8(_mm512_and_si512(k < 4 ? v : _mm512_srli_epi16(v, 4), low), add);
                if (five)       /* + 16 where the fifth bit is set (the value's bit 4 was clear) */
                    v = _mm512_mask_add_epi8(v, fs_fifth_bits_mask(qh, k), v, _mm512_set1_epi8(16));
                _mm512_storeu_si512((void *)(pb + k * 64), v);
            }
            fs_copy_dwords(rows, row_bytes, (b + h) * bb, pb + 512);
            fs_widen_scales(pb, has_m);
        }
    }
}

/* Q8_0: one block per pass, its 32 int8 quants at byte 2. */
FS_STAGE512 static void fs_stage_q8_avx512(const uint8_t *rows, int64_t row_bytes, int64_t nb, uint8_t *stage,
                                           const uint8_t *next)
{
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, nb);
    for (int64_t b = 0; b < nb; b++) {
        __m512i z[8], t[8];
        fs_prefetch_step(&pf);
        for (int g = 0; g < 8; g++) {
            const uint8_t *r0 = rows + g * row_bytes + b * 34 + 2, *r1 = rows + (g + 8) * row_bytes + b * 34 + 2;
            z[g] = fs_load4x16(r0, r0 + 16, r1, r1 + 16);
        }
        fs_transpose16x8(z, t);
        uint8_t *pb = stage + b * FS_STAGE_Q;
        for (int k = 0; k < 8; k++)
            _mm512_storeu_si512((void *)(pb + k * 64), _mm512_xor_si512(t[k], flip));
        fs_copy_dwords(rows, row_bytes, b * 34, pb + 512);       /* d and the first two quants */
        fs_widen_scales(pb, 0);
    }
}

/* 16 bytes at byte `at` of each of the 16 rows -> out[k] (k < 4): dword k of every row. */
FS_STAGE512 static inline void fs_rows16x4(const uint8_t *rows, int64_t row_bytes, int64_t at, __m512i out[4])
{
    __m512i z[8], t[8];
    for (int g = 0; g < 8; g++) {
        const uint8_t *r0 = rows + g * row_bytes + at, *r1 = rows + (g + 8) * row_bytes + at;
        z[g] = fs_load4x16(r0, r0, r1, r1);
    }
    fs_transpose16x8(z, t);
    for (int k = 0; k < 4; k++)
        out[k] = t[k];
}

/* 32 bytes at byte `at` of each of the 16 rows -> out[k] (k < 8): dword k of every row. */
FS_STAGE512 static inline void fs_rows16x8(const uint8_t *rows, int64_t row_bytes, int64_t at, __m512i out[8])
{
    __m512i z[8];
    for (int g = 0; g < 8; g++) {
        const uint8_t *r0 = rows + g * row_bytes + at, *r1 = rows + (g + 8) * row_bytes + at;
        z[g] = fs_load4x16(r0, r0 + 16, r1, r1 + 16);
    }
    fs_transpose16x8(z, out);
}

/* Byte `byte` (0..3) of each 32-bit lane, as an int32. */
FS_STAGE512 static inline __m512i fs_byte(__m512i v, int byte)
{
    return _mm512_and_si512(_mm512_srli_epi32(v, 8 * byte), _mm512_set1_epi32(0xFF));
}

/* The offset -(dmin * mn) of Q4_K / Q5_K / Q2_K (mn: int32 lanes): the rounded product, its sign bit flipped. */
FS_STAGE512 static inline __m512 fs_neg_dmin_mn512(__m512 dmin, __m512i mn)
{
    const __m512i m = _mm512_castps_si512(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn)));
    return _mm512_castsi512_ps(_mm512_xor_si512(m, _mm512_set1_epi32((int)0x80000000u)));
}

/* Each byte shifted right by s (0..7), the bits from its neighbour cleared. */
FS_STAGE512 static inline __m512i fs_bytes_srl(__m512i v, int s, int mask)
{
    return _mm512_and_si512(_mm512_srli_epi16(v, s), _mm512_set1_epi8((char)mask));
}

/* Q4_K / Q5_K: the 8 scales d * sc_j and offsets -(dmin * mn_j) of a 256-block of 16 rows from
 * h (fs_rows16x4 of its first 16 bytes: d | dmin, scales[0..3], [4..7], [8..11]). */
FS_STAGE512 static inline void fs_k45_scales(const __m512i h[4], __m512 dsc[8], __m512 mneg[8])
{
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h[0]));
    const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h[0], 16)));
    const __m512i m63 = _mm512_set1_epi32(63), m15 = _mm512_set1_epi32(15);
    for (int j = 0; j < 8; j++) {
        __m512i sc, mn;
        if (j < 4) {
            sc = _mm512_and_si512(fs_byte(h[1], j), m63);
            mn = _mm512_and_si512(fs_byte(h[2], j), m63);
        } else {
            __m512i lo = fs_byte(h[3], j - 4);
            sc = _mm512_or_si512(_mm512_and_si512(lo, m15), _mm512_slli_epi32(_mm512_srli_epi32(fs_byte(h[1], j - 4), 6), 4));
            mn = _mm512_or_si512(_mm512_srli_epi32(lo, 4), _mm512_slli_epi32(_mm512_srli_epi32(fs_byte(h[2], j - 4), 6), 4));
        }
        dsc[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
        mneg[j] = fs_neg_dmin_mn512(dmin, mn);
    }
}

/* Q4_K / Q5_K: per 256-block the 8 scales and mins (d * sc_j, -(dmin * mn_j)) of 16 rows, then the
 * quants two blocks (one 32-byte chunk, low and high nibbles) per transpose. */
FS_STAGE512 static void fs_stage_k45_avx512(int five, const uint8_t *rows, int64_t row_bytes, int64_t nb,
                                            uint8_t *stage, const uint8_t *next)
{
    const int bb = five ? 176 : 144, qoff = five ? 48 : 16;
    const __m512i hi80 = _mm512_set1_epi8((char)0x80);
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, nb / 8);
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        fs_prefetch_step(&pf);
        __m512i h[4], qh[8];
        __m512 dsc[8], mneg[8];
        fs_rows16x4(rows, row_bytes, sb * bb, h);
        fs_k45_scales(h, dsc, mneg);
        for (int j = 0; j < 8; j++) {
            uint8_t *pb = stage + (sb * 8 + j) * FS_STAGE_QM;
            _mm512_storeu_ps((void *)(pb + 512), dsc[j]);
            _mm512_storeu_ps((void *)(pb + 576), mneg[j]);
        }
        if (five)
            fs_rows16x8(rows, row_bytes, sb * bb + 16, qh);
        for (int c = 0; c < 4; c++) {
            __m512i t[8];
            fs_rows16x8(rows, row_bytes, sb * bb + qoff + 32 * c, t);
            uint8_t *p0 = stage + (sb * 8 + 2 * c) * FS_STAGE_QM, *p1 = p0 + FS_STAGE_QM;
            for (int k = 0; k < 8; k++) {
                __m512i lo = _mm512_and_si512(t[k], _mm512_set1_epi8(15)), hi = fs_bytes_srl(t[k], 4, 15);
                if (five) {     /* the fifth bit of block j is bit j of the qh byte */
                    lo = _mm512_or_si512(lo, _mm512_slli_epi16(fs_bytes_srl(qh[k], 2 * c, 1), 4));
                    hi = _mm512_or_si512(hi, _mm512_slli_epi16(fs_bytes_srl(qh[k], 2 * c + 1, 1), 4));
                }
                _mm512_storeu_si512((void *)(p0 + k * 64), _mm512_or_si512(lo, hi80));
                _mm512_storeu_si512((void *)(p1 + k * 64), _mm512_or_si512(hi, hi80));
            }
        }
    }
}

/* Q6_K: per 256-block d and the 16 int8 sub-scales of 16 rows, then per 128 inputs three
 * transposes (ql low half, ql high half, qh) give four blocks. */
FS_STAGE512 static void fs_stage_q6k_avx512(const uint8_t *rows, int64_t row_bytes, int64_t nb, uint8_t *stage,
                                            const uint8_t *next)
{
    const __m512i off = _mm512_set1_epi8(96);          /* u8 = (q6 - 32) + 128 */
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, nb / 8);
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        fs_prefetch_step(&pf);
        const int64_t at = sb * 210;
        __m512i sc[4];
        fs_rows16x4(rows, row_bytes, at + 192, sc);      /* scales[0..15] as 4 dwords per row */
        uint16_t dh[16];                                 /* d: the block's last two bytes */
        for (int l = 0; l < 16; l++)
            memcpy(&dh[l], rows + l * row_bytes + at + 208, 2);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dh));
        for (int j = 0; j < 8; j++) {
            uint8_t *pb = stage + (sb * 8 + j) * FS_STAGE_QS;
            _mm512_storeu_ps((void *)(pb + 512), d);
            for (int h = 0; h < 2; h++) {           /* int8 scale 2j + h, sign-extended */
                const int i = 2 * j + h;
                __m512i v = _mm512_srai_epi32(_mm512_slli_epi32(sc[i >> 2], 24 - 8 * (i & 3)), 24);
                _mm512_storeu_si512((void *)(pb + 576 + 64 * h), v);
            }
        }
        for (int c = 0; c < 2; c++) {
            __m512i l0[8], l1[8], qh[8];
            fs_rows16x8(rows, row_bytes, at + 64 * c, l0);
            fs_rows16x8(rows, row_bytes, at + 64 * c + 32, l1);
            fs_rows16x8(rows, row_bytes, at + 128 + 32 * c, qh);
            uint8_t *pb = stage + (sb * 8 + 4 * c) * FS_STAGE_QS;
            for (int k = 0; k < 8; k++) {
                const __m512i lo15 = _mm512_set1_epi8(15);
                __m512i v0 = _mm512_or_si512(_mm512_and_si512(l0[k], lo15), _mm512_slli_epi16(fs_bytes_srl(qh[k], 0, 3), 4));
                __m512i v1 = _mm512_or_si512(_mm512_and_si512(l1[k], lo15), _mm512_slli_epi16(fs_bytes_srl(qh[k], 2, 3), 4));
                __m512i v2 = _mm512_or_si512(fs_bytes_srl(l0[k], 4, 15), _mm512_slli_epi16(fs_bytes_srl(qh[k], 4, 3), 4));
                __m512i v3 = _mm512_or_si512(fs_bytes_srl(l1[k], 4, 15), _mm512_slli_epi16(fs_bytes_srl(qh[k], 6, 3), 4));
                _mm512_storeu_si512((void *)(pb + 0 * FS_STAGE_QS + k * 64), _mm512_add_epi8(v0, off));
                _mm512_storeu_si512((void *)(pb + 1 * FS_STAGE_QS + k * 64), _mm512_add_epi8(v1, off));
                _mm512_storeu_si512((void *)(pb + 2 * FS_STAGE_QS + k * 64), _mm512_add_epi8(v2, off));
                _mm512_storeu_si512((void *)(pb + 3 * FS_STAGE_QS + k * 64), _mm512_add_epi8(v3, off));
            }
        }
    }
}

/* IQ4_XS: the scales d * (ls_j - 32) of sub-block j of 16 rows from g (each row's first dword:
 * f16 d | scales_h << 16), sl (its second: scales_l) and d = f32(f16 d). */
FS_STAGE512 static inline __m512 fs_iq4xs_scale512(__m512i g, __m512i sl, __m512 d, int j)
{
    const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(sl, 4 * j), _mm512_set1_epi32(15));
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(g, 16 + 2 * j), _mm512_set1_epi32(3));
    const __m512i ls = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 4));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(ls, _mm512_set1_epi32(32))));
}

/* A table type's 16 values plus add, as bytes in each 128-bit lane (the vpshufb table of its nibbles). */
FS_STAGE512 static inline __m512i fs_table512(int type, int add)
{
    const __m128i v = _mm_add_epi8(_mm_loadu_si128((const __m128i *)fs_table_values(type)), _mm_set1_epi8((char)add));
    return _mm512_broadcast_i32x4(v);
}

/* MXFP4: fs_e8m0_half of 16 E8M0 bytes e (one per dword): (e - 1) << 23, or the denormal 0x00200000 << e
 * for e < 2. */
FS_STAGE512 static inline __m512 fs_e8m0_half512(__m512i e)
{
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(normal, _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2)), tiny));
}

/* IQ4_NL / IQ4_XS / MXFP4 (the table types): two blocks per pass as fs_stage_q45_avx512 reads Q4_0, each
 * nibble looked up as q + 128 (one vpshufb per 64); IQ4_XS's 8 sub-block scales per 256-block of the 16 rows. */
FS_STAGE512 static void fs_stage_iq4_avx512(int type, const uint8_t *rows, int64_t row_bytes, int64_t nb, uint8_t *stage,
                                            const uint8_t *next)
{
    const __m512i low = _mm512_set1_epi8(15), tab = fs_table512(type, 128);
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, (nb + 1) / 2);
    for (int64_t b = 0; b < nb; b += 2) {
        const int64_t b1 = b + 1 < nb ? b + 1 : b;        /* an odd last block (IQ4_NL): decoded twice, kept once */
        const int64_t a0 = fs_table_qat(type, b), a1 = fs_table_qat(type, b1);
        __m512i z[8], t[8];
        fs_prefetch_step(&pf);
        for (int g = 0; g < 8; g++) {
            const uint8_t *r0 = rows + g * row_bytes, *r1 = rows + (g + 8) * row_bytes;
            z[g] = fs_load4x16(r0 + a0, r0 + a1, r1 + a0, r1 + a1);
        }
        fs_transpose16x8(z, t);
        for (int h = 0; h < 2 && b + h < nb; h++) {
            uint8_t *pb = stage + (b + h) * FS_STAGE_Q;
            for (int k = 0; k < 8; k++) {
                const __m512i v = t[4 * h + (k & 3)];
                _mm512_storeu_si512((void *)(pb + k * 64),
                                    _mm512_shuffle_epi8(tab, _mm512_and_si512(k < 4 ? v : _mm512_srli_epi16(v, 4), low)));
            }
            if (type == FS_T_IQ4_NL) {
                fs_copy_dwords(rows, row_bytes, (b + h) * 18, pb + 512);
                fs_widen_scales(pb, 0);
            } else if (type == FS_T_MXFP4) {      /* the E8M0 byte: the low one of each dword */
                fs_copy_dwords(rows, row_bytes, (b + h) * 17, pb + 512);
                const __m512i e = _mm512_and_si512(_mm512_loadu_si512((const void *)(pb + 512)), _mm512_set1_epi32(255));
                _mm512_storeu_ps((void *)(pb + 512), fs_e8m0_half512(e));
            }
        }
        if (type == FS_T_IQ4_XS && (b & 7) == 0) {
            uint8_t w[2][64];
            fs_copy_dwords(rows, row_bytes, (b >> 3) * 136, w[0]);
            fs_copy_dwords(rows, row_bytes, (b >> 3) * 136 + 4, w[1]);
            const __m512i g = _mm512_loadu_si512((const void *)w[0]), sl = _mm512_loadu_si512((const void *)w[1]);
            const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
            for (int j = 0; j < 8; j++)
                _mm512_storeu_ps((void *)(stage + (b + j) * FS_STAGE_Q + 512), fs_iq4xs_scale512(g, sl, d, j));
        }
    }
}

/* Q3_K: per 256-block (hmask[32], qs[64], scales[12], f16 d) d and the 16 6-bit sub-scales - 32 of
 * 16 rows (the scales read as the 16 bytes ending at byte 108, d's start: no read past the block),
 * then the hmask and the two 32-byte chunks of low bits transposed once each; block j = 4c + t is
 * bits 2t of chunk c, + 4 where bit j of the hmask byte is set: u8 = (low bits) + 124 (+ 4). */
FS_STAGE512 static void fs_stage_q3k_avx512(const uint8_t *rows, int64_t row_bytes, int64_t nb, uint8_t *stage,
                                            const uint8_t *next)
{
    const __m512i base = _mm512_set1_epi8(124), four = _mm512_set1_epi8(4);
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, nb / 8);
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        fs_prefetch_step(&pf);
        const int64_t at = sb * 110;
        __m512i sc[4];
        fs_rows16x4(rows, row_bytes, at + 92, sc);     /* sc[1..3]: scales[0..3], [4..7], [8..11] */
        uint16_t dh[16];
        for (int l = 0; l < 16; l++)
            memcpy(&dh[l], rows + l * row_bytes + at + 108, 2);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dh));
        for (int j = 0; j < 8; j++) {
            uint8_t *pb = stage + (sb * 8 + j) * FS_STAGE_QS;
            _mm512_storeu_ps((void *)(pb + 512), d);
            for (int h = 0; h < 2; h++) {
                const int i = 2 * j + h;
                __m512i lo = _mm512_srli_epi32(fs_byte(sc[1 + ((i & 7) >> 2)], i & 3), 4 * (i >> 3));
                __m512i hi = _mm512_srli_epi32(fs_byte(sc[3], i & 3), 2 * (i >> 2));
                __m512i v = _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(15)),
                                            _mm512_slli_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(3)), 4));
                _mm512_storeu_si512((void *)(pb + 576 + 64 * h), _mm512_sub_epi32(v, _mm512_set1_epi32(32)));
            }
        }
        __m512i hm[8];
        fs_rows16x8(rows, row_bytes, at, hm);
        for (int c = 0; c < 2; c++) {
            __m512i ql[8];
            fs_rows16x8(rows, row_bytes, at + 32 + 32 * c, ql);
            for (int t = 0; t < 4; t++) {
                const int j = 4 * c + t;
                uint8_t *pb = stage + (sb * 8 + j) * FS_STAGE_QS;
                for (int k = 0; k < 8; k++) {
                    __m512i v = _mm512_add_epi8(fs_bytes_srl(ql[k], 2 * t, 3), base);
                    v = _mm512_mask_add_epi8(v, _mm512_test_epi8_mask(hm[k], _mm512_set1_epi8((char)(1 << j))), v, four);
                    _mm512_storeu_si512((void *)(pb + k * 64), v);
                }
            }
        }
    }
}

/* Q2_K: per 256-block (scales[16], qs[64], f16 d, f16 dmin) d, the 16 4-bit sub-scales and the
 * offsets -(dmin * min) of 16 rows, then the quants as Q3_K's low bits: u8 = q | 0x80. */
FS_STAGE512 static void fs_stage_q2k_avx512(const uint8_t *rows, int64_t row_bytes, int64_t nb, uint8_t *stage,
                                            const uint8_t *next)
{
    const __m512i m15 = _mm512_set1_epi32(15), hi80 = _mm512_set1_epi8((char)0x80);
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, nb / 8);
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        fs_prefetch_step(&pf);
        const int64_t at = sb * 84;
        __m512i sc[4];
        fs_rows16x4(rows, row_bytes, at, sc);          /* scales[4k .. 4k + 3] in sc[k] */
        uint8_t g[64];
        fs_copy_dwords(rows, row_bytes, at + 80, g);   /* d | dmin << 16 */
        const __m512i gv = _mm512_loadu_si512((const void *)g);
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(gv));
        const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(gv, 16)));
        for (int j = 0; j < 8; j++) {
            uint8_t *pb = stage + (sb * 8 + j) * FS_STAGE_QSM;
            _mm512_storeu_ps((void *)(pb + 512), d);
            for (int h = 0; h < 2; h++) {
                const int i = 2 * j + h;
                const __m512i byte = fs_byte(sc[i >> 2], i & 3);
                _mm512_storeu_si512((void *)(pb + 576 + 64 * h), _mm512_and_si512(byte, m15));
                _mm512_storeu_ps((void *)(pb + 704 + 64 * h), fs_neg_dmin_mn512(dmin, _mm512_srli_epi32(byte, 4)));
            }
        }
        for (int c = 0; c < 2; c++) {
            __m512i ql[8];
            fs_rows16x8(rows, row_bytes, at + 16 + 32 * c, ql);
            for (int t = 0; t < 4; t++) {
                uint8_t *pb = stage + (sb * 8 + 4 * c + t) * FS_STAGE_QSM;
                for (int k = 0; k < 8; k++)
                    _mm512_storeu_si512((void *)(pb + k * 64), _mm512_or_si512(fs_bytes_srl(ql[k], 2 * t, 3), hi80));
            }
        }
    }
}
#endif

#endif /* FASTSERVE_STAGE_AVX512_H */
