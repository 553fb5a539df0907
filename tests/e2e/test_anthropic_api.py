"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) driven by the real `anthropic` SDK, on
the default model with a ChatML template that renders tools (templates/chatml_tools.jinja): a tool-use round
trip streamed and not, the stream's event order and indices, stop sequences, count_tokens, and bad input
answered 4xx in Anthropic's error shape."""
from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import jsonschema
import orjson
import pytest

from .conftest import ServerProc

pytestmark = pytest.mark.model

KEY = "sekrit"
TEMPLATE = Path(__file__).parent / "templates" / "chatml_tools.jinja"
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ONE_CALL = {"type": "any", "disable_parallel_tool_use": True}    # the 135M model repeats a call given room to
GREEDY = {"temperature": 0}     # the SDK's own arguments no longer include the sampling fields; the API takes them


@pytest.fixture(scope="module")
def server(default_model_file, tmp_path_factory):
    p = ServerProc(default_model_file, tmp_path_factory.mktemp("anthropic") / "server.log", "-c", "4096", "-np", "2",
                   "--chat-template-file", str(TEMPLATE), "--api-key", KEY)
    yield p
    p.kill()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def raw(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"x-api-key": KEY}) as c:
        yield c


def _answer(call) -> list:
    """The conversation after the model's call: its tool_use, then the result of it."""
    use = {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}
    return [*ASK, {"role": "assistant", "content": [use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": [{"type": "text", "text": "18 C and sunny"}]}]}]


def _events(client, **kw) -> tuple[list, object]:
    with client.messages.stream(**kw) as s:
        events = list(s)
        return events, s.get_final_message()


def _check_order(events: list) -> None:
    """Anthropic's order: message_start, each block's start / deltas / stop with indices 0, 1, ..., one
    message_delta, message_stop (pings anywhere after message_start)."""
    kinds = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                  "content_block_stop", "message_delta", "message_stop")]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    index, open_block = -1, False
    for e in events[1:]:
        if e.type == "content_block_start":
            assert not open_block and e.index == index + 1
            index, open_block = e.index, True
        elif e.type == "content_block_delta":
            assert open_block and e.index == index
        elif e.type == "content_block_stop":
            assert open_block and e.index == index
            open_block = False
    assert not open_block and index >= 0


def test_tool_use_round_trip(client):
    kw = dict(model="smollm2", max_tokens=64, extra_body=GREEDY, tools=[WEATHER])
    first = client.messages.create(messages=ASK, tool_choice=ONE_CALL, **kw)
    assert first.stop_reason == "tool_use" and first.role == "assistant" and first.type == "message"
    (call,) = first.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    assert first.usage.input_tokens == client.messages.count_tokens(
        model="smollm2", messages=ASK, tools=[WEATHER], tool_choice=ONE_CALL).input_tokens

    final = client.messages.create(messages=_answer(call), tool_choice={"type": "none"}, **kw)
    assert final.stop_reason in ("end_turn", "max_tokens")
    (text,) = final.content
    assert text.type == "text" and text.text.strip()
    counted = client.messages.count_tokens(model="smollm2", messages=_answer(call), tools=[WEATHER],
                                           tool_choice={"type": "none"}).input_tokens
    # tool_choice none leaves the tools out of the prompt; the call and its result are in it
    assert final.usage.input_tokens == counted > client.messages.count_tokens(model="smollm2", messages=ASK).input_tokens
    assert final.usage.output_tokens > 0


def test_tool_use_round_trip_streamed(client):
    kw = dict(model="smollm2", max_tokens=64, extra_body=GREEDY, tools=[WEATHER])
    want = client.messages.create(messages=ASK, tool_choice=ONE_CALL, **kw)
    events, first = _events(client, messages=ASK, tool_choice=ONE_CALL, **kw)
    _check_order(events)
    assert first.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in first.content] == [(b.type, b.name, b.input) for b in want.content]
    assert [e for e in events if e.type == "content_block_delta"][0].delta.type == "input_json_delta"
    start = next(e for e in events if e.type == "message_start")
    assert start.message.usage.input_tokens == want.usage.input_tokens

    want_final = client.messages.create(messages=_answer(first.content[0]), tool_choice={"type": "none"}, **kw)
    events, final = _events(client, messages=_answer(first.content[0]), tool_choice={"type": "none"}, **kw)
    _check_order(events)
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == want_final.content[0].text
    assert final.stop_reason == want_final.stop_reason
    assert final.usage.output_tokens == want_final.usage.output_tokens
    assert sum(e.type == "content_block_delta" for e in events) >= 2        # text streamed as it came


def test_system_blocks_stop_sequences_and_sampling(client):
    system = [{"type": "text", "text": "You answer briefly."}, {"type": "text", "text": "In English."}]
    kw = dict(model="smollm2", max_tokens=24, system=system, messages=[{"role": "user", "content": "Name a fruit."}])
    plain = client.messages.create(extra_body=GREEDY, **kw)
    assert plain.stop_reason in ("end_turn", "max_tokens") and plain.stop_sequence is None
    text = plain.content[0].text
    word = text.split()[1]
    cut = client.messages.create(extra_body=GREEDY, stop_sequences=[word], **kw)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert text.startswith(cut.content[0].text) and word not in cut.content[0].text
    assert plain.usage.input_tokens == client.messages.count_tokens(model="smollm2", system=system,
                                                                    messages=kw["messages"]).input_tokens
    # top_k 1 is greedy whatever the temperature; top_p taken too
    sampled = client.messages.create(extra_body={"temperature": 1.0, "top_k": 1, "top_p": 0.9}, **kw)
    assert sampled.content[0].text == text


