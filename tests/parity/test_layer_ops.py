"""The element-wise operations of a layer (fastserve/backends/cpu/_layer_ops.h through fastserve.backends.cpu._forward) against their
NumPy twins (fastserve.backends.cpu.ref.layer_ops), bit for bit, on random rows with zeros, large values and odd sizes;
and close to the exact functions in float64."""
import numpy as np
import pytest

from fastserve.backends.cpu import _forward as C
from fastserve.backends.cpu.ref import layer_ops as R

SIZES = (1, 3, 15, 16, 17, 33, 64, 100, 576, 1000)


def _rows(rng, n, d, scale=1.0):
    """Random rows with a few zeros, huge and tiny values mixed in."""
    x = (rng.standard_normal((n, d)) * scale).astype(np.float32)
    x.flat[rng.integers(0, x.size, max(1, x.size // 10))] = 0.0
    x.flat[rng.integers(0, x.size, max(1, x.size // 20))] *= np.float32(1e4)
    x.flat[rng.integers(0, x.size, max(1, x.size // 20))] *= np.float32(1e-6)
    return x


def _same(a, b):
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{np.count_nonzero(a != b)} values differ"


@pytest.mark.parametrize("d", SIZES)
def test_rms_norm_is_its_twin(d):
    rng = np.random.default_rng(d)
    x, w = _rows(rng, 5, d), (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    x[0] = 0.0                                              # a zero row: x * (1 / sqrt(eps)) = 0
    x[1] *= np.float32(1e15)                                # squares overflow: inf, then 0 * x or nan
    for eps in (1e-5, 1e-6):
        got = C.rms_norm(x, w, eps)
        _same(got, R.rms_norm(x, w, eps))
        xd = x[2:].astype(np.float64)
        want = xd / np.sqrt((xd * xd).mean(axis=1, keepdims=True) + eps) * w
        np.testing.assert_allclose(got[2:], want, rtol=2e-6, atol=1e-30)


def test_rms_norm_sums_in_sixteen_lanes():
    """The fixed order: lane j sums the squares of x[j], x[j + 16], ... then the lanes fold in halves."""
    x = np.zeros((1, 40), np.float32)
    x[0, [0, 16, 1, 17]] = 2.0 ** 12, 1.0, 1.0, 1.0
    # lane 0: 2^24 + 1 rounds to 2^24; lane 1: 1 + 1 = 2; folded: 2^24 + 2 (exact: 2^24 + 3; in input
    # order the three ones would each be lost: 2^24)
    assert R.sum_squares(x)[0] == np.float32(2.0 ** 24 + 2)
    got = C.rms_norm(x, np.ones(40, np.float32), 0.0)
    _same(got, R.rms_norm(x, np.ones(40, np.float32), 0.0))


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("D, rope_dim", [(64, 64), (48, 32), (128, 96), (6, 2)])
def test_rope_is_its_twin(neox, D, rope_dim):
    rng = np.random.default_rng(D + rope_dim)
    n, heads, half = 7, 3, rope_dim // 2
    x = _rows(rng, n * heads, D).reshape(n, heads, D)
    theta = rng.uniform(-100, 100, (n, half))
    cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
    got = C.rope(x, cos, sin, rope_dim, neox)
    want = x.copy()
    R.apply_rope(want, cos, sin, rope_dim, neox=neox)
    _same(got, want)
    assert np.array_equal(got[:, :, rope_dim:], x[:, :, rope_dim:])      # past rope_dim: untouched


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("n", [1, 7, 16, 1536])
def test_glu_is_its_twin(gelu, n):
    rng = np.random.default_rng(n)
    g, u = (_rows(rng, 1, n, 4.0)[0] for _ in range(2))
    g[:3] = np.array([0.0, -200.0, 200.0], np.float32)[:n] if n >= 3 else g[:3]
    got = C.glu(g, u, gelu)
    _same(got, (R.geglu if gelu else R.swiglu)(g, u))
    gd, ud = g.astype(np.float64), u.astype(np.float64)
    if gelu:
        # 0.5 (1 + tanh(y)) as 1 / (1 + exp(-2y)): in float64 too, 1 + tanh(y) loses the far left tail
        want = gd / (1 + np.exp(-2 * np.sqrt(2 / np.pi) * (gd + 0.044715 * gd ** 3))) * ud
    else:
        want = gd / (1 + np.exp(-gd)) * ud
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-30)


@pytest.mark.parametrize("n", [1, 7, 16, 1536])
def test_swiglu_oai_is_its_twin(n):
    """gpt-oss's SwiGLU (llama.cpp's swiglu_oai): the gate clamped above at 7, up to [-7, 7], then
    (x sigmoid(1.702 x)) (y + 1); values at and past the limits, NaN kept."""
    rng = np.random.default_rng(n + 5)
    g, u = (_rows(rng, 1, n, 6.0)[0] for _ in range(2))
    edge = np.array([7.0, 7.5, -7.5, 1e4, -1e4, 0.0, np.nan], np.float32)[:n]
    g[:len(edge)], u[:len(edge)] = edge, edge[::-1]
    got = C.glu(g, u, C.GLU_KINDS["swiglu_oai"])
    _same(got, R.swiglu_oai(g, u))
    gd = np.minimum(g.astype(np.float64), 7.0)
    ud = np.clip(u.astype(np.float64), -7.0, 7.0)
    want = gd / (1 + np.exp(-1.702 * gd)) * (ud + 1)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-30)
    # the limits bite: a gate past 7 is 7's, an up past -7 is -7's (so (y + 1) is -6, not what silu * up gives)
    big = C.glu(np.array([9.0, 7.0], np.float32), np.array([-9.0, -7.0], np.float32), C.GLU_KINDS["swiglu_oai"])
    assert big[0] == big[1] and big[0] < 0 and abs(big[0] - 7.0 / (1 + np.exp(-1.702 * 7.0)) * -6.0) < 1e-5
    with pytest.raises(ValueError, match="unknown kind"):
        C.glu(g, u, 3)


SIMD = [False] + ([True] if C.glu_simd_supported() else [])


@pytest.mark.parametrize("simd", SIMD)
@pytest.mark.parametrize("kind", sorted(C.GLU_KINDS))
def test_glu_simd_is_the_scalar_code(kind, simd):
    """The forward's GLU (AVX2 eight at a time where the machine has it, the scalar code for a row's tail) is
    the twin bit for bit at every length (tails 0..7), in place too, on the edges of the contract's branches:
    e^x's clamp at -87 and 0, sigmoid's sign test, swiglu_oai's limits, NaN, infinities, zeros, denormals."""
    rng = np.random.default_rng(len(kind))
    edge = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 87.0, -87.0, 86.99999, -87.00001, 1e-40, -1e-40, 7.0,
                     -7.0, 7.000001, -7.000001, 1e4, -1e4, 0.5, -0.5, 3.4e38, -3.4e38, 88.0, -88.0, 43.5, -43.5],
                    np.float32)
    twin = {"silu": R.swiglu, "gelu": R.geglu, "swiglu_oai": R.swiglu_oai}[kind]
    for n in [*range(1, 36), 1536, 1541]:
        g, u = (_rows(rng, 1, n, 30.0)[0] for _ in range(2))
        k = min(n, len(edge))
        g[:k], u[:k] = edge[:k], rng.permutation(edge)[:k]
        with np.errstate(all="ignore"):
            want = twin(g, u)
        got = C.glu(g, u, C.GLU_KINDS[kind], simd)
        _same(got, want)


def test_softcap_is_its_twin():
    rng = np.random.default_rng(3)
    x = _rows(rng, 1, 1000, 20.0)[0]
    x[:4] = [0.0, -1e-8, 1e30, -1e30]
    for c in (30.0, 50.0):
        got = C.softcap(x, c)
        _same(got, R.softcap(x.copy(), c))
        np.testing.assert_allclose(got, c * np.tanh(x.astype(np.float64) / c), rtol=1e-5, atol=c * 2e-7)


def test_exp_is_within_an_ulp_and_a_fifth():
    """SiLU's and GELU's e^x (Cody-Waite reduction, degree-7 Taylor): <= 1.2 ulp from float64's over [-87, 0],
    0 below, as the C ops' contract says (attention's exp2(x log2 e) was up to ~60 ulp off at x = -87)."""
    x = -np.linspace(0.0, 87.0, 200_001).astype(np.float32)
    got, want = R.exp_neg(x).astype(np.float64), np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - want) / np.spacing(want.astype(np.float32))) <= 1.2
    assert R.exp_neg(np.array([-87.5, -1e30, -np.inf], np.float32)).tolist() == [0.0, 0.0, 0.0]
    assert R.exp_neg(np.array([0.0], np.float32))[0] == 1.0
