/* Matrix products y[n, out] = x[n, in] . W[out, in]^T on GGUF's own blocks: the C behind
 * fastserve/backends/cpu/_matmul.pyx (the NumPy twin, fastserve/backends/cpu/ref/matmul.py, restates every number).
 *
 * Numbers:
 *   - Activations: a row is cut into blocks of 32 inputs (the last one zero padded), each quantized
 *     as d_x = amax / 127, q_x = rint(v * (127 / amax)) in [-127, 127] (q_x = 0, d_x = 0 when
 *     amax < 2^-100), float32 arithmetic, round-half-even; once per product, for all its parts.
 *   - Weights: per block of 32 inputs w_i = d * (s_i * q_i) + m, exactly as the file stores them
 *     (_gguf_blocks.h: every supported GGUF type is of that form).
 *   - Per block the integer dot isum = sum_i s_i q_i q_x,i is exact (|isum| < 2^24, so its float
 *     conversion is exact too): s = 1 except for Q6_K, Q3_K and Q2_K, whose two integer scales per
 *     block multiply the dots of inputs 0..15 and 16..31.
 *   - Output (r, o): acc = 0; for blocks b = 0, 1, ... IN THAT ORDER:
 *         acc = acc + (float)isum * (d_w * d_x);   then, with offsets,  acc = acc + m_w * s_x,
 *     s_x = d_x * (float)sum q_x; each product and each sum rounded to float32, no fused
 *     multiply-add (the extension is built with -ffp-contract=off; only the float weights' sums below
 *     call one, by name).
 *     Kind QSM (Q2_K: an offset per half block, m_0 for inputs 0..15, m_1 for 16..31): after the
 *     isum step  acc = acc + m_0 * s_x,lo;  then  acc = acc + m_1 * s_x,hi,  with
 *     s_x,lo = d_x * (float)(sum of q_x over inputs 0..15), s_x,hi = d_x * (float)(sum over 16..31).
 *   - Float weights (F32, F16, BF16): the activations stay float32, 16 partial sums
 *         p_(i mod 16) = fma(w_i, x_i, p_(i mod 16))  for i = 0, 1, ... IN THAT ORDER (one rounding),
 *     folded in one fixed tree (p_k + p_(k+8), then + p_(k+4), + p_(k+2), p_0 + p_1): _matmul_float.h.
 * Nothing in that order depends on n, on the other rows, on the kernel (scalar, AVX2, AVX-512 VNNI,
 * NEON, NEON sdot) or on which thread computes which outputs: results are bit-identical whatever the
 * batch, and equal to the NumPy twin.
 *
 * How: a task takes panels of 16 weight rows; for each it decodes the rows' blocks from the mapped
 * file into a small staging buffer in the kernels' layout (_gguf_blocks.h, L1/L2-sized: 16 rows x
 * nb blocks), then the kernel runs every activation row over it (up to 8 rows per pass), so the
 * weights come from memory once per product and no decoded copy of a matrix ever exists. At small n
 * (<= 4; fewer for some types; on AVX2 up to 6 of narrow matrices, in groups: fs_fused_group) the types of
 * fs_fused_ok skip the staging and are read straight from the file's blocks (_matmul_fused.h), with the
 * same numbers.
 */
#ifndef FASTSERVE_MATMUL_KERNELS_H
#define FASTSERVE_MATMUL_KERNELS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

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

#include "_gguf_blocks.h"
#include "_pool.h"           /* fs_relax */

#define FS_QK 32                 /* inputs per block */
#define FS_LANES 16              /* outputs per panel */
#define FS_TINY 0x1p-100f         /* blocks with a smaller amax are zero */
#ifndef FS_PREFETCH_PANELS
/* How far ahead a task prefetches the rows it will decode, in panels: staged (compute-bound, as
 * measured when it was tuned) and fused. Fused, one: at 2 threads four were 10-50 % slower on every
 * matrix measured (most on wide ones, e.g. ffn_down's 2048 x 8192 Q6_K, whose 4 panels are 430 KB of
 * L2), and the 1 B Q4_K_M file's n = 1 products took a median 33-38 ms instead of 39-45. */
#define FS_PREFETCH_PANELS 4
#endif
#ifndef FS_PREFETCH_PANELS_FUSED
#define FS_PREFETCH_PANELS_FUSED 1
#endif
#ifndef FS_TASKS_PER_THREAD
/* 2, not 4: on the Zen 2 (2 threads, quiet, the same tree built both ways) the default model's verification
 * products at 17 / 33 / 49 rows ran 3-5 % faster, the 1 B Q4_K_M shape's prefill 2 % and decode 1 %. */
#define FS_TASKS_PER_THREAD 2
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

/* One row of n_in floats -> q [nb*32] (zero padded), d [nb], qsum [nb] (sum of each block's q),
 * qhalf [nb] (the sum of its first 16) and sx [nb] = d * (float)qsum. */
static void fs_quantize_row(const float *x, int64_t n_in, int8_t *q, float *d, int32_t *qsum,
                            int32_t *qhalf, float *sx)
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
        int32_t s = 0, h = 0;
        for (int i = 0; i < FS_QK; i++) {
            int32_t qi = fs_rint(v[i] * id);
            q[b * FS_QK + i] = (int8_t)qi;
            s += qi;
            h += i < 16 ? qi : 0;
        }
        d[b] = amax / 127.0f;
        qsum[b] = s;
        qhalf[b] = h;
        sx[b] = d[b] * (float)s;
    }
}

/* x [n, ldx] (n_in used) -> q [n, nb*32], d, qsum, qhalf, sx [n, nb]. */
static void fs_quantize_rows(const float *x, int64_t n, int64_t n_in, int64_t ldx,
                             int8_t *q, float *d, int32_t *qsum, int32_t *qhalf, float *sx)
{
    int64_t nb = (n_in + FS_QK - 1) / FS_QK;
    for (int64_t r = 0; r < n; r++)
        fs_quantize_row(x + r * ldx, n_in, q + r * nb * FS_QK, d + r * nb, qsum + r * nb,
                        qhalf + r * nb, sx + r * nb);
}

#if defined(FS_X86)
#define FS_QUANT_AVX2 __attribute__((target("avx2")))

FS_QUANT_AVX2 static inline int32_t fs_hsum8_avx2(__m256i v)
{
    __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1));
    return _mm_cvtsi128_si32(x);
}

/* fs_quantize_row, 32 inputs at a time: the same float32 operations on each input (IEEE: the same bits). max_ps(a, m)
 * is the scalar a > m ? a : m (a NaN never wins), so amax is the same whatever the order; q is the low byte of the
 * truncated int32 (masked, then packed without saturation), as the scalar cast; the sums wrap alike. */
