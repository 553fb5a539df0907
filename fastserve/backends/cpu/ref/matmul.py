"""Pure-NumPy twin of fastserve.backends.cpu._matmul: the same blocks (fastserve.models.blocks), the same activation
quantization and the same float32 order, so its outputs are bit-identical to the extension's
(tests/parity/test_matmul.py).

Activations, blocks of 32 inputs: d = amax / 127, q = rint(v * (127 / amax)) (0 when amax < 2^-100).
Weights per block w_i = d_w * (s_i * q_i) + m_w. For each (r, o), in block order:
    acc = acc + float32(isum) * (d_w * d_x);  with offsets then  acc = acc + m_w * s_x,
isum = sum_i s_i q_w,i q_x,i exact, s_x = d_x * float32(sum q_x), every product and sum rounded to
float32. Kind "qsm" (Q2_K: an offset per half block, m_0 for inputs 0..15, m_1 for 16..31): after
the isum step  acc = acc + m_0 * s_x,lo;  then  acc = acc + m_1 * s_x,hi,  with
s_x,lo = d_x * float32(sum of q_x over inputs 0..15), s_x,hi = d_x * float32(sum over 16..31).
Float weights (F32/F16/BF16): 16 partial sums p_(i mod 16) = fma(w_i, x_i, p_(i mod 16)) (one rounding) for
i = 0, 1, ... in order (inputs padded with zeros to a multiple of 16), then folded in float32 sums:
p_k + p_(k+8), + p_(k+4), + p_(k+2), p_0 + p_1.
"""
from __future__ import annotations

import numpy as np

from ....models import blocks as B

QK = 32
TINY = np.float32(2.0 ** -100)      # blocks with a smaller amax quantize to zeros (127 / amax would overflow)
ISA_NAMES = {0: "scalar"}
KERNEL_TYPES = tuple(B.TYPES)


def isas():
    return ("scalar",)


def best_isa():
    return "scalar"


def type_info(type_name: str):
    if type_name not in B.TYPES:
        raise ValueError(f"type {type_name} has no kernel; kernel types: {', '.join(KERNEL_TYPES)}")
    return B.TYPES[type_name]


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


class BlockMatrix:
    """The extension's BlockMatrix: parts (label, type name, data, rows) stacked by rows, decoded once
    into exact blocks (the twin may copy; the extension never does)."""

    def __init__(self, parts, n_in: int):
        parts = list(parts)
        if not parts:
            raise ValueError("BlockMatrix: no parts")
        self.n_in = int(n_in)
        self.parts, types, labels = [], [], []
        for label, type_name, data, rows in parts:
            if type_name not in B.TYPES:
                raise ValueError(f"{label}: type {type_name} has no kernel; kernel types: {', '.join(KERNEL_TYPES)}")
            if self.n_in % B.TYPES[type_name][0]:
                raise ValueError(f"{label}: {type_name} rows of {n_in} inputs are not whole blocks of {B.TYPES[type_name][0]}")
            try:
                self.parts.append(B.decode(type_name, data, int(rows), self.n_in))
            except ValueError as exc:
                raise ValueError(f"{label}: {exc}") from None
            types.append(type_name)
            labels.append(label)
        self.types, self.labels = tuple(types), tuple(labels)
        self.part_rows = tuple(len(p.w if p.kind == "f" else p.q) for p in self.parts)
        self.n_out = sum(self.part_rows)
        self.nbytes = sum(B.row_bytes(t, self.n_in) * r for t, r in zip(types, self.part_rows))
        self.has_float = any(p.kind == "f" for p in self.parts)
        self.has_int = any(p.kind != "f" for p in self.parts)

    @staticmethod
    def from_float(w, label="matrix"):
        w = np.asarray(w)
        if w.dtype != np.float32 or w.ndim != 2 or not w.flags.c_contiguous:
            raise ValueError(f"{label}: from_float needs a C-contiguous float32 [n_out, n_in] array")
        return BlockMatrix([(label, "F32", w, w.shape[0])], w.shape[1])

    @property
    def shape(self):
        return (self.n_out, self.n_in)

    def to_float(self):
        return np.concatenate([B.dequantize(p) for p in self.parts])

    def get_rows(self, ids, out=None):
        ids = np.asarray(ids, np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.n_out):
            raise IndexError(f"get_rows: rows outside [0, {self.n_out})")
        rows = self.to_float()[ids]
        if out is None:
            return rows
        out[...] = rows
        return out


