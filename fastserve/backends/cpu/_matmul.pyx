# cython: language_level=3
"""Matrix products y[n, out] = x[n, in] . W[out, in]^T computed on GGUF's own blocks, in C, without
the GIL.

A BlockMatrix is a view of one or more tensors as the file stores them (memory-mapped: no decoded
copy is ever kept), stacked by rows (e.g. Q | K | V), each part of its own type: Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4 (integer blocks) or F32, F16, BF16 (floats). Each
call quantizes the activations once (int8, one scale per 32 inputs) for every integer part, multiplies per
block in integers, and sums the blocks in float32 in a fixed order (see _matmul_kernels.h); float parts
keep 16 partial sums of fused multiply-adds in input order, folded in a fixed tree (_matmul_float.h). Every output is a function of its own activation row and weight row
only: bit-identical whatever n, the other rows, the kernel or the threads, and equal to the NumPy
twin fastserve.backends.cpu.ref.matmul.

    w = BlockMatrix([("blk.0.attn_q.weight", "Q4_1", data, 576), ...], n_in=576)
    mm = Matmul(pool=pool)                    # scratch; the products run on pool's threads
    mm(x, w, y)                               # x [n, in] float32, y [n, out] float32 (written)

A Matmul serves one calling thread at a time.
"""
import os

import numpy as np

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t
from libc.stdlib cimport free, malloc

from fastserve.backends.cpu._pool cimport Pool, fs_pool, pool_run

cdef extern from "_matmul_kernels.h" nogil:
    enum:
        FS_QK
        FS_LANES
        FS_ISA_SCALAR
        FS_ISA_AVX2
        FS_ISA_AVX512VNNI
        FS_ISA_NEON
        FS_ISA_NEON_DOTPROD
        FS_KIND_Q
        FS_KIND_QM
        FS_KIND_QS
        FS_KIND_F
        FS_KIND_QSM
        FS_N_KINDS
    ctypedef struct fs_type_info:
        int block_inputs, block_bytes, kind
    ctypedef struct fs_quant:
        const float *x
        int64_t ldx, n, n_in
        int isa
        int8_t *q
        float *d
        int32_t *qsum
        int32_t *qhalf
        float *sx
        int64_t next, done
    ctypedef struct fs_product:
        const fs_part *parts
        int n_parts
        int64_t n_in, n_panels
        int isa
        fs_kernel kern[5]                   # FS_N_KINDS
        fs_job act
        uint8_t *stage
        int64_t stage_bytes, chunk
        int fused
        fs_quant *quant
    int fs_type(int type, fs_type_info *info)
    int64_t fs_stage_bytes(int kind)
    int fs_stage_bias(int avx2, int type)
    int64_t fs_row_bytes(const fs_type_info *t, int64_t n_in)
    void fs_dequantize_row(int type, const uint8_t *row, int64_t n_in, float *out)
    void fs_quantize_rows(const float *x, int64_t n, int64_t n_in, int64_t ldx, int8_t *q, float *d,
                          int32_t *qsum, int32_t *qhalf, float *sx)
    void fs_quantize_rows_isa(int isa, const float *x, int64_t n, int64_t n_in, int64_t ldx, int8_t *q, float *d,
                              int32_t *qsum, int32_t *qhalf, float *sx)
    void fs_pad_rows(const float *x, int64_t n, int64_t n_in, int64_t ldx, float *xf)
    void fs_stage_panel(int isa, int type, const uint8_t *rows, int64_t row_bytes, int valid,
                        int64_t n_in, uint8_t *stage, const uint8_t *next)
    int fs_isa_supported(int isa)
    int fs_fused_ok(int isa, int type, int64_t n, int valid)
    enum:
        FS_FUSED_MAX_N
        FS_FUSED_GROUPS_MAX_N
        FS_QUANT_SPLIT_N
    int fs_best_isa()
    fs_kernel fs_kernel_for(int isa, int kind)
    void fs_product_task(void *ctx, int64_t begin, int64_t end) noexcept
    int64_t fs_product_chunk(int threads, int64_t n_panels, int64_t nb, int64_t n)

ISA_NAMES = {FS_ISA_SCALAR: "scalar", FS_ISA_AVX2: "avx2", FS_ISA_AVX512VNNI: "avx512vnni",
             FS_ISA_NEON: "neon", FS_ISA_NEON_DOTPROD: "neon_dotprod"}
