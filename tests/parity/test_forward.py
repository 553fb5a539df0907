"""The C forward pass (fastserve.backends.cpu._forward, CpuBackend's default) against the NumPy reference forward
(fastserve.backends.cpu.ref.forward: the element-wise twins composed with the same products and attention), bit for
bit, on a small synthetic model of every family of the architecture table, through prefill chunks and
decode steps of several slots; and a token's logits the same alone, in a batch, in any chunk and on any
thread count."""
import dataclasses
import time
import types

import numpy as np
import pytest

import fastserve
from fastserve.backends.cpu.backend import CpuBackend
from fastserve.models.architecture import TOPK_SOFTMAX
from fastserve.models.synthetic import write_llama_gguf

FAMILIES = {"llama": {}, "qwen2": {}, "qwen3": {}, "gemma3": {"sliding_window": 5}, "granite": {},
            "smollm3": {"n_layer": 4}, "phi3": {"head_dim": 16}, "qwen3moe": {"n_expert": 8, "n_expert_used": 2},
            "gpt-oss": {"n_expert": 8, "n_expert_used": 4, "sliding_window": 5, "yarn": (32.0, 4096)}}
MOE = ("qwen3moe", "gpt-oss")


SHAPE = dict(n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=96, n_layer=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("fwd")
    return {arch: fastserve.load_model(write_llama_gguf(d / f"{arch}.gguf", architecture=arch, weight_type="Q8_0",
                                                        seed=7, **{**SHAPE, **kw}))
            for arch, kw in FAMILIES.items()}


def _steps(n_vocab):
    """(tokens, positions, slots, out_rows): a prefill of 20 on slot 0, one of 3 on slot 1 (its element-wise
    stages split over the pool's threads), then mixed decode steps of both."""
    rng = np.random.default_rng(1)
    toks = rng.integers(0, n_vocab, 40)
    yield toks[:20], np.arange(20), np.zeros(20, int), np.arange(20)
    yield toks[20:23], np.arange(3), np.ones(3, int), [2]
    for i in range(4):
        yield toks[23 + 2 * i:25 + 2 * i], [20 + i, 3 + i], [0, 1], [0, 1]


def _run(model, cfg, **kw):
    be = CpuBackend(cfg, model.weights, 2, 64, max_tokens=8, **kw)
    if not be.reference:
        be._forward.parallel_rows = 16              # the prefill of 20 splits its element-wise stages
        be._forward.glu_split = 16                  # the smaller batches their GLU's 96 columns
    return [be.forward(*s).copy() for s in _steps(cfg.n_vocab)]


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_c_forward_is_the_reference_bit_for_bit(models, arch, threads):
    cfg = models[arch].config
    for got, want in zip(_run(models[arch], cfg, threads=threads), _run(models[arch], cfg, reference=True)):
        assert np.array_equal(got, want)
        assert np.isfinite(got).all()


def test_logit_softcap_and_linear_rope_scaling(models):
    """What no synthetic row turns on: a final logit softcap (gemma2-style) and scaled positions."""
    cfg = dataclasses.replace(models["gemma3"].config, logit_softcap=3.0, rope_scale=2.0)
    got, want = _run(models["gemma3"], cfg), _run(models["gemma3"], cfg, reference=True)
    for g, w in zip(got, want):
        assert np.array_equal(g, w)
        assert np.abs(g).max() < 3.0


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "granite", "smollm3", "phi3", "qwen3moe", "gpt-oss"])
def test_a_tokens_logits_do_not_depend_on_its_batch_chunk_or_threads(models, arch):
    model = models[arch]
    cfg = model.config
    toks = np.random.default_rng(2).integers(0, cfg.n_vocab, 24)
    results = []
    for threads, chunk in ((1, 24), (2, 24), (2, 5), (1, 1)):
        be = CpuBackend(cfg, model.weights, 3, 64, threads=threads, max_tokens=4)
        be._forward.parallel_rows = 4                   # batches of 4 rows and more split over the threads
        be._forward.glu_split = 16                      # smaller ones their GLU's columns
        out = []
        for c in range(0, 24, chunk):                       # slot 1's prompt in chunks, beside slot 0's decode
            n = min(chunk, 24 - c)
            t = np.concatenate([toks[:1], toks[c:c + n]])
            pos = np.concatenate([[c % 7], np.arange(c, c + n)])
            out.append(be.forward(t, pos, np.array([0] + [1] * n), np.arange(1, n + 1)))
        results.append(np.concatenate(out))
    for r in results[1:]:
        assert np.array_equal(r, results[0])


