/* GGUF's weight blocks, decoded where the kernels read them: the C behind fastserve/backends/cpu/_matmul.pyx's
 * BlockMatrix (the NumPy twin is fastserve/backends/cpu/ref/matmul.py's decode()).
 *
 * Every supported type is, per block of 32 inputs of a row, exactly
 *     w_i = d * (s_i * q_i) + m        (q_i integer in [-128, 127]; float32 d, m)
 * with s_i = 1 and m = 0 except where said:
 *   Q4_0  q = nibble - 8                 d = f16
 *   Q4_1  q = nibble (0..15)             d, m = f16
 *   Q5_0  q = 5-bit value - 16           d = f16
 *   Q5_1  q = 5-bit value (0..31)        d, m = f16
 *   Q8_0  q = int8                       d = f16
 *   Q4_K  q = nibble, sub-block j of a 256-block with 6-bit sc_j, mn_j:
 *         d = f32(d) * sc_j, m = -(f32(dmin) * mn_j)       (the product is exact in float32)
 *   Q5_K  as Q4_K with a fifth bit, q in 0..31
 *   Q6_K  q = 6-bit value - 32, s_i = the int8 scale of its 16 inputs (two per block), d = f32(d)
 *   IQ4_NL q = kvalues[nibble] (16 int8 values, -127 .. 113)   d = f16   (Q4_0's layout)
 *   IQ4_XS q = kvalues[nibble], sub-block j of a 256-block with a 6-bit ls_j (low 4 bits from
 *         scales_l, high 2 from scales_h): d = f32(d) * (ls_j - 32)   (exact in float32)
 *   MXFP4 q = the e2m1 value of the nibble doubled (16 int8 values, -12 .. 12), d = 2^(e - 128) for the
 *         E8M0 byte e (the doubling taken back: ggml's "half" scale; 2^-128 .. 2^127, exact in float32;
 *         one byte e, then Q4_0's 16 nibble bytes: 17 bytes a block)
 *   Q3_K  q = 2 low bits - (4 where the hmask bit is clear), in -4..3, s_i = the 6-bit scale - 32 of
 *         its 16 inputs (two per block), d = f32(d)                              (kind QS, as Q6_K)
 *   Q2_K  q = 2 bits (0..3), s_i = the 4-bit scale of its 16 inputs, d = f32(d), and an offset per
 *         16 inputs: m_i = -(f32(dmin) * mn) with mn the 4-bit min of those 16   (kind QSM)
 * (m_i is one m per block except for kind QSM, whose m_0, m_1 hold for inputs 0..15 and 16..31.)
 * The products (backends/cpu/_matmul_kernels.h) take d, m and s from here and the integer dot from q, so
 * this file and the twin's decode() are the one place that knows each bit layout (ggml's block_*
 * structs). F32, F16 and BF16 rows are decoded to float32 (exact).
 *
 * Staged panel (what a kernel reads): 16 rows of a matrix (lanes; rows past the end: q = 0, d = 0,
 * m = 0, s = 0), nb panel-blocks of 32 inputs each, of fs_stage_bytes(kind) bytes:
 *   integer kinds: bytes [0, 512): byte k*64 + lane*4 + j = (uint8)(q[lane][k*4 + j] + bias), bias 128
 *                  (VNNI's unsigned layout) except for the AVX2 tile (fs_stage_bias);
 *                  [512, 576) d[lane] float32; then, kind QM: [576, 640) m[lane] float32;
 *                  kind QS: [576, 640) s[lane] of inputs 0..15, [640, 704) of inputs 16..31, int32;
 *                  kind QSM: QS's, then [704, 768) m_0[lane] (inputs 0..15), [768, 832) m_1[lane]
 *                  (16..31) float32;
 *   kind F:        [32][16] float32: input i of lane l at (i*16 + l)*4.
 * The layout of VNNI's u8 x s8 dot: one 32-bit SIMD lane per row, four inputs per lane.
 */
#ifndef FASTSERVE_GGUF_BLOCKS_H
#define FASTSERVE_GGUF_BLOCKS_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

