/* The element-wise operations of a transformer layer, float32, each on one row (or one token's heads):
 * RMSNorm, bias add, RoPE from cos/sin tables, SwiGLU / GeGLU, residual add, scale, logit softcap.
 * fastserve/backends/cpu/_forward.pyx runs them between the matrix products; fastserve/backends/cpu/ref/layer_ops.py is the NumPy
 * twin, bit for bit (tests/parity/test_layer_ops.py).
 *
 * Every result is a fixed sequence of float32 operations, each rounded (built with -ffp-contract=off:
 * no fused multiply-add), so it does not depend on the ISA the compiler vectorises for, the row count,
 * the thread that runs the row or the batch:
 *   sum of squares of x[0..d): 16 lanes, lane j adding x[i]^2 for i = j, j + 16, ... in order of i, then
 *     lanes folded in halves (j += j + 8, then j + 4, j + 2, j + 1);
 *   rms_norm:  r = 1 / sqrt(ss / d + eps), out[i] = (x[i] * r) * w[i];
 *   e^x for x <= 0 (fs_exp_neg, ~1 ulp): x clamped to [-87, 0] (0 below -87); n = rint(x * log2 e),
 *     r = (x - n * LN2_HI) - n * LN2_LO (Cody-Waite: n * LN2_HI and the first difference exact, |r| <= 0.35),
 *     p = Horner of the degree-7 Taylor polynomial of e^r (1/7!, 1/6!, ..., 1, 1), result p * 2^n;
 *   sigmoid(z) = (z >= 0 ? 1 : t) / (1 + t) with t = e^-|z| (no overflow, as t <= 1);
 *     tanh(z) = sign(z) * (1 - t) / (1 + t) with t = e^(-2|z|);
 *   silu(g) * u = (g * sigmoid(g)) * u;
 *   gelu(g) * u = (g * sigmoid(k * (g * (1 + 0.044715 g^2)))) * u, k = 2 sqrt(2/pi): GELU's tanh form,
 *     as 0.5 (1 + tanh(y)) = sigmoid(2y);
 *   swiglu_oai(g, u) = (x * sigmoid(1.702 * x)) * (y + 1), x = min(g, 7), y = clamp(u, -7, 7): gpt-oss's
 *     SwiGLU (llama.cpp's ggml_swiglu_oai, alpha 1.702, limit 7; a NaN stays NaN);
 *   RoPE of a pair (a, b) by angle (c, s): (a * c - b * s, a * s + b * c).
 */
#ifndef FASTSERVE_LAYER_OPS_H
#define FASTSERVE_LAYER_OPS_H

#include <stdint.h>
#include <math.h>

#include "_attention_kernels.h"     /* fs_rintf, fs_bits_f32, FS_LOG2E */

#define FS_NORM_LANES 16
#define FS_GELU_K 0x1.988454p+0f    /* float32(2 * sqrt(2 / pi)) */
#define FS_GELU_C 0x1.6e4e26p-5f    /* float32(0.044715) */
#define FS_LN2_HI 0x1.62e400p-1f    /* ln 2's first 15 bits: n * FS_LN2_HI is exact for |n| < 512 */
#define FS_LN2_LO 0x1.7f7d1cp-20f   /* float32(ln 2 - FS_LN2_HI) */

static inline float fs_sum_squares(const float *x, int64_t d)
{
    float acc[FS_NORM_LANES] = {0};
    int64_t i = 0;
    for (; i + FS_NORM_LANES <= d; i += FS_NORM_LANES)
        for (int j = 0; j < FS_NORM_LANES; j++)
            acc[j] += x[i + j] * x[i + j];
    for (int j = 0; i + j < d; j++)
        acc[j] += x[i + j] * x[i + j];
    for (int w = FS_NORM_LANES / 2; w >= 1; w /= 2)
        for (int j = 0; j < w; j++)
            acc[j] += acc[j + w];
    return acc[0];
}

/* out[0..d) = x / rms(x) * w (out may be x). */
static inline void fs_rms_norm(const float *x, int64_t d, const float *w, float eps, float *out)
{
    float ms = fs_sum_squares(x, d) / (float)d;
    ms += eps;
    float r = 1.0f / sqrtf(ms);
    for (int64_t i = 0; i < d; i++)
        out[i] = (x[i] * r) * w[i];
}

/* In place: each of `heads` rows of D (consecutive) normed with w [D]. */
static inline void fs_head_norm(float *x, int64_t heads, int64_t D, const float *w, float eps)
{
    for (int64_t h = 0; h < heads; h++)
        fs_rms_norm(x + h * D, D, w, eps, x + h * D);
}

