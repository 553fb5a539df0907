"""What a constraint costs, on the default model (vocab 49,152):

1. per token: llguidance's mask computation (matcher.compute into the sampler's bit array) and the
   matcher's commit, along a real JSON output; the sampler's mask application (one constrained row
   against the same row unconstrained, default chain);
2. the decode step of 32 slots of which 8 are constrained against 32 unconstrained, in one engine,
   alternated A B A B so that the machine's noise falls on both (issue 15: at most 10 % slower);
   the ratio of the medians and of the minima (the least disturbed runs) of the rounds, and the
   tracer's sample phase (where the decode thread waits for the mask worker and applies the masks).

Run: python bench/bench_grammar.py [--steps 20] [--rounds 6]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import fastserve
from fastserve._sampling import Sampler
from fastserve.grammar import Constraint, compile_grammar, mask_words

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                 "pattern": "^[0-9]{5}$"}},
                "required": ["city"]}}, "required": ["name", "age"]}
TEXT = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["red", "blue"],
                   "address": {"city": "London", "zip": "12345"}}, indent=2)
# a grammar that never ends, so a constrained slot decodes as long as an unconstrained one
LOOP = r'root ::= ("- " [a-z ]{1,30} "\n")+'


def per_token(model, reps: int = 5) -> dict:
    tok = model.tokenizer
    ids = tok.encode(TEXT, add_special=False)
    grammar = compile_grammar(json_schema=SCHEMA)
    words = np.zeros(mask_words(tok.n_vocab), np.uint32)
    fill, commit = [], []
    for _ in range(reps):
        c = Constraint(tok, grammar)
        for t in ids:
            t0 = time.perf_counter_ns()
            c.fill_mask(words)
            t1 = time.perf_counter_ns()
            assert c.commit(t)
            t2 = time.perf_counter_ns()
            fill.append(t1 - t0)
            commit.append(t2 - t1)
    # application: the same logits, one row constrained (a mask of the run above), one not
    s = Sampler(2, tok.n_vocab)
    s.configure(0, seed=1, constrained=True)
    s.configure(1, seed=1)
    c = Constraint(tok, grammar)
    c.commit(ids[0])
    c.fill_mask(s.masks[0])
    logits = np.random.default_rng(0).standard_normal((1, tok.n_vocab)).astype(np.float32)
    out = np.zeros(1, np.int32)
    timing = {}
    for slot in (0, 1):
        rs = np.array([slot], np.int32)
        samples = []
        for _ in range(2000):
            t0 = time.perf_counter_ns()
            s.sample(logits, rs, out)
            samples.append(time.perf_counter_ns() - t0)
        timing[slot] = statistics.median(samples) / 1e3
    return {"tokens": len(ids), "mask_us_median": statistics.median(fill) / 1e3,
            "mask_us_p90": float(np.percentile(fill, 90)) / 1e3, "commit_us_median": statistics.median(commit) / 1e3,
            "sample_us_constrained": timing[0], "sample_us_unconstrained": timing[1]}


def step_ms(engine, n_constrained: int, steps: int) -> dict:
    """The tracer's summary over `steps` decode steps of 32 running requests, n_constrained of them
    constrained (its sample phase holds the wait for the mask worker and the masks' application)."""
    tok = engine.tokenizer
    ban = {t: float("-inf") for t in tok.eog_ids}
    n = engine.describe().n_slots
    readers = [engine.submit(f"Item {k}: a list of things.", max_tokens=steps + 40, temperature=0.8, seed=k,
                             logit_bias=ban, **({"grammar": LOOP} if k < n_constrained else {}))
               for k in range(n)]
    while not (engine.snapshot.n_running == n and all(st == 2 for st in engine.snapshot.slot_state)):
        time.sleep(0.01)                        # every slot decoding (2 = DECODE)
    since, s0 = engine.trace_totals(), engine.stats()
    start = engine.snapshot.step
    while engine.snapshot.step - start < steps:
        time.sleep(0.01)
    summary, s1 = engine.trace_summary(since), engine.stats()
    summary["mask_wait_ms"] = (s1.mask_wait_ns - s0.mask_wait_ns) / max(1, s1.mask_waits - s0.mask_waits) / 1e6
    for r in readers:
        r.cancel()
    while engine.snapshot.n_running:
        time.sleep(0.01)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="decode steps measured per run")
    ap.add_argument("--rounds", type=int, default=6, help="A/B rounds")
    args = ap.parse_args()
    model = fastserve.load_model(fastserve.default_model_path())
    pt = per_token(model)
    print(f"vocab {model.tokenizer.n_vocab}, JSON schema output of {pt['tokens']} tokens:")
    print(f"  mask computation  {pt['mask_us_median']:.1f} us/token median, {pt['mask_us_p90']:.1f} p90")
    print(f"  matcher commit    {pt['commit_us_median']:.1f} us/token median")
    print(f"  sample one row    {pt['sample_us_constrained']:.1f} us constrained, "
          f"{pt['sample_us_unconstrained']:.1f} us unconstrained (default chain)")
    with fastserve.Engine(model, n_parallel=32, n_ctx=32 * 256, trace=True) as engine:
        step_ms(engine, 0, 8)                   # warm-up
        a, b = [], []
        for _ in range(args.rounds):
            a.append(step_ms(engine, 0, args.steps))
            b.append(step_ms(engine, 8, args.steps))
    print(f"decode thread blocked on the mask worker: {statistics.median(r['mask_wait_ms'] for r in b):.3f} ms "
          f"per step (median of the rounds; the worker computes while the forward pass runs)")
    for name, runs in (("32 unconstrained", a), ("24 + 8 constrained", b)):
        steps = " ".join(f"{r['step_ms']:.1f}" for r in runs)
        samples = " ".join(f"{r['ms_per_step']['sample']:.2f}" for r in runs)
        print(f"{name:>20}: step {steps} ms; sample phase {samples} ms")
    sa, sb = [r["step_ms"] for r in a], [r["step_ms"] for r in b]
    pa = statistics.median(r["ms_per_step"]["sample"] for r in a)
    pb = statistics.median(r["ms_per_step"]["sample"] for r in b)
    print(f"ratio of medians {statistics.median(sb) / statistics.median(sa):.3f}, of minima {min(sb) / min(sa):.3f} "
          f"(bar: <= 1.10); sample phase +{pb - pa:.2f} ms/step = {(pb - pa) / statistics.median(sa):.1%} of a step")


if __name__ == "__main__":
    main()
