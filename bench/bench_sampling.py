"""Sampler cost per row at vocab 49,152 (SmolLM2) and 262,144 (Gemma 3), random normal float32 logits.

Run: python -m pytest bench/bench_sampling.py -p no:cacheprovider --benchmark-only
Targets (one row): greedy <= 25 us; temperature 0.8 + top-k 40 + top-p 0.95 <= 80 us.
The 32-row cases time one call; extra_info["us_per_row"] is the median per row.
"""
import numpy as np
import pytest

from fastserve._sampling import Sampler

N_ROWS = 32

CASES = {
    "greedy": dict(temperature=0.0),
    "t0.8-k40-p0.95": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.0),
    "default-chain": dict(),   # t0.8, k40, p0.95, min_p 0.05
    "k0-p0.95": dict(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0),
    "k0-p0.95-minp0.05": dict(temperature=0.8, top_k=0, top_p=0.95, min_p=0.05),
    "k40-penalties-nprobs5": dict(repeat_penalty=1.1, presence_penalty=0.3, repeat_last_n=64, n_probs=5),
}


@pytest.fixture(scope="module", params=[49152, 262144], ids=["v49k", "v262k"])
def logits(request):
    return np.random.default_rng(0).standard_normal((N_ROWS, request.param)).astype(np.float32)


def setup(n_rows, cfg, n_vocab):
    s = Sampler(N_ROWS, n_vocab)
    hist = np.random.default_rng(1).integers(0, n_vocab, 64)
    for k in range(N_ROWS):
        s.configure(k, seed=k, history=hist, **cfg)
    slots = np.arange(n_rows, dtype=np.int32)
    out = np.zeros(n_rows, np.int32)
    n_probs = max(cfg.get("n_probs", 0), 1)
    return s, slots, out, np.zeros((n_rows, n_probs), np.int32), np.zeros((n_rows, n_probs), np.float32)


@pytest.mark.parametrize("case", list(CASES))
def test_one_row(benchmark, logits, case):
    s, slots, out, pids, pp = setup(1, CASES[case], logits.shape[1])
    row = logits[:1]
    benchmark(s.sample, row, slots, out, pids, pp)


@pytest.mark.parametrize("case", ["greedy", "t0.8-k40-p0.95", "k0-p0.95"])
def test_32_rows(benchmark, logits, case):
    s, slots, out, pids, pp = setup(N_ROWS, CASES[case], logits.shape[1])
    benchmark(s.sample, logits, slots, out, pids, pp)
    benchmark.extra_info["us_per_row"] = benchmark.stats.stats.median * 1e6 / N_ROWS


def test_greedy_rows_one_row(benchmark, logits):
    s = Sampler(1, logits.shape[1])
    out = np.zeros(1, np.int32)
    benchmark(s.greedy_rows, logits[:1], out)


def test_greedy_rows_32_rows(benchmark, logits):
    s = Sampler(1, logits.shape[1])
    out = np.zeros(N_ROWS, np.int32)
    benchmark(s.greedy_rows, logits, out)
    benchmark.extra_info["us_per_row"] = benchmark.stats.stats.median * 1e6 / N_ROWS
