# cython: language_level=3
"""Quantized matrix product y[n, out] = x[n, in] . W[out, in]^T in C, without the GIL.

Weights are quantized once (Q8Matrix.from_float) to int8 with one float32 scale per 32 inputs of a
row, or taken as they are from exact int8 blocks (Q8Matrix.from_blocks: GGUF's Q4_0/Q5_0/Q8_0, and
Q4_1/Q5_1 with a float32 offset per block); each call quantizes the activations the same way, multiplies per block in integers, and sums
the blocks in float32 in a fixed order (see _matmul_kernels.h). Every output is a function of its
own activation row and weight row only: bit-identical whatever n, the other rows, the kernel or the
threads, and equal to the NumPy twin fastserve.ref.matmul.

    w = Q8Matrix.from_float(w_f32)            # [out, in] float32, once
    mm = Matmul(threads=1)                    # scratch + helper threads, one per backend
    mm(x, w, y)                               # x [n, in] float32, y [n, out] float32 (written)

A Matmul serves one calling thread at a time.
"""
import numpy as np

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t
from libc.stdlib cimport free, malloc

from fastserve._pool cimport Pool, fs_pool

cdef extern from "_matmul_kernels.h" nogil:
    enum:
        FS_QK
        FS_MAX_THREADS
        FS_ISA_SCALAR
        FS_ISA_AVX2
        FS_ISA_AVX512VNNI
        FS_ISA_NEON
        FS_ISA_NEON_DOTPROD
    ctypedef struct fs_job:
        const uint8_t *w
        int64_t n_out, nb, pbb
        const int8_t *xq
        const float *dx
        const int32_t *xs
        const float *sx
        int64_t n
        float *y
        int64_t ldy
    ctypedef void (*fs_kernel)(const fs_job *, int64_t, int64_t)
    void fs_quantize_rows(const float *x, int64_t n, int64_t n_in, int64_t ldx, int8_t *q, float *d,
                          int32_t *qsum, float *sx)
    int64_t fs_pb_bytes(int has_min)
    int64_t fs_packed_bytes(int64_t n_out, int64_t n_in, int has_min)
    int fs_pack_float(const float *w, int64_t n_out, int64_t n_in, uint8_t *dst)
    void fs_pack_blocks(const int8_t *q, const float *d, const float *m, int64_t n_out, int64_t n_in, uint8_t *dst)
    void fs_unpack(const uint8_t *src, int64_t n_out, int64_t n_in, int has_min, int8_t *q, float *d, float *m)
    int fs_isa_supported(int isa)
    int fs_best_isa()
    fs_kernel fs_kernel_for(int isa, int has_min)
    void fs_run(fs_pool *pl, fs_kernel kern, const fs_job *job)

ISA_NAMES = {FS_ISA_SCALAR: "scalar", FS_ISA_AVX2: "avx2", FS_ISA_AVX512VNNI: "avx512vnni",
             FS_ISA_NEON: "neon", FS_ISA_NEON_DOTPROD: "neon_dotprod"}
_ISA_IDS = {v: k for k, v in ISA_NAMES.items()}


def isas():
    """The kernels this machine can run ("scalar" always)."""
    return tuple(name for isa, name in sorted(ISA_NAMES.items()) if fs_isa_supported(isa))


def best_isa():
    return ISA_NAMES[fs_best_isa()]


cdef inline int64_t _blocks(int64_t n_in) noexcept nogil:
    return (n_in + FS_QK - 1) // FS_QK


cdef uint8_t *_aligned(object buf):
    """The first 64-byte aligned address inside a uint8 array allocated 64 bytes too large."""
    cdef uint8_t[::1] view = buf
    cdef size_t addr = <size_t>&view[0]
    return &view[0] + ((64 - addr % 64) % 64)


def quantize_rows(const float[:, ::1] x):
    """x [n, in] float32 -> (q int8 [n, in], d float32 [n, ceil(in/32)]): the activation quantization."""
    cdef int64_t n = x.shape[0], n_in = x.shape[1], nb = _blocks(n_in)
    q = np.zeros((n, nb * FS_QK), np.int8)
    d = np.zeros((n, nb), np.float32)
    s = np.zeros((n, nb), np.int32)
    cdef int8_t[:, ::1] qv = q
    cdef float[:, ::1] dv = d
    cdef int32_t[:, ::1] sv = s
    if n > 0 and n_in > 0:
        with nogil:
            fs_quantize_rows(&x[0, 0], n, n_in, n_in, &qv[0, 0], &dv[0, 0], &sv[0, 0], NULL)
    return q[:, :n_in], d


