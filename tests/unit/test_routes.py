"""Routes on stand-ins: each route's keyword-only parameters name what it reads (routes.Routes gives
them once), so a route runs on plain objects, with no engine, no App and no socket."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import orjson
import pytest

from fastserve.errors import RequestError
from fastserve.request import SlotState
from fastserve.server import routes
from fastserve.server.config import ServerConfig
from fastserve.server.errors import HttpError
from fastserve.server.http import HttpRequest
from fastserve.server.params import Parser

IDLE, DECODE = int(SlotState.IDLE), int(SlotState.DECODE)


def _req(target: str, method: str = "GET", body: bytes = b"") -> HttpRequest:
    return HttpRequest(method, target, {"host": "h"}, body)


def _snapshot(**slots) -> SimpleNamespace:
    return SimpleNamespace(slot_state=(IDLE, DECODE), slot_tokens=(5, 9), slot_job=(0, 0), slot_reuse_from=(2, 0),
                           **slots)


INFO = SimpleNamespace(n_slots=2, n_ctx_slot=128, window=16, ring=48, speculative=None)


def test_slots_reads_the_snapshot_and_the_engines_shape():
    engine = SimpleNamespace(snapshot=_snapshot())
    out = orjson.loads(routes.slots(_req("/slots"), None, config=ServerConfig(), engine=engine, info=INFO,
                                    inflight=set()).body)
    assert [(s["id"], s["n_ctx"], s["is_processing"], s["state"], s["n_tokens"]) for s in out] == \
        [(0, 128, False, "idle", 5), (1, 128, True, "decode", 9)]
    assert (out[0]["n_swa"], out[0]["swa_ring"], out[0]["swa_reusable"], out[1]["swa_reusable"]) == (16, 48, [2, 5], None)
    with pytest.raises(HttpError) as exc:
        routes.slots(_req("/slots"), None, config=ServerConfig(slots=False), engine=engine, info=INFO, inflight=set())
    assert exc.value.status == 501
    busy = SimpleNamespace(snapshot=SimpleNamespace(**{**vars(_snapshot()), "slot_state": (DECODE, DECODE)}))
    with pytest.raises(HttpError) as exc:
        routes.slots(_req("/slots?fail_on_no_slot=1"), None, config=ServerConfig(), engine=busy, info=INFO,
                     inflight=set())
    assert exc.value.status == 503


def test_health_and_trace():
    assert routes.health(_req("/health"), None, unhealthy=lambda: None).status == 200
    sick = routes.health(_req("/health"), None, unhealthy=lambda: "stalled")
    assert sick.status == 503 and orjson.loads(sick.body)["error"]["message"] == "stalled"
    assert orjson.loads(routes.trace(_req("/trace"), None, engine=SimpleNamespace(trace_totals=lambda: {"steps": 3}))
                        .body) == {"steps": 3}
    with pytest.raises(HttpError) as exc:
        routes.trace(_req("/trace"), None, engine=SimpleNamespace(trace_totals=lambda: None))
    assert exc.value.status == 404


class _Engine:
    """erase(): answers at once (an idle slot) and checks the id as Engine.erase does."""

    def erase(self, slot, reply):
        if not 0 <= slot < 2:
            raise RequestError("slot must be in [0, 2)")
        reply(7)


def test_slot_action_erases_through_the_engine():
    def run(target, slot, unhealthy=lambda: None):
        return asyncio.run(routes.slot_action(_req(target, "POST"), None, slot, engine=_Engine(),
                                              config=ServerConfig(), unhealthy=unhealthy))

    assert orjson.loads(run("/slots/1?action=erase", 1).body) == {"id_slot": 1, "n_erased": 7}
    with pytest.raises(RequestError):
        run("/slots/5?action=erase", 5)
    for target, status in (("/slots/1?action=save", 501), ("/slots/1?action=explode", 400)):
        with pytest.raises(HttpError) as exc:
            run(target, 1)
        assert exc.value.status == status


def test_routes_give_each_route_the_services_it_names():
    services = {name: SimpleNamespace(name=name) for name in (
        "engine", "info", "tokenizer", "config", "parser", "compile", "start", "inflight", "metrics", "unhealthy",
        "alias", "started", "responses")}
    table = routes.Routes(services)
    methods, args = table.lookup("/health")
    assert args == () and methods["GET"].keywords == {"unhealthy": services["unhealthy"]}
    methods, args = table.lookup("/slots/3")
    assert args == (3,) and set(methods["POST"].keywords) == {"engine", "config", "unhealthy"}
    assert table.lookup("/slots/x") == (None, ()) and table.lookup("/nope") == (None, ())
    methods, args = table.lookup("/v1/responses/resp_1")
    assert args == ("resp_1",) and set(methods) == {"GET", "DELETE"}
    assert table.lookup("/v1/responses/a/b") == (None, ()) and table.lookup("/v1/responses/") == (None, ())
    with pytest.raises(KeyError):
        routes.Routes({k: v for k, v in services.items() if k != "parser"})     # found missing at start


def test_tokenize_and_detokenize_refuse_ids_outside_the_vocabulary(tiny_model):
    tok = tiny_model.tokenizer
    parser = Parser(tok, SimpleNamespace(n_vocab=tok.n_vocab, n_ctx_slot=128, speculative=None), ServerConfig())

    def tokenize(body: bytes):
        return routes.tokenize(_req("/tokenize", "POST", body), None, parser=parser, tokenizer=tok, info=INFO)

    assert orjson.loads(tokenize(b'{"content": [1, 2]}').body) == {"tokens": [1, 2]}
    with pytest.raises(RequestError, match=r"'content' token ids must be in \[0, 512\), got 512"):
        tokenize(b'{"content": [1, 512]}')
    with pytest.raises(RequestError, match="not in the vocabulary"):          # the tokenizer's own check
        routes.detokenize(_req("/detokenize", "POST", b'{"tokens": [512]}'), None, tokenizer=tok, info=INFO)
