"""The matrix products on GGUF blocks: semantics on hand-made blocks, the twin's decode anchored to
gguf.quants, bit-exact parity between the C kernels (fastserve.backends.cpu._matmul, every kernel this machine
runs, 1 to 3 threads) and the NumPy twin (fastserve.backends.cpu.ref.matmul) for every block type, batch
invariance, stacked parts of mixed types, and clear errors on bad tensors.

The extension is imported inside each test, so an unbuilt extension makes its tests FAIL with
ImportError (never skip) while the twin's tests still run. The last tests compile the kernels' C
header on its own and compare every kernel with the scalar one bit for bit, natively and, when a
cross compiler and qemu are installed, for aarch64 (NEON, sdot) under emulation.
"""
import importlib
import mmap
import os
import shutil
import subprocess
import sys
import sysconfig
from fractions import Fraction

import numpy as np
import pytest

from fastserve.models import blocks as B

IMPLS = ["fastserve.backends.cpu._matmul", "fastserve.backends.cpu.ref.matmul"]
TYPES = list(B.TYPES)
# f16 bit patterns a scale may hold: zero, -zero, the smallest denormal, a denormal, the smallest
# normal, the largest finite, inf, -inf, NaN, and ordinary values.
SPECIAL_F16 = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0x7C00, 0xFC00, 0x7E00,
                        0x3C00, 0x2E66, 0xB400], np.uint16)
# E8M0 bytes (MXFP4's scales 2^(e - 128)) a block may hold: the denormals 2^-128, 2^-127, the smallest
# normal, 2^-1, 1, the largest two (2^126, 2^127)
SPECIAL_E8M0 = np.array([0, 1, 2, 127, 128, 254, 255], np.uint8)


@pytest.fixture(params=IMPLS)
def mod(request):
    return importlib.import_module(request.param)


def c_mod():
    return importlib.import_module("fastserve.backends.cpu._matmul")


def twin():
    return importlib.import_module("fastserve.backends.cpu.ref.matmul")


