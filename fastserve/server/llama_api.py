"""llama.cpp's native API: POST /completion (streamed or not), with llama-server's fields and response shape.

Request fields: prompt (text, token ids, a mix, or a list of such prompts: then the answer is a list,
and a stream's events carry each prompt's index), n_predict (or max_tokens), temperature, top_k,
top_p, min_p, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty, seed, stop,
stream, cache_prompt, n_probs, post_sampling_probs, id_slot, return_tokens, logit_bias (every form
llama-server takes), timings_per_token, response_fields, and fastserve's per-request limits
queue_timeout / request_timeout / token_timeout (seconds, may only shorten the server's). Fields of
llama-server that fastserve cannot honour are refused (NOT_SUPPORTED). grammar (GBNF) or json_schema
(an object): only output it accepts is sampled.
Response: content, tokens, id_slot, stop, model, tokens_predicted, tokens_evaluated,
generation_settings, prompt, has_new_line, truncated, stop_type, stopping_word, tokens_cached,
timings, completion_probabilities (when n_probs > 0).
"""
from __future__ import annotations

import math

from ..config import MAX_N_PROBS
from . import sse
from .errors import LLAMA, HttpError
from .fanout import interleave, run_all, start_all
from .fields import Body, parse_object
from .generation import Generation, Limits
from .response import StreamResponse, json_response

PROMPT_CHARS_PER_TOKEN = 16     # a prompt longer than 16 characters per slot token cannot fit: refused untokenized


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# llama-server's request fields that fastserve has no such thing for, each with the test of its "off"
# value and why: a request that turns one on is refused (400), never answered as if it had been applied.
# (Their companions - dry_base, mirostat_tau, xtc_threshold, dynatemp_exponent ... - do nothing while
# these are off, in llama-server too.)
NOT_SUPPORTED = {
    "dynatemp_range": (lambda v: _num(v) and v == 0, "no dynamic temperature"),
    "top_n_sigma": (lambda v: _num(v) and v <= 0, "no top-n-sigma sampler"),
    "xtc_probability": (lambda v: _num(v) and v == 0, "no XTC sampler"),
    "typical_p": (lambda v: _num(v) and v >= 1, "no locally typical sampler"),
    "dry_multiplier": (lambda v: _num(v) and v == 0, "no DRY sampler"),
    "mirostat": (lambda v: _num(v) and v == 0, "no Mirostat"),
    "adaptive_target": (lambda v: _num(v) and v < 0, "no adaptive-p sampler"),
    "min_keep": (lambda v: _num(v) and v == 0, "no minimum of kept candidates"),
    "n_cmpl": (lambda v: _num(v) and v == 1, "one completion per prompt (send the prompt several times, or "
                                             "use /v1/chat/completions' n)"),
    "n_indent": (lambda v: _num(v) and v == 0, "no indentation rule"),
    "t_max_predict_ms": (lambda v: _num(v) and v <= 0, "no prediction time limit: see request_timeout"),
    "n_cache_reuse": (lambda v: _num(v) and v == 0, "no KV shifting: a slot's common prefix is reused"),
    "return_progress": (lambda v: v is False, "no prompt progress events"),
    "lora": (lambda v: v == [], "no LoRA adapters"),
}
SAMPLER_CHAIN = ["penalties", "top_k", "top_p", "min_p", "temperature"]      # fastserve's, in llama.cpp's names
_OFF_SAMPLERS = ("dry", "top_n_sigma", "typ_p", "xtc", "adaptive_p")         # llama.cpp's, all off in fastserve
# the SamplingParams fields the server's flags set defaults for (--temp ... --frequency-penalty)
SERVER_WIDE = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
               "frequency_penalty")


