# cython: language_level=3
"""The CPU forward pass of a batch in one call, in C without the GIL: embedding rows, every layer
(norms, products, biases, q/k norms, RoPE where the layer has it, KV store, attention (with gpt-oss's sinks),
GLU or a mixture of experts (its router's gating and biases from the row), sandwich norms, residual multiplier
and adds), the final norm of the out rows, the output product,
the logit multiplier and softcap; or, for embeddings, the out rows' final hidden states (after the output norm)
instead of their logits (hidden=True: no output product).

The products are fastserve.backends.cpu._matmul's (Matmul.run), attention and the KV store fastserve.backends.cpu._attention's
(Attention.run, store_rows), the element-wise operations _layer_ops.h's: the same implementations the
NumPy reference forward (fastserve.backends.cpu.ref.forward) calls through Python, whose element-wise twins are
fastserve.backends.cpu.ref.layer_ops, so the two forwards agree bit for bit (tests/parity/test_forward.py).

Every element-wise stage computes each batch row on its own (a big batch's rows are split over the
pool, each row whole on one thread), so a token's logits do not depend on the batch, its chunk or the
threads, as for the products and attention. A mixture of experts keeps that: each row's experts and weights
come from its own router logits (_route), each selected expert runs once over the rows that chose it
(gathered in batch order: _moe), and a row's weighted expert outputs are summed in the order of their rank,
as llama.cpp's build_moe_ffn adds them (_moe_sum). The activations live in buffers sized at construction
(grown, never shrunk, when a step brings more rows): a step allocates nothing of their size.

    fwd = Forward(cfg, weights, kv, (cos, sin), (cos_local, sin_local), mm, attn, rows)
    fwd(tokens, positions, slots, out_rows, logits)      # int64 [n] x3, int64 [m], float32 [>= m, vocab]
    fwd(tokens, positions, slots, out_rows, states, hidden=True)    # states float32 [>= m, n_embd]

With fwd.profile set, each call adds its time per phase to fwd.phase_seconds() (two clock reads per
stage: for a breakdown of a step that runs as one call, bench/bench_matmul.py; off by default).
"""
import numpy as np

from libc.stdint cimport int64_t, uint8_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from fastserve.backends.cpu._pool cimport Pool, fs_task_fn, pool_run, pool_then
from fastserve.backends.cpu._matmul cimport BlockMatrix, Matmul, fs_matrix, matrix_rows
from fastserve.backends.cpu._attention cimport Attention, kv_layer, store_rows

from fastserve.backends.cpu import _attention
from fastserve.models.architecture import TOPK_SOFTMAX

cdef extern from "_layer_ops.h" nogil:
    void fs_rms_norm(const float *x, int64_t d, const float *w, float eps, float *out)
    void fs_head_norm(float *x, int64_t heads, int64_t D, const float *w, float eps)
    void fs_add(float *x, const float *b, int64_t d)
    void fs_scale(float *x, int64_t d, float s)
    void fs_rope(float *x, int64_t heads, int64_t D, int64_t rope_dim, int neox, const float *cos,
                 const float *sin)
    void fs_glu(int kind, const float *gate, const float *up, int64_t n, float *out, int simd)
    int fs_glu_simd_supported()
    void fs_softcap(float *x, int64_t n, float c)
    float fs_exp_neg(float x)

# Rows from which an element-wise stage is split over the pool (rows are independent: same bits). Zen 2,
# 2 threads, quiet, a verification pass at 3,100 tokens of context (bench_verify_cost): element-wise ops
# 2.9 / 5.4 / 8.0 ms at 17 / 33 / 49 rows on one thread, 2.4 / 4.1 / 5.5 split; 2 to 5 rows the same.
PARALLEL_ROWS = 8
# The first bytes of the next product that idle threads prefetch while this one ends and the
# element-wise ops, attention and the next quantization run (pool_then): about what a thread reads
# in one such gap, and well within a core's L2.
DEF THEN_BYTES = 256 * 1024
GLU_SPLIT = 1024        # a small batch's GLU this wide or wider is split by columns (narrower: not worth a hand-off)
# the FFN's gate by the row's ffn_act (models/architecture.py): SwiGLU, GeGLU, gpt-oss's SwiGLU
DEF GLU_SILU = 0
DEF GLU_GELU = 1
DEF GLU_SWIGLU_OAI = 2
GLU_KINDS = {"silu": GLU_SILU, "gelu": GLU_GELU, "swiglu_oai": GLU_SWIGLU_OAI}
# llama.cpp's build_moe_ffn: the sum of a row's top-k weights clamped to the smallest normal f16 before dividing
DEF MIN_WEIGHT_SUM = 6.103515625e-5


