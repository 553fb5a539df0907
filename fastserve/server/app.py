"""The HTTP application (routing, auth, CORS, logs, request lifecycle) and the server around it.

    serve(args) ─ load model ─ Engine (decode thread) ─ App ─ Server: uvloop + HttpProtocol per connection
                                                             └ Watchdog (stall, deadlines, dropped clients)

The event loop runs on the main thread beside the engine's decode thread. It
never blocks on the engine: submit() returns at once, tokens arrive through each
request's reader with one wake-up per step, and every state route reads the
published snapshot. SIGTERM/SIGINT: stop accepting, fail what runs, drop the
connections, stop the engine; the process exits 0 within 3 s in every case.
"""
from __future__ import annotations

import asyncio
import gc
import hashlib
import hmac
import os
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from ..errors import RequestError
from . import routes
from .config import ServerConfig
from .cors import PREFLIGHT, Cors, parse_origins
from .errors import HttpError, error_json, refused
from .generation import Generation
from .metrics import ServerMetrics
from .params import Parser
from .protocol import HttpProtocol
from .reqlog import RequestLog
from .response import JSON, TEXT, Response
from .response_store import ResponseStore
from .watchdog import Watchdog

EXIT_DEADLINE_S = 2.8           # after SIGTERM, the process is gone by then whatever happens
GRACE_S = 0.05                  # time given to cancelled requests to write their last bytes
GRAMMAR_WORKERS = 2             # grammars / JSON schemas compiled at once off the loop; more wait their turn


def _compile_limit(limits) -> tuple[str, float | None]:
    """(deadline kind, seconds) bounding a request's grammar compile: the shorter of its queue and total
    limits (None: no limit)."""
    bounds = [(v, kind) for kind, v in (("queue", getattr(limits, "queue", 0)), ("total", getattr(limits, "total", 0))) if v]
    if not bounds:
        return "queue", None
    v, kind = min(bounds)
    return kind, v


