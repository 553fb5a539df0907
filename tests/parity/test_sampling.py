"""The token sampler: semantics on hand-made rows, and exact parity between the Cython
sampler (fastserve._sampling) and its pure-Python twin (fastserve.ref.sampling).

Every test runs against both. The extension is imported inside each test, so an
unbuilt extension makes its tests FAIL with ImportError (never skip) while the
twin's tests still run.
"""
import importlib
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastserve.errors import RequestError

IMPLS = ["fastserve._sampling", "fastserve.ref.sampling"]
NEUTRAL = dict(top_k=0, top_p=1.0, min_p=0.0)   # the chain reduced to temperature + draw


def sampler_cls(impl):
    return importlib.import_module(impl).Sampler


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param


def make(impl, n_vocab, n_slots=1, **kw):
    return sampler_cls(impl)(n_slots, n_vocab, **kw)


def row(*vals):
    return np.array([vals], dtype=np.float32)


def draw(s, logits, slots=None, n_probs=0):
    """One sample() call; returns (ids, probs_ids, probs)."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    n = logits.shape[0]
    slots = np.zeros(n, np.int32) if slots is None else np.asarray(slots, np.int32)
    out = np.full(len(slots), -7, np.int32)
    pids = np.full((len(slots), max(n_probs, 1)), -9, np.int32)
    pp = np.full((len(slots), max(n_probs, 1)), -9.0, np.float32)
    s.sample(logits, slots, out, pids, pp)
    return out, pids, pp


def support(impl, logits, n=300, **cfg):
    """The set of ids drawn over n seeds."""
    s = make(impl, logits.shape[1])
    seen = set()
    for seed in range(n):
        s.configure(0, seed=seed, **cfg)
        seen.add(int(draw(s, logits)[0][0]))
    return seen


def test_extension_is_built():
    mod = importlib.import_module("fastserve._sampling")   # ImportError here = not built
    assert mod.Sampler.__module__ == "fastserve._sampling"


# -- greedy --------------------------------------------------------------------------

def test_greedy_argmax_and_ties_go_to_lowest_id(impl):
    s = make(impl, 6)
    s.configure(0, seed=1, temperature=0.0)
    assert draw(s, row(0.5, 3.0, -1.0, 3.0, 2.0, 3.0))[0][0] == 1
    s.configure(0, seed=1, temperature=-1.0)
    assert draw(s, row(7.0, 7.0, 7.0, 7.0, 7.0, 7.0))[0][0] == 0
    assert draw(s, row(np.nan, 1.0, np.nan, 4.0, 4.0, -np.inf))[0][0] == 3   # NaN never wins
    assert draw(s, row(-np.inf, -np.inf, np.nan, -np.inf, -np.inf, -np.inf))[0][0] == 0   # no candidate


def test_greedy_rows_fast_path(impl):
    s = make(impl, 200)
    rng = np.random.default_rng(3)
    logits = rng.integers(-3, 3, size=(9, 200)).astype(np.float32)   # many ties
    logits[4] = np.nan
    logits[5, 150] = np.inf
    out = np.zeros(9, np.int32)
    s.greedy_rows(logits, out)
    for r in range(9):
        finite = np.where(np.isnan(logits[r]), -np.inf, logits[r])
        expect = 0 if r == 4 else int(np.argmax(finite))   # np.argmax: first of the ties
        assert out[r] == expect


def test_greedy_sees_bias_and_penalties(impl):
    s = make(impl, 4)
    s.configure(0, seed=0, temperature=0.0, logit_bias={2: 5.0})
    assert draw(s, row(1.0, 4.0, 0.0, 2.0))[0][0] == 2
    s.configure(0, seed=0, temperature=0.0, repeat_penalty=3.0, history=[1])
    assert draw(s, row(1.0, 4.0, 0.0, 2.0))[0][0] == 3     # 4/3 < 2
    # the greedy choice joins the window: now 3 is penalized too (2/3) and 4/3 wins again
    assert draw(s, row(1.0, 4.0, 0.0, 2.0))[0][0] == 1


def test_top_k_one_is_greedy_at_any_temperature(impl):
    logits = row(0.1, 2.0, 1.9, -5.0, 2.0)
    assert support(impl, logits, n=100, temperature=5.0, top_k=1, top_p=1.0, min_p=0.0) == {1}


# -- top-k / top-p / min-p on hand-made rows ------------------------------------------

P4 = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))   # softmax(P4) == these probabilities


def post_probs(impl, logits, n_probs, **cfg):
    s = make(impl, logits.shape[1])
    s.configure(0, seed=5, n_probs=n_probs, post_sampling_probs=True, **cfg)
    _, pids, pp = draw(s, logits, n_probs=n_probs)
    return pids[0].tolist(), pp[0].astype(np.float64)


def test_top_k_keeps_the_k_best(impl):
    logits = row(1.0, 3.0, 0.0, 2.9, 2.95)
    assert support(impl, logits, temperature=1.0, top_k=2, top_p=1.0, min_p=0.0) == {1, 4}
    ids, p = post_probs(impl, logits, 5, temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)
    assert ids == [1, 4, -1, -1, -1]
    e = np.exp([3.0, 2.95])
    np.testing.assert_allclose(p[:2], e / e.sum(), rtol=1e-6)
    assert p[2:].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("top_p, kept", [(0.45, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (0.99, [0, 1, 2, 3])])
def test_top_p_keeps_the_shortest_prefix_reaching_p(impl, top_p, kept):
    ids, p = post_probs(impl, P4, 4, temperature=1.0, top_k=0, top_p=top_p, min_p=0.0)
    assert ids == kept + [-1] * (4 - len(kept))
    base = np.array([0.5, 0.3, 0.15, 0.05])[kept]
    np.testing.assert_allclose(p[:len(kept)], base / base.sum(), rtol=1e-6)
    # the same cut through the top-k path (top_k >= vocab) and through the sampled support
    ids_k, _ = post_probs(impl, P4, 4, temperature=1.0, top_k=4, top_p=top_p, min_p=0.0)
    assert ids_k == ids
    assert support(impl, P4, temperature=1.0, top_k=0, top_p=top_p, min_p=0.0) == set(kept)


def test_top_p_mass_is_taken_after_top_k(impl):
    # top_k=2 renormalizes over {0, 1}: 0.5/0.8 = 0.625 >= 0.6 keeps token 0 alone
    ids, _ = post_probs(impl, P4, 4, temperature=1.0, top_k=2, top_p=0.6, min_p=0.0)
    assert ids == [0, -1, -1, -1]
    ids, _ = post_probs(impl, P4, 4, temperature=1.0, top_k=0, top_p=0.6, min_p=0.0)
    assert ids == [0, 1, -1, -1]


@pytest.mark.parametrize("min_p, kept", [(0.2, [0, 1, 2]), (0.5, [0, 1]), (0.61, [0]), (0.09, [0, 1, 2, 3])])
def test_min_p_keeps_tokens_within_a_factor_of_the_best(impl, min_p, kept):
    for top_k in (0, 4):
        ids, _ = post_probs(impl, P4, 4, temperature=1.0, top_k=top_k, top_p=1.0, min_p=min_p)
        assert ids == kept + [-1] * (4 - len(kept))


def test_temperature_scales_the_kept_distribution(impl):
    logits = row(1.0, 0.0, -1.0, 0.5, 2.0)
    for t in (0.3, 1.0, 2.5):
        for top_k in (0, 5):
            ids, p = post_probs(impl, logits, 5, temperature=t, top_k=top_k, top_p=1.0, min_p=0.0)
            e = np.exp(logits[0].astype(np.float64) / t)
            e /= e.sum()
            order = [4, 0, 3, 1, 2]
            assert ids == order
            np.testing.assert_allclose(p, e[order], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("top_k", [0, 8])   # the full-vocab path and the heap path
def test_temperature_sampling_matches_softmax(impl, top_k):
    """Chi-square of 12,000 seeded draws against softmax(logits / T): deterministic."""
    logits = np.array([1.2, 0.3, -0.4, 2.0, 0.0, 1.0, -1.5, 0.7], np.float32)
    t = 0.8
    n = 12000
    s = make(impl, 8)
    s.configure(0, seed=20240601, temperature=t, top_k=top_k, top_p=1.0, min_p=0.0)
    ids, _, _ = draw(s, np.tile(logits, (n, 1)))
    counts = np.bincount(ids, minlength=8)
    p = np.exp(logits.astype(np.float64) / t)
    p /= p.sum()
    chi2 = float((((counts - n * p) ** 2) / (n * p)).sum())
    assert chi2 < 24.3, (chi2, counts.tolist())     # df = 7, p = 0.001


def test_top_p_draws_match_the_renormalized_nucleus(impl):
    logits = np.log(np.array([0.4, 0.25, 0.2, 0.1, 0.05], np.float64)).astype(np.float32)
    n = 8000
    s = make(impl, 5)
    s.configure(0, seed=99, temperature=1.0, top_k=0, top_p=0.8, min_p=0.0)
    ids, _, _ = draw(s, np.tile(logits, (n, 1)))
    counts = np.bincount(ids, minlength=5)
    assert counts[3] == counts[4] == 0
    p = np.array([0.4, 0.25, 0.2]) / 0.85
    chi2 = float((((counts[:3] - n * p) ** 2) / (n * p)).sum())
    assert chi2 < 13.8, (chi2, counts.tolist())     # df = 2, p = 0.001


# -- seeds -----------------------------------------------------------------------------

def run_seed(impl, seed, steps=40, **cfg):
    s = make(impl, 64)
    s.configure(0, seed=seed, temperature=1.0, **cfg)
    logits = np.zeros((steps, 64), np.float32)    # flat: every draw is pure RNG
    return draw(s, logits)[0].tolist()


def test_same_seed_same_ids_different_seeds_differ(impl):
    a = run_seed(impl, 12345, top_k=0, top_p=1.0, min_p=0.0)
    assert a == run_seed(impl, 12345, top_k=0, top_p=1.0, min_p=0.0)
    assert a != run_seed(impl, 12346, top_k=0, top_p=1.0, min_p=0.0)
    assert len(set(a)) > 20
    big = run_seed(impl, 2**64 - 1, top_k=10)
    assert big == run_seed(impl, 2**64 - 1, top_k=10) and big != run_seed(impl, 0, top_k=10)


def test_reconfigure_restarts_the_rng(impl):
    s = make(impl, 64)
    logits = np.zeros((10, 64), np.float32)
    s.configure(0, seed=7, temperature=1.0)
    first = draw(s, logits)[0].tolist()
    draw(s, logits)
    s.configure(0, seed=7, temperature=1.0)
    assert draw(s, logits)[0].tolist() == first


def test_slots_are_independent(impl):
    """A slot's ids do not depend on which other slots share the call."""
    logits = np.random.default_rng(1).standard_normal((6, 100)).astype(np.float32)
    s = make(impl, 100, n_slots=3)
    for k in range(3):
        s.configure(k, seed=k, temperature=1.0, top_k=0)
    mixed = draw(s, logits, slots=[0, 1, 2, 0, 1, 2])[0]
    alone = make(impl, 100, n_slots=3)
    alone.configure(1, seed=1, temperature=1.0, top_k=0)
    assert draw(alone, logits[[1, 4]], slots=[1, 1])[0].tolist() == [mixed[1], mixed[4]]


