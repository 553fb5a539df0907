"""The route table and the routes that read state: /health, /slots, /metrics, /props, /trace, /tokenize, /detokenize.

Every route is a plain function `route(app, req, ex)` returning a Response (or,
for the ones that wait, a coroutine). The monitoring routes read only the
engine's published snapshot (DESIGN.md contract 5): they answer in microseconds
whatever the decode thread is doing, stuck in a forward pass included.
"""
from __future__ import annotations

import asyncio
import time

from ..request import SlotState
from . import llama_api, openai_api, webui
from .errors import LLAMA, HttpError, error_json
from .fields import parse_object
from .response import PROMETHEUS, Response, json_response

IDLE = SlotState.IDLE


def health(app, req, ex):
    reason = app.unhealthy_reason()
    if reason:
        return Response(503, error_json(LLAMA, 503, reason, "unavailable_error"))
    return json_response({"status": "ok"})


def slots(app, req, ex):
    if not app.config.slots:
        raise HttpError(501, "This server does not support slots endpoint. Start it with `--slots`")
    eng = app.engine
    snap, info = eng.snapshot, eng.describe()
    n_ctx = info.n_ctx_slot
    if req.query.get("fail_on_no_slot") not in (None, "", "0", "false") and IDLE not in snap.slot_state:
        raise HttpError(503, "no slot available")
    # Sliding-window models: n_swa keys per local layer, which keeps swa_ring positions per slot (0: all);
    # an idle slot's cached prefix is reused by a prompt sharing m tokens with it only for m in
    # swa_reusable = [lo, n_tokens] (null while the slot is busy); a shorter shared prefix reuses nothing.
    window, ring = info.window, info.ring
    running = {g.text.id: g for g in app.inflight}
    return json_response([
        {"id": i, "id_task": job or -1, "n_ctx": n_ctx, "is_processing": state != IDLE,
         "state": SlotState(state).name.lower(), "n_tokens": n_tok, "speculative": False,
         "n_swa": window, "swa_ring": ring, "swa_reusable": _reusable(lo, n_tok) if state == IDLE else None,
         **(_request_fields(app, running[job]) if job in running else {})}
        for i, (state, n_tok, job, lo) in enumerate(zip(snap.slot_state, snap.slot_tokens, snap.slot_job,
                                                         snap.slot_reuse_from))])


def _request_fields(app, gen) -> dict:
    """llama-server's fields of the request a slot runs (its names; llama-server's n_prompt_tokens counts the
    slot's tokens so far, here it is the prompt's, and `n_tokens` says the other): the prompt's tokens,
    computed and reused, the request's sampling `params` (seed: the one in use, drawn at random when the
    request gave none) and `next_token`: whether more are coming, a newline among them so far, tokens
    left (-1: until the slot is full) and generated. Read on the loop from the request's own objects."""
    text, reader = gen.text, gen.reader
    samp = text.params
    n_decoded = reader.count
    fields = {name: getattr(samp, name) for name in (*llama_api.SERVER_WIDE, "n_probs", "post_sampling_probs")}
    return {
        "n_prompt_tokens": gen.n_prompt,
        "n_prompt_tokens_processed": gen.n_prompt - reader.n_cached,
        "n_prompt_tokens_cache": reader.n_cached,
        "params": llama_api.params_json(app, fields, samp.seed, text.max_tokens, **gen.settings),
        "next_token": [{"has_next_token": not reader.finished, "has_new_line": "\n" in text.text,
                        "n_remain": -1 if text.max_tokens < 0 else max(0, text.max_tokens - n_decoded),
                        "n_decoded": n_decoded}],
    }


def _reusable(lo: int, n_tokens: int) -> list:
    """[lo, n_tokens], or [0, 0] when the ring holds too little of the prefix for any reuse."""
    return [lo, n_tokens] if lo <= n_tokens else [0, 0]


def metrics(app, req, ex):
    if not app.config.metrics:
        raise HttpError(501, "This server does not support metrics endpoint. Start it with `--metrics`")
    return Response(200, app.metrics.render(), PROMETHEUS, app.metrics.headers())


def trace(app, req, ex):
    """GET /trace: the tracer's running totals (tracer.Tracer.totals); a client diffs two readings."""
    totals = app.engine.trace_totals()
    if totals is None:
        raise HttpError(404, "tracing is off in this server")
    return json_response(totals)


def props(app, req, ex):
    """llama-server's GET /props fields (those fastserve has a value for)."""
    eng = app.engine
    tok, info = eng.tokenizer, eng.describe()
    return json_response({
        "default_generation_settings": {"n_ctx": info.n_ctx_slot, "params": llama_api.params_json(
            app, {}, app.config.seed, app.config.n_predict)},
        "total_slots": info.n_slots,
        "model_alias": app.model_alias,
        "model_path": info.model_path,
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": app.config.slots,
        "endpoint_props": app.config.props,
        "endpoint_metrics": app.config.metrics,
        "chat_template": tok.chat_template or "",
        "bos_token": _piece(tok, getattr(tok, "bos_id", None)),
        "eos_token": _piece(tok, getattr(tok, "eos_id", None)),
        "build_info": app.fingerprint,
        "is_sleeping": False,
    })


def set_props(app, req, ex):
    """POST /props: llama-server takes it only with --props, and changes nothing (yet); nor can fastserve, so
    a field asked to change is a 400 rather than a success that did nothing."""
    if not app.config.props:
        raise HttpError(501, "This server does not support changing global properties. Start it with `--props`")
    body = parse_object(req.body)
    if body.data:
        raise HttpError(400, f"properties cannot be changed while the server runs: {', '.join(sorted(body.data))}; "
                             f"restart it with other flags")
    return json_response({"success": True})


