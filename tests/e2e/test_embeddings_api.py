"""Embeddings over HTTP against a real server on the tiny model: OpenAI's /v1/embeddings through the openai
package (unchanged: its default asks for base64), llama-server's /embedding, bad input in each API's error shape.
The expected vectors are computed here from the model's final hidden states (CpuBackend.hidden), mean-pooled
and normalised, not taken from the server."""
from __future__ import annotations

import base64

import numpy as np
import openai
import pytest

from fastserve.backends.cpu.backend import CpuBackend

from .conftest import ServerProc

N_CTX_SLOT = 256            # the server fixture's -c 2048 -np 8


@pytest.fixture(scope="module")
def expected(tiny_model):
    """text -> its mean-pooled, Euclidean-normalised vector, computed without the server."""
    def vector(text: str) -> np.ndarray:
        ids = tiny_model.tokenizer.encode(text, add_special=True)
        be = CpuBackend(tiny_model.config, tiny_model.weights, 1, len(ids), max_tokens=len(ids))
        rows = np.arange(len(ids))
        h = be.hidden(ids, rows, np.zeros(len(ids)), rows).astype(np.float64).mean(axis=0)
        return h / np.linalg.norm(h)
    return vector


def _close(a, b) -> bool:
    return float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b)) > 0.999999


def test_openai_client_single_and_list(oai, expected, tiny_model):
    one = oai.embeddings.create(model="whatever", input="the cat sat")
    assert one.object == "list" and len(one.data) == 1 and one.data[0].index == 0
    assert len(one.data[0].embedding) == tiny_model.config.n_embd
    assert _close(one.data[0].embedding, expected("the cat sat"))
    n_tokens = len(tiny_model.tokenizer.encode("the cat sat", add_special=True))
    assert one.usage.prompt_tokens == one.usage.total_tokens == n_tokens
    texts = ["hello there", "the cat sat", "a"]
    many = oai.embeddings.create(model="m", input=texts, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    assert all(_close(d.embedding, expected(t)) for d, t in zip(many.data, texts))


def test_token_ids_and_lists_of_them(oai, tiny_model):
    ids = [tiny_model.tokenizer.encode(t, add_special=True) for t in ("hello there", "the cat sat")]
    by_text = oai.embeddings.create(model="m", input=["hello there", "the cat sat"], encoding_format="float")
    one = oai.embeddings.create(model="m", input=ids[0], encoding_format="float")
    both = oai.embeddings.create(model="m", input=ids, encoding_format="float")
    assert one.data[0].embedding == by_text.data[0].embedding
    assert [d.embedding for d in both.data] == [d.embedding for d in by_text.data]


def test_base64_is_the_float32_bytes(http):
    f = http.post("/v1/embeddings", json={"input": "hello there"}).json()
    b = http.post("/v1/embeddings", json={"input": "hello there", "encoding_format": "base64"}).json()
    raw = np.frombuffer(base64.b64decode(b["data"][0]["embedding"]), np.float32)
    assert raw.tolist() == np.asarray(f["data"][0]["embedding"], np.float32).tolist()


def test_alone_or_among_fifteen_others_the_same_bytes(http):
    def vectors(texts):
        r = http.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"})
        assert r.status_code == 200, r.text
        return [d["embedding"] for d in r.json()["data"]]
    alone = vectors(["the dog barked twice"])[0]
    others = [f"other text {i} " * (1 + i % 4) for i in range(15)]
    assert vectors(others[:9] + ["the dog barked twice"] + others[9:])[9] == alone


def test_llama_server_shape_and_embd_normalize(http):
    r = http.post("/embedding", json={"content": ["hello there", "the cat sat"]})
    assert r.status_code == 200
    j = r.json()
    assert [x["index"] for x in j] == [0, 1] and all(len(x["embedding"]) == 1 for x in j)
    assert abs(np.linalg.norm(j[0]["embedding"][0]) - 1) < 1e-5
    raw = http.post("/embeddings", json={"input": "hello there", "embd_normalize": -1}).json()[0]["embedding"][0]
    taxi = http.post("/embedding", json={"input": "hello there", "embd_normalize": 1}).json()[0]["embedding"][0]
    assert abs(np.linalg.norm(raw) - 1) > 1e-3                       # not normalised
    assert abs(np.abs(taxi).sum() - 1) < 1e-4
    assert _close(raw, j[0]["embedding"][0])


@pytest.mark.parametrize("body, says", [
    ({"input": []}, "'input' is empty"),
    ({"input": [[]]}, "input 0 is empty"),
    ({"input": 5}, "must be a string"),
    ({"input": [1, "a"]}, "must be a string"),
    ({"input": [True]}, "must be a string"),
    ({"input": {"text": "a"}}, "must be a string"),
    ({}, "\"input\" or \"content\" must be provided"),
    ({"input": "a", "encoding_format": "int8"}, "float or base64"),
    ({"input": "a", "dimensions": 3}, "'dimensions' 3"),
    ({"input": "a", "pooling": "cls"}, "unknown field(s) 'pooling'"),
    ({"input": "a", "embd_normalize": -2}, "'embd_normalize' must be in"),
    ({"input": [999999]}, "token ids must be in"),
    ({"input": "word " * 400}, "exceeds the available context size (256 tokens)"),
    ({"input": ["ok", "x" * 70000]}, "request (about "),                  # refused before it is tokenized whole
])
def test_bad_input_is_a_400_in_openais_shape(http, body, says):
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert says in err["message"] and err["code"] == 400 and "param" in err and err["type"]


def test_bad_input_through_the_openai_client(oai):
    with pytest.raises(openai.BadRequestError, match="exceeds the available context size"):
        oai.embeddings.create(model="m", input="word " * 400)
    with pytest.raises(openai.BadRequestError, match="empty"):
        oai.embeddings.create(model="m", input=[])


def test_llama_route_errors_in_llamas_shape(http):
    r = http.post("/embedding", json={"content": "a", "encoding_format": "base64"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400 and "param" not in r.json()["error"]
    r = http.post("/embedding", content=b"not json")
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]


def test_pooling_none(make_server):
    import httpx
    srv: ServerProc = make_server("-c", "512", "-np", "2", "--pooling", "none")
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/embeddings", json={"input": "hello there"})
        assert r.status_code == 400 and "not OAI compatible" in r.json()["error"]["message"]
        j = c.post("/embedding", json={"content": "hello there"}).json()
        n_tokens = len(c.post("/tokenize", json={"content": "hello there", "add_special": True}).json()["tokens"])
        assert len(j[0]["embedding"]) == n_tokens and n_tokens > 1
