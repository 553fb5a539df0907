"""A chat's `messages`, and OpenAI `tools` / `tool_choice` and `response_format` for /v1/chat/completions:
request -> prompt messages and constraint, generated JSON -> `tool_calls`.

Tool calls use one generic format for every model (llama.cpp's "generic" chat format): the reply is a
JSON object, constrained by a schema built from the tools' parameters,

    {"tool_calls": [{"name": "<a tool>", "arguments": {...its parameters...}}, ...]}   a call
    {"response": "<text>"}                                                            tool_choice auto only

A tool's arguments hold only its declared parameters unless its schema says otherwise
("additionalProperties" absent counts as false, as OpenAI's strict mode has it): a small model given
an open object keeps inventing properties until n_predict cuts the call.

tool_choice: "auto" (default: a call or a response), "required" (one call or more), a named function
(exactly one call of it), "none" (the tools are left out, plain text). The chat template gets the tools
(jinja2 `tools`, for templates that render them); for a template that does not, the tools and the format
are described in a system message. Calls come back whole: in a stream, as one `delta.tool_calls` chunk
once the object is complete (the JSON is only known to be a call when it is).
"""
from __future__ import annotations

import json
import os

from .errors import HttpError

_CHOICES = ("auto", "none", "required")
ROLES = ("system", "user", "assistant", "tool", "developer")


