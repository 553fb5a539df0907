"""CupyBackend's orchestration on the CPU, with tests/gpu/fake_cupy.py standing in for CuPy.

Runs everywhere (no GPU, no CuPy). It checks what does not depend on the kernels' CUDA C: launch
arguments against the kernels' compiled signatures (with nvcc present), buffer shapes, the cuBLAS
products' column-major arguments, bucketed CUDA-graph capture and replay with padding rows, chunked
batches, KV save/restore, and the math as a whole against the NumPy backend (the kernels emulated
in NumPy). The kernels themselves are checked on a GPU by the other tests in this folder.
"""
import dataclasses
import inspect

import numpy as np
import pytest

from fastserve.backends.cpu.backend import CpuBackend

from . import fake_cupy
from .helpers import rel_err, rounded_weights, synthetic_family


@pytest.fixture
def fake(monkeypatch):
    return fake_cupy.install(monkeypatch)


def _cpu_backend(cfg, weights, n_slots, n_ctx):
    kw = {"weight_type": "f32"} if "weight_type" in inspect.signature(CpuBackend).parameters else {}
    return CpuBackend(cfg, weights, n_slots, n_ctx, **kw)


def _prefill_then_decode(backend, prompts, n_decode, rng):
    """Prompts into slots 0..; then n_decode greedy steps of every slot at once. Returns each step's logits."""
    out = []
    toks = np.concatenate(prompts).astype(np.int32)
    pos = np.concatenate([np.arange(len(p)) for p in prompts]).astype(np.int32)
    slots = np.concatenate([np.full(len(p), i) for i, p in enumerate(prompts)]).astype(np.int32)
    last = np.cumsum([len(p) for p in prompts]).astype(np.int32) - 1
    logits = np.array(backend.forward(toks, pos, slots, last))
    out.append(logits)
    cur = np.array([len(p) for p in prompts], np.int32)
    for _ in range(n_decode):
        nxt = np.argmax(logits, axis=1).astype(np.int32)
        n = len(prompts)
        logits = np.array(backend.forward(nxt, cur, np.arange(n, dtype=np.int32), np.arange(n, dtype=np.int32)))
        out.append(logits)
        cur += 1
    return out


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_logits_match_cpu_backend(fake, tiny_model, dtype):
    from fastserve.backends.cuda.backend import CupyBackend
    cfg, w = tiny_model.config, tiny_model.weights
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.n_vocab, n).astype(np.int32) for n in (7, 3, 12)]
    gpu = CupyBackend(cfg, w, n_slots=4, n_ctx_slot=64, dtype=dtype, attn_chunk=4)
    ref = _cpu_backend(cfg, rounded_weights(w, dtype), 4, 64)
    got = _prefill_then_decode(gpu, prompts, 6, rng)
    want = _prefill_then_decode(ref, prompts, 6, rng)
    worst = max(rel_err(g, r) for g, r in zip(got, want))
    assert worst <= 1e-2, f"{dtype}: worst per-step relative error {worst:.2e}"
    assert gpu._graphs, "decode steps did not go through a CUDA graph"


def test_emulated_products_are_batch_invariant(fake):
    """cuda/matvec.cu sums each row in an order that k alone fixes, whatever n; so must its emulations.
    Otherwise a graph (its bucket padded: 4 rows) and an eager step (3 rows) differ wherever the BLAS
    blocks n = 3 and n = 4 apart (an AVX2 OpenBLAS: 7.6e-4 on the logits), as `x @ w.T` does."""
    from fastserve.backends.cuda import kernels as K
    rng = np.random.default_rng(0)
    x = fake.asarray(rng.standard_normal((8, 64)), np.float32)
    x16 = fake.asarray(x, np.float16)
    norm_w = fake.asarray(rng.standard_normal(64), np.float32)
    w = fake.asarray(rng.standard_normal((192, 64)), np.float16)

    def rows(n):
        out, normed, h = fake.zeros((8, 192)), fake.zeros((8, 192)), fake.zeros((8, 64), np.float16)
        K.gemm(x16, w, out, n)
        K.norm_gemm(x, norm_w, w, normed, h, n, 1e-5)
        return np.array(out[:n]), np.array(normed[:n])

    full = rows(8)
    for n in range(1, 8):
        for got, want in zip(rows(n), full):
            np.testing.assert_array_equal(got, want[:n], err_msg=f"n = {n}")


