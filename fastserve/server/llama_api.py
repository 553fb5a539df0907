"""llama.cpp's native API: POST /completion (streamed or not), with llama-server's fields and response shape.

Request fields: prompt (text, token ids, or a mix), n_predict (or max_tokens), temperature, top_k,
top_p, min_p, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty, seed, stop,
stream, cache_prompt, n_probs, post_sampling_probs, id_slot, return_tokens, logit_bias, grammar
(GBNF) or json_schema (an object: only output it accepts is sampled), and
fastserve's per-request limits queue_timeout / request_timeout / token_timeout (seconds, may
only shorten the server's).
Response: content, tokens, id_slot, stop, model, tokens_predicted, tokens_evaluated,
generation_settings, prompt, has_new_line, truncated, stop_type, stopping_word, tokens_cached,
timings, completion_probabilities (when n_probs > 0).
"""
from __future__ import annotations

import math

from ..config import MAX_N_PROBS
from . import sse
from .errors import LLAMA, HttpError
from .fields import Body, parse_object
from .generation import Generation, Limits
from .response import StreamResponse, json_response

PROMPT_CHARS_PER_TOKEN = 16     # a prompt longer than 16 characters per slot token cannot fit: refused untokenized


def sampling(body: Body, n_vocab: int) -> dict:
    """The sampling fields shared by every generation route (llama.cpp names); engine defaults fill the rest."""
    out = {}
    for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
        v = body.number(name)
        if v is not None:
            out[name] = v
    for name in ("top_k", "repeat_last_n"):
        v = body.int(name, lo=-1 if name == "repeat_last_n" else None)
        if v is not None:
            out[name] = v
    bias = body.logit_bias("logit_bias", n_vocab)
    if bias:
        out["logit_bias"] = bias
    return out


def constraint(body: Body) -> dict:
    """grammar (GBNF; "" means none, as llama-server reads it) or json_schema, for Engine.submit."""
    out = {}
    grammar = body.str("grammar")
    if grammar:
        out["grammar"] = grammar
    schema = body.raw("json_schema")
    if schema is not None:
        if not isinstance(schema, (dict, str)):
            raise HttpError(400, "'json_schema' must be a JSON schema object")
        out["json_schema"] = schema
    return out


def limits(body: Body, cfg) -> Limits:
    return Limits(queue=body.timeout("queue_timeout", cfg.queue_timeout),
                  total=body.timeout("request_timeout", cfg.request_timeout),
                  token=body.timeout("token_timeout", cfg.token_timeout))


def check_prompt_length(app, n_chars: int, what: str = "the prompt") -> None:
    """Refuse, before tokenizing it (tokenizing holds the GIL), text too long to fit in a slot."""
    cap = app.engine.n_ctx_slot * PROMPT_CHARS_PER_TOKEN
    if n_chars > cap:
        raise HttpError(400, f"{what} has {n_chars} characters, more than a slot of {app.engine.n_ctx_slot} "
                             f"tokens can hold (at most {cap} characters are accepted); shorten it")


def prompt_ids(app, value, name: str = "prompt") -> list[int]:
    """A prompt as token ids: text, token ids, or llama.cpp's mix of both ([1, "text", 2, ...])."""
    tok = app.engine.tokenizer
    if value is None:
        raise HttpError(400, f"'{name}' is required")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]                       # a batch of one prompt
    if isinstance(value, str):
        check_prompt_length(app, len(value))
        ids = tok.encode(value, add_special=True)
    elif isinstance(value, list):
        if any(isinstance(x, list) for x in value) or (len(value) > 1 and all(isinstance(x, str) for x in value)):
            raise HttpError(400, f"'{name}' holds several prompts; send one prompt per request")
        ids = []
        for i, x in enumerate(value):
            if isinstance(x, bool) or not isinstance(x, (int, str)):
                raise HttpError(400, f"'{name}' must be a string or an array of token ids")
            if isinstance(x, str):
                check_prompt_length(app, len(x))
                ids.extend(tok.encode(x, add_special=i == 0))
            elif not 0 <= x < tok.n_vocab:
                raise HttpError(400, f"'{name}' token ids must be in [0, {tok.n_vocab}), got {x}")
            else:
                ids.append(x)
            if len(ids) > app.engine.n_ctx_slot:
                break                          # already too long: the engine refuses it clearly
    else:
        raise HttpError(400, f"'{name}' must be a string or an array of token ids")
    if not ids:
        raise HttpError(400, f"'{name}' is empty")
    return ids