_ISA_IDS = {v: k for k, v in ISA_NAMES.items()}
# GGUF tensor types the kernels run as stored (gguf.GGMLQuantizationType ids).
TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11,
            "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "BF16": 30, "MXFP4": 39}
KERNEL_TYPES = tuple(TYPE_IDS)
KINDS = {FS_KIND_Q: "q", FS_KIND_QM: "qm", FS_KIND_QS: "qs", FS_KIND_F: "f", FS_KIND_QSM: "qsm"}


def isas():
    """The kernels this machine can run ("scalar" always)."""
    return tuple(name for isa, name in sorted(ISA_NAMES.items()) if fs_isa_supported(isa))


def fused_types(str isa="auto"):
    """The types whose products at small n the isa's fused kernel computes straight from the file's
    rows (n <= FUSED_MAX_N; the K-quants: n <= 2 on avx512vnni, where fusing still wins there, whole
    panels of 16 rows; IQ4_NL, IQ4_XS and MXFP4: n <= 2 on avx512vnni; on avx2 IQ4_NL and IQ4_XS: n = 1,
    MXFP4: n <= 2), the others stage panels."""
    cdef int isa_id = _isa_id(isa)
    return tuple(t for t, i in TYPE_IDS.items() if fs_fused_ok(isa_id, i, 1, FS_LANES))


FUSED_MAX_N = FS_FUSED_MAX_N
FUSED_GROUPS_MAX_N = FS_FUSED_GROUPS_MAX_N    # avx2, narrow matrices: up to this many rows fused, in groups
QUANT_SPLIT_N = FS_QUANT_SPLIT_N              # from this many rows the tasks' threads quantize the activations


def best_isa():
    """The kernel "auto" runs: FASTSERVE_ISA's when set (a name from isas(): to run a lesser ISA's path on a
    better machine, e.g. FASTSERVE_ISA=avx2 on an AVX-512 one), else the best this machine has."""
    return ISA_NAMES[_isa_id("auto")]


def env_isa():
    """The kernel FASTSERVE_ISA names (ValueError for a name not in isas()), or "" when it is unset. The one
    reader of FASTSERVE_ISA: attention runs the kernel of the same instructions (_attention.best_isa)."""
    isa = os.environ.get("FASTSERVE_ISA") or ""
    return isa and ISA_NAMES[_isa_id(isa)]


def _isa_id(str isa):
    if isa == "auto":
        isa = env_isa()
        return _ISA_IDS[isa] if isa else fs_best_isa()
    if isa not in _ISA_IDS:
        raise ValueError(f"unknown isa {isa!r}; known: {', '.join(_ISA_IDS)}")
    if not fs_isa_supported(_ISA_IDS[isa]):
        raise ValueError(f"this machine cannot run the {isa} kernel; it can: {', '.join(isas())}")
    return _ISA_IDS[isa]


def type_info(str type_name):
    """(inputs per block, bytes per block, kind "q"/"qm"/"qs"/"qsm"/"f") of a kernel type."""
    cdef fs_type_info t
    if type_name not in TYPE_IDS:
        raise ValueError(f"type {type_name} has no kernel; kernel types: {', '.join(KERNEL_TYPES)}")
    fs_type(TYPE_IDS[type_name], &t)
    return t.block_inputs, t.block_bytes, KINDS[t.kind]


def stage_bias(str type_name, str isa="auto"):
    """What the isa's staged panels add to each q of type_name (mod 256; layout in _gguf_blocks.h)."""
    type_info(type_name)
    return fs_stage_bias(_isa_id(isa) == FS_ISA_AVX2, TYPE_IDS[type_name])


cdef inline int64_t _blocks(int64_t n_in) noexcept nogil:
    return (n_in + FS_QK - 1) // FS_QK


