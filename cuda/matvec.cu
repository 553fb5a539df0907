// Matrix products for decode-sized batches: out[j, r] (+)= sum_i x[j, i] * w[r, i] for j < n, and the
// same product with the RMSNorm before it (and the SwiGLU after it) fused in, so that a decode layer
// is 7 launches, not 10.
//
// At a few rows a decode step is a weight read: every weight element is used n times, so the kernel
// streams each weight row once, 16 bytes per lane (8 elements), coalesced across the warp, and keeps
// MAXN float32 sums per lane; x rows (small, cached) are read as they are needed. One warp per output
// row; x rows in groups of MAXN, one group per block row (blockIdx.y), so that any n runs here.
// Float32 accumulation; the summation order depends on k only, not on n, MAXN or the other rows, so a
// token's result does not depend on the batch it is in (and decode steps, captured in CUDA graphs,
// need no cuBLAS call, which CuPy refuses during a capture).
//
// matvec: w: [m, k] storage type T (f16 / bf16), rows of k elements, k % 8 == 0, 16-byte aligned;
// x: [n, k] T; out: float32 [n, m]; accumulate: 0 writes, 1 adds to out (the residual stream); each sum
// is multiplied by scale first (granite's residual multiplier; 1: none, the sum unchanged bit for bit):
// out = out + s * scale, as fastserve/backends/cpu/_forward.pyx scales a block's output before its add.
//
// norm_matvec: the same product of h = rmsnorm(x[src]) * norm_w, with x the float32 residual stream
// [*, k] (16-byte aligned), src = rows[j] (rows != NULL: the final norm of the output rows) or j,
// norm_w float32 [k]; out float32 [n, m] (written). h is never stored: each element is formed where it
// is used, rms_apply<T>(x, inv, w) as cuda/rms_norm.cu forms it (the same float ops, rounded to T),
// so h differs from rms_norm.cu's only by the summation order of inv: each row's sum of squares is
// taken by one warp, lanes strided over float4s then warp_sum, an order fixed by k (one warp per row
// of the block's group, once per block, into shared memory). When the group's h fits NORM_STAGE
// (16 KiB: nj * k <= 8192, e.g. batch 1 to 4 at k = 2048) the block forms it once into shared memory
// and its warps read it from there; otherwise every warp re-reads its group's x rows (float32) and
// norm_w from L1 / L2 and forms h again for its weight row. Both give h bit for bit, so a row's
// result does not depend on which its group took. At decode sizes these re-reads are a few KiB per
// row against the weights' MiBs, read from HBM once.
// norm_matvec_swiglu: w = w_gate_up [2 F, k] (gate rows, then up rows); the warp of output column r
// sums gate row r and up row F + r together (one h element serves both) and writes
// act[j, r] = gate_mul(gelu, g, u) (SwiGLU, or GeGLU when gelu != 0) rounded to T, as cuda/swiglu.cu on
// the float32 sums: act T [n, F].
//
// moe_matvec_swiglu, moe_matvec: a mixture of experts' products, each selected expert once over the (row,
// rank) pairs that chose it, grouped by cuda/moe.cu's moe_group: block row blockIdx.y takes its tile (expert
// e, first grouped position t0, up to MAXN positions of e) against expert e's matrix of the 3-D weights
// (moe_matvec below states the layouts). A pair's sums are a matvec's, in the order k fixes: a row's expert
// outputs do not depend on which rows share its experts. Expert biases (gpt-oss; NULL: none): bias [E, 2 F]
// (gate, then up) is added to expert e's float32 gate and up sums before the GLU, glu 2 is gpt-oss's
// swiglu_oai (common.cuh oai_mul); bias [E, m] to moe_matvec's float32 sums, as the CPU's _forward._moe.
//
// Grid: (ceil(m / MATVEC_WARPS), ceil(n / MAXN)) blocks of MATVEC_WARPS * 32 threads (m = F for
// norm_matvec_swiglu and moe_matvec_swiglu; the moe kernels: (ceil(m / MATVEC_WARPS), n_tiles)).
#include "common.cuh"

#define MATVEC_WARPS 4
#define MATVEC_LOADS 4      // 16-byte weight loads a lane issues per weight row before it uses the first

__device__ __forceinline__ void unpack2(unsigned int w, f16, float* f) {
    f16 lo, hi;
    lo.bits = (unsigned short)(w & 0xffffu);
    hi.bits = (unsigned short)(w >> 16);
    f[0] = to_float(lo);
    f[1] = to_float(hi);
}

