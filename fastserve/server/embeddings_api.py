"""Embeddings over HTTP: OpenAI's POST /v1/embeddings and llama-server's POST /embedding (/embeddings).

    OpenAI        {"input": "text" | ["text", ...] | [id, ...] | [[id, ...], ...], "encoding_format": "float" |
                  "base64", "model", "dimensions" (only the model's own), "user"}
                  -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}
    llama-server  {"content" or "input": the same shapes, "embd_normalize"}
                  -> [{"index": i, "embedding": [[...]]}]: one pooled vector, or every token's with --pooling none

Vectors are the model's final hidden states (after the output norm) pooled by the server's --pooling (as
llama-server's; pooling none is refused on the OpenAI route, as there) and normalised by `embd_normalize`
(default --embd-normalize: 2, Euclidean; pooled vectors only), computed by Engine.embed on the decode thread
(fastserve/embedding.py). Ollama's /api/embed (ollama_api.py) reads its inputs with inputs() too. Every input
is tokenized with the model's special tokens (as llama-server) and must hold at least one token and at most a
slot's context. A field neither API defines is refused, never ignored.
"""
from __future__ import annotations

import asyncio
import base64
from functools import partial

from ..errors import EngineClosed
from .errors import HttpError
from .fields import kind, parse_object
from .response import json_response

FIELDS = frozenset({"input", "content", "model", "encoding_format", "dimensions", "user", "embd_normalize"})


def inputs(value, name: str = "input") -> list:
    """The inputs of an embedding request, as llama-server reads them: a text, a list of token ids (one
    input), or a list of texts and token-id lists. 400 naming the field otherwise."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(_is_id(t) for t in value):
            return [value]
        if all(isinstance(x, str) or (isinstance(x, list) and all(_is_id(t) for t in x)) for x in value):
            return value
    if isinstance(value, list) and not value:
        raise HttpError(400, f"'{name}' is empty: give a text, a list of texts or a list of token ids")
    raise HttpError(400, f"'{name}' must be a string, a list of strings, a list of token ids or a list of token "
                         f"id lists, got {kind(value)}")


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


async def vectors(engine, parser, texts: list, pooling: str, normalize: int, truncate: bool = False) -> tuple[list, int]:
    """(per input, its vector(s): float32 arrays; the tokens computed) of Engine.embed's job. The texts are
    tokenized in a worker thread, not on the loop (a 2 MiB body is seconds of tokenizing); truncate: a text
    keeps its first tokens that fit a slot, else one too long is refused (before it is tokenized whole). A
    client that goes away cancels the job (its remaining inputs are skipped)."""
    ids = await asyncio.get_running_loop().run_in_executor(None, partial(_token_ids, engine, parser, texts, truncate))
    try:
        job = engine.embed(ids, pooling=pooling, normalize=normalize)
    except EngineClosed:
        raise HttpError(503, "the server is shutting down") from None
    try:
        return await asyncio.wrap_future(job.future), job.n_tokens
    except asyncio.CancelledError:
        job.cancel()
        raise
    except EngineClosed:
        raise HttpError(503, "the server is shutting down") from None


def _token_ids(engine, parser, texts: list, truncate: bool) -> list:
    """Each input as token ids, a text tokenized with the model's special tokens as Engine.embed would (in a worker
    thread): cut to a slot (truncate), or first checked for a length no slot can hold (400)."""
    out = []
    for t in texts:
        if isinstance(t, str):
            if truncate:
                t = engine.tokenizer.encode(t[:parser.max_chars], add_special=True)[:parser.n_ctx]
            else:
                parser.check_length(t)
                t = engine.tokenizer.encode(t, add_special=True)
        out.append(t)
    return out


def _read(req, config, info, oai: bool):
    """(inputs, normalize, base64?) of a request body, checked."""
    body = parse_object(req.body)
    unknown = sorted(set(body.data) - FIELDS)
    if unknown:
        raise HttpError(400, f"unknown field(s) {', '.join(map(repr, unknown))}; embeddings take "
                             f"{', '.join(sorted(FIELDS))}")
    if body.has("input"):
        texts = inputs(body.data["input"])
    elif body.has("content"):
        texts = inputs(body.data["content"], "content")
    else:
        raise HttpError(400, "\"input\" or \"content\" must be provided")
    fmt = body.str("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise HttpError(400, f"'encoding_format' must be float or base64, got {fmt!r}")
    dims = body.int("dimensions")
    if dims is not None and dims != info.n_embd:
        raise HttpError(400, f"'dimensions' {dims}: this model's embeddings have {info.n_embd} (no truncation)")
    body.str("user")                        # OpenAI's end-user id: checked, carries no meaning here
    body.str("model")                       # one model per server (as the other routes)
    normalize = body.int("embd_normalize", config.embd_normalize, lo=-1)
    if oai and config.pooling == "none":
        raise HttpError(400, "Pooling type 'none' is not OAI compatible. Please use a different pooling type "
                             "(--pooling mean, cls or last)")
    return texts, normalize, fmt == "base64"


async def create(req, ex, *, engine, config, info, alias, parser):
    """POST /v1/embeddings."""
    texts, normalize, b64 = _read(req, config, info, oai=True)
    vecs, n_tokens = await vectors(engine, parser, texts, config.pooling, normalize)

    def item(i, v):
        if b64:
            return {"object": "embedding", "index": i, "embedding": base64.b64encode(v.tobytes()).decode()}
        return {"object": "embedding", "index": i, "embedding": v}
    return json_response({"object": "list", "data": [item(i, v) for i, v in enumerate(vecs)], "model": alias,
                          "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})


async def embedding(req, ex, *, engine, config, info, parser):
    """POST /embedding, /embeddings: llama-server's own shape (a list of vectors per input)."""
    texts, normalize, b64 = _read(req, config, info, oai=False)
    if b64:
        raise HttpError(400, "'encoding_format' base64 is OpenAI's (/v1/embeddings); /embedding answers floats")
    vecs, _ = await vectors(engine, parser, texts, config.pooling, normalize)
    return json_response([{"index": i, "embedding": v if v.ndim == 2 else [v]} for i, v in enumerate(vecs)])
