"""Ollama's API against a real server on the tiny model, through the `ollama` package's Client (and raw HTTP
where the client would refuse the input itself). The oracle is the server's own OpenAI and llama-server routes:
at temperature 0 the same conversation gives the same text on /api/chat as on /v1/chat/completions."""
from __future__ import annotations

import json

import numpy as np
import ollama
import pytest


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.list().models[0].model


GREEDY = {"temperature": 0, "num_predict": 12}
HELLO = [{"role": "user", "content": "hello there"}]


def test_tags_show_ps_version(client, http, model):
    listed = client.list().models
    assert len(listed) == 1 and listed[0].model.endswith(".gguf") and listed[0].size > 0
    assert listed[0].details.format == "gguf" and listed[0].details.family == "llama"
    shown = client.show(model)
    assert shown.details.family == "llama" and "completion" in shown.capabilities and "embedding" in shown.capabilities
    assert shown.modelinfo["general.architecture"] == "llama" and "{%" in shown.template
    running = client.ps().models
    assert len(running) == 1 and running[0].model == model and running[0].context_length == 256
    assert running[0].expires_at.year > 2100                 # never unloaded
    assert http.get("/api/version").json()["version"].count(".") == 2
    assert client.show(f"{model}:latest").details.family == "llama"


def test_chat_equals_the_openai_chat(client, oai, model):
    ours = client.chat(model=model, messages=HELLO, options=GREEDY)
    theirs = oai.chat.completions.create(model=model, messages=HELLO, temperature=0, max_tokens=12)
    assert ours.message.role == "assistant" and ours.message.content == theirs.choices[0].message.content
    assert ours.done and ours.done_reason == "length" and ours.eval_count == 12
    assert ours.prompt_eval_count == theirs.usage.prompt_tokens
    assert ours.total_duration >= ours.eval_duration > 0 and ours.load_duration == 0


def test_chat_stream_is_the_whole_reply_in_pieces(client, model):
    whole = client.chat(model=model, messages=HELLO, options=GREEDY)
    parts = list(client.chat(model=model, messages=HELLO, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "length"
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == 12 and len(parts) >= 2


def test_generate_stream_and_not(client, http, model):
    whole = client.generate(model=model, prompt="the cat sat", options=GREEDY)
    parts = list(client.generate(model=model, prompt="the cat sat", options=GREEDY, stream=True))
    assert whole.done and whole.eval_count == 12 and whole.response
    assert "".join(p.response for p in parts) == whole.response and parts[-1].done
    raw = client.generate(model=model, prompt="the cat sat", raw=True, options=GREEDY)
    completion = http.post("/completion", json={"prompt": "the cat sat", "n_predict": 12, "temperature": 0}).json()
    assert raw.response == completion["content"]
    chat = client.chat(model=model, messages=[{"role": "user", "content": "the cat sat"}], options=GREEDY)
    assert whole.response == chat.message.content          # not raw: the chat template, one user message


def test_logprobs_are_the_openai_chats(client, oai, model):
    ours = client.chat(model=model, messages=HELLO, options=GREEDY, logprobs=True, top_logprobs=3)
    theirs = oai.chat.completions.create(model=model, messages=HELLO, temperature=0, max_tokens=12, logprobs=True,
                                         top_logprobs=3).choices[0].logprobs.content
    assert len(ours.logprobs) == 12
    assert [(x.token, x.logprob, [(t.token, t.logprob) for t in x.top_logprobs]) for x in ours.logprobs] == \
        [(x.token, x.logprob, [(t.token, t.logprob) for t in x.top_logprobs]) for x in theirs]
    parts = list(client.generate(model=model, prompt="the cat sat", raw=True, stream=True, options=GREEDY,
                                 logprobs=True, top_logprobs=2))
    streamed = [x for p in parts for x in (p.logprobs or [])]
    whole = client.generate(model=model, prompt="the cat sat", raw=True, options=GREEDY, logprobs=True, top_logprobs=2)
    assert [x.token for x in streamed] == [x.token for x in whole.logprobs] and len(streamed) == 12
    assert all(len(x.top_logprobs) == 2 and x.logprob == x.top_logprobs[0].logprob for x in whole.logprobs)
    assert client.chat(model=model, messages=HELLO, options=GREEDY).logprobs is None


def test_options_are_honoured(client, model):
    short = client.chat(model=model, messages=HELLO, options={"temperature": 0, "num_predict": 3})
    assert short.eval_count == 3 and short.done_reason == "length"
    a = client.chat(model=model, messages=HELLO, options={"temperature": 1.0, "seed": 42, "num_predict": 10})
    b = client.chat(model=model, messages=HELLO, options={"temperature": 1.0, "seed": 42, "num_predict": 10})
    assert a.message.content == b.message.content
    full = client.chat(model=model, messages=HELLO, options=GREEDY).message.content
    word = full.split()[1] if len(full.split()) > 1 else full[:2]
    cut = client.chat(model=model, messages=HELLO, options={**GREEDY, "stop": [word]})
    assert word not in cut.message.content and cut.done_reason == "stop"
    ok = client.chat(model=model, messages=HELLO, options={**GREEDY, "num_ctx": 256, "num_keep": 5, "tfs_z": 1.0,
                                                            "typical_p": 1.0, "mirostat": 0})
    assert ok.message.content == full


def test_loading_requests(client, model):
    assert client.generate(model=model).done_reason == "load"
    assert client.chat(model=model, messages=[]).done_reason == "load"


def test_tool_history_and_json_format(client, model):
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "weather",
                                                                                  "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_name": "weather", "content": "sunny"}]
    r = client.chat(model=model, messages=messages, options=GREEDY)
    assert r.done
    j = client.chat(model=model, messages=HELLO, format="json", options={"temperature": 0, "num_predict": 40})
    assert j.message.content.lstrip().startswith("{")


