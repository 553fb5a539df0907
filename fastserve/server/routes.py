"""The route table and the routes that read state: /health, /slots, /metrics, /props, /trace, /tokenize, /detokenize.

Every route is a plain function `route(req, ex, *, services...)` returning a Response (or, for the
ones that wait, a coroutine); its keyword-only parameters say what it reads, given once at start
(Routes), so that a route runs as well on stand-ins. The monitoring routes read only the engine's
published snapshot (DESIGN.md contract 5) and its fixed EngineInfo: they answer in microseconds
whatever the decode thread is doing, stuck in a forward pass included.
"""
from __future__ import annotations

import asyncio
import inspect
import time
from functools import partial

from ..config import check_token_ids
from ..request import SlotState
from . import anthropic_api, embeddings_api, llama_api, ollama_api, openai_api, responses_api, webui
from .config import BUILD_INFO
from .errors import ANTHROPIC, LLAMA, OLLAMA, OPENAI, HttpError, error_json
from .fields import parse_object
from .params import PROMPT_CHARS_PER_TOKEN, settings_json
from .response import PROMETHEUS, Response, json_response

IDLE = SlotState.IDLE


def health(req, ex, *, unhealthy):
    reason = unhealthy()
    if reason:
        return Response(503, error_json(LLAMA, 503, reason, "unavailable_error"))
    return json_response({"status": "ok"})


def slots(req, ex, *, config, engine, info, inflight):
    if not config.slots:
        raise HttpError(501, "This server does not support slots endpoint. Start it with `--slots`")
    snap = engine.snapshot
    if req.query.get("fail_on_no_slot") not in (None, "", "0", "false") and IDLE not in snap.slot_state:
        raise HttpError(503, "no slot available")
    # Sliding-window models: n_swa keys per local layer, which keeps swa_ring positions per slot (0: all);
    # an idle slot's cached prefix is reused by a prompt sharing m tokens with it only for m in
    # swa_reusable = [lo, n_tokens] (null while the slot is busy); a shorter shared prefix reuses nothing.
    running = {g.text.id: g for g in inflight}
    spec = info.speculative is not None and info.speculative.on
    return json_response([
        {"id": i, "id_task": job or -1, "n_ctx": info.n_ctx_slot, "is_processing": state != IDLE,
         "state": SlotState(state).name.lower(), "n_tokens": n_tok, "speculative": spec,
         "n_swa": info.window, "swa_ring": info.ring, "swa_reusable": _reusable(lo, n_tok) if state == IDLE else None,
         **(_draft_fields(snap.slot_drafts[i]) if spec else {}),
         **(_request_fields(running[job]) if job in running else {})}
        for i, (state, n_tok, job, lo) in enumerate(zip(snap.slot_state, snap.slot_tokens, snap.slot_job,
                                                         snap.slot_reuse_from))])


def _draft_fields(drafts) -> dict:
    """Speculative decoding on a slot, for its current (or last) request: tokens drafted and accepted (the
    names of llama-server's timings), and their ratio."""
    n, accepted = drafts
    return {"draft_n": n, "draft_n_accepted": accepted, "draft_acceptance": accepted / n if n else 0.0}


def _request_fields(gen) -> dict:
    """llama-server's fields of the request a slot runs (its names; llama-server's n_prompt_tokens counts the
    slot's tokens so far, here it is the prompt's, and `n_tokens` says the other): the prompt's tokens,
    computed and reused, the request's sampling `params` (seed: the one in use, drawn at random when the
    request gave none) and `next_token`: whether more are coming, a newline among them so far, tokens
    left (-1: until the slot is full) and generated. Read on the loop from the request's own objects."""
    reader, n_cached, max_tokens = gen.reader, gen.reader.n_cached, gen.params.max_tokens
    n_decoded = reader.count
    return {
        "n_prompt_tokens": gen.n_prompt,
        "n_prompt_tokens_processed": gen.n_prompt - n_cached,
        "n_prompt_tokens_cache": n_cached,
        "params": gen.params.settings(gen.sampling),
        "next_token": [{"has_next_token": not reader.finished, "has_new_line": "\n" in gen.text.text,
                        "n_remain": -1 if max_tokens < 0 else max(0, max_tokens - n_decoded),
                        "n_decoded": n_decoded}],
    }


def _reusable(lo: int, n_tokens: int) -> list:
    """[lo, n_tokens], or [0, 0] when the ring holds too little of the prefix for any reuse."""
    return [lo, n_tokens] if lo <= n_tokens else [0, 0]


def metrics(req, ex, *, config, metrics):
    if not config.metrics:
        raise HttpError(501, "This server does not support metrics endpoint. Start it with `--metrics`")
    return Response(200, metrics.render(), PROMETHEUS, metrics.headers())


