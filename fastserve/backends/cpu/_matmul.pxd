# The C-level contract of fastserve.backends.cpu._matmul, for callers that run a whole forward pass without the GIL
# (fastserve.backends.cpu._forward): a BlockMatrix's view() is a plain struct, Matmul.run the product on raw pointers.
#
#   from fastserve.backends.cpu._matmul cimport BlockMatrix, Matmul, fs_matrix, matrix_rows
#   cdef fs_matrix w = block_matrix.view()        # with the GIL, once (the BlockMatrix must stay alive)
#   mm.run(x, ldx, n, &w, y, ldy)                 # nogil; 0, or -1 when the scratch could not grow
#   mm.run_groups(x, ldx, start, G, ws, y, ldy)   # rows [start[g], start[g + 1]) . ws[g]^T (ws: G views), one pool run
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t

from fastserve.backends.cpu._pool cimport Pool

cdef extern from "_matmul_kernels.h" nogil:
    ctypedef struct fs_job:
        const uint8_t *w
        int valid
        int64_t nb
        const int8_t *xq
        const float *dx
        const int32_t *xs
        const int32_t *xh
        const float *sx
        const float *xf
        int64_t n
        float *y
        int64_t ldy
    ctypedef void (*fs_kernel)(const fs_job *)
    ctypedef struct fs_part:
        int type, kind
        const uint8_t *data
        int64_t rows, row_bytes, col0, first_panel

# What a product reads of a BlockMatrix (its parts stay owned by it).
cdef struct fs_matrix:
    const fs_part *parts
    int n_parts
    int64_t n_out, n_in, n_panels, stage_bytes
    bint has_int, has_float

cdef class BlockMatrix:
    cdef readonly int64_t n_out, n_in, nbytes
    cdef readonly tuple types, labels
    cdef readonly bint has_int, has_float
    cdef list _keep
    cdef fs_part *parts
    cdef int n_parts
    cdef int64_t n_panels, stage_bytes
    cdef fs_matrix view(self)

cdef class Matmul:
    cdef readonly int threads
    cdef readonly str isa
    cdef readonly Pool pool
    cdef public bint fused
    cdef int isa_id
    cdef fs_kernel kern[5]                  # FS_N_KINDS
    cdef int8_t *xq
    cdef float *dx
    cdef int32_t *xs
    cdef int32_t *xh
    cdef float *sx
    cdef float *xf
    cdef uint8_t *stage
    cdef int64_t cap_q, cap_b, cap_f, cap_stage
    cdef bint busy
    cdef int _reserve(self, int64_t n, int64_t nb, bint ints, bint floats, int64_t stage) noexcept nogil
    cdef int run(self, const float *x, int64_t ldx, int64_t n, const fs_matrix *w, float *y,
                 int64_t ldy) noexcept nogil
    cdef int run_groups(self, const float *x, int64_t ldx, const int64_t *start, int64_t n_groups,
                        const fs_matrix *ws, float *y, int64_t ldy) noexcept nogil
    cdef _locked(self, const float *x, int64_t ldx, int64_t n, const int64_t *start, int64_t n_groups,
                 const fs_matrix *ws, float *y, int64_t ldy)

# Rows ids[0..n) of w decoded into out [n, w.n_in] (the embedding lookup); ids must be in range.
cdef void matrix_rows(const fs_matrix *w, const int64_t *ids, int64_t n, float *out) noexcept nogil
