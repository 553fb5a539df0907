"""The transformer forward pass in NumPy (float32): the CPU backend and the reference for the GPU one.
It reads what a family adds (biases, q/k norms, sandwich norms, GeGLU, NeoX RoPE, local layers)
from cfg (models/architecture.py: one row per architecture), never from the architecture's name.

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
from ..models.transformer import ModelConfig, ModelWeights
from .host_sampling import HostSampling
from .kv_cache import DEFAULT_CACHE_TYPE, KVCache

def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None,
             ms: np.ndarray | None = None) -> np.ndarray:
    """x [n, d] -> x / rms(x) * w, in float32; into out [n, d] (and ms [n] as scratch) when given."""
    ms = np.einsum("ij,ij->i", x, x, out=ms)
    ms /= np.float32(x.shape[1])
    ms += np.float32(eps)
    np.sqrt(ms, out=ms)
    np.divide(1.0, ms, out=ms)
    out = np.multiply(x, ms[:, None], out=out)
    out *= w
    return out


def rope_tables(cfg: ModelConfig, n_pos: int, freq_factors: np.ndarray | None, local: bool = False):
    """cos, sin [n_pos, rope_dim/2] in float32: angle (pos / scale) * base^(-2i/rope_dim) (/ factor i), the
    same for llama.cpp's adjacent-pair and NeoX layouts. local: the local layers' table (their own base,
    and no position scaling: llama.cpp's rope_freq_scale_train_swa is 1)."""
    half = cfg.rope_dim // 2
    base, scale = (cfg.rope_base_local, 1.0) if local else (cfg.rope_base, cfg.rope_scale)
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.rope_dim)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors[:half].astype(np.float64)
    pos = np.arange(n_pos, dtype=np.float64) / scale
    theta = np.outer(pos, inv_freq)
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope_dim: int, tmp=None, neox: bool = False) -> None:
    """In place. x [n, heads, D]; cos/sin [n, rope_dim/2]; rotates pairs (2i, 2i+1) of the first rope_dim
    (llama.cpp's "normal" RoPE), or (i, i + rope_dim/2) when neox.
    tmp: three float32 scratch arrays of at least [n, heads, rope_dim/2] (allocated when None)."""
    n, heads, half = x.shape[0], x.shape[1], rope_dim // 2
    if tmp is None:
        tmp = [np.empty((n, heads, half), np.float32) for _ in range(3)]
    x0, t, u = (a[:n, :heads] for a in tmp)
    first, second = (slice(0, half), slice(half, rope_dim)) if neox else (slice(0, rope_dim, 2), slice(1, rope_dim, 2))
    x1 = x[:, :, second]
    c, s = cos[:, None, :], sin[:, None, :]
    np.copyto(x0, x[:, :, first])
    np.multiply(x0, c, out=t)
    np.multiply(x1, s, out=u)
    np.multiply(x0, s, out=x0)                 # x0 * s, before x1 is overwritten
    np.subtract(t, u, out=x[:, :, first])
    np.multiply(x1, c, out=u)
    np.add(x0, u, out=x1)


def swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = silu(gate) * up = gate / (1 + exp(-gate)) * up in float32, written into out."""
    np.negative(gate, out=out)
    np.exp(out, out=out)
    out += np.float32(1.0)
    np.divide(gate, out, out=out)
    out *= up
    return out


_SQRT_2_OVER_PI = np.float32(np.sqrt(2.0 / np.pi))


def geglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = gelu(gate) * up in float32, written into out; GELU's tanh form, as llama.cpp's ggml_gelu:
    0.5 g (1 + tanh(sqrt(2/pi) g (1 + 0.044715 g^2))). (llama.cpp's CPU backend reads it from an f16
    table; emulating that rounding changed neither agreement nor |dp| on Gemma 3 270M.)"""
    np.multiply(gate, gate, out=out)
    out *= np.float32(0.044715)
    out += np.float32(1.0)
    out *= gate
    out *= _SQRT_2_OVER_PI
    np.tanh(out, out=out)
    out += np.float32(1.0)
    out *= gate
    out *= np.float32(0.5)
    out *= up
    return out


def head_norm(x: np.ndarray, w: np.ndarray, eps: float, ms: np.ndarray) -> None:
    """In place: RMSNorm of each head of x [n, heads, D] with w [D]; ms: scratch of >= n * heads."""
    flat = x.reshape(-1, x.shape[2])
    rms_norm(flat, w, eps, out=flat, ms=ms[:len(flat)])


