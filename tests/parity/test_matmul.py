"""The int8 matrix product: semantics on hand-made blocks, bit-exact parity between the C kernels
(fastserve._matmul, every kernel this machine runs, 1 to 3 threads) and the NumPy twin
(fastserve.ref.matmul), batch invariance, and GGUF's exact int8 blocks.

The extension is imported inside each test, so an unbuilt extension makes its tests FAIL with
ImportError (never skip) while the twin's tests still run. The last tests compile the kernels' C
header on its own and compare every kernel with the scalar one bit for bit, natively and, when a
cross compiler and qemu are installed, for aarch64 (NEON, sdot) under emulation.
"""
import importlib
import os
import shutil
import subprocess
import sys
import sysconfig
import threading

import numpy as np
import pytest

IMPLS = ["fastserve._matmul", "fastserve.ref.matmul"]
# (n_out, n_in): whole panels and blocks, ragged ones, a single input, the default model's shapes.
SHAPES = [(16, 32), (37, 70), (1, 1), (33, 1536), (960, 576), (5, 100)]


@pytest.fixture(params=IMPLS)
def mod(request):
    return importlib.import_module(request.param)


def c_mod():
    return importlib.import_module("fastserve._matmul")


def twin():
    return importlib.import_module("fastserve.ref.matmul")