__device__ __forceinline__ void unpack2(unsigned int w, bf16, float* f) {
    f[0] = __uint_as_float(w << 16);
    f[1] = __uint_as_float(w & 0xffff0000u);
}

// Eight elements of storage type T, loaded as one uint4, to float32.
template <typename T>
__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    unpack2(v.x, T(), f);
    unpack2(v.y, T(), f + 2);
    unpack2(v.z, T(), f + 4);
    unpack2(v.w, T(), f + 6);
}

// What a product reads as its x: row(j, i, f) gives elements 8i .. 8i + 7 of the group's row j as
// float32, after chunk(i) (once per i, for all rows); prologue(nj) runs once per block, every warp.

template <typename T>
struct StoredRows {         // x [n, k] in T
    const T* __restrict__ x;
    int k;
    __device__ __forceinline__ void prologue(int) {}
    __device__ __forceinline__ void chunk(int) {}
    __device__ __forceinline__ void row(int j, int i, float* f) const {
        unpack8<T>(__ldg(reinterpret_cast<const uint4*>(x + (size_t)j * k) + i), f);
    }
};

#define NORM_STAGE 1024     // uint4s (16 KiB) of shared memory a block stages its group's h in, when it fits

template <typename T>
struct NormedRows {         // rmsnorm(x[src]) * w rounded to T, from the float32 residual stream
    const float* __restrict__ x;
    const int* __restrict__ rows;   // NULL: src = j0 + j
    const float* __restrict__ w;
    float eps;
    int k, j0;
    float* inv;                 // shared [MAXN]
    int* src;                   // shared [MAXN]
    uint4* staged;              // shared [NORM_STAGE]: h[j, 8i .. 8i + 7] at j * k / 8 + i, when `stage`
    bool stage;
    float wn[8];

    __device__ __forceinline__ void prologue(int nj) {
        const int lane = threadIdx.x & 31, k8 = k >> 3;
        for (int j = threadIdx.x >> 5; j < nj; j += MATVEC_WARPS) {
            const int r = rows != nullptr ? rows[j0 + j] : j0 + j;
            const float4* xr = reinterpret_cast<const float4*>(x + (size_t)r * k);
            float s = 0.0f;
            for (int q = lane; q < (k >> 2); q += 32) {
                const float4 v = __ldg(xr + q);
                s += v.x * v.x;
                s += v.y * v.y;
                s += v.z * v.z;
                s += v.w * v.w;
            }
            s = warp_sum(s);
            if (lane == 0) {
                inv[j] = rms_inv(s, k, eps);
                src[j] = r;
            }
        }
        __syncthreads();
        // Small groups: h once per block, not once per warp (the same elements, bit for bit).
        stage = nj * k8 <= NORM_STAGE;
        if (!stage) return;
        for (int e = threadIdx.x; e < nj * k8; e += MATVEC_WARPS * 32) {
            const int j = e / k8, i = e - j * k8;
            float wv[8];
            norm_weights(i, wv);
            T h[8];
            form(j, i, wv, h);
            staged[e] = make_uint4(h[0].bits | ((unsigned int)h[1].bits << 16),
                                   h[2].bits | ((unsigned int)h[3].bits << 16),
                                   h[4].bits | ((unsigned int)h[5].bits << 16),
                                   h[6].bits | ((unsigned int)h[7].bits << 16));
        }
        __syncthreads();
    }
    __device__ __forceinline__ void norm_weights(int i, float* wv) const {
        const float4 a = __ldg(reinterpret_cast<const float4*>(w) + 2 * i);
        const float4 b = __ldg(reinterpret_cast<const float4*>(w) + 2 * i + 1);
        wv[0] = a.x; wv[1] = a.y; wv[2] = a.z; wv[3] = a.w;
        wv[4] = b.x; wv[5] = b.y; wv[6] = b.z; wv[7] = b.w;
    }
    // h[j, 8i .. 8i + 7], as rms_norm.cu rounds it.
    __device__ __forceinline__ void form(int j, int i, const float* wv, T* h) const {
        const float4* xr = reinterpret_cast<const float4*>(x + (size_t)src[j] * k) + 2 * i;
        const float4 a = __ldg(xr), b = __ldg(xr + 1);
        const float s = inv[j];
        h[0] = rms_apply<T>(a.x, s, wv[0]);
        h[1] = rms_apply<T>(a.y, s, wv[1]);
        h[2] = rms_apply<T>(a.z, s, wv[2]);
        h[3] = rms_apply<T>(a.w, s, wv[3]);
        h[4] = rms_apply<T>(b.x, s, wv[4]);
        h[5] = rms_apply<T>(b.y, s, wv[5]);
        h[6] = rms_apply<T>(b.z, s, wv[6]);
        h[7] = rms_apply<T>(b.w, s, wv[7]);
    }
    __device__ __forceinline__ void chunk(int i) {
        if (!stage) norm_weights(i, wn);
    }
    __device__ __forceinline__ void row(int j, int i, float* f) const {
        if (stage) {
            unpack8<T>(staged[j * (k >> 3) + i], f);
            return;
        }
        T h[8];
        form(j, i, wn, h);
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = to_float(h[e]);
    }
};

