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
    FS_T_IQ4_NL = 20, FS_T_IQ4_XS = 23, FS_T_BF16 = 30
};

/* IQ4_NL / IQ4_XS: a nibble indexes these 16 values (ggml's kvalues_iq4nl) */
static const int8_t fs_iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* What a kernel does with a staged panel: integer dot times d (Q), plus the offset m (QM), with two
 * integer sub-scales per block (QS), QS plus an offset per half block (QSM), or a float dot (F). */
enum { FS_KIND_Q = 0, FS_KIND_QM = 1, FS_KIND_QS = 2, FS_KIND_F = 3, FS_KIND_QSM = 4, FS_N_KINDS = 5 };

#define FS_STAGE_Q 576
#define FS_STAGE_QM 640
#define FS_STAGE_QS 704
#define FS_STAGE_F 2048
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

/* IQ4_NL / IQ4_XS: where block b's 16 nibble bytes sit in its row (low nibbles: inputs 0..15). */
static inline int64_t fs_iq4_qat(int xs, int64_t b)
{
    return xs ? (b >> 3) * 136 + 8 + 16 * (b & 7) : b * 18 + 2;
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
    case FS_T_IQ4_NL: case FS_T_IQ4_XS: {
        const uint8_t *qs;
        if (type == FS_T_IQ4_NL) {
            o->d = fs_f16(row + b * 18);
        } else {
            const int j = (int)(b & 7);
            const uint8_t *p = row + (b >> 3) * 136;
            const int ls = ((p[4 + j / 2] >> (4 * (j & 1))) & 15) | (((p[2 + j / 4] >> (2 * (j & 3))) & 3) << 4);
            o->d = fs_f16(p) * (float)(ls - 32);          /* exact: 11 bits times 6 */
        }
        qs = row + fs_iq4_qat(type == FS_T_IQ4_XS, b);
        for (int i = 0; i < 16; i++) {
            q[i] = fs_iq4_values[qs[i] & 15];
            q[i + 16] = fs_iq4_values[qs[i] >> 4];
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

/* Rows past `valid` as q = 0, d = m = s = 0 (float kind: zeros). */
static void fs_stage_clear(uint8_t *stage, int kind, int64_t nb, int valid, int bias)
{
    const int64_t pbb = fs_stage_bytes(kind);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *pb = stage + b * pbb;
        if (kind == FS_KIND_F) {
            for (int i = 0; i < 32; i++)
                memset(pb + i * 64 + valid * 4, 0, (size_t)(16 - valid) * 4);
            continue;
        }
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
            if (t.kind == FS_KIND_F) {
                for (int i = 0; i < 32; i++) {
                    float v = b * 32 + i < n_in ? fs_float_at(type, row, b * 32 + i) : 0.0f;
                    memcpy(pb + (i * 16 + lane) * 4, &v, 4);
                }
                continue;
            }
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

/* The 16 IQ4 values plus add, as bytes in each 128-bit lane (the vpshufb table of the nibbles). */
FS_STAGE512 static inline __m512i fs_iq4_table512(int add)
{
    const __m128i v = _mm_add_epi8(_mm_loadu_si128((const __m128i *)fs_iq4_values), _mm_set1_epi8((char)add));
    return _mm512_broadcast_i32x4(v);
}

/* IQ4_NL / IQ4_XS: two blocks per pass as fs_stage_q45_avx512 reads Q4_0, each nibble looked up as
 * q + 128 (one vpshufb per 64); IQ4_XS's 8 sub-block scales per 256-block of the 16 rows. */
FS_STAGE512 static void fs_stage_iq4_avx512(int xs, const uint8_t *rows, int64_t row_bytes, int64_t nb, uint8_t *stage,
                                            const uint8_t *next)
{
    const __m512i low = _mm512_set1_epi8(15), tab = fs_iq4_table512(128);
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, (nb + 1) / 2);
    for (int64_t b = 0; b < nb; b += 2) {
        const int64_t b1 = b + 1 < nb ? b + 1 : b;        /* an odd last block (IQ4_NL): decoded twice, kept once */
        const int64_t a0 = fs_iq4_qat(xs, b), a1 = fs_iq4_qat(xs, b1);
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
            if (!xs) {
                fs_copy_dwords(rows, row_bytes, (b + h) * 18, pb + 512);
                fs_widen_scales(pb, 0);
            }
        }
        if (xs && (b & 7) == 0) {
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

/* F32 / F16 / BF16 (n_in a multiple of 32): 8 floats of 16 rows per transpose. */
FS_STAGE512 static void fs_stage_float_avx512(int type, const uint8_t *rows, int64_t row_bytes, int64_t nb,
                                              uint8_t *stage, const uint8_t *next)
{
    const int es = type == FS_T_F32 ? 4 : 2;
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, nb);
    for (int64_t b = 0; b < nb; b++) {
        fs_prefetch_step(&pf);
        float *pb = (float *)(stage + b * FS_STAGE_F);
        for (int64_t at = 0; at < 32 * es; at += 32) {       /* 32 bytes: 8 (F32) or 16 inputs */
            __m512i t[8];
            fs_rows16x8(rows, row_bytes, b * 32 * es + at, t);
            const int i0 = (int)(at / es);
            for (int k = 0; k < 8; k++) {
                if (type == FS_T_F32) {
                    _mm512_storeu_si512((void *)(pb + (i0 + k) * 16), t[k]);
                } else if (type == FS_T_F16) {
                    _mm512_storeu_ps(pb + (i0 + 2 * k) * 16, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(t[k])));
                    _mm512_storeu_ps(pb + (i0 + 2 * k + 1) * 16, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(t[k], 16))));
                } else {
                    _mm512_storeu_si512((void *)(pb + (i0 + 2 * k) * 16), _mm512_slli_epi32(t[k], 16));
                    _mm512_storeu_si512((void *)(pb + (i0 + 2 * k + 1) * 16), _mm512_and_si512(t[k], _mm512_set1_epi32((int)0xFFFF0000u)));
                }
            }
        }
    }
}
#endif

/* ---- AVX2 staging (x86 without AVX-512): the same decoders over two halves of 8 rows ----------- */
#if defined(__x86_64__) || defined(__i386__)
#define FS_HAVE_STAGE_AVX2 1
#define FS_STAGE256 __attribute__((target("avx2,f16c")))

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

/* Q4_0 / Q4_1 / Q5_0 / Q5_1 (two blocks per transpose; Q5's 32 fifth bits before the quants) and
 * Q8_0 (one). */
FS_STAGE256 static void fs_stage_q48_avx2(int type, const uint8_t *rows, int64_t row_bytes, int64_t nb, uint8_t *stage,
                                          const uint8_t *next)
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
            fs_f16x16_avx2(rows, row_bytes, (b + e) * bb, pb + 512);
            if (has_m)
                fs_f16x16_avx2(rows, row_bytes, (b + e) * bb + 2, pb + 576);
        }
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

