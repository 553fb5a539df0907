/* Q8 matrix product y[n, out] = x[n, in] . W[out, in]^T: the C behind fastserve/_matmul.pyx.
 *
 * Numbers (the contract that fastserve/ref/matmul.py restates in NumPy):
 *   - A row is cut into blocks of 32 inputs (the last one zero padded). A block is quantized as
 *     d = amax / 127, q = rint(v * (127 / amax)) in [-127, 127] (q = 0, d = 0 when amax < 2^-100), with
 *     float32 arithmetic and round-half-even. Activation rows are quantized so at each call;
 *     weights once, at packing (from float32), or taken as stored (GGUF's int8 blocks, q_w in
 *     [-128, 127]).
 *   - Per block the integer dot  isum = sum q_w * q_x  is exact (|isum| <= 32 * 128 * 127 < 2^24,
 *     so its float conversion is exact too).
 *   - Weights may carry a per-block offset m_w too (x_w = d_w * q_w + m_w: the exact form of GGUF's
 *     Q4_1 / Q5_1 blocks); its share of a block is m_w * s_x with s_x = d_x * (float)sum q_x.
 *   - Output (r, o): acc = 0; for blocks b = 0, 1, ... IN THAT ORDER:
 *         acc = acc + (float)isum * (d_w * d_x);   then, with offsets,  acc = acc + m_w * s_x;
 *     each product and each sum rounded to float32, no fused multiply-add (the extension is built
 *     with -ffp-contract=off). Nothing in that order depends on n, on the other rows, on the
 *     kernel (scalar, AVX2, AVX-512 VNNI, NEON, NEON sdot) or on which thread computes which
 *     outputs: results are bit-identical whatever the batch, and equal to the NumPy twin.
 *
 * Packed weight layout: outputs in panels of 16 (the last one padded with q = 0, d = 0); a panel is
 * nb consecutive panel-blocks of FS_PB_BYTES bytes:
 *   bytes [0, 512):  byte k*64 + lane*4 + j = (uint8)(q[lane][b*32 + k*4 + j] + 128), k < 8, j < 4
 *                    (lane = output within the panel: one 32-bit SIMD lane per output, four inputs
 *                    per lane, the layout of VNNI's u8 x s8 dot);
 *   bytes [512, 576): d[lane] as float32;
 *   bytes [576, 640): m[lane] as float32, only in a matrix with offsets.
 * One sequential stream per panel; the kernels take up to 8 rows per pass over a panel, so at
 * decode batch sizes a matrix comes from memory once per call.
 */
#ifndef FASTSERVE_MATMUL_KERNELS_H
#define FASTSERVE_MATMUL_KERNELS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include "_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#define FS_X86 1
#include <immintrin.h>
#elif defined(__aarch64__)
#define FS_ARM64 1
#include <arm_neon.h>
#if defined(__linux__)
#include <sys/auxv.h>
#endif
#endif

#define FS_QK 32                 /* inputs per block */
#define FS_LANES 16              /* outputs per panel */
#define FS_PB_QBYTES 512         /* quants of one panel-block */
#define FS_PB_BYTES 576          /* quants + 16 float32 scales (+ 16 float32 offsets: FS_PB_BYTES_M) */
#define FS_PB_BYTES_M 640
#define FS_TINY 0x1p-100f         /* blocks with a smaller amax are zero */
#define FS_MAX_THREADS FS_POOL_MAX_THREADS
#ifndef FS_TASKS_PER_THREAD
#define FS_TASKS_PER_THREAD 4
#endif

enum { FS_ISA_SCALAR = 0, FS_ISA_AVX2 = 1, FS_ISA_AVX512VNNI = 2, FS_ISA_NEON = 3, FS_ISA_NEON_DOTPROD = 4 };

/* ---- quantization ------------------------------------------------------------------------- */

/* rint(v) for |v| < 2^22 under the default round-to-nearest-even mode: adding 1.5 * 2^23 leaves
 * no fraction bits. Exact and vectorizable (rintf is a library call on baseline x86-64). */
static inline int32_t fs_rint(float v)
{
    const float magic = 12582912.0f;
    float t = v + magic;
    return (int32_t)(t - magic);
}

