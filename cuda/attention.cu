// Causal attention of a batch's query tokens over each one's slot in the KV cache, for decode and
// prefill alike: token t (slot s, position p) attends keys 0..p of slot s (a sliding-window layer,
// window > 0: keys p - window < k <= p, as the CPU's attention and llama.cpp's), with grouped-query heads
// (G = n_head / n_head_kv query heads share one KV head). Prefill tokens of one prompt chunk are
// separate queries like any other: their K/V rows were written by kv_store before this runs.
//
// Split along the sequence (flash-decoding): one block per (split, KV head, token) keeps an online
// softmax over its share of the keys for the G heads of its group and writes an unnormalised partial
// result; attention_combine merges the splits. The grid is fixed by the slot length (S = n_split =
// ceil(n_ctx_slot / chunk)), not by the positions, so a decode step can be captured once in a CUDA
// graph and replayed at any position (the window is an argument, fixed per layer, so one graph serves
// every position too). A token's n keys (p + 1, or at most `window`) are cut into S runs of `span` keys,
// span = ceil(n / S) rounded up to whole block steps (ATTN_WARPS * 32 / LPK * ATTN_KEYS_PER_GROUP
// keys): at any position the keys spread over as many blocks as they fill, so a short decode still
// runs on many SMs. Splits past the last key exit at once, writing an empty partial (m = -inf,
// l = 0, part_o untouched: the combine never reads it).
//
// Inside a block, a group of LPK lanes reads one key: lane c of the group holds dimensions
// 8c..8c+7 (one 16-byte load per K or V row for f16/bf16, two for f32), so a warp reads 32 / LPK keys
// at once, ATTN_KEYS_PER_GROUP per group per step, and a dot product is a log2(LPK)-step shuffle sum
// in the group, the G heads' sums interleaved. G is a template parameter: no per-head branch.
// Scores are kept in log2 units (q is pre-scaled by scale * log2(e); exp2f), so part_ml's m is too.
//
// Every (token, head) is computed on its own, in an order that depends only on its position and on
// the launch shape: a token's result does not depend on the other tokens in the batch.
//
// Shapes (n tokens, H = n_head, Hkv = n_head_kv, D = head_dim, a multiple of 8, <= 256, S = n_split):
//   qkv      float32 [n, qkv_stride]: Q heads first (after RoPE); only Q is read here
//   k_cache  [n_slots, n_ctx_slot, Hkv, D] storage type T, 16-byte aligned; v_cache the same
//   slots, positions  int32 [n]
//   part_o   float32 [n, H, S, D]   unnormalised sum of p * v over the split
//   part_ml  float32 [n, H, S, 2]   (max score in log2 units, sum of 2^(score - max)) over the split
//   out      [n, H * D] type TOut (what the output projection reads)
//   sinks    float32 [H] or NULL: each query head's attention sink (gpt-oss), a logit in natural-log units
// attention_split_<T>_d<8 LPK>_g<G>: grid (S, Hkv, n), block ATTN_WARPS * 32 threads; LPK lanes per
// key: 4 for D <= 32, 8 for D <= 64, 16 for D <= 128, 32 (a whole warp) for D <= 256.
// attention_combine_*: grid (H, n), block ATTN_COMBINE_THREADS. With sinks, head h's sink joins the
// softmax's denominator only, as the CPU's (_attention_kernels.h): sg = sinks[h] * log2(e) is one more
// score of no value, M = max(max over splits of m, sg), out = sum_s 2^(m_s - M) o_s / (sum_s 2^(m_s - M) l_s
// + 2^(sg - M)), the sink's term added last; NULL: no term (the sum's bits are those without sinks).
#include "common.cuh"

#define ATTN_WARPS 4
#define ATTN_KEYS_PER_GROUP 2   // keys each lane group reads per step; the next step's are loaded before
                                // this step's math: 4 K and 4 V rows in flight per lane