FS_QUANT_AVX2 static void fs_quantize_row_avx2(const float *x, int64_t n_in, int8_t *q, float *d, int32_t *qsum,
                                               int32_t *qhalf, float *sx)
{
    const int64_t nb = (n_in + FS_QK - 1) / FS_QK;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), magic = _mm256_set1_ps(12582912.0f);
    const __m256i low = _mm256_set1_epi32(0xFF), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * FS_QK;
        float pad[FS_QK];
        if (n_in - b * FS_QK < FS_QK) {
            const int64_t m = n_in - b * FS_QK;
            memset(pad, 0, sizeof pad);
            memcpy(pad, xb, (size_t)m * sizeof(float));
            xb = pad;
        }
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            mx = _mm256_max_ps(_mm256_and_ps(v[i], abs_mask), mx);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ps(m4, _mm_shuffle_ps(m4, m4, 1));
        float amax = _mm_cvtss_f32(m4);
        if (!(amax >= FS_TINY))
            amax = 0.0f;
        const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i qi[4];
        for (int i = 0; i < 4; i++)
            qi[i] = _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v[i], id), magic), magic));
        const __m256i ab = _mm256_packus_epi32(_mm256_and_si256(qi[0], low), _mm256_and_si256(qi[1], low));
        const __m256i cd = _mm256_packus_epi32(_mm256_and_si256(qi[2], low), _mm256_and_si256(qi[3], low));
        _mm256_storeu_si256((__m256i *)(q + b * FS_QK), _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd), order));
        const int32_t h = fs_hsum8_avx2(_mm256_add_epi32(qi[0], qi[1]));
        const int32_t s = h + fs_hsum8_avx2(_mm256_add_epi32(qi[2], qi[3]));
        d[b] = amax / 127.0f;
        qsum[b] = s;
        qhalf[b] = h;
        sx[b] = d[b] * (float)s;
    }
}
#endif

/* fs_quantize_rows with the isa's instructions (the same numbers): AVX2 where the products run AVX2 or AVX-512. */
static void fs_quantize_rows_isa(int isa, const float *x, int64_t n, int64_t n_in, int64_t ldx,
                                 int8_t *q, float *d, int32_t *qsum, int32_t *qhalf, float *sx)
{
#if defined(FS_X86)
    if (isa == FS_ISA_AVX2 || isa == FS_ISA_AVX512VNNI) {
        const int64_t nb = (n_in + FS_QK - 1) / FS_QK;
        for (int64_t r = 0; r < n; r++)
            fs_quantize_row_avx2(x + r * ldx, n_in, q + r * nb * FS_QK, d + r * nb, qsum + r * nb, qhalf + r * nb,
                                 sx + r * nb);
        return;
    }
#endif
    fs_quantize_rows(x, n, n_in, ldx, q, d, qsum, qhalf, sx);
}

/* x [n, ldx] (n_in used) -> xf [n, nb*32], zero padded: what the float kernels read. */
static void fs_pad_rows(const float *x, int64_t n, int64_t n_in, int64_t ldx, float *xf)
{
    int64_t K = (n_in + FS_QK - 1) / FS_QK * FS_QK;
    for (int64_t r = 0; r < n; r++) {
        memcpy(xf + r * K, x + r * ldx, (size_t)n_in * sizeof(float));
        memset(xf + r * K + n_in, 0, (size_t)(K - n_in) * sizeof(float));
    }
}

/* ---- kernels: one staged panel times every activation row ---------------------------------- */

typedef struct {
    const uint8_t *w;       /* one staged panel: nb panel-blocks (_gguf_blocks.h) */
    int valid;              /* lanes that are real outputs, 1..16 */
    int64_t nb;             /* blocks per row (K = nb*32 inputs, padded) */
    const int8_t *xq;       /* [n, K] quantized activations */
    const float *dx;        /* [n, nb] their scales */
    const int32_t *xs;      /* [n, nb] their block sums */
    const int32_t *xh;      /* [n, nb] the sums of each block's first 16 */
    const float *sx;        /* [n, nb] dx * xs */
    const float *xf;        /* [n, K] the activations as float32 (float kinds) */
    int64_t n;
    float *y;               /* y[r * ldy + lane], lanes 0 .. valid-1 written */
    int64_t ldy;
    int type;               /* the staged rows' GGUF type (the range of their q: fs_avx2_group, fs_q_offset) */
} fs_job;

typedef void (*fs_kernel)(const fs_job *);

static inline void fs_store_lanes(float *y, const float *acc, int valid)
{
    memcpy(y, acc, (size_t)valid * sizeof(float));
}

/* Integer kinds (Q, QM, QS, QSM). */
static inline void fs_panel_scalar(const fs_job *j, const int kind)
{
    const int64_t nb = j->nb, K = nb * FS_QK, pbb = fs_stage_bytes(kind);
    for (int64_t r = 0; r < j->n; r++) {
        const int8_t *xr = j->xq + r * K;
        float acc[FS_LANES];
        for (int l = 0; l < FS_LANES; l++)
            acc[l] = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *pb = j->w + b * pbb;
            /* products summed per byte position first (a plain loop that compilers vectorize),
             * then the 4 positions of each lane; inputs 0..15 (k < 4) apart from 16..31 */
            int32_t lo64[64], hi64[64], is[FS_LANES];
            const int32_t xs = j->xs[r * nb + b], xh = j->xh[r * nb + b];
            int16_t xrep[64];
            for (int i = 0; i < 64; i++)
                lo64[i] = hi64[i] = 0;
            for (int k = 0; k < 8; k++) {
                const int8_t *xk = xr + b * FS_QK + k * 4;
                const uint8_t *wk = pb + k * 64;
                int32_t *a = k < 4 ? lo64 : hi64;
                for (int i = 0; i < 64; i++)
                    xrep[i] = xk[i & 3];
                for (int i = 0; i < 64; i++)
                    a[i] += (int32_t)((int16_t)wk[i] * xrep[i]);
            }
            for (int l = 0; l < FS_LANES; l++) {
                /* minus the +128 of the stored weights, per half */
                int32_t lo = (lo64[l * 4] + lo64[l * 4 + 1]) + (lo64[l * 4 + 2] + lo64[l * 4 + 3]) - 128 * xh;
                int32_t hi = (hi64[l * 4] + hi64[l * 4 + 1]) + (hi64[l * 4 + 2] + hi64[l * 4 + 3]) - 128 * (xs - xh);
                if (kind == FS_KIND_QS || kind == FS_KIND_QSM) {
                    int32_t s0, s1;
                    memcpy(&s0, pb + 576 + l * 4, 4);
                    memcpy(&s1, pb + 640 + l * 4, 4);
                    is[l] = lo * s0 + hi * s1;
                } else {
                    is[l] = lo + hi;
                }
            }
            float dw[FS_LANES], mw[FS_LANES];
            memcpy(dw, pb + 512, sizeof dw);
            const float dxb = j->dx[r * nb + b];
            for (int l = 0; l < FS_LANES; l++) {
                float s = dw[l] * dxb;
                float t = (float)is[l] * s;
                acc[l] = acc[l] + t;
            }
            if (kind == FS_KIND_QM) {
                const float sxb = j->sx[r * nb + b];
                memcpy(mw, pb + 576, sizeof mw);
                for (int l = 0; l < FS_LANES; l++) {
                    float t = mw[l] * sxb;
                    acc[l] = acc[l] + t;
                }
            }
            if (kind == FS_KIND_QSM) {
                /* the halves' offsets, inputs 0..15 first */
                const float sl = dxb * (float)xh, sh = dxb * (float)(xs - xh);
                float m1[FS_LANES];
                memcpy(mw, pb + 704, sizeof mw);
                memcpy(m1, pb + 768, sizeof m1);
                for (int l = 0; l < FS_LANES; l++) {
                    float t = mw[l] * sl;
                    acc[l] = acc[l] + t;
                    t = m1[l] * sh;
                    acc[l] = acc[l] + t;
                }
            }
        }
        fs_store_lanes(j->y + r * j->ldy, acc, j->valid);
    }
}

