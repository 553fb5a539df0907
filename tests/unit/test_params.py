"""server/params.py: one parse of a request body. Each default where it comes from (the request, else
the server's flags, else SamplingParams'), each check once, with the field it names."""
from __future__ import annotations

import json
import math
import sys
from dataclasses import fields
from types import SimpleNamespace

import pytest

import fastserve
from fastserve.config import MAX_N_PROBS, SamplingParams, check_context, check_max_tokens, check_token_ids
from fastserve.errors import ContextExceeded, RequestError
from fastserve.server.config import ServerConfig
from fastserve.server.errors import LLAMA, OPENAI, HttpError, refused
from fastserve.server.fields import Body
from fastserve.server.generation import Generation
from fastserve.server.metrics import LlamaTotals
from fastserve.server.params import (EXACT_CHARS, MAX_CHOICES, MAX_PROMPTS, PROB_POOL, SAMPLING,
                                     Parser)

N_CTX = 64


@pytest.fixture(scope="module")
def tok(tiny_model):
    return tiny_model.tokenizer


def _json(body: dict) -> bytes:
    return json.dumps(body).encode()


def _parser(tok, **config) -> Parser:
    return Parser(tok, SimpleNamespace(n_vocab=tok.n_vocab, n_ctx_slot=N_CTX, speculative=None), ServerConfig(**config))


def _completion(tok, body: dict, **config):
    return _parser(tok, **config).completion(_json({"prompt": "hi", **body}))


def _refused(fn, needle: str, status: int = 400):
    """fn() is refused: an HttpError (status) or the RequestError SamplingParams.make raises (a 400 in App),
    its message naming needle."""
    with pytest.raises((HttpError, RequestError)) as exc:
        fn()
    if isinstance(exc.value, HttpError):
        assert exc.value.status == status, exc.value.message
    assert needle in str(exc.value), str(exc.value)
    return exc.value


# -- defaults ------------------------------------------------------------------------------------------

def test_a_bare_request_gets_samplingparams_defaults(tok):
    p = _completion(tok, {})
    want = SamplingParams()
    for f in fields(SamplingParams):
        if f.name != "seed":
            assert getattr(p.sampling, f.name) == getattr(want, f.name), f.name
    assert (p.max_tokens, p.stop, p.stream, p.n, p.cache_prompt, p.id_slot, p.ignore_eos) == (-1, [], False, 1, True,
                                                                                             -1, False)
    assert p.seed is None and 0 <= p.sampling.seed < 2 ** 64        # none given: one is drawn
    assert p.constraint == {} and p.prompts == [tok.encode("hi", add_special=True)] and p.texts == ("hi",)
    assert (p.limits.queue, p.limits.total, p.limits.token) == (600.0, 0.0, 60.0)       # ServerConfig's


def test_a_field_left_out_takes_the_servers_default_and_a_given_one_wins(tok):
    server = SamplingParams.make(tok.n_vocab, seed=0, temperature=0.3, top_k=5, repeat_last_n=16)
    p = _completion(tok, {"top_k": 9}, sampling=server, seed=42, n_predict=7, ignore_eos=True)
    assert (p.sampling.temperature, p.sampling.top_k, p.sampling.repeat_last_n) == (0.3, 9, 16)
    assert p.seed == 42 == p.sampling.seed and p.max_tokens == 7 and p.ignore_eos
    assert all(p.sampling.kwargs()["logit_bias"][t] == -math.inf for t in tok.eog_ids)     # --ignore-eos
    for name, read in SAMPLING.items():
        value = 3 if read is Body.int else 0.5
        assert getattr(_completion(tok, {name: value}).sampling, name) == value, name
    assert _completion(tok, {"seed": -1}, seed=42).seed is None
    assert not _completion(tok, {"ignore_eos": False}, ignore_eos=True).sampling.logit_bias


def test_max_tokens_names_and_the_slot_cap(tok):
    assert _completion(tok, {"n_predict": 5, "max_tokens": 9}).max_tokens == 5
    assert _completion(tok, {"max_tokens": 9}).max_tokens == 9
    assert _completion(tok, {"n_predict": 10 ** 9}).max_tokens == N_CTX       # the slot is full by then
    parser = _parser(tok, n_predict=11)
    chat = {"messages": [{"role": "user", "content": "a"}]}
    assert parser.chat(_json(chat)).max_tokens == 11
    assert parser.chat(_json({**chat, "max_completion_tokens": 3, "max_tokens": 9})).max_tokens == 3
    assert parser.completions(_json({"prompt": "a", "max_tokens": 4, "n_predict": 9})).max_tokens == 4


