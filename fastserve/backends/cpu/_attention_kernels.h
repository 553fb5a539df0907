/* Causal attention of a batch's queries over each slot's KV cache: the C behind fastserve/backends/cpu/_attention.pyx.
 *
 * KV cache types (llama-server's --cache-type-k / --cache-type-v):
 *   f32   the value as float32;
 *   f16   the value rounded to IEEE half (round to nearest even; values past 65504 become inf);
 *   q8_0  blocks of 32 values along head_dim: amax = max |x|, d = fp16(amax / 127), dq = float(d),
 *         q = clamp(rint(x / dq), -127, 127) (round half even; q = 0 when dq == 0); value = float(q) * dq.
 *         A block is stored as d (2 bytes) then q (32 int8): 34 bytes, ggml's block_q8_0 layout.
 * A head row in "row format" (one token, one KV head, D values): f32 D*4 bytes, f16 D*2, q8_0 D/32 blocks.
 *
 * Cache layout, per layer:
 *   V  uint8 [n_slots, n_ctx, Hkv, vrow]: row format (vrow = row bytes of one head row).
 *   K  uint8 [n_slots, n_tiles, Hkv, ktile]: keys in tiles of FS_KT positions (0, 64, 128, ...), each
 *      tile transposed so that one dimension d of the tile's 64 keys is contiguous, the layout the
 *      score product reads: f32/f16 [D][KT]; q8_0 the scales fp16 [D/32][KT], then q int8 [D][KT].
 *
 * Rings (ring = R > 0, a multiple of FS_KT): a sliding-window layer's cache holds only R positions per
 * slot, position p at row p mod R of V and in K tile (p / FS_KT) mod (R / FS_KT), n_ctx = R and n_tiles =
 * R / FS_KT. The caller keeps every key a query sees in the ring (R >= window + the tokens one step writes
 * into one slot - 1); the numbers below are unchanged, only where a position's row lives.
 *
 * Visible keys: a query at position pos sees the keys at positions lo .. pos, lo = 0 (window = 0: causal
 * attention) or lo = max(0, pos - window + 1) (a sliding window of `window` keys, the query's own
 * included: key p is visible iff pos - window < p <= pos).
 *
 * Numbers (the contract fastserve/backends/cpu/ref/attention.py restates in NumPy): for each batch row t and head h
 * (KV head h / G), with c = float(scale) * float(log2 e) and qs[d] = q[t, h, d] * c, the keys are taken
 * in segments of SEG = FS_SEG positions at fixed places (0, SEG, 2 SEG, ...); for each segment
 * z0 = 0, SEG, ... with lo < z0 + SEG and z0 <= pos, IN THAT ORDER:
 *   m = -inf, l = 0, acc[d] = 0; for the key tiles k0 = z0, z0 + KT, ..., z0 + SEG - KT with lo < k0 + KT
 *   and k0 <= pos, IN THAT ORDER, over the tile's visible keys j = max(k0, lo) .. min(k0 + KT - 1, pos):
 *     s_j   = 0; s_j = s_j + qs[d] * k_j[d] for d = 0, 1, ..., D-1 in that order;
 *     m'    = max(m, max_j s_j);  alpha = exp2(m - m');  p_j = exp2(s_j - m');
 *     l     = l * alpha;  acc[d] = acc[d] * alpha;
 *     then for j ascending:  acc[d] = acc[d] + p_j * v_j[d];  l = l + p_j;   m = m';
 *   then the segment's (m, l, acc) merges into the running (M, L, ACC): the first segment is taken as
 *   it is; after it  M' = max(M, m);  a = exp2(M - M');  b = exp2(m - M');  L = L * a + l * b;
 *   ACC[d] = ACC[d] * a + acc[d] * b;  M = M'.
 * With attention sinks (a learned logit per query head, gpt-oss), the sink of head h joins last as one more
 * segment of no value: sg = sink[h] * log2(e); M' = max(M, sg); a = exp2(M - M'); L = L * a + exp2(sg - M');
 * ACC[d] = ACC[d] * a; M = M' (softmax over the keys' scores and the sink, the sink's column dropped).
 * out[t, h*D + d] = ACC[d] / L.
 * exp2 is fs_exp2 below, float32 throughout; every product and sum rounded to float32, no fused
 * multiply-add (built with -ffp-contract=off). Nothing depends on the batch, the other rows, how rows
 * are grouped into work items (a row's segments may run on different threads: the merge is the same),
 * the thread count or the kernel (scalar, AVX2, AVX-512, NEON): a token's output is the same in a decode
 * step and in any prefill chunk.
 */
#ifndef FASTSERVE_ATTENTION_KERNELS_H
#define FASTSERVE_ATTENTION_KERNELS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#if defined(__x86_64__) || defined(__i386__)
#define FS_ATTN_X86 1
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#define FS_ATTN_NEON_BUILD 1
#include <arm_neon.h>
#endif

#define FS_KT 64                  /* keys per tile */
#define FS_QB 32                  /* values per q8_0 block */
#define FS_Q8_BLOCK 34            /* bytes per q8_0 block: fp16 scale + 32 int8 */
#define FS_ROWS 196               /* most query rows (tokens x heads of a KV head) in one work item (64: a
                                     verification block of 33 tokens x 3 heads took two, each converting
                                     every K / V tile to float32; 128: ~4 % less at 33, prefill ~4 %; 196: a
                                     block of up to 65 tokens x 3 heads in one, ~3 % less at 49 and 65) */
