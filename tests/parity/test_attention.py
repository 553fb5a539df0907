"""fastserve._attention against its NumPy twin fastserve.ref.attention: cache bytes and outputs bit for
bit, every cache type and kernel; outputs independent of batch, chunking and threads; close to exact
softmax attention in float64."""
import numpy as np
import pytest

from fastserve import _attention as C
from fastserve._pool import Pool
from fastserve.ref import attention as R

TYPES = ("f32", "f16", "q8_0")


def _caches(mod, type_k, type_v, n_slots, n_ctx, Hkv, D):
    n_tiles = -(-n_ctx // C.KT)
    k = np.zeros((n_slots, n_tiles, Hkv, mod.k_tile_bytes(type_k, D)), np.uint8)
    v = np.zeros((n_slots, n_ctx, Hkv, mod.row_bytes(type_v, D)), np.uint8)
    return k, v


def _filled(type_k, type_v, n_slots, n_ctx, Hkv, D, seed):
    """Caches with every position of every slot written by the C store (random K/V, like a model's)."""
    rng = np.random.default_rng(seed)
    kc, vc = _caches(C, type_k, type_v, n_slots, n_ctx, Hkv, D)
    n = n_slots * n_ctx
    kx = (rng.standard_normal((n, Hkv, D)) * 2).astype(np.float32)
    vx = rng.standard_normal((n, Hkv, D)).astype(np.float32)
    slots = np.repeat(np.arange(n_slots), n_ctx).astype(np.int64)
    pos = np.tile(np.arange(n_ctx), n_slots).astype(np.int64)
    C.store(type_k, type_v, kc, vc, kx, vx, slots, pos)
    return kc, vc


def _run(attn, q, kc, vc, tk, tv, slots, pos, scale):
    out = np.full((len(q), q.shape[1] * q.shape[2]), np.nan, np.float32)
    attn(q, kc, vc, tk, tv, np.asarray(slots, np.int64), np.asarray(pos, np.int64), out, scale)
    return out


def _same_bits(a, b):
    assert a.shape == b.shape
    bad = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
    assert len(bad) == 0, f"{len(bad)} of {a.size} differ, first at {bad[0]}: {a.flat[bad[0]]!r} vs {b.flat[bad[0]]!r}"


@pytest.mark.parametrize("t", TYPES)
def test_encode_decode_match_twin(t):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((50, 64)) * np.exp(rng.uniform(-12, 12, (50, 1)))).astype(np.float32)
    x[0] = 0
    x[1, :32] = 1e-9                                  # scale rounds to 0 in fp16: block of zeros
    x[2, 5] = 70000.0                                 # past fp16's range
    x[3] = np.float32(2.0 ** -20) * np.arange(64)     # fp16 subnormals
    _same_bits(C.encode_rows(t, x), R.encode_rows(t, x))
    enc = C.encode_rows(t, x)
    _same_bits(C.decode_rows(t, enc, 64), R.decode_rows(t, enc, 64))
    if t != "f32":
        amax = np.abs(x).max(axis=1)
        ok = (amax < 60000) & (amax > 1e-2)              # fp16 normals (q8_0: its scale too)
        dec = C.decode_rows(t, enc, 64)
        tol = 1e-3 if t == "f16" else 1.0 / 127
        err = np.abs(dec[ok] - x[ok]).max(axis=1) / np.maximum(np.abs(x[ok]).max(axis=1), 1e-30)
        assert np.all(err <= tol) and ok.sum() > 20