def test_graph_replay_equals_eager(fake, tiny_model):
    from fastserve.backends.cuda.backend import CupyBackend
    cfg, w = tiny_model.config, tiny_model.weights
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, cfg.n_vocab, n).astype(np.int32) for n in (5, 9, 4)]
    a = _prefill_then_decode(CupyBackend(cfg, w, 4, 64, graphs=True, attn_chunk=8), prompts, 5, rng)
    b = _prefill_then_decode(CupyBackend(cfg, w, 4, 64, graphs=False, attn_chunk=8), prompts, 5, rng)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_graphs_are_per_bucket_and_replayed(fake, tiny_model):
    from fastserve.backends.cuda.backend import CupyBackend
    cfg, w = tiny_model.config, tiny_model.weights
    be = CupyBackend(cfg, w, n_slots=8, n_ctx_slot=32)
    for n in (1, 3, 3, 4, 5, 8, 1):
        ids = np.arange(n, dtype=np.int32)
        be.forward(ids + 10, np.full(n, 2, np.int32), ids, ids)
    assert sorted(be._graphs) == [1, 4, 8]
    assert be._graphs[4].replays == 2 and be._graphs[1].replays == 1 and be._graphs[8].replays == 1


def test_padding_rows_touch_only_the_scratch_slot(fake, tiny_model):
    from fastserve.backends.cuda.backend import CupyBackend
    cfg, w = tiny_model.config, tiny_model.weights
    be = CupyBackend(cfg, w, n_slots=4, n_ctx_slot=16)
    before = np.array(be.kv[:, :, :4])
    ids = np.arange(3, dtype=np.int32)
    be.forward(ids, np.zeros(3, np.int32), ids, ids)           # bucket 4: one padding row
    after = np.array(be.kv[:, :, :4])
    changed = np.flatnonzero((before != after).any(axis=(0, 1, 3, 4, 5)))
    assert changed.tolist() == [0, 1, 2]


def test_chunked_batch_equals_one_pass(fake, tiny_model):
    from fastserve.backends.cuda.backend import CupyBackend
    cfg, w = tiny_model.config, tiny_model.weights
    rng = np.random.default_rng(3)
    n = 40
    toks = rng.integers(0, cfg.n_vocab, n).astype(np.int32)
    pos = np.arange(n, dtype=np.int32)
    slots = np.zeros(n, np.int32)
    rows = np.array([3, 39, 17, 20, 0], np.int32)
    whole = np.array(CupyBackend(cfg, w, 2, 64, max_tokens=64).forward(toks, pos, slots, rows))
    parts = CupyBackend(cfg, w, 2, 64, max_tokens=16, max_out=2).forward(toks, pos, slots, rows)
    # Products over other row counts may sum in another order (BLAS, cuBLAS): equal up to rounding.
    assert rel_err(parts, whole) <= 1e-3


def test_forward_greedy(fake, tiny_model):
    """Greedy ids on the device (device sampling: tests/gpu/test_device_sampling.py)."""
    from fastserve.backends.cuda.backend import CupyBackend
    cfg, w = tiny_model.config, tiny_model.weights
    be = CupyBackend(cfg, w, 4, 32)
    ids = np.arange(4, dtype=np.int32)
    logits = np.array(be.forward(ids + 5, np.zeros(4, np.int32), ids, ids))
    # The next call recomputes the same positions: same logits, ids on the device.
    greedy = np.array(be.forward_greedy(ids + 5, np.zeros(4, np.int32), ids, ids))
    np.testing.assert_array_equal(greedy, np.argmax(logits, axis=1))


def test_save_restore_and_copy_slot(fake, tiny_model):
    from fastserve.backends.cuda.backend import CupyBackend
    cfg, w = tiny_model.config, tiny_model.weights
    be = CupyBackend(cfg, w, 3, 32)
    rng = np.random.default_rng(4)
    toks = rng.integers(0, cfg.n_vocab, 10).astype(np.int32)
    be.forward(toks, np.arange(10, dtype=np.int32), np.zeros(10, np.int32), np.array([9], np.int32))
    buf = np.zeros(10 * be.kv_bytes_per_token() + 5, np.uint8)
    be.save_slot(0, 2, 6, buf)
    be.restore_slot(2, 2, 6, buf)
    np.testing.assert_array_equal(np.asarray(be.kv[:, :, 2, 2:8]), np.asarray(be.kv[:, :, 0, 2:8]))
    be.copy_slot(0, 1, 10)
    np.testing.assert_array_equal(np.asarray(be.kv[:, :, 1, :10]), np.asarray(be.kv[:, :, 0, :10]))
    with pytest.raises(ValueError):
        be.save_slot(0, 0, 10, np.zeros(10, np.uint8))


