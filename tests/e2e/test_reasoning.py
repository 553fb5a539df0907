"""Reasoning models on the tiny model with a DeepSeek-R1 / Qwen3-style template (templates/think.jinja: the
generation prompt opens <think>): the budget cuts the thinking at N tokens exactly and the answer follows,
reasoning_content apart from the content streamed and not, --reasoning-budget as the default, budget 0 and
chat_template_kwargs reaching the template, --reasoning-format none."""
from __future__ import annotations

import json
from pathlib import Path

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