cdef struct fs_layer:
    const float *attn_norm
    const float *ffn_norm
    const float *bias               # [q_dim + 2 kv_dim], or NULL
    const float *q_norm             # [D], or NULL (then k_norm is too)
    const float *k_norm
    const float *post_attn          # [d], or NULL
    const float *post_ffn
    const float *out_bias           # [d] o's bias, or NULL
    const float *sinks              # [H] the heads' attention sinks, or NULL
    const float *router_bias        # [n_expert], or NULL
    const float *egu_bias           # [n_expert, 2 n_ff] each expert's gate | up biases, or NULL
    const float *edown_bias         # [n_expert, d] each expert's down biases, or NULL
    fs_matrix wqkv, wo, wgu, wdown   # wgu, wdown: a dense FFN's
    fs_matrix router                # a mixture of experts': [n_expert, d]
    const fs_matrix *egu            # [n_expert] each expert's gate | up rows, or NULL (a dense FFN)
    const fs_matrix *edown          # [n_expert] each expert's down matrix
    kv_layer kv
    const float *cos                # the layer's RoPE table [n_ctx, rope_dim / 2]
    const float *sin
    int rope                        # 0: q and k are not rotated (SmolLM3's every 4th layer)
    int64_t window                  # 0: causal; else a local layer's window


cdef struct fs_fwd:
    # the model
    int64_t d, H, Hkv, D, q_dim, kv_dim, n_ff, rope_dim, n_layer
    int64_t n_expert, n_used        # a mixture of experts (0: dense FFNs), the experts a token runs
    int neox, glu                   # glu: GLU_KINDS' value of the row's ffn_act
    int glu_simd                    # 1: the GLU's AVX2 code (same bits; not under FASTSERVE_ISA=scalar)
    int64_t glu_rows                # _glu_cols' rows
    int topk_softmax                # the router's gating: 1 TOPK_SOFTMAX, 0 SOFTMAX (models/architecture.py)
    float eps, embd_scale, softcap, attn_scale, residual_scale, logit_scale, expert_scale
    fs_layer *layers
    fs_matrix *experts              # [n_layer, 2, n_expert]: the layers' egu, edown
    fs_matrix embd, output
    const float *out_norm
    # the activations, [rows, width] each
    float *x                        # [d] the residual stream
    float *h                        # [d] the normed input of a product
    float *y                        # [d] a product into the stream
    float *qkv                      # [q_dim + 2 kv_dim]
    float *q                        # [q_dim] the queries, [H, D]
    float *att                      # [q_dim] attention's output
    float *gu                       # [2 n_ff] gate | up (a mixture's: a row per (row, rank) pair)
    float *act                      # [n_ff] (as gu)
    # a mixture of experts'
    float *route                    # [n_expert] router logits, then probabilities
    int64_t *sel                    # [n_used] the row's experts by rank
    float *wts                      # [n_used] their weights
    float *xe                       # [d] the (row, rank) pairs' rows of h, grouped by expert (order)
    float *ye                       # [d] their expert's outputs
    float *moe                      # [n_used, d] the row's weighted expert outputs, by rank
    int64_t *order                  # [n_used] (row, rank) pairs i * n_used + r, grouped by expert (whole batch)
    int64_t *start                  # [n_expert + 1] (not per row) each expert's first entry of order
    # the step
    const int64_t *tokens
    const int64_t *pos
    const int64_t *slots
    const int64_t *out_rows
    float *logits
    int64_t ld_logits
    bint hidden                     # the out rows' normed states go to logits (ld n_embd); no output product
    const fs_layer *layer           # the stage's layer, and the next one (or NULL)
    const fs_layer *next


cdef void _embed(void *ctx, int64_t b, int64_t e) noexcept nogil:
    cdef fs_fwd *f = <fs_fwd *>ctx
    cdef int64_t i
    matrix_rows(&f.embd, f.tokens + b, e - b, f.x + b * f.d)
    for i in range(b, e):
        if f.embd_scale != 1.0:
            fs_scale(f.x + i * f.d, f.d, f.embd_scale)
        fs_rms_norm(f.x + i * f.d, f.d, f.layers[0].attn_norm, f.eps, f.h + i * f.d)


cdef void _qkv(void *ctx, int64_t b, int64_t e) noexcept nogil:
    """qkv rows: bias, q/k norms, RoPE (in place), the queries out, K/V into the cache."""
    cdef fs_fwd *f = <fs_fwd *>ctx
    cdef const fs_layer *L = f.layer
    cdef int64_t i, w = f.q_dim + 2 * f.kv_dim, half = f.rope_dim // 2
    cdef float *r
    for i in range(b, e):
        r = f.qkv + i * w
        if L.bias != NULL:
            fs_add(r, L.bias, w)
        if L.q_norm != NULL:
            fs_head_norm(r, f.H, f.D, L.q_norm, f.eps)
            fs_head_norm(r + f.q_dim, f.Hkv, f.D, L.k_norm, f.eps)
        if L.rope:
            fs_rope(r, f.H, f.D, f.rope_dim, f.neox, L.cos + f.pos[i] * half, L.sin + f.pos[i] * half)
            fs_rope(r + f.q_dim, f.Hkv, f.D, f.rope_dim, f.neox, L.cos + f.pos[i] * half, L.sin + f.pos[i] * half)
        memcpy(f.q + i * f.q_dim, r, f.q_dim * sizeof(float))
    store_rows(&L.kv, f.qkv + b * w + f.q_dim, f.qkv + b * w + f.q_dim + f.kv_dim, w, f.slots + b, f.pos + b, e - b)