def test_limits_may_only_shorten_the_servers(tok):
    lim = _completion(tok, {"queue_timeout": 5, "request_timeout": 7, "token_timeout": 999},
                      queue_timeout=10, request_timeout=0, token_timeout=60).limits
    assert (lim.queue, lim.total, lim.token) == (5, 7, 60)
    assert _completion(tok, {"queue_timeout": 0}, queue_timeout=10).limits.queue == 10


def test_choices_seed_each_choice_of_each_prompt(tok):
    p = _parser(tok).completions(_json({"prompt": ["a", "b"], "n": 3, "seed": 2 ** 64 - 2}))
    seeds = [s.seed for _, s in p.choices()]
    assert seeds == [2 ** 64 - 2, 2 ** 64 - 1, 0] * 2
    assert [ids for ids, _ in p.choices()] == [p.prompts[0]] * 3 + [p.prompts[1]] * 3
    assert all(s.temperature == p.sampling.temperature for _, s in p.choices())


def test_probabilities_fields_of_each_api(tok):
    # the engine reports what sampling can pick (top_k; PROB_POOL when off), before or after sampling; 3 are shown
    for post in (True, False):
        p = _completion(tok, {"n_probs": 3, "post_sampling_probs": post, "top_k": 20, "temperature": 0.8})
        assert (p.sampling.n_probs, p.shown_probs, p.settings()["n_probs"]) == (20, 3, 3)
        p = _completion(tok, {"n_probs": 3, "post_sampling_probs": post, "top_k": 0, "temperature": 0.8})
        assert p.sampling.n_probs == PROB_POOL
    assert _completion(tok, {"n_probs": 3, "temperature": 0}).sampling.n_probs == 3         # greedy: the first
    assert _completion(tok, {"n_probs": 80, "top_k": 20, "temperature": 1}).sampling.n_probs == 80
    parser = _parser(tok)
    legacy = parser.completions(_json({"prompt": "a", "logprobs": 2, "top_k": 30, "temperature": 1}))
    assert (legacy.logprobs, legacy.sampling.n_probs) == (2, 30)
    legacy = parser.completions(_json({"prompt": "a", "logprobs": 0, "temperature": 0}))
    assert (legacy.logprobs, legacy.sampling.n_probs) == (0, 1)
    chat = {"messages": [{"role": "user", "content": "a"}]}
    assert parser.chat(_json(chat)).logprobs is None and parser.chat(_json(chat)).sampling.n_probs == 0
    lp = parser.chat(_json({**chat, "logprobs": True, "top_logprobs": 15, "top_k": 0, "temperature": 1}))
    assert (lp.logprobs, lp.sampling.n_probs) == (15, PROB_POOL)
    lp = parser.chat(_json({**chat, "logprobs": True, "temperature": 0}))
    assert (lp.logprobs, lp.sampling.n_probs) == (0, 1)
    assert parser.completions(_json({"prompt": "a", "n_probs": 5})).sampling.n_probs == 0    # llama's field


def test_settings_show_the_request_and_the_samplers_fastserve_lacks(tok):
    p = _completion(tok, {"temperature": 0.25, "stream": True, "n_predict": 9})
    s = p.settings()
    assert (s["seed"], s["temperature"], s["n_predict"], s["max_tokens"], s["stream"]) == (-1, 0.25, 9, 9, True)
    assert (s["top_n_sigma"], s["typical_p"], s["mirostat"]) == (-1.0, 1.0, 0)
    assert p.settings(p.sampling)["seed"] == p.sampling.seed                  # /slots: the seed in use


def test_a_chat_prompt_is_made_after_the_rest(tok):
    parser = _parser(tok)
    p = parser.chat(_json({"messages": [{"role": "user", "content": "hello"}], "n": 2}))
    assert p.prompts == [] and p.n == 2
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    assert parser.conversation(p).prompts == [tok.encode(text, add_special=True)]


