"""Prompt cache figures on the default model: time to first token of a 400-token prompt cold,
with a warm slot prefix, and restored from the host-RAM cache; copy and restore cost per MiB.

    PYTHONPATH=. python bench/bench_prompt_cache.py [--rounds 3] [--tokens 400]
    PYTHONPATH=. python -m pytest bench/bench_prompt_cache.py --benchmark-only

One slot (so every new prompt reuses it), greedy, max_tokens 1: the time to first token is the
prompt's fill plus one step. Prompts are random token ids, each round a fresh pair.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import fastserve
from fastserve.backends.cpu.backend import CpuBackend
from fastserve.prompt_cache import MIB, PromptCache


def ttft(engine, prompt, **kw):
    c = engine.generate(prompt, max_tokens=1, temperature=0, **kw)
    return c.timings["first_token_ms"], c.timings["cache_n"]


def measure(model, n_tokens: int = 400, rounds: int = 3, threads: int = 1) -> dict:
    rng = np.random.default_rng(400)
    n_vocab = model.config.n_vocab
    cold, warm, restored, cache_n = [], [], [], {}
    with fastserve.Engine(model, n_parallel=1, n_ctx=1024, cache_ram_mib=256, threads=threads) as e:
        ttft(e, rng.integers(100, n_vocab, 8).tolist())                 # warm-up: BLAS, first allocations
        for _ in range(rounds):
            a, b = (rng.integers(100, n_vocab, n_tokens).tolist() for _ in range(2))
            t, cache_n["cold"] = ttft(e, a)                             # nothing of a anywhere
            cold.append(t)
            t, cache_n["warm slot"] = ttft(e, a)                        # the slot holds a
            warm.append(t)
            ttft(e, b)                                                  # a's prefix goes to host RAM
            t, cache_n["restored"] = ttft(e, a)                         # ... and comes back
            restored.append(t)
        stats = e.stats().prompt_cache
    # The copies alone, on a backend as the engine's: save and restore n_tokens of slot 0, 10 times each.
    be = CpuBackend(model.config, model.weights, 1, 1024, threads=threads)
    pc = PromptCache(be, 64 * MIB)
    ids = np.arange(n_tokens, dtype=np.int32)
    mib = n_tokens * be.kv_bytes_per_token() / MIB
    save_ms, restore_ms = [], []
    for _ in range(10):
        pc.clear()
        t0 = time.perf_counter()
        pc.save(0, ids)
        save_ms.append((time.perf_counter() - t0) * 1e3)
        entry = pc.lookup(ids)[0]
        t0 = time.perf_counter()
        pc.restore(entry, 0, 0, n_tokens)
        restore_ms.append((time.perf_counter() - t0) * 1e3)
    med = statistics.median
    return {"tokens": n_tokens, "kv_mib": mib, "cache_n": cache_n,
            "ttft_ms": {"cold": med(cold), "warm slot": med(warm), "restored": med(restored)},
            "ttft_all_ms": {"cold": cold, "warm slot": warm, "restored": restored},
            "save_ms_per_mib": med(save_ms) / mib, "restore_ms_per_mib": med(restore_ms) / mib,
            "save_ms": med(save_ms), "restore_ms": med(restore_ms), "cache_stats": stats}


def report(r: dict) -> str:
    lines = [f"{r['tokens']}-token prompt, KV {r['kv_mib']:.1f} MiB",
             f"{'':12} {'TTFT ms':>9} {'cache_n':>8}"]
    for k, v in r["ttft_ms"].items():
        lines.append(f"{k:12} {v:9.1f} {r['cache_n'][k]:8d}")
    lines.append(f"save    {r['save_ms']:.2f} ms = {r['save_ms_per_mib']:.3f} ms/MiB")
    lines.append(f"restore {r['restore_ms']:.2f} ms = {r['restore_ms_per_mib']:.3f} ms/MiB")
    return "\n".join(lines)


def test_prompt_cache_figures(benchmark):
    model = fastserve.load_model(fastserve.default_model_path())
    r = benchmark.pedantic(measure, args=(model,), kwargs={"rounds": 1}, rounds=1, iterations=1)
    benchmark.extra_info.update({k: r[k] for k in ("ttft_ms", "cache_n", "save_ms_per_mib", "restore_ms_per_mib")})
    assert r["cache_n"] == {"cold": 0, "warm slot": r["tokens"] - 1, "restored": r["tokens"] - 1}
    assert r["ttft_ms"]["restored"] < r["ttft_ms"]["cold"] / 2


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    t0 = time.perf_counter()
    m = fastserve.load_model(fastserve.default_model_path())
    print(f"model loaded in {time.perf_counter() - t0:.1f} s")
    print(report(measure(m, args.tokens, args.rounds, args.threads)))
