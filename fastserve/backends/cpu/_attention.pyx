# cython: language_level=3
"""Causal attention of a batch's queries over each slot's KV cache, in C without the GIL.

The KV cache is stored in f32, f16 or q8_0 (llama-server's cache types) and attention reads it
directly, flash-attention style: the queries of a (token tile, KV head) run against the slot's
keys in tiles of KT positions at fixed absolute places (0, 64, 128, ...), with an online softmax
(running max, running sum) merged in tile order within each segment of SEG keys (0, 512, ...),
and the segments' states merged in segment order (so that the segments of one long decode row can
run on different threads). Every (token, head) output is a fixed sequence of
float32 operations (_attention_kernels.h states it), so it never depends on the batch, on how a
prompt was chunked, on the thread count or on the kernel: greedy output is batch-invariant and a
decode step gives the bits of the same row inside a prefill chunk. fastserve.backends.cpu.ref.attention is the
NumPy twin, bit for bit.

Cache arrays, per layer (allocated by fastserve.backends.cpu.kv_cache.KVCache):
    k_cache uint8 [n_slots, n_ctx / KT (rounded up), Hkv, k_tile_bytes(type_k, D)]
    v_cache uint8 [n_slots, n_ctx, Hkv, row_bytes(type_v, D)]
or, for a ring (ring = R > 0, a multiple of KT: a sliding-window layer's last R positions), n_ctx = R and
position p at row p % R (K tile (p // KT) % (R // KT)); store, move_rows and attention take the ring.
"""
import numpy as np

from fastserve.backends.cpu import _matmul

cimport cython
from libc.stdint cimport int64_t, uint8_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from fastserve.backends.cpu._pool cimport Pool, fs_pool, fs_task_fn, pool_run

cdef extern from "<stdlib.h>" nogil:
    void *aligned_alloc(size_t alignment, size_t size)

cdef extern from "_attention_kernels.h" nogil:
    enum:
        FS_KT
        FS_SEG
        FS_QB
        FS_ROWS
        FS_MERGE_POOL_ROWS
        FS_KV_F32
        FS_KV_F16
        FS_KV_Q8_0
        FS_ATTN_SCALAR
        FS_ATTN_AVX2
        FS_ATTN_AVX512
        FS_ATTN_NEON
    ctypedef struct fs_attn_job:
        const float *q
        const uint8_t *k
        const uint8_t *v
        const int64_t *slots
        const int64_t *pos
        const int64_t *tile_start
        const int64_t *tile_len
        float *out
        int64_t n_tiles_q, H, Hkv, D, Dp, G, n_ctx, n_ktiles
        int64_t window
        int type_k, type_v
        float c
        uint8_t *scratch
        int *scratch_busy
        int n_scratch
        int64_t scratch_bytes
        const fs_attn_isa *isa
        int split
        int64_t n_seg, heads_per_item
        float *partial
        int64_t ring
        const float *sinks
    int64_t fs_kv_row_bytes(int type, int64_t D)
    int64_t fs_k_tile_bytes(int type, int64_t D)
    void fs_kv_encode(int type, const float *x, int64_t n, int64_t D, uint8_t *out)
    void fs_kv_decode(int type, const uint8_t *inp, int64_t n, int64_t D, float *x)
    void fs_k_tile_move(int type, uint8_t *tile, int64_t D, int64_t j, uint8_t *row, int put)
    float fs_exp2(float x)
    float FS_LOG2E
    int64_t fs_attn_scratch_floats(int64_t D, int64_t Dp)
    int64_t fs_attn_tokens_per_item(int64_t G)
    void fs_attn_task(void *ctx, int64_t begin, int64_t end)
    int64_t fs_attn_plan(fs_attn_job *jb)
    int64_t fs_attn_partial_floats(const fs_attn_job *jb)
    void fs_attn_merge_task(void *ctx, int64_t begin, int64_t end)
    int64_t fs_attn_merge_units(const fs_attn_job *jb)
    int fs_attn_isa_supported(int isa)
    int fs_attn_best_isa()
    const fs_attn_isa *fs_attn_isa_for(int isa)