class Activations:
    """The forward pass's buffers, allocated once for `rows` tokens (grown, never shrunk, if a
    step brings more): a step uses their first n rows and allocates nothing else of its size."""

    def __init__(self, cfg: ModelConfig, rows: int):
        q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        self.rows = rows
        self.x = np.zeros((rows, cfg.n_embd), np.float32)            # the residual stream
        self.h = np.zeros((rows, cfg.n_embd), np.float32)            # normed input of a product
        self.y = np.zeros((rows, cfg.n_embd), np.float32)            # a product into the stream
        self.ms = np.zeros(rows * cfg.n_head, np.float32)            # RMSNorm's mean squares (rows, or heads)
        self.qkv = np.zeros((rows, q_dim + 2 * kv_dim), np.float32)
        self.q = np.zeros((rows, cfg.n_head, cfg.head_dim), np.float32)
        self.k = np.zeros((rows, cfg.n_head_kv, cfg.head_dim), np.float32)
        self.v = np.zeros((rows, cfg.n_head_kv, cfg.head_dim), np.float32)
        self.attn = np.zeros((rows, q_dim), np.float32)
        self.gu = np.zeros((rows, 2 * cfg.n_ff), np.float32)
        self.act = np.zeros((rows, cfg.n_ff), np.float32)
        half = cfg.rope_dim // 2
        self.cos = np.zeros((rows, half), np.float32)
        self.sin = np.zeros((rows, half), np.float32)
        self.cos_local = np.zeros((rows, half), np.float32)        # the local layers' (their own base)
        self.sin_local = np.zeros((rows, half), np.float32)
        # RoPE's temporaries: [rows, heads, rope_dim/2] for the widest (query) heads.
        self.r0 = np.zeros((rows, cfg.n_head, half), np.float32)
        self.r1 = np.zeros((rows, cfg.n_head, half), np.float32)
        self.r2 = np.zeros((rows, cfg.n_head, half), np.float32)


