// The fiber scheduler behind cuda_emu.h: one launch at a time, blocks in order, a block's threads
// as fibers switched at barriers. Compiled into each kernel family's shared library, after it.
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

extern "C" {
volatile uint3 threadIdx, blockIdx;
volatile dim3 blockDim, gridDim;
}

// Shared memory: every __shared__ variable of the library is in this section (cuda_emu.h).
extern "C" char __start_fsemu_shared[] __attribute__((weak));
extern "C" char __stop_fsemu_shared[] __attribute__((weak));

namespace fsemu {

enum State { RUNNABLE, AT_BLOCK_BARRIER, AT_WARP_BARRIER, DONE };

struct Fiber {
    void* sp;
    State state;
};

struct Warp {
    int live;       // lanes not exited
    int arrived;    // lanes waiting at the warp barrier
    unsigned int live_mask;
    unsigned int ballot;
};

constexpr int kMaxThreads = 1024;
constexpr size_t kStackBytes = 128 * 1024;

static Fiber fibers[kMaxThreads];
static Warp warps[kMaxThreads / 32];
static volatile unsigned long long exchange[kMaxThreads];   // shuffle values, by thread
static int n_threads, current, block_live, block_arrived;
static void* scheduler_sp;
static char* stacks;
static int order[kMaxThreads];             // the order in which a pass resumes the block's threads
static int order_mode;                     // 0 ascending, 1 descending, 2 shuffled per block
static unsigned long long order_seed;
static void (*entry)(void**);
static void** entry_args;
static char error[512];

}  // namespace fsemu