def kernels():
    """(isa, threads) of the C side worth comparing on this machine."""
    return [(isa, t) for isa in c_mod().isas() for t in (1, 2, 3)]


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def weights(m, kind, rng, n_out, n_in):
    """The same random matrix for both sides: from float32, from symmetric or from offset blocks."""
    if kind == "float":
        return m.Q8Matrix.from_float(rand(np.random.default_rng(n_out * 7 + n_in), n_out, n_in))
    r = np.random.default_rng(n_out * 11 + n_in)
    nb = -(-n_in // 32)
    d = r.random((n_out, nb)).astype(np.float32) * 0.01
    if kind == "sym":
        return m.Q8Matrix.from_blocks(r.integers(-128, 128, (n_out, n_in)).astype(np.int8), d)
    q = r.integers(0, 32, (n_out, n_in)).astype(np.int8)
    return m.Q8Matrix.from_blocks(q, d, -r.random((n_out, nb)).astype(np.float32) * 0.1)


def product(m, x, w, **kw):
    out = np.full((len(x), w.n_out), np.nan, np.float32)
    assert m.Matmul(**kw)(x, w, out) is out
    return out


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


def test_from_blocks_round_trip(mod):
    rng = np.random.default_rng(0)
    q = rng.integers(-128, 128, (20, 70)).astype(np.int8)
    d = rng.random((20, 3)).astype(np.float32)
    m = rng.random((20, 3)).astype(np.float32)
    w = mod.Q8Matrix.from_blocks(q, d, m)
    assert w.shape == (20, 70) and w.has_min
    q2, d2, m2 = w.unpack()
    np.testing.assert_array_equal(q2, q)
    np.testing.assert_array_equal(d2, d)
    np.testing.assert_array_equal(m2, m)
    assert mod.Q8Matrix.from_blocks(q, d).unpack()[2] is None
    with pytest.raises(ValueError):
        mod.Q8Matrix.from_blocks(q, d[:, :2])


def test_product_is_the_block_formula(mod):
    """One output by hand: sum over blocks of isum * (d_w * d_x) (+ m_w * d_x * sum q_x)."""
    rng = np.random.default_rng(1)
    q = rng.integers(0, 16, (1, 64)).astype(np.int8)
    d = np.array([[0.5, 0.25]], np.float32)
    m = np.array([[-1.0, 2.0]], np.float32)
    x = rand(rng, 1, 64)
    xq, dx = mod.quantize_rows(x)
    acc = np.float32(0)
    for b in range(2):
        isum = int(np.dot(q[0, b * 32:(b + 1) * 32].astype(np.int64), xq[0, b * 32:(b + 1) * 32]))
        acc = acc + np.float32(isum) * (d[0, b] * dx[0, b])
        acc = acc + m[0, b] * (dx[0, b] * np.float32(xq[0, b * 32:(b + 1) * 32].astype(np.int32).sum()))
    y = product(mod, x, mod.Q8Matrix.from_blocks(q, d, m))
    assert y[0, 0] == acc


@pytest.mark.parametrize("n_out,n_in", SHAPES)
def test_close_to_float32(mod, n_out, n_in):
    rng = np.random.default_rng(2)
    w = rand(rng, n_out, n_in)
    x = rand(rng, 9, n_in)
    y = product(mod, x, mod.Q8Matrix.from_float(w))
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    assert np.abs(y - ref).max() <= 0.02 * np.abs(ref).max() + 1e-6


def test_shape_errors(mod):
    w = mod.Q8Matrix.from_float(np.ones((4, 8), np.float32))
    with pytest.raises(ValueError):
        mod.Matmul()(np.ones((2, 9), np.float32), w, np.empty((2, 4), np.float32))
    with pytest.raises(ValueError):
        mod.Matmul()(np.ones((2, 8), np.float32), w, np.empty((3, 4), np.float32))
    with pytest.raises(ValueError):
        mod.Matmul(threads=0)
    out = np.empty((0, 4), np.float32)
    assert mod.Matmul()(np.ones((0, 8), np.float32), w, out) is out


# -- C against the twin, bit for bit ------------------------------------------------------------

@pytest.mark.parametrize("n_out,n_in", SHAPES)
def test_quantization_bit_exact(n_out, n_in):
    rng = np.random.default_rng(3)
    x = rand(rng, n_out, n_in, scale=3.0)
    x[0, : min(n_in, 5)] = 0.0
    if n_out > 2:
        x[1] = 0.0                                   # a row of zero blocks
        x[2] *= np.float32(1e-30)                    # tiny scales
    if n_out > 3:
        x[3] *= np.float32(1e-39)                    # denormals: zero blocks
    for a, b in zip(c_mod().quantize_rows(x), twin().quantize_rows(x)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(c_mod().Q8Matrix.from_float(x).unpack(), twin().Q8Matrix.from_float(x).unpack()):
        if a is None:
            assert b is None
        else:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["float", "sym", "offsets"])
@pytest.mark.parametrize("n_out,n_in", SHAPES)
def test_outputs_bit_exact(kind, n_out, n_in):
    rng = np.random.default_rng(4)
    x = rand(rng, 19, n_in)
    x[3] = 0.0
    want = product(twin(), x, weights(twin(), kind, rng, n_out, n_in))
    wc = weights(c_mod(), kind, rng, n_out, n_in)
    for isa, threads in kernels():
        got = product(c_mod(), x, wc, threads=threads, isa=isa)
        np.testing.assert_array_equal(got, want, err_msg=f"{isa}, {threads} threads")


@pytest.mark.parametrize("kind", ["float", "offsets"])
def test_batch_invariance(kind):
    """Each row's outputs are bit-identical alone, among 1..63 other rows, at any offset in the batch."""
    rng = np.random.default_rng(5)
    n_out, n_in = 200, 576
    x = rand(rng, 64, n_in)
    wc, wt = weights(c_mod(), kind, rng, n_out, n_in), weights(twin(), kind, rng, n_out, n_in)
    full = product(twin(), x, wt)
    for isa, threads in kernels():
        mm = c_mod().Matmul(threads=threads, isa=isa)
        for n in (1, 2, 3, 17, 64):
            for start in sorted({0, 1, 5, 64 - n}):
                if start + n > 64:
                    continue
                got = mm(x[start:start + n], wc, np.empty((n, n_out), np.float32))
                np.testing.assert_array_equal(got, full[start:start + n],
                                              err_msg=f"{isa}, {threads} threads, rows {start}..{start + n}")


def test_scratch_reuse_after_a_larger_call():
    rng = np.random.default_rng(6)
    w = c_mod().Q8Matrix.from_float(rand(rng, 40, 300))
    mm = c_mod().Matmul()
    big, small = rand(rng, 50, 300), rand(rng, 2, 300)
    mm(big, w, np.empty((50, 40), np.float32))
    np.testing.assert_array_equal(mm(small, w, np.empty((2, 40), np.float32)), product(c_mod(), small, w))


def test_two_threads_each_with_its_own_matmul():
    rng = np.random.default_rng(7)
    w = c_mod().Q8Matrix.from_float(rand(rng, 300, 256))
    xs = [rand(rng, 8, 256) for _ in range(2)]
    want = [product(c_mod(), x, w) for x in xs]
    errors = []

    def work(i):
        mm = c_mod().Matmul(threads=2)
        for _ in range(50):
            got = mm(xs[i], w, np.empty((8, 300), np.float32))
            if not np.array_equal(got, want[i]):
                errors.append(i)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


def test_unknown_isa_is_refused():
    with pytest.raises(ValueError):
        c_mod().Matmul(isa="sse9")
    assert "scalar" in c_mod().isas() and c_mod().best_isa() in c_mod().isas()


# -- GGUF blocks taken as they are ---------------------------------------------------------------

@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_gguf_blocks_are_exact(tmp_path, qtype):
    """exact_blocks gives the very values gguf.quants dequantizes, and the packed matrix keeps them."""
    from fastserve.models.gguf_file import GGUFFile
    from fastserve.models.llama import dequantize, exact_blocks
    from fastserve.models.synthetic import write_llama_gguf

    gf = GGUFFile(write_llama_gguf(tmp_path / f"{qtype}.gguf", seed=3, weight_type=qtype))
    entry = gf.tensors["blk.1.ffn_down.weight"]
    assert entry.type_name == qtype
    q, d, m = exact_blocks(entry)
    rebuilt = q.reshape(q.shape[0], -1, 32).astype(np.float32) * d[:, :, None]
    if m is not None:
        rebuilt = rebuilt + m[:, :, None]
    np.testing.assert_array_equal(rebuilt.reshape(q.shape), dequantize(entry, gf.path))
    assert (m is not None) == (qtype in ("Q4_1", "Q5_1"))
    packed = c_mod().Q8Matrix.from_blocks(q, d, m).unpack()
    np.testing.assert_array_equal(packed[0], q)
    np.testing.assert_array_equal(packed[1], d)


# -- in the backend --------------------------------------------------------------------------------

def test_backend_q8_against_f32_and_threads(tiny_model):
    """The q8 forward pass: the same bits on 1 or 3 threads, close to the float32 one."""
    from fastserve.backends.numpy_backend import NumpyBackend

    cfg, w = tiny_model.config, tiny_model.weights
    ids = np.array([5, 77, 300, 12, 9, 401, 33], np.int32)
    pos = np.arange(len(ids))

    def logits(**kw):
        be = NumpyBackend(cfg, w, 1, 16, **kw)
        return be.forward(ids, pos, np.zeros(len(ids), np.int64), pos)

    q1, q3, f = logits(), logits(threads=3), logits(weight_type="f32")
    np.testing.assert_array_equal(q1, q3)
    assert np.corrcoef(q1.ravel(), f.ravel())[0, 1] > 0.99
    with pytest.raises(ValueError):
        NumpyBackend(cfg, w, 1, 16, weight_type="q4")


def test_loaded_weights_are_packed_once(tiny_model):
    from fastserve.backends.numpy_backend import NumpyBackend, q8_matrices

    layers, output = q8_matrices(tiny_model.weights)
    assert layers[0][0].shape == tiny_model.weights.layers[0].wqkv.shape
    assert output.shape == tiny_model.weights.output.shape
    be = NumpyBackend(tiny_model.config, tiny_model.weights, 1, 8)
    assert be._layer_mats is layers and be._output is output


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "F16"])
def test_load_packs_gguf_blocks_as_stored(tmp_path, qtype):
    """At load, Q4_1 matrices keep their int8 values and offsets, Q8_0 its values; other types are
    requantized from float32 (as Q8Matrix.from_float would)."""
    import fastserve
    from fastserve.backends.numpy_backend import q8_matrices
    from fastserve.models.gguf_file import GGUFFile
    from fastserve.models.llama import exact_blocks
    from fastserve.models.synthetic import write_llama_gguf

    path = write_llama_gguf(tmp_path / f"{qtype}.gguf", seed=5, weight_type=qtype)
    model = fastserve.load_model(path)
    wqkv = q8_matrices(model.weights)[0][1][0]
    q, d, m = wqkv.unpack()
    if qtype == "F16":
        want = c_mod().Q8Matrix.from_float(model.weights.layers[1].wqkv).unpack()
        for a, b in zip((q, d, m), want):
            assert (a is None and b is None) or np.array_equal(a, b)
        return
    gf = GGUFFile(path)
    parts = [exact_blocks(gf.tensors[f"blk.1.attn_{x}.weight"]) for x in "qkv"]
    np.testing.assert_array_equal(q, np.concatenate([p[0] for p in parts]))
    np.testing.assert_array_equal(d, np.concatenate([p[1] for p in parts]))
    assert (m is not None) == (qtype == "Q4_1")
    if m is not None:
        np.testing.assert_array_equal(m, np.concatenate([p[2] for p in parts]))


