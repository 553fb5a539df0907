"""Pure-Python twin of fastserve._batch (same names, same behaviour)."""
import numpy as np


class Batch:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("batch capacity must be >= 1")
        self.capacity = capacity
        self.tokens = np.zeros(capacity, np.int32)
        self.positions = np.zeros(capacity, np.int32)
        self.slots = np.zeros(capacity, np.int32)
        self.out_rows = np.zeros(capacity, np.int32)
        self.row_slot = np.zeros(capacity, np.int32)
        self.row_draft = np.full(capacity, -1, np.int32)
        self.clear()

    def clear(self):
        self.n = 0
        self.n_out = 0
        self.owner = -1
        self.n_drafted = 0

    def push(self, token, pos, slot, output) -> bool:
        if self.n >= self.capacity:
            return False
        self.tokens[self.n], self.positions[self.n], self.slots[self.n] = token, pos, slot
        if output:
            self.out_rows[self.n_out] = self.n
            self.row_slot[self.n_out] = slot
            self.row_draft[self.n_out] = -1
            self.n_out += 1
        self.n += 1
        self.owner = slot
        return True

    def push_draft(self, token, pos, slot) -> bool:
        if self.n >= self.capacity or self.n_out == 0 or self.row_slot[self.n_out - 1] != slot:
            return False
        self.row_draft[self.n_out - 1] = token
        self.n_drafted += 1
        return self.push(token, pos, slot, True)

    def add(self, token, pos, slot, output=False):
        if not self.push(token, pos, slot, output):
            raise OverflowError(f"batch full ({self.capacity} tokens)")

    def add_draft(self, token, pos, slot):
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
        return (self.tokens[:self.n], self.positions[:self.n], self.slots[:self.n],
                self.out_rows[:self.n_out], self.row_slot[:self.n_out])