class ToolPlan:
    """What a request's tools mean for its prompt, its constraint and its reply."""

    __slots__ = ("tools", "choice", "schema", "parallel")

    def __init__(self, tools: list[dict], choice, parallel: bool):
        self.tools = tools          # [{"type": "function", "function": {"name", "description", "parameters"}}]
        self.choice = choice        # "auto" | "required" | a tool's name
        self.parallel = parallel
        self.schema = _reply_schema(tools, choice, parallel)

    def system_text(self) -> str:
        """The tools and the reply format, for a template that does not render `tools` itself."""
        lines = ["You can call these tools (JSON schema of each one's arguments):"]
        for t in self.tools:
            f = t["function"]
            lines.append(json.dumps({"name": f["name"], "description": f.get("description", ""),
                                     "parameters": f.get("parameters", {})}, ensure_ascii=False))
        lines.append('To call tools, reply with JSON only: {"tool_calls": [{"name": "<tool name>", '
                     '"arguments": {<its arguments>}}]}.')
        if self.choice == "auto":
            lines.append('To answer without a tool, reply with JSON: {"response": "<your answer>"}.')
        return "\n".join(lines)

    def calls(self, text: str):
        """(content, calls) of a finished reply, each call {"name", "arguments": its JSON object}; calls is
        None when it holds none. Every API writes these its own way (parse: OpenAI chat's)."""
        try:
            obj = json.loads(text)
        except ValueError:
            return text, None               # cut short (length) or not JSON: the text as it is
        if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
            return None, [{"name": c.get("name", ""), "arguments": c.get("arguments", {})}
                          for c in obj["tool_calls"] if isinstance(c, dict)]
        if isinstance(obj, dict) and isinstance(obj.get("response"), str):
            return obj["response"], None
        return text, None

    def parse(self, text: str):
        """(content, tool_calls) of a finished reply as OpenAI's chat writes them; tool_calls is None when it
        holds none."""
        content, calls = self.calls(text)
        if calls is None:
            return content, None
        return None, [{"id": new_id("call_"), "type": "function",
                       "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                      for c in calls]


def new_id(prefix: str) -> str:
    """An id for a response, a message or a call: the API's prefix and 24 random hex digits."""
    return prefix + os.urandom(12).hex()


def tool_plan(body) -> ToolPlan | None:
    """The request's tools and tool_choice, validated (400 naming the problem); None without tools."""
    tools = body.raw("tools")
    if body.raw("functions") is not None:
        raise HttpError(400, "'functions' is deprecated and not supported: send 'tools'")
    choice = body.raw("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise HttpError(400, "'tool_choice' needs 'tools'")
        return None
    if not isinstance(tools, list):
        raise HttpError(400, "'tools' must be an array of {\"type\": \"function\", \"function\": {...}} objects")
    out, names = [], set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise HttpError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not name:
            raise HttpError(400, f"tools[{i}].function.name is required (a non-empty string)")
        if name in names:
            raise HttpError(400, f"tools[{i}].function.name {name!r} is given twice")
        names.add(name)
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise HttpError(400, f"tools[{i}].function.parameters must be a JSON schema object")
        desc = f.get("description", "")
        if not isinstance(desc, str):
            raise HttpError(400, f"tools[{i}].function.description must be a string")
        out.append({"type": "function", "function": {"name": name, "description": desc, "parameters": params}})
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise HttpError(400, "'tool_choice' as an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in names:
            raise HttpError(400, f"'tool_choice' names {name!r}, which is not among the tools")
        choice = name
    elif choice not in _CHOICES:
        raise HttpError(400, f"'tool_choice' must be one of {', '.join(map(repr, _CHOICES))} or a named function")
    if choice == "none" or not out:
        return None
    return ToolPlan(out, choice, body.bool("parallel_tool_calls", True))


def _reply_schema(tools: list[dict], choice: str, parallel: bool) -> dict:
    chosen = [t for t in tools if choice in ("auto", "required") or t["function"]["name"] == choice]
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "arguments": _closed(t["function"]["parameters"])},
              "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array = {"type": "array", "items": items, "minItems": 1}
    if not parallel or choice not in ("auto", "required"):
        array["maxItems"] = 1
    call = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
            "additionalProperties": False}
    if choice != "auto":
        return call
    answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
              "additionalProperties": False}
    return {"anyOf": [call, answer]}


def _closed(params: dict) -> dict:
    if params.get("type") == "object" and "additionalProperties" not in params:
        return {**params, "additionalProperties": False}
    return params


def with_tools(messages: list[dict], plan: ToolPlan, template_takes_tools: bool) -> list[dict]:
    """Messages for the template: the tools described in a system message when it does not take them."""
    if template_takes_tools:
        return messages
    text = plan.system_text()
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def response_format(body) -> dict | None:
    """`response_format` as a JSON schema to enforce; None for text (400 for anything else)."""
    fmt = body.raw("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise HttpError(400, "'response_format' must be an object like {\"type\": \"json_object\"}")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = fmt.get("schema")         # llama-server also takes a schema here
        return schema if isinstance(schema, dict) else {"type": "object"}
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict):
            raise HttpError(400, "'response_format.json_schema' must be an object {\"name\": ..., \"schema\": {...}}")
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise HttpError(400, "'response_format.json_schema.schema' must be a JSON schema object")
        return schema
    raise HttpError(400, f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def history_message(i: int, m: dict, content: str, template_takes_tools: bool) -> dict:
    """An assistant message with tool_calls, or a tool result, as the template should see it."""
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise HttpError(400, f"messages[{i}].tool_calls must be an array")
        plain = []
        for j, c in enumerate(calls):
            f = c.get("function") if isinstance(c, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise HttpError(400, f"messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", "
                                     f"\"function\": {{\"name\": ..., \"arguments\": \"...\"}}}}")
            args = f.get("arguments", "{}")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except ValueError:
                raise HttpError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON") from None
            plain.append({"name": f["name"], "arguments": args})
        if template_takes_tools:
            return {"role": m["role"], "content": content,
                    "tool_calls": [{"type": "function", "function": c} for c in plain]}
        return {"role": m["role"], "content": json.dumps({"tool_calls": plain}, ensure_ascii=False)}
    out = {"role": m["role"], "content": content}
    if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def chat_messages(value, template_takes_tools: bool = False) -> list[dict]:
    """Validate OpenAI messages; content parts of type text are joined into one string; earlier tool
    calls and their results are kept for the template (history_message). Refused (400): a message that
    is not an object, without a known role, with content of a wrong type, without content (only an
    assistant's may be null, and it needs the key or tool_calls, as llama-server), a tool message without
    its tool_call_id."""
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
            if "content" not in m and m.get("tool_calls") is None:     # null content is an assistant's right
                raise HttpError(400, f"messages[{i}] (assistant) has neither 'content' nor 'tool_calls'")
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