# -- the C header alone: every kernel against the scalar one, here and on aarch64 -------------------

HARNESS = r"""
#include "_matmul_kernels.h"
#include <stdio.h>
static uint32_t rs = 12345;
static uint32_t rnd(void) { rs = rs * 1664525u + 1013904223u; return rs >> 8; }
static float frnd(void) { return ((float)(rnd() % 20001) - 10000.0f) / 3000.0f; }
int main(void) {
    int shapes[][2] = {{16, 32}, {37, 70}, {1, 1}, {33, 1536}, {960, 576}, {5, 100}};
    int fails = 0, checks = 0;
    for (int isa = 0; isa <= 4; isa++) printf("isa %d supported %d\n", isa, fs_isa_supported(isa));
    printf("best %d\n", fs_best_isa());
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int64_t o = shapes[si][0], in = shapes[si][1], nb = (in + 31) / 32;
        for (int has_min = 0; has_min < 2; has_min++) {
            int8_t *q = malloc(o * in); float *d = malloc(o * nb * 4), *m = malloc(o * nb * 4);
            for (int64_t i = 0; i < o * in; i++) q[i] = (int8_t)(rnd() % 256 - 128);
            for (int64_t i = 0; i < o * nb; i++) { d[i] = frnd() * 0.01f; m[i] = frnd() * 0.1f; }
            uint8_t *wp = aligned_alloc(64, (fs_packed_bytes(o, in, has_min) + 63) / 64 * 64);
            fs_pack_blocks(q, d, has_min ? m : NULL, o, in, wp);
            for (int n = 1; n <= 19; n += (n < 10 ? 1 : 9)) {
                float *x = malloc(n * in * 4);
                for (int64_t i = 0; i < n * in; i++) x[i] = frnd();
                int8_t *xq = malloc(n * nb * 32); float *dx = malloc(n * nb * 4), *sx = malloc(n * nb * 4);
                int32_t *xs = malloc(n * nb * 4);
                fs_quantize_rows(x, n, in, in, xq, dx, xs, sx);
                float *y0 = malloc(n * o * 4), *y1 = malloc(n * o * 4);
                fs_job job = {wp, o, nb, fs_pb_bytes(has_min), xq, dx, xs, sx, n, y0, o};
                fs_kernel_for(FS_ISA_SCALAR, has_min)(&job, 0, (o + 15) / 16);
                for (int isa = 1; isa <= 4; isa++) {
                    if (!fs_isa_supported(isa)) continue;
                    for (int th = 1; th <= 2; th++) {
                        fs_pool *pl = th > 1 ? fs_pool_new(th, 100000) : NULL;
                        memset(y1, 0xff, n * o * 4);
                        job.y = y1;
                        fs_run(pl, fs_kernel_for(isa, has_min), &job);
                        job.y = y0;
                        fs_pool_free(pl);
                        checks++;
                        if (memcmp(y0, y1, n * o * 4)) { fails++; printf("MISMATCH isa %d o %ld in %ld n %d min %d th %d\n", isa, (long)o, (long)in, n, has_min, th); }
                    }
                }
                free(x); free(xq); free(dx); free(sx); free(xs); free(y0); free(y1);
            }
            free(q); free(d); free(m); free(wp);
        }
    }
    printf("%d checks, %d mismatches\n", checks, fails);
    return fails != 0;
}
"""
HEADER_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "fastserve")
CFLAGS = ["-O3", "-ffp-contract=off", "-pthread", "-Wall", "-Wextra", "-Werror", "-Wno-unused-function"]


def _check_harness(tmp_path, cc, run_prefix=()):
    src = tmp_path / "harness.c"
    src.write_text(HARNESS)
    exe = tmp_path / "harness"
    built = subprocess.run([*cc, *CFLAGS, "-I", HEADER_DIR, str(src), "-o", str(exe)], capture_output=True, text=True)
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


@pytest.mark.skipif(sys.platform != "linux", reason="cross-checks run on Linux")
@pytest.mark.parametrize("march", ["armv8-a", "armv8.2-a+dotprod"])
def test_c_kernels_agree_on_aarch64(tmp_path, march):
    if not (shutil.which("aarch64-linux-gnu-gcc") and shutil.which("qemu-aarch64")):
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt: gcc-aarch64-linux-gnu qemu-user)")
    out = _check_harness(tmp_path, ["aarch64-linux-gnu-gcc", f"-march={march}"],
                         ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu"])
    assert "isa 3 supported 1" in out and "isa 4 supported 1" in out      # neon, and sdot (built or detected)
