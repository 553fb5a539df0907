"""Typed launchers for the CUDA kernels in cuda/*.cu: the only way fastserve reaches them.

Each kernel family (one .cu file) is compiled once per device with cupy.RawModule, lazily, the first
time one of its kernels is launched (or all at once by `compile_all`, at start-up). CuPy checks
nothing about a raw kernel's arguments and passes a Python int as a 64-bit integer, so every
launcher checks dtype, shape and C-contiguity of each array, passes scalars as the exact C types the
kernel declares, and picks the launch shape the kernel's header comment asks for.

Arrays are preallocated at their largest size and reused (no allocation per step): a launcher takes
the number of live rows `n` and checks that every array has at least that many.

Sources are found in the installed package (fastserve/cuda/, copied there by setup.py) or, for an
editable install, at the repository's top-level cuda/. `#include "common.cuh"` is pasted in before
compiling, so that CuPy's on-disk kernel cache keys on the header's text as well.

Importing this module needs no CuPy; calling a launcher does.
"""
from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import numpy as np

# Storage types of weights, activations fed to matrix products, and the KV cache.
STORAGE = {"f16": np.float16, "bf16": None, "f32": np.float32}   # bf16: raw uint16 words on the device
ATTN_WARPS = 4          # cuda/attention.cu: ATTN_WARPS
ATTN_COMBINE_THREADS = 256         # cuda/attention.cu: ATTN_COMBINE_THREADS
ATTN_GROUPS = tuple(range(1, 9))   # query heads per KV head: an attention_split_*_g<G> for each
ATTN_HEAD_DIMS = (32, 64, 128, 256)   # attention_split_*_d<D>: head_dim <= D, a multiple of 8
MATVEC_WARPS = 4        # cuda/matvec.cu: MATVEC_WARPS
MATVEC_MAX_N = 32       # the largest matvec_*_n<N> instantiated: x rows per block (more: more blocks)
MATVEC_ROWS = (1, 2, 4, 8, 16, 32)
MOE_MAX_EXPERTS = 512  # cuda/moe.cu: MOE_MAX_EXPERTS
MOE_ROUTER_WARPS = 8   # cuda/moe.cu: MOE_ROUTER_WARPS (experts per block of moe_router_f32, a warp each)
SAMPLE_THREADS = 512    # cuda/sampling.cu: SAMPLE_THREADS
SAMPLE_MAX_PROBS = 128  # cuda/sampling.cu: SAMPLE_MAX_PROBS
SAMPLE_GREEDY, SAMPLE_POST_PROBS, SAMPLE_PENALIZE = 1, 2, 4       # SampleRow.flags
# cuda/sampling.cu's struct SampleRow, field for field (88 bytes): one per row of sample_chain.
SAMPLE_ROW = np.dtype({
    "names": ["temperature", "top_p", "min_p", "log_min_p", "rng", "top_k", "n_probs", "probs_row", "flags",
              "slot", "n_bias", "hist_len", "hist_pos", "repeat_penalty", "presence_penalty", "frequency_penalty",
              "mask_row"],
    "formats": ["<f8", "<f8", "<f8", "<f8", "<u8", "<i4", "<i4", "<i4", "<i4", "<i4", "<i4", "<i4", "<i4",
                "<f4", "<f4", "<f4", "<i4"],
    "offsets": [0, 8, 16, 24, 32, 40, 44, 48, 52, 56, 60, 64, 68, 72, 76, 80, 84],
    "itemsize": 88})
SAMPLE_ROW_WORDS = SAMPLE_ROW.itemsize // 4
_S3 = ("f16", "bf16", "f32")
# Every kernel a launcher may call, by family (one .cu each): tests/unit/test_cuda_sources.py checks
# that nvcc compiles exactly these entry points.
KERNELS = {
    "attention": [f"attention_split_{s}_d{d}_g{g}" for s in _S3 for d in ATTN_HEAD_DIMS for g in ATTN_GROUPS]
                 + [f"attention_combine_{s}" for s in _S3],
    "bias": ["add_bias_f32"],
    "cast": ["cast_f32_f16", "cast_f32_bf16"],
    "embedding": [f"embed_rows_{s}" for s in _S3],
    "kv_cache": [f"kv_store_{s}" for s in _S3] + [f"rope_store_{s}" for s in _S3],
    "logit_out": ["logit_out_f32"],
    "matvec": [f"{kind}_{s}_n{n}" for kind in ("matvec", "norm_matvec", "norm_matvec_swiglu", "moe_matvec",
                                               "moe_matvec_swiglu")
               for s in ("f16", "bf16") for n in MATVEC_ROWS],
    "moe": ["moe_router_f32", "moe_route_f32", "moe_group", "moe_sum_f32"],
    "qk_prep": ["qk_prep_f32"],
    "rms_norm": [f"rms_norm_{s}" for s in _S3] + ["rms_norm_add_f32"],
    "rope": ["rope_qk_f32"],
    "sampling": ["argmax_rows_f32", "sample_chain_f32"],
    "swiglu": [f"swiglu_{s}" for s in _S3],
}
FAMILIES = tuple(KERNELS)
NVRTC_OPTIONS = ("-std=c++17",)

_PACKAGE_DIR = Path(__file__).resolve().parents[2] / "cuda"
_REPO_DIR = Path(__file__).resolve().parents[3] / "cuda"
_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.M)


