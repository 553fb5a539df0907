# cython: language_level=3
"""Token sampler over float32 logits [n_rows, n_vocab]: one slot per row, nogil.

What it computes is written once, in the twin fastserve/ref/sampling.py (the
chain, the rank order, the fixed-point weights, the draw); this file gives the
same token ids bit for bit, fast. How:

- Every row starts with one pass of per-block maxima (BLOCK = 64 logits, SSE max
  where the compiler has it). Greedy is that pass plus a scan of one block.
- top_k = k > 0: tau = the k-th largest block max is a lower bound of the k-th
  largest logit, so only blocks whose max reaches tau (about k of them) feed a
  bounded heap of k; then the heap is sorted (k log k).
- top_k <= 0 with top_p < 1: one exp per token that can carry weight (blocks too
  far below the max are skipped), integer mass bucketed by the distance from the
  max; only the bucket where the prefix mass crosses the target is sorted. Integer
  sums do not depend on order, so this finds the same cut as the twin's full sort.
- The draw walks the kept set in id order, block by block, using each block's mass.

Constraints (grammars, JSON schemas; fastserve/grammar.py): a slot configured with constrained=True
reads its row of `masks` (a bit array the engine fills before each step). Its logits are copied into
a scratch row with -inf wherever the bit is 0, before every other stage, so bias, penalties, top-k/p,
min-p and n_probs see only allowed tokens; a constrained row with no allowed candidate yields -1
(unconstrained rows keep "no candidate -> 0"). An unconstrained row pays one branch. A constrained
slot's drafted rows (speculative decoding) read `draft_masks`: row j >= 1 of its run reads
draft_masks[slot, j - 1] (the allowed tokens after its first j drafts), so a slot verifies at most
N_DRAFT_MASKS drafts.

logits: sample() applies bias and penalties in place (at most
max_penalty_window + max_logit_bias entries of a row) and restores the original
values before it returns, so callers see logits unchanged; they must be writable.

Threads: construct and configure() with the GIL; sample() and greedy_rows() run
their loops without it. One call at a time per Sampler (shared scratch): the
decode thread owns it. Nothing is allocated per call beyond argument buffers.
"""
import operator

import numpy as np

from libc.math cimport INFINITY, ceil, exp, log
from libc.stdint cimport INT32_MAX, int32_t, int64_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memset

from fastserve.errors import RequestError
from fastserve.config import SAMPLING_DEFAULTS, check_fits, check_sampling as check_config
from fastserve.ref.sampling import quant_bits

cdef extern from *:
    """
    #include <stdint.h>
    #include <math.h>
    #if defined(__SSE__) || defined(_M_X64) || defined(_M_AMD64)
    #include <xmmintrin.h>
    /* max of p[0..n), NaN ignored, -inf if none: _mm_max_ps(x, acc) yields acc when x is NaN */
    static inline float fs_max_f32(const float *p, Py_ssize_t n) {
        __m128 a = _mm_set1_ps(-INFINITY), b = a, c = a, d = a;
        Py_ssize_t i = 0;
        for (; i + 16 <= n; i += 16) {
            a = _mm_max_ps(_mm_loadu_ps(p + i), a);
            b = _mm_max_ps(_mm_loadu_ps(p + i + 4), b);
            c = _mm_max_ps(_mm_loadu_ps(p + i + 8), c);
            d = _mm_max_ps(_mm_loadu_ps(p + i + 12), d);
        }
        a = _mm_max_ps(_mm_max_ps(a, b), _mm_max_ps(c, d));
        float t[4];
        _mm_storeu_ps(t, a);
        float m = t[0];
        for (int k = 1; k < 4; k++) if (t[k] > m) m = t[k];
        for (; i < n; i++) if (p[i] > m) m = p[i];
        return m;
    }
    #else
    static inline float fs_max_f32(const float *p, Py_ssize_t n) {
        float m0 = -INFINITY, m1 = -INFINITY, m2 = -INFINITY, m3 = -INFINITY;
        Py_ssize_t i = 0;
        for (; i + 4 <= n; i += 4) {
            if (p[i] > m0) m0 = p[i];
            if (p[i + 1] > m1) m1 = p[i + 1];
            if (p[i + 2] > m2) m2 = p[i + 2];
            if (p[i + 3] > m3) m3 = p[i + 3];
        }
        if (m1 > m0) m0 = m1;
        if (m3 > m2) m2 = m3;
        if (m2 > m0) m0 = m2;
        for (; i < n; i++) if (p[i] > m0) m0 = p[i];
        return m0;
    }
    #endif

    static inline uint64_t fs_splitmix64(uint64_t *state) {
        uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        return z ^ (z >> 31);
    }

    /* llama.cpp's penalties on one logit, each operation rounded to float like the twin's
       numpy.float32 arithmetic: the volatile keeps compilers (GCC's default -ffp-contract=fast
       on FMA targets) from fusing count * freq + present into one FMA. */
    static inline float fs_penalize(float x, int32_t count, float repeat, float freq, float present) {
        x = x <= 0.0f ? x * repeat : x / repeat;
        volatile float pen = (float)count * freq;
        return x - (pen + present);
    }

    /* (a * b) >> 64 without a 128-bit type (MSVC has none) */
    static inline uint64_t fs_mulhi64(uint64_t a, uint64_t b) {
        uint64_t a_lo = a & 0xFFFFFFFFu, a_hi = a >> 32, b_lo = b & 0xFFFFFFFFu, b_hi = b >> 32;
        uint64_t ll = a_lo * b_lo, hl = a_hi * b_lo, lh = a_lo * b_hi, hh = a_hi * b_hi;
        uint64_t mid = (ll >> 32) + (hl & 0xFFFFFFFFu) + lh;
        return hh + (hl >> 32) + (mid >> 32);
    }
    """
    float fs_max_f32(const float *p, Py_ssize_t n) nogil
    uint64_t fs_splitmix64(uint64_t *state) nogil
    uint64_t fs_mulhi64(uint64_t a, uint64_t b) nogil
    float fs_penalize(float x, int32_t count, float repeat, float freq, float present) nogil

