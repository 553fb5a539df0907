"""OpenAI-compatible API: GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

Streams are SSE ending with `data: [DONE]`; usage comes in the response (and, when
stream_options.include_usage is set, in a last chunk with no choices). A chat stream's first
chunk of each choice carries the role with `content: null`, as OpenAI's server sends it. Both
take n > 1, and /v1/completions a list of prompts (as llama-server): the choices are generated
together, streamed interleaved by index. Fields OpenAI defines that fastserve cannot honour
(best_of > 1, echo, suffix) are refused with a 400 that says so; llama.cpp's extra sampling fields
(top_k, min_p, repeat_penalty, ..., grammar, json_schema) are accepted as llama-server does. Chat:
`response_format` (json_object, json_schema) and `tools` / `tool_choice` are enforced in the sampler
(server/tools.py).
"""
from __future__ import annotations

import os
import time

from ..errors import RequestError
from . import sse
from .errors import OPENAI, HttpError
from .fields import Body, parse_object
from .fanout import interleave, run_all, start_all
from .llama_api import (_log, check_context, check_prompt_length, constraint, ignore_eos, limits, prompt_list,
                        request_seed, sampling)
from .response import StreamResponse, json_response
from .tools import history_message, response_format, tool_plan, with_tools

MAX_TOP_LOGPROBS = 20
# The engine reports the top-N probabilities of each step; the sampled token's own logprob is found
# among them (-9999.0 when it lies outside, which needs sampling far from the top).
LOGPROB_POOL = 10
ROLES = ("system", "user", "assistant", "tool", "developer")


def models(app, req, ex):
    return json_response({"object": "list", "data": [{
        "id": app.model_alias, "object": "model", "created": int(app.started_wall), "owned_by": "fastserve",
        "meta": {"n_ctx_slot": app.engine.describe().n_ctx_slot, "n_vocab": app.engine.tokenizer.n_vocab,
                 "n_slots": app.engine.describe().n_slots}}]})


MAX_CHOICES = 16        # chat choices per request (each takes a slot)


def _common(body: Body, app):
    max_tokens = body.int("max_completion_tokens", None, lo=-1)
    if max_tokens is None:
        max_tokens = body.int("max_tokens", app.config.n_predict, lo=-1)
    opts = body.raw("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise HttpError(400, "'stream_options' must be an object")
    include_usage = Body(opts or {}).bool("include_usage")
    return max_tokens, body.bool("stream"), include_usage


def _usage(per_prompt: list) -> dict:
    """per_prompt: for each prompt, the generations of its choices; a prompt's tokens count once (as OpenAI)."""
    n_prompt = sum(gens[0].n_prompt for gens in per_prompt)
    n_gen = sum(len(g.ids) for gens in per_prompt for g in gens)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}


def _settings(body: Body, app, stream: bool) -> dict:
    """The request's /slots params beyond its sampling (Generation.settings)."""
    return {"stream": stream, "ignore_eos": ignore_eos(body, app)}


def _new_id(prefix: str) -> str:
    return prefix + os.urandom(12).hex()


# -- /v1/completions -----------------------------------------------------------------------------

