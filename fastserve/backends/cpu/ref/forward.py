"""The forward pass written out in NumPy: the readable reference of fastserve.backends.cpu._forward (which runs it in
one C call), composed of the element-wise twins (fastserve.backends.cpu.ref.layer_ops) and the backend's products
and attention called from Python, so that the two agree bit for bit (tests/parity/test_forward.py).
It reads what a family adds (biases, q/k norms, sandwich norms, GeGLU or gpt-oss's SwiGLU, NeoX RoPE, local
layers, layers without RoPE, residual and logit multipliers, attention sinks, a mixture of experts and its
gating and biases) from cfg (models/architecture.py), never from the architecture's name.

A mixture of experts (moe_ffn): each row's experts and weights from its own router logits (route), each
selected expert run once over the rows that chose it (rows in batch order), each row's weighted expert outputs
summed in the order of their rank (llama.cpp's build_moe_ffn adds them so): nothing of a row depends on the
others.

Shapes: n = tokens in the batch, d = n_embd, H = heads, Hkv = KV heads, D = head_dim.
"""
from __future__ import annotations

import numpy as np

from ....models.architecture import GELU, SILU, SWIGLU_OAI, TOPK_SOFTMAX
from .layer_ops import apply_rope, exp_neg, geglu, head_norm, rms_norm, softcap, swiglu, swiglu_oai

F32 = np.float32
# llama.cpp's build_moe_ffn: the sum of a row's top-k weights clamped to the smallest normal f16 before dividing
MIN_WEIGHT_SUM = F32(6.103515625e-5)


class Activations:
    """The reference forward's buffers for `rows` tokens (grown, never shrunk, if a step brings more)."""

    def __init__(self, cfg, rows: int):
        q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        self.rows = rows
        self.x = np.zeros((rows, cfg.n_embd), np.float32)            # the residual stream
        self.h = np.zeros((rows, cfg.n_embd), np.float32)            # normed input of a product
        self.y = np.zeros((rows, cfg.n_embd), np.float32)            # a product into the stream
        self.qkv = np.zeros((rows, q_dim + 2 * kv_dim), np.float32)
        self.q = np.zeros((rows, cfg.n_head, cfg.head_dim), np.float32)
        self.k = np.zeros((rows, cfg.n_head_kv, cfg.head_dim), np.float32)
        self.v = np.zeros((rows, cfg.n_head_kv, cfg.head_dim), np.float32)
        self.attn = np.zeros((rows, q_dim), np.float32)
        self.gu = np.zeros((rows, 2 * cfg.n_ff), np.float32)
        self.act = np.zeros((rows, cfg.n_ff), np.float32)
        if cfg.n_expert:
            self.route = np.zeros((rows, cfg.n_expert), np.float32)             # router logits
            self.xe = np.zeros((rows, cfg.n_embd), np.float32)                  # an expert's rows of h
            self.ye = np.zeros((rows, cfg.n_embd), np.float32)                  # its outputs
            self.moe = np.zeros((rows, cfg.n_expert_used, cfg.n_embd), np.float32)  # weighted, by rank


ACTIVATIONS = {SILU: swiglu, GELU: geglu, SWIGLU_OAI: swiglu_oai}


def route(logits: np.ndarray, k: int, scale: float, gating: str = "softmax") -> tuple[np.ndarray, np.ndarray]:
    """Router logits float32 [n, n_expert] -> (experts int64 [n, k] by rank, weights float32 [n, k]). SOFTMAX:
    llama.cpp's softmax gating with normalised weights: p = softmax(logits) (sums in expert order); the k
    largest p, ties to the lower id; w = p / max(sum of the k, MIN_WEIGHT_SUM) (sums in rank order), * scale.
    TOPK_SOFTMAX (gpt-oss's "softmax weight"): the k largest logits, ties to the lower id; w = their softmax
    (the sum in rank order), * scale."""
    if gating == TOPK_SOFTMAX:
        experts = np.argsort(-logits, axis=1, kind="stable")[:, :k]
        p = exp_neg(np.take_along_axis(logits, experts, axis=1) - logits.max(axis=1, keepdims=True))
        total = p[:, 0].copy()
        for r in range(1, k):
            total += p[:, r]
        w = p / total[:, None]
        if scale != 1.0:
            w *= F32(scale)
        return experts, w
    p = exp_neg(logits - logits.max(axis=1, keepdims=True))
    total = p[:, 0].copy()
    for e in range(1, p.shape[1]):
        total += p[:, e]
    p /= total[:, None]
    experts = np.argsort(-p, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, experts, axis=1)
    total = w[:, 0].copy()
    for r in range(1, k):
        total += w[:, r]
    w /= np.maximum(total, MIN_WEIGHT_SUM)[:, None]
    if scale != 1.0:
        w *= F32(scale)
    return experts, w


