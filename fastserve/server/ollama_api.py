"""Ollama's API over the same engine: /api/chat, /api/generate, /api/embed (and the older /api/embeddings),
/api/tags, /api/show, /api/ps, /api/version, as the `ollama` package and the desktop apps that speak Ollama
call them.

A chat or generate request is translated into the chat route's form (ollama_body.py, then
params.Parser.chat_body; raw generate: the completions route's) so that the template, tools, JSON formats
and every field check are the chat's:

    model                         required; this server's one model (its alias, with or without ":latest"),
                                  else 404 "model ... not found"
    messages (role, content,      the chat's messages; tool_calls' arguments kept as objects, a tool message
      tool_calls, tool_name)      answering the last call of its tool_name; images: 400 (no vision); an
                                  assistant's thinking is left out of the prompt (the templates drop it)
    prompt, system, raw           generate: the prompt as the user's message after the system (raw: the prompt
                                  as it is, no template); no prompt and no messages: the model "loads"
                                  (done_reason "load")
    format "" | "json" | schema   response_format: text, a JSON object, that schema
    tools                         the chat's tools (OpenAI's shape, which Ollama's is)
    think true | false            thinking on (no budget) | off (server/reasoning.py); levels: 400
    logprobs, top_logprobs        each token's logprob and its top_logprobs alternatives (0-20), as OpenAI's chat
    stream (default true)         NDJSON, one object a line, the last with done true and the counts
    keep_alive                    taken (a duration): the one model stays loaded whatever it says
    options                       ollama_body.OPTIONS: each taken, taken with no effect (and why), or refused

Refused (400, never ignored): any other field, an option not in OPTIONS, suffix / template / context /
images. The answer carries Ollama's fields: done_reason (stop, length,
load), total_duration, load_duration (0: the model is loaded at start), prompt_eval_count /
prompt_eval_duration, eval_count / eval_duration (ns). Errors: {"error": "..."} (errors.OLLAMA) with 400,
404 and 5xx as Ollama; in a stream, a last line {"error": "..."}.
"""
from __future__ import annotations

import os
import time
from datetime import datetime, timezone

import orjson

from .embeddings_api import inputs, vectors
from . import ollama_body
from .errors import HttpError
from .fanout import run_all
from .fields import Body, parse_object
from .openai_api import start_chat
from .probs import chat_logprobs
from .reasoning import Splitter, split
from .response import StreamResponse, json_response

NDJSON = "application/x-ndjson"
# The Ollama release whose API these routes follow: clients gate features on /api/version (fastserve's own
# version: /props' build_info).
OLLAMA_VERSION = "0.12.0"
NEVER = "2318-01-01T00:00:00Z"          # /api/ps' expires_at: the model is never unloaded (Ollama's keep_alive -1)
DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop"}
# general.file_type (llama.cpp's llama_ftype) -> the quantization name Ollama shows
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              32: "BF16"}


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# -- the answers ----------------------------------------------------------------------------------------

def _counts(gen, t0: float) -> dict:
    """done_reason and the counts of a finished generation (durations in ns)."""
    t = gen.timings()
    return {"done_reason": DONE_REASONS.get(gen.openai_finish_reason, "stop"),
            "total_duration": int((time.monotonic() - t0) * 1e9), "load_duration": 0,
            "prompt_eval_count": gen.n_prompt, "prompt_eval_duration": int(t["prompt_ms"] * 1e6),
            "eval_count": len(gen.ids), "eval_duration": int(t["predicted_ms"] * 1e6)}


class Logprobs:
    """A request's logprobs as Ollama writes them (OpenAI chat's entries: token, bytes, logprob, top_logprobs);
    k: the alternatives shown, None when the request did not ask."""

    def __init__(self, tokenizer, body: Body):
        self.tokenizer = tokenizer
        self.k = (body.int("top_logprobs", 0) or 0) if body.bool("logprobs") else None

    def fields(self, ids: list, probs) -> dict:
        if self.k is None:
            return {}
        return {"logprobs": chat_logprobs(self.tokenizer, ids, probs or [], self.k)}


def _line(obj: dict) -> bytes:
    return orjson.dumps(obj) + b"\n"


def _stream(events) -> StreamResponse:
    return StreamResponse(events, on_error=lambda err: _line({"error": err.message}), content_type=NDJSON)


def _loaded(model: str, field: str, empty) -> dict:
    """The answer to a request with nothing to generate: the model is loaded (it always is)."""
    return {"model": model, "created_at": _now(), field: empty, "done": True, "done_reason": "load"}


