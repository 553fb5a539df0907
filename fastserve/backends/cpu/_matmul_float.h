/* Float weights (F32, F16, BF16) times float32 activations, read straight from the file's rows at every
 * n (included by _matmul_kernels.h): nothing is staged. A staged float panel is 2-4x the file's bytes,
 * transposed, and at batch 1 each weight is read once, so staging only added traffic (BF16 decoded at
 * ~0.6x llama-server's speed so).
 *
 * Numbers (the twin, ref/matmul.py, restates them): output (r, o) keeps 16 partial sums p_0 .. p_15,
 *     p_k = 0;   for i = 0, 1, ... IN THAT ORDER:   p_(i mod 16) = fma(w_i, x_i, p_(i mod 16))
 * (one rounding to float32: fmaf, vfmadd, vfma; up to the next multiple of 16 the inputs past n_in count
 * as zeros, x padded and w read as 0, and their fma(0, 0, p) are computed too: they turn a -0 sum into
 * +0), then one fixed tree of float32 sums:
 *     p_k = p_k + p_(k+8) (k < 8);   p_k = p_k + p_(k+4) (k < 4);   p_k = p_k + p_(k+2) (k < 2);   y = p_0 + p_1.
 * Nothing depends on n, the ISA or the thread. The 16 sums are one AVX-512 register, two AVX2 ones, four
 * NEON ones; rows go a few at a time (independent chains, each weight converted once for up to 4
 * activation rows; 6 on AVX2, whose 16 registers hold 12 sums of one half at a time). The fused
 * multiply-add is half the instructions of a product and a sum. At many activation rows (prefill) the
 * inputs go in blocks of FS_FKB, the sums kept in a small buffer between blocks, so that the activations'
 * block stays in L1 while every row of the panel passes over it.
 */
#ifndef FASTSERVE_MATMUL_FLOAT_H
#define FASTSERVE_MATMUL_FLOAT_H

#define FS_FA 4                 /* activation rows per pass */
#define FS_FKB 512              /* inputs per block: 4-6 activation rows' 8-12 KB stay in L1 while the rows pass */
#define FS_FA_HALF 6            /* activation rows per pass of a half (AVX2 above batch 1) */

/* Elements per row of a float type's row_bytes. */
static inline int64_t fs_float_inputs(int type, int64_t row_bytes)
{
    return row_bytes / (type == FS_T_F32 ? 4 : 2);
}

/* steps of fs_prefetch_step at once (above batch 1 a tile asks for its share at its start). */
static inline void fs_prefetch_steps(fs_prefetcher *p, int64_t steps)
{
    if (!p->next || p->at >= p->total)
        return;
    const int64_t to = p->at + steps * p->per < p->total ? p->at + steps * p->per : p->total;
    for (int64_t off = p->at; off < to; off += 64)
        __builtin_prefetch(p->next + off, 0, 2);
    p->at = to;
}

static inline float fs_fold16(float p[16])
{
    for (int k = 0; k < 8; k++)
        p[k] = p[k] + p[k + 8];
    for (int k = 0; k < 4; k++)
        p[k] = p[k] + p[k + 4];
    for (int k = 0; k < 2; k++)
        p[k] = p[k] + p[k + 2];
    return p[0] + p[1];
}

static void fs_float_panel_scalar(const fs_job *j, int type, const uint8_t *rows, int64_t row_bytes)
{
    const int64_t K = j->nb * FS_QK, n_in = fs_float_inputs(type, row_bytes), n16 = (n_in + 15) & ~(int64_t)15;
    for (int l = 0; l < j->valid; l++) {
        const uint8_t *row = rows + l * row_bytes;
        for (int64_t r = 0; r < j->n; r++) {
            const float *x = j->xf + r * K;         /* zero padded to K >= n16 */
            float p[16] = {0};
            for (int64_t i = 0; i < n16; i++) {
                p[i & 15] = fmaf(i < n_in ? fs_float_at(type, row, i) : 0.0f, x[i], p[i & 15]);
            }
            j->y[r * j->ldy + l] = fs_fold16(p);
        }
    }
}