def sampling(body: Body, app) -> dict:
    """The sampling fields shared by every generation route (llama.cpp names) over the server-wide defaults
    (ServerConfig.sampling: --temp, --top-k, ...). The seed is request_seed's."""
    defaults = app.config.sampling
    out = {name: getattr(defaults, name) for name in SERVER_WIDE}
    for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
        v = body.number(name)
        if v is not None:
            out[name] = v
    for name in ("top_k", "repeat_last_n"):
        v = body.int(name, lo=-1 if name == "repeat_last_n" else None)
        if v is not None:
            out[name] = v
    for name, (off, why) in NOT_SUPPORTED.items():
        v = body.raw(name)
        if v is not None and not off(v):
            raise HttpError(400, f"'{name}' = {v!r} is not supported by fastserve: {why}; leave it out")
    chain = body.raw("samplers")
    if chain is not None and (not isinstance(chain, list) or [x for x in chain if x not in _OFF_SAMPLERS]
                              != SAMPLER_CHAIN):
        raise HttpError(400, f"'samplers' must be fastserve's chain {SAMPLER_CHAIN} (in that order; samplers that "
                             f"are off may be named too), got {chain!r}")
    bias = body.logit_bias("logit_bias", app.engine.tokenizer) or {}
    if ignore_eos(body, app):             # as llama-server: the end-of-generation tokens are never sampled
        bias.update({tok: -math.inf for tok in app.engine.tokenizer.eog_ids})
    if bias:
        out["logit_bias"] = bias
    return out


def ignore_eos(body: Body, app) -> bool:
    """The request's ignore_eos; absent, the server's --ignore-eos."""
    return body.bool("ignore_eos", app.config.ignore_eos)


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


def request_seed(body: Body, app):
    """The request's seed; absent, the server's --seed (None: a random one)."""
    if body.has("seed"):
        return body.seed()
    return app.config.seed


def params_json(app, samp: dict, seed, n_predict: int, **extra) -> dict:
    """llama-server's generation settings object (/props' default_generation_settings.params, and each
    answer's generation_settings): its field names; samplers fastserve lacks show their "off" value."""
    defaults = app.config.sampling
    eff = {**{name: getattr(defaults, name) for name in SERVER_WIDE}, "n_probs": defaults.n_probs,
           "post_sampling_probs": defaults.post_sampling_probs, **samp}
    out = {"seed": -1 if seed is None else seed}
    for name in ("temperature", "top_k", "top_p", "min_p"):
        out[name] = eff[name]
    out.update({"dynatemp_range": 0.0, "top_n_sigma": -1.0, "xtc_probability": 0.0, "typical_p": 1.0})
    for name in ("repeat_last_n", "repeat_penalty", "presence_penalty", "frequency_penalty"):
        out[name] = eff[name]
    out.update({"dry_multiplier": 0.0, "mirostat": 0, "max_tokens": n_predict, "n_predict": n_predict, "n_keep": 0,
                "ignore_eos": bool(extra.pop("ignore_eos", app.config.ignore_eos)), "stream": False,
                "n_probs": eff["n_probs"], "min_keep": 0,
                "samplers": SAMPLER_CHAIN, "timings_per_token": False,
                "post_sampling_probs": eff["post_sampling_probs"]})
    out.update(extra)
    return out


def limits(body: Body, cfg) -> Limits:
    return Limits(queue=body.timeout("queue_timeout", cfg.queue_timeout),
                  total=body.timeout("request_timeout", cfg.request_timeout),
                  token=body.timeout("token_timeout", cfg.token_timeout))


def check_prompt_length(app, n_chars: int, what: str = "the prompt") -> None:
    """Refuse, before tokenizing it (tokenizing holds the GIL), text too long to fit in a slot."""
    n_ctx = app.engine.describe().n_ctx_slot
    cap = n_ctx * PROMPT_CHARS_PER_TOKEN
    if n_chars > cap:
        raise HttpError(400, f"{what} has {n_chars} characters, more than a slot of {n_ctx} "
                             f"tokens can hold (at most {cap} characters are accepted); shorten it")


