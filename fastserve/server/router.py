"""Several models in one server (llama-server's router mode, Ollama's way): `fastserve serve --models-dir DIR`.

    HttpProtocol ── Router.handle ── the request's model ── loaded? else built in a worker thread (load, Engine, App)
                                                        └─ that model's App.handle: its engine, routes, watchdog

Every `*.gguf` in DIR is a model, named by its file name without `.gguf` (Ollama's `name:latest` is the same one).
A request names its model in its body's `model` (GET routes: `?model=`); a server of one model needs no name,
and a GET without one looks at the only model loaded (400 when none or several are).
The models listing routes (/v1/models, /models, /api/tags, /api/ps) and /health are the router's own.

At most --models-max models are loaded; loading another first unloads the least recently used one that has no
request in flight (a request is never cut: the load waits for one to be idle, up to --queue-timeout). A model
idle for --sleep-idle-seconds is unloaded, and so is one whose request said Ollama's keep_alive 0, once its
requests end. Unloading closes the model's engine (its decode thread, KV cache and weights go with it). Each
model's engine, decode thread and App are its own; the event loop, the connections and the log are shared.
"""
from __future__ import annotations

import asyncio
import gc
import hashlib
import os
import sys
import time
from dataclasses import dataclass

from functools import partial

import orjson

from . import routes
from .app import App, run
from .cors import PREFLIGHT, Cors
from .errors import HttpError
from .metrics import Counter
from .ollama_api import NEVER
from .reqlog import RequestLog
from .config import ServerConfig
from .response import TEXT, Response, StreamResponse, json_response

LISTS = frozenset({"/v1/models", "/models", "/api/tags", "/api/ps", "/health", "/v1/health"})
IDLE_TICK_S = 0.5


def catalog(models_dir: str) -> dict[str, str]:
    """name -> path of every GGUF file in models_dir (ValueError when there is none)."""
    try:
        files = sorted(f for f in os.listdir(models_dir) if f.endswith(".gguf"))
    except OSError as exc:
        raise ValueError(f"--models-dir {models_dir}: {exc.strerror}") from None
    if not files:
        raise ValueError(f"--models-dir {models_dir}: no .gguf file there")
    return {f[:-len(".gguf")]: os.path.join(models_dir, f) for f in files}