/* One row of n_in floats -> q [nb*32] (zero padded), d [nb], qsum [nb] (sum of each block's q)
 * and, when sx is not NULL, sx [nb] = d * (float)qsum. */
static void fs_quantize_row(const float *x, int64_t n_in, int8_t *q, float *d, int32_t *qsum, float *sx)
{
    int64_t nb = (n_in + FS_QK - 1) / FS_QK;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * FS_QK;
        int m = (int)(n_in - b * FS_QK < FS_QK ? n_in - b * FS_QK : FS_QK);
        float v[FS_QK];
        float amax = 0.0f;
        for (int i = 0; i < FS_QK; i++) {
            v[i] = i < m ? xb[i] : 0.0f;
            float a = fabsf(v[i]);
            amax = a > amax ? a : amax;
        }
        if (!(amax >= FS_TINY))       /* a block of zeros, denormals (whose 127 / amax would */
            amax = 0.0f;              /* overflow) or NaN quantizes to zeros */
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t s = 0;
        for (int i = 0; i < FS_QK; i++) {
            int32_t qi = fs_rint(v[i] * id);
            q[b * FS_QK + i] = (int8_t)qi;
            s += qi;
        }
        d[b] = amax / 127.0f;
        qsum[b] = s;
        if (sx)
            sx[b] = d[b] * (float)s;
    }
}

/* x [n, ldx] (n_in used) -> q [n, nb*32], d [n, nb], qsum [n, nb], sx [n, nb] (or NULL). */
static void fs_quantize_rows(const float *x, int64_t n, int64_t n_in, int64_t ldx,
                             int8_t *q, float *d, int32_t *qsum, float *sx)
{
    int64_t nb = (n_in + FS_QK - 1) / FS_QK;
    for (int64_t r = 0; r < n; r++)
        fs_quantize_row(x + r * ldx, n_in, q + r * nb * FS_QK, d + r * nb, qsum + r * nb,
                        sx ? sx + r * nb : NULL);
}

/* ---- packing ------------------------------------------------------------------------------ */

static inline int64_t fs_pb_bytes(int has_min)
{
    return has_min ? FS_PB_BYTES_M : FS_PB_BYTES;
}

static inline int64_t fs_packed_bytes(int64_t n_out, int64_t n_in, int has_min)
{
    return (n_out + FS_LANES - 1) / FS_LANES * ((n_in + FS_QK - 1) / FS_QK) * fs_pb_bytes(has_min);
}

/* Writes output row o's blocks into its lane: q [n_in] (the last block zero padded), d [nb], m [nb]
 * (NULL: a matrix without offsets). The padding lanes must have been cleared (fs_pack_clear). */
static void fs_pack_row(uint8_t *dst, int64_t n_in, int64_t o, const int8_t *q, const float *d, const float *m)
{
    int64_t nb = (n_in + FS_QK - 1) / FS_QK, pbb = fs_pb_bytes(m != NULL), lane = o % FS_LANES;
    uint8_t *panel = dst + o / FS_LANES * nb * pbb;
    for (int64_t b = 0; b < nb; b++) {
        int8_t qb[FS_QK];
        int64_t take = n_in - b * FS_QK < FS_QK ? n_in - b * FS_QK : FS_QK;
        memset(qb, 0, sizeof qb);
        memcpy(qb, q + b * FS_QK, (size_t)take);
        uint8_t *pb = panel + b * pbb;
        for (int k = 0; k < 8; k++)
            for (int j = 0; j < 4; j++)
                pb[k * 64 + lane * 4 + j] = (uint8_t)(qb[k * 4 + j] + 128);
        memcpy(pb + FS_PB_QBYTES + lane * 4, &d[b], 4);
        if (m)
            memcpy(pb + FS_PB_BYTES + lane * 4, &m[b], 4);
    }
}

/* Every lane q = 0, d = 0, m = 0: what the padding outputs keep. */
static void fs_pack_clear(uint8_t *dst, int64_t n_out, int64_t n_in, int has_min)
{
    int64_t pbb = fs_pb_bytes(has_min), n_pb = fs_packed_bytes(n_out, n_in, has_min) / pbb;
    for (int64_t i = 0; i < n_pb; i++) {
        memset(dst + i * pbb, 128, FS_PB_QBYTES);
        memset(dst + i * pbb + FS_PB_QBYTES, 0, (size_t)(pbb - FS_PB_QBYTES));
    }
}

