// The logits' last step, in place over the first `size` elements (the output rows' logits), as
// fastserve/backends/cpu/ref/forward.py: the logit multiplier, then final-logit soft-capping (Gemma 2 style,
// <arch>.final_logit_softcapping):
//     z = logits[e] * scale                 (granite's 1 / <arch>.logit_scale; 1: none)
//     logits[e] = cap > 0 ? cap * tanh(z / cap) : z
// with tanh as backends/cpu/ref/layer_ops.softcap: tanh(u) = sign(u) (1 - e^(-2|u|)) / (1 + e^(-2|u|)).
//
// logits: float32 [size]; cap >= 0. Grid-stride; any grid and block.
#include "common.cuh"

extern "C" __global__ void logit_out_f32(float* __restrict__ logits, long long size, float scale, float cap) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < size;
         e += (long long)gridDim.x * blockDim.x) {
        const float z = logits[e] * scale;
        if (cap > 0.0f) {
            const float u = z / cap;
            const float t = expf(-2.0f * fabsf(u));
            const float r = (1.0f - t) / (1.0f + t);
            logits[e] = (u < 0.0f ? -r : r) * cap;
        } else {
            logits[e] = z;
        }
    }
}