def moe_ffn(be, cfg, lw, a, h: np.ndarray, y: np.ndarray, act_fn) -> None:
    """y [n, d] = the mixture of experts of h [n, d]: each selected expert once over its rows."""
    n, nf = len(h), cfg.n_ff
    be._mm(h, lw.router, a.route[:n])
    if lw.router_bias is not None:
        a.route[:n] += lw.router_bias
    experts, weights = route(a.route[:n], cfg.n_expert_used, cfg.expert_weights_scale, cfg.arch.moe_gating)
    out = a.moe[:n]
    for e in range(cfg.n_expert):
        rows, ranks = np.nonzero(experts == e)          # by row: a row picks an expert at most once
        m = len(rows)
        if not m:
            continue
        xe, gu, act, ye = a.xe[:m], a.gu[:m], a.act[:m], a.ye[:m]
        np.take(h, rows, axis=0, out=xe)
        be._mm(xe, lw.experts_gate_up[e], gu)
        if lw.experts_gate_up_bias is not None:
            gu += lw.experts_gate_up_bias[e]
        act_fn(gu[:, :nf], gu[:, nf:], act)
        be._mm(act, lw.experts_down[e], ye)
        if lw.experts_down_bias is not None:
            ye += lw.experts_down_bias[e]
        out[rows, ranks] = ye * weights[rows, ranks][:, None]
    np.copyto(y, out[:, 0])
    for r in range(1, cfg.n_expert_used):
        y += out[:, r]


def forward(be, tokens, positions, slots, out_rows, logits: np.ndarray, hidden: bool = False) -> np.ndarray:
    """be: a backends.cpu.backend.CpuBackend (its weights, KV cache, RoPE tables, products _mm,
    attention _attn and reference activations act). tokens, positions, slots [n]; out_rows [m]:
    logits[:m] float32 [m, n_vocab] of those rows, written into logits; hidden: logits[:m] float32
    [m, n_embd] gets those rows' final hidden states (after the output norm) instead."""
    cfg, w = be.cfg, be.w
    positions = np.asarray(positions, dtype=np.int64)
    slots = np.asarray(slots, dtype=np.int64)
    n = len(positions)
    if n > be.act.rows:
        be.act = Activations(cfg, n)
    a = be.act
    q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    x, h, y, qkv = a.x[:n], a.h[:n], a.y[:n], a.qkv[:n]
    q, k, v, attn, gu, act = a.q[:n], a.k[:n], a.v[:n], a.attn[:n], a.gu[:n], a.act[:n]
    ropes = {False: (be.cos[positions], be.sin[positions]), True: (be.cos_local[positions], be.sin_local[positions])}
    w.tok_embd.get_rows(np.asarray(tokens, dtype=np.int64), out=x)
    if cfg.embd_scale != 1.0:
        x *= np.float32(cfg.embd_scale)
    act_fn = ACTIVATIONS[cfg.arch.ffn_act]
    for li, lw in enumerate(w.layers):
        local = cfg.local_layers[li]
        rms_norm(x, lw.attn_norm, cfg.norm_eps, out=h)
        be._mm(h, lw.wqkv, qkv)
        if lw.qkv_bias is not None:
            qkv += lw.qkv_bias
        np.copyto(q, qkv[:, :q_dim].reshape(n, cfg.n_head, cfg.head_dim))
        np.copyto(k, qkv[:, q_dim:q_dim + kv_dim].reshape(n, cfg.n_head_kv, cfg.head_dim))
        np.copyto(v, qkv[:, q_dim + kv_dim:].reshape(n, cfg.n_head_kv, cfg.head_dim))
        if lw.q_norm is not None:
            head_norm(q, lw.q_norm, cfg.norm_eps)
            head_norm(k, lw.k_norm, cfg.norm_eps)
        if cfg.rope_layers[li]:
            cos, sin = ropes[local]
            apply_rope(q, cos, sin, cfg.rope_dim, neox=cfg.rope_neox)
            apply_rope(k, cos, sin, cfg.rope_dim, neox=cfg.rope_neox)
        be.kv.store(li, k, v, slots, positions)
        # a local layer's query at q sees keys q - window < p <= q (llama.cpp's is_masked_swa, standard)
        be._attn(q, be.kv.k[li], be.kv.v[li], be.kv.type_k, be.kv.type_v, slots, positions, attn,
                 cfg.attn_scale, window=cfg.sliding_window if local else 0, ring=be.kv.rings[li], sinks=lw.attn_sinks)
        be._mm(attn, lw.wo, y)
        if lw.out_bias is not None:
            y += lw.out_bias
        if lw.post_attn_norm is not None:
            rms_norm(y, lw.post_attn_norm, cfg.norm_eps, out=y)
        if cfg.residual_scale != 1.0:
            y *= np.float32(cfg.residual_scale)
        x += y
        rms_norm(x, lw.ffn_norm, cfg.norm_eps, out=h)
        if cfg.n_expert:
            moe_ffn(be, cfg, lw, a, h, y, act_fn)
        else:
            be._mm(h, lw.w_gate_up, gu)
            act_fn(gu[:, :cfg.n_ff], gu[:, cfg.n_ff:], act)
            be._mm(act, lw.w_down, y)
        if lw.post_ffn_norm is not None:
            rms_norm(y, lw.post_ffn_norm, cfg.norm_eps, out=y)
        if cfg.residual_scale != 1.0:
            y *= np.float32(cfg.residual_scale)
        x += y
    rows = np.asarray(out_rows, dtype=np.int64)
    m = len(rows)
    if m and (rows.min() < 0 or rows.max() >= n):
        raise ValueError(f"out_rows must be in [0, {n}), got {rows.min()}..{rows.max()}")
    if hidden:
        return rms_norm(x[rows], w.out_norm, cfg.norm_eps, out=logits[:m])
    rms_norm(x[rows], w.out_norm, cfg.norm_eps, out=h[:m])
    out = be._mm(h[:m], w.output, logits[:m])
    if cfg.logit_scale != 1.0:
        out *= np.float32(cfg.logit_scale)
    if cfg.logit_softcap > 0:
        softcap(out, cfg.logit_softcap)
    return out