def trace(req, ex, *, engine):
    """GET /trace: the tracer's running totals (tracer.Tracer.totals); a client diffs two readings."""
    totals = engine.trace_totals()
    if totals is None:
        raise HttpError(404, "tracing is off in this server")
    return json_response(totals)


def props(req, ex, *, config, tokenizer, info, alias):
    """llama-server's GET /props fields (those fastserve has a value for)."""
    tok = tokenizer
    return json_response({
        "default_generation_settings": {"n_ctx": info.n_ctx_slot, "params": settings_json(
            config.sampling, -1 if config.seed is None else config.seed, config.n_predict,
            ignore_eos=config.ignore_eos)},
        "total_slots": info.n_slots,
        "model_alias": alias,
        "model_path": info.model_path,
        "speculative": _speculative(info.speculative),
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": config.slots,
        "endpoint_props": config.props,
        "endpoint_metrics": config.metrics,
        "chat_template": tok.chat_template or "",
        "bos_token": _piece(tok, getattr(tok, "bos_id", None)),
        "eos_token": _piece(tok, getattr(tok, "eos_id", None)),
        "build_info": BUILD_INFO,
        "is_sleeping": False,
    })


def _speculative(spec) -> dict:
    """/props' speculative decoding (fastserve's field): the drafter, its draft model (a path, "" for the n-gram
    drafters) and the server's speculative.* limits; {"type": "none"} when off."""
    if spec is None or not spec.on:
        return {"type": "none"}
    lim = spec.limits
    return {"type": spec.type, "draft_model": spec.draft_model, "n_max": spec.most, "n_min": lim.n_min,
            "p_min": lim.p_min}


def set_props(req, ex, *, config):
    """POST /props: llama-server takes it only with --props, and changes nothing (yet); nor can fastserve, so
    a field asked to change is a 400 rather than a success that did nothing."""
    if not config.props:
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


def tokenizer_info(req, ex, *, tokenizer, info):
    """vLLM's GET /tokenizer_info, which lm-evaluation-harness's remote tokenizer reads: the special tokens' texts
    (null: the model has none), the chat template, a slot's context."""
    tok = tokenizer

    def text(tid):
        return None if tid is None else tok.token_text(tid)
    return json_response({"tokenizer_class": "fastserve", "bos_token": text(tok.bos_id), "eos_token": text(tok.eos_id),
                          "pad_token": text(tok.pad_id), "unk_token": text(tok.unk_id), "add_bos_token": tok.add_bos,
                          "chat_template": tok.chat_template or None, "model_max_length": info.n_ctx_slot})


def tokenize(req, ex, *, parser, tokenizer, info):
    """At most the whole KV cache's tokens at once. vLLM's field names too: 'prompt' for 'content',
    'add_special_tokens' for 'add_special' (vLLM's default, true, with 'prompt')."""
    body = parse_object(req.body)
    if body.has("content") and body.has("prompt"):
        raise HttpError(400, "give 'content' (llama-server) or 'prompt' (vLLM), not both")
    vllm = body.has("prompt")
    content = body.raw("prompt" if vllm else "content")
    if content is None:
        raise HttpError(400, f"'{'prompt' if vllm else 'content'}' is required")
    if body.has("add_special") and body.has("add_special_tokens"):
        raise HttpError(400, "give 'add_special' (llama-server) or 'add_special_tokens' (vLLM), not both")
    add_special = body.bool("add_special") if body.has("add_special") else body.bool("add_special_tokens", vllm)
    cap = info.n_ctx_slot * info.n_slots
    if isinstance(content, str):
        if len(content) > cap * PROMPT_CHARS_PER_TOKEN:
            raise HttpError(400, f"'content' has {len(content)} characters; at most {cap * PROMPT_CHARS_PER_TOKEN} "
                                 f"are tokenized at once")
        ids = tokenizer.encode(content, add_special=add_special,
                               parse_special=body.bool("parse_special", True))
    else:
        ids = parser.prompt(content, "content", limit=cap)
        check_token_ids(ids, tokenizer.n_vocab, "'content'")
    if body.bool("with_pieces"):
        out = []
        for t in ids:
            b = tokenizer.token_bytes(t)
            try:
                piece = b.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(b)
            out.append({"id": t, "piece": piece})
        return json_response({"tokens": out})
    return json_response({"tokens": ids})


def detokenize(req, ex, *, tokenizer, info):
    body = parse_object(req.body)
    ids = body.raw("tokens", [])
    cap = info.n_ctx_slot * info.n_slots
    if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
        raise HttpError(400, "'tokens' must be an array of token ids")
    if len(ids) > cap:
        raise HttpError(400, f"'tokens' has {len(ids)} ids; at most {cap} are detokenized at once")
    text = tokenizer.decode(ids)                   # an id outside the vocabulary: its RequestError
    return json_response({"content": text, "prompt": text})     # llama-server's name, vLLM's


