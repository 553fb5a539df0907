/* The attention kernel pieces, written once and included by _attention_kernels.h once per ISA
 * (FS_SIMD_SCALAR, FS_SIMD_AVX2, FS_SIMD_AVX512, FS_SIMD_NEON defined around the #include). Every piece does, per
 * lane, exactly the float32 operations of the contract at the top of _attention_kernels.h; the ISAs
 * differ only in how many keys (qk) or dimensions (pv) one instruction covers. */

#if defined(FS_SIMD_SCALAR)
#define FS_S(name) name##_scalar
#define FS_ATTR
#define VL 1
#define NV 1                       /* vectors per row in qk / pv register blocks */
#define RB 4                       /* rows per block */
typedef float fs_vf_scalar;
#define VF fs_vf_scalar
#define VLOAD(p) (*(p))
#define VSTORE(p, v) (*(p) = (v))
#define VSET1(x) (x)
#define VMUL(a, b) ((a) * (b))
#define VADD(a, b) ((a) + (b))
#define VDIV(a, b) ((a) / (b))
#define VMAXF(a, b) ((a) > (b) ? (a) : (b))
#define VHMAX(v) (v)
#define VLOAD_F16(p) fs_f16_to_f32(*(p))
#define VLOAD_I8(p) ((float)*(p))
#define VMINF(a, b) ((a) < (b) ? (a) : (b))
#define VSUB(a, b) ((a) - (b))
#define VPOW2I(n) fs_bits_f32((uint32_t)((int32_t)(n) + 127) << 23)
#define VZERO_BELOW(x, t, r) ((x) < (t) ? 0.0f : (r))

#elif defined(FS_SIMD_AVX2)
#define FS_S(name) name##_avx2
#define FS_ATTR __attribute__((target("avx2,f16c")))
#define VL 8
#define NV 2
#define RB 6                       /* 12 accumulators of 16: 3 % under 4 rows on a verification block (Zen 2) */
#define VF __m256
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps((p), (v))
#define VSET1(x) _mm256_set1_ps(x)
#define VMUL(a, b) _mm256_mul_ps((a), (b))
#define VADD(a, b) _mm256_add_ps((a), (b))
#define VDIV(a, b) _mm256_div_ps((a), (b))
#define VMAXF(a, b) _mm256_max_ps((a), (b))
#define VLOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define VLOAD_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
FS_ATTR static inline float fs_hmax_avx2(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}
#define VHMAX(v) fs_hmax_avx2(v)
#define VMINF(a, b) _mm256_min_ps((a), (b))
#define VSUB(a, b) _mm256_sub_ps((a), (b))
#define VPOW2I(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
#define VZERO_BELOW(x, t, r) _mm256_andnot_ps(_mm256_cmp_ps((x), _mm256_set1_ps(t), _CMP_LT_OQ), (r))

#elif defined(FS_SIMD_AVX512)
#define FS_S(name) name##_avx512
#define FS_ATTR __attribute__((target("avx512f,avx512bw,f16c")))
#define VL 16
#define NV 4
#define RB 4
#define VF __m512
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps((p), (v))
#define VSET1(x) _mm512_set1_ps(x)
#define VMUL(a, b) _mm512_mul_ps((a), (b))
#define VADD(a, b) _mm512_add_ps((a), (b))
#define VDIV(a, b) _mm512_div_ps((a), (b))
#define VMAXF(a, b) _mm512_max_ps((a), (b))
#define VHMAX(v) _mm512_reduce_max_ps(v)
#define VLOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define VLOAD_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define VMINF(a, b) _mm512_min_ps((a), (b))
#define VSUB(a, b) _mm512_sub_ps((a), (b))
#define VPOW2I(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
#define VZERO_BELOW(x, t, r) _mm512_maskz_mov_ps((__mmask16)~_mm512_cmp_ps_mask((x), _mm512_set1_ps(t), _CMP_LT_OQ), (r))

