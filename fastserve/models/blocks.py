"""Pure-NumPy twin of fastserve/backends/cpu/_gguf_blocks.h: GGUF's weight blocks decoded into exact per-block
integers and scales, and (for tests and synthetic models) encoded from float32.

Per block of 32 inputs of a row, every kernel type is exactly  w_i = d * (s_i * q_i) + m_i  (the
table is in _gguf_blocks.h); decode() returns those numbers, nothing rounded:
    q int8 [rows, nb, 32], d float32 [rows, nb], s int32 [rows, nb, 2] or None (kinds "qs", "qsm":
    the scales of inputs 0..15 and 16..31), m float32 [rows, nb] (kind "qm": one offset per block)
    or [rows, nb, 2] (kind "qsm", Q2_K: the offsets of inputs 0..15 and 16..31) or None; IQ4_NL and
    IQ4_XS are kind "q" with q the 16 int8 values IQ4_VALUES indexed by nibbles (IQ4_XS: d = f16 d *
    (ls - 32) per sub-block, exact); MXFP4 is kind "q" with q = MXFP4_VALUES[nibble] and d = 2^(e - 128)
    for its E8M0 byte e (the values' doubling taken back: ggml's e8m0_to_fp32_half);
float types (F32, F16, BF16) decode to float32 [rows, n_in].
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# type name -> (inputs per block, bytes per block, kind): kinds "q" (d * q), "qm" (+ m), "qs" (sub-scales),
# "qsm" (sub-scales and an offset per half block), "f"
TYPES = {"F32": (1, 4, "f"), "F16": (1, 2, "f"), "BF16": (1, 2, "f"),
         "Q4_0": (32, 18, "q"), "Q4_1": (32, 20, "qm"), "Q5_0": (32, 22, "q"), "Q5_1": (32, 24, "qm"),
         "Q8_0": (32, 34, "q"), "Q2_K": (256, 84, "qsm"), "Q3_K": (256, 110, "qs"),
         "Q4_K": (256, 144, "qm"), "Q5_K": (256, 176, "qm"), "Q6_K": (256, 210, "qs"),
         "IQ4_NL": (32, 18, "q"), "IQ4_XS": (256, 136, "q"), "MXFP4": (32, 17, "q")}
# IQ4_NL / IQ4_XS: a nibble indexes these 16 int8 values (ggml's kvalues_iq4nl)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
# MXFP4: a nibble indexes the e2m1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6, then negated) doubled (kvalues_mxfp4)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


@dataclass
class Blocks:
    """One tensor decoded: kind "f" fills w; the others q, d (and m for "qm", s for "qs", both for "qsm")."""
    kind: str
    q: np.ndarray | None = None
    d: np.ndarray | None = None
    m: np.ndarray | None = None
    s: np.ndarray | None = None
    w: np.ndarray | None = None


def row_bytes(type_name: str, n_in: int) -> int:
    per, nbytes, _ = TYPES[type_name]
    return n_in // per * nbytes


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> float32 [...]"""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _u32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u4")[..., 0]


