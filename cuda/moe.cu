// A mixture of experts' steps around its products (the products: cuda/matvec.cu moe_matvec*), as
// fastserve/backends/cpu/_forward.pyx's _route, _moe and _moe_sum compute them, each row on its own (a row's
// experts, weights and output do not depend on the other rows of the batch).
//
// moe_router_f32: the router's logits route [n, E] float32 = h @ router^T, h = rmsnorm(x) * norm_w, every operand
// float32 as the CPU's (x the residual stream [n, d], norm_w [d], router [E, d] as the file keeps it, F32): the
// experts' h is rounded to the weights' f16 / bf16, but a routing decided on those would flip at near-ties the CPU
// decides otherwise. h's elements are formed where they are used (common.cuh rms_apply<float>, as rms_norm.cu);
// each block's rms over the row (block_sum: an order fixed by the block size alone), then each warp one expert's
// sum, lanes strided over d, then warp_sum. Grid: (n, ceil(E / MOE_ROUTER_WARPS)); block: MOE_ROUTER_WARPS * 32.
// Each block reads its experts' router rows, so a batch of n reads the router n times (from L2: 1 MiB a layer at
// Qwen3-30B-A3B's 128 x 2048).
//
// moe_route_f32: route [n, E] float32, a row's router logits -> its k experts sel [n, k] int32 by rank and
// their weights wts [n, k] float32, llama.cpp's softmax gating with normalised weights:
//     p = softmax(route[i]), the k largest p (ties to the lower id), by rank;
//     w_r = p_r / max(sum of the k p_r in rank order, 2^-14) * scale (expert_weights_scale; 1: none).
// With bias (gpt-oss's router bias, [E] float32; NULL: none) the logits are route[i] + bias first. topk_softmax
// (gpt-oss's gating, as _forward._route_topk): the k largest logits by rank (ties to the lower id, a NaN never
// chosen; no candidate left: expert 0), w_r = e^(l_r - l_0) / (their sum in rank order) * scale.
// Grid: n blocks, one per row; block: a multiple of 32 up to 1024. The block works together: the softmax's max and
// sum (block_sum: its order fixed by the block size; the CPU sums in expert order, within rounding) and each
// rank's choice (moe_best: every thread its strided experts, then common.cuh block_argmax); thread 0 only the k
// weights. E <= MOE_MAX_EXPERTS.
//
// moe_group: the n_pairs = n * k (row, rank) pairs j = i * k + r grouped by expert, a counting sort in one
// block with pairs in batch order within an expert: start [E + 1] (expert e's pairs are the grouped
// positions start[e] .. start[e + 1] - 1), order [n_pairs] (the pair j at each grouped position), pos
// [n_pairs] (pair j's grouped position), and the tiles the grouped products run: tiles [n_tiles, 2]
// (expert, first grouped position) of at most tile_rows pairs each, every expert's positions covered in
// order, the unused tiles (-1, 0). n_tiles >= min(E, n_pairs) + n_pairs / tile_rows always suffices. Every
// size is fixed by n: the launches are the same at every step (a CUDA graph replays them) and nothing waits
// for the host. Grid: 1 block; block: any multiple of 32, each thread scanning the pairs for its experts.
//
// moe_sum_f32: out[i] (+)= scale * (sum over ranks r, in rank order, of ye[pos[i k + r]] * wts[i k + r]),
// ye [n_pairs, d] float32 the experts' outputs in grouped order; accumulate 1: out is the residual stream x
// and scale the residual multiplier; 0: out = y (a post-FFN norm follows), scale 1.
// Grid: n blocks; any block size.
#include "common.cuh"

#define MOE_MAX_EXPERTS 512
#define MOE_MIN_WEIGHT_SUM 6.103515625e-5f     // llama.cpp's build_moe_ffn: the smallest normal f16

#define MOE_ROUTER_WARPS 8

extern "C" __global__ void moe_router_f32(const float* __restrict__ x, const float* __restrict__ norm_w,
                                          const float* __restrict__ router, float* __restrict__ route, int d,
                                          int n_expert, float eps) {
    __shared__ float scratch[32];
    const int i = blockIdx.x, e = blockIdx.y * MOE_ROUTER_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const float* xr = x + (size_t)i * d;
    float s = 0.0f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) s += xr[c] * xr[c];
    const float inv = rms_inv(block_sum(s, scratch), d, eps);
    if (e >= n_expert) return;
    const float* w = router + (size_t)e * d;
    float acc = 0.0f;
    for (int c = lane; c < d; c += 32) acc += rms_apply<float>(xr[c], inv, norm_w[c]) * w[c];
    acc = warp_sum(acc);
    if (lane == 0) route[(size_t)i * n_expert + e] = acc;
}