#ifndef FS_SEG                    /* (the C harness of tests/parity sets it smaller) */
#define FS_SEG 512                /* keys per segment (positions 0, 512, ...), a multiple of FS_KT */
#endif
#define FS_SUMS 8                 /* rows whose sums l run interleaved (fs_row_sums) */
#define FS_SPLIT_BELOW 4          /* fewer (token tile, KV head) items than this per thread: split by segment */
#define FS_MERGE_POOL_ROWS 8      /* a split job of this many rows merges its segments over the pool (decode
                                     rows on the caller: a pool round costs more than their merge) */
#define FS_MAX_DP 1024            /* most head_dim (padded to 16) */

enum { FS_KV_F32 = 0, FS_KV_F16 = 1, FS_KV_Q8_0 = 2 };
enum { FS_ATTN_SCALAR = 0, FS_ATTN_AVX2 = 1, FS_ATTN_AVX512 = 2, FS_ATTN_NEON = 3 };

/* ---- half precision and q8_0 ----------------------------------------------------------------- */

static inline float fs_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t fs_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* IEEE half -> float (exact). */
static inline float fs_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0x1f)
        return fs_bits_f32(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        if (m == 0)
            return fs_bits_f32(sign);
        float v = (float)m * 0x1p-24f;     /* subnormal: m * 2^-24, exact */
        return sign ? -v : v;
    }
    return fs_bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

/* float -> IEEE half, round to nearest even (overflow -> inf, NaN stays NaN). */
static inline uint16_t fs_f32_to_f16(float f)
{
    uint32_t u = fs_f32_bits(f), sign = (u >> 16) & 0x8000, a = u & 0x7fffffff;
    if (a >= 0x7f800000u)                                   /* inf, NaN */
        return (uint16_t)(sign | 0x7c00 | (a > 0x7f800000u ? 0x200 | ((a >> 13) & 0x3ff) : 0));
    if (a >= 0x477ff000u)                                   /* rounds to >= 65520: inf */
        return (uint16_t)(sign | 0x7c00);
    if (a < 0x38800000u) {                                  /* below 2^-14: subnormal half (or 0) */
        if (a < 0x33000000u)                                /* below 2^-25: rounds to 0 */
            return (uint16_t)sign;
        uint32_t e = a >> 23, m = (a & 0x7fffff) | 0x800000;
        uint32_t shift = 126 - e;                           /* 14..24: bits dropped below 2^-24 */
        uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1)))
            q++;
        return (uint16_t)(sign | q);
    }
    uint32_t q = ((a >> 13) - (112u << 10)), rem = a & 0x1fff;   /* exponent rebased, 10 mantissa bits */
    if (rem > 0x1000 || (rem == 0x1000 && (q & 1)))
        q++;                                                /* may carry into the exponent: still right */
    return (uint16_t)(sign | q);
}

/* A row of n floats -> IEEE half, fs_f32_to_f16's bits value by value. With F16C, eight at a time:
 * vcvtps2ph rounding to nearest even (the immediate, not MXCSR) gives fs_f32_to_f16's bits for every one of
 * the 2^32 floats, NaNs quieted with their payload's top bits as it does (the C harness of
 * tests/parity/test_attention.py checks them all); software value by value took ~1 % of a verification. */
static inline void fs_f16_row_sw(const float *x, int64_t n, uint8_t *out)
{
    for (int64_t d = 0; d < n; d++) {
        uint16_t h = fs_f32_to_f16(x[d]);
        memcpy(out + 2 * d, &h, 2);
    }
}

#if defined(FS_ATTN_X86) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 8))
#define FS_ATTN_F16C 1
__attribute__((target("avx,f16c"))) static void fs_f16_row_f16c(const float *x, int64_t n, uint8_t *out)
{
    int64_t d = 0;
    for (; d + 8 <= n; d += 8)
        _mm_storeu_si128((__m128i *)(out + 2 * d),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    fs_f16_row_sw(x + d, n - d, out + 2 * d);
}
#endif

static inline void fs_f16_row(const float *x, int64_t n, uint8_t *out)
{
#if defined(FS_ATTN_F16C)
    if (__builtin_cpu_supports("f16c")) {
        fs_f16_row_f16c(x, n, out);
        return;
    }
#endif
    fs_f16_row_sw(x, n, out);
}

/* rint for |v| < 2^22 under round-to-nearest-even: adding 1.5 * 2^23 leaves no fraction bits. */
static inline float fs_rintf(float v)
{
    const float magic = 12582912.0f;
    return (v + magic) - magic;
}

static inline int64_t fs_kv_row_bytes(int type, int64_t D)
{
    return type == FS_KV_F32 ? D * 4 : type == FS_KV_F16 ? D * 2 : D / FS_QB * FS_Q8_BLOCK;
}

static inline int64_t fs_k_tile_bytes(int type, int64_t D)
{
    return type == FS_KV_F32 ? D * FS_KT * 4 : type == FS_KV_F16 ? D * FS_KT * 2
         : D / FS_QB * FS_KT * 2 + D * FS_KT;
}

/* n head rows x [n, D] float32 -> row format (out: n * fs_kv_row_bytes bytes). */
static void fs_kv_encode(int type, const float *x, int64_t n, int64_t D, uint8_t *out)
{
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * D;
        uint8_t *o = out + r * fs_kv_row_bytes(type, D);
        if (type == FS_KV_F32) {
            memcpy(o, xr, (size_t)D * 4);
        } else if (type == FS_KV_F16) {
            fs_f16_row(xr, D, o);
        } else {
            for (int64_t b = 0; b < D / FS_QB; b++) {
                const float *xb = xr + b * FS_QB;
                uint8_t *ob = o + b * FS_Q8_BLOCK;
                float amax = 0.0f;
                for (int i = 0; i < FS_QB; i++) {
                    float a = fabsf(xb[i]);
                    amax = a > amax ? a : amax;
                }
                uint16_t dh = fs_f32_to_f16(amax / 127.0f);
                float dq = fs_f16_to_f32(dh);
                memcpy(ob, &dh, 2);
                for (int i = 0; i < FS_QB; i++) {
                    float v = dq != 0.0f ? fs_rintf(xb[i] / dq) : 0.0f;
                    v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
                    ob[2 + i] = (uint8_t)(int8_t)v;
                }
            }
        }
    }
}