# -- penalties and bias -----------------------------------------------------------------

def effective(logits, history, rp, fp, pp, bias=None):
    """llama.cpp's logit bias then penalties, in float32."""
    x = np.array(logits, np.float32)
    for t, b in (bias or {}).items():
        x[t] = np.float32(x[t] + np.float32(b))
    counts = {}
    for t in history:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        v = x[t]
        v = v * np.float32(rp) if v <= 0 else v / np.float32(rp)
        x[t] = v - (np.float32(c) * np.float32(fp) + np.float32(pp))
    return x


def full_post_probs(impl, logits, **cfg):
    v = logits.shape[1]
    s = make(impl, v)
    s.configure(0, seed=3, n_probs=v, post_sampling_probs=True, temperature=1.0, **NEUTRAL, **cfg)
    _, pids, pp = draw(s, logits, n_probs=v)
    out = np.zeros(v)
    for i, p in zip(pids[0], pp[0]):
        if i >= 0:
            out[i] = p
    return out


def test_penalties_follow_llama_cpp_formulas(impl):
    logits = row(2.0, -1.0, 0.5, 1.5, 0.0, -0.5)
    hist = [0, 1, 1, 4, 0, 0]
    cfg = dict(repeat_penalty=1.5, frequency_penalty=0.25, presence_penalty=0.4, repeat_last_n=8)
    got = full_post_probs(impl, logits, history=hist, **cfg)
    x = effective(logits[0], hist, 1.5, 0.25, 0.4).astype(np.float64)
    e = np.exp(x - x.max())
    np.testing.assert_allclose(got, e / e.sum(), rtol=1e-6)
    assert x[0] == pytest.approx(2.0 / 1.5 - (3 * 0.25 + 0.4), rel=1e-6)   # positive: divided
    assert x[1] == pytest.approx(-1.0 * 1.5 - (2 * 0.25 + 0.4), rel=1e-6)  # negative: multiplied


