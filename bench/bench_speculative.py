"""Speculative decoding (issue 26's acceptance): fastserve plain, fastserve with each n-gram drafter, and
llama-server with its own --spec-type ngram-mod (and without), on the same model, prompts and flags.

1. One client, three tasks, greedy, the same prompt token ids for every system (the model's chat template,
   applied here): a code edit (a 300-line source file of this repository, to be returned with one function
   renamed), a summary that quotes its text, and free chat. Each system answers each task, the
   systems taking turns request by request, --repeat times; decode tokens/s (the best run) is the server's
   own timings.predicted_per_second (the prompt's pass excluded), with draft_n / draft_n_accepted where it drafted. fastserve's speculative
   answers must be its plain answers, token for token.
2. Under load (fastserve only): --load-clients closed-loop streaming clients (8 and 32) of the bench's
   usual 60-100-token prompts and 128-token greedy answers, speculation off and on (ngram-mod): the
   aggregate tokens/s of each (the bar: on >= 0.97x off).
3. A draft model (--draft-model FILE: the system "fastserve draft-model", -md FILE, in the one-client table; its
   speed-up is reported, with no bar). The issue's case: the default model drafting for a larger model of its
   vocabulary; none is at hand, so --write-1b PATH writes one once (Llama-3.2-1B's shape, random Q8_0 weights,
   the draft model's vocabulary) and serves it as the model. Its random weights are no
   language, so a real draft model agrees with it only where it repeats itself.

Run: python bench/bench_speculative.py [--llama-server /work/llama-peer/build/bin/llama-server] [-m MODEL]
         [--threads 2] [--max-tokens 1024] [--load-seconds 30] [--json out.json]
     python bench/bench_speculative.py --draft-model ~/.cache/fastserve/SmolLM2-135M-Instruct.Q4_1.gguf
         --write-1b /tmp/fastserve-sizes/1b-smollm2-vocab-q8_0.gguf --drafters '' --load-clients ''
         --tasks 'free chat,quoting summary' --max-tokens 64 --repeat 1
Without a llama-server binary its columns are skipped, saying why. Machines shared with other work are
noisy: only the ratios of one run mean anything.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

from httpload import ServerProcess, closed_loop, fastserve_command, free_port, post_once  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
N_CTX = 8192
SPEC = {"ngram-mod": ["--spec-type", "ngram-mod"], "ngram-simple": ["--spec-type", "ngram-simple"]}
BARS = {"code edit": 2.0, "quoting summary": 1.5, "free chat": 0.97}    # speculative / plain fastserve
LLAMA_BAR = 1.3                                                        # code edit: / llama-server ngram-mod
LOAD_BAR = 0.97


def tasks() -> dict:
    """task -> its user message."""
    source = (REPO / "fastserve" / "server" / "protocol.py").read_text().splitlines()[:300]
    text = (REPO / "ARCHITECTURE.md").read_text().split("\n## ")[1][:2500]
    return {
        "code edit": "Here is a Python file. Return the whole file unchanged, except that the function "
                     "`_dispatch` is renamed to `_route` everywhere. Answer with the code only.\n\n"
                     "```python\n" + "\n".join(source) + "\n```",
        "quoting summary": "Summarize the following text. Quote its most important sentences word for word.\n\n"
                           + text,
        "free chat": "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
    }


def start(name: str, argv, logdir: Path) -> ServerProcess:
    port = free_port()
    return ServerProcess(argv(port), port, logdir / f"{name}-{port}.log")


def complete(port: int, ids: list, max_tokens: int) -> dict:
    body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "cache_prompt": False, "return_tokens": True}
    status, raw = asyncio.run(post_once(port, "/completion", body))
    if status != 200:
        raise RuntimeError(f"/completion answered {status}: {raw[:300]!r}")
    return orjson.loads(raw)


def one_client(systems: dict, prompts: dict, max_tokens: int, repeat: int, logdir: Path) -> dict:
    """system -> task -> {tok_s (the best of repeat), runs, n, draft_n, draft_n_accepted, tokens}; each server
    started once, the systems taking turns request by request."""
    out = {name: {} for name in systems}
    running = {name: start(name, argv, logdir) for name, argv in systems.items()}
    try:
        for task, ids in prompts.items():
            for _ in range(repeat):
                for name, srv in running.items():
                    r = complete(srv.port, ids, max_tokens)
                    t = r["timings"]
                    row = out[name].setdefault(task, {"runs": [], "tokens": r.get("tokens", [])})
                    row["runs"].append(t["predicted_per_second"])
                    row.update(tok_s=max(row["runs"]), n=t["predicted_n"], draft_n=t.get("draft_n", 0),
                               draft_n_accepted=t.get("draft_n_accepted", 0))
                    print(f"  {task:16s} {name:24s} {t['predicted_per_second']:8.1f} tok/s  n={t['predicted_n']}"
                          f"  drafted {t.get('draft_n', 0)} accepted {t.get('draft_n_accepted', 0)}", flush=True)
    finally:
        for srv in running.values():
            srv.stop()
    return out


def under_load(model: str, threads: int, levels: list, seconds: float, logdir: Path, temperature: float = 0.0) -> dict:
    """clients -> {"off": tok/s, "on": tok/s}: fastserve -np 32, speculation off then on (ngram-mod); temperature
    > 0 samples (seed 1), where far fewer drafts are accepted."""
    from fastserve.bench import make_prompts
    from fastserve.models.model import load_model
    tok = load_model(model).tokenizer
    prompts = make_prompts(tok, 64)
    out = {}
    for clients in levels:
        row = {}
        for mode, extra in (("off", []), ("on", SPEC["ngram-mod"])):
            port = free_port()
            srv = ServerProcess(fastserve_command(model, port, 32, 16384, threads, "--log-disable", "--stall-limit",
                                                  "600", *extra), port,
                                logdir / f"load-{mode}-{clients}.log")
            try:
                w = asyncio.run(closed_loop(port, prompts, clients, seconds, min(10.0, seconds / 3),
                                            extra={"temperature": temperature, "seed": 1}))
                row[mode] = w.result.tokens / w.result.seconds
            finally:
                srv.stop()
            print(f"  {clients:3d} clients, speculation {mode:3s}: {row[mode]:7.1f} tok/s", flush=True)
        out[str(clients)] = row
    return out


def report(one: dict, load: dict, llama_note: str) -> str:
    lines = ["| task | " + " | ".join(one) + " |", "| --- |" + " --- |" * len(one)]
    for task in one["fastserve"]:
        cells = []
        for name in one:
            r = one[name][task]
            acc = f" ({r['draft_n_accepted']}/{r['draft_n']})" if r["draft_n"] else ""
            cells.append(f"{r['tok_s']:.1f}{acc}")
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    plain = one["fastserve"]
    lines.append("")
    for task in one.get("fastserve draft-model", {}):
        r = one["fastserve draft-model"][task]
        same = r["tokens"] == plain[task]["tokens"]
        lines.append(f"- fastserve draft-model, {task}: {r['tok_s'] / plain[task]['tok_s']:.2f}x plain, "
                     f"{r['draft_n_accepted']} of {r['draft_n']} drafts accepted; output "
                     f"{'identical' if same else 'DIFFERENT'}")
    for name in one:
        if name.startswith("fastserve ") and name != "fastserve draft-model":
            for task, bar in BARS.items():
                if task not in plain:
                    continue
                ratio = one[name][task]["tok_s"] / plain[task]["tok_s"]
                same = one[name][task]["tokens"] == plain[task]["tokens"]
                lines.append(f"- {name}, {task}: {ratio:.2f}x plain (bar {bar}x: {'met' if ratio >= bar else 'NOT met'});"
                             f" output {'identical' if same else 'DIFFERENT'}")
    if "llama-server ngram-mod" in one and "code edit" in plain:
        for name in [n for n in one if n.startswith("fastserve ") and n != "fastserve draft-model"]:
            ratio = one[name]["code edit"]["tok_s"] / one["llama-server ngram-mod"]["code edit"]["tok_s"]
            lines.append(f"- {name}, code edit: {ratio:.2f}x llama-server ngram-mod (bar {LLAMA_BAR}x: "
                         f"{'met' if ratio >= LLAMA_BAR else 'NOT met'})")
    else:
        lines.append(f"- llama-server: {llama_note}")
    for clients, row in load.items():
        ratio = row["on"] / row["off"]
        lines.append(f"- {clients} clients: {row['on']:.1f} vs {row['off']:.1f} tok/s, {ratio:.2f}x with speculation "
                     f"(bar {LOAD_BAR}x: {'met' if ratio >= LOAD_BAR else 'NOT met'})")
    return "\n".join(lines)


def target_1b(path: Path, vocab_model: str) -> str:
    """The 1B-shaped random-weight model with vocab_model's vocabulary at path, written once (~1.1 GB): Llama-3.2-1B's
    shape (bench_sizes.SHAPES) in Q8_0, whose products batch the verification's rows well on a CPU (F16's do not:
    4 rows cost 3.3x one there, 1.4x in Q8_0)."""
    if not path.exists():
        from bench_sizes import SHAPES

        from fastserve.models.gguf_file import GGUFFile
        from fastserve.models.synthetic import write_llama_gguf
        arch, n_layer, d, n_head, n_kv, n_ff, _, tied = SHAPES["1b"]
        md = GGUFFile(vocab_model).metadata
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} (Llama-3.2-1B's shape, random Q8_0 weights, {vocab_model}'s vocabulary)", flush=True)
        write_llama_gguf(path, architecture=arch, n_layer=n_layer, n_embd=d, n_head=n_head, n_head_kv=n_kv, n_ff=n_ff,
                         n_vocab=len(md["tokenizer.ggml.tokens"]), n_ctx=N_CTX, weight_type="Q8_0", tied=tied,
                         rope_base=500000.0, tokenizer=lambda w: add_tokenizer_of(w, md))
    return str(path)


def add_tokenizer_of(w, metadata: dict) -> None:
    """A GGUF's tokenizer.* keys (its metadata, as fastserve's reader gives it) into a gguf.GGUFWriter."""
    import gguf

    T = gguf.GGUFValueType
    for key, value in metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            values = list(value.tolist() if hasattr(value, "tolist") else value)
            w.add_key_value(key, values, T.ARRAY, T.STRING if isinstance(values[0], str) else
                            T.FLOAT32 if isinstance(values[0], float) else T.INT32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", help="GGUF (default: the default model)")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3, help="requests per task and system; the best is reported")
    ap.add_argument("--load-clients", default="8,32")
    ap.add_argument("--load-seconds", type=float, default=30.0)
    ap.add_argument("--load-temperature", type=float, default=0.0, help="the load's sampling (default 0: greedy)")
    ap.add_argument("--drafters", default="ngram-mod,ngram-simple")
    ap.add_argument("--draft-model", help="a draft model of the model's vocabulary: the 'fastserve draft-model' system")
    ap.add_argument("--write-1b", metavar="PATH", help="serve as the model Llama-3.2-1B's shape with random Q8_0 "
                                                      "weights and the draft model's vocabulary, written to PATH once")
    ap.add_argument("--systems", help="comma-separated names of the systems to run (default: all; plain fastserve, "
                                      "the ratios' base, always runs)")
    ap.add_argument("--tasks", help=f"comma-separated tasks (default: all: {', '.join(BARS)})")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from fastserve.models.default_model import default_model_path
    from fastserve.models.model import load_model
    model = args.model or default_model_path()
    if args.write_1b:
        model = target_1b(Path(args.write_1b), args.draft_model or default_model_path())
    tok = load_model(model).tokenizer
    prompts = {task: tok.encode(tok.apply_chat_template([{"role": "user", "content": msg}]), add_special=False)
               for task, msg in tasks().items()}
    print("prompt tokens:", {t: len(ids) for t, ids in prompts.items()}, flush=True)
    common = ["--log-disable", "-b", "512", "--stall-limit", "600"]      # a loaded machine's long prompt steps
    systems = {"fastserve": lambda port: fastserve_command(model, port, 1, N_CTX, args.threads, *common)}
    for d in filter(None, args.drafters.split(",")):
        systems[f"fastserve {d}"] = lambda port, d=d: fastserve_command(model, port, 1, N_CTX, args.threads,
                                                                        *common, *SPEC[d])
    if args.draft_model:
        systems["fastserve draft-model"] = lambda port: fastserve_command(model, port, 1, N_CTX, args.threads, *common,
                                                                          "-md", args.draft_model,
                                                                          "--spec-draft-p-min", "0")   # as recorded
    llama_note = "not measured: give --llama-server PATH (or LLAMA_SERVER)"
    if args.llama_server and not Path(args.llama_server).exists():
        llama_note = f"not measured: {args.llama_server} does not exist (build llama.cpp's llama-server there)"
    elif args.llama_server:
        base = lambda port: [args.llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(port),  # noqa: E731
                             "-np", "1", "-c", str(N_CTX), "-t", str(args.threads)]
        systems["llama-server"] = base
        systems["llama-server ngram-mod"] = lambda port: base(port) + ["--spec-type", "ngram-mod"]
    if args.systems:
        keep = {"fastserve", *args.systems.split(",")}
        systems = {name: argv for name, argv in systems.items() if name in keep}
    if args.tasks:
        prompts = {task: ids for task, ids in prompts.items() if task in args.tasks.split(",")}
    logdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_speculative_{int(time.time())}"
    logdir.mkdir(parents=True, exist_ok=True)
    print("1 client, greedy:", flush=True)
    one = one_client(systems, prompts, args.max_tokens, args.repeat, logdir)
    print("under load:", flush=True)
    levels = [int(x) for x in args.load_clients.split(",") if x]
    load = under_load(model, args.threads, levels, args.load_seconds, logdir, args.load_temperature) if levels else {}
    text = report(one, load, llama_note)
    print(text)
    if args.json:
        Path(args.json).write_text(orjson.dumps({"one_client": one, "load": load, "report": text},
                                                option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
