"""The matrix products on the GGUF file's blocks (fastserve.backends.cpu._matmul), on the default model.

Run: python bench/bench_matmul.py [--model PATH] [--rounds 5] [--busy] [--old-so PATH]
     python bench/bench_matmul.py --rows [TYPE:OUTxIN,...] [--ns 1,2,...] [--before DIR] [--rounds N]
     pytest bench/bench_matmul.py --benchmark-only -p no:cacheprovider -s

Prints (1) each weight matrix's product at n = 1, 2, 4, 8, 32 rows for every kernel this machine runs
(GB/s of file bytes streamed; at n <= 4 the fused kernels where the type has one, and the staging
path beside them), beside the int8-copy kernels of an older build of fastserve.backends.cpu._matmul (--old-so:
its .so; the matrix repacked from the same exact blocks) when given, and every fused type on random
2048 x 2048 blocks at n = 1, 2, 4, fused and staged; (2) a batch-1 step's products alone (every matrix
once, from memory) against the floor; (3) a decode step of the whole model (CpuBackend.forward, 32
slots holding 64 tokens each) at batch 1, 8 and 32 on 1 and 2 threads (batch 1 also staged), with the
machine's read bandwidth measured in the same run (a NumPy sum over 256 MB, on 1 and 2 threads) and
the floor it sets for batch 1 (weight bytes / bandwidth); (4) where a batch-1 step's time goes
(the C forward's phase clocks: products, attention, element-wise ops, output product). --rows prints only
(5): products of n rows (prefill, a verification's 1 + k rows) on matrices of given types and shapes, random
blocks, 2 threads, beside another checkout's (--before) in one run. The configurations
take turns within each round, so the ratios compare runs made under the same load; a shared machine
still moves every figure, so read medians over rounds. --busy adds a process that keeps one core
busy and measures everything again beside it.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

BATCHES = (1, 8, 32)
MATRIX_BATCHES = (1, 2, 4, 8, 32)
CONFIGS = (1, 2)                    # threads
FUSED_MAX_N = 4                     # batches also measured staged (fastserve.backends.cpu._matmul.FUSED_MAX_N)
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
    from fastserve.models import blocks as B
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
    from fastserve.backends.cpu import _matmul

    lw = model.weights.layers[0]
    mats = [("wqkv", lw.wqkv), ("wo", lw.wo), ("w_gate_up", lw.w_gate_up), ("w_down", lw.w_down),
            ("output", model.weights.output)]
    rng = np.random.default_rng(0)
    best = _matmul.best_isa()
    heads = [*_matmul.isas()] + [best + " staged"] + (["old q8 " + old.best_isa()] if old else [])
    lines = [f"(n <= {_matmul.FUSED_MAX_N} rows of {', '.join(_matmul.fused_types(best))}: the fused kernels; "
             f"(Q4_K, Q6_K: n <= 2); '{best} staged': the staging path at the same n)",
             f"{'matrix':10s} {'type':6s} {'n':>3s} " + " ".join(f"{k:>22s}" for k in heads)]
    for name, w in mats:
        ow = _old_matrix(old, w) if old else None
        for n in MATRIX_BATCHES:
            x = rng.standard_normal((n, w.n_in)).astype(np.float32)
            y = np.empty((n, w.n_out), np.float32)
            cells = []
            for isa, fused in [(isa, True) for isa in _matmul.isas()] + [(best, False)]:
                mm = _matmul.Matmul(1, isa, fused=fused)
                if not fused and (n > _matmul.FUSED_MAX_N or not set(w.types) & set(_matmul.fused_types(best))):
                    cells.append("-")
                    continue
                t = _best(lambda: mm(x, w, y), reps)
                cells.append(f"{t * 1e6:8.0f} us {w.nbytes / t / 1e9:5.1f} GB/s")
            if old:
                mm_old = old.Matmul(1)
                t = _best(lambda: mm_old(x, ow, y), reps)
                cells.append(f"{t * 1e6:8.0f} us {ow.nbytes / t / 1e9:5.1f} GB/s")
            lines.append(f"{name:10s} {'+'.join(sorted(set(w.types))):6s} {n:3d} " + " ".join(f"{c:>22s}" for c in cells))
    return lines


def random_matrix(type_name: str, n_out: int = 2048, n_in: int = 2048, seed: int = 0):
    """A BlockMatrix of random blocks of type_name whose scales (f16, MXFP4's E8M0) are ordinary numbers."""
    from fastserve.backends.cpu import _matmul
    per, nbytes, _ = _matmul.type_info(type_name)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n_out, n_in // per, nbytes), dtype=np.uint8)
    scales = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2],
              "Q6_K": [208], "Q3_K": [108], "Q2_K": [80, 82], "IQ4_NL": [0], "IQ4_XS": [0]}.get(type_name, [])
    for off in scales:
        f16 = np.float16(rng.random((n_out, n_in // per)) * 0.02 - 0.01).view(np.uint8).reshape(n_out, -1, 2)
        raw[:, :, off:off + 2] = f16
    if type_name == "MXFP4":                # its E8M0 scale byte: 2^-10 .. 2^9
        raw[:, :, 0] = rng.integers(118, 138, (n_out, n_in // per))
    return _matmul.BlockMatrix([(type_name, type_name, raw.reshape(n_out, -1), n_out)], n_in)


def type_table(reps: int = 7) -> list[str]:
    """Per fused type (random 2048 x 2048 blocks, warm caches, 1 thread): GB/s of file bytes at n =
    1, 2, 4, the fused kernels (where they run at that n) beside the staging path."""
    from fastserve.backends.cpu import _matmul
    best = _matmul.best_isa()
    rng = np.random.default_rng(1)
    lines = [f"per type, 2048 x 2048, 1 thread, {best}: GB/s of file bytes, fused / staged (ratio)"]
    for t in _matmul.fused_types(best):
        w = random_matrix(t)
        cells = []
        for n in (1, 2, 4):
            x = rng.standard_normal((n, w.n_in)).astype(np.float32)
            y = np.empty((n, w.n_out), np.float32)
            tf, ts = (_best(lambda: _matmul.Matmul(1, best, fused=f)(x, w, y), reps) for f in (True, False))
            cells.append(f"n={n} {w.nbytes / tf / 1e9:5.1f} / {w.nbytes / ts / 1e9:5.1f} ({ts / tf:4.2f})")
        lines.append(f"  {t:5s} " + "   ".join(cells))
    return lines


ROW_SHAPES = "Q4_K:16384x2048,Q6_K:2048x8192,Q8_0:2048x8192,Q4_1:3072x576,Q4_1:576x1536,Q8_0:49152x576"


def rows_times(shapes: str, ns: list[int], threads: int = 2) -> dict:
    """Best seconds of one product per 'TYPE:OUTxIN' of shapes (random blocks) and n activation rows."""
    from fastserve.backends.cpu import _matmul
    from fastserve.backends.cpu._pool import Pool
    mm, rng, out = _matmul.Matmul(pool=Pool(threads)), np.random.default_rng(0), {}
    for spec in shapes.split(","):
        t, shape = spec.split(":")
        n_out, n_in = map(int, shape.split("x"))
        w = random_matrix(t, n_out, n_in)
        for n in ns:
            x = rng.standard_normal((n, n_in)).astype(np.float32)
            y = np.empty((n, n_out), np.float32)
            out[f"{spec} n={n}"] = _best(lambda: mm(x, w, y), max(3, min(30, int(2e8 / (n * n_out * n_in)))))
    return out


def rows_table(shapes: str, ns: list[int], rounds: int, before: str | None) -> list[str]:
    """Products of n rows (prefill, a verification's 1 + k rows) on 2 threads, GOP/s; with before (another
    checkout, built in place) its times beside, the two taking turns each round (in subprocesses)."""
    roots = ([before] if before else []) + [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    best: dict = {r: {} for r in roots}
    code = ("import sys, json; sys.path.insert(0, {root!r}); sys.path.insert(1, {bench!r}); import bench_matmul as B; "
            "print(json.dumps(B.rows_times({shapes!r}, {ns!r})))")
    for _ in range(rounds):
        for r in roots:
            run = code.format(root=r, bench=os.path.dirname(os.path.abspath(__file__)), shapes=shapes, ns=ns)
            got = json.loads(subprocess.run([sys.executable, "-c", run], check=True, capture_output=True,
                                            text=True).stdout)
            best[r] = {k: min(v, best[r].get(k, v)) for k, v in got.items()}
    lines = [f"products of n rows, 2 threads, random blocks, best of {rounds} rounds: ms (GOP/s)"
             + (f"; before = {before}" if before else "")]
    for k, t in best[roots[-1]].items():
        (o, i), n = map(int, k.split(":")[1].split()[0].split("x")), int(k.split("n=")[1])
        cell = f"{t * 1e3:9.3f} ms ({2 * n * o * i / t / 1e9:5.1f})"
        if before:
            tb = best[before][k]
            cell += f"   before {tb * 1e3:9.3f} ms   after / before {t / tb:5.3f}"
        lines.append(f"  {k:24s} {cell}")
    return lines


def step_products(model, rounds: int = 9) -> list[str]:
    """A batch-1 step's products alone (every matrix of the model once, in the forward's order, so
    the weights come from memory as in a step) on 1 and 2 threads, fused and staged, against the
    floor weight bytes / read bandwidth measured between them with the same threads."""
    from fastserve.backends.cpu import _matmul
    from fastserve.backends.cpu._pool import Pool
    w = model.weights
    mats = [getattr(lw, k) for lw in w.layers for k in ("wqkv", "wo", "w_gate_up", "w_down")] + [w.output]
    total = sum(m.nbytes for m in mats)
    rng = np.random.default_rng(2)
    xs = {m.n_in: rng.standard_normal((1, m.n_in)).astype(np.float32) for m in mats}
    ys = [np.empty((1, m.n_out), np.float32) for m in mats]
    lines = [f"a batch-1 step's products ({total / 1e6:.1f} MB), median of {rounds} rounds"]
    for c in CONFIGS:
        mm = _matmul.Matmul(pool=Pool(c))
        t: dict = {True: [], False: [], "bw": []}
        for _ in range(rounds):
            t["bw"].append(read_bandwidth(c))
            for fused in (True, False):
                mm.fused = fused
                t0 = time.perf_counter()
                for m, y in zip(mats, ys):
                    mm(xs[m.n_in], m, y)
                t[fused].append(time.perf_counter() - t0)
        floor = total / float(np.median(t["bw"]))
        f, s = (float(np.median(t[k])) for k in (True, False))
        lines.append(f"  {c} thread(s): fused {f * 1e3:6.2f} ms ({f / floor:4.2f}x floor), staged {s * 1e3:6.2f} ms "
                     f"({s / floor:4.2f}x); floor {floor * 1e3:.2f} ms at {np.median(t['bw']) / 1e9:.1f} GB/s")
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
    from fastserve.backends.cpu.backend import CpuBackend

    cfg = model.config
    be = CpuBackend(cfg, model.weights, 32, 256, threads=threads)
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
                for fused in (True, False) if n <= FUSED_MAX_N else (True,):
                    be = backends[c]
                    be._mm.fused = fused
                    time.sleep(SETTLE_S)
                    be.forward(toks, np.full(n, N_CTX_FILLED), slots, slots)       # warm
                    for i in range(steps):
                        pos = np.full(n, N_CTX_FILLED + i)
                        t0 = time.perf_counter()
                        be.forward(toks, pos, slots, slots)
                        out.setdefault((n, c) if fused else (n, c, "staged"), []).append(time.perf_counter() - t0)
                    be._mm.fused = True
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
        if (n, 1, "staged") in times:
            med = {c: 1e3 * float(np.median(times[(n, c, "staged")])) for c in CONFIGS}
            cells = [f"{med[c]:7.1f} ({1e3 * min(times[(n, c, 'staged')]):5.1f})" for c in CONFIGS]
            floors = "   ".join(f"{med[c] / (wbytes / bw[c] * 1e3):13.2f}" for c in CONFIGS)
            r2 = np.median(np.array(times[(n, 2, "staged")]) / np.array(times[(n, 1, "staged")]))
            lines.append(f"{'':5s} " + " ".join(f"{c:>16s}" for c in cells) + f"   {floors}   {r2:7.3f}   (staged, not fused)")
    return lines


def forward_breakdown(model, threads: int, steps: int = 40) -> list[str]:
    """Where a batch-1 decode step's time goes: the C forward's own phase clocks (Forward.profile:
    layer products, attention, element-wise ops and KV stores, output product); the rest is the
    backend's Python around the one C call. Fused and staged products."""
    be = make_backend(model, threads)
    toks, slots = np.full(1, 100, np.int32), np.arange(1)
    lines = [f"batch-1 step on {threads} thread(s), {steps} steps: ms per step (share)"]
    be._forward.profile = True
    try:
        for fused in (True, False):
            be._mm.fused = fused
            be._forward.phase_seconds(reset=True)
            total = 0.0
            for i in range(steps):
                pos = np.full(1, N_CTX_FILLED + i % 8)
                t0 = time.perf_counter()
                be.forward(toks, pos, slots, slots)
                total += time.perf_counter() - t0
            acc = be._forward.phase_seconds(reset=True)
            parts = sorted(acc.items(), key=lambda kv: -kv[1]) + [("rest (Python around the call)", total - sum(acc.values()))]
            lines.append(f"  {'fused' if fused else 'staged'}: {total / steps * 1e3:.2f} ms: " +
                         ", ".join(f"{k} {v / steps * 1e3:.2f} ({100 * v / total:.0f} %)" for k, v in parts))
    finally:
        be._mm.fused, be._forward.profile = True, False
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
    ap.add_argument("--old-so", help="an older build's fastserve/backends/cpu/_matmul*.so (int8 copies) to compare with")
    ap.add_argument("--rows", nargs="?", const=ROW_SHAPES, help="only the products of n rows, per TYPE:OUTxIN "
                    f"(random blocks; default {ROW_SHAPES})")
    ap.add_argument("--ns", default="1,2,4,5,8,9,17,33,64,256", help="--rows: the rows n")
    ap.add_argument("--before", help="--rows: another checkout (built in place) measured beside, taking turns")
    args = ap.parse_args(argv)
    if args.rows:
        print("\n".join(rows_table(args.rows, [int(v) for v in args.ns.split(",")], args.rounds, args.before)))
        return 0
    import fastserve
    from fastserve.backends.cpu import _matmul

    model = fastserve.load_model(args.model)
    print(f"model {model.name}; kernels here: {', '.join(_matmul.isas())} (auto: {_matmul.best_isa()}); "
          f"{os.cpu_count()} CPUs")
    if not args.no_matrices:
        print("\n".join(matrix_table(model, old=load_old(args.old_so) if args.old_so else None)))
        print("\n".join(type_table()))
    print("\n".join(step_products(model)))
    print(f"\ndecode step, 32 slots x {N_CTX_FILLED} tokens of context, {args.rounds} rounds")
    print("\n".join(step_table(step_times(model, args.rounds), weight_bytes(model))))
    for c in CONFIGS:
        print("\n".join(forward_breakdown(model, c)))
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