KT = FS_KT
SEG = FS_SEG
ROWS = FS_ROWS              # most query rows of one work item: a KV head's query heads may not be more
KV_TYPES = {"f32": FS_KV_F32, "f16": FS_KV_F16, "q8_0": FS_KV_Q8_0}
ISA_NAMES = {FS_ATTN_SCALAR: "scalar", FS_ATTN_AVX2: "avx2", FS_ATTN_AVX512: "avx512", FS_ATTN_NEON: "neon"}
_ISA_IDS = {v: k for k, v in ISA_NAMES.items()}
MAX_HEAD_DIM = 1024


def isas():
    """The kernels this machine can run ("scalar" always)."""
    return tuple(name for isa, name in sorted(ISA_NAMES.items()) if fs_attn_isa_supported(isa))


# the products' kernels (_matmul.isas()) -> attention's of the same instructions
_FROM_MATMUL_ISA = {"scalar": "scalar", "avx2": "avx2", "avx512vnni": "avx512", "neon": "neon", "neon_dotprod": "neon"}


def best_isa():
    """The kernel "auto" runs: the one of the products' instructions when FASTSERVE_ISA names them (read and
    checked once, by _matmul.env_isa), else the best this machine has."""
    want = _matmul.env_isa()
    return _FROM_MATMUL_ISA[want] if want else ISA_NAMES[fs_attn_best_isa()]


def kv_type_id(str type_name, int64_t head_dim):
    """The C id of a KV cache type; ValueError naming the problem for an unknown type or a head_dim
    that type cannot hold."""
    if type_name not in KV_TYPES:
        raise ValueError(f"unknown KV cache type {type_name!r}; known: {', '.join(KV_TYPES)}")
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not in 1..{MAX_HEAD_DIM}")
    if type_name == "q8_0" and head_dim % FS_QB:
        raise ValueError(f"a q8_0 KV cache needs head_dim a multiple of {FS_QB}; this model's is {head_dim}")
    return KV_TYPES[type_name]


def row_bytes(str type_name, int64_t head_dim):
    """Bytes of one token's row of one KV head (D values) in that type."""
    return fs_kv_row_bytes(kv_type_id(type_name, head_dim), head_dim)


def k_tile_bytes(str type_name, int64_t head_dim):
    """Bytes of one K tile (KT keys of one KV head)."""
    return fs_k_tile_bytes(kv_type_id(type_name, head_dim), head_dim)


def exp2(const float[::1] x):
    """The kernels' 2^x (x <= 0), element-wise: float32 [n] -> float32 [n]."""
    out = np.empty(x.shape[0], np.float32)
    cdef float[::1] o = out
    cdef Py_ssize_t i
    for i in range(x.shape[0]):
        o[i] = fs_exp2(x[i])
    return out


def encode_rows(str type_name, const float[:, ::1] x):
    """Head rows float32 [n, D] -> uint8 [n, row_bytes] in the type's row format."""
    cdef int64_t n = x.shape[0], D = x.shape[1]
    cdef int t = kv_type_id(type_name, D)
    out = np.zeros((n, fs_kv_row_bytes(t, D)), np.uint8)
    cdef uint8_t[:, ::1] o = out
    if n:
        fs_kv_encode(t, &x[0, 0], n, D, &o[0, 0])
    return out


def decode_rows(str type_name, const uint8_t[:, ::1] rows, int64_t head_dim):
    """The inverse of encode_rows: uint8 [n, row_bytes] -> float32 [n, D] (the values attention reads)."""
    cdef int t = kv_type_id(type_name, head_dim)
    cdef int64_t n = rows.shape[0]
    if rows.shape[1] != fs_kv_row_bytes(t, head_dim):
        raise ValueError(f"{type_name} rows of head_dim {head_dim} have {fs_kv_row_bytes(t, head_dim)} bytes, "
                         f"got {rows.shape[1]}")
    out = np.zeros((n, head_dim), np.float32)
    cdef float[:, ::1] o = out
    if n:
        fs_kv_decode(t, &rows[0, 0], n, head_dim, &o[0, 0])
    return out