def fma32(a, b, c) -> np.ndarray:
    """float32 fma(a, b, c): a * b + c rounded once. a * b is exact in float64 (48 bits); the float64 sum s
    and its exact error e (TwoSum) give the true value s + e, whose float32 rounding differs from s's
    only where s is exactly halfway between two float32 numbers and e is not zero: then it goes e's way."""
    t = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = t + c64
    with np.errstate(invalid="ignore", over="ignore"):
        v = s - t
        e = (t - (s - v)) + (c64 - v)
        r = s.astype(np.float32)
        # a sum that rounded to +-inf from 2^128 - 2^103 (the tie past FLT_MAX): inf counts as 2^128 there
        r64 = np.where(np.isinf(r) & np.isfinite(s), np.copysign(2.0 ** 128, s), r.astype(np.float64))
        toward = np.nextafter(r, np.where(s > r64, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32))
        halfway = np.isfinite(s) & (s != r64) & (s == (r64 + toward.astype(np.float64)) / 2)
        # at a tie s rounded to even (r); the true value lies past it (take toward) when e points away from r
        fix = halfway & (e != 0) & ((e > 0) == (toward > r64))
    return np.where(fix, toward, r).astype(np.float32)


def _part_product(x, xq, dx, xs, xh, sx, p: B.Blocks) -> np.ndarray:
    """[n, rows] float32 of one part."""
    n = len(x)
    if p.kind == "f":
        n_in = p.w.shape[1]
        k = -(-n_in // 16) * 16
        xp = np.zeros((n, k), np.float32)
        wp = np.zeros((len(p.w), k), np.float32)
        xp[:, :n_in], wp[:, :n_in] = x[:, :n_in], p.w
        acc = np.zeros((n, len(p.w), 16), np.float32)
        for c in range(0, k, 16):
            acc = fma32(wp[None, :, c:c + 16], xp[:, None, c:c + 16], acc)
        for half in (8, 4, 2, 1):
            acc = acc[..., :half] + acc[..., half:2 * half]
        return acc[..., 0]
    acc = np.zeros((n, len(p.q)), np.float32)
    for b in range(p.q.shape[1]):
        # The exact integer block dots: every partial sum is an integer below 2^53.
        qx, qw = xq[:, b].astype(np.float64), p.q[:, b].astype(np.float64)
        if p.s is None:
            isum = qx @ qw.T
        else:
            isum = (qx[:, :16] @ qw[:, :16].T) * p.s[None, :, b, 0] + (qx[:, 16:] @ qw[:, 16:].T) * p.s[None, :, b, 1]
        acc = acc + isum.astype(np.float32) * (p.d[None, :, b] * dx[:, b, None])
        if p.m is not None and p.kind == "qsm":
            acc = acc + p.m[None, :, b, 0] * (dx[:, b] * xh[:, b].astype(np.float32))[:, None]
            acc = acc + p.m[None, :, b, 1] * (dx[:, b] * (xs[:, b] - xh[:, b]).astype(np.float32))[:, None]
        elif p.m is not None:
            acc = acc + p.m[None, :, b] * sx[:, b, None]
    return acc


class Matmul:
    """The extension's Matmul: threads, isa, spin_us and pool are accepted and change no number (as in C)."""

    def __init__(self, threads: int = 1, isa: str = "auto", spin_us: float = 100.0, pool=None):
        if pool is not None:
            threads = pool.threads
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if isa not in ("auto", "scalar"):
            raise ValueError(f"this machine cannot run the {isa} kernel; it can: scalar")
        self.threads, self.isa, self.pool = threads, "scalar", pool

    def __call__(self, x, w: BlockMatrix, out):
        n = x.shape[0]
        if x.shape[1] != w.n_in or out.shape != (n, w.n_out):
            raise ValueError(f"Matmul: x {x.shape} . W^T {w.shape} does not fit out {out.shape}")
        x = np.ascontiguousarray(x, dtype=np.float32)
        xq, dx = _quantize(x)
        xs = xq.sum(axis=2, dtype=np.int32)
        xh = xq[:, :, :16].sum(axis=2, dtype=np.int32)
        sx = dx * xs.astype(np.float32)                                    # [n, nb]
        col = 0
        with np.errstate(invalid="ignore", over="ignore"):     # inf and NaN scales propagate, as in C
            for p, rows in zip(w.parts, w.part_rows):
                out[:, col:col + rows] = _part_product(x, xq, dx, xs, xh, sx, p)
                col += rows
        return out

    def groups(self, x, ws, start, out):
        """out rows [start[g], start[g + 1]) = x's same rows . ws[g]^T: the extension's run_groups (a mixture's
        experts over their gathered rows), group by group."""
        start = np.asarray(start, np.int64)
        if not ws or len(start) != len(ws) + 1 or start[0] != 0 or start[-1] != len(x) or len(out) != len(x) \
                or np.any(np.diff(start) < 0):
            raise ValueError(f"Matmul.groups: {len(ws)} matrices, start {start.tolist()}, x {x.shape}, out {out.shape}")
        for g, w in enumerate(ws):
            if w.n_in != x.shape[1] or w.n_out != out.shape[1] or w.types != ws[0].types:
                raise ValueError(f"Matmul.groups: matrix {g} {w.shape} {w.types} or its rows do not fit")
            if start[g + 1] > start[g]:
                self(x[start[g]:start[g + 1]], w, out[start[g]:start[g + 1]])
        return out