def quantize_rows(const float[:, ::1] x, str isa="scalar"):
    """x [n, in] float32 -> (q int8 [n, in], d float32 [n, ceil(in/32)]): the activation quantization, with the
    instructions the isa's products use (the same numbers whichever)."""
    cdef int64_t n = x.shape[0], n_in = x.shape[1], nb = _blocks(n_in)
    cdef int isa_id = _isa_id(isa)
    q = np.zeros((n, nb * FS_QK), np.int8)
    d = np.zeros((n, nb), np.float32)
    s = np.zeros((n, nb), np.int32)
    h = np.zeros((n, nb), np.int32)
    sx = np.zeros((n, nb), np.float32)
    cdef int8_t[:, ::1] qv = q
    cdef float[:, ::1] dv = d
    cdef int32_t[:, ::1] sv = s
    cdef int32_t[:, ::1] hv = h
    cdef float[:, ::1] xv = sx
    if n > 0 and n_in > 0:
        with nogil:
            fs_quantize_rows_isa(isa_id, &x[0, 0], n, n_in, n_in, &qv[0, 0], &dv[0, 0], &sv[0, 0], &hv[0, 0],
                                 &xv[0, 0])
    return q[:, :n_in], d


cdef class BlockMatrix:
    """A weight matrix [n_out, n_in] as GGUF blocks: parts stacked by rows, each (label, type name,
    data, rows) with data any C-contiguous array whose bytes are the part's rows as the file stores
    them (kept referenced, never copied). nbytes: the bytes a product reads. types: each part's type.
    (Attributes: _matmul.pxd.)"""

    def __cinit__(self):
        self.parts = NULL

    def __dealloc__(self):
        free(self.parts)

    def __init__(self, parts, int64_t n_in):
        cdef fs_type_info t
        cdef const uint8_t[::1] raw
        parts = list(parts)
        if not parts:
            raise ValueError("BlockMatrix: no parts")
        if n_in <= 0:
            raise ValueError(f"BlockMatrix: n_in must be positive, got {n_in}")
        self.parts = <fs_part *>malloc(len(parts) * sizeof(fs_part))
        if self.parts == NULL:
            raise MemoryError()
        self.n_in, self.n_parts, self._keep = n_in, len(parts), []
        self.n_out = self.nbytes = self.n_panels = self.stage_bytes = 0
        self.has_int = self.has_float = False
        types, labels = [], []
        for i, (label, type_name, data, rows) in enumerate(parts):
            if type_name not in TYPE_IDS:
                raise ValueError(f"{label}: type {type_name} has no kernel; kernel types: {', '.join(KERNEL_TYPES)}")
            fs_type(TYPE_IDS[type_name], &t)
            if n_in % t.block_inputs:
                raise ValueError(f"{label}: {type_name} rows of {n_in} inputs are not whole blocks of {t.block_inputs}")
            arr = np.asarray(data)
            if not arr.flags.c_contiguous:
                raise ValueError(f"{label}: the tensor data is not contiguous")
            arr = arr.reshape(-1).view(np.uint8)
            rows = int(rows)
            want = rows * fs_row_bytes(&t, n_in)
            if rows <= 0 or arr.nbytes != want:
                raise ValueError(f"{label}: {arr.nbytes} bytes of {type_name} data for {rows} rows of {n_in} "
                                 f"inputs, which take {want}: the tensor is truncated or its shape is wrong")
            raw = arr
            self.parts[i].type, self.parts[i].kind = TYPE_IDS[type_name], t.kind
            self.parts[i].data = &raw[0]
            self.parts[i].rows, self.parts[i].row_bytes = rows, fs_row_bytes(&t, n_in)
            self.parts[i].col0, self.parts[i].first_panel = self.n_out, self.n_panels
            self.n_out += rows
            self.n_panels += (rows + FS_LANES - 1) // FS_LANES
            self.nbytes += want
            self.stage_bytes = max(self.stage_bytes, _blocks(n_in) * fs_stage_bytes(t.kind))
            if t.kind == FS_KIND_F:
                self.has_float = True
            else:
                self.has_int = True
            self._keep.append(arr)
            types.append(type_name)
            labels.append(label)
        self.types, self.labels = tuple(types), tuple(labels)

    cdef fs_matrix view(self):
        cdef fs_matrix m
        m.parts, m.n_parts, m.n_out, m.n_in = self.parts, self.n_parts, self.n_out, self.n_in
        m.n_panels, m.stage_bytes, m.has_int, m.has_float = self.n_panels, self.stage_bytes, self.has_int, self.has_float
        return m

    @staticmethod
    def from_float(w, label="matrix"):
        """A float32 matrix [n_out, n_in] (C-contiguous, kept referenced) as an F32 BlockMatrix."""
        w = np.asarray(w)
        if w.dtype != np.float32 or w.ndim != 2 or not w.flags.c_contiguous:
            raise ValueError(f"{label}: from_float needs a C-contiguous float32 [n_out, n_in] array")
        return BlockMatrix([(label, "F32", w, w.shape[0])], w.shape[1])

    @property
    def shape(self):
        return (self.n_out, self.n_in)

    @property
    def arrays(self):
        """Each part's data (uint8 views of the arrays given, never copies)."""
        return tuple(self._keep)

    @property
    def part_rows(self):
        return tuple(self.parts[i].rows for i in range(self.n_parts))

    def get_rows(self, ids, out=None):
        """Rows ids of the matrix as float32 [len(ids), n_in]: d * (s * q) + m per input (the
        embedding lookup: only these rows are decoded). out: a float32 array to write, or None."""
        cdef int64_t[::1] iv = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        cdef int64_t k, n = iv.shape[0]
        cdef fs_matrix m = self.view()
        if out is None:
            out = np.empty((n, self.n_in), np.float32)
        cdef float[:, ::1] ov = out
        if ov.shape[0] != n or ov.shape[1] != self.n_in:
            raise ValueError(f"get_rows: out has shape {np.shape(out)}, expected {(n, self.n_in)}")
        for k in range(n):
            if iv[k] < 0 or iv[k] >= self.n_out:
                raise IndexError(f"get_rows: row {iv[k]} is outside [0, {self.n_out})")
        if n:
            with nogil:
                matrix_rows(&m, &iv[0], n, &ov[0, 0])
        return out

    def to_float(self):
        """The whole matrix as float32 [n_out, n_in] (for uploading to a GPU and for tests)."""
        return self.get_rows(np.arange(self.n_out))

    def staged_panel(self, int64_t panel, str isa="auto"):
        """The bytes the kernels read for panel `panel` (rows panel*16 .. of its part, decoded by the
        isa's decoder): uint8 [nb, stage bytes of the part's kind] (layout in _gguf_blocks.h)."""
        cdef int pi = 0
        cdef int isa_id = _isa_id(isa)
        if panel < 0 or panel >= self.n_panels:
            raise IndexError(f"panel {panel} outside [0, {self.n_panels})")
        while panel >= self.parts[pi].first_panel + (self.parts[pi].rows + FS_LANES - 1) // FS_LANES:
            pi += 1
        if self.parts[pi].kind == FS_KIND_F:
            raise ValueError("float rows have no staged layout: the products read them as stored (_matmul_float.h)")
        cdef int64_t r0 = (panel - self.parts[pi].first_panel) * FS_LANES
        cdef int valid = <int>min(FS_LANES, self.parts[pi].rows - r0)
        cdef int64_t nb = _blocks(self.n_in), pbb = fs_stage_bytes(self.parts[pi].kind)
        buf = np.zeros((nb, pbb), np.uint8)
        cdef uint8_t[:, ::1] bv = buf
        fs_stage_panel(isa_id, self.parts[pi].type, self.parts[pi].data + r0 * self.parts[pi].row_bytes,
                       self.parts[pi].row_bytes, valid, self.n_in, &bv[0, 0], NULL)
        return buf

    def __repr__(self):
        return f"BlockMatrix({self.n_out}x{self.n_in}, {'+'.join(self.types)}, {self.nbytes} bytes)"


