// RMSNorm: out[r, :] = x[src, :] / sqrt(mean(x[src, :]^2) + eps) * w, with src = rows[r] when a row
// index is given (the final norm runs on the output rows only) and src = r otherwise (rows == NULL).
//
// x: float32 [*, d] (the residual stream); w: float32 [d]; out: [n, d] in the type the next matrix
// product reads (f16 / bf16), or float32. Arithmetic in float32, as backends/cpu/ref/layer_ops.rms_norm:
// x * (1 / sqrt(ms + eps)) * w.
//
// rms_norm_add_f32: x[r, :] += (y[r, :] / sqrt(mean(y[r, :]^2) + eps) * w) * scale, the sandwich norms
// (gemma3's post-attention and post-FFN norms): a block's float32 output y [n, d] normed, then times the
// residual multiplier scale (1: none), then added to the residual stream x [n, d], as
// fastserve/backends/cpu/ref/forward.py: rms_norm(y), y *= scale, then x += y.
// Grid: n blocks, one per output row; block: a multiple of 32 threads, at most 1024.
#include "common.cuh"

template <typename TOut>
__device__ __forceinline__ void rms_norm(const float* __restrict__ x, const int* __restrict__ rows,
                                         const float* __restrict__ w, TOut* __restrict__ out,
                                         int d, float eps) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    const int src = rows != nullptr ? rows[r] : r;
    const float* xr = x + (size_t)src * d;
    float s = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = xr[i];
        s += v * v;
    }
    s = block_sum(s, scratch);
    const float inv = rms_inv(s, d, eps);
    TOut* o = out + (size_t)r * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = rms_apply<TOut>(xr[i], inv, w[i]);
}

extern "C" __global__ void rms_norm_f16(const float* x, const int* rows, const float* w, f16* out, int d,
                                        float eps) {
    rms_norm(x, rows, w, out, d, eps);
}

extern "C" __global__ void rms_norm_bf16(const float* x, const int* rows, const float* w, bf16* out, int d,
                                         float eps) {
    rms_norm(x, rows, w, out, d, eps);
}

extern "C" __global__ void rms_norm_f32(const float* x, const int* rows, const float* w, float* out, int d,
                                        float eps) {
    rms_norm(x, rows, w, out, d, eps);
}

extern "C" __global__ void rms_norm_add_f32(const float* __restrict__ y, const float* __restrict__ w,
                                            float* __restrict__ x, int d, float eps, float scale) {
    __shared__ float scratch[32];
    const float* yr = y + (size_t)blockIdx.x * d;
    float* xr = x + (size_t)blockIdx.x * d;
    float s = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += yr[i] * yr[i];
    s = block_sum(s, scratch);
    const float inv = rms_inv(s, d, eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) xr[i] += rms_apply<float>(yr[i], inv, w[i]) * scale;
}