#if defined(FS_X86)
#define FS_FLOAT256 __attribute__((target("avx2,fma,f16c")))

/* 8 weights of a row from input i as float32 (all < n_in). */
FS_FLOAT256 FS_INLINE __m256 fs_float8_avx2(const int type, const uint8_t *row, int64_t i)
{
    if (type == FS_T_F32)
        return _mm256_loadu_ps((const float *)row + i);
    if (type == FS_T_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * i)));
    /* BF16 is a float32's high half (a byte shuffle would do it in one instruction, but its constant takes
     * the register the 2 x 3 tile has not got: GCC then keeps two sums in memory) */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * i))), 16));
}

/* The same at the row's end: n_in - i of them real, zeros past them. */
FS_FLOAT256 FS_INLINE __m256 fs_float8_end_avx2(const int type, const uint8_t *row, int64_t i, int64_t n_in)
{
    if (n_in - i >= 8)
        return fs_float8_avx2(type, row, i);
    float t[8] = {0};
    for (int64_t k = i; k < n_in; k++)
        t[k - i] = fs_float_at(type, row, k);
    return _mm256_loadu_ps(t);
}

/* The tree of 16 sums held as a (p_0..7) and b (p_8..15). */
FS_FLOAT256 FS_INLINE float fs_fold16_avx2(__m256 a, __m256 b)
{
    const __m256 s = _mm256_add_ps(a, b);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

/* 16 inputs from i (end: the row's last 16, maybe partial) of rows l .. l + RW - 1 times activation row r
 * into the sums p, as two halves of 8 (p_0..7, then p_8..15). */
FS_FLOAT256 FS_INLINE void fs_float_step_avx2(const fs_job *j, const int type, const uint8_t *rows, int64_t row_bytes,
                                              int l, int64_t r, const int RW, int64_t i, int64_t n_in, const int end,
                                              __m256 p[4][2])
{
    const int64_t K = j->nb * FS_QK;
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        __m256 w[4];
#pragma GCC unroll 4
        for (int a = 0; a < RW; a++)
            w[a] = end ? fs_float8_end_avx2(type, rows + (l + a) * row_bytes, i + 8 * h, n_in)
                       : fs_float8_avx2(type, rows + (l + a) * row_bytes, i + 8 * h);
        __m256 x = _mm256_loadu_ps(j->xf + r * K + i + 8 * h);
        __asm__("" : "+x"(x));      /* one load for the RW rows, not a memory operand in each */
#pragma GCC unroll 4
        for (int a = 0; a < RW; a++)
            p[a][h] = _mm256_fmadd_ps(w[a], x, p[a][h]);
    }
}

/* Rows l .. l + RW - 1 of the panel times activation row r (batch 1, or a batch's last odd row), inputs
 * [i0, i1): the sums start at zero (i0 = 0) or from keep, and go to keep, or folded to y at the row's
 * end. The loop over whole 16s has no test of the row's end; the next panel's prefetch goes per step
 * (reading the weights is the whole cost at batch 1). */
