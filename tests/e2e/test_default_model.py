"""The server on the default model (SmolLM2-135M-Instruct): greedy text over HTTP equals the engine's
in-process text, streamed or not, and the chat template is applied."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from .conftest import ServerProc

PROMPT = "The capital of France is"


@pytest.mark.model
def test_default_model_over_http(default_model, default_model_file, tmp_path):
    import fastserve
    with fastserve.Engine(default_model, n_parallel=2, n_ctx=1024) as e:
        want = e.generate(PROMPT, max_tokens=16, temperature=0).text
        chat = default_model.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
        want_chat = e.generate(chat, max_tokens=12, temperature=0).text
    srv = ServerProc(default_model_file, tmp_path / "server.log", "-c", "1024", "-np", "2")
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            got = c.post("/completion", json={"prompt": PROMPT, "n_predict": 16, "temperature": 0}).json()
            assert got["content"] == want and got["tokens_predicted"] == 16
            with c.stream("POST", "/completion", json={"prompt": PROMPT, "n_predict": 16, "temperature": 0,
                                                       "stream": True}) as r:
                streamed = "".join(json.loads(x[6:])["content"] for x in r.iter_lines() if x.startswith("data: "))
            assert streamed == want
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi."}],
                                        max_tokens=12, temperature=0)
        assert r.choices[0].message.content == want_chat
        rc, dt = srv.stop()
        assert rc == 0 and dt < 3
    finally:
        srv.kill()


@pytest.mark.model
def test_a_schema_without_additional_properties_ends_with_its_keys(default_model_file, tmp_path):
    """As llama.cpp's schema converter: an object listing its properties takes no others when the schema says
    nothing of additionalProperties. Read as the JSON Schema standard has it, the default model adds keys ('id',
    'name', ...) or writes one key until n_predict cuts the JSON."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "integer"}}}
    with ServerProc(default_model_file, tmp_path / "server.log", "-c", "1024", "-np", "1") as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        for prompt in ("{", "A person record as JSON:", "Reply in JSON: is the sky blue? Give ok and score."):
            r = c.post("/completion", json={"prompt": prompt, "json_schema": schema, "n_predict": 64,
                                            "temperature": 0}).json()
            assert r["stop_type"] == "eos", (prompt, r["content"])
            assert set(json.loads(r["content"])) <= {"ok", "score"}, (prompt, r["content"])
