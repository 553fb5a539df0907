"""The CPU backend: the transformer forward pass of a batch in one C call (fastserve.backends.cpu._forward: the
products on the GGUF file's own blocks, attention on the KV cache, every element-wise operation between
them), and the reference for the GPU one. fastserve.backends.cpu.ref.forward is the same pass written out in NumPy
(CpuBackend(..., reference=True) runs it), bit for bit the C one's.

Shapes: n = tokens in the batch, d = n_embd, H = heads, Hkv = KV heads,
D = head_dim, G = H // Hkv (queries per KV head), L = keys attended.
"""
from __future__ import annotations

import numpy as np

from ._attention import Attention
from ._forward import Forward
from ._matmul import Matmul
from ._pool import Pool
from ...models.transformer import ModelConfig, ModelWeights
from .ref import forward as ref_forward
from ..host_sampling import HostSampling
from .kv_cache import DEFAULT_CACHE_TYPE, KVCache
from ..rope import RopeTables


class CpuBackend(HostSampling):
    """CPU backend. KV cache: self.kv (backends/cpu/kv_cache.py), in cache_type_k / cache_type_v
    ("f16", the default, "f32" or "q8_0"), read directly by attention.

    max_tokens: the most tokens a step carries (its buffers; and the most one step writes into one
    slot, which sizes the local layers' rings: backends/cpu/kv_cache.ring_size); a step of more tokens in
    one slot is refused when the model has a ring (Model.logits makes its backend for the whole sequence).

    threads: threads of the step's loops (self.pool: the caller + threads - 1 helpers); 1 is the safe default
    on a machine whose other cores serve the event loop (see bench/bench_matmul.py).

    Batch invariance: a token's logits do not depend on what else is in the
    batch. The products sum every output in a fixed order whatever n. Attention
    (fastserve.backends.cpu._attention) computes each (token, head) in a fixed order of key tiles, whatever
    the batch or the threads. The element-wise operations compute each row on its own.

    reference: run fastserve.backends.cpu.ref.forward (NumPy, the same bits, slower) instead of the C forward.
    kv_resident: the KV cache's pages all brought in at start (KVCache's resident; False: as written).
    """

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, n_slots: int, n_ctx_slot: int,
                 threads: int = 1, cache_type_k: str = DEFAULT_CACHE_TYPE,
                 cache_type_v: str = DEFAULT_CACHE_TYPE, max_tokens: int = 512, reuse_logits: bool = False,
                 reference: bool = False, kv_resident: bool = True):
        self.cfg, self.w = cfg, weights
        self.reference = reference
        self.act = ref_forward.Activations(cfg, max(1, max_tokens) if reference else 1)
        # The engine samples a step's logits before the next step: it may have them in one reused
        # buffer; other callers (Model.logits, tests) keep them, so they get fresh arrays.
        self.reuse_logits = reuse_logits
        self._logits = np.zeros((max(1, max_tokens) if reuse_logits else 0, cfg.n_vocab), np.float32)
        self.pool = Pool(threads)      # the step's helper threads, shared by its parallel loops
        self._mm = Matmul(pool=self.pool)
        self.n_slots, self.n_ctx_slot, self.n_vocab = n_slots, n_ctx_slot, cfg.n_vocab
        self.kv = KVCache(cfg.n_layer, n_slots, n_ctx_slot, cfg.n_head_kv, cfg.head_dim, cache_type_k, cache_type_v,
                          window=cfg.sliding_window, local_layers=cfg.local_layers, step_tokens=max(1, max_tokens),
                          resident=kv_resident)
        self._attn = Attention(self.pool)
        # local layers' own RoPE base (gemma3: 10k beside the global layers' 1M); rows filled as reached
        self.rope = RopeTables(cfg, n_ctx_slot, weights.rope_factors(cfg, n_ctx_slot))
        self.cos, self.sin, self.cos_local, self.sin_local = (self.rope.cos, self.rope.sin, self.rope.cos_local,
                                                              self.rope.sin_local)
        self.scale = cfg.attn_scale
        self._forward = Forward(cfg, weights, self.kv, (self.cos, self.sin), (self.cos_local, self.sin_local),
                                self._mm, self._attn, self.pool, max(1, max_tokens))
        self.init_sampling(n_slots, cfg.n_vocab, max_tokens)    # the step's sampler: backends/host_sampling.py

    def kv_bytes_per_token(self) -> int:
        return self.kv.bytes_per_token()

    def kv_bytes(self) -> int:
        return self.kv.nbytes()

    @property
    def isa(self) -> str:
        """The instruction set the products run on (chosen when they were made: the best this machine has, or
        FASTSERVE_ISA's)."""
        return self._mm.isa

    def kv_resident(self) -> bool:
        return self.kv.resident.is_set()

    def copy_slot(self, src: int, dst: int, n_tokens: int) -> None:
        self.kv.copy_slot(src, dst, n_tokens)

    def save_slot(self, slot: int, start: int, n_tokens: int, into: np.ndarray) -> None:
        """KV rows start..start+n_tokens of slot into `into` (uint8, >= n_tokens * kv_bytes_per_token()),
        in the cache types' row formats (KVCache.save_slot). Copies into `into`, allocates nothing."""
        self.kv.save_slot(slot, start, n_tokens, into)

    def restore_slot(self, slot: int, start: int, n_tokens: int, src: np.ndarray, held_from: int = 0) -> None:
        """The inverse of save_slot: KV rows start..start+n_tokens of slot from `src` (held_from: see kv_held_from)."""
        self.kv.restore_slot(slot, start, n_tokens, src, held_from)

    def kv_held_from(self, slot: int, n_tokens: int) -> int:
        """The first position from which the local layers' rings still hold every position before
        n_tokens of slot (0: every position, as without a ring)."""
        return self.kv.held_from(slot, n_tokens)

    def kv_reuse_from(self, slot: int, n_tokens: int) -> int:
        """The shortest prefix of slot's first n_tokens a continuation can reuse, 0: any (KVCache.reuse_from)."""
        return self.kv.reuse_from(slot, n_tokens)

    @property
    def kv_ring(self) -> int:
        """Positions a local layer keeps per slot (0: every position, no ring)."""
        return self.kv.ring

    def forward(self, tokens, positions, slots, out_rows) -> np.ndarray:
        """tokens, positions, slots [n]; out_rows [m]: logits float32 [m, n_vocab] of those rows
        (a view of a reused buffer when the backend was made with reuse_logits=True)."""
        m = len(out_rows)
        if not self.reuse_logits or m > len(self._logits):
            logits = np.empty((m, self.cfg.n_vocab), np.float32)
        else:
            logits = self._logits
        return self._pass(tokens, positions, slots, out_rows, logits, False)

    def hidden(self, tokens, positions, slots, out_rows, out: np.ndarray | None = None) -> np.ndarray:
        """The same pass, with the final hidden states float32 [m, n_embd] of the out rows (after the output
        norm: what llama.cpp's embeddings pool) instead of their logits; no output product. out: float32
        [>= m, n_embd] to write them into (C-contiguous), else a fresh array."""
        m = len(out_rows)
        if out is None:
            out = np.empty((m, self.cfg.n_embd), np.float32)
        return self._pass(tokens, positions, slots, out_rows, out, True)

    def _pass(self, tokens, positions, slots, out_rows, out: np.ndarray, hidden: bool) -> np.ndarray:
        tokens, positions, slots, out_rows = _int64(tokens), _int64(positions), _int64(slots), _int64(out_rows)
        self.kv.begin_step(slots, positions)        # what the local layers' rings hold after this step
        if len(positions):
            self.rope.cover(int(positions.max()))   # the RoPE rows this step reads
        if self.reference:
            return ref_forward.forward(self, tokens, positions, slots, out_rows, out, hidden)
        return self._forward(tokens, positions, slots, out_rows, out, hidden)


def _int64(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64).reshape(-1)

