# cython: language_level=3
"""The slot table: per-slot bookkeeping of a step, typed, without the GIL.

A slot holds one sequence: tokens[s, :n_tokens] (prompt, then generated), of
which the first n_past have KV written in the backend's cache.
States: IDLE (free; its tokens[:n_tokens] are still a reusable KV prefix),
PREFILL (prompt tokens n_past..n_prompt still to run), DECODE (feeds its
last token each step, and with speculative decoding the tokens drafted after it).

Speculative decoding: a DECODE slot with a draft d1..dk adds 1 + k output rows
(its last token, then d1..dk at the following positions). commit() keeps the
longest prefix the sampler agreed with: row j's sample counts only while every
earlier row's sample equalled the next row's draft; the first one that differs is
the slot's last new token (the sampler's own pick there), and every row after it
is REJECTED (-2 in sampled: nothing is appended or delivered). n_past is then
n_tokens - 1, so the KV of rejected positions is past the slot's length: stale,
never read, overwritten by the next step.

Invariants:
- n_past <= n_tokens <= n_ctx_slot; n_past only grows in commit(), after a
  forward pass really wrote the KV rows (and only over accepted tokens).
- the decode thread is the only caller (contract 1 of DESIGN.md).
"""
import numpy as np

from libc.stdint cimport int64_t

from fastserve._batch cimport Batch

cdef enum:
    S_IDLE = 0
    S_PREFILL = 1
    S_DECODE = 2
    F_NONE = 0
    F_STOP = 1
    F_LENGTH = 2
    T_REJECTED = -2

IDLE, PREFILL, DECODE = S_IDLE, S_PREFILL, S_DECODE
FINISH_NONE, FINISH_STOP, FINISH_LENGTH = F_NONE, F_STOP, F_LENGTH
REJECTED = T_REJECTED      # a sampled id of a row after a rejected draft: not a token


