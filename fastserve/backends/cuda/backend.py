"""The transformer forward pass on an NVIDIA GPU: fastserve's kernels (cuda/*.cu) plus cuBLAS, through CuPy.

Same contract as CpuBackend (fastserve/backends/base.py); same math, in this order per layer, the
bracketed steps where the architecture row asks for them (models/architecture.py, read through cfg):
    x = embedding rows [* embd_scale]
    h = rmsnorm(x) -> qkv = h Wqkv^T -> [+ bias, per-head q/k RMSNorm: qk_prep] -> [RoPE(q, k) (a local
      layer: its own base, or gpt-oss's: the global tables, YaRN included; none on smollm3's every 4th layer)]
      -> K, V into the cache -> attention (a local layer: keys q - window < p <= q; gpt-oss: each head's sink
      in the softmax's denominator) -> y = a Wo^T -> [y = rmsnorm(y): post-attention norm] -> x += [r *] y
      [-> x += o's bias: add_bias]
    h = rmsnorm(x) -> gu = h Wgu^T -> s = silu(g) * u (GeGLU: gelu(g) * u) -> y = s Wdown^T
      -> [y = rmsnorm(y): post-FFN norm] -> x += [r *] y
      (a mixture of experts, _moe: router logits h Wr^T [+ bias], h and Wr float32 as the CPU's -> each row's
      top-k experts and weights (cuda/moe.cu, one block a row; gpt-oss: the softmax over the top k logits) -> the
      (row, rank) pairs grouped by expert on the device (a counting sort into tiles whose number n fixes: no host
      wait, so a decode step stays one graph) -> each selected expert once over its pairs (cuda/matvec.cu's grouped
      products, the file's 3-D expert tensors, MXFP4 ones dequantized on upload like any matrix; gpt-oss: the
      experts' gate/up and down biases, swiglu_oai) -> y = each row's weighted expert outputs summed in rank
      order, as the CPU's _forward._moe)
then the final norm on the output rows only, logits = [l *] h Wout^T [-> c tanh(logits / c): soft-capping]
(r, l: granite's residual and logit multipliers, taken into the products' and logit_out's launches).
Products of up to matvec_max_n rows (decode) form h as they read it and gate/up's warp writes s: h and
gu are then never stored. Without sandwich norms the output products add into x directly (y unused).

Precision: weights are dequantized on the host matrix by matrix (float32, BlockMatrix.to_float) and rounded once at load
to `dtype` (f16 by default, or bf16); the residual stream x, the products' accumulation and outputs
(qkv, gate/up, logits), norms, RoPE and softmax are float32; what a product reads (normed h,
attention output, SwiGLU output) is rounded to `dtype`; the KV cache is `dtype`.

Device memory, all allocated here, once (sizes for N = max_tokens, M = max_out rows):
    weights                          per layer wqkv [(H+2Hkv)D, d], wo [d, HD], w_gate_up [2F, d],
                                     w_down [d, F] (a mixture of experts: router [E, d] f32, experts_gate_up
                                     [E, 2F, d], experts_down [E, d, F]) in dtype; norms f32; tok_embd
                                     [V, d] dtype (the same array as the output matrix when the model ties them)
    kv     [L, 2, n_slots + 1, n_ctx_slot, Hkv, D] dtype   (slot n_slots: scratch for padding rows).
           Every layer keeps every position of a slot, the sliding-window layers too (no ring, unlike
           the CPU's KVCache: a local layer's memory is not bounded by its window here; kv_ring = 0)
    cos, sin [n_ctx_slot, rope_dim / 2] f32 (and cos_local, sin_local: the local layers' own base)
    x [N, d] f32, h [N, d] dtype, qkv [N, (H+2Hkv)D] f32, attn [N, HD] dtype, gu [N, 2F] f32,
    act [N, F] dtype, y [N, d] f32 (sandwich norms only), part_o [N, H, S, D] f32, part_ml [N, H, S, 2] f32,
    a mixture of experts' route [N, E] f32, sel [N, k] int32, wts [N, k] f32, start [E + 1], order and
    pos [N k], tiles [T, 2] int32, act_e [N k, F] dtype, ye [N k, d] f32;
    hout [M, d] dtype, logits [M, V] f32, ids [M] int32, inputs [4, N] int32 (tokens, positions, slots, rows)
    device sampling: rows [M] SampleRow records (after the inputs, in the same buffer), slot table
    [n_slots, W + 2B] int32 (penalty rings, bias lists), results [M + M * 2 * P] int32 (ids, lists)
Host: pinned inputs [4, N] int32 + rows, logits [M, V] f32, ids [M] int32, slot table, results, and a
KV staging buffer.

A decode step (every token an output row) can run as a CUDA graph captured once per batch-size
bucket (1, 2, 4, ... up to the slot count): the batch is padded to its bucket with rows that write
and read only the scratch slot, and one graph launch replaces 7 launches per layer (the RMSNorms and
the SwiGLU fused into the products; 9 with sandwich norms).

One host synchronisation per forward (the logits, or only the ids with forward_greedy, or the ids and
asked-for probabilities with forward_sample: the host sampler's chain on the device, cuda/sampling.cu);
CuPy's stream synchronisation releases the GIL while it waits.

It reads the same description as the CPU backend (ModelConfig and its architecture row,
models/architecture.py): the rows of CHECKED_ARCHITECTURES run (each checked on tests/gpu's emulators
against the CPU backend). What a model asks for that these kernels do not run (unsupported_features: a row
not in CHECKED_ARCHITECTURES, heads over 256 wide, more than 8 query heads per KV head, over 512 experts) is
refused at construction, naming it, and `auto` picks the CPU for such a model.

Importing this module needs no CuPy; building a CupyBackend does.
"""
from __future__ import annotations

import time

import numpy as np

