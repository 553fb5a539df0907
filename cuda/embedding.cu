// Embedding rows: x[t, :] = table[tokens[t], :] as float32, times scale (gemma3: sqrt(n_embd); 1 elsewhere),
// one float32 multiplication as fastserve/backends/cpu/ref/forward.py makes it.
//
// table: [n_vocab, d] in the weights' storage type (the same device array as the output matrix when
// the model ties them); tokens: int32 [n]; x: float32 [n, d] (the residual stream).
// Grid: n blocks, one per token; any block size.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void embed_rows(const T* __restrict__ table, const int* __restrict__ tokens,
                                           float* __restrict__ x, int d, float scale) {
    const int t = blockIdx.x;
    const T* row = table + (size_t)tokens[t] * d;
    float* out = x + (size_t)t * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) out[i] = to_float(row[i]) * scale;
}

extern "C" __global__ void embed_rows_f16(const f16* table, const int* tokens, float* x, int d, float scale) {
    embed_rows(table, tokens, x, d, scale);
}

extern "C" __global__ void embed_rows_bf16(const bf16* table, const int* tokens, float* x, int d, float scale) {
    embed_rows(table, tokens, x, d, scale);
}

extern "C" __global__ void embed_rows_f32(const float* table, const int* tokens, float* x, int d, float scale) {
    embed_rows(table, tokens, x, d, scale);
}
