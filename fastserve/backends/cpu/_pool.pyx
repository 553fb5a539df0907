# cython: language_level=3
"""Pool(threads): the caller plus threads - 1 helper threads, shared by the parallel loops of a
decode step (matrix products, attention). Loops reach it from C with pool_run (see _pool.pxd);
Python only creates, passes and closes it. A Pool serves one calling thread at a time."""
from libc.stdint cimport int64_t, uint8_t

cdef extern from "_pool.h" nogil:
    int FS_POOL_MAX_THREADS
    fs_pool *fs_pool_new(int n_threads, int64_t spin_ns)
    void fs_pool_free(fs_pool *pl)
    void fs_pool_run(fs_pool *pl, fs_task_fn fn, void *ctx, int64_t n_items, int64_t chunk)
    void fs_pool_then(fs_pool *pl, const uint8_t *p, int64_t nbytes)

MAX_THREADS = FS_POOL_MAX_THREADS


cdef void pool_run(fs_pool *pl, fs_task_fn fn, void *ctx, int64_t n_items, int64_t chunk) noexcept nogil:
    fs_pool_run(pl, fn, ctx, n_items, chunk)


cdef void pool_then(fs_pool *pl, const uint8_t *p, int64_t nbytes) noexcept nogil:
    fs_pool_then(pl, p, nbytes)


cdef class Pool:
    """threads: 1 runs everything on the caller (no helper thread); helpers spin for spin_us
    microseconds after a loop, waiting for the next one, then sleep."""

    def __cinit__(self):
        self.pl = NULL

    def __init__(self, int threads=1, double spin_us=100.0):
        if threads < 1 or threads > FS_POOL_MAX_THREADS:
            raise ValueError(f"threads must be in 1..{FS_POOL_MAX_THREADS}, got {threads}")
        self.threads, self.spin_us = threads, spin_us
        if threads > 1:
            self.pl = fs_pool_new(threads, <int64_t>(max(spin_us, 0.0) * 1000))
            if self.pl == NULL:
                raise MemoryError(f"Pool: could not start {threads - 1} helper threads")

    def prefetch_then(self, data):
        """data (a C-contiguous buffer, or None): the bytes the next loop after the next run will read
        first; from that run's start, threads with nothing to do prefetch them (no number changes)."""
        cdef const uint8_t[::1] raw
        if data is None:
            self._then = None
            fs_pool_then(self.pl, NULL, 0)
            return
        raw = memoryview(data).cast("B")
        self._then = data
        fs_pool_then(self.pl, &raw[0] if raw.shape[0] else NULL, raw.shape[0])

    def close(self):
        """Stops and joins the helpers (also done when the Pool is collected)."""
        fs_pool_free(self.pl)
        self.pl = NULL

    def __dealloc__(self):
        fs_pool_free(self.pl)

    def __repr__(self):
        return f"Pool(threads={self.threads})"