def test_penalty_window_is_the_last_repeat_last_n_tokens(impl):
    s = make(impl, 10, max_penalty_window=4)
    s.configure(0, seed=0, temperature=0.0, repeat_last_n=3, repeat_penalty=2.0, history=[9, 8, 7, 6, 5])
    assert s.history(0) == [7, 6, 5]
    out = draw(s, np.tile(np.arange(10, dtype=np.float32), (3, 1)))[0].tolist()
    # 9 and 8 fell out of the window, so they win in turn and push the window along
    assert out == [9, 8, 7]
    assert s.history(0) == [9, 8, 7]
    s.configure(0, seed=0, repeat_last_n=-1, history=range(10))
    assert s.history(0) == [6, 7, 8, 9]
    s.configure(0, seed=0, repeat_last_n=0, history=[1, 2])
    assert s.history(0) == []


def test_sampled_tokens_feed_the_penalty(impl):
    """With a huge frequency penalty a greedy slot never repeats within its window."""
    s = make(impl, 5)
    s.configure(0, seed=0, temperature=0.0, frequency_penalty=100.0, repeat_last_n=5)
    out = draw(s, np.tile(row(5.0, 4.0, 3.0, 2.0, 1.0), (5, 1)))[0].tolist()
    assert out == [0, 1, 2, 3, 4]