/* Q4_K / Q5_K: the 8 scales d * sc_j and offsets -(dmin * mn_j) of a 256-block of 8 rows from hs
 * (fs_rows8_avx2 of its first 16 bytes: d | dmin, scales[0..3], [4..7], [8..11]) and d, dmin. */
FS_STAGE256 static inline void fs_k45_scales_avx2(const __m256i hs[4], __m256 d, __m256 dmin, __m256 dsc[8],
                                                  __m256 mneg[8])
{
    const __m256i m63 = _mm256_set1_epi32(63), m15 = _mm256_set1_epi32(15);
    for (int j = 0; j < 8; j++) {
        __m256i sc, mn;
        if (j < 4) {
            sc = _mm256_and_si256(fs_byte256(hs[1], j), m63);
            mn = _mm256_and_si256(fs_byte256(hs[2], j), m63);
        } else {
            __m256i lo = fs_byte256(hs[3], j - 4);
            sc = _mm256_or_si256(_mm256_and_si256(lo, m15), _mm256_slli_epi32(_mm256_srli_epi32(fs_byte256(hs[1], j - 4), 6), 4));
            mn = _mm256_or_si256(_mm256_srli_epi32(lo, 4), _mm256_slli_epi32(_mm256_srli_epi32(fs_byte256(hs[2], j - 4), 6), 4));
        }
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

FS_STAGE256 static inline __m256i fs_iq4_table256(int add)
{
    const __m128i v = _mm_add_epi8(_mm_loadu_si128((const __m128i *)fs_iq4_values), _mm_set1_epi8((char)add));
    return _mm256_broadcastsi128_si256(v);
}

/* IQ4_NL / IQ4_XS, as fs_stage_iq4_avx512 over two halves of 8 rows, q stored as the plain int8 value
 * (fs_stage_bias(1, IQ4) = 0: the tile's sign trick, as Q8_0). */
FS_STAGE256 static void fs_stage_iq4_avx2(int xs, const uint8_t *rows, int64_t row_bytes, int64_t nb, uint8_t *stage,
                                          const uint8_t *next)
{
    const __m256i low = _mm256_set1_epi8(15), tab = fs_iq4_table256(0);
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, (nb + 1) / 2);
    for (int64_t b = 0; b < nb; b += 2) {
        const int64_t b1 = b + 1 < nb ? b + 1 : b;
        const int64_t a0 = fs_iq4_qat(xs, b), a1 = fs_iq4_qat(xs, b1);
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
        if (!xs) {
            for (int e = 0; e < 2 && b + e < nb; e++)
                fs_f16x16_avx2(rows, row_bytes, (b + e) * 18, stage + (b + e) * FS_STAGE_Q + 512);
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
            const __m256 d = _mm256_loadu_ps(dd + 8 * h);
            for (int j = 0; j < 8; j++) {
                uint8_t *pb = stage + (sb * 8 + j) * FS_STAGE_QS + h * 32;
                _mm256_storeu_ps((float *)(pb + 512), d);
                for (int e = 0; e < 2; e++) {
                    const int i = 2 * j + e;
                    __m256i v = _mm256_srai_epi32(_mm256_slli_epi32(sc[i >> 2], 24 - 8 * (i & 3)), 24);
                    _mm256_storeu_si256((__m256i *)(pb + 576 + 64 * e), v);
                }
            }
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
            const __m256 d = _mm256_loadu_ps(dd + 8 * h);
            for (int j = 0; j < 8; j++) {
                uint8_t *pb = stage + (sb * 8 + j) * FS_STAGE_QS + h * 32;
                _mm256_storeu_ps((float *)(pb + 512), d);
                for (int e = 0; e < 2; e++) {
                    const int i = 2 * j + e;
                    __m256i lo = _mm256_srli_epi32(fs_byte256(sc[1 + ((i & 7) >> 2)], i & 3), 4 * (i >> 3));
                    __m256i hi = _mm256_srli_epi32(fs_byte256(sc[3], i & 3), 2 * (i >> 2));
                    __m256i v = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(15)),
                                                _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(3)), 4));
                    _mm256_storeu_si256((__m256i *)(pb + 576 + 64 * e), _mm256_sub_epi32(v, _mm256_set1_epi32(32)));
                }
            }
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

#endif /* FASTSERVE_GGUF_BLOCKS_H */