/* The inverse: row format -> n head rows [n, D] float32 (the values attention reads). */
static void fs_kv_decode(int type, const uint8_t *in, int64_t n, int64_t D, float *x)
{
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *ir = in + r * fs_kv_row_bytes(type, D);
        float *xr = x + r * D;
        if (type == FS_KV_F32) {
            memcpy(xr, ir, (size_t)D * 4);
        } else if (type == FS_KV_F16) {
            for (int64_t d = 0; d < D; d++) {
                uint16_t h;
                memcpy(&h, ir + 2 * d, 2);
                xr[d] = fs_f16_to_f32(h);
            }
        } else {
            for (int64_t b = 0; b < D / FS_QB; b++) {
                uint16_t dh;
                memcpy(&dh, ir + b * FS_Q8_BLOCK, 2);
                float dq = fs_f16_to_f32(dh);
                for (int i = 0; i < FS_QB; i++)
                    xr[b * FS_QB + i] = (float)(int8_t)ir[b * FS_Q8_BLOCK + 2 + i] * dq;
            }
        }
    }
}

/* K tile <-> one key's head row (row format), key j of the tile. put: row -> tile; get: tile -> row. */
static void fs_k_tile_move(int type, uint8_t *tile, int64_t D, int64_t j, uint8_t *row, int put)
{
    int64_t vb = type == FS_KV_F32 ? 4 : 2;
    if (type != FS_KV_Q8_0) {
        for (int64_t d = 0; d < D; d++) {
            uint8_t *t = tile + (d * FS_KT + j) * vb, *r = row + d * vb;
            memcpy(put ? t : r, put ? r : t, (size_t)vb);
        }
        return;
    }
    uint8_t *scales = tile, *qs = tile + D / FS_QB * FS_KT * 2;
    for (int64_t b = 0; b < D / FS_QB; b++) {
        uint8_t *t = scales + (b * FS_KT + j) * 2, *r = row + b * FS_Q8_BLOCK;
        memcpy(put ? t : r, put ? r : t, 2);
        for (int i = 0; i < FS_QB; i++) {
            uint8_t *tq = qs + (b * FS_QB + i) * FS_KT + j, *rq = r + 2 + i;
            if (put) *tq = *rq; else *rq = *tq;
        }
    }
}

/* ---- exp2 ------------------------------------------------------------------------------------ */

/* 2^x for x <= 0, float32: x clamped to [-127, 0]; 0 below -126; else n = rint(x), f = x - n
 * (exact, |f| <= 1/2), p = Horner of the degree-6 Taylor polynomial of 2^f, result p * 2^n. */
/* exact float32 values (hex), so that the twin reads the same numbers */
#define FS_E1 0x1.62e430p-1f      /* ln 2 ^ k / k! */
#define FS_E2 0x1.ebfbe0p-3f
#define FS_E3 0x1.c6b08ep-5f
#define FS_E4 0x1.3b2ab6p-7f
#define FS_E5 0x1.5d87fep-10f
#define FS_E6 0x1.430912p-13f
#define FS_LOG2E 0x1.715476p+0f

static inline float fs_exp2(float x)
{
    float xc = x > -127.0f ? x : -127.0f;
    xc = xc < 0.0f ? xc : 0.0f;
    float n = fs_rintf(xc), f = xc - n;
    float p = FS_E6;
    p = p * f + FS_E5;
    p = p * f + FS_E4;
    p = p * f + FS_E3;
    p = p * f + FS_E2;
    p = p * f + FS_E1;
    p = p * f + 1.0f;
    float r = p * fs_bits_f32((uint32_t)((int32_t)n + 127) << 23);
    return x < -126.0f ? 0.0f : r;
}

/* ---- one work item: the query rows of a (token tile, KV head) against the slot's key segments --- */