// switch_to(save, to): saves the callee-saved registers and the stack pointer into *save, continues
// on the stack `to` (made by a previous switch_to, or by new_fiber).
extern "C" void fsemu_switch(void** save, void* to);
#if defined(__x86_64__)
asm(R"(
    .text
    .p2align 4
    .hidden fsemu_switch
    .globl fsemu_switch
    .type fsemu_switch, @function
fsemu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size fsemu_switch, .-fsemu_switch
)");
#elif defined(__aarch64__)
asm(R"(
    .text
    .p2align 4
    .hidden fsemu_switch
    .globl fsemu_switch
    .type fsemu_switch, %function
fsemu_switch:
    sub sp, sp, #176
    stp x19, x20, [sp, #0]
    stp x21, x22, [sp, #16]
    stp x23, x24, [sp, #32]
    stp x25, x26, [sp, #48]
    stp x27, x28, [sp, #64]
    stp x29, x30, [sp, #80]
    stp d8, d9, [sp, #96]
    stp d10, d11, [sp, #112]
    stp d12, d13, [sp, #128]
    stp d14, d15, [sp, #144]
    mov x9, sp
    str x9, [x0]
    mov sp, x1
    ldp x19, x20, [sp, #0]
    ldp x21, x22, [sp, #16]
    ldp x23, x24, [sp, #32]
    ldp x25, x26, [sp, #48]
    ldp x27, x28, [sp, #64]
    ldp x29, x30, [sp, #80]
    ldp d8, d9, [sp, #96]
    ldp d10, d11, [sp, #112]
    ldp d12, d13, [sp, #128]
    ldp d14, d15, [sp, #144]
    add sp, sp, #176
    ret
    .size fsemu_switch, .-fsemu_switch
)");
#else
#error "cuda_emu: fiber switch written for x86-64 and aarch64 only"
#endif

namespace fsemu {

static void set_coordinates(int tid) {
    const unsigned int bx = blockDim.x, by = blockDim.y;
    threadIdx.x = (unsigned int)tid % bx;
    threadIdx.y = ((unsigned int)tid / bx) % by;
    threadIdx.z = (unsigned int)tid / (bx * by);
}

// Other fibers run inside the switch: the compiler must assume that any memory changed (shared
// arrays, the exchange buffer), as a __syncthreads is a compiler barrier on a GPU too.
static void yield_to_scheduler() {
    asm volatile("" ::: "memory");
    fsemu_switch(&fibers[current].sp, scheduler_sp);
    asm volatile("" ::: "memory");
}

[[noreturn]] static void fail(const char* fmt, int a, int b) {
    if (!error[0]) {
        char what[400];
        snprintf(what, sizeof what, fmt, a, b);
        snprintf(error, sizeof error, "%s (block %u,%u,%u thread %d)", what, blockIdx.x, blockIdx.y, blockIdx.z,
                 current);
    }
    fibers[current].state = DONE;
    for (;;) yield_to_scheduler();      // never resumed: the launch stops
}

static void release_block_barrier() {
    block_arrived = 0;
    for (int i = 0; i < n_threads; ++i)
        if (fibers[i].state == AT_BLOCK_BARRIER) fibers[i].state = RUNNABLE;
}

static void release_warp_barrier(int w) {
    warps[w].arrived = 0;
    for (int i = w * 32; i < n_threads && i < w * 32 + 32; ++i)
        if (fibers[i].state == AT_WARP_BARRIER) fibers[i].state = RUNNABLE;
}

static void warp_barrier() {
    const int w = current >> 5;
    if (++warps[w].arrived == warps[w].live) {
        release_warp_barrier(w);
        return;
    }
    fibers[current].state = AT_WARP_BARRIER;
    yield_to_scheduler();
}

static void check_mask(unsigned int mask, const char* what) {
    const int w = current >> 5;
    (void)what;
    if (!(mask >> (current & 31) & 1u))
        fail("lane %d calls a warp operation whose mask %#x leaves it out", current & 31, (int)mask);
    if (mask != warps[w].live_mask) fail("warp operation with mask %#x but the warp's live lanes are %#x", (int)mask,
                                         (int)warps[w].live_mask);
}

static void thread_exit() {
    const int w = current >> 5;
    fibers[current].state = DONE;
    --block_live;
    --warps[w].live;
    warps[w].live_mask &= ~(1u << (current & 31));
    if (block_arrived > 0)
        fail("a thread exited while %d threads of the block wait at __syncthreads", block_arrived, 0);
    if (warps[w].arrived > 0 && warps[w].arrived == warps[w].live) release_warp_barrier(w);
}

static void fiber_main() {
    entry(entry_args);
    thread_exit();
    for (;;) yield_to_scheduler();
}

static void new_fiber(int tid) {
    char* top = stacks + (size_t)(tid + 1) * kStackBytes;
    void** sp = reinterpret_cast<void**>(top);
#if defined(__x86_64__)
    *--sp = nullptr;                                        // alignment: fiber_main starts as if called
    *--sp = reinterpret_cast<void*>(&fiber_main);           // where fsemu_switch's ret goes
    for (int r = 0; r < 6; ++r) *--sp = nullptr;            // rbp rbx r12 r13 r14 r15
    unsigned long long csr = 0x1F80ull | (0x037Full << 32);  // default MXCSR, x87 control word
    *--sp = reinterpret_cast<void*>(csr);
#else
    sp -= 22;                                               // 176 bytes: x19-x30, d8-d15
    for (int r = 0; r < 22; ++r) sp[r] = nullptr;
    sp[11] = reinterpret_cast<void*>(&fiber_main);          // x30: where ret goes
#endif
    fibers[tid].sp = sp;
    fibers[tid].state = RUNNABLE;
}

// Threads run one at a time between barriers, so a missing barrier goes unseen when the writer
// happens to run before the reader. Other orders (FASTSERVE_CUDA_EMU_ORDER) bring such races out.
static void set_order() {
    for (int t = 0; t < n_threads; ++t) order[t] = order_mode == 1 ? n_threads - 1 - t : t;
    if (order_mode != 2) return;
    const unsigned long long block = blockIdx.x + 65536ull * (blockIdx.y + 65536ull * blockIdx.z);
    unsigned long long x = order_seed ^ (0x9E3779B97F4A7C15ull * (block + 1));
    for (int t = n_threads - 1; t > 0; --t) {       // Fisher-Yates with xorshift64
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        const int u = (int)(x % (unsigned long long)(t + 1));
        const int tmp = order[t];
        order[t] = order[u];
        order[u] = tmp;
    }
}

static int run_block() {
    block_live = n_threads;
    block_arrived = 0;
    for (int w = 0; w * 32 < n_threads; ++w) {
        const int lanes = n_threads - w * 32 < 32 ? n_threads - w * 32 : 32;
        warps[w].live = lanes;
        warps[w].arrived = 0;
        warps[w].live_mask = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
        warps[w].ballot = 0;
    }
    for (int t = 0; t < n_threads; ++t) new_fiber(t);
    set_order();
    int done = 0;
    while (done < n_threads) {
        bool ran = false;
        for (int o = 0; o < n_threads; ++o) {
            const int t = order[o];
            if (fibers[t].state != RUNNABLE) continue;
            current = t;
            set_coordinates(t);
            fsemu_switch(&scheduler_sp, fibers[t].sp);
            if (error[0]) return -1;
            ran = true;
            if (fibers[t].state == DONE) ++done;
        }
        if (!ran) {
            int at_block = 0, at_warp = 0;
            for (int t = 0; t < n_threads; ++t) {
                at_block += fibers[t].state == AT_BLOCK_BARRIER;
                at_warp += fibers[t].state == AT_WARP_BARRIER;
            }
            snprintf(error, sizeof error, "dead-lock: %d threads wait at __syncthreads, %d at a warp barrier, %d have "
                     "exited (block %u,%u,%u)", at_block, at_warp, n_threads - block_live, blockIdx.x, blockIdx.y,
                     blockIdx.z);
            return -1;
        }
    }
    return 0;
}

}  // namespace fsemu

using namespace fsemu;

extern "C" void fsemu_syncthreads(void) {
    // CUDA leaves a __syncthreads undefined once some threads of the block have exited (it may hang).
    if (block_live < n_threads) fail("__syncthreads after %d of %d threads of the block exited", n_threads - block_live,
                                     n_threads);
    if (++block_arrived == block_live) {
        release_block_barrier();
        return;
    }
    fibers[current].state = AT_BLOCK_BARRIER;
    yield_to_scheduler();
}

extern "C" void fsemu_syncwarp(unsigned int mask) {
    check_mask(mask, "__syncwarp");
    warp_barrier();
}

extern "C" unsigned long long fsemu_shfl(unsigned int mask, unsigned long long bits, int src_lane, int width) {
    (void)width;
    check_mask(mask, "shuffle");
    const int w = current >> 5;
    exchange[current] = bits;
    warp_barrier();                                     // every lane has written
    if (!(warps[w].live_mask >> src_lane & 1u)) fail("shuffle reads lane %d, which has exited (lane %d)", src_lane,
                                                      current & 31);
    const unsigned long long v = exchange[w * 32 + src_lane];
    warp_barrier();                                     // every lane has read
    return v;
}

extern "C" unsigned int fsemu_ballot(unsigned int mask, int pred) {
    check_mask(mask, "ballot");
    const int w = current >> 5;
    exchange[current] = pred ? 1ull : 0ull;
    warp_barrier();
    unsigned int b = 0;
    for (int l = 0; l < 32; ++l)
        if ((warps[w].live_mask >> l & 1u) && exchange[w * 32 + l]) b |= 1u << l;
    warp_barrier();
    return b;
}

FSEMU_EXPORT void fsemu_set_order(int mode, unsigned long long seed) {
    order_mode = mode;
    order_seed = seed;
}

// Runs stub(args) as the kernel over the grid. Returns 0, or -1 with the reason in err.
FSEMU_EXPORT int fsemu_launch(void (*stub)(void**), void** args, unsigned int gx, unsigned int gy, unsigned int gz,
                              unsigned int bx, unsigned int by, unsigned int bz, char* err, int err_len) {
    error[0] = 0;
    const unsigned long long threads = (unsigned long long)bx * by * bz;
    if (threads < 1 || threads > (unsigned long long)kMaxThreads || gx < 1 || gy < 1 || gz < 1) {
        snprintf(err, err_len, "bad launch shape grid (%u,%u,%u) block (%u,%u,%u)", gx, gy, gz, bx, by, bz);
        return -1;
    }
    if (stacks == nullptr) {
        void* p = mmap(nullptr, kMaxThreads * kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            snprintf(err, err_len, "cannot map fiber stacks");
            return -1;
        }
        stacks = static_cast<char*>(p);
    }
    entry = stub;
    entry_args = args;
    n_threads = (int)threads;
    blockDim.x = bx, blockDim.y = by, blockDim.z = bz;
    gridDim.x = gx, gridDim.y = gy, gridDim.z = gz;
    for (unsigned int z = 0; z < gz; ++z)
        for (unsigned int y = 0; y < gy; ++y)
            for (unsigned int x = 0; x < gx; ++x) {
                blockIdx.x = x, blockIdx.y = y, blockIdx.z = z;
                if (__start_fsemu_shared != nullptr)
                    memset(__start_fsemu_shared, 0xff, (size_t)(__stop_fsemu_shared - __start_fsemu_shared));
                if (run_block() != 0) {
                    snprintf(err, err_len, "%s", error);
                    return -1;
                }
            }
    return 0;
}
