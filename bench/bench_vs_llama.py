"""fastserve side by side with llama.cpp's llama-server on the same model, flags and load (issue 10's acceptance).

Both servers get `-np 32 -c 16384 -t 2` (fastserve's -t: the decode thread's compute threads) on the
default model (SmolLM2-135M-Instruct Q4_1) or -m. For each: seconds from start to the first /health
200 (median of --starts starts), RSS idle (after start, before any load), peak (sampled every 0.2 s
from /proc during the load) and after the load; then closed-loop streaming greedy /completion
requests of 128 tokens, prompts of 60-120 tokens (the same token ids for both), at 1, 8 and 32
clients: tokens/s, time to first token p50/p99, inter-token p50/p99/max and /health p50/p99 probed
at 10 Hz beside the load, all measured by the client. The levels are interleaved (fastserve then
llama-server at each level) so that both see the same machine noise; ratios are fastserve /
llama-server of one run. It names the llama.cpp commit measured against.

Run: python bench/bench_vs_llama.py --llama-server PATH [-m MODEL] [-np 32] [-c 16384] [--clients 1,8,32]
     [--quick] [--json out.json]
     (or LLAMA_SERVER=PATH in the environment); without a binary it says why and exits 0.
llama-server is built from source for the benchmark only (never committed). When its --version
says "commit unknown" (a source tree without .git), pass --llama-commit, else the bench looks for
the source tree of its build (CMakeCache.txt) and asks git there.
--quick: 10 s of warm-up and 30 s measured per level (the first wave of requests may be inside the
window at 32 clients, so its time to first token is a burst's); the default is 30 s + 90 s.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

from httpload import (MIB, HttpTokenizer, RssSampler, ServerProcess, closed_loop,  # noqa: E402
                      fastserve_command, free_port, pct_ms)

from fastserve.bench import make_prompts  # noqa: E402

N_PARALLEL, N_CTX, THREADS = 32, 16384, 2
LEVELS = (1, 8, 32)
N_PREDICT = 128
NAMES = ("fastserve", "llama-server")
# issue 10's bars on the ratios fastserve / llama-server
TOKS_BAR = {1: 1.3, 8: 1.6, 32: 2.0}
RSS_BAR = 1.1


def llama_command(binary: str, model: str, port: int) -> list[str]:
    return [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(N_PARALLEL),
            "-c", str(N_CTX), "-t", str(THREADS)]


def llama_version(binary: str, override: str | None = None) -> dict:
    """{'version': its --version line, 'commit': the llama.cpp commit, 'commit_from': where that came from}."""
    p = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    text = (p.stdout + p.stderr).strip()
    line = next((ln for ln in text.splitlines() if ln.startswith("version")), text.splitlines()[0] if text else "")
    out = {"version": line, "commit": None, "commit_from": None}
    m = re.search(r"commit ([0-9a-f]{7,40})", text)
    if override:
        out.update(commit=override, commit_from="--llama-commit")
    elif m:
        out.update(commit=m.group(1), commit_from="llama-server --version")
    else:
        src = _build_source_dir(Path(binary).resolve())
        if src is not None:
            g = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True)
            if g.returncode == 0:
                out.update(commit=g.stdout.strip(), commit_from=f"git rev-parse HEAD in {src}")
        if out["commit"] is None:
            out.update(commit="unknown", commit_from=f"--version says {line!r} and the source tree "
                       f"({src or 'not found'}) is not a git checkout: pass --llama-commit")
    return out


def _build_source_dir(binary: Path) -> Path | None:
    for d in binary.parents:
        cache = d / "CMakeCache.txt"
        if cache.is_file():
            m = re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.+)$", cache.read_text(errors="replace"), re.M)
            return Path(m.group(1)) if m else None
    return None


def commands(model: str, llama_server: str):
    """name -> (port -> argv)"""
    return {"fastserve": lambda port: fastserve_command(model, port, N_PARALLEL, N_CTX, THREADS, "--log-disable"),
            "llama-server": lambda port: llama_command(llama_server, model, port)}


def start(name: str, cmd, logdir: Path) -> ServerProcess:
    port = free_port()
    return ServerProcess(cmd(port), port, logdir / f"{name}-{port}.log")


def measure_starts(cmds: dict, n: int, logdir: Path) -> dict:
    """name -> [seconds from start to /health 200], the servers taking turns."""
    out = {name: [] for name in cmds}
    for _ in range(n):
        for name, cmd in cmds.items():
            srv = start(name, cmd, logdir)
            out[name].append(srv.ready_s)
            srv.stop()
    return out


def run(model: str, llama_server: str, quick: bool, starts: int, llama_commit: str | None = None,
        levels=LEVELS) -> dict:
    import uvloop
    warmup_s, seconds = (10.0, 30.0) if quick else (30.0, 90.0)
    logdir = Path(tempfile.mkdtemp(prefix="bench_vs_llama-"))
    cmds = commands(model, llama_server)
    out = {"model": model, "flags": {"np": N_PARALLEL, "c": N_CTX, "t": THREADS}, "n_predict": N_PREDICT,
           "warmup_s": warmup_s, "seconds": seconds, "llama": llama_version(llama_server, llama_commit),
           "logs": str(logdir), "loadavg_start": os.getloadavg(), "cpus": os.cpu_count(),
           "ready_s": measure_starts(cmds, starts, logdir), "servers": {}, "rows": []}
    servers, samplers = {}, {}
    try:
        for name, cmd in cmds.items():
            servers[name] = start(name, cmd, logdir)
        time.sleep(2.0)
        for name, srv in servers.items():
            out["servers"][name] = {"rss_idle_mib": srv.rss() / MIB}
            samplers[name] = RssSampler(srv.pid)
        prompts = make_prompts(HttpTokenizer(servers["fastserve"].port), 64, lo=60, hi=120)
        for clients in levels:
            for name, srv in servers.items():
                w = uvloop.run(closed_loop(srv.port, prompts, clients, seconds, warmup_s, N_PREDICT))
                row = {"server": name, **w.result.row(), "health_p50_ms": pct_ms(w.probes["/health"], 50),
                       "health_p99_ms": pct_ms(w.probes["/health"], 99), "health_n": len(w.probes["/health"]),
                       "rss_peak_mib": samplers[name].peak(w.t_measure - warmup_s, w.t_end) / MIB,
                       "errors": w.errors, "loadavg_1m": os.getloadavg()[0]}
                out["rows"].append(row)
                print(f"  {name:12s} {clients:2d} clients: {row['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
                time.sleep(2.0)            # the cancelled streams' slots come free
        time.sleep(3.0)
        for name, srv in servers.items():
            s = out["servers"][name]
            s["rss_peak_mib"] = samplers[name].peak() / MIB
            s["rss_after_mib"] = srv.rss() / MIB
    finally:
        for name, srv in servers.items():
            if name in samplers:
                samplers[name].close()
            out["servers"].setdefault(name, {})["exit_code"], _ = srv.stop()
    out["loadavg_end"] = os.getloadavg()
    out["ratios"] = ratios(out)
    return out


def ratios(out: dict) -> dict:
    """fastserve / llama-server, per level and for start time and RSS."""
    by = {(r["server"], r["clients"]): r for r in out["rows"]}
    keys = ("tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_ms", "itl_p99_ms", "itl_max_ms", "health_p50_ms",
            "health_p99_ms")
    per_level = {}
    for clients in sorted({r["clients"] for r in out["rows"]}):
        a, b = by.get(("fastserve", clients)), by.get(("llama-server", clients))
        if a and b:
            per_level[clients] = {k: _ratio(a[k], b[k]) for k in keys}
    med = {n: sorted(v)[len(v) // 2] for n, v in out["ready_s"].items()}
    fs, ll = out["servers"]["fastserve"], out["servers"]["llama-server"]
    return {"levels": per_level, "ready_s": _ratio(med["fastserve"], med["llama-server"]),
            "rss_idle": _ratio(fs.get("rss_idle_mib"), ll.get("rss_idle_mib")),
            "rss_peak": _ratio(fs.get("rss_peak_mib"), ll.get("rss_peak_mib"))}


def _ratio(a, b) -> float:
    return a / b if a is not None and b else float("nan")


def report(out: dict) -> str:
    ll = out["llama"]
    lines = [f"fastserve vs llama-server {ll['version']} — llama.cpp commit {ll['commit']} ({ll['commit_from']})",
             f"model {Path(out['model']).name}; both -np {N_PARALLEL} -c {N_CTX} -t {THREADS}; streaming /completion, "
             f"greedy, n_predict {N_PREDICT}, prompts 60-120 tokens; {out['warmup_s']:g} s warm-up + "
             f"{out['seconds']:g} s measured per level, interleaved", "",
             f"{'server':12s} {'clients':>7} {'tok/s':>7} {'ttft p50':>9} {'p99':>7} {'itl p50':>8} {'p99':>6} "
             f"{'max':>7} {'health p50':>11} {'p99':>7} {'RSS peak':>9} {'load':>5} errors"]
    for r in out["rows"]:
        lines.append(f"{r['server']:12s} {r['clients']:>7} {r['tok_s']:>7.1f} {r['ttft_p50_s']:>8.2f}s "
                     f"{r['ttft_p99_s']:>6.2f}s {r['itl_p50_ms']:>6.0f}ms {r['itl_p99_ms']:>4.0f}ms "
                     f"{r['itl_max_ms']:>5.0f}ms {r['health_p50_ms']:>9.2f}ms {r['health_p99_ms']:>5.2f}ms "
                     f"{r['rss_peak_mib']:>6.0f}MiB {r['loadavg_1m']:>5.1f} {r['errors'] or ''}")
    lines += ["", "ratios fastserve / llama-server (tok/s: higher is better; the rest: lower is better)",
              f"{'clients':>7} {'tok/s':>7} {'bar':>5} {'ttft p50':>9} {'p99':>6} {'itl p50':>8} {'p99':>6} "
              f"{'max':>6} {'health p99':>11}"]
    for clients, q in out["ratios"]["levels"].items():
        bar = TOKS_BAR.get(clients)
        mark = "" if bar is None else (f">={bar:g} " + ("ok" if q["tok_s"] >= bar else "NO"))
        lines.append(f"{clients:>7} {q['tok_s']:>7.2f} {mark:>8} {q['ttft_p50_s']:>6.2f} {q['ttft_p99_s']:>6.2f} "
                     f"{q['itl_p50_ms']:>8.2f} {q['itl_p99_ms']:>6.2f} {q['itl_max_ms']:>6.2f} "
                     f"{q['health_p99_ms']:>11.2f}")
    lines.append("")
    for name, s in out["servers"].items():
        rs = out["ready_s"][name]
        lines.append(f"{name:12s} start -> /health 200 {sorted(rs)[len(rs) // 2]:.2f} s (of {len(rs)}: "
                     f"{', '.join(f'{x:.2f}' for x in rs)}); RSS idle {s.get('rss_idle_mib', 0):.0f} MiB, "
                     f"peak {s.get('rss_peak_mib', 0):.0f} MiB, after the load {s.get('rss_after_mib', 0):.0f} MiB; "
                     f"exit code {s.get('exit_code')}")
    la = ", ".join(f"{x:.1f}" for x in out["loadavg_start"])
    lines.append(f"machine: {out['cpus']} CPUs, load average {la} at the start (load: its 1-minute figure after each "
                 f"row); llama-server's -t {THREADS} threads wait by spinning, and slow down far more than fastserve "
                 f"when other programs take the cores: read the ratios of a busy machine with that in mind")
    q = out["ratios"]
    lines.append(f"ratios: start {q['ready_s']:.2f}, RSS idle {q['rss_idle']:.2f} (bar <= {RSS_BAR}), "
                 f"RSS peak {q['rss_peak']:.2f} (bar <= {RSS_BAR})")
    r32 = next((r for r in out["rows"] if r["server"] == "fastserve" and r["clients"] == 32), None)
    if r32:
        lines.append(f"fastserve at 32 clients: inter-token max {r32['itl_max_ms']:.0f} ms (bar <= 1000), "
                     f"/health p99 {r32['health_p99_ms']:.2f} ms (bar <= 8)")
    return "\n".join(lines)


def main(argv=None) -> int:
    global N_PARALLEL, N_CTX            # -np / -c: what both commands and the report read
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                    help="llama-server binary (default: $LLAMA_SERVER)")
    ap.add_argument("--llama-commit", help="the llama.cpp commit the binary was built from, when it cannot tell")
    ap.add_argument("-m", "--model", help="GGUF path (default: the default model)")
    ap.add_argument("--quick", action="store_true", help="10 s warm-up + 30 s per level instead of 30 + 90")
    ap.add_argument("--starts", type=int, help="starts of each server timed (default: 1 with --quick, else 3)")
    ap.add_argument("--clients", default=",".join(map(str, LEVELS)))
    ap.add_argument("-np", "--parallel", type=int, default=N_PARALLEL, help="slots of both servers")
    ap.add_argument("-c", "--ctx-size", type=int, default=N_CTX, help="context of both servers (all slots)")
    ap.add_argument("--json", default="bench_vs_llama.json", help="where the figures go (JSON)")
    a = ap.parse_args(argv)
    N_PARALLEL, N_CTX = a.parallel, a.ctx_size
    if not a.llama_server:
        print("bench_vs_llama: skipped: no llama-server binary given (--llama-server PATH or LLAMA_SERVER=PATH); "
              "build llama.cpp's llama-server from source for it (never committed). Without one, "
              "bench/bench_forward_bound.py measures the batch-1 forward pass against the memory bound.")
        return 0
    if not os.access(a.llama_server, os.X_OK):
        print(f"bench_vs_llama: skipped: {a.llama_server} is not an executable file (is the build finished?)")
        return 0
    import fastserve
    model = a.model or fastserve.default_model_path()
    out = run(model, a.llama_server, a.quick, a.starts or (1 if a.quick else 3), a.llama_commit,
              tuple(int(x) for x in a.clients.split(",")))
    print(report(out))
    Path(a.json).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    print(f"figures: {a.json}; server logs: {out['logs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
