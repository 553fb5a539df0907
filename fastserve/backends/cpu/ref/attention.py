"""NumPy twin of fastserve.backends.cpu._attention: the same cache formats and the same float32 operations in the
same order (see the contract at the top of backends/cpu/_attention_kernels.h), so its outputs and cache
bytes are bit-identical to the extension's (tests/parity/test_attention.py). ring: 0, or the cache holds
R positions per slot, position p at row p % R (K tile (p // KT) % (R // KT)), as in the extension."""
from __future__ import annotations

import numpy as np

KT = 64                 # keys per tile, at positions 0, 64, 128, ...
SEG = 512               # keys per segment, at positions 0, 512, ...: each its own online softmax, then merged
QB = 32                 # values per q8_0 block
KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 2}
MAX_HEAD_DIM = 1024
ISA_NAMES = {0: "scalar"}
F32 = np.float32
LOG2E = F32(float.fromhex("0x1.715476p+0"))
MAGIC = F32(12582912.0)           # 1.5 * 2^23: (v + MAGIC) - MAGIC is rint(v) for |v| < 2^22
E = [F32(float.fromhex(h)) for h in ("0x1.62e430p-1", "0x1.ebfbe0p-3", "0x1.c6b08ep-5", "0x1.3b2ab6p-7",
                                     "0x1.5d87fep-10", "0x1.430912p-13")]     # ln 2 ^ k / k!, k = 1..6


def isas():
    return ("scalar",)


def best_isa():
    return "scalar"


def kv_type_id(type_name: str, head_dim: int) -> int:
    if type_name not in KV_TYPES:
        raise ValueError(f"unknown KV cache type {type_name!r}; known: {', '.join(KV_TYPES)}")
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not in 1..{MAX_HEAD_DIM}")
    if type_name == "q8_0" and head_dim % QB:
        raise ValueError(f"a q8_0 KV cache needs head_dim a multiple of {QB}; this model's is {head_dim}")
    return KV_TYPES[type_name]