#elif defined(FS_SIMD_NEON)
/* AArch64 Advanced SIMD (baseline there: no target attribute). max / min as the scalar and x86
 * macros pick (a > b ? a : b), not vmaxq's NaN rule; int8 loads read exactly VL bytes. */
#define FS_S(name) name##_neon
#define FS_ATTR
#define VL 4
#define NV 4
#define RB 4
#define VF float32x4_t
#define VLOAD(p) vld1q_f32(p)
#define VSTORE(p, v) vst1q_f32((p), (v))
#define VSET1(x) vdupq_n_f32(x)
#define VMUL(a, b) vmulq_f32((a), (b))
#define VADD(a, b) vaddq_f32((a), (b))
#define VDIV(a, b) vdivq_f32((a), (b))
#define VMAXF(a, b) fs_vmax_neon((a), (b))
static inline float32x4_t fs_vmax_neon(float32x4_t a, float32x4_t b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
static inline float32x4_t fs_vmin_neon(float32x4_t a, float32x4_t b) { return vbslq_f32(vcltq_f32(a, b), a, b); }
static inline float fs_hmax_neon(float32x4_t v)
{
    float x[4];
    vst1q_f32(x, v);
    float m = x[0];
    for (int i = 1; i < 4; i++)
        m = x[i] > m ? x[i] : m;
    return m;
}
static inline float32x4_t fs_load_i8_neon(const int8_t *p)
{
    int32_t w;
    memcpy(&w, p, 4);
    int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(w)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
}
#define VHMAX(v) fs_hmax_neon(v)
#define VLOAD_F16(p) vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(p))))
#define VLOAD_I8(p) fs_load_i8_neon((const int8_t *)(p))
#define VMINF(a, b) fs_vmin_neon((a), (b))
#define VSUB(a, b) vsubq_f32((a), (b))
#define VPOW2I(n) vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23))
#define VZERO_BELOW(x, t, r) vbslq_f32(vcltq_f32((x), vdupq_n_f32(t)), vdupq_n_f32(0.0f), (r))
#endif

/* x[u] = exp2(x[u]) for U (a constant) vectors in lock step: the polynomial's chains are long (a multiply and
 * an add per coefficient, one after the other), so that one vector at a time leaves the pipes idle; 8 (a key
 * tile's row, AVX2) keep Zen 2's two multipliers and two adders busier than 4. Each vector's operations are
 * those of U = 1. */
FS_ATTR static inline __attribute__((always_inline)) void FS_S(fs_exp2v_n)(VF *x, const int U)
{
    const VF magic = VSET1(12582912.0f);
    VF n[8], f[8], p[8];
    for (int u = 0; u < U; u++) {
        VF xc = VMINF(VMAXF(x[u], VSET1(-127.0f)), VSET1(0.0f));
        n[u] = VSUB(VADD(xc, magic), magic);
        f[u] = VSUB(xc, n[u]);
        p[u] = VSET1(FS_E6);
    }
    const float coef[6] = {FS_E5, FS_E4, FS_E3, FS_E2, FS_E1, 1.0f};
    for (int c = 0; c < 6; c++)
        for (int u = 0; u < U; u++)
            p[u] = VADD(VMUL(p[u], f[u]), VSET1(coef[c]));
    for (int u = 0; u < U; u++)
        x[u] = VZERO_BELOW(x[u], -126.0f, VMUL(p[u], VPOW2I(n[u])));
}

/* fs_exp2 (_attention_kernels.h) lane by lane. */
FS_ATTR static inline VF FS_S(fs_exp2v)(VF x)
{
    FS_S(fs_exp2v_n)(&x, 1);
    return x;
}

/* s[0 .. U VL) = fs_exp2v(s + mb), U vectors in lock step (fs_exp2v_n). */
FS_ATTR static inline __attribute__((always_inline)) void FS_S(fs_exp2v_xu)(float *s, VF mb, const int U)
{
    VF x[8];
    for (int u = 0; u < U; u++)
        x[u] = VADD(VLOAD(s + u * VL), mb);
    FS_S(fs_exp2v_n)(x, U);
    for (int u = 0; u < U; u++)
        VSTORE(s + u * VL, x[u]);
}

/* kt [D][KT] float32 from the tile's storage (f32: the cache itself, no copy). */
FS_ATTR static const float *FS_S(fs_k_tile)(int type, const uint8_t *src, int64_t D, float *kt)
{
    if (type == FS_KV_F32)
        return (const float *)src;
    if (type == FS_KV_F16) {
        const uint16_t *h = (const uint16_t *)src;
        for (int64_t i = 0; i < D * FS_KT; i += VL)
            VSTORE(kt + i, VLOAD_F16(h + i));
        return kt;
    }
    const uint16_t *scales = (const uint16_t *)src;
    const int8_t *q = (const int8_t *)(src + D / FS_QB * FS_KT * 2);
    for (int64_t d = 0; d < D; d++)
        for (int64_t j = 0; j < FS_KT; j += VL)
            VSTORE(kt + d * FS_KT + j, VMUL(VLOAD_I8(q + d * FS_KT + j), VLOAD_F16(scales + d / FS_QB * FS_KT + j)));
    return kt;
}

/* vt [KT][Dp] float32: keys 0..nk-1 of the tile (rows `stride` bytes apart), dimensions D..Dp zero. */
FS_ATTR static void FS_S(fs_v_tile)(int type, const uint8_t *src, int64_t stride, int64_t D, int64_t Dp,
                                    int64_t nk, float *vt)
{
    for (int64_t j = 0; j < nk; j++) {
        const uint8_t *row = src + j * stride;
        float *o = vt + j * Dp;
        int64_t d = 0;
        if (type == FS_KV_F32) {
            memcpy(o, row, (size_t)D * 4);
            d = D;
        } else if (type == FS_KV_F16) {
            const uint16_t *h = (const uint16_t *)row;
            for (; d + VL <= D; d += VL)
                VSTORE(o + d, VLOAD_F16(h + d));
            for (; d < D; d++)
                o[d] = fs_f16_to_f32(h[d]);
        } else {
            for (int64_t b = 0; b < D / FS_QB; b++) {
                uint16_t dh;
                memcpy(&dh, row + b * FS_Q8_BLOCK, 2);
                float dq = fs_f16_to_f32(dh);
                const int8_t *qb = (const int8_t *)(row + b * FS_Q8_BLOCK + 2);
                for (int i = 0; i < FS_QB; i += VL)
                    VSTORE(o + b * FS_QB + i, VMUL(VLOAD_I8(qb + i), VSET1(dq)));
            }
            d = D;
        }
        for (; d < Dp; d++)
            o[d] = 0.0f;
    }
}

/* s[r][0..KT) = sum over d in order of q[r][d] * kt[d][j], for nr (<= RB) rows in a block (vectorised over
 * keys), kt the cache's own fp16 tile, converted as it is read (the same values as a float32 tile's). */
FS_ATTR static inline __attribute__((always_inline)) void FS_S(fs_qk_block)(const float *const *q, const uint16_t *kt,
                                                                           int64_t D, float *const *s, int nr,
                                                                           const fs_attn_next *nx)
{
    for (int64_t j0 = 0; j0 < FS_KT; j0 += NV * VL) {
        int64_t lo = 0, hi = 0;                        /* this pass's share of the next tile's rows */
        if (nx)
            fs_attn_share(nx->k_row, j0 / (NV * VL), FS_KT / (NV * VL), &lo, &hi);
        VF acc[RB][NV];
        for (int r = 0; r < nr; r++)
            for (int v = 0; v < NV; v++)
                acc[r][v] = VSET1(0.0f);
        for (int64_t d = 0; d < D; d++) {
            if (nx)
                fs_attn_prefetch(nx->k + d * nx->k_row, lo, hi);
            VF kv[NV];
            for (int v = 0; v < NV; v++) {
                int64_t i = d * FS_KT + j0 + v * VL;
                kv[v] = VLOAD_F16(kt + i);
            }
            for (int r = 0; r < nr; r++) {
                VF qb = VSET1(q[r][d]);
                for (int v = 0; v < NV; v++)
                    acc[r][v] = VADD(acc[r][v], VMUL(qb, kv[v]));
            }
        }
        for (int r = 0; r < nr; r++)
            for (int v = 0; v < NV; v++)
                VSTORE(s[r] + j0 + v * VL, acc[r][v]);
    }
}

/* The row count as a constant in each case (the loops over rows unrolled, no padding row computed); the
 * calls below also compile apart with and without a next tile to read ahead (nx NULL: no check left in
 * the loops, which prefill's many-row blocks take). */
#define FS_NR_CASES(nr, call) \
    switch (nr) { case 1: call(1); break; case 2: call(2); break; case 3: call(3); break; \
                  case 4: call(4 < RB ? 4 : RB); break; case 5: call(5 < RB ? 5 : RB); break; default: call(RB); }

/* One row's scores over a float32 tile, all KT keys at once: KT / VL sums, one broadcast of q[d] per KT / VL
 * products (Zen 2 AVX2: ~3.3 vector products or sums a cycle this way, ~2.9 in blocks of 6 rows x 2
 * vectors; a broadcast costs about as much as a product there). pf: read the next K tile ahead. */
FS_ATTR static inline __attribute__((always_inline)) void FS_S(fs_qk_row)(const float *q, const float *kt, int64_t D,
                                                                         float *s, const fs_attn_next *pf)
{
    VF acc[FS_KT / VL];
    for (int v = 0; v < FS_KT / VL; v++)
        acc[v] = VSET1(0.0f);
    for (int64_t d = 0; d < D; d++) {
        if (pf)
            fs_attn_prefetch(pf->k + d * pf->k_row, 0, pf->k_row);
        VF qb = VSET1(q[d]);
        for (int v = 0; v < FS_KT / VL; v++)
            acc[v] = VADD(acc[v], VMUL(qb, VLOAD(kt + d * FS_KT + v * VL)));
    }
    for (int v = 0; v < FS_KT / VL; v++)
        VSTORE(s + v * VL, acc[v]);
}

/* s[r][0..KT) = sum over d in order of q[r][d] * kt[d][j] for nr rows, kt float32, row by row (the first
 * reads the next tile ahead). */
FS_ATTR static void FS_S(fs_qk)(const float *const *q, const float *kt, int64_t D, float *const *s, int nr,
                                const fs_attn_next *nx)
{
    int r = 0;
    if (nx)
        FS_S(fs_qk_row)(q[r], kt, D, s[r], nx), r++;
    for (; r < nr; r++)
        FS_S(fs_qk_row)(q[r], kt, D, s[r], NULL);
}

FS_ATTR static void FS_S(fs_qk_f16)(const float *const *q, const uint16_t *kt, int64_t D, float *const *s, int nr,
                                    const fs_attn_next *nx)
{
#define FS_CALL(k) (nx ? FS_S(fs_qk_block)(q, kt, D, s, k, nx) : FS_S(fs_qk_block)(q, kt, D, s, k, NULL))
    FS_NR_CASES(nr, FS_CALL)
#undef FS_CALL
}

/* The greatest of a row's n scores. */
FS_ATTR static inline float FS_S(fs_row_max)(const float *s, int64_t n)
{
    int64_t j = 0;
    float mt = -INFINITY;
    if (n >= VL) {
        VF mv = VLOAD(s);
        for (j = VL; j + VL <= n; j += VL)
            mv = VMAXF(mv, VLOAD(s + j));
        mt = VHMAX(mv);
    }
    for (; j < n; j++)
        mt = s[j] > mt ? s[j] : mt;
    return mt;
}

/* l[i] + p[i][j] for j = j0 .. j1 - 1 in order, for k (a constant in each call) rows at once. */
FS_ATTR static inline __attribute__((always_inline)) void FS_S(fs_sums_k)(float *ls, const float *const *p, int64_t j0,
                                                                         int64_t j1, int k)
{
    float a[FS_SUMS];
    for (int i = 0; i < k; i++)
        a[i] = ls[i];
    for (int64_t j = j0; j < j1; j++)
        for (int i = 0; i < k; i++)
            a[i] = a[i] + p[i][j];
    for (int i = 0; i < k; i++)
        ls[i] = a[i];
}

#if defined(FS_SIMD_AVX2)
/* fs_sums_k for 8 rows, 4 keys at a time: the rows' p of key j gathered into one vector (lane i: row i) by a
 * 4 x 8 transposition, so that one vector add extends the 8 chains by a key (each lane's additions in key
 * order, as fs_sums_k's) in place of 8 scalar adds and 8 loads. */
FS_ATTR static inline void fs_sums8_avx2(float *ls, const float *const *p, int64_t j0, int64_t j1)
{
    __m256 a = _mm256_loadu_ps(ls);
    int64_t j = j0;
    for (; j + 4 <= j1; j += 4) {
        __m256 r[4];
        for (int i = 0; i < 4; i++)     /* lanes 0-3: row i's keys j..j+3; lanes 4-7: row i + 4's */
            r[i] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(p[i] + j)), _mm_loadu_ps(p[i + 4] + j), 1);
        __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
        __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
        a = _mm256_add_ps(a, _mm256_shuffle_ps(t0, t2, 0x44));   /* key j: rows 0, 1, 2, 3 | 4, 5, 6, 7 */
        a = _mm256_add_ps(a, _mm256_shuffle_ps(t0, t2, 0xee));
        a = _mm256_add_ps(a, _mm256_shuffle_ps(t1, t3, 0x44));
        a = _mm256_add_ps(a, _mm256_shuffle_ps(t1, t3, 0xee));
    }
    _mm256_storeu_ps(ls, a);
    FS_S(fs_sums_k)(ls, p, j, j1, 8);
}
#endif

