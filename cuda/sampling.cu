// Token selection on the device, so that only the chosen ids (and the top-N probabilities a request
// asks for) cross to the host: never the logits.
//
// argmax_rows_f32: greedy; ties go to the lowest token id; NaN and -inf are never chosen (a row
//   without a candidate gives 0).
//   logits float32 [m, n_vocab]; out int32 [m]. Grid: m blocks; block: a multiple of 32 threads, <= 1024.
//
// sample_chain_f32: the host sampler's whole chain, one block per row, with the same token ids and
//   probabilities bit for bit (fastserve/ref/sampling.py states the rules; the ones that matter here):
//   logit bias -> penalties -> top-k -> top-p -> min-p -> temperature -> draw, on float32 logits;
//   rank order: higher logit first, equal logits lower id first; candidates are logits > -inf
//   (NaN never); fixed-point weights q = trunc(exp((x - max) / temp) * 2^QBITS) in double, summed as
//   integers (so no sum depends on the order of the threads); top-p keeps the shortest rank prefix
//   whose temperature-1 mass reaches min(total, ceil(top_p * total)); min-p keeps x >= max +
//   log(min_p); the draw r = (splitmix64(state) * total) >> 64 walks the kept ids in ascending order.
//   No sort of the vocabulary: each "k-th in rank order" and the top-p cut are radix selections
//   (four 8-bit digits of an order-preserving key, histograms of counts or of integer masses), and
//   only ties at the boundary are resolved by id. With 0 < top_k <= SAMPLE_THREADS (the usual case)
//   the top-k set is gathered into shared memory once and the rest of the chain runs there. Bias and
//   penalties are written into the row (the logits are scratch after this kernel).
//
//   logits  float32 [m, n_vocab] (modified: bias and penalties)
//   rows    SampleRow [m] (below; the host packs them: fastserve/backends/cuda/sampling.py)
//   slot_tab int32 [n_slots, window_cap + 2 bias_cap] per slot: the penalty window ring (token ids,
//           hist_len of them valid, in any order), then bias token ids, then bias values (float32
//           bits). The kernel writes each row's token into its slot's ring at hist_pos.
//   out_ids int32 [m]: the token; -1 for a sampled (not greedy) row without any candidate (the host
//           reports 0 and does not advance that row's random state).
//   out_probs int32 [*, 2, probs_cap]: row probs_row of a row that asks for n_probs: ids in [0, n),
//           float32 probabilities (bits) in [probs_cap, probs_cap + n); id -1 and 0.0 past the
//           candidates. Pre-sampling lists are over the raw logits (whole vocabulary, temperature 1),
//           post-sampling ones over the kept set after temperature ((tok, 1.0) for greedy).
//   Grid: m blocks, one per row; block: SAMPLE_THREADS threads. probs_cap <= SAMPLE_MAX_PROBS.
#include "common.cuh"

#define SAMPLE_THREADS 512
#define SAMPLE_MAX_PROBS 128
#define SAMPLE_GREEDY 1           // SampleRow.flags
#define SAMPLE_POST_PROBS 2
#define SAMPLE_PENALIZE 4
#define WEIGHT_FLOOR (-45.5)      // exp(d) * 2^63 < 1 below it: the weight is 0 whatever QBITS

