"""The CPU kernel emulator (tests/gpu/cuda_emu) itself: what the kernel tests rely on when they run
the CUDA C on the CPU. Barriers order shared memory, shuffles exchange lanes, coordinates cover the
grid, and the CUDA errors that would hang or corrupt a GPU (a barrier some threads never reach, a
__syncthreads after some threads exited, a shuffle from an exited lane, reading shared memory nobody
wrote) stop the launch with a message."""
import numpy as np
import pytest

from . import cuda_emu

pytestmark = pytest.mark.skipif(cuda_emu.unavailable() is not None, reason=str(cuda_emu.unavailable()))

SOURCE = r'''
extern "C" __global__ void reverse_in_shared(const float* in, float* out) {
    __shared__ float s[1024];
    const int t = threadIdx.x, n = blockDim.x;
    s[t] = in[blockIdx.x * n + t];
    __syncthreads();                       // without it, thread t would read s[n-1-t] before it is written
    out[blockIdx.x * n + t] = s[n - 1 - t];
}

extern "C" __global__ void butterfly(const float* in, float* out, int* src) {
    float v = in[threadIdx.x];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    out[threadIdx.x] = v;
    src[threadIdx.x] = __shfl_down_sync(0xffffffffu, (int)threadIdx.x, 3);
}

extern "C" __global__ void coordinates(int* out) {
    const int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    const int thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    out[block * blockDim.x * blockDim.y * blockDim.z + thread] = block * 10000 + thread;
}

extern "C" __global__ void divergent_barrier(int* out) {
    if (threadIdx.x < 16) __syncthreads();      // waits for lanes 16..31, which wait for lanes 0..15
    else __syncwarp();
    out[threadIdx.x] = 1;
}

extern "C" __global__ void neighbour_without_barrier(const float* in, float* out) {
    __shared__ float s[256];
    s[threadIdx.x] = in[threadIdx.x];
    out[threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];    // a race: no __syncthreads in between
}

extern "C" __global__ void barrier_after_exit(int* out) {
    if (threadIdx.x >= 16) return;
    __syncthreads();                            // undefined on a GPU: some threads have exited
    out[threadIdx.x] = 1;
}

extern "C" __global__ void shuffle_after_exit(float* out) {
    if ((threadIdx.x & 31) >= 16) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 16);
}

extern "C" __global__ void read_unwritten_shared(float* out) {
    __shared__ float s[64];
    if (threadIdx.x == 0) s[1] = 2.0f;
    __syncthreads();
    out[threadIdx.x] = s[threadIdx.x];
}
'''


def test_syncthreads_orders_shared_memory():
    a = np.arange(3 * 256, dtype=np.float32)
    out = np.zeros_like(a)
    cuda_emu.Kernel(SOURCE, "reverse_in_shared")((3,), (256,), [a.ctypes.data, out.ctypes.data])
    np.testing.assert_array_equal(out, a.reshape(3, 256)[:, ::-1].reshape(-1))


def test_warp_shuffles():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(64).astype(np.float32)
    out, src = np.zeros(64, np.float32), np.zeros(64, np.int32)
    cuda_emu.Kernel(SOURCE, "butterfly")((1,), (64,), [a.ctypes.data, out.ctypes.data, src.ctypes.data])
    for w in range(2):
        v = a[32 * w:32 * w + 32].copy()
        for o in (16, 8, 4, 2, 1):
            v = (v + v[np.arange(32) ^ o]).astype(np.float32)
        np.testing.assert_array_equal(out[32 * w:32 * w + 32], v)
    lane = np.arange(64) % 32
    np.testing.assert_array_equal(src, np.where(lane + 3 < 32, np.arange(64) + 3, np.arange(64)))


def test_every_thread_of_the_grid_runs_once_with_its_coordinates():
    out = np.full(3 * 2 * 2 * 8 * 4 * 2, -1, np.int32)
    cuda_emu.Kernel(SOURCE, "coordinates")((3, 2, 2), (8, 4, 2), [out.ctypes.data])
    n_thr = 8 * 4 * 2
    want = np.array([b * 10000 + t for b in range(12) for t in range(n_thr)], np.int32)
    np.testing.assert_array_equal(out, want)


def test_threads_waiting_at_different_barriers_are_a_dead_lock():
    out = np.zeros(32, np.int32)
    with pytest.raises(RuntimeError, match="dead-lock"):
        cuda_emu.Kernel(SOURCE, "divergent_barrier")((1,), (32,), [out.ctypes.data])


@pytest.mark.parametrize("block", [32, 64])
def test_a_barrier_after_some_threads_exited_is_refused(block):
    out = np.zeros(block, np.int32)
    with pytest.raises(RuntimeError, match="exited"):
        cuda_emu.Kernel(SOURCE, "barrier_after_exit")((1,), (block,), [out.ctypes.data])


def test_a_shuffle_over_exited_lanes_is_refused():
    out = np.zeros(32, np.float32)
    with pytest.raises(RuntimeError, match="exited|live lanes"):
        cuda_emu.Kernel(SOURCE, "shuffle_after_exit")((1,), (32,), [out.ctypes.data])


def test_shared_memory_starts_poisoned():
    out = np.zeros(64, np.float32)
    cuda_emu.Kernel(SOURCE, "read_unwritten_shared")((2,), (64,), [out.ctypes.data])
    assert out[1] == 2.0 and np.isnan(np.delete(out, 1)).all()


def test_a_bad_launch_shape_is_refused():
    out = np.zeros(4, np.int32)
    with pytest.raises(RuntimeError, match="launch shape"):
        cuda_emu.Kernel(SOURCE, "coordinates")((1,), (2048,), [out.ctypes.data])


@pytest.mark.parametrize("other", ["descending", "shuffled"])
def test_other_thread_orders_bring_out_a_missing_barrier(other):
    """Run in two thread orders: a kernel with its barriers gives the same bits, a race does not."""
    a = np.arange(256, dtype=np.float32)

    def run(name, order):
        before = cuda_emu.order()
        cuda_emu.set_order(order, seed=7)
        try:
            out = np.zeros(256, np.float32)
            cuda_emu.Kernel(SOURCE, name)((1,), (256,), [a.ctypes.data, out.ctypes.data])
            return out
        finally:
            cuda_emu.set_order(*before)

    np.testing.assert_array_equal(run("reverse_in_shared", "ascending"), run("reverse_in_shared", other))
    assert not np.array_equal(run("neighbour_without_barrier", "ascending"),
                              run("neighbour_without_barrier", other), equal_nan=True)