/* The row sums of nr (<= FS_SUMS) rows: l[i] + p[i][j] for j = lo[i] .. n[i] - 1 in order, each row's chain
 * its own; the keys all rows share run interleaved (nr chains in flight, not one add's latency per key). */
FS_ATTR static void FS_S(fs_row_sums)(const float *const *p, const int64_t *lo, const int64_t *n, float *const *l,
                                      int64_t nr)
{
    float ls[FS_SUMS];
    int64_t lmax = lo[0], nmin = n[0];
    for (int64_t i = 0; i < nr; i++) {
        ls[i] = *l[i];
        lmax = lo[i] > lmax ? lo[i] : lmax;
        nmin = n[i] < nmin ? n[i] : nmin;
    }
    if (lmax > nmin)                                 /* no key common to the rows */
        lmax = nmin;
    for (int64_t i = 0; i < nr; i++)                 /* each row's own keys before the common ones */
        FS_S(fs_sums_k)(ls + i, p + i, lo[i], lmax > lo[i] ? lmax : lo[i], 1);
#if defined(FS_SIMD_AVX2)
    if (nr == 8)
        fs_sums8_avx2(ls, p, lmax, nmin);
    else
#endif
    switch (nr) {
#define FS_CASE(k) case k: FS_S(fs_sums_k)(ls, p, lmax, nmin, k); break;
    FS_CASE(1) FS_CASE(2) FS_CASE(3) FS_CASE(4) FS_CASE(5) FS_CASE(6) FS_CASE(7) FS_CASE(8)
#undef FS_CASE
    }
    for (int64_t i = 0; i < nr; i++) {               /* and after them */
        FS_S(fs_sums_k)(ls + i, p + i, nmin > lo[i] ? nmin : lo[i], n[i], 1);
        *l[i] = ls[i];
    }
}