cdef extern from "<stdlib.h>" nogil:
    void c_qsort "qsort"(void *base, size_t n, size_t size,
                         int (*cmp)(const void *, const void *) noexcept nogil)

cdef enum:
    REJECTED = -2       # a row after a rejected draft (fastserve/_slots.pyx REJECTED)
    N_DRAFT_MASKS = 8   # the most drafts a constrained slot verifies in one call (its draft_masks rows)
    BLOCK = 64          # logits per block of the block-max pass
    N_BUCKETS = 4096    # top-p mass buckets over [0, _qrange] of distance from the max


# -- small pure functions ---------------------------------------------------------

cdef inline uint64_t _weight(float x, float m, double temp, double scale) noexcept nogil:
    """trunc(exp((x - m) / temp) * scale); the row's max m (and x == m == +inf) weigh scale."""
    if x == m:
        return <uint64_t>scale
    # the product is < 2**63: the signed conversion is exact and cheaper than the unsigned one
    return <uint64_t><int64_t>(exp((<double>x - <double>m) / temp) * scale)


cdef inline float _own_prob(float x, float m, double temp, double scale, uint64_t total) noexcept nogil:
    """The sampled token's own probability in a distribution of mass total (the list's float32(q / total)); a
    weight truncated to 0 (a token far below the max: pre-sampling, a hot temperature) by the same exp untruncated."""
    cdef uint64_t q
    if not (x > -INFINITY) or total == 0:
        return 0.0
    q = _weight(x, m, temp, scale)
    if q != 0:
        return <float>(<double>q / <double>total)
    return <float>(exp((<double>x - <double>m) / temp) * scale / <double>total)


cdef inline uint64_t _target(double p, uint64_t total) noexcept nogil:
    cdef uint64_t t = <uint64_t>ceil(p * <double>total)
    return t if t < total else total


cdef inline bint _worse(const Cand *a, const Cand *b) noexcept nogil:
    """a ranks after b: lower logit, or equal logit and higher id."""
    return a.v < b.v or (a.v == b.v and a.id > b.id)


cdef void _sift_down(Cand *h, Py_ssize_t n, Py_ssize_t i) noexcept nogil:
    # heap with the worst candidate at the root
    cdef Cand tmp = h[i]
    cdef Py_ssize_t c
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and _worse(&h[c + 1], &h[c]):
            c += 1
        if not _worse(&h[c], &tmp):
            break
        h[i] = h[c]
        i = c
    h[i] = tmp


cdef void _sift_up(Cand *h, Py_ssize_t i) noexcept nogil:
    cdef Cand tmp = h[i]
    cdef Py_ssize_t p
    while i > 0:
        p = (i - 1) >> 1
        if not _worse(&tmp, &h[p]):
            break
        h[i] = h[p]
        i = p
    h[i] = tmp


cdef float _kth_largest(float *h, const float *vals, Py_ssize_t n, Py_ssize_t k) noexcept nogil:
    """k-th largest of the values > -inf in vals[0..n) (min-heap h[k]); -inf if fewer."""
    cdef Py_ssize_t m = 0, i, j, c
    cdef float x
    for i in range(n):
        x = vals[i]
        if x == -INFINITY:
            continue
        if m < k:
            j = m
            m += 1
            while j > 0 and h[(j - 1) >> 1] > x:
                h[j] = h[(j - 1) >> 1]
                j = (j - 1) >> 1
            h[j] = x
        elif x > h[0]:
            j = 0
            while True:
                c = 2 * j + 1
                if c >= m:
                    break
                if c + 1 < m and h[c + 1] < h[c]:
                    c += 1
                if h[c] >= x:
                    break
                h[j] = h[c]
                j = c
            h[j] = x
    return h[0] if m == k else -INFINITY