/* In place: x[i] += b[i]. Also the residual add. */
static inline void fs_add(float *x, const float *b, int64_t d)
{
    for (int64_t i = 0; i < d; i++)
        x[i] += b[i];
}

static inline void fs_scale(float *x, int64_t d, float s)
{
    for (int64_t i = 0; i < d; i++)
        x[i] *= s;
}

/* In place: RoPE of `heads` consecutive head rows of D with one token's cos/sin [rope_dim / 2]: pairs
 * (2i, 2i + 1) of the first rope_dim values (llama.cpp's normal RoPE), or (i, i + rope_dim / 2) (NeoX). */
static inline void fs_rope(float *x, int64_t heads, int64_t D, int64_t rope_dim, int neox,
                           const float *cos, const float *sin)
{
    int64_t half = rope_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *xh = x + h * D;
        for (int64_t i = 0; i < half; i++) {
            int64_t ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
            float a = xh[ia], b = xh[ib], c = cos[i], s = sin[i];
            xh[ia] = a * c - b * s;
            xh[ib] = a * s + b * c;
        }
    }
}

/* e^x for x <= 0, float32 within ~1 ulp (the contract above). Not attention's fs_exp2(x * log2 e): there the
 * rounding of x * log2 e alone costs |x| * 2^-24 relative (measured: up to ~60 ulp near -87, ~8 above -8). */
static inline float fs_exp_neg(float x)
{
    float xc = x > -87.0f ? x : -87.0f;
    xc = xc < 0.0f ? xc : 0.0f;
    float n = fs_rintf(xc * FS_LOG2E);
    float r = (xc - n * FS_LN2_HI) - n * FS_LN2_LO;
    float p = 0x1.a01a02p-13f;               /* 1/7! */
    p = p * r + 0x1.6c16c2p-10f;             /* 1/6! */
    p = p * r + 0x1.111112p-7f;              /* 1/5! */
    p = p * r + 0x1.555556p-5f;              /* 1/4! */
    p = p * r + 0x1.555556p-3f;              /* 1/3! */
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    float e = p * fs_bits_f32((uint32_t)((int32_t)n + 127) << 23);
    return x < -87.0f ? 0.0f : e;
}

static inline float fs_sigmoid(float z)
{
    float t = fs_exp_neg(-fabsf(z));
    return (z >= 0.0f ? 1.0f : t) / (1.0f + t);
}

static inline float fs_tanh(float z)
{
    float t = fs_exp_neg(-2.0f * fabsf(z));
    float r = (1.0f - t) / (1.0f + t);
    return z < 0.0f ? -r : r;
}

/* out[i] = silu(gate[i]) * up[i] (out may be gate). */
static inline void fs_swiglu(const float *gate, const float *up, int64_t n, float *out)
{
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i];
        out[i] = (g * fs_sigmoid(g)) * up[i];
    }
}

/* out[i] = gelu(gate[i]) * up[i], GELU's tanh form (out may be gate). */
static inline void fs_geglu(const float *gate, const float *up, int64_t n, float *out)
{
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i];
        float y = ((g * g) * FS_GELU_C + 1.0f) * g;
        out[i] = (g * fs_sigmoid(y * FS_GELU_K)) * up[i];
    }
}

#define FS_OAI_ALPHA 1.702f
#define FS_OAI_LIMIT 7.0f

/* out[i] = swiglu_oai(gate[i], up[i]) (out may be gate). */
static inline void fs_swiglu_oai(const float *gate, const float *up, int64_t n, float *out)
{
    for (int64_t i = 0; i < n; i++) {
        float x = gate[i] > FS_OAI_LIMIT ? FS_OAI_LIMIT : gate[i];
        float y = up[i] > FS_OAI_LIMIT ? FS_OAI_LIMIT : up[i] < -FS_OAI_LIMIT ? -FS_OAI_LIMIT : up[i];
        out[i] = (x * fs_sigmoid(FS_OAI_ALPHA * x)) * (y + 1.0f);
    }
}

/* ---- the GLUs, eight elements at a time (AVX2) ------------------------------------------------------
 * Each output is its own gate and up element's alone, so the vector code runs the scalar code's operations
 * above, in the same order with the same roundings, on eight elements at once: the same bits. Every ?: of
 * the scalar code is an ordered compare and a blend (a NaN takes the same branch), rint the same magic
 * add and subtract, 2^n the same exponent bits. Chosen at run time (fs_glu); the tail of a row stays scalar. */
