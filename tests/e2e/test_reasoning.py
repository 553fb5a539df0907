"""Reasoning models on the tiny model with a DeepSeek-R1 / Qwen3-style template (templates/think.jinja: the
generation prompt opens <think>): the budget cuts the thinking at N tokens exactly and the answer follows,
reasoning_content apart from the content streamed and not, --reasoning-budget as the default, budget 0 and
chat_template_kwargs reaching the template, --reasoning-format none."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from .conftest import ServerProc

TEMPLATE = Path(__file__).parent / "templates" / "think.jinja"
ASK = [{"role": "user", "content": "hi"}]
GREEDY = {"messages": ASK, "temperature": 0, "ignore_eos": True, "logprobs": True}


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    p = ServerProc(tiny_model_path, tmp_path_factory.mktemp("reasoning") / "server.log", "-c", "2048", "-np", "2",
                   "--chat-template-file", str(TEMPLATE), "--reasoning-budget", "7")
    yield p
    p.kill()


def _chat(http, **body) -> tuple[dict, list]:
    r = http.post("/v1/chat/completions", json={**GREEDY, **body})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"], [bytes(t["bytes"]) for t in choice["logprobs"]["content"]]


def _streamed(http, **body) -> tuple[str, str]:
    with http.stream("POST", "/v1/chat/completions", json={**GREEDY, **body, "stream": True}) as r:
        deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in r.iter_lines()
                  if x.startswith("data: {") and '"choices":[]' not in x]
    return ("".join(d.get("reasoning_content") or "" for d in deltas),
            "".join(d.get("content") or "" for d in deltas))


@pytest.mark.parametrize("budget", [3, 12])
def test_the_budget_cuts_the_thinking_at_n_tokens_and_the_answer_follows(http, budget):
    free, free_tokens = _chat(http, max_tokens=budget, thinking_budget_tokens=-1)
    assert free["content"] == "" and len(free_tokens) == budget      # the random model thinks on: all reasoning
    msg, tokens = _chat(http, max_tokens=budget + 24, thinking_budget_tokens=budget)
    assert tokens[:budget] == free_tokens                                   # the same thought, to the token
    assert msg["reasoning_content"] == b"".join(free_tokens).decode("utf-8", "replace")
    after = b"".join(tokens[budget:])
    assert after.startswith(b"</think>")                                   # forced right after the N-th token
    assert msg["content"] and msg["content"] == after[len(b"</think>"):].decode("utf-8", "replace").lstrip()
    assert _streamed(http, max_tokens=budget + 24, thinking_budget_tokens=budget) == \
        (msg["reasoning_content"], msg["content"])


def test_the_servers_budget_effort_and_format(http):
    msg, tokens = _chat(http, max_tokens=30)                                # --reasoning-budget 7
    assert b"".join(tokens[7:]).startswith(b"</think>") and b"</think>" not in b"".join(tokens[:7])
    low, _ = _chat(http, max_tokens=30, reasoning_effort="low")             # 1024: not reached here
    assert low["content"] == "" and low["reasoning_content"]
    raw, _ = _chat(http, max_tokens=30, reasoning_format="none")            # the text as it came
    assert "reasoning_content" not in raw and "</think>" in raw["content"]
    assert raw["content"].startswith(msg["reasoning_content"])


def test_a_constrained_reply_is_not_split(http):
    """JSON from the first token (response_format) has no thinking: the prompt opened one, the reply is content."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}}
    msg, _ = _chat(http, max_tokens=64, response_format=fmt, ignore_eos=False)
    assert "reasoning_content" not in msg and json.loads(msg["content"]).keys() == {"n"}


def test_budget_zero_and_template_kwargs_reach_the_template(http):
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    for body in ({"thinking_budget_tokens": 0}, {"reasoning_effort": "none"},
                 {"chat_template_kwargs": {"enable_thinking": False}}):
        assert http.post("/apply-template", json={"messages": ASK, **body}).json()["prompt"].endswith(closed), body
    assert http.post("/apply-template", json={"messages": ASK}).json()["prompt"].endswith("assistant\n<think>\n")
    off, _ = _chat(http, max_tokens=6, thinking_budget_tokens=0)          # the prompt closed it: all content
    assert "reasoning_content" not in off and off["content"]


@pytest.mark.parametrize("body, needle", [
    ({"thinking_budget_tokens": -2}, "thinking_budget_tokens"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"reasoning_format": "deepseek-legacy"}, "reasoning_format"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
])
def test_bad_reasoning_fields_are_400(http, body, needle):
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **body})
    assert r.status_code == 400 and needle in r.json()["error"]["message"]