cdef int _cmp_rank(const void *pa, const void *pb) noexcept nogil:
    cdef const Cand *a = <const Cand *>pa
    cdef const Cand *b = <const Cand *>pb
    if a.v > b.v:
        return -1
    if a.v < b.v:
        return 1
    return <int>(a.id > b.id) - <int>(a.id < b.id)


cdef int _cmp_id(const void *pa, const void *pb) noexcept nogil:
    cdef const Cand *a = <const Cand *>pa
    cdef const Cand *b = <const Cand *>pb
    return <int>(a.id > b.id) - <int>(a.id < b.id)


cdef inline Py_ssize_t _bucket_of(float x, float m, double bscale, double qrange) noexcept nogil:
    """Bucket of a logit by its distance from the max; N_BUCKETS when it cannot carry weight."""
    cdef double d = 0.0 if x == m else <double>m - <double>x
    if not (d <= qrange):
        return N_BUCKETS
    cdef Py_ssize_t k = <Py_ssize_t>(d * bscale)
    return k if k < N_BUCKETS else N_BUCKETS - 1


cdef inline bint _out_of_range(float bm, float m, double qrange) noexcept nogil:
    """A block whose max logit bm lies more than qrange below the row's max m holds no token of weight > 0
    (nor one at all when empty: -inf)."""
    return bm == -INFINITY or <double>m - <double>bm > qrange


cdef inline bint _member(float x, Py_ssize_t j, double thr, bint cut, float bv, Py_ssize_t bid) noexcept nogil:
    """x (token j) survives min-p (x >= thr) and the top-p cut (ranks at or before (bv, bid))."""
    return x > -INFINITY and <double>x >= thr and (not cut or x > bv or (x == bv and j <= bid))


