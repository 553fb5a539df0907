"""Drop-in for llama-server (issue 14): what its scripts and OpenAI's clients do, against `fastserve serve`.

Most cases share the session's server (tests/e2e/conftest.py: 8 slots of 256 tokens, -n 16, --metrics);
the flags get two servers of their own, and the refused flags a process each that exits at once.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import REPO_ROOT, wait_until

GREEDY = {"temperature": 0, "n_predict": 8}


def events(resp) -> list:
    return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def stream_post(http, path: str, body: dict) -> list:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return events(r)


def tokens(http, text: str, add_special: bool = False) -> list:
    return http.post("/tokenize", json={"content": text, "add_special": add_special}).json()["tokens"]


def error(r, status: int, type_: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == type_, err
    return err


# -- /completion -------------------------------------------------------------------------------------

def test_prompt_forms(http):
    """Mixed ids and text is one prompt (text gets BOS only when first); a list of prompts answers a list,
    each the same as that prompt alone; streamed, each event says which prompt it belongs to."""
    a, b = tokens(http, "my fox"), tokens(http, " ran")
    text_alone = http.post("/completion", json={"prompt": "my fox ran", **GREEDY, "return_tokens": True}).json()
    mixed = http.post("/completion", json={"prompt": [*a, " ran"], **GREEDY, "return_tokens": True}).json()
    ids = http.post("/completion", json={"prompt": a + b, **GREEDY, "return_tokens": True}).json()
    assert mixed["tokens_evaluated"] == len(a) + len(b) and mixed["tokens"] == ids["tokens"]
    assert text_alone["tokens_evaluated"] == len(tokens(http, "my fox ran", add_special=True))

    prompts = ["my fox ran", [*a, " ran"], a + b, "far away"]
    many = http.post("/completion", json={"prompt": prompts, **GREEDY, "return_tokens": True}).json()
    assert isinstance(many, list) and [r["index"] for r in many] == [0, 1, 2, 3]
    assert many[0]["content"] == text_alone["content"] and many[1]["tokens"] == mixed["tokens"]
    assert many[2]["tokens"] == ids["tokens"]
    alone = http.post("/completion", json={"prompt": "far away", **GREEDY}).json()
    assert many[3]["content"] == alone["content"] and many[3]["prompt"] == "far away"

    # llama-server's object form, ids or text inside, alone or in a list; its multimodal_data is a 400 (no vision)
    obj = http.post("/completion", json={"prompt": {"prompt_string": a + b}, **GREEDY, "return_tokens": True}).json()
    assert obj["tokens"] == ids["tokens"] and obj["tokens_evaluated"] == len(a) + len(b)
    two = http.post("/completion", json={"prompt": [{"prompt_string": "far away"}, a + b], **GREEDY}).json()
    assert [r["content"] for r in two] == [alone["content"], ids["content"]] and two[0]["prompt"] == "far away"
    error(http.post("/completion", json={"prompt": {"prompt_string": "x", "multimodal_data": ["aGk="]}}), 400)
    error(http.post("/completion", json={"prompt": {"text": "x"}}), 400)

    ev = stream_post(http, "/completion", {"prompt": ["my fox ran", "far away"], **GREEDY})
    for i, want in enumerate((text_alone, alone)):
        mine = [e for e in ev if e["index"] == i]
        assert mine[-1]["stop"] is True and all(e["stop"] is False for e in mine[:-1])
        assert "".join(e["content"] for e in mine) == want["content"]
    assert {e["index"] for e in ev} == {0, 1}



def test_openai_completions_prompt_list_and_n(oai):
    """As llama-server: a list of prompts, n choices of each (index = prompt * n + choice), streamed or not."""
    alone = [oai.completions.create(model="x", prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in ("my fox ran", "far away")]
    r = oai.completions.create(model="x", prompt=["my fox ran", "far away"], n=2, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [alone[0], alone[0], alone[1], alone[1]]     # greedy: n equal choices
    one = oai.completions.create(model="x", prompt="my fox ran", max_tokens=6, temperature=0)
    two = oai.completions.create(model="x", prompt="far away", max_tokens=6, temperature=0)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens + two.usage.prompt_tokens
    chunks = list(oai.completions.create(model="x", prompt=["my fox ran", "far away"], n=2, max_tokens=6,
                                         temperature=0, stream=True))
    for i in range(4):
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == i) == r.choices[i].text
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model="x", prompt=["a"] * 9, n=2, max_tokens=1)        # 18 choices > 16


def test_logit_bias_forms(http):
    """[[id, b]], [["text", b]], {"id": b}, {"text": b} (a text stands for its tokens), and false to ban."""
    (tq,) = tokens(http, "q")

    def gen(bias) -> list:
        r = http.post("/completion", json={"prompt": "abc", **GREEDY, "return_tokens": True, "logit_bias": bias})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    for bias in ([[tq, 1000]], [["q", 1000]], {str(tq): 1000}, {"q": 1000}):
        assert gen(bias) == [tq] * 8, bias
    first = gen(None)[0]
    for bias in ([[first, False]], {str(first): False}, [[tq, 1000], ["q", False]], {str(tq): 1000, "q": False}):
        assert first not in gen(bias) if "q" not in json.dumps(bias) else tq not in gen(bias), bias
    for bad in ({"7": "x"}, [[7]], [["", 1]], {"99999": 1}, 5, {"x" * 300: 1}, [[7, 1]] * 1025):
        error(http.post("/completion", json={"prompt": "abc", "logit_bias": bad}), 400)


def test_post_sampling_probs_give_each_sampled_token_its_probability(http):
    """As llama-server: a sampled token's prob is its probability in the kept set, never 0, even when it is
    not among the n_probs shown; generation_settings show n_probs as asked."""
    body = {"prompt": "my fox", "n_probs": 1, "post_sampling_probs": True, "temperature": 1.5, "n_predict": 16,
            "seed": 5}
    r = http.post("/completion", json=body).json()
    probs = r["completion_probabilities"]
    assert len(probs) == 16 and all(0 < p["prob"] <= 1 and len(p["top_probs"]) == 1 for p in probs), probs
    assert any(p["id"] != p["top_probs"][0]["id"] for p in probs)          # sampled outside the one shown
    assert r["generation_settings"]["n_probs"] == 1
    streamed = [p for e in stream_post(http, "/completion", body) for p in e.get("completion_probabilities", [])]
    assert [(p["id"], p["prob"]) for p in streamed] == [(p["id"], p["prob"]) for p in probs]


def test_each_sampled_token_has_its_logprob_on_every_api(http, oai):
    """As llama-server: a sampled token's own logprob (before sampling) is never missing (-9999), also when it
    is not among the n_probs / top_logprobs shown, and it is the same however many are shown."""
    body = {"prompt": "my fox", "n_probs": 1, "temperature": 1.5, "n_predict": 16, "seed": 5}
    probs = http.post("/completion", json=body).json()["completion_probabilities"]
    assert any(p["id"] != p["top_logprobs"][0]["id"] for p in probs)          # sampled outside the one shown
    assert all(-30 < p["logprob"] <= 0 for p in probs), probs
    many = http.post("/completion", json={**body, "n_probs": 40}).json()["completion_probabilities"]
    assert [(p["id"], p["logprob"]) for p in many] == [(p["id"], p["logprob"]) for p in probs]
    assert all(p["logprob"] == next(t["logprob"] for t in p["top_logprobs"] if t["id"] == p["id"]) for p in many)

    legacy = oai.completions.create(model="x", prompt="my fox", max_tokens=16, temperature=1.5, seed=5, logprobs=0)
    assert all(-30 < lp <= 0 for lp in legacy.choices[0].logprobs.token_logprobs)
    chat = oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "my fox"}], max_tokens=16,
                                       temperature=1.5, seed=5, logprobs=True, top_logprobs=1)
    content = chat.choices[0].logprobs.content
    assert any(c.token != c.top_logprobs[0].token for c in content)
    assert all(-30 < c.logprob <= 0 for c in content)


def test_a_token_sampled_outside_every_list_has_its_true_probability(http):
    """top_k off and a hot temperature sample far outside the 64 probabilities the engine used to look the
    sampled token up in (it read 0 / -9999 then): its logprob is finite, below the 100th listed, and where it is
    listed, the listed one; post-sampling its prob is never 0."""
    body = {"prompt": "my fox", "n_probs": 100, "temperature": 8.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "n_predict": 16, "seed": 7}
    probs = http.post("/completion", json=body).json()["completion_probabilities"]
    outside = [p for p in probs if p["id"] not in [t["id"] for t in p["top_logprobs"]]]
    assert len(outside) > 8, probs
    assert all(-60 < p["logprob"] <= p["top_logprobs"][-1]["logprob"] for p in outside), outside
    assert all(p["logprob"] == next(t["logprob"] for t in p["top_logprobs"] if t["id"] == p["id"])
               for p in probs if p not in outside)
    post = http.post("/completion", json={**body, "n_probs": 1, "post_sampling_probs": True}).json()
    assert [p["id"] for p in post["completion_probabilities"]] == [p["id"] for p in probs]
    assert all(0 < p["prob"] < 1 for p in post["completion_probabilities"])


def test_a_list_with_fewer_candidates_than_asked_shows_each_once(http):
    """A grammar allows fewer tokens than n_probs: the list is the allowed ones, each once (its padding and the
    sampled token's own entry after it are not shown), and the sampled token's logprob is its listed one."""
    body = {"prompt": "my fox", "n_probs": 100, "temperature": 1.0, "n_predict": 6, "seed": 3,
            "grammar": 'root ::= [ab]+'}
    probs = http.post("/completion", json=body).json()["completion_probabilities"]
    for p in probs:
        listed = {t["id"]: t["logprob"] for t in p["top_logprobs"]}
        assert 0 < len(listed) == len(p["top_logprobs"]) < 100 and p["logprob"] == listed[p["id"]], p


def test_stream_equals_non_stream_for_a_seed(http):
    body = {"prompt": "zebra song", "n_predict": 24, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "seed": 1234, "return_tokens": True, "n_probs": 2}
    whole = http.post("/completion", json=body).json()
    ev = stream_post(http, "/completion", body)
    assert "".join(e["content"] for e in ev) == whole["content"]
    assert [t for e in ev for t in e["tokens"]] == whole["tokens"]
    assert [p for e in ev for p in e.get("completion_probabilities", [])] == whole["completion_probabilities"]
    assert ev[-1]["tokens_predicted"] == whole["tokens_predicted"] and ev[-1]["stop_type"] == whole["stop_type"]


def test_timings_per_token_and_response_fields(http):
    ev = stream_post(http, "/completion", {"prompt": "abc", **GREEDY, "timings_per_token": True})
    assert all("timings" in e and e["timings"]["prompt_n"] > 0 for e in ev)
    assert ev[-1]["generation_settings"]["timings_per_token"] is True
    plain = stream_post(http, "/completion", {"prompt": "abc", **GREEDY})
    assert all("timings" not in e for e in plain[:-1]) and "timings" in plain[-1]

    r = http.post("/completion", json={"prompt": "abc", **GREEDY, "response_fields": [
        "content", "generation_settings/n_predict", "timings/predicted_n", "no/such"]}).json()
    assert set(r) == {"content", "generation_settings/n_predict", "timings/predicted_n"}
    assert r["generation_settings/n_predict"] == 8 and r["timings/predicted_n"] == 8
    error(http.post("/completion", json={"prompt": "a", "response_fields": "content"}), 400)


def test_constraints_are_applied_and_unsupported_fields_refused(http, oai):
    """grammar / json_schema on the three routes (issue 15: server/tools.py, fastserve/grammar.py)."""
    for field, value in (("grammar", 'root ::= "yes"'), ("json_schema", {"enum": ["yes"]})):
        want = "yes" if field == "grammar" else '"yes"'
        r = http.post("/completion", json={"prompt": "a", field: value, "n_predict": 8})
        assert r.status_code == 200 and r.json()["content"] == want
        r = http.post("/v1/completions", json={"prompt": "a", field: value, "max_tokens": 8})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}],
                                                    field: value, "max_tokens": 8})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want
    assert http.post("/completion", json={"prompt": "a", "grammar": "", "n_predict": 1}).status_code == 200
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}],
                                    response_format={"type": "xml"})
    for field, value in (("mirostat", 2), ("dry_multiplier", 0.5), ("n_cmpl", 2),
                         ("typical_p", 0.5), ("samplers", ["top_k", "temperature"]), ("lora", [{"id": 0}])):
        msg = error(http.post("/completion", json={"prompt": "a", field: value}), 400)["message"]
        assert field in msg and "not supported" in msg or "chain" in msg, msg
    neutral = {"mirostat": 0, "dry_multiplier": 0.0, "n_cmpl": 1, "ignore_eos": False, "typical_p": 1.0,
               "samplers": ["penalties", "dry", "top_k", "top_p", "min_p", "temperature"], "lora": [], "n_keep": 4}
    assert http.post("/completion", json={"prompt": "a", "n_predict": 1, **neutral}).status_code == 200


def test_ignore_eos(http):
    """ignore_eos: the end-of-generation tokens are never sampled (llama-server bans them), so a reply whose
    likeliest token is the end runs to n_predict; without it, that reply ends at once."""
    eog = [[0, 100.0], [2, 100.0]]          # the tiny model's end-of-generation tokens, made the likeliest
    ends = http.post("/completion", json={"prompt": "a", **GREEDY, "logit_bias": eog, "return_tokens": True}).json()
    assert ends["stop_type"] == "eos" and ends["tokens_predicted"] <= 1, ends
    runs = http.post("/completion", json={"prompt": "a", **GREEDY, "logit_bias": eog, "ignore_eos": True,
                                          "return_tokens": True}).json()
    assert runs["tokens_predicted"] == GREEDY["n_predict"] and not {0, 2} & set(runs["tokens"]), runs
    assert runs["stop_type"] == "limit" and runs["generation_settings"]["ignore_eos"] is True
    error(http.post("/completion", json={"prompt": "a", "ignore_eos": "yes"}), 400)


def test_ignore_eos_flag(make_server):
    """--ignore-eos: every request that does not say ignore_eos gets it (/props shows it), on every route;
    a request's own ignore_eos: false wins, and a request's logit_bias adds to the ban rather than dropping it."""
    eog = {"0": 100.0, "2": 100.0}          # the tiny model's end-of-generation tokens, made the likeliest
    srv = make_server("-c", "512", "-np", "2", "--ignore-eos")
    with httpx.Client(base_url=srv.url, timeout=20) as c:
        assert c.get("/props").json()["default_generation_settings"]["params"]["ignore_eos"] is True
        for extra in ({}, {"ignore_eos": None}):
            runs = c.post("/completion", json={"prompt": "a", **GREEDY, "logit_bias": eog, "return_tokens": True,
                                               **extra}).json()
            assert runs["stop_type"] == "limit" and runs["tokens_predicted"] == GREEDY["n_predict"], runs
            assert not {0, 2} & set(runs["tokens"]) and runs["generation_settings"]["ignore_eos"] is True
        ends = c.post("/completion", json={"prompt": "a", **GREEDY, "logit_bias": eog, "ignore_eos": False}).json()
        assert ends["stop_type"] == "eos" and ends["tokens_predicted"] <= 1, ends
        assert ends["generation_settings"]["ignore_eos"] is False
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}], "max_tokens": 8,
                                                    "temperature": 0, "logit_bias": eog}).json()
        assert chat["choices"][0]["finish_reason"] == "length" and chat["usage"]["completion_tokens"] == 8, chat
        legacy = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 8, "temperature": 0,
                                                 "logit_bias": eog, "ignore_eos": False}).json()
        assert legacy["choices"][0]["finish_reason"] == "stop", legacy
        error(c.post("/completion", json={"prompt": "a", "ignore_eos": "yes"}), 400)


def test_chat_without_a_template_falls_back_to_chatml(tmp_path):
    """A model whose file has no chat template chats in ChatML, as llama-server does (common/chat.cpp), and
    says so at start; /props shows the template in use."""
    from fastserve.models.chat_template import CHATML
    from fastserve.models.synthetic import write_llama_gguf

    from .conftest import ServerProc

    path = write_llama_gguf(tmp_path / "no_template.gguf", chat_template=None)
    srv = ServerProc(path, tmp_path / "server.log", "-c", "512", "-np", "1")
    try:
        assert "no chat template: chat uses ChatML" in srv.log()
        with httpx.Client(base_url=srv.url, timeout=20) as c:
            assert c.get("/props").json()["chat_template"] == CHATML
            messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
            r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            chatml = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
            assert r.json()["usage"]["prompt_tokens"] == len(tokens(c, chatml, add_special=True))
            error(c.post("/v1/chat/completions", json={"messages": [{"role": "user"}]}), 400)
    finally:
        srv.kill()


def test_exceed_context_size_error(http):
    """The slot holds 256 tokens: llama-server's error type, with n_prompt_tokens and n_ctx, streamed or not."""
    long_ids = [5] * 300
    long_chat = [{"role": "user", "content": "word " * 200}]
    longer_chat = [{"role": "user", "content": "word " * 1000}]         # more than 16 characters a slot token
    for path, body in (("/completion", {"prompt": long_ids}), ("/completion", {"prompt": [[1, 2], long_ids]}),
                       ("/v1/completions", {"prompt": long_ids}), ("/v1/chat/completions", {"messages": long_chat}),
                       ("/v1/chat/completions", {"messages": longer_chat}), ("/completion", {"prompt": "word " * 1000})):
        for stream in (False, True):
            err = error(http.post(path, json={**body, "stream": stream}), 400, "exceed_context_size_error")
            assert err["n_ctx"] == 256 and err["n_prompt_tokens"] > 256, err
            assert "context size" in err["message"]


# -- OpenAI chat ---------------------------------------------------------------------------------------

def test_chat_n_choices_and_first_delta(oai, http):
    msgs = [{"role": "user", "content": "hello"}]
    r = oai.chat.completions.create(model="x", messages=msgs, n=3, max_tokens=6, temperature=1.0, seed=9)
    assert [c.index for c in r.choices] == [0, 1, 2]
    one = oai.chat.completions.create(model="x", messages=msgs, max_tokens=6, temperature=1.0, seed=9)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens and 3 <= r.usage.completion_tokens <= 18
    assert r.choices[0].message.content == one.choices[0].message.content      # choice 0 has the seed itself
    again = oai.chat.completions.create(model="x", messages=msgs, n=3, max_tokens=6, temperature=1.0, seed=9)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    assert len({c.message.content for c in r.choices}) > 1            # seed + i: the choices differ

    chunks = list(oai.chat.completions.create(model="x", messages=msgs, n=3, max_tokens=6, temperature=1.0,
                                              seed=9, stream=True))
    for i in range(3):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[0].delta.content is None
        assert "".join(c.delta.content or "" for c in mine) == r.choices[i].message.content
        assert mine[-1].finish_reason in ("stop", "length")
    raw = stream_post(http, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2})
    assert raw[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}


