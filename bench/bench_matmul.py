"""The int8 matrix product (fastserve._matmul) against float32 OpenBLAS, on the default model.

Run: python bench/bench_matmul.py [--model PATH] [--rounds 5] [--busy]
     pytest bench/bench_matmul.py --benchmark-only -p no:cacheprovider -s

Prints (1) each weight matrix's product at n = 1, 8, 32 rows for every kernel this machine runs
(GB/s of weights streamed, GMAC/s), and (2) a decode step of the whole model (NumpyBackend.forward,
32 slots holding 64 tokens each) at batch 1, 8 and 32 for f32 (OpenBLAS 1 and 2 threads) and q8 (1
and 2 threads). The configurations take turns within each round, so the ratios compare runs made
under the same load; a shared machine still moves every figure, so read medians over rounds.
--busy adds a process that keeps one core busy (a stand-in for the event loop and other programs)
and measures everything again beside it.
Targets (issue): step <= ~60 ms at batch 8 and <= ~240 ms at batch 32.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np
import pytest

BATCHES = (1, 8, 32)
CONFIGS = (("f32", 1), ("f32", 2), ("q8", 1), ("q8", 2))   # (weight_type, threads)
N_CTX_FILLED = 64
# Idle time before each configuration: OpenBLAS's worker threads spin for about 0.1 s after a call,
# and would steal the next configuration's core.
SETTLE_S = 0.3


def default_model_path() -> str:
    return os.environ.get("FASTSERVE_MODEL") or os.path.expanduser("~/.cache/fastserve/SmolLM2-135M-Instruct.Q4_1.gguf")


def matrix_table(model, reps: int = 5) -> list[str]:
    """Per matrix and n: microseconds and throughput of every q8 kernel and of OpenBLAS (1 thread)."""
    from threadpoolctl import threadpool_limits

    from fastserve import _matmul
    from fastserve.backends.numpy_backend import matmul as f32_matmul, q8_matrices

    layers, output = q8_matrices(model.weights)
    lw = model.weights.layers[0]
    mats = [("wqkv", layers[0][0], lw.wqkv), ("wo", layers[0][1], lw.wo), ("w_gate_up", layers[0][2], lw.w_gate_up),
            ("w_down", layers[0][3], lw.w_down), ("output", output, model.weights.output)]
    rng = np.random.default_rng(0)
    lines = [f"{'matrix':10s} {'n':>3s} " + " ".join(f"{k:>26s}" for k in (*_matmul.isas(), "f32 openblas"))]
    for name, q, f in mats:
        for n in BATCHES:
            x = rng.standard_normal((n, q.n_in)).astype(np.float32)
            y = np.empty((n, q.n_out), np.float32)
            cells = []
            for isa in _matmul.isas():
                mm = _matmul.Matmul(1, isa)
                t = _best(lambda: mm(x, q, y), reps)
                cells.append(f"{t * 1e6:9.0f} us {q.nbytes / t / 1e9:5.1f} GB/s")
            with threadpool_limits(1):
                xp = np.zeros((max(n, 4), q.n_in), np.float32)      # the f32 path's min_rows padding
                t = _best(lambda: f32_matmul(xp, f), reps)
            cells.append(f"{t * 1e6:9.0f} us {f.nbytes / t / 1e9:5.1f} GB/s")
            lines.append(f"{name:10s} {n:3d} " + " ".join(f"{c:>26s}" for c in cells))
    return lines


def _best(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def make_backend(model, weight_type: str, threads: int):
    from fastserve.backends.numpy_backend import NumpyBackend

    cfg = model.config
    be = NumpyBackend(cfg, model.weights, 32, 256, weight_type=weight_type, threads=threads if weight_type == "q8" else 1)
    rng = np.random.default_rng(0)
    for s in range(32):
        toks = rng.integers(0, cfg.n_vocab, N_CTX_FILLED).astype(np.int32)
        be.forward(toks, np.arange(N_CTX_FILLED), np.full(N_CTX_FILLED, s), np.arange(0))
    return be


def step_times(model, rounds: int, steps: int = 4) -> dict:
    """{(batch, config): [seconds per step, ...]}, the configurations taking turns in each round."""
    from threadpoolctl import threadpool_limits

    backends = {c: make_backend(model, *c) for c in CONFIGS}
    out: dict = {}
    for _ in range(rounds):
        for n in BATCHES:
            toks, slots = np.full(n, 100, np.int32), np.arange(n)
            for c in CONFIGS:
                be = backends[c]
                time.sleep(SETTLE_S)
                with threadpool_limits(c[1] if c[0] == "f32" else 1):
                    be.forward(toks, np.full(n, N_CTX_FILLED), slots, slots)       # warm
                    for i in range(steps):
                        pos = np.full(n, N_CTX_FILLED + i)
                        t0 = time.perf_counter()
                        be.forward(toks, pos, slots, slots)
                        out.setdefault((n, c), []).append(time.perf_counter() - t0)
    return out


def step_table(times: dict) -> list[str]:
    def name(c):
        return f"{c[0]} {c[1]}t"

    lines = ["batch " + " ".join(f"{name(c):>16s}" for c in CONFIGS) + "   q8 1t / f32 1t   q8 2t / q8 1t",
             "      " + " ".join(f"{'median (min) ms':>16s}" for _ in CONFIGS)]
    for n in BATCHES:
        med = {c: 1e3 * float(np.median(times[(n, c)])) for c in CONFIGS}
        cells = [f"{med[c]:7.1f} ({1e3 * min(times[(n, c)]):5.1f})" for c in CONFIGS]
        # ratios of medians of paired samples (taken in the same round)
        r1 = np.median(np.array(times[(n, ("q8", 1))]) / np.array(times[(n, ("f32", 1))]))
        r2 = np.median(np.array(times[(n, ("q8", 2))]) / np.array(times[(n, ("q8", 1))]))
        lines.append(f"{n:5d} " + " ".join(f"{c:>16s}" for c in cells) + f"   {r1:14.3f}   {r2:13.3f}")
    return lines


class BusyCore:
    """A child process spinning on the CPU for the duration of a with-block."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=default_model_path())
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--busy", action="store_true", help="also measure beside a process that keeps a core busy")
    ap.add_argument("--no-matrices", action="store_true", help="skip the per-matrix table")
    args = ap.parse_args(argv)
    import fastserve
    from fastserve import _matmul

    model = fastserve.load_model(args.model)
    print(f"model {model.name}; q8 kernels here: {', '.join(_matmul.isas())} (auto: {_matmul.best_isa()}); "
          f"{os.cpu_count()} CPUs")
    if not args.no_matrices:
        print("\n".join(matrix_table(model)))
    print(f"\ndecode step, 32 slots x {N_CTX_FILLED} tokens of context, {args.rounds} rounds")
    print("\n".join(step_table(step_times(model, args.rounds))))
    if args.busy:
        print("\nthe same beside a process that keeps one core busy")
        with BusyCore():
            print("\n".join(step_table(step_times(model, args.rounds))))
    return 0


# -- pytest-benchmark ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_model():
    path = default_model_path()
    if not os.path.isfile(path):
        pytest.skip(f"default model not found at {path}")
    import fastserve
    return fastserve.load_model(path)


@pytest.mark.parametrize("n", BATCHES)
def test_q8_decode_step(benchmark, default_model, n):
    be = make_backend(default_model, "q8", 1)
    toks, slots = np.full(n, 100, np.int32), np.arange(n)
    benchmark(be.forward, toks, np.full(n, N_CTX_FILLED), slots, slots)
    benchmark.extra_info["ms_per_step"] = benchmark.stats.stats.median * 1e3


if __name__ == "__main__":
    sys.exit(main())
