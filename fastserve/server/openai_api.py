"""OpenAI-compatible API: GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

Streams are SSE ending with `data: [DONE]`; usage comes in the response (and, when
stream_options.include_usage is set, in a last chunk with no choices). A chat stream's first
chunk of each choice carries the role with `content: null`, as OpenAI's server sends it. Both
take n > 1, and /v1/completions a list of prompts (as llama-server): the choices are generated
together, streamed interleaved by index. `echo` puts the prompt before each completion and, with
`logprobs`, its tokens' own log-probabilities (the first null): the engine's teacher-forced scores of the
prompt (Engine.score, fastserve/scoring.py), the same at any concurrency; `max_tokens: 0` scores the prompt
alone, as OpenAI's and vLLM's. An echo is refused with n > 1 or stream. Fields OpenAI defines that fastserve
cannot honour (best_of > 1, suffix) are refused with a 400 that says so; llama.cpp's extra sampling fields
(top_k, min_p, repeat_penalty, ..., grammar, json_schema) are accepted as llama-server does. Chat:
`response_format` (json_object, json_schema) and `tools` / `tool_choice` are enforced in the sampler
(server/tools.py). The bodies are read by params.Parser.completions / .chat.
"""
from __future__ import annotations

import asyncio
import time
from functools import partial

from . import sse
from .config import BUILD_INFO
from ..errors import EngineClosed, RequestError
from .errors import OPENAI, HttpError, refused
from .fanout import interleave, run_all, start_all
from .probs import chat_logprobs, legacy_logprobs, prompt_logprobs
from .response import StreamResponse, json_response
from .reasoning import Splitter, split
from .tools import new_id


def models(req, ex, *, alias, started, info):
    return json_response({"object": "list", "data": [{
        "id": alias, "object": "model", "created": int(started), "owned_by": "fastserve",
        "meta": {"n_ctx_slot": info.n_ctx_slot, "n_vocab": info.n_vocab, "n_slots": info.n_slots}}]})


def _usage(per_prompt: list) -> dict:
    """per_prompt: for each prompt, the generations of its choices; a prompt's tokens count once (as OpenAI)."""
    n_prompt = sum(gens[0].n_prompt for gens in per_prompt)
    n_gen = sum(len(g.ids) for gens in per_prompt for g in gens)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}


def _envelope(rid: str, created: int, model: str, obj: str, choices: list, **extra) -> dict:
    """A response's (or a stream chunk's) outer object, around its choices; extra: usage, timings."""
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": BUILD_INFO,
            "choices": choices, **extra}


# -- /v1/completions -----------------------------------------------------------------------------

async def completions(req, ex, *, parser, compile, start, tokenizer, alias, engine):
    """OpenAI's legacy completions: a prompt or a list of prompts (as llama-server), n choices of each;
    choice index = prompt index * n + choice."""
    params = parser.completions(req.body)
    compiled = await compile(params.constraint, params.limits)
    if params.echo:
        return await _echoed(ex, params, compiled, start=start, tokenizer=tokenizer, alias=alias, engine=engine)
    gens = start_all(start, ex, params, compiled)
    rid, created, n, k = new_id("cmpl-"), int(time.time()), params.n, params.logprobs

    def choice(i, text, ids, probs, offset, finish):
        lp = None if k is None else legacy_logprobs(tokenizer, ids, probs or [], k, offset)
        return {"text": text, "index": i, "logprobs": lp, "finish_reason": finish}

    envelope = partial(_envelope, rid, created, alias, "text_completion")

    def usage():
        return _usage([gens[j * n: (j + 1) * n] for j in range(len(params.prompts))])

    if params.stream:
        async def events():
            offset = [0] * len(gens)
            async for i, d in interleave([g.deltas() for g in gens], gens):
                if d is None:
                    yield sse.event(envelope([choice(i, "", [], [], offset[i], gens[i].openai_finish_reason)]))
                else:
                    yield sse.event(envelope([choice(i, d.text, d.ids, d.probs, offset[i], None)]))
                    offset[i] += len(d.text)
            if params.include_usage:
                yield sse.event(envelope([], usage=usage()))
            yield sse.DONE
        return StreamResponse(events(), on_error=lambda err: sse.error_event(err.payload(OPENAI)))
    await run_all(gens)
    return json_response(envelope([choice(i, g.text.text, g.ids, g.probs, 0, g.openai_finish_reason)
                                   for i, g in enumerate(gens)], usage=usage(), timings=gens[0].timings()))


