"""The cluster's HTTP ingress: every request of the server's API goes to one replica through Ray Serve's
streaming handle (its router, PrefixCacheAffinityRouter, picks the replica whose past prompts share the
longest prefix with this one), and the replica's answer comes back byte for byte. /health and /metrics are
the replicas' own, put together from the board.

When a replica goes away (its process killed, or Ray Serve replacing it after its watchdog said it is wedged):
- a request that has not had its answer's first bytes yet goes to another replica (within RETRY_S), and so
  does one that a replica's server refused with 503 (stalled, shutting down, its queue full);
- a request whose answer had started ends with a 503 in its API's shape: an error event in a stream.
A 503 is passed on the same way when every replica's queue is full, so such a request waits up to RETRY_S
where one server would refuse it at once. Routes that read one server's state (/slots, /props, /trace)
answer for the replica the router picks.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import time

import orjson
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import ReplicaUnavailableError
from starlette.responses import Response, StreamingResponse

from ..server import sse
from ..server.errors import ANTHROPIC, HttpError, error_json
from ..server.response import JSON, PROMETHEUS
from ..server.routes import family
from .exposition import merge
from .replica import HOP_BY_HOP, Forward

RETRY_S = 30.0          # how long a request that has not started may wait for a replica that can take it
RETRY_WAIT_S = 0.25
GONE = (RayActorError, ReplicaUnavailableError)
HEALTH_PATHS = frozenset({"/health", "/v1/health"})


def routing_text(method: str, path: str, body: bytes) -> str:
    """The text the router matches prefixes on: a chat's system prompt and messages, a completion's prompt;
    for anything else (or a body that is not JSON) the method and path, so that every request has some."""
    try:
        obj = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        parts = [obj.get("system"), obj.get("instructions"), obj.get("messages"), obj.get("input"),
                 obj.get("prompt")]
        text = "".join(_text(p) for p in parts)
        if text:
            return text
    return f"{method} {path}"


def _text(value) -> str:
    """The words of a prompt, a message list or a content list (images and tool calls carry none)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(v) for v in value)
    if isinstance(value, dict):
        return _text(value.get("text")) + _text(value.get("content"))
    return ""


def _error(fam: str, err: HttpError) -> Response:
    return Response(error_json(fam, err.status, err.message, err.type), err.status, media_type=JSON)


def _stream_tail(fam: str, err: HttpError) -> bytes:
    """The last event of a stream cut short, as the server sends it (Anthropic's is a named event)."""
    payload = err.payload(fam)
    return sse.named("error", payload) if fam == ANTHROPIC else sse.error_event(payload)