/* ggml's type ids (gguf.GGMLQuantizationType) */
enum {
    FS_T_F32 = 0, FS_T_F16 = 1, FS_T_Q4_0 = 2, FS_T_Q4_1 = 3, FS_T_Q5_0 = 6, FS_T_Q5_1 = 7,
    FS_T_Q8_0 = 8, FS_T_Q2_K = 10, FS_T_Q3_K = 11, FS_T_Q4_K = 12, FS_T_Q5_K = 13, FS_T_Q6_K = 14,
    FS_T_IQ4_NL = 20, FS_T_IQ4_XS = 23, FS_T_BF16 = 30, FS_T_MXFP4 = 39
};

/* The table types: a nibble indexes 16 int8 values, IQ4_NL's and IQ4_XS's (ggml's kvalues_iq4nl) or
 * MXFP4's (kvalues_mxfp4: the e2m1 values 0, 0.5, 1, 1.5, 2, 3, 4, 6 doubled, then their negatives). */
static const int8_t fs_iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t fs_mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
#define FS_TABLE_TYPE(type) ((type) == FS_T_IQ4_NL || (type) == FS_T_IQ4_XS || (type) == FS_T_MXFP4)

static inline const int8_t *fs_table_values(int type)
{
    return type == FS_T_MXFP4 ? fs_mxfp4_values : fs_iq4_values;
}

/* What a kernel does with a staged panel: integer dot times d (Q), plus the offset m (QM), with two
 * integer sub-scales per block (QS), QS plus an offset per half block (QSM), or a float dot (F). */
enum { FS_KIND_Q = 0, FS_KIND_QM = 1, FS_KIND_QS = 2, FS_KIND_F = 3, FS_KIND_QSM = 4, FS_N_KINDS = 5 };

#define FS_STAGE_Q 576
#define FS_STAGE_QM 640
#define FS_STAGE_QS 704
#define FS_STAGE_F 0             /* float rows are never staged (_matmul_float.h) */
#define FS_STAGE_QSM 832

typedef struct {
    int block_inputs;      /* inputs per stored block: 1 (float types), 32 or 256 */
    int block_bytes;
    int kind;
} fs_type_info;

/* 0 and *info for a type the kernels run; -1 for any other. */
static int fs_type(int type, fs_type_info *info)
{
    switch (type) {
    case FS_T_F32:  *info = (fs_type_info){1, 4, FS_KIND_F}; return 0;
    case FS_T_F16:  *info = (fs_type_info){1, 2, FS_KIND_F}; return 0;
    case FS_T_BF16: *info = (fs_type_info){1, 2, FS_KIND_F}; return 0;
    case FS_T_Q4_0: *info = (fs_type_info){32, 18, FS_KIND_Q}; return 0;
    case FS_T_Q4_1: *info = (fs_type_info){32, 20, FS_KIND_QM}; return 0;
    case FS_T_Q5_0: *info = (fs_type_info){32, 22, FS_KIND_Q}; return 0;
    case FS_T_Q5_1: *info = (fs_type_info){32, 24, FS_KIND_QM}; return 0;
    case FS_T_Q8_0: *info = (fs_type_info){32, 34, FS_KIND_Q}; return 0;
    case FS_T_Q4_K: *info = (fs_type_info){256, 144, FS_KIND_QM}; return 0;
    case FS_T_Q5_K: *info = (fs_type_info){256, 176, FS_KIND_QM}; return 0;
    case FS_T_Q6_K: *info = (fs_type_info){256, 210, FS_KIND_QS}; return 0;
    case FS_T_IQ4_NL: *info = (fs_type_info){32, 18, FS_KIND_Q}; return 0;
    case FS_T_IQ4_XS: *info = (fs_type_info){256, 136, FS_KIND_Q}; return 0;
    case FS_T_MXFP4: *info = (fs_type_info){32, 17, FS_KIND_Q}; return 0;
    case FS_T_Q3_K: *info = (fs_type_info){256, 110, FS_KIND_QS}; return 0;
    case FS_T_Q2_K: *info = (fs_type_info){256, 84, FS_KIND_QSM}; return 0;
    default: return -1;
    }
}

/* What makes a type's q unsigned (q + off >= 0): the kernels that multiply unsigned weights add it
 * and take it back as off * sum(q_x), an exact integer. */
