// Casts from float32 into a storage type: weights dequantized on the host (float32) are uploaded
// once and rounded on the device, so that host and device agree on one rounding (nearest even).
//
// src: float32 [n]; dst: [n]. Grid-stride; any grid and block.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void cast_from_f32(const float* __restrict__ src, T* __restrict__ dst, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = from_float<T>(src[i]);
}

extern "C" __global__ void cast_f32_f16(const float* src, f16* dst, long long n) { cast_from_f32(src, dst, n); }

extern "C" __global__ void cast_f32_bf16(const float* src, bf16* dst, long long n) { cast_from_f32(src, dst, n); }
