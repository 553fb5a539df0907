"""The n-gram drafters (fastserve._drafts) against their twin (fastserve.ref.drafts), and against what the
drafts mean, written out by brute force: ngram-simple copies what followed the latest earlier occurrence of
the slot's last size_n tokens; ngram-mod follows "after these size_n tokens came this one"."""
import importlib

import numpy as np
import pytest

IMPLS = ["fastserve._drafts", "fastserve.ref.drafts"]


@pytest.fixture(params=IMPLS)
def impl(request):
    return importlib.import_module(request.param)


def _stream(seed, n, vocab=6):
    """Tokens with repeats: random runs copied from earlier in the stream."""
    rng = np.random.default_rng(seed)
    out = list(rng.integers(0, vocab, 8))
    while len(out) < n:
        if rng.random() < 0.6 and len(out) > 8:
            start = int(rng.integers(0, len(out) - 4))
            out += out[start:start + int(rng.integers(3, 12))]
        else:
            out += list(rng.integers(0, vocab, 3))
    return np.array(out[:n], np.int32)


def _simple(t, n, size_n, size_m):
    """Brute force: the latest p < n with t[p-size_n:p] == t[n-size_n:n], and what follows it."""
    for p in range(n - 1, size_n - 1, -1):
        if list(t[p - size_n:p]) == list(t[n - size_n:n]):
            k = min(size_m, n - p)
            return [] if k < size_n else list(t[p:p + k])
    return []


def _propose(d, tokens, n, k_max, k_min=0, n_slots=1, cap=64):
    toks = np.zeros((n_slots, tokens.shape[-1]), np.int32)
    toks[0] = tokens
    drafts, n_draft = np.zeros((n_slots, cap), np.int32), np.zeros(n_slots, np.int32)
    km = np.zeros(n_slots, np.int32)
    km[0] = k_max
    d.propose(toks, np.array([n] + [0] * (n_slots - 1), np.int32), km, np.full(n_slots, k_min, np.int32),
              drafts, n_draft)
    return drafts[0, :n_draft[0]].tolist()


@pytest.mark.parametrize("seed", range(4))
def test_ngram_simple_drafts_what_followed_the_latest_match(impl, seed):
    t = _stream(seed, 300)
    d = impl.Drafter(1, 512, "ngram-simple", size_n=3, size_m=10)
    hits = 0
    for n in range(1, 300):                 # the slot grows one token at a time: indexing is incremental
        got, want = _propose(d, np.pad(t, (0, 212)), n, k_max=8), _simple(t, n, 3, 10)[:8]
        assert got == want or (got == [] and want), (n, got, want)   # a collision may only lose a draft
        hits += bool(got)
    assert hits > 50


@pytest.mark.parametrize("seed", range(3))
def test_both_twins_give_the_same_drafts(seed):
    a, b = (importlib.import_module(m) for m in IMPLS)
    t = np.pad(_stream(seed, 400), (0, 112))
    for kind, kw in (("ngram-simple", dict(size_n=2, size_m=12)), ("ngram-mod", dict(size_n=2, n_min=3))):
        da, db = a.Drafter(2, 512, kind, **kw), b.Drafter(2, 512, kind, **kw)
        for n in range(1, 400, 3):
            k = 1 + n % 9
            assert _propose(da, t, n, k, k_min=2, n_slots=2) == _propose(db, t, n, k, k_min=2, n_slots=2), (kind, n)
        assert (da.table == db.table).all()


def test_ngram_mod_chains_its_lookups_and_refuses_short_chains(impl):
    t = np.array([1, 2, 3, 4, 5, 6, 9, 1, 2] + [0] * 55, np.int32)
    d = impl.Drafter(1, 64, "ngram-mod", size_n=2, n_min=3)
    assert _propose(d, t, 9, k_max=10) == [3, 4, 5, 6, 9, 1, 2, 3, 4, 5]   # 1 2 -> 3 -> 4 ..., a cycle
    assert _propose(d, t, 9, k_max=2) == [3, 4]
    fresh = np.array([1, 2, 3, 4, 5, 6, 9, 7, 8] + [0] * 55, np.int32)
    assert _propose(d, fresh, 9, k_max=10) == []                  # 7 8 never came before: nothing to chain


def test_k_min_reset_and_a_slot_cut_back(impl):
    t = np.pad(np.array([5, 6, 7, 8, 9, 5, 6], np.int32), (0, 57))
    d = impl.Drafter(1, 64, "ngram-simple", size_n=2, size_m=8)
    assert _propose(d, t, 7, k_max=8) == [7, 8, 9, 5, 6]
    assert _propose(d, t, 7, k_max=8, k_min=6) == []              # fewer than the request's n_min: none
    d.reset(0)
    other = np.pad(np.array([1, 2, 3, 1, 2], np.int32), (0, 59))
    assert _propose(d, other, 5, k_max=8) == [3, 1, 2]            # what the earlier tokens said is gone
    assert _propose(d, other, 4, k_max=8) == []                   # 1 token follows its match: < size_n
    assert _propose(d, other, 3, k_max=8) == []                   # cut back: indexed again


def test_bad_drafter_arguments(impl):
    with pytest.raises(ValueError, match="unknown drafter"):
        impl.Drafter(1, 64, "draft-simple", size_n=2)
    with pytest.raises(ValueError, match="n-gram length"):
        impl.Drafter(1, 64, "ngram-mod", size_n=0)
    assert impl.Drafter(3, 100_000_000, "ngram-mod", size_n=4).table.shape == (3, 1 << 20)   # bounded per slot
