"""Matmul.groups (run_groups: a mixture's selected experts, each over its gathered rows, in one pool run) against
its NumPy twin (fastserve.backends.cpu.ref.matmul.Matmul.groups) and against the extension's own products group by
group, bit for bit: every kernel this machine runs, 1 to 3 threads, groups of 0 to 6 rows (on both sides of the
fused kernels' largest batch), the types a mixture's experts come in; and clear errors on groups that do not fit."""
import importlib

import numpy as np
import pytest

from fastserve.models import blocks as B

TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "IQ4_XS", "F16", "F32"]
N_IN, N_OUT = 512, 80            # 5 panels of 16 rows, the last one ragged
ROWS = [1, 0, 3, 6, 1, 2, 0, 4]  # each group's gathered rows: empty groups among them, as most experts are


def c_mod():
    return importlib.import_module("fastserve.backends.cpu._matmul")


def twin():
    return importlib.import_module("fastserve.backends.cpu.ref.matmul")


def experts(m, type_name, seed):
    rng = np.random.default_rng(seed)
    out = []
    for e in range(len(ROWS)):
        w = (rng.standard_normal((N_OUT, N_IN)) * 0.05).astype(np.float32)
        out.append(m.BlockMatrix([(f"expert{e}", type_name, B.encode(type_name, w), N_OUT)], N_IN))
    return out


def grouped(m, mm, x, ws, start):
    out = np.full((len(x), N_OUT), np.nan, np.float32)
    return mm.groups(x, ws, start, out)


@pytest.mark.parametrize("type_name", TYPES)
def test_groups_equal_the_twin_and_the_products_one_by_one(type_name):
    c, t = c_mod(), twin()
    start = np.concatenate([[0], np.cumsum(ROWS)]).astype(np.int64)
    x = (np.random.default_rng(7).standard_normal((start[-1], N_IN))).astype(np.float32)
    want = grouped(t, t.Matmul(), x, experts(t, type_name, 3), start)
    assert not np.isnan(want).any()
    ws = experts(c, type_name, 3)
    for isa in c.isas():
        for threads in (1, 2, 3):
            mm = c.Matmul(threads=threads, isa=isa)
            got = grouped(c, mm, x, ws, start)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"{isa} {threads}")
            for g, w in enumerate(ws):          # the same bits as each group's own product
                rows = slice(start[g], start[g + 1])
                if start[g + 1] > start[g]:
                    one = mm(np.ascontiguousarray(x[rows]), w, np.empty((ROWS[g], N_OUT), np.float32))
                    np.testing.assert_array_equal(one.view(np.uint32), got[rows].view(np.uint32))


@pytest.mark.parametrize("impl", ["c", "twin"])
def test_groups_refuse_what_does_not_fit(impl):
    m = c_mod() if impl == "c" else twin()
    ws = experts(m, "Q8_0", 1)[:2]
    x, out = np.zeros((3, N_IN), np.float32), np.zeros((3, N_OUT), np.float32)
    mm = m.Matmul()
    for start in ([0, 1], [0, 2, 2], [1, 2, 3], [0, 2, 1], [0, 1, 4]):
        with pytest.raises(ValueError, match="groups"):
            mm.groups(x, ws, start, out)
    other = m.BlockMatrix([("other", "Q4_0", B.encode("Q4_0", np.zeros((N_OUT, N_IN), np.float32)), N_OUT)], N_IN)
    with pytest.raises(ValueError, match="do not fit"):
        mm.groups(x, [ws[0], other], [0, 1, 3], out)
    with pytest.raises(ValueError, match="groups"):
        mm.groups(x, [], [0], out)
