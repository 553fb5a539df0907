"""HTTP serving under closed-loop streaming load on the default model, and what HTTP costs the decode thread.

For 1, 8 and 32 concurrent clients (streaming /completion, n_predict 128, greedy, prompts of
60-100 tokens): aggregate tokens/s, time to first token p50/p99, inter-token p50/p99/max, and
/health and /slots latency (p50/p99, polled at 10 Hz each) under that load. Then the mean decode
step time (the tracer's phases, from /metrics) at 32 HTTP clients against the same load run
in-process with no HTTP at all: the ratio is the HTTP loop's cost to the decode thread.

Run: python bench/bench_http.py [--seconds 30] [--clients 1,8,32]
 or: pytest bench/bench_http.py --benchmark-only -s   (make bench)
The clients are bench/httpload.py's raw asyncio sockets (uvloop) in this process.
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from httpload import ServerProcess, closed_loop, fastserve_command, free_port, get_once, pct_ms  # noqa: E402

from fastserve.bench import closed_loop as inproc_closed_loop, format_rows, make_prompts  # noqa: E402

N_SLOTS, N_CTX = 32, 32 * 256


async def _server_counters(port) -> tuple[float, float, float, float, float]:
    """(Σ phase sums, phase observations, generated tokens, prompt tokens, steps) from /metrics."""
    text = (await get_once(port, "/metrics"))[1].decode()
    sums = {m.group(1): float(m.group(2)) for m in re.finditer(r'fastserve_step_phase_seconds_sum\{phase="(\w+)"\} (\S+)', text)}
    counts = {m.group(1): float(m.group(2)) for m in re.finditer(r'fastserve_step_phase_seconds_count\{phase="(\w+)"\} (\S+)', text)}
    gen = float(re.search(r"^fastserve_generated_tokens_total (\S+)$", text, re.M).group(1))
    prompt = float(re.search(r"^fastserve_prompt_tokens_total (\S+)$", text, re.M).group(1))
    steps = float(re.search(r"^fastserve_decode_steps_total (\S+)$", text, re.M).group(1))
    return sum(sums.values()), max(counts.values(), default=0.0), gen, prompt, steps


async def http_load(port, prompts, clients: int, seconds: float, warmup_s: float, n_predict: int = 128):
    w = await closed_loop(port, prompts, clients, seconds, warmup_s, n_predict,
                          at_window=lambda: _server_counters(port), probes=("/health", "/slots"))
    s0, s1 = w.marks
    res = w.result
    res.tokens = int(s1[2] - s0[2])            # the server's count of tokens generated in the window
    step_ms = (s1[0] - s0[0]) / (s1[1] - s0[1]) * 1e3 if s1[1] > s0[1] else float("nan")
    work = _work(res.seconds, s1[2] - s0[2], s1[3] - s0[3], s1[4] - s0[4])
    return res, w.probes["/health"], w.probes["/slots"], step_ms, work


def _work(seconds, generated, prompt, steps) -> dict:
    """The decode thread's pace over a window: wall ms per step, batch tokens per step, and ms per
    batch token (which does not depend on how full the steps were)."""
    tokens = generated + prompt
    return {"ms_per_step": seconds * 1e3 / max(steps, 1), "tokens_per_step": tokens / max(steps, 1),
            "ms_per_token": seconds * 1e3 / max(tokens, 1)}


def run(model_path: str, clients_list=(1, 8, 32), seconds: float = 40.0, warmup_s: float = 20.0,
        threads: int = 1) -> dict:
    import uvloop

    import fastserve
    model = fastserve.load_model(model_path)
    prompts = make_prompts(model.tokenizer, 64)
    out = {"rows": [], "probes": []}
    port = free_port()
    srv = ServerProcess(fastserve_command(model_path, port, N_SLOTS, N_CTX, threads, "--log-disable"), port,
                        tempfile.NamedTemporaryFile(suffix=".log", delete=False).name)
    try:
        for clients in clients_list:
            res, health, slots, step_ms, work = uvloop.run(http_load(port, prompts, clients, seconds, warmup_s))
            out["rows"].append(res.row())
            out["probes"].append({"clients": clients, "health_p50_ms": pct_ms(health, 50),
                                  "health_p99_ms": pct_ms(health, 99), "slots_p50_ms": pct_ms(slots, 50),
                                  "slots_p99_ms": pct_ms(slots, 99), "step_ms": step_ms, "work": work})
    finally:
        out["exit_code"] = srv.stop()[0]
    # the same load, in-process, no HTTP
    clients = max(clients_list)
    engine = fastserve.Engine(model, n_parallel=N_SLOTS, n_ctx=N_CTX, trace=True, threads=threads)
    with engine:
        mark = {}

        def measure_start():
            mark["trace"] = engine.trace_totals()
            snap = engine.snapshot
            mark["t"], mark["gen"], mark["prompt"], mark["step"] = (time.perf_counter(), snap.tokens_generated,
                                                                    snap.tokens_prompt, snap.step)
        timer = threading.Timer(warmup_s, measure_start)
        timer.start()
        res = inproc_closed_loop(engine, prompts, clients, seconds, warmup_s=warmup_s)
        summary = engine.trace_summary(mark["trace"])
        snap = engine.snapshot
        res.tokens = snap.tokens_generated - mark["gen"]
        res.seconds = time.perf_counter() - mark["t"]
        out["inproc_row"] = res.row()
        out["inproc_step_ms"] = summary["step_ms"]
        out["inproc_work"] = _work(res.seconds, res.tokens, snap.tokens_prompt - mark["prompt"], snap.step - mark["step"])
    out["http_step_ms"] = out["probes"][-1]["step_ms"]
    out["ratio"] = out["http_step_ms"] / out["inproc_step_ms"]
    out["ratio_per_token"] = out["probes"][-1]["work"]["ms_per_token"] / out["inproc_work"]["ms_per_token"]
    return out


def report(out: dict) -> str:
    lines = ["HTTP, streaming /completion, n_predict 128, greedy:", format_rows(out["rows"]), "",
             f"{'clients':>7} {'/health p50':>12} {'p99':>8} {'/slots p50':>11} {'p99':>8} {'step ms':>8}"]
    for p in out["probes"]:
        lines.append(f"{p['clients']:>7} {p['health_p50_ms']:>10.2f}ms {p['health_p99_ms']:>6.2f}ms "
                     f"{p['slots_p50_ms']:>9.2f}ms {p['slots_p99_ms']:>6.2f}ms {p['step_ms']:>8.1f}")
    lines += ["", "in-process, same load, no HTTP:", format_rows([out["inproc_row"]]), "",
              f"decode step: {out['http_step_ms']:.1f} ms with HTTP clients vs {out['inproc_step_ms']:.1f} ms "
              f"in-process: ratio {out['ratio']:.3f} (target <= 1.05); server exit code {out['exit_code']}"]
    hw, iw = out["probes"][-1]["work"], out["inproc_work"]
    lines.append(f"decode thread per batch token: {hw['ms_per_token']:.2f} ms with HTTP "
                 f"({hw['tokens_per_step']:.1f} tokens/step, {hw['ms_per_step']:.1f} ms/step) vs "
                 f"{iw['ms_per_token']:.2f} ms in-process ({iw['tokens_per_step']:.1f} tokens/step, "
                 f"{iw['ms_per_step']:.1f} ms/step): ratio {out['ratio_per_token']:.3f}")
    return "\n".join(lines)


def test_http_load(benchmark):
    from fastserve.models.default_model import default_model_path
    out = benchmark.pedantic(run, args=(default_model_path(),), kwargs={"seconds": 20.0}, rounds=1, iterations=1)
    print("\n" + report(out))
    benchmark.extra_info.update({"ratio": out["ratio"], "rows": out["rows"], "probes": out["probes"]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="GGUF path (default: the default model)")
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--warmup", type=float, default=20.0)
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("-t", "--threads", type=int, default=1)
    a = ap.parse_args()
    from fastserve.models.default_model import default_model_path
    out = run(a.model or default_model_path(), tuple(int(x) for x in a.clients.split(",")), a.seconds, a.warmup,
              a.threads)
    print(report(out))


if __name__ == "__main__":
    main()