cdef inline void _residual(fs_fwd *f, int64_t b, int64_t e, const float *post, const float *norm) noexcept nogil:
    """x += r * post(y) (post: a sandwich norm, or NULL; r: the residual multiplier); h = norm(x) (norm: the
    next product's, or NULL)."""
    cdef int64_t i, d = f.d
    for i in range(b, e):
        if post != NULL:
            fs_rms_norm(f.y + i * d, d, post, f.eps, f.y + i * d)
        if f.residual_scale != 1.0:
            fs_scale(f.y + i * d, d, f.residual_scale)
        fs_add(f.x + i * d, f.y + i * d, d)
        if norm != NULL:
            fs_rms_norm(f.x + i * d, d, norm, f.eps, f.h + i * d)


cdef void _attn_out(void *ctx, int64_t b, int64_t e) noexcept nogil:
    cdef fs_fwd *f = <fs_fwd *>ctx
    cdef int64_t i
    if f.layer.out_bias != NULL:
        for i in range(b, e):
            fs_add(f.y + i * f.d, f.layer.out_bias, f.d)
    _residual(f, b, e, f.layer.post_attn, f.layer.ffn_norm)


cdef inline void _glu_span(fs_fwd *f, int64_t i, int64_t c0, int64_t c1) noexcept nogil:
    """Row i's GLU outputs [c0, c1): each is its own gate and up element's alone."""
    cdef int64_t nf = f.n_ff
    cdef const float *g = f.gu + i * 2 * nf + c0
    fs_glu(f.glu, g, g + nf, c1 - c0, f.act + i * nf + c0, f.glu_simd)


cdef void _glu(void *ctx, int64_t b, int64_t e) noexcept nogil:
    cdef fs_fwd *f = <fs_fwd *>ctx
    cdef int64_t i
    for i in range(b, e):
        _glu_span(f, i, 0, f.n_ff)


cdef void _glu_cols(void *ctx, int64_t b, int64_t e) noexcept nogil:
    """Columns [b, e) of the GLU of the batch's f.glu_rows rows: a small batch's GLU split across threads
    (per element, so the split changes no bit)."""
    cdef fs_fwd *f = <fs_fwd *>ctx
    cdef int64_t i
    for i in range(f.glu_rows):
        _glu_span(f, i, b, e)


cdef void _route(void *ctx, int64_t b, int64_t e) noexcept nogil:
    """Each row's experts and weights from its router logits (+ the router's bias), as llama.cpp's softmax
    gating with normalised weights: p = softmax(logits) (summed in expert order); the n_used largest p, ties to
    the lower id; w = p / max(their sum, MIN_WEIGHT_SUM) (summed in rank order), times the expert scale; or, for
    a TOPK_SOFTMAX row, _route_topk's."""
    cdef fs_fwd *f = <fs_fwd *>ctx
    cdef int64_t i, x, r, best, E = f.n_expert, k = f.n_used
    cdef float *p
    cdef float mx, total
    for i in range(b, e):
        p = f.route + i * E
        if f.layer.router_bias != NULL:
            fs_add(p, f.layer.router_bias, E)
        if f.topk_softmax:
            _route_topk(f, i)
            continue
        mx = p[0]
        for x in range(1, E):
            if p[x] > mx:
                mx = p[x]
        total = 0.0
        for x in range(E):
            p[x] = fs_exp_neg(p[x] - mx)
            total = total + p[x]
        for x in range(E):
            p[x] = p[x] / total
        total = 0.0
        for r in range(k):
            best = 0
            for x in range(1, E):
                if p[x] > p[best]:
                    best = x
            f.sel[i * k + r], f.wts[i * k + r] = best, p[best]
            p[best] = -1.0                  # taken (probabilities are >= 0)
            total = total + f.wts[i * k + r]
        if total < MIN_WEIGHT_SUM:
            total = MIN_WEIGHT_SUM
        for r in range(k):
            f.wts[i * k + r] = f.wts[i * k + r] / total
            if f.expert_scale != 1.0:
                f.wts[i * k + r] = f.wts[i * k + r] * f.expert_scale


cdef inline void _route_topk(fs_fwd *f, int64_t i) noexcept nogil:
    """Row i's TOPK_SOFTMAX route (gpt-oss): the n_used largest logits, ties to the lower id; w = their softmax
    (e^(l - l_first), summed in rank order), times the expert scale."""
    cdef int64_t x, r, best, E = f.n_expert, k = f.n_used
    cdef float *p = f.route + i * E
    cdef float total = 0.0
    for r in range(k):
        best = -1
        for x in range(E):
            if p[x] == p[x] and (best < 0 or p[x] > p[best]) and not _taken(f.sel + i * k, r, x):
                best = x
        best = best if best >= 0 else 0
        f.sel[i * k + r], f.wts[i * k + r] = best, p[best]
    cdef float mx = f.wts[i * k]                # the largest
    for r in range(k):
        f.wts[i * k + r] = fs_exp_neg(f.wts[i * k + r] - mx)
        total = total + f.wts[i * k + r]
    for r in range(k):
        f.wts[i * k + r] = f.wts[i * k + r] / total
        if f.expert_scale != 1.0:
            f.wts[i * k + r] = f.wts[i * k + r] * f.expert_scale