def test_bad_indices_are_refused_before_any_launch(fake, tiny_model):
    from fastserve.backends.cuda.backend import CupyBackend
    cfg, w = tiny_model.config, tiny_model.weights
    be = CupyBackend(cfg, w, 2, 16)
    one = np.zeros(1, np.int32)
    bad = lambda v: np.array([v], np.int32)      # noqa: E731
    launched = fake_cupy.Recorder.launches       # the weights' upload
    for toks, pos, slots, rows in ((bad(cfg.n_vocab), one, one, one), (bad(-1), one, one, one),
                                   (one, bad(16), one, one), (one, bad(-1), one, one),
                                   (one, one, bad(2), one), (one, one, bad(-1), one),
                                   (one, one, one, bad(1)), (one, one, one, bad(-1))):
        with pytest.raises(ValueError):
            be.forward(toks, pos, slots, rows)
    assert fake_cupy.Recorder.launches == launched


def test_launchers_refuse_wrong_arrays(fake):
    from fastserve.backends.cuda import kernels as K
    cp = fake
    x = cp.zeros((4, 8), np.float32)
    w = cp.zeros(8, np.float32)
    with pytest.raises(TypeError):
        K.rms_norm(x, w, cp.zeros((4, 8), np.float64), 4, 1e-5)
    with pytest.raises(ValueError):
        K.rms_norm(x, w, cp.zeros((2, 8), np.float16), 4, 1e-5)            # too few rows
    with pytest.raises(ValueError):
        K.rms_norm(x, w, cp.zeros((8, 4), np.float16).T, 4, 1e-5)          # not C-contiguous
    with pytest.raises(TypeError):
        K.gemm(cp.zeros((4, 8), np.float16), cp.zeros((3, 8), np.uint16), cp.zeros((4, 3), np.float32), 4)


@pytest.mark.parametrize("model_name", ["tiny_model", "tiny_gemma3"])
def test_engine_runs_on_the_backend(fake, request, model_name):
    """The engine drives the GPU backend like any other, for llama's row and gemma3's (prompts past its
    window of 8, and generation past it): greedy text equals the NumPy backend's on the same (rounded) weights."""
    import fastserve
    from fastserve.backends.cuda.backend import CupyBackend
    tiny_model = request.getfixturevalue(model_name)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
    with fastserve.Engine(tiny_model, n_parallel=2, n_ctx=128,
                          backend=lambda cfg, w, ns, nc: CupyBackend(cfg, w, ns, nc)) as e:
        got = [r.result().token_ids for r in [e.submit(p, max_tokens=8, temperature=0) for p in prompts]]
    with fastserve.Engine(tiny_model, n_parallel=2, n_ctx=128,
                          backend=lambda cfg, w, ns, nc: _cpu_backend(cfg, rounded_weights(w, "f16"), ns, nc)) as e:
        want = [r.result().token_ids for r in [e.submit(p, max_tokens=8, temperature=0) for p in prompts]]
    assert got == want


def _row_against_numpy(cfg, w, lengths, gpu_weights=None) -> float:
    """Prompts of `lengths` prefilled into slots 0.., then 6 decode steps of them all (through graphs) on
    CupyBackend (with gpu_weights when given) and on the NumPy backend (the weights rounded as the GPU holds
    them): the worst relative error of a step's logits."""
    from fastserve.backends.cuda.backend import CupyBackend, unsupported_features
    assert unsupported_features(cfg) == []
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.n_vocab, n).astype(np.int32) for n in lengths]
    gpu = CupyBackend(cfg, w if gpu_weights is None else gpu_weights, n_slots=4, n_ctx_slot=64, dtype="f16",
                      attn_chunk=4)
    ref = _cpu_backend(cfg, rounded_weights(w, "f16"), 4, 64)
    got = _prefill_then_decode(gpu, prompts, 6, rng)
    want = _prefill_then_decode(ref, prompts, 6, rng)
    assert gpu._graphs, "decode steps did not go through a CUDA graph"
    return max(rel_err(g, r) for g, r in zip(got, want))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3"])
