# The decode thread's helper threads, shared by every parallel loop of a step (see _pool.h).
#
#   from fastserve.backends.cpu._pool cimport Pool, pool_run, fs_task_fn
#   pool_run(pool.pl, fn, ctx, n_items, chunk)      # fn(ctx, begin, end), nogil
#   pool_then(pool.pl, p, bytes)                    # the next product's first bytes, prefetched by waiting threads
from libc.stdint cimport int64_t, uint8_t

cdef extern from "_pool.h" nogil:
    ctypedef void (*fs_task_fn)(void *ctx, int64_t begin, int64_t end) noexcept nogil
    ctypedef struct fs_pool:
        int n_helpers

cdef class Pool:
    cdef fs_pool *pl
    cdef readonly int threads
    cdef readonly double spin_us
    cdef object _then                # the buffer prefetch_then names, kept alive

cdef void pool_run(fs_pool *pl, fs_task_fn fn, void *ctx, int64_t n_items, int64_t chunk) noexcept nogil
cdef void pool_then(fs_pool *pl, const uint8_t *p, int64_t nbytes) noexcept nogil