cdef inline bint _taken(const int64_t *sel, int64_t r, int64_t x) noexcept nogil:
    """Expert x among the first r chosen."""
    cdef int64_t j
    for j in range(r):
        if sel[j] == x:
            return True
    return False


cdef void _moe_sum(void *ctx, int64_t b, int64_t e) noexcept nogil:
    """y = a row's weighted expert outputs summed in rank order."""
    cdef fs_fwd *f = <fs_fwd *>ctx
    cdef int64_t i, r, d = f.d, k = f.n_used
    for i in range(b, e):
        memcpy(f.y + i * d, f.moe + i * k * d, d * sizeof(float))
        for r in range(1, k):
            fs_add(f.y + i * d, f.moe + (i * k + r) * d, d)


cdef void _ffn_out(void *ctx, int64_t b, int64_t e) noexcept nogil:
    cdef fs_fwd *f = <fs_fwd *>ctx
    _residual(f, b, e, f.layer.post_ffn, f.next.attn_norm if f.next != NULL else NULL)


cdef void _out_norm(void *ctx, int64_t b, int64_t e) noexcept nogil:
    """h[j] = out_norm(x[out_rows[j]]) for out rows j (into the caller's states when hidden)."""
    cdef fs_fwd *f = <fs_fwd *>ctx
    cdef int64_t j
    cdef float *out = f.logits if f.hidden else f.h
    for j in range(b, e):
        fs_rms_norm(f.x + f.out_rows[j] * f.d, f.d, f.out_norm, f.eps, out + j * f.d)


cdef void _logits_out(void *ctx, int64_t b, int64_t e) noexcept nogil:
    """The logit multiplier, then the softcap, where the model has them."""
    cdef fs_fwd *f = <fs_fwd *>ctx
    cdef int64_t j
    for j in range(b, e):
        if f.logit_scale != 1.0:
            fs_scale(f.logits + j * f.ld_logits, f.output.n_out, f.logit_scale)
        if f.softcap > 0:
            fs_softcap(f.logits + j * f.ld_logits, f.output.n_out, f.softcap)


