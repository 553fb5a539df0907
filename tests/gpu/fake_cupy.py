"""A stand-in for CuPy on machines without a GPU: runs CupyBackend's orchestration on the CPU.

What it checks for real: every launch's arguments against the kernel's parameter list as nvcc
compiles it (count, and pointer / 32-bit int / float / 64-bit int for each, read from the PTX; a
Python int or float, which CuPy would pass as a 64-bit integer or a double, is refused), launch
shapes (block <= 1024 threads, grid y/z <= 65535), cuBLAS gemmEx's column-major arguments (the
product is computed from the raw pointers and leading dimensions, as cuBLAS would read them),
host<->device copies by pointer, and graph capture (launches recorded, replayed by Graph.launch).

What it does NOT check: the CUDA C kernels themselves. Each kernel is emulated in NumPy from its
header comment's contract, so the emulation says what the launcher and the backend expect of the
kernel; tests/gpu/ checks the kernels on a GPU.
"""
from __future__ import annotations

import ctypes
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

from .cuda_emu import c_param_kinds

# -- arrays: device memory is host memory here --------------------------------------------------


class _Ptr:
    def __init__(self, ptr: int):
        self.ptr = ptr


class ndarray(np.ndarray):
    """A host array posing as a device array: .data.ptr is its address."""

    @property
    def data(self):     # noqa: D401 - CuPy's MemoryPointer has .ptr
        return _Ptr(self.__array_interface__["data"][0])

    def get(self):
        return np.asarray(self).copy()

    def set(self, arr, stream=None):
        np.copyto(np.asarray(self), arr)


def _dev(a: np.ndarray) -> ndarray:
    return np.ascontiguousarray(a).view(ndarray)


def zeros(shape, dtype=np.float32):
    return _dev(np.zeros(shape, dtype))


def empty(shape, dtype=np.float32):
    # Poisoned, so that a kernel emulation reading unwritten memory shows up.
    a = np.empty(shape, dtype)
    if a.dtype.kind == "f":
        a.fill(np.nan)
    else:
        a.fill(np.iinfo(a.dtype).max if a.dtype.kind in "iu" else 0)
    return _dev(a)


def asarray(a, dtype=None):
    return _dev(np.array(a, dtype=dtype, copy=True))


class _Pool:
    def free_all_blocks(self):
        pass

    def used_bytes(self):
        return 0

    def total_bytes(self):
        return 0


def get_default_memory_pool():
    return _Pool()


def empty_pinned(shape, dtype=np.float32):
    return np.zeros(shape, dtype)


# -- kernels: PTX signatures and NumPy emulations -----------------------------------------------

_PTX_CACHE: dict[str, dict[str, list[str]]] = {}


def ptx_signatures(source: str) -> dict[str, list[str]] | None:
    """{kernel: [param types]} from nvcc's PTX of `source` (None without nvcc)."""
    if source in _PTX_CACHE:
        return _PTX_CACHE[source]
    from fastserve.backends.cuda.kernels import nvcc_available
    nvcc = nvcc_available()
    if nvcc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "k.cu", Path(tmp) / "k.ptx"
        src.write_text(source)
        subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "--ptx", "-o", str(out), str(src)], check=True,
                       capture_output=True)
        ptx = out.read_text()
    sigs = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx, re.S):
        sigs[m.group(1)] = re.findall(r"\.param\s+\.(\w+)", m.group(2))
    _PTX_CACHE[source] = sigs
    return sigs


def _arg_kind(a) -> str:
    if isinstance(a, ndarray):
        return "ptr"
    if isinstance(a, np.uint64) and int(a) == 0:
        return "null"
    if isinstance(a, (np.uint64, np.int64)):
        return "b64"
    if isinstance(a, (np.int32, np.uint32)):
        return "b32"
    if isinstance(a, np.float32):
        return "f32"
    raise TypeError(f"kernel argument of type {type(a).__name__}: CuPy would pass a Python int as a 64-bit "
                    "integer and a float as a double; pass numpy.int32 / numpy.float32 / a cupy array")


_PTX_KIND = {"u64": ("ptr", "b64"), "s64": ("b64",), "b64": ("ptr", "b64"), "u32": ("b32",), "s32": ("b32",),
             "b32": ("b32",), "f32": ("f32",)}
