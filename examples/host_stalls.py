"""Where a decode step's time goes under load: the tracer's phase table, for people who hunt host stalls.

    python examples/host_stalls.py [--model PATH] [--clients 4] [--seconds 10]

A closed loop: each client sends its next request as soon as its last one ends, so the engine always has
`clients` requests running. The tracer (Engine(trace=True)) times each phase of every step: admit (inbox,
slots), build (batch), forward (the backend), sync (waiting for the device), sample, publish (delivery,
wake-up, snapshot). Host work is everything but forward and sync; on a GPU that is where stalls hide.
`fastserve bench` runs the same kind of load at several levels.
"""
import argparse
import threading
import time

import fastserve
from fastserve.tracer import format_summary

PROMPTS = ["The history of computing is a story of", "In the small village at the edge of the forest,",
           "Explain to a ten year old why the sky is blue.", "Write a short poem about the ocean at night.",
           "A good cup of coffee depends on", "Once upon a time there was a clockmaker who"]

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--model", help="a llama GGUF file (default: the default model)")
p.add_argument("--clients", type=int, default=4)
p.add_argument("--seconds", type=float, default=10.0)
p.add_argument("--max-tokens", type=int, default=64)
args = p.parse_args()

model = fastserve.load_model(args.model or fastserve.default_model_path())
tokens = [0] * args.clients                       # per client, so the threads share nothing


def client(k: int, until: float) -> None:
    i = k
    while time.perf_counter() < until:
        out = engine.generate(PROMPTS[i % len(PROMPTS)], max_tokens=args.max_tokens, temperature=0,
                              cache_prompt=False)   # every prompt computed again: steady prefill load
        tokens[k] += len(out.token_ids)
        i += args.clients


def run(seconds: float) -> float:
    """The closed loop for `seconds`; returns the measured wall time."""
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k, t0 + seconds)) for k in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


with fastserve.Engine(model, n_parallel=args.clients, n_ctx=512 * args.clients, trace=True) as engine:
    run(min(2.0, args.seconds / 4))               # warm-up: caches, page faults, thread pools
    since = engine.trace_totals()
    tokens[:] = [0] * args.clients
    wall = run(args.seconds)
    print(f"{args.clients} clients, {wall:.1f} s: {sum(tokens) / wall:.1f} tokens/s\n")
    print(format_summary(engine.trace_summary(since)))
