# cython: language_level=3
"""Result delivery: one pass over a step's outputs into the readers' buffers.

Invariants (the twin in fastserve/ref/delivery.py keeps the same ones):
- Each request owns one ResultBuffer: single producer (the decode thread), single
  consumer (its Reader). It is preallocated for `capacity` tokens (the slot's
  context size) and is append-only, so a send never allocates and never blocks.
- The producer writes a position, then release-stores `count`; the consumer
  acquire-loads `count` and reads below it. `finish_code` is release-stored once,
  after the last `count`: a consumer that sees it set and then loads `count`
  has the final count.
- Waiting is a handshake on `waiting`: the consumer stores WAIT_DATA (or
  WAIT_FINISH), fences, and re-checks; the producer publishes, fences, and
  claims a waiting flag back to 0. Whoever moves it to 0 owns the wake, so a
  wake is never lost and never doubled. A stale wake (claimed just as the
  consumer withdrew) only causes one spurious re-check.
- The consumer side is woken at most once per step: claimed buffers are
  collected, and wake() makes ONE call `waker(buffers)`. A reader that is not
  waiting costs the producer nothing but its own buffer.
- Delivery holds the buffer, never the Reader, and only while attached:
  detach + consumer drop frees it (no registry).
- The buffer is all the two sides share of a request: attach() also writes
  where it runs (`slot`, `n_cached`), once, before its first token (both
  sides hold the GIL for these plain fields).
Thread rule: every Delivery method runs on the decode thread (or after it has
exited). Only ResultBuffer's consumer methods run on the consumer side.
"""
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_FromLong
from cpython.ref cimport Py_INCREF
from libc.stdint cimport int32_t, int64_t, uint8_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

import numpy as np

# Finish codes (int, 0 = still running). The engine may use its own codes above
# these; reader.py maps the known ones to finish reasons.
FINISH_STOP = 1        # end-of-generation token
FINISH_LENGTH = 2      # n_predict reached or context full
FINISH_CANCELLED = 3   # cancelled by the client (or a stop string found by the loop)
FINISH_ERROR = 4       # the request failed; see error
FINISH_CLOSED = 5      # the engine shut down (Delivery.close())
FINISH_GRAMMAR = 6     # the request's grammar / JSON schema allowed no next token; see error
FINISH_REASONS = {1: "stop", 2: "length", 3: "cancelled", 4: "error", 5: "closed", 6: "grammar"}

cdef int32_t _CLOSED = FINISH_CLOSED
cdef int32_t _ERROR = FINISH_ERROR


