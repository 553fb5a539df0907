"""The CPU backend's KV cache (backends/kv_cache.py) in each type: bytes per token, slot copies, saves
and restores bit-exact, the same bytes whether the extension or its twin wrote them, and a clear
error for a type the model's head size cannot hold."""
import numpy as np
import pytest

from fastserve.backends.kv_cache import KVCache
from fastserve.errors import ConfigError
from fastserve.ref import attention as twin

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