@pytest.mark.parametrize("arch", MOE)
@pytest.mark.parametrize("reference", [False, True])
def test_a_mixture_of_experts_token_is_the_same_alone_and_among_other_rows(models, reference, arch):
    """qwen3moe (8 experts, top 2), gpt-oss (top 4, biases, its gating): 12 decode rows of 12 slots, whose
    experts overlap (each selected expert runs once over all its rows), give each row the logits it gets alone."""
    model = models[arch]
    cfg = model.config
    rng = np.random.default_rng(4)
    prompts = rng.integers(0, cfg.n_vocab, (12, 6))
    be = CpuBackend(cfg, model.weights, 12, 32, max_tokens=72, threads=2, reference=reference)
    if not reference:
        be._forward.parallel_rows = 4
    for s, p in enumerate(prompts):                     # each slot's prompt, alone
        be.forward(p[:5], np.arange(5), np.full(5, s), [4])
    together = be.forward(prompts[:, 5], np.full(12, 5), np.arange(12), np.arange(12)).copy()
    for s, p in enumerate(prompts):
        assert np.array_equal(be.forward(p[5:], [5], [s], [0]), together[s:s + 1]), f"row {s}"
    from fastserve.backends.cpu.ref.forward import route
    h = rng.standard_normal((12, cfg.n_embd)).astype(np.float32)
    logits = np.zeros((12, cfg.n_expert), np.float32)
    be._mm(h, model.weights.layers[0].router, logits)
    experts, _ = route(logits, cfg.n_expert_used, 1.0, cfg.arch.moe_gating)
    assert len(np.unique(experts)) < experts.size      # some expert was chosen by several rows


@pytest.mark.parametrize("arch", MOE)
def test_tied_experts_are_the_reference_bit_for_bit(models, arch):
    """A router of zeros (every expert tied on every row: the lower ids win) in the C forward and the reference."""
    from fastserve.backends.cpu._matmul import BlockMatrix
    model = models[arch]
    cfg, w = model.config, model.weights
    zero = BlockMatrix.from_float(np.zeros((cfg.n_expert, cfg.n_embd), np.float32))
    tied = dataclasses.replace(w, layers=[dataclasses.replace(lw, router=zero, router_bias=None) for lw in w.layers])
    model = types.SimpleNamespace(weights=tied)
    for got, want in zip(_run(model, cfg, threads=2), _run(model, cfg, reference=True)):
        assert np.array_equal(got, want)


def test_expert_routes_softmax_top_k_renormalised():
    """route: the k largest probabilities, ties to the lower id, weights renormalised to sum to 1 (times the
    scale), as llama.cpp's softmax gating with norm_w; a row's route is its own."""
    from fastserve.backends.cpu.ref.forward import route
    logits = np.array([[0.0, 2.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0], [-1.0, 0.0, 3.0, 1.0]], np.float32)
    experts, w = route(logits.copy(), 2, 1.0)
    assert experts.tolist() == [[1, 3], [0, 1], [2, 3]]
    assert np.allclose(w.sum(axis=1), 1.0) and np.allclose(w[:2], 0.5)
    p = np.exp(logits[2] - 3.0)
    assert np.allclose(w[2], [1 / (1 + p[3]), p[3] / (1 + p[3])])
    assert np.allclose(route(logits.copy(), 2, 2.5)[1], 2.5 * w)
    alone = [route(logits[i:i + 1].copy(), 2, 1.0) for i in range(3)]
    assert all(np.array_equal(a[0][0], experts[i]) and np.array_equal(a[1][0], w[i]) for i, a in enumerate(alone))


