"""The llama.cpp and OpenAI APIs against a real server process, through httpx and the official openai client."""
from __future__ import annotations

import json

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import wait_until


def sse_events(resp) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            out.append(line[6:])
    return out


# -- llama.cpp API ---------------------------------------------------------------------------------

def test_completion_shape(http):
    # cache_prompt off: another test file on this session's server may have left "the cat sat" in a slot
    r = http.post("/completion", json={"prompt": "the cat sat", "n_predict": 8, "temperature": 0, "cache_prompt": False})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    j = r.json()
    for key in ("content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
                "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
                "tokens_cached", "timings"):
        assert key in j, key
    assert j["stop"] is True and j["tokens_predicted"] == 8 and j["stop_type"] == "limit"
    n_prompt = len(http.post("/tokenize", json={"content": "the cat sat", "add_special": True}).json()["tokens"])
    assert j["tokens_evaluated"] == n_prompt and 0 <= j["id_slot"] < 8
    t = j["timings"]
    assert t["prompt_n"] == n_prompt and t["predicted_n"] == 8 and t["predicted_ms"] >= 0 and "cache_n" in t


def test_completion_is_deterministic_and_streams_the_same_text(http):
    body = {"prompt": "hello there", "n_predict": 20, "temperature": 0, "return_tokens": True}
    a = http.post("/completion", json=body).json()
    b = http.post("/completion", json={**body, "cache_prompt": False}).json()
    assert a["content"] == b["content"] and a["tokens"] == b["tokens"] and len(a["tokens"]) == 20
    with http.stream("POST", "/completion", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(e) for e in sse_events(r)]
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == a["content"]
    assert [t for e in events[:-1] for t in e["tokens"]] == a["tokens"]
    assert events[-1]["tokens_predicted"] == 20 and "timings" in events[-1]


def test_token_id_prompt_equals_text_prompt(http):
    ids = http.post("/tokenize", json={"content": "the cat", "add_special": True}).json()["tokens"]
    a = http.post("/completion", json={"prompt": "the cat", "n_predict": 6, "temperature": 0}).json()
    b = http.post("/completion", json={"prompt": ids, "n_predict": 6, "temperature": 0}).json()
    assert a["content"] == b["content"]


def test_stop_string(http):
    full = http.post("/completion", json={"prompt": "abc", "n_predict": 30, "temperature": 0}).json()["content"]
    stop = full[6:9]
    assert stop and full.find(stop) >= 0
    j = http.post("/completion", json={"prompt": "abc", "n_predict": 30, "temperature": 0, "stop": [stop]}).json()
    assert j["content"] == full[:full.find(stop)]
    assert j["stop_type"] == "word" and j["stopping_word"] == stop


