"""Each kernel family of cuda/ against NumPy: on a GPU (skips without one), and the same CUDA C run
on the CPU (tests/gpu/cuda_emu), on every machine.

Fresh random inputs for every check, outputs poisoned (NaN / max int) before each launch so that an
unwritten element fails, errors as ||got - want|| / ||want|| against float64 references.
"""
import threading
import time

import numpy as np
import pytest

from fastserve.backends.cuda import kernels as K

from .conftest import on_gpu
from .helpers import rel_err, round_to

STORAGES = ["f16", "bf16", "f32"]


def _np_storage(storage):
    return {"f16": np.float16, "bf16": np.uint16, "f32": np.float32}[storage]


def _to_storage(cp, a, storage):
    """float32 host array -> device array of storage (bf16 as uint16 words, rounded as the GPU rounds)."""
    a = np.ascontiguousarray(a, np.float32)
    if storage == "bf16":
        return cp.asarray((round_to(a, "bf16").view(np.uint32) >> 16).astype(np.uint16))
    return cp.asarray(a.astype(_np_storage(storage)))


def _from_storage(a, storage):
    a = np.asarray(a.get())
    if storage == "bf16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def _poisoned(cp, shape, dtype):
    dt = np.dtype(dtype)
    fill = np.nan if dt.kind == "f" else (0xFFFF if dt == np.uint16 else np.iinfo(dt).max)
    return cp.asarray(np.full(shape, fill, dt))


@pytest.mark.parametrize("storage", ["f16", "bf16"])
def test_cast_rounds_to_nearest_even(cupy, storage):
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    a = (rng.standard_normal(10007) * 10.0 ** rng.integers(-6, 4, 10007)).astype(np.float32)
    a[:4] = [0.0, -0.0, 65504.0, 1e-8]
    dst = _poisoned(cupy, a.shape, _np_storage(storage))
    K.cast_from_f32(cupy.asarray(a), dst)
    got = _from_storage(dst, storage)
    np.testing.assert_array_equal(got, round_to(a, storage))


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("scale", [1.0, float(np.sqrt(np.float32(640)))])    # gemma3 270M's sqrt(n_embd)
def test_embed_rows(cupy, storage, scale):
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    table = rng.standard_normal((300, 72)).astype(np.float32)
    tokens = rng.integers(0, 300, 9).astype(np.int32)
    x = _poisoned(cupy, (12, 72), np.float32)
    K.embed_rows(_to_storage(cupy, table, storage), cupy.asarray(np.r_[tokens, 0, 0, 0].astype(np.int32)), x, 9,
                 scale)
    # bit for bit fastserve/backends/cpu/ref/forward.py: the row, then one float32 multiplication
    np.testing.assert_array_equal(x.get()[:9], round_to(table, storage)[tokens] * np.float32(scale))
    assert np.isnan(x.get()[9:]).all()


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("d", [64, 576, 2048, 2050])
def test_rms_norm(cupy, storage, d):
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    x = (rng.standard_normal((7, d)) * 3).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-5) * w
    out = _poisoned(cupy, (7, d), _np_storage(storage))
    K.rms_norm(cupy.asarray(x), cupy.asarray(w), out, 7, 1e-5)
    tol = {"f16": 1e-3, "bf16": 8e-3, "f32": 1e-6}[storage]
    assert rel_err(_from_storage(out, storage), want) <= tol
    rows = np.array([6, 0, 3], np.int32)
    out = _poisoned(cupy, (4, d), _np_storage(storage))
    K.rms_norm(cupy.asarray(x), cupy.asarray(w), out, 3, 1e-5, rows=cupy.asarray(rows))
    assert rel_err(_from_storage(out, storage)[:3], want[rows]) <= tol


