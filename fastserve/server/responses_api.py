"""OpenAI's Responses API: POST /v1/responses (Codex CLI's API), GET and DELETE /v1/responses/{id}.

Like anthropic_api, a request is translated into the chat route's form and read by Parser.chat_body:

    instructions                      a system message first (not carried over by previous_response_id,
                                      as OpenAI's)
    input: text                       one user message
    input: items                      message items (input_text / output_text parts), function_call items
                                      (an assistant's tool_calls), function_call_output items (tool messages
                                      answering a call_id of the conversation, else 400); reasoning items are
                                      left out; input_image / input_file / input_audio: 400 (no vision)
    previous_response_id              the stored conversation it ended goes first (400 when not stored)
    tools [{type: function, name,     the chat's function tools; tool_choice auto / none / required /
      description, parameters}]       {"type": "function", "name"}, parallel_tool_calls
    text.format                       the chat's response_format (text, json_object, json_schema)
    max_output_tokens, temperature,   max_tokens and the chat's sampling fields
      top_p, ...

    reasoning.effort                  the chat's reasoning_effort (a thinking budget: server/reasoning.py)

The answer's output: a message item (one output_text part), after a reasoning item (one reasoning_text part)
for a reasoning model's reply, or the function_call items of the calls;
status completed, or incomplete (incomplete_details.reason max_output_tokens). With store (default true) the
response is kept (response_store.py). A stream sends OpenAI's events, each with its sequence_number:
response.created, response.in_progress, then per output item response.output_item.added,
(response.content_part.added, response.output_text.delta... (a reasoning item: response.reasoning_text.delta...),
its .done, response.content_part.done | response.function_call_arguments.delta / .done), response.output_item.done,
and last response.completed (response.incomplete; response.failed when cut short). With tools the items
come once the reply's JSON is complete, as the chat's tool_calls do.
"""
from __future__ import annotations

import json
import time

from . import sse
from .errors import HttpError
from .fanout import run_all
from .fields import Body, parse_object
from .openai_api import start_chat
from .params import PASSED_TO_CHAT
from .response import StreamResponse, json_response
from .reasoning import Splitter, split, thought_tokens
from .tools import new_id

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
NO_VISION = ("input_image", "input_file", "input_audio")
TOOL_CHOICES = ("auto", "none", "required")


async def create(req, ex, *, parser, compile, start, alias, responses, tokenizer):
    body = parse_object(req.body)
    chat, history, calls = chat_request(body, responses)
    params, gens = await start_chat(ex, parser.chat_body(Body(chat)), parser=parser, compile=compile, start=start)
    gen, plan = gens[0], params.tools
    think = params.reasoning if params.reasoning is not None and params.reasoning.split and plan is None else None
    rid, created, store = new_id("resp_"), int(time.time()), body.bool("store", True)
    echo = _echo(body)

    def response(status: str, output: list, **extra) -> dict:
        return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
                "incomplete_details": None, "model": alias, "output": output, **echo, "usage": None, **extra}

    def finished(ids: dict) -> dict:
        output, said = reply(plan, gen, ids, think)
        status = "incomplete" if gen.stop_type == "limit" else "completed"
        thought = thought_tokens(think, tokenizer, gen.ids) if think is not None else 0
        usage = {"input_tokens": gen.n_prompt, "input_tokens_details": {"cached_tokens": gen.reader.n_cached},
                 "output_tokens": len(gen.ids), "output_tokens_details": {"reasoning_tokens": thought},
                 "total_tokens": gen.n_prompt + len(gen.ids)}
        out = response(status, output, usage=usage,
                       incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None)
        if store:
            new_calls = {item["call_id"] for item in output if item["type"] == "function_call"}
            responses.put(rid, history + [said], frozenset(calls | new_calls), out)
        return out

    if not params.stream:
        await run_all(gens)
        return json_response(finished(_item_ids()))

    seq = Sequence()

    async def events():
        yield seq("response.created", response=response("in_progress", []))
        yield seq("response.in_progress", response=response("in_progress", []))
        ids = _item_ids()
        items, splitter = Items(seq, ids), Splitter(think) if think is not None else None
        async for d in gen.deltas():
            if plan is None and d.text:
                thought, text = splitter.feed(d.text) if splitter is not None else ("", d.text)
                yield items.delta("reasoning", thought) + items.delta("message", text)
        if splitter is not None:
            thought, text = splitter.flush()
            yield items.delta("reasoning", thought) + items.delta("message", text)
        out = finished(ids)
        yield items.close(out["output"][items.index] if items.index >= 0 else None)
        for i, item in enumerate(out["output"][items.index + 1:], items.index + 1):     # not streamed: whole
            yield seq("response.output_item.added", output_index=i, item=_opening(item))
            for event in _item_events(seq, i, item, True):
                yield event
        yield seq("response.incomplete" if out["status"] == "incomplete" else "response.completed", response=out)

    def failed(err) -> bytes:
        return seq("response.failed", response=response("failed", [], error={"code": err.type, "message": err.message}))
    return StreamResponse(events(), on_error=failed)