/* For na rows, row r's tile of n[r] keys: the running max m, scores -> probabilities p (in s), l and acc
 * scaled by alpha = exp2(m - m'); with lo (not NULL: the keys lo[r] .. n[r] - 1 visible, the scores before
 * lo[r] -inf), then the visible p added into l (else pv adds them). The alphas of VL rows come from one
 * vector exp2 (fs_exp2 lane by lane), and the rows' work is independent, so that no row waits on its own
 * max -> alpha chain. */
FS_ATTR static void FS_S(fs_probs)(float *const *s, const int64_t *lo, const int64_t *n, float *const *m,
                                   float *const *l, float *const *acc, int64_t Dp, int64_t na)
{
    for (int64_t r0 = 0; r0 < na; r0 += VL) {
        int64_t nr = na - r0 < VL ? na - r0 : VL;
        float mold[VL], mnew[VL], alpha[VL];
        for (int64_t k = 0; k < VL; k++) {
            float mt = k < nr ? FS_S(fs_row_max)(s[r0 + k], n[r0 + k]) : 0.0f;
            mold[k] = k < nr ? *m[r0 + k] : 0.0f;
            mnew[k] = mt > mold[k] ? mt : mold[k];
        }
        VSTORE(alpha, FS_S(fs_exp2v)(VSUB(VLOAD(mold), VLOAD(mnew))));
        for (int64_t k = 0; k < nr; k++) {
            float *sr = s[r0 + k], *ar = acc[r0 + k];
            *m[r0 + k] = mnew[k];
            VF mb = VSET1(-mnew[k]);
            int64_t j = 0;                                  /* whole vectors: lanes past n are never read */
            for (; j + 7 * VL < n[r0 + k]; j += 8 * VL)
                FS_S(fs_exp2v_xu)(sr + j, mb, 8);
            for (; j + 3 * VL < n[r0 + k]; j += 4 * VL)
                FS_S(fs_exp2v_xu)(sr + j, mb, 4);
            for (; j < n[r0 + k]; j += VL)
                VSTORE(sr + j, FS_S(fs_exp2v)(VADD(VLOAD(sr + j), mb)));
            *l[r0 + k] = *l[r0 + k] * alpha[k];
            VF ab = VSET1(alpha[k]);
            for (int64_t d = 0; d < Dp; d += VL)
                VSTORE(ar + d, VMUL(VLOAD(ar + d), ab));
        }
    }
    for (int64_t r0 = 0; lo && r0 < na; r0 += FS_SUMS)
        FS_S(fs_row_sums)((const float *const *)s + r0, lo + r0, n + r0, l + r0, na - r0 < FS_SUMS ? na - r0 : FS_SUMS);
}

