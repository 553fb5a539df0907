"""The llama forward pass in NumPy (float32): the CPU backend and the reference for the GPU one.

The matrix products run on int8 weights (fastserve._matmul, "q8", the default: a quarter of the
memory traffic of float32, and batch-invariant by construction) or on the float32 weights through
OpenBLAS ("f32"). Everything else is float32.

Shapes: n = tokens in the batch, d = n_embd, H = heads, Hkv = KV heads,
D = head_dim, G = H // Hkv (queries per KV head), L = keys attended.
"""
from __future__ import annotations

import numpy as np

from .._attention import attend
from .._matmul import Matmul, Q8Matrix
from ..models.llama import LlamaConfig, LlamaWeights

WEIGHT_TYPES = ("q8", "f32")


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


def matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [n, in] times w [out, in] transposed: [n, out], C-contiguous.

    Written as w @ x.T: with the weight as BLAS's first operand, OpenBLAS is
    faster than x @ w.T at the small n of decode steps. The copy back to C
    order keeps every later operation's summation order independent of n."""
    return np.ascontiguousarray((w @ x.T).T)


def q8_matrices(w: LlamaWeights):
    """([(wqkv, wo, w_gate_up, w_down) per layer], output) as Q8Matrix: requantized once per weights
    object (cached in w.packed) and shared by every backend built on them."""
    if "q8" not in w.packed:
        layers = [tuple(Q8Matrix.from_float(m) for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down))
                  for lw in w.layers]
        w.packed["q8"] = (layers, Q8Matrix.from_float(w.output))
    return w.packed["q8"]


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


