"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, as Claude Code and the
`anthropic` SDK speak it.

A request is translated into the chat route's form (messages, tools, tool_choice, sampling) and read by
params.Parser.chat_body, so the template, the tools' constraint and every field check are the chat's:

    system (text or text blocks)          a system message first
    text blocks                           a message's content (blocks joined by a blank line)
    tool_use blocks (assistant)           its tool_calls, the call's id kept
    tool_result blocks (user)             tool messages answering a tool_use id given earlier (else 400);
                                          is_error: the text marked "Error: "
    image / document blocks               400: fastserve has no vision
    thinking blocks (assistant)           left out of the prompt (the templates drop earlier thinking)
    tools [{name, description,            OpenAI function tools; tool_choice auto / any / tool / none,
      input_schema}]                      disable_parallel_tool_use
    stop_sequences, max_tokens (required) stop, max_tokens; temperature, top_p, top_k and llama.cpp's
                                          sampling fields as the chat takes them
    thinking enabled / disabled /         thinking_budget_tokens budget_tokens / 0 / none (server/reasoning.py)
      adaptive

The answer: a message whose content is a text block (after a thinking block, for a reasoning model's reply),
or the tool_use blocks of the calls (stop_reason tool_use); stop_reason end_turn, max_tokens or stop_sequence
otherwise. A stream sends Anthropic's events: message_start, ping, then each block's content_block_start /
content_block_delta / content_block_stop (indices from 0; a block opens with its first text), message_delta
(stop_reason, usage), message_stop; with tools, the blocks come once the reply's JSON is complete (as the
chat's tool_calls do). Errors: Anthropic's shape (errors.ANTHROPIC).
"""
from __future__ import annotations

import orjson

from . import sse
from .errors import ANTHROPIC, HttpError
from .fanout import run_all
from .fields import Body, parse_object
from .openai_api import start_chat
from .params import PASSED_TO_CHAT
from .response import StreamResponse, json_response
from .reasoning import Splitter, split
from .tools import new_id

STOP_REASONS = {"eos": "end_turn", "grammar": "end_turn", "limit": "max_tokens", "word": "stop_sequence"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}      # and {"type": "tool", "name": ...}
NO_VISION = ("image", "document")


async def messages(req, ex, *, parser, compile, start, alias):
    params = parser.chat_body(Body(chat_request(parse_object(req.body))))
    params, gens = await start_chat(ex, params, parser=parser, compile=compile, start=start)
    gen, plan = gens[0], params.tools
    think = params.reasoning if params.reasoning is not None and params.reasoning.split else None
    mid = new_id("msg_")

    def message(content: list, stop_reason, stop_sequence, output_tokens: int) -> dict:
        return {"id": mid, "type": "message", "role": "assistant", "model": alias, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": gen.n_prompt, "output_tokens": output_tokens}}

    if not params.stream:
        await run_all(gens)
        return json_response(message(*reply(plan, gen, think), len(gen.ids)))

    async def events():
        yield event("message_start", {"message": message([], None, None, 0)})
        yield event("ping", {})
        blocks, splitter = Blocks(), Splitter(think) if think is not None else None
        async for d in gen.deltas():
            if plan is None and d.text:
                thought, text = splitter.feed(d.text) if splitter is not None else ("", d.text)
                yield blocks.delta("thinking", thought) + blocks.delta("text", text)
        if splitter is not None:
            thought, text = splitter.flush()
            yield blocks.delta("thinking", thought) + blocks.delta("text", text)
        content, stop_reason, stop_sequence = reply(plan, gen, think)
        if plan is None:        # as the answer not streamed: a text block last, if empty
            yield blocks.stop() + (b"" if "text" in blocks.kinds else from_block(blocks.index + 1, content[-1]))
        else:
            for i, b in enumerate(content):
                yield from_block(i, b)
        yield event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                      "usage": {"output_tokens": len(gen.ids)}})
        yield event("message_stop", {})
    return StreamResponse(events(), on_error=lambda err: event("error", err.payload(ANTHROPIC)))


def count_tokens(req, ex, *, parser):
    """The prompt's tokens as /v1/messages would make it (the tools' text included)."""
    body = parse_object(req.body)
    params = parser.conversation(parser.chat_body(Body(chat_request(body, counting=True))))
    return json_response({"input_tokens": len(params.prompts[0])})


def event(kind: str, fields: dict) -> bytes:
    return sse.named(kind, {"type": kind, **fields})


def from_block(i: int, block: dict) -> bytes:
    """One whole content block as its start, one delta and its stop."""
    if block["type"] == "text":
        start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
    else:
        start = {**block, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": orjson.dumps(block["input"]).decode()}
    return (event("content_block_start", {"index": i, "content_block": start})
            + event("content_block_delta", {"index": i, "delta": delta})
            + event("content_block_stop", {"index": i}))


class Blocks:
    """A stream's content blocks as the text comes: a block opens with its first text of a kind and closes when
    the other kind begins (a reasoning reply: its thinking block, then its text block)."""

    def __init__(self):
        self.index, self.kind = -1, None
        self.kinds: list = []           # of the blocks opened, in order

    def delta(self, kind: str, text: str) -> bytes:
        if not text:
            return b""
        out = b""
        if kind != self.kind:
            out = self.stop()
            self.index, self.kind = self.index + 1, kind
            self.kinds.append(kind)
            out += event("content_block_start", {"index": self.index, "content_block": _empty(kind)})
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                          "text": text}
        return out + event("content_block_delta", {"index": self.index, "delta": delta})

    def stop(self) -> bytes:
        if self.kind is None:
            return b""
        kind, self.kind = self.kind, None
        return event("content_block_stop", {"index": self.index})


def _empty(kind: str) -> dict:
    return {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}


def reply(plan, gen, think=None) -> tuple[list, str, str | None]:
    """(content blocks, stop_reason, stop_sequence) of a finished generation; think: a reasoning reply's plan
    (its thinking block first)."""
    content, calls = plan.calls(gen.text.text) if plan is not None else (gen.text.text, None)
    if calls:
        return [{"type": "tool_use", "id": new_id("toolu_"), "name": c["name"], "input": c["arguments"]}
                for c in calls], "tool_use", None
    thought = ""
    if think is not None and plan is None:
        thought, content = split(think, content)
    reason = STOP_REASONS.get(gen.stop_type, "end_turn")
    blocks = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
    blocks.append({"type": "text", "text": content or ""})
    return blocks, reason, gen.text.stopping_word if reason == "stop_sequence" else None


# -- the request, in the chat's form ---------------------------------------------------------------

def chat_request(body: Body, counting: bool = False) -> dict:
    """The chat body standing for a Messages request (400 naming the Anthropic field that is wrong).
    counting (count_tokens): max_tokens is not asked for."""
    out = {name: body.data[name] for name in PASSED_TO_CHAT if body.has(name)}
    max_tokens = body.int("max_tokens", None, lo=1)
    if max_tokens is None and not counting:
        raise HttpError(400, "'max_tokens' is required (the most tokens to generate, >= 1)")
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    out["messages"] = chat_messages(body.raw("system"), body.raw("messages"))
    stops = body.raw("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise HttpError(400, "'stop_sequences' must be an array of strings")
        out["stop"] = stops
    budget = _thinking(body.raw("thinking"))
    if budget is not None:
        out["thinking_budget_tokens"] = budget
    tools = body.raw("tools")
    if tools is not None:
        out["tools"] = chat_tools(tools)
    choice = body.raw("tool_choice")
    if choice is not None:
        out["tool_choice"], parallel = chat_tool_choice(choice)
        out["parallel_tool_calls"] = parallel
    return out


def _thinking(value) -> int | None:
    """`thinking` as the chat's thinking_budget_tokens (None: the server's): enabled, its budget_tokens; disabled,
    0 (the template's enable_thinking false); adaptive or between_tools, no budget."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise HttpError(400, "'thinking.budget_tokens' must be an integer >= 1")
        return budget
    if kind == "disabled":
        return 0
    if kind in ("adaptive", "between_tools"):
        return -1
    raise HttpError(400, "'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N}, or of type disabled, "
                         "adaptive or between_tools")


def chat_tools(tools) -> list[dict]:
    """Anthropic's custom tools as OpenAI function tools; server tools (web search, bash, ...) are refused."""
    if not isinstance(tools, list):
        raise HttpError(400, "'tools' must be an array of {\"name\", \"description\", \"input_schema\"} objects")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise HttpError(400, f"tools[{i}] must be an object")
        if t.get("type", "custom") != "custom":
            raise HttpError(400, f"tools[{i}]: tool type {t['type']!r} is not supported (only custom tools: "
                                 f"name, description, input_schema)")
        name, schema = t.get("name"), t.get("input_schema")
        if not isinstance(name, str) or not name:
            raise HttpError(400, f"tools[{i}].name is required (a non-empty string)")
        if not isinstance(schema, dict):
            raise HttpError(400, f"tools[{i}].input_schema is required (a JSON schema object)")
        fn = {"name": name, "parameters": schema}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice) -> tuple:
    """(OpenAI tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise HttpError(400, "'tool_choice' of type tool needs the tool's 'name'")
        openai = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in TOOL_CHOICES:
        openai = TOOL_CHOICES[kind]
    else:
        raise HttpError(400, "'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} "
                             "or {\"type\": \"tool\", \"name\": ...}")
    parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(parallel, bool):
        raise HttpError(400, "'tool_choice.disable_parallel_tool_use' must be true or false")
    return openai, not parallel


def chat_messages(system, messages) -> list[dict]:
    """Anthropic's system and messages as OpenAI chat messages (tools.chat_messages reads them next)."""
    out = [] if system is None else [{"role": "system", "content": _text(system, "system")}]
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "'messages' must be a non-empty array of {\"role\": ..., \"content\": ...} objects")
    calls: set[str] = set()              # the tool_use ids given so far: what a tool_result may answer
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise HttpError(400, f"messages[{i}] must be an object whose 'role' is user or assistant")
        role, content = m["role"], m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise HttpError(400, f"messages[{i}].content must be a string or an array of content blocks")
        text, uses, results = [], [], []
        for j, b in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text.append(_text([b], where))
            elif kind in NO_VISION:
                raise HttpError(400, f"{where}: {kind} blocks are not supported: this server's model has no vision")
            elif kind == "tool_use" and role == "assistant":
                uses.append(_tool_use(b, where))
                calls.add(b["id"])
            elif kind == "tool_result" and role == "user":
                results.append(_tool_result(b, where, calls))
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                pass
            else:
                raise HttpError(400, f"{where}: block type {kind!r} is not supported in a {role} message")
        if role == "assistant":
            out.append({"role": "assistant", "content": "\n\n".join(text), **({"tool_calls": uses} if uses else {})})
            continue
        out.extend(results)
        if text or not results:
            out.append({"role": "user", "content": "\n\n".join(text)})
    return out