MAX_PROMPTS = 16               # prompts in one /completion request (each takes a slot)


def prompt_list(app, value, name: str = "prompt") -> list[list[int]]:
    """Every prompt of a request as token ids. As llama-server reads it: an array holding a number is
    one prompt (ids, or ids mixed with text); any other array is a list of prompts."""
    if isinstance(value, list) and value and not any(_num(x) for x in value):
        if len(value) > MAX_PROMPTS:
            raise HttpError(400, f"'{name}' holds {len(value)} prompts; at most {MAX_PROMPTS} are taken at once")
        return [prompt_ids(app, p, f"{name}[{i}]") for i, p in enumerate(value)]
    return [prompt_ids(app, value, name)]


def prompt_ids(app, value, name: str = "prompt", limit: int | None = None) -> list[int]:
    """One prompt as token ids: text, token ids, or llama.cpp's mix of both ([1, "text", 2, ...]); text
    gets the BOS token when it comes first. Refuses a prompt its slot cannot hold (check_context), or,
    given a limit (/tokenize), more than limit tokens."""
    tok = app.engine.tokenizer
    cap = app.engine.describe().n_ctx_slot if limit is None else limit
    if value is None:
        raise HttpError(400, f"'{name}' is required")
    if isinstance(value, str):
        check_prompt_length(app, len(value))
        ids = tok.encode(value, add_special=True)
    elif isinstance(value, list):
        ids = []
        for i, x in enumerate(value):
            if isinstance(x, bool) or not isinstance(x, (int, str)):
                raise HttpError(400, f"'{name}' must be a string, an array of token ids and strings, or an array "
                                     f"of such prompts; got {type(x).__name__} at [{i}]")
            if isinstance(x, str):
                check_prompt_length(app, len(x))
                ids.extend(tok.encode(x, add_special=i == 0))
            elif not 0 <= x < tok.n_vocab:
                raise HttpError(400, f"'{name}' token ids must be in [0, {tok.n_vocab}), got {x}")
            else:
                ids.append(x)
            if len(ids) > cap:
                break                          # already too long (and refused below): tokenize no more
    else:
        raise HttpError(400, f"'{name}' must be a string or an array of token ids")
    if not ids:
        raise HttpError(400, f"'{name}' is empty")
    if limit is None:
        check_context(app, len(ids))
    elif len(ids) > limit:
        raise HttpError(400, f"'{name}' has more than {limit} tokens; at most {limit} are tokenized at once")
    return ids