FS_FLOAT256 FS_INLINE void fs_float_tile_avx2(const fs_job *j, const int type, const uint8_t *rows, int64_t row_bytes,
                                              int l, int64_t r, const int RW, int64_t i0, int64_t i1, float *keep,
                                              fs_prefetcher *pf)
{
    const int64_t n_in = fs_float_inputs(type, row_bytes), whole = n_in & ~(int64_t)15, i2 = i1 < whole ? i1 : whole;
    __m256 p[4][2];
#pragma GCC unroll 4
    for (int a = 0; a < RW; a++)
        for (int h = 0; h < 2; h++)
            p[a][h] = i0 ? _mm256_loadu_ps(keep + (l + a) * 16 + 8 * h) : _mm256_setzero_ps();
    int64_t i = i0;
    for (; i < i2; i += 16) {
        fs_prefetch_step(pf);
        fs_float_step_avx2(j, type, rows, row_bytes, l, r, RW, i, n_in, 0, p);
    }
    for (; i < i1; i += 16) {
        fs_prefetch_step(pf);
        fs_float_step_avx2(j, type, rows, row_bytes, l, r, RW, i, n_in, 1, p);
    }
#pragma GCC unroll 4
    for (int a = 0; a < RW; a++) {
        if (i1 >= n_in) {
            j->y[r * j->ldy + l + a] = fs_fold16_avx2(p[a][0], p[a][1]);
            continue;
        }
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(keep + (l + a) * 16 + 8 * h, p[a][h]);
    }
}

/* 8 inputs from i (end: maybe past the row's end) of rows l .. l + RW - 1 times activation rows
 * r .. r + RA - 1 into the sums p of one half. */
FS_FLOAT256 FS_INLINE void fs_float_half_step_avx2(const fs_job *j, const int type, const uint8_t *rows,
                                                   int64_t row_bytes, int l, int64_t r, const int RW, const int RA,
                                                   int64_t i, int64_t n_in, const int end, __m256 p[4][FS_FA_HALF])
{
    const int64_t K = j->nb * FS_QK;
    __m256 w[4];
#pragma GCC unroll 4
    for (int a = 0; a < RW; a++)
        w[a] = end ? fs_float8_end_avx2(type, rows + (l + a) * row_bytes, i, n_in)
                   : fs_float8_avx2(type, rows + (l + a) * row_bytes, i);
#pragma GCC unroll 6
    for (int b = 0; b < RA; b++) {
        __m256 x = _mm256_loadu_ps(j->xf + (r + b) * K + i);
        __asm__("" : "+x"(x));      /* one load for the RW rows, not a memory operand in each */
#pragma GCC unroll 4
        for (int a = 0; a < RW; a++)
            p[a][b] = _mm256_fmadd_ps(w[a], x, p[a][b]);
    }
}

/* Rows l .. l + RW - 1 times activation rows r .. r + RA - 1 above batch 1, inputs [i0, i1), in two
 * passes: p_0..7 of every sum, then p_8..15 (the halves never meet before the fold, so their order
 * between them is free). Holding one half at a time fits 2 x 6 sums in 12 registers beside 2 weights
 * and 1 activation: each converted weight serves 6 rows, twice the 2 x 3 tile of both halves. The
 * first half's sums wait in keep for the fold; both halves go to keep between blocks of inputs. */
FS_FLOAT256 FS_INLINE void fs_float_halves_avx2(const fs_job *j, const int type, const uint8_t *rows,
                                                int64_t row_bytes, int l, int64_t r, const int RW, const int RA,
                                                int64_t i0, int64_t i1, float *keep, fs_prefetcher *pf)
{
    const int64_t n_in = fs_float_inputs(type, row_bytes), whole = n_in & ~(int64_t)15, i2 = i1 < whole ? i1 : whole;
    fs_prefetch_steps(pf, (i1 - i0 + 15) / 16);
#pragma GCC unroll 1
    for (int h = 0; h < 2; h++) {       /* one copy of the loop: two took the register of a sum */
        __m256 p[4][FS_FA_HALF];
#pragma GCC unroll 4
        for (int a = 0; a < RW; a++)
#pragma GCC unroll 6
            for (int b = 0; b < RA; b++)
                p[a][b] = i0 ? _mm256_loadu_ps(keep + ((l + a) * FS_FA_HALF + b) * 16 + 8 * h) : _mm256_setzero_ps();
        int64_t i = i0;
        for (; i < i2; i += 16)
            fs_float_half_step_avx2(j, type, rows, row_bytes, l, r, RW, RA, i + 8 * h, n_in, 0, p);
        for (; i < i1; i += 16)
            fs_float_half_step_avx2(j, type, rows, row_bytes, l, r, RW, RA, i + 8 * h, n_in, 1, p);
#pragma GCC unroll 4
        for (int a = 0; a < RW; a++)
#pragma GCC unroll 6
            for (int b = 0; b < RA; b++) {
                float *k = keep + ((l + a) * FS_FA_HALF + b) * 16;
                if (h == 1 && i1 >= n_in)
                    j->y[(r + b) * j->ldy + l + a] = fs_fold16_avx2(_mm256_loadu_ps(k), p[a][b]);
                else
                    _mm256_storeu_ps(k + 8 * h, p[a][b]);
            }
    }
}