// The warp's R weight rows w + (row + r * r_stride) * k against the nj x rows of `in`: acc[r][j] holds
// lane's part of the sum (warp_sum it). False for the warps past the last row (after the prologue,
// which every warp of the block runs).
template <typename T, int MAXN, int R, typename In>
__device__ __forceinline__ bool matvec_rows(const T* __restrict__ w, int r_stride, int m, int k, In& in, int nj,
                                            float (&acc)[R][MAXN]) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * MATVEC_WARPS + (threadIdx.x >> 5);
    const bool live = row < m;
    const int k8 = k >> 3;
    const uint4* wrow[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wrow[r] = reinterpret_cast<const uint4*>(w + (size_t)(row + r * r_stride) * k);
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < MAXN; ++j) acc[r][j] = 0.0f;
    // A pass's weight loads go out before any is used, so that R * MATVEC_LOADS of them are in flight;
    // the first pass's before the prologue, whose x reads they overlap.
    uint4 wv[R][MATVEC_LOADS];
    auto load = [&](int i0) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int u = 0; u < MATVEC_LOADS; ++u) {
                wv[r][u] = make_uint4(0u, 0u, 0u, 0u);
                if (live && i0 + 32 * u < k8) wv[r][u] = __ldg(wrow[r] + i0 + 32 * u);
            }
    };
    load(lane);
    in.prologue(nj);
    if (!live) return false;
    for (int i0 = lane; i0 < k8; i0 += 32 * MATVEC_LOADS) {
        if (i0 != lane) load(i0);
#pragma unroll
        for (int u = 0; u < MATVEC_LOADS; ++u) {
            const int i = i0 + 32 * u;
            if (i < k8) {
                float wf[R][8];
#pragma unroll
                for (int r = 0; r < R; ++r) unpack8<T>(wv[r][u], wf[r]);
                in.chunk(i);
#pragma unroll
                for (int j = 0; j < MAXN; ++j) {
                    if (j < nj) {
                        float xf[8];
                        in.row(j, i, xf);
#pragma unroll
                        for (int r = 0; r < R; ++r) {
                            float s = 0.0f;
#pragma unroll
                            for (int e = 0; e < 8; ++e) s += wf[r][e] * xf[e];
                            acc[r][j] += s;
                        }
                    }
                }
            }
        }
    }
    return true;
}

// out[j, row] (+)= the warp's sums times scale, j < nj (out: the group's first row).
template <int MAXN>
__device__ __forceinline__ void store_rows(float (&acc)[1][MAXN], float* __restrict__ out, int nj, int m,
                                           int accumulate, float scale, const float* __restrict__ bias) {
    const int row = blockIdx.x * MATVEC_WARPS + (threadIdx.x >> 5);
    const float b = bias != nullptr ? bias[row] : 0.0f;
#pragma unroll
    for (int j = 0; j < MAXN; ++j) {
        if (j < nj) {
            float s = warp_sum(acc[0][j]) * scale;
            if (bias != nullptr) s += b;
            if ((threadIdx.x & 31) == 0) {
                float* o = out + (size_t)j * m + row;
                *o = accumulate ? *o + s : s;
            }
        }
    }
}

