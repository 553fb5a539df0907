"""The older in-process closed loop on threads (bench/bench_http.py and bench/gpu_check.py use it):
N clients, each submitting the next request as soon as one ends; tokens/s, TTFT, inter-token gaps.
`fastserve bench` itself drives an in-process Engine through load.py, like any other target.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class LoadResult:
    clients: int
    seconds: float
    tokens: int
    requests: int
    ttft: list = field(default_factory=list)     # seconds, per request
    gaps: list = field(default_factory=list)     # seconds between tokens of one request

    def row(self) -> dict:
        def pct(xs, q):
            return float(np.percentile(xs, q)) if xs else float("nan")
        return {"clients": self.clients, "tok_s": self.tokens / self.seconds, "requests": self.requests,
                "ttft_p50_s": pct(self.ttft, 50), "ttft_p99_s": pct(self.ttft, 99),
                "itl_p50_ms": pct(self.gaps, 50) * 1e3, "itl_p99_ms": pct(self.gaps, 99) * 1e3,
                "itl_max_ms": max(self.gaps) * 1e3 if self.gaps else float("nan")}


def closed_loop(engine, prompts, clients: int, seconds: float, n_predict: int = 128,
                warmup_s: float = 0.0) -> LoadResult:
    """Run `clients` closed-loop clients for `seconds` (after warmup_s); greedy, n_predict tokens each."""
    stop_at = time.perf_counter() + warmup_s + seconds
    t_measure = time.perf_counter() + warmup_s
    res = LoadResult(clients, seconds, 0, 0)
    lock = threading.Lock()

    def client(k: int):
        i = k
        while time.perf_counter() < stop_at:
            prompt = prompts[i % len(prompts)]
            i += clients
            t0 = time.perf_counter()
            reader = engine.submit(prompt, max_tokens=n_predict, temperature=0, cache_prompt=False).reader
            last, n, gaps, ttft = None, 0, [], None
            for batch in reader.batches():
                now = time.perf_counter()
                if last is None:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                last = now
                n += len(batch)
            if t0 >= t_measure:
                with lock:
                    res.requests += 1
                    res.ttft.append(ttft)
            if last is not None and last >= t_measure:
                with lock:
                    res.tokens += n
                    res.gaps.extend(gaps)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    res.seconds = time.perf_counter() - t_measure
    return res


def format_rows(rows: list[dict]) -> str:
    head = f"{'clients':>7} {'tok/s':>8} {'reqs':>5} {'ttft p50':>9} {'ttft p99':>9} {'itl p50':>8} {'itl p99':>8} {'itl max':>8}"
    lines = [head]
    for r in rows:
        lines.append(f"{r['clients']:>7} {r['tok_s']:>8.1f} {r['requests']:>5} {r['ttft_p50_s']:>8.2f}s "
                     f"{r['ttft_p99_s']:>8.2f}s {r['itl_p50_ms']:>6.0f}ms {r['itl_p99_ms']:>6.0f}ms {r['itl_max_ms']:>6.0f}ms")
    return "\n".join(lines)