cdef class Q8Matrix:
    """A weight matrix [n_out, n_in]: int8 values with one float32 scale d (and, when has_min, one
    float32 offset m) per 32 inputs of a row, w = d * q (+ m), packed for the kernels
    (_matmul_kernels.h). nbytes: the packed size (1.125 bytes per weight, 1.25 with offsets)."""
    cdef readonly int64_t n_out, n_in, nbytes
    cdef readonly bint has_min
    cdef object _buf
    cdef uint8_t *data

    def __cinit__(self):
        self.data = NULL

    @staticmethod
    cdef Q8Matrix _alloc(int64_t n_out, int64_t n_in, bint has_min):
        cdef Q8Matrix m = Q8Matrix.__new__(Q8Matrix)
        m.n_out, m.n_in, m.has_min = n_out, n_in, has_min
        m.nbytes = fs_packed_bytes(n_out, n_in, has_min)
        m._buf = np.empty(m.nbytes + 64, np.uint8)
        m.data = _aligned(m._buf)
        return m

    @staticmethod
    def from_float(const float[:, ::1] w):
        """w [n_out, n_in] float32 (C-contiguous), each row quantized as activations are."""
        cdef Q8Matrix m = Q8Matrix._alloc(w.shape[0], w.shape[1], False)
        cdef int rc = 0
        if m.nbytes > 0:
            with nogil:
                rc = fs_pack_float(&w[0, 0], m.n_out, m.n_in, m.data)
        if rc != 0:
            raise MemoryError("Q8Matrix.from_float: out of memory")
        return m

    @staticmethod
    def from_blocks(const int8_t[:, ::1] q, const float[:, ::1] d, m=None):
        """Exact blocks: q int8 [n_out, n_in], d float32 [n_out, ceil(n_in/32)], m float32 like d
        (offsets) or None; w = d * q (+ m) per block of 32 inputs."""
        cdef int64_t n_out = q.shape[0], n_in = q.shape[1], nb = _blocks(n_in)
        cdef const float[:, ::1] mv
        cdef const float *mp = NULL
        if d.shape[0] != n_out or d.shape[1] != nb:
            raise ValueError(f"Q8Matrix.from_blocks: d has shape {(d.shape[0], d.shape[1])}, expected {(n_out, nb)}")
        if m is not None:
            mv = m
            if mv.shape[0] != n_out or mv.shape[1] != nb:
                raise ValueError(f"Q8Matrix.from_blocks: m has shape {np.shape(m)}, expected {(n_out, nb)}")
            if n_out > 0 and nb > 0:
                mp = &mv[0, 0]
        cdef Q8Matrix w = Q8Matrix._alloc(n_out, n_in, m is not None)
        if w.nbytes > 0:
            with nogil:
                fs_pack_blocks(&q[0, 0], &d[0, 0], mp, n_out, n_in, w.data)
        return w

    @property
    def shape(self):
        return (self.n_out, self.n_in)

    def unpack(self):
        """(q int8 [n_out, n_in], d float32 [n_out, ceil(n_in/32)], m like d or None): the blocks."""
        cdef int64_t nb = _blocks(self.n_in)
        q = np.zeros((self.n_out, nb * FS_QK), np.int8)
        d = np.zeros((self.n_out, nb), np.float32)
        m = np.zeros((self.n_out, nb), np.float32)
        cdef int8_t[:, ::1] qv = q
        cdef float[:, ::1] dv = d
        cdef float[:, ::1] mv = m
        if self.n_out > 0 and nb > 0:
            fs_unpack(self.data, self.n_out, self.n_in, self.has_min, &qv[0, 0], &dv[0, 0], &mv[0, 0])
        return q[:, :self.n_in], d, (m if self.has_min else None)

    def __repr__(self):
        return f"Q8Matrix({self.n_out}x{self.n_in}{', offsets' if self.has_min else ''}, {self.nbytes} bytes)"