def kernels():
    """(isa, threads) of the C side worth comparing on this machine."""
    return [(isa, t) for isa in c_mod().isas() for t in (1, 2, 3)]


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def scale_offsets(type_name):
    """Byte offsets of the f16 scales inside one block of type_name."""
    return {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
            "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0], "Q3_K": [108], "Q2_K": [80, 82]}.get(type_name, [])


def random_blocks(type_name, rows, n_in, seed, special=True):
    """Random bytes of rows x n_in weights of type_name: every bit pattern of quants and sub-scales;
    f16 scales ordinary, except (special) in some rows: zero, denormal, extreme, inf or NaN; MXFP4's
    E8M0 scales ordinary (2^-10 .. 2^9), except (special) some blocks' extremes (SPECIAL_E8M0)."""
    rng = np.random.default_rng(seed)
    per, nbytes, kind = B.TYPES[type_name]
    if kind == "f":
        w = rand(rng, rows, n_in)
        if special and rows > 3:
            w[1, :3] = [np.inf, np.nan, 1e-40]
            w[2] = 0.0
        return B.encode(type_name, w) if type_name != "BF16" else \
            (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
    raw = rng.integers(0, 256, (rows, n_in // per, nbytes), dtype=np.uint8)
    for off in scale_offsets(type_name):
        f16 = np.float16(rng.random((rows, n_in // per)) * 0.02 - 0.01).view(np.uint16)
        if special:
            picks = rng.integers(0, len(SPECIAL_F16), (rows, n_in // per))
            chosen = rng.random((rows, n_in // per)) < 0.15
            f16 = np.where(chosen, SPECIAL_F16[picks], f16)
        raw[:, :, off:off + 2] = f16.astype("<u2").view(np.uint8).reshape(rows, -1, 2)
    if type_name == "MXFP4":            # random exponents would make nearly every product inf or 0
        e = rng.integers(118, 138, (rows, n_in // per))
        if special:
            e = np.where(rng.random(e.shape) < 0.15, SPECIAL_E8M0[rng.integers(0, len(SPECIAL_E8M0), e.shape)], e)
        raw[:, :, 0] = e
    return raw.reshape(rows, -1)


def n_in_for(type_name, blocks=2, ragged=True):
    """Inputs per row: whole blocks of the type; float types: 32 * blocks (+ 8 when ragged: the
    last block zero padded, which the SIMD decoders leave to the scalar one)."""
    per = B.TYPES[type_name][0]
    return per * blocks if per > 1 else 32 * blocks + (8 if ragged else 0)


# (type, ragged): the float types both with a zero-padded last block and with whole blocks
TYPE_SHAPES = [pytest.param(t, r, id=t + ("-ragged" if r and B.TYPES[t][0] == 1 else ""))
               for t in TYPES for r in ((True, False) if B.TYPES[t][0] == 1 else (True,))]


def matrix(m, parts, n_in):
    return m.BlockMatrix([(f"part{i}", t, data, len(data)) for i, (t, data) in enumerate(parts)], n_in)


def product(m, x, w, **kw):
    out = np.full((len(x), w.n_out), np.nan, np.float32)
    assert m.Matmul(**kw)(x, w, out) is out
    return out


def assert_same(a, b, msg=""):
    """Bit-identical, NaN included (any NaN equals any NaN)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, msg
    both_nan = np.isnan(a) & np.isnan(b)
    same = (a.view(np.uint32) == b.view(np.uint32)) | both_nan
    assert same.all(), f"{msg}: {np.count_nonzero(~same)} of {a.size} differ"


# -- semantics, on both sides -----------------------------------------------------------------

def test_block_quantization_by_hand(mod):
    x = np.zeros((2, 40), np.float32)
    x[0, :32] = np.linspace(-2.0, 1.0, 32, dtype=np.float32)
    x[0, 32:] = [0.5, -0.25, 0, 0, 0, 0, 0, 0]
    q, d = mod.quantize_rows(x)
    assert q.shape == (2, 40) and q.dtype == np.int8 and d.shape == (2, 2) and d.dtype == np.float32
    assert d[0, 0] == np.float32(2.0) / np.float32(127) and d[0, 1] == np.float32(0.5) / np.float32(127)
    assert q[0, 0] == -127 and q[0, 32] == 127 and q[0, 33] == -64       # -63.5 rounds half to even
    assert (q[1] == 0).all() and (d[1] == 0).all()                          # an all-zero block
    assert np.abs(q).max() <= 127


def test_rounding_is_half_to_even(mod):
    # amax 127 makes the step exactly 1: the values are their own quantization.
    x = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49] + [0.0] * 24], np.float32)
    q, d = mod.quantize_rows(x)
    assert d[0, 0] == 1.0
    assert q[0, :8].tolist() == [127, 0, 2, 2, 0, -2, -2, 3]


def q4_1_row(q, d, m):
    """One Q4_1 row from q [nb, 32] in 0..15, d [nb], m [nb] (ggml's block_q4_1)."""
    out = []
    for b in range(len(q)):
        nib = (q[b, :16] | (q[b, 16:] << 4)).astype(np.uint8)
        out.append(np.concatenate([np.float16([d[b], m[b]]).view(np.uint8), nib]))
    return np.concatenate(out)[None]


def test_product_is_the_block_formula(mod):
    """One output by hand: sum over blocks of isum * (d_w * d_x) + m_w * d_x * sum q_x."""
    rng = np.random.default_rng(1)
    q = rng.integers(0, 16, (2, 32))
    d, m = np.float32([0.5, 0.25]), np.float32([-1.0, 2.0])
    x = rand(rng, 1, 64)
    xq, dx = mod.quantize_rows(x)
    acc = np.float32(0)
    for b in range(2):
        isum = int(np.dot(q[b].astype(np.int64), xq[0, b * 32:(b + 1) * 32]))
        acc = acc + np.float32(isum) * (d[b] * dx[0, b])
        acc = acc + m[b] * (dx[0, b] * np.float32(xq[0, b * 32:(b + 1) * 32].astype(np.int32).sum()))
    y = product(mod, x, matrix(mod, [("Q4_1", q4_1_row(q, d, m))], 64))
    assert y[0, 0] == acc


def test_mxfp4_blocks_by_hand(mod):
    """MXFP4 (ggml's block_mxfp4: an E8M0 byte e, then 16 nibble bytes, low nibbles inputs 0..15, high
    16..31): each weight is its nibble's e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6, then their negatives)
    times 2^(e - 127), at the extreme scale bytes too; the product is the block formula with q the
    doubled values and d = 2^(e - 128)."""
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])
    i = np.arange(16)
    nibbles = [(i, 15 - i), ((7 * i + 3) % 16, (3 * i + 5) % 16)]          # [block] (low, high)
    es = [(0, 1), (127, 128), (255, 254), (120, 131)]                      # [row] (block 0's e, block 1's)
    raw = np.array([[b for (lo, hi), e in zip(nibbles, row) for b in [e, *(lo | (hi << 4))]] for row in es], np.uint8)
    want = np.array([[e2m1[n] * 2.0 ** (e - 127) for (lo, hi), e in zip(nibbles, row) for n in [*lo, *hi]]
                     for row in es], np.float32)
    w = mod.BlockMatrix([("t", "MXFP4", raw, len(es))], 64)
    assert mod.type_info("MXFP4") == (32, 17, "q")
    np.testing.assert_array_equal(w.to_float(), want)
    x = rand(np.random.default_rng(2), 1, 64)
    xq, dx = mod.quantize_rows(x)
    y = product(mod, x, w)
    for r, row in enumerate(es):
        acc = np.float32(0)
        for b, ((lo, hi), e) in enumerate(zip(nibbles, row)):
            q = (2 * e2m1[np.concatenate([lo, hi])]).astype(np.int64)
            isum = int(np.dot(q, xq[0, b * 32:(b + 1) * 32]))
            with np.errstate(over="ignore"):
                acc = acc + np.float32(isum) * (np.float32(2.0 ** (e - 128)) * dx[0, b])
        assert_same(y[0, r], acc, f"row {r}")


def test_half_block_offsets_are_the_qsm_formula(mod):
    """Kind "qsm" by hand (a Q2_K row): per block isum = s_0 * dot(0..15) + s_1 * dot(16..31), then
    acc + isum * (d * d_x), + m_0 * (d_x * sum q_x 0..15), + m_1 * (d_x * sum q_x 16..31), in that order.
    16 identical rows (a whole panel, which the fused Q2_K kernels need), on every isa fused and staged."""
    rng = np.random.default_rng(16)
    q = rng.integers(0, 4, (8, 32)).astype(np.uint8)
    sc, mn = rng.integers(0, 16, 16).astype(np.uint8), rng.integers(0, 16, 16).astype(np.uint8)
    d, dmin = np.float16(0.0123), np.float16(0.0456)
    qs = (q.reshape(2, 4, 32) << np.array([0, 2, 4, 6], np.uint8)[None, :, None]).sum(1, dtype=np.uint8).reshape(-1)
    row = np.concatenate([sc | (mn << 4), qs, np.float16([d, dmin]).view(np.uint8)])[None]
    assert B.TYPES["Q2_K"] == (256, 84, "qsm") and mod.type_info("Q2_K")[2] == "qsm"
    x = rand(rng, 1, 256)
    xq, dx = mod.quantize_rows(x)
    acc = np.float32(0)
    for b in range(8):
        xb = xq[0, b * 32:(b + 1) * 32].astype(np.int64)
        isum = int(sc[2 * b]) * int(np.dot(q[b, :16], xb[:16])) + int(sc[2 * b + 1]) * int(np.dot(q[b, 16:], xb[16:]))
        acc = acc + np.float32(isum) * (np.float32(d) * dx[0, b])
        for h in range(2):
            m = -(np.float32(dmin) * np.float32(mn[2 * b + h]))
            acc = acc + m * (dx[0, b] * np.float32(xb[16 * h:16 * h + 16].sum()))
    w = matrix(mod, [("Q2_K", np.repeat(row, 16, axis=0))], 256)
    runs = [{}] if mod.__name__ != IMPLS[0] else [dict(isa=i, fused=f) for i in mod.isas() for f in (True, False)]
    for kw in runs:
        y = product(mod, x, w, **kw)
        assert (y[0] == acc).all(), kw


def fma_exact(a, b, c) -> np.float32:
    """float32 a * b + c rounded once, from exact rationals: the nearest float32, ties to even."""
    v = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    with np.errstate(over="ignore"):
        r = np.float32(float(v))
    cands = [f for f in (r, np.nextafter(r, np.float32(np.inf)), np.nextafter(r, np.float32(-np.inf))) if np.isfinite(f)]
    return min(cands, key=lambda f: (abs(Fraction(float(f)) - v), int(f.view(np.uint32)) & 1))


def test_twin_fma_rounds_once():
    """The twin's fma32 on a product whose float64 sum lands on a float32 tie it is not (rounding through
    float64 would give 1 + 2^-22), and on random triples, equals the exact rational rounding."""
    a, b, c = np.float32(1 + 2 ** -23), np.float32(2 ** -24 * (1 - 2 ** -23)), np.float32(1 + 2 ** -23)
    assert np.float32(np.float64(a) * np.float64(b) + np.float64(c)) == np.float32(1 + 2 ** -22)
    assert twin().fma32(np.array([a]), np.array([b]), np.array([c]))[0] == fma_exact(a, b, c) == c
    big = np.float32(18631 * 2.0 ** 60), np.float32(1801 * 2.0 ** 43)      # a * b = 2^128 - 2^103: the tie past FLT_MAX
    below, above = (twin().fma32(np.array([big[0]]), np.array([big[1]]), np.array([c], np.float32))[0] for c in (-1, 1))
    assert below == fma_exact(big[0], big[1], np.float32(-1)) == np.finfo(np.float32).max
    assert above == np.inf          # just past the tie: rounds to 2^128, which overflows
    rng = np.random.default_rng(9)
    t = rand(rng, 3, 300)
    t[2, ::3] *= np.float32(-1e-3)
    got = twin().fma32(t[0], t[1], t[2])
    assert_same(got, np.array([fma_exact(*v) for v in t.T], np.float32), "random")


def test_float_product_sums_in_16_partial_sums(mod):
    """Float rows: p_(i mod 16) = fma(w_i, x_i, p_(i mod 16)) in input order, then p_k + p_(k+8), + p_(k+4),
    + p_(k+2), p_0 + p_1, worked here one scalar at a time with exact rationals (40 inputs: a partial last
    16; 19 rows: a partial panel and rows in groups of 4, 2 and 1), on every isa and thread count; inputs
    of very different sizes make any other order give other bits."""
    rng = np.random.default_rng(2)
    w, x = rand(rng, 19, 40), rand(rng, 5, 40)
    x[:, ::7] *= np.float32(3e4)
    want = np.zeros((5, 19), np.float32)
    for r in range(5):
        for o in range(19):
            p = [np.float32(0)] * 16
            for i in range(40):
                p[i % 16] = fma_exact(w[o, i], x[r, i], p[i % 16])
            for half in (8, 4, 2):
                p = [p[k] + p[k + half] for k in range(half)]
            want[r, o] = p[0] + p[1]
    m = mod.BlockMatrix.from_float(w)
    runs = [{}] if mod.__name__ != IMPLS[0] else [dict(isa=i, threads=t) for i in mod.isas() for t in (1, 2)]
    for kw in runs:
        for n in (1, 2, 5):
            np.testing.assert_array_equal(product(mod, x[:n], m, **kw), want[:n], err_msg=f"{kw} n={n}")
    sequential = np.zeros((5, 19), np.float32)
    for i in range(40):
        sequential = sequential + x[:, i, None] * w[None, :, i]
    assert (sequential != want).any()       # the order is seen


def test_float_padding_turns_a_negative_zero_sum_positive(mod):
    """17 inputs whose products all underflow to -0: the 15 partial sums the 17th input leaves alone still
    take the zero padding's fma(0, 0, -0) = +0, on every isa, so the output is +0 (not -0) everywhere."""
    w = np.full((3, 17), -2.0 ** -100, np.float32)
    x = np.full((2, 17), 2.0 ** -100, np.float32)
    m = mod.BlockMatrix.from_float(w)
    runs = [{}] if mod.__name__ != IMPLS[0] else [dict(isa=i) for i in mod.isas()]
    for kw in runs:
        y = product(mod, x, m, **kw)
        assert (y == 0).all() and not np.signbit(y).any(), kw


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_float_rows_in_input_blocks(type_name):
    """Rows longer than a block of inputs (_matmul_float.h FS_FKB = 512: 1100 = 2 blocks and a partial one,
    whose sums wait in a buffer between blocks) at 1, 5 and 9 activation rows: every isa and thread count
    gives the twin's bits."""
    x = rand(np.random.default_rng(11), 9, 1100)
    raw = random_blocks(type_name, 21, 1100, seed=12, special=False)
    want_m, got_m = matrix(twin(), [(type_name, raw)], 1100), matrix(c_mod(), [(type_name, raw)], 1100)
    for n in (1, 5, 9):
        want = product(twin(), x[:n], want_m)
        for isa in c_mod().isas():
            for threads in (1, 2):
                assert_same(product(c_mod(), x[:n], got_m, isa=isa, threads=threads), want, f"{isa} {threads} n={n}")


@pytest.mark.parametrize("type_name", TYPES)
def test_close_to_float32(mod, type_name):
    """The product on encoded random weights is close to the float64 product of the decoded weights."""
    rng = np.random.default_rng(3)
    n_in = n_in_for(type_name, 3 if B.TYPES[type_name][0] == 256 else 6)
    data = B.encode(type_name, rand(rng, 21, n_in))
    w = matrix(mod, [(type_name, data)], n_in)
    x = rand(rng, 5, n_in)
    ref = x.astype(np.float64) @ w.to_float().T.astype(np.float64)
    y = product(mod, x, w)
    assert np.abs(y - ref).max() <= 0.02 * np.abs(ref).max() + 1e-6


def test_bad_matrices_are_refused(mod):
    data = B.encode("Q4_1", np.ones((4, 64), np.float32))
    with pytest.raises(ValueError, match="truncated"):
        mod.BlockMatrix([("t", "Q4_1", data.reshape(-1)[:-3], 4)], 64)
    with pytest.raises(ValueError, match="IQ2_XXS has no kernel"):
        mod.BlockMatrix([("t", "IQ2_XXS", data, 4)], 64)
    with pytest.raises(ValueError, match="whole blocks"):
        mod.BlockMatrix([("t", "Q4_K", data, 4)], 64)
    w = mod.BlockMatrix([("t", "Q4_1", data, 4)], 64)
    with pytest.raises(ValueError):
        mod.Matmul()(np.ones((2, 63), np.float32), w, np.empty((2, 4), np.float32))
    with pytest.raises(ValueError):
        mod.Matmul()(np.ones((2, 64), np.float32), w, np.empty((3, 4), np.float32))
    with pytest.raises(ValueError):
        mod.Matmul(threads=0)
    with pytest.raises(IndexError):
        w.get_rows([4])
    out = np.empty((0, 4), np.float32)
    assert mod.Matmul()(np.ones((0, 64), np.float32), w, out) is out


# -- the twin's decode is the file format ---------------------------------------------------------

@pytest.mark.parametrize("type_name", TYPES)
def test_twin_decode_is_gguf_dequantize(type_name):
    """d * (s * q) + m per input equals gguf.quants.dequantize within float32 rounding, on random
    bytes (every quant pattern; finite scales)."""
    import gguf
    from gguf.quants import dequantize

    n_in = n_in_for(type_name, 4 if B.TYPES[type_name][0] == 256 else 8)
    if B.TYPES[type_name][2] == "f":
        n_in = 128
    raw = random_blocks(type_name, 6, n_in, seed=4, special=False)
    mine = B.dequantize(B.decode(type_name, raw, 6, n_in))
    ref = dequantize(raw, gguf.GGMLQuantizationType[type_name]).astype(np.float32).reshape(6, n_in)
    np.testing.assert_allclose(mine, ref, rtol=2 ** -22, atol=1e-37)


@pytest.mark.parametrize("type_name", TYPES)
def test_encoder_round_trip(type_name):
    rng = np.random.default_rng(5)
    n_in = n_in_for(type_name, 2)
    w = rand(rng, 8, n_in)
    back = B.dequantize(B.decode(type_name, B.encode(type_name, w), 8, n_in))
    bound = {"Q3_K": 0.2, "Q2_K": 0.35}.get(type_name, 0.15)     # 8 and 4 levels per 16 inputs
    assert np.sqrt(np.mean((back - w) ** 2) / np.mean(w ** 2)) < bound


# -- C against the twin, bit for bit ------------------------------------------------------------

def test_quantization_bit_exact():
    rng = np.random.default_rng(3)
    x = rand(rng, 9, 100, scale=3.0)
    x[0, :5] = 0.0
    x[1] = 0.0                                       # a row of zero blocks
    x[2] *= np.float32(1e-30)                        # tiny scales
    x[3] *= np.float32(1e-39)                        # denormals: zero blocks
    for a, b in zip(c_mod().quantize_rows(x), twin().quantize_rows(x)):
        np.testing.assert_array_equal(a, b)


def test_quantization_isas_bit_exact():
    """The SIMD quantizers (AVX2: the avx2 and avx512vnni products') give the portable one's bytes: against the twin
    on ordinary, zero, tiny, denormal, huge and ragged rows; against the portable C on inf and NaN (no twin rule)."""
    m = c_mod()
    rng = np.random.default_rng(5)
    x = rand(rng, 12, 200, scale=3.0)
    x[0, :40] = 0.0
    x[1, 7] = -x[1, 7] * 1e4                         # one input sets the block's scale, its sign negative
    x[2] *= np.float32(1e-30)
    x[3] *= np.float32(1e-39)
    x[4, :] = np.float32(3e38) * np.sign(x[4])
    x[5, ::2] = 0.5                                  # halves: v * 127 / amax at .5 rounds to even
    odd = x.copy()
    odd[6, 3], odd[7, 40], odd[8, 100], odd[8, 130] = np.inf, np.nan, -np.inf, np.nan
    for r, i in ((9, 31), (10, 64 + 27), (11, 96 + 24), (11, 160 + 7)):   # NaN last in each 8-input slice
        odd[r, i] = np.nan
    for isa in m.isas():
        for n_in in (200, 32, 1, 45):
            xs = np.ascontiguousarray(x[:, :n_in])
            for a, b in zip(m.quantize_rows(xs, isa), twin().quantize_rows(xs)):
                assert a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), \
                    f"{isa}, {n_in} inputs"
        for a, b in zip(m.quantize_rows(odd, isa), m.quantize_rows(odd, "scalar")):
            assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), f"{isa}, inf and NaN"


@pytest.mark.parametrize("type_name,ragged", TYPE_SHAPES)
def test_decode_bit_exact(type_name, ragged):
    """What each isa's decoder stages (q, d, m, s per lane and block) is the twin's decode."""
    n_out, n_in = 37, n_in_for(type_name, 3, ragged)     # 3: the stagers' odd last block (32-input types)
    raw = random_blocks(type_name, n_out, n_in, seed=6)
    want = B.decode(type_name, raw, n_out, n_in)
    w = matrix(c_mod(), [(type_name, raw)], n_in)
    if want.kind == "f":            # read as stored by the products (_matmul_float.h)
        with pytest.raises(ValueError, match="no staged layout"):
            w.staged_panel(0)
        return
    for isa in c_mod().isas():
        for p in range(3):
            st = w.staged_panel(p, isa)
            lanes = range(p * 16, min(n_out, p * 16 + 16))
            nv = len(lanes)
            raw_q = st[:, :512].reshape(-1, 8, 16, 4).transpose(2, 0, 1, 3).reshape(16, -1, 32)
            q = (raw_q - np.uint8(c_mod().stage_bias(type_name, isa))).view(np.int8).astype(np.int16)
            np.testing.assert_array_equal(q[:nv], want.q[lanes], err_msg=f"{isa} q")
            assert (q[nv:] == 0).all()
            assert_same(st[:, 512:576].view(np.float32).T[:nv], want.d[lanes], f"{isa} d")
            if want.m is not None and want.kind == "qsm":
                m = np.stack([st[:, 704:768].view(np.float32).T, st[:, 768:832].view(np.float32).T], -1)
                assert_same(m[:nv], want.m[lanes], f"{isa} m")
                assert (m[nv:] == 0).all()
            elif want.m is not None:
                assert_same(st[:, 576:640].view(np.float32).T[:nv], want.m[lanes], f"{isa} m")
            if want.s is not None:
                s = np.stack([st[:, 576:640].view(np.int32).T, st[:, 640:704].view(np.int32).T], -1)
                np.testing.assert_array_equal(s[:nv], want.s[lanes], err_msg=f"{isa} s")


def test_stage_bias_by_isa():
    """Pins the API: stage_bias's table. Staged q are VNNI's unsigned q + 128, except on AVX2, whose
    tile reads them as its maddubs operand: the unsigned q + offset (Q4_0: nibble, Q5_0: 5-bit value,
    Q6_K: 6-bit value, Q3_K: q + 4, the offset-free types as they are) and the plain int8 q of Q8_0
    and IQ4_NL / IQ4_XS, MXFP4's q + 12. That the stagers store these is test_decode_bit_exact's check; that stagers
    and tiles agree is what test_outputs_bit_exact / test_small_batches_bit_exact check."""
    m = c_mod()
    avx2 = {"Q4_0": 8, "Q4_1": 0, "Q5_0": 16, "Q5_1": 0, "Q8_0": 0, "Q4_K": 0, "Q5_K": 0, "Q6_K": 32,
            "IQ4_NL": 0, "IQ4_XS": 0, "Q3_K": 4, "Q2_K": 0, "MXFP4": 12}
    for isa in m.isas():
        for t, off in avx2.items():
            assert m.stage_bias(t, isa) == (off if isa == "avx2" else 128), (isa, t)
    with pytest.raises(ValueError):
        m.stage_bias("Q7_X")


@pytest.mark.parametrize("type_name,ragged", TYPE_SHAPES)
def test_outputs_bit_exact(type_name, ragged):
    """Every kernel and thread count gives the twin's bits, on random blocks with zero, denormal,
    NaN, inf and extreme scales, and activations with zero, tiny and denormal blocks."""
    rng = np.random.default_rng(7)
    n_out, n_in = 53, n_in_for(type_name, 3 if B.TYPES[type_name][0] == 256 else 5, ragged)
    raw = random_blocks(type_name, n_out, n_in, seed=8)
    x = rand(rng, 19, n_in)
    x[3] = 0.0
    x[4] *= np.float32(1e-39)
    x[5, :32] *= np.float32(1e30)
    want = product(twin(), x, matrix(twin(), [(type_name, raw)], n_in))
    wc = matrix(c_mod(), [(type_name, raw)], n_in)
    for isa, threads in kernels():
        assert_same(product(c_mod(), x, wc, threads=threads, isa=isa), want, f"{type_name} {isa} {threads} threads")
    assert_same(wc.get_rows([0, 5, n_out - 1]), matrix(twin(), [(type_name, raw)], n_in).get_rows([0, 5, n_out - 1]))


@pytest.mark.parametrize("type_name", TYPES)
def test_small_batches_bit_exact(type_name):
    """n = 1..6 rows (the fused kernels' batches, fused_types(); on avx2 n = 5, 6 of these narrow matrices
    run fused in groups of FUSED_MAX_N rows, each group's activations and outputs offset), with odd block
    counts and row counts that leave a partial panel of 16: the twin's bits with the fused path and with
    staging, on 1 to 3 threads."""
    m = c_mod()
    rng = np.random.default_rng(14)
    per = B.TYPES[type_name][0]
    for isa in set(m.isas()) & {"avx2", "avx512vnni"}:
        assert {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "IQ4_XS", "MXFP4", "Q3_K", "Q2_K"} <= set(m.fused_types(isa)), isa
    for n_out, blocks in ((37, 1), (16, 3), (53, 2 if per == 256 else 5)):
        n_in = n_in_for(type_name, blocks, ragged=True)
        raw = random_blocks(type_name, n_out, n_in, seed=15 + blocks)
        x = rand(rng, m.FUSED_GROUPS_MAX_N, n_in)
        x[1, :32] = 0.0
        x[2, -32:] *= np.float32(1e30)
        want = product(twin(), x, matrix(twin(), [(type_name, raw)], n_in))
        wc = matrix(m, [(type_name, raw)], n_in)
        for isa, threads in kernels():
            for fused in (True, False):
                mm = m.Matmul(threads=threads, isa=isa, fused=fused)
                for n in range(1, m.FUSED_GROUPS_MAX_N + 1):
                    got = mm(x[:n], wc, np.full((n, n_out), np.nan, np.float32))
                    assert_same(got, want[:n], f"{type_name} {n_out}x{n_in} n={n} {isa} {threads} threads fused={fused}")


def test_stacked_parts_of_mixed_types():
    """Q4_K | Q6_K | F16 | Q8_0 | Q3_K | Q2_K parts in one matrix: one activation quantization, each
    part into its column range, the same bits as each part alone and as the twin."""
    rng = np.random.default_rng(9)
    n_in = 512
    parts = [(t, random_blocks(t, r, n_in, seed=i, special=False))
             for i, (t, r) in enumerate([("Q4_K", 40), ("Q6_K", 19), ("F16", 5), ("Q8_0", 16), ("Q3_K", 21),
                                         ("Q2_K", 32)])]
    x = rand(rng, 7, n_in)
    want = product(twin(), x, matrix(twin(), parts, n_in))
    alone = np.concatenate([product(c_mod(), x, matrix(c_mod(), [p], n_in)) for p in parts], axis=1)
    wc = matrix(c_mod(), parts, n_in)
    assert wc.types == ("Q4_K", "Q6_K", "F16", "Q8_0", "Q3_K", "Q2_K") and wc.n_out == 133
    for isa, threads in kernels():
        assert_same(product(c_mod(), x, wc, threads=threads, isa=isa), want, f"{isa}, {threads} threads")
    assert_same(alone, want)


def test_stacked_iq4_parts():
    """IQ4_NL | Q4_0 | IQ4_XS | MXFP4 | Q4_K parts of partial panels in one matrix: the twin's bits at the
    fused kernels' batches and above, on every kernel."""
    rng = np.random.default_rng(16)
    n_in = 512
    parts = [(t, random_blocks(t, r, n_in, seed=20 + i))
             for i, (t, r) in enumerate([("IQ4_NL", 21), ("Q4_0", 16), ("IQ4_XS", 19), ("MXFP4", 23), ("Q4_K", 8)])]
    x = rand(rng, 7, n_in)
    want = product(twin(), x, matrix(twin(), parts, n_in))
    wc = matrix(c_mod(), parts, n_in)
    assert wc.types == ("IQ4_NL", "Q4_0", "IQ4_XS", "MXFP4", "Q4_K") and wc.n_out == 87
    for isa, threads in kernels():
        for n in (1, 2, 7):
            assert_same(product(c_mod(), x[:n], wc, threads=threads, isa=isa), want[:n], f"{isa}, {threads} threads, n={n}")


@pytest.mark.parametrize("type_name", [t for t in TYPES if B.TYPES[t][2] != "f"])
def test_verification_batches_bit_exact(type_name):
    """A verification's 7 to 49 rows through the staged panels (on avx2 tiles of 3 rows times both halves of a
    panel, the 1 or 2 rows left in a last tile; a last panel of 13 outputs, whose second half is partial, and
    one of 5, a half alone; 13 or 16 blocks of inputs: the sums carried across avx2's input blocks of 6, the
    last one short, and across its row blocks of 24): the twin's bits, on 1 and 2 threads, the first n rows or
    the last."""
    m = c_mod()
    rng = np.random.default_rng(21)
    n_in = n_in_for(type_name, 2 if B.TYPES[type_name][0] == 256 else 13)
    x = rand(rng, 49, n_in)
    x[8, :32] = 0.0
    for n_out in (29, 21):
        raw = random_blocks(type_name, n_out, n_in, seed=n_out)
        want = product(twin(), x, matrix(twin(), [(type_name, raw)], n_in))
        wc = matrix(m, [(type_name, raw)], n_in)
        for isa, threads in kernels():
            if threads == 3:
                continue
            mm = m.Matmul(threads=threads, isa=isa, fused=False)
            for n in (7, 9, 10, 17, 33, 49):
                for rows in (slice(0, n), slice(49 - n, 49)):
                    got = mm(x[rows], wc, np.full((n, n_out), np.nan, np.float32))
                    assert_same(got, want[rows], f"{type_name} {n_out}x{n_in} rows {rows} {isa} {threads} threads")


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q6_K"])
def test_activations_quantized_by_the_tasks_threads(type_name):
    """From QUANT_SPLIT_N rows the threads of a product's tasks quantize its activations, 4 rows at a time, and
    wait for each other's rows before their first panel: on a matrix of 64 panels (tasks on every thread), n
    around the split and around the 4-row takes gives the twin's bits on 2 and 3 threads as on 1 (which
    quantizes alone), the quantization's special values included (a zero block, a row of one huge input)."""
    m = c_mod()
    split = m.QUANT_SPLIT_N
    rng = np.random.default_rng(23)
    n_in = n_in_for(type_name, 18 if B.TYPES[type_name][0] == 32 else 3)
    x = rand(rng, 49, n_in)
    x[5, :32] = 0.0
    x[split, 7] = 3e38
    raw = random_blocks(type_name, 1024, n_in, seed=24, special=False)
    want = product(twin(), x, matrix(twin(), [(type_name, raw)], n_in))
    wc = matrix(m, [(type_name, raw)], n_in)
    for isa, threads in kernels():
        mm = m.Matmul(threads=threads, isa=isa)
        for n in (split - 1, split, split + 1, split + 3, 49):
            got = mm(x[:n], wc, np.full((n, 1024), np.nan, np.float32))
            assert_same(got, want[:n], f"{type_name} n={n} {isa} {threads} threads")


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4", "Q3_K", "Q2_K", "F16"])
def test_batch_invariance(type_name):
    """Each row's outputs are bit-identical alone, among 2, 7 or 31 other rows, at any offset."""
    rng = np.random.default_rng(10)
    n_out, n_in = 70, 512
    raw = random_blocks(type_name, n_out, n_in, seed=11, special=False)
    x = rand(rng, 32, n_in)
    full = product(twin(), x, matrix(twin(), [(type_name, raw)], n_in))
    wc = matrix(c_mod(), [(type_name, raw)], n_in)
    for isa, threads in kernels():
        mm = c_mod().Matmul(threads=threads, isa=isa)
        for n in (1, 3, 8, 32):
            for start in sorted({0, 1, 5, 32 - n}):
                if start + n > 32:
                    continue
                got = mm(x[start:start + n], wc, np.empty((n, n_out), np.float32))
                np.testing.assert_array_equal(got, full[start:start + n],
                                              err_msg=f"{isa}, {threads} threads, rows {start}..{start + n}")


def test_scratch_reuse_after_a_larger_call():
    rng = np.random.default_rng(12)
    w = matrix(c_mod(), [("Q6_K", random_blocks("Q6_K", 40, 512, 13, special=False))], 512)
    mm = c_mod().Matmul(threads=2)
    big, small = rand(rng, 50, 512), rand(rng, 2, 512)
    mm(big, w, np.empty((50, 40), np.float32))
    np.testing.assert_array_equal(mm(small, w, np.empty((2, 40), np.float32)), product(c_mod(), small, w))


def test_unknown_isa_is_refused():
    with pytest.raises(ValueError):
        c_mod().Matmul(isa="sse9")
    assert "scalar" in c_mod().isas() and c_mod().best_isa() in c_mod().isas()


def test_isa_named_by_the_environment(monkeypatch):
    """FASTSERVE_ISA picks the kernels "auto" runs (a lesser ISA's path on a better machine), for the
    products and attention alike; a name this machine cannot run is refused, never ignored."""
    from fastserve.backends.cpu import _attention
    for isa in c_mod().isas():
        monkeypatch.setenv("FASTSERVE_ISA", isa)
        assert c_mod().best_isa() == isa and c_mod().Matmul().isa == isa
        assert _attention.Attention().isa in _attention.isas()
    monkeypatch.setenv("FASTSERVE_ISA", "scalar")
    assert _attention.Attention().isa == "scalar"
    monkeypatch.setenv("FASTSERVE_ISA", "sse9")
    with pytest.raises(ValueError):
        c_mod().Matmul()
    with pytest.raises(ValueError):
        _attention.Attention()


# -- in the backend --------------------------------------------------------------------------------

def test_backend_threads_change_no_bit(tiny_model):
    from fastserve.backends.cpu.backend import CpuBackend

    cfg, w = tiny_model.config, tiny_model.weights
    ids = np.array([5, 77, 300, 12, 9, 401, 33], np.int32)
    pos = np.arange(len(ids))

    def logits(**kw):
        be = CpuBackend(cfg, w, 1, 16, **kw)
        return be.forward(ids, pos, np.zeros(len(ids), np.int64), pos)

    np.testing.assert_array_equal(logits(), logits(threads=3))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4", "Q3_K", "Q2_K", "F16"])
def test_load_maps_tensors_without_copying(tmp_path, qtype):
    """The loaded matrices are views of the mapped file: each part shares memory with its tensor."""
    import fastserve
    from fastserve.models.gguf_file import GGUFFile
    from fastserve.models.synthetic import write_llama_gguf

    path = write_llama_gguf(tmp_path / f"{qtype}.gguf", seed=5, weight_type=qtype, n_embd=256, n_ff=512)
    model = fastserve.load_model(path)
    gf = GGUFFile(path)
    wqkv = model.weights.layers[1].wqkv
    assert wqkv.types == (qtype,) * 3 and wqkv.labels[0].endswith("blk.1.attn_q.weight")
    for arr, name in zip(wqkv.arrays, "qkv"):
        assert arr.nbytes == gf.tensors[f"blk.1.attn_{name}.weight"].data.nbytes
        root = arr
        while getattr(root, "base", None) is not None:
            root = root.base
        assert isinstance(root, mmap.mmap), f"blk.1.attn_{name}.weight is not a view of the mapped file"
    entries = [gf.tensors[f"blk.1.attn_{n}.weight"] for n in "qkv"]
    want = np.concatenate([B.dequantize(B.decode(qtype, e.data, e.shape[0], 256)) for e in entries])
    np.testing.assert_array_equal(wqkv.to_float(), want)


def test_other_types_are_repacked_to_q8_0(tmp_path, monkeypatch, caplog):
    """A TQ2_0 tensor (random valid blocks: a type with no kernel) is repacked once at load into Q8_0,
    and the load log says so."""
    import gguf
    import fastserve
    from fastserve.models import synthetic

    real_add = synthetic._add

    def add(writer, name, arr, weight_type):
        if name == "blk.0.ffn_down.weight":
            raw = np.random.default_rng(0).integers(0, 256, (arr.shape[0], arr.shape[1] // 256 * 66), dtype=np.uint8)
            raw.reshape(arr.shape[0], -1, 66)[:, :, 64:66] = np.array([0.001], np.float16).view(np.uint8)
            writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.TQ2_0)
        else:
            real_add(writer, name, arr, weight_type)

    monkeypatch.setattr(synthetic, "_add", add)
    path = synthetic.write_llama_gguf(tmp_path / "tq2.gguf", n_embd=256, n_ff=512, seed=1)
    caplog.set_level("INFO", logger="fastserve.models")
    model = fastserve.load_model(path)
    assert model.weights.layers[0].w_down.types == ("Q8_0",)
    assert "TQ2_0" not in c_mod().KERNEL_TYPES
    assert "tensor blk.0.ffn_down.weight: TQ2_0 repacked to Q8_0" in caplog.text
    assert np.isfinite(model.logits([1, 2, 3])).all()


# -- the C header alone: every kernel against the scalar one, here and on aarch64 -------------------

HARNESS = r"""
#include "_matmul_kernels.h"
#include "_pool.h"
#include <stdio.h>
static uint32_t rs = 12345;
static uint32_t rnd(void) { rs = rs * 1664525u + 1013904223u; return rs >> 8; }
static float frnd(void) { return ((float)(rnd() % 20001) - 10000.0f) / 3000.0f; }
static int same(const float *a, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], 4) && !(isnan(a[i]) && isnan(b[i]))) return 0;
    return 1;
}
int main(void) {
    const int types[] = {FS_T_F32, FS_T_F16, FS_T_BF16, FS_T_Q4_0, FS_T_Q4_1, FS_T_Q5_0, FS_T_Q5_1,
                         FS_T_Q8_0, FS_T_Q4_K, FS_T_Q5_K, FS_T_Q6_K, FS_T_IQ4_NL, FS_T_IQ4_XS, FS_T_Q3_K, FS_T_Q2_K,
                         FS_T_MXFP4};
    int fails = 0, checks = 0, fused_checks = 0;
    for (int isa = 0; isa <= 4; isa++) printf("isa %d supported %d\n", isa, fs_isa_supported(isa));
    printf("best %d\n", fs_best_isa());
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        fs_type_info t;
        fs_type(types[ti], &t);
        /* floats: 1064 inputs, two input blocks (FS_FKB) and a partial 16 */
        int64_t o = 37, in = t.kind == FS_KIND_F ? 1064 : t.block_inputs == 256 ? 512 : 96, nb = (in + 31) / 32;
        int64_t rb = fs_row_bytes(&t, in);
        uint8_t *w = malloc(o * rb);
        for (int64_t i = 0; i < o * rb; i++) w[i] = (uint8_t)rnd();
        if (types[ti] == FS_T_MXFP4)    /* ordinary exponents: random ones would make most products inf or 0 */
            for (int64_t i = 0; i < o * rb; i += 17) w[i] = (uint8_t)(118 + rnd() % 20);
        if (t.kind == FS_KIND_F)        /* finite floats: random bits would be mostly NaN for F32 */
            for (int64_t i = 0; i < o * in; i++) {
                float f = frnd();
                if (types[ti] == FS_T_F32) memcpy(w + 4 * i, &f, 4);
                else { uint16_t h = (uint16_t)(0x3000 + rnd() % 0x1800); memcpy(w + 2 * i, &h, 2); }
            }
        fs_part part = {types[ti], t.kind, w, o, rb, 0, 0};
        for (int n = 1; n <= 19; n += (n < 10 ? 1 : 9)) {
            float *x = malloc(n * in * 4);
            for (int64_t i = 0; i < n * in; i++) x[i] = frnd();
            int8_t *xq = malloc(n * nb * 32); float *dx = malloc(n * nb * 4), *sx = malloc(n * nb * 4);
            float *xf = malloc(n * nb * 32 * 4);
            int32_t *xs = malloc(n * nb * 4), *xh = malloc(n * nb * 4);
            fs_quantize_rows(x, n, in, in, xq, dx, xs, xh, sx);
            fs_pad_rows(x, n, in, in, xf);
            float *y0 = malloc(n * o * 4), *y1 = malloc(n * o * 4);
            int64_t n_panels = (o + 15) / 16;
            uint8_t *stage = malloc(n_panels * nb * fs_stage_bytes(t.kind));
            fs_product pr = {&part, 1, in, n_panels, FS_ISA_SCALAR, {0}, {0}, stage, nb * fs_stage_bytes(t.kind), 1};
            pr.act.nb = nb; pr.act.xq = xq; pr.act.dx = dx; pr.act.xs = xs; pr.act.xh = xh; pr.act.sx = sx;
            pr.act.xf = xf; pr.act.n = n; pr.act.y = y0; pr.act.ldy = o;
            for (int k = 0; k < FS_N_KINDS; k++) pr.kern[k] = fs_kernel_for(FS_ISA_SCALAR, k);
            fs_product_task(&pr, 0, n_panels);
            fused_checks += fs_fused_ok(FS_ISA_AVX512VNNI, types[ti], n, 16) && fs_isa_supported(FS_ISA_AVX512VNNI);
            for (int isa = 1; isa <= 4; isa++) {
                if (!fs_isa_supported(isa)) continue;
                for (int th = 1; th <= 4; th++) {          /* 3, 4: 1, 2 threads, fused */
                    fs_pool *pl = th % 2 == 0 ? fs_pool_new(2, 100000) : NULL;
                    memset(y1, 0xff, n * o * 4);
                    pr.isa = isa;
                    pr.fused = th > 2;
                    for (int k = 0; k < FS_N_KINDS; k++) pr.kern[k] = fs_kernel_for(isa, k);
                    pr.act.y = y1;
                    fs_pool_run(pl, fs_product_task, &pr, n_panels, 1);
                    fs_pool_free(pl);
                    checks++;
                    if (!same(y0, y1, n * o)) { fails++; printf("MISMATCH isa %d type %d n %d th %d\n", isa, types[ti], n, th); }
                }
            }
            free(x); free(xq); free(dx); free(sx); free(xf); free(xs); free(xh); free(y0); free(y1); free(stage);
        }
        free(w);
    }
    printf("%d fused products\n", fused_checks);
    printf("%d checks, %d mismatches\n", checks, fails);
    return fails != 0;
}
"""
HEADER_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "fastserve", "backends", "cpu")
CFLAGS = ["-O3", "-ffp-contract=off", "-pthread", "-Wall", "-Wextra", "-Werror", "-Wno-unused-function",
          "-Wno-missing-field-initializers"]


def _check_harness(tmp_path, cc, run_prefix=()):
    src = tmp_path / "harness.c"
    src.write_text(HARNESS)
    exe = tmp_path / "harness"
    built = subprocess.run([*cc, *CFLAGS, "-I", HEADER_DIR, str(src), "-o", str(exe), "-lm"], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    ran = subprocess.run([*run_prefix, str(exe)], capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0 and " 0 mismatches" in ran.stdout, ran.stdout + ran.stderr
    return ran.stdout


def test_c_kernels_agree_natively(tmp_path):
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()
    if not shutil.which(cc[0]):
        pytest.skip(f"no C compiler {cc[0]!r}")
    out = _check_harness(tmp_path, cc)
    assert "checks" in out
    if c_mod().best_isa() == "avx512vnni":
        assert int(out.split(" fused products")[0].split()[-1]) > 0, out


@pytest.mark.skipif(sys.platform != "linux", reason="cross-checks run on Linux")
@pytest.mark.parametrize("march", ["armv8-a", "armv8.2-a+dotprod"])
def test_c_kernels_agree_on_aarch64(tmp_path, march):
    if not (shutil.which("aarch64-linux-gnu-gcc") and shutil.which("qemu-aarch64")):
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt: gcc-aarch64-linux-gnu qemu-user)")
    out = _check_harness(tmp_path, ["aarch64-linux-gnu-gcc", f"-march={march}"],
                         ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu"])
    assert "isa 3 supported 1" in out and "isa 4 supported 1" in out      # neon, and sdot (built or detected)