/* One group of nv (<= NV) vectors of dimensions from d0 for nr rows; nv a constant where it is NV (the
 * common case). The first group (sums = 1) also adds the keys' p into the row sums l, keys in order: nr
 * independent scalar chains that run beside the vector work. */
FS_ATTR static inline __attribute__((always_inline)) void FS_S(fs_pv_group)(
    float *const *acc, const float *const *p, float *ls, int sums, int64_t j0, int64_t j1, const uint16_t *v16,
    int64_t ldv, int64_t d0, int nv, int nr, const fs_attn_next *nx, int64_t groups)
{
    VF a[RB][NV];
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < NV; v++)
            a[r][v] = v < nv ? VLOAD(acc[r] + d0 + v * VL) : VSET1(0.0f);
    int64_t lo = 0, hi = 0, jn = 0;                /* this group's share of the next tile's rows */
    if (nx) {
        fs_attn_share(nx->v_run, d0 / (NV * VL), groups, &lo, &hi);
        jn = nx->v_rows;
    }
    for (int64_t j = j0; j < j1; j++) {
        if (j < jn)
            fs_attn_prefetch(nx->v + j * nx->v_stride, lo, hi);
        VF vv[NV];
        for (int v = 0; v < NV; v++) {                  /* (v >= nv: never used, set for the compiler's sake) */
            int64_t i = j * ldv + d0 + v * VL;
            vv[v] = v >= nv ? VSET1(0.0f) : VLOAD_F16(v16 + i);
        }
        for (int r = 0; r < nr; r++) {
            float pj = p[r][j];
            VF pb = VSET1(pj);
            for (int v = 0; v < nv; v++)
                a[r][v] = VADD(a[r][v], VMUL(pb, vv[v]));
            if (sums)
                ls[r] = ls[r] + pj;
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++)
            VSTORE(acc[r] + d0 + v * VL, a[r][v]);
}