def row_bytes(type_name: str, head_dim: int) -> int:
    kv_type_id(type_name, head_dim)
    return {"f32": 4 * head_dim, "f16": 2 * head_dim, "q8_0": head_dim // QB * (2 + QB)}[type_name]


def k_tile_bytes(type_name: str, head_dim: int) -> int:
    return row_bytes(type_name, head_dim) * KT


def exp2(x):
    """2^x for x <= 0 (float32 in, float32 out), operation by operation as fs_exp2."""
    x = np.asarray(x, F32)
    xc = np.minimum(np.maximum(x, F32(-127.0)), F32(0.0))
    n = (xc + MAGIC) - MAGIC
    f = xc - n
    p = np.full_like(f, E[5])
    for c in (E[4], E[3], E[2], E[1], E[0], F32(1.0)):
        p = p * f + c
    scale = ((n.astype(np.int32) + 127).astype(np.uint32) << np.uint32(23)).view(F32)
    return np.where(x < F32(-126.0), F32(0.0), p * scale).astype(F32)


def encode_rows(type_name: str, x) -> np.ndarray:
    """Head rows float32 [n, D] -> uint8 [n, row_bytes] (f32 as is; f16 round-half-even; q8_0 blocks)."""
    x = np.ascontiguousarray(x, F32)
    n, D = x.shape
    kv_type_id(type_name, D)
    if type_name == "f32":
        return x.view(np.uint8).reshape(n, -1).copy()
    if type_name == "f16":
        with np.errstate(over="ignore"):              # past 65504: inf, as in C
            return x.astype(np.float16).view(np.uint8).reshape(n, -1).copy()
    xb = x.reshape(n, D // QB, QB)
    amax = np.abs(xb).max(axis=2)
    with np.errstate(over="ignore"):
        dh = (amax / F32(127.0)).astype(F32).astype(np.float16)
    dq = dh.astype(F32)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(dq != 0, ((xb / np.where(dq != 0, dq, F32(1.0))) + MAGIC) - MAGIC, F32(0.0))
    q = np.clip(v, -127, 127).astype(np.int8)
    out = np.zeros((n, D // QB, 2 + QB), np.uint8)
    out[:, :, :2] = dh[:, :, None].view(np.uint8)
    out[:, :, 2:] = q.view(np.uint8)
    return out.reshape(n, -1)


def decode_rows(type_name: str, rows, head_dim: int) -> np.ndarray:
    """uint8 [n, row_bytes] -> float32 [n, D]."""
    rows = np.ascontiguousarray(rows, np.uint8)
    if rows.shape[1] != row_bytes(type_name, head_dim):
        raise ValueError(f"{type_name} rows of head_dim {head_dim} have {row_bytes(type_name, head_dim)} bytes, "
                         f"got {rows.shape[1]}")
    n = len(rows)
    if type_name == "f32":
        return rows.view(F32).reshape(n, head_dim).copy()
    if type_name == "f16":
        return rows.view(np.float16).astype(F32).reshape(n, head_dim)
    b = rows.reshape(n, head_dim // QB, 2 + QB)
    d = b[:, :, :2].copy().view(np.float16).astype(F32)          # [n, nb, 1]
    return (b[:, :, 2:].view(np.int8).astype(F32) * d).reshape(n, head_dim)


def _k_tile_column(type_name: str, tile: np.ndarray, D: int, j: int, row=None):
    """Key j of a K tile (uint8 [k_tile_bytes]) as a row-format row; with row given, writes it there."""
    if type_name in ("f32", "f16"):
        dt = F32 if type_name == "f32" else np.float16
        cols = tile.view(dt).reshape(D, KT)
        if row is None:
            return cols[:, j].copy().view(np.uint8)
        cols[:, j] = row.view(dt)
        return None
    nb = D // QB
    scales = tile[:nb * KT * 2].view(np.uint16).reshape(nb, KT)
    qs = tile[nb * KT * 2:].reshape(D, KT)
    if row is None:
        out = np.zeros((nb, 2 + QB), np.uint8)
        out[:, :2] = scales[:, j].copy().view(np.uint8).reshape(nb, 2)
        out[:, 2:] = qs[:, j].reshape(nb, QB)
        return out.reshape(-1)
    blocks = row.reshape(nb, 2 + QB)
    scales[:, j] = blocks[:, :2].copy().view(np.uint16)[:, 0]
    qs[:, j] = blocks[:, 2:].reshape(-1)
    return None


def _check_ring(k_cache, v_cache, ring):
    if ring < 0 or ring % KT or (ring and (v_cache.shape[1] != ring or k_cache.shape[1] * KT != ring)):
        raise ValueError(f"a ring of {ring} positions needs a multiple of {KT} and a cache of that many "
                         f"(this one: {v_cache.shape[1]} positions, {k_cache.shape[1]} tiles)")


def store(type_k, type_v, k_cache, v_cache, k, v, slots, positions, ring=0):
    """k, v float32 [n, Hkv, D] into the caches at (slots[i], positions[i])."""
    n, Hkv, D = k.shape
    _check_ring(k_cache, v_cache, ring)
    for i in range(n):
        s, p = int(slots[i]), int(positions[i]) % (ring or 1 << 62)
        krows = encode_rows(type_k, k[i])
        v_cache[s, p] = encode_rows(type_v, v[i])
        for h in range(Hkv):
            _k_tile_column(type_k, k_cache[s, p // KT, h], D, p % KT, krows[h])


def move_rows(type_k, type_v, k_cache, v_cache, head_dim, slot, start, k_rows, v_rows, put, ring=0):
    """Positions start..start+n of slot <-> k_rows, v_rows uint8 [n, Hkv, row_bytes]."""
    n, Hkv = k_rows.shape[:2]
    _check_ring(k_cache, v_cache, ring)
    if not (0 <= slot < k_cache.shape[0] and 0 <= start and (ring or start + n <= v_cache.shape[1])):
        raise ValueError(f"slot {slot}, positions {start}..{start + n} outside the cache")
    for i in range(n):
        p = (start + i) % (ring or 1 << 62)
        for h in range(Hkv):
            tile = k_cache[slot, p // KT, h]
            if put:
                _k_tile_column(type_k, tile, head_dim, p % KT, k_rows[i, h])
            else:
                k_rows[i, h] = _k_tile_column(type_k, tile, head_dim, p % KT)
        if put:
            v_cache[slot, p] = v_rows[i]
        else:
            v_rows[i] = v_cache[slot, p]


def cache_values(type_k, type_v, k_cache, v_cache, head_dim):
    """The float32 values attention reads: K, V [n_slots, n_tiles * KT, Hkv, D] (V zero past n_ctx)."""
    D = head_dim
    n_slots, n_tiles, Hkv, _ = k_cache.shape
    if type_k in ("f32", "f16"):
        kv = k_cache.view(F32 if type_k == "f32" else np.float16).reshape(n_slots, n_tiles, Hkv, D, KT).astype(F32)
    else:
        nb = D // QB
        sc = k_cache[..., :nb * KT * 2].copy().view(np.float16).reshape(n_slots, n_tiles, Hkv, nb, KT).astype(F32)
        q = k_cache[..., nb * KT * 2:].view(np.int8).reshape(n_slots, n_tiles, Hkv, D, KT).astype(F32)
        kv = q * np.repeat(sc, QB, axis=3)
    K = kv.transpose(0, 1, 4, 2, 3).reshape(n_slots, n_tiles * KT, Hkv, D)
    n_ctx = v_cache.shape[1]
    V = np.zeros_like(K)
    V[:, :n_ctx] = decode_rows(type_v, v_cache.reshape(-1, v_cache.shape[3]), D).reshape(n_slots, n_ctx, Hkv, D)
    return K, V


def attend(q, k_cache, v_cache, type_k, type_v, slots, positions, out, scale, window=0, ring=0, sinks=None):
    """q float32 [n, H, D]; out [>= n, H * D]: rows < n written. The online softmax over each key
    segment's tiles, the segments' states merged in order, all rows at once, each row's operations
    those of the C kernel. window: 0 causal; w > 0 a query at q sees the keys at q - w < p <= q.
    ring: 0, or the caches are a ring of that many positions. sinks: None, or float32 [H] each head's
    sink logit, merged last as a segment of no value (in the denominator only)."""
    if window < 0:
        raise ValueError(f"window must be 0 (causal) or a count of keys > 0, got {window}")
    if ring and not 0 < window <= ring:
        raise ValueError(f"a ring of {ring} positions holds a window of at most {ring} keys, got {window}")
    _check_ring(k_cache, v_cache, ring)
    n, H, D = q.shape
    Hkv = k_cache.shape[2]
    G = H // Hkv
    if sinks is not None and len(sinks) != H:
        raise ValueError(f"sinks: {len(sinks)} values for {H} query heads")
    if n == 0:
        return out
    K, V = cache_values(type_k, type_v, k_cache, v_cache, D)
    qs = (np.ascontiguousarray(q, F32) * (F32(scale) * LOG2E)).reshape(n * H, D)
    slot_r = np.repeat(np.asarray(slots[:n], np.int64), H)
    pos_r = np.repeat(np.asarray(positions[:n], np.int64), H)
    kvh_r = np.tile(np.arange(H) // G, n)
    lo_r = np.maximum(pos_r - window + 1, 0) if window > 0 else np.zeros_like(pos_r)     # first visible key
    M = np.full(n * H, -np.inf, F32)          # the segments merged so far
    L = np.zeros(n * H, F32)
    ACC = np.zeros((n * H, D), F32)
    for z0 in range(int(lo_r.min()) // SEG * SEG, int(pos_r.max()) + 1, SEG):
        rows = np.flatnonzero((pos_r >= z0) & (lo_r < z0 + SEG))
        if len(rows) == 0:                      # between the windows of rows far apart
            continue
        m, l, acc = _segment(qs[rows], K, V, slot_r[rows], kvh_r[rows], pos_r[rows], lo_r[rows], z0, ring)
        first = lo_r[rows] >= z0                # the row's first segment: taken as it is
        mn = np.where(m > M[rows], m, M[rows])
        a = exp2(np.where(first, F32(0.0), M[rows] - mn))
        b = exp2(m - mn)
        M[rows] = np.where(first, m, mn)
        L[rows] = np.where(first, l, L[rows] * a + l * b)
        ACC[rows] = np.where(first[:, None], acc, ACC[rows] * a[:, None] + acc * b[:, None])
    if sinks is not None:
        sg = np.tile(np.asarray(sinks, F32), n) * LOG2E
        mn = np.where(sg > M, sg, M)
        a = exp2(M - mn)
        L = L * a + exp2(sg - mn)
        ACC = ACC * a[:, None]
    out[:n] = (ACC / L[:, None]).reshape(n, H * D)
    return out


def _segment(qs, K, V, slot_r, kvh_r, pos_r, lo_r, z0, ring):
    """The rows' (m, l, acc) over the keys of the segment at z0, tile by tile from a fresh state."""
    R, D = qs.shape
    m = np.full(R, -np.inf, F32)
    l = np.zeros(R, F32)
    acc = np.zeros((R, D), F32)
    for k0 in range(max(z0, int(lo_r.min()) // KT * KT), min(z0 + SEG, int(pos_r.max()) + 1), KT):
        a = np.flatnonzero((pos_r >= k0) & (lo_r < k0 + KT))
        col = np.arange(KT)[None, :]
        valid = (col < np.minimum(KT, pos_r[a] - k0 + 1)[:, None]) & (col >= (lo_r[a] - k0)[:, None])
        r0 = k0 % ring if ring else k0                              # the tile's first row
        kg = K[slot_r[a], r0:r0 + KT, kvh_r[a]]                      # [Ra, KT, D]
        vg = V[slot_r[a], r0:r0 + KT, kvh_r[a]]
        s = np.zeros((len(a), KT), F32)
        for d in range(D):
            s = s + qs[a, d, None] * kg[:, :, d]
        mnew = np.maximum(m[a], np.where(valid, s, F32(-np.inf)).max(axis=1))
        alpha = exp2(m[a] - mnew)
        p = exp2(np.where(valid, s + (-mnew)[:, None], F32(0.0)))
        la, aa = l[a] * alpha, acc[a] * alpha[:, None]
        for j in range(KT):
            vj = valid[:, j]
            if not vj.any():
                continue
            aa = np.where(vj[:, None], aa + p[:, j, None] * vg[:, j, :], aa)
            la = np.where(vj, la + p[:, j], la)
        m[a], l[a], acc[a] = mnew, la, aa
    return m, l, acc


class Attention:
    """The extension's Attention: pool and isa are accepted and change no number (as in C)."""

    def __init__(self, pool=None, isa: str = "auto"):
        if isa not in ("auto", "scalar"):
            raise ValueError(f"this machine cannot run the {isa} attention kernel; it can: scalar")
        self.pool, self.isa = pool, "scalar"

    def __call__(self, q, k_cache, v_cache, type_k, type_v, slots, positions, out, scale, window=0, ring=0, sinks=None):
        return attend(q, k_cache, v_cache, type_k, type_v, slots, positions, out, scale, window, ring, sinks)