// act[j, row] = gate_mul(glu, gate sum [+ bias[row]], up sum [+ bias[m + row]]) rounded to T, j < nj (act:
// the group's first row, [*, m]; bias: [2 m] or NULL).
template <typename T, int MAXN>
__device__ __forceinline__ void store_gated(float (&acc)[2][MAXN], T* __restrict__ act, int nj, int m, int glu,
                                            const float* __restrict__ bias) {
    const int row = blockIdx.x * MATVEC_WARPS + (threadIdx.x >> 5);
    const float bg = bias != nullptr ? bias[row] : 0.0f, bu = bias != nullptr ? bias[m + row] : 0.0f;
#pragma unroll
    for (int j = 0; j < MAXN; ++j) {
        if (j < nj) {
            float g = warp_sum(acc[0][j]), u = warp_sum(acc[1][j]);
            if (bias != nullptr) {
                g += bg;
                u += bu;
            }
            if ((threadIdx.x & 31) == 0) act[(size_t)j * m + row] = from_float<T>(gate_mul(glu, g, u));
        }
    }
}

template <typename T, int MAXN>
__device__ __forceinline__ void matvec(const T* __restrict__ w, const T* __restrict__ x, float* __restrict__ out,
                                       int n, int m, int k, int accumulate, float scale) {
    const int j0 = blockIdx.y * MAXN;               // this block's group of x rows
    const int nj = min(MAXN, n - j0);
    StoredRows<T> in{x + (size_t)j0 * k, k};
    float acc[1][MAXN];
    if (matvec_rows<T, MAXN, 1>(w, 0, m, k, in, nj, acc))
        store_rows<MAXN>(acc, out + (size_t)j0 * m, nj, m, accumulate, scale, nullptr);
}

// R = 1: out[j, row] = the product (float32 [n, m]); R = 2: w holds 2 m rows (gate, then up) and
// act[j, row] = gate_mul(gelu, gate row, up row m + row) rounded to T ([n, m]).
template <typename T, int MAXN, int R>
__device__ __forceinline__ void norm_matvec(const T* __restrict__ w, const float* __restrict__ x,
                                            const int* __restrict__ rows, const float* __restrict__ norm_w,
                                            float* __restrict__ out, T* __restrict__ act, int n, int m, int k,
                                            float eps, int gelu) {
    __shared__ float inv[MAXN];
    __shared__ int src[MAXN];
    __shared__ uint4 staged[NORM_STAGE];
    const int j0 = blockIdx.y * MAXN;
    const int nj = min(MAXN, n - j0);
    NormedRows<T> in{x, rows, norm_w, eps, k, j0, inv, src, staged, false, {}};
    float acc[R][MAXN];
    if (!matvec_rows<T, MAXN, R>(w, m, m, k, in, nj, acc)) return;
    if constexpr (R == 1) {
        store_rows<MAXN>(acc, out + (size_t)j0 * m, nj, m, 0, 1.0f, nullptr);
    } else {
        store_gated<T, MAXN>(acc, act + (size_t)j0 * m, nj, m, gelu, nullptr);
    }
}

// A mixture of experts' rows (cuda/moe.cu groups them): x rows h[order[t0 + j] / k_used], the rows of
// the (row, rank) pairs at grouped positions t0 + j.
template <typename T>
struct GatheredRows {
    const T* __restrict__ x;
    int k;
    const int* __restrict__ order;
    int t0, k_used;
    int* src;                   // shared [MAXN]
    __device__ __forceinline__ void prologue(int nj) {
        for (int j = threadIdx.x; j < nj; j += MATVEC_WARPS * 32) src[j] = order[t0 + j] / k_used;
        __syncthreads();
    }
    __device__ __forceinline__ void chunk(int) {}
    __device__ __forceinline__ void row(int j, int i, float* f) const {
        unpack8<T>(__ldg(reinterpret_cast<const uint4*>(x + (size_t)src[j] * k) + i), f);
    }
};

