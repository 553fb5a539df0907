// Causal attention of a batch's query tokens over each one's slot in the KV cache, for decode and
// prefill alike: token t (slot s, position p) attends keys 0..p of slot s, with grouped-query heads
// (G = n_head / n_head_kv query heads share one KV head). Prefill tokens of one prompt chunk are
// separate queries like any other: their K/V rows were written by kv_store before this runs.
//
// Split along the sequence (flash-decoding): keys are cut into chunks of `chunk`; one block per
// (chunk, KV head, token) keeps an online softmax over its chunk for the G heads of its group and
// writes an unnormalised partial result; attention_combine merges the chunks. The grid is fixed by
// the slot length (n_split = ceil(n_ctx_slot / chunk)), not by the positions, so a decode step can
// be captured once in a CUDA graph and replayed at any position: chunks past a token's position exit
// at once, writing an empty partial (m = -inf, l = 0).
//
// Every (token, head) is computed on its own, in an order that depends only on its position and on
// the launch shape: a token's result does not depend on the other tokens in the batch.
//
// Shapes (n tokens, H = n_head, Hkv = n_head_kv, D = head_dim <= 32 * E, S = n_split):
//   qkv      float32 [n, qkv_stride]: Q heads first (after RoPE); only Q is read here
//   k_cache  [n_slots, n_ctx_slot, Hkv, D] storage type T; v_cache the same
//   slots, positions  int32 [n]
//   part_o   float32 [n, H, S, D]   unnormalised sum of p * v over the chunk
//   part_ml  float32 [n, H, S, 2]   (max score, sum of exp(score - max)) over the chunk
//   out      [n, H * D] type TOut (what the output projection reads)
// attention_split_*: grid (S, Hkv, n), block ATTN_WARPS * 32 threads.
// attention_combine_*: grid (H, n), block: a multiple of 32 threads >= D (at most 1024).
#include "common.cuh"

#define ATTN_WARPS 4
#define ATTN_MAX_G 8     // query heads per KV head (the launcher refuses more)

template <typename T, int E>
__device__ __forceinline__ void attention_split(const float* __restrict__ qkv, const T* __restrict__ k_cache,
                                                const T* __restrict__ v_cache, const int* __restrict__ slots,
                                                const int* __restrict__ positions, float* __restrict__ part_o,
                                                float* __restrict__ part_ml, int qkv_stride, int n_head,
                                                int n_head_kv, int head_dim, int n_ctx_slot, int chunk,
                                                float scale) {
    __shared__ float s_acc[ATTN_WARPS][ATTN_MAX_G][32 * E];
    __shared__ float s_m[ATTN_WARPS][ATTN_MAX_G];
    __shared__ float s_l[ATTN_WARPS][ATTN_MAX_G];

    const int split = blockIdx.x, kvh = blockIdx.y, t = blockIdx.z;
    const int n_split = gridDim.x;
    const int G = n_head / n_head_kv;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_keys = positions[t] + 1;
    const int k0 = split * chunk;
    const int k1 = min(k0 + chunk, n_keys);
    const size_t kv_row = (size_t)n_head_kv * head_dim;
    const T* kbase = k_cache + (size_t)slots[t] * n_ctx_slot * kv_row + (size_t)kvh * head_dim;
    const T* vbase = v_cache + (size_t)slots[t] * n_ctx_slot * kv_row + (size_t)kvh * head_dim;

    // Lane `lane` holds dimensions lane, lane + 32, ... of each query head of the group.
    float q[ATTN_MAX_G][E], acc[ATTN_MAX_G][E], m[ATTN_MAX_G], l[ATTN_MAX_G];
    const float* qrow = qkv + (size_t)t * qkv_stride + (size_t)kvh * G * head_dim;
#pragma unroll
    for (int g = 0; g < ATTN_MAX_G; ++g) {
        m[g] = -FS_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int d = lane + 32 * e;
            q[g][e] = (g < G && d < head_dim) ? qrow[g * head_dim + d] * scale : 0.0f;
            acc[g][e] = 0.0f;
        }
    }

    for (int k = k0 + warp; k < k1; k += ATTN_WARPS) {
        float kv[E], vv[E];
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int d = lane + 32 * e;
            kv[e] = d < head_dim ? to_float(kbase[(size_t)k * kv_row + d]) : 0.0f;
            vv[e] = d < head_dim ? to_float(vbase[(size_t)k * kv_row + d]) : 0.0f;
        }
#pragma unroll
        for (int g = 0; g < ATTN_MAX_G; ++g) {
            if (g < G) {
                float s = 0.0f;
#pragma unroll
                for (int e = 0; e < E; ++e) s += q[g][e] * kv[e];
                s = warp_sum(s);
                const float m_new = fmaxf(m[g], s);
                const float corr = expf(m[g] - m_new);     // 0 on the first key (m = -inf)
                const float p = expf(s - m_new);
                l[g] = l[g] * corr + p;
#pragma unroll
                for (int e = 0; e < E; ++e) acc[g][e] = acc[g][e] * corr + p * vv[e];
                m[g] = m_new;
            }
        }
    }

