"""The float products' tiles (_matmul_float.h) against the NumPy twin (fastserve.backends.cpu.ref.matmul), bit for
bit, at every batch size that picks a different tile: batch 1 (4 rows, both halves of the 16 sums at once), and above
it activation rows 6 at a time a half at a time (FS_FA_HALF), the last 1 to 5 in a smaller tile, a last single row
after them in the batch-1 tile; rows longer than a block of inputs (FS_FKB = 512: the sums wait in a buffer) with
a partial last 16; 21 output rows (a whole panel, then 2-row tiles and a single row); every isa and 1 or 2 threads.
Each output row must not depend on the other activation rows (batch invariance)."""
import importlib

import numpy as np
import pytest

N_IN, N_OUT = 1100, 21          # 2 blocks of 512 and one of 76 (its last 16 partial); a panel and 5 rows
BATCHES = list(range(1, 15)) + [19]


def c_mod():
    return importlib.import_module("fastserve.backends.cpu._matmul")


def twin():
    return importlib.import_module("fastserve.backends.cpu.ref.matmul")


def weights(type_name, seed):
    """N_OUT x N_IN weights stored as type_name: ordinary values, and a row with inf, NaN, a denormal."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N_OUT, N_IN)).astype(np.float32)
    w[3, :3] = [np.inf, np.nan, 1e-40]
    if type_name == "F32":
        return w.view(np.uint8).reshape(N_OUT, -1)
    if type_name == "F16":
        return w.astype(np.float16).view(np.uint8).reshape(N_OUT, -1)
    return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(N_OUT, -1)


def product(m, x, w, **kw):
    out = np.full((len(x), w.n_out), np.nan, np.float32)
    assert m.Matmul(**kw)(x, w, out) is out
    return out


def assert_same(a, b, msg):
    """Bit-identical, NaN included (any NaN equals any NaN)."""
    same = (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))
    assert same.all(), f"{msg}: {np.count_nonzero(~same)} of {a.size} differ"


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_every_tile_gives_the_twins_bits(type_name):
    raw = weights(type_name, seed=21)
    x = np.random.default_rng(22).standard_normal((max(BATCHES), N_IN)).astype(np.float32)
    x[:, ::13] *= np.float32(3e4)           # inputs of very different sizes: another order gives other bits
    mats = {m: m.BlockMatrix([("w", type_name, raw, N_OUT)], N_IN) for m in (twin(), c_mod())}
    want = product(twin(), x, mats[twin()])
    for isa in c_mod().isas():
        for threads in (1, 2):
            for n in BATCHES:
                assert_same(product(c_mod(), x[:n], mats[c_mod()], isa=isa, threads=threads), want[:n],
                            f"{type_name} {isa} threads={threads} n={n}")


@pytest.mark.parametrize("type_name", ["F16", "BF16"])
def test_a_row_does_not_depend_on_its_batch(type_name):
    """Row 0 alone, then at each place of a batch of 13 other rows (a 6-row tile, a 1-row one): the same bits."""
    m = c_mod()
    w = m.BlockMatrix([("w", type_name, weights(type_name, seed=23), N_OUT)], N_IN)
    rng = np.random.default_rng(24)
    row, others = rng.standard_normal((1, N_IN)).astype(np.float32), rng.standard_normal((12, N_IN)).astype(np.float32)
    for isa in m.isas():
        alone = product(m, row, w, isa=isa)
        for at in (0, 5, 6, 11, 12):
            batch = np.insert(others, at, row[0], axis=0)
            assert_same(product(m, batch, w, isa=isa, threads=2)[at], alone[0], f"{type_name} {isa} at {at}")
