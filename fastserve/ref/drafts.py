"""Pure-Python twin of fastserve._drafts (same names, same drafts token for token): see its docstring."""
import numpy as np

KINDS = {"ngram-simple": 1, "ngram-mod": 2}
MASK64 = (1 << 64) - 1
MUL = 6364136223846793005
MIX = 0x9E3779B97F4A7C15


def table_bits(n_ctx_slot):
    bits = 10
    while bits < 20 and (1 << bits) < 2 * n_ctx_slot:
        bits += 1
    return bits


class Drafter:
    def __init__(self, n_slots, n_ctx_slot, kind, size_n, size_m=0, n_min=0):
        if kind not in KINDS:
            raise ValueError(f"unknown drafter {kind!r}; known: {', '.join(KINDS)}")
        if size_n < 1:
            raise ValueError(f"the n-gram length must be >= 1, got {size_n}")
        self.n_slots, self.n_ctx_slot, self.kind = n_slots, n_ctx_slot, KINDS[kind]
        self.size_n, self.size_m, self.n_min = size_n, size_m, n_min
        self.bits = table_bits(n_ctx_slot)
        self.table = np.full((n_slots, 1 << self.bits), -1, np.int32)
        self.pos = np.full(n_slots, -1, np.int32)
        self.hash = np.zeros(n_slots, np.uint64)
        self.top = pow(MUL, size_n - 1, 1 << 64)

    def reset(self, slot):
        self.table[slot, :] = -1
        self.pos[slot] = -1

    def propose(self, tokens, n_tokens, k_max, k_min, drafts, n_draft):
        total, cap = 0, drafts.shape[1]
        for s in range(self.n_slots):
            k = 0
            if k_max[s] > 0:
                t, n = [int(x) for x in tokens[s, :n_tokens[s]]], int(n_tokens[s])
                self._index(s, t, n)
                out = self._draft(s, t, n, min(int(k_max[s]), cap))
                drafts[s, :len(out)] = out
                k = len(out) if len(out) >= k_min[s] else 0
            n_draft[s] = k
            total += k
        return total

    def _entry(self, h):
        return ((h * MIX) & MASK64) >> (64 - self.bits)

    def _roll(self, h, t_out, t_in):
        return ((h - (t_out + 1) * self.top) * MUL + t_in + 1) & MASK64

    def _index(self, s, t, n):
        i, h, N = int(self.pos[s]), int(self.hash[s]), self.size_n
        if n < N:
            return
        if i >= n:
            i = -1
        if i < 0:
            h = 0
            for j in range(N):
                h = (h * MUL + t[j] + 1) & MASK64
            i = N - 1
        while i < n - 1:
            self.table[s, self._entry(h)] = i + 1 if self.kind == 1 else t[i + 1]
            h = self._roll(h, t[i + 1 - N], t[i + 1])
            i += 1
        self.pos[s], self.hash[s] = i, h

    def _draft(self, s, t, n, k_max):
        if n < self.size_n or self.pos[s] != n - 1:
            return []
        N, h = self.size_n, int(self.hash[s])
        if self.kind == 1:
            p = int(self.table[s, self._entry(h)])
            if p < N or p >= n or t[p - N:p] != t[n - N:n]:
                return []
            k = min(self.size_m, n - p)
            return [] if k < N else t[p:p + min(k, k_max)]
        chain, want = [], min(max(k_max, self.n_min), self.n_ctx_slot)
        while len(chain) < want:
            v = int(self.table[s, self._entry(h)])
            if v < 0:
                break
            j = len(chain)
            chain.append(v)
            h = self._roll(h, t[n - N + j] if j < N else chain[j - N], v)
        return [] if len(chain) < self.n_min else chain[:k_max]