static void fs_kernel_scalar_q(const fs_job *j) { fs_panel_scalar(j, FS_KIND_Q); }
static void fs_kernel_scalar_qm(const fs_job *j) { fs_panel_scalar(j, FS_KIND_QM); }
static void fs_kernel_scalar_qs(const fs_job *j) { fs_panel_scalar(j, FS_KIND_QS); }
static void fs_kernel_scalar_qsm(const fs_job *j) { fs_panel_scalar(j, FS_KIND_QSM); }

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

/* Lanes h*8 .. of output row r (those of the panel's valid ones). */
FS_AVX2 FS_INLINE void fs_store_half_avx2(const fs_job *j, int h, int64_t r, __m256 v)
{
    int valid = j->valid - h * 8;
    valid = valid > 8 ? 8 : valid;
    float *yr = j->y + r * j->ldy + h * 8;
    if (valid == 8) {
        _mm256_storeu_ps(yr, v);
    } else if (valid > 0) {
        float tmp[8];
        _mm256_storeu_ps(tmp, v);
        memcpy(yr, tmp, (size_t)valid * sizeof(float));
    }
}

/* Each lane's int16 sub-scale twice (the two int16 of its dword), from the int32 one: madd by it scales a lane's
 * maddubs pair sums in one step, exactly (|pair sum| < 2^15, |s| <= 128). */
FS_AVX2 FS_INLINE __m256i fs_pair16_avx2(__m256i s)
{
    return _mm256_blend_epi16(s, _mm256_slli_epi32(s, 16), 0xAA);
}

/* v as it is now, in a register: an empty asm that GCC must assume reads and rewrites it. In the fully
 * unrolled steps of a group it keeps each step's sums in place; left free, GCC hoists the eight steps'
 * loads and multiplies ahead of their adds and spills (the Zen 2 ran a step loop unrolled by 2 at
 * 73 GMAC/s a core, fully unrolled 66, fully unrolled and settled 80, Q4_1 at n = 33). */
FS_AVX2 FS_INLINE void fs_settle_avx2(__m256i *v)
{
    __asm__("" : "+x"(*v));
}

/* AVX2 (no VNNI): halves h0 .. h0 + H - 1 of a panel (8 outputs each) times R rows; G: fs_avx2_group's, off:
 * fs_q_offset's (the panel was staged as q + fs_stage_bias(1, type): q + off for G > 0, the plain int8 q for G = 0).
 * The integer result is VNNI's exact dot either way. G > 0: each row's sum starts at minus what the offset adds,
 * -off * sum(q_x) (sub-scaled kinds: -off * (s_0 * sum of inputs 0..15 + s_1 * sum of 16..31), one madd of
 * the int16 pairs (-off s_0, -off s_1) and (sum 0..15, sum 16..31)), and a group's pair sums are widened by a
 * madd with ones, or with its half's sub-scale: no int32 multiply per row. Both halves at once (H = 2) load
 * each row's four inputs once for two weight vectors; every output's operations are those of H = 1. */
FS_AVX2 FS_INLINE void fs_tile_avx2(const fs_job *j, const int h0, const int H, int64_t r0, const int R,
                                    const int kind, const int G, const int32_t off, const int64_t b0,
                                    const int64_t b1, float *part)
{
    const int64_t nb = j->nb, K = nb * FS_QK, pbb = fs_stage_bytes(kind);
    const int S = kind == FS_KIND_QS || kind == FS_KIND_QSM, M = kind == FS_KIND_QM, QSM = kind == FS_KIND_QSM;
    const uint8_t *wp = j->w + h0 * 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 f[4][2];
    __m256i a[4][2], ah[4][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int h = 0; h < H; h++)
            f[r][h] = b0 ? _mm256_loadu_ps(part + (r * 2 + h) * 8) : _mm256_setzero_ps();
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *pb = wp + b * pbb;
        const int8_t *xb = j->xq + r0 * K + b * FS_QK;
        if (G) {
            __m256i sc[2][2] = {{ones, ones}, {ones, ones}}, offs[2] = {ones, ones};
#pragma GCC unroll 2
            for (int h = 0; h < H && S; h++) {
                const __m256i s0 = _mm256_loadu_si256((const __m256i *)(pb + h * 32 + 576));
                const __m256i s1 = _mm256_loadu_si256((const __m256i *)(pb + h * 32 + 640));
                sc[h][0] = fs_pair16_avx2(s0);
                sc[h][1] = fs_pair16_avx2(s1);
                if (off)      /* (-off s_0, -off s_1): |off s| <= 4096 */
                    offs[h] = _mm256_mullo_epi16(_mm256_blend_epi16(s0, _mm256_slli_epi32(s1, 16), 0xAA),
                                                 _mm256_set1_epi16((int16_t)-off));
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const int64_t o = (r0 + r) * nb + b;
#pragma GCC unroll 2
                for (int h = 0; h < H; h++) {
                    if (off && S) {
                        const uint32_t xs2 = (uint16_t)j->xh[o] | (uint32_t)(j->xs[o] - j->xh[o]) << 16;
                        a[r][h] = _mm256_madd_epi16(offs[h], _mm256_set1_epi32((int32_t)xs2));
                    } else {
                        a[r][h] = off ? _mm256_set1_epi32(-off * j->xs[o]) : _mm256_setzero_si256();
                    }
                }
            }
#pragma GCC unroll 8
            for (int k0 = 0; k0 < 8; k0 += G) {
                __m256i s16[4][2];
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
#pragma GCC unroll 2
                    for (int h = 0; h < H; h++)
                        s16[r][h] = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int k = k0; k < k0 + G; k++) {
                    __m256i w[2];
#pragma GCC unroll 2
                    for (int h = 0; h < H; h++)
                        w[h] = _mm256_loadu_si256((const __m256i *)(pb + k * 64 + h * 32));
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++) {
                        const __m256i xv = _mm256_set1_epi32(fs_load4(xb + r * K + k * 4));
#pragma GCC unroll 2
                        for (int h = 0; h < H; h++)
                            s16[r][h] = _mm256_add_epi16(s16[r][h], _mm256_maddubs_epi16(w[h], xv));
                    }
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
                        for (int h = 0; h < H; h++)
                            fs_settle_avx2(&s16[r][h]);
                }
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
#pragma GCC unroll 2
                    for (int h = 0; h < H; h++)
                        a[r][h] = _mm256_add_epi32(a[r][h], _mm256_madd_epi16(s16[r][h], sc[h][k0 >= 4]));
            }
        } else {
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
#pragma GCC unroll 2
                for (int h = 0; h < H; h++)
                    a[r][h] = ah[r][h] = _mm256_setzero_si256();
#pragma GCC unroll 2
            for (int k = 0; k < 8; k++) {
                __m256i ws[2], aw[2];
#pragma GCC unroll 2
                for (int h = 0; h < H; h++) {
                    ws[h] = _mm256_loadu_si256((const __m256i *)(pb + k * 64 + h * 32));
                    aw[h] = _mm256_abs_epi8(ws[h]);
                }
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const __m256i xv = _mm256_set1_epi32(fs_load4(xb + r * K + k * 4));
#pragma GCC unroll 2
                    for (int h = 0; h < H; h++) {
                        __m256i m = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[h], _mm256_sign_epi8(xv, ws[h])), ones);
                        if (S && k >= 4)
                            ah[r][h] = _mm256_add_epi32(ah[r][h], m);
                        else
                            a[r][h] = _mm256_add_epi32(a[r][h], m);
                    }
                }
            }