class NumpyBackend(HostSampling):
    """CPU backend. KV cache: self.kv (backends/kv_cache.py), in cache_type_k / cache_type_v
    ("f16", the default, "f32" or "q8_0"), read directly by attention.

    max_tokens: the most tokens a step carries (its buffers; and the most one step writes into one
    slot, which sizes the local layers' rings: backends/kv_cache.ring_size); a step of more tokens in
    one slot is refused when the model has a ring (Model.logits makes its backend for the whole sequence).

    threads: threads of the step's loops (self.pool: the caller + threads - 1 helpers); 1 is the safe default
    on a machine whose other cores serve the event loop (see bench/bench_matmul.py).

    Batch invariance: a token's logits do not depend on what else is in the
    batch. The products sum every output in a fixed order whatever n. Attention
    (fastserve._attention) computes each (token, head) in a fixed order of key tiles, whatever
    the batch or the threads.
    """

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, n_slots: int, n_ctx_slot: int,
                 threads: int = 1, cache_type_k: str = DEFAULT_CACHE_TYPE,
                 cache_type_v: str = DEFAULT_CACHE_TYPE, max_tokens: int = 512, reuse_logits: bool = False):
        self.cfg, self.w = cfg, weights
        self.act = Activations(cfg, max(1, max_tokens))
        # The engine samples a step's logits before the next step: it may have them in one reused
        # buffer; other callers (Model.logits, tests) keep them, so they get fresh arrays.
        self.reuse_logits = reuse_logits
        self._logits = np.zeros((max(1, max_tokens) if reuse_logits else 0, cfg.n_vocab), np.float32)
        self.pool = Pool(threads)      # the step's helper threads, shared by its parallel loops
        self._mm = Matmul(pool=self.pool)
        self.n_slots, self.n_ctx_slot, self.n_vocab = n_slots, n_ctx_slot, cfg.n_vocab
        self.kv = KVCache(cfg.n_layer, n_slots, n_ctx_slot, cfg.n_head_kv, cfg.head_dim, cache_type_k, cache_type_v,
                          window=cfg.sliding_window, local_layers=cfg.local_layers, step_tokens=max(1, max_tokens))
        self._attn = Attention(self.pool)
        self.cos, self.sin = rope_tables(cfg, n_ctx_slot, weights.rope_freqs)
        # local layers' own RoPE base (gemma3: 10k beside the global layers' 1M)
        self.cos_local, self.sin_local = (rope_tables(cfg, n_ctx_slot, weights.rope_freqs, local=True)
                                          if any(cfg.local_layers) else (self.cos, self.sin))
        self.scale = cfg.attn_scale
        self.init_sampling(n_slots, cfg.n_vocab, max_tokens)    # the step's sampler: backends/host_sampling.py

    def kv_bytes_per_token(self) -> int:
        return self.kv.bytes_per_token()

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
        cfg, w = self.cfg, self.w
        positions = np.asarray(positions, dtype=np.int64)
        slots = np.asarray(slots, dtype=np.int64)
        n = len(positions)
        if n > self.act.rows:
            self.act = Activations(cfg, n)
        a = self.act
        q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        x, h, y, ms, qkv = a.x[:n], a.h[:n], a.y[:n], a.ms[:n], a.qkv[:n]
        q, k, v, attn, gu, act = a.q[:n], a.k[:n], a.v[:n], a.attn[:n], a.gu[:n], a.act[:n]
        rope_tmp = (a.r0, a.r1, a.r2)
        if n and (positions.min() < 0 or positions.max() >= self.n_ctx_slot):
            raise ValueError(f"positions must be in [0, {self.n_ctx_slot}), got {positions.min()}..{positions.max()}")
        # mode="clip": take's default ("raise") copies through a temporary; positions are checked above.
        ropes = {}
        for local, (ct, st, cos, sin) in {False: (self.cos, self.sin, a.cos, a.sin),
                                          True: (self.cos_local, self.sin_local, a.cos_local, a.sin_local)}.items():
            if local in cfg.local_layers:
                ropes[local] = (np.take(ct, positions, axis=0, out=cos[:n], mode="clip"),
                                np.take(st, positions, axis=0, out=sin[:n], mode="clip"))
        self.kv.begin_step(slots, positions)
        w.tok_embd.get_rows(np.asarray(tokens, dtype=np.int64), out=x)
        if cfg.embd_scale != 1.0:
            x *= np.float32(cfg.embd_scale)
        act_fn = geglu if cfg.ffn_gelu else swiglu
        for li, lw in enumerate(w.layers):
            local = cfg.local_layers[li]
            rms_norm(x, lw.attn_norm, cfg.norm_eps, out=h, ms=ms)
            self._mm(h, lw.wqkv, qkv)
            if lw.qkv_bias is not None:
                qkv += lw.qkv_bias
            np.copyto(q, qkv[:, :q_dim].reshape(n, cfg.n_head, cfg.head_dim))
            np.copyto(k, qkv[:, q_dim:q_dim + kv_dim].reshape(n, cfg.n_head_kv, cfg.head_dim))
            np.copyto(v, qkv[:, q_dim + kv_dim:].reshape(n, cfg.n_head_kv, cfg.head_dim))
            if lw.q_norm is not None:
                head_norm(q, lw.q_norm, cfg.norm_eps, a.ms)
                head_norm(k, lw.k_norm, cfg.norm_eps, a.ms)
            cos, sin = ropes[local]
            apply_rope(q, cos, sin, cfg.rope_dim, rope_tmp, cfg.rope_neox)
            apply_rope(k, cos, sin, cfg.rope_dim, rope_tmp, cfg.rope_neox)
            self.kv.store(li, k, v, slots, positions)
            # a local layer's query at q sees keys q - window < p <= q (llama.cpp's is_masked_swa, standard)
            self._attn(q, self.kv.k[li], self.kv.v[li], self.kv.type_k, self.kv.type_v, slots, positions, attn,
                       self.scale, window=cfg.sliding_window if local else 0, ring=self.kv.rings[li])
            self._mm(attn, lw.wo, y)
            if lw.post_attn_norm is not None:
                rms_norm(y, lw.post_attn_norm, cfg.norm_eps, out=y, ms=ms)
            x += y
            rms_norm(x, lw.ffn_norm, cfg.norm_eps, out=h, ms=ms)
            self._mm(h, lw.w_gate_up, gu)
            act_fn(gu[:, :cfg.n_ff], gu[:, cfg.n_ff:], act)
            self._mm(act, lw.w_down, y)
            if lw.post_ffn_norm is not None:
                rms_norm(y, lw.post_ffn_norm, cfg.norm_eps, out=y, ms=ms)
            x += y
        rows = np.asarray(out_rows, dtype=np.int64)
        m = len(rows)
        if m and (rows.min() < 0 or rows.max() >= n):
            raise ValueError(f"out_rows must be in [0, {n}), got {rows.min()}..{rows.max()}")
        np.take(x, rows, axis=0, out=y[:m], mode="clip")
        rms_norm(y[:m], w.out_norm, cfg.norm_eps, out=h[:m], ms=ms[:m])
        if not self.reuse_logits or m > len(self._logits):
            logits = self._mm(h[:m], w.output, np.empty((m, cfg.n_vocab), np.float32))
        else:
            logits = self._mm(h[:m], w.output, self._logits[:m])
        if cfg.logit_softcap > 0:
            c = np.float32(cfg.logit_softcap)
            logits /= c
            np.tanh(logits, out=logits)
            logits *= c
        return logits