/* Exact blocks: q [n_out, n_in] int8, d [n_out, nb], m [n_out, nb] or NULL -> dst. */
static void fs_pack_blocks(const int8_t *q, const float *d, const float *m, int64_t n_out, int64_t n_in, uint8_t *dst)
{
    int64_t nb = (n_in + FS_QK - 1) / FS_QK;
    fs_pack_clear(dst, n_out, n_in, m != NULL);
    for (int64_t o = 0; o < n_out; o++)
        fs_pack_row(dst, n_in, o, q + o * n_in, d + o * nb, m ? m + o * nb : NULL);
}

/* w [n_out, n_in] float32, each row quantized as an activation row -> dst (no offsets).
 * Returns 0, or -1 when out of memory. */
static int fs_pack_float(const float *w, int64_t n_out, int64_t n_in, uint8_t *dst)
{
    int64_t nb = (n_in + FS_QK - 1) / FS_QK;
    int8_t *q = (int8_t *)malloc((size_t)(nb * FS_QK));
    float *d = (float *)malloc((size_t)nb * sizeof(float));
    int32_t *s = (int32_t *)malloc((size_t)nb * sizeof(int32_t));
    if (!q || !d || !s) {
        free(q); free(d); free(s);
        return -1;
    }
    fs_pack_clear(dst, n_out, n_in, 0);
    for (int64_t o = 0; o < n_out; o++) {
        fs_quantize_row(w + o * n_in, n_in, q, d, s, NULL);
        fs_pack_row(dst, n_in, o, q, d, NULL);
    }
    free(q); free(d); free(s);
    return 0;
}

/* The inverse of the packing: q [n_out, nb*32] int8, d [n_out, nb], m [n_out, nb] (when has_min). */
static void fs_unpack(const uint8_t *src, int64_t n_out, int64_t n_in, int has_min, int8_t *q, float *d, float *m)
{
    int64_t nb = (n_in + FS_QK - 1) / FS_QK, pbb = fs_pb_bytes(has_min);
    for (int64_t o = 0; o < n_out; o++) {
        int64_t lane = o % FS_LANES;
        const uint8_t *panel = src + o / FS_LANES * nb * pbb;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *pb = panel + b * pbb;
            for (int k = 0; k < 8; k++)
                for (int j = 0; j < 4; j++)
                    q[o * nb * FS_QK + b * FS_QK + k * 4 + j] = (int8_t)(pb[k * 64 + lane * 4 + j] - 128);
            memcpy(&d[o * nb + b], pb + FS_PB_QBYTES + lane * 4, 4);
            if (has_min)
                memcpy(&m[o * nb + b], pb + FS_PB_BYTES + lane * 4, 4);
        }
    }
}

/* ---- kernels ------------------------------------------------------------------------------ */

typedef struct {
    const uint8_t *w;       /* packed weights */
    int64_t n_out, nb;      /* outputs; blocks per row (K = nb*32 inputs, padded) */
    int64_t pbb;            /* bytes per panel-block: FS_PB_BYTES, or FS_PB_BYTES_M with offsets */
    const int8_t *xq;       /* [n, K] quantized activations */
    const float *dx;        /* [n, nb] their scales */
    const int32_t *xs;      /* [n, nb] their block sums */
    const float *sx;        /* [n, nb] dx * xs (used with offsets) */
    int64_t n;
    float *y;               /* [n, ldy], outputs 0..n_out written */
    int64_t ldy;
} fs_job;

/* Computes every row of panels [p0, p1). */
typedef void (*fs_kernel)(const fs_job *, int64_t, int64_t);

/* Lanes of panel p that are real outputs. */
static inline int fs_valid(const fs_job *j, int64_t p)
{
    int64_t v = j->n_out - p * FS_LANES;
    return (int)(v < FS_LANES ? v : FS_LANES);
}

