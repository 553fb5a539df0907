"""NumPy twin of fastserve/backends/cpu/_layer_ops.h, the element-wise operations of a layer: the same float32
operations in the same order (the contract is at the top of the header), so that the C forward pass
(fastserve.backends.cpu._forward) and the reference one (fastserve.backends.cpu.ref.forward) agree bit for bit.

Shapes: x [n, d] rows; heads [n, heads, D]; cos, sin [n, rope_dim / 2] (one row per token).
"""
from __future__ import annotations

import numpy as np

from .attention import LOG2E, MAGIC

F32 = np.float32
NORM_LANES = 16
GELU_K = F32(2 * np.sqrt(2 / np.pi))
GELU_C = F32(0.044715)
OAI_ALPHA, OAI_LIMIT = F32(1.702), F32(7.0)        # gpt-oss's SwiGLU (llama.cpp's ggml_swiglu_oai)
LN2_HI = F32(float.fromhex("0x1.62e400p-1"))       # ln 2's first 15 bits: n * LN2_HI exact for |n| < 512
LN2_LO = F32(float.fromhex("0x1.7f7d1cp-20"))      # float32(ln 2 - LN2_HI)
EXP_TAYLOR = [F32(float.fromhex(h)) for h in ("0x1.a01a02p-13", "0x1.6c16c2p-10", "0x1.111112p-7", "0x1.555556p-5",
                                              "0x1.555556p-3", "0x1p-1", "0x1p0", "0x1p0")]   # 1/7!, ..., 1/1!, 1/0!


def sum_squares(x: np.ndarray) -> np.ndarray:
    """x [n, d] -> [n]: 16 lanes (lane j sums x[i]^2 for i = j mod 16, in order), folded in halves."""
    n, d = x.shape
    blocks = -(-d // NORM_LANES)
    sq = np.zeros((n, blocks * NORM_LANES), F32)          # the tail's missing lanes add +0: exact
    acc = np.zeros((n, NORM_LANES), F32)
    with np.errstate(over="ignore"):                       # overflow: inf, as in C
        np.multiply(x, x, out=sq[:, :d])
        for b in range(blocks):
            acc += sq[:, b * NORM_LANES:(b + 1) * NORM_LANES]
        w = NORM_LANES // 2
        while w >= 1:
            acc = acc[:, :w] + acc[:, w:2 * w]
            w //= 2
    return acc[:, 0]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None, ms=None) -> np.ndarray:
    """x [n, d] -> x / rms(x) * w in float32, into out [n, d] when given (may be x). ms: unused
    (the NumPy forward's old scratch; kept so callers need not change)."""
    ss = sum_squares(x)
    r = F32(1.0) / np.sqrt(ss / F32(x.shape[1]) + F32(eps))
    with np.errstate(invalid="ignore"):                    # inf rows: x * 0, as in C
        return np.multiply(x * r[:, None], w, out=out)


def head_norm(x: np.ndarray, w: np.ndarray, eps: float, ms=None) -> None:
    """In place: RMSNorm of each head of x [n, heads, D] with w [D]."""
    flat = x.reshape(-1, x.shape[2])
    rms_norm(flat, w, eps, out=flat)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope_dim: int, tmp=None, neox: bool = False) -> None:
    """In place. x [n, heads, D]; cos/sin [n, rope_dim/2]: rotates pairs (2i, 2i+1) of the first rope_dim
    (llama.cpp's "normal" RoPE), or (i, i + rope_dim/2) when neox. tmp: unused (kept for callers)."""
    half = rope_dim // 2
    first, second = (slice(0, half), slice(half, rope_dim)) if neox else (slice(0, rope_dim, 2), slice(1, rope_dim, 2))
    a, b = x[:, :, first].copy(), x[:, :, second].copy()
    c, s = cos[:, None, :], sin[:, None, :]
    x[:, :, first] = a * c - b * s
    x[:, :, second] = a * s + b * c


def exp_neg(x: np.ndarray) -> np.ndarray:
    """e^x for x <= 0 (float32, ~1 ulp), operation by operation as fs_exp_neg: Cody-Waite reduction
    r = (x - n LN2_HI) - n LN2_LO with n = rint(x log2 e), e^r by Horner of its degree-7 Taylor polynomial,
    times 2^n; x clamped to [-87, 0], 0 below -87."""
    x = np.asarray(x, F32)
    xc = np.minimum(np.maximum(x, F32(-87.0)), F32(0.0))
    n = (xc * LOG2E + MAGIC) - MAGIC
    r = (xc - n * LN2_HI) - n * LN2_LO
    p = np.full_like(r, EXP_TAYLOR[0])
    for c in EXP_TAYLOR[1:]:
        p = p * r + c
    scale = ((n.astype(np.int32) + 127).astype(np.uint32) << np.uint32(23)).view(F32)
    return np.where(x < F32(-87.0), F32(0.0), p * scale).astype(F32)


def sigmoid(z: np.ndarray) -> np.ndarray:
    t = exp_neg(-np.abs(z))
    return np.where(z >= 0, F32(1.0), t) / (F32(1.0) + t)


def tanh(z: np.ndarray) -> np.ndarray:
    t = exp_neg(F32(-2.0) * np.abs(z))
    r = (F32(1.0) - t) / (F32(1.0) + t)
    return np.where(z < 0, -r, r)


def swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """silu(gate) * up in float32, written into out when given."""
    gate = np.asarray(gate, F32)
    return np.multiply(gate * sigmoid(gate), up, out=out)


def geglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """gelu(gate) * up in float32 (GELU's tanh form, as llama.cpp's ggml_gelu:
    0.5 g (1 + tanh(sqrt(2/pi) g (1 + 0.044715 g^2))) = g sigmoid(2 sqrt(2/pi) g (1 + 0.044715 g^2))),
    written into out when given. (llama.cpp's CPU backend reads it from an f16 table; emulating that
    rounding changed neither agreement nor |dp| on Gemma 3 270M.)"""
    g = np.asarray(gate, F32)
    y = ((g * g) * GELU_C + F32(1.0)) * g
    return np.multiply(g * sigmoid(y * GELU_K), up, out=out)


def swiglu_oai(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """gpt-oss's SwiGLU in float32: (x sigmoid(1.702 x)) (y + 1) with x = min(gate, 7), y = clip(up, -7, 7),
    written into out when given."""
    x = np.minimum(np.asarray(gate, F32), OAI_LIMIT)
    y = np.clip(np.asarray(up, F32), -OAI_LIMIT, OAI_LIMIT)
    return np.multiply(x * sigmoid(OAI_ALPHA * x), y + F32(1.0), out=out)


def softcap(x: np.ndarray, c: float) -> np.ndarray:
    """In place: x = c * tanh(x / c)."""
    c = F32(c)
    x[...] = tanh(x / c) * c
    return x