def check_context(app, n_prompt: int) -> None:
    """llama-server's exceed_context_size_error: a prompt must leave its slot room for one token."""
    n_ctx = app.engine.describe().n_ctx_slot
    if n_prompt >= n_ctx:
        raise HttpError(400, f"request ({n_prompt} tokens) exceeds the available context size ({n_ctx} tokens) "
                             f"of a slot (n_ctx / n_parallel), try increasing it",
                        type="exceed_context_size_error", fields={"n_prompt_tokens": n_prompt, "n_ctx": n_ctx})


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
    raw = body.raw("prompt")
    prompts = prompt_list(app, raw)
    n_predict = body.int("n_predict", None, lo=-1)
    if n_predict is None:
        n_predict = body.int("max_tokens", app.config.n_predict, lo=-1)
    n_probs = body.int("n_probs", 0, lo=0, hi=MAX_N_PROBS)
    post = body.bool("post_sampling_probs")
    stream = body.bool("stream")
    return_tokens = body.bool("return_tokens")
    per_token = body.bool("timings_per_token")
    fields = response_fields(body)
    stop = body.stop()
    seed = request_seed(body, app)
    samp = sampling(body, app)
    cache_prompt = body.bool("cache_prompt", True)
    lim = limits(body, app.config)
    compiled = await app.compile(constraint(body), lim)     # in a worker thread: a big schema takes long
    gens = start_all(app, ex, prompts, lambda i: {}, stop=stop, limits=lim,
                     max_tokens=n_predict, seed=seed, cache_prompt=cache_prompt,
                     id_slot=body.int("id_slot", -1, lo=-1), n_probs=n_probs, post_sampling_probs=post,
                     constraint=compiled, settings={"stream": stream, "ignore_eos": ignore_eos(body, app),
                                                    "timings_per_token": per_token}, **samp)
    settings = params_json(app, {k: v for k, v in samp.items() if k != "logit_bias"}, seed, n_predict,
                           stream=stream, n_probs=n_probs, post_sampling_probs=post, timings_per_token=per_token,
                           stop=stop, cache_prompt=cache_prompt, ignore_eos=ignore_eos(body, app))
    raws = raw if len(prompts) > 1 else [raw]
    texts = [r if isinstance(r, str) else engine.tokenizer.decode(ids) for r, ids in zip(raws, prompts)]

    def final(i: int, content: str, tokens: list) -> dict:
        return _select(_final(app, gens[i], i, settings, texts[i], content, tokens), fields)

    if stream:
        return StreamResponse(_stream(app, gens, final, return_tokens, post, per_token),
                              on_error=lambda err: sse.error_event(err.payload(LLAMA)))
    await run_all(gens)
    out = []
    for i, gen in enumerate(gens):
        res = final(i, gen.text.text, gen.ids if return_tokens else [])
        if n_probs and (not fields or "completion_probabilities" in fields):
            res["completion_probabilities"] = probs_json(engine.tokenizer, gen.ids, gen.probs, post)
        out.append(res)
    return json_response(out[0] if len(out) == 1 else out)


def response_fields(body: Body) -> list[str]:
    """llama-server's response_fields: the paths ("a/b" reaches into objects) the final answer keeps."""
    v = body.raw("response_fields", [])
    if not isinstance(v, list) or not all(isinstance(f, str) for f in v):
        raise HttpError(400, "'response_fields' must be an array of field names (\"a/b\" for a nested one)")
    return v


def _select(res: dict, fields: list) -> dict:
    """Only the asked-for fields, each under its path's name; missing ones are left out (as llama-server)."""
    if not fields:
        return res
    out = {}
    for path in fields:
        v = res
        for key in path.split("/"):
            if not isinstance(v, dict) or key not in v:
                break
            v = v[key]
        else:
            out[path] = v
    return out


async def _stream(app, gens: list, final, return_tokens: bool, post: bool, per_token: bool):
    tok = app.engine.tokenizer
    n = [0] * len(gens)
    async for i, d in interleave([g.deltas() for g in gens], gens):
        gen = gens[i]
        if d is None:                          # prompt i is done
            yield sse.event(final(i, "", []))
            continue
        n[i] += len(d.ids)
        chunk = {"index": i, "content": d.text, "tokens": d.ids if return_tokens else [], "stop": False,
                 "id_slot": gen.id_slot(), "tokens_predicted": n[i], "tokens_evaluated": gen.n_prompt}
        if d.probs:
            chunk["completion_probabilities"] = probs_json(tok, d.ids, d.probs, post)
        if per_token:
            chunk["timings"] = gen.timings()
        yield sse.event(chunk)


def _final(app, gen: Generation, index: int, settings: dict, prompt: str, content: str, tokens: list) -> dict:
    return {
        "index": index,
        "content": content,
        "tokens": tokens,
        "id_slot": gen.id_slot(),
        "stop": True,
        "model": app.model_alias,
        "tokens_predicted": len(gen.ids),
        "tokens_evaluated": gen.n_prompt,
        "generation_settings": settings,
        "has_new_line": "\n" in gen.text.text,
        "truncated": False,
        "stop_type": gen.stop_type,
        "stopping_word": gen.text.stopping_word,
        "tokens_cached": gen.n_prompt + len(gen.ids) if gen.id_slot() >= 0 else 0,
        "timings": gen.timings(),
        "prompt": prompt,
    }