/* For nr (<= RB) rows in a block: keys j0..j1-1 in order, acc[r][d] += p[r][j] * v[j][d] and
 * l[r] += p[r][j], v the cache's own fp16 rows, ldv values apart (D == Dp). */
FS_ATTR static inline __attribute__((always_inline)) void FS_S(fs_pv_block)(
    float *const *acc, const float *const *p, float *const *l, int64_t j0, int64_t j1, const uint16_t *v16,
    int64_t ldv, int64_t Dp, int nr, const fs_attn_next *nx)
{
    float ls[RB];
    for (int r = 0; r < nr; r++)
        ls[r] = *l[r];
    int64_t groups = (Dp + NV * VL - 1) / (NV * VL);
    for (int64_t d0 = 0; d0 < Dp; d0 += NV * VL) {     /* the sums' flag a constant in each call: no test per key */
        int nv = Dp - d0 >= NV * VL ? NV : (int)((Dp - d0) / VL);
        if (d0 == 0 && nv == NV)
            FS_S(fs_pv_group)(acc, p, ls, 1, j0, j1, v16, ldv, d0, NV, nr, nx, groups);
        else if (d0 == 0)
            FS_S(fs_pv_group)(acc, p, ls, 1, j0, j1, v16, ldv, d0, nv, nr, nx, groups);
        else if (nv == NV)
            FS_S(fs_pv_group)(acc, p, ls, 0, j0, j1, v16, ldv, d0, NV, nr, nx, groups);
        else
            FS_S(fs_pv_group)(acc, p, ls, 0, j0, j1, v16, ldv, d0, nv, nr, nx, groups);
    }
    for (int r = 0; r < nr; r++)
        *l[r] = ls[r];
}

