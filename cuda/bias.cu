// A bias added to each of n rows: x[t, j] += bias[j] (gpt-oss's attention-output bias, added to the residual
// stream after the output product's sum: (x + y) + b where the CPU adds x + (y + b), one float32 rounding apart).
//
// x: float32 [n, d]; bias: float32 [d]. Grid-stride over the n * d elements; any grid and block.
#include "common.cuh"

extern "C" __global__ void add_bias_f32(float* __restrict__ x, const float* __restrict__ bias, int n, int d) {
    const long long total = (long long)n * d;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) x[i] += bias[i % d];
}
