// RoPE on one token's fused QKV row, shared by rope.cu and the fused kernel in kv_cache.cu.
// llama.cpp's "normal" layout (adjacent pairs), as backends/cpu/ref/layer_ops.apply_rope: pair (2i, 2i+1) of the
// first rope_dim dimensions of each of the first n_rot_heads heads turns by pos * inv_freq[i]:
//     x[2i] = x0 * cos - x1 * sin,   x[2i+1] = x0 * sin + x1 * cos
// c, s: the token's row of the cos / sin tables [rope_dim / 2]. The block's threads share the work.
#pragma once

__device__ __forceinline__ void rope_row(float* row, const float* c, const float* s, int n_rot_heads,
                                         int head_dim, int rope_dim) {
    const int half = rope_dim >> 1;
    for (int j = threadIdx.x; j < n_rot_heads * half; j += blockDim.x) {
        const int h = j / half, i = j - h * half;
        float* p = row + h * head_dim + 2 * i;
        const float x0 = p[0], x1 = p[1];
        p[0] = x0 * c[i] - x1 * s[i];
        p[1] = x0 * s[i] + x1 * c[i];
    }
}