def test_logit_bias_shifts_and_minus_inf_bans(impl):
    logits = row(3.0, 1.0, 0.0, -2.0)
    got = full_post_probs(impl, logits, logit_bias={1: 2.0, 3: 1.5})
    x = effective(logits[0], [], 1.0, 0.0, 0.0, {1: 2.0, 3: 1.5}).astype(np.float64)
    e = np.exp(x - x.max())
    np.testing.assert_allclose(got, e / e.sum(), rtol=1e-6)
    ban = {0: -np.inf}
    assert full_post_probs(impl, logits, logit_bias=ban)[0] == 0.0
    assert 0 not in support(impl, logits, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, logit_bias=ban)
    s = make(impl, 4)
    s.configure(0, seed=0, temperature=0.0, logit_bias=ban)
    assert draw(s, logits)[0][0] == 1
    s.configure(0, seed=0, temperature=0.0, logit_bias={2: np.inf})
    assert draw(s, logits)[0][0] == 2


def test_sample_leaves_logits_unchanged(impl):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 300)).astype(np.float32)
    before = logits.copy()
    s = make(impl, 300, n_slots=2)
    s.configure(0, seed=1, repeat_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1,
                history=rng.integers(0, 300, 50), logit_bias={5: -np.inf, 6: 3.0, 7: -2.0})
    s.configure(1, seed=2, temperature=0.0, logit_bias={5: 1.0}, history=[5, 5, 6], repeat_penalty=2.0)
    draw(s, logits, slots=[0, 1, 0, 1])
    assert np.array_equal(logits, before)


# -- n_probs -----------------------------------------------------------------------------

