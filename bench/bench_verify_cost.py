"""What a speculative verification costs: one slot's forward pass of n rows (its decode row and n - 1 drafts) after
a long context, against n = 1, split into the C forward's phases (issue 26: the code edit's verifications of
1 + k rows over a ~3,100-token prompt).

A slot is filled with --context random tokens (the prompt's chunks), then each n takes --reps passes of the
rows that follow it (the same positions every pass: the KV they store is overwritten), the best pass reported
with its phases (Forward.profile's clocks: layer products, attention, element-wise ops and KV stores, output
product). The last columns are what speculation weighs (fastserve/speculation.py's step cost a + b n): the
pass over n = 1's, and the cost of each row beyond the first. With every draft accepted a pass of n rows
yields n tokens, so (ms at n) / n is the cost of a drafted token beside the plain step's ms at 1.
--staged: the products of n <= 4 rows through the staging kernels too (the fused kernels off), to see the
step the dispatch takes at n = 5.

Run: python bench/bench_verify_cost.py [-m PATH] [--threads 2] [--context 3100] [--rows 1,2,3,4,5,8,17,33,65]
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def fill(be, n_vocab: int, context: int, chunk: int = 512) -> np.ndarray:
    """Slot 0 holds `context` random tokens; returns them and the tokens after them."""
    toks = np.random.default_rng(0).integers(0, n_vocab, context + 1024).astype(np.int32)
    for c0 in range(0, context, chunk):
        c1 = min(context, c0 + chunk)
        be.forward(toks[c0:c1], np.arange(c0, c1), np.zeros(c1 - c0, np.int64), np.arange(0))
    return toks


def measure(be, toks, context: int, n: int, reps: int) -> tuple[float, dict]:
    """Best seconds of a pass of n rows at positions context .. context + n - 1, and its phase seconds (mean)."""
    args = (toks[context:context + n], np.arange(context, context + n), np.zeros(n, np.int64), np.arange(n))
    be.forward(*args)
    be._forward.phase_seconds(reset=True)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        be.forward(*args)
        times.append(time.perf_counter() - t0)
    return min(times), {k: v / reps for k, v in be._forward.phase_seconds(reset=True).items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", help="GGUF (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=3100)
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,9,17,33,65")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--staged", action="store_true", help="products through the staging kernels at every n")
    args = ap.parse_args(argv)
    from fastserve.backends.cpu.backend import CpuBackend
    from fastserve.models.default_model import default_model_path
    from fastserve.models.model import load_model
    model = load_model(args.model or default_model_path())
    rows = [int(x) for x in args.rows.split(",")]
    be = CpuBackend(model.config, model.weights, 1, args.context + max(rows) + 1, threads=args.threads,
                    max_tokens=max(512, max(rows)))
    toks = fill(be, model.config.n_vocab, args.context)
    be._forward.profile, be._mm.fused = True, not args.staged
    print(f"{args.threads} thread(s), {args.context} tokens of context, isa {be.isa}"
          f"{', products staged' if args.staged else ''}; ms per pass (best of {args.reps}), phases (mean):")
    print("| rows | ms | layer products | attention | output product | element-wise | x n = 1 | ms / extra row |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    base = None
    for n in rows:
        s, phases = measure(be, toks, args.context, n, args.reps)
        base = base if base is not None else s
        extra = f"{(s - base) / (n - 1) * 1e3:.2f}" if n > 1 else ""
        cells = [phases.get(k, 0.0) * 1e3 for k in ("layer products", "attention", "output product",
                                                   "element-wise ops and KV stores")]
        print(f"| {n} | {s * 1e3:.1f} | " + " | ".join(f"{c:.1f}" for c in cells) + f" | {s / base:.2f} | {extra} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