@pytest.mark.parametrize("d,scale", [(64, 1.0), (640, 1.0), (2050, 1.0), (640, 0.22)])
def test_rms_norm_add_is_the_sandwich_norm(cupy, d, scale):
    """x += rmsnorm(y) * w * scale (gemma3's post-attention and post-FFN norms; scale: a residual multiplier)
    against fastserve/backends/cpu/ref/layer_ops.rms_norm, the multiplier, then the add, as
    fastserve/backends/cpu/ref/forward.py makes them: within float32 rounding (the sum of squares is taken in
    another order); the rows past n untouched."""
    from fastserve.backends.cpu.ref.layer_ops import rms_norm
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    n, eps = 7, 1e-6
    y = (rng.standard_normal((n + 1, d)) * 30).astype(np.float32)
    x = rng.standard_normal((n + 1, d)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    want = x[:n] + rms_norm(y[:n], w, eps) * np.float32(scale)
    xd = cupy.asarray(x)
    K.rms_norm_add(cupy.asarray(y), cupy.asarray(w), xd, n, eps, scale=scale)
    got = xd.get()
    assert rel_err(got[:n], want) <= 1e-6
    assert rel_err(got[:n] - x[:n], want - x[:n]) <= 1e-6           # the normed part itself, not only the sum
    np.testing.assert_array_equal(got[n], x[n])


@pytest.mark.parametrize("scale,cap", [(1.0, 30.0), (0.125, 0.0), (0.125, 30.0)])
def test_logit_out_matches_the_reference(cupy, scale, cap):
    """logits = c tanh(l logits / c) (the logit multiplier l: granite's 1 / logit_scale, then final-logit
    soft-capping, cap 0: none) against fastserve/backends/cpu/ref/forward.py's steps (the float32 product, then
    layer_ops.softcap), within an ulp or two (expf against the reference's polynomial exp), first m rows only."""
    from fastserve.backends.cpu.ref.layer_ops import softcap
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    m, V = 5, 1003
    logits = (rng.standard_normal((m + 1, V)) * 40).astype(np.float32)
    logits[0, :4] = [0.0, -0.0, 1e-30, -500.0 / scale]
    want = logits[:m] * np.float32(scale)
    if cap:
        want = softcap(want, cap)
    dev = cupy.asarray(logits)
    K.logit_out(dev, m, scale, cap)
    got = dev.get()
    np.testing.assert_allclose(got[:m], want, rtol=3e-7, atol=3e-7 * max(cap, 1.0))
    if cap:
        assert np.abs(got[:m]).max() <= cap and got[0, 3] == -cap
    else:
        np.testing.assert_array_equal(got[:m], want)        # one float32 multiplication
    np.testing.assert_array_equal(got[m], logits[m])


def test_rope_matches_cpu_backend(cupy):
    from fastserve.backends.cpu.ref.layer_ops import apply_rope
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    H, Hkv, D, rope_dim, n_ctx = 6, 2, 32, 24, 100
    n = 11
    qkv = rng.standard_normal((n, (H + 2 * Hkv) * D)).astype(np.float32)
    pos = rng.integers(0, n_ctx, n).astype(np.int32)
    theta = np.outer(np.arange(n_ctx), 1e4 ** (-np.arange(rope_dim // 2) * 2.0 / rope_dim))
    cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
    want = qkv.copy()
    q = want[:, :H * D].reshape(n, H, D)
    k = want[:, H * D:(H + Hkv) * D].reshape(n, Hkv, D)
    apply_rope(q, cos[pos], sin[pos], rope_dim)
    apply_rope(k, cos[pos], sin[pos], rope_dim)
    want[:, :H * D] = q.reshape(n, -1)
    want[:, H * D:(H + Hkv) * D] = k.reshape(n, -1)
    dev = cupy.asarray(qkv)
    K.rope_qk(dev, cupy.asarray(cos), cupy.asarray(sin), cupy.asarray(pos), n, H, Hkv, D, rope_dim)
    got = dev.get()
    assert rel_err(got, want) <= 1e-6
    np.testing.assert_array_equal(got[:, (H + Hkv) * D:], qkv[:, (H + Hkv) * D:])     # V untouched


@pytest.mark.parametrize("storage", STORAGES)
def test_kv_store(cupy, storage):
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    H, Hkv, D, n_slots, n_ctx = 4, 2, 16, 3, 20
    n = 5
    qkv = rng.standard_normal((n, (H + 2 * Hkv) * D)).astype(np.float32)
    slots = np.array([0, 2, 2, 1, 0], np.int32)
    pos = np.array([0, 5, 6, 19, 1], np.int32)
    kc = cupy.asarray(np.zeros((n_slots, n_ctx, Hkv, D), _np_storage(storage)))
    vc = cupy.asarray(np.zeros((n_slots, n_ctx, Hkv, D), _np_storage(storage)))
    K.kv_store(cupy.asarray(qkv), kc, vc, cupy.asarray(slots), cupy.asarray(pos), n, H)
    k, v = _from_storage(kc, storage), _from_storage(vc, storage)
    for t in range(n):
        np.testing.assert_array_equal(k[slots[t], pos[t]].reshape(-1), round_to(qkv[t, H * D:(H + Hkv) * D], storage))
        np.testing.assert_array_equal(v[slots[t], pos[t]].reshape(-1), round_to(qkv[t, (H + Hkv) * D:], storage))
    assert np.count_nonzero(np.abs(k).sum(axis=(2, 3))) == n


def _attention_ref(q, k, v, slots, pos, H, Hkv, window=0, sinks=None):
    """float64 causal GQA attention: q [n, H, D]; k, v [n_slots, n_ctx, Hkv, D] float32; window > 0: the
    query at p sees keys p - window < k <= p (the CPU's contract for a local layer); sinks [H]: head h's
    softmax gets one more logit sinks[h] whose column is dropped (it only adds to the denominator)."""
    n, _, D = q.shape
    G = H // Hkv
    out = np.zeros((n, H, D))
    for t in range(n):
        first = max(0, pos[t] + 1 - window) if window else 0
        for h in range(H):
            kk = k[slots[t], first:pos[t] + 1, h // G].astype(np.float64)
            vv = v[slots[t], first:pos[t] + 1, h // G].astype(np.float64)
            s = kk @ q[t, h].astype(np.float64) / np.sqrt(D)
            mx = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            p = np.exp(s - mx)
            extra = 0.0 if sinks is None else np.exp(float(sinks[h]) - mx)
            out[t, h] = p @ vv / (p.sum() + extra)
    return out.reshape(n, H * D)


def _attention_inputs(rng, storage, H, Hkv, D, n_ctx, n, n_slots=3):
    k = round_to(rng.standard_normal((n_slots, n_ctx, Hkv, D)).astype(np.float32), storage)
    v = round_to(rng.standard_normal((n_slots, n_ctx, Hkv, D)).astype(np.float32), storage)
    qkv = (rng.standard_normal((n, (H + 2 * Hkv) * D)) * 2).astype(np.float32)
    slots = rng.integers(0, n_slots, n).astype(np.int32)
    pos = rng.integers(0, n_ctx, n).astype(np.int32)
    return qkv, k, v, slots, pos


def _run_attention(cupy, storage, qkv, k, v, slots, pos, H, chunk, window=0, sinks=None):
    """K.attention on fresh poisoned scratch and output; returns out as stored (f32 for f32 KV)."""
    n, (_, n_ctx, _, D) = len(slots), k.shape
    S = K.attention_splits(n_ctx, chunk)
    out_storage = "f32" if storage == "f32" else storage
    out = _poisoned(cupy, (n, H * D), _np_storage(out_storage))
    K.attention(cupy.asarray(qkv), _to_storage(cupy, k, storage), _to_storage(cupy, v, storage),
                cupy.asarray(slots), cupy.asarray(pos), _poisoned(cupy, (n, H, S, D), np.float32),
                _poisoned(cupy, (n, H, S, 2), np.float32), out, n, H, chunk, float(1 / np.sqrt(D)), window=window,
                sinks=None if sinks is None else cupy.asarray(np.asarray(sinks, np.float32)))
    return out, out_storage


_ATTN_TOL = {"f16": 2e-3, "bf16": 1e-2, "f32": 1e-5}


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("H,Hkv,D,n_ctx,chunk", [(4, 2, 16, 64, 8), (9, 3, 64, 512, 64), (32, 4, 64, 1024, 256),
                                                 (8, 8, 128, 300, 128), (8, 1, 40, 96, 1000),
                                                 (32, 4, 64, 2048, 64),      # TinyLlama's heads, 32 splits
                                                 (2, 1, 128, 4200, 16),      # splits past one combine tile
                                                 (4, 1, 256, 200, 64)])      # gemma3's heads: a warp per key
def test_attention(cupy, storage, H, Hkv, D, n_ctx, chunk):
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    n = 13
    qkv, k, v, slots, pos = _attention_inputs(rng, storage, H, Hkv, D, n_ctx, n)
    pos[:3] = [0, n_ctx - 1, min(chunk, n_ctx - 1)]          # first key only, the whole slot, a split edge
    out, out_storage = _run_attention(cupy, storage, qkv, k, v, slots, pos, H, chunk)
    want = _attention_ref(qkv[:, :H * D].reshape(n, H, D), k, v, slots, pos, H, Hkv)
    assert rel_err(_from_storage(out, out_storage), want) <= _ATTN_TOL[storage]


@pytest.mark.parametrize("H,Hkv,D", [(3, 3, 32), (4, 2, 24), (9, 3, 64), (8, 2, 128), (10, 2, 80), (12, 2, 96),
                                     (14, 2, 64), (64, 8, 56)])
def test_attention_every_group_size(cupy, H, Hkv, D):
    """Each G = H / Hkv (1..8, one kernel each) and head_dim class (<= 32, 64, 128, with idle lanes),
    at positions that end mid-step and past most of the 16 splits."""
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    n, n_ctx, chunk = 7, 400, 25
    qkv, k, v, slots, pos = _attention_inputs(rng, "f16", H, Hkv, D, n_ctx, n)
    pos[:4] = [0, 31, 32, n_ctx - 1]
    out, out_storage = _run_attention(cupy, "f16", qkv, k, v, slots, pos, H, chunk)
    want = _attention_ref(qkv[:, :H * D].reshape(n, H, D), k, v, slots, pos, H, Hkv)
    assert rel_err(_from_storage(out, out_storage), want) <= _ATTN_TOL["f16"]


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("H,Hkv,D,n_ctx,chunk,window", [(4, 2, 16, 64, 8, 8), (4, 1, 256, 160, 32, 20),
                                                        (6, 3, 64, 300, 16, 100), (2, 2, 32, 40, 64, 1)])
def test_attention_sliding_window(cupy, storage, H, Hkv, D, n_ctx, chunk, window):
    """A local layer (window > 0): the query at p sees keys p - window < k <= p, at positions before the
    window fills, at its edge, past it, at a split edge and at the slot's end; the answer differs from
    the whole-causal one (so the window is really applied)."""
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    n = 9
    qkv, k, v, slots, pos = _attention_inputs(rng, storage, H, Hkv, D, n_ctx, n)
    pos[:6] = [0, window - 1, window, min(chunk, n_ctx - 1), n_ctx - 1, min(2 * window + 3, n_ctx - 1)]
    out, out_storage = _run_attention(cupy, storage, qkv, k, v, slots, pos, H, chunk, window)
    q = qkv[:, :H * D].reshape(n, H, D)
    got = _from_storage(out, out_storage)
    assert rel_err(got, _attention_ref(q, k, v, slots, pos, H, Hkv, window)) <= _ATTN_TOL[storage]
    past = pos >= window
    assert rel_err(got[past], _attention_ref(q, k, v, slots, pos, H, Hkv)[past]) > 10 * _ATTN_TOL[storage]


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("H,Hkv,D,n_ctx,chunk,window", [(4, 2, 16, 64, 8, 0), (8, 1, 64, 300, 32, 16),
                                                        (2, 1, 32, 1040, 4, 0), (4, 4, 128, 160, 1000, 0)])
def test_attention_sinks(cupy, storage, H, Hkv, D, n_ctx, chunk, window):
    """gpt-oss's attention sinks (one logit per query head, in the denominator only), full and local
    layers, splits past one combine tile: a sink under the scores, one above them all (the max is the
    sink's), one far below (no effect); the answer differs from the one without sinks (so they are
    really applied), and sinks of -inf give the bits of no sinks."""
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    n = 9
    qkv, k, v, slots, pos = _attention_inputs(rng, storage, H, Hkv, D, n_ctx, n)
    pos[:4] = [0, 1, min(chunk, n_ctx - 1), n_ctx - 1]
    sinks = rng.uniform(2.0, 6.0, H).astype(np.float32)
    sinks[0], sinks[-1] = 40.0, -40.0
    q = qkv[:, :H * D].reshape(n, H, D)
    out, out_storage = _run_attention(cupy, storage, qkv, k, v, slots, pos, H, chunk, window, sinks)
    got = _from_storage(out, out_storage)
    assert rel_err(got, _attention_ref(q, k, v, slots, pos, H, Hkv, window, sinks)) <= _ATTN_TOL[storage]
    assert rel_err(got, _attention_ref(q, k, v, slots, pos, H, Hkv, window)) > 10 * _ATTN_TOL[storage]
    if n_ctx > 1000:
        return                          # the emulator's time: the bits of -inf sinks are checked on the others
    none, _ = _run_attention(cupy, storage, qkv, k, v, slots, pos, H, chunk, window)
    off, _ = _run_attention(cupy, storage, qkv, k, v, slots, pos, H, chunk, window, np.full(H, -np.inf))
    np.testing.assert_array_equal(off.get(), none.get())


def test_attention_sinks_checked(cupy):
    """A sinks array of the wrong length or type is refused before any launch."""
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    qkv, k, v, slots, pos = _attention_inputs(rng, "f32", 4, 2, 16, 64, 3)
    for bad in (np.zeros(3, np.float32), np.zeros(4, np.float64)):
        with pytest.raises((TypeError, ValueError), match="sinks"):
            K.attention(cupy.asarray(qkv), cupy.asarray(k), cupy.asarray(v), cupy.asarray(slots), cupy.asarray(pos),
                        cupy.zeros((3, 4, 8, 16), np.float32), cupy.zeros((3, 4, 8, 2), np.float32),
                        cupy.zeros((3, 64), np.float32), 3, 4, 8, 0.25, sinks=cupy.asarray(bad))


@pytest.mark.parametrize("storage", ["f16", "f32"])
def test_attention_token_does_not_depend_on_the_batch(cupy, storage):
    """A token's output is bitwise the same alone and among other tokens (other slots, positions)."""
    if getattr(cupy, "fake_kernels", "") == "numpy":
        pytest.skip("needs the real kernel")
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    H, Hkv, D, n_ctx, chunk, n = 32, 4, 64, 512, 16, 9
    qkv, k, v, slots, pos = _attention_inputs(rng, storage, H, Hkv, D, n_ctx, n)
    pos[4] = 300
    alone, _ = _run_attention(cupy, storage, qkv[4:5], k, v, slots[4:5], pos[4:5], H, chunk)
    for others in range(2):
        batch, _ = _run_attention(cupy, storage, qkv, k, v, slots, pos, H, chunk)
        np.testing.assert_array_equal(batch.get()[4], alone.get()[0])
        qkv[:4], pos[5:] = rng.standard_normal((4, qkv.shape[1])), rng.integers(0, n_ctx, n - 5)


def test_add_bias(cupy):
    """x[t] += bias for the first n rows only; a bias of the wrong length is refused."""
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    n, d = 5, 300
    x0 = rng.standard_normal((n + 2, d)).astype(np.float32)
    bias = rng.standard_normal(d).astype(np.float32)
    x = cupy.asarray(x0)
    K.add_bias(x, cupy.asarray(bias), n)
    np.testing.assert_array_equal(x.get()[:n], x0[:n] + bias)
    np.testing.assert_array_equal(x.get()[n:], x0[n:])
    with pytest.raises(ValueError, match="bias|x"):
        K.add_bias(x, cupy.asarray(bias[:7]), n)


def _gated(g, u, gelu: bool):
    """silu(g) * u, or GeGLU's gelu(g) * u in GELU's tanh form, in float64."""
    if gelu:
        return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u
    return g / (1 + np.exp(-g)) * u


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("gelu", [False, True])
def test_swiglu(cupy, storage, gelu):
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    n, n_ff = 6, 1536
    gu = (rng.standard_normal((n, 2 * n_ff)) * 4).astype(np.float32)
    gu[0, :3] = [-60.0, 60.0, 0.0]                 # exp's overflow side: 0 (not NaN), and g itself
    g, u = gu[:, :n_ff].astype(np.float64), gu[:, n_ff:].astype(np.float64)
    want = _gated(g, u, gelu)
    out = _poisoned(cupy, (n + 2, n_ff), _np_storage(storage))
    K.swiglu(cupy.asarray(gu), out, n, gelu=gelu)
    tol = {"f16": 1e-3, "bf16": 8e-3, "f32": 1e-6}[storage]
    got = _from_storage(out, storage)
    assert rel_err(got[:n], want) <= tol
    assert np.isnan(got[n:]).all()
    if gelu and storage == "f32":                  # fastserve/backends/cpu/ref/layer_ops.geglu, which the CPU runs
        from fastserve.backends.cpu.ref.layer_ops import geglu
        np.testing.assert_allclose(got[:n], geglu(gu[:, :n_ff], gu[:, n_ff:]), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("bias, norms", [(True, False), (False, True), (True, True)])
def test_qk_prep_is_bias_then_head_norms(cupy, bias, norms):
    """qwen2's q/k/v bias and qwen3's per-head q/k RMSNorm, as the CPU backend computes them."""
    from fastserve.backends.cpu.ref.layer_ops import head_norm
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    H, Hkv, D, n, eps = 4, 2, 48, 5, 1e-6
    qkv = rng.standard_normal((n, (H + 2 * Hkv) * D)).astype(np.float32)
    b = rng.standard_normal(qkv.shape[1]).astype(np.float32)
    qn, kn = (rng.standard_normal(D).astype(np.float32) for _ in range(2))
    want = qkv + b if bias else qkv.copy()
    if norms:
        ms = np.zeros(n * H, np.float32)
        for lo, hi, w in ((0, H, qn), (H, H + Hkv, kn)):
            heads = np.ascontiguousarray(want[:, lo * D:hi * D]).reshape(n, hi - lo, D)
            head_norm(heads, w, eps, ms)
            want[:, lo * D:hi * D] = heads.reshape(n, -1)
    dev = cupy.asarray(qkv)
    K.qk_prep(dev, cupy.asarray(b) if bias else None, cupy.asarray(qn) if norms else None,
              cupy.asarray(kn) if norms else None, n, H, Hkv, D, eps)
    got = dev.get()
    assert rel_err(got, want) <= 1e-6
    if not bias:
        np.testing.assert_array_equal(got[:, (H + Hkv) * D:], qkv[:, (H + Hkv) * D:])     # V untouched


@pytest.mark.parametrize("storage", STORAGES)
def test_rope_store_is_rope_then_kv_store(cupy, storage):
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    H, Hkv, D, rope_dim, n_slots, n_ctx, n = 9, 3, 64, 64, 2, 50, 7
    qkv = rng.standard_normal((n, (H + 2 * Hkv) * D)).astype(np.float32)
    slots = rng.integers(0, n_slots, n).astype(np.int32)
    pos = rng.permutation(n_ctx)[:n].astype(np.int32)
    theta = np.outer(np.arange(n_ctx), 1e5 ** (-np.arange(rope_dim // 2) * 2.0 / rope_dim))
    cos, sin = cupy.asarray(np.cos(theta).astype(np.float32)), cupy.asarray(np.sin(theta).astype(np.float32))
    caches = []
    for fused in (True, False):
        q = cupy.asarray(qkv)
        kc = cupy.asarray(np.zeros((n_slots, n_ctx, Hkv, D), _np_storage(storage)))
        vc = cupy.asarray(np.zeros((n_slots, n_ctx, Hkv, D), _np_storage(storage)))
        if fused:
            K.rope_store(q, cos, sin, kc, vc, cupy.asarray(slots), cupy.asarray(pos), n, H, rope_dim)
        else:
            K.rope_qk(q, cos, sin, cupy.asarray(pos), n, H, Hkv, D, rope_dim)
            K.kv_store(q, kc, vc, cupy.asarray(slots), cupy.asarray(pos), n, H)
        caches.append((q.get(), _from_storage(kc, storage), _from_storage(vc, storage)))
    for a, b in zip(*caches):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("storage", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 17, 32, 100])
@pytest.mark.parametrize("matvec_max_n", [0, 32, 1 << 20])
def test_gemm(cupy, storage, n, matvec_max_n):
    """cuBLAS (matvec_max_n 0, n > matvec_max_n, or f32) and cuda/matvec.cu (f16 / bf16 otherwise;
    past 32 rows in several block rows)."""
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    k, m = 576, 1003
    x = round_to(rng.standard_normal((n, k)).astype(np.float32), storage)
    w = round_to((rng.standard_normal((m, k)) / np.sqrt(k)).astype(np.float32), storage)
    base = rng.standard_normal((n, m)).astype(np.float32)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    out = _poisoned(cupy, (n + 1, m), np.float32)
    K.gemm(_to_storage(cupy, x, storage), _to_storage(cupy, w, storage), out, n, matvec_max_n=matvec_max_n)
    assert rel_err(out.get()[:n], want) <= 1e-5
    assert np.isnan(out.get()[n]).all()                           # rows past n untouched
    acc = cupy.asarray(base)              # the residual add, with granite's multiplier (0.22)
    K.gemm(_to_storage(cupy, x, storage), _to_storage(cupy, w, storage), acc, n, accumulate=True,
           matvec_max_n=matvec_max_n, scale=0.22)
    assert rel_err(acc.get(), 0.22 * want + base) <= 1e-5


@pytest.mark.parametrize("storage", ["f16", "bf16"])
def test_matvec_rows_do_not_depend_on_the_batch(cupy, storage):
    """cuda/matvec.cu sums each output in one order whatever n: a row's result is bitwise the same
    alone, in any batch size and in any 32-row group."""
    if getattr(cupy, "fake_kernels", "") == "numpy":
        pytest.skip("needs the real kernel (the NumPy emulation's BLAS sums in another order per n)")
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    k, m, most = 2048, 333, 70
    rows = rng.standard_normal((most, k)).astype(np.float32)
    w = _to_storage(cupy, rng.standard_normal((m, k)).astype(np.float32), storage)
    alone = _poisoned(cupy, (1, m), np.float32)
    K.gemm(_to_storage(cupy, rows[5:6], storage), w, alone, 1)
    for n in (6, 8, 17, 32, 33, 70):
        batch = rows[:n].copy()
        batch[:5] = rng.standard_normal((5, k))                 # other tokens around row 5
        out = _poisoned(cupy, (n, m), np.float32)
        K.gemm(_to_storage(cupy, batch, storage), w, out, n, matvec_max_n=1 << 20)
        np.testing.assert_array_equal(out.get()[5], alone.get()[0], err_msg=f"n={n}")


def _norm_inputs(rng, n_x, k):
    """float32 residual rows and a norm weight near 1."""
    return (rng.standard_normal((n_x, k)) * 3).astype(np.float32), (1 + rng.standard_normal(k) * 0.1).astype(np.float32)


def _fused_h(cupy, x, nw, eps, storage, rows=None):
    """The h a fused product reads, seen through norm_gemm with an identity matrix (exact: one h
    element times 1.0 plus zeros), checked against rmsnorm in float64 rounded to storage: the kernel
    sums inv in its own order, so an element may round the other way at a tie's edge (one ulp, rarely)."""
    k = x.shape[1]
    src = np.arange(len(x)) if rows is None else rows
    n = len(src)
    eye = _to_storage(cupy, np.eye(k, dtype=np.float32), storage)
    out = _poisoned(cupy, (n, k), np.float32)
    K.norm_gemm(cupy.asarray(x), cupy.asarray(nw), eye, out, _poisoned(cupy, (n, k), _np_storage(storage)), n, eps,
                rows=None if rows is None else cupy.asarray(rows))
    h = out.get()
    x64 = x[src].astype(np.float64)
    want = round_to((x64 / np.sqrt((x64 * x64).mean(axis=1, keepdims=True) + eps) * nw).astype(np.float32), storage)
    assert np.array_equal(round_to(h, storage), h)               # rounded to storage, as rms_norm.cu
    ulp = np.abs(round_to(want * np.float32(1 + 2 ** -7), storage) - want)   # >= one ulp of storage
    assert (np.abs(h - want) <= ulp).all()
    assert np.count_nonzero(h != want) <= max(2, h.size // 1000)
    return h.astype(np.float64)


@pytest.mark.parametrize("storage", ["f16", "bf16"])
@pytest.mark.parametrize("n", [1, 3, 8, 17, 32])
@pytest.mark.parametrize("with_rows", [False, True])
def test_norm_gemm_is_rms_norm_then_gemm(cupy, storage, n, with_rows):
    """cuda/matvec.cu norm_matvec (the matvec path): h as rmsnorm rounded to storage (_fused_h), then
    the product against float64 within gemm's tolerance; with rows, x rows picked by index (the final
    norm of the output rows)."""
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    k, m, eps, n_x = 576, 1003, 1e-5, 40
    x, nw = _norm_inputs(rng, n_x, k)
    w = round_to((rng.standard_normal((m, k)) / np.sqrt(k)).astype(np.float32), storage)
    rows = rng.permutation(n_x)[:n].astype(np.int32) if with_rows else None
    h_seen = _poisoned(cupy, (n, k), _np_storage(storage))
    want = _fused_h(cupy, x if with_rows else x[:n], nw, eps, storage, rows) @ w.T.astype(np.float64)
    out = _poisoned(cupy, (n + 1, m), np.float32)
    K.norm_gemm(cupy.asarray(x if with_rows else x[:n]), cupy.asarray(nw), _to_storage(cupy, w, storage), out,
                h_seen, n, eps, rows=None if rows is None else cupy.asarray(rows))
    assert rel_err(out.get()[:n], want) <= 1e-5
    assert np.isnan(out.get()[n]).all()                           # rows past n untouched
    assert np.isnan(_from_storage(h_seen, storage)).all()         # h is never stored on the matvec path


@pytest.mark.parametrize("storage", ["f16", "bf16"])
@pytest.mark.parametrize("n,gelu", [(1, False), (3, False), (8, False), (17, False), (32, False),
                                    (1, True), (5, True), (32, True)])
def test_norm_gemm_swiglu_is_rms_norm_gemm_swiglu(cupy, storage, n, gelu):
    """cuda/matvec.cu norm_matvec_swiglu: silu(g) * u (gelu: gelu(g) * u) of the gate/up product of h (_fused_h) against
    float64 within swiglu's tolerance, and against the three launches it replaces (rms_norm, gemm, swiglu)."""
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    k, n_ff, eps = 576, 501, 1e-5
    tol = {"f16": 1e-3, "bf16": 8e-3}[storage]
    x, nw = _norm_inputs(rng, n, k)
    w = round_to((rng.standard_normal((2 * n_ff, k)) * 2 / np.sqrt(k)).astype(np.float32), storage)
    gu = _fused_h(cupy, x, nw, eps, storage) @ w.T.astype(np.float64)
    want = _gated(gu[:, :n_ff], gu[:, n_ff:], gelu)
    act = _poisoned(cupy, (n + 1, n_ff), _np_storage(storage))
    h = _poisoned(cupy, (n, k), _np_storage(storage))
    gu_d = _poisoned(cupy, (n, 2 * n_ff), np.float32)
    w_d = _to_storage(cupy, w, storage)
    K.norm_gemm_swiglu(cupy.asarray(x), cupy.asarray(nw), w_d, act, h, gu_d, n, eps, gelu=gelu)
    got = _from_storage(act, storage)
    assert rel_err(got[:n], want) <= tol
    assert np.isnan(got[n]).all()
    assert np.isnan(gu_d.get()).all()                             # gu is never stored on the matvec path
    three = _poisoned(cupy, (n, n_ff), _np_storage(storage))
    K.rms_norm(cupy.asarray(x), cupy.asarray(nw), h, n, eps)
    K.gemm(h, w_d, gu_d, n)
    K.swiglu(gu_d, three, n, gelu=gelu)
    assert rel_err(got[:n], _from_storage(three, storage)) <= tol


@pytest.mark.parametrize("storage", ["f16", "bf16"])
def test_fused_products_rows_do_not_depend_on_the_batch(cupy, storage):
    """norm_matvec and norm_matvec_swiglu: a row alone and the same row in a batch of 33 (matvec_max_n
    raised past it), its neighbours different, are bitwise equal: row 32 (the second block row) and
    row 5 (in a group of 32, too large to stage h in shared memory, which a row alone does)."""
    if getattr(cupy, "fake_kernels", "") == "numpy":
        pytest.skip("needs the real kernel (the NumPy emulation's BLAS sums in another order per n)")
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    k, m, n_ff, eps, n = 2048, 133, 71, 1e-5, 33
    nw = cupy.asarray((1 + rng.standard_normal(k) * 0.1).astype(np.float32))
    w = _to_storage(cupy, rng.standard_normal((m, k)).astype(np.float32) / np.sqrt(k), storage)
    wgu = _to_storage(cupy, rng.standard_normal((2 * n_ff, k)).astype(np.float32) / np.sqrt(k), storage)
    batch = rng.standard_normal((n, k)).astype(np.float32)

    def run(rows):
        nr = len(rows)
        x = cupy.asarray(rows)
        out = _poisoned(cupy, (nr, m), np.float32)
        act = _poisoned(cupy, (nr, n_ff), _np_storage(storage))
        h = _poisoned(cupy, (nr, k), _np_storage(storage))
        K.norm_gemm(x, nw, w, out, h, nr, eps, matvec_max_n=1 << 20)
        K.norm_gemm_swiglu(x, nw, wgu, act, h, _poisoned(cupy, (nr, 2 * n_ff), np.float32), nr, eps,
                           matvec_max_n=1 << 20)
        return out.get(), np.asarray(act.get())

    out, act = run(batch)
    for r in (32, 5):
        out1, act1 = run(batch[r:r + 1])
        np.testing.assert_array_equal(out1[0], out[r], err_msg=f"row {r}")
        np.testing.assert_array_equal(act1[0], act[r], err_msg=f"row {r}")


def test_argmax_ties_go_to_the_lowest_id(cupy):
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    V = 49152
    logits = rng.standard_normal((5, V)).astype(np.float32)
    logits[1, [7, 70, 40000]] = 50.0               # a three-way tie
    logits[2, :] = -np.inf
    logits[3, 100] = np.nan                        # NaN is never chosen
    logits[3, 200] = 60.0
    out = _poisoned(cupy, 6, np.int32)
    K.argmax_rows(cupy.asarray(logits), out, 5)
    got = out.get()[:5]
    want = np.argmax(np.nan_to_num(logits, nan=-np.inf), axis=1)
    assert got.tolist() == want.tolist() and got[1] == 7 and got[2] == 0 and got[3] == 200


def test_synchronize_releases_the_gil(cupy):
    """While the decode thread waits for the device, other Python threads run (DESIGN: the decode
    thread must not hold the GIL while it waits)."""
    if not on_gpu(cupy):
        pytest.skip("needs the real CuPy and a GPU")
    n = 4096
    a = cupy.asarray(np.random.default_rng().standard_normal((n, n)).astype(np.float32))
    out = cupy.zeros((n, n), np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(3):                         # warm-up: cuBLAS handle, kernels
            K.gemm(a, a, out, n)
    stream.synchronize()
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    th = threading.Thread(target=spin)
    with stream:
        for _ in range(60):                        # ~0.1 s or more of device work
            K.gemm(a, a, out, n)
    th.start()
    time.sleep(0.001)
    t0, before = time.perf_counter(), ticks[0]
    stream.synchronize()
    waited, gained = time.perf_counter() - t0, ticks[0] - before
    stop.set()
    th.join()
    assert waited > 0.02, f"the device work took only {waited * 1e3:.1f} ms: the test proves nothing"
    assert gained > 1000, f"another thread ran {gained} loop turns in {waited * 1e3:.1f} ms of synchronize()"


# -- a mixture of experts (cuda/moe.cu and the grouped products of cuda/matvec.cu) ---------------------

def _moe_route_ref(route, k, scale):
    """The CPU's _route in float64: softmax, top k (ties to the lower id), normalised over the k, times scale."""
    p = np.exp(route - route.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    sel = np.argsort(-p, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, sel, axis=1)
    return sel, w / np.maximum(w.sum(axis=1, keepdims=True), 2.0 ** -14) * scale


def test_moe_route(cupy):
    """Each row's top-k experts by rank and their normalised weights (the row of ties goes to the lower ids)."""
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    n, E, k = 9, 8, 3
    route = (rng.standard_normal((n + 1, E)) * 2).astype(np.float32)
    route[2] = [1.0, 3.0, 3.0, 0.0, 3.0, 3.0, -1.0, 2.0]              # four ways tied: experts 1, 2, 4
    sel, wts = _poisoned(cupy, (n + 1, k), np.int32), _poisoned(cupy, (n + 1, k), np.float32)
    K.moe_route(cupy.asarray(route), sel, wts, n, scale=1.5)
    want_sel, want_w = _moe_route_ref(route[:n].astype(np.float64), k, 1.5)
    np.testing.assert_array_equal(sel.get()[:n], want_sel)
    np.testing.assert_allclose(wts.get()[:n], want_w, rtol=2e-6)
    assert (sel.get()[n] == np.iinfo(np.int32).max).all()             # rows past n untouched


def test_moe_route_topk_softmax_with_bias(cupy):
    """gpt-oss's routing: the router's bias added to the logits, the top k logits (ties to the lower id),
    the softmax over those k, times scale; without the bias the experts differ (so it is really added)."""
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    n, E, k = 9, 8, 4
    route = (rng.standard_normal((n + 1, E)) * 2).astype(np.float32)
    bias = (rng.integers(-8, 9, E) / 4).astype(np.float32)        # quarters: route[2] + bias is exact
    route[2] = np.array([1.0, 3.0, 3.0, 0.0, 3.0, 3.0, -1.0, 2.0], np.float32) - bias   # ties after the bias
    sel, wts = _poisoned(cupy, (n + 1, k), np.int32), _poisoned(cupy, (n + 1, k), np.float32)
    K.moe_route(cupy.asarray(route), sel, wts, n, scale=1.5, bias=cupy.asarray(bias), topk_softmax=True)
    logits = route[:n].astype(np.float64) + bias
    want_sel = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(logits, want_sel, axis=1)
    want_w = np.exp(top - top[:, :1]) / np.exp(top - top[:, :1]).sum(axis=1, keepdims=True) * 1.5
    np.testing.assert_array_equal(sel.get()[:n], want_sel)
    np.testing.assert_array_equal(sel.get()[2], [1, 2, 4, 5])
    np.testing.assert_allclose(wts.get()[:n], want_w, rtol=2e-6)
    assert (sel.get()[n] == np.iinfo(np.int32).max).all()             # rows past n untouched
    K.moe_route(cupy.asarray(route), sel, wts, n, scale=1.5, topk_softmax=True)
    assert (sel.get()[:n] != want_sel).any()
    with pytest.raises(ValueError, match="bias"):
        K.moe_route(cupy.asarray(route), sel, wts, n, bias=cupy.asarray(bias[:3]), topk_softmax=True)


def test_moe_router_is_the_cpus_float32_product(cupy):
    """The router's logits from the float32 residual stream, its norm and a float32 router (E = 20: the last
    block's warps partly past the experts): within float32 rounding of the CPU's RMSNorm then product in float64,
    each row's logits the same alone as among the others (bit for bit), rows past n untouched."""
    from fastserve.backends.cpu.ref.layer_ops import rms_norm
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    n, d, E = 5, 96, 20
    x = (rng.standard_normal((n + 1, d)) * 3).astype(np.float32)
    norm_w = rng.uniform(0.5, 1.5, d).astype(np.float32)
    router = (rng.standard_normal((E, d)) / np.sqrt(d)).astype(np.float32)
    route = _poisoned(cupy, (n + 1, E), np.float32)
    xd, nwd, rd = cupy.asarray(x), cupy.asarray(norm_w), cupy.asarray(router)
    K.moe_router(xd, nwd, rd, route, n, 1e-6)
    want = rms_norm(x[:n], norm_w, 1e-6).astype(np.float64) @ router.T.astype(np.float64)
    np.testing.assert_allclose(route.get()[:n], want, rtol=1e-5, atol=1e-5)
    assert np.isnan(route.get()[n]).all()                               # rows past n untouched
    alone = _poisoned(cupy, (1, E), np.float32)
    K.moe_router(cupy.asarray(x[3:4]), nwd, rd, alone, 1, 1e-6)
    np.testing.assert_array_equal(alone.get()[0], route.get()[3])
    with pytest.raises(TypeError, match="router"):
        K.moe_router(xd, nwd, cupy.asarray(router.astype(np.float16)), route, n, 1e-6)


@pytest.mark.parametrize("E, k", [(128, 8), (512, 8), (40, 40)])
@pytest.mark.parametrize("gating", ["softmax", "topk_softmax"])
def test_moe_route_many_experts_is_the_cpus(cupy, E, k, gating):
    """The block's choice with the experts spread over several warps (E = 128: 4 warps of one expert per thread;
    512: 8 warps of two; 40: every expert chosen) is the CPU's (fastserve/backends/cpu/ref/forward.py route, which
    _forward.pyx's _route equals bit for bit): the same experts in the same order, ties across warps to the lower
    id, weights within float32 rounding (exp and the softmax's sum in another order)."""
    from fastserve.backends.cpu.ref.forward import route as cpu_route
    rng = np.random.default_rng(E + k)   # fixed: a failure must reproduce
    n = 6
    logits = (rng.standard_normal((n + 1, E)) * 2).astype(np.float32)
    logits[1] = np.round(logits[1])                                    # ties everywhere
    logits[2] = 0.0
    logits[2, [E - 1, E // 2, 33, 3]] = 5.0                            # tied leaders in different warps
    logits[3, ::2] = np.nan                                            # a NaN is never chosen (top k)
    rows = [0, 1, 2, 4, 5]          # row 3 apart: the twin's NaN handling is not _forward.pyx's (its max, its order)
    sel, wts = _poisoned(cupy, (n + 1, k), np.int32), _poisoned(cupy, (n + 1, k), np.float32)
    K.moe_route(cupy.asarray(logits), sel, wts, n, scale=1.5, topk_softmax=gating == "topk_softmax")
    want_sel, want_w = cpu_route(logits[:n], k, 1.5, gating)
    np.testing.assert_array_equal(sel.get()[rows], want_sel[rows])
    np.testing.assert_allclose(wts.get()[rows], want_w[rows], rtol=2e-6)
    np.testing.assert_array_equal(sel.get()[2, :4], sorted([E - 1, E // 2, 33, 3]))
    assert (sel.get()[n] == np.iinfo(np.int32).max).all()             # rows past n untouched
    if gating == "topk_softmax":    # _route_topk's: the valid logits' top k, their softmax; no candidate left: 0
        valid = min(k, E // 2)
        np.testing.assert_array_equal(sel.get()[3, :valid], want_sel[3, :valid])
        assert (sel.get()[3, valid:] == 0).all()
        top = logits[3, want_sel[3, :valid]].astype(np.float64)
        want_w3 = np.exp(top - top[0]) / np.exp(top - top[0]).sum() * 1.5
        if valid < k:               # expert 0's logit, NaN here, in the softmax: every weight NaN, as the CPU's
            want_w3[:] = np.nan
        np.testing.assert_allclose(wts.get()[3, :valid], want_w3, rtol=2e-6)


@pytest.mark.parametrize("n", [1, 3, 40])
def test_moe_group_is_a_counting_sort(cupy, n):
    """Pairs grouped by expert (batch order within one), pos its inverse, the tiles cover each expert's pairs
    in order, tile_rows at a time, and the rest of the tile list is unused (-1)."""
    rng = np.random.default_rng(n)
    E, k = 8, 2
    sel = np.stack([rng.choice(E, k, replace=False) for _ in range(n)]).astype(np.int32)
    sel[0] = [5, 1]
    n_tiles, rows = K.moe_tiles(n, k, E), K.moe_tile_rows(n)
    start, order, pos = cupy.zeros(E + 1, np.int32), _poisoned(cupy, n * k, np.int32), _poisoned(cupy, n * k, np.int32)
    tiles = _poisoned(cupy, (n_tiles, 2), np.int32)
    K.moe_group(cupy.asarray(sel), n, E, start, order, pos, tiles)
    pairs = sel.reshape(-1)
    want = np.argsort(pairs, kind="stable")
    np.testing.assert_array_equal(order.get(), want)
    np.testing.assert_array_equal(pos.get()[want], np.arange(n * k))
    np.testing.assert_array_equal(start.get(), np.searchsorted(pairs[want], np.arange(E + 1)))
    st = start.get()
    cover = [(e, t0) for e in range(E) for t0 in range(st[e], st[e + 1], rows)]
    np.testing.assert_array_equal(tiles.get()[:len(cover)].reshape(-1, 2), np.array(cover).reshape(-1, 2))
    assert (tiles.get()[len(cover):, 0] == -1).all()


def _moe_ffn(cupy, storage, h, wgu, wd, sel, wts, base, oai=False, bgu=None, bd=None):
    """The device's moe_group, grouped products and moe_sum over the rows of h: base + each row's sum (oai:
    gpt-oss's swiglu_oai; bgu [E, 2 F], bd [E, d]: the experts' biases)."""
    n, k, E = len(h), sel.shape[1], len(wgu)
    F, d = wd.shape[2], wd.shape[1]
    start, order, pos = cupy.zeros(E + 1, np.int32), cupy.zeros(n * k, np.int32), cupy.zeros(n * k, np.int32)
    tiles = cupy.zeros((K.moe_tiles(n, k, E), 2), np.int32)
    act, ye = _poisoned(cupy, (n * k, F), _np_storage(storage)), _poisoned(cupy, (n * k, d), np.float32)
    K.moe_group(cupy.asarray(sel), n, E, start, order, pos, tiles)
    K.moe_gemm_swiglu(_to_storage(cupy, h, storage), wgu, start, order, tiles, act, n, k, oai=oai,
                      bias=None if bgu is None else cupy.asarray(bgu))
    K.moe_gemm(act, wd, start, tiles, ye, n, k, bias=None if bd is None else cupy.asarray(bd))
    x = cupy.asarray(base)
    K.moe_sum(ye, pos, cupy.asarray(wts), x, n, accumulate=True, scale=0.5)
    return x.get()


@pytest.mark.parametrize("storage", ["f16", "bf16"])
def test_moe_ffn_and_its_batch_invariance(cupy, storage):
    """x += 0.5 * sum over a row's experts (by rank) of w_r * down_e(swiglu(gate_up_e h)), against float64 on
    the rounded inputs; and a row's result bitwise the same alone and among 37 rows sharing its experts."""
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    n, d, F, E, k = 37, 64, 48, 6, 2
    h = round_to(rng.standard_normal((n, d)).astype(np.float32), storage)
    wgu_h = round_to((rng.standard_normal((E, 2 * F, d)) / np.sqrt(d)).astype(np.float32), storage)
    wd_h = round_to((rng.standard_normal((E, d, F)) / np.sqrt(F)).astype(np.float32), storage)
    wgu, wd = _to_storage(cupy, wgu_h, storage), _to_storage(cupy, wd_h, storage)
    sel = np.stack([rng.choice(E, k, replace=False) for _ in range(n)]).astype(np.int32)
    wts = rng.random((n, k)).astype(np.float32)
    base = rng.standard_normal((n, d)).astype(np.float32)
    got = _moe_ffn(cupy, storage, h, wgu, wd, sel, wts, base)
    want = base.astype(np.float64).copy()
    for i in range(n):
        for r in range(k):
            gu = wgu_h[sel[i, r]].astype(np.float64) @ h[i]
            act = round_to(_gated(gu[:F], gu[F:], False).astype(np.float32), storage).astype(np.float64)
            want[i] += 0.5 * wts[i, r] * (wd_h[sel[i, r]].astype(np.float64) @ act)
    assert rel_err(got - base, want - base) <= {"f16": 2e-3, "bf16": 1e-2}[storage]
    if getattr(cupy, "fake_kernels", "") == "numpy":
        return                          # the NumPy emulation's sums are not batch-invariant (BLAS)
    for i in (0, 17):
        alone = _moe_ffn(cupy, storage, h[i:i + 1], wgu, wd, sel[i:i + 1], wts[i:i + 1], base[i:i + 1])
        np.testing.assert_array_equal(alone[0], got[i], err_msg=f"row {i}")


def _swiglu_oai(g, u):
    """gpt-oss's SwiGLU in float64: x sigmoid(1.702 x) (y + 1), x = min(g, 7), y = clamp(u, -7, 7)."""
    x, y = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
    return x / (1 + np.exp(-1.702 * x)) * (y + 1)


@pytest.mark.parametrize("storage", ["f16", "bf16"])
def test_moe_ffn_gpt_oss(cupy, storage):
    """gpt-oss's experts: gate | up biases before swiglu_oai (its clamps bite: sums past +-7), down biases
    after the down product, against float64 on the rounded inputs; without the biases, or with plain SwiGLU,
    the answer is far off (so each is really applied); a row bitwise the same alone and among 29."""
    rng = np.random.default_rng(1234)   # fixed: a failure must reproduce
    n, d, F, E, k = 29, 64, 48, 6, 3
    h = round_to(rng.standard_normal((n, d)).astype(np.float32), storage)
    wgu_h = round_to((rng.standard_normal((E, 2 * F, d)) * 5 / np.sqrt(d)).astype(np.float32), storage)
    wd_h = round_to((rng.standard_normal((E, d, F)) / np.sqrt(F)).astype(np.float32), storage)
    wgu, wd = _to_storage(cupy, wgu_h, storage), _to_storage(cupy, wd_h, storage)
    bgu = (rng.standard_normal((E, 2 * F)) * 2).astype(np.float32)
    bd = (rng.standard_normal((E, d)) * 4).astype(np.float32)
    sel = np.stack([rng.choice(E, k, replace=False) for _ in range(n)]).astype(np.int32)
    wts = rng.random((n, k)).astype(np.float32)
    base = rng.standard_normal((n, d)).astype(np.float32)
    got = _moe_ffn(cupy, storage, h, wgu, wd, sel, wts, base, oai=True, bgu=bgu, bd=bd)

    def want(glu, biases):
        out, seen = base.astype(np.float64).copy(), []
        for i in range(n):
            for r in range(k):
                e = sel[i, r]
                gu = wgu_h[e].astype(np.float64) @ h[i] + (bgu[e] if biases else 0.0)
                seen.append(gu)
                act = round_to(glu(gu[:F], gu[F:]).astype(np.float32), storage).astype(np.float64)
                out[i] += 0.5 * wts[i, r] * (wd_h[e].astype(np.float64) @ act + (bd[e] if biases else 0.0))
        return out, np.array(seen)

    full, seen = want(_swiglu_oai, True)
    assert (seen[:, :F] > 7).any() and (seen[:, F:] > 7).any() and (seen[:, F:] < -7).any()   # the clamps bite
    tol = {"f16": 2e-3, "bf16": 1e-2}[storage]
    assert rel_err(got - base, full - base) <= tol
    assert rel_err(got - base, want(_swiglu_oai, False)[0] - base) > 10 * tol
    assert rel_err(got - base, want(lambda g, u: _gated(g, u, False), True)[0] - base) > 10 * tol
    with pytest.raises(ValueError, match="bias"):
        _moe_ffn(cupy, storage, h, wgu, wd, sel, wts, base, oai=True, bgu=bgu[:, :F], bd=bd)
    if getattr(cupy, "fake_kernels", "") == "numpy":
        return                          # the NumPy emulation's sums are not batch-invariant (BLAS)
    for i in (0, 11):
        alone = _moe_ffn(cupy, storage, h[i:i + 1], wgu, wd, sel[i:i + 1], wts[i:i + 1], base[i:i + 1], oai=True,
                         bgu=bgu, bd=bd)
        np.testing.assert_array_equal(alone[0], got[i], err_msg=f"row {i}")