static inline int32_t fs_q_offset(int type)
{
    switch (type) {
    case FS_T_Q4_0: return 8;
    case FS_T_Q5_0: return 16;
    case FS_T_Q6_K: return 32;
    case FS_T_Q8_0: return 128;
    case FS_T_IQ4_NL: case FS_T_IQ4_XS: return 127;      /* -127 .. 113 -> 0 .. 240 */
    case FS_T_MXFP4: return 12;                          /* -12 .. 12 -> 0 .. 24 */
    case FS_T_Q3_K: return 4;
    default: return 0;
    }
}

/* How the AVX2 tile reads a staged type's q: the unsigned q + fs_q_offset
 * (0..15, 0..31 or 0..63; Q3_K's q + 4 0..7, Q2_K's q 0..3), in groups of G four-input steps whose
 * maddubs pair sums add up in int16 without overflow (G * 2 * max * 127 < 2^15: widened once per group,
 * not per step), the offset taken back from the exact integer dot; G = 0: q may be any int8 (Q8_0),
 * maddubs(|w|, sign(x, w)). IQ4_NL / IQ4_XS get G = 0 too: their q + 127 reaches 240, and one maddubs
 * pair, 2 * 240 * 127 = 60960, saturates int16, so they take Q8_0's sign trick. */
static inline int fs_avx2_group(int type)
{
    switch (type) {
    case FS_T_Q4_0: case FS_T_Q4_1: case FS_T_Q4_K: return 8;
    case FS_T_Q5_0: case FS_T_Q5_1: case FS_T_Q5_K: return 4;
    case FS_T_MXFP4: return 4;                     /* q + 12 <= 24: 4 * 2 * 24 * 127 < 2^15 */
    case FS_T_Q6_K: return 2;
    case FS_T_Q3_K: case FS_T_Q2_K: return 4;      /* sub-scaled: a group must not span the halves (G <= 4) */
    default: return 0;
    }
}

/* The byte a staged q is stored as, q + bias (mod 256): VNNI's unsigned q + 128 (the scalar, AVX-512 and
 * NEON kernels), or for the AVX2 tile (avx2 = 1) the maddubs operand itself, q + fs_q_offset where
 * fs_avx2_group is > 0 and the plain int8 q where it is 0 (Q8_0's sign trick): no add per weight load. */
static inline int fs_stage_bias(int avx2, int type)
{
    return !avx2 ? 128 : fs_avx2_group(type) ? (int)fs_q_offset(type) : 0;
}

static inline int64_t fs_stage_bytes(int kind)
{
    static const int64_t b[FS_N_KINDS] = {FS_STAGE_Q, FS_STAGE_QM, FS_STAGE_QS, FS_STAGE_F, FS_STAGE_QSM};
    return b[kind];
}

/* Bytes of one row of n_in inputs (n_in a multiple of the type's block). */
static inline int64_t fs_row_bytes(const fs_type_info *t, int64_t n_in)
{
    return n_in / t->block_inputs * t->block_bytes;
}

