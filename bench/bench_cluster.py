"""fastserve.cluster measured: what the Ray Serve path adds to a request, and 2 replicas against 1.

    python bench/bench_cluster.py [--requests 200] [--clients 8] [--duration 20] [-t 1] [-np 4]

1. Overhead: a direct `fastserve serve` and the cluster with ONE replica (the same server behind the
   ingress, the router and the replica's forwarding), both idle but for this client: the same 1-token
   /completion sent to each in turn, one at a time; p50 / p99 of each and the difference; with
   PrefixCacheAffinityRouter, then with Ray Serve's default router (power of two choices).
2. Throughput: closed loop, `--clients` streams of `-n` tokens (greedy, ignore_eos, prompts with no shared
   prefix so the router spreads them): the direct server, the cluster with 1 replica, with 2 replicas.
Each replica and the direct server run `-t` threads with `-np` slots; Ray gets every core of the machine.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_direct(flags: list, log: Path) -> tuple[subprocess.Popen, str]:
    f = open(log, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "fastserve", "serve", *flags, "--port", "0"], stderr=f,
                            stdout=subprocess.DEVNULL, cwd=REPO)
    for _ in range(600):
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text(errors="replace"))
        if m:
            return proc, m.group(1)
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(log.read_text())


def pct(xs: list, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def latencies(urls: dict, n: int) -> dict:
    """{name: [ms]} of n 1-token completions per URL, sent in turn (A, B, A, B, ...)."""
    out = {name: [] for name in urls}
    clients = {name: httpx.Client(base_url=u, timeout=60) for name, u in urls.items()}
    body = {"prompt": "The capital of France is", "n_predict": 1, "temperature": 0}
    for c in clients.values():          # warm: connections, the prompt cache
        for _ in range(5):
            c.post("/completion", json=body).raise_for_status()
    for _ in range(n):
        for name, c in clients.items():
            t0 = time.perf_counter()
            c.post("/completion", json=body).raise_for_status()
            out[name].append((time.perf_counter() - t0) * 1e3)
    return out


def throughput(url: str, clients: int, n_predict: int, duration: float) -> float:
    """Generated tokens per second of a closed loop of streaming clients."""
    stop = time.monotonic() + duration
    counts = [0] * clients

    def client(i: int) -> None:
        k = 0
        with httpx.Client(base_url=url, timeout=120) as c:
            while time.monotonic() < stop:
                body = {"prompt": f"{chr(65 + (i * 7 + k) % 26)}{i}-{k} once upon a time", "n_predict": n_predict,
                        "temperature": 0, "ignore_eos": True, "stream": True}
                with c.stream("POST", "/completion", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: ") and time.monotonic() < stop and '"stop":true' not in line:
                            counts[i] += 1
                k += 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / min(duration, time.monotonic() - t0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-t", type=int, default=1)
    ap.add_argument("-np", type=int, default=4)
    ap.add_argument("--json")
    a = ap.parse_args()

    import fastserve
    import ray
    from ray import serve

    from fastserve.cluster import POW2, ROUTER, build

    model = fastserve.default_model_path()
    flags = ["-m", model, "-c", str(a.np * 512), "-np", str(a.np), "-t", str(a.t), "--log-disable"]
    log = Path("/tmp/bench_cluster_direct.log")
    direct, direct_url = start_direct([*flags, "--host", "127.0.0.1"], log)
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}})
    logging.getLogger("httpx").setLevel(logging.WARNING)     # ray.init sets the root logger to INFO
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    cluster_url = f"http://127.0.0.1:{port}"
    results: dict = {"cpus": os.cpu_count(), "flags": flags}
    try:
        for router_name, router in (("prefix", ROUTER), ("pow2", POW2)):
            app, board = build(flags, replicas=1, num_cpus=0.5, router=router)
            serve.run(app, name="fastserve", route_prefix="/")
            lat = latencies({"direct": direct_url, "cluster": cluster_url}, a.requests)
            d, c = ({"p50": pct(xs, 0.5), "p99": pct(xs, 0.99)} for xs in (lat["direct"], lat["cluster"]))
            results[f"latency_ms_{router_name}"] = {"direct": d, "cluster": c,
                                                    "added": {q: c[q] - d[q] for q in ("p50", "p99")}}
            print(json.dumps({router_name: results[f"latency_ms_{router_name}"]}), flush=True)
        results["tok_s_direct"] = throughput(direct_url, a.clients, a.n, a.duration)
        direct.terminate()
        direct.wait(10)
        results["tok_s_1_replica"] = throughput(cluster_url, a.clients, a.n, a.duration)
        app, board = build(flags, replicas=2, num_cpus=0.5)
        serve.run(app, name="fastserve", route_prefix="/")
        results["tok_s_2_replicas"] = throughput(cluster_url, a.clients, a.n, a.duration)
    finally:
        if direct.poll() is None:
            direct.kill()
        serve.shutdown()
        ray.shutdown()
    print(json.dumps(results, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