def test_an_assistant_message_last_is_continued(tok):
    """llama-server's prefill: the template renders the messages before it, then its text follows; two
    assistant messages at the end are a 400; --no-prefill-assistant renders it as any other."""
    ask = [{"role": "user", "content": "hello"}]
    body = {"messages": [*ask, {"role": "assistant", "content": "Hi, I am"}]}
    text = tok.apply_chat_template(ask, add_generation_prompt=True) + "Hi, I am"
    parser = _parser(tok)
    assert parser.conversation(parser.chat(_json(body))).prompts == [tok.encode(text, add_special=True)]
    twice = {"messages": [*body["messages"], {"role": "assistant", "content": "x"}]}
    _refused(lambda: parser.conversation(parser.chat(_json(twice))), "2 or more assistant messages")
    plain = _parser(tok, prefill_assistant=False)
    whole = tok.apply_chat_template(body["messages"], add_generation_prompt=True)
    assert plain.conversation(plain.chat(_json(body))).prompts == [tok.encode(whole, add_special=True)]
    assert plain.conversation(plain.chat(_json(twice))).prompts        # not a prefill: allowed


# -- checks --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, needle", [
    ({"temperature": "hot"}, "'temperature' must be a number"),
    ({"top_k": 1.5}, "'top_k' must be an integer"),
    ({"top_p": 7}, "top_p must be in [0, 1]"),
    ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"repeat_last_n": -2}, "repeat_last_n"),
    ({"n_probs": MAX_N_PROBS + 1}, f"n_probs must be at most {MAX_N_PROBS}"),
    ({"n_probs": -1}, "n_probs"),
    ({"seed": 1.5}, "'seed' must be an integer"),
    ({"seed": 2 ** 64}, "seed must be in [0, 2**64)"),
    ({"max_tokens": "x"}, "'max_tokens' must be an integer"),
    ({"id_slot": -2}, "'id_slot'"),
    ({"stop": [1]}, "'stop' must be a string or an array of strings"),
    ({"stop": ["a"] * 17}, "'stop' allows at most 16"),
    ({"stream": "yes"}, "'stream' must be true or false"),
    ({"ignore_eos": "yes"}, "'ignore_eos'"),
    ({"queue_timeout": -1}, "'queue_timeout'"),
    ({"mirostat": 2}, "'mirostat' = 2 is not supported"),
    ({"lora": [{"id": 0}]}, "'lora'"),
    ({"samplers": ["top_k", "temperature"]}, "fastserve's chain"),
    ({"logit_bias": 5}, "'logit_bias' must be an object"),
    ({"logit_bias": [[7]]}, "pairs"),
    ({"logit_bias": {"7": "x"}}, "biases must be numbers"),
    ({"logit_bias": [[True, 1]]}, "token ids must be integers"),
    ({"logit_bias": {"99999": 1}}, "outside the vocabulary"),
    ({"logit_bias": [["", 1]]}, "has no tokens"),
    ({"logit_bias": {"x" * 300: 1}}, "at most 256 characters"),
    ({"logit_bias": [[7, 1]] * 1025}, "at most 1024"),
    ({"grammar": 5}, "'grammar' must be a string"),
    ({"json_schema": [1]}, "'json_schema'"),
    ({"response_fields": "content"}, "'response_fields'"),
])
def test_completion_checks(tok, body, needle):
    _refused(lambda: _completion(tok, body), needle)


def test_neutral_values_of_unsupported_fields_pass(tok):
    _completion(tok, {"mirostat": 0, "typical_p": 1.0, "lora": [], "n_cmpl": 1,
                      "samplers": ["penalties", "dry", "top_k", "top_p", "min_p", "temperature"]})


@pytest.mark.parametrize("prompt, needle", [
    (None, "'prompt' is required"),
    (5, "'prompt' must be a string, an array"),
    ("", "'prompt' is empty"),
    ([], "'prompt' is empty"),
    ([1, 2.5], "got float at [1]"),
    ([[1], [2, "x", {}]], "'prompt[1]'"),
    (["a"] * (MAX_PROMPTS + 1), f"at most {MAX_PROMPTS}"),
    ("x" * (EXACT_CHARS + 1), "exceeds the available context size"),
])
def test_prompt_checks(tok, prompt, needle):
    _refused(lambda: _parser(tok).completion(_json({"prompt": prompt})), needle)