async def completions(app, req, ex):
    """OpenAI's legacy completions: a prompt or a list of prompts (as llama-server), n choices of each;
    choice index = prompt index * n + choice."""
    body = parse_object(req.body)
    max_tokens, stream, include_usage = _common(body, app)
    if body.bool("echo"):
        raise HttpError(400, "'echo' is not supported")
    if body.int("best_of", 1, lo=1) > 1:
        raise HttpError(400, "'best_of' > 1 is not supported")
    if body.str("suffix"):
        raise HttpError(400, "'suffix' is not supported")
    prompts = prompt_list(app, body.raw("prompt"))
    n = body.int("n", 1, lo=1, hi=MAX_CHOICES)
    if len(prompts) * n > MAX_CHOICES:
        raise HttpError(400, f"{len(prompts)} prompts x n = {n} make {len(prompts) * n} choices; at most "
                             f"{MAX_CHOICES} are generated per request")
    logprobs = body.int("logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    n_probs = 0 if logprobs is None else max(LOGPROB_POOL, logprobs)
    seed = request_seed(body, app)
    samp = sampling(body, app)
    lim = limits(body, app.config)
    compiled = await app.compile(constraint(body), lim)
    gens = start_all(app, ex, [ids for ids in prompts for _ in range(n)],
                     lambda i: {"seed": None if seed is None else (seed + i % n) % 2 ** 64},
                     stop=body.stop(), limits=lim, max_tokens=max_tokens, n_probs=n_probs,
                     constraint=compiled, settings=_settings(body, app, stream), **samp)
    rid, created = _new_id("cmpl-"), int(time.time())
    tok = app.engine.tokenizer

    def choice(i, text, ids, probs, offset, finish):
        lp = None
        if logprobs is not None:
            lp = _legacy_logprobs(tok, ids, probs or [], logprobs, offset)
        return {"text": text, "index": i, "logprobs": lp, "finish_reason": finish}

    def envelope(choices, **extra):
        return {"id": rid, "object": "text_completion", "created": created, "model": app.model_alias,
                "system_fingerprint": app.fingerprint, "choices": choices, **extra}

    def usage():
        return _usage([gens[k * n: (k + 1) * n] for k in range(len(prompts))])

    if stream:
        async def events():
            offset = [0] * len(gens)
            async for i, d in interleave([g.deltas() for g in gens], gens):
                if d is None:
                    yield sse.event(envelope([choice(i, "", [], [], offset[i], gens[i].openai_finish_reason)]))
                else:
                    yield sse.event(envelope([choice(i, d.text, d.ids, d.probs, offset[i], None)]))
                    offset[i] += len(d.text)
            if include_usage:
                yield sse.event(envelope([], usage=usage()))
            yield sse.DONE
        return StreamResponse(events(), on_error=lambda err: sse.error_event(err.payload(OPENAI)))
    await run_all(gens)
    return json_response(envelope([choice(i, g.text.text, g.ids, g.probs, 0, g.openai_finish_reason)
                                   for i, g in enumerate(gens)], usage=usage(), timings=gens[0].timings()))


def _legacy_logprobs(tok, ids, probs, k: int, offset: int) -> dict:
    tokens, token_lp, top, offsets = [], [], [], []
    for tid, (top_ids, top_ps) in zip(ids, probs):
        text = tok.token_bytes(tid).decode("utf-8", "replace")
        tokens.append(text)
        token_lp.append(_log(next((q for t, q in zip(top_ids, top_ps) if t == tid), 0.0)))
        alts = {}       # most probable first: of two tokens that read alike (byte tokens read as U+FFFD), the first
        for t, q in zip(top_ids[:k], top_ps[:k]):
            alts.setdefault(tok.token_bytes(t).decode("utf-8", "replace"), _log(q))
        top.append(alts)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lp, "top_logprobs": top, "text_offset": offsets}


# -- /v1/chat/completions ------------------------------------------------------------------------

