"""Ollama's request bodies, checked and translated into the chat route's body (ollama_api.py's routes answer).

Every field and option is taken, taken with no effect (saying why in OPTIONS), or refused with a 400 that says
what the route takes: never silently ignored.
"""
from __future__ import annotations

from .errors import HttpError
from .fields import Body, kind

# -- options: name -> (what it becomes, its argument) ---------------------------------------------------
#   field    the chat's field of that name (its checks: params.py, with the chat's message)
#   tokens   max_tokens; -1 (no limit) and -2 (fill the context) both run until the slot is full
#   context  at most this server's context per slot (-c / -np: fixed at start); more is refused
#   moot     taken with no effect, for the reason given
#   neutral  only its neutral value (the argument), for fastserve has no such sampler
#   start    refused: a load-time setting of `fastserve serve` (the flag given)
OPTIONS = {
    "temperature": ("field", None), "top_k": ("field", None), "top_p": ("field", None), "min_p": ("field", None),
    "seed": ("field", None), "stop": ("field", None), "repeat_penalty": ("field", None),
    "repeat_last_n": ("field", None), "presence_penalty": ("field", None), "frequency_penalty": ("field", None),
    "typical_p": ("field", None), "mirostat": ("field", None),
    "num_predict": ("tokens", None),
    "num_ctx": ("context", None),
    "num_keep": ("moot", "nothing is ever discarded from the context"),
    "mirostat_tau": ("moot", "Mirostat is off"), "mirostat_eta": ("moot", "Mirostat is off"),
    "penalize_newline": ("moot", "Ollama itself no longer reads it"),
    "tfs_z": ("neutral", 1.0),
    "num_batch": ("start", "-b"), "num_thread": ("start", "-t"), "num_gpu": ("start", "--device / -ngl"),
    "main_gpu": ("start", "--device"), "low_vram": ("start", "--device"), "f16_kv": ("start", "-ctk / -ctv"),
    "use_mmap": ("start", "(always memory-mapped)"), "use_mlock": ("start", "(never locked)"),
    "numa": ("start", "(no NUMA placement)"), "vocab_only": ("start", "(the whole model is loaded)"),
    "logits_all": ("start", "(no logits output)"), "embedding_only": ("start", "(embeddings are always served)"),
}
COMMON = {"model", "stream", "options", "format", "keep_alive", "think", "logprobs", "top_logprobs"}
CHAT_FIELDS = COMMON | {"messages", "tools"}
GENERATE_FIELDS = COMMON | {"prompt", "system", "raw", "suffix", "template", "context", "images"}
EMBED_FIELDS = {"model", "input", "truncate", "options", "keep_alive", "dimensions"}


def known(body: Body, allowed: set, route: str) -> None:
    unknown = sorted(set(body.data) - allowed)
    if unknown:
        raise HttpError(400, f"{route}: unknown field(s) {', '.join(map(repr, unknown))}; it takes "
                             f"{', '.join(sorted(allowed))}")


def model_name(body: Body, alias: str, field: str = "model") -> str:
    """The request's model: this server's one (its alias, with or without a tag ":latest"), else 404."""
    name = body.str(field) or (body.str("name") if field == "model" else None)
    if not name:
        raise HttpError(400, "model is required")
    if name not in (alias, f"{alias}:latest"):
        raise HttpError(404, f"model '{name}' not found (this server has '{alias}')")
    return name


def keep_alive(body: Body) -> None:
    """keep_alive: a number of seconds or a duration ("5m", "-1"); checked, then moot (one model, never unloaded)."""
    v = body.raw("keep_alive")
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float, str))):
        raise HttpError(400, f"'keep_alive' must be a duration (\"5m\") or a number of seconds, got {kind(v)}")


def options(body: Body, out: dict, n_ctx: int, allowed=None) -> None:
    """Ollama's options into the chat body out (OPTIONS); allowed: the only names this route takes."""
    opts = body.raw("options", {})
    if not isinstance(opts, dict):
        raise HttpError(400, f"'options' must be an object, got {kind(opts)}")
    for name, value in opts.items():
        if value is None:
            continue
        what, arg = OPTIONS.get(name, (None, None))
        if what is None or (allowed is not None and name not in allowed):
            raise HttpError(400, f"option '{name}' is not supported by fastserve"
                                 + ("" if what is None else " on this route"))
        if what == "field":
            out[name] = value
        elif what == "tokens":
            n = Body({name: value}).int(name, lo=-2)
            out["max_tokens"] = -1 if n < 0 else n
        elif what == "context":
            n = Body({name: value}).int(name, lo=1)
            if n > n_ctx:
                raise HttpError(400, f"option 'num_ctx' {n} exceeds this server's context per slot ({n_ctx} tokens, "
                                     f"set at start by -c / -np)")
        elif what == "neutral" and value != arg:
            raise HttpError(400, f"option '{name}' = {value!r} is not supported by fastserve (no such sampler); "
                                 f"leave it out or give {arg}")
        elif what == "start":
            raise HttpError(400, f"option '{name}' is a load-time setting: fastserve takes it when the server "
                                 f"starts ({arg})")


def _format(body: Body, out: dict) -> None:
    fmt = body.raw("format")
    if fmt in (None, ""):
        return
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    else:
        raise HttpError(400, "'format' must be \"json\" or a JSON schema object")


def _think(body: Body, out: dict) -> None:
    v = body.raw("think")
    if v is None:
        return
    if not isinstance(v, bool):
        raise HttpError(400, f"'think' must be true or false (levels such as {v!r} are not supported)")
    out["thinking_budget_tokens"] = -1 if v else 0


def common_fields(body: Body, n_ctx: int) -> dict:
    """The chat body's fields every generating route reads alike (stream defaults to true, as Ollama's)."""
    stream = body.bool("stream", True)
    out = {"stream": stream}
    for name in ("logprobs", "top_logprobs"):       # the chat's checks (top_logprobs needs logprobs: true)
        if body.has(name):
            out[name] = body.data[name]
    options(body, out, n_ctx)
    _format(body, out)
    _think(body, out)
    keep_alive(body)
    return out


def chat_messages(messages) -> list[dict]:
    """Ollama's messages as the chat's (tools.chat_messages checks them next)."""
    if not isinstance(messages, list):
        raise HttpError(400, "'messages' must be an array of {\"role\": ..., \"content\": ...} objects")
    out, calls = [], {}                  # tool name -> the id of its last call
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise HttpError(400, f"messages[{i}] must be an object")
        if m.get("images"):
            raise HttpError(400, f"messages[{i}]: images are not supported: this server's model has no vision")
        msg = {k: m[k] for k in ("role", "content") if k in m}
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _calls(m["tool_calls"], i, calls)
            msg.setdefault("content", "")
        if m.get("role") == "tool":
            name = m.get("tool_name") or m.get("name")
            msg["tool_call_id"] = calls.get(name) or f"call_{i}"
        out.append(msg)
    return out


def _calls(value, i: int, calls: dict) -> list[dict]:
    if not isinstance(value, list):
        raise HttpError(400, f"messages[{i}].tool_calls must be an array of {{\"function\": {{...}}}} objects")
    out = []
    for j, c in enumerate(value):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise HttpError(400, f"messages[{i}].tool_calls[{j}] needs function.name")
        args = fn.get("arguments", {})
        if not isinstance(args, (dict, str)):
            raise HttpError(400, f"messages[{i}].tool_calls[{j}].function.arguments must be an object")
        cid = f"call_{i}_{j}"
        calls[fn["name"]] = cid
        out.append({"id": cid, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out
