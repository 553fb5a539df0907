"""Constraints over HTTP on the tiny model (random weights: the constraint alone makes the output valid):
/completion grammar and json_schema, OpenAI response_format and tools, streamed and not."""
from __future__ import annotations

import json

import jsonschema
import pytest

from .conftest import ServerProc

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 99},
                                           "tag": {"enum": ["a", "b"]}},
          "required": ["n", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    """Slots of 1024 tokens: the tools' system message is long in the tiny vocabulary's tokens."""
    p = ServerProc(tiny_model_path, tmp_path_factory.mktemp("structured") / "server.log", "-c", "4096", "-np", "4")
    yield p
    p.kill()


def test_completion_grammar_streamed_and_not(http):
    body = {"prompt": "x", "grammar": 'root ::= "<" [a-z]{2,5} ">"', "n_predict": 32, "temperature": 1.0, "seed": 4}
    r = http.post("/completion", json=body).json()
    assert r["stop_type"] == "eos" and r["content"].startswith("<") and r["content"].endswith(">")
    with http.stream("POST", "/completion", json={**body, "stream": True}) as s:
        text = "".join(json.loads(x[6:])["content"] for x in s.iter_lines() if x.startswith("data: "))
    assert text == r["content"]
    assert http.post("/completion", json={**body, "grammar": ""}).status_code == 200     # "" means none


def test_completion_json_schema(http):
    r = http.post("/completion", json={"prompt": "{", "json_schema": SCHEMA, "n_predict": 48,
                                       "temperature": 0.0}).json()
    assert r["stop_type"] == "eos"
    jsonschema.validate(json.loads(r["content"]), SCHEMA)


def test_chat_response_format(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "json"}],
                                    response_format=fmt, max_tokens=48, temperature=0.7, seed=1)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    text = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "json"}], response_format=fmt, max_tokens=48,
        temperature=0.7, seed=1, stream=True) if c.choices)
    assert text == r.choices[0].message.content


def test_chat_tools_named(oai):
    tool = {"type": "function", "function": {"name": "pick", "parameters": SCHEMA}}
    choice = {"type": "function", "function": {"name": "pick"}}
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], tools=[tool],
                                    tool_choice=choice, max_tokens=400, temperature=0.0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and [c.function.name for c in ch.message.tool_calls] == ["pick"]
    jsonschema.validate(json.loads(ch.message.tool_calls[0].function.arguments), SCHEMA)
    chunks = list(oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], tools=[tool],
                                              tool_choice=choice, max_tokens=400, temperature=0.0, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or ())]
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == \
        [(0, "pick", ch.message.tool_calls[0].function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
