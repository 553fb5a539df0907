"""/v1/completions with echo + logprobs (what lm-evaluation-harness's local-completions sends for multiple-choice
tasks), GET /tokenizer_info and vLLM's /tokenize, /detokenize fields, against a real server on the tiny model
through the openai package. The expected scores are the teacher-forced log-softmax of Model.logits, computed
here, not by the server."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

from fastserve.scoring import log_softmax

from .conftest import ServerProc

PROMPTS = ["the cat sat on the mat", "one two three four five", "hello world, hello again", "a b c d e f g",
           "once upon a time", "red green blue", "the end of the story", "x y z"]
N_CTX_SLOT = 256            # -c 2048 -np 8


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    """A server of this module's own: its echoes' completions leave prompts in the slots' caches, which would
    change what the shared server's later tests count as prompt tokens evaluated."""
    with ServerProc(tiny_model_path, tmp_path_factory.mktemp("echo") / "server.log", "-c", "2048", "-np", "8",
                    "-n", "16") as p:
        yield p


def _rows(model, ids):
    """float64 [n - 1, n_vocab]: row i - 1 scores token i."""
    return log_softmax(model.logits(ids))[:-1]


def _score(oai, prompt, **kw):
    return oai.completions.create(model="x", prompt=prompt, echo=True, logprobs=kw.pop("logprobs", 3),
                                  max_tokens=kw.pop("max_tokens", 1), temperature=0, **kw)


def test_echo_scores_are_the_teacher_forced_log_softmax(oai, tiny_model):
    tok = tiny_model.tokenizer
    for text in PROMPTS[:3]:
        ids = tok.encode(text, add_special=True)
        c = _score(oai, text)
        choice, lp = c.choices[0], c.choices[0].logprobs
        rows = _rows(tiny_model, ids)
        n = len(ids)
        assert len(lp.tokens) == n + 1 and c.usage.prompt_tokens == n and c.usage.completion_tokens == 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = rows[np.arange(n - 1), ids[1:]]
        np.testing.assert_allclose(lp.token_logprobs[1:n], want, rtol=0, atol=1e-6)
        for i in range(1, n):
            best = np.lexsort((np.arange(rows.shape[1]), -rows[i - 1]))[:3]
            expect = {}
            for t in best:
                expect.setdefault(tok.token_bytes(int(t)).decode("utf-8", "replace"), rows[i - 1, t])
            assert lp.top_logprobs[i].keys() == expect.keys()
            np.testing.assert_allclose(list(lp.top_logprobs[i].values()), list(expect.values()), rtol=0, atol=1e-6)
        assert choice.text.startswith(text)
        assert lp.tokens[:n] == [tok.token_bytes(t).decode("utf-8", "replace") for t in ids]
        assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(n)] + [len(text)]
        # the generated token: greedy, so its own logprob is its top one
        assert lp.token_logprobs[n] == max(lp.top_logprobs[n].values())


def test_the_same_scores_alone_and_at_concurrency_8(oai, http):
    alone = [_score(oai, p).choices[0].logprobs for p in PROMPTS]
    long = {"prompt": "busy", "max_tokens": 60, "temperature": 0}
    with ThreadPoolExecutor(10) as pool:
        busy = [pool.submit(http.post, "/v1/completions", json=long) for _ in range(2)]
        together = list(pool.map(lambda p: _score(oai, p).choices[0].logprobs, PROMPTS))
        assert all(f.result().status_code == 200 for f in busy)
    for a, b in zip(alone, together):
        assert a.token_logprobs == b.token_logprobs and a.top_logprobs == b.top_logprobs and a.tokens == b.tokens


