// Final-logit soft-capping (Gemma 2 style, <arch>.final_logit_softcapping): in place,
// logits[e] = cap * tanh(logits[e] / cap) over the first `size` elements (the output rows' logits),
// as fastserve/backends/cpu/ref/layer_ops.softcap: tanh(z) = sign(z) (1 - e^(-2|z|)) / (1 + e^(-2|z|)).
//
// logits: float32 [size]; cap > 0. Grid-stride; any grid and block.
#include "common.cuh"

extern "C" __global__ void softcap_f32(float* __restrict__ logits, long long size, float cap) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < size;
         e += (long long)gridDim.x * blockDim.x) {
        const float z = logits[e] / cap;
        const float t = expf(-2.0f * fabsf(z));
        const float r = (1.0f - t) / (1.0f + t);
        logits[e] = (z < 0.0f ? -r : r) * cap;
    }
}