class App:
    def __init__(self, engine, config: ServerConfig | None = None, log_stream=None):
        self._engine = self.engine = engine     # engine: what serve() and router.py close
        self.config = config = config or ServerConfig()
        info = engine.describe()                # fixed while the engine runs
        self.started_wall = time.time()
        self.inflight: set[Generation] = set()
        self.connections: set = set()
        self.closing = False
        self.log = RequestLog(log_stream, enabled=config.log_requests)
        self.metrics = ServerMetrics(self, engine, info)
        self.watchdog = Watchdog(self, engine)
        key = config.api_key
        self._key_digest = hashlib.sha256(key.encode()).digest() if key else None
        self.cors = Cors(config.cors_origins)
        self._compiler: ThreadPoolExecutor | None = None     # started on the first constrained request
        # what the routes may read, by the names their keyword-only parameters give (routes.Routes)
        self.routes = routes.Routes({
            "engine": engine, "info": info, "tokenizer": engine.tokenizer, "config": config,
            "parser": Parser(engine.tokenizer, info, config), "compile": self.compile, "start": self.start_generation,
            "inflight": self.inflight, "metrics": self.metrics, "unhealthy": self.unhealthy_reason,
            "alias": config.alias or info.model_name, "started": self.started_wall, "responses": ResponseStore()})

    # -- requests ------------------------------------------------------------------------------

    def handle(self, req, ex):
        """A Response now, or a coroutine that produces a Response or StreamResponse."""
        path = req.path
        ex.family = routes.family(path)
        try:
            ex.cors = self.cors.check(req)          # a browser page's origin: allowed, or 403 (cors.py)
            if req.method == "OPTIONS":
                return Response(204, b"", TEXT, PREFLIGHT)
            if self._key_digest is not None and path not in routes.PUBLIC and not self._authorized(req):
                raise HttpError(401, "Invalid API Key", headers=[("www-authenticate", "Bearer")])
            methods, args = self.routes.lookup(path)
            if methods is None:
                raise HttpError(404, f"File Not Found: no route {path}")
            route = methods.get(req.method)
            if route is None:
                raise HttpError(405, f"{path} takes {', '.join(methods)}, not {req.method}",
                                headers=[("allow", ", ".join(methods))])
            return route(req, ex, *args)
        except HttpError as err:
            return self.error_response(ex.family, err)
        except RequestError as exc:
            return self.error_response(ex.family, refused(exc))
        except Exception as exc:        # a bug in a route: log it, answer 500, keep serving
            self.log_exception(ex, exc)
            return self.error_response(ex.family, HttpError(500, f"internal error: {type(exc).__name__}"))

    def _authorized(self, req) -> bool:
        given = req.header("authorization", "")
        if given[:7].lower() == "bearer ":
            given = given[7:].strip()
        else:
            given = req.header("x-api-key", "")
        # Digests of equal length: the comparison time says nothing about the key, not even its length.
        return hmac.compare_digest(hashlib.sha256(given.encode("utf-8", "replace")).digest(), self._key_digest)

    def error_response(self, family: str, err: HttpError) -> Response:
        return Response(err.status, error_json(family, err.status, err.message, err.type, err.fields), JSON, err.headers)

    def headers(self, ex, content_type: str, extra: list) -> list:
        return [("content-type", content_type), *extra, *ex.cors]

    def start_generation(self, ex, ids: list, sampling, params, constraint=None) -> Generation:
        """Submit one choice of a request to the engine (never blocks; Generation's arguments); refuses with 503
        while stalled or shutting down."""
        if self.closing:
            raise HttpError(503, "the server is shutting down")
        stall = self.stall_reason()
        if stall:
            self.metrics.rejected.inc(1, "stalled")
            raise HttpError(503, stall)
        return Generation(ex, ids, sampling, params, constraint, engine=self._engine, metrics=self.metrics,
                          inflight=self.inflight)

    async def compile(self, constrain: dict, limits=None):
        """The engine's Constraint of a request's grammar or json_schema (None for neither), compiled in a worker
        thread: llguidance takes tens of ms for a large schema and much more for a pathological one, which on the
        loop would stall every stream and /health (it drops the GIL while it compiles). An invalid grammar or
        schema raises the compiler's RequestError (the exchange's 400). limits (params.Limits): the wait for a
        worker and the compile count against the request's queue and total limits, which run from its arrival
        (503 / 504 when they run out during the compile, which runs on, its result dropped; Generation.check
        after)."""
        if not constrain:
            return None
        if self.closing:
            raise HttpError(503, "the server is shutting down")
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(GRAMMAR_WORKERS, thread_name_prefix="fastserve-grammar")
        kind, limit = _compile_limit(limits)
        work = asyncio.get_running_loop().run_in_executor(self._compiler, partial(self._engine.constraint, **constrain))
        try:
            return await asyncio.wait_for(work, limit)
        except asyncio.TimeoutError:
            self.metrics.deadlines.inc(1, kind)
            if kind == "queue":
                raise HttpError(503, f"the grammar was not compiled within the queue limit of {limit:g} s") from None
            raise HttpError(504, f"the request ran past its time limit of {limit:g} s compiling its grammar") from None

    def stop_workers(self) -> None:
        """Shutdown: compiles not started are dropped; one running ends on its own (its request is gone)."""
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """The end: the engine (its decode thread leaves within a step), then the log."""
        self._engine.close(timeout=1.5)
        self.log.close()

    def fail(self, ex, err: HttpError) -> None:
        """End ex's request with err (deadline, stall, disconnect, shutdown): its task writes the error."""
        if ex.failure is not None:
            return
        ex.failure = err
        if ex.generation is not None:
            ex.generation.close()
        if ex.task is not None and not ex.task.done():
            ex.task.cancel()

    def finish(self, ex) -> None:
        """The exchange is over: one log line, one count."""
        status = ex.status or (ex.failure.status if ex.failure is not None else 0)
        self.metrics.http.inc(1, str(status))
        gen = ex.generation
        note = ""
        if ex.failure is not None:
            note = ex.failure.message
        self.log.request(ex.conn.peer, ex.method, ex.target, status, gen.n_prompt if gen else 0,
                         len(gen.ids) if gen else 0, (time.monotonic() - ex.t0) * 1e3, note)

    def log_exception(self, ex, exc: BaseException) -> None:
        self.log.line(f"internal error on {ex.method} {ex.target}: "
                      + "".join(traceback.format_exception(exc)).rstrip())

    # -- health --------------------------------------------------------------------------------

    def stall_reason(self, now: float | None = None) -> str | None:
        """Why the decode loop counts as stalled (work pending, no step for > --stall-limit), or None.
        Reads only; the watchdog's tick is what logs and counts a stall."""
        snap = self._engine.snapshot
        now = now or time.monotonic()
        age = now - snap.t_step
        limit = self.config.stall_limit
        if age > limit and (snap.busy or self._engine.stats().n_inbox or
                            any(not g.reader.finished for g in self.inflight)):
            return f"the decode loop is stalled: no step for {age:.1f} s (--stall-limit {limit:g} s) with work pending"
        return None

    def unhealthy_reason(self) -> str | None:
        if self.closing:
            return "the server is shutting down"
        return self.stall_reason()


class Server:
    """Listens and serves an App on the running loop until stop() (signals call it)."""

    def __init__(self, app: App):
        self.app = app
        self._server = None
        self._stopped: asyncio.Event | None = None
        self.port = None

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        cfg = self.app.config
        self._server = await loop.create_server(lambda: HttpProtocol(self.app), cfg.host, cfg.port,
                                                reuse_address=True, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]
        self.app.watchdog.start()
        return self.port

    def stop(self) -> None:
        if self._stopped is not None:
            self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        """Stop accepting, fail every running request, drop every connection."""
        app = self.app
        app.closing = True
        if self._server is not None:
            self._server.close()
        app.watchdog.stop()
        app.stop_workers()
        for conn in list(app.connections):
            ex = conn.exchange
            if ex is not None and ex.task is not None:
                app.fail(ex, HttpError(503, "the server is shutting down"))
        await asyncio.sleep(GRACE_S)
        for conn in list(app.connections):
            conn.abort()
        await asyncio.sleep(0)