cdef class Matmul:
    """y = x . W^T for Q8Matrix weights. pool: the threads to run on (a fastserve._pool.Pool shared
    with the step's other loops), or None for a Pool of its own of `threads` threads (the caller
    plus threads - 1 helpers, which spin for spin_us microseconds after a call, then sleep);
    isa: "auto" (the best kernel of this machine) or a name from isas().
    Holds the activation scratch (grown on demand, never shrunk)."""
    cdef readonly int threads
    cdef readonly str isa
    cdef fs_kernel kern, kern_m
    cdef readonly Pool pool
    cdef int8_t *xq
    cdef float *dx
    cdef int32_t *xs
    cdef float *sx
    cdef int64_t cap_q, cap_b
    cdef bint busy

    def __cinit__(self):
        self.xq = NULL
        self.dx = NULL
        self.xs = NULL
        self.sx = NULL
        self.cap_q = self.cap_b = 0

    def __init__(self, int threads=1, str isa="auto", double spin_us=100.0, Pool pool=None):
        if pool is None and (threads < 1 or threads > FS_MAX_THREADS):
            raise ValueError(f"threads must be in 1..{FS_MAX_THREADS}, got {threads}")
        if isa == "auto":
            isa = best_isa()
        if isa not in _ISA_IDS:
            raise ValueError(f"unknown isa {isa!r}; known: {', '.join(_ISA_IDS)}")
        if not fs_isa_supported(_ISA_IDS[isa]):
            raise ValueError(f"this machine cannot run the {isa} kernel; it can: {', '.join(isas())}")
        self.isa = isa
        self.kern = fs_kernel_for(_ISA_IDS[isa], 0)
        self.kern_m = fs_kernel_for(_ISA_IDS[isa], 1)
        self.pool = pool if pool is not None else Pool(threads, spin_us)
        self.threads = self.pool.threads

    def __dealloc__(self):
        free(self.xq)
        free(self.dx)
        free(self.xs)
        free(self.sx)

    cdef int _reserve(self, int64_t n, int64_t nb) except -1:
        cdef int64_t need_q = n * nb * FS_QK, need_b = n * nb
        if need_q > self.cap_q:
            free(self.xq)
            self.xq = <int8_t *>malloc(need_q)
            self.cap_q = need_q if self.xq != NULL else 0
        if need_b > self.cap_b:
            free(self.dx)
            free(self.xs)
            free(self.sx)
            self.dx = <float *>malloc(need_b * sizeof(float))
            self.xs = <int32_t *>malloc(need_b * sizeof(int32_t))
            self.sx = <float *>malloc(need_b * sizeof(float))
            self.cap_b = need_b if (self.dx != NULL and self.xs != NULL and self.sx != NULL) else 0
        if self.cap_q < need_q or self.cap_b < need_b:
            raise MemoryError("Matmul: out of memory for the activation scratch")
        return 0

    def __call__(self, x, Q8Matrix w, out):
        """x [n, w.n_in] float32, out [n, w.n_out] float32 (both C-contiguous; out is written). Returns out."""
        cdef const float[:, ::1] xv = x
        cdef float[:, ::1] ov = out
        cdef int64_t n = xv.shape[0], nb = _blocks(w.n_in)
        cdef fs_job job
        if xv.shape[1] != w.n_in or ov.shape[0] != n or ov.shape[1] != w.n_out:
            raise ValueError(f"Matmul: x {np.shape(x)} . W^T {w.shape} does not fit out {np.shape(out)}")
        if n == 0 or w.n_out == 0:
            return out
        if w.n_in == 0:
            ov[:, :] = 0
            return out
        if self.busy:
            raise RuntimeError("Matmul: called from two threads at once; give each thread its own")
        self._reserve(n, nb)
        self.busy = True
        job.w, job.n_out, job.nb, job.pbb = w.data, w.n_out, nb, fs_pb_bytes(w.has_min)
        job.xq, job.dx, job.xs, job.sx = self.xq, self.dx, self.xs, self.sx
        job.n, job.y, job.ldy = n, &ov[0, 0], ov.shape[1]
        try:
            with nogil:
                fs_quantize_rows(&xv[0, 0], n, w.n_in, w.n_in, self.xq, self.dx, self.xs, self.sx)
                fs_run(self.pool.pl, self.kern_m if w.has_min else self.kern, &job)
        finally:
            self.busy = False
        return out