cdef void matrix_rows(const fs_matrix *w, const int64_t *ids, int64_t n, float *out) noexcept nogil:
    cdef int64_t k, r
    cdef int pi
    for k in range(n):
        r = ids[k]
        pi = 0
        while r >= w.parts[pi].rows:
            r -= w.parts[pi].rows
            pi += 1
        fs_dequantize_row(w.parts[pi].type, w.parts[pi].data + r * w.parts[pi].row_bytes, w.n_in, out + k * w.n_in)


cdef struct fs_groups:
    const fs_product *pr            # [n] each group's product (its rows of the activations and of y)
    const int64_t *first            # [n + 1] each group's first panel in the run's panel range
    int64_t n, chunk, stage_bytes
    uint8_t *stage                  # one staging panel per task, stage_bytes apart (or NULL)


cdef void _groups_task(void *ctx, int64_t begin, int64_t end) noexcept nogil:
    """Panels [begin, end) of a run over groups (Matmul.run_groups): each group's share by fs_product_task,
    staged in this task's own buffer (its pr.chunk is set so that fs_product_task picks that one)."""
    cdef const fs_groups *gs = <const fs_groups *>ctx
    cdef fs_product pr
    cdef int64_t g, lo, hi
    for g in range(gs.n):
        lo, hi = max(begin, gs.first[g]), min(end, gs.first[g + 1])
        if lo >= hi:
            continue
        pr = gs.pr[g]
        pr.stage = gs.stage + begin // gs.chunk * gs.stage_bytes if gs.stage != NULL else NULL
        pr.chunk = hi - gs.first[g]             # > lo - first: fs_product_task's buffer index is 0
        fs_product_task(&pr, lo - gs.first[g], hi - gs.first[g])


