# cython: language_level=3
"""N-gram drafts from a slot's own tokens (prompt + output): what speculative decoding proposes.

Two drafters, llama-server's (common/ngram-map.cpp, common/ngram-mod.cpp), with one hash table per slot
instead of a search back through the tokens:
- ngram-simple: the latest earlier place where the slot's last size_n tokens occurred; the draft is
  what followed there, up to size_m tokens (none when fewer than size_n follow, as llama-server);
- ngram-mod: a table of "after these size_n tokens came this one"; the draft is the chain of lookups
  from the slot's last size_n tokens, one token at a time, while found (none when shorter than n_min).
  Lossy on purpose: a hash collision gives a wrong draft, which verification rejects.

Hashing: H(i) is a polynomial hash of tokens[i - size_n + 1 .. i], rolled forward one token at a time
(O(1) per token); each slot indexes its tokens lazily, when it drafts. Every n-gram that ends before the
slot's last token goes in (value: the position that follows it, or the token there); the last one is
looked up. A slot's table is reset when a request starts on it (stale positions would still be checked
by ngram-simple, but ngram-mod cannot tell). Memory: n_slots x 2**bits int32, bits from n_ctx_slot,
at most 2**20 entries per slot.

Drafts read only tokens a slot holds (accepted ones): a rejected draft never enters a table.
fastserve/ref/drafts.py is the twin (same drafts, token for token).
"""
import numpy as np

from libc.stdint cimport int32_t, uint64_t

cdef enum:
    K_SIMPLE = 1
    K_MOD = 2

KINDS = {"ngram-simple": K_SIMPLE, "ngram-mod": K_MOD}

cdef uint64_t MUL = 6364136223846793005ULL     # the polynomial's base (llama-server's ngram-mod multiplier)
cdef uint64_t MIX = 0x9E3779B97F4A7C15ULL      # Fibonacci hashing: the high bits of H * MIX pick the entry


def table_bits(int n_ctx_slot):
    """Entries per slot: 2**bits >= 2 * n_ctx_slot, within [2**10, 2**20]."""
    cdef int bits = 10
    while bits < 20 and (1 << bits) < 2 * n_ctx_slot:
        bits += 1
    return bits


