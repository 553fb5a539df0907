"""fastserve.backends.cpu._pool: the decode thread's helper threads, shared by the step's parallel loops.

Its numbers are its callers' (a product over a shared Pool equals the product on one thread); here
its own behaviour: bounds, sharing between two users, closing, and the twin's same surface."""
import numpy as np
import pytest

from fastserve.backends.cpu import _matmul, _pool
from fastserve.backends.cpu.ref import pool as ref_pool


@pytest.mark.parametrize("mod", [_pool, ref_pool], ids=["cython", "twin"])
def test_threads_bounds(mod):
    for bad in (0, -1, mod.MAX_THREADS + 1):
        with pytest.raises(ValueError, match="threads"):
            mod.Pool(bad)
    p = mod.Pool(2)
    assert p.threads == 2 and repr(p) == "Pool(threads=2)"
    p.close()
    p.close()                      # twice is harmless


def test_one_pool_serves_two_products_and_changes_no_number():
    r = np.random.default_rng(0)
    w = _matmul.BlockMatrix.from_float(r.standard_normal((700, 256)).astype(np.float32))
    x = r.standard_normal((9, 256)).astype(np.float32)
    alone = _matmul.Matmul(threads=1)(x, w, np.empty((9, 700), np.float32))
    pool = _pool.Pool(2, spin_us=50)
    a, b = _matmul.Matmul(pool=pool), _matmul.Matmul(pool=pool)
    assert a.pool is pool and b.threads == 2
    for _ in range(20):            # alternate users of the same helpers, as a decode step does
        for mm in (a, b):
            assert np.array_equal(mm(x, w, np.empty((9, 700), np.float32)), alone)
    pool.close()                   # closed: the products run on the caller alone, same numbers
    assert np.array_equal(a(x, w, np.empty((9, 700), np.float32)), alone)


@pytest.mark.parametrize("mod", [_pool, ref_pool], ids=["cython", "twin"])
def test_prefetch_then_takes_a_buffer_or_none(mod):
    p = mod.Pool(2)
    for data in (np.zeros(100_000, np.uint8), np.zeros((7, 3), np.float32), b"", None):
        p.prefetch_then(data)
    with pytest.raises(TypeError):
        p.prefetch_then(12)                    # not a buffer
    p.close()
    p.prefetch_then(np.zeros(8, np.uint8))     # closed: nothing to prefetch, no error


def test_named_next_rows_change_no_number():
    """Threads that wait prefetch the rows named by prefetch_then (the next product's, as the forward names
    them): a product with such rows named, also its own, also stale ones, gives the one-thread bits."""
    r = np.random.default_rng(1)
    w = _matmul.BlockMatrix.from_float(r.standard_normal((900, 512)).astype(np.float32))
    x = r.standard_normal((1, 512)).astype(np.float32)
    alone = _matmul.Matmul(threads=1)(x, w, np.empty((1, 900), np.float32))
    pool = _pool.Pool(2, spin_us=200)
    mm = _matmul.Matmul(pool=pool)
    other = np.ones(3 << 20, np.uint8)
    for i in range(30):
        pool.prefetch_then(other if i % 3 else w.arrays[0])
        assert np.array_equal(mm(x, w, np.empty((1, 900), np.float32)), alone)
    del other                                   # kept alive by the pool until the next call
    assert np.array_equal(mm(x, w, np.empty((1, 900), np.float32)), alone)
    pool.prefetch_then(None)
    pool.close()