async def slot_action(req, ex, slot: int, *, engine, config, unhealthy):
    """POST /slots/{id}?action=erase. A busy slot is erased when its request ends, before it takes
    another (llama-server defers it too), never by cutting the request running there; the answer
    waits for the engine's reply at most ServerConfig.erase_wait seconds (503 after that; the erasure
    still happens), and no longer than the server stays healthy. A slot id out of range: the engine's 400."""
    action = req.query.get("action")
    if action in ("save", "restore"):
        raise HttpError(501, f"slot {action} is not supported")
    if action != "erase":
        raise HttpError(400, "'action' must be erase (?action=erase)")
    loop = asyncio.get_running_loop()
    erased = loop.create_future()
    engine.erase(slot, lambda n: _call_soon(loop, _resolve, erased, n))
    deadline = time.monotonic() + config.erase_wait
    while not erased.done():
        reason = unhealthy()
        if reason:
            raise HttpError(503, reason)
        left = deadline - time.monotonic()
        if left <= 0:
            raise HttpError(503, f"slot {slot} stayed busy for {config.erase_wait:g} s; it is erased when its "
                            f"request ends")
        await asyncio.wait((erased,), timeout=min(left, config.tick))   # the health check's period
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


def not_supported(req, ex):
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
    "/tokenizer_info": {"GET": tokenizer_info},
    "/detokenize": {"POST": detokenize},
    "/completion": {"POST": llama_api.completion},
    "/completions": {"POST": llama_api.completion},
    "/apply-template": {"POST": llama_api.apply_template},
    "/v1/models": {"GET": openai_api.models},
    "/models": {"GET": openai_api.models},
    "/v1/completions": {"POST": openai_api.completions},
    "/v1/chat/completions": {"POST": openai_api.chat_completions},
    "/chat/completions": {"POST": openai_api.chat_completions},
    "/v1/messages": {"POST": anthropic_api.messages},
    "/v1/messages/count_tokens": {"POST": anthropic_api.count_tokens},
    "/v1/responses": {"POST": responses_api.create},
    "/embedding": {"POST": embeddings_api.embedding},
    "/embeddings": {"POST": embeddings_api.embedding},
    "/v1/embeddings": {"POST": embeddings_api.create},
    "/infill": {"POST": not_supported},
    **ollama_api.ROUTES,
}
# routes of a path that ends in an id, the route's third argument: prefix -> (methods, the id's test, its type)
ID_ROUTES = {
    "/slots/": ({"POST": slot_action}, lambda tail: tail.isdigit() and len(tail) < 7, int),
    "/v1/responses/": ({"GET": responses_api.retrieve, "DELETE": responses_api.delete},
                       lambda tail: 0 < len(tail) <= 64 and "/" not in tail, str),
}
# no API key asked: as llama-server, and "/" (the page holds no secret; it asks for the key itself)
PUBLIC = frozenset({"/", "/health", "/v1/health", "/models", "/v1/models"})
OPENAI_PATHS = frozenset({"/v1/models", "/models", "/v1/completions", "/v1/chat/completions", "/chat/completions",
                          "/v1/embeddings", "/v1/health"})
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


def family(path: str) -> str:
    """The error format of a path's answers (errors.py)."""
    if path in ANTHROPIC_PATHS or path.startswith("/v1/messages/"):
        return ANTHROPIC
    if path.startswith("/api/"):
        return OLLAMA
    return OPENAI if path in OPENAI_PATHS or path.startswith("/v1/") else LLAMA


class Routes:
    """The route table of one server: each route's keyword-only parameters name the services it reads
    (App's table: engine, info, config, parser, ...), resolved here once, at start; a route is then
    route(req, ex, *args)."""

    def __init__(self, services: dict):
        self.paths = {path: _bind(methods, services) for path, methods in ROUTES.items()}
        self.ids = {prefix: (_bind(methods, services), valid, typ) for prefix, (methods, valid, typ) in ID_ROUTES.items()}

    def lookup(self, path: str):
        """(methods dict, extra args) for a path, or (None, ()) when unknown."""
        methods = self.paths.get(path)
        if methods is not None:
            return methods, ()
        for prefix, (methods, valid, typ) in self.ids.items():
            if path.startswith(prefix):
                tail = path[len(prefix):]
                if valid(tail):
                    return methods, (typ(tail),)
        return None, ()


def _bind(methods: dict, services: dict) -> dict:
    """{method: route with its services given}; a route naming a service there is none of fails here, at start."""
    out = {}
    for method, route in methods.items():
        names = [p.name for p in inspect.signature(route).parameters.values() if p.kind is p.KEYWORD_ONLY]
        out[method] = partial(route, **{name: services[name] for name in names})
    return out