def _refused(r: httpx.Response, status: int = 400, kind: str = "invalid_request_error") -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    return body["error"]["message"]


def test_bad_input_is_a_4xx_in_anthropic_shape(raw, client):
    ok = {"model": "m", "max_tokens": 8, "messages": ASK}
    assert "max_tokens" in _refused(raw.post("/v1/messages", json={"model": "m", "messages": ASK}))
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        msg = _refused(raw.post(path, json={**ok, "messages": [{"role": "user", "content": [image]}]}))
        assert "image" in msg and "vision" in msg
    bad = [
        ({"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}, "video"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope",
                                                      "content": "x"}]}]}, "toolu_nope"),
        ({"messages": [{"role": "system", "content": "x"}]}, "role"),
        ({"messages": []}, "messages"),
        ({"tools": [{"name": "t"}]}, "input_schema"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"stop_sequences": "x"}, "stop_sequences"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"thinking": {"type": "enabled"}}, "budget_tokens"),
        ({"thinking": {"type": "sometimes"}}, "thinking"),
        ({"system": [{"type": "image"}]}, "image"),
    ]
    for change, named in bad:
        assert named in _refused(raw.post("/v1/messages", json={**ok, **change})), change
    assert "JSON" in _refused(raw.post("/v1/messages", content=b"{nope"))
    assert "no route" in _refused(raw.post("/v1/messages/batches", json=ok), 404, "not_found_error")
    too_long = {**ok, "messages": [{"role": "user", "content": "hello " * 3000}]}
    for stream in (False, True):        # llama-server's n_prompt_tokens and n_ctx, in Anthropic's shape
        r = raw.post("/v1/messages", json={**too_long, "stream": stream})
        err = r.json()["error"]
        assert r.status_code == 400 and r.json()["type"] == "error" and err["type"] == "invalid_request_error"
        assert err["n_ctx"] == 2048 and err["n_prompt_tokens"] > 2048 and "context size" in err["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [image]}])
    # the key: x-api-key or a bearer token; a wrong one is Anthropic's authentication_error
    assert _refused(httpx.post(raw.base_url.join("/v1/messages"), json=ok, headers={"x-api-key": "wrong"}),
                    401, "authentication_error")
    r = httpx.post(raw.base_url.join("/v1/messages"), json=ok, headers={"authorization": f"Bearer {KEY}"},
                   timeout=60)
    assert r.status_code == 200 and r.json()["content"][0]["type"] == "text"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=str(raw.base_url), api_key="wrong", max_retries=0).messages.create(**ok)


def test_a_stream_cut_short_ends_with_an_error_event(raw):
    """A deadline mid-stream: Anthropic's `error` event, in its shape, ends the stream."""
    body = {"model": "m", "max_tokens": 3000, "stream": True, "messages": ASK, "request_timeout": 0.3,
            "ignore_eos": True}
    with raw.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        lines = [x for x in r.iter_lines() if x]
    names = [x[7:] for x in lines if x.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "error"
    last = orjson.loads(lines[-1][6:])
    assert last["type"] == "error" and last["error"]["type"] == "timeout_error" and "time limit" in last["error"]["message"]


def test_tool_results_as_text_or_error(raw, client):
    """A tool_result's content (a string or text blocks) is the tool message of the chat's prompt; is_error marks
    it 'Error: ': count_tokens equals the chat's template, given the same conversation, tokenized."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Atlantis"}}
    call = {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Atlantis"}'}}
    for content, is_error, text in (("no such city", True, "Error: no such city"),
                                    ([{"type": "text", "text": "no such"}, {"type": "text", "text": "city"}], False,
                                     "no such\n\ncity")):
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": content, "is_error": is_error}
        counted = client.messages.count_tokens(model="m", messages=[*ASK, {"role": "assistant", "content": [use]},
                                                                     {"role": "user", "content": [result]}])
        chat = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": text}]
        prompt = raw.post("/apply-template", json={"messages": chat}).json()["prompt"]
        assert text in prompt
        ids = raw.post("/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
        assert counted.input_tokens == len(ids), (content, is_error)


def test_an_assistant_message_last_is_continued(raw, client):
    """Anthropic's prefill: the reply continues a last assistant message, as the chat's does (llama-server's
    prefill), streamed or not."""
    msgs = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "The fruit is"}]
    chat = raw.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, "temperature": 0}).json()
    kw = dict(model="m", max_tokens=8, messages=msgs, extra_body=GREEDY)
    m = client.messages.create(**kw)
    assert m.content[0].text == chat["choices"][0]["message"]["content"]
    assert m.usage.input_tokens == chat["usage"]["prompt_tokens"] == client.messages.count_tokens(
        model="m", messages=msgs).input_tokens
    with client.messages.stream(**kw) as s:
        assert s.get_final_message().content[0].text == m.content[0].text