def test_prompt_limits_of_the_parse(tok):
    parser = _parser(tok)
    longer = parser.chat(_json({"messages": [{"role": "user", "content": "word " * 250}]}))
    assert len(parser.conversation(longer).prompts[0]) > N_CTX     # tokenized whole: the engine refuses it, exactly
    assert parser.completion(_json({"prompt": list(range(1000))})).prompts == [list(range(N_CTX + 1))]  # read no further
    assert parser.prompt(list(range(200)), "content", limit=200) == list(range(200))       # /tokenize's limit
    _refused(lambda: parser.prompt(list(range(201)), "content", limit=200), "more than 200 tokens")


# -- the engine's checks (token ids, room in a slot, max_tokens): once per choice, answered by errors.refused

@pytest.fixture(scope="module")
def engine(tiny_model):
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=N_CTX) as e:
        yield e


def _start(engine, params) -> None:
    """Each choice submitted as App.start_generation does (a Generation), then closed."""
    metrics = SimpleNamespace(rejected=None, llama=LlamaTotals())
    for ids, sampling in params.choices():
        Generation(SimpleNamespace(generation=None), ids, sampling, params, engine=engine, metrics=metrics,
                   inflight=set()).close()


def _spy(monkeypatch, fn) -> list:
    """fn replaced, in every fastserve module that holds it, by a spy: the list of its calls."""
    calls = []

    def spy(*args):
        calls.append(args)
        return fn(*args)
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("fastserve") and getattr(module, fn.__name__, None) is fn:
            monkeypatch.setattr(module, fn.__name__, spy)
    return calls


def test_each_engine_check_runs_once_per_choice(tok, engine, monkeypatch):
    calls = [_spy(monkeypatch, fn) for fn in (check_token_ids, check_context, check_max_tokens)]
    parser = Parser(tok, engine.describe(), ServerConfig())
    params = parser.completions(_json({"prompt": [1, 2, 3], "max_tokens": 2, "n": 2}))
    assert [len(c) for c in calls] == [0, 0, 0]                # the parse leaves them to the engine
    _start(engine, params)
    assert [len(c) for c in calls] == [2, 2, 2]


@pytest.mark.parametrize("body, needle", [
    ({"prompt": [1, -4]}, "token ids must be in [0, 512), got -4"),
    ({"prompt": [1, 512]}, "token ids must be in [0, 512), got 512"),
    ({"prompt": "hi", "n_predict": -2}, "max_tokens (n_predict) must be an integer >= -1"),
    ({"prompt": list(range(N_CTX))}, f"request ({N_CTX} tokens) exceeds the available context size ({N_CTX} tokens)"),
])
def test_the_engines_refusals_are_400s(tok, engine, body, needle):
    params = Parser(tok, engine.describe(), ServerConfig()).completion(_json(body))
    with pytest.raises(RequestError) as exc:
        _start(engine, params)
    err = refused(exc.value)
    assert err.status == 400 and needle in err.message, err.message


def test_a_prompt_must_leave_its_slot_a_token(tok, engine):
    parser = Parser(tok, engine.describe(), ServerConfig())
    _start(engine, parser.completion(_json({"prompt": list(range(N_CTX - 1)), "n_predict": 1})))
    long_chat = parser.conversation(parser.chat(_json({"messages": [{"role": "user", "content": "word " * 50}]})))
    with pytest.raises(ContextExceeded) as exc:
        _start(engine, long_chat)
    assert (exc.value.n_prompt, exc.value.n_ctx) == (len(long_chat.prompts[0]), N_CTX)


