"""One streaming generation against a target, as the client sees it: when each token arrived.

Targets: an HTTP server speaking llama.cpp's /completion (api 'llamacpp'), OpenAI's
/v1/completions ('openai') or /v1/chat/completions ('chat'), through httpx on the caller's event
loop; or an in-process Engine ('inprocess'), read through its async reader on the same loop.
Times are time.perf_counter() seconds. A Record never raises: a failure is its `error` kind
('http 503', 'ReadTimeout', 'no tokens', ...), with what arrived before it kept.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import orjson

APIS = {"llamacpp": "/completion", "openai": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class Params:
    """What every request of a run asks for."""
    n_predict: int = 128
    temperature: float = 0.0       # 0: greedy
    ignore_eos: bool = False
    seed: int = 0
    model: str = "default"         # the OpenAI APIs' "model" field


@dataclass
class Record:
    """One request. arrivals: [(seconds, tokens that arrived then)]."""
    t_sent: float
    t_end: float = 0.0
    status: int = 0
    error: str | None = None
    arrivals: list = field(default_factory=list)
    done: bool = False             # it ended by itself (success or failure); False: cancelled at the window's end

    @property
    def n_tokens(self) -> int:
        return sum(k for _, k in self.arrivals)


@dataclass(frozen=True)
class Target:
    """What is measured: name (for tables), url (None: in-process), api, pid (for RSS; None: unknown)."""
    name: str
    url: str | None
    api: str = "llamacpp"
    pid: int | None = None


def request_body(api: str, prompt, p: Params) -> dict:
    sampling = {"temperature": p.temperature, "seed": p.seed, "stream": True}
    if p.ignore_eos:
        sampling["ignore_eos"] = True
    if api == "llamacpp":
        return {"prompt": prompt.text, "n_predict": p.n_predict, "cache_prompt": False, **sampling}
    common = {"model": p.model, "max_tokens": p.n_predict, "stream_options": {"include_usage": True}, **sampling}
    if api == "openai":
        return {"prompt": prompt.text, **common}
    return {"messages": prompt.messages, **common}


def _event_tokens(api: str, ev: dict, seen: int) -> tuple[int, int | None]:
    """(tokens this event carries, the request's final token count when the event says so)."""
    if api == "llamacpp":
        if ev.get("stop"):
            return 0, ev.get("tokens_predicted")
        n = ev.get("tokens_predicted")
        return (n - seen if isinstance(n, int) else 1), None
    usage = ev.get("usage") or {}
    final = usage.get("completion_tokens")
    choices = ev.get("choices") or []
    if not choices:
        return 0, final
    c = choices[0]
    piece = c.get("text") if api == "openai" else (c.get("delta") or {}).get("content")
    return (1 if piece else 0), final


async def stream_http(client, target: Target, prompt, p: Params, rec: Record) -> Record:
    """POST one streaming request with an httpx.AsyncClient; fills `rec` as the SSE events arrive (so that a
    cancelled caller keeps what came)."""
    rec.t_sent = time.perf_counter()
    body = orjson.dumps(request_body(target.api, prompt, p))
    final = None
    try:
        async with client.stream("POST", target.url.rstrip("/") + APIS[target.api], content=body,
                                 headers={"content-type": "application/json"}) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                rec.error = f"http {resp.status_code}"
                rec.done = True
                return rec
            buf, seen = b"", 0
            async for chunk in resp.aiter_raw():
                now = time.perf_counter()
                buf += chunk
                k_now = 0
                while (i := buf.find(b"\n\n")) >= 0:
                    event, buf = buf[:i], buf[i + 2:]
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                            continue
                        k, fin = _event_tokens(target.api, orjson.loads(line[5:]), seen)
                        k_now += max(k, 0)
                        seen += max(k, 0)
                        final = fin if fin is not None else final
                if k_now:
                    rec.arrivals.append((now, k_now))
        if final is not None and final > rec.n_tokens and rec.arrivals:   # pieces that carried 2+ tokens
            t, k = rec.arrivals[-1]
            rec.arrivals[-1] = (t, k + final - rec.n_tokens)
        if not rec.arrivals:
            rec.error = "no tokens"
        rec.done = True
    except Exception as exc:        # noqa: BLE001 - every failure is a figure (errors by kind)
        rec.error, rec.done = type(exc).__name__, True
    finally:
        rec.t_end = time.perf_counter()
    return rec


async def stream_engine(engine, prompt, p: Params, rec: Record) -> Record:
    """One request on an in-process Engine, read on this event loop (its reader's async iterator)."""
    rec.t_sent = time.perf_counter()
    sampling = {"temperature": p.temperature}
    if p.ignore_eos:
        tok = engine.tokenizer
        sampling["logit_bias"] = {int(i): float("-inf") for i in set(tok.eog_ids) | {tok.eos_id} - {None}}
    try:
        reader = engine.submit(prompt.text, max_tokens=p.n_predict, seed=p.seed, cache_prompt=False, **sampling).reader
        rec.status = 200
        try:
            async for batch in reader.abatches():
                rec.arrivals.append((time.perf_counter(), len(batch)))
        except asyncio.CancelledError:      # the window closed: free its slot
            reader.cancel()
            raise
        if reader.error:
            rec.error = "engine error"
        elif not rec.arrivals:
            rec.error = "no tokens"
        rec.done = True
    except Exception as exc:        # noqa: BLE001
        rec.error, rec.done = type(exc).__name__, True
    finally:
        rec.t_end = time.perf_counter()
    return rec
