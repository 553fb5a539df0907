"""The matrix products on the GGUF file's blocks (fastserve._matmul), on the default model.

Run: python bench/bench_matmul.py [--model PATH] [--rounds 5] [--busy] [--old-so PATH]
     pytest bench/bench_matmul.py --benchmark-only -p no:cacheprovider -s

Prints (1) each weight matrix's product at n = 1, 8, 32 rows for every kernel this machine runs
(GB/s of file bytes streamed), beside the int8-copy kernels of an older build of fastserve._matmul
(--old-so: its .so; the matrix repacked from the same exact blocks) when given; (2) a decode step of
the whole model (NumpyBackend.forward, 32 slots holding 64 tokens each) at batch 1, 8 and 32 on 1 and
2 threads, with the machine's read bandwidth measured in the same run (a NumPy sum over 256 MB, on
1 and 2 threads) and the floor it sets for batch 1 (weight bytes / bandwidth). The configurations
take turns within each round, so the ratios compare runs made under the same load; a shared machine
still moves every figure, so read medians over rounds. --busy adds a process that keeps one core
busy and measures everything again beside it.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

BATCHES = (1, 8, 32)
CONFIGS = (1, 2)                    # threads
N_CTX_FILLED = 64
SETTLE_S = 0.1


def default_model_path() -> str:
    return os.environ.get("FASTSERVE_MODEL") or os.path.expanduser("~/.cache/fastserve/SmolLM2-135M-Instruct.Q4_1.gguf")


def read_bandwidth(threads: int, nbytes: int = 256 << 20) -> float:
    """Bytes per second that `threads` threads read summing a float32 array of nbytes (split evenly)."""
    a = np.ones(nbytes // 4, np.float32)
    parts = np.array_split(a, threads)
    best = float("inf")
    for _ in range(3):
        ts = [threading.Thread(target=p.sum) for p in parts]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def load_old(path: str):
    """An older build's _matmul extension (Q8Matrix int8 copies) under another package name."""
    spec = importlib.util.spec_from_file_location("old_fastserve._matmul", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _old_matrix(old, w):
    """The old int8-copy matrix of BlockMatrix w (exact blocks, as the old loader packed them)."""
    from fastserve.ref import blocks as B
    qs, ds, ms = [], [], []
    for t, arr, rows in zip(w.types, w.arrays, w.part_rows):
        b = B.decode(t, arr, rows, w.n_in)
        qs.append(b.q.reshape(rows, -1))
        ds.append(b.d)
        ms.append(b.m if b.m is not None else np.zeros_like(b.d))
    m = np.ascontiguousarray(np.concatenate(ms)) if any(t in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") for t in w.types) else None
    return old.Q8Matrix.from_blocks(np.ascontiguousarray(np.concatenate(qs)), np.ascontiguousarray(np.concatenate(ds)), m)


def matrix_table(model, reps: int = 5, old=None) -> list[str]:
    """Per matrix and n: microseconds and GB/s of every kernel (1 thread), and of the old int8 copies."""
    from fastserve import _matmul

    lw = model.weights.layers[0]
    mats = [("wqkv", lw.wqkv), ("wo", lw.wo), ("w_gate_up", lw.w_gate_up), ("w_down", lw.w_down),
            ("output", model.weights.output)]
    rng = np.random.default_rng(0)
    heads = [*_matmul.isas()] + (["old q8 " + old.best_isa()] if old else [])
    lines = [f"{'matrix':10s} {'type':6s} {'n':>3s} " + " ".join(f"{k:>22s}" for k in heads)]
    for name, w in mats:
        ow = _old_matrix(old, w) if old else None
        for n in BATCHES:
            x = rng.standard_normal((n, w.n_in)).astype(np.float32)
            y = np.empty((n, w.n_out), np.float32)
            cells = []
            for isa in _matmul.isas():
                mm = _matmul.Matmul(1, isa)
                t = _best(lambda: mm(x, w, y), reps)
                cells.append(f"{t * 1e6:8.0f} us {w.nbytes / t / 1e9:5.1f} GB/s")
            if old:
                mm_old = old.Matmul(1)
                t = _best(lambda: mm_old(x, ow, y), reps)
                cells.append(f"{t * 1e6:8.0f} us {ow.nbytes / t / 1e9:5.1f} GB/s")
            lines.append(f"{name:10s} {'+'.join(sorted(set(w.types))):6s} {n:3d} " + " ".join(f"{c:>22s}" for c in cells))
    return lines


def _best(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def make_backend(model, threads: int):
    from fastserve.backends.numpy_backend import NumpyBackend

    cfg = model.config
    be = NumpyBackend(cfg, model.weights, 32, 256, threads=threads)
    rng = np.random.default_rng(0)
    for s in range(32):
        toks = rng.integers(0, cfg.n_vocab, N_CTX_FILLED).astype(np.int32)
        be.forward(toks, np.arange(N_CTX_FILLED), np.full(N_CTX_FILLED, s), np.arange(0))
    return be


def weight_bytes(model) -> int:
    """File bytes one decode step reads: every matrix once (the embedding rows are negligible)."""
    w = model.weights
    return sum(getattr(lw, k).nbytes for lw in w.layers for k in ("wqkv", "wo", "w_gate_up", "w_down")) + w.output.nbytes


def step_times(model, rounds: int, steps: int = 4) -> dict:
    """{(batch, threads): [seconds per step, ...]} and {threads: [read bandwidth, ...]}, taking turns."""
    backends = {c: make_backend(model, c) for c in CONFIGS}
    out: dict = {}
    for _ in range(rounds):
        for c in CONFIGS:
            out.setdefault(("bw", c), []).append(read_bandwidth(c))
        for n in BATCHES:
            toks, slots = np.full(n, 100, np.int32), np.arange(n)
            for c in CONFIGS:
                be = backends[c]
                time.sleep(SETTLE_S)
                be.forward(toks, np.full(n, N_CTX_FILLED), slots, slots)       # warm
                for i in range(steps):
                    pos = np.full(n, N_CTX_FILLED + i)
                    t0 = time.perf_counter()
                    be.forward(toks, pos, slots, slots)
                    out.setdefault((n, c), []).append(time.perf_counter() - t0)
    return out


def step_table(times: dict, wbytes: int) -> list[str]:
    bw = {c: float(np.median(times[("bw", c)])) for c in CONFIGS}
    lines = [f"weights read per step {wbytes / 1e6:.1f} MB; read bandwidth " +
             ", ".join(f"{c} thread(s) {bw[c] / 1e9:.1f} GB/s (floor {wbytes / bw[c] * 1e3:.2f} ms)" for c in CONFIGS),
             "batch " + " ".join(f"{f'{c} thread(s)':>16s}" for c in CONFIGS) + "   1t / floor 1t   2t / floor 2t   2t / 1t",
             "      " + " ".join(f"{'median (min) ms':>16s}" for _ in CONFIGS)]
    for n in BATCHES:
        med = {c: 1e3 * float(np.median(times[(n, c)])) for c in CONFIGS}
        cells = [f"{med[c]:7.1f} ({1e3 * min(times[(n, c)]):5.1f})" for c in CONFIGS]
        floors = "   ".join(f"{med[c] / (wbytes / bw[c] * 1e3):13.2f}" for c in CONFIGS)
        r2 = np.median(np.array(times[(n, 2)]) / np.array(times[(n, 1)]))
        lines.append(f"{n:5d} " + " ".join(f"{c:>16s}" for c in cells) + f"   {floors}   {r2:7.3f}")
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
    ap.add_argument("--old-so", help="an older build's fastserve/_matmul*.so (int8 copies) to compare with")
    args = ap.parse_args(argv)
    import fastserve
    from fastserve import _matmul

    model = fastserve.load_model(args.model)
    print(f"model {model.name}; kernels here: {', '.join(_matmul.isas())} (auto: {_matmul.best_isa()}); "
          f"{os.cpu_count()} CPUs")
    if not args.no_matrices:
        print("\n".join(matrix_table(model, old=load_old(args.old_so) if args.old_so else None)))
    print(f"\ndecode step, 32 slots x {N_CTX_FILLED} tokens of context, {args.rounds} rounds")
    print("\n".join(step_table(step_times(model, args.rounds), weight_bytes(model))))
    if args.busy:
        print("\nthe same beside a process that keeps one core busy")
        with BusyCore():
            print("\n".join(step_table(step_times(model, args.rounds), weight_bytes(model))))
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
def test_decode_step(benchmark, default_model, n):
    be = make_backend(default_model, 1)
    toks, slots = np.full(n, 100, np.int32), np.arange(n)
    benchmark(be.forward, toks, np.full(n, N_CTX_FILLED), slots, slots)
    benchmark.extra_info["ms_per_step"] = benchmark.stats.stats.median * 1e3


if __name__ == "__main__":
    sys.exit(main())