_ACCEPTS = {"ptr": ("ptr", "null"), "b64": ("b64",), "b32": ("b32",), "f32": ("f32",)}


def to_f32(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype == np.uint16:            # bf16 words
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def from_f32(v: np.ndarray, like: np.ndarray) -> np.ndarray:
    v = np.asarray(v, dtype=np.float32)
    if like.dtype == np.uint16:         # round to nearest even, as cuda/common.cuh
        u = v.view(np.uint32).astype(np.uint64)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(v)
        r[nan] = ((v.view(np.uint32)[nan] >> 16) | 0x40).astype(np.uint16)
        return r
    return v.astype(like.dtype)


def _rows_of(grid) -> int:
    return int(grid[0])


def _k_embed_rows(grid, args):
    table, tokens, x, d, scale = args
    n = _rows_of(grid)
    x[:n] = to_f32(table[tokens[:n]]) * scale


def _k_rms_norm(grid, args):
    x, rows, w, out, d, eps = args
    n = _rows_of(grid)
    src = np.asarray(rows[:n]) if isinstance(rows, ndarray) else np.arange(n)
    v = np.asarray(x[src], dtype=np.float32)
    ms = np.einsum("ij,ij->i", v, v) / np.float32(d)
    out[:n] = from_f32(v * (np.float32(1.0) / np.sqrt(ms + np.float32(eps)))[:, None] * w, out)


def _k_rms_norm_add(grid, args):
    y, w, x, d, eps, scale = args
    n = _rows_of(grid)
    h = np.empty((n, int(d)), np.float32)
    _k_rms_norm(grid, (y, None, w, h, d, eps))
    x[:n] += h * scale


def _k_logit_out(grid, args):
    logits, size, scale, cap = args
    flat = np.asarray(logits).reshape(-1)[:int(size)]
    flat *= scale
    if cap > 0:
        flat[...] = np.tanh(flat / cap) * cap


def _k_rope_qk(grid, args):
    qkv, cos, sin, positions, stride, n_rot, head_dim, rope_dim = args
    n = _rows_of(grid)
    x = np.asarray(qkv)[:n, :n_rot * head_dim].reshape(n, int(n_rot), int(head_dim))
    c, s = cos[positions[:n]][:, None, :], sin[positions[:n]][:, None, :]
    x0 = x[:, :, 0:rope_dim:2].copy()
    x1 = x[:, :, 1:rope_dim:2].copy()
    x[:, :, 0:rope_dim:2] = x0 * c - x1 * s
    x[:, :, 1:rope_dim:2] = x0 * s + x1 * c


def _k_qk_prep(grid, args):
    qkv, bias, q_norm, k_norm, stride, n_head, n_head_kv, head_dim, eps = args
    n, H, Hkv, D = _rows_of(grid), int(n_head), int(n_head_kv), int(head_dim)
    x = np.asarray(qkv)[:n]
    if isinstance(bias, ndarray):
        x += bias
    if isinstance(q_norm, ndarray):
        for lo, hi, w in ((0, H, q_norm), (H, H + Hkv, k_norm)):
            heads = x[:, lo * D:hi * D].reshape(n, hi - lo, D)
            ms = np.einsum("thd,thd->th", heads, heads) / np.float32(D)
            x[:, lo * D:hi * D] = (heads * (np.float32(1.0) / np.sqrt(ms + np.float32(eps)))[..., None]
                                   * np.asarray(w)).reshape(n, -1)


def _k_kv_store(grid, args):
    qkv, kc, vc, slots, positions, stride, n_head, n_head_kv, head_dim, n_ctx = args
    n = _rows_of(grid)
    hd, kvd = int(n_head) * int(head_dim), int(n_head_kv) * int(head_dim)
    sl, pos = np.asarray(slots[:n]), np.asarray(positions[:n])
    k = qkv[:n, hd:hd + kvd].reshape(n, int(n_head_kv), int(head_dim))
    v = qkv[:n, hd + kvd:hd + 2 * kvd].reshape(n, int(n_head_kv), int(head_dim))
    kc[sl, pos] = from_f32(k, kc)
    vc[sl, pos] = from_f32(v, vc)


def _k_rope_store(grid, args):
    qkv, cos, sin, kc, vc, slots, positions, stride, n_head, n_head_kv, head_dim, rope_dim, n_ctx = args
    _k_rope_qk(grid, (qkv, cos, sin, positions, stride, np.int32(n_head + n_head_kv), head_dim, rope_dim))
    _k_kv_store(grid, (qkv, kc, vc, slots, positions, stride, n_head, n_head_kv, head_dim, n_ctx))


def _rows_dot(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [n, k] @ w [m, k].T in float32, each element summed in one order that k alone fixes (NumPy's
    pairwise sum along a row), as cuda/matvec.cu sums it: a row's result depends neither on n nor on
    the other rows. `@` would not do: BLAS blocks a product by its shape (n = 3 and n = 4, eager and
    a graph's padded bucket, sum differently on an AVX2 OpenBLAS) and by the machine."""
    x, w = to_f32(x), to_f32(w)
    out = np.empty((len(x), len(w)), np.float32)
    step = max(1, (1 << 22) // max(1, w.shape[1]))     # w rows per product: a 16 MiB temporary at most
    for j, row in enumerate(x):
        for lo in range(0, len(w), step):
            out[j, lo:lo + step] = (w[lo:lo + step] * row).sum(axis=1)
    return out


def _k_matvec(grid, args):
    w, x, out, n, m, k, accumulate, scale = args
    n, m, k = int(n), int(m), int(k)
    if k % 8 or int(grid[0]) * 4 < m:
        raise ValueError("matvec: k must be a multiple of 8 and the grid must cover the rows")
    res = _rows_dot(x[:n], w) * scale
    out[:n] = (out[:n] + res) if int(accumulate) else res


def _normed(x, rows, nw, n, eps, like):
    """rms_norm's emulation into a fresh array of like's type (h, which the fused products never store)."""
    h = np.empty((n, nw.shape[0]), like.dtype)
    _k_rms_norm((n,), (x, rows, nw, h, np.int32(nw.shape[0]), eps))
    return to_f32(h)


def _k_norm_matvec(grid, args):
    w, x, rows, nw, out, n, m, k, eps = args
    n = int(n)
    out[:n] = _rows_dot(_normed(x, rows, nw, n, eps, w), w)


def _k_norm_matvec_swiglu(grid, args):
    w, x, nw, act, n, n_ff, k, eps, gelu = args
    n = int(n)
    gu = _rows_dot(_normed(x, None, nw, n, eps, w), w)
    _k_swiglu(grid, (gu, act, n, n_ff, gelu))


def _k_moe_router(grid, args):
    x, nw, router, route, d, E, eps = args
    n = _rows_of(grid)
    if int(grid[1]) * 8 < int(E):
        raise ValueError("moe_router: the grid must cover the experts")
    route[:n] = _rows_dot(_normed(x, None, nw, n, eps, router), router)


def _k_moe_route(grid, args):
    """fastserve/backends/cpu/_forward.pyx's _route, row by row."""
    route, bias, sel, wts, E, k, scale, topk_softmax = args
    for i in range(_rows_of(grid)):
        logits = np.asarray(route[i], np.float32)
        if isinstance(bias, ndarray):
            logits = logits + np.asarray(bias)
        if int(topk_softmax):                                   # _route_topk: top k logits, softmax over them
            top = np.argsort(-logits, kind="stable")[:int(k)]   # ties to the lower id
            w = np.exp(logits[top] - logits[top[0]])
            total = np.float32(0)
            for v in w:                                         # in rank order
                total = np.float32(total + v)
            sel[i], wts[i] = top, w / total * scale
            continue
        p = np.exp(logits - logits.max())
        p = p / np.float32(p.sum(dtype=np.float32))
        top = np.argsort(-p, kind="stable")[:int(k)]            # ties to the lower id
        w = p[top]
        total = np.float32(0)
        for v in w:                                             # in rank order
            total = np.float32(total + v)
        sel[i], wts[i] = top, w / max(total, np.float32(6.103515625e-5)) * scale


def _k_moe_group(grid, args):
    sel, n_pairs, E, tile_rows, n_tiles, start, order, pos, tiles = args
    pairs = np.asarray(sel).reshape(-1)[:int(n_pairs)]
    grouped = np.argsort(pairs, kind="stable")                  # by expert, pairs in batch order within one
    order[:len(grouped)] = grouped
    pos[grouped] = np.arange(len(grouped))
    start[:] = np.searchsorted(pairs[grouped], np.arange(int(E) + 1))
    t = [(e, t0) for e in range(int(E)) for t0 in range(int(start[e]), int(start[e + 1]), int(tile_rows))]
    tiles[:int(n_tiles)] = [-1, 0]
    tiles[:len(t)] = np.array(t, np.int32).reshape(-1, 2)


def _moe_tiles(start, tiles, m, grid):
    """(expert, grouped positions) of each used tile, checking that the grid covers them."""
    if int(grid[0]) * 4 < m or int(grid[1]) > len(tiles):
        raise ValueError("moe_matvec: the grid must cover the output rows and no more than the tiles")
    used = [(int(e), int(t0)) for e, t0 in np.asarray(tiles[:int(grid[1])]) if e >= 0]
    for (e, t0), after in zip(used, used[1:] + [(-1, 0)]):       # a tile ends where its expert's next begins
        yield e, slice(t0, after[1] if after[0] == e else int(start[e + 1]))


def _k_moe_matvec_swiglu(grid, args):
    w, h, start, order, tiles, bias, act, n_ff, k, k_used, glu = args
    for e, ts in _moe_tiles(start, tiles, int(n_ff), grid):
        gu = _rows_dot(h[np.asarray(order[ts]) // int(k_used)], w[e])
        if isinstance(bias, ndarray):
            gu = gu + np.asarray(bias[e])
        act[ts] = from_f32(_glu(gu, int(n_ff), glu), act)


def _k_moe_matvec(grid, args):
    w, x, start, tiles, bias, out, m, k = args
    for e, ts in _moe_tiles(start, tiles, int(m), grid):
        out[ts] = _rows_dot(x[ts], w[e])
        if isinstance(bias, ndarray):
            out[ts] = out[ts] + np.asarray(bias[e])


def _k_moe_sum(grid, args):
    ye, pos, wts, out, d, k, accumulate, scale = args
    for i in range(_rows_of(grid)):
        p, w = pos[i * int(k):(i + 1) * int(k)], np.asarray(wts).reshape(-1)[i * int(k):(i + 1) * int(k)]
        s = ye[p[0]] * w[0]
        for r in range(1, int(k)):
            s = s + ye[p[r]] * w[r]
        s = s * scale
        out[i] = out[i] + s if int(accumulate) else s


def _k_attention_split(grid, args):
    qkv, kc, vc, slots, positions, part_o, part_ml, stride, H, Hkv, D, n_ctx, chunk, scale, window = args
    S, n = int(grid[0]), int(grid[2])
    H, Hkv, D, chunk = int(H), int(Hkv), int(D), int(chunk)
    head_kv = np.arange(H) // (H // Hkv)
    for t in range(n):
        slot, end = int(slots[t]), int(positions[t]) + 1
        first = max(0, end - int(window)) if int(window) > 0 else 0     # a local layer's keys
        q = np.asarray(qkv[t, :H * D]).reshape(H, D) * np.float32(scale)
        for s in range(S):
            k0 = first + s * chunk
            k1 = min(k0 + chunk, end)
            if k0 >= k1:
                part_o[t, :, s] = 0.0
                part_ml[t, :, s, 0], part_ml[t, :, s, 1] = -np.inf, 0.0
                continue
            keys = to_f32(kc[slot, k0:k1])[:, head_kv]          # [L, H, D]
            vals = to_f32(vc[slot, k0:k1])[:, head_kv]
            sc = np.einsum("lhd,hd->hl", keys, q)
            mx = sc.max(axis=1, keepdims=True)
            p = np.exp(sc - mx)
            part_o[t, :, s] = np.einsum("hl,lhd->hd", p, vals)
            part_ml[t, :, s, 0], part_ml[t, :, s, 1] = mx[:, 0], p.sum(axis=1)


def _k_attention_combine(grid, args):
    part_o, part_ml, sinks, out, H, D, S = args
    n = int(grid[1])
    H, D = int(H), int(D)
    sg = np.asarray(sinks, np.float32) if isinstance(sinks, ndarray) else None   # natural-log units, like m here
    for t in range(n):
        m = part_ml[t, :, :, 0]                     # [H, S]
        mx = m.max(axis=1, keepdims=True)
        if sg is not None:                          # the sink: one more score, of no value
            mx = np.maximum(mx, sg[:, None])
        f = np.where(np.isneginf(m), 0.0, np.exp(m - mx)).astype(np.float32)
        lsum = (part_ml[t, :, :, 1] * f).sum(axis=1)
        if sg is not None:                          # in the denominator only
            lsum = lsum + np.exp(sg - mx[:, 0])
        o = (part_o[t] * f[:, :, None]).sum(axis=1) / lsum[:, None]
        out[t] = from_f32(o.reshape(H * D), out)


def _glu(gu, n_ff: int, gelu) -> np.ndarray:
    """gate_mul over rows of gate | up sums [n, 2 n_ff]: SwiGLU, GeGLU (gelu 1) or swiglu_oai (2)."""
    g, u = gu[:, :n_ff], gu[:, n_ff:2 * n_ff]
    if int(gelu) == 2:  # gpt-oss: x sigmoid(1.702 x) (y + 1), x = min(g, 7), y = clamp(u, -7, 7); NaN kept
        x = np.where(g > np.float32(7.0), np.float32(7.0), g)
        y = np.where(u > np.float32(7.0), np.float32(7.0), np.where(u < np.float32(-7.0), np.float32(-7.0), u))
        with np.errstate(over="ignore"):
            return x / (np.float32(1.0) + np.exp(-(np.float32(1.702) * x))) * (y + np.float32(1.0))
    if int(gelu):       # GeGLU: g sigmoid(2 sqrt(2/pi) g (1 + 0.044715 g^2))
        z = ((g * g) * np.float32(0.044715) + np.float32(1.0)) * g * np.float32(2 * np.sqrt(2 / np.pi))
    else:
        z = g
    with np.errstate(over="ignore"):
        return g / (np.float32(1.0) + np.exp(-z)) * u


def _k_swiglu(grid, args):
    gu, out, n, n_ff, gelu = args
    n = int(n)
    out[:n] = from_f32(_glu(np.asarray(gu[:n]), int(n_ff), gelu), out)


def _k_add_bias(grid, args):
    x, bias, n, d = args
    x[:int(n)] += np.asarray(bias)


def _k_cast(grid, args):
    src, dst, size = args
    dst.reshape(-1)[:] = from_f32(np.asarray(src).reshape(-1), dst)


def _k_argmax_rows(grid, args):
    logits, out, V = args
    m = _rows_of(grid)
    out[:m] = np.argmax(np.nan_to_num(np.asarray(logits[:m]), nan=-np.inf, posinf=np.inf), axis=1)


def _k_sample_chain(grid, args):
    """The host sampler's twin (fastserve/ref/sampling.py) on each row, from its SampleRow record: the
    kernel's contract is that twin's token ids and probabilities."""
    from fastserve.backends.cuda.kernels import SAMPLE_GREEDY, SAMPLE_PENALIZE, SAMPLE_POST_PROBS, SAMPLE_ROW
    from fastserve.ref.sampling import Sampler, _Slot
    logits, rows, tab, out_ids, out_probs, masks, V, W, B, P, _ = args
    m, V, W, B = _rows_of(grid), int(V), int(W), int(B)
    ref = Sampler(1, V)
    for r, rec in enumerate(np.asarray(rows[:m]).view(SAMPLE_ROW).reshape(-1)):
        t = np.asarray(tab[int(rec["slot"])])
        nb, flags, greedy = int(rec["n_bias"]), int(rec["flags"]), bool(rec["flags"] & SAMPLE_GREEDY)
        hist = t[:int(rec["hist_len"])].tolist()
        bias = list(zip(t[W:W + nb].tolist(), t[W + B:W + B + nb].view(np.float32).tolist()))
        st = _Slot(dict(temperature=float(rec["temperature"]), top_k=int(rec["top_k"]), top_p=float(rec["top_p"]),
                        min_p=float(rec["min_p"]), repeat_penalty=float(rec["repeat_penalty"]),
                        presence_penalty=float(rec["presence_penalty"]),
                        frequency_penalty=float(rec["frequency_penalty"]), repeat_last_n=len(hist),
                        seed=int(rec["rng"]), logit_bias=bias, history=hist,
                        n_probs=int(rec["n_probs"]) if rec["probs_row"] >= 0 else 0,
                        post_sampling_probs=bool(flags & SAMPLE_POST_PROBS)))
        st.penalize = bool(flags & SAMPLE_PENALIZE) and bool(hist)
        st.constrained = rec["mask_row"] >= 0
        row = np.asarray(logits[r])
        if st.constrained:
            ref.masks[0] = np.asarray(masks[int(rec["mask_row"])])
            row = ref._masked(0, row)
        pids, pp = np.zeros(st.n_probs, np.int32), np.zeros(st.n_probs, np.float32)
        tok = ref._sample_row(st, row, pids, pp)
        drew = st.rng != int(rec["rng"])
        out_ids[r] = tok if greedy or drew or st.constrained else -1
        if rec["hist_pos"] >= 0 and tok >= 0:
            tab[int(rec["slot"]), int(rec["hist_pos"])] = tok
        if st.n_probs:
            out_probs[int(rec["probs_row"]), 0, :st.n_probs] = pids
            out_probs[int(rec["probs_row"]), 1, :st.n_probs] = pp.view(np.int32)


_EMULATIONS = [("embed_rows_", _k_embed_rows), ("rms_norm_add_", _k_rms_norm_add), ("rms_norm_", _k_rms_norm),
               ("logit_out_", _k_logit_out), ("rope_qk_", _k_rope_qk), ("kv_store_", _k_kv_store),
               ("rope_store_", _k_rope_store), ("qk_prep_", _k_qk_prep), ("matvec_", _k_matvec),
               ("norm_matvec_swiglu_", _k_norm_matvec_swiglu), ("norm_matvec_", _k_norm_matvec),
               ("moe_matvec_swiglu_", _k_moe_matvec_swiglu), ("moe_matvec_", _k_moe_matvec),
               ("moe_router_", _k_moe_router), ("moe_route_", _k_moe_route), ("moe_group", _k_moe_group),
               ("moe_sum_", _k_moe_sum), ("attention_split_", _k_attention_split),
               ("attention_combine_", _k_attention_combine), ("swiglu_", _k_swiglu), ("cast_f32_", _k_cast),
               ("add_bias_f32", _k_add_bias),
               ("argmax_rows_", _k_argmax_rows), ("sample_chain_", _k_sample_chain)]


class Recorder:
    """Where launches go: run now, or recorded while a stream captures. kernels: "numpy" (the
    emulations above), "cuda-c" (the real kernels, compiled for the CPU by tests/gpu/cuda_emu) or
    "null" (no work)."""
    capturing: list | None = None
    launches = 0
    kernels = "numpy"


def _null(name: str):
    """No work, except that the kernels choosing tokens answer token 5 (not an end-of-generation id)."""
    out = next((i for p, i in (("argmax_rows_", 1), ("sample_chain_", 3)) if name.startswith(p)), None)

    def run(grid, args, block):
        if out is not None:
            args[out][:int(grid[0])] = 5
    return run


def _cuda_c(source: str, name: str):
    from . import cuda_emu
    kernel = cuda_emu.Kernel(source, name)

    def run(grid, args, block):
        kernel(grid, block, [a.data.ptr if isinstance(a, ndarray) else a for a in args])
    return run


class RawKernel:
    def __init__(self, name: str, params: list[str] | None, source: str):
        self.name, self.params, self.c_kinds = name, params, c_param_kinds(source, name)
        if Recorder.kernels == "cuda-c":
            self.emulate = _cuda_c(source, name)
        elif Recorder.kernels == "null":
            self.emulate = _null(name)
        else:
            f = next((f for p, f in _EMULATIONS if name.startswith(p)), None)
            if f is None:
                raise AttributeError(f"no emulation for kernel {name}")
            self.emulate = lambda grid, args, block: f(grid, args)

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        grid, block = tuple(grid), tuple(block)
        if any(int(g) < 1 for g in grid) or any(int(b) < 1 for b in block):
            raise ValueError(f"{self.name}: empty launch grid={grid} block={block}")
        if int(np.prod(block)) > 1024:
            raise ValueError(f"{self.name}: {np.prod(block)} threads per block")
        if len(grid) > 1 and any(int(g) > 65535 for g in grid[1:]):
            raise ValueError(f"{self.name}: grid {grid} exceeds 65535 in y or z")
        kinds = [_arg_kind(a) for a in args]
        if len(kinds) != len(self.c_kinds):
            raise TypeError(f"{self.name}: {len(args)} arguments, its C signature has {len(self.c_kinds)}")
        for i, (k, c) in enumerate(zip(kinds, self.c_kinds)):
            if k not in _ACCEPTS[c]:
                raise TypeError(f"{self.name}: argument {i} is {k}, the C parameter is {c}")
        if self.params is not None:
            if len(args) != len(self.params):
                raise TypeError(f"{self.name}: {len(args)} arguments, the kernel takes {len(self.params)}")
            for i, (k, p) in enumerate(zip(kinds, self.params)):
                if (k if k != "null" else "ptr") not in _PTX_KIND.get(p, ()):
                    raise TypeError(f"{self.name}: argument {i} is {k}, the kernel's parameter is .{p}")
        if Recorder.capturing is not None:
            Recorder.capturing.append(lambda: self.emulate(grid, args, block))
        else:
            Recorder.launches += 1
            self.emulate(grid, args, block)


class RawModule:
    def __init__(self, code: str, options=(), **kw):
        self.code = code
        self.sigs = ptx_signatures(code)

    def compile(self, log_stream=None):
        pass

    def get_function(self, name: str) -> RawKernel:
        if not re.search(r"\b" + re.escape(name) + r"\b", self.code):
            raise AttributeError(f"kernel {name} is not in the module's source")
        params = None
        if self.sigs is not None:
            if name not in self.sigs:
                raise AttributeError(f"nvcc produced no entry {name}")
            params = self.sigs[name]
        return RawKernel(name, params, self.code)


# -- runtime, streams, graphs, cuBLAS -----------------------------------------------------------

class Graph:
    def __init__(self, launches):
        self._launches = launches
        self.replays = 0

    def upload(self, stream=None):
        pass

    def launch(self, stream=None):
        if Recorder.capturing is not None:
            raise RuntimeError("graph launch while capturing")
        self.replays += 1
        for f in self._launches:
            Recorder.launches += 1
            f()


class Stream:
    def __init__(self, non_blocking=False):
        self.ptr = id(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        if Recorder.capturing is not None:
            raise RuntimeError("synchronize while capturing")

    def begin_capture(self, mode=None):
        if Recorder.capturing is not None:
            raise RuntimeError("nested capture")
        Recorder.capturing = []

    def end_capture(self):
        launches, Recorder.capturing = Recorder.capturing, None
        return Graph(launches)


class Event:
    """Host time stands in for device time (launches run when they are made)."""

    def __init__(self, *a, **kw):
        self.t = None

    def record(self, stream=None):
        import time
        self.t = time.perf_counter()

    def synchronize(self):
        pass


def get_elapsed_time(start: Event, stop: Event) -> float:
    return (stop.t - start.t) * 1e3


class _PinnedPool:
    def n_free_blocks(self):
        return 0


class Device:
    def __init__(self, i=0):
        self.id = i

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _memcpy_async(dst, src, nbytes, kind, stream):
    if Recorder.capturing is not None:
        raise RuntimeError("this fake does not capture copies")
    ctypes.memmove(dst, src, nbytes)


runtime = types.SimpleNamespace(
    getDeviceCount=lambda: 1, getDevice=lambda: 0, getDeviceProperties=lambda i: {"name": b"fake (NumPy) device"},
    memcpyAsync=_memcpy_async, memcpyHostToDevice=1, memcpyDeviceToHost=2,
    streamCaptureModeThreadLocal=1, streamCaptureModeRelaxed=2, memcpyDeviceToDevice=3,
    runtimeGetVersion=lambda: 0)


_CUDA_DTYPES = {0: np.float32, 2: np.float16, 14: np.uint16}


def _col_major(ptr: int, ctype: int, rows: int, cols: int, ld: int) -> np.ndarray:
    dt = np.dtype(_CUDA_DTYPES[ctype])
    count = ld * (cols - 1) + rows
    buf = np.frombuffer((ctypes.c_char * (count * dt.itemsize)).from_address(ptr), dtype=dt)
    padded = np.lib.stride_tricks.as_strided(buf, shape=(rows, cols), strides=(dt.itemsize, ld * dt.itemsize))
    return padded


def _gemm_ex(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
             computeType, algo):
    if Recorder.capturing is not None:     # as CuPy's cublas.setStream, which gemmEx calls first
        raise NotImplementedError("calling cuBLAS API during stream capture is currently unsupported")
    Recorder.launches += 1
    if Recorder.kernels != "null":
        _gemm_ex_now(transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc)


def _gemm_ex_now(transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc):
    if Atype != Btype or Ctype != 0:
        raise TypeError("this fake supports A, B of one type and float32 C")
    a_rows, a_cols = (m, k) if transa == 0 else (k, m)
    b_rows, b_cols = (k, n) if transb == 0 else (n, k)
    if lda < a_rows or ldb < b_rows or ldc < m:
        raise ValueError(f"gemmEx: leading dimensions too small (lda {lda}, ldb {ldb}, ldc {ldc})")
    a = to_f32(_col_major(A, Atype, a_rows, a_cols, lda))
    b = to_f32(_col_major(B, Btype, b_rows, b_cols, ldb))
    opa = a if transa == 0 else a.T
    opb = b if transb == 0 else b.T
    c = _col_major(C, Ctype, m, n, ldc)
    al = np.frombuffer((ctypes.c_float * 1).from_address(alpha), np.float32)[0]
    be = np.frombuffer((ctypes.c_float * 1).from_address(beta), np.float32)[0]
    res = al * (opa @ opb)
    if be != 0:
        res = res + be * c
    c[...] = res


cublas = types.ModuleType("cupy_backends.cuda.libs.cublas")
cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T = 0, 1
cublas.CUBLAS_POINTER_MODE_HOST = 0
cublas.CUBLAS_COMPUTE_32F = 68
cublas.CUBLAS_GEMM_DEFAULT = -1
cublas.setPointerMode = lambda handle, mode: None
cublas.gemmEx = _gemm_ex


def install(monkeypatch, kernels: str = "numpy") -> types.ModuleType:
    """Put this fake in place of cupy, cupyx and cupy_backends' cuBLAS for one test (monkeypatch).
    kernels: "numpy" runs each kernel's NumPy emulation, "cuda-c" the kernel itself on the CPU, "null"
    nothing (the device's work takes no time: what a step costs is the host's, for benchmarks)."""
    if kernels not in ("numpy", "cuda-c", "null"):
        raise ValueError(f"kernels must be 'numpy', 'cuda-c' or 'null', not {kernels!r}")
    cupy = types.ModuleType("cupy")
    cupy.fake_kernels = kernels
    cupy.ndarray, cupy.zeros, cupy.empty, cupy.asarray = ndarray, zeros, empty, asarray
    cupy.RawModule, cupy.get_default_memory_pool = RawModule, get_default_memory_pool
    cupy.get_default_pinned_memory_pool = _PinnedPool
    cupy.empty_like = lambda a: empty(a.shape, a.dtype)
    cupy.float32, cupy.float16, cupy.int32, cupy.uint16 = np.float32, np.float16, np.int32, np.uint16
    cupy.__version__ = f"fake ({kernels} kernels)"
    cupy.cuda = types.SimpleNamespace(runtime=runtime, Stream=Stream, Device=Device, Graph=Graph, Event=Event,
                                      get_elapsed_time=get_elapsed_time,
                                      device=types.SimpleNamespace(get_cublas_handle=lambda: 1))
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = empty_pinned
    pkg = types.ModuleType("cupy_backends")
    pkg_cuda = types.ModuleType("cupy_backends.cuda")
    pkg_libs = types.ModuleType("cupy_backends.cuda.libs")
    pkg.cuda, pkg_cuda.libs, pkg_libs.cublas = pkg_cuda, pkg_libs, cublas
    for name, mod in (("cupy", cupy), ("cupyx", cupyx), ("cupy_backends", pkg), ("cupy_backends.cuda", pkg_cuda),
                      ("cupy_backends.cuda.libs", pkg_libs), ("cupy_backends.cuda.libs.cublas", cublas)):
        monkeypatch.setitem(sys.modules, name, mod)
    from fastserve.backends.cuda import kernels as launchers
    monkeypatch.setattr(launchers, "_cp", None)
    monkeypatch.setattr(launchers, "_modules", {})
    monkeypatch.setattr(launchers, "_functions", {})
    Recorder.capturing, Recorder.launches, Recorder.kernels = None, 0, kernels
    return cupy