// The row's greedy token: the lowest id of the largest candidate; 0 without a candidate.
__device__ __forceinline__ int row_argmax(const float* row, int n_vocab, float* s_v, int* s_i) {
    float bv = -FS_INF;
    int bi = NO_TOKEN;
    for (int i = threadIdx.x; i < n_vocab; i += blockDim.x) {
        const float v = row[i];
        if (better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    const int best = block_argmax(bv, bi, s_v, s_i);
    return row[best] > -FS_INF ? best : 0;    // a row of -inf and NaN: -inf "won" the ties
}

extern "C" __global__ void argmax_rows_f32(const float* __restrict__ logits, int* __restrict__ out, int n_vocab) {
    __shared__ float s_v[32];
    __shared__ int s_i[32];
    const int best = row_argmax(logits + (size_t)blockIdx.x * n_vocab, n_vocab, s_v, s_i);
    if (threadIdx.x == 0) out[blockIdx.x] = best;
}

// -- sample_chain_f32 ------------------------------------------------------------------------------

struct SampleRow {                // 88 bytes; fastserve/backends/cuda/kernels.py SAMPLE_ROW has the same layout
    double temperature;           // <= 0: greedy (and flags has SAMPLE_GREEDY)
    double top_p;                 // 1.0: off
    double min_p;                 // 0.0: off
    double log_min_p;             // log(min_p) from the host's libm (the host sampler's threshold)
    unsigned long long rng;       // splitmix64 state before this row's draw
    int top_k;                    // 0: off
    int n_probs;                  // 0: no list
    int probs_row;                // row of out_probs; -1: none
    int flags;                    // SAMPLE_GREEDY | SAMPLE_POST_PROBS | SAMPLE_PENALIZE
    int slot;                     // row of slot_tab
    int n_bias;                   // bias entries of the slot
    int hist_len;                 // valid entries of the slot's window ring
    int hist_pos;                 // where this row's token goes in the ring; -1: nowhere
    float repeat_penalty;
    float presence_penalty;
    float frequency_penalty;
    int mask_row;                 // row of masks (bit t % 32 of word t / 32: token t allowed); -1: unconstrained
};

struct SampleShared {
    unsigned long long hist[256];             // radix histogram: counts or integer masses
    unsigned long long part[32];              // sums of 8 buckets / of a warp's worth of chunks
    unsigned long long chunk[SAMPLE_THREADS]; // draw mass of each thread's run of ids
    float tmax[SAMPLE_THREADS];               // each thread's largest candidate (select_rank's bound)
    float kv[SAMPLE_THREADS];                 // draw_top_k: the top-k set as found,
    int kid[SAMPLE_THREADS];
    float sv[SAMPLE_THREADS];                 // ... in rank order,
    int sid[SAMPLE_THREADS];
    unsigned long long q[SAMPLE_THREADS];     // ... their temperature-1 weights (top-p),
    unsigned long long wq[SAMPLE_THREADS];    // ... and the kept ones' draw weights in id order
    int wid[SAMPLE_THREADS];
    unsigned long long red_u[32];
    float red_f[32];
    int red_i[32];
    float top_v[SAMPLE_MAX_PROBS];            // the n_probs list before ordering
    int top_id[SAMPLE_MAX_PROBS];
    unsigned long long above, total;
    unsigned int digit;
    int n_top, at, found;
};

struct Rank { float v; int id; };            // a place in rank order: the candidate (v, id)

__device__ __forceinline__ bool is_cand(float x) { return x > -FS_INF; }   // NaN: false

// (x, j) ranks at or before b: a larger logit, or the same logit and an id not above b's.
__device__ __forceinline__ bool at_or_before(float x, int j, Rank b) { return x > b.v || (x == b.v && j <= b.id); }

// 32-bit key in the order of the float (with -0 as +0: they are equal logits, ordered by id).
__device__ __forceinline__ unsigned int rank_key(float x) {
    const unsigned int u = __float_as_uint(x == 0.0f ? 0.0f : x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(unsigned int k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// trunc(exp((x - m) / temp) * scale) for a candidate x of a row whose max is m (the host's _weight).
__device__ __forceinline__ unsigned long long fx_weight(float x, float m, double temp, double scale) {
    if (x == m) return (unsigned long long)scale;
    const double d = ((double)x - (double)m) / temp;
    if (d < WEIGHT_FLOOR) return 0ull;
    return (unsigned long long)(long long)(exp(d) * scale);
}

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long state) {
    unsigned long long z = state + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// (a * b) >> 64, as the host's fs_mulhi64.
__device__ __forceinline__ unsigned long long mulhi64(unsigned long long a, unsigned long long b) {
    const unsigned long long a_lo = a & 0xFFFFFFFFull, a_hi = a >> 32, b_lo = b & 0xFFFFFFFFull, b_hi = b >> 32;
    const unsigned long long ll = a_lo * b_lo, hl = a_hi * b_lo, lh = a_lo * b_hi, hh = a_hi * b_hi;
    const unsigned long long mid = (ll >> 32) + (hl & 0xFFFFFFFFull) + lh;
    return hh + (hl >> 32) + (mid >> 32);
}

// llama.cpp's penalties on one logit, each step rounded to float32 as the host sampler does. The
// products go through double (exact for these operands, then one rounding) so that the compiler
// cannot fuse a product with the subtraction into a multiply-add.
__device__ __forceinline__ float penalize(float x, int count, float repeat, float freq, float present) {
    x = x <= 0.0f ? (float)((double)x * (double)repeat) : x / repeat;
    const float pen = (float)((double)count * (double)freq);
    return x - (pen + present);
}

__device__ __forceinline__ float shfl_xor(float v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ int shfl_xor(int v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ unsigned long long shfl_xor(unsigned long long v, int o) {
    const unsigned int lo = __shfl_xor_sync(0xffffffffu, (unsigned int)v, o);
    const unsigned int hi = __shfl_xor_sync(0xffffffffu, (unsigned int)(v >> 32), o);
    return ((unsigned long long)hi << 32) | lo;
}

struct MaxOp { __device__ float operator()(float a, float b) const { return b > a ? b : a; } };
struct MinOp { __device__ int operator()(int a, int b) const { return b < a ? b : a; } };
struct SumOp {
    __device__ unsigned long long operator()(unsigned long long a, unsigned long long b) const { return a + b; }
};

// op over the block (blockDim.x a multiple of 32); every thread gets the result.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, T* scratch, T identity, Op op) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, shfl_xor(v, o));
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < n_warps ? scratch[lane] : identity;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v = op(v, shfl_xor(v, o));
        if (lane == 0) scratch[0] = v;
    }
    __syncthreads();
    v = scratch[0];
    __syncthreads();
    return v;
}

__device__ __forceinline__ float row_max(const float* row, int n_vocab, SampleShared& sh) {
    float m = -FS_INF;
    for (int j = threadIdx.x; j < n_vocab; j += blockDim.x) {
        const float x = row[j];
        if (x > m) m = x;
    }
    return block_reduce(m, sh.red_f, -FS_INF, MaxOp());
}

// Sum of the weights of the candidates with keep(j, x).
template <class Keep>
__device__ unsigned long long row_mass(const float* row, int n_vocab, float m, double temp, double scale, Keep keep,
                                       SampleShared& sh) {
    unsigned long long s = 0;
    for (int j = threadIdx.x; j < n_vocab; j += blockDim.x) {
        const float x = row[j];
        if (is_cand(x) && keep(j, x)) s += fx_weight(x, m, temp, scale);
    }
    return block_reduce(s, sh.red_u, 0ull, SumOp());
}

// Walk sh.hist from digit 255 down: sh.digit is the bucket that brings the running sum to `need`
// (>= 1), sh.above the sum of the buckets above it, sh.total the sum of them all.
__device__ __forceinline__ void pick_bucket(SampleShared& sh, unsigned long long need) {
    const int t = threadIdx.x;
    if (t < 32) {
        unsigned long long s = 0;
        for (int i = 0; i < 8; ++i) s += sh.hist[255 - 8 * t - i];
        sh.part[t] = s;
    }
    __syncthreads();
    if (t < 32) {
        unsigned long long before = 0;
        for (int i = 0; i < t; ++i) before += sh.part[i];
        if (t == 31) sh.total = before + sh.part[31];
        if (before < need && before + sh.part[t] >= need) {
            for (int i = 0; i < 8; ++i) {
                const int d = 255 - 8 * t - i;
                if (before + sh.hist[d] >= need) {
                    sh.digit = (unsigned int)d;
                    sh.above = before;
                    break;
                }
                before += sh.hist[d];
            }
        }
    }
    __syncthreads();
}

// Radix selection over the items (j, row[j]) for which key_of(j, x, &key) is true: the largest key K
// such that the items with key >= K weigh at least `need` (weight_of(x) each). False when all of them
// together weigh less. *above: the weight of the items with key > K.
template <class KeyOf, class WeightOf>
__device__ bool radix_select(const float* row, int n_vocab, unsigned long long need, KeyOf key_of, WeightOf weight_of,
                             SampleShared& sh, unsigned int* key_out, unsigned long long* above_out) {
    unsigned int prefix = 0, mask = 0;
    unsigned long long above = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) sh.hist[i] = 0;
        __syncthreads();
        unsigned int run_digit = 0;             // a thread adds runs of one digit at once: fewer atomics
        unsigned long long run = 0;
        for (int j = threadIdx.x; j < n_vocab; j += blockDim.x) {
            const float x = row[j];
            unsigned int key;
            if (key_of(j, x, &key) && (key & mask) == prefix) {
                const unsigned long long w = weight_of(x);
                const unsigned int d = (key >> shift) & 255u;
                if (d != run_digit && run != 0) {
                    atomicAdd(&sh.hist[run_digit], run);
                    run = 0;
                }
                run_digit = d;
                run += w;
            }
        }
        if (run != 0) atomicAdd(&sh.hist[run_digit], run);
        __syncthreads();
        pick_bucket(sh, need);
        if (shift == 24 && sh.total < need) return false;
        prefix |= sh.digit << shift;
        mask |= 255u << shift;
        need -= sh.above;
        above += sh.above;
    }
    *key_out = prefix;
    *above_out = above;
    return true;
}

// The need-th smallest id among the candidates equal to v with keep(j, v) (there are that many).
template <class Keep>
__device__ int nth_id(const float* row, int n_vocab, float v, unsigned long long need, Keep keep, SampleShared& sh) {
    if (need == 1) {        // the usual case (no tie at the boundary): one pass
        int best = NO_TOKEN;
        for (int j = threadIdx.x; j < n_vocab; j += blockDim.x) {
            if (row[j] == v && keep(j, v)) {
                best = j;
                break;      // ids grow along a thread's walk: its first is its smallest
            }
        }
        return block_reduce(best, sh.red_i, (int)NO_TOKEN, MinOp());
    }
    unsigned int key;
    unsigned long long above;
    radix_select(row, n_vocab, need,
                 [=](int j, float x, unsigned int* k) { *k = ~(unsigned int)j; return x == v && keep(j, x); },
                 [](float) { return 1ull; }, sh, &key, &above);
    return (int)~key;
}

// The k-th candidate in rank order among those with keep(j, x); every candidate ranks at or before
// the result when there are fewer than k.
// With k <= blockDim.x, the k-th largest of the threads' own largest candidates is a lower bound of the
// k-th largest candidate (k threads hold one at least that large): only candidates above it enter the
// histograms, about k of them rather than the vocabulary (shared atomics on few addresses serialize).
template <class Keep>
__device__ Rank select_rank(const float* row, int n_vocab, int k, Keep keep, SampleShared& sh) {
    const auto one = [](float) { return 1ull; };
    unsigned int key;
    unsigned long long above;
    float tau = -FS_INF;
    if (k <= (int)blockDim.x) {
        float mx = -FS_INF;
        for (int j = threadIdx.x; j < n_vocab; j += blockDim.x) {
            const float x = row[j];
            if (x > mx && keep(j, x)) mx = x;
        }
        sh.tmax[threadIdx.x] = mx;
        __syncthreads();
        if (radix_select(sh.tmax, (int)blockDim.x, (unsigned long long)k,
                         [](int, float x, unsigned int* kk) { *kk = rank_key(x); return is_cand(x); }, one, sh, &key,
                         &above))
            tau = key_value(key);
    }
    const auto bounded = [=](int j, float x) { return x >= tau && keep(j, x); };
    if (!radix_select(row, n_vocab, (unsigned long long)k,
                      [=](int j, float x, unsigned int* kk) { *kk = rank_key(x); return is_cand(x) && bounded(j, x); },
                      one, sh, &key, &above))
        return Rank{-FS_INF, NO_TOKEN};
    const float v = key_value(key);
    return Rank{v, nth_id(row, n_vocab, v, (unsigned long long)k - above, keep, sh)};
}

// The top-p boundary: the last candidate (with keep) of the shortest rank prefix whose temperature-1
// mass reaches target (1 <= target <= the mass of them all).
template <class Keep>
__device__ Rank select_mass(const float* row, int n_vocab, unsigned long long target, float m, double scale, Keep keep,
                            SampleShared& sh) {
    unsigned int key;
    unsigned long long above;
    radix_select(row, n_vocab, target,
                 [=](int j, float x, unsigned int* kk) { *kk = rank_key(x); return is_cand(x) && keep(j, x); },
                 [=](float x) { return fx_weight(x, m, 1.0, scale); }, sh, &key, &above);
    const float v = key_value(key);
    const unsigned long long q = fx_weight(v, m, 1.0, scale);        // > 0: its bucket carried mass
    return Rank{v, nth_id(row, n_vocab, v, (target - above + q - 1) / q, keep, sh)};
}

// The first i < n whose inclusive prefix sum of w[] reaches need (1 <= need <= the sum of all n);
// sh.above is the sum before it. Every thread gets i.
__device__ int first_reaching(const unsigned long long* w, int n, unsigned long long need, SampleShared& sh) {
    const int t = threadIdx.x, per = (n + 31) / 32;
    if (t < 32) {
        unsigned long long a = 0;
        for (int i = t * per; i < min(n, t * per + per); ++i) a += w[i];
        sh.part[t] = a;
    }
    __syncthreads();
    if (t < 32) {
        unsigned long long before = 0;
        for (int i = 0; i < t; ++i) before += sh.part[i];
        if (before < need && before + sh.part[t] >= need) {
            for (int i = t * per; i < min(n, t * per + per); ++i) {
                if (before + w[i] >= need) {
                    sh.at = i;
                    sh.above = before;
                    break;
                }
                before += w[i];
            }
        }
    }
    __syncthreads();
    return sh.at;
}

__device__ __forceinline__ void write_empty(int* out, int from, int n, int cap) {
    for (int i = from + (int)threadIdx.x; i < n; i += blockDim.x) {
        out[i] = -1;
        out[cap + i] = 0;       // 0.0f
    }
}

// The first n (<= SAMPLE_MAX_PROBS) candidates with keep(j, x), in rank order: ids into out[0, n),
// float32 weight / total into out[cap, cap + n); -1 and 0.0 past the last one.
template <class Keep>
__device__ void write_top(const float* row, int n_vocab, int n, float m, double temp, double scale,
                          unsigned long long total, Keep keep, int* out, int cap, SampleShared& sh) {
    const Rank b = select_rank(row, n_vocab, n, keep, sh);
    if (threadIdx.x == 0) sh.n_top = 0;
    __syncthreads();
    for (int j = threadIdx.x; j < n_vocab; j += blockDim.x) {
        const float x = row[j];
        if (is_cand(x) && at_or_before(x, j, b) && keep(j, x)) {
            const int at = atomicAdd(&sh.n_top, 1);
            if (at < SAMPLE_MAX_PROBS) {
                sh.top_v[at] = x;
                sh.top_id[at] = j;
            }
        }
    }
    __syncthreads();
    const int cnt = min(sh.n_top, n);
    for (int i = threadIdx.x; i < cnt; i += blockDim.x) {
        const float v = sh.top_v[i];
        const int id = sh.top_id[i];
        int rank = 0;
        for (int k = 0; k < cnt; ++k) rank += better(sh.top_v[k], sh.top_id[k], v, id) ? 1 : 0;
        out[rank] = id;
        out[cap + rank] = __float_as_int((float)((double)fx_weight(v, m, temp, scale) / (double)total));
    }
    write_empty(out, cnt, n, cap);
    __syncthreads();
}

// Logit bias, then penalties, in place (each touched logit by one thread).
__device__ __forceinline__ void adjust(float* row, const SampleRow& p, const int* hist, const int* bias_ids,
                                       const float* bias_vals) {
    for (int i = threadIdx.x; i < p.n_bias; i += blockDim.x) {
        const int tok = bias_ids[i];
        bool first = true;
        for (int k = 0; k < i && first; ++k) first = bias_ids[k] != tok;
        if (first) {            // a repeated id adds its biases in list order, as the host does
            float x = row[tok];
            for (int k = i; k < p.n_bias; ++k)
                if (bias_ids[k] == tok) x = x + bias_vals[k];
            row[tok] = x;
        }
    }
    __syncthreads();
    if ((p.flags & SAMPLE_PENALIZE) && p.hist_len > 0) {
        for (int i = threadIdx.x; i < p.hist_len; i += blockDim.x) {
            const int tok = hist[i];
            bool first = true;
            int count = 0;
            for (int k = 0; k < p.hist_len; ++k) {
                if (hist[k] == tok) {
                    first = first && k >= i;
                    ++count;
                }
            }
            if (first)
                row[tok] = penalize(row[tok], count, p.repeat_penalty, p.frequency_penalty, p.presence_penalty);
        }
    }
    __syncthreads();
}

// top-k -> top-p -> min-p -> temperature -> draw on the adjusted row whose max is m (> -inf), for
// 0 < top_k <= blockDim.x: the top-k set is gathered into shared memory, one candidate a thread, and
// everything after runs there (the host sampler's top-k path). Returns the token; writes the
// post-sampling list when asked.
__device__ int draw_top_k(const float* row, int n_vocab, float m, const SampleRow& p, double scale, int n_probs,
                          int* probs, int cap, SampleShared& sh) {
    const int t = threadIdx.x;
    const Rank bk = select_rank(row, n_vocab, p.top_k, [](int, float) { return true; }, sh);
    if (t == 0) sh.n_top = 0;
    __syncthreads();
    for (int j = t; j < n_vocab; j += blockDim.x) {
        const float x = row[j];
        if (is_cand(x) && at_or_before(x, j, bk)) {
            const int at = atomicAdd(&sh.n_top, 1);
            if (at < SAMPLE_THREADS) {
                sh.kv[at] = x;
                sh.kid[at] = j;
            }
        }
    }
    __syncthreads();
    const int n = min(sh.n_top, SAMPLE_THREADS);        // min(top_k, candidates) >= 1
    if (t < n) {                                         // thread i: the candidate of rank i after this
        const float v = sh.kv[t];
        const int id = sh.kid[t];
        int r = 0;
        for (int k = 0; k < n; ++k) r += better(sh.kv[k], sh.kid[k], v, id) ? 1 : 0;
        sh.sv[r] = v;
        sh.sid[r] = id;
    }
    __syncthreads();
    int keep = n;                                        // the kept set: ranks [0, keep)
    if (p.top_p < 1.0) {
        const unsigned long long q = t < n ? fx_weight(sh.sv[t], m, 1.0, scale) : 0ull;
        if (t < n) sh.q[t] = q;
        const unsigned long long total = block_reduce(q, sh.red_u, 0ull, SumOp());     // syncs: sh.q is set
        unsigned long long target = (unsigned long long)ceil(p.top_p * (double)total);
        if (target > total) target = total;
        keep = target == 0 ? 1 : first_reaching(sh.q, n, target, sh) + 1;
    }
    if (p.min_p > 0.0) {
        const double thr = (double)m + p.log_min_p;
        const int below = block_reduce(t < n && (double)sh.sv[t] < thr ? t : (int)NO_TOKEN, sh.red_i,
                                       (int)NO_TOKEN, MinOp());
        keep = min(keep, below);                         // >= 1: rank 0 is the max
    }
    const unsigned long long q2 = t < keep ? fx_weight(sh.sv[t], m, p.temperature, scale) : 0ull;
    const unsigned long long total = block_reduce(q2, sh.red_u, 0ull, SumOp());
    if (t < keep) {                                      // the kept set in id order, for the draw
        int r = 0;
        for (int k = 0; k < keep; ++k) r += sh.sid[k] < sh.sid[t] ? 1 : 0;
        sh.wq[r] = q2;
        sh.wid[r] = sh.sid[t];
    }
    if (n_probs > 0 && (p.flags & SAMPLE_POST_PROBS)) {
        if (t < min(n_probs, keep)) {
            probs[t] = sh.sid[t];
            probs[cap + t] = __float_as_int((float)((double)q2 / (double)total));
        }
        write_empty(probs, keep, n_probs, cap);
    }
    __syncthreads();
    const unsigned long long r = mulhi64(splitmix64(p.rng), total);      // < total
    return sh.wid[first_reaching(sh.wq, keep, r + 1, sh)];
}

// The same chain for any top_k, over the whole row: the top-k, top-p and min-p cuts make one rank
// boundary; each thread weighs its own run of ids, and the run where the mass passes r is walked again.
__device__ int draw(const float* row, int n_vocab, float m, const SampleRow& p, double scale, int n_probs,
                    int* probs, int cap, SampleShared& sh) {
    const int t = threadIdx.x;
    const auto any = [](int, float) { return true; };
    Rank b = Rank{-FS_INF, NO_TOKEN};
    if (p.top_k > 0) b = select_rank(row, n_vocab, p.top_k, any, sh);
    if (p.top_p < 1.0) {
        const Rank bk = b;
        const auto in_k = [=](int j, float x) { return at_or_before(x, j, bk); };
        const unsigned long long total = row_mass(row, n_vocab, m, 1.0, scale, in_k, sh);
        unsigned long long target = (unsigned long long)ceil(p.top_p * (double)total);
        if (target > total) target = total;
        if (target == 0) b = Rank{m, nth_id(row, n_vocab, m, 1ull, any, sh)};
        else b = select_mass(row, n_vocab, target, m, scale, in_k, sh);
    }
    const Rank bp = b;
    const double thr = p.min_p > 0.0 ? (double)m + p.log_min_p : -(double)FS_INF;
    const auto kept = [=](int j, float x) { return at_or_before(x, j, bp) && (double)x >= thr; };

    const int run = (n_vocab + blockDim.x - 1) / blockDim.x;
    const int lo = min(n_vocab, t * run), hi = min(n_vocab, lo + run);
    unsigned long long s = 0;
    for (int j = lo; j < hi; ++j) {
        const float x = row[j];
        if (is_cand(x) && kept(j, x)) s += fx_weight(x, m, p.temperature, scale);
    }
    sh.chunk[t] = s;
    const unsigned long long total = block_reduce(s, sh.red_u, 0ull, SumOp());         // syncs: sh.chunk is set
    const unsigned long long r = mulhi64(splitmix64(p.rng), total);                     // < total
    const int at = first_reaching(sh.chunk, blockDim.x, r + 1, sh);
    if (t == at) {                  // finds it: the run's mass passes r
        unsigned long long cum = sh.above;
        for (int j = lo; j < hi; ++j) {
            const float x = row[j];
            if (is_cand(x) && kept(j, x)) {
                cum += fx_weight(x, m, p.temperature, scale);
                if (cum > r) {
                    sh.found = j;
                    break;
                }
            }
        }
    }
    __syncthreads();
    const int tok = sh.found;
    if (n_probs > 0 && (p.flags & SAMPLE_POST_PROBS))
        write_top(row, n_vocab, n_probs, m, p.temperature, scale, total, kept, probs, cap, sh);
    return tok;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_chain_f32(float* logits, const SampleRow* rows, int* slot_tab, int* out_ids, int* out_probs,
                 const unsigned int* masks, int n_vocab, int window_cap, int bias_cap, int probs_cap, int mask_words) {
    __shared__ SampleShared sh;
    const int r = blockIdx.x, t = threadIdx.x;
    const SampleRow p = rows[r];
    float* row = logits + (size_t)r * n_vocab;
    int* hist = slot_tab + (size_t)p.slot * (window_cap + 2 * bias_cap);
    const int* bias_ids = hist + window_cap;
    const float* bias_vals = (const float*)(bias_ids + bias_cap);
    const int n_probs = p.probs_row >= 0 ? min(min(p.n_probs, probs_cap), SAMPLE_MAX_PROBS) : 0;
    int* probs = out_probs + (size_t)(p.probs_row >= 0 ? p.probs_row : 0) * 2 * probs_cap;
    int qbits = 63;                                   // 63 - bit_length(n_vocab): sums fit 63 bits
    for (int v = n_vocab; v != 0; v >>= 1) --qbits;
    const double scale = (double)(1ull << qbits);
    const bool post = (p.flags & SAMPLE_POST_PROBS) != 0;
    const bool constrained = p.mask_row >= 0;

    if (constrained) {                               // a grammar's mask, before every other stage
        const unsigned int* mk = masks + (size_t)p.mask_row * mask_words;
        for (int i = t; i < n_vocab; i += blockDim.x)
            if (!((mk[i >> 5] >> (i & 31)) & 1u)) row[i] = -FS_INF;
        __syncthreads();
    }
    if (n_probs > 0 && !post) {                      // the raw logits, before bias and penalties
        const auto any = [](int, float) { return true; };
        const float m0 = row_max(row, n_vocab, sh);
        if (m0 == -FS_INF) {
            write_empty(probs, 0, n_probs, probs_cap);
        } else {
            const unsigned long long total = row_mass(row, n_vocab, m0, 1.0, scale, any, sh);
            write_top(row, n_vocab, n_probs, m0, 1.0, scale, total, any, probs, probs_cap, sh);
        }
    }
    adjust(row, p, hist, bias_ids, bias_vals);
    int tok;
    if (p.flags & SAMPLE_GREEDY) {
        tok = row_argmax(row, n_vocab, sh.red_f, sh.red_i);
        if (constrained && !is_cand(row[tok])) tok = -1;   // nothing allowed: the host sampler's -1
        if (n_probs > 0 && post) {
            const bool found = is_cand(row[tok]);
            if (t == 0) {
                probs[0] = found ? tok : -1;
                probs[probs_cap] = found ? __float_as_int(1.0f) : 0;
            }
            write_empty(probs, 1, n_probs, probs_cap);
        }
    } else {
        const float m = row_max(row, n_vocab, sh);
        if (m == -FS_INF) {
            tok = -1;                                 // nothing to draw from: no draw
            if (n_probs > 0 && post) write_empty(probs, 0, n_probs, probs_cap);
        } else {
            tok = p.top_k > 0 && p.top_k <= (int)blockDim.x
                      ? draw_top_k(row, n_vocab, m, p, scale, n_probs, probs, probs_cap, sh)
                      : draw(row, n_vocab, m, p, scale, n_probs, probs, probs_cap, sh);
        }
    }
    if (t == 0) {
        out_ids[r] = tok;
        if (p.hist_pos >= 0 && !(constrained && tok < 0)) hist[p.hist_pos] = tok < 0 ? 0 : tok;
    }
}