def _force_exit() -> None:
    os.write(2, b"fastserve: shutdown took too long; exiting now\n")
    os._exit(0)


def serve(args, backend=None) -> int:
    """`fastserve serve`: load the model, start the engine, serve until SIGTERM/SIGINT; returns 0 (--models-dir:
    several models, router.py). backend: a backend factory for the Engine (tests; None: the one args.device names)."""
    from ..models.default_model import default_model_path
    from ..resources import rss_bytes, seconds_since_start
    from .llama_flags import resolve

    llama = resolve(args)                   # llama-server's flags, checked before anything loads
    cors_origins = parse_origins(args.cors_origins)
    log_stream = open(llama["log_file"], "a", encoding="utf-8") if llama["log_file"] else None
    if args.models_dir is not None:
        from .router import serve_models
        return serve_models(args, llama, cors_origins, partial(build, args, llama, cors_origins, log_stream=log_stream),
                            log_stream)
    app = build(args, llama, cors_origins, args.model or default_model_path(), log_stream=log_stream, backend=backend)

    def ready(port: int) -> None:
        info = app.engine.describe()        # the CPU backend's KV cache comes in on a thread of its own
        coming = "" if info.kv_resident else f" (the KV cache's {info.kv_bytes / 2**20:.0f} MiB being made resident)"
        print(f"fastserve: {info.model_summary}; ready {seconds_since_start():.2f} s after the process started, "
              f"RSS {rss_bytes() / 2**20:.0f} MiB{coming}", file=sys.stderr, flush=True)
        print(f"fastserve: listening on http://{app.config.host}:{port} ({info.model_name}, {info.n_slots} slots x "
              f"{info.n_ctx_slot} tokens, KV {info.cache_type_k}/{info.cache_type_v}, {args.loop} loop, "
              f"{info.threads} thread(s){f', {info.isa} kernels' if info.isa else ''})", file=sys.stderr, flush=True)
    return run(app, args.loop, ready, log_stream)


def build(args, llama: dict, cors_origins, path: str, alias: str | None = None, log_stream=None,
          backend=None) -> App:
    """One model served: loaded from path, its settings from the flags (llama: llama_flags.resolve's), its Engine
    (app.engine) and App. alias: its name in answers (default --alias, else the file name)."""
    from ..config import EngineConfig
    from ..engine import Engine
    from ..models.model import load_model
    from .llama_flags import check_gpu_layers, sampling_defaults

    # The load builds 10^5 containers (vocabulary, merges, tables) that all live as long as the process:
    # the cycle collector's passes over them while they are built find nothing and cost 10-20 ms.
    gc.disable()
    try:
        model = load_model(path)
    finally:
        gc.enable()
    cfg = ServerConfig(host=args.host, port=args.port, api_key=args.api_key, timeout=args.timeout,
                       stall_limit=args.stall_limit, queue_timeout=args.queue_timeout,
                       request_timeout=args.request_timeout, token_timeout=args.token_timeout,
                       n_predict=args.n_predict, cors_origins=cors_origins, body_limit=args.body_limit,
                       alias=alias or args.alias, log_requests=llama["log_requests"], metrics=args.metrics,
                       slots=args.slots, props=args.props, seed=llama["seed"], ignore_eos=llama["ignore_eos"],
                       sampling=sampling_defaults(model.config.n_vocab, llama["sampling"]),
                       webui=not args.no_webui, prefill_assistant=args.prefill_assistant,
                       reasoning_format=args.reasoning_format, reasoning_budget=args.reasoning_budget,
                       chat_template_kwargs=llama["chat_template_kwargs"], pooling=llama["pooling"],
                       embd_normalize=llama["embd_normalize"])
    if llama["chat_template"] is not None:
        model.tokenizer.set_chat_template(llama["chat_template"])
    elif model.tokenizer.chat_template_is_fallback:
        print("fastserve: the model has no chat template: chat uses ChatML, as llama-server's fallback "
              "(--chat-template sets another)", file=sys.stderr, flush=True)
    device = llama["device"]
    check_gpu_layers(llama["n_gpu_layers"], device, model.config.n_layer)
    engine = Engine(model, EngineConfig.from_flags(args, trace=True, n_batch=llama["n_batch"],
                                                   device=device or EngineConfig.device,
                                                   speculative=llama["speculative"]), backend=backend)
    return App(engine, cfg, log_stream=log_stream)


def run(app, loop_name: str, ready, log_stream=None) -> int:
    """Serve app (an App, or router.Router) until SIGTERM/SIGINT, then close it; ready(port) once it listens."""
    server = Server(app)
    timer: list = []

    def on_signal(signame: str) -> None:
        if not timer:
            app.log.line(f"{signame}: shutting down")
            t = threading.Timer(EXIT_DEADLINE_S, _force_exit)
            t.daemon = True
            t.start()
            timer.append(t)
        server.stop()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig.name)
        ready(await server.start())
        await server.wait()

    try:
        if loop_name == "uvloop":
            import uvloop
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(main())
        else:
            asyncio.run(main())
    finally:
        app.close()
        if log_stream is not None:
            log_stream.close()
    return 0
