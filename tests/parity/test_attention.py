"""fastserve.backends.cpu._attention against its NumPy twin fastserve.backends.cpu.ref.attention: cache bytes and outputs bit for
bit, every cache type and kernel; outputs independent of batch, chunking and threads; close to exact
softmax attention in float64."""
import os
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from fastserve.backends.cpu import _attention as C
from fastserve.backends.cpu._pool import Pool
from fastserve.backends.cpu.ref import attention as R

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


def _run(attn, q, kc, vc, tk, tv, slots, pos, scale, window=0, sinks=None):
    out = np.full((len(q), q.shape[1] * q.shape[2]), np.nan, np.float32)
    attn(q, kc, vc, tk, tv, np.asarray(slots, np.int64), np.asarray(pos, np.int64), out, scale, window=window,
         sinks=sinks)
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


def test_twin_has_the_same_tiles_and_segments():
    assert (C.KT, C.SEG) == (R.KT, R.SEG) and C.SEG % C.KT == 0


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
    (64, 1, 8, 2, 200), (32, 2, 5, 1, 150), (48, 2, 6, 1, 140), (128, 1, 7, 1, 140), (256, 2, 8, 1, 100),
]


def _mixed_batch(tk, tv, D, Hkv, G, n_slots, n_ctx, n, seed):
    """Filled caches and n query rows of random slots and positions (0, the last, 63 among them) with a
    prefill-like run of 10 across a tile edge: (k_cache, v_cache, q [n, Hkv * G, D], slots, positions, scale)."""
    kc, vc = _filled(tk, tv, n_slots, n_ctx, Hkv, D, seed=seed + 1)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, Hkv * G, D)).astype(np.float32)
    slots = rng.integers(0, n_slots, n)
    pos = rng.integers(0, n_ctx, n)
    pos[:3] = [0, n_ctx - 1, 63]
    slots[10:20] = 0
    pos[10:20] = np.arange(60, 70)
    return kc, vc, q, slots, pos, float(1 / np.sqrt(D))


@pytest.mark.parametrize("tk,tv", [(t, t) for t in TYPES] + [("f16", "q8_0")])
@pytest.mark.parametrize("D,Hkv,G,n_slots,n_ctx", CASES)
def test_attend_matches_twin_every_kernel(tk, tv, D, Hkv, G, n_slots, n_ctx):
    if "q8_0" in (tk, tv) and D % 32:
        with pytest.raises(ValueError, match="multiple of 32"):
            C.kv_type_id("q8_0", D)
        return
    kc, vc, q, slots, pos, scale = _mixed_batch(tk, tv, D, Hkv, G, n_slots, n_ctx, 37, seed=D * G)
    want = _run(R.Attention(), q, kc, vc, tk, tv, slots, pos, scale)
    for isa in C.isas():
        _same_bits(_run(C.Attention(isa=isa), q, kc, vc, tk, tv, slots, pos, scale), want)


WINDOWS = (1, 17, 64, 100, 1000)        # 1000 > every position here: the same as causal


@pytest.mark.parametrize("tk,tv", [("f16", "f16"), ("q8_0", "f32")])
@pytest.mark.parametrize("D,Hkv,G,n_slots,n_ctx", CASES[::2] + [CASES[-1]])
def test_sliding_window_matches_twin_every_kernel(tk, tv, D, Hkv, G, n_slots, n_ctx):
    if "q8_0" in (tk, tv) and D % 32:
        return
    kc, vc, q, slots, pos, scale = _mixed_batch(tk, tv, D, Hkv, G, n_slots, n_ctx, 31, seed=D * G + 1)
    causal = _run(C.Attention(), q, kc, vc, tk, tv, slots, pos, scale)
    for window in WINDOWS:
        want = _run(R.Attention(), q, kc, vc, tk, tv, slots, pos, scale, window)
        for isa in C.isas():
            _same_bits(_run(C.Attention(isa=isa), q, kc, vc, tk, tv, slots, pos, scale, window), want)
        if window > n_ctx:
            _same_bits(want, causal)