def test_pre_sampling_probs_are_the_raw_softmax(impl):
    logits = row(0.0, 2.0, 1.0, 2.0, -1.0, 0.5)
    s = make(impl, 6)
    # penalties, bias and temperature must not show in pre-sampling probabilities
    s.configure(0, seed=0, n_probs=4, temperature=0.3, logit_bias={0: 9.0}, repeat_penalty=2.0, history=[1])
    _, pids, pp = draw(s, logits, n_probs=4)
    e = np.exp(logits[0].astype(np.float64) - 2.0)
    e /= e.sum()
    assert pids[0].tolist() == [1, 3, 2, 5]
    np.testing.assert_allclose(pp[0], e[[1, 3, 2, 5]], rtol=1e-6)


def test_pre_sampling_probs_list_all_candidates_then_padding(impl):
    s = make(impl, 4)
    s.configure(0, seed=0, n_probs=4)
    _, pids, pp = draw(s, row(1.0, -np.inf, np.nan, 1.0), n_probs=4)
    assert pids[0].tolist() == [0, 3, -1, -1]
    assert pp[0].tolist() == [0.5, 0.5, 0.0, 0.0]


def test_probs_written_only_for_slots_that_asked(impl):
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((4, 50)).astype(np.float32)
    s = make(impl, 50, n_slots=3)
    s.configure(0, seed=0)
    s.configure(1, seed=1, n_probs=3)
    s.configure(2, seed=2, n_probs=5, post_sampling_probs=True)
    ids, pids, pp = draw(s, logits, slots=[0, 1, 2, 0], n_probs=6)
    for r in (0, 3):
        assert (pids[r] == -9).all() and (pp[r] == -9.0).all()
    # the list, then the sampled token's own entry in the column after it (the arrays are wider), then nothing
    assert (pids[1, :3] >= 0).all() and pids[1, 3] == ids[1] and (pids[1, 4:] == -9).all()
    assert (pids[2, :5] != -9).all() and pids[2, 5] == ids[2]
    # nobody asks: the probability arrays may be omitted
    out = np.zeros(2, np.int32)
    s.sample(logits[:2], np.array([0, 0], np.int32), out)
    s.sample(logits[:2], np.array([0, 0], np.int32), out, None, None)


def test_post_sampling_probs_greedy_lists_the_choice(impl):
    s = make(impl, 5)
    s.configure(0, seed=0, temperature=0.0, n_probs=3, post_sampling_probs=True)
    out, pids, pp = draw(s, row(0.0, 1.0, 3.0, 3.0, 2.0), n_probs=3)
    assert out[0] == 2 and pids[0].tolist() == [2, -1, -1] and pp[0].tolist() == [1.0, 0.0, 0.0]


# -- errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, msg", [
    (dict(repeat_last_n=300), "max_penalty_window"),
    (dict(repeat_last_n=-2), "repeat_last_n"),
    (dict(logit_bias={i: 1.0 for i in range(9)}), "max_logit_bias"),
    (dict(logit_bias={100: 1.0}), "outside the vocabulary"),
    (dict(logit_bias={-1: 1.0}), "outside the vocabulary"),
    (dict(logit_bias={3: float("nan")}), "NaN"),
    (dict(logit_bias=[(3, 1.0)]), "dict"),
    (dict(history=[1, 2, 100]), "history"),
    (dict(history=[-1]), "history"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.1), "top_p"),
    (dict(min_p=2.0), "min_p"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(repeat_penalty=0.0), "repeat_penalty"),
    (dict(presence_penalty=float("inf")), "presence_penalty"),
    (dict(frequency_penalty="a"), "frequency_penalty"),
    (dict(top_k=1.5), "top_k"),
    (dict(n_probs=101), "n_probs"),
    (dict(n_probs=-1), "n_probs"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(seed=1.0), "seed"),
    (dict(post_sampling_probs="yes"), "post_sampling_probs"),
])
def test_configure_rejects_bad_values(impl, kw, msg):
    s = make(impl, 100, max_penalty_window=256, max_logit_bias=8)
    args = dict(seed=1)
    args.update(kw)
    with pytest.raises(RequestError, match=msg) as e:
        s.configure(0, **args)
    assert isinstance(e.value, ValueError)


def test_configure_rejects_bad_slot_and_needs_a_seed(impl):
    s = make(impl, 10, n_slots=2)
    with pytest.raises(RequestError, match="slot"):
        s.configure(2, seed=0)
    with pytest.raises(TypeError):
        s.configure(0)


