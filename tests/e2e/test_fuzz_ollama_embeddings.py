"""Property: random JSON bodies at Ollama's routes (/api/chat, /api/generate, /api/embed, /api/embeddings, /api/show)
and the embedding routes (/v1/embeddings, /embedding) never get a 5xx, never hang, and leave the server healthy."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from .test_fuzz import FUZZ, _send, client, fuzz_server, values  # noqa: F401 (its server, this module's own)

OLLAMA_KEYS = ["model", "messages", "prompt", "system", "raw", "stream", "format", "options", "think", "keep_alive",
               "tools", "input", "truncate", "dimensions", "suffix", "logprobs", "top_logprobs"]
OPTION_KEYS = ["temperature", "top_k", "top_p", "seed", "num_predict", "num_ctx", "stop", "tfs_z", "mirostat",
               "num_thread", "typical_p", "repeat_penalty"]
EMBED_KEYS = ["input", "content", "model", "encoding_format", "dimensions", "embd_normalize", "user"]
texts = st.text(max_size=20) | st.lists(st.text(max_size=8) | st.lists(st.integers(-5, 600), max_size=5), max_size=3)


@pytest.fixture(scope="module")
def model(client):
    return client.get("/api/tags").json()["models"][0]["model"]


def ollama_bodies(model):
    messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                               "content": st.text(max_size=20) | values}), max_size=3)
    options = st.dictionaries(st.sampled_from(OPTION_KEYS), values, max_size=3)
    known = st.dictionaries(st.sampled_from(OLLAMA_KEYS), values | messages | texts, max_size=5)
    return st.builds(lambda base, m, o: {**base, "model": m, "options": o}, known,
                     st.sampled_from([model, model, "nope"]), options) | known | values


@FUZZ
@given(data=st.data(), path=st.sampled_from(["/api/chat", "/api/generate", "/api/embed", "/api/embeddings",
                                             "/api/show"]))
def test_ollama_never_5xx(client, model, data, path):
    body = data.draw(ollama_bodies(model) | st.binary(max_size=40))
    r = _send(client, path, body)
    assert r.status_code < 500, (body, r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert set(r.json()) == {"error"}


@FUZZ
@given(body=st.dictionaries(st.sampled_from(EMBED_KEYS), values | texts, max_size=4) | values | st.binary(max_size=40),
       path=st.sampled_from(["/v1/embeddings", "/embedding"]))
def test_embeddings_never_5xx(client, body, path):
    r = _send(client, path, body)
    assert r.status_code < 500, (body, r.status_code, r.text[:500])


def test_healthy_after_fuzz(client, fuzz_server):
    assert client.get("/health").status_code == 200
    assert client.post("/v1/embeddings", json={"input": "still fine"}).status_code == 200
    assert "Traceback" not in fuzz_server.log()