#define FS_PW 8                    /* vectors of dimensions one pass of fs_pv_row holds */

/* One row's acc[d0 .. d0 + nv VL) += p[j] * vt[j][d] over keys j0..j1-1 in order (nv a constant where it
 * is FS_PW): one broadcast of p[j] per nv products. pf: read the next tile's V rows ahead (row j a key). */
FS_ATTR static inline __attribute__((always_inline)) void FS_S(fs_pv_row)(float *acc, const float *p, int64_t j0,
                                                                         int64_t j1, const float *vt, int64_t Dp,
                                                                         int64_t d0, int nv, const fs_attn_next *pf)
{
    VF a[FS_PW];
    for (int v = 0; v < nv; v++)
        a[v] = VLOAD(acc + d0 + v * VL);
    for (int64_t j = j0; j < j1; j++) {
        if (pf && j < pf->v_rows)
            fs_attn_prefetch(pf->v + j * pf->v_stride, 0, pf->v_run);
        VF pb = VSET1(p[j]);
        for (int v = 0; v < nv; v++)
            a[v] = VADD(a[v], VMUL(pb, VLOAD(vt + j * Dp + d0 + v * VL)));
    }
    for (int v = 0; v < nv; v++)
        VSTORE(acc + d0 + v * VL, a[v]);
}

