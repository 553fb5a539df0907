"""The CPU backend's KV cache (backends/cpu/kv_cache.py) in each type: bytes per token, slot copies, saves
and restores bit-exact, the same bytes whether the extension or its twin wrote them, and a clear
error for a type the model's head size cannot hold."""
import numpy as np
import pytest

from fastserve.backends.cpu.kv_cache import KVCache
from fastserve.errors import ConfigError
from fastserve.backends.cpu.ref import attention as twin

TYPES = [("f16", "f16"), ("f32", "f32"), ("q8_0", "q8_0"), ("f16", "q8_0"), ("q8_0", "f32")]
L, SLOTS, CTX, HKV, D = 2, 3, 150, 2, 64


def _filled(tk, tv, kernels=None):
    kv = KVCache(L, SLOTS, CTX, HKV, D, tk, tv, **({"kernels": kernels} if kernels else {}))
    rng = np.random.default_rng(4)
    for li in range(L):
        n = 90
        x = rng.standard_normal((n, HKV, D)).astype(np.float32)
        y = rng.standard_normal((n, HKV, D)).astype(np.float32)
        kv.store(li, x, y, np.repeat(np.arange(3), 30).astype(np.int64),
                 np.tile(np.arange(30, 60), 3).astype(np.int64) + np.repeat([0, 50, 90], 30))
    return kv


def test_bytes_per_token_follow_the_type():
    per = {t: KVCache(L, 1, 64, HKV, D, t, t).bytes_per_token() for t in ("f32", "f16", "q8_0")}
    assert per["f32"] == 2 * L * HKV * D * 4
    assert per["f16"] * 2 == per["f32"]
    assert per["q8_0"] == 2 * L * HKV * D // 32 * 34
    assert KVCache(L, 1, 64, HKV, D, "f16", "q8_0").bytes_per_token() == (per["f16"] + per["q8_0"]) // 2


@pytest.mark.parametrize("tk,tv", TYPES)
def test_store_matches_twin_and_copies_are_exact(tk, tv):
    kv, ref = _filled(tk, tv), _filled(tk, tv, kernels=twin)
    assert all(np.array_equal(a, b) for a, b in zip(kv.k + kv.v, ref.k + ref.v))
    n = 120
    buf = np.zeros(n * kv.bytes_per_token() + 7, np.uint8)
    kv.save_slot(1, 10, n, buf)
    ref_buf = np.zeros_like(buf)
    ref.save_slot(1, 10, n, ref_buf)
    assert np.array_equal(buf, ref_buf)
    kv.restore_slot(2, 25, n, buf)           # another slot, another offset, across tile edges
    back = np.zeros_like(buf)
    kv.save_slot(2, 25, n, back)
    assert np.array_equal(back, buf)
    kv.copy_slot(1, 0, 140)
    kv.save_slot(0, 10, n, back)
    assert np.array_equal(back, buf)
    with pytest.raises(ValueError, match="needs a contiguous uint8 buffer"):
        kv.save_slot(0, 0, n, np.zeros(10, np.uint8))


def test_a_type_the_head_size_cannot_hold_is_refused():
    with pytest.raises(ConfigError, match="--cache-type-v q8_0: a q8_0 KV cache needs head_dim a multiple of 32"):
        KVCache(L, 1, 64, HKV, 48, "f16", "q8_0")
    with pytest.raises(ConfigError, match="--cache-type-k bf16: unknown KV cache type"):
        KVCache(L, 1, 64, HKV, 64, "bf16", "f16")


# -- sliding-window layers in a ring -------------------------------------------------------------

LOCAL = (True, False)           # layer 0 local (a ring), layer 1 global (every position)


def test_ring_size_is_the_window_plus_a_step_in_whole_tiles_below_the_context():
    from fastserve.backends.cpu.kv_cache import ring_size
    assert ring_size(512, 512, 32768) == 1024 and ring_size(512, 1, 32768) == 512
    assert ring_size(8, 57, 512) == 64 and ring_size(8, 58, 512) == 128
    assert ring_size(512, 512, 1024) == 0 and ring_size(512, 512, 1000) == 0      # no smaller than the context
    assert ring_size(0, 512, 32768) == 0
    kv = KVCache(2, 2, 4096, HKV, D, window=100, local_layers=LOCAL, step_tokens=30)
    assert kv.ring == 192 and kv.rings == [192, 0]
    assert kv.v[0].shape[1] == 192 and kv.k[0].shape[1] == 3 and kv.v[1].shape[1] == 4096
    assert KVCache(2, 2, 4096, HKV, D, window=100, local_layers=(False, False), step_tokens=30).ring == 0


def _ring_filled(kernels=None, n=300, step=30):
    kv = KVCache(2, 2, 1024, HKV, D, "q8_0", "f16", window=20, local_layers=LOCAL, step_tokens=step,
                 **({"kernels": kernels} if kernels else {}))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, HKV, D)).astype(np.float32)
    for i in range(0, n, step):                 # a prefill in steps, as the forward pass stores it
        slots, pos = np.ones(len(x[i:i + step]), np.int64), np.arange(i, min(n, i + step), dtype=np.int64)
        kv.begin_step(slots, pos)
        for li in range(2):
            kv.store(li, x[i:i + step], x[i:i + step], slots, pos)
    return kv


