"""Gemma 3 270M's KV memory with the local layers in rings (backends/cpu/kv_cache.py) against every layer
keeping every position (what fastserve did before): KV bytes and process RSS of an engine at
`-np 1 -c 32768`, each in its own process, and decode tokens/s of both side by side in one process
(a prompt of --prompt tokens, then --rounds x --gen decode steps of the two backends alternating, their
logits compared bit for bit).

    PYTHONPATH=. python bench/bench_swa_ring.py [--ctx 32768] [--prompt 1100] [--gen 32] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

import fastserve
from fastserve.backends.cpu import kv_cache, backend as cpu_backend
from fastserve.models.catalog import model_path
from fastserve.resources import rss_bytes

MIB = 1 << 20


class _EveryPosition(kv_cache.KVCache):
    """The cache without rings: every layer n_ctx_slot positions per slot (fastserve before rings)."""

    def __init__(self, *args, **kw):
        kw["window"] = 0
        super().__init__(*args, **kw)


def engine(model, ctx: int, ring: bool, threads: int):
    cpu_backend.KVCache = kv_cache.KVCache if ring else _EveryPosition
    try:
        return fastserve.Engine(model, n_parallel=1, n_ctx=ctx, threads=threads)
    finally:
        cpu_backend.KVCache = kv_cache.KVCache


def memory(ctx: int, ring: bool) -> dict:
    """In a fresh process: RSS after loading the model, then after starting the engine."""
    model = fastserve.load_model(model_path("gemma3-270m"))
    before = rss_bytes()
    e = engine(model, ctx, ring, 1)
    after = rss_bytes()
    info = e.describe()
    out = {"ring": info.ring, "kv_mib": info.kv_bytes / MIB,
           "rss_model_mib": before / MIB, "rss_engine_mib": after / MIB}
    e.close()
    return out


def speed(ctx: int, n_prompt: int, n_gen: int, rounds: int, threads: int) -> dict:
    """Both backends side by side: a prompt of n_prompt tokens in steps of 512 (a ring wraps past 1024),
    then rounds x n_gen decode steps, each timed, the two alternating step by step; their logits compared."""
    model = fastserve.load_model(model_path("gemma3-270m"))
    cfg, w = model.config, model.weights
    backends = {}
    for name, ring in (("every position", False), ("ring", True)):
        cpu_backend.KVCache = kv_cache.KVCache if ring else _EveryPosition
        try:
            backends[name] = cpu_backend.CpuBackend(cfg, w, 1, ctx, threads=threads, max_tokens=512)
        finally:
            cpu_backend.KVCache = kv_cache.KVCache
    rng = np.random.default_rng(7)
    tokens = rng.integers(1000, cfg.n_vocab, n_prompt + rounds * n_gen).astype(np.int32)
    zero = np.zeros(512, np.int32)
    last = {}
    for name, be in backends.items():
        for i in range(0, n_prompt, 512):
            n = min(512, n_prompt - i)
            last[name] = be.forward(tokens[i:i + n], np.arange(i, i + n, dtype=np.int32), zero[:n], [n - 1])
    same = bool(np.array_equal(last["ring"], last["every position"]))
    seconds = {k: [] for k in backends}
    for p in range(n_prompt, n_prompt + rounds * n_gen):
        for name, be in list(backends.items())[::1 if p % 2 else -1]:       # each goes first every other step
            t = time.perf_counter()
            last[name] = be.forward(tokens[p:p + 1], np.array([p], np.int32), zero[:1], [0])
            seconds[name].append(time.perf_counter() - t)
        same = same and bool(np.array_equal(last["ring"], last["every position"]))
    per_round = {k: [round(n_gen / sum(v[r * n_gen:(r + 1) * n_gen]), 1) for r in range(rounds)]
                 for k, v in seconds.items()}
    return {"decode_tok_s": per_round, "median_ratio_ring_over_every": round(float(np.median(
        np.array(seconds["every position"]) / np.array(seconds["ring"]))), 3), "same_logit_bits": same}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--prompt", type=int, default=1100)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--memory", choices=("ring", "every"), help=argparse.SUPPRESS)   # the child's part
    a = ap.parse_args()
    if a.memory:
        print(json.dumps(memory(a.ctx, a.memory == "ring")))
        return
    for kind in ("every", "ring"):
        run = subprocess.run([sys.executable, __file__, "--ctx", str(a.ctx), "--memory", kind],
                             capture_output=True, text=True, check=True)
        print(f"-np 1 -c {a.ctx}, {kind:5s}: {run.stdout.strip()}")
    t = time.perf_counter()
    print(json.dumps(speed(a.ctx, a.prompt, a.gen, a.rounds, a.threads)), f"({time.perf_counter() - t:.0f} s)")


if __name__ == "__main__":
    main()