class NumpyBackend:
    """CPU backend. KV cache: per layer float32 [n_slots, n_ctx_slot, Hkv, D].

    weight_type: "q8" (fastserve._matmul on int8 weights, the default) or "f32" (OpenBLAS).
    threads: threads of the q8 products (the caller + threads - 1 helpers); 1 is the safe default
    on a machine whose other cores serve the event loop (see bench/bench_matmul.py). The f32
    path's threads are OpenBLAS's (threadpoolctl).

    Batch invariance: a token's logits do not depend on what else is in the
    batch. The q8 product sums every output in a fixed order whatever n. OpenBLAS
    picks other kernels (other summation orders) for a one-column product (gemv)
    and for "small" products (out*n up to ~1152), so on the f32 path every product
    is given at least `min_rows` rows (zero padding). Attention
    (fastserve._attention) computes each (token, head) on its own.
    """

    def __init__(self, cfg: LlamaConfig, weights: LlamaWeights, n_slots: int, n_ctx_slot: int,
                 weight_type: str = "q8", threads: int = 1):
        if weight_type not in WEIGHT_TYPES:
            raise ValueError(f"unknown weight_type {weight_type!r}; known: {', '.join(WEIGHT_TYPES)}")
        self.cfg, self.w = cfg, weights
        self.weight_type = weight_type
        if weight_type == "q8":
            self._mm = Matmul(threads)
            layers, output = q8_matrices(weights)
        else:
            self._mm = None
            layers = [(lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down) for lw in weights.layers]
            output = weights.output
        self._layer_mats, self._output = layers, output   # per layer (wqkv, wo, w_gate_up, w_down)
        self.n_slots, self.n_ctx_slot, self.n_vocab = n_slots, n_ctx_slot, cfg.n_vocab
        shape = (n_slots, n_ctx_slot, cfg.n_head_kv, cfg.head_dim)
        # np.full, not np.zeros: every page is written now. np.zeros (calloc) leaves each page to its
        # first write, so RSS would creep up for hours as slots reach positions they never reached.
        self.k_cache = [np.full(shape, 0, np.float32) for _ in range(cfg.n_layer)]
        self.v_cache = [np.full(shape, 0, np.float32) for _ in range(cfg.n_layer)]
        self.cos, self.sin = rope_tables(cfg, n_ctx_slot, weights.rope_freqs)
        self.scale = float(1.0 / np.sqrt(cfg.head_dim))
        self.scratch = np.zeros(n_ctx_slot, np.float32)        # attention scores of one (token, head)
        narrowest = min(cfg.n_embd, (cfg.n_head + 2 * cfg.n_head_kv) * cfg.head_dim, 2 * cfg.n_ff)
        self.min_rows = max(2, -(-2048 // narrowest)) if weight_type == "f32" else 1

    def _matmul(self, x: np.ndarray, m) -> np.ndarray:
        """x [n, in] times m [out, in] transposed: [n, out] float32, C-contiguous."""
        if self._mm is None:
            return matmul(x, m)
        return self._mm(x, m, np.empty((len(x), m.n_out), np.float32))

    def kv_bytes_per_token(self) -> int:
        c = self.cfg
        return 2 * c.n_layer * c.n_head_kv * c.head_dim * 4

    def copy_slot(self, src: int, dst: int, n_tokens: int) -> None:
        for k, v in zip(self.k_cache, self.v_cache):
            k[dst, :n_tokens] = k[src, :n_tokens]
            v[dst, :n_tokens] = v[src, :n_tokens]

    def save_slot(self, slot: int, start: int, n_tokens: int, into: np.ndarray) -> None:
        """KV rows start..start+n_tokens of slot into `into` (uint8, >= n_tokens * kv_bytes_per_token()),
        laid out [n_layer, 2 (K, V), n_tokens, Hkv * D] float32. Copies into `into`, allocates nothing."""
        dst = self._kv_rows(into, n_tokens)
        for li, (k, v) in enumerate(zip(self.k_cache, self.v_cache)):
            np.copyto(dst[li, 0], k[slot, start:start + n_tokens])
            np.copyto(dst[li, 1], v[slot, start:start + n_tokens])

    def restore_slot(self, slot: int, start: int, n_tokens: int, src: np.ndarray) -> None:
        """The inverse of save_slot: KV rows start..start+n_tokens of slot from `src`."""
        rows = self._kv_rows(src, n_tokens)
        for li, (k, v) in enumerate(zip(self.k_cache, self.v_cache)):
            np.copyto(k[slot, start:start + n_tokens], rows[li, 0])
            np.copyto(v[slot, start:start + n_tokens], rows[li, 1])

    def _kv_rows(self, buf: np.ndarray, n_tokens: int) -> np.ndarray:
        c = self.cfg
        nbytes = n_tokens * self.kv_bytes_per_token()
        if buf.dtype != np.uint8 or buf.ndim != 1 or len(buf) < nbytes or not buf.flags.c_contiguous:
            raise ValueError(f"a KV copy of {n_tokens} tokens needs a contiguous uint8 buffer of {nbytes} bytes")
        return buf[:nbytes].view(np.float32).reshape(c.n_layer, 2, n_tokens, c.n_head_kv, c.head_dim)

    def forward(self, tokens, positions, slots, out_rows) -> np.ndarray:
        cfg, w = self.cfg, self.w
        positions = np.asarray(positions, dtype=np.int64)
        slots = np.asarray(slots, dtype=np.int64)
        n = len(positions)
        q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        cos, sin = self.cos[positions], self.sin[positions]
        # Rows past n are zero padding so that every product has >= min_rows rows.
        x = np.zeros((max(n, self.min_rows), cfg.n_embd), np.float32)
        x[:n] = w.tok_embd[np.asarray(tokens, dtype=np.int64)]
        for li, lw in enumerate(w.layers):
            wqkv, wo, w_gate_up, w_down = self._layer_mats[li]
            h = rms_norm(x, lw.attn_norm, cfg.norm_eps)
            qkv = self._matmul(h, wqkv)
            q = qkv[:n, :q_dim].reshape(n, cfg.n_head, cfg.head_dim)
            k = qkv[:n, q_dim:q_dim + kv_dim].reshape(n, cfg.n_head_kv, cfg.head_dim)
            v = qkv[:n, q_dim + kv_dim:].reshape(n, cfg.n_head_kv, cfg.head_dim)
            apply_rope(q, cos, sin, cfg.rope_dim)
            apply_rope(k, cos, sin, cfg.rope_dim)
            kc, vc = self.k_cache[li], self.v_cache[li]
            kc[slots, positions] = k
            vc[slots, positions] = v
            attn = np.zeros((len(x), q_dim), np.float32)
            attend(np.ascontiguousarray(q), kc, vc, slots, positions, attn, self.scratch, self.scale)
            x += self._matmul(attn, wo)
            h = rms_norm(x, lw.ffn_norm, cfg.norm_eps)
            gu = self._matmul(h, w_gate_up)
            x += self._matmul(silu(gu[:, :cfg.n_ff]) * gu[:, cfg.n_ff:], w_down)
        rows = np.asarray(out_rows, dtype=np.int64)
        h = np.zeros((max(len(rows), self.min_rows), cfg.n_embd), np.float32)
        h[:len(rows)] = rms_norm(x[rows], w.out_norm, cfg.norm_eps)
        return self._matmul(h, self._output)[:len(rows)]