@cython.cdivision(True)
cdef inline int64_t _row(int64_t p, int64_t ring) noexcept nogil:
    """The cache row of position p (its K tile: _row(p) // KT, its key in the tile: p % KT)."""
    return p % ring if ring else p


cdef int _check_cache(const uint8_t[:, :, :, ::1] k_cache, const uint8_t[:, :, :, ::1] v_cache, int tk, int tv,
                      int64_t D, int64_t ring=0) except -1:
    if k_cache.shape[0] != v_cache.shape[0] or k_cache.shape[2] != v_cache.shape[2]:
        raise ValueError("k_cache and v_cache disagree on slots or KV heads")
    if k_cache.shape[3] != fs_k_tile_bytes(tk, D) or v_cache.shape[3] != fs_kv_row_bytes(tv, D):
        raise ValueError(f"KV cache rows do not fit head_dim {D} in these types")
    if k_cache.shape[1] * FS_KT < v_cache.shape[1]:
        raise ValueError(f"k_cache has {k_cache.shape[1]} tiles of {FS_KT}, too few for {v_cache.shape[1]} positions")
    if ring < 0 or ring % FS_KT or (ring and (v_cache.shape[1] != ring or k_cache.shape[1] * FS_KT != ring)):
        raise ValueError(f"a ring of {ring} positions needs a multiple of {FS_KT} and a cache of that many "
                         f"(this one: {v_cache.shape[1]} positions, {k_cache.shape[1]} tiles)")
    return 0


cdef int _check_rows(const int64_t[::1] slots, const int64_t[::1] positions, int64_t n, int64_t n_slots,
                     int64_t n_ctx, int64_t ring=0) except -1:
    """Rows inside the cache (a ring takes any position >= 0)."""
    cdef int64_t i
    if slots.shape[0] < n or positions.shape[0] < n:
        raise ValueError(f"slots and positions need {n} entries")
    for i in range(n):
        if not (0 <= slots[i] < n_slots and 0 <= positions[i] and (ring or positions[i] < n_ctx)):
            raise ValueError(f"row {i}: slot {slots[i]} / position {positions[i]} outside the cache "
                             f"({n_slots} slots x {n_ctx} positions)")
    return 0


def store(str type_k, str type_v, uint8_t[:, :, :, ::1] k_cache, uint8_t[:, :, :, ::1] v_cache,
          const float[:, :, ::1] k, const float[:, :, ::1] v, const int64_t[::1] slots,
          const int64_t[::1] positions, int64_t ring=0):
    """Write K/V rows k, v float32 [n, Hkv, D] of batch row i at (slots[i], positions[i]), converted
    once into the cache's types; ring: see the module's docstring (0: none)."""
    cdef int64_t n = k.shape[0], Hkv = k.shape[1], D = k.shape[2], i, h
    cdef int tk = kv_type_id(type_k, D), tv = kv_type_id(type_v, D)
    if v.shape[0] != n or v.shape[1] != Hkv or v.shape[2] != D or k_cache.shape[2] != Hkv:
        raise ValueError(f"store: k {np.shape(k)}, v {np.shape(v)} and the cache's {k_cache.shape[2]} KV heads disagree")
    _check_cache(k_cache, v_cache, tk, tv, D, ring)
    _check_rows(slots, positions, n, k_cache.shape[0], v_cache.shape[1], ring)
    cdef kv_layer kv = _layer(k_cache, v_cache, tk, tv, D, ring)
    if n:
        with nogil:
            store_rows(&kv, &k[0, 0, 0], &v[0, 0, 0], Hkv * D, &slots[0], &positions[0], n)
    return None