def test_anthropic_thinking_blocks(server, http):
    """Messages' thinking (enabled: its budget_tokens) gives a thinking block, then the text, streamed and not;
    disabled turns the thinking off in the template."""
    import anthropic
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    chat, _ = _chat(http, max_tokens=30, thinking_budget_tokens=5)
    kw = dict(model="m", max_tokens=30, messages=ASK, thinking={"type": "enabled", "budget_tokens": 5},
              extra_body={"temperature": 0, "ignore_eos": True})
    m = client.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert (m.content[0].thinking, m.content[1].text) == (chat["reasoning_content"], chat["content"])
    with client.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in final.content] == \
        [("thinking", chat["reasoning_content"]), ("text", chat["content"])]
    starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    assert {e.delta.type for e in events if e.type == "content_block_delta" and e.index == 0} == {"thinking_delta"}
    cut = {**kw, "max_tokens": 3, "thinking": {"type": "enabled", "budget_tokens": 100}}    # ends in the thought
    want = [(b.type, getattr(b, "thinking", None) or b.text) for b in client.messages.create(**cut).content]
    with client.messages.stream(**cut) as s:
        assert [(b.type, getattr(b, "thinking", None) or b.text) for b in s.get_final_message().content] == want
    assert [t for t, _ in want] == ["thinking", "text"] and want[1][1] == ""
    off = client.messages.create(**{**kw, "thinking": {"type": "disabled"}})
    assert [b.type for b in off.content] == ["text"] and off.content[0].text


def test_responses_reasoning_items(oai, http):
    """Responses: a reasoning item (reasoning_text), then the message, streamed in OpenAI's order; a follow-up's
    conversation holds the answer, not the thinking."""
    chat, tokens = _chat(http, max_tokens=30, thinking_budget_tokens=5)
    closed = next(n for n in range(1, len(tokens) + 1) if b"</think>" in b"".join(tokens[:n]))
    kw = dict(model="m", input="hi", max_output_tokens=30, temperature=0,
              extra_body={"thinking_budget_tokens": 5, "ignore_eos": True})
    r = oai.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert (r.output[0].content[0].text, r.output_text) == (chat["reasoning_content"], chat["content"])
    assert r.usage.output_tokens_details.reasoning_tokens == closed          # the thought and its closing marker
    events = list(oai.responses.create(stream=True, **kw))
    kinds = []
    for e in events:
        if not (kinds and kinds[-1] == e.type and e.type.endswith(".delta")):
            kinds.append(e.type)
    item = ["response.output_item.added", "response.content_part.added", "{}.delta", "{}.done",
            "response.content_part.done", "response.output_item.done"]
    assert kinds == ["response.created", "response.in_progress",
                     *[k.format("response.reasoning_text") for k in item],
                     *[k.format("response.output_text") for k in item], "response.incomplete"]
    done = events[-1].response
    assert [o.type for o in done.output] == ["reasoning", "message"] and done.output_text == r.output_text
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == chat["reasoning_content"]
    follow = oai.responses.create(previous_response_id=r.id, input="and?", model="m", max_output_tokens=1)
    said = http.post("/apply-template", json={"messages": [*ASK, {"role": "assistant", "content": chat["content"]},
                                                           {"role": "user", "content": "and?"}]}).json()["prompt"]
    assert follow.usage.input_tokens == len(http.post("/tokenize", json={"content": said, "add_special": True})
                                            .json()["tokens"])


def test_the_servers_reasoning_format_none(make_server):
    """--reasoning-format none: the reply's text as it came, markers and all, in content; a request's
    reasoning_format deepseek splits it again. A budget still cuts the thinking."""
    srv = make_server("-c", "512", "-np", "1", "--chat-template-file", str(TEMPLATE), "--reasoning-format", "none",
                      "--reasoning-budget", "4")
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        raw, tokens = _chat(c, max_tokens=20)
        assert "reasoning_content" not in raw and b"".join(tokens[4:]).startswith(b"</think>")
        assert "</think>" in raw["content"]
        split, _ = _chat(c, max_tokens=20, reasoning_format="deepseek")
        assert split["reasoning_content"] == b"".join(tokens[:4]).decode("utf-8", "replace")
        assert raw["content"].startswith(split["reasoning_content"]) and raw["content"].endswith(split["content"])
        assert _streamed(c, max_tokens=20) == ("", raw["content"])
