"""Memory left behind by clients that go away (issue 11): RSS of a real `fastserve serve` over rounds.

Rounds of streaming /completion requests against one server process (the default model,
-np 8 -c 8192), 8 in flight, each ended 400 ms after it was sent (a reset, or a half-close:
--how rst|fin), RSS read 2 s after each round; then a 32-client burst of whole requests,
idle, a second burst and idle again (RSS after the second within 5 % of after the first).

Run: python bench/bench_killed_streams.py [--rounds 3] [--per-round 1200] [--how rst]
 or: pytest bench/bench_killed_streams.py --benchmark-only -s   (make bench; 3 x 1,200 and the bursts)
Bars: growth <= 1 MB a round after the first; RSS after the second burst within 5 % of the first.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.conftest import ServerProc  # noqa: E402
from tests.e2e.killed_streams import kill_streams, rss_mb  # noqa: E402

BODY = {"prompt": "Write a long story about a dragon who lives in a castle by the sea.", "n_predict": 256,
        "stream": True, "temperature": 0.8}
ROUND_BAR_MB = 1.0
BURST_BAR = 0.05


def killed_rounds(srv, rounds: int, per_round: int, how: str, warmup: int = 16, settle_s: float = 2.0) -> list:
    """[(label, RSS MB, growth MB, RssAnon MB)] for the warm-up and each round."""
    kill_streams(srv.host, srv.port, warmup, body=BODY, how=how)
    time.sleep(settle_s)
    rows = [("warm-up", rss_mb(srv.proc.pid), None, rss_mb(srv.proc.pid, "RssAnon"))]
    for r in range(rounds):
        t0 = time.monotonic()
        kill_streams(srv.host, srv.port, per_round, body=BODY, how=how)
        time.sleep(settle_s)
        rss = rss_mb(srv.proc.pid)
        rows.append((f"round {r + 1} ({time.monotonic() - t0:.0f} s)", rss, rss - rows[-1][1],
                     rss_mb(srv.proc.pid, "RssAnon")))
    return rows


def bursts(srv, clients: int = 32, n_predict: int = 64, idle_s: float = 30.0) -> list:
    """[(label, RSS MB)] after each of two bursts of `clients` whole streaming requests and idle_s of rest."""
    body = dict(BODY, n_predict=n_predict)
    rows = []
    for b in range(2):
        kill_streams(srv.host, srv.port, clients, body=body, how="read", concurrency=clients)
        time.sleep(idle_s)
        rows.append((f"burst {b + 1} + {idle_s:g} s idle", rss_mb(srv.proc.pid), rss_mb(srv.proc.pid, "RssAnon")))
    return rows


def run(rounds: int, per_round: int, how: str, idle_s: float, model: str | None = None) -> tuple[list, list]:
    import fastserve
    path = model or fastserve.default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        srv = ServerProc(path, Path(tmp) / "server.log", "-c", "8192", "-np", "8")
        try:
            killed = killed_rounds(srv, rounds, per_round, how)
            burst = bursts(srv, idle_s=idle_s)
            rc, _ = srv.stop()
            assert rc == 0, f"the server exited {rc}"
        finally:
            srv.kill()
    return killed, burst


def report(killed: list, burst: list) -> str:
    lines = ["| round | RSS after | growth | RssAnon |", "| --- | --- | --- | --- |"]
    for label, rss, growth, anon in killed:
        lines.append(f"| {label} | {rss:,.1f} MB | {'—' if growth is None else f'{growth:+.1f} MB'} | {anon:,.1f} MB |")
    lines.append("")
    for label, rss, anon in burst:
        lines.append(f"{label}: RSS {rss:,.1f} MB, RssAnon {anon:,.1f} MB")
    lines.append(f"second burst vs first: {(burst[1][1] / burst[0][1] - 1) * 100:+.2f} %")
    return "\n".join(lines)


def check(killed: list, burst: list) -> None:
    worst = max(g for _, _, g, _ in killed[2:]) if len(killed) > 2 else killed[-1][2]
    assert worst <= ROUND_BAR_MB, f"RSS grew {worst:.1f} MB in a round (bar {ROUND_BAR_MB} MB)"
    assert abs(burst[1][1] / burst[0][1] - 1) <= BURST_BAR, "RSS after the second burst is not within 5 %"


def test_killed_streams_rss(benchmark):
    killed, burst = benchmark.pedantic(lambda: run(3, 1200, "rst", 30.0), rounds=1, iterations=1)
    print("\n" + report(killed, burst))
    benchmark.extra_info["rss_mb"] = [round(r[1], 1) for r in killed]
    benchmark.extra_info["burst_rss_mb"] = [round(r[1], 1) for r in burst]
    check(killed, burst)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-round", type=int, default=1200)
    ap.add_argument("--how", choices=("rst", "fin"), default="rst")
    ap.add_argument("--idle", type=float, default=30.0, help="seconds of rest after each burst")
    ap.add_argument("-m", "--model", help="GGUF path (default: the default model)")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    k, b = run(a.rounds, a.per_round, a.how, a.idle, a.model)
    print(report(k, b))
    check(k, b)
