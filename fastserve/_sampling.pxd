# Token sampler: the contract between the engine's decode step and the sampler.
# The rules it follows exactly are written in fastserve/ref/sampling.py (the twin).
from libc.stdint cimport int32_t, uint16_t, uint32_t, uint64_t


# One candidate token. q is its fixed-point weight (see the twin's docstring).
cdef struct Cand:
    float v
    int32_t id
    uint64_t q


# One slot's request parameters and state; written by configure() (GIL held),
# read and advanced by sample() (nogil, decode thread only).
cdef struct SlotParams:
    bint configured
    bint greedy              # temperature <= 0
    bint penalize            # window > 0 and some penalty is not neutral
    bint post_probs          # n_probs lists the kept set after temperature
    bint constrained         # the slot's mask row (Sampler.masks) applies before every other stage
    double temperature
    double top_p             # 1.0: off
    double min_p             # 0.0: off
    int32_t top_k            # 0: no limit; else <= n_vocab
    int32_t n_probs          # 0: no probabilities for this slot
    int32_t n_bias           # entries used in the slot's bias arrays
    float repeat_penalty
    float presence_penalty
    float frequency_penalty
    int32_t window           # repeat_last_n, <= max_penalty_window
    int32_t hist_len         # tokens held in the ring, <= window
    int32_t hist_pos         # next ring position to write
    uint64_t rng             # splitmix64 state


cdef class Sampler:
    cdef readonly Py_ssize_t n_slots
    cdef readonly Py_ssize_t n_vocab
    cdef readonly Py_ssize_t max_penalty_window
    cdef readonly Py_ssize_t max_logit_bias
    cdef double _scale               # 2**QBITS, weights are trunc(w * _scale)
    cdef double _qrange              # logit distance beyond which every weight is 0
    cdef Py_ssize_t _n_blocks        # ceil(n_vocab / BLOCK)

    # per slot (allocated once, sized by the constructor)
    cdef SlotParams *_params         # [n_slots]
    cdef int32_t *_hist              # [n_slots, max_penalty_window] penalty rings
    cdef int32_t *_bias_ids          # [n_slots, max_logit_bias]
    cdef float *_bias_vals           # [n_slots, max_logit_bias]

    # scratch, reused by every row
    cdef int32_t *_counts            # [n_vocab] all zero between rows
    cdef int32_t *_saved_ids         # [max_penalty_window + max_logit_bias] logits to restore
    cdef float *_saved_vals          # [max_penalty_window + max_logit_bias]
    cdef float *_bmax                # [_n_blocks] max logit of each block of the current row
    cdef float *_fheap               # [_n_blocks] heap for the k-th largest block max
    cdef uint64_t *_bmass            # [_n_blocks] draw mass of each block (full-vocab path)
    cdef uint64_t *_bucket           # [N_BUCKETS] top-p mass by logit distance from the max
    cdef uint64_t *_qbuf             # [n_vocab] draw weights (full-vocab path)
    cdef uint16_t *_bk               # [n_vocab] top-p bucket of each token (full-vocab path)
    cdef Cand *_cand                 # [n_vocab] candidates
    cdef readonly object masks       # uint32 [n_slots, n_mask_words]: bit t % 32 of word t // 32 = token t allowed
    cdef readonly Py_ssize_t n_mask_words
    cdef uint32_t *_mask             # masks' data
    cdef readonly object draft_masks # uint32 [n_slots, N_DRAFT_MASKS, n_mask_words]: a constrained slot's drafted rows'
    cdef uint32_t *_draft_mask       # draft_masks' data
    cdef float *_masked              # [n_vocab] a constrained row: its logits, -inf where disallowed

    cdef float _block_max(self, const float *row) noexcept nogil
    cdef int32_t _first_max(self, const float *row, float m) noexcept nogil
    cdef Py_ssize_t _select_top(self, const float *row, Py_ssize_t k, Cand *out) noexcept nogil
    cdef uint64_t _mass(self, const float *row, float m, double temp) noexcept nogil
    cdef uint64_t _pre_probs(self, const float *row, Py_ssize_t n_probs, int32_t *pids, float *pp,
                             float *m_out) noexcept nogil
    cdef void _apply_mask(self, const uint32_t *w, const float *row) noexcept nogil
    cdef Py_ssize_t _adjust(self, SlotParams *sp, Py_ssize_t slot, float *row) noexcept nogil
    cdef int32_t _sample_row(self, SlotParams *sp, Py_ssize_t slot, const uint32_t *mask, float *row,
                             int32_t *pids, float *pprobs, bint own_entry) noexcept nogil
    cdef int32_t _sample_top_k(self, SlotParams *sp, const float *row, float m,
                               int32_t *pids, float *pprobs, float *own) noexcept nogil
    cdef int32_t _sample_full(self, SlotParams *sp, const float *row, float m,
                              int32_t *pids, float *pprobs, float *own) noexcept nogil