// The block's best expert of v [n_expert] not taken (the largest value, ties to the lower id, a NaN never), every
// thread's answer; 0 when none is left. s_v, s_i: common.cuh block_argmax's shared memory.
__device__ int moe_best(const float* v, const unsigned char* taken, int n_expert, float* s_v, int* s_i) {
    float bv = -FS_INF;
    int bi = NO_TOKEN;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        if (!taken[e] && better(v[e], e, bv, bi)) {
            bv = v[e];
            bi = e;
        }
    }
    return block_argmax(bv, bi, s_v, s_i);
}

extern "C" __global__ void moe_route_f32(const float* __restrict__ route, const float* __restrict__ bias,
                                         int* __restrict__ sel, float* __restrict__ wts, int n_expert, int k,
                                         float scale, int topk_softmax) {
    __shared__ float p[MOE_MAX_EXPERTS];
    __shared__ unsigned char taken[MOE_MAX_EXPERTS];
    __shared__ float sv[32];
    __shared__ int se[32];
    const int i = blockIdx.x;
    const float* r = route + (size_t)i * n_expert;
    int* s = sel + (size_t)i * k;
    float* w = wts + (size_t)i * k;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        p[e] = bias != nullptr ? r[e] + bias[e] : r[e];
        taken[e] = 0;
    }
    __syncthreads();
    if (!topk_softmax) {                        // p = softmax(p)
        const float mx = p[moe_best(p, taken, n_expert, sv, se)];
        __syncthreads();                        // every thread has read it before p is overwritten
        float part = 0.0f;
        for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
            p[e] = expf(p[e] - mx);
            part += p[e];
        }
        const float total = block_sum(part, sv);
        for (int e = threadIdx.x; e < n_expert; e += blockDim.x) p[e] = p[e] / total;
        __syncthreads();
    }
    for (int rank = 0; rank < k; ++rank) {
        const int best = moe_best(p, taken, n_expert, sv, se);
        if (threadIdx.x == 0) {
            s[rank] = best;
            w[rank] = p[best];
            taken[best] = 1;                    // none left (best 0): every later rank finds none too
        }
        __syncthreads();
    }
    if (threadIdx.x != 0) return;
    if (topk_softmax) {                         // the softmax of the k logits
        const float mx = w[0];
        float total = 0.0f;
        for (int rank = 0; rank < k; ++rank) {
            w[rank] = expf(w[rank] - mx);
            total += w[rank];
        }
        for (int rank = 0; rank < k; ++rank) w[rank] = w[rank] / total * scale;
        return;
    }
    float sum = 0.0f;
    for (int rank = 0; rank < k; ++rank) sum += w[rank];
    if (sum < MOE_MIN_WEIGHT_SUM) sum = MOE_MIN_WEIGHT_SUM;
    for (int rank = 0; rank < k; ++rank) w[rank] = w[rank] / sum * scale;
}

extern "C" __global__ void moe_group(const int* __restrict__ sel, int n_pairs, int n_expert, int tile_rows,
                                     int n_tiles, int* __restrict__ start, int* __restrict__ order,
                                     int* __restrict__ pos, int* __restrict__ tiles) {
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        int c = 0;
        for (int j = 0; j < n_pairs; ++j) c += sel[j] == e;
        start[e + 1] = c;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int t = 0;
        start[0] = 0;
        for (int e = 0; e < n_expert; ++e) {
            const int first = start[e], end = first + start[e + 1];
            for (int t0 = first; t0 < end; t0 += tile_rows, ++t) {
                tiles[2 * t] = e;
                tiles[2 * t + 1] = t0;
            }
            start[e + 1] = end;
        }
        for (; t < n_tiles; ++t) {
            tiles[2 * t] = -1;
            tiles[2 * t + 1] = 0;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        int at = start[e];
        for (int j = 0; j < n_pairs; ++j) {
            if (sel[j] == e) {
                order[at] = j;
                pos[j] = at++;
            }
        }
    }
}

extern "C" __global__ void moe_sum_f32(const float* __restrict__ ye, const int* __restrict__ pos,
                                       const float* __restrict__ wts, float* __restrict__ out, int d, int k,
                                       int accumulate, float scale) {
    const int i = blockIdx.x;
    const int* p = pos + (size_t)i * k;
    const float* w = wts + (size_t)i * k;
    float* o = out + (size_t)i * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float s = ye[(size_t)p[0] * d + c] * w[0];
        for (int r = 1; r < k; ++r) s = s + ye[(size_t)p[r] * d + c] * w[r];
        s = s * scale;
        o[c] = accumulate ? o[c] + s : s;
    }
}