@pytest.mark.parametrize("messages, needle", [
    ([{"content": "no role"}], "role"),
    ([{"role": "user", "content": {"text": "x"}}], "content"),
    ([{"role": "user", "content": 5}], "content"),
    ([{"role": "robot", "content": "x"}], "role"),
    ([{"role": "user"}], "content"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "42"}], "tool_call_id"),
    ([{"role": "user", "content": [{"type": "text"}]}], "content"),
    ([{"role": "user", "content": "q"}, {"role": "assistant"}], "tool_calls"),      # llama-server's 400s too
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}],
     "2 or more assistant messages"),
])
def test_malformed_messages_are_400(http, messages, needle):
    err = error(http.post("/v1/chat/completions", json={"messages": messages}), 400)
    assert needle in err["message"], err


def test_chat_prefill_and_timings_in_the_last_chunk(http):
    """An assistant message last is continued (the prompt ends with its text); streamed with timings_per_token
    every chunk carries timings, the last one (the usage chunk) too, as llama-server's."""
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Sure, the"}]
    chat = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0}).json()
    prompt = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nSure, the"      # the tiny model's ChatML
    plain = http.post("/completion", json={"prompt": prompt, "n_predict": 6, "temperature": 0}).json()
    assert chat["choices"][0]["message"]["content"] == plain["content"]
    assert chat["usage"]["prompt_tokens"] == plain["tokens_evaluated"]

    chunks = stream_post(http, "/v1/chat/completions", {"messages": msgs[:1], "max_tokens": 4, "temperature": 0,
                                                        "timings_per_token": True,
                                                        "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-1]["timings"]["predicted_n"] == 4
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert content and all("timings" in c for c in content)
    no_usage = stream_post(http, "/v1/chat/completions", {"messages": msgs[:1], "max_tokens": 4, "temperature": 0,
                                                          "timings_per_token": True})
    assert no_usage[-1]["choices"][0]["finish_reason"] and no_usage[-1]["timings"]["predicted_n"] == 4
    plain = stream_post(http, "/v1/chat/completions", {"messages": msgs[:1], "max_tokens": 4, "temperature": 0})
    assert not any("timings" in c for c in plain if c["choices"] and c["choices"][0]["delta"].get("content"))
    assert plain[-1]["timings"]["predicted_n"] == 4                     # the last chunk always has them


def test_apply_template(http):
    """The chat's prompt as its template renders it, prefill included; the same checks as the chat."""
    msgs = [{"role": "user", "content": "hello"}]
    r = http.post("/apply-template", json={"messages": msgs})
    assert r.json() == {"prompt": "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"}
    more = http.post("/apply-template", json={"messages": [*msgs, {"role": "assistant", "content": "Hi"}]}).json()
    assert more["prompt"] == r.json()["prompt"] + "Hi"
    chat = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(tokens(http, r.json()["prompt"], add_special=True))
    error(http.post("/apply-template", json={"messages": [{"role": "robot", "content": "x"}]}), 400)
    error(http.post("/apply-template", json={}), 400)


# -- /metrics, /props, /slots --------------------------------------------------------------------------

LLAMA_METRICS = {   # llama-server's names and help texts
    "llamacpp:prompt_tokens_total": "Number of prompt tokens processed, excluding cached tokens",
    "llamacpp:tokens_predicted_total": "Number of generation tokens processed",
    "llamacpp:prompt_seconds_total": "Total time spent processing prompts",
    "llamacpp:tokens_predicted_seconds_total": "Total time spent generating tokens",
    "llamacpp:prompt_tokens_seconds": "Average prompt throughput in tokens/s",
    "llamacpp:predicted_tokens_seconds": "Average generation throughput in tokens/s",
    "llamacpp:requests_processing": "Number of requests processing",
    "llamacpp:requests_deferred": "Number of requests deferred",
}


def test_metrics_names_header_and_finite_values(http):
    before = time.time()
    http.post("/completion", json={"prompt": "metrics please", **GREEDY})
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    start = int(r.headers["process-start-time-unix"])
    assert before - 3600 < start <= before
    text = r.text
    for name, help_text in LLAMA_METRICS.items():
        assert f"# HELP {name} {help_text}\n" in text, name
    samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert all(math.isfinite(v) for k, v in samples.items() if not k.endswith("_bucket")), samples
    assert samples["llamacpp:tokens_predicted_total"] >= 8 and samples["llamacpp:prompt_tokens_total"] > 0
    assert samples["llamacpp:predicted_tokens_seconds"] > 0 and samples["fastserve_generated_tokens_total"] >= 8
    # the rates are over the window since the last scrape (as llama-server): nothing ran since
    again = {s.name: s.value for fam in text_string_to_metric_families(http.get("/metrics").text) for s in fam.samples}
    assert again["llamacpp:predicted_tokens_seconds"] == 0
    # a request of one token (or none) counts in neither rate, as llama-server's
    for n in (0, 1):
        http.post("/completion", json={"prompt": "metrics please", "temperature": 0, "n_predict": n})
    after = {s.name: s.value for fam in text_string_to_metric_families(http.get("/metrics").text) for s in fam.samples}
    assert after["llamacpp:prompt_tokens_seconds"] == after["llamacpp:predicted_tokens_seconds"] == 0
    assert after["llamacpp:prompt_tokens_total"] > samples["llamacpp:prompt_tokens_total"]     # the totals count them


def test_metrics_header_keeps_llama_servers_case(server):
    """Process-Start-Time-Unix as llama-server writes it: clients that read it by its exact name find it."""
    import socket
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(4096)
    assert b"\r\nProcess-Start-Time-Unix: " in head


def test_props_fields(http, server):
    p = http.get("/props").json()
    params = p["default_generation_settings"]["params"]
    for key in ("seed", "temperature", "top_k", "top_p", "min_p", "repeat_last_n", "repeat_penalty",
                "presence_penalty", "frequency_penalty", "n_predict", "max_tokens", "samplers", "n_probs"):
        assert key in params, key
    assert params["samplers"] == ["penalties", "top_k", "top_p", "min_p", "temperature"]
    assert params["seed"] == -1 and params["n_predict"] == 16 and params["temperature"] == 0.8
    assert p["total_slots"] == 8 and p["model_path"].endswith("tiny.gguf") and p["chat_template"]
    assert p["modalities"] == {"vision": False, "video": False, "audio": False} and p["build_info"]
    assert (p["endpoint_metrics"], p["endpoint_slots"], p["endpoint_props"]) == (True, True, False)
    error(http.post("/props", json={}), 501, "not_supported_error")


# llama-server 34af94cd's /slots params of a running request (its metrics-only set) that fastserve has a value for
SLOT_PARAMS = ("seed", "temperature", "dynatemp_range", "top_k", "top_p", "min_p", "top_n_sigma", "xtc_probability",
               "typical_p", "repeat_last_n", "repeat_penalty", "presence_penalty", "frequency_penalty",
               "dry_multiplier", "mirostat", "max_tokens", "n_predict", "n_keep", "ignore_eos", "stream", "n_probs",
               "min_keep", "samplers", "timings_per_token", "post_sampling_probs")


def _first_event(lines) -> str:
    for line in lines:
        if line.startswith("data: "):
            return line[6:]
    raise AssertionError("the stream ended before its first event")


def _busy(c) -> list:
    return [s for s in c.get("/slots").json() if s["is_processing"]]


def test_slots_show_the_running_requests_params_and_progress(make_server):
    srv = make_server("-c", "8192", "-np", "2")
    body = {"prompt": "hello there", "n_predict": 4000, "temperature": 0.5, "top_k": 7, "seed": 11,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=srv.url, timeout=20) as c:
        idle = c.get("/slots").json()
        assert not any(k in s for s in idle for k in ("params", "next_token", "n_prompt_tokens"))
        with c.stream("POST", "/completion", json=body) as r:
            lines = r.iter_lines()          # kept: a generator closed early closes the response
            first = json.loads(_first_event(lines))
            (slot,) = _busy(c)
            assert slot["id"] == first["id_slot"] and slot["id_task"] > 0
            assert slot["n_prompt_tokens"] == first["tokens_evaluated"] == \
                slot["n_prompt_tokens_processed"] + slot["n_prompt_tokens_cache"]
            p = slot["params"]
            assert set(SLOT_PARAMS) <= set(p), set(SLOT_PARAMS) - set(p)
            assert (p["temperature"], p["top_k"], p["seed"], p["n_predict"], p["max_tokens"], p["stream"],
                    p["ignore_eos"]) == (0.5, 7, 11, 4000, 4000, True, True), p
            assert p["samplers"] == ["penalties", "top_k", "top_p", "min_p", "temperature"]
            (nt,) = slot["next_token"]
            assert set(nt) == {"has_next_token", "has_new_line", "n_remain", "n_decoded"}
            assert nt["has_next_token"] is True and nt["n_decoded"] >= 1 and nt["n_remain"] == 4000 - nt["n_decoded"]
            later = [s for s in c.get("/slots").json() if s["id"] == slot["id"]][0]["next_token"][0]
            assert later["n_decoded"] >= nt["n_decoded"]
        assert wait_until(lambda: not _busy(c))          # the client went away: the slot is free, its fields gone
        assert not any("params" in s for s in c.get("/slots").json())
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000, "stream": True,
                "logit_bias": {"0": False, "2": False}}
        with c.stream("POST", "/v1/chat/completions", json=chat) as r:
            lines = r.iter_lines()
            _first_event(lines)
            assert wait_until(lambda: _busy(c))
            p = _busy(c)[0]["params"]
            # no seed given: the one drawn for it (a request can be replayed with it), never -1
            assert isinstance(p["seed"], int) and p["seed"] >= 0 and p["stream"] is True and p["ignore_eos"] is False
            assert (p["temperature"], p["top_k"], p["max_tokens"]) == (0.8, 40, 4000)


# -- flags ---------------------------------------------------------------------------------------------

def test_flags_server_wide_defaults_and_endpoints(make_server, tmp_path):
    log_file = tmp_path / "requests.log"
    srv = make_server("-c", "512", "-np", "2", "--no-slots", "--api-key", "k", "--temp", "0", "--top-k", "1",
                      "--top-p", "0.5", "--min-p", "0.2", "--seed", "77", "--repeat-penalty", "1.1",
                      "--repeat-last-n", "16", "--presence-penalty", "0.5", "--frequency-penalty", "0.25",
                      "-ub", "16", "--chat-template", "chatml", "--log-file", str(log_file), "-fa", "on",
                      "-ngl", "99", "--keep", "4", "--jinja", "--no-context-shift", "--mmap", "-cb", "-lv", "3",
                      metrics=False)
    key = {"Authorization": "Bearer k"}
    with httpx.Client(base_url=srv.url, timeout=20) as c:
        for path in ("/health", "/models", "/v1/models"):                  # public, as llama-server's
            assert c.get(path).status_code == 200, path
        assert c.get("/props").status_code == 401
        error(c.get("/metrics", headers=key), 501, "not_supported_error")
        assert "--metrics" in c.get("/metrics", headers=key).json()["error"]["message"]
        error(c.get("/slots", headers=key), 501, "not_supported_error")
        params = c.get("/props", headers=key).json()["default_generation_settings"]["params"]
        assert (params["temperature"], params["top_k"], params["top_p"], params["min_p"], params["seed"],
                params["repeat_penalty"], params["repeat_last_n"], params["presence_penalty"],
                params["frequency_penalty"]) == (0, 1, 0.5, 0.2, 77, 1.1, 16, 0.5, 0.25)
        body = {"prompt": "abc", "n_predict": 6, "return_tokens": True}
        implicit = c.post("/completion", json=body, headers=key).json()
        explicit = c.post("/completion", json={**body, "temperature": 0, "top_k": 1, "repeat_penalty": 1.1,
                                               "repeat_last_n": 16, "presence_penalty": 0.5,
                                               "frequency_penalty": 0.25}, headers=key).json()
        assert implicit["tokens"] == explicit["tokens"] and implicit["generation_settings"]["seed"] == 77
        hot = c.post("/completion", json={**body, "temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
                     headers=key).json()
        assert hot["generation_settings"]["temperature"] == 1.5         # a request's own value wins
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 1}, headers=key).json()
        assert chat["usage"]["prompt_tokens"] == len(c.post("/tokenize", headers=key, json={
            "content": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "add_special": True,
            "parse_special": True}).json()["tokens"])                    # the chatml template given by name
    rc, _ = srv.stop()
    assert rc == 0 and '"POST /completion" 200' in log_file.read_text()

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>")
    srv = make_server("-c", "256", "-np", "1", "--props", "--chat-template-file", str(template), "-lv", "1")
    with httpx.Client(base_url=srv.url, timeout=20) as c:
        assert c.post("/props", json={}).json() == {"success": True}
        assert "n_predict" in error(c.post("/props", json={"n_predict": 3}), 400)["message"]
        props = c.get("/props").json()
        assert props["endpoint_props"] is True and props["chat_template"] == template.read_text()
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 1}).json()
        assert chat["usage"]["prompt_tokens"] == len(tokens(c, "[user] hi\n>", add_special=True))
    srv.stop()
    assert "POST /v1/chat/completions" not in srv.log()                 # -lv 1: no request log lines