async def _echoed(ex, params, compiled, *, start, tokenizer, alias, engine):
    """/v1/completions with echo (one choice per prompt, not streamed): each prompt's text, then its completion
    (none at max_tokens 0); with logprobs, the prompt's scores (Engine.score, computed beside the completions)
    before the completion's own."""
    k = params.logprobs
    try:
        job = None if k is None else engine.score(params.prompts, top=k)
    except RequestError as exc:
        raise refused(exc) from None
    except EngineClosed:
        raise HttpError(503, "the server is shutting down") from None
    try:
        gens = start_all(start, ex, params, compiled) if params.max_tokens != 0 else []
        if gens:
            await run_all(gens)
        scores = None if job is None else await asyncio.wrap_future(job.future)
    except EngineClosed:
        raise HttpError(503, "the server is shutting down") from None
    finally:
        if job is not None:
            job.cancel()            # a client gone or a completion failed: its prompts left unscored are skipped
    texts = [t if t is not None else tokenizer.decode(ids)
             for t, ids in zip(params.texts or [None] * len(params.prompts), params.prompts)]

    def choice(i: int) -> dict:
        text, g = texts[i], gens[i] if gens else None
        lp = None if k is None else prompt_logprobs(tokenizer, params.prompts[i], scores[i], k)
        if g is not None and lp is not None:
            own = legacy_logprobs(tokenizer, g.ids, g.probs or [], k, len(text))
            lp = {key: lp[key] + own[key] for key in lp}
        return {"text": text + (g.text.text if g else ""), "index": i, "logprobs": lp,
                "finish_reason": g.openai_finish_reason if g else "length"}

    n_prompt = sum(len(ids) for ids in params.prompts)
    n_gen = sum(len(g.ids) for g in gens)
    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}
    extra = {"timings": gens[0].timings()} if gens else {}
    return json_response(_envelope(new_id("cmpl-"), int(time.time()), alias, "text_completion",
                                   [choice(i) for i in range(len(params.prompts))], usage=usage, **extra))


# -- /v1/chat/completions ------------------------------------------------------------------------

async def start_chat(ex, params, *, parser, compile, start):
    """(params with its prompt, its generations) of a chat request as Parser.chat_body read it: the constraint
    compiled, the conversation made and the choices submitted. Every chat-shaped API starts so."""
    compiled = await compile(params.constraint, params.limits)     # the compiler's message before the prompt's size
    params = parser.conversation(params)
    return params, start_all(start, ex, params, compiled)


async def chat_completions(req, ex, *, parser, compile, start, tokenizer, alias):
    params, gens = await start_chat(ex, parser.chat(req.body), parser=parser, compile=compile, start=start)
    rid, created, plan, k = new_id("chatcmpl-"), int(time.time()), params.tools, params.logprobs
    think = params.reasoning if params.reasoning is not None and params.reasoning.split else None

    def reply(g):
        """(message fields, finish_reason) of a finished generation."""
        if plan is None:
            if think is None:
                return {"content": g.text.text}, g.openai_finish_reason
            thought, content = split(think, g.text.text)
            return {"content": content, **({"reasoning_content": thought} if thought else {})}, g.openai_finish_reason
        content, calls = plan.parse(g.text.text)
        if calls:
            return {"content": None, "tool_calls": calls}, "tool_calls"
        return {"content": content}, g.openai_finish_reason

    def logprobs(ids, probs):
        return None if k is None else {"content": chat_logprobs(tokenizer, ids, probs or [], k)}

    envelope = partial(_envelope, rid, created, alias)

    def chunk(i: int, delta: dict, lp=None, finish=None, **extra) -> bytes:
        return sse.event(envelope("chat.completion.chunk", [
            {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}], **extra))

    def per_token(g) -> dict:
        return {"timings": g.timings()} if params.timings_per_token else {}

    def split_delta(i: int, text: str, end: bool = False) -> dict:
        """A content delta, its reasoning apart (a reasoning chat) as it comes."""
        if think is None:
            return {"content": text}
        thought, content = splitters[i].flush() if end else splitters[i].feed(text)
        return {**({"reasoning_content": thought} if thought else {}), **({"content": content} if content else {})}

    if params.stream:
        splitters = [Splitter(think) for _ in gens] if think is not None else []

        async def events():
            for i in range(params.n):
                yield chunk(i, {"role": "assistant", "content": None})
            async for i, d in interleave([g.deltas() for g in gens], gens):
                if d is None:
                    fields, finish = reply(gens[i])
                    if plan is not None:    # a call is known to be one when its JSON is complete
                        yield chunk(i, {"content": fields["content"]} if "tool_calls" not in fields else
                                    {"tool_calls": [{"index": j, **c} for j, c in enumerate(fields["tool_calls"])]})
                    elif think is not None and (rest := split_delta(i, "", end=True)):
                        yield chunk(i, rest)
                    yield chunk(i, {}, finish=finish, timings=gens[i].timings())
                elif plan is None and (d.text or k is not None):
                    delta = split_delta(i, d.text)
                    if delta or k is not None:
                        yield chunk(i, delta, logprobs(d.ids, d.probs), **per_token(gens[i]))
            if params.include_usage:        # the last chunk: llama-server's carries the timings
                yield sse.event(envelope("chat.completion.chunk", [], usage=_usage([gens]), timings=gens[0].timings()))
            yield sse.DONE
        return StreamResponse(events(), on_error=lambda err: sse.error_event(err.payload(OPENAI)))
    await run_all(gens)
    replies = [reply(g) for g in gens]
    return json_response(envelope("chat.completion", [{
        "index": i, "message": {"role": "assistant", **replies[i][0]},
        "logprobs": logprobs(g.ids, g.probs), "finish_reason": replies[i][1]} for i, g in enumerate(gens)],
        usage=_usage([gens]), timings=gens[0].timings()))