def test_configure_accepts_edge_values(impl):
    s = make(impl, 100, max_penalty_window=4, max_logit_bias=2)
    s.configure(0, seed=2**64 - 1, top_k=10**9, top_p=0.0, min_p=1.0, repeat_last_n=4,
                logit_bias={0: -np.inf, 99: np.inf}, n_probs=100, history=np.arange(100))
    out, _, _ = draw(s, np.zeros((1, 100), np.float32), n_probs=100)
    assert out[0] == 99


def test_sample_rejects_bad_arguments(impl):
    s = make(impl, 10, n_slots=2)
    s.configure(0, seed=0, n_probs=3)
    logits = np.zeros((2, 10), np.float32)
    out = np.zeros(2, np.int32)
    with pytest.raises(ValueError, match="never configured"):
        s.sample(logits, np.array([1], np.int32), out)
    with pytest.raises(ValueError, match="out of range"):
        s.sample(logits, np.array([2], np.int32), out)
    with pytest.raises(ValueError, match="n_probs"):
        s.sample(logits, np.array([0], np.int32), out)
    with pytest.raises(ValueError, match="n_probs"):
        s.sample(logits, np.array([0], np.int32), out, np.zeros((1, 2), np.int32), np.zeros((1, 2), np.float32))
    with pytest.raises(ValueError):
        s.sample(np.zeros((2, 11), np.float32), np.array([0], np.int32), out)
    with pytest.raises(ValueError):
        s.sample(logits[:1], np.array([0, 0], np.int32), out)


# -- parity ------------------------------------------------------------------------------

def both(n_slots, n_vocab, **kw):
    return [sampler_cls(m)(n_slots, n_vocab, **kw) for m in IMPLS]


def assert_same_steps(samplers, logits_steps, slots, n_probs):
    for logits in logits_steps:
        results = []
        for s in samplers:
            lg = logits.copy()
            results.append(draw(s, lg, slots=slots, n_probs=n_probs))
            assert np.array_equal(lg, logits, equal_nan=True)
        (a_ids, a_pid, a_pp), (b_ids, b_pid, b_pp) = results
        assert a_ids.tolist() == b_ids.tolist()
        assert a_pid.tolist() == b_pid.tolist()
        assert np.array_equal(a_pp, b_pp)
    assert [samplers[0].history(k) for k in range(len(set(slots)))] == \
           [samplers[1].history(k) for k in range(len(set(slots)))]


params_st = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, -1.0, 0.05, 0.5, 0.8, 1.0, 1.7, 30.0]),
    "top_k": st.sampled_from([-1, 0, 1, 2, 3, 5, 40, 1000]),
    "top_p": st.sampled_from([0.0, 0.1, 0.5, 0.9, 0.95, 0.999, 1.0]),
    "min_p": st.sampled_from([0.0, 0.01, 0.05, 0.3, 1.0]),
    "repeat_penalty": st.sampled_from([1.0, 1.1, 2.0, 0.5]),
    "repeat_last_n": st.sampled_from([0, 1, 8, 64, -1]),
    "presence_penalty": st.sampled_from([0.0, 0.5, -0.3]),
    "frequency_penalty": st.sampled_from([0.0, 0.2, 1.0]),
    "seed": st.integers(0, 2**64 - 1),
    "n_probs": st.sampled_from([0, 1, 3, 8]),
    "post_sampling_probs": st.booleans(),
})


@st.composite
def parity_case(draw_):
    n_vocab = draw_(st.integers(1, 130))
    n_slots = draw_(st.integers(1, 3))
    cfgs = []
    for _ in range(n_slots):
        cfg = draw_(params_st)
        cfg["n_probs"] = min(cfg["n_probs"], n_vocab)
        bias_ids = draw_(st.lists(st.integers(0, n_vocab - 1), max_size=4, unique=True))
        cfg["logit_bias"] = {t: draw_(st.sampled_from([-np.inf, -2.0, 0.5, 3.0, np.inf])) for t in bias_ids}
        cfg["history"] = draw_(st.lists(st.integers(0, n_vocab - 1), max_size=20))
        cfgs.append(cfg)
    n_rows = draw_(st.integers(1, 6))
    slots = draw_(st.lists(st.integers(0, n_slots - 1), min_size=n_rows, max_size=n_rows))
    kind = draw_(st.sampled_from(["normal", "ties", "special", "peaked"]))
    seed = draw_(st.integers(0, 2**32 - 1))
    return n_vocab, cfgs, slots, kind, seed