def keep_alive_seconds(value) -> float | None:
    """Ollama's keep_alive as seconds (negative: forever), or None when absent or unreadable."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        units = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
        for unit in sorted(units, key=len, reverse=True):
            if value.endswith(unit):
                try:
                    return float(value[:-len(unit)]) * units[unit]
                except ValueError:
                    return None
        try:
            return float(value)
        except ValueError:
            return None
    return None


@dataclass
class Entry:
    """A model of the catalog: its App once loaded, its requests in flight, when it was last used."""
    name: str
    path: str
    app: App | None = None
    loading: asyncio.Future | None = None
    active: int = 0
    last: float = 0.0
    keep_until: float | None = None     # Ollama's keep_alive: unloaded once idle past this (None: the server's rule)


class _Counters:
    """The counts HttpProtocol keeps on its app (the models' own metrics are per model)."""

    def __init__(self):
        self.http = Counter("fastserve_http_requests", "HTTP requests answered, by status.", ("code",))
        self.dropped = Counter("fastserve_clients_dropped", "Connections dropped by the server.", ("reason",))
        self.disconnects = Counter("fastserve_client_disconnects", "Requests cancelled by their client.")


class _Ticker:
    """The router's timer: idle models unloaded (Server starts and stops it as an App's watchdog)."""

    def __init__(self, router: "Router"):
        self.router, self._handle = router, None

    def start(self) -> None:
        self._handle = asyncio.get_running_loop().call_later(IDLE_TICK_S, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        try:
            self.router.unload_idle(time.monotonic())
        finally:
            if self._handle is not None:
                self.start()


class Router:
    """The app of a server of several models (HttpProtocol's and Server's app). build(name, path) -> App: a model
    loaded and served, called in a worker thread; models_max >= 1; sleep_idle: seconds (< 0: never)."""

    error_response = App.error_response
    headers = App.headers
    fail = App.fail
    log_exception = App.log_exception
    _authorized = App._authorized

    def __init__(self, config, models: dict[str, str], build, models_max: int, sleep_idle: float,
                 log_stream=None):
        if models_max < 1:
            raise ValueError(f"--models-max must be >= 1 (models loaded at once), got {models_max}")
        self.config, self._build = config, build
        self.models = {name: Entry(name, path) for name, path in models.items()}
        self.models_max, self.sleep_idle = models_max, sleep_idle
        self.connections: set = set()
        self.closing = False
        self.log = RequestLog(log_stream, enabled=config.log_requests)
        self.metrics = _Counters()
        self.watchdog = _Ticker(self)
        self.cors = Cors(config.cors_origins)
        self._key_digest = hashlib.sha256(config.api_key.encode()).digest() if config.api_key else None
        self.started_wall = time.time()

    # -- requests ----------------------------------------------------------------------------

    def handle(self, req, ex):
        """CORS and the API key first (as App.handle: nothing, not even which models exist, before them), then
        the router's own routes, or the request's model's App."""
        ex.family = routes.family(req.path)
        try:
            ex.cors = self.cors.check(req)
            if req.method == "OPTIONS":
                return Response(204, b"", TEXT, PREFLIGHT)
            if self._key_digest is not None and req.path not in routes.PUBLIC and not self._authorized(req):
                raise HttpError(401, "Invalid API Key", headers=[("www-authenticate", "Bearer")])
            if req.path in LISTS:
                if req.method not in ("GET", "HEAD"):
                    raise HttpError(405, f"{req.path} takes GET, not {req.method}", headers=[("allow", "GET")])
                return self._list(req.path)
        except HttpError as err:
            return self.error_response(ex.family, err)
        return self._forward(req, ex)

    async def _forward(self, req, ex):
        """The request, handled by its model's App (loaded first if needed); in flight until its answer ends."""
        entry, keep = self._model_of(req)
        await self._acquire(entry)
        streaming = False
        try:
            result = entry.app.handle(req, ex)
            if asyncio.iscoroutine(result):
                result = await result
            if isinstance(result, StreamResponse):     # in flight until the stream ends, however it ends
                result.body = _until_end(result.body, partial(self._release, entry, keep))
                streaming = True
            return result
        finally:
            if not streaming:
                self._release(entry, keep)

    def _model_of(self, req) -> tuple[Entry, float | None]:
        """(the request's model, its keep_alive seconds or None); 400 without one when several, 404 when unknown."""
        name, keep = req.query.get("model"), None
        if req.body:
            try:
                body = orjson.loads(req.body)
            except orjson.JSONDecodeError:
                body = None
            if isinstance(body, dict):
                name = body.get("model", name)
                keep = keep_alive_seconds(body.get("keep_alive"))
        if not name:
            # A GET without ?model= looks at the one model there is, or at the one loaded (a client such as
            # lm-eval asks /tokenizer_info of the model it just used, without naming it).
            loaded = [e for e in self.models.values() if e.app is not None] if req.method in ("GET", "HEAD") else []
            if len(self.models) == 1 or len(loaded) == 1:
                return (next(iter(self.models.values())) if len(self.models) == 1 else loaded[0]), keep
            raise HttpError(400, f"'model' is required: one of {', '.join(self.models)}")
        if not isinstance(name, str):
            raise HttpError(400, "'model' must be a string")
        entry = self.models.get(name[:-len(":latest")] if name.endswith(":latest") else name)
        if entry is None:
            raise HttpError(404, f"model '{name}' not found; this server has {', '.join(self.models)}",
                            "not_found_error")
        return entry, keep

    async def _acquire(self, entry: Entry) -> None:
        """entry loaded and counted in flight: built on first use (one load per model at a time), after unloading
        the least recently used idle model when models_max are loaded; waits for one to be idle, up to
        --queue-timeout (503 then)."""
        if self.closing:
            raise HttpError(503, "the server is shutting down")
        entry.active += 1           # counted from now: a model a request waits for is never the one unloaded
        try:
            deadline = time.monotonic() + (self.config.queue_timeout or float("inf"))
            while entry.app is None:
                if entry.loading is None:
                    if not self._make_room():
                        if time.monotonic() > deadline:
                            raise HttpError(503, f"every loaded model ({self.models_max}, --models-max) has "
                                                 f"requests in flight; none could be unloaded within the queue limit")
                        await asyncio.sleep(0.05)
                        continue
                    entry.loading = asyncio.ensure_future(self._load(entry))
                await asyncio.shield(entry.loading)     # every waiter of this load; its failure is each one's 500
        except BaseException:
            entry.active -= 1
            raise
        entry.last = time.monotonic()

    async def _load(self, entry: Entry) -> None:
        """Build entry's App in a worker thread (the loop serves the other models meanwhile) and start it."""
        self.log.line(f"loading {entry.name} ({entry.path})")
        try:
            app = await asyncio.get_running_loop().run_in_executor(None, self._build, entry.name, entry.path)
        except Exception as exc:
            self.log.line(f"loading {entry.name} failed: {type(exc).__name__}: {exc}")
            raise HttpError(500, f"model '{entry.name}' could not be loaded: {exc}") from None
        finally:
            entry.loading = None
        app.log.close()                     # the model's answers go to the server's one log
        app.connections, app.log = self.connections, self.log
        app.watchdog.start()
        entry.app = app
        self.log.line(f"loaded {entry.name}: {app.engine.describe().model_summary}")

    def _make_room(self) -> bool:
        """Room for one more model: True when fewer than models_max are loaded or loading, or once the least
        recently used idle one is unloaded; False when every loaded model is busy."""
        held = [e for e in self.models.values() if e.app is not None or e.loading is not None]
        if len(held) < self.models_max:
            return True
        idle = [e for e in held if e.app is not None and e.active == 0]
        if not idle:
            return False
        self.unload(min(idle, key=lambda e: e.last))
        return True

    def _release(self, entry: Entry, keep: float | None) -> None:
        """A request of entry ended; keep: its keep_alive (seconds, < 0 forever), which sets when entry unloads."""
        entry.active -= 1
        entry.last = time.monotonic()
        if keep is not None:
            entry.keep_until = float("inf") if keep < 0 else entry.last + keep
        if entry.active == 0 and entry.keep_until is not None and entry.keep_until <= entry.last:
            self.unload(entry)

    def unload_idle(self, now: float) -> None:
        for e in self.models.values():
            if e.app is None or e.active:
                continue
            if e.keep_until is not None:
                if now >= e.keep_until:
                    self.unload(e)
            elif self.sleep_idle >= 0 and now - e.last >= self.sleep_idle:
                self.unload(e)

    def unload(self, entry: Entry) -> None:
        """Close an idle model's engine and drop its App (its memory returns with them)."""
        app, entry.app, entry.keep_until = entry.app, None, None
        if app is None:
            return
        app.watchdog.stop()
        app.stop_workers()
        app.engine.close(timeout=1.5)
        del app
        gc.collect()                        # the App, engine and model hold cycles: free them now, not later
        self.log.line(f"unloaded {entry.name}")

    # -- the router's own routes ---------------------------------------------------------------

    def _list(self, path: str):
        if path in ("/health", "/v1/health"):
            return json_response({"status": "ok"})
        loaded = [e for e in self.models.values() if e.app is not None]
        if path == "/api/ps":
            return json_response({"models": [{**_ollama(e), "expires_at": self._expires(e)} for e in loaded]})
        if path == "/api/tags":
            return json_response({"models": [_ollama(e) for e in self.models.values()]})
        return json_response({"object": "list", "data": [
            {"id": e.name, "object": "model", "created": int(self.started_wall), "owned_by": "fastserve",
             "status": {"value": "loaded" if e.app is not None else "unloaded"}} for e in self.models.values()]})

    def _expires(self, e: Entry) -> str:
        """When an idle model will be unloaded, as Ollama's /api/ps says it (far away: never; now: busy)."""
        wall = time.time() - time.monotonic()
        if e.keep_until is not None:
            at = e.keep_until
        elif self.sleep_idle >= 0:
            at = e.last + self.sleep_idle
        else:
            at = float("inf")
        if at == float("inf"):
            return NEVER
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall + max(at, time.monotonic())))

    # -- the server's life -------------------------------------------------------------------------

    def finish(self, ex) -> None:
        status = ex.status or (ex.failure.status if ex.failure is not None else 0)
        self.metrics.http.inc(1, str(status))
        gen = ex.generation
        self.log.request(ex.conn.peer, ex.method, ex.target, status, gen.n_prompt if gen else 0,
                         len(gen.ids) if gen else 0, (time.monotonic() - ex.t0) * 1e3,
                         ex.failure.message if ex.failure is not None else "")

    def stop_workers(self) -> None:
        for e in self.models.values():
            if e.app is not None:
                e.app.stop_workers()

    def close(self) -> None:
        """The models' engines, at the end."""
        for e in self.models.values():
            if e.app is not None:
                e.app.engine.close(timeout=1.0)
        self.log.close()