// The tile blockIdx.y of cuda/moe.cu's moe_group: expert e's grouped positions t0 .. t0 + nj - 1 against
// its matrix w + e * R * m * k. R = 2 (moe_matvec_swiglu): x = h [n, k] read through `order` (GatheredRows),
// w [E, 2 m, k] (each expert's gate rows, then its up rows), act[t, row] = gate_mul(glu, gate [+ bias],
// up [+ bias]) rounded to T ([n_pairs, m], grouped order; bias [E, 2 m] or NULL). R = 1 (moe_matvec): x = act
// [n_pairs, k] in grouped order, w [E, m, k], out[t, row] = the product [+ bias[e, row]] (float32 [n_pairs,
// m], grouped order; bias [E, m] or NULL). An unused tile (e < 0) does nothing.
template <typename T, int MAXN, int R>
__device__ __forceinline__ void moe_matvec(const T* __restrict__ w, const T* __restrict__ x,
                                           const int* __restrict__ start, const int* __restrict__ order,
                                           const int* __restrict__ tiles, const float* __restrict__ bias,
                                           float* __restrict__ out, T* __restrict__ act, int m, int k, int k_used,
                                           int glu) {
    __shared__ int src[MAXN];
    const int e = tiles[2 * blockIdx.y], t0 = tiles[2 * blockIdx.y + 1];
    if (e < 0) return;                              // the whole block: before any barrier
    const int nj = min(MAXN, start[e + 1] - t0);
    const T* we = w + (size_t)e * R * m * k;
    const float* be = bias != nullptr ? bias + (size_t)e * R * m : nullptr;
    float acc[R][MAXN];
    if constexpr (R == 1) {
        StoredRows<T> in{x + (size_t)t0 * k, k};
        if (matvec_rows<T, MAXN, 1>(we, 0, m, k, in, nj, acc))
            store_rows<MAXN>(acc, out + (size_t)t0 * m, nj, m, 0, 1.0f, be);
    } else {
        GatheredRows<T> in{x, k, order, t0, k_used, src};
        if (matvec_rows<T, MAXN, 2>(we, m, m, k, in, nj, acc))
            store_gated<T, MAXN>(acc, act + (size_t)t0 * m, nj, m, glu, be);
    }
}

#define MATVEC(NAME, T, MAXN)                                                                         \
    extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32, 1)                                  \
    NAME(const T* w, const T* x, float* out, int n, int m, int k, int accumulate, float scale) {       \
        matvec<T, MAXN>(w, x, out, n, m, k, accumulate, scale);                                        \
    }

#define NORM_MATVEC(NAME, T, MAXN)                                                                    \
    extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32, 1)                                  \
    NAME(const T* w, const float* x, const int* rows, const float* norm_w, float* out, int n, int m, int k, \
         float eps) {                                                                                  \
        norm_matvec<T, MAXN, 1>(w, x, rows, norm_w, out, nullptr, n, m, k, eps, 0);                       \
    }

#define NORM_MATVEC_SWIGLU(NAME, T, MAXN)                                                             \
    extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32, 1)                                  \
    NAME(const T* w, const float* x, const float* norm_w, T* act, int n, int n_ff, int k, float eps,   \
         int gelu) {                                                                                   \
        norm_matvec<T, MAXN, 2>(w, x, nullptr, norm_w, nullptr, act, n, n_ff, k, eps, gelu);           \
    }

#define MOE_MATVEC(NAME, T, MAXN)                                                                     \
    extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32, 1)                                  \
    NAME(const T* w, const T* x, const int* start, const int* tiles, const float* bias, float* out, int m, \
         int k) {                                                                                      \
        moe_matvec<T, MAXN, 1>(w, x, start, nullptr, tiles, bias, out, nullptr, m, k, 1, 0);           \
    }

#define MOE_MATVEC_SWIGLU(NAME, T, MAXN)                                                              \
    extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32, 1)                                  \
    NAME(const T* w, const T* x, const int* start, const int* order, const int* tiles, const float* bias, \
         T* act, int n_ff, int k, int k_used, int glu) {                                               \
        moe_matvec<T, MAXN, 2>(w, x, start, order, tiles, bias, nullptr, act, n_ff, k, k_used, glu);   \
    }