from . import kernels as K
from ...config import MAX_LOGIT_BIAS, MAX_N_PROBS, MAX_PENALTY_WINDOW, SamplingParams
from ...errors import FastserveError
from ...models.architecture import SWIGLU_OAI, TOPK_SOFTMAX
from ...models.transformer import ModelConfig, ModelWeights
from ..base import StepOutput

DTYPES = ("f16", "bf16")
DEFAULT_ATTN_CHUNK = 256


class DeviceUnavailable(FastserveError, RuntimeError):
    """The CUDA backend was asked for where CuPy or a GPU is missing."""


def cuda_status() -> tuple[bool, str]:
    """(True, device name) when CuPy imports and sees a GPU; else (False, why not). Never raises."""
    try:
        import cupy
    except Exception as exc:    # ImportError, or a CuPy that cannot load its libraries
        return False, f"CuPy is not importable ({type(exc).__name__}: {exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"CuPy sees no CUDA device ({type(exc).__name__}: {exc})"
    if n < 1:
        return False, "CuPy sees no CUDA device"
    try:
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    except Exception:           # a name is only for messages
        name = "CUDA device"
    return True, name


# The rows of models/architecture.py this backend runs, each checked against the CPU backend on the emulators
# (tests/gpu/test_backend_emulated.py, test_parity.py): a row added to the table is refused here until its
# steps have kernels and a test.
CHECKED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "granite", "smollm3", "phi3", "qwen3moe", "gpt-oss")