def source_dir() -> Path:
    """The folder holding the kernel sources: the package's copy first, else the repository's."""
    for d in (_PACKAGE_DIR, _REPO_DIR):
        if (d / "common.cuh").is_file():
            return d
    raise FileNotFoundError(f"CUDA kernel sources not found in {_PACKAGE_DIR} or {_REPO_DIR}: "
                            "reinstall fastserve (setup.py copies cuda/ into the package)")


def read_source(family: str) -> str:
    """The text of cuda/<family>.cu with its local includes pasted in (each once)."""
    d = source_dir()
    seen: set[str] = set()

    def expand(text: str) -> str:
        def paste(m: re.Match) -> str:
            name = m.group(1)
            if name in seen:
                return ""
            seen.add(name)
            return expand((d / name).read_text(encoding="utf-8"))
        return _INCLUDE.sub(paste, text)

    text = expand((d / f"{family}.cu").read_text(encoding="utf-8"))
    return re.sub(r"^\s*#pragma\s+once\s*$", "", text, flags=re.M)      # pasted headers: not needed


# -- compilation: one RawModule per (device, family) ----------------------------------------------

_modules: dict[tuple[int, str], object] = {}
_functions: dict[tuple[int, str, str], object] = {}
_lock = threading.Lock()


_cp = None


def _cupy():
    """The cupy module (imported on first use: importing this module needs no CuPy)."""
    global _cp
    if _cp is None:
        try:
            import cupy
        except ImportError as exc:
            raise RuntimeError("the CUDA backend needs CuPy (pip install cupy-cuda13x, or cupy-cuda12x "
                               "for a CUDA 12 driver)") from exc
        _cp = cupy
    return _cp


def module(family: str):
    """cuda/<family>.cu compiled for the current device (once; later calls return the same module)."""
    cp = _cupy()
    dev = cp.cuda.runtime.getDevice()
    key = (dev, family)
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                mod = cp.RawModule(code=read_source(family), options=NVRTC_OPTIONS)
                mod.compile()
                _modules[key] = mod
    return mod


def function(family: str, name: str):
    cp = _cupy()
    key = (cp.cuda.runtime.getDevice(), family, name)
    fn = _functions.get(key)
    if fn is None:
        fn = module(family).get_function(name)
        _functions[key] = fn
    return fn


def compile_all() -> None:
    """Compile every family for the current device now (start-up), not at the first step."""
    for family in FAMILIES:
        module(family)


# -- argument checks ---------------------------------------------------------------------------

def _dtype_of(storage: str):
    """numpy dtype of a storage type's device array (bf16 arrays are uint16 words)."""
    if storage == "bf16":
        return np.dtype(np.uint16)
    return np.dtype(STORAGE[storage])


def storage_of(arr) -> str:
    """'f16', 'bf16' (uint16 words) or 'f32' for a device array."""
    dt = arr.dtype
    if dt == np.float16:
        return "f16"
    if dt == np.uint16:
        return "bf16"
    if dt == np.float32:
        return "f32"
    raise TypeError(f"no storage type holds dtype {dt}")


def _check(name: str, arr, dtype, shape: tuple, min_rows: int | None = None) -> None:
    """arr: a C-contiguous device array of `dtype`; shape entries None match anything; with min_rows,
    shape[0] is a capacity that must be >= min_rows."""
    cp = _cupy()
    if not isinstance(arr, cp.ndarray):
        raise TypeError(f"{name}: expected a cupy.ndarray, got {type(arr).__name__}")
    if dtype is not None and arr.dtype != dtype:
        raise TypeError(f"{name}: dtype {arr.dtype}, expected {np.dtype(dtype)}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name}: not C-contiguous")
    if arr.ndim != len(shape):
        raise ValueError(f"{name}: {arr.ndim} dimensions, expected {len(shape)} {shape}")
    for i, (got, want) in enumerate(zip(arr.shape, shape)):
        if i == 0 and min_rows is not None:
            if got < min_rows:
                raise ValueError(f"{name}: {got} rows, at least {min_rows} needed")
        elif want is not None and got != want:
            raise ValueError(f"{name}: shape {arr.shape}, expected {shape}")


def _same_storage(*named) -> str:
    kinds = {storage_of(a) for _, a in named}
    if len(kinds) != 1:
        raise TypeError("storage types differ: " + ", ".join(f"{n} {a.dtype}" for n, a in named))
    return kinds.pop()


