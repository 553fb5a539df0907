"""A long prompt arriving among running streams (issue 19 item 3): the other streams' inter-token gap
while it is computed, and how long it takes, for three prefill-chunk rules on the default model.

In-process Engine, --clients slots: clients - 1 streams decode (short prompts, end-of-generation
tokens banned so that they keep going), then a prompt of --prompt tokens arrives (max_tokens 1, no
prompt reuse). Each rule in turn, --rounds times (the whole-batch rule once), on the same streams:
  adaptive  the engine's rule: the chunk keeps a step near scheduler.STEP_TARGET_S (this tree);
  fixed-32  the previous rule: prefill_chunk (32) tokens a step beside decode rows;
  whole     the whole batch (n_batch) a step, as llama.cpp computes a prompt.
Reported per run: the long prompt's seconds to its token, the engine steps it took (mean prompt
tokens a step), the streams' largest and median gap between tokens while it ran. Noisy machines:
compare rules within one run only.

Run: python bench/bench_chunked_prefill.py [--clients 32] [--prompt 4000] [--threads N] [--rounds 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import fastserve  # noqa: E402
from fastserve import scheduler  # noqa: E402
from fastserve.config import EngineConfig  # noqa: E402

RULES = {"adaptive": scheduler.STEP_TARGET_S, "fixed-32": 0.0, "whole": 1e9}   # step_target_s for each


def prompt_ids(tokenizer, n: int, offset: int = 0) -> list:
    """n token ids of this repository's sources, from token `offset` on."""
    text = "\n".join(p.read_text(errors="replace") for p in sorted((REPO / "fastserve").rglob("*.py")))
    ids = tokenizer.encode(text, add_special=False)
    while len(ids) < n + offset:
        ids = ids + ids
    return ids[offset:offset + n]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=0, help="0: every core")
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    model = fastserve.load_model(fastserve.default_model_path())
    tok = model.tokenizer
    n_ctx_slot = (a.prompt + 64 + 63) // 64 * 64 + 512
    no_eog = {int(t): -100.0 for t in tok.eog_ids}
    with fastserve.Engine(model, n_parallel=a.clients, n_ctx=a.clients * n_ctx_slot, n_batch=512,
                          threads=a.threads or None) as engine:
        print(f"{a.clients} slots x {n_ctx_slot} tokens, {engine.describe().threads} threads, n_batch 512, "
              f"prefill_chunk {EngineConfig.prefill_chunk}, STEP_TARGET_S {scheduler.STEP_TARGET_S}",
              flush=True)
        arrivals: list[list[float]] = [[] for _ in range(a.clients - 1)]
        streams = [engine.submit(prompt_ids(tok, 60 + i, 997 * i), max_tokens=n_ctx_slot - 200, temperature=0,
                                 logit_bias=no_eog) for i in range(a.clients - 1)]

        def read(i, r):
            for _ in r.reader.batches():
                arrivals[i].append(time.perf_counter())

        readers = [threading.Thread(target=read, args=(i, r), daemon=True) for i, r in enumerate(streams)]
        for t in readers:
            t.start()
        while min(len(x) for x in arrivals) < 5:
            time.sleep(0.05)
        long_ids = prompt_ids(tok, a.prompt)
        rows = []
        order = [r for k in range(a.rounds) for r in a.rules.split(",") if r != "whole" or k == 0]
        for rule in order:
            engine._step_target_s = RULES[rule]      # the rule under test, set inside the engine
            time.sleep(1.0)
            step0, t0 = engine.snapshot.step, time.perf_counter()
            engine.generate(long_ids, max_tokens=1, temperature=0, cache_prompt=False)
            t1, steps = time.perf_counter(), engine.snapshot.step - step0
            gaps = []
            for x in arrivals:
                inside = [t for t in x if t0 <= t <= t1]
                before = [t for t in x if t < t0]
                seq = before[-1:] + inside + [t for t in x if t > t1][:1]
                gaps += [b - c for c, b in zip(seq, seq[1:])]
            rows.append((rule, t1 - t0, steps, max(gaps), statistics.median(gaps)))
            print(f"  {rule:9s} prompt {a.prompt} tokens in {t1 - t0:6.2f} s, {steps} steps "
                  f"({a.prompt / max(steps, 1):.0f} tokens a step); other streams' gap max "
                  f"{max(gaps) * 1e3:7.0f} ms, median {statistics.median(gaps) * 1e3:6.0f} ms ({len(gaps)} gaps)",
                  flush=True)
        for r in streams:
            r.cancel()
    print(f"\n| rule | {a.prompt}-token prompt, s | steps | other streams' gap max, ms | median, ms |")
    print("| --- | --- | --- | --- | --- |")
    for rule, s, steps, gmax, gmed in rows:
        print(f"| {rule} | {s:.2f} | {steps} | {gmax * 1e3:.0f} | {gmed * 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
