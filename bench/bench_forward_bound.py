"""The batch-1 forward pass of the default model against the memory bound (issue 10's fallback acceptance).

Bound = bytes of weight a token reads, as the GGUF stores them (every block tensor, output_norm, and
the output matrix: token_embd when the output is tied to it, else output.weight plus one row of
token_embd) / this machine's read bandwidth, measured in the same run with the same threads: a NumPy
sum over 256 MB, by 1 thread and by 2 threads each summing its half. The forward pass is the backend's
own (fastserve.backends.cpu.backend.CpuBackend with its defaults but the threads), one slot
holding 64 tokens of context, one token decoded.
Bandwidth and forward pass take turns in every round; the ratio is the median over rounds of
(forward median / bound) measured in the same round. Bar: ratio <= 1.3.

Run: python bench/bench_forward_bound.py [-m PATH] [--rounds 5] [--threads 1,2] [--json out.json]
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

SUM_BYTES = 256 * 1024 * 1024
BAR = 1.3
STEPS = 8
N_CTX_FILLED = 64             # tokens of KV the decoded token attends to
SETTLE_S = 0.3                # idle before each measurement: helper threads of the last one go to sleep


def weight_bytes_per_token(path: str) -> tuple[int, dict]:
    """(bytes a batch-1 forward pass reads from the weights, {tensor type: bytes}) from the GGUF's tensor table;
    of a mixture of experts' expert tensors, the share of the experts a token runs."""
    import gguf
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    used = {k.rsplit(".", 1)[1]: int(f.contents()) for k, f in reader.fields.items()
            if k.endswith((".expert_count", ".expert_used_count"))}
    total, by_type = 0, {}
    for name, t in tensors.items():
        n = int(t.n_bytes)
        if name == "token_embd.weight" and "output.weight" in tensors:
            n //= int(t.shape[-1])                 # an input row only: the output matrix is its own tensor
        if "_exps." in name:
            n = n * used["expert_used_count"] // used["expert_count"]
        total += n
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + n
    return total, by_type


class ReadBandwidth:
    """Bytes/s of a NumPy sum over SUM_BYTES of float32, split between `threads` threads (NumPy lets go of
    the GIL inside the reduction)."""

    def __init__(self):
        self.buf = np.ones(SUM_BYTES // 4, np.float32)       # touched: no page faults in the timing
        self.pools = {}

    def measure(self, threads: int, reps: int = 5) -> float:
        parts = np.array_split(self.buf, threads)
        pool = self.pools.setdefault(threads, ThreadPoolExecutor(threads))
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - t0)
        return self.buf.nbytes / best

    def close(self) -> None:
        for p in self.pools.values():
            p.shutdown()


def make_backend(model, threads: int):
    """A CpuBackend of one slot whose KV holds N_CTX_FILLED tokens."""
    from fastserve.backends.cpu.backend import CpuBackend
    be = CpuBackend(model.config, model.weights, 1, 2 * N_CTX_FILLED, threads=threads)
    toks = np.random.default_rng(0).integers(0, model.config.n_vocab, N_CTX_FILLED).astype(np.int32)
    be.forward(toks, np.arange(N_CTX_FILLED, dtype=np.int32), np.zeros(N_CTX_FILLED, np.int32), np.arange(0))
    return be


def forward_times(be, steps: int = STEPS) -> list[float]:
    """Seconds of each of `steps` batch-1 decode steps (slot 0, at position N_CTX_FILLED), after one warm step."""
    from threadpoolctl import threadpool_limits
    tok, pos, slot = np.array([100], np.int32), np.array([N_CTX_FILLED], np.int32), np.array([0], np.int32)
    out = []
    with threadpool_limits(1):        # the backend's own threads only; no OpenBLAS pool beside them
        be.forward(tok, pos, slot, slot)
        for _ in range(steps):
            t0 = time.perf_counter()
            be.forward(tok, pos, slot, slot)
            out.append(time.perf_counter() - t0)
    return out


def run(model_path: str, threads=(1, 2), rounds: int = 5) -> dict:
    import fastserve
    nbytes, by_type = weight_bytes_per_token(model_path)
    model = fastserve.load_model(model_path)
    backends = {t: make_backend(model, t) for t in threads}
    bw = ReadBandwidth()
    samples = {t: {"bandwidth": [], "forward": [], "ratio": []} for t in threads}
    try:
        for _ in range(rounds):
            for t in threads:
                time.sleep(SETTLE_S)
                b = bw.measure(t)
                f = float(np.median(forward_times(backends[t])))
                s = samples[t]
                s["bandwidth"].append(b)
                s["forward"].append(f)
                s["ratio"].append(f / (nbytes / b))
    finally:
        bw.close()
    rows = []
    for t in threads:
        s = samples[t]
        b, f = float(np.median(s["bandwidth"])), float(np.median(s["forward"]))
        rows.append({"threads": t, "bandwidth_gb_s": b / 1e9, "bound_ms": nbytes / b * 1e3, "forward_ms": f * 1e3,
                     "forward_min_ms": min(s["forward"]) * 1e3, "ratio": float(np.median(s["ratio"])),
                     "weights_gb_s": nbytes / f / 1e9, "samples": s})
    return {"model": model_path, "weight_bytes": nbytes, "weight_bytes_by_type": by_type, "rounds": rounds,
            "weight_type": getattr(backends[threads[0]], "weight_type", "the file's blocks"), "rows": rows}


def report(out: dict) -> str:
    by = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in out["weight_bytes_by_type"].items())
    lines = [f"batch-1 forward pass of {Path(out['model']).name} (weight type {out['weight_type']}) against "
             f"{out['weight_bytes'] / 1e6:.1f} MB of weights a token reads ({by}); {out['rounds']} rounds",
             f"{'threads':>7} {'sum GB/s':>9} {'bound ms':>9} {'forward ms':>11} {'(min)':>7} {'weights GB/s':>13} "
             f"{'ratio':>6}  bar <= {BAR}"]
    for r in out["rows"]:
        lines.append(f"{r['threads']:>7} {r['bandwidth_gb_s']:>9.1f} {r['bound_ms']:>9.2f} {r['forward_ms']:>11.2f} "
                     f"{r['forward_min_ms']:>7.2f} {r['weights_gb_s']:>13.1f} {r['ratio']:>6.2f}  "
                     + ("ok" if r["ratio"] <= BAR else "NO"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="GGUF path (default: the default model)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--json", help="also write the figures here (JSON)")
    a = ap.parse_args(argv)
    import fastserve
    out = run(a.model or fastserve.default_model_path(), tuple(int(x) for x in a.threads.split(",")), a.rounds)
    print(report(out))
    if a.json:
        Path(a.json).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
