"""Constrained sampling: the allowed-token mask before every stage, Cython sampler vs twin bit for bit."""
import importlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.parity.test_sampling import IMPLS, assert_same_steps, both, draw, params_st, random_logits


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param


def set_mask(s, slot, allowed):
    """masks[slot] := the bit array of the ids in `allowed`."""
    bits = np.zeros(s.masks.shape[1] * 32, np.uint8)
    bits[list(allowed)] = 1
    s.masks[slot] = np.packbits(bits, bitorder="little").view("<u4")


def test_masks_are_a_bit_array_per_slot(impl):
    s = importlib.import_module(impl).Sampler(3, 70)
    assert s.masks.shape == (3, 3) and s.masks.dtype == np.uint32 and s.n_mask_words == 3


def test_greedy_takes_the_best_allowed_token(impl):
    s = importlib.import_module(impl).Sampler(1, 40)
    s.configure(0, seed=1, temperature=0.0, constrained=True)
    logits = np.arange(40, dtype=np.float32)[None, :].copy()
    set_mask(s, 0, {3, 17, 33})
    before = logits.copy()
    assert draw(s, logits)[0][0] == 33
    assert np.array_equal(logits, before)          # the caller's logits are untouched
    set_mask(s, 0, {3, 17})
    assert draw(s, logits)[0][0] == 17


def test_every_stage_sees_only_allowed_tokens(impl):
    """top-k, bias, penalties and n_probs (pre and post) work on the masked row."""
    s = importlib.import_module(impl).Sampler(1, 64)
    allowed = {5, 9, 40, 63}
    logits = np.linspace(-3, 3, 64, dtype=np.float32)[None, :].copy()
    for post in (False, True):
        s.configure(0, seed=3, temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, n_probs=6,
                    post_sampling_probs=post, logit_bias={63: -100.0}, constrained=True)
        set_mask(s, 0, allowed)
        seen = set()
        for _ in range(60):
            ids, pids, pp = draw(s, logits, n_probs=6)
            seen.add(int(ids[0]))
            listed = {int(t) for t in pids[0] if t >= 0}
            assert listed <= allowed
        assert seen == {9, 40}                     # top-2 of the allowed after the bias on 63


def test_no_allowed_token_yields_minus_one_and_keeps_history(impl):
    s = importlib.import_module(impl).Sampler(2, 50)
    s.configure(0, seed=1, repeat_penalty=1.1, repeat_last_n=8, history=[1, 2], constrained=True)
    s.configure(1, seed=1, repeat_penalty=1.1, repeat_last_n=8, history=[1, 2])
    logits = np.zeros((2, 50), np.float32)
    logits[1, :] = -np.inf                         # unconstrained, no candidate: token 0 as before
    set_mask(s, 0, set())
    ids, _, _ = draw(s, logits, slots=[0, 1])
    assert ids.tolist() == [-1, 0]
    assert s.history(0) == [1, 2]
    logits[0, :] = -np.inf
    set_mask(s, 0, {4, 7})                         # allowed, but no finite logit among them
    assert draw(s, logits[:1])[0][0] == -1


def test_unconstrained_slots_ignore_their_mask_row(impl):
    s = importlib.import_module(impl).Sampler(1, 30)
    s.configure(0, seed=1, temperature=0.0)
    set_mask(s, 0, {2})
    logits = np.arange(30, dtype=np.float32)[None, :].copy()
    assert draw(s, logits)[0][0] == 29


masks_st = st.sampled_from(["one", "sparse", "dense", "all", "none", "words"])


def random_mask(rng, n_vocab, kind):
    if kind == "one":
        return {int(rng.integers(n_vocab))}
    if kind == "all":
        return set(range(n_vocab))
    if kind == "none":
        return set()
    if kind == "words":                            # whole words on and off, as JSON masks look
        return {t for t in range(n_vocab) if (t // 32) % 2 == 0}
    p = 0.05 if kind == "sparse" else 0.7
    return set(np.flatnonzero(rng.random(n_vocab) < p).tolist())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 200), st.lists(params_st, min_size=1, max_size=3), st.data())
def test_parity_masked_random(n_vocab, cfgs, data):
    samplers = both(len(cfgs), n_vocab, max_penalty_window=64, max_logit_bias=4)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    for s in samplers:
        for k, cfg in enumerate(cfgs):
            cfg = {**cfg, "n_probs": min(cfg["n_probs"], n_vocab)}
            s.configure(k, constrained=k != len(cfgs) - 1 or len(cfgs) == 1, **cfg)
    slots = data.draw(st.lists(st.integers(0, len(cfgs) - 1), min_size=1, max_size=5))
    kind = data.draw(st.sampled_from(["normal", "ties", "special", "peaked"]))
    for _ in range(4):
        masks = [random_mask(rng, n_vocab, data.draw(masks_st)) for _ in cfgs]
        for s in samplers:
            for k, m in enumerate(masks):
                set_mask(s, k, m)
        assert_same_steps(samplers, [random_logits(rng, (len(slots), n_vocab), kind)], slots, 8)


@pytest.mark.parametrize("cfg", [dict(temperature=0.0), dict(), dict(top_k=0, top_p=0.9, min_p=0.0, n_probs=4),
                                 dict(top_k=0, top_p=1.0, min_p=0.0, n_probs=3, post_sampling_probs=True)],
                         ids=["greedy", "default", "topk0-topp90", "temp-only-post"])
def test_parity_masked_vocab_49152(cfg):
    rng = np.random.default_rng(11)
    n_vocab = 49152
    samplers = both(2, n_vocab)
    for s in samplers:
        s.configure(0, seed=5, constrained=True, **cfg)
        s.configure(1, seed=6, **cfg)
    for kind in ("sparse", "dense", "words", "one"):
        m = random_mask(rng, n_vocab, kind)
        for s in samplers:
            set_mask(s, 0, m)
        logits = (rng.standard_normal((2, n_vocab)) * 3).astype(np.float32)
        assert_same_steps(samplers, [logits], [0, 1], 4)
