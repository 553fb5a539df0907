"""Property: random JSON bodies at /completion, /v1/chat/completions, /apply-template and the agents' APIs
(/v1/messages, /v1/messages/count_tokens, /v1/responses) never get a 5xx, never hang, and leave the server
healthy (issue 4's acceptance, issue 27's)."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_path, tmp_path_factory):
    from .conftest import ServerProc
    # small slots: whatever n_predict a body asks for, a request ends within 64 steps
    with ServerProc(tiny_model_path, tmp_path_factory.mktemp("fuzz") / "server.log",
                    "-c", "512", "-np", "8", "-n", "8", "--log-disable") as p:
        yield p


@pytest.fixture(scope="module")
def client(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, timeout=20) as c:
        yield c


scalars = (st.none() | st.booleans() | st.integers(-2 ** 66, 2 ** 66) | st.integers(-3, 300)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids,
                                                                                          max_size=4), max_leaves=8)
LLAMA_KEYS = ["prompt", "n_predict", "max_tokens", "temperature", "top_k", "top_p", "min_p", "repeat_penalty",
              "repeat_last_n", "presence_penalty", "frequency_penalty", "seed", "stop", "stream", "cache_prompt",
              "n_probs", "post_sampling_probs", "id_slot", "return_tokens", "logit_bias", "queue_timeout",
              "request_timeout", "token_timeout"]
CHAT_KEYS = ["messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
             "stream_options", "stop", "seed", "logprobs", "top_logprobs", "logit_bias", "presence_penalty",
             "frequency_penalty", "tools", "response_format", "top_k", "min_p"]
prompts = st.text(max_size=40) | st.lists(st.integers(-5, 600), max_size=12)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot"]),
                                           "content": st.text(max_size=20) | values}), max_size=3)


def bodies(keys, required, required_values):
    known = st.dictionaries(st.sampled_from(keys), values, max_size=6)
    shaped = st.builds(lambda base, req: {**base, required: req}, known, required_values)
    return shaped | known | values


def _send(client, path, body) -> httpx.Response:
    data = json.dumps(body).encode() if not isinstance(body, bytes) else body
    with client.stream("POST", path, content=data) as r:
        r.read()            # streams too: read to the end, which must come
    return r


FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@FUZZ
@given(body=bodies(LLAMA_KEYS, "prompt", prompts) | st.binary(max_size=40))
def test_completion_never_5xx(client, body):
    r = _send(client, "/completion", body)
    assert r.status_code < 500, (body, r.status_code, r.text[:500])


@FUZZ
@given(body=bodies(CHAT_KEYS, "messages", messages) | st.binary(max_size=40))
def test_chat_never_5xx(client, body):
    r = _send(client, "/v1/chat/completions", body)
    assert r.status_code < 500, (body, r.status_code, r.text[:500])


@FUZZ
@given(body=bodies(CHAT_KEYS, "messages", messages) | st.binary(max_size=40))
def test_apply_template_never_5xx(client, body):
    r = _send(client, "/apply-template", body)
    assert r.status_code < 500, (body, r.status_code, r.text[:500])


BLOCK_TYPES = ["text", "tool_use", "tool_result", "image", "thinking", "document", "nope"]
blocks = st.fixed_dictionaries({"type": st.sampled_from(BLOCK_TYPES)},
                               optional={"text": values, "id": st.sampled_from(["t1", "t2"]) | values,
                                         "tool_use_id": st.sampled_from(["t1", "t2"]) | values, "name": values,
                                         "input": values, "content": values, "is_error": values})
anthropic_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                                     "content": st.text(max_size=12) | st.lists(blocks, max_size=3)
                                                     | values}), max_size=3)
MESSAGES_KEYS = ["messages", "max_tokens", "system", "tools", "tool_choice", "stop_sequences", "temperature", "top_p",
                 "top_k", "stream", "thinking", "metadata"]


@FUZZ
@given(body=bodies(MESSAGES_KEYS, "messages", anthropic_messages) | st.binary(max_size=40),
       path=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]))
def test_messages_never_5xx(client, body, path):
    if isinstance(body, dict) and path == "/v1/messages" and "max_tokens" in body and isinstance(body["max_tokens"], int):
        body["max_tokens"] = max(1, min(body["max_tokens"], 8))
    r = _send(client, path, body)
    assert r.status_code < 500, (body, r.status_code, r.text[:500])


ITEM_TYPES = ["message", "function_call", "function_call_output", "reasoning", "web_search_call"]
items = st.fixed_dictionaries({"type": st.sampled_from(ITEM_TYPES)},
                              optional={"role": st.sampled_from(["user", "assistant", "developer", "x"]),
                                        "content": st.text(max_size=12) | values, "call_id": st.sampled_from(["c1"])
                                        | values, "name": values, "arguments": st.text(max_size=8) | values,
                                        "output": values})
RESPONSES_KEYS = ["input", "instructions", "tools", "tool_choice", "previous_response_id", "store", "stream",
                  "max_output_tokens", "temperature", "top_p", "text", "reasoning", "parallel_tool_calls"]


@FUZZ
@given(body=bodies(RESPONSES_KEYS, "input", st.text(max_size=12) | st.lists(items, max_size=3))
       | st.binary(max_size=40))
def test_responses_never_5xx(client, body):
    r = _send(client, "/v1/responses", body)
    assert r.status_code < 500, (body, r.status_code, r.text[:500])


def test_healthy_after_fuzz(client, fuzz_server):
    assert client.get("/health").json() == {"status": "ok"}
    r = client.post("/completion", json={"prompt": "still fine", "n_predict": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 4
    assert "internal error" not in fuzz_server.log()