#define FS_FT(RW) fs_float_tile_avx2(j, type, rows, row_bytes, l, r, RW, i0, i1, keep, p)
#define FS_FH(RW, RA) fs_float_halves_avx2(j, type, rows, row_bytes, l, r, RW, RA, i0, i1, keep, p)
/* rw rows x ra activation rows: at least 8 sums in flight (an FMA takes 5 cycles, two start a cycle) */
#define FS_FLOAT_HALVES_WIDE()                                                                       \
    switch (ra) {                                                                                    \
    case 6: FS_FH(2, 6); break;                                                                      \
    case 5: FS_FH(2, 5); break;                                                                      \
    case 4: FS_FH(2, 4); break;                                                                      \
    case 3: FS_FH(3, 3); break;                                                                      \
    default: FS_FH(4, 2); break;                                                                     \
    }
#define FS_FLOAT_HALVES_BY_RA(RW)                                                                    \
    switch (ra) {                                                                                    \
    case 6: FS_FH(RW, 6); break;                                                                     \
    case 5: FS_FH(RW, 5); break;                                                                     \
    case 4: FS_FH(RW, 4); break;                                                                     \
    case 3: FS_FH(RW, 3); break;                                                                     \
    default: FS_FH(RW, 2); break;                                                                    \
    }

/* Activation row r alone (batch 1, or a batch's last after its tiles of 6): 4 rows at a time, both halves
 * (8 chains). */
FS_FLOAT256 FS_INLINE void fs_float_row_avx2(const fs_job *j, const int type, const uint8_t *rows, int64_t row_bytes,
                                             int64_t r, float *keep, fs_prefetcher *p)
{
    const int64_t n_in = fs_float_inputs(type, row_bytes);
    for (int64_t i0 = 0; i0 < n_in; i0 += FS_FKB) {
        const int64_t i1 = i0 + FS_FKB < n_in ? i0 + FS_FKB : n_in;
        int l = 0;
        for (; l + 4 <= j->valid; l += 4)
            FS_FT(4);
        for (; l < j->valid; l++)
            FS_FT(1);
    }
}

/* Batch 1 a row at a time; more: 2 rows x up to 6 activation rows (4 x 2, 3 x 3), a half at a time. */
FS_FLOAT256 FS_INLINE void fs_float_rows_avx2(const fs_job *j, const int type, const uint8_t *rows, int64_t row_bytes,
                                              fs_prefetcher *pf)
{
    const int64_t n_in = fs_float_inputs(type, row_bytes);
    float keep[FS_LANES * FS_FA_HALF * 16];
    for (int64_t r = 0; r < j->n; r += FS_FA_HALF) {
        const int ra = (int)(j->n - r >= FS_FA_HALF ? FS_FA_HALF : j->n - r), rw = ra == 2 ? 4 : ra == 3 ? 3 : 2;
        fs_prefetcher idle = fs_prefetch_plan(NULL, 0, 0), *p = r == 0 ? pf : &idle;    /* one pass prefetches */
        if (ra == 1) {
            fs_float_row_avx2(j, type, rows, row_bytes, r, keep, p);
            continue;
        }
        for (int64_t i0 = 0; i0 < n_in; i0 += FS_FKB) {
            const int64_t i1 = i0 + FS_FKB < n_in ? i0 + FS_FKB : n_in;
            int l = 0;
            for (; l + rw <= j->valid; l += rw)
                FS_FLOAT_HALVES_WIDE()
            for (; l < j->valid; l++)
                FS_FLOAT_HALVES_BY_RA(1)
        }
    }
}
#undef FS_FLOAT_HALVES_BY_RA
#undef FS_FLOAT_HALVES_WIDE
#undef FS_FH
#undef FS_FT