#define ATTN_LOG2E 1.4426950408889634f
#define ATTN_COMBINE_THREADS 256   // attention_combine's block

// 8 consecutive values of T, as loaded: one uint4 for 2-byte types, two for float.
template <typename T> struct Row8 { uint4 w[sizeof(T) / 2]; };

template <typename T>
__device__ __forceinline__ Row8<T> load_row8(const T* p) {
    Row8<T> r;
#pragma unroll
    for (int i = 0; i < (int)(sizeof(T) / 2); ++i) r.w[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
    return r;
}

template <typename T>
__device__ __forceinline__ Row8<T> zero_row8() {
    Row8<T> r;
#pragma unroll
    for (int i = 0; i < (int)(sizeof(T) / 2); ++i) r.w[i] = make_uint4(0u, 0u, 0u, 0u);
    return r;
}

__device__ __forceinline__ unsigned int word_of(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ void to_floats(const Row8<f16>& r, float* x) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned int u = word_of(r.w[0], i);
        f16 lo, hi;
        lo.bits = (unsigned short)(u & 0xffffu);
        hi.bits = (unsigned short)(u >> 16);
        x[2 * i] = to_float(lo);
        x[2 * i + 1] = to_float(hi);
    }
}

__device__ __forceinline__ void to_floats(const Row8<bf16>& r, float* x) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned int u = word_of(r.w[0], i);
        x[2 * i] = __uint_as_float(u << 16);
        x[2 * i + 1] = __uint_as_float(u & 0xffff0000u);
    }
}

__device__ __forceinline__ void to_floats(const Row8<float>& r, float* x) {
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = __uint_as_float(word_of(r.w[i / 4], i % 4));
}

// Rows k..k+U-1 of K and V (this lane's 8 dimensions); zeros past k1 or on an idle lane.
template <typename T, int U>
__device__ __forceinline__ void load_keys(Row8<T> (&kr)[U], Row8<T> (&vr)[U], const T* kb, const T* vb,
                                          size_t kv_row, int k, int k1, bool live) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const bool ok = live && k + u < k1;
        kr[u] = ok ? load_row8(kb + (size_t)(k + u) * kv_row) : zero_row8<T>();
        vr[u] = ok ? load_row8(vb + (size_t)(k + u) * kv_row) : zero_row8<T>();
    }
}

// The max to subtract: m itself, or 0 while m = -inf, so that 2^(-inf - safe) = 0, never NaN.
__device__ __forceinline__ float safe_max(float m) { return m == -FS_INF ? 0.0f : m; }

