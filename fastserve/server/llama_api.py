"""llama.cpp's native API: POST /completion (streamed or not), with llama-server's fields and response shape, and
POST /apply-template.

Request fields: prompt (text, token ids, a mix, or a list of such prompts: then the answer is a list,
and a stream's events carry each prompt's index), n_predict (or max_tokens), temperature, top_k,
top_p, min_p, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty, seed, stop,
stream, cache_prompt, n_probs, post_sampling_probs, id_slot, return_tokens, logit_bias (every form
llama-server takes), timings_per_token, response_fields, and fastserve's per-request limits
queue_timeout / request_timeout / token_timeout (seconds, may only shorten the server's). Fields of
llama-server that fastserve cannot honour are refused (params.NOT_SUPPORTED). grammar (GBNF) or
json_schema (an object): only output it accepts is sampled. The body is read by params.Parser.completion.
Response: content, tokens, id_slot, stop, model, tokens_predicted, tokens_evaluated,
generation_settings, prompt, has_new_line, truncated, stop_type, stopping_word, tokens_cached,
timings, completion_probabilities (when n_probs > 0).
"""
from __future__ import annotations

from . import sse
from .errors import LLAMA
from .fanout import interleave, run_all, start_all
from .generation import Generation
from .probs import completion_probabilities
from .response import StreamResponse, json_response


def apply_template(req, ex, *, parser):
    """POST /apply-template: a chat body's prompt as the template renders it (tools, prefill and all), untokenized,
    as llama-server answers it."""
    return json_response({"prompt": parser.chat_text(parser.chat(req.body))})


async def completion(req, ex, *, parser, compile, start, tokenizer, alias):
    params = parser.completion(req.body)
    compiled = await compile(params.constraint, params.limits)     # in a worker thread: a big schema takes long
    gens = start_all(start, ex, params, compiled)
    settings = params.settings()
    # each prompt's "prompt": given ids are decoded once the engine took them (it checks their range)
    texts = [tokenizer.decode(ids) if t is None else t for t, ids in zip(params.texts, params.prompts)]

    def final(i: int, content: str, tokens: list) -> dict:
        return _select(_final(alias, gens[i], i, settings, texts[i], content, tokens), params.response_fields)

    if params.stream:
        return StreamResponse(_stream(tokenizer, gens, final, params),
                              on_error=lambda err: sse.error_event(err.payload(LLAMA)))
    await run_all(gens)
    fields, post = params.response_fields, params.sampling.post_sampling_probs
    out = []
    for i, gen in enumerate(gens):
        res = final(i, gen.text.text, gen.ids if params.return_tokens else [])
        if params.sampling.n_probs and (not fields or "completion_probabilities" in fields):
            res["completion_probabilities"] = completion_probabilities(tokenizer, gen.ids, gen.probs, post,
                                                                       params.shown_probs)
        out.append(res)
    return json_response(out[0] if len(out) == 1 else out)


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


async def _stream(tok, gens: list, final, params):
    n = [0] * len(gens)
    async for i, d in interleave([g.deltas() for g in gens], gens):
        gen = gens[i]
        if d is None:                          # prompt i is done
            yield sse.event(final(i, "", []))
            continue
        n[i] += len(d.ids)
        chunk = {"index": i, "content": d.text, "tokens": d.ids if params.return_tokens else [], "stop": False,
                 "id_slot": gen.id_slot(), "tokens_predicted": n[i], "tokens_evaluated": gen.n_prompt}
        if d.probs:
            chunk["completion_probabilities"] = completion_probabilities(tok, d.ids, d.probs,
                                                                         params.sampling.post_sampling_probs,
                                                                         params.shown_probs)
        if params.timings_per_token:
            chunk["timings"] = gen.timings()
        yield sse.event(chunk)


def _final(alias: str, gen: Generation, index: int, settings: dict, prompt: str, content: str, tokens: list) -> dict:
    return {
        "index": index,
        "content": content,
        "tokens": tokens,
        "id_slot": gen.id_slot(),
        "stop": True,
        "model": alias,
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