cdef class SlotTable:
    cdef readonly int n_slots, n_ctx_slot
    cdef readonly object state, tokens, n_tokens, n_past, n_prompt, n_gen, max_gen, admit_seq, eog
    cdef readonly object n_drafted, n_accepted
    cdef int[::1] state_v, n_tokens_v, n_past_v, n_prompt_v, n_gen_v, max_gen_v, n_drafted_v, n_accepted_v
    cdef int64_t[::1] admit_seq_v
    cdef int[:, ::1] tokens_v
    cdef unsigned char[::1] eog_v

    def __init__(self, int n_slots, int n_ctx_slot, eog_mask):
        self.n_slots, self.n_ctx_slot = n_slots, n_ctx_slot
        self.state = np.zeros(n_slots, np.int32)
        self.tokens = np.zeros((n_slots, n_ctx_slot), np.int32)   # [n_slots, n_ctx_slot]
        self.n_tokens = np.zeros(n_slots, np.int32)
        self.n_past = np.zeros(n_slots, np.int32)
        self.n_prompt = np.zeros(n_slots, np.int32)
        self.n_gen = np.zeros(n_slots, np.int32)
        self.max_gen = np.zeros(n_slots, np.int32)
        self.admit_seq = np.zeros(n_slots, np.int64)
        self.n_drafted = np.zeros(n_slots, np.int32)              # [n_slots] this request's drafted tokens
        self.n_accepted = np.zeros(n_slots, np.int32)             # [n_slots] ... of which accepted
        self.n_drafted_v, self.n_accepted_v = self.n_drafted, self.n_accepted
        self.eog = np.ascontiguousarray(eog_mask, dtype=np.uint8)  # [n_vocab] 1 = ends generation
        self.state_v, self.tokens_v, self.n_tokens_v = self.state, self.tokens, self.n_tokens
        self.n_past_v, self.n_prompt_v, self.n_gen_v = self.n_past, self.n_prompt, self.n_gen
        self.max_gen_v, self.admit_seq_v, self.eog_v = self.max_gen, self.admit_seq, self.eog

    def start(self, int slot, prompt, int n_cached, int max_gen, int64_t seq):
        """Put a request's prompt into a free slot; the first n_cached tokens' KV is reused."""
        cdef Py_ssize_t n = len(prompt)
        if not (0 < n < self.n_ctx_slot):
            raise ValueError(f"prompt of {n} tokens does not fit a slot of {self.n_ctx_slot}")
        if not (0 <= n_cached < n):
            raise ValueError("n_cached must leave at least the last prompt token to compute")
        self.tokens[slot, :n] = prompt
        self.n_tokens_v[slot] = n
        self.n_past_v[slot] = n_cached
        self.n_prompt_v[slot] = n
        self.n_gen_v[slot] = 0
        self.max_gen_v[slot] = max_gen
        self.admit_seq_v[slot] = seq
        self.n_drafted_v[slot] = 0
        self.n_accepted_v[slot] = 0
        self.state_v[slot] = S_PREFILL

    def release(self, int slot):
        """Free the slot. Its KV prefix (tokens[:n_past]) stays reusable."""
        self.state_v[slot] = S_IDLE
        self.n_tokens_v[slot] = self.n_past_v[slot]

    def forget(self, int slot):
        """Free the slot and drop its KV prefix (erase)."""
        self.state_v[slot] = S_IDLE
        self.n_tokens_v[slot] = 0
        self.n_past_v[slot] = 0

    def add_decode(self, Batch batch, drafts=None, n_draft=None):
        """Add the last token of every DECODE slot (one output row each) and, when drafts (int32 [n_slots, K])
        and n_draft (int32 [n_slots]) are given, the first n_draft[s] drafted tokens after it (output rows
        too). A draft that does not fit the batch whole is dropped (n_draft[s] = 0). Returns the slots added."""
        cdef int s, added = 0, n, j, k
        cdef int[:, ::1] dv
        cdef int[::1] nv
        cdef bint drafting = drafts is not None
        if drafting:
            dv, nv = drafts, n_draft
        with nogil:
            for s in range(self.n_slots):
                if self.state_v[s] == S_DECODE:
                    n = self.n_tokens_v[s]
                    k = nv[s] if drafting else 0
                    if k > 0 and (batch.n + 1 + k > batch.capacity or n + k > self.n_ctx_slot):
                        k = 0
                        nv[s] = 0
                    if not batch.push(self.tokens_v[s, n - 1], n - 1, s, True):
                        break
                    for j in range(k):
                        batch.push_draft(dv[s, j], n + j, s)
                    added += 1
        return added

    def prefill_order(self):
        """PREFILL slots, oldest admission first."""
        cdef list out = [s for s in range(self.n_slots) if self.state_v[s] == S_PREFILL]
        out.sort(key=lambda s: self.admit_seq_v[s])
        return out

    def add_prefill(self, Batch batch, int slot, int max_tokens):
        """Add up to max_tokens of the slot's pending prompt; the prompt's last token is an output row."""
        cdef int start = self.n_past_v[slot], end = self.n_prompt_v[slot], i, k
        k = min(end - start, max_tokens, <int>batch.free)
        with nogil:
            for i in range(start, start + k):
                batch.push(self.tokens_v[slot, i], i, slot, i == end - 1)
        return k

    def commit(self, Batch batch, int[::1] sampled, signed char[::1] finish):
        """After forward + sampling: KV of every batch row is written; append each sampled token.

        sampled[r], finish[r] belong to output row r (batch.row_slot[r]). finish gets
        FINISH_STOP (end-of-generation token), FINISH_LENGTH (max tokens or slot full) or FINISH_NONE.
        A slot's rows after its first sample that differs from the next row's draft (batch.row_draft), or
        after the row that ends it, become REJECTED in sampled (finish NONE); n_drafted / n_accepted count."""
        cdef Py_ssize_t i, r
        cdef int s, t, n, d, cut = -1
        with nogil:
            for i in range(batch.n):
                self.n_past_v[batch.slots_v[i]] = batch.positions_v[i] + 1
            for r in range(batch.n_out):
                s = batch.row_slot_v[r]
                t = sampled[r]
                d = batch.row_draft_v[r]
                if d >= 0:
                    self.n_drafted_v[s] += 1
                if s == cut or t < 0:
                    sampled[r] = T_REJECTED
                    finish[r] = F_NONE
                    continue
                n = self.n_tokens_v[s]
                self.tokens_v[s, n] = t
                n += 1
                self.n_tokens_v[s] = n
                self.n_past_v[s] = n - 1
                self.n_gen_v[s] += 1
                self.state_v[s] = S_DECODE
                if self.eog_v[t]:
                    finish[r] = F_STOP
                elif self.n_gen_v[s] >= self.max_gen_v[s] or n >= self.n_ctx_slot:
                    finish[r] = F_LENGTH
                else:
                    finish[r] = F_NONE
                if d >= 0:
                    if t == d:
                        self.n_accepted_v[s] += 1
                    if t != d or finish[r] != F_NONE:
                        cut = s