template <typename T, int LPK, int G>
__device__ __forceinline__ void attention_split(const float* __restrict__ qkv, const T* __restrict__ k_cache,
                                                const T* __restrict__ v_cache, const int* __restrict__ slots,
                                                const int* __restrict__ positions, float* __restrict__ part_o,
                                                float* __restrict__ part_ml, int qkv_stride, int n_head,
                                                int n_head_kv, int head_dim, int n_ctx_slot, float scale,
                                                int window) {
    constexpr int GROUPS = 32 / LPK;                  // keys a warp reads at once
    constexpr int U = ATTN_KEYS_PER_GROUP;
    constexpr int STEP = ATTN_WARPS * GROUPS * U;     // keys a block reads per step
    constexpr int P = ATTN_WARPS * GROUPS;            // key groups in the block
    __shared__ float s_acc[P][G][8 * LPK] __attribute__((aligned(16)));   // 4 KiB * G: rows of float4
    __shared__ float s_m[P][G], s_l[P][G], s_f[P][G];

    const int split = blockIdx.x, kvh = blockIdx.y, t = blockIdx.z;
    const int n_split = gridDim.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int grp = lane / LPK, c = lane % LPK;       // this lane: key group grp, dimensions 8c..8c+7
    const int end = positions[t] + 1;                  // keys first .. end - 1
    const int first = window > 0 ? max(0, end - window) : 0;
    const int n_keys = end - first;
    const int span = ((n_keys + n_split - 1) / n_split + STEP - 1) / STEP * STEP;
    const int k0 = first + split * span;
    const int k1 = min(k0 + span, end);
    const size_t part = ((size_t)t * n_head + (size_t)kvh * G) * n_split + split;   // head g: part + g * S
    if (k0 >= end) {
        if (threadIdx.x < G) {
            part_ml[(part + (size_t)threadIdx.x * n_split) * 2] = -FS_INF;
            part_ml[(part + (size_t)threadIdx.x * n_split) * 2 + 1] = 0.0f;
        }
        return;
    }

    const bool live = 8 * c < head_dim;               // lanes past the head's dimensions hold zeros
    const size_t kv_row = (size_t)n_head_kv * head_dim;
    const size_t base = (size_t)slots[t] * n_ctx_slot * kv_row + (size_t)kvh * head_dim + 8 * c;
    const T* kb = k_cache + base;
    const T* vb = v_cache + base;

    float q[G][8], acc[G][8], m[G], l[G];
    const float* qrow = qkv + (size_t)t * qkv_stride + (size_t)kvh * G * head_dim + 8 * c;
    const float qscale = scale * ATTN_LOG2E;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f), b = a;
        if (live) {
            a = *reinterpret_cast<const float4*>(qrow + g * head_dim);
            b = *reinterpret_cast<const float4*>(qrow + g * head_dim + 4);
        }
        q[g][0] = a.x * qscale; q[g][1] = a.y * qscale; q[g][2] = a.z * qscale; q[g][3] = a.w * qscale;
        q[g][4] = b.x * qscale; q[g][5] = b.y * qscale; q[g][6] = b.z * qscale; q[g][7] = b.w * qscale;
        m[g] = -FS_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = 0.0f;
    }

    // The loop's trip count is the same for the whole warp (the shuffles need every lane); keys past
    // k1 are masked to score -inf. The next step's rows are loaded before this step's math.
    Row8<T> kn[U], vn[U];
    load_keys(kn, vn, kb, vb, kv_row, k0 + warp * GROUPS * U + grp * U, k1, live);
    for (int kw = k0 + warp * GROUPS * U; kw < k1; kw += STEP) {
        const int kg = kw + grp * U;                  // this group's first key
        Row8<T> kr[U], vr[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            kr[u] = kn[u];
            vr[u] = vn[u];
        }
        load_keys(kn, vn, kb, vb, kv_row, kg + STEP, k1, live);
        float s[U][G];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float kf[8];
            to_floats(kr[u], kf);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float d = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; ++i) d += q[g][i] * kf[i];
                s[u][g] = d;
            }
        }
#pragma unroll
        for (int o = LPK / 2; o > 0; o >>= 1) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
#pragma unroll
                for (int g = 0; g < G; ++g) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], o);
            }
        }
        float vf[U][8];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            to_floats(vr[u], vf[u]);
            if (kg + u >= k1) {
#pragma unroll
                for (int g = 0; g < G; ++g) s[u][g] = -FS_INF;
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float mx = s[0][g];
#pragma unroll
            for (int u = 1; u < U; ++u) mx = fmaxf(mx, s[u][g]);
            const float m_new = fmaxf(m[g], mx);
            const float ms = safe_max(m_new);
            const float corr = exp2f(m[g] - ms);
            float p[U];
            float psum = 0.0f;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                p[u] = exp2f(s[u][g] - ms);
                psum += p[u];
            }
            l[g] = l[g] * corr + psum;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float a = acc[g][i] * corr;
