# Result delivery: the contract between the decode thread (producer) and the
# readers (consumers). See _delivery.pyx for the invariants.
from libc.stdint cimport int32_t, int64_t, uint8_t

# C11/GCC atomics. The producer publishes with a release store, the consumer
# reads with an acquire load; the waiting flag is a Dekker-style handshake
# (store one flag, full fence, load the other), so both sides fence seq_cst.
cdef extern from *:
    """
    #include <stdint.h>
    static inline int64_t fs_load_acq64(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    static inline void fs_store_rel64(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
    static inline int32_t fs_load_acq32(const int32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    static inline int32_t fs_load_rlx32(const int32_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
    static inline void fs_store_rel32(int32_t *p, int32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
    static inline void fs_store_rlx32(int32_t *p, int32_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
    static inline int32_t fs_xchg32(int32_t *p, int32_t v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
    static inline int fs_cas32(int32_t *p, int32_t expected, int32_t v) {
        return __atomic_compare_exchange_n(p, &expected, v, 0, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED);
    }
    static inline void fs_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
    """
    int64_t fs_load_acq64(const int64_t *p) nogil
    void fs_store_rel64(int64_t *p, int64_t v) nogil
    int32_t fs_load_acq32(const int32_t *p) nogil
    int32_t fs_load_rlx32(const int32_t *p) nogil
    void fs_store_rel32(int32_t *p, int32_t v) nogil
    void fs_store_rlx32(int32_t *p, int32_t v) nogil
    int32_t fs_xchg32(int32_t *p, int32_t v) nogil
    bint fs_cas32(int32_t *p, int32_t expected, int32_t v) nogil
    void fs_fence() nogil


# Values of fs_buf.waiting.
cdef enum:
    WAIT_NONE = 0      # consumer not waiting
    WAIT_DATA = 1      # wake on the next token or on finish
    WAIT_FINISH = 2    # wake on finish only (result())


# One request's single-producer single-consumer buffer. Append-only: a request
# never produces more than `capacity` tokens, so a published position never
# changes and the consumer may read any position below `count` at any time.
ctypedef struct fs_buf:
    int32_t *tokens         # [capacity]            token ids
    int32_t *top_ids        # [capacity, n_probs]   NULL when n_probs == 0
    float *top_probs        # [capacity, n_probs]   NULL when n_probs == 0
    int64_t capacity        # the slot's context size, fixed at creation
    int32_t n_probs         # top-N kept per token, fixed at creation
    int32_t overflowed      # producer-only: a send found the buffer full
    int64_t count           # tokens published; producer release-stores, consumer acquire-loads
    int32_t finish_code     # 0 while running; release-stored once, after the last count
    int32_t waiting         # WAIT_*: consumer stores it, whoever exchanges it back to 0 owns the wake
    char _pad[48]           # keep the consumer's cursor off the producer's cache line
    int64_t read_pos        # tokens consumed; consumer release-stores (the producer may read it)


cdef class ResultBuffer:
    cdef fs_buf b
    cdef object _error          # str | None, written before finish_code is published
    cdef public object waiter   # what the waker wakes: None, a Future, or a lock
    cdef readonly Py_ssize_t slot       # where the request runs (-1 until attach(); GIL held both sides)
    cdef readonly Py_ssize_t n_cached   # its prompt tokens whose KV was reused (set by attach())
    cdef public int64_t draft_n         # speculative decoding: its drafted tokens, and those accepted
    cdef public int64_t draft_n_accepted    # (written by the decode thread before it finishes the buffer)
    cdef object __weakref__

    cdef tuple _probs(self, int64_t start, int64_t stop)


cdef class Delivery:
    cdef Py_ssize_t n_slots
    cdef fs_buf **table         # [n_slots] attached buffers, NULL when free
    cdef list _bufs             # [n_slots] the ResultBuffer objects behind `table`
    cdef int32_t *ready_slots   # [n_slots] slots whose waiting reader got data this step
    cdef uint8_t *ready_flag    # [n_slots] 1 when the slot is in ready_slots
    cdef Py_ssize_t n_ready
    cdef list _pending          # buffers to wake that are no longer (or never were) in the table
    cdef object _waker
    cdef bint _closed
    cdef readonly int64_t tokens_sent
    cdef readonly int64_t wakes

    cdef void _claim_finish(self, ResultBuffer buf)
    cdef int _finish_buf(self, ResultBuffer buf, int32_t code, object error) except -1