#pragma GCC unroll 2
            for (int h = 0; h < H && S; h++) {
                /* half h's 8 sub-scales sit h*32 bytes into them, as its quants into each chunk */
                __m256i s0 = _mm256_loadu_si256((const __m256i *)(pb + h * 32 + 576));
                __m256i s1 = _mm256_loadu_si256((const __m256i *)(pb + h * 32 + 640));
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    a[r][h] = _mm256_add_epi32(_mm256_mullo_epi32(a[r][h], s0), _mm256_mullo_epi32(ah[r][h], s1));
            }
        }
#pragma GCC unroll 2
        for (int h = 0; h < H; h++) {
            const uint8_t *ph = pb + h * 32;
            __m256 dw = _mm256_loadu_ps((const float *)(ph + 512));
            __m256 mw = M ? _mm256_loadu_ps((const float *)(ph + 576)) : dw;
            __m256 m0w = QSM ? _mm256_loadu_ps((const float *)(ph + 704)) : dw;     /* QSM: the halves' offsets */
            __m256 m1w = QSM ? _mm256_loadu_ps((const float *)(ph + 768)) : dw;
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                __m256 s = _mm256_mul_ps(dw, _mm256_set1_ps(j->dx[(r0 + r) * nb + b]));
                f[r][h] = _mm256_add_ps(f[r][h], _mm256_mul_ps(_mm256_cvtepi32_ps(a[r][h]), s));
                if (M)
                    f[r][h] = _mm256_add_ps(f[r][h], _mm256_mul_ps(mw, _mm256_set1_ps(j->sx[(r0 + r) * nb + b])));
                if (QSM) {
                    const int64_t o = (r0 + r) * nb + b;
                    const float dxo = j->dx[o], sl = dxo * (float)j->xh[o], sh = dxo * (float)(j->xs[o] - j->xh[o]);
                    f[r][h] = _mm256_add_ps(f[r][h], _mm256_mul_ps(m0w, _mm256_set1_ps(sl)));
                    f[r][h] = _mm256_add_ps(f[r][h], _mm256_mul_ps(m1w, _mm256_set1_ps(sh)));
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int h = 0; h < H; h++) {
            if (b1 < nb)
                _mm256_storeu_ps(part + (r * 2 + h) * 8, f[r][h]);
            else
                fs_store_half_avx2(j, h0 + h, r0 + r, f[r][h]);
        }
}

/* Rows and inputs in blocks that stay in L1 (Zen 2: 32 KB): FS_AVX2_ROW_BLOCK rows (a multiple of both tile
 * heights, so the tiles are those of one pass over all rows) over FS_AVX2_K_BLOCK blocks of inputs at a time,
 * each tile's float sums carried from one input block to the next in part (exact: a float stored and loaded).
 * In one pass a tile re-read the whole panel (11.5 KB at 576 inputs, 30 KB at 1536) after the other rows'
 * activations (28 / 75 KB at 49 rows) had pushed it out of L1. Up to FS_AVX2_BLOCKED_MAX_IN inputs: wider rows
 * (the 1 B shape's 2048 and 8192) ran 4-11 % slower in blocks than in one sequential pass the prefetcher follows
 * (Zen 2, 2 threads, bench_matmul --rows: Q4_K 8192 x 2048 and Q6_K 2048 x 8192 at n = 49 and 512). */
#ifndef FS_AVX2_BLOCKED_MAX_IN
#define FS_AVX2_BLOCKED_MAX_IN 1536
#endif
#ifndef FS_AVX2_ROW_BLOCK
#define FS_AVX2_ROW_BLOCK 24
#endif
#ifndef FS_AVX2_K_BLOCK
#define FS_AVX2_K_BLOCK 6
#endif

/* All rows over halves h0 .. h0 + H - 1, in tiles of 4 rows (H = 1) or 3 (H = 2: 6 accumulators of each
 * kind in the 16 registers), for G a constant. */
FS_AVX2 FS_INLINE void fs_rows_avx2(const fs_job *j, const int h0, const int H, const int kind, const int G,
                                    const int32_t off)
{
    float part[FS_AVX2_ROW_BLOCK * 16];
    const int64_t kb = j->nb * FS_QK <= FS_AVX2_BLOCKED_MAX_IN ? FS_AVX2_K_BLOCK : j->nb;
    for (int64_t rb = 0; rb < j->n; rb += FS_AVX2_ROW_BLOCK) {
        const int64_t re = j->n - rb < FS_AVX2_ROW_BLOCK ? j->n : rb + FS_AVX2_ROW_BLOCK;
        for (int64_t b0 = 0; b0 < j->nb; b0 += kb) {
            const int64_t b1 = j->nb - b0 < kb ? j->nb : b0 + kb;
            int64_t r = rb;
#define FS_T(R) fs_tile_avx2(j, h0, H, r, R, kind, G, off, b0, b1, part + (r - rb) * 16)
            if (H == 1) {
                for (; r + 4 <= re; r += 4)
                    FS_T(4);
            } else {
                for (; r + 3 <= re; r += 3)
                    FS_T(3);
            }
            switch (re - r) {
            case 3: FS_T(3); break;
            case 2: FS_T(2); break;
            case 1: FS_T(1); break;
            default: break;
            }
#undef FS_T
        }
    }
}

FS_AVX2 FS_INLINE void fs_halves_avx2(const fs_job *j, const int kind, const int G, const int32_t off)
{
    if (j->valid > 8) {
        fs_rows_avx2(j, 0, 2, kind, G, off);
        return;
    }
    for (int h = 0; h < 2 && j->valid > h * 8; h++)
        fs_rows_avx2(j, h, 1, kind, G, off);
}

FS_AVX2 FS_INLINE void fs_panel_avx2(const fs_job *j, const int kind)
{
    const int G = fs_avx2_group(j->type);
    const int32_t off = fs_q_offset(j->type);
    /* off = 0 a constant where it is 0 (Q4_1, Q4_K, ...): no offset code in their loops */
    switch (G) {
    case 8: off ? fs_halves_avx2(j, kind, 8, off) : fs_halves_avx2(j, kind, 8, 0); break;
    case 4: off ? fs_halves_avx2(j, kind, 4, off) : fs_halves_avx2(j, kind, 4, 0); break;
    case 2: off ? fs_halves_avx2(j, kind, 2, off) : fs_halves_avx2(j, kind, 2, 0); break;
    default: fs_halves_avx2(j, kind, 0, 0); break;
    }
}

