"""The llama forward pass in NumPy (float32): the CPU backend and the reference for the GPU one.

The matrix products run on the GGUF file's own blocks (fastserve._matmul: memory-mapped, decoded
panel by panel as they are read, batch-invariant by construction). Everything else is float32.

Shapes: n = tokens in the batch, d = n_embd, H = heads, Hkv = KV heads,
D = head_dim, G = H // Hkv (queries per KV head), L = keys attended.
"""
from __future__ import annotations

import numpy as np

from .._attention import Attention
from .._pool import Pool
from .._matmul import Matmul
from ..models.llama import LlamaConfig, LlamaWeights
from .kv_cache import DEFAULT_CACHE_TYPE, KVCache

def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [n, d] -> x / rms(x) * w, in float32."""
    ms = np.einsum("ij,ij->i", x, x) / np.float32(x.shape[1])
    return x * (1.0 / np.sqrt(ms + np.float32(eps)))[:, None].astype(np.float32) * w


def rope_tables(cfg: LlamaConfig, n_pos: int, freq_factors: np.ndarray | None):
    """cos, sin [n_pos, rope_dim/2] in float32, for llama.cpp's 'normal' (adjacent pair) RoPE."""
    half = cfg.rope_dim // 2
    inv_freq = cfg.rope_base ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.rope_dim)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors[:half].astype(np.float64)
    pos = np.arange(n_pos, dtype=np.float64) / cfg.rope_scale
    theta = np.outer(pos, inv_freq)
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope_dim: int) -> None:
    """In place. x [n, heads, D]; cos/sin [n, rope_dim/2]; rotates pairs (2i, 2i+1) of the first rope_dim."""
    x0 = x[:, :, 0:rope_dim:2].copy()
    x1 = x[:, :, 1:rope_dim:2]
    c, s = cos[:, None, :], sin[:, None, :]
    x[:, :, 0:rope_dim:2] = x0 * c - x1 * s
    x[:, :, 1:rope_dim:2] = x0 * s + x1 * c


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


class NumpyBackend:
    """CPU backend. KV cache: self.kv (backends/kv_cache.py), in cache_type_k / cache_type_v
    ("f16", the default, "f32" or "q8_0"), read directly by attention.

    threads: threads of the step's loops (self.pool: the caller + threads - 1 helpers); 1 is the safe default
    on a machine whose other cores serve the event loop (see bench/bench_matmul.py).

    Batch invariance: a token's logits do not depend on what else is in the
    batch. The products sum every output in a fixed order whatever n. Attention
    (fastserve._attention) computes each (token, head) in a fixed order of key tiles, whatever
    the batch or the threads.
    """

    def __init__(self, cfg: LlamaConfig, weights: LlamaWeights, n_slots: int, n_ctx_slot: int,
                 threads: int = 1, cache_type_k: str = DEFAULT_CACHE_TYPE,
                 cache_type_v: str = DEFAULT_CACHE_TYPE):
        self.cfg, self.w = cfg, weights
        self.pool = Pool(threads)      # the step's helper threads, shared by its parallel loops
        self._mm = Matmul(pool=self.pool)
        self.n_slots, self.n_ctx_slot, self.n_vocab = n_slots, n_ctx_slot, cfg.n_vocab
        self.kv = KVCache(cfg.n_layer, n_slots, n_ctx_slot, cfg.n_head_kv, cfg.head_dim, cache_type_k, cache_type_v)
        self._attn = Attention(self.pool)
        self.cos, self.sin = rope_tables(cfg, n_ctx_slot, weights.rope_freqs)
        self.scale = float(1.0 / np.sqrt(cfg.head_dim))

    def _matmul(self, x: np.ndarray, m) -> np.ndarray:
        """x [n, in] times m [out, in] transposed: [n, out] float32, C-contiguous."""
        return self._mm(x, m, np.empty((len(x), m.n_out), np.float32))

    def kv_bytes_per_token(self) -> int:
        return self.kv.bytes_per_token()

    def copy_slot(self, src: int, dst: int, n_tokens: int) -> None:
        self.kv.copy_slot(src, dst, n_tokens)

    def save_slot(self, slot: int, start: int, n_tokens: int, into: np.ndarray) -> None:
        """KV rows start..start+n_tokens of slot into `into` (uint8, >= n_tokens * kv_bytes_per_token()),
        in the cache types' row formats (KVCache.save_slot). Copies into `into`, allocates nothing."""
        self.kv.save_slot(slot, start, n_tokens, into)

    def restore_slot(self, slot: int, start: int, n_tokens: int, src: np.ndarray) -> None:
        """The inverse of save_slot: KV rows start..start+n_tokens of slot from `src`."""
        self.kv.restore_slot(slot, start, n_tokens, src)

    def forward(self, tokens, positions, slots, out_rows) -> np.ndarray:
        cfg, w = self.cfg, self.w
        positions = np.asarray(positions, dtype=np.int64)
        slots = np.asarray(slots, dtype=np.int64)
        n = len(positions)
        q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        cos, sin = self.cos[positions], self.sin[positions]
        x = w.tok_embd.get_rows(np.asarray(tokens, dtype=np.int64))
        for li, lw in enumerate(w.layers):
            wqkv, wo, w_gate_up, w_down = lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down
            h = rms_norm(x, lw.attn_norm, cfg.norm_eps)
            qkv = self._matmul(h, wqkv)
            q = qkv[:n, :q_dim].reshape(n, cfg.n_head, cfg.head_dim)
            k = qkv[:n, q_dim:q_dim + kv_dim].reshape(n, cfg.n_head_kv, cfg.head_dim)
            v = qkv[:n, q_dim + kv_dim:].reshape(n, cfg.n_head_kv, cfg.head_dim)
            apply_rope(q, cos, sin, cfg.rope_dim)
            apply_rope(k, cos, sin, cfg.rope_dim)
            self.kv.store(li, np.ascontiguousarray(k), np.ascontiguousarray(v), slots, positions)
            attn = np.zeros((len(x), q_dim), np.float32)
            self._attn(np.ascontiguousarray(q), self.kv.k[li], self.kv.v[li], self.kv.type_k, self.kv.type_v,
                       slots, positions, attn, self.scale)
            x += self._matmul(attn, wo)
            h = rms_norm(x, lw.ffn_norm, cfg.norm_eps)
            gu = self._matmul(h, w_gate_up)
            x += self._matmul(silu(gu[:, :cfg.n_ff]) * gu[:, cfg.n_ff:], w_down)
        rows = np.asarray(out_rows, dtype=np.int64)
        h = rms_norm(x[rows], w.out_norm, cfg.norm_eps)
        return self._matmul(h, w.output)