def test_sliding_window_is_close_to_exact_softmax_over_the_window():
    D, Hkv, G, n_ctx = 64, 2, 4, 1100                 # key segments of 512: windows across their edges
    kc, vc = _filled("f32", "f32", 1, n_ctx, Hkv, D, seed=15)
    K, V = R.cache_values("f32", "f32", kc, vc, D)
    rng = np.random.default_rng(16)
    pos = np.array([0, 5, 63, 64, 65, 130, 499, 512, 600, 1099])
    q = rng.standard_normal((len(pos), Hkv * G, D)).astype(np.float32)
    for window in (1, 6, 64, 65, 200, 700):
        out = _run(C.Attention(), q, kc, vc, "f32", "f32", np.zeros(len(pos)), pos, 0.125, window)
        for t, p in enumerate(pos):
            lo = max(0, p - window + 1)
            for h in range(Hkv * G):
                k, v = K[0, lo:p + 1, h // G].astype(np.float64), V[0, lo:p + 1, h // G].astype(np.float64)
                s = k @ q[t, h].astype(np.float64) * 0.125
                w = np.exp(s - s.max())
                np.testing.assert_allclose(out[t, h * D:(h + 1) * D], w @ v / w.sum(), rtol=0, atol=2e-5)
        if window == 1:                      # a window of one key: the query's own value, exactly
            _same_bits(out.reshape(len(pos), Hkv, G, D), np.repeat(V[0, pos][:, :, None, :], G, axis=2))


def test_sliding_window_ignores_keys_outside_it():
    """Keys before the window may hold anything, NaN included: the output does not change."""
    D, Hkv, G, n_ctx, window = 64, 1, 8, 300, 70
    kc, vc = _filled("f16", "f16", 1, n_ctx, Hkv, D, seed=17)
    rng = np.random.default_rng(18)
    pos = np.arange(200, 260)
    q = rng.standard_normal((len(pos), Hkv * G, D)).astype(np.float32)
    want = _run(C.Attention(), q, kc, vc, "f16", "f16", np.zeros(len(pos)), pos, 0.125, window)
    kx = np.full((130, Hkv, D), np.nan, np.float32)
    C.store("f16", "f16", kc, vc, kx, kx, np.zeros(130, np.int64), np.arange(130, dtype=np.int64))
    for isa in C.isas():
        _same_bits(_run(C.Attention(isa=isa), q, kc, vc, "f16", "f16", np.zeros(len(pos)), pos, 0.125, window), want)
    _same_bits(_run(R.Attention(), q, kc, vc, "f16", "f16", np.zeros(len(pos)), pos, 0.125, window), want)


def _sinks(H, seed):
    """Sink logits of gpt-oss's spread (a few nats either side of the scores), one per query head."""
    return (np.random.default_rng(seed).standard_normal(H) * 2).astype(np.float32)


@pytest.mark.parametrize("tk,tv,window", [("f16", "f16", 0), ("q8_0", "f32", 17), ("f32", "f16", 100)])
def test_sinks_match_twin_every_kernel_and_split(tk, tv, window):
    """Attention sinks (gpt-oss): C = twin bit for bit, every kernel, and a decode row's key segments split
    over threads (the sink merged after them) gives the bits of the whole batch."""
    D, Hkv, G, n_slots, n_ctx = 64, 2, 4, 2, 1100
    kc, vc, q, slots, pos, scale = _mixed_batch(tk, tv, D, Hkv, G, n_slots, n_ctx, 29, seed=21)
    sinks = _sinks(Hkv * G, 22)
    want = _run(R.Attention(), q, kc, vc, tk, tv, slots, pos, scale, window, sinks)
    assert not np.array_equal(want, _run(R.Attention(), q, kc, vc, tk, tv, slots, pos, scale, window))
    for isa in C.isas():
        _same_bits(_run(C.Attention(isa=isa), q, kc, vc, tk, tv, slots, pos, scale, window, sinks), want)
        attn = C.Attention(Pool(3), isa=isa)
        for i in (1, 5):
            _same_bits(_run(attn, q[i:i + 1], kc, vc, tk, tv, slots[i:i + 1], pos[i:i + 1], scale, window, sinks),
                       want[i:i + 1])


@pytest.mark.parametrize("tk,tv,window,sinks", [("f16", "f16", 0, False), ("q8_0", "f32", 0, True),
                                                ("f32", "f16", 700, False)])
def test_verification_block_merged_over_the_pool(tk, tv, window, sinks):
    """A verification block (8 to 65 rows of one slot after 1,100 keys: few items, so split by key segment,
    its (row, head) merges shared by the pool's threads) gives the twin's bits on 2 and 3 threads, every
    kernel; so do 7 rows (merged by the caller)."""
    D, Hkv, G, n_ctx = 64, 3, 3, 1200
    kc, vc = _filled(tk, tv, 2, n_ctx, Hkv, D, seed=41)
    rng = np.random.default_rng(42)
    q = rng.standard_normal((65, Hkv * G, D)).astype(np.float32)
    sk = _sinks(Hkv * G, 43) if sinks else None
    for n in (7, 8, 17, 49, 65):
        slots, pos = np.ones(n), np.arange(1100, 1100 + n)
        want = _run(R.Attention(), q[:n], kc, vc, tk, tv, slots, pos, 0.125, window, sk)
        for isa in C.isas():
            for threads in (2, 3):
                _same_bits(_run(C.Attention(Pool(threads), isa=isa), q[:n], kc, vc, tk, tv, slots, pos, 0.125,
                                window, sk), want)


def test_sinks_are_in_the_denominator_only():
    """Against float64: softmax over [the visible keys' scores, the head's sink] with the sink's column dropped.
    Fails if the sink is ignored (weights summing to 1) or given a value (added to the numerator)."""
    D, Hkv, G, n_ctx = 64, 2, 3, 700
    kc, vc = _filled("f32", "f32", 1, n_ctx, Hkv, D, seed=23)
    K, V = R.cache_values("f32", "f32", kc, vc, D)
    rng = np.random.default_rng(24)
    pos = np.array([0, 3, 64, 511, 512, 699])
    q = rng.standard_normal((len(pos), Hkv * G, D)).astype(np.float32)
    sinks = _sinks(Hkv * G, 25)
    sinks[0] = 40.0                                   # a sink that takes nearly all of the weight
    for window in (0, 50):
        out = _run(C.Attention(), q, kc, vc, "f32", "f32", np.zeros(len(pos)), pos, 0.125, window, sinks)
        for t, p in enumerate(pos):
            lo = max(0, p - window + 1) if window else 0
            for h in range(Hkv * G):
                k, v = K[0, lo:p + 1, h // G].astype(np.float64), V[0, lo:p + 1, h // G].astype(np.float64)
                s = np.append(k @ q[t, h].astype(np.float64) * 0.125, float(sinks[h]))
                w = np.exp(s - s.max())
                np.testing.assert_allclose(out[t, h * D:(h + 1) * D], w[:-1] @ v / w.sum(), rtol=0, atol=2e-5)
        assert np.abs(out[:, :D]).max() < 1e-9       # head 0: the sink took it all
    with pytest.raises(ValueError, match="sinks: 5 values for 6 query heads"):
        _run(C.Attention(), q, kc, vc, "f32", "f32", np.zeros(len(pos)), pos, 0.125, 0, sinks[:5])
    with pytest.raises(ValueError, match="sinks: 5 values for 6 query heads"):
        _run(R.Attention(), q, kc, vc, "f32", "f32", np.zeros(len(pos)), pos, 0.125, 0, sinks[:5])


def test_attend_is_close_to_exact_softmax():
    D, Hkv, G, n_ctx = 64, 2, 3, 1100                 # three key segments of 512, merged
    kc, vc = _filled("f32", "f32", 1, n_ctx, Hkv, D, seed=5)
    K, V = R.cache_values("f32", "f32", kc, vc, D)
    rng = np.random.default_rng(6)
    pos = np.array([0, 63, 64, 499, 511, 512, 1099])
    q = rng.standard_normal((len(pos), Hkv * G, D)).astype(np.float32)
    out = _run(C.Attention(), q, kc, vc, "f32", "f32", np.zeros(len(pos)), pos, 0.125)
    for t, p in enumerate(pos):
        for h in range(Hkv * G):
            k, v = K[0, :p + 1, h // G].astype(np.float64), V[0, :p + 1, h // G].astype(np.float64)
            s = k @ q[t, h].astype(np.float64) * 0.125
            w = np.exp(s - s.max())
            ref = w @ v / w.sum()
            np.testing.assert_allclose(out[t, h * D:(h + 1) * D], ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("tk,G,window", [(t, 4, 0) for t in TYPES] + [("f16", 8, 0), ("f16", 8, 1024), ("q8_0", 6, 4096)])
def test_long_context_positions_match_twin(tk, G, window):
    D, Hkv, n_ctx = 64, 1, 8192
    kc, vc = _filled(tk, tk, 1, n_ctx, Hkv, D, seed=7)
    rng = np.random.default_rng(8)
    pos = np.sort(rng.integers(0, n_ctx, 6))
    pos[-1] = n_ctx - 1
    q = rng.standard_normal((6, Hkv * G, D)).astype(np.float32)
    want = _run(R.Attention(), q, kc, vc, tk, tk, np.zeros(6), pos, 0.125, window)
    for isa in C.isas():
        _same_bits(_run(C.Attention(isa=isa), q, kc, vc, tk, tk, np.zeros(6), pos, 0.125, window), want)
        # decode steps: each row alone, its key segments spread over the threads
        for threads in (2, 3):
            attn = C.Attention(Pool(threads), isa=isa)
            for i in range(6):
                _same_bits(_run(attn, q[i:i + 1], kc, vc, tk, tk, np.zeros(1), pos[i:i + 1], 0.125, window),
                           want[i:i + 1])


@pytest.mark.parametrize("tk,window", [(t, 0) for t in TYPES] + [("f16", 50), ("q8_0", 129)])
def test_batch_chunking_and_threads_change_no_bit(tk, window):
    """A prefill of 700 tokens (two key segments) in one call, in chunks of 7, one row at a time
    (decode: on threads, its segments split between them), mixed with other slots' rows, on 1 to 3
    threads and every kernel: the same bits for every row."""
    D, Hkv, G, n_ctx = 64, 3, 3, 720
    kc, vc = _filled(tk, tk, 3, n_ctx, Hkv, D, seed=9)
    rng = np.random.default_rng(10)
    n = 700
    q = rng.standard_normal((n, Hkv * G, D)).astype(np.float32)
    pos = np.arange(n)
    slots = np.ones(n)
    whole = _run(C.Attention(), q, kc, vc, tk, tk, slots, pos, 0.125, window)
    if window:
        _same_bits(_run(R.Attention(), q, kc, vc, tk, tk, slots, pos, 0.125, window), whole)
    for isa in C.isas():
        for threads in (1, 2, 3):
            attn = C.Attention(Pool(threads) if threads > 1 else None, isa=isa)
            _same_bits(_run(attn, q, kc, vc, tk, tk, slots, pos, 0.125, window), whole)
            chunks = np.concatenate([_run(attn, q[i:i + 7], kc, vc, tk, tk, slots[i:i + 7], pos[i:i + 7], 0.125, window)
                                     for i in range(0, n, 7)])
            _same_bits(chunks, whole)
    attn = C.Attention(Pool(2))
    for i in [511, 512, n - 1, *rng.choice(n, 12, replace=False)]:
        _same_bits(_run(attn, q[i:i + 1], kc, vc, tk, tk, slots[i:i + 1], pos[i:i + 1], 0.125, window), whole[i:i + 1])
        # the same row among rows of other slots, before and after it
        qq = np.concatenate([q[:5], q[i:i + 1], q[:4]])
        ss = np.array([0, 2, 0, 2, 2, 1, 0, 0, 2, 2])
        pp = np.array([5, 100, 6, 7, 8, pos[i], 300, 301, 1, 2])
        _same_bits(_run(attn, qq, kc, vc, tk, tk, ss, pp, 0.125, window)[5:6], whole[i:i + 1])


def _ring_caches(tk, tv, n_slots, ring, Hkv, D):
    return tuple(np.zeros((n_slots, ring // C.KT, Hkv, mod_bytes), np.uint8) if i == 0 else
                 np.zeros((n_slots, ring, Hkv, mod_bytes), np.uint8)
                 for i, mod_bytes in enumerate((C.k_tile_bytes(tk, D), C.row_bytes(tv, D))))


@pytest.mark.parametrize("tk,tv,window,ring,chunk", [("f16", "f16", 50, 128, 7), ("q8_0", "f32", 64, 128, 65),
                                                      ("f32", "f16", 1, 64, 1), ("f16", "q8_0", 100, 192, 40)])
def test_ring_gives_the_bits_of_the_whole_cache(tk, tv, window, ring, chunk):
    """A prefill of 700 tokens (positions wrap the ring several times) in chunks, each chunk stored then
    attended as a step does, into a ring of `ring` positions (>= window + chunk - 1): every row's output
    has the bits of the same rows over a cache of every position, on every kernel and the twin; the
    ring's bytes are the twin's."""
    assert ring >= window + chunk - 1
    D, Hkv, G, n = 64, 2, 3, 700
    rng = np.random.default_rng(window + chunk)
    kx = (rng.standard_normal((n, Hkv, D)) * 2).astype(np.float32)
    vx = rng.standard_normal((n, Hkv, D)).astype(np.float32)
    q = rng.standard_normal((n, Hkv * G, D)).astype(np.float32)
    pos, slots = np.arange(n, dtype=np.int64), np.ones(n, np.int64)
    full = _caches(C, tk, tv, 2, n, Hkv, D)
    C.store(tk, tv, *full, kx, vx, slots, pos)
    want = _run(C.Attention(), q, *full, tk, tv, slots, pos, 0.125, window)
    rings = {mod: _ring_caches(tk, tv, 2, ring, Hkv, D) for mod in (C, R)}
    kernels = {isa: C.Attention(isa=isa) for isa in C.isas()}
    kernels["2 threads"] = C.Attention(Pool(2))          # the work split over threads (and key segments)
    outs = {isa: [] for isa in kernels}
    twin = []
    for i in range(0, n, chunk):
        c = slice(i, i + chunk)
        for mod, (kc, vc) in rings.items():
            mod.store(tk, tv, kc, vc, kx[c], vx[c], slots[c], pos[c], ring=ring)
        assert all(np.array_equal(a, b) for a, b in zip(rings[C], rings[R]))
        for isa, attn in kernels.items():
            out = np.full((len(q[c]), Hkv * G * D), np.nan, np.float32)
            attn(q[c], *rings[C], tk, tv, slots[c], pos[c], out, 0.125, window=window, ring=ring)
            outs[isa].append(out)
        if i % (3 * chunk) == 0 or i + chunk >= n:          # the twin is slow: every third chunk
            out = np.full((len(q[c]), Hkv * G * D), np.nan, np.float32)
            R.Attention()(q[c], *rings[R], tk, tv, slots[c], pos[c], out, 0.125, window=window, ring=ring)
            _same_bits(out, want[c])
            twin.append(i)
    for isa in kernels:
        _same_bits(np.concatenate(outs[isa]), want)
    assert n // ring >= 3 and len(twin) >= 3


@pytest.mark.parametrize("tk,tv", [("f16", "f16"), ("q8_0", "f32")])
def test_window_far_from_zero_on_a_wrapped_ring(tk, tv):
    """A local layer at position 20k (Gemma 3's shape: 1 KV head of 4 queries, head_dim 256) on a ring
    wrapped ~40 times, its window across a key-segment edge: the work is planned from the window's
    first segment, not position 0's. A decode row, a 64-row prefill chunk, and the decode row batched
    with a row of another slot near position 0, on 1 and 2 threads (2: the window's segments split
    between them) and every kernel: the twin's bits, the bits of a cache of every position, and the
    same bits for a row whatever it is batched with."""
    D, Hkv, G, window, ring, P = 256, 1, 4, 400, 512, 20001       # last position 20000: keys 19601..20000
    rng = np.random.default_rng(21)
    kx = (rng.standard_normal((ring, Hkv, D)) * 2).astype(np.float32)
    vx = rng.standard_normal((ring, Hkv, D)).astype(np.float32)
    far = np.arange(P - ring, P, dtype=np.int64)                   # what the ring of slot 0 holds
    near = np.arange(64, dtype=np.int64)                           # slot 1: its first 64 positions
    rings = {mod: _ring_caches(tk, tv, 2, ring, Hkv, D) for mod in (C, R)}
    full = _caches(C, tk, tv, 2, P, Hkv, D)
    for mod, caches in [*rings.items(), (C, full)]:
        r = ring if caches is not full else 0
        mod.store(tk, tv, *caches, kx, vx, np.zeros(ring, np.int64), far, ring=r)
        mod.store(tk, tv, *caches, kx[:64], vx[:64], np.ones(64, np.int64), near, ring=r)
    assert (P - window) // C.SEG < (P - 1) // C.SEG            # a window across a segment edge
    q = rng.standard_normal((65, Hkv * G, D)).astype(np.float32)
    cases = {"decode": (q[63:64], [0], [P - 1]), "chunk": (q[:64], [0] * 64, far[-64:]),
             "with a row near 0": (q[[64, 63]], [1, 0], [63, P - 1])}

    def run(attn, caches, case, r):
        qq, sl, ps = cases[case]
        out = np.full((len(qq), Hkv * G * D), np.nan, np.float32)
        attn(qq, *caches, tk, tv, np.asarray(sl, np.int64), np.asarray(ps, np.int64), out, 0.0625, window=window, ring=r)
        return out

    want = {case: run(R.Attention(), rings[R], case, ring) for case in cases}
    kernels = {isa: C.Attention(isa=isa) for isa in C.isas()}
    kernels["2 threads"] = C.Attention(Pool(2))
    for name, attn in kernels.items():
        for case in cases:
            _same_bits(run(attn, rings[C], case, ring), want[case])
            _same_bits(run(attn, full, case, 0), want[case])
    _same_bits(want["with a row near 0"][1:], want["decode"])
    _same_bits(want["chunk"][-1:], want["decode"])


@pytest.mark.parametrize("mod", [C, R])
def test_ring_move_rows_address_positions_mod_the_ring(mod):
    """A save of positions past the ring's size reads them where store put them (row p % R); a restore
    into another slot puts them back there."""
    tk, tv, D, Hkv, ring = "q8_0", "f16", 64, 2, 128
    rng = np.random.default_rng(3)
    kx = rng.standard_normal((300, Hkv, D)).astype(np.float32)
    kc, vc = _ring_caches(tk, tv, 2, ring, Hkv, D)
    mod.store(tk, tv, kc, vc, kx, kx, np.zeros(300, np.int64), np.arange(300, dtype=np.int64), ring=ring)
    kr = np.zeros((100, Hkv, C.row_bytes(tk, D)), np.uint8)
    vr = np.zeros((100, Hkv, C.row_bytes(tv, D)), np.uint8)
    mod.move_rows(tk, tv, kc, vc, D, 0, 190, kr, vr, False, ring=ring)       # positions 190..289: rows 62..127, 0..33
    for h in range(Hkv):
        x = np.ascontiguousarray(kx[190:290, h])
        assert np.array_equal(kr[:, h], C.encode_rows(tk, x)) and np.array_equal(vr[:, h], C.encode_rows(tv, x))
    mod.move_rows(tk, tv, kc, vc, D, 1, 190, kr, vr, True, ring=ring)
    K, V = R.cache_values(tk, tv, kc, vc, D)
    rows = np.arange(190, 290) % ring
    assert np.array_equal(K[1, rows], K[0, rows]) and np.array_equal(V[1, rows], V[0, rows])


def test_ring_bad_input_is_refused():
    kc, vc = _ring_caches("f16", "f16", 1, 128, 1, 64)
    q, out = np.zeros((1, 2, 64), np.float32), np.zeros((1, 128), np.float32)
    one = np.zeros(1, np.int64)
    for mod in (C, R):
        with pytest.raises(ValueError, match="multiple of 64"):
            mod.store("f16", "f16", kc, vc, q[:, :1], q[:, :1], one, one, ring=100)
        with pytest.raises(ValueError, match="a cache of that many"):
            mod.store("f16", "f16", kc, vc, q[:, :1], q[:, :1], one, one, ring=192)
        with pytest.raises(ValueError, match="holds a window of at most"):
            mod.Attention()(q, kc, vc, "f16", "f16", one, one, out, 0.1, window=0, ring=128)
        with pytest.raises(ValueError, match="holds a window of at most"):
            mod.Attention()(q, kc, vc, "f16", "f16", one, one, out, 0.1, window=129, ring=128)
    C.Attention()(q, kc, vc, "f16", "f16", one, one + 10_000, out, 0.1, window=128, ring=128)   # any position


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
    with pytest.raises(ValueError, match="cannot share"):         # more query heads a KV head than an item's rows
        _run(attn, np.zeros((1, 2 * (C.ROWS + 1), 64), np.float32), kc, vc, "f16", "f16", [0], [0], 0.1)
    with pytest.raises(ValueError, match="unknown KV cache type"):
        _run(attn, q, kc, vc, "bf16", "f16", [0, 1], [0, 1], 0.1)
    with pytest.raises(ValueError, match="window must be 0"):
        _run(attn, q, kc, vc, "f16", "f16", [0, 1], [0, 1], 0.1, window=-1)
    with pytest.raises(ValueError, match="window must be 0"):
        _run(R.Attention(), q, kc, vc, "f16", "f16", [0, 1], [0, 1], 0.1, window=-1)
    with pytest.raises(ValueError, match="unknown isa"):
        C.Attention(isa="avx1024")


# -- the C header alone: every kernel against the scalar one, here and on aarch64 (NEON) ------------

HARNESS = r"""
#include "_attention_kernels.h"
#include <stdio.h>
static uint32_t rs = 12345;
static uint32_t rnd(void) { rs = rs * 1664525u + 1013904223u; return rs >> 8; }
static float frnd(void) { return ((float)(rnd() % 20001) - 10000.0f) / 3000.0f; }
/* threads > 1: planned as for that many threads (few items: split by key segment), run here on one. */
static void run(int isa, int threads, const float *q, const uint8_t *k, const uint8_t *v, const int64_t *slots,
                const int64_t *pos, int64_t n, int64_t H, int64_t Hkv, int64_t D, int64_t n_ctx, int tk, int tv,
                int64_t window, float *out) {
    int64_t G = H / Hkv, Dp = (D + 15) / 16 * 16, per = fs_attn_tokens_per_item(G), nq = 0;
    int64_t ts[64], tl[64];
    for (int64_t i = 0; i < n; i++)           /* token tiles as _attention.pyx makes them */
        if (nq > 0 && slots[i] == slots[ts[nq - 1]] && tl[nq - 1] < per) tl[nq - 1]++;
        else { ts[nq] = i; tl[nq] = 1; nq++; }
    int64_t sb = (fs_attn_scratch_floats(D, Dp) * 4 + 63) / 64 * 64;
    int busy[64] = {0};
    fs_attn_job jb = {q, k, v, slots, pos, ts, tl, out, nq, H, Hkv, D, Dp, G, n_ctx, (n_ctx + FS_KT - 1) / FS_KT,
                      window, tk, tv, 0.125f * FS_LOG2E, malloc(sb), busy, threads, sb, fs_attn_isa_for(isa)};
    int64_t items = fs_attn_plan(&jb);
    if (threads > 1 && !jb.split) { printf("not split\n"); exit(2); }
    jb.partial = malloc((fs_attn_partial_floats(&jb) + 1) * sizeof(float));
    fs_attn_task(&jb, 0, items);              /* one call: it takes the first scratch area */
    fs_attn_merge(&jb);
    free(jb.scratch);
    free(jb.partial);
}
/* A windowed layer's plan far from position 0: the segments of the windows, not those from position 0. */
static int plan_check(void) {
    int64_t pos[3] = {40000, 40001, 10}, slots[3] = {0, 0, 1}, ts[2] = {0, 2}, tl[2] = {2, 1};
    int busy[2] = {0};
    fs_attn_job jb = {NULL, NULL, NULL, slots, pos, ts, tl, NULL, 2, 4, 1, 64, 64, 4, 0, 0, 300, 0, 0, 0.0f,
                      NULL, busy, 2, 0, fs_attn_isa_for(0)};
    int64_t items = fs_attn_plan(&jb);          /* keys 39701 .. 40001 (segments 310 .. 312), 0 .. 10 */
    int ok = jb.split && jb.n_seg == 3 && items == 2 * 3 && fs_attn_partial_floats(&jb) == 3 * 4 * 3 * (2 + 64);
    jb.window = 0;                              /* causal: every segment from position 0 */
    items = fs_attn_plan(&jb);
    ok = ok && jb.split && jb.n_seg == 40001 / FS_SEG + 1 && items == 2 * jb.n_seg;
    printf("plan check %s\n", ok ? "ok" : "FAILED");
    return ok;
}
int main(void) {
    const int64_t Ds[] = {32, 48, 64, 128, 256}, Gs[] = {1, 8}, windows[] = {0, 1, 17, 100};
    uint64_t hash = 1469598103934665603ull;
    int fails = 0, checks = 0;
    for (int isa = 0; isa <= 3; isa++) printf("isa %d supported %d\n", isa, fs_attn_isa_supported(isa));
    for (int di = 0; di < 5; di++) for (int gi = 0; gi < 2; gi++) for (int t = 0; t < 3; t++) {
        int64_t D = Ds[di], G = Gs[gi], Hkv = 1 + (di + gi) % 2, H = Hkv * G, n_slots = 2, n_ctx = 200, n = 24;
        int tk = t, tv = (t + di) % 3;
        if ((tk == FS_KV_Q8_0 || tv == FS_KV_Q8_0) && D % FS_QB) continue;
        int64_t ntile = (n_ctx + FS_KT - 1) / FS_KT, kb = fs_k_tile_bytes(tk, D), vb = fs_kv_row_bytes(tv, D);
        uint8_t *kc = calloc(n_slots * ntile * Hkv, kb), *vc = calloc(n_slots * n_ctx * Hkv, vb), row[2048];
        float x[256];
        for (int64_t s = 0; s < n_slots; s++) for (int64_t p = 0; p < n_ctx; p++) for (int64_t h = 0; h < Hkv; h++) {
            for (int64_t d = 0; d < D; d++) x[d] = frnd();
            fs_kv_encode(tk, x, 1, D, row);
            fs_k_tile_move(tk, kc + ((s * ntile + p / FS_KT) * Hkv + h) * kb, D, p % FS_KT, row, 1);
            for (int64_t d = 0; d < D; d++) x[d] = frnd() / 3;
            fs_kv_encode(tv, x, 1, D, vc + ((s * n_ctx + p) * Hkv + h) * vb);
        }
        float *q = malloc(n * H * D * 4), *o0 = malloc(n * H * D * 4), *o1 = malloc(n * H * D * 4);
        int64_t slots[24], pos[24];
        for (int64_t i = 0; i < n * H * D; i++) q[i] = frnd() / 4;
        for (int64_t i = 0; i < n; i++) { slots[i] = rnd() % n_slots; pos[i] = rnd() % n_ctx; }
        for (int64_t i = 8; i < 16; i++) { slots[i] = 0; pos[i] = 58 + i; }   /* a run across a tile edge */
        pos[0] = 0; pos[1] = n_ctx - 1;
        for (int w = 0; w < 4; w++) {
            run(FS_ATTN_SCALAR, 1, q, kc, vc, slots, pos, n, H, Hkv, D, n_ctx, tk, tv, windows[w], o0);
            const uint8_t *b = (const uint8_t *)o0;
            for (int64_t i = 0; i < n * H * D * 4; i++) hash = (hash ^ b[i]) * 1099511628211ull;
            for (int isa = 0; isa <= 3; isa++)
                for (int threads = 1; threads <= 64; threads += 63) {   /* 64: split by key segment */
                    if (!fs_attn_isa_supported(isa) || (isa == 0 && threads == 1)) continue;
                    memset(o1, 0xff, n * H * D * 4);
                    run(isa, threads, q, kc, vc, slots, pos, n, H, Hkv, D, n_ctx, tk, tv, windows[w], o1);
                    checks++;
                    if (memcmp(o0, o1, n * H * D * 4)) { fails++; printf("MISMATCH isa %d threads %d D %ld G %ld types %d %d window %ld\n", isa, threads, (long)D, (long)G, tk, tv, (long)windows[w]); }
                }
        }
        free(kc); free(vc); free(q); free(o0); free(o1);
    }
    fails += !plan_check();
    printf("scalar hash %016llx\n", (unsigned long long)hash);
    printf("%d checks, %d mismatches\n", checks, fails);
    return fails != 0;
}
"""
HEADER_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "fastserve", "backends", "cpu")
# FS_SEG=128: several key segments (and split plans) within the harness's 200 positions
CFLAGS = ["-O2", "-ffp-contract=off", "-DFS_SEG=128", "-Wall", "-Wextra", "-Werror", "-Wno-unused-function",
          "-Wno-missing-field-initializers"]


def _harness(tmp_path, cc, run_prefix=()) -> str:
    src, exe = tmp_path / "attn_harness.c", tmp_path / "attn_harness"
    src.write_text(HARNESS)
    built = subprocess.run([*cc, *CFLAGS, "-I", HEADER_DIR, str(src), "-o", str(exe), "-lm"], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    ran = subprocess.run([*run_prefix, str(exe)], capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0 and " 0 mismatches" in ran.stdout, ran.stdout + ran.stderr
    return ran.stdout


def _native_cc():
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()
    if not shutil.which(cc[0]):
        pytest.skip(f"no C compiler {cc[0]!r}")
    return cc


def test_c_kernels_agree_natively(tmp_path):
    out = _harness(tmp_path, _native_cc())
    assert int(out.split(" checks")[0].split()[-1]) > 0 or C.isas() == ("scalar",), out


F16_HARNESS = r"""
#include "_attention_kernels.h"
#include <stdio.h>
/* every float's bits through F16C (eight at a time) and through fs_f32_to_f16: the same half */
static uint64_t sweep(uint64_t from, uint64_t to, uint64_t step) {
    uint64_t bad = 0;
    float x[64];
    uint8_t h[128];
    for (uint64_t u = from; u < to; u += 64 * step) {
        for (int i = 0; i < 64; i++) { uint32_t b = (uint32_t)(u + i * step); memcpy(&x[i], &b, 4); }
        fs_f16_row_f16c(x, 64, h);
        for (int i = 0; i < 64; i++) {
            uint16_t v, w = fs_f32_to_f16(x[i]);
            memcpy(&v, h + 2 * i, 2);
            if (v != w && bad++ < 5) printf("%08x: f16c %04x, software %04x\n", (uint32_t)(u + i * step), v, w);
        }
    }
    return bad;
}
int main(void) {
    if (!__builtin_cpu_supports("f16c")) { printf("no f16c\n"); return 0; }
    uint64_t bad = sweep(0, 1ull << 32, 1);
    /* under flush-to-zero and denormals-are-zero (a library built with -ffast-math sets them): the small
     * values, both signs, a sample */
    _mm_setcsr(_mm_getcsr() | 0x8040);
    bad += sweep(0, 0x38800000u, 7) + sweep(0x80000000u, 0xb8800000u, 7);
    printf("%llu mismatches\n", (unsigned long long)bad);
    return bad != 0;
}
"""


@pytest.mark.skipif("avx2" not in C.isas(), reason="F16C is x86's: needs the AVX2 kernels' machine")
def test_f16c_store_is_the_software_rounding_for_every_float(tmp_path):
    """The f16 KV store converts with F16C where the CPU has it: all 2^32 float bit patterns (normals,
    subnormals, overflow to inf, -0.0, inf, every NaN) give fs_f32_to_f16's half, so the twin's."""
    src, exe = tmp_path / "f16_harness.c", tmp_path / "f16_harness"
    src.write_text(F16_HARNESS)
    built = subprocess.run([*_native_cc(), *CFLAGS, "-I", HEADER_DIR, str(src), "-o", str(exe), "-lm"],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0 and ran.stdout.strip() == "0 mismatches", ran.stdout + ran.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="cross-checks run on Linux")
def test_neon_kernel_agrees_on_aarch64(tmp_path):
    """The NEON kernel, built with the cross compiler and run under qemu: the same bits as the scalar
    kernel there, whose outputs hash as the native scalar kernel's (so NEON = the twin too)."""
    if not (shutil.which("aarch64-linux-gnu-gcc") and shutil.which("qemu-aarch64")):
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt: gcc-aarch64-linux-gnu qemu-user)")
    arm = _harness(tmp_path, ["aarch64-linux-gnu-gcc", "-march=armv8-a"], ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu"])
    assert "isa 3 supported 1" in arm and "isa 1 supported 0" in arm, arm
    assert int(arm.split(" checks")[0].split()[-1]) > 0, arm
    native = _harness(tmp_path, _native_cc())
    assert arm.split("scalar hash ")[1].split()[0] == native.split("scalar hash ")[1].split()[0]