FS_AVX2 static void fs_kernel_avx2_q(const fs_job *j) { fs_panel_avx2(j, FS_KIND_Q); }
FS_AVX2 static void fs_kernel_avx2_qm(const fs_job *j) { fs_panel_avx2(j, FS_KIND_QM); }
FS_AVX2 static void fs_kernel_avx2_qs(const fs_job *j) { fs_panel_avx2(j, FS_KIND_QS); }
FS_AVX2 static void fs_kernel_avx2_qsm(const fs_job *j) { fs_panel_avx2(j, FS_KIND_QSM); }

#if defined(FS_HAVE_AVX512VNNI)
#define FS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vnni")))

/* AVX-512 VNNI: one panel (16 outputs) times R <= 8 rows, so that up to 8 rows read each staged
 * weight once. vpdpbusd multiplies the stored unsigned weights (q + 128) with the signed
 * activations; starting each block's sum at -128 * sum(q_x) removes the offset exactly (per half
 * for the sub-scaled kind). */
FS_AVX512 FS_INLINE void fs_tile_avx512(const fs_job *j, int64_t r0, const int R, const int kind)
{
    const int64_t nb = j->nb, K = nb * FS_QK, pbb = fs_stage_bytes(kind);
    const int S = kind == FS_KIND_QS || kind == FS_KIND_QSM, M = kind == FS_KIND_QM, QSM = kind == FS_KIND_QSM;
    __m512 f[8];
    __m512i a[8], ah[8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        f[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = j->w + b * pbb;
        const int8_t *xb = j->xq + r0 * K + b * FS_QK;
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const int32_t xs = j->xs[(r0 + r) * nb + b], xh = j->xh[(r0 + r) * nb + b];
            if (S) {
                a[r] = _mm512_set1_epi32(-128 * xh);
                ah[r] = _mm512_set1_epi32(-128 * (xs - xh));
            } else {
                a[r] = _mm512_set1_epi32(-128 * xs);
            }
        }
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            __m512i wv = _mm512_loadu_si512((const void *)(pb + k * 64));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                __m512i xv = _mm512_set1_epi32(fs_load4(xb + r * K + k * 4));
                if (S && k >= 4)
                    ah[r] = _mm512_dpbusd_epi32(ah[r], wv, xv);
                else
                    a[r] = _mm512_dpbusd_epi32(a[r], wv, xv);
            }
        }
        if (S) {
            __m512i s0 = _mm512_loadu_si512((const void *)(pb + 576));
            __m512i s1 = _mm512_loadu_si512((const void *)(pb + 640));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                a[r] = _mm512_add_epi32(_mm512_mullo_epi32(a[r], s0), _mm512_mullo_epi32(ah[r], s1));
        }
        __m512 dw = _mm512_loadu_ps((const void *)(pb + 512));
        __m512 mw = M ? _mm512_loadu_ps((const void *)(pb + 576)) : dw;
        __m512 m0w = QSM ? _mm512_loadu_ps((const void *)(pb + 704)) : dw;     /* QSM: the halves' offsets */
        __m512 m1w = QSM ? _mm512_loadu_ps((const void *)(pb + 768)) : dw;
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m512 s = _mm512_mul_ps(dw, _mm512_set1_ps(j->dx[(r0 + r) * nb + b]));
            f[r] = _mm512_add_ps(f[r], _mm512_mul_ps(_mm512_cvtepi32_ps(a[r]), s));
            if (M)
                f[r] = _mm512_add_ps(f[r], _mm512_mul_ps(mw, _mm512_set1_ps(j->sx[(r0 + r) * nb + b])));
            if (QSM) {
                const int64_t o = (r0 + r) * nb + b;
                const float dxo = j->dx[o], sl = dxo * (float)j->xh[o], sh = dxo * (float)(j->xs[o] - j->xh[o]);
                f[r] = _mm512_add_ps(f[r], _mm512_mul_ps(m0w, _mm512_set1_ps(sl)));
                f[r] = _mm512_add_ps(f[r], _mm512_mul_ps(m1w, _mm512_set1_ps(sh)));
            }
        }
    }
    __mmask16 msk = (__mmask16)(j->valid >= 16 ? 0xFFFF : (1u << j->valid) - 1u);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        _mm512_mask_storeu_ps(j->y + (r0 + r) * j->ldy, msk, f[r]);
}

FS_AVX512 FS_INLINE void fs_panel_avx512(const fs_job *j, const int kind)
{
    int64_t r = 0;
#define FS_T(R) fs_tile_avx512(j, r, R, kind)
    for (; r + 8 <= j->n; r += 8)
        FS_T(8);
    switch (j->n - r) {
    case 7: FS_T(7); break;
    case 6: FS_T(6); break;
    case 5: FS_T(5); break;
    case 4: FS_T(4); break;
    case 3: FS_T(3); break;
    case 2: FS_T(2); break;
    case 1: FS_T(1); break;
    default: break;
    }
#undef FS_T
}

FS_AVX512 static void fs_kernel_avx512_q(const fs_job *j) { fs_panel_avx512(j, FS_KIND_Q); }
FS_AVX512 static void fs_kernel_avx512_qm(const fs_job *j) { fs_panel_avx512(j, FS_KIND_QM); }
FS_AVX512 static void fs_kernel_avx512_qs(const fs_job *j) { fs_panel_avx512(j, FS_KIND_QS); }
FS_AVX512 static void fs_kernel_avx512_qsm(const fs_job *j) { fs_panel_avx512(j, FS_KIND_QSM); }
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

FS_INLINE_ARM void fs_store_neon(const fs_job *j, int64_t r0, int R, float32x4_t f[2][4])
{
    for (int r = 0; r < R; r++) {
        float *yr = j->y + (r0 + r) * j->ldy;
        float tmp[FS_LANES];
        for (int l = 0; l < 4; l++)
            vst1q_f32(tmp + l * 4, f[r][l]);
        memcpy(yr, tmp, (size_t)j->valid * sizeof(float));
    }
}

/* NEON: one panel (16 outputs, 4 registers) times R <= 2 rows; DOT: the 4-input dot (sdot or
 * widening multiplies). The weights are made signed again (xor 0x80): the same exact dot. */
