"""Decode-step attention at long context (issue 19), side by side with another tree's build.

The default model's shapes (30 layers, 9 query heads, 3 KV heads, head_dim 64; --kv f16 by default), a
cache of random keys and values per layer: one decode row at each --positions, all layers' attention
calls, on 1 and 2 threads; then a speculative verification block (issue 26: --verify-rows rows of one slot
at --verify-at and after, its decode row and drafts); then a --prefill-token prompt in chunks of 512
through attention. This
tree's fastserve.backends.cpu._attention and, with --before TREE, that tree's built extension loaded beside it take
turns, round by round (noisy shared machines: only ratios from one run mean anything). Reported: the
minimum and the 10th percentile over --rounds, and the KV bytes read per second at the minimum. On one
thread the clock is the thread's CPU time (other processes' turns on the core do not count); on two,
wall time.

Run: python bench/bench_attention.py --before /work/main [--rounds 100] [--positions 100,1000,2000,4000]
        [--verify-rows 17,33,49 --verify-at 3100]
"""
from __future__ import annotations

import argparse
import glob
import importlib.machinery
import importlib.util
import os
import time

import numpy as np

import fastserve.backends.cpu._attention as this_tree
from fastserve.backends.cpu._pool import Pool

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
CHUNK = 512


def load_tree(tree: str):
    """Another tree's built fastserve.backends.cpu._attention, loaded beside this one (its own copy of the module)."""
    paths = (glob.glob(os.path.join(tree, "fastserve", "backends", "cpu", "_attention.*.so"))
             or glob.glob(os.path.join(tree, "fastserve", "_attention.*.so")))       # a tree from before the move
    if not paths:
        raise SystemExit(f"{tree}: no built fastserve/backends/cpu/_attention.*.so (build it in place first)")
    loader = importlib.machinery.ExtensionFileLoader("fastserve.backends.cpu._attention", paths[0])
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("fastserve.backends.cpu._attention", loader))
    loader.exec_module(module)
    return module


def caches(kv: str, n_ctx: int, rng) -> list:
    """Per layer (k_cache, v_cache) with every position written."""
    out = []
    for _ in range(LAYERS):
        kc = np.zeros((1, -(-n_ctx // this_tree.KT), KV_HEADS, this_tree.k_tile_bytes(kv, HEAD_DIM)), np.uint8)
        vc = np.zeros((1, n_ctx, KV_HEADS, this_tree.row_bytes(kv, HEAD_DIM)), np.uint8)
        x = rng.standard_normal((n_ctx, KV_HEADS, HEAD_DIM)).astype(np.float32)
        this_tree.store(kv, kv, kc, vc, x, x * 0.5, np.zeros(n_ctx, np.int64), np.arange(n_ctx, dtype=np.int64))
        out.append((kc, vc))
    return out


def timed(systems: dict, rounds: int, clock, run) -> dict:
    """{name: (min s, 10th percentile s)} of run(attention) over rounds, the systems taking turns."""
    samples = {name: [] for name in systems}
    for _ in range(rounds):
        for name, attn in systems.items():
            t0 = clock()
            run(attn)
            samples[name].append(clock() - t0)
    return {name: (min(s), sorted(s)[len(s) // 10]) for name, s in samples.items()}


def line(label: str, res: dict, nbytes: float | None) -> str:
    parts = [f"{name} {a * 1e3:.2f} ms (p10 {b * 1e3:.2f})" + (f" {nbytes / a / 1e9:.1f} GB/s" if nbytes else "")
             for name, (a, b) in res.items()]
    if "before" in res:
        parts.append(f"this/before {res['before'][0] / res['this'][0]:.2f}x")
    return f"{label}: " + "  ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="another fastserve tree, built in place")
    ap.add_argument("--kv", default="f16", choices=tuple(this_tree.KV_TYPES))
    ap.add_argument("--positions", default="100,1000,2000,4000")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--verify-rows", default="17,33", help="rows of a verification block; empty: skip it")
    ap.add_argument("--verify-at", type=int, default=3100, help="the block's first position")
    ap.add_argument("--prefill-tokens", type=int, default=2048, help="0: skip the prefill part")
    args = ap.parse_args()
    modules = {"this": this_tree, **({"before": load_tree(args.before)} if args.before else {})}
    positions = [int(p) for p in args.positions.split(",") if p]
    verify = [int(n) for n in args.verify_rows.split(",") if n]
    rng = np.random.default_rng(0)
    kv = caches(args.kv, max(positions + [args.prefill_tokens, args.verify_at + max(verify, default=0)]) + 1, rng)
    row_bytes = this_tree.row_bytes(args.kv, HEAD_DIM)
    out = np.zeros((CHUNK, HEADS * HEAD_DIM), np.float32)
    q = rng.standard_normal((max(args.prefill_tokens, 1, *verify), HEADS, HEAD_DIM)).astype(np.float32)
    slots = np.zeros(CHUNK, np.int64)
    for threads in (1, 2):
        pool = Pool(threads) if threads > 1 else None
        systems = {name: m.Attention(pool) for name, m in modules.items()}
        clock = time.thread_time if threads == 1 else time.perf_counter
        for p in positions:
            pos = np.array([p], np.int64)

            def decode(attn):
                for kc, vc in kv:
                    attn(q[:1], kc, vc, args.kv, args.kv, slots[:1], pos, out, 0.125)

            nbytes = (p + 1) * LAYERS * KV_HEADS * row_bytes * 2
            print(line(f"decode row at {p}, {threads} thread(s)", timed(systems, args.rounds, clock, decode), nbytes),
                  flush=True)
        for n in verify:
            pos = np.arange(args.verify_at, args.verify_at + n, dtype=np.int64)

            def block(attn):
                for kc, vc in kv:
                    attn(q[:n], kc, vc, args.kv, args.kv, slots[:n], pos, out, 0.125)

            print(line(f"verification block of {n} rows at {args.verify_at}, {threads} thread(s)",
                       timed(systems, max(2, args.rounds // 10), clock, block), None), flush=True)
        if args.prefill_tokens:
            def prefill(attn):
                for c in range(0, args.prefill_tokens, CHUNK):
                    n = min(CHUNK, args.prefill_tokens - c)
                    pos = np.arange(c, c + n, dtype=np.int64)
                    for kc, vc in kv:
                        attn(q[c:c + n], kc, vc, args.kv, args.kv, slots[:n], pos, out, 0.125)

            print(line(f"prefill of {args.prefill_tokens} tokens, {threads} thread(s)",
                       timed(systems, max(2, args.rounds // 50), clock, prefill), None), flush=True)
        if pool is not None:
            pool.close()


if __name__ == "__main__":
    main()