static void fs_kernel_scalar(const fs_job *j, int64_t p0, int64_t p1)
{
    const int64_t nb = j->nb, K = nb * FS_QK, pbb = j->pbb;
    const int has_min = pbb == FS_PB_BYTES_M;
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *panel = j->w + p * nb * pbb;
        int valid = fs_valid(j, p);
        for (int64_t r = 0; r < j->n; r++) {
            const int8_t *xr = j->xq + r * K;
            float acc[FS_LANES];
            for (int l = 0; l < FS_LANES; l++)
                acc[l] = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *pb = panel + b * pbb;
                /* products summed per byte position first (a plain loop that compilers vectorize),
                 * then the 4 positions of each lane */
                int32_t acc64[64], is[FS_LANES];
                int16_t xrep[64];
                for (int i = 0; i < 64; i++)
                    acc64[i] = 0;
                for (int k = 0; k < 8; k++) {
                    const int8_t *xk = xr + b * FS_QK + k * 4;
                    const uint8_t *wk = pb + k * 64;
                    for (int i = 0; i < 64; i++)
                        xrep[i] = xk[i & 3];
                    for (int i = 0; i < 64; i++)
                        acc64[i] += (int32_t)((int16_t)wk[i] * xrep[i]);
                }
                for (int l = 0; l < FS_LANES; l++)
                    is[l] = (acc64[l * 4] + acc64[l * 4 + 1]) + (acc64[l * 4 + 2] + acc64[l * 4 + 3]);
                float dw[FS_LANES], mw[FS_LANES];
                memcpy(dw, pb + FS_PB_QBYTES, sizeof dw);
                const float dxb = j->dx[r * nb + b];
                const int32_t corr = 128 * j->xs[r * nb + b];   /* the +128 of the stored weights */
                for (int l = 0; l < FS_LANES; l++) {
                    float s = dw[l] * dxb;
                    float t = (float)(is[l] - corr) * s;
                    acc[l] = acc[l] + t;
                }
                if (has_min) {
                    const float sxb = j->sx[r * nb + b];
                    memcpy(mw, pb + FS_PB_BYTES, sizeof mw);
                    for (int l = 0; l < FS_LANES; l++) {
                        float t = mw[l] * sxb;
                        acc[l] = acc[l] + t;
                    }
                }
            }
            memcpy(j->y + r * j->ldy + p * FS_LANES, acc, (size_t)valid * sizeof(float));
        }
    }
}

#if defined(FS_X86)

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 8)
#define FS_HAVE_AVX512VNNI 1
#endif

#define FS_AVX2 __attribute__((target("avx2")))
#define FS_INLINE static inline __attribute__((always_inline))

static inline int32_t fs_load4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* AVX2 (no VNNI): one half panel (8 outputs) times R rows; M: the matrix has offsets. The weights
 * are made signed again (xor 0x80) and multiplied with maddubs(|w|, sign(x, w)), whose i16 pair
 * sums cannot saturate (2 * 128 * 127 < 2^15); the integer result is VNNI's exact dot. */
FS_AVX2 FS_INLINE void fs_tile_avx2(const fs_job *j, int64_t p, int h, int64_t r0, const int R, const int M)
{
    const int64_t nb = j->nb, K = nb * FS_QK, pbb = M ? FS_PB_BYTES_M : FS_PB_BYTES;
    const uint8_t *wp = j->w + p * nb * pbb + h * 32;
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256 f[4];
    __m256i a[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        f[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = wp + b * pbb;
        const int8_t *xb = j->xq + r0 * K + b * FS_QK;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            a[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            __m256i ws = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(pb + k * 64)), flip);
            __m256i aw = _mm256_abs_epi8(ws);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                __m256i xv = _mm256_set1_epi32(fs_load4(xb + r * K + k * 4));
                __m256i m = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, ws));
                a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(m, ones));
            }
        }
        /* half h's 8 scales (offsets) sit h*32 bytes into them, as its quants into each chunk */
        __m256 dw = _mm256_loadu_ps((const float *)(pb + FS_PB_QBYTES));
        __m256 mw = M ? _mm256_loadu_ps((const float *)(pb + FS_PB_BYTES)) : dw;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m256 s = _mm256_mul_ps(dw, _mm256_set1_ps(j->dx[(r0 + r) * nb + b]));
            f[r] = _mm256_add_ps(f[r], _mm256_mul_ps(_mm256_cvtepi32_ps(a[r]), s));
            if (M)
                f[r] = _mm256_add_ps(f[r], _mm256_mul_ps(mw, _mm256_set1_ps(j->sx[(r0 + r) * nb + b])));
        }
    }
    int valid = fs_valid(j, p) - h * 8;
    valid = valid > 8 ? 8 : valid;
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        float *yr = j->y + (r0 + r) * j->ldy + p * FS_LANES + h * 8;
        if (valid == 8) {
            _mm256_storeu_ps(yr, f[r]);
        } else if (valid > 0) {
            float tmp[8];
            _mm256_storeu_ps(tmp, f[r]);
            memcpy(yr, tmp, (size_t)valid * sizeof(float));
        }
    }
}

