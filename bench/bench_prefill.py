"""Long prompts on one model (-m; the default model unless given), side by side: fastserve (this tree),
optionally an older fastserve tree (--before, e.g. /work/main) and llama-server (--llama-server PATH).
Issue 19's bars.

1. Prefill: prompts of --sizes tokens (default 700, 1k, 2k, 4k, 6k; one slot, n_predict 1, no prompt
   reuse): seconds from the request to its answer and prompt tokens/s.
2. Decode with a long context: a --decode-context-token prompt (2k), then --decode-tokens (128)
   generated tokens (end of generation ignored): tokens/s of the generation alone, from the first
   token to the last (llama-server: its own `timings.predicted_per_second`).
3. The share of a decode step spent in attention, at 1 slot holding 2k tokens and at 32 slots
   holding 256 each (fastserve trees only; --no-share skips it).
fastserve runs in-process (in a worker process per tree, so that two trees can be compared), with one
slot of -c tokens (default 8192); llama-server runs as `-np 1 -c CTX -t THREADS` and is asked
POST /completion {prompt: ids, n_predict, cache_prompt: false}. The systems take turns, prompt by prompt, repeat by repeat (noisy
shared machines: only ratios from one run mean anything); the best of --repeat is reported (the
--before tree runs once). --json FILE writes every figure; --plot FILE.png the prefill time against
prompt length of every system (matplotlib, Agg).

Run: python bench/bench_prefill.py --llama-server /work/llama-peer/build/bin/llama-server --threads 2 \
         --repeat 2 --json /tmp/prefill.json --plot /tmp/prefill.png
Without a llama-server binary it says why and measures fastserve alone. Gemma 3 at long context:
    python bench/bench_prefill.py -m "$(python -c 'from fastserve.models.catalog import model_path; print(model_path("gemma3-270m"))')" \
         -c 16384 --sizes 2000,8000 --decode-context 8000 --llama-server /work/llama-peer/build/bin/llama-server
On a machine whose cores other processes share, use --threads 1: llama-server's threads wait on each other
(at -t 2 on 2 busy cores its decoding fell to 0.7-18 tok/s from 45 at -t 1).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZES = (700, 1000, 2000, 4000, 6000)
BARS = (700, 2000, 6000)            # the acceptance rows: prefill >= 1.3x llama-server's


def prompt_ids(tokenizer, n: int) -> list:
    """n token ids of ordinary text (this repository's sources), the same for every system."""
    text = "\n".join(p.read_text(errors="replace") for p in sorted((REPO / "fastserve").rglob("*.py")))
    ids = tokenizer.encode(text, add_special=False)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


# -- a fastserve worker: one process per tree, commands on stdin, one JSON line per answer ----------

def worker(threads: int, model_file: str, n_ctx: int) -> None:
    import numpy as np
    import fastserve
    from fastserve.backends.cpu import backend as cpu_backend

    model = fastserve.load_model(model_file)
    kw = {"threads": threads}
    try:                    # an f16 KV cache on every tree that has the choice
        engine = fastserve.Engine(model, n_parallel=1, n_ctx=n_ctx, cache_type_k="f16", cache_type_v="f16", **kw)
    except TypeError:       # a tree from before the KV cache types
        engine = fastserve.Engine(model, n_parallel=1, n_ctx=n_ctx, **kw)
    print(json.dumps({"ready": fastserve.__file__, "kv": getattr(engine, "cache_type_k", "f32")}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "prefill":
            ids = prompt_ids(model.tokenizer, int(cmd[1]))
            t0 = time.perf_counter()
            engine.generate(ids, max_tokens=1, temperature=0, cache_prompt=False)
            print(json.dumps({"s": time.perf_counter() - t0}), flush=True)
        elif cmd[0] == "decode":
            print(json.dumps(_decode_rate(engine, model.tokenizer, int(cmd[1]), int(cmd[2]))), flush=True)
        elif cmd[0] == "share":
            print(json.dumps(_attention_share(model, cpu_backend, int(cmd[1]), int(cmd[2]), threads, np)),
                  flush=True)
    engine.close()


def _decode_rate(engine, tokenizer, n_context: int, n_gen: int) -> dict:
    """Tokens/s of n_gen greedy tokens after an n_context-token prompt, first token to last."""
    no_eog = {int(t): -100.0 for t in tokenizer.eog_ids}
    reader = engine.submit(prompt_ids(tokenizer, n_context), max_tokens=n_gen, temperature=0,
                           cache_prompt=False, logit_bias=no_eog).reader
    stamps, n = [], 0
    for batch in reader.batches(timeout=600):
        stamps.append(time.perf_counter())
        n += len(batch)
    return {"tok_s": (n - 1) / (stamps[-1] - stamps[0]), "n": n}


def _attention_share(model, nb, n_slots: int, n_held: int, threads: int, np) -> dict:
    """ms of a decode step and of its attention calls, each slot holding n_held tokens."""
    cfg = model.config
    be = nb.CpuBackend(cfg, model.weights, n_slots, max(n_held + 16, 64), threads=threads)
    spent = [0.0]

    def timed(f):
        def call(*a, **kw):
            t0 = time.perf_counter()
            r = f(*a, **kw)
            spent[0] += time.perf_counter() - t0
            return r
        return call

    if hasattr(be, "reference"):            # the C forward calls attention from C: time the reference
        be.reference = True                 # forward's calls (the same attention; its glue is NumPy's)
    if hasattr(be, "_attn"):
        be._attn = timed(be._attn)
    else:                                   # an older tree: a module-level attend()
        nb.attend = timed(nb.attend)
    ids = prompt_ids(model.tokenizer, n_held)
    for s in range(n_slots):
        for c in range(0, n_held, 512):
            pos = np.arange(c, min(n_held, c + 512))
            be.forward(np.asarray(ids)[pos], pos, np.full(len(pos), s), [len(pos) - 1])
    steps, total = 8, 0.0
    spent[0] = 0.0
    for i in range(steps):
        pos = np.full(n_slots, n_held + i)
        t0 = time.perf_counter()
        be.forward(np.full(n_slots, ids[i]), pos, np.arange(n_slots), np.arange(n_slots))
        total += time.perf_counter() - t0
    return {"step_ms": total / steps * 1e3, "attn_ms": spent[0] / steps * 1e3}


class Worker:
    def __init__(self, tree: Path, threads: int, model: str, n_ctx: int):
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", "--threads", str(threads),
                                   "-m", model, "-c", str(n_ctx)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=str(tree))
        self.info = self._read()

    def _read(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError("the fastserve worker exited")
        return json.loads(line)

    def ask(self, cmd: str) -> dict:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(30)


class LlamaServer:
    def __init__(self, binary: str, model: str, threads: int, n_ctx: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.p = subprocess.Popen([binary, "-m", model, "-np", "1", "-c", str(n_ctx), "-t", str(threads),
                                   "--port", str(self.port), "--host", "127.0.0.1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("llama-server did not become healthy within 120 s")

    def _complete(self, ids: list, n_predict: int) -> dict:
        body = json.dumps({"prompt": ids, "n_predict": n_predict, "cache_prompt": False, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def prefill(self, ids: list) -> float:
        t0 = time.perf_counter()
        self._complete(ids, 1)
        return time.perf_counter() - t0

    def decode(self, ids: list, n_gen: int) -> dict:
        t = self._complete(ids, n_gen)["timings"]
        return {"tok_s": t["predicted_per_second"], "n": t["predicted_n"]}

    def close(self) -> None:
        self.p.send_signal(signal.SIGTERM)       # it finishes a prompt in progress first
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(10)


def plot(report: dict, path: str) -> None:
    """Prefill seconds against prompt tokens, one line per system, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in report["prefill_s"].items():
        xs = sorted(int(n) for n in pts)
        ax.plot(xs, [pts[str(n)] for n in xs], marker="o", label=name)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("seconds to the answer (n_predict 1)")
    ax.set_title(f"prefill, {Path(report['model']).name}, -np 1 -c {report['n_ctx']}, {report['threads']} threads "
                 f"(best of {report['repeat']})", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", help="path of a llama-server binary to compare against")
    ap.add_argument("--llama-commit", help="the llama.cpp commit of --llama-server, when its --version cannot say")
    ap.add_argument("--before", help="another fastserve tree (built in place) to compare against")
    ap.add_argument("-m", "--model", help="the GGUF file (default: the default model)")
    ap.add_argument("-c", "--ctx", type=int, default=8192, help="context of the one slot, both systems")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--decode-context", type=int, default=2048, help="prompt tokens before the decode measurement")
    ap.add_argument("--decode-tokens", type=int, default=128, help="generated tokens measured (0: skip)")
    ap.add_argument("--no-share", action="store_true", help="skip the decode-step attention share")
    ap.add_argument("--json", help="write every figure to this JSON file")
    ap.add_argument("--plot", help="write prefill seconds against prompt tokens to this PNG")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.model is None:
        sys.path.insert(0, str(REPO))
        import fastserve
        a.model = fastserve.default_model_path()
    if a.worker:
        worker(a.threads, a.model, a.ctx)
        return 0
    sizes = [int(s) for s in a.sizes.split(",")]
    too_long = [n for n in sizes + [a.decode_context + a.decode_tokens] if n >= a.ctx]
    if too_long:
        ap.error(f"-c {a.ctx} does not hold {too_long[0]} tokens")
    systems = {"fastserve": Worker(REPO, a.threads, a.model, a.ctx)}
    if a.before:
        systems["before"] = Worker(Path(a.before).resolve(), a.threads, a.model, a.ctx)
    for name, w in systems.items():
        print(f"{name}: {w.info['ready']} (KV {w.info['kv']}, {a.threads} threads)")
    if a.llama_server and os.access(a.llama_server, os.X_OK):
        sys.path.insert(0, str(REPO))
        import fastserve
        sys.path.insert(0, str(REPO / "bench"))
        from bench_vs_llama import llama_version
        llama = llama_version(a.llama_server, a.llama_commit)
        systems["llama-server"] = LlamaServer(a.llama_server, a.model, a.threads, a.ctx)
        print(f"llama-server: {a.llama_server} (llama.cpp {llama['commit']}, from {llama['commit_from']}), "
              f"-np 1 -c {a.ctx} -t {a.threads}")
        tok = fastserve.load_model(a.model).tokenizer
    else:
        print("llama-server: skipped (" + ("no --llama-server given" if not a.llama_server else
                                         f"{a.llama_server} is not an executable") + ")")
        tok = None
    best: dict = {}
    decode: dict = {}
    shares: dict = {}
    try:
        for rep in range(a.repeat):
            for n in sizes:
                for name, sysm in systems.items():
                    if name == "before" and rep > 0:      # an old tree is slow on long prompts: once
                        continue
                    s = sysm.prefill(prompt_ids(tok, n)) if name == "llama-server" else sysm.ask(f"prefill {n}")["s"]
                    best[name, n] = min(best.get((name, n), s), s)
                    print(f"  rep {rep} {name:12s} {n:5d} tokens: {s:6.2f} s", flush=True)
            if a.decode_tokens:
                for name, sysm in systems.items():
                    if name == "before" and rep > 0:
                        continue
                    r = (sysm.decode(prompt_ids(tok, a.decode_context), a.decode_tokens) if name == "llama-server"
                         else sysm.ask(f"decode {a.decode_context} {a.decode_tokens}"))
                    decode[name] = max(decode.get(name, 0.0), r["tok_s"])
                    print(f"  rep {rep} {name:12s} decode after {a.decode_context}: {r['tok_s']:6.1f} tok/s "
                          f"({r['n']} tokens)", flush=True)
        names = list(systems)
        print("\n| prompt tokens | " + " | ".join(f"{x} s (tok/s)" for x in names) +
              "".join(f" | fastserve vs {x}" for x in names[1:]) + " |")
        print("| --- " * (1 + 2 * len(names) - 1) + "|")
        for n in sizes:
            cells = [f"{best[x, n]:.2f} ({n / best[x, n]:.0f})" for x in names]
            ratios = [f"{best[x, n] / best['fastserve', n]:.2f}x" for x in names[1:]]
            bar = " (bar 1.3x)" if n in BARS and "llama-server" in names else ""
            print(f"| {n}{bar} | " + " | ".join(cells + ratios) + " |")
        if decode:
            print(f"\n| decode at {a.decode_context} tokens, 1 client | " + " | ".join(f"{x} tok/s" for x in decode) +
                  "".join(f" | fastserve vs {x}" for x in list(decode)[1:]) + " |")
            print("| --- " * (1 + 2 * len(decode) - 1) + "|")
            print("| best of runs | " + " | ".join(f"{v:.1f}" for v in decode.values()) +
                  "".join(f" | {decode['fastserve'] / v:.2f}x" for v in list(decode.values())[1:]) + " |")
        if not a.no_share:
            print("\ndecode step, attention share:")
            for name, sysm in systems.items():
                if name == "llama-server":
                    continue
                for slots, held in ((1, 2048), (32, 256)):
                    r = sysm.ask(f"share {slots} {held}")
                    shares[f"{name} {slots}x{held}"] = r
                    print(f"  {name:10s} {slots:2d} slot(s) x {held} tokens: step {r['step_ms']:.1f} ms, attention "
                          f"{r['attn_ms']:.2f} ms ({100 * r['attn_ms'] / r['step_ms']:.0f} %)", flush=True)
        report = {"model": a.model, "n_ctx": a.ctx, "threads": a.threads, "repeat": a.repeat, "load_avg": os.getloadavg(),
                  "systems": {x: (systems[x].info if x != "llama-server" else
                                  {"binary": a.llama_server, **llama}) for x in names},
                  "prefill_s": {x: {str(n): best[x, n] for n in sizes if (x, n) in best} for x in names},
                  "decode_context": a.decode_context, "decode_tok_s": decode, "attention_share": shares}
        if a.json:
            Path(a.json).write_text(json.dumps(report, indent=1))
            print(f"wrote {a.json}")
        if a.plot:
            plot(report, a.plot)
            print(f"wrote {a.plot}")
    finally:
        for sysm in systems.values():
            sysm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