#define FS_NEON_TILE(NAME, ATTR, DOT)                                                              \
ATTR FS_INLINE_ARM void NAME(const fs_job *j, int64_t r0, const int R, const int kind)             \
{                                                                                                  \
    const int64_t nb = j->nb, K = nb * FS_QK, pbb = fs_stage_bytes(kind);                          \
    const int S = kind == FS_KIND_QS || kind == FS_KIND_QSM, M = kind == FS_KIND_QM;               \
    const int QSM = kind == FS_KIND_QSM;                                                           \
    const uint8x16_t flip = vdupq_n_u8(0x80);                                                      \
    float32x4_t f[2][4];                                                                           \
    int32x4_t a[2][4], ah[2][4];                                                                   \
    for (int r = 0; r < R; r++)                                                                    \
        for (int l = 0; l < 4; l++)                                                                \
            f[r][l] = vdupq_n_f32(0.0f);                                                           \
    for (int64_t b = 0; b < nb; b++) {                                                             \
        const uint8_t *pb = j->w + b * pbb;                                                        \
        const int8_t *xb = j->xq + r0 * K + b * FS_QK;                                             \
        for (int r = 0; r < R; r++)                                                                \
            for (int l = 0; l < 4; l++)                                                            \
                a[r][l] = ah[r][l] = vdupq_n_s32(0);                                               \
        for (int k = 0; k < 8; k++) {                                                              \
            int8x16_t wv[4];                                                                       \
            for (int l = 0; l < 4; l++)                                                            \
                wv[l] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(pb + k * 64 + l * 16), flip));       \
            for (int r = 0; r < R; r++) {                                                          \
                int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(fs_load4_arm(xb + r * K + k * 4))); \
                for (int l = 0; l < 4; l++) {                                                      \
                    if (S && k >= 4)                                                               \
                        ah[r][l] = DOT(ah[r][l], wv[l], xv);                                       \
                    else                                                                           \
                        a[r][l] = DOT(a[r][l], wv[l], xv);                                         \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        float32x4_t dw[4], mw[4], m0w[4], m1w[4];                                                  \
        int32x4_t s0[4], s1[4];                                                                    \
        for (int l = 0; l < 4; l++) {                                                              \
            dw[l] = vld1q_f32((const float *)(pb + 512) + l * 4);                                  \
            mw[l] = M ? vld1q_f32((const float *)(pb + 576) + l * 4) : dw[l];                      \
            m0w[l] = QSM ? vld1q_f32((const float *)(pb + 704) + l * 4) : dw[l];                   \
            m1w[l] = QSM ? vld1q_f32((const float *)(pb + 768) + l * 4) : dw[l];                   \
            s0[l] = S ? vld1q_s32((const int32_t *)(pb + 576) + l * 4) : vdupq_n_s32(0);           \
            s1[l] = S ? vld1q_s32((const int32_t *)(pb + 640) + l * 4) : vdupq_n_s32(0);           \
        }                                                                                          \
        for (int r = 0; r < R; r++) {                                                              \
            float32x4_t dxv = vdupq_n_f32(j->dx[(r0 + r) * nb + b]);                               \
            float32x4_t sxv = vdupq_n_f32(M ? j->sx[(r0 + r) * nb + b] : 0.0f);                    \
            for (int l = 0; l < 4; l++) {                                                          \
                int32x4_t is = S ? vaddq_s32(vmulq_s32(a[r][l], s0[l]), vmulq_s32(ah[r][l], s1[l])) \
                                 : a[r][l];                                                        \
                float32x4_t s = vmulq_f32(dw[l], dxv);                                             \
                f[r][l] = vaddq_f32(f[r][l], vmulq_f32(vcvtq_f32_s32(is), s));                     \
                if (M)                                                                             \
                    f[r][l] = vaddq_f32(f[r][l], vmulq_f32(mw[l], sxv));                           \
            }                                                                                      \
            if (QSM) {                                                                             \
                const int64_t o = (r0 + r) * nb + b;                                               \
                const float dxo = j->dx[o];                                                        \
                const float32x4_t sl = vdupq_n_f32(dxo * (float)j->xh[o]);                         \
                const float32x4_t sh = vdupq_n_f32(dxo * (float)(j->xs[o] - j->xh[o]));            \
                for (int l = 0; l < 4; l++) {                                                      \
                    f[r][l] = vaddq_f32(f[r][l], vmulq_f32(m0w[l], sl));                           \
                    f[r][l] = vaddq_f32(f[r][l], vmulq_f32(m1w[l], sh));                           \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    fs_store_neon(j, r0, R, f);                                                                    \
}                                                                                                  \
ATTR static void NAME##_panel(const fs_job *j, const int kind)                                     \
{                                                                                                  \
    int64_t r = 0;                                                                                 \
    for (; r + 2 <= j->n; r += 2)                                                                  \
        NAME(j, r, 2, kind);                                                                       \
    if (r < j->n)                                                                                  \
        NAME(j, r, 1, kind);                                                                       \
}

FS_NEON_TILE(fs_tile_neon, , fs_dot4_neon)

static void fs_kernel_neon_q(const fs_job *j) { fs_tile_neon_panel(j, FS_KIND_Q); }
static void fs_kernel_neon_qm(const fs_job *j) { fs_tile_neon_panel(j, FS_KIND_QM); }
static void fs_kernel_neon_qs(const fs_job *j) { fs_tile_neon_panel(j, FS_KIND_QS); }
static void fs_kernel_neon_qsm(const fs_job *j) { fs_tile_neon_panel(j, FS_KIND_QSM); }

#if defined(FS_HAVE_DOTPROD)
FS_DOTPROD FS_INLINE_ARM int32x4_t fs_dot4_sdot(int32x4_t acc, int8x16_t w, int8x16_t x)
{
    return vdotq_s32(acc, w, x);
}

FS_NEON_TILE(fs_tile_sdot, FS_DOTPROD, fs_dot4_sdot)

FS_DOTPROD static void fs_kernel_sdot_q(const fs_job *j) { fs_tile_sdot_panel(j, FS_KIND_Q); }
FS_DOTPROD static void fs_kernel_sdot_qm(const fs_job *j) { fs_tile_sdot_panel(j, FS_KIND_QM); }
FS_DOTPROD static void fs_kernel_sdot_qs(const fs_job *j) { fs_tile_sdot_panel(j, FS_KIND_QS); }
FS_DOTPROD static void fs_kernel_sdot_qsm(const fs_job *j) { fs_tile_sdot_panel(j, FS_KIND_QSM); }
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
        return (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vnni")) ? 1 : 0;
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

/* The kernel of an isa for a staged panel of kind (FS_KIND_*); NULL for the float kind (fs_float_panel). */
static fs_kernel fs_kernel_for(int isa, int kind)
{
#if defined(FS_X86)
    if (isa == FS_ISA_AVX2) {
        static const fs_kernel k[FS_N_KINDS] = {fs_kernel_avx2_q, fs_kernel_avx2_qm, fs_kernel_avx2_qs, NULL,
                                                fs_kernel_avx2_qsm};
        return k[kind];
    }
#if defined(FS_HAVE_AVX512VNNI)
    if (isa == FS_ISA_AVX512VNNI) {
        static const fs_kernel k[FS_N_KINDS] = {fs_kernel_avx512_q, fs_kernel_avx512_qm, fs_kernel_avx512_qs,
                                                NULL, fs_kernel_avx512_qsm};
        return k[kind];
    }
#endif
#endif
#if defined(FS_ARM64)
    if (isa == FS_ISA_NEON) {
        static const fs_kernel k[FS_N_KINDS] = {fs_kernel_neon_q, fs_kernel_neon_qm, fs_kernel_neon_qs, NULL,
                                                fs_kernel_neon_qsm};
        return k[kind];
    }
#if defined(FS_HAVE_DOTPROD)
    if (isa == FS_ISA_NEON_DOTPROD) {
        static const fs_kernel k[FS_N_KINDS] = {fs_kernel_sdot_q, fs_kernel_sdot_qm, fs_kernel_sdot_qs, NULL,
                                                fs_kernel_sdot_qsm};
        return k[kind];
    }
#endif
#endif
    static const fs_kernel k[FS_N_KINDS] = {fs_kernel_scalar_q, fs_kernel_scalar_qm, fs_kernel_scalar_qs, NULL,
                                            fs_kernel_scalar_qsm};
    (void)isa;
    return k[kind];
}

#include "_matmul_fused.h"
#include "_matmul_float.h"

/* ---- a product over the parts of a stacked matrix ------------------------------------------ */

/* One part: rows [col0, col0 + rows) of the matrix (columns of y), all of one GGUF type. */
typedef struct {
    int type, kind;
    const uint8_t *data;        /* rows x row_bytes, as the file stores them */
    int64_t rows, row_bytes, col0;
    int64_t first_panel;        /* the product's index of its first panel of 16 rows */
} fs_part;

/* A product's activations quantized by the threads of its tasks (Matmul.run from FS_QUANT_SPLIT_N rows): each
 * thread that starts a task takes FS_QUANT_ROWS rows at a time until none is left, then waits for the rows the
 * others took (running tasks are writing them), so no panel starts before every row is ready. A row's numbers
 * are its own: which thread writes it changes no bit. Before, the caller quantized every row while the helpers
 * waited (~3.4 ms of a 49-row verification pass of the default model on the Zen 2). */
#define FS_QUANT_SPLIT_N 8
#define FS_QUANT_ROWS 4

typedef struct {
    const float *x;
    int64_t ldx, n, n_in;
    int isa;
    int8_t *q;
    float *d;
    int32_t *qsum, *qhalf;
    float *sx;
    int64_t next, done;         /* rows taken, rows written (atomic) */
} fs_quant;

static void fs_quant_share(fs_quant *qt)
{
    const int64_t nb = (qt->n_in + FS_QK - 1) / FS_QK;
    if (__atomic_load_n(&qt->done, __ATOMIC_ACQUIRE) == qt->n)
        return;
    for (;;) {
        const int64_t r = __atomic_fetch_add(&qt->next, FS_QUANT_ROWS, __ATOMIC_RELAXED);
        if (r >= qt->n)
            break;
        const int64_t m = qt->n - r < FS_QUANT_ROWS ? qt->n - r : FS_QUANT_ROWS;
        fs_quantize_rows_isa(qt->isa, qt->x + r * qt->ldx, m, qt->n_in, qt->ldx, qt->q + r * nb * FS_QK,
                             qt->d + r * nb, qt->qsum + r * nb, qt->qhalf + r * nb, qt->sx + r * nb);
        __atomic_fetch_add(&qt->done, m, __ATOMIC_RELEASE);
    }
    while (__atomic_load_n(&qt->done, __ATOMIC_ACQUIRE) < qt->n)
        fs_relax();
}

typedef struct {
    const fs_part *parts;
    int n_parts;
    int64_t n_in, n_panels;
    int isa;
    fs_kernel kern[FS_N_KINDS];
    fs_job act;                 /* activations, n, y (the matrix's column 0) and ldy */
    uint8_t *stage;             /* one staging panel per task, stage_bytes apart */
    int64_t stage_bytes, chunk;
    int fused;                  /* panels fs_fused_ok accepts skip staging (_matmul_fused.h) */
    fs_quant *quant;            /* the activations to quantize first (fs_quant_share), or NULL: done before */
} fs_product;

static inline int64_t fs_part_panels(const fs_part *p)
{
    return (p->rows + FS_LANES - 1) / FS_LANES;
}

/* 16 rows (valid of them real) of one type into the kernels' layout, with the isa's decoder; next:
 * the next panel's rows (16 * row_bytes bytes) to prefetch meanwhile, or NULL. */
static void fs_stage_panel(int isa, int type, const uint8_t *rows, int64_t row_bytes, int valid,
                           int64_t n_in, uint8_t *stage, const uint8_t *next)
{
#if defined(FS_HAVE_STAGE_AVX512)
    /* whole panels (the loads read 16 rows) of the types with a SIMD decoder */
    if (isa == FS_ISA_AVX512VNNI && valid == FS_LANES &&
        (type == FS_T_Q4_0 || type == FS_T_Q4_1 || type == FS_T_Q5_0 || type == FS_T_Q5_1)) {
        fs_stage_q45_avx512(type, rows, row_bytes, n_in / FS_QK, stage, next);
        return;
    }
    if (isa == FS_ISA_AVX512VNNI && valid == FS_LANES && type == FS_T_Q8_0) {
        fs_stage_q8_avx512(rows, row_bytes, n_in / FS_QK, stage, next);
        return;
    }
    if (isa == FS_ISA_AVX512VNNI && valid == FS_LANES && (type == FS_T_Q4_K || type == FS_T_Q5_K)) {
        fs_stage_k45_avx512(type == FS_T_Q5_K, rows, row_bytes, n_in / FS_QK, stage, next);
        return;
    }
    if (isa == FS_ISA_AVX512VNNI && valid == FS_LANES && type == FS_T_Q6_K) {
        fs_stage_q6k_avx512(rows, row_bytes, n_in / FS_QK, stage, next);
        return;
    }
    if (isa == FS_ISA_AVX512VNNI && valid == FS_LANES && FS_TABLE_TYPE(type)) {
        fs_stage_iq4_avx512(type, rows, row_bytes, n_in / FS_QK, stage, next);
        return;
    }
    if (isa == FS_ISA_AVX512VNNI && valid == FS_LANES && (type == FS_T_Q3_K || type == FS_T_Q2_K)) {
        (type == FS_T_Q3_K ? fs_stage_q3k_avx512 : fs_stage_q2k_avx512)(rows, row_bytes, n_in / FS_QK, stage, next);
        return;
    }
#endif
#if defined(FS_HAVE_STAGE_AVX2)
    if (isa == FS_ISA_AVX2 && valid == FS_LANES &&
        (type == FS_T_Q4_0 || type == FS_T_Q4_1 || type == FS_T_Q5_0 || type == FS_T_Q5_1 || type == FS_T_Q8_0)) {
        fs_stage_q48_avx2(type, rows, row_bytes, n_in / FS_QK, stage, next);
        return;
    }
    if (isa == FS_ISA_AVX2 && valid == FS_LANES && (type == FS_T_Q4_K || type == FS_T_Q5_K)) {
        fs_stage_k45_avx2(type == FS_T_Q5_K, rows, row_bytes, n_in / FS_QK, stage, next);
        return;
    }
    if (isa == FS_ISA_AVX2 && valid == FS_LANES && type == FS_T_Q6_K) {
        fs_stage_q6k_avx2(rows, row_bytes, n_in / FS_QK, stage, next);
        return;
    }
    if (isa == FS_ISA_AVX2 && valid == FS_LANES && FS_TABLE_TYPE(type)) {
        fs_stage_iq4_avx2(type, rows, row_bytes, n_in / FS_QK, stage, next);
        return;
    }
    if (isa == FS_ISA_AVX2 && valid == FS_LANES && (type == FS_T_Q3_K || type == FS_T_Q2_K)) {
        (type == FS_T_Q3_K ? fs_stage_q3k_avx2 : fs_stage_q2k_avx2)(rows, row_bytes, n_in / FS_QK, stage, next);
        return;
    }
#endif
    (void)isa;
    fs_prefetch_range(next, 0, 16 * row_bytes);
    fs_stage_panel_scalar(type, rows, row_bytes, valid, n_in, stage, fs_stage_bias(isa == FS_ISA_AVX2, type));
}

/* The fused kernels hold at most FS_FUSED_MAX_N activation rows in registers. On AVX2 a few more rows of narrow
 * matrices (n_in <= FS_FUSED_GROUPS_MAX_IN) still take them, in groups of that many over the same panel (its
 * rows in L1 after the first group): there a panel's staging costs more than the fused kernels' extra work
 * per row. Measured on the Zen 2 (2 threads, products fused / staged): 576 inputs, Q4_0 / Q4_1 / Q5_0 / Q8_0
 * 0.92 / 0.88 / 0.87 / 0.71 at n = 5, 1.00 / 0.91 / 0.94 / 0.75 at 6, 1.10 / 1.01 / 1.03 / 0.80 at 8; 2048
 * inputs Q4_0 1.11 at n = 5; the default model's verification of 4 drafts 37.2 -> 33.8 ms at 3,100 tokens
 * of context (bench/bench_verify_cost.py). Each row's bits are its own either way. */
#define FS_FUSED_GROUPS_MAX_N 6
#define FS_FUSED_GROUPS_MAX_IN 1536

/* The rows n that fs_fused_ok is asked about: a group's when the product's rows run in groups. */
static inline int64_t fs_fused_group(const fs_product *pr, int64_t n)
{
    return pr->isa == FS_ISA_AVX2 && n > FS_FUSED_MAX_N && n <= FS_FUSED_GROUPS_MAX_N &&
           pr->n_in <= FS_FUSED_GROUPS_MAX_IN ? FS_FUSED_MAX_N : n;
}

/* A panel's product by the fused kernel, its rows in groups of at most FS_FUSED_MAX_N (fs_fused_group). */
static void fs_fused_rows(int isa, int type, const fs_job *j, const uint8_t *rows, int64_t row_bytes,
                          const uint8_t *next)
{
    if (j->n <= FS_FUSED_MAX_N) {
        fs_fused_panel(isa, type, j, rows, row_bytes, next);
        return;
    }
    for (int64_t r0 = 0; r0 < j->n; r0 += FS_FUSED_MAX_N) {
        fs_job g = *j;
        const int64_t o = r0 * j->nb;
        g.n = j->n - r0 < FS_FUSED_MAX_N ? j->n - r0 : FS_FUSED_MAX_N;
        g.xq = j->xq + o * FS_QK;
        g.dx = j->dx + o;
        g.xs = j->xs + o;
        g.xh = j->xh + o;
        g.sx = j->sx + o;
        g.y = j->y + r0 * j->ldy;
        fs_fused_panel(isa, type, &g, rows, row_bytes, r0 == 0 ? next : NULL);
    }
}

/* Panels [begin, end) of the product: fs_task_fn for fs_pool_run. Task t (begin = t * chunk, or
 * the whole range without helpers) stages into its own buffer. */
static void fs_product_task(void *ctx, int64_t begin, int64_t end)
{
    const fs_product *pr = (const fs_product *)ctx;
    if (pr->quant)
        fs_quant_share(pr->quant);
    uint8_t *stage = pr->stage ? pr->stage + begin / pr->chunk * pr->stage_bytes : NULL;     /* float only: none */
    int pi = 0;
    for (int64_t g = begin; g < end; g++) {
        while (g >= pr->parts[pi].first_panel + fs_part_panels(&pr->parts[pi]))
            pi++;
        const fs_part *pt = &pr->parts[pi];
        const int64_t r0 = (g - pt->first_panel) * FS_LANES, panel_bytes = FS_LANES * pt->row_bytes;
        const int valid = (int)(pt->rows - r0 < FS_LANES ? pt->rows - r0 : FS_LANES);
        fs_job j = pr->act;
        j.valid = valid;
        j.y = pr->act.y + pt->col0 + r0;
        const int direct = pt->kind == FS_KIND_F,
                  fused = !direct && pr->fused && fs_fused_ok(pr->isa, pt->type, fs_fused_group(pr, j.n), valid);
        /* Rows `ahead` panels ahead (in this part) come into L2 while this panel is decoded; a
         * task's first panel also asks for the ones between. */
        const int64_t ahead = fused || direct ? FS_PREFETCH_PANELS_FUSED : FS_PREFETCH_PANELS;
        if (g == begin || r0 == 0) {
            int64_t upto = r0 + ahead * FS_LANES < pt->rows ? r0 + ahead * FS_LANES : pt->rows;
            fs_prefetch_range(pt->data, r0 * pt->row_bytes, upto * pt->row_bytes);
        }
        const uint8_t *next = r0 + (ahead + 1) * FS_LANES <= pt->rows
                              ? pt->data + r0 * pt->row_bytes + ahead * panel_bytes : NULL;
        if (direct) {
            fs_float_panel(pr->isa, pt->type, &j, pt->data + r0 * pt->row_bytes, pt->row_bytes, next);
            continue;
        }
        if (fused) {
            fs_fused_rows(pr->isa, pt->type, &j, pt->data + r0 * pt->row_bytes, pt->row_bytes, next);
            continue;
        }
        fs_stage_panel(pr->isa, pt->type, pt->data + r0 * pt->row_bytes, pt->row_bytes, valid, pr->n_in, stage, next);
        j.w = stage;
        j.type = pt->type;
        pr->kern[pt->kind](&j);
    }
}

/* Panels per task for threads threads: tasks of >= ~64k multiply-adds, so that claiming one costs
 * well under 1 % of it, and about FS_TASKS_PER_THREAD per thread: long runs of adjacent panels keep
 * each core's prefetcher on one sequential stream, and the last tasks still balance the threads. */
static int64_t fs_product_chunk(int threads, int64_t n_panels, int64_t nb, int64_t n)
{
    int64_t per_panel = FS_LANES * nb * FS_QK * (n > 0 ? n : 1);
    int64_t chunk = (65536 + per_panel - 1) / per_panel;
    if (threads <= 1)
        return n_panels > 0 ? n_panels : 1;
    int64_t even = (n_panels + FS_TASKS_PER_THREAD * threads - 1) / (FS_TASKS_PER_THREAD * threads);
    return even > chunk ? even : chunk;
}

#endif /* FASTSERVE_MATMUL_KERNELS_H */