def test_other_rows_match_cpu_backend(fake, tmp_path, arch):
    """The rows the kernels run besides llama's: NeoX RoPE (Q/K rows uploaded in neox_order), q/k/v biases
    and per-head q/k RMSNorm (cuda/qk_prep.cu), head_dim decoupled from n_embd / n_head; phi3's fused
    tensors (one W_qkv, one W_gu as the others') and longrope (its factors and attn_factor in the tables)."""
    import fastserve
    from fastserve.models.synthetic import write_llama_gguf
    model = fastserve.load_model(write_llama_gguf(tmp_path / f"{arch}.gguf", architecture=arch, head_dim=24))
    worst = _row_against_numpy(model.config, model.weights, (7, 3, 12))
    assert worst <= 1e-2, f"{arch}: worst per-step relative error {worst:.2e}"


def test_gemma3_row_matches_cpu_backend(fake, tiny_gemma3):
    """gemma3's row (tests/gpu/conftest.tiny_gemma3: GeGLU, sandwich norms, scaled embedding, a local layer
    with its own RoPE table and window 8, 256-wide heads, soft-capping): every launch's arguments against
    the kernels' signatures, the logits against the NumPy backend over a prompt past the window, and decode
    steps through graphs."""
    worst = _row_against_numpy(tiny_gemma3.config, tiny_gemma3.weights, (21, 3, 12))
    assert worst <= 1e-2, f"gemma3: worst per-step relative error {worst:.2e}"


@pytest.mark.parametrize("family", ["granite", "smollm3", "qwen3moe"])
def test_family_rows_match_cpu_backend(fake, tmp_path, family):
    """The synthetic families' rows (tests/golden/synthetic_families.py's shapes and weights): granite's
    residual multiplier (in the products' launches) and logit multiplier (logit_out), its embedding and
    attention scales; smollm3's every 4th layer without RoPE (kv_store instead of rope_store); qwen3moe's
    experts (8, top 2: router, moe_route, moe_group, the grouped products, moe_sum), decode steps in graphs."""
    model = synthetic_family(tmp_path, family)
    worst = _row_against_numpy(model.config, model.weights, (7, 3, 12))
    assert worst <= 1e-2, f"{family}: worst per-step relative error {worst:.2e}"


@pytest.mark.parametrize("family", ["gpt-oss", "gpt-oss-mxfp4"])
def test_gpt_oss_row_matches_cpu_backend(fake, tmp_path, family):
    """gpt-oss's row (Q8_0, and MXFP4 experts dequantized on upload): q/k/v biases (qk_prep), o's bias
    (add_bias), attention sinks (attention_combine), local layers of a 16-key window rotating with the global
    YaRN tables, the router's bias and TOPK_SOFTMAX gating (moe_route), the experts' biases and swiglu_oai (the
    grouped products), over a prompt past the window, decode steps in graphs."""
    model = synthetic_family(tmp_path, family)
    worst = _row_against_numpy(model.config, model.weights, (21, 3, 12))
    assert worst <= 1e-2, f"{family}: worst per-step relative error {worst:.2e}"


@pytest.mark.parametrize("dropped", ["attn_sinks", "out_bias", "router_bias", "experts_gate_up_bias",
                                     "experts_down_bias"])
def test_gpt_oss_row_is_off_without_each_of_its_tensors(fake, tmp_path, dropped):
    """Each of gpt-oss's own tensors is really applied on the device: the run without one of them (the others
    as they are) is off the CPU's by far more than the run with all of them. The synthetic model's sinks
    (N(0, 1.5^2) beside its scores) move its logits by less than the rounding (measured: 4.73e-4 without them,
    4.75e-4 with), so for them the device gets sinks 8 higher instead of none."""
    model = synthetic_family(tmp_path, "gpt-oss")
    w = model.weights

    def changed(lw):
        return None if dropped != "attn_sinks" else lw.attn_sinks + np.float32(8.0)
    without = dataclasses.replace(w, layers=[dataclasses.replace(lw, **{dropped: changed(lw)}) for lw in w.layers])
    worst = _row_against_numpy(model.config, w, (21, 3, 12), gpu_weights=without)
    matched = _row_against_numpy(model.config, w, (21, 3, 12))
    print(f"without {dropped}: {worst:.2e}, with it: {matched:.2e}")
    assert worst > 10 * matched, f"without {dropped}: worst per-step relative error {worst:.2e}, with {matched:.2e}"
