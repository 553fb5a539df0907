# The C-level contract of fastserve.backends.cpu._attention, for callers that run a whole forward pass without the
# GIL (fastserve.backends.cpu._forward): one layer's cache as a plain struct, the store and attention on raw pointers.
#
#   from fastserve.backends.cpu._attention cimport Attention, kv_layer, store_rows
#   store_rows(&kv, k, v, ld, slots, pos, n)                          # nogil
#   attn.run(q, n, H, &kv, slots, pos, out, scale, window, sinks)     # nogil; 0, or -1: out of memory
#   (sinks: float32 [H] each head's sink logit, or NULL)
# (a ring layer: kv.ring; the caller keeps every key a query sees in it, backends/cpu/kv_cache.py)
from libc.stdint cimport int64_t, uint8_t

from fastserve.backends.cpu._pool cimport Pool

cdef extern from "_attention_kernels.h" nogil:
    ctypedef struct fs_attn_isa:
        int rb

# One layer's KV cache (the arrays of fastserve.backends.cpu.kv_cache.KVCache, which stay their owner).
cdef struct kv_layer:
    uint8_t *k                  # [n_slots, n_ktiles, Hkv, k_tile_bytes]
    uint8_t *v                  # [n_slots, n_ctx, Hkv, row_bytes]
    int64_t n_slots, n_ktiles, n_ctx, Hkv, D
    int type_k, type_v
    int64_t ring                # 0, or the layer keeps a ring of n_ctx positions (p at row p % ring)

cdef class Attention:
    cdef readonly str isa
    cdef readonly Pool pool         # or None: the caller alone
    cdef const fs_attn_isa *kern
    cdef uint8_t *scratch
    cdef float *partial             # the segments' states of a split job (fs_attn_plan)
    cdef int64_t partial_floats
    cdef int *busy
    cdef int n_scratch
    cdef int64_t scratch_bytes
    cdef int64_t *tile_start
    cdef int64_t *tile_len
    cdef int64_t tile_cap
    cdef int _reserve(self, int64_t D, int64_t Dp, int64_t n) noexcept nogil
    cdef int run(self, const float *q, int64_t n, int64_t H, const kv_layer *kv, const int64_t *slots,
                 const int64_t *positions, float *out, float scale, int64_t window,
                 const float *sinks) noexcept nogil

# K/V head rows of batch row i (k + i * ld, v + i * ld: Hkv rows of D float32 each) into the cache at
# (slots[i], positions[i]) (row positions[i] % kv.ring of a ring), converted once into its types; slots and
# positions must be in range.
cdef void store_rows(const kv_layer *kv, const float *k, const float *v, int64_t ld, const int64_t *slots,
                     const int64_t *positions, int64_t n) noexcept nogil
