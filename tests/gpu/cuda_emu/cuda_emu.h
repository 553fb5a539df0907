// Runs fastserve's CUDA C kernels (cuda/*.cu) on the CPU, for tests on machines without a GPU.
//
// g++ compiles a kernel family's source with this header forced in front (-include). Every CUDA
// thread of a block is a fiber (its own stack, cooperative switching): a block's threads run one at
// a time, each until it reaches a barrier (__syncthreads, a warp shuffle, __syncwarp), and the
// barrier releases them when every live thread of the block (or warp) has arrived. Blocks run one
// after another. So kernels run with CUDA's semantics of barriers, shuffles and shared memory,
// including the dead-locks: a barrier some threads never reach stops the launch with an error, as
// do a __syncthreads once some threads of the block have exited (undefined in CUDA) and a shuffle
// that names a lane that has exited.
//
// What it cannot show: races that need real concurrency (the order here is always the same), memory
// outside an array (no bounds checks), speed, and the last bits of float math (no FMA contraction,
// the CPU's libm). Shared memory is filled with 0xff bytes (NaN, -1) before each block, so that
// reading what the block did not write shows up.
//
// The launcher (tests/gpu/cuda_emu.py) appends one stub per kernel and calls fsemu_launch.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#define FASTSERVE_CUDA_EMU 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static __attribute__((section("fsemu_shared")))
#define FSEMU_EXPORT extern "C" __attribute__((visibility("default")))