cdef class ResultBuffer:
    """One request's token buffer: int32 ids [capacity], and top-N ids/probs
    [capacity, n_probs] only when n_probs > 0. The consumer-side methods below
    are for the single consumer; the producer side is Delivery's."""

    def __cinit__(self, Py_ssize_t capacity, int n_probs=0):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if n_probs < 0:
            raise ValueError(f"n_probs must be >= 0, got {n_probs}")
        self.b.capacity = capacity
        self.b.n_probs = n_probs
        self.slot = -1
        self.b.tokens = <int32_t *>malloc(capacity * sizeof(int32_t))
        if n_probs:
            self.b.top_ids = <int32_t *>malloc(capacity * n_probs * sizeof(int32_t))
            self.b.top_probs = <float *>malloc(capacity * n_probs * sizeof(float))
        if self.b.tokens == NULL or (n_probs and (self.b.top_ids == NULL or self.b.top_probs == NULL)):
            raise MemoryError(f"result buffer of {capacity} tokens x {n_probs} probs")

    def __dealloc__(self):
        free(self.b.tokens)
        free(self.b.top_ids)
        free(self.b.top_probs)

    @property
    def capacity(self):
        return self.b.capacity

    @property
    def n_probs(self):
        return self.b.n_probs

    @property
    def count(self):
        """Tokens published so far."""
        return fs_load_acq64(&self.b.count)

    @property
    def read_pos(self):
        """Tokens consumed so far (the producer may watch it to drop idle readers)."""
        return fs_load_acq64(&self.b.read_pos)

    @property
    def available(self):
        """Tokens published and not yet consumed."""
        return fs_load_acq64(&self.b.count) - self.b.read_pos

    @property
    def finished(self):
        return fs_load_acq32(&self.b.finish_code) != 0

    @property
    def finish_code(self):
        """0 while running, then the FINISH_* code."""
        return fs_load_acq32(&self.b.finish_code)

    @property
    def error(self):
        """The error message of a failed request, else None."""
        if fs_load_acq32(&self.b.finish_code) == 0:
            return None
        if self._error is None and self.b.overflowed:
            return f"result buffer full: more than {self.b.capacity} tokens sent to one request"
        return self._error

    @property
    def ready(self):
        """True when a token is available or the request is finished."""
        return fs_load_acq32(&self.b.finish_code) != 0 or fs_load_acq64(&self.b.count) > self.b.read_pos

    # -- consumer side ---------------------------------------------------------

    def take(self):
        """Consume every available token id: list[int], FIFO, possibly empty."""
        cdef int64_t start = self.b.read_pos
        cdef int64_t stop = fs_load_acq64(&self.b.count)
        out = _id_list(self.b.tokens, start, stop)
        fs_store_rel64(&self.b.read_pos, stop)
        return out

    def take_probs(self):
        """Consume every available token with its top-N:
        (ids list[int], top_ids int32[k, n_probs], top_probs float32[k, n_probs])."""
        cdef int64_t start = self.b.read_pos
        cdef int64_t stop = fs_load_acq64(&self.b.count)
        out = (_id_list(self.b.tokens, start, stop),) + self._probs(start, stop)
        fs_store_rel64(&self.b.read_pos, stop)
        return out

    def all_tokens(self):
        """Every token id published so far, from the first, whatever was consumed."""
        return _id_list(self.b.tokens, 0, fs_load_acq64(&self.b.count))

    def all_probs(self):
        """(top_ids int32[count, n_probs], top_probs float32[count, n_probs]) from the first token."""
        return self._probs(0, fs_load_acq64(&self.b.count))

    cdef tuple _probs(self, int64_t start, int64_t stop):
        cdef Py_ssize_t n = self.b.n_probs
        ids = np.empty((stop - start, n), dtype=np.int32)
        probs = np.empty((stop - start, n), dtype=np.float32)
        cdef int32_t[:, ::1] ids_v = ids
        cdef float[:, ::1] probs_v = probs
        if n and stop > start:
            memcpy(&ids_v[0, 0], self.b.top_ids + start * n, (stop - start) * n * sizeof(int32_t))
            memcpy(&probs_v[0, 0], self.b.top_probs + start * n, (stop - start) * n * sizeof(float))
        return ids, probs

    def arm(self, bint finish_only=False):
        """Announce that the consumer is about to park on `waiter` (set it first).
        Returns True: park, a wake will come. False: there is already something to
        read (or the request finished) and the announcement was withdrawn."""
        fs_store_rlx32(&self.b.waiting, WAIT_FINISH if finish_only else WAIT_DATA)
        fs_fence()
        if fs_load_acq32(&self.b.finish_code) != 0 or (
                not finish_only and fs_load_acq64(&self.b.count) > self.b.read_pos):
            fs_xchg32(&self.b.waiting, WAIT_NONE)
            return False
        return True

    def disarm(self):
        """Withdraw the announcement (after a wake, a timeout or a cancelled wait)."""
        fs_xchg32(&self.b.waiting, WAIT_NONE)

    @property
    def waiting(self):
        return fs_load_acq32(&self.b.waiting)

    def __repr__(self):
        return (f"<ResultBuffer {self.count}/{self.b.capacity} tokens, read {self.read_pos}, "
                f"n_probs {self.b.n_probs}, finish {self.finish_code}>")


cdef list _id_list(const int32_t *tokens, int64_t start, int64_t stop):
    cdef list out = PyList_New(stop - start)
    cdef int64_t i
    cdef object v
    for i in range(start, stop):
        v = PyLong_FromLong(tokens[i])
        Py_INCREF(v)  # PyList_SET_ITEM steals a reference
        PyList_SET_ITEM(out, i - start, v)
    return out


cdef int _check_slot(Py_ssize_t slot, Py_ssize_t n_slots) except -1:
    if slot < 0 or slot >= n_slots:
        raise IndexError(f"slot {slot} out of range [0, {n_slots})")
    return 0


cdef void _remove_slot(int32_t *slots, Py_ssize_t *n, int32_t slot) noexcept:
    """Drop `slot` from slots[:n], keeping the order (rare: a detach between claim and wake)."""
    cdef Py_ssize_t i, j = 0
    for i in range(n[0]):
        if slots[i] != slot:
            slots[j] = slots[i]
            j += 1
    n[0] = j