async def chat(req, ex, *, parser, compile, start, alias, tokenizer):
    t0 = time.monotonic()
    body = parse_object(req.body)
    ollama_body.known(body, ollama_body.CHAT_FIELDS, "/api/chat")
    model = ollama_body.model_name(body, alias)
    out = ollama_body.common_fields(body, parser.n_ctx)
    lp = Logprobs(tokenizer, body)
    messages = ollama_body.chat_messages(body.raw("messages", []))
    if not messages:
        return json_response(_loaded(model, "message", {"role": "assistant", "content": ""}))
    out["messages"] = messages
    if body.raw("tools"):
        out["tools"] = body.raw("tools")
    params, gens = await start_chat(ex, parser.chat_body(Body(out)), parser=parser, compile=compile, start=start)
    gen, plan = gens[0], params.tools
    think = params.reasoning if params.reasoning is not None and params.reasoning.split else None

    def message(text: str, thought: str = "", calls=None) -> dict:
        m = {"role": "assistant", "content": text}
        if thought:
            m["thinking"] = thought
        if calls:
            m["tool_calls"] = [{"function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
        return m

    def final() -> dict:
        """The whole reply: its content, thinking and tool calls."""
        content, calls = plan.calls(gen.text.text) if plan is not None else (gen.text.text, None)
        thought = ""
        if think is not None and plan is None:
            thought, content = split(think, content)
        return message(content or "", thought, calls)

    if not params.stream:
        await run_all(gens)
        return json_response({"model": model, "created_at": _now(), "message": final(), "done": True,
                              **_counts(gen, t0), **lp.fields(gen.ids, gen.probs)})

    async def events():
        splitter = Splitter(think) if think is not None else None
        async for d in gen.deltas():
            if plan is None and (d.text or (lp.k is not None and d.ids)):
                thought, text = splitter.feed(d.text) if splitter is not None else ("", d.text)
                if thought or text or lp.k is not None:
                    yield _line({"model": model, "created_at": _now(), "message": message(text, thought), "done": False,
                                 **lp.fields(d.ids, d.probs)})
        last = message("")
        if plan is not None:            # a call is known to be one when its JSON is complete
            last = final()
        elif splitter is not None:
            thought, text = splitter.flush()
            last = message(text, thought)
        yield _line({"model": model, "created_at": _now(), "message": last, "done": True, **_counts(gen, t0)})
    return _stream(events())


async def generate(req, ex, *, parser, compile, start, alias, tokenizer):
    t0 = time.monotonic()
    body = parse_object(req.body)
    ollama_body.known(body, ollama_body.GENERATE_FIELDS, "/api/generate")
    model = ollama_body.model_name(body, alias)
    lp = Logprobs(tokenizer, body)
    for name, why in (("suffix", "no fill-in-the-middle"), ("template", "the model's chat template is used (or the "
                      "server's --chat-template)"), ("context", "send the conversation to /api/chat instead"),
                      ("images", "this server's model has no vision")):
        if body.raw(name):
            raise HttpError(400, f"'{name}' is not supported: {why}")
    out = ollama_body.common_fields(body, parser.n_ctx)
    prompt, system = body.str("prompt", ""), body.str("system")
    if not prompt:
        return json_response(_loaded(model, "response", ""))
    if body.bool("raw"):
        if system is not None or body.raw("think") is not None:
            raise HttpError(400, "'raw' takes the prompt as it is: no 'system' or 'think'")
        out["prompt"] = prompt
        if out.pop("logprobs", None):                # the completions route's logprobs: the alternatives shown
            out["logprobs"] = out.pop("top_logprobs", 0)
        out.pop("top_logprobs", None)
        fmt = out.pop("response_format", None)      # the completions route reads a schema as json_schema
        if fmt is not None:
            out["json_schema"] = fmt.get("json_schema", {}).get("schema", {"type": "object"})
        params = parser.completions(orjson.dumps(out))
        compiled = await compile(params.constraint, params.limits)
        gen = start(ex, params.prompts[0], params.sampling, params, compiled)
        think = None
    else:
        out["messages"] = ([{"role": "system", "content": system}] if system is not None else []) + \
                          [{"role": "user", "content": prompt}]
        params, gens = await start_chat(ex, parser.chat_body(Body(out)), parser=parser, compile=compile, start=start)
        gen = gens[0]
        think = params.reasoning if params.reasoning is not None and params.reasoning.split else None

    def piece(text: str, thought: str = "") -> dict:
        return {"model": model, "created_at": _now(), "response": text, **({"thinking": thought} if thought else {})}

    if not params.stream:
        await run_all([gen])
        thought, text = split(think, gen.text.text) if think is not None else ("", gen.text.text)
        return json_response({**piece(text, thought), "done": True, **_counts(gen, t0),
                              **lp.fields(gen.ids, gen.probs)})

    async def events():
        splitter = Splitter(think) if think is not None else None
        async for d in gen.deltas():
            if d.text or (lp.k is not None and d.ids):
                thought, text = splitter.feed(d.text) if splitter is not None else ("", d.text)
                if thought or text or lp.k is not None:
                    yield _line({**piece(text, thought), "done": False, **lp.fields(d.ids, d.probs)})
        thought, text = splitter.flush() if splitter is not None else ("", "")
        yield _line({**piece(text, thought), "done": True, **_counts(gen, t0)})
    return _stream(events())


# -- embeddings ----------------------------------------------------------------------------------------

async def embed(req, ex, *, engine, config, info, alias, parser):
    """Ollama's /api/embed: Euclidean-normalised vectors of the server's --pooling (none: refused); truncate
    (default true) keeps an input's first tokens that fit a slot, false refuses a longer input."""
    t0 = time.monotonic()
    body = parse_object(req.body)
    ollama_body.known(body, ollama_body.EMBED_FIELDS, "/api/embed")
    model = ollama_body.model_name(body, alias)
    ollama_body.options(body, {}, info.n_ctx_slot, allowed={"num_ctx"})
    ollama_body.keep_alive(body)
    dims = body.int("dimensions")
    if dims is not None and dims != info.n_embd:
        raise HttpError(400, f"'dimensions' {dims}: this model's embeddings have {info.n_embd} (no truncation)")
    if config.pooling == "none":
        raise HttpError(400, "the server's --pooling none gives every token's vector: /api/embed needs mean, cls "
                             "or last")
    texts = inputs(body.raw("input"), "input") if body.has("input") else []
    if not texts:
        return json_response({"model": model, "embeddings": [], "total_duration": 0, "load_duration": 0,
                              "prompt_eval_count": 0})
    vecs, n_tokens = await vectors(engine, parser, texts, config.pooling, 2, truncate=body.bool("truncate", True))
    return json_response({"model": model, "embeddings": vecs, "total_duration": int((time.monotonic() - t0) * 1e9),
                          "load_duration": 0, "prompt_eval_count": n_tokens})


async def embeddings(req, ex, *, engine, config, info, alias, parser):
    """Ollama's older /api/embeddings: one prompt, its vector not normalised (as Ollama's)."""
    body = parse_object(req.body)
    ollama_body.known(body, {"model", "prompt", "options", "keep_alive"}, "/api/embeddings")
    ollama_body.model_name(body, alias)
    ollama_body.options(body, {}, info.n_ctx_slot, allowed={"num_ctx"})
    ollama_body.keep_alive(body)
    prompt = body.str("prompt", "")
    if not prompt:
        return json_response({"embedding": []})
    if config.pooling == "none":
        raise HttpError(400, "the server's --pooling none gives every token's vector: /api/embeddings needs mean, "
                             "cls or last")
    vecs, _ = await vectors(engine, parser, [prompt], config.pooling, -1)
    return json_response({"embedding": vecs[0]})


# -- the model -------------------------------------------------------------------------------------------

def _details(info) -> dict:
    md = info.model_info
    arch = md.get("general.architecture", "")
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch] if arch else [],
            "parameter_size": md.get("general.size_label", ""),
            "quantization_level": FILE_TYPES.get(md.get("general.file_type"), "")}