def test_expert_routes_top_k_then_softmax():
    """gpt-oss's gating (TOPK_SOFTMAX, llama.cpp's softmax-weight): the k largest logits, ties to the lower id, then
    the softmax over those k (the others' logits play no part), times the scale."""
    from fastserve.backends.cpu.ref.forward import route
    logits = np.array([[0.0, 2.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0], [-1.0, 0.0, 3.0, 1.0]], np.float32)
    experts, w = route(logits.copy(), 2, 1.0, TOPK_SOFTMAX)
    assert experts.tolist() == [[1, 3], [0, 1], [2, 3]]
    assert np.allclose(w[:2], 0.5) and np.allclose(w[2], [1 / (1 + np.exp(-2.0)), np.exp(-2.0) / (1 + np.exp(-2.0))])
    other = logits.copy()
    other[2, :2] = -50.0                                # the unselected logits: the same weights
    assert np.array_equal(route(other, 2, 1.0, TOPK_SOFTMAX)[1][2], w[2])
    assert np.allclose(route(logits.copy(), 2, 2.5, TOPK_SOFTMAX)[1], 2.5 * w)


def test_a_ring_is_the_reference_bit_for_bit(models):
    """Gemma's local layers in a ring (window 5, steps of 8: 64 positions, wrapped 3 times): the C
    forward and the reference the same bits, through a chunked prefill and decode steps."""
    model = models["gemma3"]
    cfg = model.config
    toks = np.random.default_rng(3).integers(0, cfg.n_vocab, 200)
    outs = []
    for kw in ({"threads": 2}, {"reference": True}):
        be = CpuBackend(cfg, model.weights, 1, 256, max_tokens=8, **kw)
        assert be.kv_ring == 64
        outs.append([be.forward(toks[c:c + 8], np.arange(c, min(200, c + 8)), np.zeros(len(toks[c:c + 8]), int),
                                [len(toks[c:c + 8]) - 1]).copy() for c in range(0, 200, 8)])
    for got, want in zip(*outs):
        assert np.array_equal(got, want)


def test_bad_rows_are_refused(models):
    model = models["llama"]
    be = CpuBackend(model.config, model.weights, 2, 16)
    with pytest.raises(ValueError, match="positions"):
        be.forward([1], [16], [0], [0])
    with pytest.raises(ValueError, match="slots"):
        be.forward([1], [0], [2], [0])
    with pytest.raises(ValueError, match="out_rows"):
        be.forward([1], [0], [0], [1])
    with pytest.raises(IndexError, match="vocabulary"):
        be.forward([model.config.n_vocab], [0], [0], [0])


def test_the_phase_clocks_change_no_number_and_sum_under_the_call(models):
    """Forward.profile (bench/bench_matmul.py's breakdown): the same logits; every phase timed, their sum
    within the calls' own time; nothing counted with profile off; reset zeroes them."""
    model = models["gemma3"]
    cfg = model.config
    be = CpuBackend(cfg, model.weights, 2, 64, max_tokens=8, threads=2)
    be._forward.profile = True
    t0 = time.perf_counter()
    got = [be.forward(*s).copy() for s in _steps(cfg.n_vocab)]
    elapsed = time.perf_counter() - t0
    phases = be._forward.phase_seconds(reset=True)
    for g, w in zip(got, _run(model, cfg, threads=2)):
        assert np.array_equal(g, w)
    assert set(phases) == {"layer products", "attention", "element-wise ops and KV stores", "output product"}
    assert all(v > 0 for v in phases.values()), phases
    assert sum(phases.values()) <= elapsed
    assert not any(be._forward.phase_seconds().values())
    be._forward.profile = False
    be.forward(*next(_steps(cfg.n_vocab)))
    assert not any(be._forward.phase_seconds().values())
