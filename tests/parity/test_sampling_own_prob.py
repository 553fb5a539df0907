"""The sampled token's own probability (column n_probs of arrays wider than n_probs): its true value in the
distribution the list is taken from, also when it is not listed (top_k off, a hot temperature), as llama-server
reports it; the Cython sampler and its twin write the same bits."""
import importlib

import numpy as np
import pytest

IMPLS = ["fastserve._sampling", "fastserve.ref.sampling"]


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param


def _run(impl, logits, n_probs, width, seed=0, slots=None, masks=None, **cfg):
    """One sample() call over logits [rows, V] for one slot per row; returns (ids, probs_ids, probs)."""
    logits = np.ascontiguousarray(logits, np.float32)
    rows, n_vocab = logits.shape
    s = importlib.import_module(impl).Sampler(rows, n_vocab)
    for r in range(rows):
        s.configure(r, seed=seed + r, n_probs=n_probs, constrained=masks is not None, **cfg)
    if masks is not None:
        s.masks[:] = masks
    ids = np.full(rows, -7, np.int32)
    pids, pp = np.full((rows, width), -9, np.int32), np.full((rows, width), -9.0, np.float32)
    s.sample(logits.copy(), np.arange(rows, dtype=np.int32) if slots is None else slots, ids, pids, pp)
    return ids, pids, pp


def _softmax(x, temp=1.0):
    z = np.exp((x.astype(np.float64) - x.max()) / temp)
    return z / z.sum()


@pytest.mark.parametrize("post", [False, True])
def test_own_probability_of_a_token_outside_the_list_is_its_true_value(impl, post):
    """A hot temperature with top_k off samples far outside the 2 listed: the own entry is the token's softmax
    probability (pre: the raw logits at temperature 1; post: the kept set, here every token, at the temperature);
    before this entry, a token outside the list read 0 (logprob -9999)."""
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 3, (48, 500)).astype(np.float32)
    ids, pids, pp = _run(impl, logits, 2, 3, temperature=4.0, top_k=0, top_p=1.0, min_p=0.0,
                         post_sampling_probs=post)
    outside = 0
    for r, tok in enumerate(ids):
        want = _softmax(logits[r], 4.0 if post else 1.0)[tok]
        assert pids[r, 2] == tok
        assert pp[r, 2] == pytest.approx(want, rel=1e-5), r
        outside += tok not in pids[r, :2]
    assert outside > 30, "the test needs tokens sampled outside the list"


@pytest.mark.parametrize("post", [False, True])
def test_own_entry_of_a_listed_token_is_its_listed_value(impl, post):
    rng = np.random.default_rng(6)
    logits = rng.normal(0, 2, (40, 300)).astype(np.float32)
    ids, pids, pp = _run(impl, logits, 50, 51, temperature=0.8, top_k=40, top_p=0.95, post_sampling_probs=post)
    for r, tok in enumerate(ids):
        listed = list(pids[r, :50]).index(tok)
        assert (pids[r, 50], pp[r, 50].view(np.int32)) == (tok, pp[r, listed].view(np.int32))


def test_own_probability_of_a_weight_truncated_to_zero(impl):
    """Pre-sampling weights are fixed-point: a token 40 nats below the max weighs 0 there; drawn at temperature
    100, its own probability is still its softmax value (exp(-40) / (1 + exp(-40)))."""
    logits = np.array([[0.0, -40.0]] * 32, np.float32)
    ids, pids, pp = _run(impl, logits, 1, 2, temperature=100.0, top_k=0, top_p=1.0, min_p=0.0)
    assert 1 in ids and 0 in ids
    for r, tok in enumerate(ids):
        assert pp[r, 1] == pytest.approx(_softmax(logits[r])[tok], rel=1e-6)
        assert pp[r, 1] > 0


def test_own_entry_of_greedy_and_of_rows_without_candidates(impl):
    logits = np.array([[1.0, 3.0, 2.0], [-np.inf, -np.inf, np.nan]], np.float32)
    ids, pids, pp = _run(impl, logits, 1, 2, temperature=0.0, post_sampling_probs=True)
    assert ids.tolist() == [1, 0] and pids[:, 1].tolist() == [1, 0] and pp[:, 1].tolist() == [1.0, 0.0]
    ids, pids, pp = _run(impl, logits, 1, 2, temperature=0.0)
    assert pp[0, 1] == np.float32(_softmax(logits[0])[1]) and pp[1, 1] == 0.0
    none = np.zeros((2, 1), np.uint32)          # constrained, nothing allowed: -1 and 0
    ids, pids, pp = _run(impl, logits, 1, 2, temperature=0.7, masks=none)
    assert ids.tolist() == [-1, -1] and pids[:, 1].tolist() == [-1, -1] and pp[:, 1].tolist() == [0.0, 0.0]


def test_arrays_of_n_probs_columns_get_no_own_entry(impl):
    """The own entry needs a column past the list: an array of exactly n_probs columns keeps the list only."""
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 3, (4, 100)).astype(np.float32)
    _, pids, pp = _run(impl, logits, 3, 3, temperature=1.5, top_k=0)
    wide = _run(impl, logits, 3, 5, temperature=1.5, top_k=0)
    assert (pids == wide[1][:, :3]).all() and (pp == wide[2][:, :3]).all()
    assert (wide[1][:, 4] == -9).all()          # nothing past the own entry


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_own_entry_is_the_same_bits_in_the_twin(seed):
    """Random chains (top-k, top-p, min-p, bias, penalties, constrained rows), pre and post: same ids, lists and
    own entries bit for bit."""
    rng = np.random.default_rng(seed)
    n_vocab, rows = 700, 12
    logits = (rng.normal(0, 4, (rows, n_vocab))).astype(np.float32)
    logits[rng.random(logits.shape) < 0.05] = -np.inf
    masks = np.packbits(rng.random((rows, 704)) < 0.6, axis=1, bitorder="little").view("<u4").astype(np.uint32)
    for cfg in (dict(temperature=3.0, top_k=0, post_sampling_probs=False),
                dict(temperature=2.0, top_k=0, top_p=0.9, min_p=0.01, post_sampling_probs=True),
                dict(temperature=1.2, top_k=30, top_p=0.8, post_sampling_probs=True, logit_bias={5: 9.0}),
                dict(temperature=5.0, top_k=300, repeat_penalty=1.5, history=[1, 2, 3], post_sampling_probs=False)):
        for m in (None, masks):
            got = [_run(i, logits, 4, 6, seed=seed, masks=m, **cfg) for i in IMPLS]
            assert got[0][0].tolist() == got[1][0].tolist(), cfg
            assert got[0][1].tolist() == got[1][1].tolist(), cfg
            assert got[0][2].view(np.int32).tolist() == got[1][2].view(np.int32).tolist(), cfg