def _threads(width: int, most: int = 1024) -> int:
    """A block size: width rounded up to a multiple of 32, between 32 and `most`."""
    return max(32, min(most, (width + 31) // 32 * 32))


_i32, _f32, _i64 = np.int32, np.float32, np.int64
_NULL = np.uint64(0)     # a null pointer argument


# -- launchers ---------------------------------------------------------------------------------

def embed_rows(table, tokens, x, n: int, scale: float = 1.0) -> None:
    """x[:n] = table[tokens[:n]] as float32, times scale (gemma3's sqrt(n_embd)). table [V, d] f16/bf16/f32;
    tokens int32 [>=n]; x f32 [>=n, d]."""
    V, d = table.shape
    storage = storage_of(table)
    _check("table", table, _dtype_of(storage), (V, d))
    _check("tokens", tokens, np.int32, (None,), min_rows=n)
    _check("x", x, np.float32, (None, d), min_rows=n)
    if n:
        function("embedding", f"embed_rows_{storage}")((n,), (_threads(d, 256),),
                                                        (table, tokens, x, _i32(d), _f32(scale)))


def rms_norm(x, w, out, n: int, eps: float, rows=None) -> None:
    """out[r] = rmsnorm(x[rows[r] if rows else r]) * w for r < n. x f32 [*, d]; w f32 [d];
    out [>=n, d] f16/bf16/f32; rows int32 [>=n] or None."""
    d = w.shape[0]
    _check("w", w, np.float32, (d,))
    _check("x", x, np.float32, (None, d), min_rows=0 if rows is not None else n)
    storage = storage_of(out)
    _check("out", out, _dtype_of(storage), (None, d), min_rows=n)
    if rows is not None:
        _check("rows", rows, np.int32, (None,), min_rows=n)
    if n:
        function("rms_norm", f"rms_norm_{storage}")(
            (n,), (_threads(d),), (x, _NULL if rows is None else rows, w, out, _i32(d), _f32(eps)))


def rms_norm_add(y, w, x, n: int, eps: float, scale: float = 1.0) -> None:
    """x[:n] += rmsnorm(y[:n]) * w * scale: a block's output normed, times the residual multiplier (granite's;
    1: none), then added to the residual stream (the sandwich norms). y f32 [>=n, d]; w f32 [d]; x f32 [>=n, d]."""
    d = w.shape[0]
    _check("w", w, np.float32, (d,))
    _check("y", y, np.float32, (None, d), min_rows=n)
    _check("x", x, np.float32, (None, d), min_rows=n)
    if n:
        function("rms_norm", "rms_norm_add_f32")((n,), (_threads(d),), (y, w, x, _i32(d), _f32(eps), _f32(scale)))


def logit_out(logits, m: int, scale: float = 1.0, cap: float = 0.0) -> None:
    """In place: logits[:m] *= scale (the logit multiplier, granite's 1 / logit_scale), then, cap > 0,
    logits[:m] = cap * tanh(logits[:m] / cap) (final-logit soft-capping). logits f32 [>=m, V]."""
    V = logits.shape[1]
    _check("logits", logits, np.float32, (None, V), min_rows=m)
    if not cap >= 0:
        raise ValueError(f"cap must be >= 0 (0: no soft-capping), not {cap}")
    if m:
        size = m * V
        function("logit_out", "logit_out_f32")((min(-(-size // 256), 65535),), (256,),
                                               (logits, _i64(size), _f32(scale), _f32(cap)))


def rope_qk(qkv, cos, sin, positions, n: int, n_head: int, n_head_kv: int, head_dim: int, rope_dim: int) -> None:
    """In place: RoPE on the Q and K heads of qkv f32 [>=n, (n_head + 2 n_head_kv) head_dim];
    cos, sin f32 [n_ctx_slot, rope_dim / 2]; positions int32 [>=n] (each < n_ctx_slot: not checked on
    the device)."""
    stride = (n_head + 2 * n_head_kv) * head_dim
    if rope_dim % 2 or rope_dim > head_dim:
        raise ValueError(f"rope_dim {rope_dim} must be even and <= head_dim {head_dim}")
    _check("qkv", qkv, np.float32, (None, stride), min_rows=n)
    _check("cos", cos, np.float32, (None, rope_dim // 2))
    _check("sin", sin, np.float32, cos.shape)
    _check("positions", positions, np.int32, (None,), min_rows=n)
    if n:
        n_rot = n_head + n_head_kv
        function("rope", "rope_qk_f32")(
            (n,), (_threads(n_rot * rope_dim // 2, 256),),
            (qkv, cos, sin, positions, _i32(stride), _i32(n_rot), _i32(head_dim), _i32(rope_dim)))


def qk_prep(qkv, bias, q_norm, k_norm, n: int, n_head: int, n_head_kv: int, head_dim: int, eps: float) -> None:
    """In place, before RoPE: qkv f32 [>=n, (n_head + 2 n_head_kv) head_dim] += bias f32 [that width]
    (None: no bias); then each Q head RMS-normed with q_norm f32 [head_dim] and each K head with k_norm
    (both None: no norms)."""
    stride = (n_head + 2 * n_head_kv) * head_dim
    _check("qkv", qkv, np.float32, (None, stride), min_rows=n)
    if bias is not None:
        _check("bias", bias, np.float32, (stride,))
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    if q_norm is not None:
        _check("q_norm", q_norm, np.float32, (head_dim,))
        _check("k_norm", k_norm, np.float32, (head_dim,))
    if n and (bias is not None or q_norm is not None):
        function("qk_prep", "qk_prep_f32")(
            (n,), (_threads(max(head_dim, 32), 256),),
            (qkv, _NULL if bias is None else bias, _NULL if q_norm is None else q_norm,
             _NULL if k_norm is None else k_norm, _i32(stride), _i32(n_head), _i32(n_head_kv), _i32(head_dim),
             _f32(eps)))


def _check_kv(qkv, k_cache, v_cache, slots, positions, n: int, n_head: int) -> tuple:
    """The checks every KV-cache launcher makes: caches [n_slots, n_ctx_slot, Hkv, D] of one storage
    type, qkv f32 [>=n, (n_head + 2 Hkv) D], slots and positions int32 [>=n]. Returns (storage,
    n_ctx_slot, Hkv, D, qkv's row stride)."""
    n_slots, n_ctx, Hkv, D = k_cache.shape
    storage = _same_storage(("k_cache", k_cache), ("v_cache", v_cache))
    stride = (n_head + 2 * Hkv) * D
    _check("k_cache", k_cache, _dtype_of(storage), (n_slots, n_ctx, Hkv, D))
    _check("v_cache", v_cache, _dtype_of(storage), (n_slots, n_ctx, Hkv, D))
    _check("qkv", qkv, np.float32, (None, stride), min_rows=n)
    _check("slots", slots, np.int32, (None,), min_rows=n)
    _check("positions", positions, np.int32, (None,), min_rows=n)
    return storage, n_ctx, Hkv, D, stride


def kv_store(qkv, k_cache, v_cache, slots, positions, n: int, n_head: int) -> None:
    """K and V heads of qkv f32 [>=n, (n_head + 2 Hkv) D] into k_cache, v_cache [n_slots, n_ctx_slot, Hkv, D]
    at (slots[t], positions[t]); slots, positions int32 [>=n]."""
    storage, n_ctx, Hkv, D, stride = _check_kv(qkv, k_cache, v_cache, slots, positions, n, n_head)
    if n:
        function("kv_cache", f"kv_store_{storage}")(
            (n,), (_threads(Hkv * D, 256),),
            (qkv, k_cache, v_cache, slots, positions, _i32(stride), _i32(n_head), _i32(Hkv), _i32(D), _i32(n_ctx)))


def rope_store(qkv, cos, sin, k_cache, v_cache, slots, positions, n: int, n_head: int, rope_dim: int) -> None:
    """rope_qk then kv_store in one launch: RoPE in place on the Q and K heads of qkv f32
    [>=n, (n_head + 2 Hkv) D], then K and V into k_cache, v_cache [n_slots, n_ctx_slot, Hkv, D] at
    (slots[t], positions[t]); cos, sin f32 [n_ctx_slot, rope_dim / 2]; slots, positions int32 [>=n]."""
    D = k_cache.shape[-1]
    if rope_dim % 2 or rope_dim > D:
        raise ValueError(f"rope_dim {rope_dim} must be even and <= head_dim {D}")
    storage, n_ctx, Hkv, D, stride = _check_kv(qkv, k_cache, v_cache, slots, positions, n, n_head)
    _check("cos", cos, np.float32, (n_ctx, rope_dim // 2))
    _check("sin", sin, np.float32, (n_ctx, rope_dim // 2))
    if n:
        function("kv_cache", f"rope_store_{storage}")(
            (n,), (_threads(max(Hkv * D, (n_head + Hkv) * rope_dim // 2), 256),),
            (qkv, cos, sin, k_cache, v_cache, slots, positions, _i32(stride), _i32(n_head), _i32(Hkv), _i32(D),
             _i32(rope_dim), _i32(n_ctx)))


def attention_splits(n_ctx_slot: int, chunk: int) -> int:
    """Blocks per (token, KV head) along the keys: fixed by the slot length, never by the positions."""
    return -(-n_ctx_slot // chunk)


def attention(qkv, k_cache, v_cache, slots, positions, part_o, part_ml, out, n: int, n_head: int,
              chunk: int, scale: float, window: int = 0, sinks=None) -> None:
    """out[t] = causal GQA attention of token t's Q heads (in qkv f32 [>=n, (H + 2 Hkv) D]) over keys
    0..positions[t] of slot slots[t] (window > 0, a sliding-window layer: keys p - window < k <= p, p =
    positions[t]). k_cache, v_cache [n_slots, n_ctx_slot, Hkv, D], 16-byte aligned,
    D a multiple of 8, at most 256, H / Hkv at most 8; part_o f32 [>=n, H, S, D] and part_ml f32
    [>=n, H, S, 2] scratch with S = ceil(n_ctx_slot / chunk) blocks per (token, KV head), each taking
    an even share of the token's keys in whole steps of 2048 / D' keys (D' = 32, 64, 128 or 256 >= D);
    out [>=n, H * D] f16/bf16/f32. sinks f32 [H] (gpt-oss's attention sinks, natural-log logits) or None: head
    h's sink joins its softmax's denominator only. A token's result depends on its position, its slot's KV
    and S, not on the batch."""
    Hkv, D = k_cache.shape[-2:]
    if n_head % Hkv or n_head // Hkv not in ATTN_GROUPS:
        raise ValueError(f"n_head {n_head} must be a multiple of n_head_kv {Hkv}, at most {ATTN_GROUPS[-1]} times")
    if D % 8 or D > ATTN_HEAD_DIMS[-1]:
        raise ValueError(f"head_dim {D}: cuda/attention.cu takes multiples of 8 up to {ATTN_HEAD_DIMS[-1]}")
    if chunk < 1:
        raise ValueError("chunk must be >= 1")
    if window < 0:
        raise ValueError("window must be >= 0 (0: every key up to the query's position)")
    storage, n_ctx, Hkv, D, stride = _check_kv(qkv, k_cache, v_cache, slots, positions, n, n_head)
    S = attention_splits(n_ctx, chunk)
    _check("part_o", part_o, np.float32, (None, n_head, S, D), min_rows=n)
    _check("part_ml", part_ml, np.float32, (None, n_head, S, 2), min_rows=n)
    out_storage = storage_of(out)
    _check("out", out, _dtype_of(out_storage), (None, n_head * D), min_rows=n)
    if sinks is not None:
        _check("sinks", sinks, np.float32, (n_head,))
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache), ("qkv", qkv)):
        if a.data.ptr % 16:
            raise ValueError(f"{name}: not 16-byte aligned (the kernel reads K/V rows and Q in 16-byte words)")
    if not n:
        return
    d = next(d for d in ATTN_HEAD_DIMS if D <= d)
    function("attention", f"attention_split_{storage}_d{d}_g{n_head // Hkv}")(
        (S, Hkv, n), (ATTN_WARPS * 32,),
        (qkv, k_cache, v_cache, slots, positions, part_o, part_ml, _i32(stride), _i32(n_head), _i32(Hkv),
         _i32(D), _i32(n_ctx), _i32(chunk), _f32(scale), _i32(window)))
    function("attention", f"attention_combine_{out_storage}")(
        (n_head, n), (ATTN_COMBINE_THREADS,),
        (part_o, part_ml, _NULL if sinks is None else sinks, out, _i32(n_head), _i32(D), _i32(S)))


def swiglu(gu, out, n: int, gelu: bool = False) -> None:
    """out[t] = silu(gate) * up (gelu: GeGLU, gelu(gate) * up in GELU's tanh form) for gu f32 [>=n, 2 n_ff]
    (gate rows first); out [>=n, n_ff] f16/bf16/f32."""
    n_ff = out.shape[1]
    storage = storage_of(out)
    _check("gu", gu, np.float32, (None, 2 * n_ff), min_rows=n)
    _check("out", out, _dtype_of(storage), (None, n_ff), min_rows=n)
    if n:
        total = n * n_ff
        blocks = min(-(-total // 256), 65535)
        function("swiglu", f"swiglu_{storage}")((blocks,), (256,), (gu, out, _i32(n), _i32(n_ff),
                                                                    _i32(1 if gelu else 0)))


def add_bias(x, bias, n: int) -> None:
    """x[t] += bias for t < n: x f32 [>=n, d], bias f32 [d] (gpt-oss's attention-output bias)."""
    d = bias.shape[0] if bias.ndim == 1 else -1
    _check("x", x, np.float32, (None, d), min_rows=n)
    _check("bias", bias, np.float32, (d,))
    if n:
        function("bias", "add_bias_f32")((min(-(-n * d // 256), 65535),), (256,), (x, bias, _i32(n), _i32(d)))


def cast_from_f32(src, dst) -> None:
    """dst = src rounded to dst's storage type (nearest even); same shape, both contiguous."""
    storage = storage_of(dst)
    if storage == "f32":
        raise TypeError("dst must be f16 or bf16")
    _check("src", src, np.float32, tuple(dst.shape))
    _check("dst", dst, _dtype_of(storage), tuple(dst.shape))
    size = int(dst.size)
    if size:
        blocks = min(-(-size // 256), 65535)
        function("cast", f"cast_f32_{storage}")((blocks,), (256,), (src, dst, _i64(size)))


def argmax_rows(logits, out, m: int) -> None:
    """out[r] = argmax(logits[r]) for r < m, ties to the lowest id, NaN and -inf never (0 when nothing else).
    logits f32 [>=m, V]; out int32 [>=m]."""
    V = logits.shape[1]
    _check("logits", logits, np.float32, (None, V), min_rows=m)
    _check("out", out, np.int32, (None,), min_rows=m)
    if m:
        function("sampling", "argmax_rows_f32")((m,), (_threads(V),), (logits, out, _i32(V)))


def sample_chain(logits, rows, slot_tab, out_ids, out_probs, m: int, window_cap: int, bias_cap: int,
                 masks) -> None:
    """The host sampler's chain on rows r < m of logits f32 [>=m, V] (modified in place: bias and
    penalties). rows int32 [>=m, SAMPLE_ROW_WORDS]: SAMPLE_ROW records, 8-byte aligned; slot_tab int32
    [n_slots, window_cap + 2 bias_cap] (each slot's penalty ring, bias ids, bias values' float32 bits; the
    kernel appends row r's token to slot rows[r].slot's ring); out_ids int32 [>=m] (-1: a sampled row
    with no candidate); out_probs int32 [*, 2, P] with P <= SAMPLE_MAX_PROBS: ids, then float32 bits of
    the probabilities, of the rows whose probs_row >= 0; masks uint32 [>=1, ceil(V / 32)]: the allowed
    tokens of the rows whose mask_row >= 0 (a constrained row with nothing allowed gives -1).
    cuda/sampling.cu states the rest."""
    V = logits.shape[1]
    P = out_probs.shape[2]
    if not 0 < P <= SAMPLE_MAX_PROBS:
        raise ValueError(f"out_probs holds lists of {P}; 1 to {SAMPLE_MAX_PROBS} fit the kernel")
    _check("logits", logits, np.float32, (None, V), min_rows=m)
    _check("rows", rows, np.int32, (None, SAMPLE_ROW_WORDS), min_rows=m)
    _check("slot_tab", slot_tab, np.int32, (None, window_cap + 2 * bias_cap))
    _check("out_ids", out_ids, np.int32, (None,), min_rows=m)
    _check("out_probs", out_probs, np.int32, (None, 2, P))
    _check("masks", masks, np.uint32, (None, (V + 31) // 32))
    if rows.data.ptr % 8:
        raise ValueError("rows: SampleRow records need 8-byte alignment")
    if m:
        function("sampling", "sample_chain_f32")(
            (m,), (SAMPLE_THREADS,),
            (logits, rows, slot_tab, out_ids, out_probs, masks, _i32(V), _i32(window_cap), _i32(bias_cap), _i32(P),
             _i32(masks.shape[1])))


# -- matrix products (cuBLAS through CuPy's bindings) -------------------------------------------

_CUDA_TYPE = {"f16": 2, "bf16": 14, "f32": 0}        # cudaDataType: CUDA_R_16F, CUDA_R_16BF, CUDA_R_32F
_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)
_SCALARS: dict[float, np.ndarray] = {1.0: _ONE}


def _host_scalar(v: float) -> np.ndarray:
    """A float32 [1] holding v, made once per value (a model has one or two), kept for cuBLAS to read."""
    a = _SCALARS.get(v)
    if a is None:
        a = _SCALARS.setdefault(v, np.full(1, v, np.float32))
    return a


def gemm(x, w, out, n: int, accumulate: bool = False, matvec_max_n: int = MATVEC_MAX_N, scale: float = 1.0) -> None:
    """out[:n] = scale * x[:n] @ w.T (accumulate: out[:n] += ...; scale: granite's residual multiplier, 1: none),
    float32 accumulation. x [>=n, k] and w [m, k] in
    one storage type (f16/bf16/f32); out f32 [>=n, m]. Up to matvec_max_n rows (f16/bf16, k % 8 == 0):
    cuda/matvec.cu, which streams the weights once per 32 rows and sums each row in one order whatever
    n; otherwise cublasGemmEx (compute 32F), which CuPy refuses inside a CUDA graph capture. Runs on
    CuPy's current stream and allocates nothing."""
    cp = _cupy()
    m_out, k = w.shape
    storage = _same_storage(("x", x), ("w", w))
    _check("w", w, _dtype_of(storage), (m_out, k))
    _check("x", x, _dtype_of(storage), (None, k), min_rows=n)
    _check("out", out, np.float32, (None, m_out), min_rows=n)
    if not n:
        return
    if _matvec_path(n, matvec_max_n, storage, k, x, w):
        _matvec("matvec", storage, n, m_out, (w, x, out, _i32(n), _i32(m_out), _i32(k), _i32(1 if accumulate else 0),
                                              _f32(scale)))
        return
    from cupy_backends.cuda.libs import cublas
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    alpha = _host_scalar(scale)         # read by the call (host pointer mode)
    # Row-major out[n, m] is column-major out^T (m x n): out^T = w (col-major k x m, transposed) @ x^T.
    cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, m_out, n, k,
                  alpha.ctypes.data, w.data.ptr, _CUDA_TYPE[storage], k,
                  x.data.ptr, _CUDA_TYPE[storage], k,
                  (_ONE if accumulate else _ZERO).ctypes.data, out.data.ptr, _CUDA_TYPE["f32"], m_out,
                  cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)


def matvec_fits(storage: str, k: int) -> bool:
    """cuda/matvec.cu takes this product (16-byte loads of 8 f16/bf16 elements)."""
    return storage in ("f16", "bf16") and k % 8 == 0


def _matvec_path(n: int, matvec_max_n: int, storage: str, k: int, *arrays) -> bool:
    """A product of n rows runs in cuda/matvec.cu (else cuBLAS): the one rule for gemm and the fused
    products, so that a row takes the same path, and gets the same result, whichever launcher runs it."""
    return n <= matvec_max_n and matvec_fits(storage, k) and all(a.data.ptr % 16 == 0 for a in arrays)


def _matvec(kind: str, storage: str, n: int, m_out: int, args: tuple) -> None:
    """Launch cuda/matvec.cu's <kind>_<storage>_n<MAXN> over m_out output rows and n x rows."""
    rows = next(r for r in MATVEC_ROWS if r >= min(n, MATVEC_MAX_N))
    function("matvec", f"{kind}_{storage}_n{rows}")(
        (-(-m_out // MATVEC_WARPS), -(-n // rows)), (MATVEC_WARPS * 32,), args)


def norm_gemm(x, norm_w, w, out, h, n: int, eps: float, rows=None, matvec_max_n: int = MATVEC_MAX_N) -> None:
    """out[:n] = rms_norm(x[rows[:n] if rows else :n]) * norm_w @ w.T (as rms_norm into h, then gemm).
    x f32 [*, k]; norm_w f32 [k]; w [m, k] f16/bf16/f32; out f32 [>=n, m]; h [>=n, k] in w's storage:
    the normed rows, written only when the product runs in cuBLAS; rows int32 [>=n] or None.
    On gemm's matvec path one launch (cuda/matvec.cu norm_matvec) forms h's elements as it reads them,
    with inv summed in another order than rms_norm's (so within rounding of the two-launch result)."""
    m_out, k = w.shape
    storage = storage_of(w)
    if not _matvec_path(n, matvec_max_n, storage, k, w, x):
        rms_norm(x, norm_w, h, n, eps, rows=rows)
        gemm(h, w, out, n, matvec_max_n=matvec_max_n)
        return
    _check("w", w, _dtype_of(storage), (m_out, k))
    _check("x", x, np.float32, (None, k), min_rows=0 if rows is not None else n)
    _check("norm_w", norm_w, np.float32, (k,))
    _check("out", out, np.float32, (None, m_out), min_rows=n)
    if rows is not None:
        _check("rows", rows, np.int32, (None,), min_rows=n)
    if n:
        _matvec("norm_matvec", storage, n, m_out, (w, x, _NULL if rows is None else rows, norm_w, out, _i32(n),
                                                    _i32(m_out), _i32(k), _f32(eps)))


def norm_gemm_swiglu(x, norm_w, w_gate_up, act, h, gu, n: int, eps: float, matvec_max_n: int = MATVEC_MAX_N,
                     gelu: bool = False) -> None:
    """act[:n] = swiglu(rms_norm(x[:n]) * norm_w @ w_gate_up.T) (as rms_norm into h, gemm into gu, then
    swiglu; gelu: GeGLU instead). x f32 [>=n, k]; norm_w f32 [k]; w_gate_up [2 n_ff, k] f16/bf16 (gate rows
    first); act [>=n, n_ff] in its storage; h [>=n, k] and gu f32 [>=n, 2 n_ff]: written only when the
    product runs in cuBLAS. On gemm's matvec path one launch (cuda/matvec.cu norm_matvec_swiglu): one warp
    sums a gate row and its up row and writes silu(g) * u (or gelu(g) * u), bitwise what gemm then swiglu
    make of the same h."""
    m2, k = w_gate_up.shape
    storage = storage_of(w_gate_up)
    if m2 % 2 or not _matvec_path(n, matvec_max_n, storage, k, w_gate_up, x):
        rms_norm(x, norm_w, h, n, eps)
        gemm(h, w_gate_up, gu, n, matvec_max_n=matvec_max_n)
        swiglu(gu, act, n, gelu)
        return
    n_ff = m2 // 2
    _check("w_gate_up", w_gate_up, _dtype_of(storage), (m2, k))
    _check("x", x, np.float32, (None, k), min_rows=n)
    _check("norm_w", norm_w, np.float32, (k,))
    _check("act", act, _dtype_of(storage), (None, n_ff), min_rows=n)
    if n:
        _matvec("norm_matvec_swiglu", storage, n, n_ff, (w_gate_up, x, norm_w, act, _i32(n), _i32(n_ff), _i32(k),
                                                          _f32(eps), _i32(1 if gelu else 0)))


# -- a mixture of experts (cuda/moe.cu, and its grouped products in cuda/matvec.cu) ----------------

def moe_tile_rows(n: int) -> int:
    """The pairs a grouped product's block takes (its MAXN): an expert has at most n pairs (one per row)."""
    return next(r for r in MATVEC_ROWS if r >= min(n, MATVEC_MAX_N))


def moe_tiles(n: int, k: int, n_expert: int) -> int:
    """Tiles of moe_group over n rows of k pairs: enough for any routing (min(E, n k) experts used, each
    its pairs in tiles of moe_tile_rows(n)), fixed by n alone."""
    return min(n_expert, n * k) + n * k // moe_tile_rows(n)


def moe_router(x, norm_w, router, route, n: int, eps: float) -> None:
    """The router's logits in float32 throughout, as the CPU's: route[:n] = (rmsnorm(x[:n]) * norm_w) @ router.T.
    x f32 [>=n, d] (the residual stream); norm_w f32 [d]; router f32 [E, d]; route f32 [>=n, E]."""
    E, d = router.shape
    _check("router", router, np.float32, (E, d))
    _check("norm_w", norm_w, np.float32, (d,))
    _check("x", x, np.float32, (None, d), min_rows=n)
    _check("route", route, np.float32, (None, E), min_rows=n)
    if n:
        function("moe", "moe_router_f32")((n, -(-E // MOE_ROUTER_WARPS)), (MOE_ROUTER_WARPS * 32,),
                                          (x, norm_w, router, route, _i32(d), _i32(E), _f32(eps)))


def moe_route(route, sel, wts, n: int, scale: float = 1.0, bias=None, topk_softmax: bool = False) -> None:
    """Each row's experts by rank, sel int32 [>=n, k], and weights, wts f32 [>=n, k], from its router logits
    route f32 [>=n, E] [+ bias f32 [E]] (softmax, top k ties to the lower id, normalised over the k, times scale;
    topk_softmax: the top k logits, then the softmax over those k, times scale)."""
    E, k = route.shape[1], sel.shape[1]
    _check("route", route, np.float32, (None, E), min_rows=n)
    _check("sel", sel, np.int32, (None, k), min_rows=n)
    _check("wts", wts, np.float32, (None, k), min_rows=n)
    if bias is not None:
        _check("bias", bias, np.float32, (E,))
    if not 0 < k <= E <= MOE_MAX_EXPERTS:
        raise ValueError(f"{k} experts used of {E}: cuda/moe.cu takes 0 < k <= E <= {MOE_MAX_EXPERTS}")
    if n:
        function("moe", "moe_route_f32")((n,), (_threads(E, 256),),
                                         (route, _NULL if bias is None else bias, sel, wts, _i32(E), _i32(k),
                                          _f32(scale), _i32(1 if topk_softmax else 0)))


def moe_group(sel, n: int, n_expert: int, start, order, pos, tiles) -> None:
    """The n rows' (row, rank) pairs of sel int32 [>=n, k] grouped by expert (cuda/moe.cu moe_group): start int32
    [E + 1], order and pos int32 [>=n k], tiles int32 [>=moe_tiles(n, k, E), 2] (unused ones: expert -1)."""
    k = sel.shape[1]
    _check("sel", sel, np.int32, (None, k), min_rows=n)
    _check("start", start, np.int32, (n_expert + 1,))
    _check("order", order, np.int32, (None,), min_rows=n * k)
    _check("pos", pos, np.int32, (None,), min_rows=n * k)
    n_tiles = moe_tiles(n, k, n_expert)
    _check("tiles", tiles, np.int32, (None, 2), min_rows=n_tiles)
    if n:
        function("moe", "moe_group")((1,), (_threads(n_expert, 256),),
                                     (sel, _i32(n * k), _i32(n_expert), _i32(moe_tile_rows(n)), _i32(n_tiles), start,
                                      order, pos, tiles))


GLU_SILU, GLU_GELU, GLU_OAI = 0, 1, 2     # cuda/common.cuh gate_mul's glu: SwiGLU, GeGLU, gpt-oss's swiglu_oai


def moe_gemm_swiglu(h, w_gate_up, start, order, tiles, act, n: int, k: int, gelu: bool = False, oai: bool = False,
                    bias=None) -> None:
    """Each expert's gate | up product over the rows that chose it, then the GLU: act[t] = swiglu(h[order[t] //
    k] @ w_gate_up[e].T [+ bias[e]]) for the grouped positions t of each expert e (moe_group's start, order,
    tiles of n rows). h [>=n, d] f16/bf16; w_gate_up [E, 2 F, d] in its storage (gate rows, then up rows);
    act [>=n k, F]. gelu: GeGLU; oai: gpt-oss's swiglu_oai; bias f32 [E, 2 F] (gate, then up) or None."""
    E, m2, d = w_gate_up.shape
    storage = _same_storage(("h", h), ("w_gate_up", w_gate_up), ("act", act))
    F, n_tiles = m2 // 2, moe_tiles(n, k, E)
    _check_moe(storage, d, h, w_gate_up, start, tiles, n_tiles, E)
    _check("h", h, _dtype_of(storage), (None, d), min_rows=n)
    _check("order", order, np.int32, (None,), min_rows=n * k)
    _check("act", act, _dtype_of(storage), (None, F), min_rows=n * k)
    if bias is not None:
        _check("bias", bias, np.float32, (E, 2 * F))
    if gelu and oai:
        raise ValueError("one GLU: GeGLU (gelu) or swiglu_oai (oai), not both")
    glu = GLU_OAI if oai else GLU_GELU if gelu else GLU_SILU
    if n:
        function("matvec", f"moe_matvec_swiglu_{storage}_n{moe_tile_rows(n)}")(
            (-(-F // MATVEC_WARPS), n_tiles), (MATVEC_WARPS * 32,),
            (w_gate_up, h, start, order, tiles, _NULL if bias is None else bias, act, _i32(F), _i32(d), _i32(k),
             _i32(glu)))


def moe_gemm(act, w_down, start, tiles, out, n: int, k: int, bias=None) -> None:
    """Each expert's down product over its grouped positions: out[t] = act[t] @ w_down[e].T [+ bias[e]]. act
    [>=n k, F] f16/bf16 and w_down [E, d, F] in one storage; out f32 [>=n k, d], grouped order as act; bias f32
    [E, d] or None."""
    E, d, F = w_down.shape
    storage = _same_storage(("act", act), ("w_down", w_down))
    n_tiles = moe_tiles(n, k, E)
    _check_moe(storage, F, act, w_down, start, tiles, n_tiles, E)
    _check("act", act, _dtype_of(storage), (None, F), min_rows=n * k)
    _check("out", out, np.float32, (None, d), min_rows=n * k)
    if bias is not None:
        _check("bias", bias, np.float32, (E, d))
    if n:
        function("matvec", f"moe_matvec_{storage}_n{moe_tile_rows(n)}")(
            (-(-d // MATVEC_WARPS), n_tiles), (MATVEC_WARPS * 32,),
            (w_down, act, start, tiles, _NULL if bias is None else bias, out, _i32(d), _i32(F)))


def _check_moe(storage, k_in, x, w, start, tiles, n_tiles, E) -> None:
    """What both grouped products check: weights [E, *, k_in] and x of one storage that cuda/matvec.cu reads."""
    if not matvec_fits(storage, k_in) or x.data.ptr % 16 or w.data.ptr % 16:
        raise ValueError(f"the grouped expert products read 16-byte rows of f16/bf16: {storage}, {k_in} inputs")
    _check("w", w, _dtype_of(storage), (E, None, k_in))
    _check("start", start, np.int32, (E + 1,))
    _check("tiles", tiles, np.int32, (None, 2), min_rows=n_tiles)


def moe_sum(ye, pos, wts, out, n: int, accumulate: bool, scale: float = 1.0) -> None:
    """out[i] (+)= scale * sum over ranks r (in rank order) of ye[pos[i k + r]] * wts[i, r], i < n: a row's weighted
    expert outputs (accumulate: into the residual stream, scale its multiplier). ye f32 [>=n k, d]; pos int32
    [>=n k]; wts f32 [>=n, k]; out f32 [>=n, d]."""
    d, k = ye.shape[1], wts.shape[1]
    _check("ye", ye, np.float32, (None, d), min_rows=n * k)
    _check("pos", pos, np.int32, (None,), min_rows=n * k)
    _check("wts", wts, np.float32, (None, k), min_rows=n)
    _check("out", out, np.float32, (None, d), min_rows=n)
    if n:
        function("moe", "moe_sum_f32")((n,), (_threads(d, 256),),
                                       (ye, pos, wts, out, _i32(d), _i32(k), _i32(1 if accumulate else 0), _f32(scale)))


def nvcc_available() -> str | None:
    """Path of nvcc on PATH or in $CUDA_HOME/bin (for tests that compile the sources ahead of time)."""
    import shutil
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return None