def _file(info) -> tuple[int, str]:
    """(size in bytes, modified_at) of the model's file."""
    try:
        st = os.stat(info.model_path)
    except OSError:
        return 0, _now()
    return st.st_size, datetime.fromtimestamp(st.st_mtime, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def tags(req, ex, *, info, alias):
    size, modified = _file(info)
    return json_response({"models": [{"name": alias, "model": alias, "modified_at": modified, "size": size,
                                      "digest": "", "details": _details(info)}]})


def show(req, ex, *, info, alias, tokenizer):
    body = parse_object(req.body)
    ollama_body.known(body, {"model", "name", "verbose"}, "/api/show")
    ollama_body.model_name(body, alias)
    _, modified = _file(info)
    caps = ["completion", "embedding"] + (["tools"] if tokenizer.chat_template_takes_tools else [])
    return json_response({"modelfile": "", "parameters": "", "template": tokenizer.chat_template,
                          "details": _details(info), "model_info": info.model_info, "capabilities": caps,
                          "modified_at": modified})


def ps(req, ex, *, info, alias):
    size, _ = _file(info)
    size += info.kv_bytes
    return json_response({"models": [{"name": alias, "model": alias, "size": size, "digest": "",
                                      "details": _details(info), "expires_at": NEVER,
                                      "size_vram": size if info.device == "cuda" else 0,
                                      "context_length": info.n_ctx_slot}]})


def version(req, ex):
    return json_response({"version": OLLAMA_VERSION})


ROUTES = {
    "/api/chat": {"POST": chat},
    "/api/generate": {"POST": generate},
    "/api/embed": {"POST": embed},
    "/api/embeddings": {"POST": embeddings},
    "/api/tags": {"GET": tags},
    "/api/show": {"POST": show},
    "/api/ps": {"GET": ps},
    "/api/version": {"GET": version},
}