def test_exp2_matches_twin_and_is_accurate():
    x = np.concatenate([-np.linspace(0, 130, 20001), [-np.inf, -126.0, -126.5, 0.0, -0.0]]).astype(np.float32)
    _same_bits(C.exp2(x), R.exp2(x))
    y = C.exp2(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    norm = x >= -126
    assert np.max(np.abs(y[norm] - want[norm]) / want[norm]) < 4e-7
    assert C.exp2(np.zeros(1, np.float32))[0] == 1.0
    assert np.all(y[~norm] == 0)


@pytest.mark.parametrize("tk,tv", [(t, t) for t in TYPES] + [("f16", "q8_0"), ("q8_0", "f32")])
def test_store_and_move_rows_match_twin(tk, tv):
    D, Hkv, n_slots, n_ctx = 64, 3, 2, 100
    rng = np.random.default_rng(2)
    kx = rng.standard_normal((40, Hkv, D)).astype(np.float32)
    vx = rng.standard_normal((40, Hkv, D)).astype(np.float32)
    slots = rng.integers(0, n_slots, 40)
    pos = rng.integers(0, n_ctx, 40)
    caches = {}
    for mod in (C, R):
        kc, vc = _caches(mod, tk, tv, n_slots, n_ctx, Hkv, D)
        mod.store(tk, tv, kc, vc, kx, vx, slots, pos)
        caches[mod] = (kc, vc)
    assert np.array_equal(caches[C][0], caches[R][0]) and np.array_equal(caches[C][1], caches[R][1])
    # a slot's rows out (save) and back into another slot (restore), both implementations
    n = 70
    for mod in (C, R):
        kc, vc = caches[mod]
        kr = np.zeros((n, Hkv, mod.row_bytes(tk, D)), np.uint8)
        vr = np.zeros((n, Hkv, mod.row_bytes(tv, D)), np.uint8)
        mod.move_rows(tk, tv, kc, vc, D, 0, 20, kr, vr, False)
        mod.move_rows(tk, tv, kc, vc, D, 1, 5, kr, vr, True)
        caches[mod] = (kr, vr, kc, vc)
    for a, b in zip(caches[C], caches[R]):
        assert np.array_equal(a, b)
    kr, vr, kc, vc = caches[C]
    K, V = R.cache_values(tk, tv, kc, vc, D)
    assert np.array_equal(K[0, 20:90], K[1, 5:75]) and np.array_equal(V[0, 20:90], V[1, 5:75])


CASES = [  # D, Hkv, G, n_slots, n_ctx
    (64, 3, 3, 2, 300), (32, 2, 1, 3, 200), (128, 2, 4, 2, 200), (48, 1, 3, 2, 150), (256, 1, 2, 1, 130),
]


@pytest.mark.parametrize("tk,tv", [(t, t) for t in TYPES] + [("f16", "q8_0")])
@pytest.mark.parametrize("D,Hkv,G,n_slots,n_ctx", CASES)
def test_attend_matches_twin_every_kernel(tk, tv, D, Hkv, G, n_slots, n_ctx):
    if "q8_0" in (tk, tv) and D % 32:
        with pytest.raises(ValueError, match="multiple of 32"):
            C.kv_type_id("q8_0", D)
        return
    kc, vc = _filled(tk, tv, n_slots, n_ctx, Hkv, D, seed=D + G)
    rng = np.random.default_rng(D * G)
    n = 37
    q = rng.standard_normal((n, Hkv * G, D)).astype(np.float32)
    slots = rng.integers(0, n_slots, n)
    pos = rng.integers(0, n_ctx, n)
    pos[:3] = [0, n_ctx - 1, 63]
    slots[10:20] = 0
    pos[10:20] = np.arange(60, 70)           # a prefill-like run across a tile edge
    scale = float(1 / np.sqrt(D))
    want = _run(R.Attention(), q, kc, vc, tk, tv, slots, pos, scale)
    for isa in C.isas():
        _same_bits(_run(C.Attention(isa=isa), q, kc, vc, tk, tv, slots, pos, scale), want)


def test_attend_is_close_to_exact_softmax():
    D, Hkv, G, n_ctx = 64, 2, 3, 500
    kc, vc = _filled("f32", "f32", 1, n_ctx, Hkv, D, seed=5)
    K, V = R.cache_values("f32", "f32", kc, vc, D)
    rng = np.random.default_rng(6)
    q = rng.standard_normal((4, Hkv * G, D)).astype(np.float32)
    pos = np.array([0, 63, 64, 499])
    out = _run(C.Attention(), q, kc, vc, "f32", "f32", np.zeros(4), pos, 0.125)
    for t, p in enumerate(pos):
        for h in range(Hkv * G):
            k, v = K[0, :p + 1, h // G].astype(np.float64), V[0, :p + 1, h // G].astype(np.float64)
            s = k @ q[t, h].astype(np.float64) * 0.125
            w = np.exp(s - s.max())
            ref = w @ v / w.sum()
            np.testing.assert_allclose(out[t, h * D:(h + 1) * D], ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("tk", TYPES)
def test_long_context_positions_match_twin(tk):
    D, Hkv, G, n_ctx = 64, 1, 4, 8192
    kc, vc = _filled(tk, tk, 1, n_ctx, Hkv, D, seed=7)
    rng = np.random.default_rng(8)
    pos = np.sort(rng.integers(0, n_ctx, 6))
    pos[-1] = n_ctx - 1
    q = rng.standard_normal((6, Hkv * G, D)).astype(np.float32)
    want = _run(R.Attention(), q, kc, vc, tk, tk, np.zeros(6), pos, 0.125)
    _same_bits(_run(C.Attention(), q, kc, vc, tk, tk, np.zeros(6), pos, 0.125), want)


@pytest.mark.parametrize("tk", TYPES)
def test_batch_chunking_and_threads_change_no_bit(tk):
    """A prefill of 300 tokens in one call, in chunks of 7, one row at a time (decode), mixed with
    other slots' rows, on 1 and 2 threads and every kernel: the same bits for every row."""
    D, Hkv, G, n_ctx = 64, 3, 3, 320
    kc, vc = _filled(tk, tk, 3, n_ctx, Hkv, D, seed=9)
    rng = np.random.default_rng(10)
    n = 300
    q = rng.standard_normal((n, Hkv * G, D)).astype(np.float32)
    pos = np.arange(n)
    slots = np.ones(n)
    whole = _run(C.Attention(), q, kc, vc, tk, tk, slots, pos, 0.125)
    for isa in C.isas():
        for threads in (1, 2, 3):
            attn = C.Attention(Pool(threads) if threads > 1 else None, isa=isa)
            _same_bits(_run(attn, q, kc, vc, tk, tk, slots, pos, 0.125), whole)
            chunks = np.concatenate([_run(attn, q[i:i + 7], kc, vc, tk, tk, slots[i:i + 7], pos[i:i + 7], 0.125)
                                     for i in range(0, n, 7)])
            _same_bits(chunks, whole)
    attn = C.Attention(Pool(2))
    for i in rng.choice(n, 12, replace=False):
        _same_bits(_run(attn, q[i:i + 1], kc, vc, tk, tk, slots[i:i + 1], pos[i:i + 1], 0.125), whole[i:i + 1])
        # the same row among rows of other slots, before and after it
        qq = np.concatenate([q[:5], q[i:i + 1], q[:4]])
        ss = np.array([0, 2, 0, 2, 2, 1, 0, 0, 2, 2])
        pp = np.array([5, 100, 6, 7, 8, pos[i], 300, 301, 1, 2])
        _same_bits(_run(attn, qq, kc, vc, tk, tk, ss, pp, 0.125)[5:6], whole[i:i + 1])


def test_bad_input_is_refused():
    kc, vc = _filled("f16", "f16", 2, 100, 2, 64, seed=11)
    attn = C.Attention()
    q = np.zeros((2, 4, 64), np.float32)
    with pytest.raises(ValueError, match="outside the cache"):
        _run(attn, q, kc, vc, "f16", "f16", [0, 2], [0, 1], 0.1)
    with pytest.raises(ValueError, match="outside the cache"):
        _run(attn, q, kc, vc, "f16", "f16", [0, 1], [0, 100], 0.1)
    with pytest.raises(ValueError, match="do not fit"):
        _run(attn, q, kc, vc, "f32", "f16", [0, 1], [0, 1], 0.1)
    with pytest.raises(ValueError, match="cannot share"):
        _run(attn, np.zeros((2, 3, 64), np.float32), kc, vc, "f16", "f16", [0, 1], [0, 1], 0.1)
    with pytest.raises(ValueError, match="unknown KV cache type"):
        _run(attn, q, kc, vc, "bf16", "f16", [0, 1], [0, 1], 0.1)
    with pytest.raises(ValueError, match="unknown isa"):
        C.Attention(isa="avx1024")