#pragma unroll
                for (int u = 0; u < U; ++u) a += p[u] * vf[u][i];
                acc[g][i] = a;
            }
            m[g] = m_new;
        }
    }

    // Merge the block's P = ATTN_WARPS * GROUPS key groups through shared memory: each group's state
    // goes there, one thread per (group, head) finds its weight 2^(m - max over groups), then thread j
    // sums (head, dimension) pairs over the groups, all in a fixed order.
    const int p = warp * GROUPS + grp;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        float4* dst = reinterpret_cast<float4*>(&s_acc[p][g][8 * c]);
        dst[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
        dst[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
    }
    if (c == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            s_m[p][g] = m[g];
            s_l[p][g] = l[g];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < P * G; i += blockDim.x) {
        const int pi = i / G, g = i - pi * G;
        float mx = -FS_INF;
        for (int r = 0; r < P; ++r) mx = fmaxf(mx, s_m[r][g]);
        s_f[pi][g] = exp2f(s_m[pi][g] - safe_max(mx));      // 0 for a group that saw no key
    }
    __syncthreads();
    for (int j = threadIdx.x; j < G * head_dim; j += blockDim.x) {
        const int g = j / head_dim, d = j - g * head_dim;
        float o = 0.0f;
#pragma unroll 8
        for (int r = 0; r < P; ++r) o += s_f[r][g] * s_acc[r][g][d];
        const size_t pg = part + (size_t)g * n_split;
        part_o[pg * head_dim + d] = o;
        if (d == 0) {
            float mx = -FS_INF, lsum = 0.0f;
            for (int r = 0; r < P; ++r) {
                mx = fmaxf(mx, s_m[r][g]);
                lsum += s_f[r][g] * s_l[r][g];
            }
            part_ml[pg * 2] = mx;
            part_ml[pg * 2 + 1] = lsum;
        }
    }
}

// One block per (head, token). Splits' weights 2^(m_s - max) go to shared memory a tile of blockDim.x
// splits at a time; then thread (r, d) (r = threadIdx.x / D', D' = D rounded up to 32) sums
// dimension d over splits r, r + R, ... of the tile (R = blockDim.x / D' of them at once, so that
// their part_o loads are in flight together), and row 0 adds the R sums, all in fixed orders.
template <typename TOut>
__device__ __forceinline__ void attention_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                                  const float* __restrict__ sinks, TOut* __restrict__ out,
                                                  int n_head, int head_dim, int n_split) {
    __shared__ float s_w[ATTN_COMBINE_THREADS];      // weight of each split of the tile (0: empty split)
    __shared__ float s_l[ATTN_COMBINE_THREADS];      // its l
    __shared__ float s_o[ATTN_COMBINE_THREADS];      // the rows' sums, [R][D']
    __shared__ float s_red[32];
    const int h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x;
    const int dp = (head_dim + 31) / 32 * 32, rows = blockDim.x / dp;
    const int r = tid / dp, d = tid - r * dp;
    const bool mine = r < rows && d < head_dim;
    const size_t part0 = ((size_t)t * n_head + h) * n_split;

    float mx = -FS_INF;
    for (int s = tid; s < n_split; s += blockDim.x) mx = fmaxf(mx, part_ml[(part0 + s) * 2]);
    mx = warp_max(mx);
    if ((tid & 31) == 0) s_red[tid >> 5] = mx;
    __syncthreads();
    mx = -FS_INF;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) mx = fmaxf(mx, s_red[w]);
    const float sg = sinks != nullptr ? sinks[h] * ATTN_LOG2E : -FS_INF;   // the sink's score, log2 units
    if (sinks != nullptr) mx = fmaxf(mx, sg);

    float o = 0.0f, lsum = 0.0f;
    for (int s0 = 0; s0 < n_split; s0 += blockDim.x) {
        const int n_tile = min((int)blockDim.x, n_split - s0);
        if (tid < n_tile) {
            const float m = part_ml[(part0 + s0 + tid) * 2];
            s_w[tid] = m == -FS_INF ? 0.0f : exp2f(m - mx);   // an empty split: part_o unwritten
            s_l[tid] = part_ml[(part0 + s0 + tid) * 2 + 1];
        }
        __syncthreads();
        if (mine) {
#pragma unroll 8
            for (int s = r; s < n_tile; s += rows) {
                const float w = s_w[s];
                if (w != 0.0f) o += w * part_o[(part0 + s0 + s) * head_dim + d];
            }
        }
        if (r == 0) {
            for (int s = 0; s < n_tile; ++s) lsum += s_w[s] * s_l[s];
        }
        __syncthreads();
    }
    if (r < rows) s_o[tid] = o;
    __syncthreads();
    if (r == 0 && d < head_dim) {
        float sum = 0.0f;
        for (int i = 0; i < rows; ++i) sum += s_o[i * dp + d];
        if (sinks != nullptr) lsum += exp2f(sg - mx);      // the sink: in the denominator only, last
        out[((size_t)t * n_head + h) * head_dim + d] = from_float<TOut>(sum / lsum);
    }
}

