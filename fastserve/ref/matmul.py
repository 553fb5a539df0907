"""Pure-NumPy twin of fastserve._matmul: the same quantization and the same float32 block order,
so its outputs are bit-identical to the extension's (tests/parity/test_matmul.py).

Blocks of 32 inputs: d = amax / 127, q = rint(v * (127 / amax)) (0 when amax < 2^-100), float32.
Weights w = d_w * q_w (+ m_w: offsets, from GGUF's Q4_1/Q5_1 blocks). For each (r, o), in block order:
    acc = acc + float32(isum) * (d_w * d_x);  with offsets then  acc = acc + m_w * s_x,
s_x = d_x * float32(sum q_x), every product and sum rounded to float32; isum is the exact integer dot.
"""
from __future__ import annotations

import numpy as np

QK = 32
TINY = np.float32(2.0 ** -100)      # blocks with a smaller amax quantize to zeros (127 / amax would overflow)
ISA_NAMES = {0: "scalar"}


def isas():
    return ("scalar",)


def best_isa():
    return "scalar"


def _blocks(n_in: int) -> int:
    return -(-n_in // QK)


def _quantize(x: np.ndarray):
    """x [n, in] float32 -> q int8 [n, nb, 32] (zero padded), d float32 [n, nb]."""
    n, n_in = x.shape
    nb = _blocks(n_in)
    xb = np.zeros((n, nb * QK), np.float32)
    xb[:, :n_in] = x
    xb = xb.reshape(n, nb, QK)
    amax = np.abs(xb).max(axis=2) if nb else np.zeros((n, 0), np.float32)
    amax = np.where(amax >= TINY, amax, np.float32(0.0)).astype(np.float32)   # zeros, denormals, NaN
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(xb * inv[:, :, None]).astype(np.int8)
    return q, (amax / np.float32(127.0)).astype(np.float32)


def quantize_rows(x):
    """x [n, in] float32 -> (q int8 [n, in], d float32 [n, ceil(in/32)])."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    q, d = _quantize(x)
    return q.reshape(len(x), -1)[:, :x.shape[1]], d


class Q8Matrix:
    """A weight matrix [n_out, n_in]: q int8 [n_out, nb, 32], d float32 [n_out, nb], m like d or None."""

    def __init__(self, q: np.ndarray, d: np.ndarray, m: np.ndarray | None, n_in: int):
        self.q, self.d, self.m = q, d, m
        self.n_out, self.n_in, self.has_min = q.shape[0], n_in, m is not None
        self.nbytes = -(-self.n_out // 16) * q.shape[1] * (640 if self.has_min else 576)

    @staticmethod
    def from_float(w):
        w = np.ascontiguousarray(w, dtype=np.float32)
        q, d = _quantize(w)
        return Q8Matrix(q, d, None, w.shape[1])

    @staticmethod
    def from_blocks(q, d, m=None):
        n_out, n_in = q.shape
        nb = _blocks(n_in)
        if d.shape != (n_out, nb) or (m is not None and m.shape != (n_out, nb)):
            raise ValueError(f"Q8Matrix.from_blocks: d {d.shape}, m {None if m is None else m.shape}, "
                             f"expected {(n_out, nb)}")
        qp = np.zeros((n_out, nb * QK), np.int8)
        qp[:, :n_in] = q
        return Q8Matrix(qp.reshape(n_out, nb, QK), np.array(d, np.float32),
                        None if m is None else np.array(m, np.float32), n_in)

    @property
    def shape(self):
        return (self.n_out, self.n_in)

    def unpack(self):
        m = None if self.m is None else self.m.copy()
        return self.q.reshape(self.n_out, -1)[:, :self.n_in].copy(), self.d.copy(), m


class Matmul:
    """The extension's Matmul: threads, pool, isa and spin_us are accepted and change no number (as in C)."""

    def __init__(self, threads: int = 1, isa: str = "auto", spin_us: float = 100.0, pool=None):
        if pool is not None:
            threads = pool.threads
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if isa not in ("auto", "scalar"):
            raise ValueError(f"this machine cannot run the {isa} kernel; it can: scalar")
        self.threads, self.isa = threads, "scalar"

    def __call__(self, x, w: Q8Matrix, out):
        n = x.shape[0]
        if x.shape[1] != w.n_in or out.shape != (n, w.n_out):
            raise ValueError(f"Matmul: x {x.shape} . W^T {w.shape} does not fit out {out.shape}")
        xq, dx = _quantize(np.ascontiguousarray(x, dtype=np.float32))
        sx = dx * xq.sum(axis=2, dtype=np.int32).astype(np.float32)       # [n, nb]
        acc = np.zeros((n, w.n_out), np.float32)
        for b in range(w.q.shape[1]):
            # The exact integer block dot: every partial sum is an integer below 2^53.
            isum = xq[:, b].astype(np.float64) @ w.q[:, b].astype(np.float64).T
            scale = w.d[None, :, b] * dx[:, b, None]                      # float32 [n, n_out]
            acc = acc + isum.astype(np.float32) * scale
            if w.m is not None:
                acc = acc + w.m[None, :, b] * sx[:, b, None]
        out[...] = acc
        return out
