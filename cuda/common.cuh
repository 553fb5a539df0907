// Shared by every kernel family in cuda/: storage types, conversions, reductions.
//
// No CUDA header is included: the same text compiles under nvcc (CI) and under NVRTC (CuPy's
// RawModule, at run time), and the kernel loader (fastserve/backends/cuda/kernels.py) pastes this file
// in place of its #include, so that CuPy's on-disk kernel cache keys on the header's text too.
//
// Storage types are two-byte structs rather than CUDA's __half / __nv_bfloat16 so that nothing
// depends on which fp16 headers NVRTC finds. Arithmetic is always float32.
#pragma once

#define FS_INF __int_as_float(0x7f800000)   // +infinity (no <math.h> under NVRTC)

struct f16 { unsigned short bits; };    // IEEE binary16
struct bf16 { unsigned short bits; };   // bfloat16: the top half of a float32

__device__ __forceinline__ float to_float(float x) { return x; }

__device__ __forceinline__ float to_float(f16 h) {
#ifdef FASTSERVE_CUDA_EMU      // the kernels compiled for the CPU by tests/gpu/cuda_emu
    _Float16 v;
    memcpy(&v, &h.bits, 2);
    return (float)v;
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
    return f;
#endif
}

__device__ __forceinline__ float to_float(bf16 h) {
    return __uint_as_float(((unsigned int)h.bits) << 16);
}

template <typename T> __device__ __forceinline__ T from_float(float x);

template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }

template <> __device__ __forceinline__ f16 from_float<f16>(float x) {
    f16 h;
#ifdef FASTSERVE_CUDA_EMU
    const _Float16 v = (_Float16)x;                           // round to nearest even
    memcpy(&h.bits, &v, 2);
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));   // round to nearest even
#endif
    return h;
}

template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) {
    // Round to nearest even by hand (cvt.rn.bf16.f32 needs sm_80); NaN stays a quiet NaN.
    unsigned int u = __float_as_uint(x);
    bf16 h;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        h.bits = (unsigned short)((u >> 16) | 0x0040u);
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        h.bits = (unsigned short)(u >> 16);
    }
    return h;
}

// RMSNorm and SwiGLU / GeGLU, each written once: cuda/rms_norm.cu and cuda/swiglu.cu apply them to whole rows,
// cuda/matvec.cu's fused products to the elements they read, with the same float32 operations.
// rms_inv: 1 / sqrt(mean square + eps) from a row's sum of squares over d elements; rms_apply: one
// normed element x * inv * w, rounded to the type the next product reads; silu_mul: silu(g) * u.
__device__ __forceinline__ float rms_inv(float sum_sq, int d, float eps) {
    return 1.0f / sqrtf(sum_sq / (float)d + eps);
}

template <typename T>
__device__ __forceinline__ T rms_apply(float x, float inv, float w) { return from_float<T>(x * inv * w); }

__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// gelu_mul: GELU's tanh form times u, as fastserve/backends/cpu/ref/layer_ops.geglu writes it:
// 0.5 g (1 + tanh(sqrt(2/pi) g (1 + 0.044715 g^2))) = g sigmoid(2 sqrt(2/pi) g (1 + 0.044715 g^2)).
// oai_mul: gpt-oss's SwiGLU, as fastserve/backends/cpu/_layer_ops.h's fs_swiglu_oai (llama.cpp's swiglu_oai):
// x = min(g, 7), y = clamp(u, -7, 7), x sigmoid(1.702 x) (y + 1); the clamps are comparisons, so a NaN stays NaN.
// gate_mul: the gated FFN's activation by glu: 0 silu_mul (SwiGLU), 1 gelu_mul (GeGLU), 2 oai_mul (gpt-oss).
#define FS_GELU_K 1.5957691216057308f     // 2 sqrt(2 / pi)
#define FS_GELU_C 0.044715f

__device__ __forceinline__ float gelu_mul(float g, float u) {
    const float y = ((g * g) * FS_GELU_C + 1.0f) * g;
    return g / (1.0f + expf(-(y * FS_GELU_K))) * u;
}

#define FS_OAI_ALPHA 1.702f
#define FS_OAI_LIMIT 7.0f

__device__ __forceinline__ float oai_mul(float g, float u) {
    const float x = g > FS_OAI_LIMIT ? FS_OAI_LIMIT : g;
    const float y = u > FS_OAI_LIMIT ? FS_OAI_LIMIT : u < -FS_OAI_LIMIT ? -FS_OAI_LIMIT : u;
    return x / (1.0f + expf(-(FS_OAI_ALPHA * x))) * (y + 1.0f);
}

__device__ __forceinline__ float gate_mul(int glu, float g, float u) {
    return glu == 2 ? oai_mul(g, u) : glu ? gelu_mul(g, u) : silu_mul(g, u);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024), in a fixed order: the result does
// not depend on timing, only on blockDim.x. `scratch` holds 32 floats of shared memory; every thread
// gets the sum; the block may reuse `scratch` after the call.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < n_warps ? scratch[lane] : 0.0f;
        v = warp_sum(v);
        if (lane == 0) scratch[0] = v;
    }
    __syncthreads();
    v = scratch[0];
    __syncthreads();
    return v;
}

// The block's best (value, index) pair: the larger value, equal values to the lower index, NaN never (a
// -inf value still beats no candidate); each thread passes its own best pair (NO_TOKEN: none) and every thread
// gets the winner's index, 0 when no thread had one. s_v, s_i: 32 floats and 32 ints of shared memory, reusable
// after the call. cuda/sampling.cu's greedy rows and cuda/moe.cu's top-k ranks.
#define NO_TOKEN 0x7fffffff

__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);     // NaN compares false: never better
}

__device__ __forceinline__ int block_argmax(float v, int i, float* s_v, int* s_i) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
    if (lane == 0) { s_v[warp] = v; s_i[warp] = i; }
    __syncthreads();
    if (warp == 0) {
        v = lane < n_warps ? s_v[lane] : -FS_INF;
        i = lane < n_warps ? s_i[lane] : NO_TOKEN;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, v, o);
            const int oi = __shfl_xor_sync(0xffffffffu, i, o);
            if (better(ov, oi, v, i)) { v = ov; i = oi; }
        }
        if (lane == 0) s_i[0] = i == NO_TOKEN ? 0 : i;
    }
    __syncthreads();
    const int best = s_i[0];
    __syncthreads();
    return best;
}