FS_FLOAT256 static void fs_float_panel_avx2(const fs_job *j, int type, const uint8_t *rows, int64_t row_bytes,
                                            fs_prefetcher *pf)
{
    switch (type) {
    case FS_T_F32: fs_float_rows_avx2(j, FS_T_F32, rows, row_bytes, pf); break;
    case FS_T_F16: fs_float_rows_avx2(j, FS_T_F16, rows, row_bytes, pf); break;
    default: fs_float_rows_avx2(j, FS_T_BF16, rows, row_bytes, pf); break;
    }
}

#if defined(FS_HAVE_AVX512VNNI)
#define FS_FLOAT512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

/* A row's 16 weights from input i, n_in - i of them real (a masked load at the row's end). */
FS_FLOAT512 FS_INLINE __m512 fs_float16_avx512(const int type, const uint8_t *row, int64_t i, int64_t n_in)
{
    const __mmask16 m = n_in - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n_in - i)) - 1u);
    if (type == FS_T_F32)
        return _mm512_maskz_loadu_ps(m, (const float *)row + i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, row + 2 * i);
    if (type == FS_T_F16)
        return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

FS_FLOAT512 FS_INLINE float fs_fold16_avx512(__m512 v)
{
    return fs_fold16_avx2(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* Rows l .. l + RW - 1 of the panel times activation rows r .. r + RA - 1, inputs [i0, i1): the sums
 * start at zero (i0 = 0) or from keep, and go to keep, or folded to y at the row's end. */
FS_FLOAT512 FS_INLINE void fs_float_tile_avx512(const fs_job *j, const int type, const uint8_t *rows, int64_t row_bytes,
                                                int l, int64_t r, const int RW, const int RA, int64_t i0, int64_t i1,
                                                float *keep, fs_prefetcher *pf)
{
    const int64_t K = j->nb * FS_QK, n_in = fs_float_inputs(type, row_bytes);
    __m512 p[4][FS_FA];
#pragma GCC unroll 4
    for (int a = 0; a < RW; a++)
#pragma GCC unroll 4
        for (int b = 0; b < RA; b++)
            p[a][b] = i0 ? _mm512_loadu_ps(keep + ((l + a) * FS_FA + b) * 16) : _mm512_setzero_ps();
    for (int64_t i = i0; i < i1; i += 16) {
        fs_prefetch_step(pf);
        __m512 w[4];
#pragma GCC unroll 4
        for (int a = 0; a < RW; a++)
            w[a] = fs_float16_avx512(type, rows + (l + a) * row_bytes, i, n_in);
#pragma GCC unroll 4
        for (int b = 0; b < RA; b++) {
            const __m512 x = _mm512_loadu_ps(j->xf + (r + b) * K + i);
#pragma GCC unroll 4
            for (int a = 0; a < RW; a++)
                p[a][b] = _mm512_fmadd_ps(w[a], x, p[a][b]);
        }
    }
#pragma GCC unroll 4
    for (int a = 0; a < RW; a++)
#pragma GCC unroll 4
        for (int b = 0; b < RA; b++) {
            if (i1 >= n_in)
                j->y[(r + b) * j->ldy + l + a] = fs_fold16_avx512(p[a][b]);
            else
                _mm512_storeu_ps(keep + ((l + a) * FS_FA + b) * 16, p[a][b]);
        }
}

#define FS_FT(RW, RA) fs_float_tile_avx512(j, type, rows, row_bytes, l, r, RW, RA, i0, i1, keep, p)
#define FS_FLOAT_BY_RA(RW)                                                                           \
    switch (ra) {                                                                                    \
    case 4: FS_FT(RW, 4); break;                                                                     \
    case 3: FS_FT(RW, 3); break;                                                                     \
    case 2: FS_FT(RW, 2); break;                                                                     \
    default: FS_FT(RW, 1); break;                                                                    \
    }

/* 4 rows x up to 4 activation rows per pass (16 sums, 4 weights, 1 activation: 21 registers; 2 x 8
 * measured 2x slower in prefill). */
FS_FLOAT512 FS_INLINE void fs_float_rows_avx512(const fs_job *j, const int type, const uint8_t *rows, int64_t row_bytes,
                                                fs_prefetcher *pf)
{
    const int64_t n_in = fs_float_inputs(type, row_bytes);
    float keep[FS_LANES * FS_FA * 16];
    for (int64_t r = 0; r < j->n; r += FS_FA) {
        const int ra = (int)(j->n - r >= FS_FA ? FS_FA : j->n - r);
        fs_prefetcher idle = fs_prefetch_plan(NULL, 0, 0), *p = r == 0 ? pf : &idle;    /* one pass prefetches */
        for (int64_t i0 = 0; i0 < n_in; i0 += FS_FKB) {
            const int64_t i1 = i0 + FS_FKB < n_in ? i0 + FS_FKB : n_in;
            int l = 0;
            for (; l + 4 <= j->valid; l += 4)
                FS_FLOAT_BY_RA(4)
            for (; l < j->valid; l++)
                FS_FLOAT_BY_RA(1)
        }
    }
}
#undef FS_FLOAT_BY_RA
#undef FS_FT

FS_FLOAT512 static void fs_float_panel_avx512(const fs_job *j, int type, const uint8_t *rows, int64_t row_bytes,
                                              fs_prefetcher *pf)
{
    switch (type) {
    case FS_T_F32: fs_float_rows_avx512(j, FS_T_F32, rows, row_bytes, pf); break;
    case FS_T_F16: fs_float_rows_avx512(j, FS_T_F16, rows, row_bytes, pf); break;
    default: fs_float_rows_avx512(j, FS_T_BF16, rows, row_bytes, pf); break;
    }
}
#endif /* FS_HAVE_AVX512VNNI */
#endif /* FS_X86 */

#if defined(FS_ARM64)
/* A row's 16 weights from input i as four registers (a zero-padded copy at the row's end). */
FS_INLINE_ARM void fs_float16_neon(int type, const uint8_t *row, int64_t i, int64_t n_in, float32x4_t w[4])
{
    if (n_in - i < 16) {
        float t[16] = {0};
        for (int64_t k = i; k < n_in; k++)
            t[k - i] = fs_float_at(type, row, k);
        for (int q = 0; q < 4; q++)
            w[q] = vld1q_f32(t + 4 * q);
        return;
    }
    for (int q = 0; q < 4; q++) {
        if (type == FS_T_F32)
            w[q] = vld1q_f32((const float *)row + i + 4 * q);
        else if (type == FS_T_F16)
            w[q] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(row + 2 * (i + 4 * q)))));
        else
            w[q] = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)(row + 2 * (i + 4 * q))), 16));
    }
}