cdef inline void _write_empty(int32_t *pids, float *pp, Py_ssize_t start, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t j
    for j in range(start, n):
        pids[j] = -1
        pp[j] = 0.0


cdef class Sampler:
    """Per-slot token sampler; see the module docstring and fastserve/ref/sampling.py."""

    def __cinit__(self, Py_ssize_t n_slots, Py_ssize_t n_vocab, Py_ssize_t max_penalty_window=256,
                  Py_ssize_t max_logit_bias=256):
        if n_slots < 1 or n_vocab < 1 or max_penalty_window < 0 or max_logit_bias < 0:
            raise ValueError("n_slots and n_vocab must be >= 1, the maxima >= 0")
        if n_vocab > INT32_MAX:
            raise ValueError(f"n_vocab={n_vocab} does not fit int32 token ids")
        self.n_slots = n_slots
        self.n_vocab = n_vocab
        self.max_penalty_window = max_penalty_window
        self.max_logit_bias = max_logit_bias
        self._n_blocks = (n_vocab + BLOCK - 1) // BLOCK
        bits = quant_bits(n_vocab)
        self._scale = float(1 << bits)
        self._qrange = bits * log(2.0) + 1.0   # exp(-_qrange) * _scale < 1: weight 0
        n_saved = max_penalty_window + max_logit_bias + 1
        self._params = <SlotParams *>calloc(n_slots, sizeof(SlotParams))
        self._hist = <int32_t *>calloc(n_slots * max_penalty_window + 1, sizeof(int32_t))
        self._bias_ids = <int32_t *>calloc(n_slots * max_logit_bias + 1, sizeof(int32_t))
        self._bias_vals = <float *>calloc(n_slots * max_logit_bias + 1, sizeof(float))
        self._counts = <int32_t *>calloc(n_vocab, sizeof(int32_t))
        self._saved_ids = <int32_t *>calloc(n_saved, sizeof(int32_t))
        self._saved_vals = <float *>calloc(n_saved, sizeof(float))
        self._bmax = <float *>calloc(self._n_blocks, sizeof(float))
        self._fheap = <float *>calloc(self._n_blocks, sizeof(float))
        self._bmass = <uint64_t *>calloc(self._n_blocks, sizeof(uint64_t))
        self._bucket = <uint64_t *>calloc(N_BUCKETS, sizeof(uint64_t))
        self._qbuf = <uint64_t *>calloc(n_vocab, sizeof(uint64_t))
        self._cand = <Cand *>calloc(n_vocab, sizeof(Cand))
        self._bk = <uint16_t *>calloc(n_vocab, sizeof(uint16_t))
        self.n_mask_words = (n_vocab + 31) // 32
        self.masks = np.zeros((n_slots, self.n_mask_words), np.uint32)
        cdef uint32_t[:, ::1] mv = self.masks
        self._mask = &mv[0, 0]
        self.draft_masks = np.zeros((n_slots, N_DRAFT_MASKS, self.n_mask_words), np.uint32)
        cdef uint32_t[:, :, ::1] dv = self.draft_masks
        self._draft_mask = &dv[0, 0, 0]
        self._masked = <float *>calloc(n_vocab, sizeof(float))
        if (self._params == NULL or self._hist == NULL or self._bias_ids == NULL
                or self._bias_vals == NULL or self._counts == NULL or self._saved_ids == NULL
                or self._saved_vals == NULL or self._bmax == NULL or self._fheap == NULL
                or self._bmass == NULL or self._bucket == NULL or self._qbuf == NULL
                or self._cand == NULL or self._bk == NULL):
            raise MemoryError("Sampler: cannot allocate its buffers")

    def __dealloc__(self):
        free(self._params)
        free(self._hist)
        free(self._bias_ids)
        free(self._bias_vals)
        free(self._counts)
        free(self._saved_ids)
        free(self._saved_vals)
        free(self._bmax)
        free(self._fheap)
        free(self._bmass)
        free(self._bucket)
        free(self._qbuf)
        free(self._cand)
        free(self._bk)
        free(self._masked)

    def configure(self, slot, *, seed, history=(), constrained=False, **params):
        """Give `slot` a request's parameters (SamplingParams' fields; config.SAMPLING_DEFAULTS for those not
        given), its RNG seed, and its prompt as penalty history;
        constrained: sample only tokens whose bit is set in masks[slot] (the caller fills it).
        Raises RequestError (a ValueError) on a bad value; the slot is then left as it was."""
        try:
            slot = operator.index(slot)
        except TypeError:
            raise RequestError(f"slot must be an integer, got {slot!r}") from None
        if not 0 <= slot < self.n_slots:
            raise RequestError(f"slot {slot} out of range [0, {self.n_slots})")
        cfg = check_config(self.n_vocab, self.max_penalty_window, self.max_logit_bias, seed=seed, history=history,
                           **{**SAMPLING_DEFAULTS, **params})
        self.configure_checked(slot, cfg, constrained)

    def configure_checked(self, Py_ssize_t slot, dict cfg, constrained=False):
        """configure() with parameters check_sampling already normalized (SamplingParams.slot_config):
        only what this sampler's capacities bound is checked again."""
        if not 0 <= slot < self.n_slots:
            raise RequestError(f"slot {slot} out of range [0, {self.n_slots})")
        check_fits(cfg, self.max_penalty_window, self.max_logit_bias)
        cdef SlotParams *sp = &self._params[slot]
        cdef Py_ssize_t base, i
        memset(sp, 0, sizeof(SlotParams))
        sp.temperature = cfg["temperature"]
        sp.greedy = sp.temperature <= 0.0
        sp.top_k = cfg["top_k"]
        sp.top_p = cfg["top_p"]
        sp.min_p = cfg["min_p"]
        sp.repeat_penalty = cfg["repeat_penalty"]
        sp.presence_penalty = cfg["presence_penalty"]
        sp.frequency_penalty = cfg["frequency_penalty"]
        sp.window = cfg["repeat_last_n"]
        sp.penalize = sp.window > 0 and not (sp.repeat_penalty == 1.0 and sp.frequency_penalty == 0.0
                                             and sp.presence_penalty == 0.0)
        sp.n_probs = cfg["n_probs"]
        sp.post_probs = cfg["post_sampling_probs"]
        sp.constrained = bool(constrained)
        sp.rng = cfg["seed"]
        base = slot * self.max_logit_bias
        for i, (tok, b) in enumerate(cfg["logit_bias"]):
            self._bias_ids[base + i] = tok
            self._bias_vals[base + i] = b
        sp.n_bias = len(cfg["logit_bias"])
        base = slot * self.max_penalty_window
        for i, tok in enumerate(cfg["history"]):
            self._hist[base + i] = tok
        sp.hist_len = len(cfg["history"])
        sp.hist_pos = sp.hist_len % sp.window if sp.window > 0 else 0
        sp.configured = True

    def history(self, slot):
        """The slot's penalty window, oldest token first (a new list)."""
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.n_slots})")
        cdef SlotParams *sp = &self._params[<Py_ssize_t>slot]
        cdef int32_t *h = self._hist + <Py_ssize_t>slot * self.max_penalty_window
        if sp.hist_len < sp.window:
            return [h[i] for i in range(sp.hist_len)]
        return [h[(sp.hist_pos + i) % sp.window] for i in range(sp.window)]

    def greedy_rows(self, const float[:, ::1] logits not None, int32_t[::1] out_ids not None):
        """out_ids[r] = argmax of logits[r] for every row: ties -> lowest id, NaN ignored,
        no candidate -> 0. No slot is read or advanced (for steps where every row is
        greedy with no penalties, bias or probabilities)."""
        cdef Py_ssize_t r, n_rows = logits.shape[0]
        cdef float m
        if logits.shape[1] != self.n_vocab or out_ids.shape[0] < n_rows:
            raise ValueError(f"logits must be [n_rows, {self.n_vocab}] and out_ids at least n_rows long")
        with nogil:
            for r in range(n_rows):
                m = self._block_max(&logits[r, 0])
                out_ids[r] = self._first_max(&logits[r, 0], m)

    def sample(self, float[:, ::1] logits not None, const int32_t[::1] row_slot not None,
               int32_t[::1] out_ids not None, int32_t[:, ::1] probs_ids=None, float[:, ::1] probs=None,
               const int32_t[::1] drafts=None):
        """Sample one token per row r for slot row_slot[r] into out_ids[r] and append it
        to that slot's penalty history.

        logits [>= n_rows, n_vocab] float32 (restored before return), row_slot [n_rows]
        int32, out_ids [>= n_rows] int32. Only rows whose slot has n_probs = n > 0 write
        probs_ids[r, :n] (int32 ids, -1 past the candidates) and probs[r, :n] (float32);
        both may be None when no slot in the call asked for probabilities. Where the arrays have
        more than n columns, column n gets the sampled token's own entry: its id and its probability
        in the distribution the list is taken from, also when it is not among the n (a hot
        temperature); probability 0 when the row had no candidate.
        drafts [>= n_rows] int32 (speculative decoding; the batch's row_draft), or None: drafts[r] >= 0 is
        the token the next row (same slot) was fed; when row r's sample differs from it, the rows after r
        up to the slot's last one (drafts == -1) are not sampled (out_ids REJECTED, -2): no draw, no
        history, exactly as if they had never been computed.
        """
        cdef Py_ssize_t n_rows = row_slot.shape[0], r, s
        cdef SlotParams *sp
        cdef int32_t *pids
        cdef float *pp
        cdef const int32_t *dr = NULL
        cdef bint skip = False, own_entry
        cdef Py_ssize_t j = 0           # a row's place in its slot's run of drafted rows
        cdef const uint32_t *mask
        if drafts is not None and n_rows > 0:
            if drafts.shape[0] < n_rows:
                raise ValueError(f"drafts needs at least {n_rows} entries")
            dr = &drafts[0]
        if logits.shape[1] != self.n_vocab:
            raise ValueError(f"logits must be [n_rows, {self.n_vocab}], got {logits.shape[1]} columns")
        if logits.shape[0] < n_rows or out_ids.shape[0] < n_rows:
            raise ValueError(f"logits and out_ids need at least {n_rows} rows")
        for r in range(n_rows):
            s = row_slot[r]
            if s < 0 or s >= self.n_slots:
                raise ValueError(f"row {r}: slot {s} out of range [0, {self.n_slots})")
            sp = &self._params[s]
            if not sp.configured:
                raise ValueError(f"row {r}: slot {s} was never configured")
            j = j + 1 if dr != NULL and r > 0 and dr[r - 1] >= 0 else 0
            if sp.constrained and j > N_DRAFT_MASKS:
                raise ValueError(f"row {r}: a constrained slot verifies at most {N_DRAFT_MASKS} drafts")
            if sp.n_probs > 0 and (probs_ids is None or probs is None
                                   or probs_ids.shape[0] <= r or probs_ids.shape[1] < sp.n_probs
                                   or probs.shape[0] <= r or probs.shape[1] < sp.n_probs):
                raise ValueError(f"row {r}: slot {s} asked for n_probs={sp.n_probs}; probs_ids and "
                                 f"probs must be at least [{r + 1}, {sp.n_probs}]")
        with nogil:
            for r in range(n_rows):
                j = j + 1 if dr != NULL and r > 0 and dr[r - 1] >= 0 else 0
                if skip:                # after a rejected draft: up to the slot's last row
                    out_ids[r] = REJECTED
                    skip = dr[r] >= 0
                    continue
                s = row_slot[r]
                sp = &self._params[s]
                pids = NULL
                pp = NULL
                own_entry = False
                if sp.n_probs > 0:
                    pids = &probs_ids[r, 0]
                    pp = &probs[r, 0]
                    own_entry = probs_ids.shape[1] > sp.n_probs and probs.shape[1] > sp.n_probs
                mask = self._mask + s * self.n_mask_words if j == 0 else \
                    self._draft_mask + (s * N_DRAFT_MASKS + j - 1) * self.n_mask_words
                out_ids[r] = self._sample_row(sp, s, mask, &logits[r, 0], pids, pp, own_entry)
                skip = dr != NULL and dr[r] >= 0 and out_ids[r] != dr[r]

    # -- one row (nogil) ---------------------------------------------------------

    cdef float _block_max(self, const float *row) noexcept nogil:
        """Fill _bmax with each block's max (NaN ignored) and return the row's max."""
        cdef Py_ssize_t b, lo, n = self.n_vocab
        cdef float m = -INFINITY, x
        for b in range(self._n_blocks):
            lo = b * BLOCK
            x = fs_max_f32(row + lo, BLOCK if lo + BLOCK <= n else n - lo)
            self._bmax[b] = x
            if x > m:
                m = x
        return m

    cdef int32_t _first_max(self, const float *row, float m) noexcept nogil:
        """Lowest id whose logit is m (the row's max, _bmax current); 0 if m is -inf."""
        cdef Py_ssize_t b, j, hi
        if m == -INFINITY:
            return 0
        for b in range(self._n_blocks):
            if self._bmax[b] == m:
                hi = min((b + 1) * BLOCK, self.n_vocab)
                for j in range(b * BLOCK, hi):
                    if row[j] == m:
                        return <int32_t>j
        return 0

    cdef Py_ssize_t _select_top(self, const float *row, Py_ssize_t k, Cand *out) noexcept nogil:
        """The first k candidates in rank order into out[0..n), best first; returns n <= k.
        _bmax must be current for row."""
        cdef Py_ssize_t b, j, hi, n = 0
        cdef float tau = -INFINITY, x, bm
        if k <= 0:
            return 0
        if k <= self._n_blocks:
            tau = _kth_largest(self._fheap, self._bmax, self._n_blocks, k)
        for b in range(self._n_blocks):
            bm = self._bmax[b]
            if bm < tau or bm == -INFINITY or (n == k and bm <= out[0].v):
                continue
            hi = min((b + 1) * BLOCK, self.n_vocab)
            for j in range(b * BLOCK, hi):
                x = row[j]
                if not (x >= tau) or x == -INFINITY:
                    continue
                if n < k:
                    out[n].v = x
                    out[n].id = <int32_t>j
                    out[n].q = 0
                    _sift_up(out, n)
                    n += 1
                elif x > out[0].v:   # ids grow, so an equal logit ranks after the root
                    out[0].v = x
                    out[0].id = <int32_t>j
                    _sift_down(out, n, 0)
        j = n - 1
        while j > 0:   # heap sort: the worst goes to the back, so out ends best first
            out[0], out[j] = out[j], out[0]
            _sift_down(out, j, 0)
            j -= 1
        return n

    cdef uint64_t _mass(self, const float *row, float m, double temp) noexcept nogil:
        """Sum of the weights of every candidate (_bmax current, m its max)."""
        cdef Py_ssize_t b, j, hi
        cdef uint64_t total = 0
        cdef float x, bm
        for b in range(self._n_blocks):
            bm = self._bmax[b]
            if bm == -INFINITY or (<double>m - <double>bm) / temp > self._qrange:
                continue
            hi = min((b + 1) * BLOCK, self.n_vocab)
            for j in range(b * BLOCK, hi):
                x = row[j]
                if x > -INFINITY:
                    total += _weight(x, m, temp, self._scale)
        return total

    cdef uint64_t _pre_probs(self, const float *row, Py_ssize_t n_probs, int32_t *pids, float *pp,
                             float *m_out) noexcept nogil:
        """Top n_probs of softmax(raw row), temperature 1, over the whole vocab; returns its mass (0: no
        candidate) and its max in m_out (for the sampled token's own probability)."""
        cdef float m = self._block_max(row)
        cdef Py_ssize_t j, n
        cdef uint64_t total
        m_out[0] = m
        if m == -INFINITY:
            _write_empty(pids, pp, 0, n_probs)
            return 0
        total = self._mass(row, m, 1.0)
        n = self._select_top(row, n_probs, self._cand)
        for j in range(n):
            pids[j] = self._cand[j].id
            pp[j] = <float>(<double>_weight(self._cand[j].v, m, 1.0, self._scale) / <double>total)
        _write_empty(pids, pp, n, n_probs)
        return total

    cdef void _apply_mask(self, const uint32_t *w, const float *row) noexcept nogil:
        """_masked = row where the mask w allows, -inf elsewhere."""
        cdef float *out = self._masked
        cdef Py_ssize_t i, j, base, n
        cdef uint32_t word
        for i in range(self.n_mask_words):
            word = w[i]
            base = i * 32
            n = min(<Py_ssize_t>32, self.n_vocab - base)
            if word == 0:
                for j in range(n):
                    out[base + j] = -INFINITY
            elif word == 0xFFFFFFFFu:
                memcpy(out + base, row + base, n * sizeof(float))
            else:
                for j in range(n):
                    out[base + j] = row[base + j] if (word >> j) & 1u else -INFINITY

    cdef Py_ssize_t _adjust(self, SlotParams *sp, Py_ssize_t slot, float *row) noexcept nogil:
        """Logit bias, then penalties, in place; the originals go to _saved_*. Returns their count."""
        cdef Py_ssize_t i, n = 0, t
        cdef int32_t c
        cdef int32_t *ids = self._bias_ids + slot * self.max_logit_bias
        cdef float *vals = self._bias_vals + slot * self.max_logit_bias
        cdef int32_t *h = self._hist + slot * self.max_penalty_window
        for i in range(sp.n_bias):
            t = ids[i]
            self._saved_ids[n] = <int32_t>t
            self._saved_vals[n] = row[t]
            n += 1
            row[t] = row[t] + vals[i]
        if sp.penalize and sp.hist_len > 0:
            for i in range(sp.hist_len):
                self._counts[h[i]] += 1
            for i in range(sp.hist_len):
                t = h[i]
                c = self._counts[t]
                if c == 0:
                    continue   # already penalized (a repeat within the window)
                self._counts[t] = 0
                self._saved_ids[n] = <int32_t>t
                self._saved_vals[n] = row[t]
                n += 1
                row[t] = fs_penalize(row[t], c, sp.repeat_penalty, sp.frequency_penalty,
                                     sp.presence_penalty)
        return n

    cdef int32_t _sample_row(self, SlotParams *sp, Py_ssize_t slot, const uint32_t *mask, float *row,
                             int32_t *pids, float *pprobs, bint own_entry) noexcept nogil:
        """own_entry: pids[n_probs] / pprobs[n_probs] get the sampled token's own entry."""
        cdef Py_ssize_t n_saved, i
        cdef float m, m_raw = -INFINITY, own = 0.0
        cdef uint64_t total_raw = 0
        cdef int32_t tok
        cdef int32_t *h
        if sp.constrained:      # the unconstrained row's one branch
            self._apply_mask(mask, row)
            row = self._masked
        if sp.n_probs > 0 and not sp.post_probs:
            total_raw = self._pre_probs(row, sp.n_probs, pids, pprobs, &m_raw)
        n_saved = self._adjust(sp, slot, row)
        m = self._block_max(row)
        if m == -INFINITY:      # no candidate (a constrained row: none allowed)
            tok = -1 if sp.constrained else 0
            if sp.n_probs > 0 and sp.post_probs:
                _write_empty(pids, pprobs, 0, sp.n_probs)
        elif sp.greedy:
            tok = self._first_max(row, m)
            own = 1.0
            if sp.n_probs > 0 and sp.post_probs:
                pids[0] = tok
                pprobs[0] = 1.0
                _write_empty(pids, pprobs, 1, sp.n_probs)
        elif sp.top_k > 0:
            tok = self._sample_top_k(sp, row, m, pids, pprobs, &own)
        else:
            tok = self._sample_full(sp, row, m, pids, pprobs, &own)
        i = n_saved - 1
        while i >= 0:   # backwards: a token both biased and penalized gets its first saved value
            row[self._saved_ids[i]] = self._saved_vals[i]
            i -= 1
        if own_entry:
            if not sp.post_probs:   # the raw row's softmax, as the list: row[tok] is raw again
                own = _own_prob(row[tok], m_raw, 1.0, self._scale, total_raw) if tok >= 0 else 0.0
            pids[sp.n_probs] = tok
            pprobs[sp.n_probs] = own
        if sp.window > 0 and tok >= 0:
            h = self._hist + slot * self.max_penalty_window
            h[sp.hist_pos] = tok
            sp.hist_pos = (sp.hist_pos + 1) % sp.window
            if sp.hist_len < sp.window:
                sp.hist_len += 1
        return tok

    cdef int32_t _sample_top_k(self, SlotParams *sp, const float *row, float m,
                               int32_t *pids, float *pprobs, float *own) noexcept nogil:
        """The kept set's draw; own: the drawn token's share of the kept set."""
        cdef Cand *c = self._cand
        cdef Py_ssize_t n, i
        cdef uint64_t total = 0, target, cum = 0, r
        cdef double thr
        n = self._select_top(row, sp.top_k, c)
        if sp.top_p < 1.0:
            for i in range(n):
                c[i].q = _weight(c[i].v, m, 1.0, self._scale)
                total += c[i].q
            target = _target(sp.top_p, total)
            for i in range(n):
                cum += c[i].q
                if cum >= target:
                    n = i + 1
                    break
        if sp.min_p > 0.0:
            thr = <double>m + log(sp.min_p)
            for i in range(n):
                if <double>c[i].v < thr:
                    n = i
                    break
        total = 0
        for i in range(n):
            c[i].q = _weight(c[i].v, m, sp.temperature, self._scale)
            total += c[i].q
        if sp.n_probs > 0 and sp.post_probs:
            for i in range(min(n, <Py_ssize_t>sp.n_probs)):
                pids[i] = c[i].id
                pprobs[i] = <float>(<double>c[i].q / <double>total)
            _write_empty(pids, pprobs, n, sp.n_probs)
        r = fs_mulhi64(fs_splitmix64(&sp.rng), total)
        if n > 1:
            c_qsort(c, n, sizeof(Cand), _cmp_id)
        cum = 0
        for i in range(n):
            cum += c[i].q
            if cum > r:
                own[0] = <float>(<double>c[i].q / <double>total)
                return c[i].id
        return c[n - 1].id   # unreachable: r < total

    cdef int32_t _sample_full(self, SlotParams *sp, const float *row, float m,
                              int32_t *pids, float *pprobs, float *own) noexcept nogil:
        """top_k <= 0: the kept set is {min-p} and, with top_p < 1, the rank prefix ending at
        the boundary token (bv, bid); own: the drawn token's share of the kept set."""
        cdef Cand *c = self._cand
        cdef uint64_t *qbuf = self._qbuf
        cdef Py_ssize_t b, j, hi, k, n, i
        cdef uint64_t total = 0, target, cum, q, s, r
        cdef double thr = -INFINITY, temp = sp.temperature, qrange = self._qrange
        cdef double bscale = N_BUCKETS / qrange
        cdef bint cut = sp.top_p < 1.0
        cdef float bv = INFINITY, x, bm
        cdef Py_ssize_t bid = -1
        if sp.min_p > 0.0:
            thr = <double>m + log(sp.min_p)
        if cut:
            memset(self._bucket, 0, N_BUCKETS * sizeof(uint64_t))
            for b in range(self._n_blocks):
                if _out_of_range(self._bmax[b], m, qrange):
                    continue
                hi = min((b + 1) * BLOCK, self.n_vocab)
                for j in range(b * BLOCK, hi):
                    x = row[j]
                    q = _weight(x, m, 1.0, self._scale) if x > -INFINITY else 0
                    if q != 0:
                        k = _bucket_of(x, m, bscale, qrange)
                        self._bucket[k] += q
                        total += q
                        self._bk[j] = <uint16_t>k
                    else:
                        self._bk[j] = N_BUCKETS
            target = _target(sp.top_p, total)
            if target == 0:
                bv = m
                bid = self._first_max(row, m)
            else:
                cum = 0
                for k in range(N_BUCKETS):
                    if cum + self._bucket[k] >= target:
                        break
                    cum += self._bucket[k]
                n = 0
                for b in range(self._n_blocks):
                    if _out_of_range(self._bmax[b], m, qrange):
                        continue
                    hi = min((b + 1) * BLOCK, self.n_vocab)
                    for j in range(b * BLOCK, hi):
                        if self._bk[j] == k:
                            c[n].v = row[j]
                            c[n].id = <int32_t>j
                            c[n].q = _weight(row[j], m, 1.0, self._scale)
                            n += 1
                if n > 1:
                    c_qsort(c, n, sizeof(Cand), _cmp_rank)
                for i in range(n):
                    cum += c[i].q
                    if cum >= target:
                        bv = c[i].v
                        bid = c[i].id
                        break

        # draw weights of the kept set, per block, then the pick
        total = 0
        for b in range(self._n_blocks):
            bm = self._bmax[b]
            self._bmass[b] = 0
            if (not (bm > -INFINITY) or <double>bm < thr or (cut and bm < bv)
                    or (<double>m - <double>bm) / temp > qrange):
                continue
            hi = min((b + 1) * BLOCK, self.n_vocab)
            s = 0
            for j in range(b * BLOCK, hi):
                x = row[j]
                q = _weight(x, m, temp, self._scale) if _member(x, j, thr, cut, bv, bid) else 0
                qbuf[j] = q
                s += q
            self._bmass[b] = s
            total += s
        if sp.n_probs > 0 and sp.post_probs:
            n = self._select_top(row, sp.n_probs, c)
            for i in range(n):
                if not _member(c[i].v, c[i].id, thr, cut, bv, bid):
                    n = i
                    break
                pids[i] = c[i].id
                pprobs[i] = <float>(<double>_weight(c[i].v, m, temp, self._scale) / <double>total)
            _write_empty(pids, pprobs, n, sp.n_probs)
        r = fs_mulhi64(fs_splitmix64(&sp.rng), total)
        cum = 0
        for b in range(self._n_blocks):
            if cum + self._bmass[b] <= r:
                cum += self._bmass[b]
                continue
            hi = min((b + 1) * BLOCK, self.n_vocab)
            for j in range(b * BLOCK, hi):
                cum += qbuf[j]
                if cum > r:
                    own[0] = <float>(<double>qbuf[j] / <double>total)
                    return <int32_t>j
        return self._first_max(row, m)   # unreachable: r < total