cdef inline bint _send_one(fs_buf *b, int32_t token, const int32_t *ids, const float *probs,
                           Py_ssize_t n_cols) noexcept nogil:
    """Append one token (and its top-N row when the buffer keeps one). Producer only.
    Returns False when nothing was appended (finished or full)."""
    cdef int64_t c = b.count
    cdef Py_ssize_t k, j, n
    if fs_load_rlx32(&b.finish_code) != 0:
        return False
    if c >= b.capacity:
        # Cannot happen with capacity = the slot's context; fail the request, never the step.
        b.overflowed = 1
        fs_store_rel32(&b.finish_code, _ERROR)
        return False
    b.tokens[c] = token
    n = b.n_probs
    if n:
        k = n_cols if n_cols < n else n
        if ids != NULL and k > 0:
            memcpy(b.top_ids + c * n, ids, k * sizeof(int32_t))
            memcpy(b.top_probs + c * n, probs, k * sizeof(float))
        else:
            k = 0
        for j in range(k, n):
            b.top_ids[c * n + j] = -1
            b.top_probs[c * n + j] = 0.0
    fs_store_rel64(&b.count, c + 1)
    return True


cdef class Delivery:
    """The decode thread's side: a slot-indexed table of attached buffers.

    Delivery(n_slots, waker); on the decode thread, per step:
        attach(slot, reader, n_cached)   admitted requests (step boundary)
        send_step(slots, tokens[, probs_ids, probs])   one nogil pass
        finish(slot, code[, error]); detach(slot)      requests that ended
        wake()                           at most ONE waker(buffers) call
    `waker(buffers)` gets the buffers whose waiting consumer has something new;
    fastserve.reader.Waker is the one to hand in. close() at shutdown.
    """

    def __cinit__(self, Py_ssize_t n_slots, waker):
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        if not callable(waker):
            raise TypeError("waker must be callable: waker(buffers)")
        self.n_slots = n_slots
        self.table = <fs_buf **>calloc(n_slots, sizeof(fs_buf *))
        self.ready_slots = <int32_t *>calloc(n_slots, sizeof(int32_t))
        self.ready_flag = <uint8_t *>calloc(n_slots, sizeof(uint8_t))
        if self.table == NULL or self.ready_slots == NULL or self.ready_flag == NULL:
            raise MemoryError(f"delivery table for {n_slots} slots")
        self._bufs = [None] * n_slots
        self._pending = []
        self._waker = waker

    def __dealloc__(self):
        free(self.table)
        free(self.ready_slots)
        free(self.ready_flag)

    @property
    def n_slots(self):
        return self.n_slots

    @property
    def closed(self):
        return self._closed

    def buffer(self, Py_ssize_t slot):
        """The buffer attached to `slot`, or None."""
        _check_slot(slot, self.n_slots)
        return self._bufs[slot]

    def attach(self, Py_ssize_t slot, reader, Py_ssize_t n_cached=0):
        """Route `slot`'s tokens to `reader` (a Reader, or anything whose
        `.buffer` is a ResultBuffer, or a ResultBuffer), and tell it the slot and
        n_cached (its prompt tokens whose KV was reused). Step boundary, GIL held.
        After close() the reader is finished with FINISH_CLOSED at once."""
        _check_slot(slot, self.n_slots)
        cdef ResultBuffer buf = reader if isinstance(reader, ResultBuffer) else getattr(reader, "buffer", reader)
        if self._bufs[slot] is not None:
            raise ValueError(f"slot {slot} already has a reader attached; detach it first")
        if self._closed:
            self._finish_buf(buf, _CLOSED, None)
            self.wake()
            return
        buf.slot, buf.n_cached = slot, n_cached
        self._bufs[slot] = buf
        self.table[slot] = &buf.b

    def detach(self, Py_ssize_t slot):
        """Stop routing `slot`; returns its buffer (or None). The buffer stays
        alive only as long as its consumer holds it."""
        _check_slot(slot, self.n_slots)
        buf = self._bufs[slot]
        if buf is None:
            return None
        if self.ready_flag[slot]:
            # Claimed this step but not woken yet: wake() must still reach it.
            self.ready_flag[slot] = 0
            self._pending.append(buf)
            _remove_slot(self.ready_slots, &self.n_ready, <int32_t>slot)
        self._bufs[slot] = None
        self.table[slot] = NULL
        return buf

    def send_step(self, const int32_t[::1] slots not None, const int32_t[::1] tokens not None,
                  const int32_t[:, ::1] probs_ids=None, const float[:, ::1] probs=None):
        """Deliver tokens[i] (and row i of probs_ids/probs, [n, N]) to slots[i].
        Slots with no reader attached, or already finished, are skipped; so are tokens < 0 (rows after a
        rejected draft: fastserve/_slots.pyx REJECTED)."""
        cdef Py_ssize_t n = slots.shape[0], i, n_cols = 0, sent = 0
        cdef int32_t s
        cdef fs_buf *b
        cdef const int32_t *row_ids = NULL
        cdef const float *row_probs = NULL
        if tokens.shape[0] != n:
            raise ValueError(f"tokens has {tokens.shape[0]} entries for {n} slots")
        if (probs_ids is None) != (probs is None):
            raise ValueError("probs_ids and probs go together: give both or neither")
        if probs_ids is not None:
            if probs_ids.shape[0] != n or probs.shape[0] != n or probs_ids.shape[1] != probs.shape[1]:
                raise ValueError(f"probs_ids {tuple(probs_ids.shape)[:2]} and probs {tuple(probs.shape)[:2]} "
                                 f"must both be [{n}, N]")
            n_cols = probs_ids.shape[1]
        for i in range(n):
            if slots[i] < 0 or slots[i] >= self.n_slots:
                raise IndexError(f"slot {slots[i]} out of range [0, {self.n_slots})")
        with nogil:
            for i in range(n):
                b = self.table[slots[i]]
                if b == NULL or tokens[i] < 0:
                    continue
                if n_cols:
                    row_ids = &probs_ids[i, 0]
                    row_probs = &probs[i, 0]
                if _send_one(b, tokens[i], row_ids, row_probs, n_cols):
                    sent += 1
            # Pair with arm(): our count stores above, their waiting store there.
            fs_fence()
            for i in range(n):
                s = slots[i]
                b = self.table[s]
                if b == NULL or self.ready_flag[s]:
                    continue
                if fs_load_rlx32(&b.waiting) == WAIT_DATA and fs_cas32(&b.waiting, WAIT_DATA, WAIT_NONE):
                    self.ready_flag[s] = 1
                    self.ready_slots[self.n_ready] = s
                    self.n_ready += 1
                elif fs_load_rlx32(&b.finish_code) != 0 and fs_load_rlx32(&b.waiting) != WAIT_NONE \
                        and fs_xchg32(&b.waiting, WAIT_NONE) != WAIT_NONE:
                    # Overflowed above: finished with an error, wake even a finish-only waiter.
                    self.ready_flag[s] = 1
                    self.ready_slots[self.n_ready] = s
                    self.n_ready += 1
        self.tokens_sent += sent

    def finish(self, Py_ssize_t slot, int code, error=None):
        """End `slot`'s request with `code` (> 0) and an optional error message.
        The first finish wins; later sends to the slot are ignored."""
        _check_slot(slot, self.n_slots)
        buf = self._bufs[slot]
        if buf is None:
            raise ValueError(f"slot {slot} has no reader attached")
        self._finish_buf(buf, code, error)

    def reject(self, reader, int code, error=None):
        """Finish a reader that was never attached (refused at admission, or still
        in the inbox at shutdown). It is woken by the next wake()."""
        cdef ResultBuffer buf = reader if isinstance(reader, ResultBuffer) else getattr(reader, "buffer", reader)
        self._finish_buf(buf, code, error)

    cdef int _finish_buf(self, ResultBuffer buf, int32_t code, object error) except -1:
        if code <= 0:
            raise ValueError(f"finish code must be > 0, got {code}")
        if error is not None and not isinstance(error, str):
            raise TypeError("error must be a str or None")
        if fs_load_rlx32(&buf.b.finish_code) != 0:
            return 0
        buf._error = error
        fs_store_rel32(&buf.b.finish_code, code)
        self._claim_finish(buf)
        return 0

    cdef void _claim_finish(self, ResultBuffer buf):
        fs_fence()
        if fs_load_rlx32(&buf.b.waiting) != WAIT_NONE and fs_xchg32(&buf.b.waiting, WAIT_NONE) != WAIT_NONE:
            self._pending.append(buf)

    def wake(self):
        """Once per step: one waker call with every buffer whose waiting consumer
        got data or a finish since the last wake(); no call when there is none."""
        cdef Py_ssize_t i
        cdef int32_t s
        cdef list ready = self._pending
        for i in range(self.n_ready):
            s = self.ready_slots[i]
            if self.ready_flag[s]:
                self.ready_flag[s] = 0
                ready.append(self._bufs[s])
        self.n_ready = 0
        if not ready:
            return 0
        self._pending = []
        self.wakes += 1
        self._waker(ready)
        return len(ready)

    def close(self):
        """Engine shutdown: finish every attached reader with FINISH_CLOSED, detach
        it, and wake every waiting consumer. Later attach() calls finish at once."""
        cdef Py_ssize_t slot
        self._closed = True
        for slot in range(self.n_slots):
            buf = self._bufs[slot]
            if buf is not None:
                self._finish_buf(buf, _CLOSED, None)
                self.detach(slot)
        return self.wake()

    def attached(self):
        """The slots that have a reader attached (a list of ints, for checks and /slots)."""
        return [s for s in range(self.n_slots) if self._bufs[s] is not None]

    def __repr__(self):
        return f"<Delivery {len(self.attached())}/{self.n_slots} slots attached, {self.tokens_sent} tokens sent>"
