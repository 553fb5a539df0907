// SwiGLU: out[t, j] = silu(gu[t, j]) * gu[t, n_ff + j], silu(g) = g / (1 + exp(-g)), or GeGLU (gelu != 0:
// gemma3) gelu(gu[t, j]) * gu[t, n_ff + j] in GELU's tanh form (common.cuh gate_mul), as
// fastserve/backends/cpu/ref/layer_ops: the fused gate/up product's rows hold the gate, then the up projection.
//
// gu: float32 [n, 2 * n_ff]; out: [n, n_ff] in the type the down projection reads (or float32).
// Grid-stride over n * n_ff elements; any grid and block.
#include "common.cuh"

template <typename TOut>
__device__ __forceinline__ void swiglu(const float* __restrict__ gu, TOut* __restrict__ out, int n, int n_ff,
                                       int gelu) {
    const size_t total = (size_t)n * n_ff;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        const size_t t = e / n_ff, j = e - t * n_ff;
        const float g = gu[t * 2 * n_ff + j];
        const float u = gu[t * 2 * n_ff + n_ff + j];
        out[e] = from_float<TOut>(gate_mul(gelu, g, u));
    }
}

extern "C" __global__ void swiglu_f16(const float* gu, f16* out, int n, int n_ff, int gelu) {
    swiglu(gu, out, n, n_ff, gelu);
}

extern "C" __global__ void swiglu_bf16(const float* gu, bf16* out, int n, int n_ff, int gelu) {
    swiglu(gu, out, n, n_ff, gelu);
}

extern "C" __global__ void swiglu_f32(const float* gu, float* out, int n, int n_ff, int gelu) {
    swiglu(gu, out, n, n_ff, gelu);
}