struct uint3 { unsigned int x, y, z; };
struct dim3 { unsigned int x, y, z; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(8) int2 { int x, y; };

static inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return {x, y, z, w}; }
static inline uint2 make_uint2(unsigned int x, unsigned int y) { return {x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline int2 make_int2(int x, int y) { return {x, y}; }

// The running thread's coordinates: set by the scheduler before it resumes a fiber. Volatile so
// that a value read before a barrier is never reused after it (another fiber ran in between).
extern "C" volatile uint3 threadIdx, blockIdx;
extern "C" volatile dim3 blockDim, gridDim;

// -- bit casts and integer intrinsics ---------------------------------------------------------

template <typename To, typename From>
static inline To fsemu_bits(From v) {
    static_assert(sizeof(To) == sizeof(From), "bit cast between types of one size");
    To t;
    memcpy(&t, &v, sizeof t);
    return t;
}

static inline float __int_as_float(int i) { return fsemu_bits<float>(i); }
static inline float __uint_as_float(unsigned int u) { return fsemu_bits<float>(u); }
static inline int __float_as_int(float f) { return fsemu_bits<int>(f); }
static inline unsigned int __float_as_uint(float f) { return fsemu_bits<unsigned int>(f); }
static inline double __longlong_as_double(long long v) { return fsemu_bits<double>(v); }
static inline long long __double_as_longlong(double v) { return fsemu_bits<long long>(v); }
static inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
static inline int __popc(unsigned int v) { return __builtin_popcount(v); }
static inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
static inline int __clz(unsigned int v) { return v ? __builtin_clz(v) : 32; }
static inline int __clzll(unsigned long long v) { return v ? __builtin_clzll(v) : 64; }
static inline int __ffs(unsigned int v) { return __builtin_ffs((int)v); }
static inline int __ffsll(unsigned long long v) { return __builtin_ffsll((long long)v); }
static inline unsigned int __brev(unsigned int v) {
    unsigned int r = 0;
    for (int i = 0; i < 32; ++i) r |= ((v >> i) & 1u) << (31 - i);
    return r;
}
template <typename T>
static inline T __ldg(const T* p) { return *p; }

template <typename A, typename B>
static inline typename std::common_type<A, B>::type min(A a, B b) { return b < a ? b : a; }
template <typename A, typename B>
static inline typename std::common_type<A, B>::type max(A a, B b) { return a < b ? b : a; }

// __expf, __logf: glibc declares them already (the same functions as expf, logf).
static inline float __fdividef(float a, float b) { return a / b; }
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

// -- barriers and warp exchange (the fiber scheduler, below) --------------------------------------

extern "C" void fsemu_syncthreads(void);
extern "C" void fsemu_syncwarp(unsigned int mask);
extern "C" unsigned long long fsemu_shfl(unsigned int mask, unsigned long long bits, int src_lane, int width);
extern "C" unsigned int fsemu_ballot(unsigned int mask, int pred);

static inline void __syncthreads(void) { fsemu_syncthreads(); }
static inline void __syncwarp(unsigned int mask = 0xffffffffu) { fsemu_syncwarp(mask); }
static inline void __threadfence(void) {}
static inline void __threadfence_block(void) {}

template <typename T>
static inline unsigned long long fsemu_to_bits(T v) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    unsigned long long b = 0;
    memcpy(&b, &v, sizeof v);
    return b;
}

template <typename T>
static inline T fsemu_from_bits(unsigned long long b) {
    T v;
    memcpy(&v, &b, sizeof v);
    return v;
}

static inline int fsemu_lane(void) { return (int)(threadIdx.x & 31u); }

template <typename T>
static inline T __shfl_sync(unsigned int mask, T v, int src, int width = 32) {
    const int lane = fsemu_lane();
    const int src_lane = (lane & ~(width - 1)) + (src & (width - 1));
    return fsemu_from_bits<T>(fsemu_shfl(mask, fsemu_to_bits(v), src_lane, width));
}

template <typename T>
static inline T __shfl_xor_sync(unsigned int mask, T v, int lane_mask, int width = 32) {
    const int lane = fsemu_lane();
    int src = lane ^ lane_mask;
    if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
    return fsemu_from_bits<T>(fsemu_shfl(mask, fsemu_to_bits(v), src, width));
}

template <typename T>
static inline T __shfl_down_sync(unsigned int mask, T v, unsigned int delta, int width = 32) {
    const int lane = fsemu_lane();
    int src = lane + (int)delta;
    if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
    return fsemu_from_bits<T>(fsemu_shfl(mask, fsemu_to_bits(v), src, width));
}

template <typename T>
static inline T __shfl_up_sync(unsigned int mask, T v, unsigned int delta, int width = 32) {
    const int lane = fsemu_lane();
    int src = lane - (int)delta;
    if (src < (lane & ~(width - 1))) src = lane;
    return fsemu_from_bits<T>(fsemu_shfl(mask, fsemu_to_bits(v), src, width));
}

static inline unsigned int __ballot_sync(unsigned int mask, int pred) { return fsemu_ballot(mask, pred); }
static inline int __any_sync(unsigned int mask, int pred) { return fsemu_ballot(mask, pred) != 0; }
static inline int __all_sync(unsigned int mask, int pred) { return fsemu_ballot(mask, pred) == (mask & fsemu_ballot(mask, 1)); }

// -- atomics: one fiber runs at a time, so a plain read-modify-write is atomic ------------------

template <typename T>
static inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <typename T>
static inline T atomicSub(T* p, T v) { T old = *p; *p = old - v; return old; }
template <typename T>
static inline T atomicMax(T* p, T v) { T old = *p; if (old < v) *p = v; return old; }
template <typename T>
static inline T atomicMin(T* p, T v) { T old = *p; if (v < old) *p = v; return old; }
template <typename T>
static inline T atomicOr(T* p, T v) { T old = *p; *p = old | v; return old; }
template <typename T>
static inline T atomicAnd(T* p, T v) { T old = *p; *p = old & v; return old; }
template <typename T>
static inline T atomicXor(T* p, T v) { T old = *p; *p = old ^ v; return old; }
template <typename T>
static inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
template <typename T>
static inline T atomicCAS(T* p, T cmp, T v) { T old = *p; if (old == cmp) *p = v; return old; }
static inline unsigned int atomicInc(unsigned int* p, unsigned int limit) {
    unsigned int old = *p;
    *p = old >= limit ? 0u : old + 1u;
    return old;
}
