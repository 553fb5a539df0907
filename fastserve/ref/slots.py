"""Pure-Python twin of fastserve._slots (same names, same behaviour)."""
import numpy as np

IDLE, PREFILL, DECODE = 0, 1, 2
FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
REJECTED = -2


class SlotTable:
    def __init__(self, n_slots, n_ctx_slot, eog_mask):
        self.n_slots, self.n_ctx_slot = n_slots, n_ctx_slot
        self.state = np.zeros(n_slots, np.int32)
        self.tokens = np.zeros((n_slots, n_ctx_slot), np.int32)
        self.n_tokens = np.zeros(n_slots, np.int32)
        self.n_past = np.zeros(n_slots, np.int32)
        self.n_prompt = np.zeros(n_slots, np.int32)
        self.n_gen = np.zeros(n_slots, np.int32)
        self.max_gen = np.zeros(n_slots, np.int32)
        self.admit_seq = np.zeros(n_slots, np.int64)
        self.n_drafted = np.zeros(n_slots, np.int32)
        self.n_accepted = np.zeros(n_slots, np.int32)
        self.eog = np.ascontiguousarray(eog_mask, dtype=np.uint8)

    def start(self, slot, prompt, n_cached, max_gen, seq):
        n = len(prompt)
        if not (0 < n < self.n_ctx_slot):
            raise ValueError(f"prompt of {n} tokens does not fit a slot of {self.n_ctx_slot}")
        if not (0 <= n_cached < n):
            raise ValueError("n_cached must leave at least the last prompt token to compute")
        self.tokens[slot, :n] = prompt
        self.n_tokens[slot] = n
        self.n_past[slot] = n_cached
        self.n_prompt[slot] = n
        self.n_gen[slot] = 0
        self.max_gen[slot] = max_gen
        self.admit_seq[slot] = seq
        self.n_drafted[slot] = 0
        self.n_accepted[slot] = 0
        self.state[slot] = PREFILL

    def release(self, slot):
        self.state[slot] = IDLE
        self.n_tokens[slot] = self.n_past[slot]

    def forget(self, slot):
        self.state[slot] = IDLE
        self.n_tokens[slot] = 0
        self.n_past[slot] = 0

    def add_decode(self, batch, drafts=None, n_draft=None):
        added = 0
        for s in range(self.n_slots):
            if self.state[s] == DECODE:
                n = int(self.n_tokens[s])
                k = int(n_draft[s]) if drafts is not None else 0
                if k > 0 and (batch.n + 1 + k > batch.capacity or n + k > self.n_ctx_slot):
                    k = 0
                    n_draft[s] = 0
                if not batch.push(int(self.tokens[s, n - 1]), n - 1, s, True):
                    break
                for j in range(k):
                    batch.push_draft(int(drafts[s, j]), n + j, s)
                added += 1
        return added

    def prefill_order(self):
        out = [s for s in range(self.n_slots) if self.state[s] == PREFILL]
        out.sort(key=lambda s: self.admit_seq[s])
        return out

    def add_prefill(self, batch, slot, max_tokens):
        start, end = int(self.n_past[slot]), int(self.n_prompt[slot])
        k = min(end - start, max_tokens, batch.free)
        for i in range(start, start + k):
            batch.push(int(self.tokens[slot, i]), i, slot, i == end - 1)
        return k

    def commit(self, batch, sampled, finish):
        for i in range(batch.n):
            self.n_past[batch.slots[i]] = batch.positions[i] + 1
        cut = -1
        for r in range(batch.n_out):
            s, t, d = int(batch.row_slot[r]), int(sampled[r]), int(batch.row_draft[r])
            if d >= 0:
                self.n_drafted[s] += 1
            if s == cut or t < 0:
                sampled[r] = REJECTED
                finish[r] = FINISH_NONE
                continue
            n = int(self.n_tokens[s])
            self.tokens[s, n] = t
            n += 1
            self.n_tokens[s] = n
            self.n_past[s] = n - 1
            self.n_gen[s] += 1
            self.state[s] = DECODE
            if self.eog[t]:
                finish[r] = FINISH_STOP
            elif self.n_gen[s] >= self.max_gen[s] or n >= self.n_ctx_slot:
                finish[r] = FINISH_LENGTH
            else:
                finish[r] = FINISH_NONE
            if d >= 0:
                if t == d:
                    self.n_accepted[s] += 1
                if t != d or finish[r] != FINISH_NONE:
                    cut = s