/* Row r's dimensions from d0 (pf: with the next tile's read-ahead): their count a constant in each call, so
 * that the sums stay in registers. */
FS_ATTR static inline __attribute__((always_inline)) void FS_S(fs_pv_pass)(float *acc, const float *p, int64_t j0,
                                                                          int64_t j1, const float *vt, int64_t Dp,
                                                                          int64_t d0, const fs_attn_next *pf)
{
    switch ((Dp - d0) / VL < FS_PW ? (Dp - d0) / VL : FS_PW) {
#define FS_CASE(k) case k: FS_S(fs_pv_row)(acc, p, j0, j1, vt, Dp, d0, k, pf); break;
    FS_CASE(1) FS_CASE(2) FS_CASE(3) FS_CASE(4) FS_CASE(5) FS_CASE(6) FS_CASE(7)
    default: FS_S(fs_pv_row)(acc, p, j0, j1, vt, Dp, d0, FS_PW, pf);
#undef FS_CASE
    }
}

/* For nr rows, each over its own keys lo[r]..n[r]-1 in order: acc[r][d] += p[r][j] * vt[j][d], vt float32
 * [KT][Dp], row by row; the first reads the next tile ahead, the others compile without the check (~3 %).
 * (The row sums l: fs_probs.) */
FS_ATTR static void FS_S(fs_pv)(float *const *acc, const float *const *p, const int64_t *lo, const int64_t *n,
                                const float *vt, int64_t Dp, int nr, const fs_attn_next *nx)
{
    for (int r = 0; r < nr; r++)
        for (int64_t d0 = 0; d0 < Dp; d0 += FS_PW * VL) {
            if (r == 0 && d0 == 0 && nx)
                FS_S(fs_pv_pass)(acc[r], p[r], lo[r], n[r], vt, Dp, d0, nx);
            else
                FS_S(fs_pv_pass)(acc[r], p[r], lo[r], n[r], vt, Dp, d0, NULL);
        }
}

FS_ATTR static void FS_S(fs_pv_f16)(float *const *acc, const float *const *p, float *const *l, int64_t j0,
                                    int64_t j1, const uint16_t *v, int64_t ldv, int64_t D, int nr,
                                    const fs_attn_next *nx)
{
#define FS_CALL(k) (nx ? FS_S(fs_pv_block)(acc, p, l, j0, j1, v, ldv, D, k, nx) \
                      : FS_S(fs_pv_block)(acc, p, l, j0, j1, v, ldv, D, k, NULL))
    FS_NR_CASES(nr, FS_CALL)
#undef FS_CALL
}

/* out[d] = acc[d] / l. */
FS_ATTR static void FS_S(fs_finish)(const float *acc, float l, int64_t D, float *out)
{
    int64_t d = 0;
    VF lb = VSET1(l);
    for (; d + VL <= D; d += VL)
        VSTORE(out + d, VDIV(VLOAD(acc + d), lb));
    for (; d < D; d++)
        out[d] = acc[d] / l;
}

static const fs_attn_isa FS_S(fs_attn) = {RB, FS_S(fs_k_tile), FS_S(fs_v_tile), FS_S(fs_qk), FS_S(fs_qk_f16),
                                          FS_S(fs_probs), FS_S(fs_pv), FS_S(fs_pv_f16), FS_S(fs_finish)};

#undef FS_S
#undef FS_ATTR
#undef VL
#undef NV
#undef RB
#undef FS_NR_CASES
#undef FS_PW
#undef VF
#undef VLOAD
#undef VSTORE
#undef VSET1
#undef VMUL
#undef VADD
#undef VDIV
#undef VMAXF
#undef VHMAX
#undef VLOAD_F16
#undef VLOAD_I8
#undef VMINF
#undef VSUB
#undef VPOW2I
#undef VZERO_BELOW
