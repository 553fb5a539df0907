"""Start-up: seconds from the process start of `fastserve serve` to its first /health 200.

Each round starts the server on the default model (or -m) on a free loopback port and polls
GET /health every 5 ms from the moment the process was spawned; the figure is the time to the first
200. One uncounted round first warms the page cache and Python's bytecode cache (the servers start
without PYTHONDONTWRITEBYTECODE, as a user's would). With a llama-server binary (--llama-server PATH
or $FASTSERVE_LLAMA_SERVER) the same is measured for it, rounds interleaved so that both see the
same machine load; without one that side is skipped, saying why. --tree DIR (repeatable) measures other fastserve checkouts too (e.g. main, for a
before/after in one run). The server's own start line (load time, RSS) is shown for fastserve, and
where it names the load's phases, the start less the weights' phase too (the rest of the start).

--first-request also times each server's first chat request once /health is 200 (what start-up work left
for later costs the first user).

Run: python bench/bench_start.py [--rounds 5] [--first-request] [--llama-server PATH [--llama-commit SHA]] [--tree ../main]
 or: pytest bench/bench_start.py --benchmark-only -s   (make bench)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
N_SLOTS, N_CTX = 32, 16384          # issue 10's comparison: -np 32 -c 16384
POLL_S = 0.005


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_status(port: int) -> int | None:
    """The status code of GET /health, or None while nothing answers."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            head = s.recv(64)
    except OSError:
        return None
    parts = head.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def first_chat(port: int) -> float:
    """Seconds of one greedy 4-token chat request, the first the server gets: what start-up work left
    for later costs the first user (the chat template is compiled then, for one)."""
    body = json.dumps({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4,
                       "temperature": 0}).encode()
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=60.0) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    if not reply.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the first chat request failed: {reply[:300]!r}")
    return time.perf_counter() - t0


def time_to_health(cmd: list[str], port: int, env: dict | None = None, cwd: str | None = None,
                   timeout: float = 120.0, then=None) -> tuple[float, str, float | None]:
    """(seconds from spawn to the first /health 200, the process's stderr up to then, then(port) or None):
    then, when given, runs once /health has answered 200 (first_chat); the process is stopped after it."""
    log = tempfile.TemporaryFile()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=cwd)
    try:
        while time.perf_counter() - t0 < timeout:
            if health_status(port) == 200:
                dt = time.perf_counter() - t0
                after = then(port) if then is not None else None
                break
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}:\n{_read(log)}")
            time.sleep(POLL_S)
        else:
            raise RuntimeError(f"{cmd[0]}: no /health 200 within {timeout} s:\n{_read(log)}")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return dt, _read(log), after


def _read(log) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")


def fastserve_cmd(model: str, port: int) -> list[str]:
    return [sys.executable, "-m", "fastserve", "serve", "-m", model, "--port", str(port),
            "-np", str(N_SLOTS), "-c", str(N_CTX), "--log-disable"]


def llama_cmd(binary: str, model: str, port: int) -> list[str]:
    return [binary, "-m", model, "--port", str(port), "-np", str(N_SLOTS), "-c", str(N_CTX), "-t", "2"]


def llama_version(binary: str) -> str:
    """llama-server's own version line (it names the commit it was built from)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        return f"unknown ({exc})"
    text = (out.stdout + out.stderr).strip().splitlines()
    return next((line for line in text if "version" in line), text[0] if text else "unknown")


def run(model: str, rounds: int = 5, llama_server: str | None = None, trees: tuple[str, ...] = (),
        llama_commit: str | None = None, first_request: bool = False) -> dict:
    """{label: [seconds per round]} plus the start lines; rounds interleaved across the servers.
    first_request: also time each server's first chat request (first_chat), as "<label> first request"."""
    sides = {f"fastserve ({REPO.name})": str(REPO)}
    for t in trees:
        sides[f"fastserve ({Path(t).resolve().name})"] = str(Path(t).resolve())
    times: dict[str, list[float]] = {label: [] for label in sides}
    lines: dict[str, str] = {}
    if llama_server:
        times["llama-server"] = []
    then = first_chat if first_request else None
    for i in range(rounds + 1):             # round 0 warms the page cache and writes the .pyc files; not counted
        for label, tree in sides.items():
            port = free_port()
            env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}   # start as a user would
            env["PYTHONPATH"] = tree
            dt, err, first = time_to_health(fastserve_cmd(model, port), port, env=env, cwd=tree, then=then)
            if i == 0:
                continue
            times[label].append(dt)
            if first is not None:
                times.setdefault(f"{label} first request", []).append(first)
            lines[label] = next((x for x in err.splitlines() if "loaded" in x), "")
            weights = re.search(r"weights ([\d.]+) s", lines[label])   # start lines that name their phases
            if weights:
                times.setdefault(f"{label} - weights", []).append(dt - float(weights.group(1)))
        if llama_server:
            port = free_port()
            dt, _, first = time_to_health(llama_cmd(llama_server, model, port), port, then=then)
            if i:
                times["llama-server"].append(dt)
                if first is not None:
                    times.setdefault("llama-server first request", []).append(first)
    version = llama_version(llama_server) if llama_server else None
    if version and llama_commit:
        version += f"; built from commit {llama_commit}"
    return {"times": times, "lines": lines, "llama_version": version}


def report(out: dict) -> str:
    rows = [f"start -> /health 200, -np {N_SLOTS} -c {N_CTX} ({len(next(iter(out['times'].values())))} rounds):",
            f"{'server':<44} {'median s':>9} {'min s':>7} {'max s':>7}"]
    for label, ts in out["times"].items():
        rows.append(f"{label:<44} {statistics.median(ts):>9.3f} {min(ts):>7.3f} {max(ts):>7.3f}")
    for label, line in out["lines"].items():
        rows.append(f"{label}: {line.strip()}")
    if out["llama_version"]:
        rows.append(f"llama-server: {out['llama_version']}")
    else:
        rows.append("llama-server: skipped (no binary: pass --llama-server PATH or set FASTSERVE_LLAMA_SERVER)")
    return "\n".join(rows)


def test_start_to_health(benchmark):
    from fastserve.models.default_model import default_model_path
    out = benchmark.pedantic(run, args=(default_model_path(),),
                             kwargs={"rounds": 3, "llama_server": os.environ.get("FASTSERVE_LLAMA_SERVER"),
                                     "llama_commit": os.environ.get("FASTSERVE_LLAMA_COMMIT")},
                             rounds=1, iterations=1)
    print("\n" + report(out))
    benchmark.extra_info.update(out["times"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="GGUF path (default: the default model)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--llama-server", default=os.environ.get("FASTSERVE_LLAMA_SERVER"),
                    help="llama-server binary to measure side by side ($FASTSERVE_LLAMA_SERVER)")
    ap.add_argument("--llama-commit", default=os.environ.get("FASTSERVE_LLAMA_COMMIT"),
                    help="the llama.cpp commit the binary was built from, when its --version does not say "
                         "($FASTSERVE_LLAMA_COMMIT)")
    ap.add_argument("--tree", action="append", default=[], help="another fastserve checkout to measure too")
    ap.add_argument("--first-request", action="store_true",
                    help="also time each server's first chat request after /health 200 (4 tokens, greedy)")
    a = ap.parse_args()
    if a.model is None:
        sys.path.insert(0, str(REPO))
        from fastserve.models.default_model import default_model_path
        a.model = default_model_path()
    print(report(run(a.model, a.rounds, a.llama_server, tuple(a.tree), a.llama_commit, a.first_request)))


if __name__ == "__main__":
    main()
