// Token selection on the device, so that only the chosen ids (4 bytes a row) cross to the host.
//
// argmax_rows_f32: greedy; ties go to the lowest token id (as fastserve._sampling); NaN is never
//   chosen (a row of NaN only gives 0).
// sample_rows_f32: temperature sampling by the Gumbel-max trick: argmax_i(logit_i / T + G_i) with
//   G_i = -log(-log(U_i)) is distributed as softmax(logits / T). U_i comes from Philox4x32-10 keyed by
//   the request's seed, with counter (i, step, 0, 0): a row's draw depends only on its own seed and
//   step, never on the batch it shares. T <= 0 means greedy. (Top-k / top-p / min-p and penalties
//   stay on the host sampler for now.)
//
// logits: float32 [m, n_vocab]; out: int32 [m]; params: uint32 [m, 4] per row: the temperature's
// float32 bits, the 64-bit seed's low and high words, the step (the row's position in its sequence).
// Grid: m blocks, one per row; block: a multiple of 32 threads, at most 1024.
#include "common.cuh"

#define NO_TOKEN 0x7fffffff

__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);     // NaN compares false: never better
}

// Argmax over the block of (value, index) pairs; every thread gets the winner's index.
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
    return s_i[0];
}

extern "C" __global__ void argmax_rows_f32(const float* __restrict__ logits, int* __restrict__ out, int n_vocab) {
    __shared__ float s_v[32];
    __shared__ int s_i[32];
    const float* row = logits + (size_t)blockIdx.x * n_vocab;
    float bv = -FS_INF;
    int bi = NO_TOKEN;
    for (int i = threadIdx.x; i < n_vocab; i += blockDim.x) {
        const float v = row[i];
        if (better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    const int best = block_argmax(bv, bi, s_v, s_i);
    if (threadIdx.x == 0) out[blockIdx.x] = best;
}

// Philox4x32-10 (Salmon et al., SC'11): counter c, key k -> four random 32-bit words.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const unsigned int hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const unsigned int hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
        k.x += 0x9E3779B9u;
        k.y += 0xBB67AE85u;
    }
    return c;
}

extern "C" __global__ void sample_rows_f32(const float* __restrict__ logits, const unsigned int* __restrict__ params,
                                           int* __restrict__ out, int n_vocab) {
    __shared__ float s_v[32];
    __shared__ int s_i[32];
    const int r = blockIdx.x;
    const float* row = logits + (size_t)r * n_vocab;
    const float temp = __uint_as_float(params[4 * r]);
    const uint2 key = make_uint2(params[4 * r + 1], params[4 * r + 2]);
    const unsigned int step = params[4 * r + 3];
    float bv = -FS_INF;
    int bi = NO_TOKEN;
    for (int i = threadIdx.x; i < n_vocab; i += blockDim.x) {
        float v = row[i];
        if (temp > 0.0f) {
            const uint4 x = philox4x32_10(make_uint4((unsigned int)i, step, 0u, 0u), key);
            const float u = ((float)(x.x >> 8) + 0.5f) * (1.0f / 16777216.0f);    // in (0, 1)
            v = v / temp - logf(-logf(u));
        }
        if (better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    const int best = block_argmax(bv, bi, s_v, s_i);
    if (threadIdx.x == 0) out[r] = best;
}