def retrieve(req, ex, rid: str, *, responses):
    entry = responses.get(rid)
    if entry is None:
        raise HttpError(404, f"no stored response has the id {rid!r}")
    return json_response(entry.response)


def delete(req, ex, rid: str, *, responses):
    if not responses.delete(rid):
        raise HttpError(404, f"no stored response has the id {rid!r}")
    return json_response({"id": rid, "object": "response.deleted", "deleted": True})


def _item_ids() -> dict:
    return {"message": new_id("msg_"), "reasoning": new_id("rs_")}


class Items:
    """A stream's output items as the text comes: an item opens with its first text of a kind (a reasoning reply:
    its reasoning item, then its message) and closes when the other kind begins, or at the end."""

    def __init__(self, seq, ids: dict):
        self.seq, self.ids = seq, ids
        self.index, self.kind, self.text = -1, None, ""

    def delta(self, kind: str, text: str) -> bytes:
        if not text:
            return b""
        seq, out = self.seq, b""
        if kind != self.kind:
            out = self.close(None)
            self.index, self.kind, self.text = self.index + 1, kind, ""
            opening = _message(self.ids[kind], "in_progress", None) if kind == "message" else \
                _reasoning(self.ids[kind], None)
            out += seq("response.output_item.added", output_index=self.index, item=opening)
            out += seq("response.content_part.added", item_id=self.ids[kind], output_index=self.index,
                       content_index=0, part=_part(kind, ""))
        self.text += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return out + seq(name, item_id=self.ids[kind], output_index=self.index, content_index=0, delta=text, **extra)

    def close(self, item: dict | None) -> bytes:
        """The open item's done events; item: its final form (None: completed, of the text streamed)."""
        if self.kind is None:
            return b""
        kind, self.kind = self.kind, None
        if item is None:
            item = _message(self.ids[kind], "completed", self.text) if kind == "message" else \
                _reasoning(self.ids[kind], self.text)
        if kind == "message":
            return b"".join(_item_events(self.seq, self.index, item, False))
        rid, seq, i = self.ids[kind], self.seq, self.index
        return (seq("response.reasoning_text.done", item_id=rid, output_index=i, content_index=0, text=self.text)
                + seq("response.content_part.done", item_id=rid, output_index=i, content_index=0,
                      part=_part(kind, self.text))
                + seq("response.output_item.done", output_index=i, item=item))


class Sequence:
    """Named events numbered in order (sequence_number), as OpenAI's stream numbers them."""

    def __init__(self):
        self.n = 0

    def __call__(self, kind: str, **fields) -> bytes:
        out = sse.named(kind, {"type": kind, **fields, "sequence_number": self.n})
        self.n += 1
        return out