def random_logits(rng, shape, kind):
    if kind == "ties":
        return rng.integers(-2, 3, size=shape).astype(np.float32)
    if kind == "peaked":
        return (rng.standard_normal(shape) * 8).astype(np.float32)
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "special":
        mask = rng.random(shape)
        x[mask < 0.1] = -np.inf
        x[(mask >= 0.1) & (mask < 0.15)] = np.nan
        x[mask > 0.995] = np.inf
    return x


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parity_case())
def test_parity_random_small_vocab(case):
    n_vocab, cfgs, slots, kind, seed = case
    samplers = both(len(cfgs), n_vocab, max_penalty_window=64, max_logit_bias=4)
    for s in samplers:
        for k, cfg in enumerate(cfgs):
            s.configure(k, **cfg)
    rng = np.random.default_rng(seed)
    steps = [random_logits(rng, (len(slots), n_vocab), kind) for _ in range(5)]
    assert_same_steps(samplers, steps, slots, 8)


def test_parity_thousands_of_rows():
    """3,000 rows of mixed configurations at vocab 257, one slot per configuration."""
    rng = np.random.default_rng(7)
    cfgs = [
        dict(), dict(temperature=0.0), dict(top_k=0), dict(top_k=0, min_p=0.0, top_p=0.9, temperature=1.3),
        dict(top_k=0, top_p=1.0, min_p=0.0), dict(top_k=3, top_p=0.5), dict(top_k=300, top_p=0.99, min_p=0.0),
        dict(repeat_penalty=1.3, frequency_penalty=0.3, presence_penalty=0.2, repeat_last_n=32),
        dict(n_probs=5), dict(n_probs=7, post_sampling_probs=True, top_k=0, min_p=0.02),
        dict(logit_bias={1: -np.inf, 2: 4.0}, temperature=2.0, top_k=0, top_p=0.7),
        dict(temperature=0.01, top_k=0, top_p=0.95),
    ]
    samplers = both(len(cfgs), 257)
    for s in samplers:
        for k, cfg in enumerate(cfgs):
            s.configure(k, seed=1000 + k, **cfg)
    slots = list(range(len(cfgs))) * 2
    steps = [random_logits(rng, (len(slots), 257), ["normal", "ties", "special", "peaked"][i % 4])
             for i in range(125)]
    assert_same_steps(samplers, steps, slots, 8)


@pytest.mark.parametrize("cfg", [
    dict(temperature=0.0),
    dict(),
    dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.0, n_probs=5),
    dict(top_k=0, top_p=0.95, min_p=0.0, n_probs=4, post_sampling_probs=True),
    dict(top_k=0, top_p=0.5, temperature=1.0),
    dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.2),
    dict(top_k=5000, top_p=0.9, min_p=0.0, repeat_penalty=1.2, presence_penalty=0.5,
         logit_bias={0: 5.0, 17: -np.inf}, n_probs=3, post_sampling_probs=True),
], ids=["greedy", "default", "topk40", "topk0-topp95-post", "topk0-topp50", "temp-only", "topk5000-pen"])
def test_parity_vocab_49152(cfg):
    n_vocab = 49152
    rng = np.random.default_rng(11)
    history = rng.integers(0, n_vocab, 40).tolist()
    samplers = both(2, n_vocab)
    for s in samplers:
        for k in range(2):
            s.configure(k, seed=77 + k, history=history if k else (), **cfg)
    normal = rng.standard_normal((2, n_vocab)).astype(np.float32)
    peaked = (rng.standard_normal((2, n_vocab)) * 4).astype(np.float32)
    peaked[:, 123] = 25.0
    assert_same_steps(samplers, [normal, peaked], [0, 1], 5)