FS_INLINE_ARM float fs_fold16_neon(const float32x4_t p[4])
{
    const float32x4_t q = vaddq_f32(vaddq_f32(p[0], p[2]), vaddq_f32(p[1], p[3]));
    const float32x2_t h = vadd_f32(vget_low_f32(q), vget_high_f32(q));
    return vget_lane_f32(h, 0) + vget_lane_f32(h, 1);
}

/* Two rows x two activation rows per pass (16 sums in 16 registers). */
static void fs_float_panel_neon(const fs_job *j, int type, const uint8_t *rows, int64_t row_bytes, fs_prefetcher *pf)
{
    const int64_t K = j->nb * FS_QK, n_in = fs_float_inputs(type, row_bytes);
    for (int64_t r = 0; r < j->n; r += 2) {
        const int ra = j->n - r >= 2 ? 2 : 1;
        for (int l = 0; l < j->valid; l += 2) {
            const int rw = j->valid - l >= 2 ? 2 : 1;
            float32x4_t p[2][2][4];
            for (int a = 0; a < 2; a++)
                for (int b = 0; b < 2; b++)
                    for (int q = 0; q < 4; q++)
                        p[a][b][q] = vdupq_n_f32(0.0f);
            for (int64_t i = 0; i < n_in; i += 16) {
                if (r == 0)
                    fs_prefetch_step(pf);
                float32x4_t w[2][4];
                for (int a = 0; a < rw; a++)
                    fs_float16_neon(type, rows + (l + a) * row_bytes, i, n_in, w[a]);
                for (int b = 0; b < ra; b++)
                    for (int q = 0; q < 4; q++) {
                        const float32x4_t x = vld1q_f32(j->xf + (r + b) * K + i + 4 * q);
                        for (int a = 0; a < rw; a++)
                            p[a][b][q] = vfmaq_f32(p[a][b][q], w[a][q], x);
                    }
            }
            for (int a = 0; a < rw; a++)
                for (int b = 0; b < ra; b++)
                    j->y[(r + b) * j->ldy + l + a] = fs_fold16_neon(p[a][b]);
        }
    }
}
#endif /* FS_ARM64 */