def chat_messages(value, template_takes_tools: bool = False) -> list[dict]:
    """Validate OpenAI messages; content parts of type text are joined into one string; earlier tool
    calls and their results are kept for the template (server/tools.py). Refused (400): a message that
    is not an object, without a known role, with content of a wrong type, without content (only an
    assistant's may be null), a tool message without its tool_call_id."""
    if not isinstance(value, list) or not value:
        raise HttpError(400, "'messages' must be a non-empty array of {\"role\": ..., \"content\": ...} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise HttpError(400, f"messages[{i}] must be an object")
        if "role" not in m:
            raise HttpError(400, f"messages[{i}] has no 'role' (one of {', '.join(ROLES)})")
        role = m["role"]
        if role not in ROLES:
            raise HttpError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        content = m.get("content")
        if content is None:
            if role != "assistant":
                raise HttpError(400, f"messages[{i}] ({role}) has no 'content'")
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise HttpError(400, f"messages[{i}].content[{j}] must be {{\"type\": \"text\", \"text\": ...}}; "
                                         f"other content types are not supported")
                parts.append(p["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise HttpError(400, f"messages[{i}].content must be a string or an array of text parts")
        if role == "tool" and not (isinstance(m.get("tool_call_id"), str) and m["tool_call_id"]):
            raise HttpError(400, f"messages[{i}] (tool) needs the 'tool_call_id' of the call it answers")
        out.append(history_message(i, m, content, template_takes_tools))
    return out


async def chat_completions(app, req, ex):
    body = parse_object(req.body)
    max_tokens, stream, include_usage = _common(body, app)
    n = body.int("n", 1, lo=1, hi=MAX_CHOICES)
    plan = tool_plan(body)
    fmt_schema = response_format(body)
    constrain = constraint(body)
    given = [name for name, v in (("tools", plan), ("response_format", fmt_schema), ("grammar", constrain or None))
             if v is not None]
    if len(given) > 1:
        raise HttpError(400, f"give one constraint, not several: {', '.join(given)}")
    if plan is not None:
        constrain = {"json_schema": plan.schema}
    elif fmt_schema is not None:
        constrain = {"json_schema": fmt_schema}
    lim = limits(body, app.config)
    compiled = await app.compile(constrain, lim)    # the compiler's message before the prompt's size is judged
    tok = app.engine.tokenizer
    native = tok.chat_template_takes_tools
    messages = chat_messages(body.raw("messages"), native)
    if plan is not None:
        messages = with_tools(messages, plan, native)
    total = sum(len(m["content"] or "") for m in messages)
    check_prompt_length(app, total, "the conversation")
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True,
                                       tools=plan.tools if plan is not None and native else None)
    except RequestError as exc:
        raise HttpError(400, str(exc)) from None
    check_prompt_length(app, len(text), "the conversation")
    ids = tok.encode(text, add_special=True)
    if not ids:
        raise HttpError(400, "the conversation is empty")
    check_context(app, len(ids))
    want_lp = body.bool("logprobs")
    top_lp = body.int("top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if top_lp is not None and not want_lp:
        raise HttpError(400, "'top_logprobs' needs 'logprobs': true")
    n_probs = max(LOGPROB_POOL, top_lp or 0) if want_lp else 0
    seed = request_seed(body, app)
    # n choices of one prompt: a given seed seeds the i-th choice with seed + i, so that they differ
    gens = start_all(app, ex, [ids] * n, lambda i: {"seed": None if seed is None else (seed + i) % 2 ** 64},
                     stop=body.stop(), limits=lim, max_tokens=max_tokens, n_probs=n_probs,
                     constraint=compiled, settings=_settings(body, app, stream), **sampling(body, app))
    rid, created = _new_id("chatcmpl-"), int(time.time())

    def reply(g):
        """(message fields, finish_reason) of a finished generation."""
        if plan is None:
            return {"content": g.text.text}, g.openai_finish_reason
        content, calls = plan.parse(g.text.text)
        if calls:
            return {"content": None, "tool_calls": calls}, "tool_calls"
        return {"content": content}, g.openai_finish_reason

    def logprobs(ids, probs):
        return {"content": _chat_logprobs(tok, ids, probs or [], top_lp or 0)} if want_lp else None

    def envelope(obj: str, choices, **extra):
        return {"id": rid, "object": obj, "created": created, "model": app.model_alias,
                "system_fingerprint": app.fingerprint, "choices": choices, **extra}

    def chunk(i: int, delta: dict, lp=None, finish=None, **extra) -> bytes:
        return sse.event(envelope("chat.completion.chunk", [
            {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}], **extra))

    if stream:
        async def events():
            for i in range(n):
                yield chunk(i, {"role": "assistant", "content": None})
            async for i, d in interleave([g.deltas() for g in gens], gens):
                if d is None:
                    fields, finish = reply(gens[i])
                    if plan is not None:    # a call is known to be one when its JSON is complete
                        yield chunk(i, {"content": fields["content"]} if "tool_calls" not in fields else
                                    {"tool_calls": [{"index": k, **c} for k, c in enumerate(fields["tool_calls"])]})
                    yield chunk(i, {}, finish=finish, timings=gens[i].timings())
                elif plan is None and (d.text or want_lp):
                    yield chunk(i, {"content": d.text}, logprobs(d.ids, d.probs))
            if include_usage:
                yield sse.event(envelope("chat.completion.chunk", [], usage=_usage([gens])))
            yield sse.DONE
        return StreamResponse(events(), on_error=lambda err: sse.error_event(err.payload(OPENAI)))
    await run_all(gens)
    replies = [reply(g) for g in gens]
    return json_response(envelope("chat.completion", [{
        "index": i, "message": {"role": "assistant", **replies[i][0]},
        "logprobs": logprobs(g.ids, g.probs), "finish_reason": replies[i][1]} for i, g in enumerate(gens)],
        usage=_usage([gens]), timings=gens[0].timings()))


def _chat_logprobs(tok, ids, probs, k: int) -> list:
    out = []
    for tid, (top_ids, top_ps) in zip(ids, probs):
        b = tok.token_bytes(tid)
        out.append({"token": b.decode("utf-8", "replace"), "bytes": list(b),
                    "logprob": _log(next((q for t, q in zip(top_ids, top_ps) if t == tid), 0.0)),
                    "top_logprobs": [{"token": tok.token_bytes(t).decode("utf-8", "replace"),
                                      "bytes": list(tok.token_bytes(t)), "logprob": _log(q)}
                                     for t, q in zip(top_ids[:k], top_ps[:k])]})
    return out
