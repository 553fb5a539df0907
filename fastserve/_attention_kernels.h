/* Causal attention of a batch's queries over each slot's KV cache: the C behind fastserve/_attention.pyx.
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
 * Numbers (the contract fastserve/ref/attention.py restates in NumPy): for each batch row t and head h
 * (KV head h / G), with c = float(scale) * float(log2 e) and qs[d] = q[t, h, d] * c,
 *   m = -inf, l = 0, acc[d] = 0; for the key tiles k0 = 0, KT, 2 KT, ... with lo < k0 + KT and k0 <= pos,
 *   IN THAT ORDER, over the tile's visible keys j = max(k0, lo) .. min(k0 + KT - 1, pos):
 *     s_j   = 0; s_j = s_j + qs[d] * k_j[d] for d = 0, 1, ..., D-1 in that order;
 *     m'    = max(m, max_j s_j);  alpha = exp2(m - m');  p_j = exp2(s_j - m');
 *     l     = l * alpha;  acc[d] = acc[d] * alpha;
 *     then for j ascending:  acc[d] = acc[d] + p_j * v_j[d];  l = l + p_j;   m = m';
 *   out[t, h*D + d] = acc[d] / l.
 * exp2 is fs_exp2 below, float32 throughout; every product and sum rounded to float32, no fused
 * multiply-add (built with -ffp-contract=off). Nothing depends on the batch, the other rows, how rows
 * are grouped into work items, the thread count or the kernel (scalar, AVX2, AVX-512): a token's output
 * is the same in a decode step and in any prefill chunk.
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
#define FS_ROWS 64                /* most query rows (tokens x heads of a KV head) in one work item */

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
            for (int64_t d = 0; d < D; d++) {
                uint16_t h = fs_f32_to_f16(xr[d]);
                memcpy(o + 2 * d, &h, 2);
            }
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

/* ---- one work item: the query rows of a (token tile, KV head) against the slot's key tiles ------ */

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
    int64_t ring;                 /* 0: position p at row p; else at row p mod ring (see Rings above) */
} fs_attn_job;

/* The kernel pieces an ISA provides (see _attention_simd.h); rows are padded to FS_RB[isa]. */
typedef struct fs_attn_isa {
    int rb;                                                                       /* rows per block */
    const float *(*k_tile)(int type, const uint8_t *src, int64_t D, float *kt);   /* -> [D][KT] f32 */
    void (*v_tile)(int type, const uint8_t *src, int64_t stride, int64_t D, int64_t Dp, int64_t nk, float *vt);
    void (*qk)(const float *const *q, const float *kt, int64_t D, float *const *s);
    void (*qk_f16)(const float *const *q, const uint16_t *kt, int64_t D, float *const *s);     /* fp16 tile */
    void (*probs)(float *s, int64_t n, float *m, float *l, float *acc, int64_t Dp);
    void (*pv)(float *const *acc, const float *const *p, float *const *l, int64_t j0, int64_t j1,
               const float *vt, int64_t Dp);
    void (*pv_f16)(float *const *acc, const float *const *p, float *const *l, int64_t j0, int64_t j1,
                   const uint16_t *v, int64_t ldv, int64_t D);                                 /* fp16 rows */
    void (*finish)(const float *acc, float l, int64_t D, float *out);
} fs_attn_isa;

/* Scratch of one running task (all float32): qs [ROWS][D], acc [ROWS + 1][Dp] (the last: padding
 * rows' sink), s [ROWS + 1][KT], m, l [ROWS + 1], kt [D][KT], vt [KT][Dp]. */
static inline int64_t fs_attn_scratch_floats(int64_t D, int64_t Dp, int64_t rows)
{
    return rows * D + (rows + 1) * Dp + (rows + 1) * FS_KT + 2 * (rows + 1) + D * FS_KT + FS_KT * Dp + 64;
}

static inline int64_t fs_attn_tokens_per_item(int64_t G)
{
    return G >= FS_ROWS ? 1 : FS_ROWS / G;
}

/* acc += p v over keys j0..j1-1: from the fp16 cache rows (vdirect, ldv values apart) or the float32 tile vt. */
static inline void fs_attn_pv(const fs_attn_isa *isa, float *const *a, const float *const *p, float *const *l,
                              int64_t j0, int64_t j1, const uint8_t *vdirect, int64_t ldv, const float *vt, int64_t Dp)
{
    if (vdirect)
        isa->pv_f16(a, p, l, j0, j1, (const uint16_t *)vdirect, ldv, Dp);
    else
        isa->pv(a, p, l, j0, j1, vt, Dp);
}

