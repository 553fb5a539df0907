# cython: language_level=3
"""Causal attention of a batch's queries over each slot's KV cache, in C without the GIL.

Every (token, head) is computed on its own, in a fixed order, over exactly the
keys 0..pos of its slot. So a token's result never depends on what else is in
the batch or on how its prompt was chunked: greedy output is batch-invariant
and prefix reuse gives the same numbers as recomputation.
"""
from libc.math cimport expf


cdef inline float _dot(const float* a, const float* b, Py_ssize_t n) noexcept nogil:
    """Dot product with eight partial sums in a fixed order (vectorizable, deterministic)."""
    cdef float s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0
    cdef Py_ssize_t i = 0
    while i + 8 <= n:
        s0 += a[i] * b[i]
        s1 += a[i + 1] * b[i + 1]
        s2 += a[i + 2] * b[i + 2]
        s3 += a[i + 3] * b[i + 3]
        s4 += a[i + 4] * b[i + 4]
        s5 += a[i + 5] * b[i + 5]
        s6 += a[i + 6] * b[i + 6]
        s7 += a[i + 7] * b[i + 7]
        i += 8
    while i < n:
        s0 += a[i] * b[i]
        i += 1
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


def attend(const float[:, :, ::1] q, const float[:, :, :, ::1] k_cache, const float[:, :, :, ::1] v_cache,
           const long[::1] slots, const long[::1] positions, float[:, ::1] out, float[::1] scratch,
           float scale):
    """q [n, H, D]; k_cache, v_cache [n_slots, n_ctx_slot, Hkv, D]; slots, positions [n];
    out [n, H*D] (written); scratch [n_ctx_slot] (score buffer)."""
    cdef Py_ssize_t n = q.shape[0], H = q.shape[1], D = q.shape[2]
    cdef Py_ssize_t Hkv = k_cache.shape[2], G = H // Hkv
    cdef Py_ssize_t t, h, kvh, l, d, n_keys, slot
    cdef float m, s, inv, p
    cdef const float* qrow
    cdef float* orow
    with nogil:
        for t in range(n):
            slot = slots[t]
            n_keys = positions[t] + 1
            for h in range(H):
                kvh = h // G
                qrow = &q[t, h, 0]
                orow = &out[t, h * D]
                m = -3.4e38
                for l in range(n_keys):
                    s = _dot(qrow, &k_cache[slot, l, kvh, 0], D) * scale
                    scratch[l] = s
                    if s > m:
                        m = s
                s = 0
                for l in range(n_keys):
                    p = expf(scratch[l] - m)
                    scratch[l] = p
                    s += p
                for d in range(D):
                    orow[d] = 0
                for l in range(n_keys):
                    p = scratch[l]
                    for d in range(D):
                        orow[d] += p * v_cache[slot, l, kvh, d]
                inv = 1.0 / s
                for d in range(D):
                    orow[d] *= inv