def test_ring_store_save_restore_match_the_twin_and_track_what_is_held():
    kv, ref = _ring_filled(), _ring_filled(twin)
    assert kv.ring == 64 and all(np.array_equal(a, b) for a, b in zip(kv.k + kv.v, ref.k + ref.v))
    # the ring holds positions 236..299 of slot 1: a continuation needs the 19 keys before it
    assert kv.held_from(1, 300) == 236 and kv.reuse_from(1, 300) == 236 + 19
    assert kv.held_from(1, 250) == 236 and kv.held_from(0, 10) == 10 and kv.held_from(0, 0) == 0
    n = 300
    buf, ref_buf = np.zeros(n * kv.bytes_per_token(), np.uint8), np.zeros(n * kv.bytes_per_token(), np.uint8)
    kv.save_slot(1, 0, n, buf)
    ref.save_slot(1, 0, n, ref_buf)
    assert np.array_equal(buf, ref_buf)
    kv.restore_slot(0, 0, n, buf, held_from=kv.held_from(1, n))
    assert all(np.array_equal(a[0], a[1]) for a in kv.k + kv.v) and kv.held_from(0, n) == 236
    kv.restore_slot(0, 0, n, buf, held_from=280)         # a copy whose ring held less: so does the slot
    assert kv.held_from(0, n) == 280 and kv.reuse_from(0, n) == 299
    kv.copy_slot(1, 0, 290)                             # positions 290.. are past the copy: not held
    assert kv.held_from(0, 290) == 236 and kv.held_from(0, 300) == 300


def test_ring_refuses_a_step_longer_than_it_was_sized_for():
    kv = _ring_filled(n=60)
    x = np.zeros((31, HKV, D), np.float32)
    with pytest.raises(ValueError, match="more than 30 tokens into one slot"):
        kv.begin_step(np.zeros(31, np.int64), np.arange(31, dtype=np.int64))
    kv.begin_step(np.repeat([0, 1], [16, 15]).astype(np.int64), np.arange(31, dtype=np.int64))   # two slots
    with pytest.raises(ValueError, match="slots must be in"):
        kv.begin_step(np.array([2]), np.array([0]))
    with pytest.raises(ValueError, match="positions >= 0"):
        kv.begin_step(np.array([0]), np.array([-1]))


def test_the_cache_is_zeros_resident_from_the_start():
    """Every page is in memory soon after the cache exists (RSS does not creep up as slots reach new
    positions), zero, writable, and freed with the cache."""
    from fastserve.resources import rss_bytes
    before = rss_bytes()
    kv = KVCache(4, 8, 4096, HKV, D, "f16", "f16")      # 32 MiB
    assert kv.resident.wait(30)
    grown = rss_bytes() - before
    assert grown >= 0.9 * kv.nbytes(), (grown, kv.nbytes())
    for a in kv.k + kv.v:
        assert a.dtype == np.uint8 and a.flags.writeable and a.flags.c_contiguous and not a.any()
    del kv, a
    assert rss_bytes() - before < 0.5 * 32 * 2**20


def test_a_cache_not_made_resident_costs_only_what_is_written():
    """resident=False (the embeddings' cache): no page comes in at start; a write brings in its own rows only."""
    from fastserve.resources import rss_bytes
    before = rss_bytes()
    kv = KVCache(4, 8, 4096, HKV, D, "f16", "f16", resident=False)      # 32 MiB
    assert kv.resident.is_set()
    kv.store(0, np.ones((16, HKV, D), np.float32), np.ones((16, HKV, D), np.float32), np.zeros(16, np.int64),
             np.arange(16))
    assert rss_bytes() - before < 0.1 * kv.nbytes(), (rss_bytes() - before, kv.nbytes())
    assert kv.v[0][0, :16].any() and not kv.v[0][1:].any()


def test_the_fill_thread_writes_what_the_kernel_refuses_and_stops_for_a_dropped_cache():
    """_populate: an advice refused (ENOMEM, EINTR, ...) has its chunk written instead; a cache dropped
    before its turn is not touched (weak references); done is set whatever happens, an error included."""
    import threading
    import weakref

    from fastserve.backends.cpu import kv_cache as kvc
    calls = []

    def refuse(ptr, n, advice):
        calls.append(n)
        return -1

    a = kvc.mapped_zeros((3, kvc.POPULATE_CHUNK // 2))          # 1.5 chunks: two calls
    done = threading.Event()
    kvc._populate([weakref.ref(a)], refuse, done)
    assert done.is_set() and calls == [kvc.POPULATE_CHUNK, kvc.POPULATE_CHUNK // 2] and not a.any()
    b = kvc.mapped_zeros((1 << 20,))
    ref, calls[:] = weakref.ref(b), []
    del b
    done = threading.Event()
    kvc._populate([ref], refuse, done)
    assert done.is_set() and calls == []

    def boom(ptr, n, advice):
        raise OSError("madvise went wrong")

    done = threading.Event()
    with pytest.raises(OSError):
        kvc._populate([weakref.ref(a)], boom, done)
    assert done.is_set()