#if defined(__x86_64__) || defined(__i386__)
#define FS_LAYER_X86 1
#include <immintrin.h>

__attribute__((target("avx2")))
static inline __m256 fs_exp_neg8(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-87.0f), zero = _mm256_setzero_ps(), magic = _mm256_set1_ps(12582912.0f);
    __m256 xc = _mm256_blendv_ps(lo, x, _mm256_cmp_ps(x, lo, _CMP_GT_OQ));
    xc = _mm256_blendv_ps(zero, xc, _mm256_cmp_ps(xc, zero, _CMP_LT_OQ));
    __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(FS_LOG2E)), magic), magic);
    __m256 r = _mm256_sub_ps(_mm256_sub_ps(xc, _mm256_mul_ps(n, _mm256_set1_ps(FS_LN2_HI))),
                             _mm256_mul_ps(n, _mm256_set1_ps(FS_LN2_LO)));
    __m256 p = _mm256_set1_ps(0x1.a01a02p-13f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(0x1.6c16c2p-10f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(0x1.111112p-7f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(0x1.555556p-5f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(0x1.555556p-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(0.5f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 v = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_blendv_ps(v, zero, _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
}

__attribute__((target("avx2")))
static inline __m256 fs_sigmoid8(__m256 z)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 t = fs_exp_neg8(_mm256_or_ps(z, _mm256_set1_ps(-0.0f)));        /* e^-|z| */
    __m256 num = _mm256_blendv_ps(t, one, _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_GE_OQ));
    return _mm256_div_ps(num, _mm256_add_ps(one, t));
}

/* kind: 0 silu, 1 gelu, 2 swiglu_oai (_forward.pyx's GLU_KINDS); the first n - n % 8 outputs. */
__attribute__((target("avx2")))
static int64_t fs_glu_avx2(int kind, const float *gate, const float *up, int64_t n, float *out)
{
    const __m256 lim = _mm256_set1_ps(FS_OAI_LIMIT), nlim = _mm256_set1_ps(-FS_OAI_LIMIT);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i), u = _mm256_loadu_ps(up + i), o;
        if (kind == 1) {
            __m256 y = _mm256_mul_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(g, g), _mm256_set1_ps(FS_GELU_C)),
                                                   _mm256_set1_ps(1.0f)), g);
            o = _mm256_mul_ps(_mm256_mul_ps(g, fs_sigmoid8(_mm256_mul_ps(y, _mm256_set1_ps(FS_GELU_K)))), u);
        } else if (kind == 2) {
            __m256 x = _mm256_blendv_ps(g, lim, _mm256_cmp_ps(g, lim, _CMP_GT_OQ));
            __m256 y = _mm256_blendv_ps(_mm256_blendv_ps(u, nlim, _mm256_cmp_ps(u, nlim, _CMP_LT_OQ)), lim,
                                        _mm256_cmp_ps(u, lim, _CMP_GT_OQ));
            o = _mm256_mul_ps(_mm256_mul_ps(x, fs_sigmoid8(_mm256_mul_ps(_mm256_set1_ps(FS_OAI_ALPHA), x))),
                              _mm256_add_ps(y, _mm256_set1_ps(1.0f)));
        } else {
            o = _mm256_mul_ps(_mm256_mul_ps(g, fs_sigmoid8(g)), u);
        }
        _mm256_storeu_ps(out + i, o);
    }
    return i;
}
#endif

/* 1 where fs_glu may take the AVX2 code (the machine has it). */
static inline int fs_glu_simd_supported(void)
{
#ifdef FS_LAYER_X86
    return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

/* out[i] = the GLU `kind` of gate[i] and up[i] (out may be gate); simd: the AVX2 code for the first
 * n - n % 8 (fs_glu_simd_supported() must be 1). The same bits either way. */
static inline void fs_glu(int kind, const float *gate, const float *up, int64_t n, float *out, int simd)
{
    int64_t i = 0;
#ifdef FS_LAYER_X86
    if (simd)
        i = fs_glu_avx2(kind, gate, up, n, out);
#else
    (void)simd;
#endif
    if (kind == 1)
        fs_geglu(gate + i, up + i, n - i, out + i);
    else if (kind == 2)
        fs_swiglu_oai(gate + i, up + i, n - i, out + i);
    else
        fs_swiglu(gate + i, up + i, n - i, out + i);
}

/* In place: x = c * tanh(x / c). */
static inline void fs_softcap(float *x, int64_t n, float c)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = fs_tanh(x[i] / c) * c;
}

#endif
