# The batch of one step, preallocated for n_batch tokens. Contract in _batch.pyx.
# Fixed-width ints only: every array is int32 (a C long is 32 bits on Windows, 64 elsewhere).

from libc.stdint cimport int32_t

cdef struct BatchMark:
    Py_ssize_t n
    Py_ssize_t n_out
    int owner

cdef class Batch:
    cdef readonly Py_ssize_t capacity
    cdef public Py_ssize_t n          # tokens in the batch
    cdef public Py_ssize_t n_out      # rows whose logits are wanted
    cdef public int owner             # slot that added tokens last (-1: none)
    cdef public Py_ssize_t n_drafted  # rows that carry a drafted token (speculative decoding)
    cdef int32_t[::1] tokens_v
    cdef int32_t[::1] positions_v
    cdef int32_t[::1] slots_v
    cdef int32_t[::1] out_rows_v
    cdef int32_t[::1] row_slot_v
    cdef int32_t[::1] row_draft_v
    cdef readonly object tokens, positions, slots, out_rows, row_slot, row_draft

    cdef inline bint push(self, int32_t token, int32_t pos, int32_t slot, bint output) noexcept nogil:
        """Add one token; False when the batch is full (nothing is added then)."""
        if self.n >= self.capacity:
            return False
        self.tokens_v[self.n] = token
        self.positions_v[self.n] = pos
        self.slots_v[self.n] = slot
        if output:
            self.out_rows_v[self.n_out] = <int32_t>self.n
            self.row_slot_v[self.n_out] = slot
            self.row_draft_v[self.n_out] = -1
            self.n_out += 1
        self.n += 1
        self.owner = slot
        return True

    cdef inline bint push_draft(self, int32_t token, int32_t pos, int32_t slot) noexcept nogil:
        """Add a drafted token after the same slot's output row: that row's sample is checked against it
        (row_draft), and its own row is an output row too. False when the batch is full."""
        if self.n >= self.capacity or self.n_out == 0 or self.row_slot_v[self.n_out - 1] != slot:
            return False
        self.row_draft_v[self.n_out - 1] = token
        self.n_drafted += 1
        return self.push(token, pos, slot, True)