#pragma unroll
    for (int g = 0; g < ATTN_MAX_G; ++g) {
#pragma unroll
        for (int e = 0; e < E; ++e) s_acc[warp][g][lane + 32 * e] = acc[g][e];
        if (lane == 0) {
            s_m[warp][g] = m[g];
            s_l[warp][g] = l[g];
        }
    }
    __syncthreads();

    // Merge the warps' partial softmaxes: thread j handles (head g, dimension d) pairs.
    for (int j = threadIdx.x; j < G * head_dim; j += blockDim.x) {
        const int g = j / head_dim, d = j - g * head_dim;
        float mx = -FS_INF;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) mx = fmaxf(mx, s_m[w][g]);
        float lsum = 0.0f, o = 0.0f;
        if (mx != -FS_INF) {
#pragma unroll
            for (int w = 0; w < ATTN_WARPS; ++w) {
                const float f = expf(s_m[w][g] - mx);   // 0 for a warp that saw no key
                lsum += s_l[w][g] * f;
                o += s_acc[w][g][d] * f;
            }
        }
        const int h = kvh * G + g;
        const size_t part = ((size_t)t * n_head + h) * n_split + split;
        part_o[part * head_dim + d] = o;
        if (d == 0) {
            part_ml[part * 2] = mx;
            part_ml[part * 2 + 1] = lsum;
        }
    }
}

template <typename TOut>
__device__ __forceinline__ void attention_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                                  TOut* __restrict__ out, int n_head, int head_dim, int n_split) {
    const int h = blockIdx.x, t = blockIdx.y, d = threadIdx.x;
    if (d >= head_dim) return;
    const size_t part0 = ((size_t)t * n_head + h) * n_split;
    float mx = -FS_INF;
    for (int s = 0; s < n_split; ++s) mx = fmaxf(mx, part_ml[(part0 + s) * 2]);
    float lsum = 0.0f, o = 0.0f;
    for (int s = 0; s < n_split; ++s) {
        const float ms = part_ml[(part0 + s) * 2];
        if (ms == -FS_INF) continue;          // a chunk past the token's position
        const float f = expf(ms - mx);
        lsum += part_ml[(part0 + s) * 2 + 1] * f;
        o += part_o[(part0 + s) * head_dim + d] * f;
    }
    out[((size_t)t * n_head + h) * head_dim + d] = from_float<TOut>(o / lsum);
}

#define ATTENTION_SPLIT(NAME, T, E)                                                                          \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)                                             \
    NAME(const float* qkv, const T* k_cache, const T* v_cache, const int* slots, const int* positions,        \
         float* part_o, float* part_ml, int qkv_stride, int n_head, int n_head_kv, int head_dim,              \
         int n_ctx_slot, int chunk, float scale) {                                                            \
        attention_split<T, E>(qkv, k_cache, v_cache, slots, positions, part_o, part_ml, qkv_stride, n_head,   \
                              n_head_kv, head_dim, n_ctx_slot, chunk, scale);                                 \
    }

// E = dimensions per lane: head_dim <= 32 (E1), <= 64 (E2), <= 128 (E4).
ATTENTION_SPLIT(attention_split_f16_e1, f16, 1)
ATTENTION_SPLIT(attention_split_f16_e2, f16, 2)
ATTENTION_SPLIT(attention_split_f16_e4, f16, 4)
ATTENTION_SPLIT(attention_split_bf16_e1, bf16, 1)
ATTENTION_SPLIT(attention_split_bf16_e2, bf16, 2)
ATTENTION_SPLIT(attention_split_bf16_e4, bf16, 4)
ATTENTION_SPLIT(attention_split_f32_e1, float, 1)
ATTENTION_SPLIT(attention_split_f32_e2, float, 2)
ATTENTION_SPLIT(attention_split_f32_e4, float, 4)

extern "C" __global__ void attention_combine_f16(const float* part_o, const float* part_ml, f16* out, int n_head,
                                                 int head_dim, int n_split) {
    attention_combine(part_o, part_ml, out, n_head, head_dim, n_split);
}

extern "C" __global__ void attention_combine_bf16(const float* part_o, const float* part_ml, bf16* out, int n_head,
                                                  int head_dim, int n_split) {
    attention_combine(part_o, part_ml, out, n_head, head_dim, n_split);
}

extern "C" __global__ void attention_combine_f32(const float* part_o, const float* part_ml, float* out, int n_head,
                                                 int head_dim, int n_split) {
    attention_combine(part_o, part_ml, out, n_head, head_dim, n_split);
}