def _piece(tok, tid) -> str:
    if tid is None or not 0 <= tid < tok.n_vocab:
        return ""
    return tok.token_text(tid)


def tokenize(app, req, ex):
    body = parse_object(req.body)
    content = body.raw("content")
    if content is None:
        raise HttpError(400, "'content' is required")
    tok, info = app.engine.tokenizer, app.engine.describe()
    cap = info.n_ctx_slot * info.n_slots * llama_api.PROMPT_CHARS_PER_TOKEN
    if isinstance(content, str):
        if len(content) > cap:
            raise HttpError(400, f"'content' has {len(content)} characters; at most {cap} are tokenized at once")
        ids = tok.encode(content, add_special=body.bool("add_special"), parse_special=body.bool("parse_special", True))
    else:
        ids = llama_api.prompt_ids(app, content, "content", limit=info.n_ctx_slot * info.n_slots)
    if body.bool("with_pieces"):
        out = []
        for t in ids:
            b = tok.token_bytes(t)
            try:
                piece = b.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(b)
            out.append({"id": t, "piece": piece})
        return json_response({"tokens": out})
    return json_response({"tokens": ids})


def detokenize(app, req, ex):
    body = parse_object(req.body)
    ids = body.raw("tokens", [])
    tok, info = app.engine.tokenizer, app.engine.describe()
    cap = info.n_ctx_slot * info.n_slots
    if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
        raise HttpError(400, "'tokens' must be an array of token ids")
    if len(ids) > cap:
        raise HttpError(400, f"'tokens' has {len(ids)} ids; at most {cap} are detokenized at once")
    if any(not 0 <= t < tok.n_vocab for t in ids):
        raise HttpError(400, f"token ids must be in [0, {tok.n_vocab})")
    return json_response({"content": tok.decode(ids)})


async def slot_action(app, req, ex, slot: int):
    """POST /slots/{id}?action=erase. A busy slot is erased when its request ends, before it takes
    another (llama-server defers it too), never by cutting the request running there; the answer
    waits for the engine's reply at most ServerConfig.erase_wait seconds (503 after that; the erasure
    still happens), and no longer than the server stays healthy."""
    action = req.query.get("action")
    if action in ("save", "restore"):
        raise HttpError(501, f"slot {action} is not supported")
    if action != "erase":
        raise HttpError(400, "'action' must be erase (?action=erase)")
    eng = app.engine
    n_slots = eng.describe().n_slots
    if not 0 <= slot < n_slots:
        raise HttpError(400, f"slot id must be in [0, {n_slots})")
    loop = asyncio.get_running_loop()
    erased = loop.create_future()
    eng.erase(slot, lambda n: _call_soon(loop, _resolve, erased, n))
    deadline = time.monotonic() + app.config.erase_wait
    while not erased.done():
        reason = app.unhealthy_reason()
        if reason:
            raise HttpError(503, reason)
        left = deadline - time.monotonic()
        if left <= 0:
            raise HttpError(503, f"slot {slot} stayed busy for {app.config.erase_wait:g} s; it is erased when its "
                            f"request ends")
        await asyncio.wait((erased,), timeout=min(left, app.config.tick))   # the health check's period
    return json_response({"id_slot": slot, "n_erased": erased.result()})


def _call_soon(loop, fn, *args) -> None:
    """From the decode thread: run fn on loop (returns at once; a closed loop has nobody left to tell)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _resolve(fut, value) -> None:
    if not fut.done():
        fut.set_result(value)


def not_supported(app, req, ex):
    raise HttpError(501, f"{req.path} is not supported by fastserve")


# path -> {method: route}; the family picks the error format.
ROUTES = {
    "/": {"GET": webui.index, "HEAD": webui.index},
    "/health": {"GET": health},
    "/v1/health": {"GET": health},
    "/slots": {"GET": slots},
    "/metrics": {"GET": metrics},
    "/trace": {"GET": trace},
    "/props": {"GET": props, "POST": set_props},
    "/tokenize": {"POST": tokenize},
    "/detokenize": {"POST": detokenize},
    "/completion": {"POST": llama_api.completion},
    "/completions": {"POST": llama_api.completion},
    "/v1/models": {"GET": openai_api.models},
    "/models": {"GET": openai_api.models},
    "/v1/completions": {"POST": openai_api.completions},
    "/v1/chat/completions": {"POST": openai_api.chat_completions},
    "/chat/completions": {"POST": openai_api.chat_completions},
    "/embedding": {"POST": not_supported},
    "/embeddings": {"POST": not_supported},
    "/v1/embeddings": {"POST": not_supported},
    "/infill": {"POST": not_supported},
}
# no API key asked: as llama-server, and "/" (the page holds no secret; it asks for the key itself)
PUBLIC = frozenset({"/", "/health", "/v1/health", "/models", "/v1/models"})
OPENAI_PATHS = frozenset({"/v1/models", "/models", "/v1/completions", "/v1/chat/completions", "/chat/completions",
                          "/v1/embeddings", "/v1/health"})


def lookup(path: str):
    """(methods dict, extra args) for a path, or (None, ()) when unknown."""
    methods = ROUTES.get(path)
    if methods is not None:
        return methods, ()
    if path.startswith("/slots/"):
        tail = path[len("/slots/"):]
        if tail.isdigit() and len(tail) < 7:
            return {"POST": slot_action}, (int(tail),)
    return None, ()