@pytest.mark.parametrize("body, status, says", [
    ({"model": "nope", "messages": HELLO}, 404, "model 'nope' not found"),
    ({"messages": HELLO}, 400, "model is required"),
    ({"model": "M", "messages": HELLO, "temprature": 0}, 400, "unknown field(s) 'temprature'"),
    ({"model": "M", "messages": HELLO, "options": {"temprature": 0}}, 400, "option 'temprature' is not supported"),
    ({"model": "M", "messages": HELLO, "options": {"num_ctx": 100000}}, 400, "exceeds this server's context"),
    ({"model": "M", "messages": HELLO, "options": {"num_thread": 4}}, 400, "load-time setting"),
    ({"model": "M", "messages": HELLO, "options": {"tfs_z": 0.5}}, 400, "'tfs_z' = 0.5 is not supported"),
    ({"model": "M", "messages": HELLO, "options": {"mirostat": 2}}, 400, "no Mirostat"),
    ({"model": "M", "messages": HELLO, "options": {"temperature": "hot"}}, 400, "'temperature' must be a number"),
    ({"model": "M", "messages": HELLO, "options": {"num_predict": -3}}, 400, "'num_predict' must be in"),
    ({"model": "M", "messages": HELLO, "options": []}, 400, "'options' must be an object"),
    ({"model": "M", "messages": HELLO, "think": "high"}, 400, "'think' must be true or false"),
    ({"model": "M", "messages": HELLO, "format": "xml"}, 400, "'format' must be"),
    ({"model": "M", "messages": HELLO, "keep_alive": [1]}, 400, "'keep_alive' must be a duration"),
    ({"model": "M", "messages": HELLO, "top_logprobs": 2}, 400, "'top_logprobs' needs 'logprobs': true"),
    ({"model": "M", "messages": HELLO, "logprobs": True, "top_logprobs": 21}, 400, "'top_logprobs' must be in"),
    ({"model": "M", "messages": "hi"}, 400, "'messages' must be an array"),
    ({"model": "M", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, 400, "no vision"),
    ({"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, 400, "role must be one of"),
    ({"model": "M", "messages": [{"role": "user", "content": "word " * 400}]}, 400, "exceeds the available context"),
])
def test_bad_chat_is_ollamas_error(http, model, body, status, says):
    body = {k: (model if v == "M" else v) for k, v in body.items()}
    for stream in (False, True):           # refused before anything streams: a status, not a stream
        r = http.post("/api/chat", json={**body, "stream": stream})
        assert r.status_code == status, r.text
        assert r.json().keys() == {"error"} and says in r.json()["error"], r.json()


@pytest.mark.parametrize("body, says", [
    ({"prompt": "x", "suffix": "y"}, "'suffix' is not supported"),
    ({"prompt": "x", "images": ["aGk="]}, "'images' is not supported"),
    ({"prompt": "x", "context": [1, 2]}, "'context' is not supported"),
    ({"prompt": "x", "template": "{{ .Prompt }}"}, "'template' is not supported"),
    ({"prompt": "x", "raw": True, "system": "be brief"}, "no 'system' or 'think'"),
    ({"prompt": 5}, "'prompt' must be a string"),
])
def test_bad_generate_is_ollamas_error(http, model, body, says):
    r = http.post("/api/generate", json={"model": model, **body})
    assert r.status_code == 400 and says in r.json()["error"], r.text


def test_the_client_raises_response_error(client, model):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=HELLO)
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        list(client.chat(model=model, messages=HELLO, stream=True, options={"num_gpu": 1}))
    assert e.value.status_code == 400 and "load-time setting" in e.value.error


def test_stream_is_ndjson(http, model):
    with http.stream("POST", "/api/generate", json={"model": model, "prompt": "hi", "options": GREEDY}) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True and all(line["done"] is False for line in lines[:-1])


# -- embeddings ------------------------------------------------------------------------------------

def test_embed_equals_the_openai_route(client, http, model):
    texts = ["hello there", "the cat sat"]
    ours = client.embed(model=model, input=texts)
    theirs = http.post("/v1/embeddings", json={"input": texts}).json()["data"]
    assert np.asarray(ours.embeddings, np.float32).tolist() == [np.asarray(d["embedding"], np.float32).tolist()
                                                                for d in theirs]
    assert ours.prompt_eval_count > 0 and ours.model == model
    one = client.embed(model=model, input="hello there").embeddings
    assert len(one) == 1 and one[0] == ours.embeddings[0]


def test_embed_truncates_unless_told_not_to(client, http, model):
    long = "word " * 400
    cut = client.embed(model=model, input=long).embeddings[0]
    assert abs(np.linalg.norm(cut) - 1) < 1e-5
    huge = client.embed(model=model, input=long * 40)          # cut before it is tokenized whole: the same start
    assert huge.embeddings[0] == cut and huge.prompt_eval_count == 256
    r = http.post("/api/embed", json={"model": model, "input": long, "truncate": False})
    assert r.status_code == 400 and "exceeds the available context size (256 tokens)" in r.json()["error"]


def test_older_embeddings_route_is_not_normalised(client, model):
    old = np.asarray(client.embeddings(model=model, prompt="hello there").embedding)
    new = np.asarray(client.embed(model=model, input="hello there").embeddings[0])
    assert abs(np.linalg.norm(old) - 1) > 1e-3
    assert float(old @ new / np.linalg.norm(old)) > 0.999999


@pytest.mark.parametrize("body, status, says", [
    ({"model": "nope", "input": "x"}, 404, "not found"),
    ({"model": "M", "input": 5}, 400, "'input' must be a string"),
    ({"model": "M", "input": "x", "dimensions": 3}, 400, "'dimensions' 3"),
    ({"model": "M", "input": "x", "options": {"temperature": 0}}, 400, "not supported by fastserve on this route"),
    ({"model": "M", "input": "x", "prompt": "y"}, 400, "unknown field(s) 'prompt'"),
])
def test_bad_embed_is_ollamas_error(http, model, body, status, says):
    body = {k: (model if v == "M" else v) for k, v in body.items()}
    r = http.post("/api/embed", json=body)
    assert r.status_code == status and says in r.json()["error"], r.text