typedef struct {
    const float *q;               /* [n, H, D] */
    const uint8_t *k, *v;         /* the layer's K and V caches (layouts above) */
    const int64_t *slots, *pos;   /* [n] */
    const int64_t *tile_start, *tile_len;   /* token tiles: batch rows [start, start + len), one slot */
    float *out;                   /* [n, H * D] */
    int64_t n_tiles_q, H, Hkv, D, Dp, G, n_ctx, n_ktiles;
    int64_t window;               /* 0: causal; else keys pos - window < p <= pos */
    int type_k, type_v;
    float c;                      /* scale * log2(e) */
    uint8_t *scratch;             /* n_scratch areas of scratch_bytes */
    int *scratch_busy;
    int n_scratch;
    int64_t scratch_bytes;
    const struct fs_attn_isa *isa;
    /* set by fs_attn_plan: */
    int split;                    /* 1: an item is one segment of a (token tile, KV head), see fs_attn_plan */
    int64_t n_seg;                /* most segments a token tile's rows see (a window's: from its first) */
    int64_t heads_per_item;       /* KV heads of an item: all (tiles of few tokens), a run of them, or 1 */
    float *partial;               /* split: [n][H][n_seg][2 + Dp] a segment's m, l, acc, the row's first
                                     segment (fs_attn_lo(pos) / SEG) at 0; else unused */
    int64_t ring;                 /* 0: position p at row p; else at row p mod ring (see Rings above) */
    const float *sinks;           /* [H] each query head's sink logit (natural log), or NULL: none */
} fs_attn_job;

/* The key tile an item takes next, read ahead while this tile's products run: qk's pass b over the
 * dimensions d prefetches share b of the next K tile's row d, pv's group g over the keys j share g of
 * the next tile's V row j, a line or two a step, so that the memory reads overlap the arithmetic. Without it each tile's first pass stalls on memory: V's rows lie Hkv row bytes apart, a
 * stride the hardware prefetchers do not follow across pages (3B shape, 448 keys, 1 thread: 11.3 ms
 * of a decode step's attention where it reads ahead, 7.8). Values are unaffected. */
typedef struct {
    const uint8_t *k;             /* the next K tile, k_row bytes per dimension d */
    int64_t k_row;
    const uint8_t *v;             /* the next tile's V rows: v_rows of v_run bytes, v_stride apart */
    int64_t v_stride, v_run, v_rows;
} fs_attn_next;

/* Share `part` of `parts` of a run of n bytes: its bytes [*lo, *hi), whole cache lines. */
static inline void fs_attn_share(int64_t n, int64_t part, int64_t parts, int64_t *lo, int64_t *hi)
{
    int64_t per = ((n + 63) / 64 + parts - 1) / parts * 64;
    *lo = part * per;
    *hi = *lo + per < n ? *lo + per : n;
}

static inline void fs_attn_prefetch(const uint8_t *p, int64_t lo, int64_t hi)
{
    for (int64_t b = lo; b < hi; b += 64)
        __builtin_prefetch(p + b, 0, 3);
}

/* The kernel pieces an ISA provides (see _attention_simd.h): the fp16 products in blocks of nr <= rb rows,
 * the float32 ones (qk, pv) any number of rows, one at a time. */
typedef struct fs_attn_isa {
    int rb;                                                                       /* most rows per block */
    const float *(*k_tile)(int type, const uint8_t *src, int64_t D, float *kt);   /* -> [D][KT] f32 */
    void (*v_tile)(int type, const uint8_t *src, int64_t stride, int64_t D, int64_t Dp, int64_t nk, float *vt);
    void (*qk)(const float *const *q, const float *kt, int64_t D, float *const *s, int nr, const fs_attn_next *nx);
    void (*qk_f16)(const float *const *q, const uint16_t *kt, int64_t D, float *const *s, int nr,
                   const fs_attn_next *nx);                                                    /* fp16 tile */
    void (*probs)(float *const *s, const int64_t *lo, const int64_t *n, float *const *m, float *const *l,
                  float *const *acc, int64_t Dp, int64_t na);                 /* na rows; lo: sums l too */
    void (*pv)(float *const *acc, const float *const *p, const int64_t *lo, const int64_t *n, const float *vt,
               int64_t Dp, int nr, const fs_attn_next *nx);                     /* row r: keys lo..n-1 */
    void (*pv_f16)(float *const *acc, const float *const *p, float *const *l, int64_t j0, int64_t j1,
                   const uint16_t *v, int64_t ldv, int64_t D, int nr, const fs_attn_next *nx); /* fp16 rows */
    void (*finish)(const float *acc, float l, int64_t D, float *out);
} fs_attn_isa;

/* Scratch of one running task (all float32; an item has at most ROWS rows): qs [ROWS][D], acc [ROWS][Dp], s [ROWS][KT], m, l [ROWS]
 * (a segment's state), racc [ROWS][Dp], rm, rl [ROWS] (the merged segments'), kt [D][KT], vt [KT][Dp]. */
static inline int64_t fs_attn_scratch_floats(int64_t D, int64_t Dp)
{
    return FS_ROWS * D + 2 * FS_ROWS * Dp + FS_ROWS * FS_KT + 4 * FS_ROWS + D * FS_KT + FS_KT * Dp + 64;
}

static inline int64_t fs_attn_tokens_per_item(int64_t G)
{
    return G >= FS_ROWS ? 1 : FS_ROWS / G;
}