class Ingress:
    """The Ray Serve deployment that takes the HTTP requests. replicas: the replicas' DeploymentHandle;
    board: the Board actor; api_key: the server's --api-key (/metrics is checked here, the rest by the
    replicas); metrics: --metrics (/metrics answers 501 without it, as one server)."""

    def __init__(self, replicas, board, api_key: str | None = None, metrics: bool = False):
        self.replicas = replicas.options(stream=True)
        self.board = board
        self._key = hashlib.sha256(api_key.encode()).digest() if api_key else None
        self.metrics_on = metrics

    async def __call__(self, request):
        path = request.url.path
        fam = family(path)
        if request.method == "GET" and path in HEALTH_PATHS:
            return await self.health(fam)
        if request.method == "GET" and path == "/metrics":
            return await self.metrics(request, fam)
        body = await request.body()
        raw = request.scope.get("raw_path")          # as the client sent it: percent-encoding kept
        target = (raw.decode("latin-1") if raw else path) + (f"?{request.url.query}" if request.url.query else "")
        headers = tuple((k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP)
        return await self.forward(Forward(request.method, target, headers, body, routing_text(request.method, path, body)),
                                  fam)

    async def forward(self, fwd: Forward, fam: str):
        """The replica's answer, once its first body bytes are here: until then nothing has reached the client,
        and a replica that goes away or refuses with 503 passes the request on to another."""
        deadline = time.monotonic() + RETRY_S
        while True:
            gen = self.replicas.handle.remote(fwd)
            try:
                status, headers = await gen.__anext__()
                first = await anext(gen, b"")
            except asyncio.CancelledError:  # the client went away before its answer began (Ray Serve cancels us)
                gen.cancel()
                raise
            except Exception as exc:        # noqa: BLE001 (sorted below: gone, or a bug)
                gen.cancel()
                if not _gone(exc):
                    return _error(fam, HttpError(500, f"internal error in a replica: {type(exc).__name__}"))
                why = type(exc).__name__
            else:
                if not (_refused(status, first) and time.monotonic() < deadline):
                    break
                gen.cancel()
                why = "503 from its server"
            if time.monotonic() > deadline:
                return _error(fam, HttpError(503, f"no replica could take the request within {RETRY_S:g} s ({why})"))
            await asyncio.sleep(RETRY_WAIT_S)
        is_sse = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in headers)
        return StreamingResponse(self._body(first, gen, fam, is_sse), status_code=status, headers=dict(headers))

    async def _body(self, first: bytes, gen, fam: str, is_sse: bool):
        try:
            yield first
            async for chunk in gen:
                yield chunk
        except Exception as exc:            # noqa: BLE001
            if is_sse:
                why = "went away" if _gone(exc) else f"failed ({type(exc).__name__})"
                yield _stream_tail(fam, HttpError(503, f"the replica serving this request {why}"))
        finally:
            gen.cancel()                    # the client went away: the replica's server cancels the request

    async def health(self, fam: str):
        """200 while at least one replica's server is healthy; 503 with each replica's reason when none is."""
        reports = await self.board.read.remote()
        states = {r: rep["reason"] for r, rep in sorted(reports.items())}
        if any(rep["healthy"] for rep in reports.values()):
            return Response(orjson.dumps({"status": "ok", "replicas": states}), 200, media_type=JSON)
        why = "; ".join(f"{r}: {s}" for r, s in states.items()) or "no replica has reported yet"
        return _error(fam, HttpError(503, f"no healthy replica ({why})", "unavailable_error"))

    async def metrics(self, request, fam: str):
        if self._key is not None and not self._authorized(request):
            return _error(fam, HttpError(401, "Invalid API Key"))
        if not self.metrics_on:
            return _error(fam, HttpError(501, "This server does not support metrics endpoint. Start it with `--metrics`"))
        reports = await self.board.read.remote()
        text = merge({r: rep["metrics"] for r, rep in reports.items() if rep["metrics"]})
        healthy = sum(1 for rep in reports.values() if rep["healthy"])
        own = ("# HELP fastserve_cluster_replicas Replicas that reported in the last seconds, by health.\n"
               "# TYPE fastserve_cluster_replicas gauge\n"
               f'fastserve_cluster_replicas{{healthy="true"}} {healthy}\n'
               f'fastserve_cluster_replicas{{healthy="false"}} {len(reports) - healthy}\n')
        return Response((own + text).encode(), 200, media_type=PROMETHEUS)

    def _authorized(self, request) -> bool:
        given = request.headers.get("authorization", "")
        given = given[7:].strip() if given[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        return hmac.compare_digest(hashlib.sha256(given.encode("utf-8", "replace")).digest(), self._key)


def _refused(status: int, first: bytes) -> bool:
    """A replica's server refused before it produced anything (stalled, shutting down, queue full): a 503, or
    a stream whose first event is a 503 error."""
    if status == 503:
        return True
    if status != 200 or b"error" not in first[:32]:
        return False
    data = first.split(b"data: ", 1)[-1].split(b"\n", 1)[0]
    try:
        err = orjson.loads(data).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return False
    return isinstance(err, dict) and (err.get("code") == 503 or err.get("type") == "overloaded_error")


def _gone(exc: BaseException) -> bool:
    """The replica died or is going (Ray's errors), or its server did (the replica's HTTP client failed)."""
    if isinstance(exc, GONE):
        return True
    if isinstance(exc, RayTaskError):
        import httpx
        return isinstance(exc.cause, (httpx.TransportError, *GONE))
    return False
