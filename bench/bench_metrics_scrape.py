"""What one /metrics scrape costs the event loop: the hand-written exposition (fastserve/server/metrics.py)
beside the same metrics through prometheus_client (its Counter/Histogram and a custom collector for the
engine's snapshot: the metrics.py of commit 3676c74, read from git), same run.

Both render for an engine on the tiny model with 32 slots after the same observations (every labelled
series present, histograms filled): median and p99 wall time, median CPU time of the loop's thread, of N
scrapes. Issue 14's budget for prometheus_client: 1 ms per scrape.

Run: python bench/bench_metrics_scrape.py [--scrapes 2000] [--prom-rev 3676c74]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _metrics_module_at(rev: str):
    """fastserve/server/metrics.py at rev, imported as a sibling of fastserve.server.metrics."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:fastserve/server/metrics.py"],
                         capture_output=True, text=True, check=True).stdout
    mod = types.ModuleType("fastserve.server._metrics_at_rev")
    mod.__package__ = "fastserve.server"
    exec(compile(src, "metrics_before.py", "exec"), mod.__dict__)
    return mod


def _fill(m) -> None:
    """The observations a busy server has made: every label value, histograms spread over their buckets."""
    for i in range(200):
        v = 0.001 * (i % 50 + 1)
        m.ttft.observe(v * 10)
        m.itl.observe(v, 1)
        m.e2e.observe(v * 100)
        m.queue_time.observe(v)
        for phase in ("admit", "build", "forward", "sync", "sample", "publish"):
            m.phase.observe(v / 10, 1, phase)
    for code in ("200", "400", "404", "413", "503"):
        m.http.inc(3, code)
    for label in ("eos", "limit", "word"):
        m.requests_done.inc(2, label)
    for kind in ("queue", "total", "token"):
        m.deadlines.inc(1, kind)
    for reason in ("queue_full", "stalled"):
        m.rejected.inc(1, reason)
    for reason in ("slow_reader", "slow_sender", "idle"):
        m.dropped.inc(1, reason)


def _time(render, n: int) -> tuple[float, float, float, int]:
    """(median wall µs, p99 wall µs, median CPU µs of this thread, bytes): the CPU time is what the loop
    spends, whatever else the machine runs; the wall time includes being descheduled."""
    out = render()
    wall, cpu = [], []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.thread_time()
        render()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    wall.sort()
    return statistics.median(wall) * 1e6, wall[int(0.99 * (n - 1))] * 1e6, statistics.median(cpu) * 1e6, len(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scrapes", type=int, default=2000)
    ap.add_argument("--prom-rev", default="3676c74", help="the commit whose prometheus_client metrics.py to compare")
    args = ap.parse_args(argv)

    import fastserve
    from fastserve.models.synthetic import write_llama_gguf
    from fastserve.server.app import App
    from fastserve.server.config import ServerConfig
    prom = _metrics_module_at(args.prom_rev)
    with tempfile.TemporaryDirectory() as tmp:
        model = fastserve.load_model(write_llama_gguf(Path(tmp) / "tiny.gguf"))
        with fastserve.Engine(model, n_parallel=32, n_ctx=32 * 64, trace=True) as engine:
            fastserve.Engine.generate(engine, "warm the tracer", max_tokens=4, temperature=0)
            app = App(engine, ServerConfig(log_requests=False, metrics=True))
            # the prometheus_client version reads app.metrics.llama: an App-like object of its own
            other = types.SimpleNamespace(engine=engine, connections=app.connections, log=app.log,
                                          stall_reason=app.stall_reason, started_wall=app.started_wall)
            import prometheus_client
            prometheus_client.disable_created_metrics()     # no <name>_created series: the same samples
            other.metrics = prom.ServerMetrics(other)
            _fill(app.metrics)
            _fill(other.metrics)
            rows = [("hand-written (fastserve)", *_time(app.metrics.render, args.scrapes)),
                    ("prometheus_client", *_time(other.metrics.render, args.scrapes))]
            app.log.close()
    print(f"{'exposition':<26} {'median µs':>10} {'p99 µs':>9} {'CPU µs':>8} {'bytes':>7}")
    for name, med, p99, cpu, size in rows:
        print(f"{name:<26} {med:>10.0f} {p99:>9.0f} {cpu:>8.0f} {size:>7}")
    print(f"prometheus_client / hand-written (median CPU): {rows[1][3] / rows[0][3]:.2f}x; "
          f"budget for prometheus_client: 1000 µs per scrape")
    return 0


if __name__ == "__main__":
    sys.exit(main())
