"""OpenAI's Responses API (/v1/responses) driven by the `openai` SDK's client.responses, on the default model with
a ChatML template that renders tools: a function tool round trip, previous_response_id continuing a
conversation (the same tokens as the chat route given the whole conversation), the streamed events in OpenAI's
documented order, stored responses, and bad input answered 4xx in OpenAI's error shape."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from .conftest import ServerProc

pytestmark = pytest.mark.model

TEMPLATE = Path(__file__).parent / "templates" / "chatml_tools.jinja"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"]}}
ASK = "What is the weather in Paris?"
KW = dict(model="smollm2", temperature=0, max_output_tokens=48)

# OpenAI's documented order of a streamed response's events (one message item; a function_call item has
# function_call_arguments.delta / .done where the message has its content part and text)
TEXT_ITEM = ["response.output_item.added", "response.content_part.added", "response.output_text.delta*",
             "response.output_text.done", "response.content_part.done", "response.output_item.done"]
CALL_ITEM = ["response.output_item.added", "response.function_call_arguments.delta*",
             "response.function_call_arguments.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(default_model_file, tmp_path_factory):
    p = ServerProc(default_model_file, tmp_path_factory.mktemp("responses") / "server.log", "-c", "4096", "-np", "2",
                   "--chat-template-file", str(TEMPLATE))
    yield p
    p.kill()


def _collapsed(events: list) -> list:
    """Event types, a run of deltas as one `...delta*`."""
    out = []
    for e in events:
        name = e.type + "*" if e.type.endswith(".delta") else e.type
        if not (out and out[-1] == name and name.endswith("*")):
            out.append(name)
    return out


def _stream(oai, **kw) -> tuple[list, object]:
    events = list(oai.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events, events[-1].response


def test_function_tool_round_trip_and_stored_responses(oai, http):
    first = oai.responses.create(input=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, **KW)
    assert first.status == "completed" and first.object == "response"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    final = oai.responses.create(previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
                                 input=[{"type": "function_call_output", "call_id": call.call_id,
                                         "output": "18 C and sunny"}], **KW)
    assert final.previous_response_id == first.id and final.output[0].type == "message"
    assert final.output_text.strip() and final.output[0].content[0].type == "output_text"
    alone = oai.responses.create(input=ASK, **KW)
    assert final.usage.input_tokens > alone.usage.input_tokens       # the stored call and its result came first
    assert final.usage.total_tokens == final.usage.input_tokens + final.usage.output_tokens

    # the same conversation given whole, with the call as an input item, is the same prompt
    whole = oai.responses.create(tools=[WEATHER], tool_choice="none", input=[
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}], **KW)
    assert (whole.usage.input_tokens, whole.output_text) == (final.usage.input_tokens, final.output_text)

    assert oai.responses.retrieve(first.id).output[0].call_id == call.call_id
    assert http.delete(f"/v1/responses/{first.id}").json() == {"id": first.id, "object": "response.deleted",
                                                               "deleted": True}
    assert http.get(f"/v1/responses/{first.id}").status_code == 404
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        oai.responses.create(previous_response_id=first.id, input="and now?", **KW)
    unstored = oai.responses.create(input="hi", store=False, **KW)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)


def test_previous_response_id_continues_the_conversation(oai):
    """A follow-up's prompt is the stored conversation plus its input: the chat route, given the whole
    conversation, answers the same; the first response's instructions do not carry over (as OpenAI's)."""
    first = oai.responses.create(input="My name is Ada. Remember it.", instructions="You are terse.", **KW)
    second = oai.responses.create(previous_response_id=first.id, input="What is my name?", **KW)
    chat = oai.chat.completions.create(model="smollm2", temperature=0, max_tokens=48, messages=[
        {"role": "user", "content": "My name is Ada. Remember it."},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What is my name?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.instructions is None


def test_streamed_events_in_openais_order(oai):
    events, done = _stream(oai, input="Say hello.", instructions="Be brief.", **KW)
    end = "response.completed" if done.status == "completed" else "response.incomplete"
    assert _collapsed(events) == ["response.created", "response.in_progress", *TEXT_ITEM, end]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == done.output_text == oai.responses.create(input="Say hello.", instructions="Be brief.", **KW).output_text
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {done.output[0].id}

    events, done = _stream(oai, input=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, **KW)
    assert _collapsed(events) == ["response.created", "response.in_progress", *CALL_ITEM, "response.completed"]
    args = [e for e in events if e.type == "response.function_call_arguments.done"][0]
    assert (args.name, args.arguments) == (done.output[0].name, done.output[0].arguments)
    assert events[2].item.arguments == "" and events[2].item.status == "in_progress"
    # a streamed response is stored too
    assert oai.responses.retrieve(done.id).output[0].call_id == done.output[0].call_id


def test_a_stream_cut_short_ends_with_response_failed(oai):
    events = list(oai.responses.create(input=ASK, stream=True, model="m", max_output_tokens=3000,
                                       extra_body={"request_timeout": 0.3, "ignore_eos": True}))
    assert events[0].type == "response.created" and events[-1].type == "response.failed"
    assert events[-1].response.status == "failed" and "time limit" in events[-1].response.error.message


def _refused(r: httpx.Response, status: int = 400) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == ("invalid_request_error" if status == 400 else "not_found_error") and err["code"] == status
    return err["message"]


def test_bad_input_is_a_4xx_in_openai_shape(http, oai):
    ok = {"model": "m", "input": "hi", "max_output_tokens": 4}
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    bad = [
        ({"previous_response_id": "resp_nope"}, "resp_nope"),
        ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]}, "call_nope"),
        ({"input": [{"role": "user", "content": [image]}]}, "input_image"),
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "web_search_call"),
        ({"input": [{"role": "robot", "content": "x"}]}, "role"),
        ({"input": []}, "input"),
        ({"input": 7}, "input"),
        ({"tools": [{"type": "web_search"}]}, "web_search"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "nope"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"temperature": "hot"}, "temperature"),
        ({"instructions": 5}, "instructions"),
    ]
    for change, named in bad:
        assert named in _refused(http.post("/v1/responses", json={**ok, **change})), change
    for stream in (False, True):        # a prompt its slot cannot hold: llama-server's error, in OpenAI's shape
        r = http.post("/v1/responses", json={**ok, "input": "hello " * 3000, "stream": stream})
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "exceed_context_size_error" and err["n_ctx"] == 2048
        assert err["n_prompt_tokens"] > 2048
    assert "no stored response" in _refused(http.get("/v1/responses/resp_nope"), 404)
    assert "no stored response" in _refused(http.delete("/v1/responses/resp_nope"), 404)
    with pytest.raises(openai.BadRequestError, match="input_image"):
        oai.responses.create(model="m", input=[{"role": "user", "content": [image]}])
