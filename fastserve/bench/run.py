"""`fastserve bench`: its flags, and the run that wires prompts → load → figures → report and plots.

Targets are measured in turn per level (A, B, A, B ... over the repeats) so that both see the
same machine noise; ratios are A / B within one run.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import sys
import time

from ..config import SPEC_TYPES, SpecConfig
from .client import APIS, Params, Target
from .load import Level, run_level
from .prompts import builtin, load_jsonl, parse_lengths

DEFAULT_PROBES = "/health,/slots,/metrics"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench's own flags (cli.py adds the model flags -m, -c, -np, -b, -ctk, -ctv and --device)."""
    g = p.add_argument_group("targets (default: an in-process Engine on -m)")
    g.add_argument("--url", help="server to measure, e.g. http://127.0.0.1:8080 (target A)")
    g.add_argument("--api", choices=sorted(APIS), default="llamacpp",
                   help="what --url speaks: llamacpp (/completion), openai (/v1/completions), chat "
                        "(/v1/chat/completions) (default llamacpp)")
    g.add_argument("--vs", metavar="URL2", help="a second server (target B), measured interleaved with A at each "
                                                "level; ratios A/B with the spread of the repeats")
    g.add_argument("--vs-api", choices=sorted(APIS), help="what --vs speaks (default: --api)")
    g.add_argument("--name", help="target A's name in tables and plots (default: from its /props, or its URL)")
    g.add_argument("--vs-name", help="target B's name")
    g.add_argument("--pid", type=int, help="process id of --url's server, to sample its RSS (default: the process "
                                           "listening on its port, when it runs on this machine; in-process: this one)")
    g.add_argument("--vs-pid", type=int, help="process id of --vs's server, to sample its RSS (default: as --pid)")
    g.add_argument("--model-name", default="default", help="the 'model' field of OpenAI requests")
    g = p.add_argument_group("load")
    g.add_argument("--clients", default="1,8,32", help="closed loop: comma-separated concurrency levels "
                                                       "(default 1,8,32)")
    g.add_argument("--rate", help="open loop instead: comma-separated request rates, requests/s, Poisson arrivals")
    g.add_argument("--duration", "--seconds", dest="duration", type=float, default=30.0,
                   help="measured seconds per level and repeat (default 30)")
    g.add_argument("--warmup", type=float, default=5.0,
                   help="seconds of load before each measured window, excluded from every figure (default 5)")
    g.add_argument("--repeats", type=int, default=1, help="runs of each level per target (default 1); with 2+ the "
                                                          "A/B table gives the spread of the ratios")
    g.add_argument("--prompts", metavar="FILE", help="JSONL prompts: a string, {\"prompt\": ...} or "
                                                     "{\"messages\": [...]} a line (default: the built-in mix of "
                                                     "English, code and chat)")
    g.add_argument("--prompt-tokens", default="60-120", help="built-in prompts' length in tokens: N (fixed) or "
                                                             "LO-HI (drawn uniformly) (default 60-120)")
    g.add_argument("--n-prompts", type=int, default=64, help="built-in prompts made (default 64)")
    g.add_argument("-n", "--n-predict", type=int, default=128, help="tokens asked of each request (default 128)")
    g.add_argument("--ignore-eos", action="store_true", help="ask the server to generate past end-of-text")
    g.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    g.add_argument("--seed", type=int, default=0, help="seed of the requests' sampling, the prompt draw and arrivals")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds a request may go without a byte before it "
                                                                "counts as an error (default 600)")
    g.add_argument("--probes", default=DEFAULT_PROBES, help="paths GET-timed beside the load from a child process, "
                                                            f"comma-separated ('' for none; default {DEFAULT_PROBES})")
    g.add_argument("--probe-every", type=float, default=0.1, help="seconds between two probes of a path (default 0.1)")
    g.add_argument("-t", "--threads", type=int, default=0, help="in-process: threads of the decode step "
                                                                "(0: every core)")
    g.add_argument("--spec-type", choices=SPEC_TYPES, default="none",
                   help="in-process: speculative decoding's drafter (the table's 'draft acc' column: accepted / "
                        "drafted tokens; a server's comes from its /trace)")
    g.add_argument("-md", "--spec-draft-model", default="", metavar="FILE",
                   help="in-process: a draft model of the model's vocabulary (with --spec-type draft-simple)")
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="FILE", help="write every figure, the command, versions and machine facts")
    g.add_argument("--plot", metavar="DIR", help="write itl_over_time.png, concurrency.png and phases.png here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(parallel=0)     # in-process -np default: a slot per client at the largest level


def levels_of(args) -> list[Level]:
    spec, kind = (args.rate, "rate") if args.rate else (args.clients, "clients")
    try:
        vals = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{kind} {spec!r}: give comma-separated numbers") from None
    if not vals or any(v <= 0 for v in vals) or (kind == "clients" and any(v != int(v) for v in vals)):
        raise ValueError(f"--{kind} {spec!r}: give positive {'integers' if kind == 'clients' else 'rates'}")
    return [Level(kind, v) for v in vals]


def _check(args) -> None:
    if args.duration <= 0 or args.warmup < 0 or args.repeats < 1 or args.n_prompts < 1 or args.timeout <= 0 \
            or args.probe_every <= 0:
        raise ValueError("--duration, --timeout and --probe-every must be > 0, --warmup >= 0, --repeats and "
                         "--n-prompts >= 1")
    parse_lengths(args.prompt_tokens)
    for flag in ("url", "vs"):
        u = getattr(args, flag)
        if u and not u.startswith(("http://", "https://")):
            raise ValueError(f"--{flag} {u!r}: give an http:// or https:// URL")


def main(args) -> int:
    """Run the bench from parsed args; returns the exit code."""
    import httpx
    from .report import ab_table, tables, write_json

    _check(args)
    levels = levels_of(args)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'fastserve[bench]'") from None
    command = shlex.join(["fastserve", *sys.argv[1:]])      # argv[0] may be __main__.py (python -m fastserve)
    engine = model = None
    targets = []
    if args.url:
        targets.append(Target(args.name or "", args.url, args.api, args.pid or _local_pid(args.url)))
    else:
        model, engine = _inprocess(args, levels)
        targets.append(Target(args.name or "in-process", None, "inprocess", os.getpid()))
    if args.vs:
        targets.append(Target(args.vs_name or "", args.vs, args.vs_api or args.api, args.vs_pid or _local_pid(args.vs)))
    try:
        versions = [_describe(t, model) for t in targets]
        targets = [t if t.name else Target(v["name"], t.url, t.api, t.pid) for t, v in zip(targets, versions)]
        if len({t.name for t in targets}) < len(targets):
            targets[1] = Target(targets[1].name + " (B)", targets[1].url, targets[1].api, targets[1].pid)
        prompts, prompt_info = _prompts(args, targets[0], model)
        params = Params(args.n_predict, args.temp, args.ignore_eos, args.seed, args.model_name)
        result = {"command": command, "argv": sys.argv[1:], "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                         time.gmtime()),
                  "machine": machine_facts(), "versions": software_versions(),
                  "targets": [{**v, "name": t.name, "url": t.url, "api": t.api, "pid": t.pid}
                              for t, v in zip(targets, versions)],
                  "settings": {"n_predict": args.n_predict, "temperature": args.temp, "ignore_eos": args.ignore_eos,
                               "seed": args.seed, "warmup_s": args.warmup, "duration_s": args.duration,
                               "repeats": args.repeats, "probes": _probe_paths(args), "prompts": prompt_info,
                               "api_note": ", ".join(t.name if t.url is None else f"{t.name} via {t.api}"
                                                     for t in targets)},
                  "levels": [{"kind": lv.kind, "value": lv.value} for lv in levels], "runs": []}
        # a connection per request, as vLLM's benchmark client does: llama-server (34af94cd) at times closes a
        # kept-alive connection after a streamed response without saying so, and the next POST on it fails
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        runs = asyncio.run(_run_all(args, targets, levels, prompts, params, engine, limits, result))
    finally:
        if engine is not None:
            engine.close()
    result["machine"]["loadavg_end"] = os.getloadavg()
    if len(targets) == 2:
        result["ab"] = ab_table(result)
    result["client_overhead"] = client_overhead(result)
    if args.plot:
        from .plots import write_plots
        result["plots"] = write_plots(result, runs, args.plot)
    print(tables(result))
    if args.json:
        write_json(result, args.json)
        print(f"figures: {args.json}", file=sys.stderr)
    if args.plot:
        print(f"plots: {', '.join(result['plots'])}", file=sys.stderr)
    return 0


async def _run_all(args, targets, levels, prompts, params, engine, limits, result) -> list:
    import httpx
    from tqdm import tqdm
    from .figures import level_figures
    runs = []
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    for lv in levels:
        for rep in range(args.repeats):
            for t in targets:
                async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
                    with tqdm(total=args.warmup + args.duration, unit="s", file=sys.stderr, leave=False,
                              desc=f"{t.name} {lv} #{rep + 1}", disable=True if args.no_progress else None,
                              bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s {postfix}") as bar:
                        run = await run_level(t, lv, prompts, params, args.warmup, args.duration, client=client,
                                              engine=engine, probe_paths=_probe_paths(args) if t.url else (),
                                              probe_every=args.probe_every, progress=bar, seed=args.seed + rep)
                runs.append(run)
                result["runs"].append({"target": t.name, "level": {"kind": lv.kind, "value": lv.value},
                                       "repeat": rep, "figures": level_figures(run)})
                f = result["runs"][-1]["figures"]
                print(f"  {t.name} {lv} #{rep + 1}: {f['tok_s']:.1f} tok/s, {f['requests_finished']} requests, "
                      f"{sum(f['errors'].values())} errors", file=sys.stderr, flush=True)
    return runs


def _local_pid(url: str) -> int | None:
    """The PID of a server on this machine (loopback or localhost URL), for its RSS; None elsewhere."""
    from urllib.parse import urlsplit
    from .load import pid_listening_on
    u = urlsplit(url)
    if u.hostname not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
        return None
    return pid_listening_on(u.port or (443 if u.scheme == "https" else 80))


def _probe_paths(args) -> list[str]:
    return [p.strip() for p in args.probes.split(",") if p.strip()]


def _inprocess(args, levels):
    from ..models.default_model import default_model_path
    from ..engine import Engine
    from ..models.model import load_model
    model = load_model(args.model or default_model_path())
    print(f"fastserve: {model.load_summary()}", file=sys.stderr)
    most = max(int(lv.value) for lv in levels) if levels[0].kind == "clients" else 8
    n_parallel = args.parallel or most
    spec = SpecConfig(type=args.spec_type, draft_model=args.spec_draft_model)
    engine = Engine(model, n_parallel=n_parallel, n_ctx=max(args.ctx_size, 512 * n_parallel), n_batch=args.batch_size,
                    trace=True, threads=args.threads or None, backend=args.device, cache_type_k=args.cache_type_k,
                    cache_type_v=args.cache_type_v, speculative=spec)
    return model, engine


def _prompts(args, target: Target, model):
    """The prompt set and what describes it; lengths counted by target A's tokenizer (/tokenize) when it has one."""
    if args.prompts:
        prompts = load_jsonl(args.prompts)
        source = args.prompts
    else:
        count = _counter(target, model)
        prompts = builtin(count, args.n_prompts, parse_lengths(args.prompt_tokens), args.seed)
        source = f"built-in English, code and chat, {args.prompt_tokens} tokens by {count.__doc__}"
    lens = [p.n_tokens for p in prompts if p.n_tokens is not None]
    tokens = f"{min(lens)}-{max(lens)} tokens, mean {sum(lens) / len(lens):.0f}" if lens else "lengths not counted"
    return prompts, {"source": source, "n": len(prompts), "tokens": tokens,
                     "kinds": sorted({p.kind for p in prompts})}


def _counter(target: Target, model):
    if model is not None:
        def count(text):
            """the in-process tokenizer"""
            return len(model.tokenizer.encode(text, add_special=False))
        return count
    import httpx
    url = target.url.rstrip("/") + "/tokenize"
    client = httpx.Client(timeout=30)       # one kept-alive connection for the hundred or so counts
    try:
        client.post(url, json={"content": "probe"}).raise_for_status()
    except httpx.HTTPError:
        client.close()

        def approx(text):
            """4/3 tokens per word (the target has no /tokenize)"""
            return max(1, round(len(text.split()) * 4 / 3))
        return approx

    def count(text):
        """the target's /tokenize"""
        return len(client.post(url, json={"content": text, "add_special": False}).json()["tokens"])
    return count


def _describe(target: Target, model) -> dict:
    """{name, version, model} of a target: from /props (llama-server, fastserve) and /v1/models."""
    if target.url is None:
        return {"name": "in-process", "version": f"fastserve-{software_versions()['fastserve']}",
                "model": str(getattr(model, "path", ""))}
    import httpx
    out = {"name": target.url.split("//", 1)[-1].rstrip("/"), "version": None, "model": None}
    try:
        props = httpx.get(target.url.rstrip("/") + "/props", timeout=10).json()
        build = props.get("build_info")
        out["version"] = build
        out["model"] = props.get("model_path") or props.get("model_alias")
        if isinstance(build, str) and build.startswith("fastserve"):
            out["name"] = "fastserve"
        elif build is not None:
            out["name"] = "llama-server"
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return out


def machine_facts() -> dict:
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(), "cpus_usable": usable,
            "memory_mib": mem, "python": platform.python_version(), "loadavg_start": os.getloadavg()}


def software_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for name in ("fastserve", "httpx", "numpy", "matplotlib", "tqdm", "uvloop"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    out["fastserve_commit"] = _checkout_commit()
    return out


def _checkout_commit() -> str | None:
    """The git commit of the fastserve checkout this runs from (None for an installed wheel)."""
    import subprocess
    from pathlib import Path
    try:
        p = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "HEAD"],
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return None
    dirty = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "status", "--porcelain",
                            "--untracked-files=no"], capture_output=True, text=True, timeout=10).stdout.strip()
    return p.stdout.strip() + ("-dirty" if dirty else "")


def client_overhead(result: dict) -> str | None:
    """One line: the client's own CPU cost, so a reader can tell it from the server's."""
    rows = [r["figures"]["client_cpu"] for r in result["runs"] if r["figures"]["client_cpu"]]
    if not rows:
        return None
    worst = max(rows, key=lambda c: c["core_share"])
    per_tok = [c["us_per_token"] for c in rows if c["us_per_token"]]
    return (f"client overhead: this process (httpx streams on one event loop; probes run in child processes) "
            f"used at most {worst['core_share']:.0%} of one core in a window, "
            f"{min(per_tok):.0f}-{max(per_tok):.0f} µs of CPU per token received" if per_tok else
            f"client overhead: at most {worst['core_share']:.0%} of one core in a window")