def test_seeded_sampling_is_reproducible(http):
    body = {"prompt": "x", "n_predict": 16, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    a = http.post("/completion", json={**body, "seed": 11}).json()["content"]
    b = http.post("/completion", json={**body, "seed": 11}).json()["content"]
    assert a == b


def test_completion_probabilities(http):
    j = http.post("/completion", json={"prompt": "hi", "n_predict": 4, "temperature": 0, "n_probs": 3}).json()
    probs = j["completion_probabilities"]
    assert len(probs) == 4
    for p in probs:
        assert set(p) >= {"id", "token", "bytes", "logprob", "top_logprobs"}
        assert len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"]     # greedy: the top one
        assert p["logprob"] <= 0
    j = http.post("/completion", json={"prompt": "hi", "n_predict": 2, "temperature": 0, "n_probs": 2,
                                       "post_sampling_probs": True}).json()
    assert all("prob" in p and "top_probs" in p for p in j["completion_probabilities"])


def test_tokenize_detokenize(http):
    toks = http.post("/tokenize", json={"content": "hello world"}).json()["tokens"]
    assert toks and all(isinstance(t, int) for t in toks)
    assert http.post("/detokenize", json={"tokens": toks}).json()["content"] == "hello world"
    pieces = http.post("/tokenize", json={"content": "hello", "with_pieces": True}).json()["tokens"]
    assert all(set(p) == {"id", "piece"} for p in pieces)


def test_health_props_slots(http):
    assert http.get("/health").json() == {"status": "ok"}
    props = http.get("/props").json()
    assert props["total_slots"] == 8 and props["default_generation_settings"]["n_ctx"] == 256
    assert props["chat_template"]
    slots = http.get("/slots").json()
    assert [s["id"] for s in slots] == list(range(8)) and all("is_processing" in s for s in slots)


def test_slot_erase(http):
    j = http.post("/completion", json={"prompt": "erase me", "n_predict": 4, "temperature": 0}).json()
    slot = j["id_slot"]
    assert wait_until(lambda: http.get("/slots").json()[slot]["n_tokens"] > 0)
    r = http.post(f"/slots/{slot}?action=erase")
    assert r.status_code == 200 and r.json()["id_slot"] == slot and r.json()["n_erased"] > 0
    assert http.get("/slots").json()[slot]["n_tokens"] == 0
    assert http.post("/slots/99?action=erase").status_code == 400
    assert http.post(f"/slots/{slot}?action=explode").status_code == 400
    assert http.post(f"/slots/{slot}?action=save").status_code == 501


def test_metrics_parse(http):
    http.post("/completion", json={"prompt": "m", "n_predict": 3, "temperature": 0})
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("fastserve_requests_running", "fastserve_requests_waiting", "fastserve_prompt_tokens",
                 "fastserve_generated_tokens", "fastserve_kv_usage_ratio", "fastserve_slots_busy",
                 "fastserve_seconds_since_last_step", "fastserve_decode_stalled",
                 "fastserve_time_to_first_token_seconds", "fastserve_inter_token_latency_seconds",
                 "fastserve_request_duration_seconds", "fastserve_queue_time_seconds",
                 "fastserve_step_phase_seconds", "fastserve_step_seconds"):
        assert name in fams, name
    gen = [s for s in fams["fastserve_generated_tokens"].samples if s.name.endswith("_total")][0].value
    assert gen >= 3
    ttft = {s.name: s.value for s in fams["fastserve_time_to_first_token_seconds"].samples if not s.labels.get("le")}
    assert ttft["fastserve_time_to_first_token_seconds_count"] >= 1
    assert [s.value for s in fams["fastserve_decode_stalled"].samples] == [0]
    steps = {s.name: s.value for s in fams["fastserve_step_seconds"].samples if not s.labels.get("le")}
    assert steps["fastserve_step_seconds_count"] >= 3 and steps["fastserve_step_seconds_sum"] > 0


def test_request_log_line(server, http):
    http.post("/completion", json={"prompt": "log me", "n_predict": 5, "temperature": 0})
    assert wait_until(lambda: '"POST /completion" 200 prompt=' in server.log() and "gen=5" in server.log(), 5)


# -- OpenAI API, with the official client ----------------------------------------------------------

def test_openai_models(oai):
    models = oai.models.list()
    assert len(models.data) == 1 and models.data[0].id.endswith(".gguf")


def test_openai_chat(oai, http):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = oai.chat.completions.create(model="x", messages=msgs, max_tokens=12, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stream = oai.chat.completions.create(model="x", messages=msgs, max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    r2 = oai.chat.completions.create(model="x", messages=msgs, max_completion_tokens=5, temperature=0)
    assert r2.usage.completion_tokens <= 5


def test_openai_chat_stream_ends_with_done(http):
    with http.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")


def test_openai_logprobs(oai):
    r = oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}], max_tokens=4,
                                    temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob == item.top_logprobs[0].logprob <= 0
    c = oai.completions.create(model="x", prompt="abc", max_tokens=3, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens


def test_openai_completions_and_stop_and_seed(oai):
    a = oai.completions.create(model="x", prompt="the dog", max_tokens=10, temperature=0)
    text = a.choices[0].text
    assert a.usage.completion_tokens == 10 and a.choices[0].finish_reason == "length"
    streamed = "".join(ch.choices[0].text for ch in oai.completions.create(
        model="x", prompt="the dog", max_tokens=10, temperature=0, stream=True) if ch.choices)
    assert streamed == text
    if len(text) > 4:
        stop = text[2:4]
        s = oai.completions.create(model="x", prompt="the dog", max_tokens=10, temperature=0, stop=[stop])
        assert s.choices[0].text == text[:text.find(stop)] and s.choices[0].finish_reason == "stop"
    x = oai.completions.create(model="x", prompt="q", max_tokens=8, temperature=1.0, seed=5)
    y = oai.completions.create(model="x", prompt="q", max_tokens=8, temperature=1.0, seed=5)
    assert x.choices[0].text == y.choices[0].text


def test_openai_completions_refuse_n_above_the_cap(oai):
    # n > 1 and lists of prompts: tests/e2e/test_llama_compat.py
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="x", prompt="a", n=17)
    assert "'n'" in str(e.value)