def test_max_tokens_0_scores_token_id_prompts_alone(oai, tiny_model):
    tok = tiny_model.tokenizer
    prompts = [tok.encode(p, add_special=True) for p in PROMPTS[:3]] + [[5]]
    c = _score(oai, prompts, max_tokens=0, logprobs=1)
    assert [ch.index for ch in c.choices] == [0, 1, 2, 3]
    assert c.usage.completion_tokens == 0 and c.usage.prompt_tokens == sum(len(p) for p in prompts)
    for ids, ch in zip(prompts, c.choices):
        assert ch.text == tok.decode(ids) and ch.finish_reason == "length"
        assert len(ch.logprobs.token_logprobs) == len(ids) and ch.logprobs.token_logprobs[0] is None
        if len(ids) > 1:
            want = _rows(tiny_model, ids)[np.arange(len(ids) - 1), ids[1:]]
            np.testing.assert_allclose(ch.logprobs.token_logprobs[1:], want, rtol=0, atol=1e-6)


def test_echo_without_logprobs_puts_the_prompt_before_the_completion(oai):
    plain = oai.completions.create(model="x", prompt="the cat", max_tokens=4, temperature=0)
    echoed = oai.completions.create(model="x", prompt="the cat", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "the cat" + plain.choices[0].text
    assert echoed.choices[0].logprobs is None


def test_lm_eval_reads_the_continuation_as_it_does(oai, tiny_model):
    """lm-evaluation-harness's parse: sum(token_logprobs[ctxlen:-1]) (the last is the generated token) and
    is_greedy when each is its position's top one."""
    tok = tiny_model.tokenizer
    ctx, cont = tok.encode("the cat sat", add_special=False), tok.encode(" on the mat", add_special=False)
    lp = _score(oai, [ctx + cont], logprobs=1).choices[0].logprobs
    got = sum(lp.token_logprobs[len(ctx):-1])
    rows = _rows(tiny_model, ctx + cont)
    want = sum(rows[i - 1, t] for i, t in enumerate(ctx + cont) if i >= len(ctx))
    assert abs(got - want) < 1e-6
    greedy = all(t == max(top.values()) for t, top in zip(lp.token_logprobs[len(ctx):-1], lp.top_logprobs[len(ctx):-1]))
    assert greedy == all(int(np.argmax(rows[i - 1])) == t for i, t in enumerate(ctx + cont) if i >= len(ctx))


@pytest.mark.parametrize("extra,words", [
    ({"n": 2}, "'echo' with 'n' > 1"),
    ({"stream": True}, "'echo' with 'stream'"),
    ({"logprobs": 21}, "'logprobs' must be in [0, 20]"),
    ({"prompt": [1] * (N_CTX_SLOT + 1)}, "exceeds the available context size"),
    ({"prompt": [1, 10 ** 6]}, "token"),
])
def test_bad_echo_requests_are_400_in_openai_shape(http, extra, words):
    body = {"prompt": "the cat", "echo": True, "logprobs": 1, "max_tokens": 1, **extra}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] in ("invalid_request_error", "exceed_context_size_error")


def test_the_openai_client_gets_a_400_for_echo_with_n(oai):
    with pytest.raises(openai.BadRequestError, match="'echo' with 'n' > 1"):
        oai.completions.create(model="x", prompt="a", echo=True, n=2, max_tokens=1)


def test_tokenizer_info_and_vllm_field_names(http, tiny_model):
    tok = tiny_model.tokenizer
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == tok.token_text(tok.eos_id)
    assert info["bos_token"] == (tok.token_text(tok.bos_id) if tok.bos_id is not None else None)
    assert "pad_token" in info and info["model_max_length"] == N_CTX_SLOT
    assert info["chat_template"] == (tok.chat_template or None)
    text = "the cat sat"
    vllm = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    llama = http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert vllm == llama == tok.encode(text, add_special=False)
    assert http.post("/tokenize", json={"prompt": text}).json()["tokens"] == tok.encode(text, add_special=True)
    back = http.post("/detokenize", json={"tokens": vllm}).json()
    assert back["prompt"] == back["content"] == tok.decode(vllm)
    for body, words in (({"prompt": "a", "content": "a"}, "not both"),
                        ({"content": "a", "add_special": True, "add_special_tokens": True}, "not both"),
                        ({"add_special_tokens": False}, "'content' is required")):
        r = http.post("/tokenize", content=json.dumps(body))
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