FS_AVX2 FS_INLINE void fs_panels_avx2(const fs_job *j, int64_t p0, int64_t p1, const int M)
{
    for (int64_t p = p0; p < p1; p++)
        for (int h = 0; h < 2; h++) {
            int64_t r = 0;
            for (; r + 4 <= j->n; r += 4)
                fs_tile_avx2(j, p, h, r, 4, M);
            switch (j->n - r) {
            case 3: fs_tile_avx2(j, p, h, r, 3, M); break;
            case 2: fs_tile_avx2(j, p, h, r, 2, M); break;
            case 1: fs_tile_avx2(j, p, h, r, 1, M); break;
            default: break;
            }
        }
}

FS_AVX2 static void fs_kernel_avx2(const fs_job *j, int64_t p0, int64_t p1)
{
    fs_panels_avx2(j, p0, p1, 0);
}

FS_AVX2 static void fs_kernel_avx2_m(const fs_job *j, int64_t p0, int64_t p1)
{
    fs_panels_avx2(j, p0, p1, 1);
}

#if defined(FS_HAVE_AVX512VNNI)
#define FS_AVX512 __attribute__((target("avx512f,avx512vnni")))

/* AVX-512 VNNI: one panel (16 outputs) times R <= 8 rows, so that up to 8 rows read each weight
 * from memory once; M: the matrix has offsets. vpdpbusd multiplies the stored unsigned weights
 * (q + 128) with the signed activations; starting each block's sum at -128 * sum(q_x) removes the
 * offset exactly. */
FS_AVX512 FS_INLINE void fs_tile_avx512(const fs_job *j, int64_t p, int64_t r0, const int R, const int M)
{
    const int64_t nb = j->nb, K = nb * FS_QK, pbb = M ? FS_PB_BYTES_M : FS_PB_BYTES;
    const uint8_t *w = j->w + p * nb * pbb;
    /* The first row tile fetches the next panel while it computes: the later row tiles read this
     * panel from L1, and memory would sit idle during them. */
    const uint8_t *ahead = r0 == 0 && j->n > R ? w + nb * pbb : NULL;
    __m512 f[8];
    __m512i a[8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        f[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = w + b * pbb;
        const int8_t *xb = j->xq + r0 * K + b * FS_QK;
        if (ahead)
            for (int64_t off = 0; off < pbb; off += 64)
                _mm_prefetch((const char *)(ahead + b * pbb + off), _MM_HINT_T0);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            a[r] = _mm512_set1_epi32(-128 * j->xs[(r0 + r) * nb + b]);
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            __m512i wv = _mm512_loadu_si512((const void *)(pb + k * 64));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                a[r] = _mm512_dpbusd_epi32(a[r], wv, _mm512_set1_epi32(fs_load4(xb + r * K + k * 4)));
        }
        __m512 dw = _mm512_loadu_ps((const void *)(pb + FS_PB_QBYTES));
        __m512 mw = M ? _mm512_loadu_ps((const void *)(pb + FS_PB_BYTES)) : dw;
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m512 s = _mm512_mul_ps(dw, _mm512_set1_ps(j->dx[(r0 + r) * nb + b]));
            f[r] = _mm512_add_ps(f[r], _mm512_mul_ps(_mm512_cvtepi32_ps(a[r]), s));
            if (M)
                f[r] = _mm512_add_ps(f[r], _mm512_mul_ps(mw, _mm512_set1_ps(j->sx[(r0 + r) * nb + b])));
        }
    }
    int valid = fs_valid(j, p);
    __mmask16 msk = (__mmask16)(valid >= 16 ? 0xFFFF : (1u << valid) - 1u);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        _mm512_mask_storeu_ps(j->y + (r0 + r) * j->ldy + p * FS_LANES, msk, f[r]);
}

