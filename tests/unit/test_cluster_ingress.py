"""The cluster's ingress without a Ray cluster: its replicas' handle and its board are stand-ins that answer
as Ray's would (a stream of (status, headers) then bytes; Ray's errors when a replica dies), so each failure
path runs in milliseconds: a replica gone before the first bytes, a 503 refusal, a stream cut short, no
healthy replica, /metrics' key and flag."""
from __future__ import annotations

import asyncio

import orjson
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'fastserve[ray]')")
from ray.exceptions import RayActorError  # noqa: E402
from starlette.requests import Request  # noqa: E402

from fastserve.cluster import ingress as ingress_mod  # noqa: E402
from fastserve.cluster.ingress import Ingress  # noqa: E402

SSE = [("content-type", "text/event-stream")]
JSONH = [("content-type", "application/json; charset=utf-8")]


class Stream:
    """One call's answer: items are yielded in turn, an exception among them is raised there."""

    def __init__(self, items):
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


class Replicas:
    """The DeploymentHandle stand-in: each .handle.remote() call gets the next scripted Stream."""

    def __init__(self, *scripts):
        self.scripts = list(scripts)
        self.streams: list = []
        self.forwards: list = []

    def options(self, **_):
        return self

    @property
    def handle(self):
        return self

    def remote(self, fwd):
        self.forwards.append(fwd)
        self.streams.append(Stream(self.scripts.pop(0)))
        return self.streams[-1]


class Board:
    def __init__(self, reports):
        self.read = self
        self._reports = reports

    def remote(self):
        fut = asyncio.get_event_loop().create_future()
        fut.set_result(self._reports)
        return fut


def request(method: str, path: str, body: bytes = b"", headers=(), query: bytes = b"", raw_path=None) -> Request:
    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}
    scope = {"type": "http", "method": method, "path": path, "query_string": query,
             "headers": [(k.encode(), v.encode()) for k, v in headers]}
    if raw_path is not None:
        scope["raw_path"] = raw_path
    return Request(scope, receive)


def call(ing: Ingress, req: Request) -> tuple[int, bytes]:
    async def go():
        resp = await ing(req)
        if hasattr(resp, "body_iterator"):
            body = b"".join([c async for c in resp.body_iterator])
        else:
            body = resp.body
        return resp.status_code, body
    return asyncio.run(go())


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(ingress_mod, "RETRY_S", 0.5)
    monkeypatch.setattr(ingress_mod, "RETRY_WAIT_S", 0.01)


BODY = b'{"prompt": "The sky is", "stream": true}'
TOKEN = b'data: {"content":" blue","stop":false}\n\n'


def test_a_replica_gone_before_the_first_bytes_passes_the_request_on():
    reps = Replicas([RayActorError()], [(200, SSE), RayActorError()], [(200, SSE), TOKEN, b"data: [DONE]\n\n"])
    status, body = call(Ingress(reps, Board({})), request("POST", "/completion", BODY))
    assert status == 200 and body == TOKEN + b"data: [DONE]\n\n"
    assert len(reps.forwards) == 3 and reps.forwards[0].prompt == "The sky is"
    assert reps.forwards[0].target == "/completion" and reps.forwards[0].body == BODY


def test_the_target_goes_as_the_client_sent_it():
    reps = Replicas([(200, JSONH), b"{}"])
    req = request("GET", "/slots/0", query=b"fail_on_no_slot=1", raw_path=b"/slots/%30")
    assert call(Ingress(reps, Board({})), req) == (200, b"{}")
    assert reps.forwards[0].target == "/slots/%30?fail_on_no_slot=1" and reps.forwards[0].prompt == "GET /slots/0"


def test_a_503_before_the_first_bytes_passes_the_request_on():
    refused = b'data: {"error":{"code":503,"message":"the decode loop is stalled","type":"unavailable_error"}}\n\n'
    reps = Replicas([(503, JSONH), b'{"error":{"code":503}}'], [(200, SSE), refused], [(200, SSE), TOKEN])
    status, body = call(Ingress(reps, Board({})), request("POST", "/completion", BODY))
    assert status == 200 and body == TOKEN and all(s.cancelled for s in reps.streams)