def unsupported_features(cfg: ModelConfig) -> list[str]:
    """What cfg asks for that the CUDA kernels do not run (empty: all of it runs). The features of the
    checked rows (GeGLU, sandwich norms, the embedding scale, sliding-window layers, soft-capping, fused
    tensors, RoPE factors, granite's multipliers, smollm3's layers without RoPE) run; what is left are rows
    not checked here, shapes the attention kernel has no instance for, expert counts and widths the grouped
    products do not take, and combinations no row has (gpt-oss's o bias beside sandwich norms or granite's
    multiplier, swiglu_oai in a dense FFN)."""
    name = cfg.arch.name
    wanted = [(name not in CHECKED_ARCHITECTURES,
               f"the {name!r} architecture's row (not checked on CUDA; it runs {', '.join(CHECKED_ARCHITECTURES)})"),
              (cfg.head_dim > K.ATTN_HEAD_DIMS[-1] or cfg.head_dim % 8,
               f"head_dim {cfg.head_dim} (cuda/attention.cu: multiples of 8 up to {K.ATTN_HEAD_DIMS[-1]})"),
              (cfg.n_head // cfg.n_head_kv > 8, f"{cfg.n_head // cfg.n_head_kv} query heads per KV head (at most 8)"),
              (cfg.n_expert > K.MOE_MAX_EXPERTS, f"{cfg.n_expert} experts (cuda/moe.cu: at most {K.MOE_MAX_EXPERTS})"),
              (cfg.n_expert > 0 and not K.matvec_fits("f16", cfg.n_ff),
               f"experts {cfg.n_ff} wide (the grouped products: a multiple of 8)"),
              (cfg.arch.ffn_act == SWIGLU_OAI and not cfg.n_expert, "swiglu_oai in a dense FFN (experts only)"),
              (cfg.arch.out_bias and (cfg.arch.sandwich_norms or cfg.arch.multipliers),
               "an output bias beside sandwich norms or a residual multiplier")]
    return [name for needed, name in wanted if needed]


def neox_order(cfg: ModelConfig) -> np.ndarray:
    """Within a head, the order of dimensions that makes NeoX RoPE (pairs i, i + rope_dim/2) the adjacent
    pairs (2i, 2i+1) the kernels rotate: new dimension 2i is old i, 2i+1 is old i + rope_dim/2. Q and K
    rows (and their biases and norm weights) are uploaded in this order; q . k is the same in any common
    order, and V is not touched, so attention is unchanged (convert_hf_to_gguf permutes llama's the same way)."""
    half, j = cfg.rope_dim // 2, np.arange(cfg.head_dim)
    return np.where(j < cfg.rope_dim, j // 2 + (j % 2) * half, j)


def _bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


class CupyBackend:
    """GPU backend. KV cache: [n_layer, 2, n_slots + 1, n_ctx_slot, Hkv, D] in `dtype` on the device.

    dtype: "f16" (default) or "bf16" for weights, product inputs and KV. max_tokens: the most tokens
    one forward() computes in one pass (larger batches run in chunks, in order). max_out: the most
    output rows kept in the preallocated logits (more rows: chunks into a fresh host array).
    graphs: capture decode steps as CUDA graphs per batch-size bucket. attn_chunk: keys per attention
    split (None: chosen from n_ctx_slot). matvec_max_n: products of up to this many rows run in
    cuda/matvec.cu (weights streamed once per 32 rows; a row's result is the same in any batch), larger
    ones in cuBLAS (tensor cores, for long prompts); 0: cuBLAS always. Only decode buckets up to
    matvec_max_n are captured as graphs (CuPy refuses cuBLAS during a capture); raise it past
    max_tokens to make every product batch-invariant. Changing it needs reset_graphs().
    max_penalty_window, max_logit_bias, max_n_probs: capacities of device sampling (forward_sample), as
    the host Sampler's.
    """

    samples_on_device = True        # step(): fastserve/backends/cuda/sampling.py drives forward_sample

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, n_slots: int, n_ctx_slot: int, *,
                 dtype: str = "f16", max_tokens: int = 512, max_out: int | None = None, graphs: bool = True,
                 attn_chunk: int | None = None, matvec_max_n: int = K.MATVEC_MAX_N, device: int | None = None,
                 max_penalty_window: int = MAX_PENALTY_WINDOW, max_logit_bias: int = MAX_LOGIT_BIAS,
                 max_n_probs: int = MAX_N_PROBS):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
        missing = unsupported_features(cfg)
        if missing:
            raise DeviceUnavailable(f"the CUDA backend does not run {', '.join(missing)} yet, which the "
                                    f"{cfg.arch.name!r} architecture needs; run it on the CPU (--device cpu)")
        ok, why = cuda_status()
        if not ok:
            raise DeviceUnavailable(f"the CUDA backend cannot start: {why}; run on the CPU (--device cpu, or "
                                    "--device auto to use a GPU only when there is one)")
        import cupy as cp

        self.cp = cp
        self.cfg, self.dtype = cfg, dtype
        self.n_slots, self.n_ctx_slot, self.n_vocab = n_slots, n_ctx_slot, cfg.n_vocab
        self.max_tokens = max(1, int(max_tokens))
        self.max_out = max(1, int(max_out if max_out is not None else max(n_slots, 64)))
        self.max_out = min(self.max_out, self.max_tokens)
        self.use_graphs = bool(graphs)
        self.matvec_max_n = int(matvec_max_n)
        c = cfg
        self._matvec_only = all(K.matvec_fits(dtype, k) for k in (c.n_embd, c.n_head * c.head_dim, c.n_ff))
        self.sample_window, self.sample_bias = int(max_penalty_window), int(max_logit_bias)
        self.sample_probs = int(max_n_probs)
        if not 0 < self.sample_probs <= K.SAMPLE_MAX_PROBS:
            raise ValueError(f"max_n_probs must be in [1, {K.SAMPLE_MAX_PROBS}]")
        self.device = cp.cuda.Device(cp.cuda.runtime.getDevice() if device is None else device)
        c = cfg
        self.q_dim, self.kv_dim = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        self.qkv_dim = self.q_dim + 2 * self.kv_dim
        self.scale = cfg.attn_scale
        if attn_chunk is None:      # ~128 blocks a decode token (splits x KV heads, <= 32 splits), >= 64 keys each
            per_split = -(-n_ctx_slot // min(32, -(-128 // c.n_head_kv)))
            attn_chunk = max(64, -(-per_split // 64) * 64)
        self.attn_chunk = int(attn_chunk)
        self.n_split = K.attention_splits(n_ctx_slot, self.attn_chunk)
        self.submit_ns = 0          # host time spent enqueueing work (launches, copies), cumulative
        self.wait_ns = 0            # host time spent waiting for the device, cumulative
        self.steps = 0

        with self.device:
            self.stream = cp.cuda.Stream(non_blocking=True)
            with self.stream:
                K.compile_all()
                self._upload_weights(weights)
                self._allocate()
            self.stream.synchronize()
            cp.get_default_memory_pool().free_all_blocks()     # the float32 upload temporaries
        self._graphs: dict[int, object] = {}
        self._sample_graphs: dict[int, object] = {}       # decode steps that end with sample_chain
        self._scratch_slot = n_slots
        self._pending = (0, 0)                            # (n, m) of the step submit_sample queued
        # The engine's step: the device sampler's per-slot state, and the step's outputs on the host.
        from .sampling import DeviceSampler
        self.sampler = DeviceSampler(self, n_slots, cfg.n_vocab, self.sample_window, self.sample_bias)
        self.masks = self.sampler.masks         # constrained slots' allowed tokens (the engine writes them)
        self._step_ids = np.zeros(self.max_out, np.int32)                         # [max_out]
        self._step_probs_ids = np.zeros((self.max_out, MAX_N_PROBS), np.int32)    # [max_out, MAX_N_PROBS]
        self._step_probs = np.zeros((self.max_out, MAX_N_PROBS), np.float32)

    # -- set-up --------------------------------------------------------------------------------

    def _to_device(self, a, storage: str):
        """A host float32 array, or a BlockMatrix decoded here (one matrix at a time, so that no
        float32 copy of the model exists on the host), as a device array of `storage` ('f32', or
        rounded on the device)."""
        cp = self.cp
        if hasattr(a, "to_float"):
            a = a.to_float()
        src = cp.asarray(np.ascontiguousarray(a, dtype=np.float32))
        if storage == "f32":
            return src
        dst = cp.empty(src.shape, K._dtype_of(storage))
        K.cast_from_f32(src, dst)
        del src
        return dst

    def _upload_weights(self, w: ModelWeights) -> None:
        dt, c = self.dtype, self.cfg
        # rows of Q and K heads in neox_order (NeoX RoPE as the kernels' adjacent pairs), V rows as they are
        order = np.arange(self.qkv_dim)
        if c.rope_neox:
            heads = np.arange(c.n_head + c.n_head_kv)[:, None] * c.head_dim
            order[:self.q_dim + self.kv_dim] = (heads + neox_order(c)[None, :]).reshape(-1)
        qk = neox_order(c) if c.rope_neox else np.arange(c.head_dim)     # one head's norm weights

        def opt(v, idx):
            return None if v is None else self._to_device(np.ascontiguousarray(v[idx]), "f32")

        from ..rope import rope_tables
        factors = w.rope_factors(c, self.n_ctx_slot)
        self.cos, self.sin = (self.cp.asarray(t) for t in rope_tables(c, self.n_ctx_slot, factors))
        # the local layers' own RoPE base (gemma3: 10k beside the global layers' 1M)
        self.cos_local, self.sin_local = ((self.cp.asarray(t) for t in rope_tables(
            c, self.n_ctx_slot, factors, local=True)) if any(c.local_layers) else (self.cos, self.sin))
        self.layers = []
        for li, lw in enumerate(w.layers):
            local = c.local_layers[li]
            self.layers.append(dict(
                cos=self.cos_local if local else self.cos, sin=self.sin_local if local else self.sin,
                window=c.sliding_window if local else 0, rope=c.rope_layers[li],
                post_attn_norm=opt(lw.post_attn_norm, slice(None)), post_ffn_norm=opt(lw.post_ffn_norm, slice(None)),
                attn_norm=self._to_device(lw.attn_norm, "f32"),
                out_bias=opt(lw.out_bias, slice(None)), sinks=opt(lw.attn_sinks, slice(None)),
                wqkv=self._to_device(lw.wqkv.to_float()[order] if c.rope_neox else lw.wqkv, dt),
                wo=self._to_device(lw.wo, dt), ffn_norm=self._to_device(lw.ffn_norm, "f32"),
                qkv_bias=opt(lw.qkv_bias, order), q_norm=opt(lw.q_norm, qk), k_norm=opt(lw.k_norm, qk),
                **self._ffn_weights(lw)))
        self.tok_embd = self._to_device(w.tok_embd, dt)
        self.output = self.tok_embd if w.output is w.tok_embd else self._to_device(w.output, dt)
        self.out_norm = self._to_device(w.out_norm, "f32")

    def _ffn_weights(self, lw) -> dict:
        """A layer's FFN on the device: a dense one's w_gate_up, w_down; a mixture of experts' router [E, d] (float32,
        as the file keeps it: the routing decided on the CPU's values, cuda/moe.cu moe_router_f32) and
        its experts stacked as the file's 3-D tensors, experts_gate_up [E, 2F, d] (each expert's gate rows, then
        its up rows) and experts_down [E, d, F], uploaded one expert at a time."""
        dt = self.dtype
        if not self.cfg.n_expert:
            return dict(w_gate_up=self._to_device(lw.w_gate_up, dt), w_down=self._to_device(lw.w_down, dt))

        def stacked(mats):
            out = self.cp.empty((len(mats), *mats[0].shape), K._dtype_of(dt))
            for e, m in enumerate(mats):
                out[e] = self._to_device(m, dt)
            return out

        def bias(v):
            return None if v is None else self._to_device(v, "f32")
        return dict(router=self._to_device(lw.router, "f32"), experts_gate_up=stacked(lw.experts_gate_up),
                    experts_down=stacked(lw.experts_down), router_bias=bias(lw.router_bias),
                    experts_gate_up_bias=bias(lw.experts_gate_up_bias), experts_down_bias=bias(lw.experts_down_bias))

    def weight_bytes_per_step(self) -> int:
        """Bytes of weights one decode step of one token reads (every matrix once, of a mixture of experts the
        router and the experts a token uses; the embedding rows are negligible)."""
        c, total = self.cfg, self.output.nbytes + self.out_norm.nbytes
        for lw in self.layers:
            total += sum(lw[k].nbytes for k in ("wqkv", "wo", "attn_norm", "ffn_norm"))
            if c.n_expert:
                used = c.n_expert_used / c.n_expert
                total += lw["router"].nbytes + (lw["experts_gate_up"].nbytes + lw["experts_down"].nbytes) * used
            else:
                total += lw["w_gate_up"].nbytes + lw["w_down"].nbytes
        return int(total)

    def _allocate(self) -> None:
        cp, c = self.cp, self.cfg
        N, M = self.max_tokens, self.max_out
        st = K._dtype_of(self.dtype)
        self.kv = cp.zeros((c.n_layer, 2, self.n_slots + 1, self.n_ctx_slot, c.n_head_kv, c.head_dim), st)
        self.k_cache = [self.kv[li, 0] for li in range(c.n_layer)]      # contiguous views, made once
        self.v_cache = [self.kv[li, 1] for li in range(c.n_layer)]
        R, W, P = K.SAMPLE_ROW_WORDS, self.sample_window + 2 * self.sample_bias, self.sample_probs
        self._in_d = cp.zeros(4 * N + M * R, np.int32)                  # one copy: inputs, then sampling rows
        self.inputs = self._in_d[:4 * N].reshape(4, N)                  # tokens, positions, slots, rows
        self.sample_rows_d = self._in_d[4 * N:].reshape(M, R)
        self.slot_tab_d = cp.zeros((self.n_slots, W), np.int32)
        self.mask_words = (c.n_vocab + 31) // 32
        self._n_masks = 0
        self.sample_masks_d = cp.zeros((M, self.mask_words), np.uint32)   # constrained rows' allowed tokens
        self._out_d = cp.zeros(M + M * 2 * P, np.int32)                 # one copy back: ids, then lists
        self.sample_ids_d, self.sample_probs_d = self._out_d[:M], self._out_d[M:].reshape(M, 2, P)
        self.tokens_d, self.positions_d, self.slots_d, self.rows_d = (self.inputs[i] for i in range(4))
        self.x = cp.zeros((N, c.n_embd), np.float32)
        self.h = cp.zeros((N, c.n_embd), st)
        self.qkv = cp.zeros((N, self.qkv_dim), np.float32)
        self.attn = cp.zeros((N, self.q_dim), st)
        self.gu = cp.zeros((N, 2 * c.n_ff), np.float32)
        self.act = cp.zeros((N, c.n_ff), st)
        self.y = cp.zeros((N, c.n_embd), np.float32) if c.arch.sandwich_norms else None
        self.part_o = cp.zeros((N, c.n_head, self.n_split, c.head_dim), np.float32)
        self.part_ml = cp.zeros((N, c.n_head, self.n_split, 2), np.float32)
        if c.n_expert:      # a mixture of experts: a row per (row, rank) pair, grouped by expert
            k = c.n_expert_used
            self.route = cp.zeros((N, c.n_expert), np.float32)
            self.sel = cp.zeros((N, k), np.int32)
            self.wts = cp.zeros((N, k), np.float32)
            self.moe_start = cp.zeros(c.n_expert + 1, np.int32)
            self.moe_order = cp.zeros(N * k, np.int32)
            self.moe_pos = cp.zeros(N * k, np.int32)
            self.moe_tiles = cp.zeros((K.moe_tiles(N, k, c.n_expert), 2), np.int32)
            self.act_e = cp.zeros((N * k, c.n_ff), st)
            self.ye = cp.zeros((N * k, c.n_embd), np.float32)
        self.hout = cp.zeros((M, c.n_embd), st)
        self.logits = cp.zeros((M, c.n_vocab), np.float32)
        self.ids = cp.zeros(M, np.int32)
        self.kv_stage = cp.zeros(c.n_layer * 2 * self.n_ctx_slot * self.kv_dim, st)
        import cupyx
        self._in_h = cupyx.empty_pinned(4 * N + M * R, np.int32)
        self.inputs_h = self._in_h[:4 * N].reshape(4, N)
        self.sample_rows_h = self._in_h[4 * N:].view(K.SAMPLE_ROW)     # [M] records
        self.slot_tab_h = cupyx.empty_pinned((self.n_slots, W), np.int32)
        self.sample_masks_h = cupyx.empty_pinned((M, self.mask_words), np.uint32)
        self._out_h = cupyx.empty_pinned(M + M * 2 * P, np.int32)
        self._pad_row = np.zeros(1, K.SAMPLE_ROW)                       # padding rows: greedy, touch nothing
        for f, v in (("flags", K.SAMPLE_GREEDY), ("probs_row", -1), ("hist_pos", -1), ("top_p", 1.0),
                     ("mask_row", -1)):
            self._pad_row[f] = v
        self.logits_h = cupyx.empty_pinned((M, c.n_vocab), np.float32)
        self.ids_h = cupyx.empty_pinned(M, np.int32)
        self._arange = np.arange(N, dtype=np.int32)

    # -- the protocol --------------------------------------------------------------------------

    def kv_bytes_per_token(self) -> int:
        c = self.cfg
        return 2 * c.n_layer * c.n_head_kv * c.head_dim * self.kv.itemsize

    def kv_bytes(self) -> int:
        return int(self.kv.nbytes)

    def kv_resident(self) -> bool:
        return True                 # device memory, allocated at start

    def forward(self, tokens, positions, slots, out_rows) -> np.ndarray:
        """tokens, positions, slots int32 [n]; out_rows int32 [m] -> float32 logits [m, n_vocab] on the
        host (a pinned buffer reused at the next call when m <= max_out)."""
        return self._run(tokens, positions, slots, out_rows, want="logits")

    def forward_greedy(self, tokens, positions, slots, out_rows) -> np.ndarray:
        """As forward, but returns the greedy ids int32 [m] (argmax on the device; ties to the lowest
        id): only 4 bytes per row cross to the host."""
        return self._run(tokens, positions, slots, out_rows, want="ids")

    def forward_sample(self, tokens, positions, slots, out_rows, n_lists: int = 0, masked: bool = False):
        """As forward, then the host sampler's chain on the device (cuda/sampling.cu sample_chain_f32) for
        the m output rows, whose SampleRow records the caller wrote into sample_rows_h[:m] (rows with
        probs_row = 0 .. n_lists - 1 ask for probabilities; with masked, rows with mask_row = r >= 0 read the
        allowed tokens in sample_masks_h[r], copied in too). One copy in, one copy back, one wait.
        Returns (ids int32 [m] (-1: a sampled row without candidates), list ids int32 [n_lists, P], list
        probabilities float32 [n_lists, P]), views of pinned buffers reused at the next call. The batch
        must fit the buffers (n <= max_tokens, m <= max_out). submit_sample + wait_sample."""
        self.submit_sample(tokens, positions, slots, out_rows, n_lists, masked)
        return self.wait_sample()

    def submit_sample(self, tokens, positions, slots, out_rows, n_lists: int = 0, masked: bool = False) -> None:
        """forward_sample's launches and copies, queued on the stream; wait_sample() waits for them."""
        n, m = len(tokens), len(out_rows)
        if n > self.max_tokens or m > self.max_out or not 0 <= n_lists <= m:
            raise ValueError(f"device sampling needs n <= max_tokens={self.max_tokens}, m <= max_out={self.max_out} "
                             f"and 0 <= n_lists <= m (got n={n}, m={m}, n_lists={n_lists})")
        self._n_lists, self._pending = int(n_lists), (n, m)
        self._n_masks = m if masked else 0
        if n == 0:
            return
        tokens, positions, slots, out_rows = (np.asarray(a, dtype=np.int32) for a in (tokens, positions, slots, out_rows))
        if not (len(positions) == len(slots) == n):
            raise ValueError("tokens, positions and slots must have the same length")
        self._check_inputs(tokens, positions, slots, out_rows)
        t0 = time.perf_counter_ns()
        with self.device, self.stream:
            self._submit(tokens, positions, slots, out_rows, "sample")
        self.submit_ns += time.perf_counter_ns() - t0

    def wait_sample(self):
        """Wait for the last submit_sample(); its (ids, list ids, list probabilities), as forward_sample."""
        (n, m), self._pending = self._pending, (0, 0)
        if n == 0:
            empty = np.zeros((0, self.sample_probs), np.int32)
            return np.zeros(m, np.int32), empty, empty.view(np.float32)
        t1 = time.perf_counter_ns()
        self.stream.synchronize()           # releases the GIL while it waits
        self.wait_ns += time.perf_counter_ns() - t1
        self.steps += 1
        P, k = self.sample_probs, self._n_lists
        lists = self._out_h[self.max_out:self.max_out + k * 2 * P].reshape(k, 2, P)
        return self._out_h[:m], lists[:, 0], lists[:, 1].view(np.float32)

    def sample_slot_table(self) -> np.ndarray:
        """The host side of the sampling slot table, int32 [n_slots, W + 2B] (pinned): each slot's penalty
        ring, bias ids, bias values as float32 bits. upload_sample_slot copies a slot's row to the device."""
        return self.slot_tab_h

    def upload_sample_slot(self, slot: int) -> None:
        """Queue the copy of slot's row of sample_slot_table() to the device (ordered before the next step)."""
        rt = self.cp.cuda.runtime
        row = self.slot_tab_h[slot]
        with self.device, self.stream:
            rt.memcpyAsync(self.slot_tab_d.data.ptr + slot * row.nbytes, row.ctypes.data, row.nbytes,
                           rt.memcpyHostToDevice, self.stream.ptr)

    # -- the engine's step (backends/base.py): sampling on the device ------------------------------

    def configure(self, slot: int, params: SamplingParams, history, constrained: bool = False) -> None:
        self.sampler.configure_checked(slot, params.slot_config(history), constrained)

    def release(self, slot: int) -> None:
        """Nothing to drop: a slot's device sampling state is rewritten whole by its next configure()."""

    def step(self, batch, lap=None, before_sample=None) -> StepOutput:
        tokens, positions, slots, out_rows, row_slot = batch.view()
        ds = self.sampler
        if before_sample is not None:
            before_sample()                 # the masks travel with the rows' records
        ds.forward(tokens, positions, slots, out_rows, row_slot)      # queued: pass, chain, copy back
        if lap is not None:
            lap("forward")
        result = self.wait_sample()                                  # the one wait: ids and asked-for lists
        if lap is not None:
            lap("sync")
        m = len(row_slot)
        ids, pids, probs = self._step_ids[:m], self._step_probs_ids, self._step_probs
        ds.sample(row_slot, ids, pids, probs, result)                 # the slots' sampler state moves on
        if lap is not None:
            lap("sample")
        return StepOutput(ids, pids[:m], probs[:m]) if ds.n_lists else StepOutput(ids, None, None)

    def sync(self) -> None:
        """Wait for everything queued on the stream."""
        self.stream.synchronize()

    def copy_slot(self, src: int, dst: int, n_tokens: int) -> None:
        with self.device, self.stream:
            self.kv[:, :, dst, :n_tokens] = self.kv[:, :, src, :n_tokens]
        self.stream.synchronize()

    def save_slot(self, slot: int, start: int, n_tokens: int, into: np.ndarray) -> None:
        """KV rows start..start+n_tokens of slot into `into` (uint8, >= n_tokens * kv_bytes_per_token()),
        laid out [n_layer, 2 (K, V), n_tokens, Hkv, D] in the cache's storage type."""
        host = self._kv_rows_host(into, n_tokens)
        with self.device, self.stream:
            stage = self._kv_stage_view(n_tokens)
            stage[...] = self.kv[:, :, slot, start:start + n_tokens]
            self.cp.cuda.runtime.memcpyAsync(host.ctypes.data, stage.data.ptr, host.nbytes,
                                             self.cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        self.stream.synchronize()

    # Its KV keeps every position of every layer, the sliding-window layers too (no ring).
    kv_ring = 0

    def kv_held_from(self, slot: int, n_tokens: int) -> int:
        return 0

    def kv_reuse_from(self, slot: int, n_tokens: int) -> int:
        return 0

    def restore_slot(self, slot: int, start: int, n_tokens: int, src: np.ndarray, held_from: int = 0) -> None:
        """The inverse of save_slot (held_from: nothing to do without a ring)."""
        host = self._kv_rows_host(src, n_tokens)
        with self.device, self.stream:
            stage = self._kv_stage_view(n_tokens)
            self.cp.cuda.runtime.memcpyAsync(stage.data.ptr, host.ctypes.data, host.nbytes,
                                             self.cp.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
            self.kv[:, :, slot, start:start + n_tokens] = stage
        self.stream.synchronize()

    def _kv_rows_host(self, buf: np.ndarray, n_tokens: int) -> np.ndarray:
        nbytes = n_tokens * self.kv_bytes_per_token()
        if buf.dtype != np.uint8 or buf.ndim != 1 or len(buf) < nbytes or not buf.flags.c_contiguous:
            raise ValueError(f"a KV copy of {n_tokens} tokens needs a contiguous uint8 buffer of {nbytes} bytes")
        if not 0 <= n_tokens <= self.n_ctx_slot:
            raise ValueError(f"n_tokens {n_tokens} outside [0, {self.n_ctx_slot}]")
        return buf[:nbytes]

    def _kv_stage_view(self, n_tokens: int):
        c = self.cfg
        return self.kv_stage[:c.n_layer * 2 * n_tokens * self.kv_dim].reshape(
            c.n_layer, 2, n_tokens, c.n_head_kv, c.head_dim)

    # -- one forward pass ------------------------------------------------------------------------

    def _run(self, tokens, positions, slots, out_rows, want: str) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int32)
        positions = np.asarray(positions, dtype=np.int32)
        slots = np.asarray(slots, dtype=np.int32)
        out_rows = np.asarray(out_rows, dtype=np.int32)
        n, m = len(tokens), len(out_rows)
        if not (len(positions) == len(slots) == n):
            raise ValueError("tokens, positions and slots must have the same length")
        if n == 0:
            return np.zeros((m, self.n_vocab) if want == "logits" else m, np.float32 if want == "logits" else np.int32)
        self._check_inputs(tokens, positions, slots, out_rows)
        if n <= self.max_tokens and m <= self.max_out:
            t0 = time.perf_counter_ns()
            with self.device, self.stream:
                self._submit(tokens, positions, slots, out_rows, want)
            t1 = time.perf_counter_ns()
            self.stream.synchronize()           # releases the GIL while it waits
            self.wait_ns += time.perf_counter_ns() - t1
            self.submit_ns += t1 - t0
            self.steps += 1
            return self.logits_h[:m] if want == "logits" else self.ids_h[:m]
        return self._run_chunked(tokens, positions, slots, out_rows, want)

    def _check_inputs(self, tokens, positions, slots, out_rows) -> None:
        """Indices are not checked on the device: a bad one would read or write out of bounds. One max
        per array: as uint32, a negative index is above every bound."""
        if tokens.view(np.uint32).max() >= self.n_vocab:
            raise ValueError(f"token ids must be in [0, {self.n_vocab})")
        if positions.view(np.uint32).max() >= self.n_ctx_slot:
            raise ValueError(f"positions must be in [0, {self.n_ctx_slot})")
        if slots.view(np.uint32).max() >= self.n_slots:
            raise ValueError(f"slots must be in [0, {self.n_slots})")
        if len(out_rows) and out_rows.view(np.uint32).max() >= len(tokens):
            raise ValueError("out_rows must index the batch")

    def _is_decode(self, n: int, out_rows: np.ndarray) -> bool:
        """Every token is an output row, in order: a decode step (graph-eligible). Its products must all
        run in cuda/matvec.cu: CuPy refuses cuBLAS calls while a stream captures."""
        return (self.use_graphs and self._matvec_only and len(out_rows) == n
                and _bucket(n) <= min(self.max_out, self.max_tokens, self.matvec_max_n)
                and n <= self.n_slots and bool((out_rows == self._arange[:n]).all()))

    def _submit(self, tokens, positions, slots, out_rows, want: str) -> None:
        """Enqueue inputs, the pass and the results' copy to the host on self.stream (no wait)."""
        cp = self.cp
        n, m = len(tokens), len(out_rows)
        rt = cp.cuda.runtime
        graph = None
        sample = want == "sample"
        if self._is_decode(n, out_rows):
            b = _bucket(n)
            ih = self.inputs_h
            ih[0, :n], ih[1, :n], ih[2, :n], ih[3, :b] = tokens, positions, slots, self._arange[:b]
            ih[0, n:b], ih[1, n:b], ih[2, n:b] = 0, 0, self._scratch_slot      # padding: the scratch slot
            if sample:
                self.sample_rows_h[m:b] = self._pad_row
            self._copy_inputs(b if sample else 0)
            graphs = self._sample_graphs if sample else self._graphs
            graph = graphs.get(b)
            if graph is None:
                self._enqueue(b, b, sample)     # the first step of a bucket runs eagerly (warm-up) ...
                graphs[b] = self._capture(b, sample)
            else:
                graph.launch(self.stream)
        else:
            ih = self.inputs_h
            ih[0, :n], ih[1, :n], ih[2, :n], ih[3, :m] = tokens, positions, slots, out_rows
            self._copy_inputs(m if sample else 0)
            self._enqueue(n, m, sample)
        if sample:
            nbytes = (self.max_out + self._n_lists * 2 * self.sample_probs) * 4
            rt.memcpyAsync(self._out_h.ctypes.data, self._out_d.data.ptr, nbytes, rt.memcpyDeviceToHost,
                           self.stream.ptr)
        elif want == "logits":
            rt.memcpyAsync(self.logits_h.ctypes.data, self.logits.data.ptr, m * self.n_vocab * 4,
                           rt.memcpyDeviceToHost, self.stream.ptr)
        else:
            rt.memcpyAsync(self.ids_h.ctypes.data, self.ids.data.ptr, m * 4, rt.memcpyDeviceToHost, self.stream.ptr)

    def _copy_inputs(self, n_rows: int) -> None:
        """The inputs and n_rows sampling records (right after them in memory) to the device, one copy."""
        rt = self.cp.cuda.runtime
        nbytes = self.inputs_h.nbytes + n_rows * K.SAMPLE_ROW.itemsize
        rt.memcpyAsync(self._in_d.data.ptr, self._in_h.ctypes.data, nbytes, rt.memcpyHostToDevice, self.stream.ptr)
        if n_rows and self._n_masks:        # outside any graph: the kernel reads the buffer, wherever it came from
            rt.memcpyAsync(self.sample_masks_d.data.ptr, self.sample_masks_h.ctypes.data,
                           self._n_masks * self.mask_words * 4, rt.memcpyHostToDevice, self.stream.ptr)

    def reset_graphs(self) -> None:
        """Drop the captured graphs (after changing matvec_max_n); the next decode steps capture again."""
        self._graphs.clear()
        self._sample_graphs.clear()

    def _capture(self, b: int, sample: bool = False):
        """... and is captured for the next ones (capture records, it does not run)."""
        s = self.stream
        s.begin_capture(mode=self.cp.cuda.runtime.streamCaptureModeThreadLocal)
        try:
            self._enqueue(b, b, sample)
        finally:
            graph = s.end_capture()
        graph.upload(s)
        return graph

    def _enqueue(self, n: int, m: int, sample: bool = False) -> None:
        """The pass over the first n rows of the device inputs; logits of rows rows_d[:m], then their greedy
        ids, or (sample) the sampling chain over them with the records in sample_rows_d[:m].
        Products of at most matvec_max_n rows (every decode step) take each RMSNorm, and the SwiGLU after
        the gate/up product, into the product's launch: 7 launches a layer (1 + 1 + 2 + 1 + 1 + 1, 9 with
        sandwich norms, 10 with q/k norms too); larger ones run the norms, cuBLAS and the SwiGLU apart: 10
        (h and gu are their scratch). A local layer's window and RoPE table are arguments of its launches,
        the same at every step: a captured graph replays at any position."""
        c, mv = self.cfg, self.matvec_max_n
        K.embed_rows(self.tok_embd, self.tokens_d, self.x, n, c.embd_scale)
        for li, lw in enumerate(self.layers):
            kc, vc = self.k_cache[li], self.v_cache[li]
            K.norm_gemm(self.x, lw["attn_norm"], lw["wqkv"], self.qkv, self.h, n, c.norm_eps, matvec_max_n=mv)
            if lw["qkv_bias"] is not None or lw["q_norm"] is not None:
                K.qk_prep(self.qkv, lw["qkv_bias"], lw["q_norm"], lw["k_norm"], n, c.n_head, c.n_head_kv,
                          c.head_dim, c.norm_eps)
            if lw["rope"]:
                K.rope_store(self.qkv, lw["cos"], lw["sin"], kc, vc, self.slots_d, self.positions_d, n, c.n_head,
                             c.rope_dim)
            else:           # smollm3's every 4th layer: q and k as they are
                K.kv_store(self.qkv, kc, vc, self.slots_d, self.positions_d, n, c.n_head)
            K.attention(self.qkv, kc, vc, self.slots_d, self.positions_d, self.part_o, self.part_ml, self.attn,
                        n, c.n_head, self.attn_chunk, self.scale, window=lw["window"], sinks=lw["sinks"])
            self._add_product(self.attn, lw["wo"], lw["post_attn_norm"], n, bias=lw["out_bias"])
            if c.n_expert:
                self._moe(lw, n)
                continue
            K.norm_gemm_swiglu(self.x, lw["ffn_norm"], lw["w_gate_up"], self.act, self.h, self.gu, n, c.norm_eps,
                               matvec_max_n=mv, gelu=c.ffn_gelu)
            self._add_product(self.act, lw["w_down"], lw["post_ffn_norm"], n)
        K.norm_gemm(self.x, self.out_norm, self.output, self.logits, self.hout, m, c.norm_eps, rows=self.rows_d,
                    matvec_max_n=mv)
        if c.logit_scale != 1.0 or c.logit_softcap > 0:
            K.logit_out(self.logits, m, c.logit_scale, c.logit_softcap)
        if sample:
            K.sample_chain(self.logits, self.sample_rows_d, self.slot_tab_d, self.sample_ids_d, self.sample_probs_d, m,
                           self.sample_window, self.sample_bias, self.sample_masks_d)
        else:
            K.argmax_rows(self.logits, self.ids, m)

    def _moe(self, lw, n: int) -> None:
        """x[:n] += r * the mixture of experts of rmsnorm(x[:n]) (as the CPU's _forward._moe): the router's
        logits from x, its norm and the router in float32 (moe_router; h, rounded to dtype, feeds the experts only),
        each row's experts and weights (moe_route), the (row, rank) pairs grouped by expert on the device (moe_group:
        sizes fixed by n, no wait for the host, so a graph captures it), each selected expert once over its pairs
        (the grouped products), then each row's weighted outputs summed in rank order (moe_sum)."""
        c, k = self.cfg, self.cfg.n_expert_used
        K.rms_norm(self.x, lw["ffn_norm"], self.h, n, c.norm_eps)
        K.moe_router(self.x, lw["ffn_norm"], lw["router"], self.route, n, c.norm_eps)     # float32, not h
        K.moe_route(self.route, self.sel, self.wts, n, c.expert_weights_scale, bias=lw["router_bias"],
                    topk_softmax=c.arch.moe_gating == TOPK_SOFTMAX)
        K.moe_group(self.sel, n, c.n_expert, self.moe_start, self.moe_order, self.moe_pos, self.moe_tiles)
        K.moe_gemm_swiglu(self.h, lw["experts_gate_up"], self.moe_start, self.moe_order, self.moe_tiles, self.act_e,
                          n, k, gelu=c.ffn_gelu, oai=c.arch.ffn_act == SWIGLU_OAI, bias=lw["experts_gate_up_bias"])
        K.moe_gemm(self.act_e, lw["experts_down"], self.moe_start, self.moe_tiles, self.ye, n, k,
                   bias=lw["experts_down_bias"])
        post = lw["post_ffn_norm"]
        if post is None:
            K.moe_sum(self.ye, self.moe_pos, self.wts, self.x, n, accumulate=True, scale=c.residual_scale)
        else:
            K.moe_sum(self.ye, self.moe_pos, self.wts, self.y, n, accumulate=False)
            K.rms_norm_add(self.y, post, self.x, n, c.norm_eps, scale=c.residual_scale)

    def _add_product(self, a, w, post_norm, n: int, bias=None) -> None:
        """x[:n] += r * a[:n] @ w.T [+ bias], or (a sandwich norm) x[:n] += r * rmsnorm(a[:n] @ w.T) * post_norm
        (r: the residual multiplier, 1 but for granite; bias: gpt-oss's o bias, added to x after the product's sum,
        where the CPU adds it to the product first: one float32 rounding apart. A row with a bias and a sandwich
        norm or r is refused by unsupported_features)."""
        r = self.cfg.residual_scale
        if post_norm is None:
            K.gemm(a, w, self.x, n, accumulate=True, matvec_max_n=self.matvec_max_n, scale=r)
            if bias is not None:
                K.add_bias(self.x, bias, n)
            return
        K.gemm(a, w, self.y, n, matvec_max_n=self.matvec_max_n)
        K.rms_norm_add(self.y, post_norm, self.x, n, self.cfg.norm_eps, scale=r)

    def _run_chunked(self, tokens, positions, slots, out_rows, want: str) -> np.ndarray:
        """A batch larger than the buffers: tokens in order, max_tokens at a time (a later chunk's
        tokens see the KV the earlier chunks wrote); output rows max_out at a time. Allocates the result."""
        m = len(out_rows)
        result = np.empty((m, self.n_vocab) if want == "logits" else m, np.float32 if want == "logits" else np.int32)
        for c0 in range(0, len(tokens), self.max_tokens):
            c1 = min(c0 + self.max_tokens, len(tokens))
            mine = np.flatnonzero((out_rows >= c0) & (out_rows < c1))
            sl = slice(c0, c1)
            if len(mine) == 0:
                # No output rows in this chunk: still run it for its KV (one throwaway output row).
                self._run(tokens[sl], positions[sl], slots[sl], np.zeros(1, np.int32), want)
                continue
            for g0 in range(0, len(mine), self.max_out):
                group = mine[g0:g0 + self.max_out]
                # Later groups of one chunk recompute it: the same tokens write the same KV rows.
                got = self._run(tokens[sl], positions[sl], slots[sl], out_rows[group] - c0, want)
                result[group] = got
        return result