FS_AVX512 FS_INLINE void fs_panels_avx512(const fs_job *j, int64_t p0, int64_t p1, const int M)
{
    for (int64_t p = p0; p < p1; p++) {
        int64_t r = 0;
        for (; r + 8 <= j->n; r += 8)
            fs_tile_avx512(j, p, r, 8, M);
        switch (j->n - r) {
        case 7: fs_tile_avx512(j, p, r, 7, M); break;
        case 6: fs_tile_avx512(j, p, r, 6, M); break;
        case 5: fs_tile_avx512(j, p, r, 5, M); break;
        case 4: fs_tile_avx512(j, p, r, 4, M); break;
        case 3: fs_tile_avx512(j, p, r, 3, M); break;
        case 2: fs_tile_avx512(j, p, r, 2, M); break;
        case 1: fs_tile_avx512(j, p, r, 1, M); break;
        default: break;
        }
    }
}

FS_AVX512 static void fs_kernel_avx512(const fs_job *j, int64_t p0, int64_t p1)
{
    fs_panels_avx512(j, p0, p1, 0);
}

FS_AVX512 static void fs_kernel_avx512_m(const fs_job *j, int64_t p0, int64_t p1)
{
    fs_panels_avx512(j, p0, p1, 1);
}
#endif /* FS_HAVE_AVX512VNNI */
#endif /* FS_X86 */

#if defined(FS_ARM64)

#define FS_INLINE_ARM static inline __attribute__((always_inline))

/* sdot (ARMv8.2 dotprod): built in when the compiler targets it (e.g. Apple M-series), else with
 * GCC a function-level target and a run-time check (Linux); clang before 16 cannot do the latter. */
#if defined(__ARM_FEATURE_DOTPROD)
#define FS_HAVE_DOTPROD 1
#define FS_DOTPROD
#elif defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && __GNUC__ >= 10
#define FS_HAVE_DOTPROD 1
#define FS_DOTPROD_RUNTIME 1
#define FS_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#endif

static inline int32_t fs_load4_arm(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ARMv8.0 NEON: 4 outputs x 4 inputs per register; products widened to i16 (|w x| <= 128 * 127),
 * pairwise-added twice to one i32 per output. */
FS_INLINE_ARM int32x4_t fs_dot4_neon(int32x4_t acc, int8x16_t w, int8x16_t x)
{
    int32x4_t lo = vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(x)));
    int32x4_t hi = vpaddlq_s16(vmull_high_s8(w, x));
    return vaddq_s32(acc, vpaddq_s32(lo, hi));
}

/* NEON: one panel (16 outputs, 4 registers) times R <= 2 rows; D: use sdot; M: offsets. The
 * weights are made signed again (xor 0x80): the integer result is the same exact dot. */