def test_no_replica_within_the_retry_time_is_a_503_in_the_apis_shape():
    reps = Replicas(*[[RayActorError()]] * 1000)
    status, body = call(Ingress(reps, Board({})), request("POST", "/v1/chat/completions",
                                                          b'{"messages": [{"role": "user", "content": "hi"}]}'))
    err = orjson.loads(body)["error"]
    assert status == 503 and err["code"] == 503 and err["param"] is None and "no replica" in err["message"]


def test_a_stream_cut_by_a_dying_replica_ends_with_a_503_event():
    reps = Replicas([(200, SSE), TOKEN, RayActorError()])
    status, body = call(Ingress(reps, Board({})), request("POST", "/completion", BODY))
    assert status == 200 and body.startswith(TOKEN)
    tail = orjson.loads(body[len(TOKEN):].removeprefix(b"data: "))
    assert tail["error"]["code"] == 503 and "went away" in tail["error"]["message"]
    reps = Replicas([(200, SSE), b"event: message_start\ndata: {}\n\n", RayActorError()])
    _, body = call(Ingress(reps, Board({})), request("POST", "/v1/messages", b'{"messages": []}'))
    assert b"event: error\ndata: " in body and b'"overloaded_error"' in body      # Anthropic's shape


def test_a_client_gone_before_its_answer_began_cancels_the_replicas_work():
    class Hangs(Stream):
        async def __anext__(self):
            await asyncio.sleep(3600)

    reps = Replicas()
    reps.remote = lambda fwd: reps.streams.append(Hangs([])) or reps.streams[-1]

    async def go():
        task = asyncio.ensure_future(Ingress(reps, Board({}))(request("POST", "/completion", b'{"prompt": "x"}')))
        await asyncio.sleep(0.05)
        task.cancel()               # what Ray Serve does when the HTTP client disconnects
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(go())
    assert reps.streams[0].cancelled


def test_a_bug_in_a_replica_is_a_500_not_a_retry():
    reps = Replicas([ValueError("bug")])
    status, body = call(Ingress(reps, Board({})), request("POST", "/completion", BODY))
    assert status == 500 and len(reps.forwards) == 1 and "ValueError" in orjson.loads(body)["error"]["message"]


def test_health_is_503_with_each_replicas_reason_when_none_is_healthy():
    sick = {"a": {"healthy": False, "reason": "the decode loop is stalled", "metrics": ""}}
    status, body = call(Ingress(Replicas(), Board(sick)), request("GET", "/health"))
    assert status == 503 and "a: the decode loop is stalled" in orjson.loads(body)["error"]["message"]
    status, body = call(Ingress(Replicas(), Board({})), request("GET", "/health"))
    assert status == 503 and "no replica has reported" in orjson.loads(body)["error"]["message"]
    ok = {**sick, "b": {"healthy": True, "reason": "ok", "metrics": ""}}
    status, body = call(Ingress(Replicas(), Board(ok)), request("GET", "/health"))
    assert status == 200 and orjson.loads(body)["replicas"] == {"a": "the decode loop is stalled", "b": "ok"}


def test_metrics_asks_for_the_key_and_the_flag():
    reports = {"a": {"healthy": True, "reason": "ok", "metrics": "# HELP x X\n# TYPE x gauge\nx 1\n"}}
    ing = Ingress(Replicas(), Board(reports), api_key="k", metrics=True)
    assert call(ing, request("GET", "/metrics"))[0] == 401
    status, body = call(ing, request("GET", "/metrics", headers=[("authorization", "Bearer k")]))
    assert status == 200 and b'x{replica="a"} 1' in body and b'fastserve_cluster_replicas{healthy="true"} 1' in body
    status, body = call(Ingress(Replicas(), Board(reports)), request("GET", "/metrics"))
    assert status == 501 and b"--metrics" in body