def _text(value, where: str) -> str:
    """A string, or text blocks joined by a blank line (their cache_control is moot: prefixes are reused)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise HttpError(400, f"'{where}' must be a string or an array of text blocks")
    parts = []
    for j, b in enumerate(value):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind in NO_VISION:
                raise HttpError(400, f"{where}: {kind} blocks are not supported: this server's model has no vision")
            raise HttpError(400, f"{where}[{j}] must be a text block {{\"type\": \"text\", \"text\": ...}}")
        parts.append(b["text"])
    return "\n\n".join(parts)


def _tool_use(b: dict, where: str) -> dict:
    if not isinstance(b.get("id"), str) or not b["id"] or not isinstance(b.get("name"), str):
        raise HttpError(400, f"{where}: a tool_use block needs its 'id' and 'name'")
    if not isinstance(b.get("input"), dict):
        raise HttpError(400, f"{where}.input must be an object (the call's arguments)")
    return {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b["input"]}}


def _tool_result(b: dict, where: str, calls: set) -> dict:
    tid = b.get("tool_use_id")
    if not isinstance(tid, str) or tid not in calls:
        raise HttpError(400, f"{where}: tool_result answers tool_use_id {tid!r}, which no earlier tool_use "
                             f"block has")
    content = b.get("content", "")
    text = _text(content, f"{where}.content")
    if b.get("is_error"):
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": tid, "content": text}