cdef class Matmul:
    """y = x . W^T for BlockMatrix weights. pool: a fastserve.backends.cpu._pool.Pool whose threads the products
    run on (shared with the backend's other loops), or None: then threads (the calling thread plus
    threads - 1 helpers spinning spin_us after a call) makes one of its own. isa: "auto" (the best
    kernel of this machine) or a name from isas(). fused: small batches (n <= 4; on avx2 up to 6 rows of
    narrow matrices, in groups of 4) of the types the
    isa has a fused kernel for (fused_types()) compute straight from the file's rows instead of
    staging panels (the same bits; False: always stage, for comparison). Holds the activation scratch and one staging
    panel per task (grown on demand, never shrunk). (Attributes: _matmul.pxd.)"""

    def __cinit__(self):
        self.xq = NULL
        self.dx = self.sx = self.xf = NULL
        self.xs = self.xh = NULL
        self.stage = NULL
        self.cap_q = self.cap_b = self.cap_f = self.cap_stage = 0

    def __init__(self, int threads=1, str isa="auto", double spin_us=100.0, Pool pool=None, bint fused=True):
        self.isa_id = _isa_id(isa)
        self.fused = fused
        self.isa = ISA_NAMES[self.isa_id]
        for k in range(FS_N_KINDS):
            self.kern[k] = fs_kernel_for(self.isa_id, k)
        if pool is None:
            pool = Pool(threads, spin_us)
        self.pool, self.threads = pool, pool.threads

    def __dealloc__(self):
        free(self.xq)
        free(self.dx)
        free(self.xs)
        free(self.xh)
        free(self.sx)
        free(self.xf)
        free(self.stage)

    cdef int _reserve(self, int64_t n, int64_t nb, bint ints, bint floats, int64_t stage) noexcept nogil:
        """Grows the scratch to fit; -1 when out of memory."""
        cdef int64_t need_q = n * nb * FS_QK if ints else 0, need_b = n * nb if ints else 0
        cdef int64_t need_f = n * nb * FS_QK if floats else 0
        cdef bint ok
        if need_q > self.cap_q:
            free(self.xq)
            self.xq = <int8_t *>malloc(need_q)
            self.cap_q = need_q if self.xq != NULL else 0
        if need_b > self.cap_b:
            free(self.dx)
            free(self.xs)
            free(self.xh)
            free(self.sx)
            self.dx = <float *>malloc(need_b * sizeof(float))
            self.xs = <int32_t *>malloc(need_b * sizeof(int32_t))
            self.xh = <int32_t *>malloc(need_b * sizeof(int32_t))
            self.sx = <float *>malloc(need_b * sizeof(float))
            ok = self.dx != NULL and self.xs != NULL and self.xh != NULL and self.sx != NULL
            self.cap_b = need_b if ok else 0
        if need_f > self.cap_f:
            free(self.xf)
            self.xf = <float *>malloc(need_f * sizeof(float))
            self.cap_f = need_f if self.xf != NULL else 0
        if stage > self.cap_stage:
            free(self.stage)
            self.stage = <uint8_t *>malloc(stage)
            self.cap_stage = stage if self.stage != NULL else 0
        if self.cap_q < need_q or self.cap_b < need_b or self.cap_f < need_f or self.cap_stage < stage:
            return -1
        return 0

    cdef int run(self, const float *x, int64_t ldx, int64_t n, const fs_matrix *w, float *y,
                 int64_t ldy) noexcept nogil:
        """y[i, :w.n_out] = x[i, :w.n_in] . W^T for rows i < n (row strides ldx, ldy floats), on the
        pool's threads. 0, or -1 when the scratch could not grow (nothing written)."""
        cdef int64_t nb = _blocks(w.n_in), n_tasks
        cdef fs_product pr
        cdef fs_quant qt
        cdef int k
        if n == 0:
            return 0
        pr.chunk = fs_product_chunk(self.threads, w.n_panels, nb, n)
        n_tasks = (w.n_panels + pr.chunk - 1) // pr.chunk
        if self._reserve(n, nb, w.has_int, w.has_float, n_tasks * w.stage_bytes) < 0:
            return -1
        pr.parts, pr.n_parts, pr.n_in, pr.n_panels = w.parts, w.n_parts, w.n_in, w.n_panels
        pr.isa = self.isa_id
        pr.fused = self.fused
        for k in range(FS_N_KINDS):
            pr.kern[k] = self.kern[k]
        pr.act.nb = nb
        pr.act.xq, pr.act.dx, pr.act.xs, pr.act.xh, pr.act.sx = self.xq, self.dx, self.xs, self.xh, self.sx
        pr.act.xf = self.xf
        pr.act.n, pr.act.y, pr.act.ldy = n, y, ldy
        pr.stage, pr.stage_bytes = self.stage, w.stage_bytes
        pr.quant = NULL
        if w.has_int and n >= FS_QUANT_SPLIT_N and self.threads > 1:    # quantized by the tasks' threads
            qt.x, qt.ldx, qt.n, qt.n_in, qt.isa = x, ldx, n, w.n_in, self.isa_id
            qt.q, qt.d, qt.qsum, qt.qhalf, qt.sx = self.xq, self.dx, self.xs, self.xh, self.sx
            qt.next = qt.done = 0
            pr.quant = &qt
        elif w.has_int:
            fs_quantize_rows_isa(self.isa_id, x, n, w.n_in, ldx, self.xq, self.dx, self.xs, self.xh, self.sx)
        if w.has_float:
            fs_pad_rows(x, n, w.n_in, ldx, self.xf)
        pool_run(self.pool.pl, fs_product_task, &pr, w.n_panels, pr.chunk)
        return 0

    cdef int run_groups(self, const float *x, int64_t ldx, const int64_t *start, int64_t n_groups,
                        const fs_matrix *ws, float *y, int64_t ldy) noexcept nogil:
        """y rows [start[g], start[g + 1]) = x's same rows . ws[g]^T for each group g < n_groups (start[0] = 0;
        matrices of one n_in and types: a mixture's experts), the numbers run() gives group by group, in one
        pool run: the activations quantized once, the threads going from a group's panels on to the next's
        without waiting (a decode step's 8 experts are 8 small products). 0, or -1 when the scratch could
        not grow (nothing written)."""
        cdef int64_t nb, n = start[n_groups], total = 0, g, r0, n_tasks, used = 0
        cdef fs_groups gs
        cdef fs_product *pr
        cdef int k
        if n == 0:
            return 0
        nb = _blocks(ws[0].n_in)
        gs.pr = pr = <fs_product *>malloc(n_groups * sizeof(fs_product))
        gs.first = <int64_t *>malloc((n_groups + 1) * sizeof(int64_t))
        if pr == NULL or gs.first == NULL:
            free(pr)
            free(<void *>gs.first)
            return -1
        gs.n, gs.stage_bytes = n_groups, 0
        for g in range(n_groups):
            (<int64_t *>gs.first)[g] = total
            if start[g + 1] > start[g]:
                total += ws[g].n_panels
                used += 1
            gs.stage_bytes = max(gs.stage_bytes, ws[g].stage_bytes)
        (<int64_t *>gs.first)[n_groups] = total
        gs.chunk = fs_product_chunk(self.threads, total, nb, n // used)
        n_tasks = (total + gs.chunk - 1) // gs.chunk
        if self._reserve(n, nb, ws[0].has_int, ws[0].has_float, n_tasks * gs.stage_bytes) < 0:
            free(pr)
            free(<void *>gs.first)
            return -1
        gs.stage = self.stage
        if ws[0].has_int:
            fs_quantize_rows_isa(self.isa_id, x, n, ws[0].n_in, ldx, self.xq, self.dx, self.xs, self.xh, self.sx)
        if ws[0].has_float:
            fs_pad_rows(x, n, ws[0].n_in, ldx, self.xf)
        for g in range(n_groups):
            r0 = start[g]
            if start[g + 1] == r0:
                continue
            pr[g].parts, pr[g].n_parts, pr[g].n_in, pr[g].n_panels = ws[g].parts, ws[g].n_parts, ws[g].n_in, ws[g].n_panels
            pr[g].isa, pr[g].fused = self.isa_id, self.fused
            for k in range(FS_N_KINDS):
                pr[g].kern[k] = self.kern[k]
            pr[g].act.nb, pr[g].act.n, pr[g].act.y, pr[g].act.ldy = nb, start[g + 1] - r0, y + r0 * ldy, ldy
            pr[g].act.xq, pr[g].act.dx, pr[g].act.xs = self.xq + r0 * nb * FS_QK, self.dx + r0 * nb, self.xs + r0 * nb
            pr[g].act.xh, pr[g].act.sx = self.xh + r0 * nb, self.sx + r0 * nb
            pr[g].act.xf = self.xf + r0 * nb * FS_QK if ws[0].has_float else NULL
            pr[g].stage, pr[g].stage_bytes = self.stage, ws[g].stage_bytes
            pr[g].quant = NULL                  # quantized above
        pool_run(self.pool.pl, _groups_task, &gs, total, gs.chunk)
        free(pr)
        free(<void *>gs.first)
        return 0

    def __call__(self, x, BlockMatrix w, out):
        """x [n, w.n_in] float32, out [n, w.n_out] float32 (both C-contiguous; out is written). Returns out."""
        cdef const float[:, ::1] xv = x
        cdef float[:, ::1] ov = out
        cdef int64_t n = xv.shape[0]
        cdef fs_matrix m = w.view()
        if xv.shape[1] != w.n_in or ov.shape[0] != n or ov.shape[1] != w.n_out:
            raise ValueError(f"Matmul: x {np.shape(x)} . W^T {w.shape} does not fit out {np.shape(out)}")
        if n == 0:
            return out
        self._locked(&xv[0, 0], w.n_in, n, NULL, 1, &m, &ov[0, 0], ov.shape[1])
        return out

    cdef _locked(self, const float *x, int64_t ldx, int64_t n, const int64_t *start, int64_t n_groups,
                 const fs_matrix *ws, float *y, int64_t ldy):
        """run (start NULL: ws[0] over n rows) or run_groups, for one calling thread at a time."""
        cdef int rc
        if self.busy:
            raise RuntimeError("Matmul: called from two threads at once; give each thread its own")
        self.busy = True
        try:
            with nogil:
                rc = self.run(x, ldx, n, ws, y, ldy) if start == NULL else self.run_groups(x, ldx, start, n_groups, ws, y, ldy)
        finally:
            self.busy = False
        if rc < 0:
            raise MemoryError("Matmul: out of memory for the activation scratch")

    def groups(self, x, ws, start, out):
        """out rows [start[g], start[g + 1]) = x's same rows . ws[g]^T (run_groups): x [n, in], out [n, out]
        float32 C-contiguous, ws BlockMatrix of one n_in, n_out and types, start int64 [len(ws) + 1] from 0
        to n, not decreasing. Returns out."""
        cdef const float[:, ::1] xv = x
        cdef float[:, ::1] ov = out
        cdef const int64_t[::1] sv = np.ascontiguousarray(start, np.int64)
        cdef int64_t G = len(ws), g
        cdef BlockMatrix w
        if G == 0 or sv.shape[0] != G + 1 or sv[0] != 0 or sv[G] != xv.shape[0] or ov.shape[0] != xv.shape[0]:
            raise ValueError(f"Matmul.groups: {G} matrices, start {np.asarray(start).tolist()}, x {np.shape(x)}, "
                             f"out {np.shape(out)}")
        views = np.zeros(G * sizeof(fs_matrix), np.uint8)
        cdef uint8_t[::1] vv = views
        cdef fs_matrix *mats = <fs_matrix *>&vv[0]
        for g in range(G):
            w = ws[g]
            if sv[g + 1] < sv[g] or w.n_in != xv.shape[1] or w.n_out != ov.shape[1] or w.types != ws[0].types:
                raise ValueError(f"Matmul.groups: matrix {g} {w.shape} {w.types} or its rows do not fit")
            mats[g] = w.view()
        if xv.shape[0] == 0:
            return out
        self._locked(&xv[0, 0], xv.shape[1], xv.shape[0], &sv[0], G, mats, &ov[0, 0], ov.shape[1])
        return out