/* IEEE half -> float, exactly (denormals, inf and NaN payloads included). */
static inline float fs_f16(const uint8_t *p)
{
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    float f;
    if (e == 0) {
        f = (float)m * 0x1p-24f;            /* zero or denormal: exact */
        memcpy(&bits, &f, 4);
        bits |= s;
    } else if (e == 31) {
        bits = s | 0x7f800000u | (m << 13);
    } else {
        bits = s | ((e + 112) << 23) | (m << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

static inline float fs_bf16(const uint8_t *p)
{
    uint32_t bits = (uint32_t)(p[0] | (p[1] << 8)) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ---- one block of 32 inputs: q [32], d, m, s [2] --------------------------------------------- */

typedef struct {
    float d, m;
    int32_t s[2];
    float m1;               /* kind QSM: the offset of inputs 16..31 (m: of 0..15) */
} fs_blk;

/* Q4_K / Q5_K's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4). */
static inline void fs_scale_min_k4(int j, const uint8_t *q, int *sc, int *mn)
{
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* E8M0 byte e -> 2^(e - 128) (ggml's e8m0_to_fp32_half), exactly: the denormals 2^-128, 2^-127 for e < 2. */
static inline float fs_e8m0_half(uint8_t e)
{
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* A table type's block b: where its 16 nibble bytes sit in its row (low nibbles: inputs 0..15). */
static inline int64_t fs_table_qat(int type, int64_t b)
{
    return type == FS_T_IQ4_XS ? (b >> 3) * 136 + 8 + 16 * (b & 7) : type == FS_T_MXFP4 ? b * 17 + 1 : b * 18 + 2;
}

/* Block b (of 32 inputs) of one row's bytes. */
static void fs_decode_block(int type, const uint8_t *row, int64_t b, int8_t *q, fs_blk *o)
{
    o->m = o->m1 = 0.0f;
    o->s[0] = o->s[1] = 1;
    switch (type) {
    case FS_T_Q4_0: case FS_T_Q4_1: {
        const int has_m = type == FS_T_Q4_1;
        const uint8_t *p = row + b * (has_m ? 20 : 18), *qs = p + (has_m ? 4 : 2);
        const int off = has_m ? 0 : 8;
        o->d = fs_f16(p);
        if (has_m)
            o->m = fs_f16(p + 2);
        for (int i = 0; i < 16; i++) {
            q[i] = (int8_t)((qs[i] & 15) - off);
            q[i + 16] = (int8_t)((qs[i] >> 4) - off);
        }
        return;
    }
    case FS_T_Q5_0: case FS_T_Q5_1: {
        const int has_m = type == FS_T_Q5_1;
        const uint8_t *p = row + b * (has_m ? 24 : 22), *hp = p + (has_m ? 4 : 2), *qs = hp + 4;
        const uint32_t qh = (uint32_t)hp[0] | ((uint32_t)hp[1] << 8) | ((uint32_t)hp[2] << 16) | ((uint32_t)hp[3] << 24);
        const int off = has_m ? 0 : 16;
        o->d = fs_f16(p);
        if (has_m)
            o->m = fs_f16(p + 2);
        for (int i = 0; i < 16; i++) {
            q[i] = (int8_t)(((qs[i] & 15) | (((qh >> i) & 1) << 4)) - off);
            q[i + 16] = (int8_t)(((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - off);
        }
        return;
    }
    case FS_T_Q8_0: {
        const uint8_t *p = row + b * 34;
        o->d = fs_f16(p);
        memcpy(q, p + 2, 32);
        return;
    }
    case FS_T_Q4_K: case FS_T_Q5_K: {
        const int five = type == FS_T_Q5_K, j = (int)(b & 7);
        const uint8_t *p = row + (b >> 3) * (five ? 176 : 144);
        const uint8_t *qh = p + 16, *qs = p + (five ? 48 : 16) + 32 * (j >> 1);
        int sc, mn;
        fs_scale_min_k4(j, p + 4, &sc, &mn);
        o->d = fs_f16(p) * (float)sc;
        o->m = -(fs_f16(p + 2) * (float)mn);
        for (int i = 0; i < 32; i++) {
            int v = (qs[i] >> (4 * (j & 1))) & 15;
            if (five)
                v |= ((qh[i] >> j) & 1) << 4;
            q[i] = (int8_t)v;
        }
        return;
    }
    case FS_T_Q6_K: {
        const int j = (int)(b & 7), c = j >> 2, t = j & 3;
        const uint8_t *p = row + (b >> 3) * 210;
        const uint8_t *ql = p + 64 * c + 32 * (t & 1), *qh = p + 128 + 32 * c;
        const int8_t *sc = (const int8_t *)(p + 192);
        o->d = fs_f16(p + 208);
        o->s[0] = sc[2 * j];
        o->s[1] = sc[2 * j + 1];
        for (int i = 0; i < 32; i++)
            q[i] = (int8_t)((((ql[i] >> (4 * (t >> 1))) & 15) | (((qh[i] >> (2 * t)) & 3) << 4)) - 32);
        return;
    }
    case FS_T_IQ4_NL: case FS_T_IQ4_XS: case FS_T_MXFP4: {
        const int8_t *v = fs_table_values(type);
        const uint8_t *qs;
        if (type == FS_T_IQ4_NL) {
            o->d = fs_f16(row + b * 18);
        } else if (type == FS_T_MXFP4) {
            o->d = fs_e8m0_half(row[b * 17]);
        } else {
            const int j = (int)(b & 7);
            const uint8_t *p = row + (b >> 3) * 136;
            const int ls = ((p[4 + j / 2] >> (4 * (j & 1))) & 15) | (((p[2 + j / 4] >> (2 * (j & 3))) & 3) << 4);
            o->d = fs_f16(p) * (float)(ls - 32);          /* exact: 11 bits times 6 */
        }
        qs = row + fs_table_qat(type, b);
        for (int i = 0; i < 16; i++) {
            q[i] = v[qs[i] & 15];
            q[i + 16] = v[qs[i] >> 4];
        }
        return;
    }
    case FS_T_Q3_K: {
        /* hmask[32], qs[64], scales[12], f16 d: input l of block j = 4c + t is bits 2t of qs[32c + l],
         * minus 4 where bit j of hmask[l] is clear; sub-block i's 6-bit scale: 4 low bits in byte
         * i % 8 (high nibble for i >= 8), 2 high bits at 2 * (i / 4) of byte 8 + i % 4 */
        const int j = (int)(b & 7), c = j >> 2, t = j & 3;
        const uint8_t *p = row + (b >> 3) * 110, *qs = p + 32 + 32 * c, *sc = p + 96;
        o->d = fs_f16(p + 108);
        for (int h = 0; h < 2; h++) {
            const int i = 2 * j + h;
            o->s[h] = (((sc[i & 7] >> (4 * (i >> 3))) & 15) | (((sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3) << 4)) - 32;
        }
        for (int i = 0; i < 32; i++)
            q[i] = (int8_t)(((qs[i] >> (2 * t)) & 3) - (((p[i] >> j) & 1) ? 0 : 4));
        return;
    }
    case FS_T_Q2_K: {
        /* scales[16] (low nibble scale, high nibble min of sub-block i), qs[64] (as Q3_K's), f16 d, dmin */
        const int j = (int)(b & 7), c = j >> 2, t = j & 3;
        const uint8_t *p = row + (b >> 3) * 84, *qs = p + 16 + 32 * c;
        const float dmin = fs_f16(p + 82);
        o->d = fs_f16(p + 80);
        o->s[0] = p[2 * j] & 15;
        o->s[1] = p[2 * j + 1] & 15;
        o->m = -(dmin * (float)(p[2 * j] >> 4));
        o->m1 = -(dmin * (float)(p[2 * j + 1] >> 4));
        for (int i = 0; i < 32; i++)
            q[i] = (int8_t)((qs[i] >> (2 * t)) & 3);
        return;
    }
    default:
        memset(q, 0, 32);
        o->d = 0.0f;
        return;
    }
}

/* Input i of a float-type row. */
static inline float fs_float_at(int type, const uint8_t *row, int64_t i)
{
    if (type == FS_T_F32) {
        float f;
        memcpy(&f, row + 4 * i, 4);
        return f;
    }
    return type == FS_T_F16 ? fs_f16(row + 2 * i) : fs_bf16(row + 2 * i);
}

/* One row as float32 out [n_in]: d * (s * q) + m per input (d * q where m = 0 and s = 1). */
static void fs_dequantize_row(int type, const uint8_t *row, int64_t n_in, float *out)
{
    fs_type_info t;
    if (fs_type(type, &t) != 0)
        return;
    if (t.kind == FS_KIND_F) {
        for (int64_t i = 0; i < n_in; i++)
            out[i] = fs_float_at(type, row, i);
        return;
    }
    for (int64_t b = 0; b < n_in / 32; b++) {
        int8_t q[32];
        fs_blk o;
        fs_decode_block(type, row, b, q, &o);
        for (int i = 0; i < 32; i++) {
            float v = (float)(o.s[i >> 4] * q[i]) * o.d;
            out[b * 32 + i] = t.kind == FS_KIND_QM ? v + o.m : t.kind == FS_KIND_QSM ? v + (i < 16 ? o.m : o.m1) : v;
        }
    }
}

/* ---- staging a panel -------------------------------------------------------------------------- */

/* Rows past `valid` as q = 0, d = m = s = 0. */
static void fs_stage_clear(uint8_t *stage, int kind, int64_t nb, int valid, int bias)
{
    const int64_t pbb = fs_stage_bytes(kind);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *pb = stage + b * pbb;
        for (int k = 0; k < 8; k++)
            memset(pb + k * 64 + valid * 4, bias, (size_t)(16 - valid) * 4);
        for (int64_t off = 512; off < pbb; off += 64)
            memset(pb + off + valid * 4, 0, (size_t)(16 - valid) * 4);
    }
}

/* The portable staging: rows [0, valid) at row_bytes apart, n_in inputs (nb = ceil(n_in / 32)), q stored as
 * q + bias (fs_stage_bias). */
static void fs_stage_panel_scalar(int type, const uint8_t *rows, int64_t row_bytes, int valid,
                                  int64_t n_in, uint8_t *stage, int bias)
{
    fs_type_info t;
    fs_type(type, &t);
    const int64_t nb = (n_in + 31) / 32, pbb = fs_stage_bytes(t.kind);
    if (valid < 16)
        fs_stage_clear(stage, t.kind, nb, valid, bias);
    for (int lane = 0; lane < valid; lane++) {
        const uint8_t *row = rows + lane * row_bytes;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *pb = stage + b * pbb;
            int8_t q[32];
            fs_blk o;
            fs_decode_block(type, row, b, q, &o);
            for (int k = 0; k < 8; k++)
                for (int j = 0; j < 4; j++)
                    pb[k * 64 + lane * 4 + j] = (uint8_t)(q[k * 4 + j] + bias);
            memcpy(pb + 512 + lane * 4, &o.d, 4);
            if (t.kind == FS_KIND_QM)
                memcpy(pb + 576 + lane * 4, &o.m, 4);
            if (t.kind == FS_KIND_QS || t.kind == FS_KIND_QSM) {
                memcpy(pb + 576 + lane * 4, &o.s[0], 4);
                memcpy(pb + 640 + lane * 4, &o.s[1], 4);
            }
            if (t.kind == FS_KIND_QSM) {
                memcpy(pb + 704 + lane * 4, &o.m, 4);
                memcpy(pb + 768 + lane * 4, &o.m1, 4);
            }
        }
    }
}


/* The bytes [from, to) of the next panel into the cache while this one is decoded: its 16 rows are
 * one contiguous region, read here as 16 interleaved streams that the hardware prefetchers do not
 * follow well. */
static inline void fs_prefetch_range(const uint8_t *next, int64_t from, int64_t to)
{
    if (!next)
        return;
    for (int64_t off = from & ~(int64_t)63; off < to; off += 64)
        __builtin_prefetch(next + off, 0, 2);
}

/* The next panel's bytes [0, total) prefetched in `steps` even slices, one per call of
 * fs_prefetch_step: the slice size comes from one division per panel, not two per step. */
typedef struct {
    const uint8_t *next;
    int64_t at, per, total;
} fs_prefetcher;

static inline fs_prefetcher fs_prefetch_plan(const uint8_t *next, int64_t total, int64_t steps)
{
    fs_prefetcher p = {next, 0, 0, total};
    if (next && steps > 0)
        p.per = ((total + steps - 1) / steps + 63) & ~(int64_t)63;
    return p;
}

static inline void fs_prefetch_step(fs_prefetcher *p)
{
    if (!p->next || p->at >= p->total)
        return;
    const int64_t to = p->at + p->per < p->total ? p->at + p->per : p->total;
    for (int64_t off = p->at; off < to; off += 64)
        __builtin_prefetch(p->next + off, 0, 2);
    p->at = to;
}

/* The 4 bytes at byte `at` of block b of each of the 16 rows, copied (scalar: the load and store
 * ports are idle while the vector units transpose) to dst [16] as 32-bit words. */
static inline void fs_copy_dwords(const uint8_t *rows, int64_t row_bytes, int64_t at, uint8_t *dst)
{
    for (int l = 0; l < 16; l++)
        memcpy(dst + 4 * l, rows + l * row_bytes + at, 4);
}

/* ---- SIMD staging: the same bytes as fs_stage_panel_scalar, 16 rows at a time ------------------ */
#include "_stage_avx512.h"
#include "_stage_avx2.h"

#endif /* FASTSERVE_GGUF_BLOCKS_H */