def _halves(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: low nibbles are inputs 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _scale_min_k4(sc12: np.ndarray):
    """[..., 12] -> sc, mn int [..., 8] (ggml's get_scale_min_k4 for j = 0..7)."""
    q = sc12.astype(np.int32)
    lo_sc, lo_mn = q[..., 0:4] & 63, q[..., 4:8] & 63
    hi_sc = (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)
    hi_mn = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return np.concatenate([lo_sc, hi_sc], -1), np.concatenate([lo_mn, hi_mn], -1)


def _iq4_xs_scales(h6: np.ndarray) -> np.ndarray:
    """[..., 6] (u16 scales_h, 4 bytes scales_l) -> the 6-bit scales ls int32 [..., 8] of sub-blocks 0..7."""
    hi = h6[..., 0].astype(np.int32) | (h6[..., 1].astype(np.int32) << 8)
    lo = h6[..., 2:6].astype(np.int32)
    j = np.arange(8)
    return (lo[..., j // 2] >> (4 * (j % 2)) & 15) | (((hi[..., None] >> (2 * j)) & 3) << 4)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> float32 2^(e - 128), exactly: the bits (e - 1) << 23, or the denormals 2^-128, 2^-127 for e < 2."""
    e = e.astype(np.uint32)
    return np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23).astype(np.uint32).view(np.float32)


def decode(type_name: str, data, rows: int, n_in: int) -> Blocks:
    """The tensor's bytes (any array whose bytes are rows x row_bytes) as exact blocks."""
    if type_name not in TYPES:
        raise ValueError(f"type {type_name} has no kernel; kernel types: {', '.join(TYPES)}")
    per, nbytes, kind = TYPES[type_name]
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if n_in % per or raw.nbytes != rows * row_bytes(type_name, n_in):
        raise ValueError(f"{raw.nbytes} bytes of {type_name} data for {rows} rows of {n_in} inputs, which take "
                         f"{rows * row_bytes(type_name, n_in)}: the tensor is truncated or its shape is wrong")
    if kind == "f":
        if type_name == "F32":
            w = raw.view("<f4")
        elif type_name == "F16":
            w = raw.view("<f2").astype(np.float32)
        else:
            w = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        return Blocks("f", w=np.array(w, np.float32).reshape(rows, n_in))
    nb = n_in // 32
    blk = raw.reshape(rows, n_in // per, nbytes)
    m = s = None
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        has_m = type_name.endswith("_1")
        d = _f16(blk[..., 0:2])
        at = 4 if has_m else 2
        if has_m:
            m = _f16(blk[..., 2:4])
        if type_name.startswith("Q5"):
            qh = _u32(blk[..., at:at + 4])
            high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16) << 4
            at += 4
        q = _halves(blk[..., at:at + 16]).astype(np.int16)
        if type_name.startswith("Q5"):
            q = q | high
        if not has_m:
            q = q - (8 if type_name == "Q4_0" else 16)
    elif type_name == "Q8_0":
        d = _f16(blk[..., 0:2])
        q = blk[..., 2:34].view(np.int8)
    elif type_name == "IQ4_NL":
        d = _f16(blk[..., 0:2])
        q = IQ4_VALUES[_halves(blk[..., 2:18])]
    elif type_name == "MXFP4":
        d = e8m0_half(blk[..., 0])
        q = MXFP4_VALUES[_halves(blk[..., 1:17])]
    elif type_name == "IQ4_XS":
        dd, ls = _f16(blk[..., 0:2]), _iq4_xs_scales(blk[..., 2:8])               # [rows, nsb], [rows, nsb, 8]
        with np.errstate(invalid="ignore"):                                  # inf * 0 is NaN, as in C
            d = (dd[..., None] * (ls - 32).astype(np.float32)).astype(np.float32)    # exact: 11 bits x 6 bits
        q = IQ4_VALUES[_halves(blk[..., 8:136].reshape(rows, -1, 8, 16))]
    elif type_name in ("Q4_K", "Q5_K"):
        five = type_name == "Q5_K"
        dd, dmin = _f16(blk[..., 0:2]), _f16(blk[..., 2:4])
        sc, mn = _scale_min_k4(blk[..., 4:16])                                   # [rows, nsb, 8]
        qs = blk[..., 48:176] if five else blk[..., 16:144]
        qs = qs.reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
        q = (qs & 15).reshape(rows, -1, 8, 32).astype(np.int16)                   # sub-block j = 2c + h
        if five:
            qh = blk[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            q = q | ((qh & 1).astype(np.int16) << 4)
        d = (dd[..., None] * sc.astype(np.float32)).astype(np.float32)
        m = -(dmin[..., None] * mn.astype(np.float32)).astype(np.float32)
    elif type_name in ("Q3_K", "Q2_K"):
        q, d, s, m = _decode_k23(type_name, blk, rows)
    else:                                                                         # Q6_K
        ql, qh = blk[..., 0:128], blk[..., 128:192]
        lo = ql.reshape(rows, -1, 2, 1, 2, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1, 1)
        lo = (lo & 15).reshape(rows, -1, 8, 32)                                   # j = 4c + 2(shift) + half
        hi = qh.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
        hi = (hi & 3).reshape(rows, -1, 8, 32)                                    # j = 4c + t
        q = (lo | (hi << 4)).astype(np.int16) - 32
        d = np.repeat(_f16(blk[..., 208:210])[..., None], 8, axis=-1)
        s = blk[..., 192:208].view(np.int8).astype(np.int32).reshape(rows, -1, 8, 2)
    q = np.asarray(q).reshape(rows, nb, 32).astype(np.int8)
    d = np.asarray(d, np.float32).reshape(rows, nb)
    m = None if m is None else np.asarray(m, np.float32).reshape((rows, nb, 2) if kind == "qsm" else (rows, nb))
    s = None if s is None else s.reshape(rows, nb, 2)
    return Blocks(kind, q=q, d=d, m=m, s=s)


def _two_bits(qs: np.ndarray, rows: int) -> np.ndarray:
    """[rows, nsb, 64] -> [rows, nsb, 8, 32] uint8: input l of block j = 4c + t is bits 2t of byte 32c + l
    (Q2_K's and Q3_K's low bits)."""
    v = qs.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    return (v & 3).reshape(rows, -1, 8, 32)


def _decode_k23(type_name: str, blk: np.ndarray, rows: int):
    """Q3_K, Q2_K 256-blocks [rows, nsb, bytes] -> q [rows, nsb, 8, 32], d [rows, nsb, 8], s int32
    [rows, nsb, 8, 2], m (Q2_K) float32 [rows, nsb, 8, 2] or None: per block j of 32 its two
    sub-blocks of 16."""
    if type_name == "Q3_K":                 # hmask[32], qs[64], scales[12], f16 d
        lo = _two_bits(blk[..., 32:96], rows).astype(np.int16)
        hb = (blk[..., 0:32].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
        q = lo - 4 * (1 - hb.astype(np.int16))                                  # the bit clear: minus 4
        sc = blk[..., 96:108]
        low = np.concatenate([sc[..., 0:8] & 15, sc[..., 0:8] >> 4], -1)        # sub-block i: 4 low bits
        high = (sc[..., 8:12].reshape(rows, -1, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        s = (low | (high.reshape(rows, -1, 16) << 4)).astype(np.int32) - 32
        d = np.repeat(_f16(blk[..., 108:110])[..., None], 8, axis=-1)
        return q, d, s.reshape(rows, -1, 8, 2), None
    sc = blk[..., 0:16]                    # Q2_K: scales[16] (low nibble scale, high min), qs[64], f16 d, dmin
    q = _two_bits(blk[..., 16:80], rows)
    d = np.repeat(_f16(blk[..., 80:82])[..., None], 8, axis=-1)
    mn = (sc >> 4).astype(np.float32).reshape(rows, -1, 8, 2)
    m = -(_f16(blk[..., 82:84])[..., None, None] * mn).astype(np.float32)
    return q, d, (sc & 15).astype(np.int32).reshape(rows, -1, 8, 2), m


def dequantize(b: Blocks) -> np.ndarray:
    """float32 [rows, n_in]: d * (s * q) (+ m), each product and sum rounded to float32 (as C's rows)."""
    if b.kind == "f":
        return b.w.copy()
    sq = b.q.astype(np.int32)
    if b.s is not None:
        sq = sq * np.repeat(b.s, 16, axis=-1)
    with np.errstate(invalid="ignore", over="ignore"):     # inf and NaN scales propagate, as in C
        v = sq.astype(np.float32) * b.d[..., None]
        if b.m is not None:
            v = v + (np.repeat(b.m, 16, axis=-1) if b.m.ndim == 3 else b.m[..., None])
    return v.reshape(len(b.q), -1).astype(np.float32)


# -- encoders (tests and synthetic models): valid blocks of each type, not tuned quantizers ----------

def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, np.float16).reshape(*np.shape(v), 1).view(np.uint8)


def encode(type_name: str, w: np.ndarray) -> np.ndarray:
    """float32 [rows, n_in] -> uint8 [rows, row_bytes] in type_name's layout."""
    w = np.ascontiguousarray(w, np.float32)
    rows, n_in = w.shape
    if type_name in ("Q4_K", "Q5_K"):
        return _encode_k(w, five=type_name == "Q5_K").reshape(rows, -1)
    if type_name == "Q6_K":
        return _encode_q6_k(w).reshape(rows, -1)
    if type_name in ("IQ4_NL", "IQ4_XS"):
        return _encode_iq4(w, xs=type_name == "IQ4_XS").reshape(rows, -1)
    if type_name == "Q3_K":
        return _encode_q3_k(w).reshape(rows, -1)
    if type_name == "Q2_K":
        return _encode_q2_k(w).reshape(rows, -1)
    import gguf
    from gguf.quants import quantize
    if type_name == "F32":
        return w.view(np.uint8).reshape(rows, -1)
    if type_name == "F16":
        return w.astype(np.float16).view(np.uint8).reshape(rows, -1)
    return np.asarray(quantize(w, gguf.GGMLQuantizationType[type_name])).view(np.uint8).reshape(rows, -1)


def _pack_scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """sc, mn int [..., 8] in 0..63 -> [..., 12] (the inverse of _scale_min_k4)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    return out


def _encode_k(w: np.ndarray, five: bool) -> np.ndarray:
    top = 31 if five else 15
    v = w.reshape(-1, 8, 32)                                   # [superblocks, sub-blocks, 32]
    lo = np.minimum(v.min(-1), 0.0)
    span = v.max(-1) - lo
    d = np.maximum(span.max(-1) / top / 63, 1e-30)             # superblock scales, f16-rounded below
    dmin = np.maximum((-lo).max(-1) / 63, 1e-30)
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    d32, dmin32 = np.maximum(d16.astype(np.float32), 1e-7), np.maximum(dmin16.astype(np.float32), 1e-7)
    sc = np.clip(np.rint(span / top / d32[:, None]), 1, 63)
    mn = np.clip(np.rint(-lo / dmin32[:, None]), 0, 63)
    step = (d16.astype(np.float32)[:, None] * sc)[..., None]
    off = (dmin16.astype(np.float32)[:, None] * mn)[..., None]
    q = np.clip(np.rint((v + off) / np.where(step > 0, step, 1)), 0, top).astype(np.uint8)   # [sb, 8, 32]
    pairs = q.reshape(-1, 4, 2, 32)
    qs = ((pairs[:, :, 0] & 15) | ((pairs[:, :, 1] & 15) << 4)).reshape(-1, 128)
    parts = [_f16_bytes(d16).reshape(-1, 2), _f16_bytes(dmin16).reshape(-1, 2), _pack_scales_k4(sc, mn)]
    if five:
        qh = ((q >> 4) & 1).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]
        parts.append(qh.sum(axis=1, dtype=np.uint8).reshape(-1, 32))
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _encode_q6_k(w: np.ndarray) -> np.ndarray:
    v = w.reshape(-1, 16, 16)                                  # [superblocks, groups of 16, 16]
    a = np.abs(v).max(-1) / 32                                 # per-group step
    d = np.maximum(a.max(-1) / 127, 1e-30).astype(np.float16)
    d32 = np.maximum(d.astype(np.float32), 1e-7)
    sc = np.clip(np.rint(a / d32[:, None]), 1, 127).astype(np.int8)
    step = (d.astype(np.float32)[:, None] * sc.astype(np.float32))[..., None]
    q = (np.clip(np.rint(v / np.where(step > 0, step, 1)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)                                # [sb, chunk c, t, l]: sub-block j = 4c + t
    ql = np.zeros((len(q), 2, 64), np.uint8)
    ql[:, :, 0:32] = (q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4)
    ql[:, :, 32:64] = (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64).astype(np.uint8),
                           sc.view(np.uint8).reshape(-1, 16), _f16_bytes(d).reshape(-1, 2)], axis=1)


def _iq4_nibbles(v: np.ndarray, step: np.ndarray) -> np.ndarray:
    """v [..., 32], step [...] -> the nibbles [..., 16] (low: inputs 0..15) of the nearest d * IQ4_VALUES."""
    t = v / np.where(step != 0, step, 1)[..., None]
    idx = np.abs(t[..., None] - IQ4_VALUES.astype(np.float32)).argmin(-1).astype(np.uint8)
    return idx[..., :16] | (idx[..., 16:] << 4)


def _encode_iq4(w: np.ndarray, xs: bool) -> np.ndarray:
    v = w.reshape(-1, 32)
    step = v[np.arange(len(v)), np.abs(v).argmax(-1)] / -127          # the largest |w| on the -127 end
    if not xs:
        d = step.astype(np.float16)
        return np.concatenate([_f16_bytes(d).reshape(-1, 2), _iq4_nibbles(v, d.astype(np.float32))], axis=1)
    step = step.reshape(-1, 8)                                         # [superblocks, sub-blocks]
    d = (np.abs(step).max(-1) / 32).astype(np.float16)
    d32 = d.astype(np.float32)
    ls = (np.clip(np.rint(step / np.where(d32 > 0, d32, 1)[:, None]), -32, 31) + 32).astype(np.uint16)
    qs = _iq4_nibbles(v.reshape(-1, 8, 32), d32[:, None] * (ls.astype(np.float32) - 32))
    lo = (ls & 15).astype(np.uint8)
    scales_h = ((ls >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(-1, dtype=np.uint16)
    return np.concatenate([_f16_bytes(d).reshape(-1, 2), scales_h.astype("<u2").view(np.uint8).reshape(-1, 2),
                           lo[:, 0::2] | (lo[:, 1::2] << 4), qs.reshape(-1, 128)], axis=1)


def _pack_two_bits(q: np.ndarray) -> np.ndarray:
    """q uint8 [sb, 8, 32] in 0..3 -> [sb, 64] (the inverse of _two_bits)."""
    q = q.reshape(-1, 2, 4, 32)                                # [sb, chunk c, t, l]: block j = 4c + t
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64).astype(np.uint8)


def _encode_q3_k(w: np.ndarray) -> np.ndarray:
    v = w.reshape(-1, 16, 16)                                  # [superblocks, groups of 16, 16]
    a = np.abs(v).max(-1) / 4                                  # per-group step (q in -4..3)
    d = np.maximum(a.max(-1) / 31, 1e-30).astype(np.float16)
    d32 = np.maximum(d.astype(np.float32), 1e-7)
    sc = np.clip(np.rint(a / d32[:, None]), 1, 31).astype(np.int32)
    step = (d.astype(np.float32)[:, None] * sc.astype(np.float32))[..., None]
    q = (np.clip(np.rint(v / np.where(step > 0, step, 1)), -4, 3) + 4).astype(np.uint8).reshape(-1, 8, 32)
    hmask = ((q >> 2) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)   # [sb, 32]
    u = (sc + 32).astype(np.uint8)                             # 6-bit stored scales
    scales = np.zeros((len(u), 12), np.uint8)
    scales[:, 0:8] = (u[:, 0:8] & 15) | ((u[:, 8:16] & 15) << 4)
    hi = (u >> 4).reshape(-1, 4, 4)                            # [sb, shift, byte]
    scales[:, 8:12] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    return np.concatenate([hmask, _pack_two_bits(q & 3), scales, _f16_bytes(d).reshape(-1, 2)], axis=1)


def _encode_q2_k(w: np.ndarray) -> np.ndarray:
    v = w.reshape(-1, 16, 16)
    lo = np.minimum(v.min(-1), 0.0)
    span = v.max(-1) - lo
    d = np.maximum(span.max(-1) / 3 / 15, 1e-30).astype(np.float16)
    dmin = np.maximum((-lo).max(-1) / 15, 1e-30).astype(np.float16)
    d32, dmin32 = np.maximum(d.astype(np.float32), 1e-7), np.maximum(dmin.astype(np.float32), 1e-7)
    sc = np.clip(np.rint(span / 3 / d32[:, None]), 1, 15).astype(np.uint8)
    mn = np.clip(np.rint(-lo / dmin32[:, None]), 0, 15).astype(np.uint8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    off = (dmin.astype(np.float32)[:, None] * mn)[..., None]
    q = np.clip(np.rint((v + off) / np.where(step > 0, step, 1)), 0, 3).astype(np.uint8).reshape(-1, 8, 32)
    return np.concatenate([sc | (mn << 4), _pack_two_bits(q), _f16_bytes(d).reshape(-1, 2),
                           _f16_bytes(dmin).reshape(-1, 2)], axis=1)