@pytest.mark.parametrize("flags, needle", [
    (["--mlock"], "--mlock"),
    (["--no-mmap"], "memory-mapped"),
    (["--no-jinja"], "Jinja"),
    (["-fa", "off"], "flash"),
    (["--context-shift"], "shift"),
    (["--chat-template", "llama3"], "chatml"),
    (["--grammar", "root ::= x"], "server-wide constraint"),
    (["-hf", "x/y"], "download"),
    (["--keep", "-2"], "--keep"),
    (["--seed", "-5"], "--seed"),
    (["--temp", "nan"], "temperature"),
    (["--device", "cuda", "-ngl", "1"], "split"),
    (["--host", "/tmp/fastserve.sock"], "UNIX socket"),
    (["-c", "0"], "give a size"),
    (["-ub", "0"], "--ubatch-size"),
    (["--cors-origins", "ftp://x.example"], "--cors-origins"),
    (["--reasoning-format", "deepseek-legacy"], "--reasoning-format"),
    (["--reasoning-budget", "-2"], "--reasoning-budget"),
    (["--chat-template-file", "/nonexistent/t.jinja"], "--chat-template-file"),     # the tiny model has 2 layers: all or nothing on a GPU
])
def test_refused_flags_exit_with_the_reason(tiny_model_path, flags, needle):
    env = {"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-m", "fastserve", "serve", "-m", tiny_model_path, "--port", "0", *flags],
                       capture_output=True, text=True, timeout=60, env=env, cwd=str(REPO_ROOT))
    assert p.returncode == 2 and needle in p.stderr, (p.returncode, p.stderr)