/* First visible key of a query at position p. */
static inline int64_t fs_attn_lo(int64_t p, int64_t window)
{
    return window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

/* (rm, rl, racc) <- the segments merged so far, then this one's (m, l, acc): a row's first segment as it
 * is; after that mn = max(rm, m), a = exp2(rm - mn), b = exp2(m - mn), rl = rl * a + l * b,
 * racc[d] = racc[d] * a + acc[d] * b, rm = mn. */
static inline void fs_attn_merge_state(float *rm, float *rl, float *racc, float m, float l, const float *acc,
                                       int64_t Dp, int first)
{
    if (first) {
        *rm = m;
        *rl = l;
        memcpy(racc, acc, (size_t)Dp * 4);
        return;
    }
    float mn = m > *rm ? m : *rm;
    float a = fs_exp2(*rm - mn), b = fs_exp2(m - mn);
    *rl = *rl * a + l * b;
    for (int64_t d = 0; d < Dp; d++)
        racc[d] = racc[d] * a + acc[d] * b;
    *rm = mn;
}

/* A head's sink (natural-log logit) into its merged state (rm, rl, racc): the contract's last step. */
static inline void fs_attn_sink(float *rm, float *rl, float *racc, float sink, int64_t Dp)
{
    float sg = sink * FS_LOG2E, mn = sg > *rm ? sg : *rm;
    float a = fs_exp2(*rm - mn), b = fs_exp2(sg - mn);
    *rl = *rl * a + b;
    for (int64_t d = 0; d < Dp; d++)
        racc[d] = racc[d] * a;
    *rm = mn;
}

/* acc += p v over keys j0..j1-1 of nr rows from the fp16 cache rows (v, ldv values apart); nothing when
 * j1 <= j0. */
static inline void fs_attn_pv_f16(const fs_attn_isa *isa, float *const *a, const float *const *p, float *const *l,
                                  int64_t j0, int64_t j1, const uint8_t *v, int64_t ldv, int64_t D, int nr,
                                  const fs_attn_next *nx)
{
    if (j1 > j0)
        isa->pv_f16(a, p, l, j0, j1, (const uint16_t *)v, ldv, D, nr, nx);
}

/* Where key tile kt of KV head kvh lies in a slot's K and V caches. */
static inline void fs_attn_tile_src(const fs_attn_job *jb, int64_t slot, int64_t kt, int64_t kvh, const uint8_t **ksrc,
                                    const uint8_t **vsrc)
{
    int64_t krow = fs_k_tile_bytes(jb->type_k, jb->D), vrow = fs_kv_row_bytes(jb->type_v, jb->D);
    int64_t kslot = jb->ring ? kt % jb->n_ktiles : kt, vrow0 = jb->ring ? kt * FS_KT % jb->ring : kt * FS_KT;
    *ksrc = jb->k + ((slot * jb->n_ktiles + kslot) * jb->Hkv + kvh) * krow;
    *vsrc = jb->v + ((slot * jb->n_ctx + vrow0) * jb->Hkv + kvh) * vrow;
}

/* The rows of one key tile: those of the token tile [b0, b0 + nt) that see one of its keys, in blocks of
 * at most rb rows, from the scores to acc and l. s, m, l, acc: the segment's state per row. The tile the
 * caller takes next (next_kt, next_kvh; next_kt < 0: none) is read ahead during the products. */
static void fs_attn_key_tile(const fs_attn_job *jb, int64_t b0, int64_t nt, int64_t kvh, int64_t kt, int64_t maxpos,
                             const float *qs, float *s, float *m, float *l, float *acc, float *ktbuf, float *vt,
                             int64_t next_kt, int64_t next_kvh)
{
    const fs_attn_isa *isa = jb->isa;
    int64_t D = jb->D, Dp = jb->Dp, G = jb->G, Hkv = jb->Hkv, k0 = kt * FS_KT;
    int64_t nk = maxpos - k0 + 1 < FS_KT ? maxpos - k0 + 1 : FS_KT;    /* keys any row needs */
    const float *qp[FS_ROWS];
    float *sp[FS_ROWS], *ap[FS_ROWS], *lp[FS_ROWS], *mp[FS_ROWS];
    int64_t nk_row[FS_ROWS], lo_row[FS_ROWS];
    int64_t na = 0, rb = isa->rb;
    /* Active rows: tokens that see a key of this tile, each with its own keys lo_row .. nk_row - 1. */
    for (int64_t t = 0; t < nt; t++) {
        int64_t p = jb->pos[b0 + t], lo = fs_attn_lo(p, jb->window);
        if (p < k0 || lo >= k0 + FS_KT)
            continue;
        for (int64_t g = 0; g < G; g++) {
            int64_t r = t * G + g;
            qp[na] = qs + r * D;
            sp[na] = s + r * FS_KT;
            ap[na] = acc + r * Dp;
            lp[na] = l + r;
            mp[na] = m + r;
            nk_row[na] = p - k0 + 1 < FS_KT ? p - k0 + 1 : FS_KT;
            lo_row[na] = lo > k0 ? lo - k0 : 0;
            na++;
        }
    }
    if (na == 0)
        return;
    int64_t krow = fs_k_tile_bytes(jb->type_k, D), vrow = fs_kv_row_bytes(jb->type_v, D);
    int64_t slot = jb->slots[b0];
    const uint8_t *ksrc, *vsrc;
    fs_attn_tile_src(jb, slot, kt, kvh, &ksrc, &vsrc);
    fs_attn_next next = {NULL, krow / D, NULL, Hkv * vrow, vrow, 0}, *nx = next_kt >= 0 ? &next : NULL;
    if (nx) {
        fs_attn_tile_src(jb, slot, next_kt, next_kvh, &next.k, &next.v);
        next.v_rows = maxpos - next_kt * FS_KT + 1 < FS_KT ? maxpos - next_kt * FS_KT + 1 : FS_KT;
    }
    /* A few rows (a decode step's G heads) read the fp16 cache as they go, in one block; more rows (a
     * verification block's, a prefill chunk's) share one conversion of the tile to float32, then take it
     * row by row (fs_qk, fs_pv: fewer broadcasts per product than blocks of rows). The same values. */
    int k_direct = jb->type_k == FS_KV_F16 && na <= rb;
    int v_direct = jb->type_v == FS_KV_F16 && na <= rb && D == Dp;
    if (k_direct)
        isa->qk_f16(qp, (const uint16_t *)ksrc, D, sp, (int)na, nx);
    else
        isa->qk(qp, isa->k_tile(jb->type_k, ksrc, D, ktbuf), D, sp, (int)na, nx);
    for (int64_t i = 0; i < na; i++)
        for (int64_t j = 0; j < lo_row[i]; j++)     /* keys before the window: out of the max, p = 0 */
            sp[i][j] = -INFINITY;
    /* the sums l: fp16 blocks in pv (beside its vector work, the scalar chains cost nothing), row by row in
     * probs (eight rows' chains interleaved; in pv's row loop they cost ~8 %) */
    isa->probs(sp, v_direct ? NULL : lo_row, nk_row, mp, lp, ap, Dp, na);
    const float *const *pp = (const float *const *)sp;
    if (!v_direct) {
        isa->v_tile(jb->type_v, vsrc, Hkv * vrow, D, Dp, nk, vt);
        isa->pv(ap, pp, lo_row, nk_row, vt, Dp, (int)na, nx);
        return;
    }
    int64_t lmax = lo_row[0], nmin = nk_row[0];
    for (int64_t k = 1; k < na; k++) {
        lmax = lo_row[k] > lmax ? lo_row[k] : lmax;
        nmin = nk_row[k] < nmin ? nk_row[k] : nmin;
    }
    if (lmax >= nmin) {                             /* no key common to the rows: row by row */
        for (int64_t k = 0; k < na; k++)
            fs_attn_pv_f16(isa, ap + k, pp + k, lp + k, lo_row[k], nk_row[k], vsrc, Hkv * D, D, 1, nx);
        return;
    }
    /* keys in order: each row's own before the common ones, those of every row, each row's own after */
    for (int64_t k = 0; k < na; k++)
        fs_attn_pv_f16(isa, ap + k, pp + k, lp + k, lo_row[k], lmax, vsrc, Hkv * D, D, 1, nx);
    fs_attn_pv_f16(isa, ap, pp, lp, lmax, nmin, vsrc, Hkv * D, D, (int)na, nx);
    for (int64_t k = 0; k < na; k++)
        fs_attn_pv_f16(isa, ap + k, pp + k, lp + k, nmin, nk_row[k], vsrc, Hkv * D, D, 1, nx);
}

/* The keys some row of token tile qt sees: positions *minlo .. *maxpos. */
static inline void fs_attn_tile_keys(const fs_attn_job *jb, int64_t qt, int64_t *minlo, int64_t *maxpos)
{
    *maxpos = 0;
    *minlo = INT64_MAX;
    for (int64_t b = jb->tile_start[qt]; b < jb->tile_start[qt] + jb->tile_len[qt]; b++) {
        int64_t p = jb->pos[b], lo = fs_attn_lo(p, jb->window);
        *maxpos = p > *maxpos ? p : *maxpos;
        *minlo = lo < *minlo ? lo : *minlo;
    }
}

/* Item of a job (fs_attn_plan): token tile qt, KV heads h0 .. h0 + nh - 1 (all of them for a decode row:
 * a key tile's K and V are then read in address order, which the memory prefetchers follow), and
 * either every segment its rows see, merged here, or (split) one segment, its state left in
 * jb->partial for fs_attn_merge. Rows: r = (hh * nt + t) * G + g for KV head h0 + hh, token t. */
static void fs_attn_item(const fs_attn_job *jb, int64_t item, float *sc)
{
    int64_t D = jb->D, Dp = jb->Dp, G = jb->G, H = jb->H, W = jb->window, nh = jb->heads_per_item;
    int64_t per_tile = jb->split ? jb->n_seg : 1, groups = jb->Hkv / nh;
    int64_t h0 = item % groups * nh, qt = jb->n_tiles_q - 1 - item / groups / per_tile;   /* later (longer) tiles first */
    int64_t b0 = jb->tile_start[qt], nt = jb->tile_len[qt], ng = nt * G;   /* rows per KV head */
    int64_t rows_cap = FS_ROWS;
    float *qs = sc, *acc = qs + rows_cap * D, *s = acc + rows_cap * Dp, *m = s + rows_cap * FS_KT, *l = m + rows_cap;
    float *racc = l + rows_cap, *rm = racc + rows_cap * Dp, *rl = rm + rows_cap, *ktbuf = rl + rows_cap;
    float *vt = ktbuf + D * FS_KT;
    int64_t maxpos, minlo;
    fs_attn_tile_keys(jb, qt, &minlo, &maxpos);
    int64_t sg0 = minlo / FS_SEG, sg1 = maxpos / FS_SEG + 1;     /* segments some row sees */
    if (jb->split) {
        int64_t sg = sg0 + item / groups % per_tile;          /* counted from the tile's first segment */
        if (sg >= sg1)
            return;
        sg0 = sg;
        sg1 = sg + 1;
    }
    for (int64_t hh = 0; hh < nh; hh++)
        for (int64_t t = 0; t < nt; t++)
            for (int64_t g = 0; g < G; g++) {
                int64_t r = hh * ng + t * G + g;
                const float *qr = jb->q + ((b0 + t) * H + (h0 + hh) * G + g) * D;
                for (int64_t d = 0; d < D; d++)
                    qs[r * D + d] = qr[d] * jb->c;
            }
    for (int64_t sg = sg0; sg < sg1; sg++) {
        for (int64_t r = 0; r < nh * ng; r++) {
            memset(acc + r * Dp, 0, (size_t)Dp * 4);
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
        int64_t k_first = sg * FS_SEG > minlo ? sg * FS_SEG : minlo, k_last = (sg + 1) * FS_SEG - 1;
        k_last = k_last < maxpos ? k_last : maxpos;
        for (int64_t kt = k_first / FS_KT; kt * FS_KT <= k_last; kt++)
            for (int64_t hh = 0; hh < nh; hh++) {
                int64_t r = hh * ng, last = hh + 1 == nh, next_kt = last ? kt + 1 : kt;
                if (next_kt * FS_KT > k_last)
                    next_kt = -1;
                fs_attn_key_tile(jb, b0, nt, h0 + hh, kt, maxpos, qs + r * D, s + r * FS_KT, m + r, l + r,
                                 acc + r * Dp, ktbuf, vt, next_kt, last ? h0 : h0 + hh + 1);
            }
        for (int64_t t = 0; t < nt; t++) {             /* the rows that see this segment */
            int64_t p = jb->pos[b0 + t], rs0 = fs_attn_lo(p, W) / FS_SEG;
            if (sg < rs0 || sg > p / FS_SEG)
                continue;
            for (int64_t hh = 0; hh < nh; hh++)
                for (int64_t g = 0; g < G; g++) {
                    int64_t r = hh * ng + t * G + g, h = (h0 + hh) * G + g;
                    if (jb->split) {
                        float *pt = jb->partial + (((b0 + t) * H + h) * jb->n_seg + sg - rs0) * (2 + Dp);
                        pt[0] = m[r];
                        pt[1] = l[r];
                        memcpy(pt + 2, acc + r * Dp, (size_t)Dp * 4);
                    } else {
                        fs_attn_merge_state(rm + r, rl + r, racc + r * Dp, m[r], l[r], acc + r * Dp, Dp, sg == rs0);
                    }
                }
        }
    }
    if (jb->split)
        return;
    for (int64_t hh = 0; hh < nh; hh++)
        for (int64_t t = 0; t < nt; t++)
            for (int64_t g = 0; g < G; g++) {
                int64_t r = hh * ng + t * G + g, h = (h0 + hh) * G + g;
                if (jb->sinks)
                    fs_attn_sink(rm + r, rl + r, racc + r * Dp, jb->sinks[h], Dp);
                jb->isa->finish(racc + r * Dp, rl[r], D, jb->out + (b0 + t) * H * D + h * D);
            }
}

static void fs_attn_task(void *ctx, int64_t begin, int64_t end)
{
    fs_attn_job *jb = (fs_attn_job *)ctx;
    /* At most n_scratch tasks run at once (one per pool thread): one scratch area is always free. */
    int k = 0;
    for (;; k = (k + 1) % jb->n_scratch)
        if (!__atomic_exchange_n(&jb->scratch_busy[k], 1, __ATOMIC_ACQUIRE))
            break;
    float *sc = (float *)(jb->scratch + k * jb->scratch_bytes);
    for (int64_t i = begin; i < end; i++)
        fs_attn_item(jb, i, sc);
    __atomic_store_n(&jb->scratch_busy[k], 0, __ATOMIC_RELEASE);
}

/* The job's work items, given its token tiles: one per (token tile, KV head), or one per token tile
 * with all its KV heads when its rows fit one item (decode rows: their K and V are then read in
 * address order, which the memory prefetchers follow: ~1.3x on a 2k-token decode row here). When
 * those items are too few to keep n_scratch threads busy (a few long decode rows), one per (item,
 * key segment), split = 1, so that the threads share a row's keys: n_seg items per tile, counted from
 * the tile's first segment (a sliding window's, not position 0's: a local layer of window 512 at
 * position 32k has 1 or 2, not 64). Rows shorter than a segment have nothing to split: their KV heads
 * go to separate items in runs (Hkv / threads heads each where that divides, so that an item still
 * reads ahead from one head's tiles into the next's). Either way every row's numbers are the
 * same: only who computes a segment changes. Sets split, n_seg and heads_per_item; returns the item
 * count. A split job needs partial (fs_attn_partial_floats) and, after its items ran, fs_attn_merge. */
static int64_t fs_attn_plan(fs_attn_job *jb)
{
    int64_t longest = 0;
    jb->n_seg = 1;
    for (int64_t i = 0; i < jb->n_tiles_q; i++) {     /* a windowed tile's segments start at its window's */
        int64_t minlo, maxpos;
        fs_attn_tile_keys(jb, i, &minlo, &maxpos);
        int64_t segs = maxpos / FS_SEG - minlo / FS_SEG + 1;
        jb->n_seg = segs > jb->n_seg ? segs : jb->n_seg;
        longest = jb->tile_len[i] > longest ? jb->tile_len[i] : longest;
    }
    int threads = jb->n_scratch;
    jb->heads_per_item = longest * jb->H <= FS_ROWS ? jb->Hkv : 1;
    if (jb->n_seg == 1)             /* too few items otherwise: runs of KV heads, one per thread if they divide */
        while (jb->heads_per_item > 1 && (jb->Hkv % jb->heads_per_item
                                          || jb->n_tiles_q * (jb->Hkv / jb->heads_per_item) < threads))
            jb->heads_per_item--;
    int64_t items = jb->n_tiles_q * (jb->Hkv / jb->heads_per_item);
    jb->split = threads > 1 && jb->n_seg > 1 && items < FS_SPLIT_BELOW * threads;
    return jb->split ? items * jb->n_seg : items;
}

/* Floats of jb->partial a planned job needs (0 unless split). */
static inline int64_t fs_attn_partial_floats(const fs_attn_job *jb)
{
    int64_t n = jb->tile_start[jb->n_tiles_q - 1] + jb->tile_len[jb->n_tiles_q - 1];
    return jb->split ? n * jb->H * jb->n_seg * (2 + jb->Dp) : 0;
}

/* A split job's outputs of units [begin, end), unit b * H + h the (row b, head h): its segments merged in
 * segment order, then acc / l. Units are independent: any split of them over threads gives the same bits. */
static void fs_attn_merge_task(void *ctx, int64_t begin, int64_t end)
{
    const fs_attn_job *jb = (const fs_attn_job *)ctx;
    int64_t H = jb->H, D = jb->D, Dp = jb->Dp;
    float racc[FS_MAX_DP], rm = 0.0f, rl = 0.0f;
    for (int64_t u = begin; u < end; u++) {
        int64_t b = u / H, h = u % H, p = jb->pos[b], rs0 = fs_attn_lo(p, jb->window) / FS_SEG;
        const float *pt = jb->partial + u * jb->n_seg * (2 + Dp);
        for (int64_t i = 0; i <= p / FS_SEG - rs0; i++)       /* the row's segments, from its first */
            fs_attn_merge_state(&rm, &rl, racc, pt[i * (2 + Dp)], pt[i * (2 + Dp) + 1], pt + i * (2 + Dp) + 2,
                                Dp, i == 0);
        if (jb->sinks)
            fs_attn_sink(&rm, &rl, racc, jb->sinks[h], Dp);
        jb->isa->finish(racc, rl, D, jb->out + b * H * D + h * D);
    }
}

/* The (row, head) units of a split job's merge (0 for a job not split). */
static inline int64_t fs_attn_merge_units(const fs_attn_job *jb)
{
    return jb->split ? (jb->tile_start[jb->n_tiles_q - 1] + jb->tile_len[jb->n_tiles_q - 1]) * jb->H : 0;
}

/* A split job's outputs, on this thread. */
static void fs_attn_merge(const fs_attn_job *jb)
{
    fs_attn_merge_task((void *)jb, 0, fs_attn_merge_units(jb));
}

/* ---- the kernels: one template, instantiated per ISA ------------------------------------------ */

#define FS_SIMD_SCALAR 1
#include "_attention_simd.h"
#undef FS_SIMD_SCALAR

#if defined(FS_ATTN_X86) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 8))
#define FS_SIMD_AVX2 1
#include "_attention_simd.h"
#undef FS_SIMD_AVX2
#define FS_SIMD_AVX512 1
#include "_attention_simd.h"
#undef FS_SIMD_AVX512
#define FS_ATTN_HAVE_X86_KERNELS 1
#endif

#if defined(FS_ATTN_NEON_BUILD)
#define FS_SIMD_NEON 1
#include "_attention_simd.h"
#undef FS_SIMD_NEON
#endif

static int fs_attn_isa_supported(int isa)
{
    if (isa == FS_ATTN_SCALAR)
        return 1;
#if defined(FS_ATTN_NEON_BUILD)
    if (isa == FS_ATTN_NEON)
        return 1;                     /* Advanced SIMD is part of every AArch64 core */
#endif
#if defined(FS_ATTN_HAVE_X86_KERNELS)
    __builtin_cpu_init();
    if (isa == FS_ATTN_AVX2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    if (isa == FS_ATTN_AVX512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#endif
    return 0;
}

static int fs_attn_best_isa(void)
{
#if defined(FS_ATTN_NEON_BUILD)
    return FS_ATTN_NEON;
#endif
    return fs_attn_isa_supported(FS_ATTN_AVX512) ? FS_ATTN_AVX512
         : fs_attn_isa_supported(FS_ATTN_AVX2) ? FS_ATTN_AVX2 : FS_ATTN_SCALAR;
}

static const fs_attn_isa *fs_attn_isa_for(int isa)
{
#if defined(FS_ATTN_HAVE_X86_KERNELS)
    if (isa == FS_ATTN_AVX512)
        return &fs_attn_avx512;
    if (isa == FS_ATTN_AVX2)
        return &fs_attn_avx2;
#endif
#if defined(FS_ATTN_NEON_BUILD)
    if (isa == FS_ATTN_NEON)
        return &fs_attn_neon;
#endif
    (void)isa;
    return &fs_attn_scalar;
}

#endif /* FASTSERVE_ATTENTION_KERNELS_H */
