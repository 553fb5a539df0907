# cython: language_level=3
"""The batch of one decode step: token ids, positions, slot ids and output rows.

Invariants:
- Allocated once for `capacity` (n_batch) tokens; a step never allocates.
- A slot's tokens are contiguous and in position order.
- out_rows[i] is the batch row whose logits are wanted; row_slot[i] its slot; row_draft[i] the drafted
  token that the next output row (same slot) carries, which output row i's sample must equal for that
  row to count (-1: none; speculative decoding, fastserve/speculation.py).
- Every array is int32, what both backends read without a conversion.
- mark() records (n, n_out, owner) before a slot adds anything; rollback(mark)
  restores exactly that, so a prompt fill that fails halfway leaves no token
  without an owner in the batch.
"""
from libc.stdint cimport int32_t

import numpy as np


cdef class Batch:
    def __init__(self, Py_ssize_t capacity):
        if capacity < 1:
            raise ValueError("batch capacity must be >= 1")
        self.capacity = capacity
        self.tokens = np.zeros(capacity, np.int32)      # [capacity] token ids
        self.positions = np.zeros(capacity, np.int32)   # [capacity] position in the slot's sequence
        self.slots = np.zeros(capacity, np.int32)       # [capacity] slot id
        self.out_rows = np.zeros(capacity, np.int32)    # [capacity] rows whose logits are wanted
        self.row_slot = np.zeros(capacity, np.int32)    # [capacity] slot of each output row
        self.row_draft = np.full(capacity, -1, np.int32)  # [capacity] per output row: the next row's draft or -1
        self.tokens_v, self.positions_v, self.slots_v = self.tokens, self.positions, self.slots
        self.out_rows_v, self.row_slot_v, self.row_draft_v = self.out_rows, self.row_slot, self.row_draft
        self.clear()

    def clear(self):
        self.n = 0
        self.n_out = 0
        self.owner = -1
        self.n_drafted = 0

    def add(self, int32_t token, int32_t pos, int32_t slot, bint output=False):
        """Add one token; raises OverflowError when the batch is full."""
        if not self.push(token, pos, slot, output):
            raise OverflowError(f"batch full ({self.capacity} tokens)")

    def add_draft(self, int32_t token, int32_t pos, int32_t slot):
        """Add a drafted token after slot's output row (push_draft); raises OverflowError when full,
        ValueError when the last output row is not slot's."""
        if self.n >= self.capacity:
            raise OverflowError(f"batch full ({self.capacity} tokens)")
        if not self.push_draft(token, pos, slot):
            raise ValueError(f"a draft follows an output row of its own slot ({slot})")

    @property
    def free(self):
        return self.capacity - self.n

    def mark(self):
        return (self.n, self.n_out, self.owner)

    def rollback(self, mark):
        n, n_out, owner = mark
        if not (0 <= n <= self.n and 0 <= n_out <= self.n_out):
            raise ValueError(f"rollback to {mark} from a batch at ({self.n}, {self.n_out}, {self.owner})")
        self.n, self.n_out, self.owner = n, n_out, owner

    def view(self):
        """(tokens, positions, slots, out_rows, row_slot) trimmed to the current contents (views, no copy)."""
        return (self.tokens[:self.n], self.positions[:self.n], self.slots[:self.n],
                self.out_rows[:self.n_out], self.row_slot[:self.n_out])
