"""The sampler's verification of drafted rows (speculative decoding), both implementations: a slot's rows
are sampled in order and stop at the first sample that differs from the next row's draft, so what is kept
is exactly what plain decoding gives, seed for seed (greedy, sampling with top-k / top-p / min-p,
penalties, probabilities), and the rows after a rejection are never drawn (REJECTED, no RNG, no history).

The "model" is a table: the logits of the next token are W[previous token] (vocab 40)."""
import importlib
import math
from collections import Counter

import numpy as np
import pytest

IMPLS = ["fastserve._sampling", "fastserve.ref.sampling"]
V = 40
W = np.random.default_rng(7).normal(0.0, 2.0, (V, V)).astype(np.float32)      # [prev, next] logits
SAMPLED = dict(temperature=0.7, top_k=12, top_p=0.9, min_p=0.0)
CONFIGS = {"greedy": dict(temperature=0.0), "sampled": SAMPLED,
           "penalties": dict(SAMPLED, repeat_penalty=1.4, repeat_last_n=6, presence_penalty=0.3),
           "min_p+probs": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05, n_probs=3)}


def _sampler(impl, seed, cfg, n_slots=1):
    s = importlib.import_module(impl).Sampler(n_slots, V)
    for slot in range(n_slots):
        s.configure(slot, seed=seed + slot, history=[1], **cfg)
    return s


def _plain(impl, seed, cfg, n):
    """n tokens, one row per call (plain decoding), from token 1."""
    s, prev, out = _sampler(impl, seed, cfg), 1, []
    ids, pids, pp = np.zeros(1, np.int32), np.zeros((1, 3), np.int32), np.zeros((1, 3), np.float32)
    for _ in range(n):
        s.sample(np.ascontiguousarray(W[[prev]]), np.zeros(1, np.int32), ids, pids, pp)
        prev = int(ids[0])
        out.append((prev, pids[0].tolist(), pp[0].tolist()))
    return out


def _drafted(impl, seed, cfg, n, draft_of, k=4):
    """n tokens the speculative way: each call verifies k drafts (draft_of(context, j)) after the last token."""
    s, ctx, out, calls = _sampler(impl, seed, cfg), [1], [], []
    while len(out) < n:
        drafts = [draft_of(ctx, j) for j in range(k)]
        fed = [ctx[-1]] + drafts
        row_draft = np.array(drafts + [-1], np.int32)
        ids = np.zeros(k + 1, np.int32)
        pids, pp = np.zeros((k + 1, 3), np.int32), np.zeros((k + 1, 3), np.float32)
        s.sample(np.ascontiguousarray(W[fed]), np.zeros(k + 1, np.int32), ids, pids, pp, row_draft)
        calls.append(ids.tolist())
        for j in range(k + 1):
            assert ids[j] >= 0
            out.append((int(ids[j]), pids[j].tolist(), pp[j].tolist()))
            ctx.append(int(ids[j]))
            if j == k or ids[j] != drafts[j]:
                assert (ids[j + 1:] == -2).all(), "the rows after a rejection are not drawn"
                break
    return out[:n], calls


def _guess(truth):
    """Drafts that are right for a while, then wrong: the true token, but a wrong one at every seventh
    position."""
    def draft_of(ctx, j):
        i = len(ctx) - 1 + j
        t = truth[i] if i < len(truth) else 0
        return t if i % 7 else (t + 1) % V
    return draft_of


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", CONFIGS)
def test_verified_drafts_give_plain_decoding_exactly(impl, name):
    cfg = CONFIGS[name]
    for seed in (3, 11):
        plain = _plain(impl, seed, cfg, 40)
        got, calls = _drafted(impl, seed, cfg, 40, _guess([t for t, _, _ in plain]))
        assert got == plain if cfg.get("n_probs") else [t for t, _, _ in got] == [t for t, _, _ in plain]
        assert any(-2 in c for c in calls) and any(-2 not in c for c in calls)     # rejections and whole accepts


@pytest.mark.parametrize("name", CONFIGS)
def test_both_implementations_verify_alike(name):
    truth = [t for t, _, _ in _plain(IMPLS[1], 5, CONFIGS[name], 30)]
    a = _drafted(IMPLS[0], 5, CONFIGS[name], 30, _guess(truth))
    b = _drafted(IMPLS[1], 5, CONFIGS[name], 30, _guess(truth))
    assert a == b


def test_rows_of_other_slots_are_sampled_after_a_rejection():
    """Slot 0 rejects at its first row; slot 1's rows, after it in the same call, are still sampled."""
    for impl in IMPLS:
        s = _sampler(impl, 1, dict(temperature=0.0), n_slots=2)
        best = int(np.argmax(W[1]))
        fed = [1, (best + 1) % V, 2, 1]
        ids = np.zeros(4, np.int32)
        s.sample(np.ascontiguousarray(W[fed]), np.array([0, 0, 1, 1], np.int32), ids,
                 drafts=np.array([(best + 1) % V, -1, 1, -1], np.int32))
        assert ids[0] == best and ids[1] == -2 and ids[2] == int(np.argmax(W[2]))
        assert ids[3] == (int(np.argmax(W[1])) if ids[2] == 1 else -2)


def _chi2_sf(x, df):
    """P(chi2_df > x), Wilson-Hilferty (good to well under 0.005 near p = 0.01 for df >= 3)."""
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_first_two_tokens_are_distributed_as_plain_sampling():
    """2,000 seeds of speculative sampling (temperature 0.7, top-k, top-p; drafts: the plain argmax chain,
    often accepted, often not) against 2,000 other seeds of plain sampling: the pairs of first tokens are
    one distribution (chi-square test of homogeneity, p > 0.01). The same seed gives the same pair."""
    impl, cfg, n = IMPLS[0], SAMPLED, 2000
    argmax_chain = [int(np.argmax(W[1]))]
    argmax_chain.append(int(np.argmax(W[argmax_chain[0]])))
    spec, plain, accepted = Counter(), Counter(), 0
    for seed in range(n):
        got, calls = _drafted(impl, seed, cfg, 2, lambda ctx, j: argmax_chain[min(len(ctx) - 1 + j, 1)], k=2)
        spec[tuple(t for t, _, _ in got)] += 1
        accepted += calls[0][1] != -2
        plain[tuple(t for t, _, _ in _plain(impl, n + seed, cfg, 2))] += 1
        if seed < 100:
            assert [t for t, _, _ in got] == [t for t, _, _ in _plain(impl, seed, cfg, 2)]
    assert 0.2 * n < accepted < 0.9 * n
    cells = sorted(set(spec) | set(plain), key=lambda c: -(spec[c] + plain[c]))
    big = [c for c in cells if spec[c] + plain[c] >= 10]
    table = [(spec[c], plain[c]) for c in big]
    table.append((n - sum(a for a, _ in table), n - sum(b for _, b in table)))
    chi2 = sum((a - b) ** 2 / (a + b) for a, b in table if a + b)     # equal sample sizes
    p = _chi2_sf(chi2, len(table) - 1)
    assert p > 0.01, (chi2, len(table), p)