def _ollama(entry: Entry) -> dict:
    """A model as Ollama's /api/tags and /api/ps list it (a loaded one with its context)."""
    st = os.stat(entry.path)
    out = {"name": entry.name, "model": entry.name, "size": st.st_size, "digest": "",
           "modified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(st.st_mtime))}
    if entry.app is not None:
        out["context_length"] = entry.app.engine.describe().n_ctx_slot
    return out


def serve_models(args, llama: dict, cors_origins, build, log_stream=None) -> int:
    """`fastserve serve --models-dir DIR`: the Router over DIR's models, served until SIGTERM/SIGINT.
    build(path, alias=name) -> App: one model (app.build with the flags given)."""
    models = catalog(args.models_dir)
    config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key, timeout=args.timeout,
                          stall_limit=args.stall_limit, queue_timeout=args.queue_timeout,
                          body_limit=args.body_limit, cors_origins=cors_origins, log_requests=llama["log_requests"])
    router = Router(config, models, lambda name, path: build(path, alias=name), args.models_max,
                    args.sleep_idle_seconds, log_stream)

    def ready(port: int) -> None:
        print(f"fastserve: listening on http://{config.host}:{port} ({len(models)} models in {args.models_dir}: "
              f"{', '.join(models)}; at most {args.models_max} loaded)", file=sys.stderr, flush=True)
    return run(router, args.loop, ready, log_stream)


async def _until_end(body, release):
    """A stream's body that releases its model when it ends, however it ends."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        release()
        await body.aclose()