cdef kv_layer _layer(const uint8_t[:, :, :, ::1] k_cache, const uint8_t[:, :, :, ::1] v_cache, int tk, int tv,
                     int64_t D, int64_t ring):
    cdef kv_layer kv
    kv.k, kv.v = <uint8_t *>&k_cache[0, 0, 0, 0], <uint8_t *>&v_cache[0, 0, 0, 0]
    kv.n_slots, kv.n_ktiles, kv.n_ctx, kv.Hkv, kv.D = k_cache.shape[0], k_cache.shape[1], v_cache.shape[1], k_cache.shape[2], D
    kv.type_k, kv.type_v, kv.ring = tk, tv, ring
    return kv


cdef void store_rows(const kv_layer *kv, const float *k, const float *v, int64_t ld, const int64_t *slots,
                     const int64_t *positions, int64_t n) noexcept nogil:
    cdef uint8_t row[4096]              # one head row of up to MAX_HEAD_DIM float32
    cdef int64_t i, h, p, D = kv.D, Hkv = kv.Hkv
    cdef int64_t kb = fs_k_tile_bytes(kv.type_k, D), vb = fs_kv_row_bytes(kv.type_v, D)
    for i in range(n):
        p = _row(positions[i], kv.ring)
        for h in range(Hkv):
            fs_kv_encode(kv.type_k, k + i * ld + h * D, 1, D, row)
            fs_k_tile_move(kv.type_k, kv.k + ((slots[i] * kv.n_ktiles + p // FS_KT) * Hkv + h) * kb, D, p % FS_KT,
                           row, 1)
            fs_kv_encode(kv.type_v, v + i * ld + h * D, 1, D, kv.v + ((slots[i] * kv.n_ctx + p) * Hkv + h) * vb)


def move_rows(str type_k, str type_v, uint8_t[:, :, :, ::1] k_cache, uint8_t[:, :, :, ::1] v_cache,
              int64_t head_dim, int64_t slot, int64_t start, uint8_t[:, :, ::1] k_rows, uint8_t[:, :, ::1] v_rows,
              bint put, int64_t ring=0):
    """Positions start..start+n of slot <-> row-format copies k_rows, v_rows uint8 [n, Hkv, row_bytes]:
    put=False reads the cache into them (a slot save), put=True writes them into the cache (a restore).
    ring: see the module's docstring (0: none)."""
    cdef int64_t D = head_dim, n = k_rows.shape[0], Hkv = k_cache.shape[2], i, h, p
    cdef int tk = kv_type_id(type_k, D), tv = kv_type_id(type_v, D)
    _check_cache(k_cache, v_cache, tk, tv, D, ring)
    if not (0 <= slot < k_cache.shape[0] and 0 <= start and (ring or start + n <= v_cache.shape[1])):
        raise ValueError(f"slot {slot}, positions {start}..{start + n} outside the cache")
    if (v_rows.shape[0] != n or k_rows.shape[1] != Hkv or v_rows.shape[1] != Hkv
            or k_rows.shape[2] != fs_kv_row_bytes(tk, D) or v_rows.shape[2] != fs_kv_row_bytes(tv, D)):
        raise ValueError("move_rows: row buffers do not fit the cache")
    cdef int64_t vb = fs_kv_row_bytes(tv, D)
    with nogil:
        for i in range(n):
            p = _row(start + i, ring)
            for h in range(Hkv):
                fs_k_tile_move(tk, &k_cache[slot, p // FS_KT, h, 0], D, p % FS_KT, &k_rows[i, h, 0], put)
                if put:
                    memcpy(&v_cache[slot, p, h, 0], &v_rows[i, h, 0], vb)
                else:
                    memcpy(&v_rows[i, h, 0], &v_cache[slot, p, h, 0], vb)
    return None


cdef class Attention:
    """attn(q, k_cache, v_cache, type_k, type_v, slots, positions, out, scale, window=0, ring=0, sinks=None).

    pool: the step's helper threads (fastserve.backends.cpu._pool.Pool; None: the caller alone); the work is
    split over (token tile, KV head) items, or, when those are too few for the threads (long decode
    rows), over (token tile, KV head, key segment) items whose states are merged after (the same
    numbers either way). isa: "auto" or a name from isas(). Holds the per-thread scratch and the
    segments' states (grown on demand, never shrunk). One caller at a time. (Attributes: _attention.pxd.)"""

    def __cinit__(self):
        self.scratch = NULL
        self.partial = NULL
        self.partial_floats = 0
        self.busy = NULL
        self.tile_start = self.tile_len = NULL
        self.tile_cap = 0

    def __init__(self, Pool pool=None, str isa="auto"):
        if isa == "auto":
            isa = best_isa()
        if isa not in _ISA_IDS:
            raise ValueError(f"unknown isa {isa!r}; known: {', '.join(_ISA_IDS)}")
        if not fs_attn_isa_supported(_ISA_IDS[isa]):
            raise ValueError(f"this machine cannot run the {isa} attention kernel; it can: {', '.join(isas())}")
        self.isa, self.pool = isa, pool
        self.kern = fs_attn_isa_for(_ISA_IDS[isa])
        self.n_scratch = pool.threads if pool is not None else 1
        self.busy = <int *>malloc(self.n_scratch * sizeof(int))
        if self.busy == NULL:
            raise MemoryError("Attention: out of memory")
        memset(self.busy, 0, self.n_scratch * sizeof(int))
        self.scratch_bytes = 0

    def __dealloc__(self):
        free(self.scratch)
        free(self.partial)
        free(self.busy)
        free(self.tile_start)
        free(self.tile_len)

    cdef int _reserve(self, int64_t D, int64_t Dp, int64_t n) noexcept nogil:
        """Grows the scratch to fit; -1 when out of memory."""
        cdef int64_t need = (fs_attn_scratch_floats(D, Dp) * 4 + 63) // 64 * 64
        if need > self.scratch_bytes:
            free(self.scratch)         # cache-line aligned: the tiles' vector loads never straddle two lines
            self.scratch = <uint8_t *>aligned_alloc(64, need * self.n_scratch)
            if self.scratch == NULL:
                self.scratch_bytes = 0
                return -1
            self.scratch_bytes = need
        if self.tile_cap < n:
            free(self.tile_start)
            free(self.tile_len)
            self.tile_start = <int64_t *>malloc(n * sizeof(int64_t))
            self.tile_len = <int64_t *>malloc(n * sizeof(int64_t))
            self.tile_cap = n if self.tile_start != NULL and self.tile_len != NULL else 0
            if self.tile_cap == 0:
                return -1
        return 0

    cdef int run(self, const float *q, int64_t n, int64_t H, const kv_layer *kv, const int64_t *slots,
                 const int64_t *positions, float *out, float scale, int64_t window,
                 const float *sinks) noexcept nogil:
        """__call__ on raw pointers (q [n, H, D] and out [n, H * D] contiguous; sinks [H] or NULL), checked by
        the caller. 0, or -1 when the scratch could not grow (nothing written)."""
        cdef int64_t D = kv.D, Hkv = kv.Hkv
        cdef int64_t G = H // Hkv, Dp = (D + 15) // 16 * 16, per = fs_attn_tokens_per_item(G), nq = 0, i
        if n == 0:
            return 0
        if self._reserve(D, Dp, n) < 0:
            return -1
        for i in range(n):              # token tiles: runs of consecutive rows of one slot, at most `per`
            if nq > 0 and slots[i] == slots[self.tile_start[nq - 1]] and self.tile_len[nq - 1] < per:
                self.tile_len[nq - 1] += 1
            else:
                self.tile_start[nq], self.tile_len[nq] = i, 1
                nq += 1
        cdef fs_attn_job job
        job.q, job.k, job.v = q, kv.k, kv.v
        job.slots, job.pos = slots, positions
        job.tile_start, job.tile_len = self.tile_start, self.tile_len
        job.out = out
        job.n_tiles_q, job.H, job.Hkv, job.D, job.Dp, job.G = nq, H, Hkv, D, Dp, G
        job.n_ctx, job.n_ktiles, job.window, job.ring = kv.n_ctx, kv.n_ktiles, window, kv.ring
        job.type_k, job.type_v = kv.type_k, kv.type_v
        job.c = scale * FS_LOG2E
        job.sinks = sinks
        job.scratch, job.scratch_busy, job.n_scratch, job.scratch_bytes = self.scratch, self.busy, self.n_scratch, self.scratch_bytes
        job.isa = self.kern
        # the work items planned: a split job's segments' states go to self.partial, merged after
        cdef int64_t n_items = fs_attn_plan(&job), need = fs_attn_partial_floats(&job)
        if need > self.partial_floats:
            free(self.partial)
            self.partial = <float *>malloc(need * sizeof(float))
            self.partial_floats = need if self.partial != NULL else 0
            if self.partial == NULL:
                return -1
        job.partial = self.partial
        cdef int64_t units = fs_attn_merge_units(&job), tasks = 2 * self.n_scratch
        cdef int64_t per_task = (units + tasks - 1) // tasks
        if self.pool is not None and self.pool.pl != NULL:
            pool_run(self.pool.pl, <fs_task_fn>fs_attn_task, &job, n_items, 1)
            if n >= FS_MERGE_POOL_ROWS:     # a verification block's merge: (row, head) units, two tasks a thread
                pool_run(self.pool.pl, <fs_task_fn>fs_attn_merge_task, &job, units, per_task)
                return 0
        else:
            fs_attn_task(&job, 0, n_items)
        fs_attn_merge_task(&job, 0, units)
        return 0

    def __call__(self, const float[:, :, ::1] q, const uint8_t[:, :, :, ::1] k_cache,
                 const uint8_t[:, :, :, ::1] v_cache, str type_k, str type_v, const int64_t[::1] slots,
                 const int64_t[::1] positions, float[:, ::1] out, float scale, int64_t window=0, int64_t ring=0,
                 sinks=None):
        """q float32 [n, H, D]; slots, positions int64 [n]; out float32 [>= n, H * D] (rows < n written).

        window: 0 for causal attention (a query at q sees every key at p <= q); w > 0 for a sliding
        window of w keys (it sees p with q - w < p <= q, its own included). ring: 0, or the cache is a
        ring of that many positions (module docstring), which must hold every key a query sees.
        sinks: None, or float32 [H] each head's sink logit, in the softmax's denominator only (gpt-oss)."""
        cdef int64_t n = q.shape[0], H = q.shape[1], D = q.shape[2], Hkv = k_cache.shape[2]
        cdef int tk = kv_type_id(type_k, D), tv = kv_type_id(type_v, D)
        if Hkv < 1 or H % Hkv or H // Hkv > FS_ROWS:
            raise ValueError(f"{H} query heads cannot share {Hkv} KV heads (a multiple, at most {FS_ROWS} each)")
        if window < 0:
            raise ValueError(f"window must be 0 (causal) or a count of keys > 0, got {window}")
        if ring and not 0 < window <= ring:
            raise ValueError(f"a ring of {ring} positions holds a window of at most {ring} keys, got {window}")
        if out.shape[0] < n or out.shape[1] != H * D:
            raise ValueError(f"out {np.shape(out)} does not fit {n} rows of {H} x {D}")
        cdef const float[::1] sv
        cdef const float *sp = NULL
        if sinks is not None:
            sv = np.ascontiguousarray(sinks, np.float32)
            if sv.shape[0] != H:
                raise ValueError(f"sinks: {sv.shape[0]} values for {H} query heads")
            sp = &sv[0]
        _check_cache(k_cache, v_cache, tk, tv, D, ring)
        _check_rows(slots, positions, n, k_cache.shape[0], v_cache.shape[1], ring)
        if n == 0:
            return out
        cdef kv_layer kv = _layer(k_cache, v_cache, tk, tv, D, ring)
        cdef int rc
        with nogil:
            rc = self.run(&q[0, 0, 0], n, H, &kv, &slots[0], &positions[0], &out[0, 0], scale, window, sp)
        if rc < 0:
            raise MemoryError("Attention: out of memory for the scratch or the segments' states")
        return out