cdef class Drafter:
    cdef readonly int n_slots, n_ctx_slot, kind, size_n, size_m, n_min, bits
    cdef readonly object table, pos, hash, chain
    cdef int32_t[:, ::1] table_v
    cdef int32_t[::1] pos_v, chain_v
    cdef uint64_t[::1] hash_v
    cdef uint64_t top          # MUL ** (size_n - 1): the weight of a window's oldest token

    def __init__(self, int n_slots, int n_ctx_slot, str kind, int size_n, int size_m=0, int n_min=0):
        """kind: "ngram-simple" (size_n lookup, size_m most drafted) or "ngram-mod" (size_n lookup, n_min
        shortest chain proposed)."""
        if kind not in KINDS:
            raise ValueError(f"unknown drafter {kind!r}; known: {', '.join(KINDS)}")
        if size_n < 1:
            raise ValueError(f"the n-gram length must be >= 1, got {size_n}")
        self.n_slots, self.n_ctx_slot, self.kind = n_slots, n_ctx_slot, KINDS[kind]
        self.size_n, self.size_m, self.n_min = size_n, size_m, n_min
        self.bits = table_bits(n_ctx_slot)
        self.table = np.full((n_slots, 1 << self.bits), -1, np.int32)   # [n_slots, 2**bits]
        self.pos = np.full(n_slots, -1, np.int32)       # [n_slots] i: hash[s] = H(i), every n-gram before it in
        self.hash = np.zeros(n_slots, np.uint64)        # [n_slots]
        self.chain = np.zeros(n_ctx_slot, np.int32)     # [n_ctx_slot] ngram-mod's chain, before it is cut
        self.table_v, self.pos_v, self.hash_v, self.chain_v = self.table, self.pos, self.hash, self.chain
        cdef int j
        self.top = 1
        for j in range(size_n - 1):
            self.top *= MUL

    def reset(self, int slot):
        """A request starts on slot: forget what its earlier tokens said."""
        self.table[slot, :] = -1
        self.pos_v[slot] = -1

    def propose(self, const int32_t[:, ::1] tokens not None, const int32_t[::1] n_tokens not None,
                const int32_t[::1] k_max not None, const int32_t[::1] k_min not None,
                int32_t[:, ::1] drafts not None, int32_t[::1] n_draft not None):
        """For every slot s with k_max[s] > 0: index its tokens[s, :n_tokens[s]] and draft at most k_max[s]
        tokens (also at most drafts.shape[1]) into drafts[s]; n_draft[s]: how many (0: none, or fewer than
        k_min[s]). Slots with k_max[s] <= 0 get 0. Returns the tokens drafted."""
        cdef int s, k, total = 0, cap = drafts.shape[1]
        with nogil:
            for s in range(self.n_slots):
                k = 0
                if k_max[s] > 0:
                    self._index(s, &tokens[s, 0], n_tokens[s])
                    k = self._draft(s, &tokens[s, 0], n_tokens[s], min(k_max[s], cap), &drafts[s, 0])
                    if k < k_min[s]:
                        k = 0
                n_draft[s] = k
                total += k
        return total

    cdef inline Py_ssize_t _entry(self, uint64_t h) noexcept nogil:
        return <Py_ssize_t>((h * MIX) >> (64 - self.bits))

    cdef inline uint64_t _roll(self, uint64_t h, int32_t t_out, int32_t t_in) noexcept nogil:
        return (h - <uint64_t>(t_out + 1) * self.top) * MUL + <uint64_t>(t_in + 1)

    cdef void _index(self, int s, const int32_t *t, int n) noexcept nogil:
        """Every n-gram ending before position n - 1 into the table; hash[s] = H(n - 1)."""
        cdef int i = self.pos_v[s], j, N = self.size_n
        cdef uint64_t h = self.hash_v[s]
        if n < N:
            return
        if i >= n:                      # the slot's tokens were cut back: index again (ngram-simple checks)
            i = -1
        if i < 0:
            h = 0
            for j in range(N):
                h = h * MUL + <uint64_t>(t[j] + 1)
            i = N - 1
        while i < n - 1:
            self.table_v[s, self._entry(h)] = i + 1 if self.kind == K_SIMPLE else t[i + 1]
            h = self._roll(h, t[i + 1 - N], t[i + 1])
            i += 1
        self.pos_v[s], self.hash_v[s] = i, h

    cdef int _draft(self, int s, const int32_t *t, int n, int k_max, int32_t *out) noexcept nogil:
        if n < self.size_n or self.pos_v[s] != n - 1:
            return 0
        if self.kind == K_SIMPLE:
            return self._draft_simple(s, t, n, k_max, out)
        return self._draft_mod(s, t, n, k_max, out)

    cdef int _draft_simple(self, int s, const int32_t *t, int n, int k_max, int32_t *out) noexcept nogil:
        cdef int N = self.size_n, p = self.table_v[s, self._entry(self.hash_v[s])], j, k
        if p < N or p >= n:
            return 0
        for j in range(N):              # the entry may be another n-gram's (a collision) or stale
            if t[p - N + j] != t[n - N + j]:
                return 0
        k = min(self.size_m, n - p)
        if k < N:                       # llama-server's rule: fewer than size_n to copy, no draft
            return 0
        k = min(k, k_max)
        for j in range(k):
            out[j] = t[p + j]
        return k

    cdef int _draft_mod(self, int s, const int32_t *t, int n, int k_max, int32_t *out) noexcept nogil:
        cdef int N = self.size_n, j = 0, want = min(max(k_max, self.n_min), self.n_ctx_slot)
        cdef int32_t v, t_out
        cdef uint64_t h = self.hash_v[s]
        # followed to n_min even when fewer are wanted: a chain shorter than n_min is not proposed
        while j < want:
            v = self.table_v[s, self._entry(h)]
            if v < 0:
                break
            self.chain_v[j] = v
            t_out = t[n - N + j] if j < N else self.chain_v[j - N]
            h = self._roll(h, t_out, v)
            j += 1
        if j < self.n_min:
            return 0
        j = min(j, k_max)
        for v in range(j):
            out[v] = self.chain_v[v]
        return j
