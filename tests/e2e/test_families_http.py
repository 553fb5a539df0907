"""Every family over HTTP (issue 13, point 5): one server per model, the same requests to each.

    gemma3-tiny   the synthetic Gemma 3 of tests/golden/test_swa_ring.py (window 8), written here: needs nothing
    qwen2, qwen3, llama3
                  ../shared/reference/models/<family>-synth.gguf (skipped without ../shared)
    granite, smollm3, phi3
                  tests/golden/synthetic_families.py's models, written here (the default model's vocabulary)
    gemma3-270m   Gemma 3 270M Q4_K_M (`fastserve pull gemma3-270m`; marked `model`; window 512)

Both Gemmas are served with -b 32, so that their local layers keep a ring smaller than a slot's context.

Each server gets /v1/completions and /v1/chat/completions (streamed and not, logprobs, stop strings),
/completion (n_probs, tokens), prefix reuse (cache_prompt: the second request reuses its prefix and gives
the same greedy tokens), the host-RAM cache (slot 0's prefix evicted by another prompt, then restored),
and two prompts decoded together giving what each gives alone. Greedy throughout.
"""
from __future__ import annotations

import json
from typing import NamedTuple

import httpx
import pytest

from tests.golden import synthetic_families
from tests.reference_data import default_model_or_skip, shared_model

from .conftest import ServerProc

N_PREDICT = 8
# Text prompts: a short one, a long one, and a distinct one per test, so that no test finds another's
# prefix in the server.
SHORT = "The quick brown fox"
LONG = ("Once upon a time, in a small village by the sea, there lived an old fisherman who every morning "
        "walked to the harbour, checked his nets, mended the torn ones, and told the children stories "
        "about the storms he had seen and the fish that got away.")
# The shared synthetic files and Gemma 3 270M's GGUF carry no chat template: chat goes through ChatML (the
# regenerated ones carry ChatML's own)
NO_TEMPLATE = ("--chat-template", "chatml")


class Family(NamedTuple):
    flags: tuple        # server flags beyond the common ones
    window: int = 0     # sliding window (0: none)
    ring: int = 0       # positions its local layers keep per slot with those flags (0: every position)
    n_long: int = 1     # copies of LONG in its long prompt (_story): enough to wrap the ring


# -b 32: rings of window + 31 positions in whole K tiles, below the slot's context
FAMILY = {"gemma3-tiny": Family(("-c", "1024", "-b", "32"), 8, 64),
          "qwen2": Family(("-c", "1024", *NO_TEMPLATE)), "qwen3": Family(("-c", "1024", *NO_TEMPLATE)),
          "llama3": Family(("-c", "1024", *NO_TEMPLATE)), "granite": Family(("-c", "1024",)),
          "smollm3": Family(("-c", "1024",)), "phi3": Family(("-c", "1024",)),
          "gemma3-270m": Family(("-c", "2048", "-b", "32", *NO_TEMPLATE), 512, 576, 14)}
FAMILIES = ["gemma3-tiny", "qwen2", "qwen3", "llama3", "granite", "smollm3", "phi3", pytest.param("gemma3-270m", marks=pytest.mark.model)]


def _story(name: str, title: str) -> str:
    """A long prompt: longer than the family's ring, in tokens."""
    return title + " " + " ".join([LONG] * FAMILY[name].n_long)


def _model_path(name: str, tmp_path_factory) -> str:
    if name == "gemma3-tiny":
        from fastserve.models.synthetic import write_llama_gguf
        return write_llama_gguf(tmp_path_factory.mktemp("gemma") / "gemma3.gguf", architecture="gemma3",
                                n_layer=7, head_dim=24, sliding_window=8, seed=3)
    if name == "gemma3-270m":
        from fastserve.models.catalog import model_path
        return model_path("gemma3-270m")
    if name in synthetic_families.SPECS:
        return synthetic_families.write(name, tmp_path_factory.mktemp(name), default_model_or_skip(name))
    return shared_model(f"{name}-synth.gguf")


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    """(family name, httpx client) of a server on the family's model: 2 slots, 64 MiB of host-RAM cache."""
    name = request.param
    srv = ServerProc(_model_path(name, tmp_path_factory), tmp_path_factory.mktemp("srv") / f"{name}.log",
                     "-np", "2", "--cache-ram", "64", "-n", str(N_PREDICT), "--timeout", "30", *FAMILY[name].flags)
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            yield name, c
    finally:
        srv.kill()