// MAXN: the x rows one block takes (the launcher picks the smallest that fits n, or 32 per block row).
MATVEC(matvec_f16_n1, f16, 1)
MATVEC(matvec_f16_n2, f16, 2)
MATVEC(matvec_f16_n4, f16, 4)
MATVEC(matvec_f16_n8, f16, 8)
MATVEC(matvec_f16_n16, f16, 16)
MATVEC(matvec_f16_n32, f16, 32)
MATVEC(matvec_bf16_n1, bf16, 1)
MATVEC(matvec_bf16_n2, bf16, 2)
MATVEC(matvec_bf16_n4, bf16, 4)
MATVEC(matvec_bf16_n8, bf16, 8)
MATVEC(matvec_bf16_n16, bf16, 16)
MATVEC(matvec_bf16_n32, bf16, 32)
NORM_MATVEC(norm_matvec_f16_n1, f16, 1)
NORM_MATVEC(norm_matvec_f16_n2, f16, 2)
NORM_MATVEC(norm_matvec_f16_n4, f16, 4)
NORM_MATVEC(norm_matvec_f16_n8, f16, 8)
NORM_MATVEC(norm_matvec_f16_n16, f16, 16)
NORM_MATVEC(norm_matvec_f16_n32, f16, 32)
NORM_MATVEC(norm_matvec_bf16_n1, bf16, 1)
NORM_MATVEC(norm_matvec_bf16_n2, bf16, 2)
NORM_MATVEC(norm_matvec_bf16_n4, bf16, 4)
NORM_MATVEC(norm_matvec_bf16_n8, bf16, 8)
NORM_MATVEC(norm_matvec_bf16_n16, bf16, 16)
NORM_MATVEC(norm_matvec_bf16_n32, bf16, 32)
NORM_MATVEC_SWIGLU(norm_matvec_swiglu_f16_n1, f16, 1)
NORM_MATVEC_SWIGLU(norm_matvec_swiglu_f16_n2, f16, 2)
NORM_MATVEC_SWIGLU(norm_matvec_swiglu_f16_n4, f16, 4)
NORM_MATVEC_SWIGLU(norm_matvec_swiglu_f16_n8, f16, 8)
NORM_MATVEC_SWIGLU(norm_matvec_swiglu_f16_n16, f16, 16)
NORM_MATVEC_SWIGLU(norm_matvec_swiglu_f16_n32, f16, 32)
NORM_MATVEC_SWIGLU(norm_matvec_swiglu_bf16_n1, bf16, 1)
NORM_MATVEC_SWIGLU(norm_matvec_swiglu_bf16_n2, bf16, 2)
NORM_MATVEC_SWIGLU(norm_matvec_swiglu_bf16_n4, bf16, 4)
NORM_MATVEC_SWIGLU(norm_matvec_swiglu_bf16_n8, bf16, 8)
NORM_MATVEC_SWIGLU(norm_matvec_swiglu_bf16_n16, bf16, 16)
NORM_MATVEC_SWIGLU(norm_matvec_swiglu_bf16_n32, bf16, 32)
MOE_MATVEC(moe_matvec_f16_n1, f16, 1)
MOE_MATVEC(moe_matvec_f16_n2, f16, 2)
MOE_MATVEC(moe_matvec_f16_n4, f16, 4)
MOE_MATVEC(moe_matvec_f16_n8, f16, 8)
MOE_MATVEC(moe_matvec_f16_n16, f16, 16)
MOE_MATVEC(moe_matvec_f16_n32, f16, 32)
MOE_MATVEC(moe_matvec_bf16_n1, bf16, 1)
MOE_MATVEC(moe_matvec_bf16_n2, bf16, 2)
MOE_MATVEC(moe_matvec_bf16_n4, bf16, 4)
MOE_MATVEC(moe_matvec_bf16_n8, bf16, 8)
MOE_MATVEC(moe_matvec_bf16_n16, bf16, 16)
MOE_MATVEC(moe_matvec_bf16_n32, bf16, 32)
MOE_MATVEC_SWIGLU(moe_matvec_swiglu_f16_n1, f16, 1)
MOE_MATVEC_SWIGLU(moe_matvec_swiglu_f16_n2, f16, 2)
MOE_MATVEC_SWIGLU(moe_matvec_swiglu_f16_n4, f16, 4)
MOE_MATVEC_SWIGLU(moe_matvec_swiglu_f16_n8, f16, 8)
MOE_MATVEC_SWIGLU(moe_matvec_swiglu_f16_n16, f16, 16)
MOE_MATVEC_SWIGLU(moe_matvec_swiglu_f16_n32, f16, 32)
MOE_MATVEC_SWIGLU(moe_matvec_swiglu_bf16_n1, bf16, 1)
MOE_MATVEC_SWIGLU(moe_matvec_swiglu_bf16_n2, bf16, 2)
MOE_MATVEC_SWIGLU(moe_matvec_swiglu_bf16_n4, bf16, 4)
MOE_MATVEC_SWIGLU(moe_matvec_swiglu_bf16_n8, bf16, 8)
MOE_MATVEC_SWIGLU(moe_matvec_swiglu_bf16_n16, bf16, 16)
MOE_MATVEC_SWIGLU(moe_matvec_swiglu_bf16_n32, bf16, 32)
