// Matrix products for decode-sized batches: out[j, r] (+)= sum_i x[j, i] * w[r, i] for j < n <= MAXN.
//
// At a few rows a decode step is a weight read: every weight element is used n times, so the kernel
// streams each weight row once, 16 bytes per lane (8 elements), coalesced across the warp, and keeps n
// float32 sums per lane; x rows (small, cached) are read as they are needed. One warp per output row.
// Float32 accumulation; the summation order depends on k and the launch shape only, not on n or on
// the other rows, so a token's result does not depend on the batch it is in.
//
// w: [m, k] storage type T (f16 / bf16), rows of k elements, k % 8 == 0, 16-byte aligned; x: [n, k] T;
// out: float32 [n, m]; accumulate: 0 writes, 1 adds to out (the residual stream).
// Grid: ceil(m / MATVEC_WARPS) blocks of MATVEC_WARPS * 32 threads.
#include "common.cuh"

#define MATVEC_WARPS 4

__device__ __forceinline__ void unpack8(uint4 v, f16, float* f) {
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f16 lo, hi;
        lo.bits = (unsigned short)(w[i] & 0xffffu);
        hi.bits = (unsigned short)(w[i] >> 16);
        f[2 * i] = to_float(lo);
        f[2 * i + 1] = to_float(hi);
    }
}

__device__ __forceinline__ void unpack8(uint4 v, bf16, float* f) {
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

template <typename T, int MAXN>
__device__ __forceinline__ void matvec(const T* __restrict__ w, const T* __restrict__ x, float* __restrict__ out,
                                       int n, int m, int k, int accumulate) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * MATVEC_WARPS + (threadIdx.x >> 5);
    if (row >= m) return;
    const uint4* wrow = reinterpret_cast<const uint4*>(w + (size_t)row * k);
    const int k8 = k >> 3;
    float acc[MAXN];
#pragma unroll
    for (int j = 0; j < MAXN; ++j) acc[j] = 0.0f;
#pragma unroll 4
    for (int i = lane; i < k8; i += 32) {
        float wf[8];
        unpack8(__ldg(wrow + i), T(), wf);
#pragma unroll
        for (int j = 0; j < MAXN; ++j) {
            if (j < n) {
                float xf[8];
                unpack8(__ldg(reinterpret_cast<const uint4*>(x + (size_t)j * k) + i), T(), xf);
                float s = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; ++e) s += wf[e] * xf[e];
                acc[j] += s;
            }
        }
    }
#pragma unroll
    for (int j = 0; j < MAXN; ++j) {
        if (j < n) {
            const float s = warp_sum(acc[j]);
            if (lane == 0) {
                float* o = out + (size_t)j * m + row;
                *o = accumulate ? *o + s : s;
            }
        }
    }
}

#define MATVEC(NAME, T, MAXN)                                                                         \
    extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32)                                    \
    NAME(const T* w, const T* x, float* out, int n, int m, int k, int accumulate) {                    \
        matvec<T, MAXN>(w, x, out, n, m, k, accumulate);                                               \
    }

// MAXN: the most rows one launch takes (the launcher picks the smallest that fits n).
MATVEC(matvec_f16_n1, f16, 1)
MATVEC(matvec_f16_n2, f16, 2)
MATVEC(matvec_f16_n4, f16, 4)
MATVEC(matvec_f16_n8, f16, 8)
MATVEC(matvec_bf16_n1, bf16, 1)
MATVEC(matvec_bf16_n2, bf16, 2)
MATVEC(matvec_bf16_n4, bf16, 4)
MATVEC(matvec_bf16_n8, bf16, 8)