/* One row's keys j0..j1-1 (nothing when j1 <= j0): a block whose other rows write into the sinks. */
static inline void fs_attn_pv_row(const fs_attn_isa *isa, float *a, const float *p, float *l, int64_t j0, int64_t j1,
                                  const uint8_t *vdirect, int64_t ldv, const float *vt, int64_t Dp,
                                  float *acc_sink, float *l_sink)
{
    if (j1 <= j0)
        return;
    float *a1[8], *l1[8];
    const float *p1[8];
    for (int z = 0; z < isa->rb; z++) {
        a1[z] = z == 0 ? a : acc_sink;
        p1[z] = p;
        l1[z] = z == 0 ? l : l_sink;
    }
    fs_attn_pv(isa, a1, p1, l1, j0, j1, vdirect, ldv, vt, Dp);
}

static void fs_attn_item(const fs_attn_job *jb, int64_t item, float *sc)
{
    const fs_attn_isa *isa = jb->isa;
    int64_t D = jb->D, Dp = jb->Dp, G = jb->G, H = jb->H, Hkv = jb->Hkv;
    int64_t qt = jb->n_tiles_q - 1 - item / Hkv;      /* later (longer) token tiles first */
    int64_t kvh = item % Hkv;
    int64_t b0 = jb->tile_start[qt], nt = jb->tile_len[qt];
    int64_t rows_cap = fs_attn_tokens_per_item(G) * G;
    float *qs = sc, *acc = qs + rows_cap * D, *s = acc + (rows_cap + 1) * Dp;
    float *m = s + (rows_cap + 1) * FS_KT, *l = m + rows_cap + 1, *ktbuf = l + rows_cap + 1;
    float *vt = ktbuf + D * FS_KT;
    float *acc_sink = acc + rows_cap * Dp, *s_sink = s + rows_cap * FS_KT;
    int64_t slot = jb->slots[b0], maxpos = 0, minlo = INT64_MAX, W = jb->window;
    for (int64_t t = 0; t < nt; t++) {
        int64_t p = jb->pos[b0 + t], lo = W > 0 && p - W + 1 > 0 ? p - W + 1 : 0;
        maxpos = p > maxpos ? p : maxpos;
        minlo = lo < minlo ? lo : minlo;
    }
    for (int64_t t = 0; t < nt; t++)
        for (int64_t g = 0; g < G; g++) {
            int64_t r = t * G + g;
            const float *qr = jb->q + ((b0 + t) * H + kvh * G + g) * D;
            for (int64_t d = 0; d < D; d++)
                qs[r * D + d] = qr[d] * jb->c;
            memset(acc + r * Dp, 0, (size_t)Dp * 4);
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
    int64_t krow = fs_k_tile_bytes(jb->type_k, D), vrow = fs_kv_row_bytes(jb->type_v, D);
    const float *qp[FS_ROWS + 8];
    float *sp[FS_ROWS + 8], *ap[FS_ROWS + 8], *lp[FS_ROWS + 8], *mp[FS_ROWS + 8];
    const float *pp[FS_ROWS + 8];
    int64_t nk_row[FS_ROWS + 8], lo_row[FS_ROWS + 8];
    int rb = isa->rb;
    for (int64_t kt = minlo / FS_KT; kt * FS_KT <= maxpos; kt++) {
        int64_t k0 = kt * FS_KT;
        int64_t nk = maxpos - k0 + 1 < FS_KT ? maxpos - k0 + 1 : FS_KT;    /* keys any row needs */
        /* Active rows: tokens that see a key of this tile, each with its own keys lo_row .. nk_row - 1. */
        int64_t na = 0;
        for (int64_t t = 0; t < nt; t++) {
            int64_t p = jb->pos[b0 + t], lo = W > 0 && p - W + 1 > 0 ? p - W + 1 : 0;
            if (p < k0 || lo >= k0 + FS_KT)
                continue;
            for (int64_t g = 0; g < G; g++) {
                int64_t r = t * G + g;
                qp[na] = qs + r * D;
                sp[na] = s + r * FS_KT;
                ap[na] = acc + r * Dp;
                lp[na] = l + r;
                mp[na] = m + r;
                pp[na] = sp[na];
                nk_row[na] = p - k0 + 1 < FS_KT ? p - k0 + 1 : FS_KT;
                lo_row[na] = lo > k0 ? lo - k0 : 0;
                na++;
            }
        }
        int64_t napad = (na + rb - 1) / rb * rb;
        for (int64_t i = na; i < napad; i++) {          /* padding rows: a real row's input, a sink */
            qp[i] = qp[0];
            sp[i] = s_sink;
            ap[i] = acc_sink;
            lp[i] = l + rows_cap;
            mp[i] = m + rows_cap;
            pp[i] = pp[0];
            nk_row[i] = nk_row[0];
            lo_row[i] = lo_row[0];
        }
        /* One block of rows (a decode step's G heads): the products read the fp16 cache as they go;
         * more rows share one conversion of the tile to float32. The values are the same. */
        int64_t kslot = jb->ring ? kt % jb->n_ktiles : kt, vrow0 = jb->ring ? k0 % jb->ring : k0;
        const uint8_t *ksrc = jb->k + ((slot * jb->n_ktiles + kslot) * Hkv + kvh) * krow;
        const uint8_t *vsrc = jb->v + ((slot * jb->n_ctx + vrow0) * Hkv + kvh) * vrow;
        int k_direct = jb->type_k == FS_KV_F16 && napad <= rb;
        int v_direct = jb->type_v == FS_KV_F16 && napad <= rb && D == Dp;
        const float *ktile = k_direct ? NULL : isa->k_tile(jb->type_k, ksrc, D, ktbuf);
        if (!v_direct)
            isa->v_tile(jb->type_v, vsrc, Hkv * vrow, D, Dp, nk, vt);
        for (int64_t i = 0; i < napad; i += rb) {
            if (k_direct)
                isa->qk_f16(qp + i, (const uint16_t *)ksrc, D, sp + i);
            else
                isa->qk(qp + i, ktile, D, sp + i);
        }
        for (int64_t i = 0; i < na; i++) {
            for (int64_t j = 0; j < lo_row[i]; j++)     /* keys before the window: out of the max, p = 0 */
                sp[i][j] = -INFINITY;
            isa->probs(sp[i], nk_row[i], mp[i], lp[i], ap[i], Dp);
        }
        const uint8_t *vd = v_direct ? vsrc : NULL;
        for (int64_t i = 0; i < napad; i += rb) {
            int64_t lmax = lo_row[i], nmin = nk_row[i];
            for (int k = 1; k < rb; k++) {
                lmax = lo_row[i + k] > lmax ? lo_row[i + k] : lmax;
                nmin = nk_row[i + k] < nmin ? nk_row[i + k] : nmin;
            }
            if (lmax >= nmin) {                         /* no key common to the block: row by row */
                for (int k = 0; k < rb && i + k < na; k++)
                    fs_attn_pv_row(isa, ap[i + k], pp[i + k], lp[i + k], lo_row[i + k], nk_row[i + k], vd, Hkv * D,
                                   vt, Dp, acc_sink, l + rows_cap);
                continue;
            }
            /* keys in order: each row's own before the common ones, those of every row, each row's own after */
            for (int k = 0; k < rb && i + k < na; k++)
                fs_attn_pv_row(isa, ap[i + k], pp[i + k], lp[i + k], lo_row[i + k], lmax, vd, Hkv * D, vt, Dp,
                               acc_sink, l + rows_cap);
            fs_attn_pv(isa, ap + i, pp + i, lp + i, lmax, nmin, vd, Hkv * D, vt, Dp);
            for (int k = 0; k < rb && i + k < na; k++)
                fs_attn_pv_row(isa, ap[i + k], pp[i + k], lp[i + k], nmin, nk_row[i + k], vd, Hkv * D, vt, Dp,
                               acc_sink, l + rows_cap);
        }
    }
    for (int64_t t = 0; t < nt; t++)
        for (int64_t g = 0; g < G; g++) {
            int64_t r = t * G + g;
            isa->finish(acc + r * Dp, l[r], D, jb->out + (b0 + t) * H * D + (kvh * G + g) * D);
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