/* Whether isa's float kernel can run here: FMA and F16C beside AVX2 (every AVX2 CPU known has them,
 * but the integer kernels do not need them), AVX-512VL beside AVX-512 VNNI; else the portable one,
 * whose fmaf gives the same bits. */
static int fs_float_simd_ok(int isa)
{
#if defined(FS_X86)
    __builtin_cpu_init();
    if (isa == FS_ISA_AVX2)
        return __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa == FS_ISA_AVX512VNNI)
        return __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx512vl");
#endif
    return isa == FS_ISA_NEON || isa == FS_ISA_NEON_DOTPROD;
}

/* A float panel's product (valid rows at row_bytes apart) on isa; next: the next panel's rows
 * (16 * row_bytes bytes) to prefetch meanwhile, or NULL. */
static void fs_float_panel(int isa, int type, const fs_job *j, const uint8_t *rows, int64_t row_bytes,
                           const uint8_t *next)
{
    const int64_t steps = (j->valid + 3) / 4 * ((fs_float_inputs(type, row_bytes) + 15) / 16);
    fs_prefetcher pf = fs_prefetch_plan(next, 16 * row_bytes, steps);
    if (!fs_float_simd_ok(isa))         /* a few loads per panel: no cache shared by the pool's threads */
        isa = FS_ISA_SCALAR;
#if defined(FS_X86)
#if defined(FS_HAVE_AVX512VNNI)
    if (isa == FS_ISA_AVX512VNNI) {
        fs_float_panel_avx512(j, type, rows, row_bytes, &pf);
        return;
    }
#endif
    if (isa == FS_ISA_AVX2) {
        fs_float_panel_avx2(j, type, rows, row_bytes, &pf);
        return;
    }
#endif
#if defined(FS_ARM64)
    if (isa == FS_ISA_NEON || isa == FS_ISA_NEON_DOTPROD) {
        fs_float_panel_neon(j, type, rows, row_bytes, &pf);
        return;
    }
#endif
    (void)isa;
    fs_prefetch_range(next, 0, 16 * row_bytes);
    fs_float_panel_scalar(j, type, rows, row_bytes);
}

#endif /* FASTSERVE_MATMUL_FLOAT_H */