def probs_json(tok, ids: list, probs: list, post: bool) -> list:
    """completion_probabilities entries, as llama-server writes them."""
    key, top_key = ("prob", "top_probs") if post else ("logprob", "top_logprobs")
    out = []
    for tid, (top_ids, top_ps) in zip(ids, probs):
        p = next((q for t, q in zip(top_ids, top_ps) if t == tid), 0.0)
        e = _token_json(tok, tid)
        e[key] = p if post else _log(p)
        e[top_key] = [{**_token_json(tok, t), key: q if post else _log(q)} for t, q in zip(top_ids, top_ps)]
        out.append(e)
    return out


def _log(p: float) -> float:
    return math.log(p) if p > 0 else -9999.0


def _token_json(tok, tid: int) -> dict:
    b = tok.token_bytes(tid)
    return {"id": tid, "token": b.decode("utf-8", "replace"), "bytes": list(b)}


async def completion(app, req, ex):
    body = parse_object(req.body)
    engine = app.engine
    ids = prompt_ids(app, body.raw("prompt"))
    n_predict = body.int("n_predict", None, lo=-1)
    if n_predict is None:
        n_predict = body.int("max_tokens", app.config.n_predict, lo=-1)
    n_probs = body.int("n_probs", 0, lo=0, hi=MAX_N_PROBS)
    post = body.bool("post_sampling_probs")
    stream = body.bool("stream")
    return_tokens = body.bool("return_tokens")
    stop = body.stop()
    seed = body.seed()
    samp = sampling(body, engine.tokenizer.n_vocab)
    gen = app.start_generation(
        ex, ids, stop=stop, limits=limits(body, app.config), max_tokens=n_predict, seed=seed,
        cache_prompt=body.bool("cache_prompt", True), id_slot=body.int("id_slot", -1, lo=-1),
        n_probs=n_probs, post_sampling_probs=post, **constraint(body), **samp)
    raw = body.raw("prompt")
    prompt_text = raw if isinstance(raw, str) else engine.tokenizer.decode(ids)
    settings = {"n_predict": n_predict, "seed": -1 if seed is None else seed, "stop": stop, "stream": stream,
                "n_probs": n_probs, "post_sampling_probs": post, "cache_prompt": body.bool("cache_prompt", True),
                **{k: v for k, v in samp.items() if k != "logit_bias"}}
    settings["_prompt"] = prompt_text
    if stream:
        return StreamResponse(_stream(app, gen, settings, return_tokens, post),
                              on_error=lambda err: sse.error_event(err.payload(LLAMA)))
    await gen.run()
    out = _final(app, gen, settings, gen.text.text, gen.ids if return_tokens else [])
    if n_probs:
        out["completion_probabilities"] = probs_json(engine.tokenizer, gen.ids, gen.probs, post)
    return json_response(out)


async def _stream(app, gen: Generation, settings: dict, return_tokens: bool, post: bool):
    tok = app.engine.tokenizer
    n = 0
    async for d in gen.deltas():
        n += len(d.ids)
        chunk = {"index": 0, "content": d.text, "tokens": d.ids if return_tokens else [], "stop": False,
                 "id_slot": gen.id_slot(), "tokens_predicted": n, "tokens_evaluated": gen.n_prompt}
        if d.probs:
            chunk["completion_probabilities"] = probs_json(tok, d.ids, d.probs, post)
        yield sse.event(chunk)
    yield sse.event(_final(app, gen, settings, "", []))


def _final(app, gen: Generation, settings: dict, content: str, tokens: list) -> dict:
    return {
        "index": 0,
        "content": content,
        "tokens": tokens,
        "id_slot": gen.id_slot(),
        "stop": True,
        "model": app.model_alias,
        "tokens_predicted": len(gen.ids),
        "tokens_evaluated": gen.n_prompt,
        "generation_settings": {k: v for k, v in settings.items() if k != "_prompt"},
        "has_new_line": "\n" in gen.text.text,
        "truncated": False,
        "stop_type": gen.stop_type,
        "stopping_word": gen.text.stopping_word,
        "tokens_cached": gen.n_prompt + len(gen.ids) if gen.id_slot() >= 0 else 0,
        "timings": gen.timings(),
        "prompt": settings.get("_prompt", ""),
    }
