// A mixture of experts' steps around its products (the products: cuda/matvec.cu moe_matvec*), as
// fastserve/backends/cpu/_forward.pyx's _route, _moe and _moe_sum compute them, each row on its own (a row's
// experts, weights and output do not depend on the other rows of the batch).
//
// moe_route_f32: route [n, E] float32, a row's router logits -> its k experts sel [n, k] int32 by rank and
// their weights wts [n, k] float32, llama.cpp's softmax gating with normalised weights:
//     p = softmax(route[i]) (the sum in expert order), the k largest p (ties to the lower id), by rank;
//     w_r = p_r / max(sum of the k p_r in rank order, 2^-14) * scale (expert_weights_scale; 1: none).
// With bias (gpt-oss's router bias, [E] float32; NULL: none) the logits are route[i] + bias first. topk_softmax
// (gpt-oss's gating, as _forward._route_topk): the k largest logits by rank (ties to the lower id, a NaN never
// chosen; no candidate left: expert 0), w_r = e^(l_r - l_0) / (their sum in rank order) * scale.
// Grid: n blocks, one per row; block: any multiple of 32 (the exponentials shared, the rest on thread 0:
// E * k comparisons). E <= MOE_MAX_EXPERTS.
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

// Thread 0's TOPK_SOFTMAX route of one row's logits l (see above).
__device__ void moe_route_topk(const float* l, int* s, float* w, int n_expert, int k, float scale) {
    for (int rank = 0; rank < k; ++rank) {
        int best = -1;
        for (int e = 0; e < n_expert; ++e) {
            bool taken = false;
            for (int j = 0; j < rank; ++j) taken = taken || s[j] == e;
            if (l[e] == l[e] && (best < 0 || l[e] > l[best]) && !taken) best = e;
        }
        best = best >= 0 ? best : 0;
        s[rank] = best;
        w[rank] = l[best];
    }
    const float mx = w[0];
    float total = 0.0f;
    for (int rank = 0; rank < k; ++rank) {
        w[rank] = expf(w[rank] - mx);
        total += w[rank];
    }
    for (int rank = 0; rank < k; ++rank) w[rank] = w[rank] / total * scale;
}

extern "C" __global__ void moe_route_f32(const float* __restrict__ route, const float* __restrict__ bias,
                                         int* __restrict__ sel, float* __restrict__ wts, int n_expert, int k,
                                         float scale, int topk_softmax) {
    __shared__ float p[MOE_MAX_EXPERTS];
    __shared__ float top;
    const int i = blockIdx.x;
    const float* r = route + (size_t)i * n_expert;
    int* s = sel + (size_t)i * k;
    float* w = wts + (size_t)i * k;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) p[e] = bias != nullptr ? r[e] + bias[e] : r[e];
    __syncthreads();
    if (topk_softmax) {
        if (threadIdx.x == 0) moe_route_topk(p, s, w, n_expert, k, scale);
        return;
    }
    if (threadIdx.x == 0) {
        float mx = p[0];
        for (int e = 1; e < n_expert; ++e)
            if (p[e] > mx) mx = p[e];
        top = mx;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) p[e] = expf(p[e] - top);
    __syncthreads();
    if (threadIdx.x != 0) return;
    float total = 0.0f;
    for (int e = 0; e < n_expert; ++e) total += p[e];
    for (int e = 0; e < n_expert; ++e) p[e] = p[e] / total;
    float sum = 0.0f;
    for (int rank = 0; rank < k; ++rank) {
        int best = 0;
        for (int e = 1; e < n_expert; ++e)
            if (p[e] > p[best]) best = e;
        s[rank] = best;
        w[rank] = p[best];
        p[best] = -1.0f;                    // taken (probabilities are >= 0)
        sum += w[rank];
    }
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