PHASES = ("layer products", "attention", "element-wise ops and KV stores", "output product")
DEF N_PHASES = 4


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef class Forward:
    """The forward pass over one model's weights and KV cache (kv: backends.cpu.kv_cache.KVCache), with
    the products on mm (a fastserve.backends.cpu._matmul.Matmul) and attention on attn (a fastserve.backends.cpu._attention.
    Attention), both on pool (fastserve.backends.cpu._pool.Pool), whose threads also run the element-wise stages
    of big batches. ropes: (cos, sin) float32 [n_ctx, rope_dim / 2] of the global layers, and of the
    local ones. rows: the activations' first size. Keeps every array it points into referenced."""
    cdef fs_fwd f
    cdef Matmul mm
    cdef Attention attn
    cdef Pool pool
    cdef list _keep
    cdef list _bufs                 # the activations' arrays
    cdef readonly int64_t rows
    cdef public int64_t parallel_rows   # batches of this many rows split their element-wise stages over the pool
    cdef public int64_t glu_split       # smaller batches split a GLU of this many columns or more (_glu_stage)
    cdef int64_t n_vocab, n_slots, n_ctx
    cdef public bint profile            # add each phase's time to _phase (phase_seconds)
    cdef double _phase[N_PHASES]
    cdef double _mark

    def __cinit__(self):
        self.f.layers = NULL
        self.f.experts = NULL

    def __dealloc__(self):
        free(self.f.layers)
        free(self.f.experts)

    def __init__(self, cfg, weights, kv, ropes, ropes_local, Matmul mm, Attention attn, Pool pool, int64_t rows):
        cdef fs_fwd *f = &self.f
        cdef fs_layer *L
        cdef int64_t li
        cdef int i, local
        self.mm, self.attn, self.pool, self._keep = mm, attn, pool, []
        f.d, f.H, f.Hkv, f.D = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim
        f.q_dim, f.kv_dim, f.n_ff, f.rope_dim = f.H * f.D, f.Hkv * f.D, cfg.n_ff, cfg.rope_dim
        f.n_layer, f.neox, f.glu = cfg.n_layer, cfg.rope_neox, GLU_KINDS[cfg.arch.ffn_act]
        f.glu_simd = 1 if attn.isa != "scalar" and fs_glu_simd_supported() else 0
        f.eps, f.embd_scale, f.softcap, f.attn_scale = cfg.norm_eps, cfg.embd_scale, cfg.logit_softcap, cfg.attn_scale
        f.residual_scale, f.logit_scale = cfg.residual_scale, cfg.logit_scale
        f.n_expert, f.n_used, f.expert_scale = cfg.n_expert, cfg.n_expert_used, cfg.expert_weights_scale
        f.topk_softmax = cfg.arch.moe_gating == TOPK_SOFTMAX
        if f.n_expert and not 0 < f.n_used <= f.n_expert:
            raise ValueError(f"Forward: {f.n_used} experts used of {f.n_expert}")
        if f.n_layer < 1 or f.H % f.Hkv:
            raise ValueError(f"Forward: {f.n_layer} layers, {f.H} heads over {f.Hkv} KV heads")
        self.n_vocab, self.n_slots, self.n_ctx = cfg.n_vocab, kv.n_slots, kv.n_ctx_slot
        tk, tv = _attention.kv_type_id(kv.type_k, f.D), _attention.kv_type_id(kv.type_v, f.D)
        f.layers = <fs_layer *>malloc(f.n_layer * sizeof(fs_layer))
        if f.layers == NULL:
            raise MemoryError("Forward: out of memory")
        if f.n_expert:
            f.experts = <fs_matrix *>malloc(f.n_layer * 2 * f.n_expert * sizeof(fs_matrix))
            if f.experts == NULL:
                raise MemoryError("Forward: out of memory")
        cdef const float *tables[4]
        for i, t in enumerate((*ropes, *ropes_local)):
            tables[i] = self._table(t, kv.n_ctx_slot, f.rope_dim // 2)
        for li in range(f.n_layer):
            lw, L = weights.layers[li], &f.layers[li]
            L.attn_norm, L.ffn_norm = self._vec(lw.attn_norm, f.d), self._vec(lw.ffn_norm, f.d)
            L.bias = self._vec(lw.qkv_bias, f.q_dim + 2 * f.kv_dim)
            L.q_norm, L.k_norm = self._vec(lw.q_norm, f.D), self._vec(lw.k_norm, f.D)
            if (L.q_norm == NULL) != (L.k_norm == NULL):
                raise ValueError(f"Forward: layer {li} has a q norm or a k norm, not both")
            L.post_attn, L.post_ffn = self._vec(lw.post_attn_norm, f.d), self._vec(lw.post_ffn_norm, f.d)
            L.out_bias, L.sinks = self._vec(lw.out_bias, f.d), self._vec(lw.attn_sinks, f.H)
            L.wqkv = self._matrix(lw.wqkv, f.q_dim + 2 * f.kv_dim, f.d)
            L.wo = self._matrix(lw.wo, f.d, f.q_dim)
            self._ffn(L, lw, li)
            L.kv.k, L.kv.v = self._cache(kv.k[li]), self._cache(kv.v[li])
            L.kv.n_slots, L.kv.n_ktiles, L.kv.n_ctx = kv.k[li].shape[0], kv.k[li].shape[1], kv.v[li].shape[1]
            L.kv.Hkv, L.kv.D, L.kv.type_k, L.kv.type_v, L.kv.ring = f.Hkv, f.D, tk, tv, kv.rings[li]
            local = 1 if cfg.local_layers[li] else 0
            L.cos, L.sin = tables[2 * local], tables[2 * local + 1]
            L.rope = 1 if cfg.rope_layers[li] else 0
            L.window = cfg.sliding_window if local else 0
        f.embd = self._matrix(weights.tok_embd, cfg.n_vocab, f.d)
        f.output = self._matrix(weights.output, cfg.n_vocab, f.d)
        f.out_norm = self._vec(weights.out_norm, f.d)
        self.rows = 0
        self._grow(max(1, rows))
        self.parallel_rows = PARALLEL_ROWS
        self.glu_split = GLU_SPLIT

    cdef _ffn(self, fs_layer *L, lw, int64_t li):
        """Layer li's FFN matrices: a dense one's, or a mixture of experts' router and experts (egu, edown)."""
        cdef fs_fwd *f = &self.f
        cdef int64_t e, E = f.n_expert
        cdef fs_matrix *gu
        cdef fs_matrix *down
        memset(&L.wgu, 0, sizeof(fs_matrix))
        memset(&L.wdown, 0, sizeof(fs_matrix))
        memset(&L.router, 0, sizeof(fs_matrix))
        L.egu = L.edown = NULL
        L.router_bias = L.egu_bias = L.edown_bias = NULL
        if not E:
            L.wgu = self._matrix(lw.w_gate_up, 2 * f.n_ff, f.d)
            L.wdown = self._matrix(lw.w_down, f.d, f.n_ff)
            return
        if len(lw.experts_gate_up) != E or len(lw.experts_down) != E:
            raise ValueError(f"Forward: layer {li} has {len(lw.experts_gate_up)} experts, expected {E}")
        gu, down = f.experts + 2 * li * E, f.experts + (2 * li + 1) * E
        L.router = self._matrix(lw.router, E, f.d)
        for e in range(E):
            gu[e] = self._matrix(lw.experts_gate_up[e], 2 * f.n_ff, f.d)
            down[e] = self._matrix(lw.experts_down[e], f.d, f.n_ff)
        L.egu, L.edown = gu, down
        L.router_bias = self._vec(lw.router_bias, E)
        L.egu_bias = self._vec(None if lw.experts_gate_up_bias is None else lw.experts_gate_up_bias.reshape(-1),
                               E * 2 * f.n_ff)
        L.edown_bias = self._vec(None if lw.experts_down_bias is None else lw.experts_down_bias.reshape(-1), E * f.d)

    cdef const float *_vec(self, a, int64_t n) except? NULL:
        """A float32 vector of n (kept), or NULL for None."""
        if a is None:
            return NULL
        cdef const float[::1] v = np.ascontiguousarray(a, np.float32)
        if v.shape[0] != n:
            raise ValueError(f"Forward: a vector of {v.shape[0]} where {n} are needed")
        self._keep.append(v)
        return &v[0]

    cdef const float *_table(self, a, int64_t n_ctx, int64_t half) except NULL:
        cdef const float[:, ::1] t = np.ascontiguousarray(a, np.float32)
        if t.shape[0] < n_ctx or t.shape[1] != half:
            raise ValueError(f"Forward: a RoPE table of {np.shape(a)}, expected ({n_ctx}, {half})")
        self._keep.append(t)
        return &t[0, 0] if half else <const float *>self._vec(np.zeros(1, np.float32), 1)

    cdef fs_matrix _matrix(self, BlockMatrix w, int64_t n_out, int64_t n_in) except *:
        if w.n_out != n_out or w.n_in != n_in:
            raise ValueError(f"Forward: a matrix of {w.shape}, expected {(n_out, n_in)}")
        self._keep.append(w)
        return w.view()

    cdef uint8_t *_cache(self, a) except NULL:
        cdef uint8_t[:, :, :, ::1] c = a
        self._keep.append(a)
        return &c[0, 0, 0, 0]

    cdef _grow(self, int64_t rows):
        """The activations for `rows` batch rows (kept in self._bufs)."""
        cdef fs_fwd *f = &self.f
        cdef int64_t E = max(1, f.n_expert), k = max(1, f.n_used)
        widths = (f.d, f.d, f.d, f.q_dim + 2 * f.kv_dim, f.q_dim, f.q_dim, 2 * f.n_ff, f.n_ff,
                  E, k, f.d, f.d, k * f.d)
        per_row = (1, 1, 1, 1, 1, 1, k, k, 1, 1, k, k, 1)      # gu, act, xe, ye: a row per (row, rank) pair
        bufs = [np.zeros((rows * p, w), np.float32) for p, w in zip(per_row, widths)]
        cdef float[:, ::1] b0 = bufs[0], b1 = bufs[1], b2 = bufs[2], b3 = bufs[3]
        cdef float[:, ::1] b4 = bufs[4], b5 = bufs[5], b6 = bufs[6], b7 = bufs[7]
        cdef float[:, ::1] b8 = bufs[8], b9 = bufs[9], b10 = bufs[10], b11 = bufs[11], b12 = bufs[12]
        f.x, f.h, f.y, f.qkv = &b0[0, 0], &b1[0, 0], &b2[0, 0], &b3[0, 0]
        f.q, f.att, f.gu, f.act = &b4[0, 0], &b5[0, 0], &b6[0, 0], &b7[0, 0]
        f.route, f.wts, f.xe, f.ye, f.moe = &b8[0, 0], &b9[0, 0], &b10[0, 0], &b11[0, 0], &b12[0, 0]
        ints = [np.zeros((rows, k), np.int64), np.zeros((rows, k), np.int64), np.zeros(E + 1, np.int64)]
        cdef int64_t[:, ::1] i0 = ints[0], i1 = ints[1]
        cdef int64_t[::1] i2 = ints[2]
        f.sel, f.order, f.start = &i0[0, 0], &i1[0, 0], &i2[0]
        self._bufs = bufs + ints
        self.rows = rows

    def __call__(self, tokens, positions, slots, out_rows, logits, bint hidden=False):
        """tokens, positions, slots int64 [n]; out_rows int64 [m] (in [0, n)); logits float32 [>= m,
        n_vocab] (C-contiguous): rows < m written. Returns logits[:m]. hidden: logits is float32 [>= m,
        n_embd] and gets the out rows' final hidden states (after the output norm) instead."""
        cdef const int64_t[::1] tv = tokens, pv = positions, sv = slots, ov = out_rows
        cdef float[:, ::1] lv = logits
        cdef int64_t n = tv.shape[0], m = ov.shape[0], i
        cdef fs_fwd *f = &self.f
        if pv.shape[0] != n or sv.shape[0] != n:
            raise ValueError(f"forward: {n} tokens, {pv.shape[0]} positions, {sv.shape[0]} slots")
        cdef int64_t width = self.f.d if hidden else self.n_vocab
        if lv.shape[0] < m or lv.shape[1] != width:
            raise ValueError(f"forward: logits {np.shape(logits)} do not fit {m} rows of {width}")
        for i in range(n):
            if not 0 <= tv[i] < self.n_vocab:
                raise IndexError(f"token {tv[i]} is outside the vocabulary [0, {self.n_vocab})")
            if not 0 <= pv[i] < self.n_ctx:
                raise ValueError(f"positions must be in [0, {self.n_ctx}), got {pv[i]} at row {i}")
            if not 0 <= sv[i] < self.n_slots:
                raise ValueError(f"slots must be in [0, {self.n_slots}), got {sv[i]} at row {i}")
        for i in range(m):
            if not 0 <= ov[i] < n:
                raise ValueError(f"out_rows must be in [0, {n}), got {ov[i]}")
        if n == 0:
            return logits[:m]
        if n > self.rows:
            self._grow(n)
        f.tokens, f.pos, f.slots, f.out_rows = &tv[0], &pv[0], &sv[0], &ov[0] if m else NULL
        f.logits, f.ld_logits, f.hidden = &lv[0, 0] if m else NULL, lv.shape[1], hidden
        cdef int rc
        with nogil:
            rc = self._run(n, m)
        if rc < 0:
            raise MemoryError("forward: out of memory for a product's or attention's scratch")
        return logits[:m]

    def phase_seconds(self, bint reset=False):
        """{phase: seconds} summed over the calls made with profile set (PHASES); reset: zero them after."""
        out = {name: self._phase[i] for i, name in enumerate(PHASES)}
        if reset:
            for i in range(N_PHASES):
                self._phase[i] = 0.0
        return out

    cdef inline void _lap(self, int phase) noexcept nogil:
        """With profile set: the time since the last lap goes to phase."""
        cdef double t
        if self.profile:
            t = _now()
            self._phase[phase] += t - self._mark
            self._mark = t

    cdef void _rows(self, fs_task_fn stage, int64_t n) noexcept nogil:
        """stage over batch rows [0, n): on the pool when the batch is big, else on this thread."""
        cdef int threads = self.pool.threads
        if threads > 1 and n >= self.parallel_rows:
            pool_run(self.pool.pl, stage, &self.f, n, (n + 2 * threads - 1) // (2 * threads))
        else:
            stage(&self.f, 0, n)

    cdef inline int _product(self, const float *x, int64_t ldx, int64_t n, const fs_matrix *w, float *y,
                             int64_t ldy, int phase, const fs_matrix *then) noexcept nogil:
        """y = x . w^T (Matmul.run), its time to phase; then (or NULL): the product after it, whose first
        rows the threads that wait prefetch from this one's start on. < 0: out of memory."""
        cdef int64_t nbytes = 0
        if then != NULL and then.n_parts > 0:
            nbytes = min(THEN_BYTES, then.parts[0].rows * then.parts[0].row_bytes)
        pool_then(self.pool.pl, then.parts[0].data if nbytes else NULL, nbytes)
        cdef int rc = self.mm.run(x, ldx, n, w, y, ldy)
        self._lap(phase)
        return rc

    cdef inline void _stage(self, fs_task_fn stage, int64_t n) noexcept nogil:
        """An element-wise stage over rows [0, n) (_rows), its time to the element-wise phase."""
        self._rows(stage, n)
        self._lap(2)

    cdef void _glu_stage(self, int64_t n) noexcept nogil:
        """The GLU of rows [0, n): a batch too small to split by rows is split by columns (at one row, the
        n_ff exponentials are the longest element-wise stage: ~23 us of 8192 on the Zen 2)."""
        cdef int threads = self.pool.threads
        if threads > 1 and n < self.parallel_rows and self.f.n_ff >= self.glu_split:
            self.f.glu_rows = n
            pool_run(self.pool.pl, _glu_cols, &self.f, self.f.n_ff, (self.f.n_ff + 2 * threads - 1) // (2 * threads))
            self._lap(2)
        else:
            self._stage(_glu, n)

    cdef int _moe(self, int64_t n, const fs_layer *L) noexcept nogil:
        """y [n, d] = the mixture of experts of h [n, d]: the rows' routes (_route), the (row, rank) pairs grouped
        by expert (a counting sort, rows in batch order) and their rows of h gathered in that order, each
        selected expert once over its rows (one grouped product for all the experts' gate | up, the GLU, one for
        their down: Matmul.run_groups), the outputs weighted into the rows' moe slots, then each row's sum by
        rank (_moe_sum). < 0: out of memory."""
        cdef fs_fwd *f = &self.f
        cdef int64_t E = f.n_expert, k = f.n_used, d = f.d, e, j, t, c
        cdef float w
        cdef float *src
        cdef float *dst
        if self._product(f.h, d, n, &L.router, f.route, E, 0, NULL) < 0:
            return -1
        self._stage(_route, n)
        memset(f.start, 0, (E + 1) * sizeof(int64_t))
        for j in range(n * k):
            f.start[f.sel[j] + 1] += 1
        for e in range(E):
            f.start[e + 1] += f.start[e]
        for j in range(n * k):                  # start[e] runs ahead as e's entries are placed, then is restored
            f.order[f.start[f.sel[j]]] = j
            f.start[f.sel[j]] += 1
        for e in range(E - 1, 0, -1):
            f.start[e] = f.start[e - 1]
        f.start[0] = 0
        for t in range(n * k):
            memcpy(f.xe + t * d, f.h + (f.order[t] // k) * d, d * sizeof(float))
        self._lap(2)
        if self.mm.run_groups(f.xe, d, f.start, E, L.egu, f.gu, 2 * f.n_ff) < 0:
            return -1
        self._lap(0)
        if L.egu_bias != NULL:
            for t in range(n * k):
                fs_add(f.gu + t * 2 * f.n_ff, L.egu_bias + f.sel[f.order[t]] * 2 * f.n_ff, 2 * f.n_ff)
        self._glu_stage(n * k)
        if self.mm.run_groups(f.act, f.n_ff, f.start, E, L.edown, f.ye, d) < 0:
            return -1
        self._lap(0)
        for t in range(n * k):
            j = f.order[t]
            w, src, dst = f.wts[j], f.ye + t * d, f.moe + j * d
            if L.edown_bias != NULL:
                fs_add(src, L.edown_bias + f.sel[j] * d, d)
            for c in range(d):
                dst[c] = src[c] * w
        self._stage(_moe_sum, n)
        return 0

    cdef int _run(self, int64_t n, int64_t m) noexcept nogil:
        cdef fs_fwd *f = &self.f
        cdef const fs_layer *L
        cdef int64_t li, wq = f.q_dim + 2 * f.kv_dim
        if self.profile:
            self._mark = _now()
        self._stage(_embed, n)
        for li in range(f.n_layer):
            L = &f.layers[li]
            f.layer, f.next = L, (&f.layers[li + 1] if li + 1 < f.n_layer else NULL)
            if self._product(f.h, f.d, n, &L.wqkv, f.qkv, wq, 0, &L.wo) < 0:
                return -1
            self._stage(_qkv, n)
            if self.attn.run(f.q, n, f.H, &L.kv, f.slots, f.pos, f.att, f.attn_scale, L.window, L.sinks) < 0:
                return -1
            self._lap(1)
            if self._product(f.att, f.q_dim, n, &L.wo, f.y, f.d, 0, &L.wgu if L.egu == NULL else NULL) < 0:
                return -1
            self._stage(_attn_out, n)
            if L.egu != NULL:
                if self._moe(n, L) < 0:
                    return -1
            else:
                if self._product(f.h, f.d, n, &L.wgu, f.gu, 2 * f.n_ff, 0, &L.wdown) < 0:
                    return -1
                self._glu_stage(n)
                if self._product(f.act, f.n_ff, n, &L.wdown, f.y, f.d, 0,
                                 &f.layers[li + 1].wqkv if li + 1 < f.n_layer else &f.output) < 0:
                    return -1
            self._stage(_ffn_out, n)
        if m == 0:
            return 0
        self._stage(_out_norm, m)
        if f.hidden:
            return 0
        if self._product(f.h, f.d, m, &f.output, f.logits, f.ld_logits, 3, &f.layers[0].wqkv) < 0:
            return -1
        if f.softcap > 0 or f.logit_scale != 1.0:
            self._stage(_logits_out, m)
        return 0


# ---- the element-wise operations one by one, for their parity tests (tests/parity/test_layer_ops.py) ----

def rms_norm(const float[:, ::1] x, const float[::1] w, float eps):
    """x [n, d], w [d] -> float32 [n, d]: each row / rms(row) * w."""
    out = np.zeros((x.shape[0], x.shape[1]), np.float32)
    cdef float[:, ::1] o = out
    cdef Py_ssize_t i
    if w.shape[0] != x.shape[1]:
        raise ValueError("rms_norm: w does not fit the rows")
    for i in range(x.shape[0]):
        fs_rms_norm(&x[i, 0], x.shape[1], &w[0], eps, &o[i, 0])
    return out


def rope(const float[:, :, ::1] x, const float[:, ::1] cos, const float[:, ::1] sin, int64_t rope_dim, bint neox):
    """x [n, heads, D]; cos, sin [n, rope_dim / 2] -> float32 [n, heads, D] rotated."""
    out = np.array(x, np.float32)
    cdef float[:, :, ::1] o = out
    cdef Py_ssize_t i
    if rope_dim > x.shape[2] or cos.shape[0] != x.shape[0] or cos.shape[1] != rope_dim // 2 \
            or sin.shape[0] != cos.shape[0] or sin.shape[1] != cos.shape[1]:
        raise ValueError("rope: the tables do not fit x")
    for i in range(x.shape[0]):
        fs_rope(&o[i, 0, 0], x.shape[1], x.shape[2], rope_dim, neox, &cos[i, 0], &sin[i, 0])
    return out


def glu(const float[::1] gate, const float[::1] up, int kind, bint simd=False):
    """gate, up [n] -> float32 [n]: silu(gate) * up (kind GLU_SILU, or False), gelu(gate) * up (GLU_GELU, or
    True), gpt-oss's swiglu_oai(gate, up) (GLU_SWIGLU_OAI); simd: the AVX2 code (ValueError where the machine
    has none)."""
    out = np.zeros(gate.shape[0], np.float32)
    cdef float[::1] o = out
    if up.shape[0] != gate.shape[0]:
        raise ValueError("glu: gate and up differ in size")
    if kind not in GLU_KINDS.values():
        raise ValueError(f"glu: unknown kind {kind}")
    if simd and not fs_glu_simd_supported():
        raise ValueError("glu: this machine has no AVX2")
    if gate.shape[0]:
        fs_glu(kind, &gate[0], &up[0], gate.shape[0], &o[0], simd)
    return out


def glu_simd_supported():
    """True where glu(..., simd=True) and the forward's GLU can run the AVX2 code."""
    return bool(fs_glu_simd_supported())


def softcap(const float[::1] x, float c):
    """x [n] -> float32 [n]: c * tanh(x / c)."""
    out = np.array(x, np.float32)
    cdef float[::1] o = out
    if x.shape[0]:
        fs_softcap(&o[0], x.shape[0], c)
    return out
