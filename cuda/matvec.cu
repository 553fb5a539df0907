// Matrix products for decode-sized batches: out[j, r] (+)= sum_i x[j, i] * w[r, i] for j < n.
//
// At a few rows a decode step is a weight read: every weight element is used n times, so the kernel
// streams each weight row once, 16 bytes per lane (8 elements), coalesced across the warp, and keeps
// MAXN float32 sums per lane; x rows (small, cached) are read as they are needed. One warp per output
// row; x rows in groups of MAXN, one group per block row (blockIdx.y), so that any n runs here.
// Float32 accumulation; the summation order depends on k only, not on n, MAXN or the other rows, so a
// token's result does not depend on the batch it is in (and decode steps, captured in CUDA graphs,
// need no cuBLAS call, which CuPy refuses during a capture).
//
// w: [m, k] storage type T (f16 / bf16), rows of k elements, k % 8 == 0, 16-byte aligned; x: [n, k] T;
// out: float32 [n, m]; accumulate: 0 writes, 1 adds to out (the residual stream).
// Grid: (ceil(m / MATVEC_WARPS), ceil(n / MAXN)) blocks of MATVEC_WARPS * 32 threads.
#include "common.cuh"

#define MATVEC_WARPS 4
#define MATVEC_LOADS 4      // 16-byte weight loads a lane issues before it uses the first

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

template <typename T, int MAXN>
__device__ __forceinline__ void matvec(const T* __restrict__ w, const T* __restrict__ x, float* __restrict__ out,
                                       int n, int m, int k, int accumulate) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * MATVEC_WARPS + (threadIdx.x >> 5);
    if (row >= m) return;
    const int j0 = blockIdx.y * MAXN;               // this block's group of x rows
    const int nj = min(MAXN, n - j0);
    x += (size_t)j0 * k;
    out += (size_t)j0 * m;
    const uint4* wrow = reinterpret_cast<const uint4*>(w + (size_t)row * k);
    const int k8 = k >> 3;
    float acc[MAXN];
#pragma unroll
    for (int j = 0; j < MAXN; ++j) acc[j] = 0.0f;
    for (int i0 = lane; i0 < k8; i0 += 32 * MATVEC_LOADS) {
        // All of this pass's weight loads first, so that MATVEC_LOADS of them are in flight at once.
        uint4 wv[MATVEC_LOADS];
#pragma unroll
        for (int u = 0; u < MATVEC_LOADS; ++u) {
            wv[u] = make_uint4(0u, 0u, 0u, 0u);
            if (i0 + 32 * u < k8) wv[u] = __ldg(wrow + i0 + 32 * u);
        }
#pragma unroll
        for (int u = 0; u < MATVEC_LOADS; ++u) {
            const int i = i0 + 32 * u;
            if (i < k8) {
                float wf[8];
                unpack8<T>(wv[u], wf);
#pragma unroll
                for (int j = 0; j < MAXN; ++j) {
                    if (j < nj) {
                        float xf[8];
                        unpack8<T>(__ldg(reinterpret_cast<const uint4*>(x + (size_t)j * k) + i), xf);
                        float s = 0.0f;
#pragma unroll
                        for (int e = 0; e < 8; ++e) s += wf[e] * xf[e];
                        acc[j] += s;
                    }
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < MAXN; ++j) {
        if (j < nj) {
            const float s = warp_sum(acc[j]);
            if (lane == 0) {
                float* o = out + (size_t)j * m + row;
                *o = accumulate ? *o + s : s;
            }
        }
    }
}

#define MATVEC(NAME, T, MAXN)                                                                         \
    extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32, 1)                                  \
    NAME(const T* w, const T* x, float* out, int n, int m, int k, int accumulate) {                    \
        matvec<T, MAXN>(w, x, out, n, m, k, accumulate);                                               \
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