def _post(c: httpx.Client, path: str, body: dict) -> dict:
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _sse(c: httpx.Client, path: str, body: dict) -> list[dict]:
    """The data events of a streamed request (without the final [DONE])."""
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
    return [json.loads(x) for x in lines if x != "[DONE]"]


def _completion(c, prompt, **kw) -> dict:
    """/completion, greedy, with the generated token ids."""
    return _post(c, "/completion", {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0,
                                    "return_tokens": True, **kw})


def _stop_in(text: str) -> str:
    """Two characters from the middle of a greedy text, to stop at (skips when there are none)."""
    stop = next((text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip(f"the greedy text {text!r} has no two characters to stop at")
    return stop


def test_v1_completions(served):
    _, c = served
    body = {"prompt": SHORT, "max_tokens": N_PREDICT, "temperature": 0, "logprobs": 3}
    r = _post(c, "/v1/completions", body)
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert r["usage"]["completion_tokens"] == len(lp["tokens"]) > 0
    assert "".join(lp["tokens"]) == choice["text"]
    # greedy: each token is its row's most probable (two tokens reading alike, as byte tokens that are no
    # UTF-8 alone do, share one key: the more probable one's)
    assert all(0 < len(top) <= 3 and top[s] == max(top.values()) == t
               for s, top, t in zip(lp["tokens"], lp["top_logprobs"], lp["token_logprobs"]))
    events = _sse(c, "/v1/completions", body)
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    assert events[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    # a stop string from the middle of that text: the text up to it, finish_reason "stop"
    text = choice["text"]
    stop = _stop_in(text)
    r = _post(c, "/v1/completions", {**body, "stop": [stop]})["choices"][0]
    assert (r["text"], r["finish_reason"]) == (text[:text.index(stop)], "stop")
    events = _sse(c, "/v1/completions", {**body, "stop": [stop]})
    assert "".join(e["choices"][0]["text"] for e in events) == text[:text.index(stop)]


def test_v1_chat_completions(served):
    _, c = served
    body = {"messages": [{"role": "user", "content": SHORT}], "max_tokens": N_PREDICT, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    r = _post(c, "/v1/chat/completions", body)
    choice = r["choices"][0]
    content = choice["logprobs"]["content"]
    assert r["usage"]["completion_tokens"] == len(content) > 0
    assert "".join(t["token"] for t in content) == choice["message"]["content"]
    assert all(len(t["top_logprobs"]) == 2 and t["top_logprobs"][0]["logprob"] >= t["logprob"] for t in content)
    events = _sse(c, "/v1/chat/completions", body)
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert streamed == choice["message"]["content"]
    text = choice["message"]["content"]
    stop = _stop_in(text)
    r = _post(c, "/v1/chat/completions", {**body, "stop": stop})["choices"][0]
    assert (r["message"]["content"], r["finish_reason"]) == (text[:text.index(stop)], "stop")


def test_llama_completion(served):
    _, c = served
    r = _completion(c, SHORT, n_probs=2, cache_prompt=False)
    assert len(r["tokens"]) == r["tokens_predicted"] == len(r["completion_probabilities"]) > 0
    assert [p["id"] for p in r["completion_probabilities"]] == r["tokens"]
    assert all(len(p["top_logprobs"]) == 2 for p in r["completion_probabilities"])
    events = _sse(c, "/completion", {"prompt": SHORT, "n_predict": N_PREDICT, "temperature": 0,
                                     "return_tokens": True, "cache_prompt": False})
    assert [t for e in events for t in e["tokens"]] == r["tokens"]
    assert "".join(e["content"] for e in events) == r["content"]


def test_prefix_reuse(served):
    """The same long prompt twice: the second reuses all of it but its last token, with the same tokens;
    a prompt sharing only its beginning reuses that, except where a ring no longer holds it."""
    name, c = served
    fam = FAMILY[name]
    prompt = _story(name, "Prefix reuse.")
    cold = _completion(c, prompt, cache_prompt=False)
    warm = _completion(c, prompt)
    n = warm["tokens_evaluated"]
    assert warm["timings"]["cache_n"] == n - 1 and warm["tokens"] == cold["tokens"]
    slot = next(s for s in c.get("/slots").json() if s["id"] == warm["id_slot"])
    n_held = n + len(warm["tokens"]) - 1
    assert slot["n_tokens"] == n_held
    if fam.ring:    # the ring holds the last `ring` positions: a continuation needs the window before it
        assert n_held > fam.ring
        assert (slot["n_swa"], slot["swa_ring"], slot["swa_reusable"]) == (
            fam.window, fam.ring, [n_held - fam.ring + fam.window - 1, n_held])
    else:
        assert (slot["swa_ring"], slot["swa_reusable"]) == (0, [0, n_held])
    # a prompt sharing its first sixth, on that slot (its reference computed on the other one)
    part = prompt[:len(prompt) // 6] + " and then something else entirely happened."
    cold = _completion(c, part, cache_prompt=False, id_slot=1 - slot["id"])
    warm = _completion(c, part, id_slot=slot["id"])
    shared = warm["timings"]["cache_n"]
    assert warm["tokens"] == cold["tokens"]
    if fam.ring:    # the ring holds too little of that part: none of it is reused, rather than garbage
        # (Gemma 3 270M's prompts begin with BOS, which the host-RAM cache restores when it holds an entry)
        assert shared in ((0, 1) if name == "gemma3-270m" else (0,))
    else:
        assert 0 < shared < n - 1


def test_a_free_slot_is_chosen_by_the_prefix_it_can_reuse(served):
    """Slot 0 holds a long prompt a, slot 1 a short b sharing k tokens with it; the prompt shares 2k with a.
    Without a window it goes to slot 0 and reuses 2k. With one, slot 0's ring no longer holds those 2k
    (/slots: reusable only from lo > 2k) while slot 1 holds all of b: it goes to slot 1 and reuses k."""
    name, c = served
    fam = FAMILY[name]
    tokenize = lambda text, bos=False: _post(c, "/tokenize", {"content": text, "add_special": bos})["tokens"]
    a = tokenize(_story(name, "Slot choice."), True)
    tail = [t for t in range(3, 500) if t not in a][:3]         # ids a does not hold: it diverges there
    n_held_a = len(a) + N_PREDICT - 1
    # windowed: b all in slot 1's ring, and 2k short of what slot 0's ring can reuse (from lo on); short
    k = (min(48, fam.ring - len(tail) - N_PREDICT + 1, (n_held_a - fam.ring + fam.window - 2) // 2)
         if fam.ring else len(a) // 3)
    b, prompt = a[:k] + tail, a[:2 * k] + tail
    _completion(c, a, id_slot=0, cache_prompt=False)
    _completion(c, b, id_slot=1, cache_prompt=False)
    s0, s1 = c.get("/slots").json()
    if fam.ring:
        assert s0["swa_reusable"][0] > 2 * k and s1["swa_reusable"] == [0, len(b) + N_PREDICT - 1]
    r = _completion(c, prompt)
    assert (r["id_slot"], r["timings"]["cache_n"]) == ((1, k) if fam.ring else (0, 2 * k))
    assert r["tokens"] == _completion(c, prompt, cache_prompt=False)["tokens"]


def test_host_ram_cache_restores_an_evicted_prefix(served):
    """Slot 0's prefix goes to the host-RAM cache when another prompt takes the slot, and comes back."""
    _, c = served
    prompt = "Host cache. " + LONG
    first = _completion(c, prompt, id_slot=0, cache_prompt=False)
    _completion(c, "Something unrelated to the story, said before it is told again.", id_slot=0)
    again = _completion(c, prompt, id_slot=0)
    assert again["timings"]["cache_n"] == again["tokens_evaluated"] - 1
    assert again["tokens"] == first["tokens"]


def test_two_prompts_together_give_what_each_gives_alone(served):
    _, c = served
    prompts = ["Batch invariance, first. " + LONG, "Batch invariance, second: " + SHORT]
    alone = [_completion(c, p, cache_prompt=False)["tokens"] for p in prompts]
    together = _post(c, "/completion", {"prompt": prompts, "n_predict": N_PREDICT, "temperature": 0,
                                        "return_tokens": True, "cache_prompt": False})
    assert [r["tokens"] for r in together] == alone