#define ATTENTION_SPLIT(NAME, T, LPK, G)                                                                     \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)                                             \
    NAME(const float* qkv, const T* k_cache, const T* v_cache, const int* slots, const int* positions,        \
         float* part_o, float* part_ml, int qkv_stride, int n_head, int n_head_kv, int head_dim,              \
         int n_ctx_slot, int chunk, float scale, int window) {                                                \
        (void)chunk;        /* S = gridDim.x = ceil(n_ctx_slot / chunk) is all the kernel needs */            \
        attention_split<T, LPK, G>(qkv, k_cache, v_cache, slots, positions, part_o, part_ml, qkv_stride,      \
                                   n_head, n_head_kv, head_dim, n_ctx_slot, scale, window);                   \
    }

// attention_split_<T>_d<D>_g<G>: every G = 1..8 (the query heads per KV head of llama-family models)
// for head_dim <= D = 32, 64, 128, 256 (LPK = D / 8 lanes per key; gemma3's heads are 256).
ATTENTION_SPLIT(attention_split_f16_d32_g1, f16, 4, 1)
ATTENTION_SPLIT(attention_split_f16_d32_g2, f16, 4, 2)
ATTENTION_SPLIT(attention_split_f16_d32_g3, f16, 4, 3)
ATTENTION_SPLIT(attention_split_f16_d32_g4, f16, 4, 4)
ATTENTION_SPLIT(attention_split_f16_d32_g5, f16, 4, 5)
ATTENTION_SPLIT(attention_split_f16_d32_g6, f16, 4, 6)
ATTENTION_SPLIT(attention_split_f16_d32_g7, f16, 4, 7)
ATTENTION_SPLIT(attention_split_f16_d32_g8, f16, 4, 8)
ATTENTION_SPLIT(attention_split_f16_d64_g1, f16, 8, 1)
ATTENTION_SPLIT(attention_split_f16_d64_g2, f16, 8, 2)
ATTENTION_SPLIT(attention_split_f16_d64_g3, f16, 8, 3)
ATTENTION_SPLIT(attention_split_f16_d64_g4, f16, 8, 4)
ATTENTION_SPLIT(attention_split_f16_d64_g5, f16, 8, 5)
ATTENTION_SPLIT(attention_split_f16_d64_g6, f16, 8, 6)
ATTENTION_SPLIT(attention_split_f16_d64_g7, f16, 8, 7)
ATTENTION_SPLIT(attention_split_f16_d64_g8, f16, 8, 8)
ATTENTION_SPLIT(attention_split_f16_d128_g1, f16, 16, 1)
ATTENTION_SPLIT(attention_split_f16_d128_g2, f16, 16, 2)
ATTENTION_SPLIT(attention_split_f16_d128_g3, f16, 16, 3)
ATTENTION_SPLIT(attention_split_f16_d128_g4, f16, 16, 4)
ATTENTION_SPLIT(attention_split_f16_d128_g5, f16, 16, 5)
ATTENTION_SPLIT(attention_split_f16_d128_g6, f16, 16, 6)
ATTENTION_SPLIT(attention_split_f16_d128_g7, f16, 16, 7)
ATTENTION_SPLIT(attention_split_f16_d128_g8, f16, 16, 8)
ATTENTION_SPLIT(attention_split_f16_d256_g1, f16, 32, 1)
ATTENTION_SPLIT(attention_split_f16_d256_g2, f16, 32, 2)
ATTENTION_SPLIT(attention_split_f16_d256_g3, f16, 32, 3)
ATTENTION_SPLIT(attention_split_f16_d256_g4, f16, 32, 4)
ATTENTION_SPLIT(attention_split_f16_d256_g5, f16, 32, 5)
ATTENTION_SPLIT(attention_split_f16_d256_g6, f16, 32, 6)
ATTENTION_SPLIT(attention_split_f16_d256_g7, f16, 32, 7)
ATTENTION_SPLIT(attention_split_f16_d256_g8, f16, 32, 8)
ATTENTION_SPLIT(attention_split_bf16_d32_g1, bf16, 4, 1)
ATTENTION_SPLIT(attention_split_bf16_d32_g2, bf16, 4, 2)
ATTENTION_SPLIT(attention_split_bf16_d32_g3, bf16, 4, 3)
ATTENTION_SPLIT(attention_split_bf16_d32_g4, bf16, 4, 4)
ATTENTION_SPLIT(attention_split_bf16_d32_g5, bf16, 4, 5)
ATTENTION_SPLIT(attention_split_bf16_d32_g6, bf16, 4, 6)
ATTENTION_SPLIT(attention_split_bf16_d32_g7, bf16, 4, 7)
ATTENTION_SPLIT(attention_split_bf16_d32_g8, bf16, 4, 8)
ATTENTION_SPLIT(attention_split_bf16_d64_g1, bf16, 8, 1)
ATTENTION_SPLIT(attention_split_bf16_d64_g2, bf16, 8, 2)
ATTENTION_SPLIT(attention_split_bf16_d64_g3, bf16, 8, 3)
ATTENTION_SPLIT(attention_split_bf16_d64_g4, bf16, 8, 4)
ATTENTION_SPLIT(attention_split_bf16_d64_g5, bf16, 8, 5)
ATTENTION_SPLIT(attention_split_bf16_d64_g6, bf16, 8, 6)
ATTENTION_SPLIT(attention_split_bf16_d64_g7, bf16, 8, 7)
ATTENTION_SPLIT(attention_split_bf16_d64_g8, bf16, 8, 8)
ATTENTION_SPLIT(attention_split_bf16_d128_g1, bf16, 16, 1)
ATTENTION_SPLIT(attention_split_bf16_d128_g2, bf16, 16, 2)
ATTENTION_SPLIT(attention_split_bf16_d128_g3, bf16, 16, 3)
ATTENTION_SPLIT(attention_split_bf16_d128_g4, bf16, 16, 4)
ATTENTION_SPLIT(attention_split_bf16_d128_g5, bf16, 16, 5)
ATTENTION_SPLIT(attention_split_bf16_d128_g6, bf16, 16, 6)
ATTENTION_SPLIT(attention_split_bf16_d128_g7, bf16, 16, 7)
ATTENTION_SPLIT(attention_split_bf16_d128_g8, bf16, 16, 8)
ATTENTION_SPLIT(attention_split_bf16_d256_g1, bf16, 32, 1)
ATTENTION_SPLIT(attention_split_bf16_d256_g2, bf16, 32, 2)
ATTENTION_SPLIT(attention_split_bf16_d256_g3, bf16, 32, 3)
ATTENTION_SPLIT(attention_split_bf16_d256_g4, bf16, 32, 4)
ATTENTION_SPLIT(attention_split_bf16_d256_g5, bf16, 32, 5)
ATTENTION_SPLIT(attention_split_bf16_d256_g6, bf16, 32, 6)
ATTENTION_SPLIT(attention_split_bf16_d256_g7, bf16, 32, 7)
ATTENTION_SPLIT(attention_split_bf16_d256_g8, bf16, 32, 8)
ATTENTION_SPLIT(attention_split_f32_d32_g1, float, 4, 1)
ATTENTION_SPLIT(attention_split_f32_d32_g2, float, 4, 2)
ATTENTION_SPLIT(attention_split_f32_d32_g3, float, 4, 3)
ATTENTION_SPLIT(attention_split_f32_d32_g4, float, 4, 4)
ATTENTION_SPLIT(attention_split_f32_d32_g5, float, 4, 5)
ATTENTION_SPLIT(attention_split_f32_d32_g6, float, 4, 6)
ATTENTION_SPLIT(attention_split_f32_d32_g7, float, 4, 7)
ATTENTION_SPLIT(attention_split_f32_d32_g8, float, 4, 8)
ATTENTION_SPLIT(attention_split_f32_d64_g1, float, 8, 1)
ATTENTION_SPLIT(attention_split_f32_d64_g2, float, 8, 2)
ATTENTION_SPLIT(attention_split_f32_d64_g3, float, 8, 3)
ATTENTION_SPLIT(attention_split_f32_d64_g4, float, 8, 4)
ATTENTION_SPLIT(attention_split_f32_d64_g5, float, 8, 5)
ATTENTION_SPLIT(attention_split_f32_d64_g6, float, 8, 6)
ATTENTION_SPLIT(attention_split_f32_d64_g7, float, 8, 7)
ATTENTION_SPLIT(attention_split_f32_d64_g8, float, 8, 8)
ATTENTION_SPLIT(attention_split_f32_d128_g1, float, 16, 1)
ATTENTION_SPLIT(attention_split_f32_d128_g2, float, 16, 2)
ATTENTION_SPLIT(attention_split_f32_d128_g3, float, 16, 3)
ATTENTION_SPLIT(attention_split_f32_d128_g4, float, 16, 4)
ATTENTION_SPLIT(attention_split_f32_d128_g5, float, 16, 5)
ATTENTION_SPLIT(attention_split_f32_d128_g6, float, 16, 6)
ATTENTION_SPLIT(attention_split_f32_d128_g7, float, 16, 7)
ATTENTION_SPLIT(attention_split_f32_d128_g8, float, 16, 8)
ATTENTION_SPLIT(attention_split_f32_d256_g1, float, 32, 1)
ATTENTION_SPLIT(attention_split_f32_d256_g2, float, 32, 2)
ATTENTION_SPLIT(attention_split_f32_d256_g3, float, 32, 3)
ATTENTION_SPLIT(attention_split_f32_d256_g4, float, 32, 4)
ATTENTION_SPLIT(attention_split_f32_d256_g5, float, 32, 5)
ATTENTION_SPLIT(attention_split_f32_d256_g6, float, 32, 6)
ATTENTION_SPLIT(attention_split_f32_d256_g7, float, 32, 7)
ATTENTION_SPLIT(attention_split_f32_d256_g8, float, 32, 8)

extern "C" __global__ void attention_combine_f16(const float* part_o, const float* part_ml, const float* sinks,
                                                 f16* out, int n_head, int head_dim, int n_split) {
    attention_combine(part_o, part_ml, sinks, out, n_head, head_dim, n_split);
}

extern "C" __global__ void attention_combine_bf16(const float* part_o, const float* part_ml, const float* sinks,
                                                  bf16* out, int n_head, int head_dim, int n_split) {
    attention_combine(part_o, part_ml, sinks, out, n_head, head_dim, n_split);
}

extern "C" __global__ void attention_combine_f32(const float* part_o, const float* part_ml, const float* sinks,
                                                 float* out, int n_head, int head_dim, int n_split) {
    attention_combine(part_o, part_ml, sinks, out, n_head, head_dim, n_split);
}