def test_a_text_too_long_to_tokenize_whole_is_llama_servers_context_error(tok):
    """Past EXACT_CHARS (and 16 characters a slot token) a text is not tokenized whole on the loop: still
    llama-server's exceed_context_size_error, its n_prompt_tokens estimated from the first EXACT_CHARS."""
    parser = _parser(tok)
    text = "word " * (EXACT_CHARS // 5 * 3)
    per_char = len(tok.encode(text[:EXACT_CHARS], add_special=False)) / EXACT_CHARS
    for fn in (lambda: parser.conversation(parser.chat(_json({"messages": [{"role": "user", "content": text}]}))),
               lambda: parser.completion(_json({"prompt": [1, 2, text]}))):
        err = _refused(fn, "exceeds the available context size")
        assert err.type == "exceed_context_size_error" and err.fields["n_ctx"] == N_CTX
        assert abs(err.fields["n_prompt_tokens"] - per_char * len(text)) < 0.01 * per_char * len(text)
        assert "(about " in err.message


def test_refused_keeps_llama_servers_context_error_in_both_families():
    err = refused(ContextExceeded(300, 256))
    for family in (LLAMA, OPENAI):
        e = err.payload(family)["error"]
        assert (e["type"], e["n_prompt_tokens"], e["n_ctx"]) == ("exceed_context_size_error", 300, 256), e
        assert e["message"].startswith("request (300 tokens) exceeds the available context size (256 tokens)")
    plain = refused(RequestError("top_p must be in [0, 1]"))
    assert (plain.status, plain.type, plain.message, plain.fields) == (400, "invalid_request_error",
                                                                       "top_p must be in [0, 1]", None)


@pytest.mark.parametrize("body, needle", [
    ({"echo": True, "n": 2}, "'echo' with 'n' > 1"),
    ({"echo": True, "stream": True}, "'echo' with 'stream'"),
    ({"best_of": 2}, "'best_of'"),
    ({"suffix": "x"}, "'suffix'"),
    ({"n": MAX_CHOICES + 1}, "'n' must be in"),
    ({"prompt": ["a", "b"], "n": 9}, "make 18 choices"),
    ({"logprobs": 21}, "'logprobs' must be in [0, 20]"),
    ({"stream_options": 5}, "'stream_options'"),
])
def test_openai_completions_checks(tok, body, needle):
    _refused(lambda: _parser(tok).completions(_json({"prompt": "a", **body})), needle)


@pytest.mark.parametrize("body, needle", [
    ({"messages": []}, "'messages'"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"top_logprobs": 3}, "needs 'logprobs'"),
    ({"logprobs": True, "top_logprobs": 50}, "'top_logprobs'"),
    ({"response_format": {"type": "json_object"}, "grammar": "root ::= \"a\""}, "one constraint"),
    ({"tool_choice": "required"}, "needs 'tools'"),
    # as llama-server: an assistant message needs the 'content' key (null will do) or tool_calls
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]}, "neither 'content' nor 'tool_calls'"),
])
def test_chat_checks(tok, body, needle):
    _refused(lambda: _parser(tok).chat(_json({"messages": [{"role": "user", "content": "a"}], **body})), needle)


def test_tools_and_response_format_become_the_constraint(tok):
    parser = _parser(tok)
    chat = {"messages": [{"role": "user", "content": "a"}]}
    assert parser.chat(_json({**chat, "response_format": {"type": "json_object"}})).constraint == \
        {"json_schema": {"type": "object"}}
    p = parser.chat(_json({**chat, "tools": [{"type": "function", "function": {"name": "f"}}]}))
    assert p.tools is not None and p.constraint == {"json_schema": p.tools.schema}
    assert parser.chat(_json({**chat, "grammar": ""})).constraint == {}          # "" means none


def test_the_sampling_is_checked_once_per_request(tiny_model, monkeypatch):
    """SamplingParams.make runs once for a request of n choices: the engine takes the parse's SamplingParams."""
    import asyncio

    import fastserve
    from fastserve.server.app import App
    from fastserve.server.http import HttpRequest
    from fastserve.server.protocol import Exchange

    made = []
    real = SamplingParams.make.__func__
    monkeypatch.setattr(SamplingParams, "make", classmethod(lambda cls, *a, **k: made.append(k) or real(cls, *a, **k)))
    with fastserve.Engine(tiny_model, n_parallel=4, n_ctx=256, n_batch=32) as engine:
        app = App(engine, ServerConfig(log_requests=False))
        req = HttpRequest("POST", "/v1/chat/completions", {"host": "h"},
                          b'{"messages": [{"role": "user", "content": "x"}], "n": 3, "max_tokens": 2, "seed": 5}')
        ex = Exchange(SimpleNamespace(peer="test"), req)
        resp = asyncio.run(app.handle(req, ex))
        assert resp.status == 200 and len(made) == 1