#define FS_NEON_TILE(NAME, ATTR, DOT)                                                              \
ATTR FS_INLINE_ARM void NAME(const fs_job *j, int64_t p, int64_t r0, const int R, const int M)     \
{                                                                                                  \
    const int64_t nb = j->nb, K = nb * FS_QK, pbb = M ? FS_PB_BYTES_M : FS_PB_BYTES;               \
    const uint8_t *w = j->w + p * nb * pbb;                                                        \
    const uint8x16_t flip = vdupq_n_u8(0x80);                                                      \
    float32x4_t f[2][4];                                                                           \
    int32x4_t a[2][4];                                                                             \
    for (int r = 0; r < R; r++)                                                                    \
        for (int l = 0; l < 4; l++)                                                                \
            f[r][l] = vdupq_n_f32(0.0f);                                                           \
    for (int64_t b = 0; b < nb; b++) {                                                             \
        const uint8_t *pb = w + b * pbb;                                                           \
        const int8_t *xb = j->xq + r0 * K + b * FS_QK;                                             \
        for (int r = 0; r < R; r++)                                                                \
            for (int l = 0; l < 4; l++)                                                            \
                a[r][l] = vdupq_n_s32(0);                                                          \
        for (int k = 0; k < 8; k++) {                                                              \
            int8x16_t wv[4];                                                                       \
            for (int l = 0; l < 4; l++)                                                            \
                wv[l] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(pb + k * 64 + l * 16), flip));       \
            for (int r = 0; r < R; r++) {                                                          \
                int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(fs_load4_arm(xb + r * K + k * 4))); \
                for (int l = 0; l < 4; l++)                                                        \
                    a[r][l] = DOT(a[r][l], wv[l], xv);                                             \
            }                                                                                      \
        }                                                                                          \
        float32x4_t dw[4], mw[4];                                                                  \
        for (int l = 0; l < 4; l++) {                                                              \
            dw[l] = vld1q_f32((const float *)(pb + FS_PB_QBYTES) + l * 4);                         \
            mw[l] = M ? vld1q_f32((const float *)(pb + FS_PB_BYTES) + l * 4) : dw[l];              \
        }                                                                                          \
        for (int r = 0; r < R; r++) {                                                              \
            float32x4_t dxv = vdupq_n_f32(j->dx[(r0 + r) * nb + b]);                               \
            float32x4_t sxv = vdupq_n_f32(M ? j->sx[(r0 + r) * nb + b] : 0.0f);                    \
            for (int l = 0; l < 4; l++) {                                                          \
                float32x4_t s = vmulq_f32(dw[l], dxv);                                             \
                f[r][l] = vaddq_f32(f[r][l], vmulq_f32(vcvtq_f32_s32(a[r][l]), s));                \
                if (M)                                                                             \
                    f[r][l] = vaddq_f32(f[r][l], vmulq_f32(mw[l], sxv));                           \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    int valid = fs_valid(j, p);                                                                    \
    for (int r = 0; r < R; r++) {                                                                  \
        float *yr = j->y + (r0 + r) * j->ldy + p * FS_LANES;                                       \
        if (valid == FS_LANES) {                                                                   \
            for (int l = 0; l < 4; l++)                                                            \
                vst1q_f32(yr + l * 4, f[r][l]);                                                    \
        } else {                                                                                   \
            float tmp[FS_LANES];                                                                   \
            for (int l = 0; l < 4; l++)                                                            \
                vst1q_f32(tmp + l * 4, f[r][l]);                                                   \
            memcpy(yr, tmp, (size_t)valid * sizeof(float));                                       \
        }                                                                                          \
    }                                                                                              \
}                                                                                                  \
ATTR static void NAME##_kernel(const fs_job *j, int64_t p0, int64_t p1, const int M)             \
{                                                                                                  \
    for (int64_t p = p0; p < p1; p++) {                                                            \
        int64_t r = 0;                                                                             \
        for (; r + 2 <= j->n; r += 2)                                                              \
            NAME(j, p, r, 2, M);                                                                   \
        if (r < j->n)                                                                              \
            NAME(j, p, r, 1, M);                                                                   \
    }                                                                                              \
}

FS_NEON_TILE(fs_tile_neon, , fs_dot4_neon)

static void fs_kernel_neon(const fs_job *j, int64_t p0, int64_t p1)
{
    fs_tile_neon_kernel(j, p0, p1, 0);
}

static void fs_kernel_neon_m(const fs_job *j, int64_t p0, int64_t p1)
{
    fs_tile_neon_kernel(j, p0, p1, 1);
}

#if defined(FS_HAVE_DOTPROD)
FS_DOTPROD FS_INLINE_ARM int32x4_t fs_dot4_sdot(int32x4_t acc, int8x16_t w, int8x16_t x)
{
    return vdotq_s32(acc, w, x);
}

FS_NEON_TILE(fs_tile_sdot, FS_DOTPROD, fs_dot4_sdot)

FS_DOTPROD static void fs_kernel_sdot(const fs_job *j, int64_t p0, int64_t p1)
{
    fs_tile_sdot_kernel(j, p0, p1, 0);
}

FS_DOTPROD static void fs_kernel_sdot_m(const fs_job *j, int64_t p0, int64_t p1)
{
    fs_tile_sdot_kernel(j, p0, p1, 1);
}
#endif /* FS_HAVE_DOTPROD */
#endif /* FS_ARM64 */

static int fs_isa_supported(int isa)
{
    if (isa == FS_ISA_SCALAR)
        return 1;
#if defined(FS_X86)
    __builtin_cpu_init();
    if (isa == FS_ISA_AVX2)
        return __builtin_cpu_supports("avx2") ? 1 : 0;
#if defined(FS_HAVE_AVX512VNNI)
    if (isa == FS_ISA_AVX512VNNI)
        return (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni")) ? 1 : 0;
#endif
#endif
#if defined(FS_ARM64)
    if (isa == FS_ISA_NEON)
        return 1;
#if defined(FS_HAVE_DOTPROD)
    if (isa == FS_ISA_NEON_DOTPROD) {
#if defined(FS_DOTPROD_RUNTIME)
        return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) ? 1 : 0;
#else
        return 1;
#endif
    }
#endif
#endif
    return 0;
}

static int fs_best_isa(void)
{
    static const int best_first[] = {FS_ISA_AVX512VNNI, FS_ISA_AVX2, FS_ISA_NEON_DOTPROD, FS_ISA_NEON};
    for (size_t i = 0; i < sizeof best_first / sizeof best_first[0]; i++)
        if (fs_isa_supported(best_first[i]))
            return best_first[i];
    return FS_ISA_SCALAR;
}

static fs_kernel fs_kernel_for(int isa, int has_min)
{
#if defined(FS_X86)
    if (isa == FS_ISA_AVX2)
        return has_min ? fs_kernel_avx2_m : fs_kernel_avx2;
#if defined(FS_HAVE_AVX512VNNI)
    if (isa == FS_ISA_AVX512VNNI)
        return has_min ? fs_kernel_avx512_m : fs_kernel_avx512;
#endif
#endif
#if defined(FS_ARM64)
    if (isa == FS_ISA_NEON)
        return has_min ? fs_kernel_neon_m : fs_kernel_neon;
#if defined(FS_HAVE_DOTPROD)
    if (isa == FS_ISA_NEON_DOTPROD)
        return has_min ? fs_kernel_sdot_m : fs_kernel_sdot;
#endif
#endif
    (void)isa;
    (void)has_min;
    return fs_kernel_scalar;
}

/* ---- threads ------------------------------------------------------------------------------ */

/* The panels of one call are shared out in tasks over the decode thread's Pool (_pool.h). Which
 * thread computes which panel does not change any number: every output is summed by one thread in
 * the fixed block order. */
typedef struct {
    fs_kernel kern;
    const fs_job *job;
} fs_call;

static void fs_call_panels(void *ctx, int64_t p0, int64_t p1)
{
    const fs_call *c = (const fs_call *)ctx;
    c->kern(c->job, p0, p1);
}

/* Computes job with kern over all its panels, on the caller and the pool's helpers (pool may be NULL). */
static void fs_run(fs_pool *pl, fs_kernel kern, const fs_job *job)
{
    int64_t n_panels = (job->n_out + FS_LANES - 1) / FS_LANES;
    if (job->n == 0 || n_panels == 0)
        return;
    /* Tasks of >= ~64k multiply-adds, so that claiming one costs well under 1 % of it, and about
     * FS_TASKS_PER_THREAD per thread: long runs of adjacent panels keep each core's prefetcher on
     * one sequential stream, and the last tasks are still small enough to balance the threads. */
    int64_t per_panel = FS_LANES * job->nb * FS_QK * job->n;
    int64_t chunk = (65536 + per_panel - 1) / per_panel;
    if (pl && pl->n_helpers > 0) {
        int64_t even = (n_panels + FS_TASKS_PER_THREAD * (pl->n_helpers + 1) - 1) /
                       (FS_TASKS_PER_THREAD * (pl->n_helpers + 1));
        chunk = even > chunk ? even : chunk;
    }
    fs_call c = {kern, job};
    fs_pool_run(pl, fs_call_panels, &c, n_panels, chunk);
}

#endif /* FASTSERVE_MATMUL_KERNELS_H */