def _item_events(seq, i: int, item: dict, whole: bool):
    """An output item's events after its output_item.added: its content (whole: in one delta), then its done."""
    if item["type"] == "message":
        text = item["content"][0]["text"]
        if whole:
            yield seq("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                      part=_text(""))
            yield seq("response.output_text.delta", item_id=item["id"], output_index=i, content_index=0, delta=text,
                      logprobs=[])
        yield seq("response.output_text.done", item_id=item["id"], output_index=i, content_index=0, text=text,
                  logprobs=[])
        yield seq("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=_text(text))
    else:
        yield seq("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                  delta=item["arguments"])
        yield seq("response.function_call_arguments.done", item_id=item["id"], output_index=i, name=item["name"],
                  arguments=item["arguments"])
    yield seq("response.output_item.done", output_index=i, item=item)


def _opening(item: dict) -> dict:
    """An item as output_item.added shows it: in progress, its content still empty."""
    if item["type"] == "message":
        return _message(item["id"], "in_progress", None)
    return {**item, "arguments": "", "status": "in_progress"}


def _text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _part(kind: str, text: str) -> dict:
    return _text(text) if kind == "message" else {"type": "reasoning_text", "text": text}


def _reasoning(rid: str, text: str | None) -> dict:
    return {"type": "reasoning", "id": rid, "summary": [], "status": "in_progress" if text is None else "completed",
            "content": [] if text is None else [_part("reasoning", text)]}


def _message(mid: str, status: str, text: str | None) -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [] if text is None else [_text(text)]}


def reply(plan, gen, ids: dict, think=None) -> tuple[list, dict]:
    """(output items, the reply as the chat message a follow-up's conversation holds) of a finished generation;
    ids: its items' ids by kind; think: a reasoning reply's plan (its reasoning item first, left out of the
    conversation as the templates leave earlier thinking out)."""
    content, calls = plan.calls(gen.text.text) if plan is not None else (gen.text.text, None)
    status = "incomplete" if gen.stop_type == "limit" else "completed"
    if not calls:
        thought = ""
        if think is not None:
            thought, content = split(think, content)
        first = [_reasoning(ids["reasoning"], thought)] if thought else []
        return first + [_message(ids["message"], status, content or "")], {"role": "assistant", "content": content or ""}
    items = [{"type": "function_call", "id": new_id("fc_"), "call_id": new_id("call_"), "name": c["name"],
              "arguments": json.dumps(c["arguments"], ensure_ascii=False), "status": "completed"} for c in calls]
    said = {"role": "assistant", "content": "", "tool_calls": [
        {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
        for it in items]}
    return items, said


def _echo(body: Body) -> dict:
    """The request's settings as the response object repeats them."""
    d = body.data
    return {"instructions": d.get("instructions"), "max_output_tokens": d.get("max_output_tokens"),
            "previous_response_id": d.get("previous_response_id"), "temperature": d.get("temperature"),
            "top_p": d.get("top_p"), "tools": d.get("tools") or [], "tool_choice": d.get("tool_choice", "auto"),
            "parallel_tool_calls": d.get("parallel_tool_calls", True), "store": d.get("store", True),
            "text": d.get("text") or {"format": {"type": "text"}}, "reasoning": d.get("reasoning") or {},
            "metadata": d.get("metadata") or {}, "truncation": "disabled"}


# -- the request, in the chat's form ---------------------------------------------------------------

def chat_request(body: Body, responses) -> tuple[dict, list, set]:
    """(the chat body standing for the request, its conversation without the instructions, the call_ids in
    it); a 400 names the Responses field that is wrong."""
    out = {name: body.data[name] for name in PASSED_TO_CHAT if body.has(name)}
    if body.has("max_output_tokens"):
        out["max_tokens"] = body.int("max_output_tokens", lo=1)
    history, calls = [], set()
    prev = body.str("previous_response_id")
    if prev is not None:
        entry = responses.get(prev)
        if entry is None:
            raise HttpError(400, f"'previous_response_id': no stored response has the id {prev!r} (responses are "
                                 f"kept in memory, the least recently used dropped first)")
        history, calls = list(entry.messages), set(entry.calls)
    history += input_messages(body.raw("input"), calls)
    instructions = body.str("instructions")
    out["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + history
    tools = body.raw("tools")
    if tools is not None:
        out["tools"] = chat_tools(tools)
    choice = body.raw("tool_choice")
    if choice is not None:
        out["tool_choice"] = chat_tool_choice(choice)
    if body.has("parallel_tool_calls"):
        out["parallel_tool_calls"] = body.bool("parallel_tool_calls")
    fmt = _format(body.raw("text"))
    if fmt is not None:
        out["response_format"] = fmt
    reasoning = body.raw("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise HttpError(400, "'reasoning' must be an object like {\"effort\": \"low\"}")
    if reasoning is not None and reasoning.get("effort") is not None:
        out["reasoning_effort"] = reasoning["effort"]        # the chat's budget of it (server/reasoning.py)
    return out, history, calls


def input_messages(value, calls: set) -> list[dict]:
    """`input` as chat messages; calls: the call_ids so far, those of function_call items added."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise HttpError(400, "'input' must be a string or a non-empty array of items")
    out = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise HttpError(400, f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise HttpError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
            out.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = _function_call(item, where)
            calls.add(call["id"])
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            cid = item.get("call_id")
            if not isinstance(cid, str) or cid not in calls:
                raise HttpError(400, f"{where}: function_call_output answers call_id {cid!r}, which no function call "
                                     f"of the conversation has")
            out.append({"role": "tool", "tool_call_id": cid, "content": _content(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            pass
        else:
            raise HttpError(400, f"{where}: item type {kind!r} is not supported (message, function_call, "
                                 f"function_call_output, reasoning)")
    return out


def _content(value, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise HttpError(400, f"{where}.content must be a string or an array of input_text parts")
    parts = []
    for j, p in enumerate(value):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in NO_VISION:
            raise HttpError(400, f"{where}.content[{j}]: {kind} is not supported: this server's model has no vision")
        if kind not in TEXT_PARTS or not isinstance(p.get("text"), str):
            raise HttpError(400, f"{where}.content[{j}] must be {{\"type\": \"input_text\", \"text\": ...}}, "
                                 f"got type {kind!r}")
        parts.append(p["text"])
    return "".join(parts)


def _function_call(item: dict, where: str) -> dict:
    cid, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not isinstance(cid, str) or not cid or not isinstance(name, str) or not isinstance(args, str):
        raise HttpError(400, f"{where}: a function_call item needs its 'call_id', 'name' and 'arguments' (a JSON "
                             f"string)")
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def chat_tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise HttpError(400, "'tools' must be an array of {\"type\": \"function\", \"name\": ...} objects")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise HttpError(400, f"tools[{i}]: tool type {kind!r} is not supported (only function tools)")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise HttpError(400, f"tools[{i}].name is required (a non-empty string)")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice):
    if choice in TOOL_CHOICES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise HttpError(400, "'tool_choice' must be auto, none, required or {\"type\": \"function\", \"name\": ...}")


def _format(text) -> dict | None:
    """text.format as the chat's response_format."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        if not isinstance(text, dict):
            raise HttpError(400, "'text' must be an object like {\"format\": {\"type\": \"text\"}}")
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", ""), "schema": fmt.get("schema", {})}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise HttpError(400, "'text.format.type' must be text, json_object or json_schema")
