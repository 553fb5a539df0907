"""The model math against llama.cpp's outputs on the default model (tests/golden/data, from shared/reference).

Teacher forcing: feed prompt + llama.cpp's generated tokens, compare next-token
distributions position by position. Free running: our greedy continuation
through the Engine must equal llama.cpp's for 16 tokens, except for a first
divergence at a near-tie (we took another of llama.cpp's candidates within 0.02 of its top).
Both with the KV cache in f16 (the default) and in f32.
"""
from pathlib import Path

import numpy as np
import pytest

import fastserve

NEAR_TIE = 0.02
CACHE_TYPES = ("f16", "f32")


def _softmax(row):
    p = np.exp(row.astype(np.float64) - row.max())
    return p / p.sum()


@pytest.fixture(scope="module", params=CACHE_TYPES)
def teacher_forced(default_model, reference, request):
    """Per generated position: (our argmax, our probs, llama.cpp's top5 entry), KV cache in request.param."""
    out = []
    for case in reference["completions"]:
        prompt = case["prompt_token_ids"]
        logits = default_model.logits(prompt + case["generated_token_ids"], request.param, request.param)
        for entry in case["top5_per_position"]:
            row = logits[len(prompt) - 1 + entry["pos"]]
            out.append((int(np.argmax(row)), _softmax(row), entry))
    return out


def test_teacher_forced_argmax_agreement(teacher_forced):
    agree = 0
    for ours, _, entry in teacher_forced:
        top = entry["top5"]
        near_tie = top[0]["prob"] - top[1]["prob"] <= NEAR_TIE
        agree += ours == entry["id"] or (near_tie and ours in (top[0]["id"], top[1]["id"]))
    rate = agree / len(teacher_forced)
    print(f"argmax agreement {agree}/{len(teacher_forced)} = {rate:.4f}")
    assert rate >= 0.98


def test_teacher_forced_top5_probabilities(teacher_forced):
    worst = [max(abs(p[t["id"]] - t["prob"]) for t in entry["top5"]) for _, p, entry in teacher_forced]
    median = float(np.median(worst))
    print(f"median max|dp| over llama.cpp's top-5: {median:.4f}")
    assert median <= 0.03


@pytest.mark.parametrize("cache_type", CACHE_TYPES)
def test_greedy_continuations_match(default_model, reference, cache_type):
    cases = reference["completions"]
    with fastserve.Engine(default_model, n_parallel=4, n_ctx=2048, cache_type_k=cache_type,
                          cache_type_v=cache_type) as engine:
        readers = [engine.submit(c["prompt_token_ids"], max_tokens=16, temperature=0, cache_prompt=False)
                   for c in cases]
        ours = [r.result().token_ids for r in readers]
    flips = []
    for case, got in zip(cases, ours):
        want = case["generated_token_ids"][:16]
        n = min(len(got), len(want))
        first = next((i for i in range(n) if got[i] != want[i]), None)
        if first is None:
            assert len(got) == len(want), f"{case['name']}: {len(got)} tokens, llama.cpp {len(want)}"
            continue
        # A near-tie: our token is one of llama.cpp's candidates within NEAR_TIE of its top (two-way
        # mostly; long_history_~300tok opens on a three-way tie, its top three within 0.011).
        top = case["top5_per_position"][first]["top5"]
        gap = next((top[0]["prob"] - t["prob"] for t in top[1:] if t["id"] == got[first]), None)
        assert gap is not None and gap <= NEAR_TIE, (
            f"{case['name']}: diverges at {first} ({got[first]} vs {want[first]}) outside a near-tie")
        flips.append((case["name"], first, round(gap, 4)))
    print(f"near-tie flips: {flips}")


def test_greedy_is_batch_invariant_on_the_default_model(default_model, reference):
    """A request's greedy tokens are the same alone and among 31 concurrent others (prompt chunking,
    batch composition and slot all differ between the two runs)."""
    prompts = [c["prompt_token_ids"] for c in reference["completions"]]
    crowd_prompts = (prompts * 3)[:32]
    with fastserve.Engine(default_model, n_parallel=32, n_ctx=32 * 512, n_batch=256) as engine:
        crowd = [engine.submit(p, max_tokens=16, temperature=0, cache_prompt=False) for p in crowd_prompts]
        crowd = [r.result().token_ids for r in crowd]
    with fastserve.Engine(default_model, n_parallel=1, n_ctx=512) as engine:
        alone = [engine.generate(p, max_tokens=16, temperature=0, cache_prompt=False).token_ids for p in prompts[:6]]
    for i, want in enumerate(alone):
        assert crowd[i] == want and crowd[i + 13] == want, f"prompt {i} differs in company"


def test_long_prompt_greedy_is_the_same_whatever_the_prefill_chunk(default_model):
    """A 1,100-token prompt prefilled 512 tokens a step or 96 in a q8_0 cache: the same greedy
    continuation (attention's key tiles sit at fixed positions, whatever the chunk). The f16 cache,
    the default, is checked on a 4k-token prompt below."""
    text = "\n".join(p.read_text(errors="replace") for p in sorted(Path(fastserve.__file__).parent.glob("*.py")))
    ids = default_model.tokenizer.encode(text, add_special=False)[:1100]
    outs = {}
    for n_batch in (512, 96):
        with fastserve.Engine(default_model, n_parallel=1, n_ctx=2048, n_batch=n_batch, cache_type_k="q8_0",
                              cache_type_v="q8_0") as engine:
            outs[n_batch] = engine.generate(ids, max_tokens=8, temperature=0, cache_prompt=False).token_ids
    assert outs[512] == outs[96] and len(outs[512]) == 8


@pytest.mark.model
def test_4k_prompt_greedy_is_the_same_whatever_the_prefill_chunk(default_model):
    """A 4,000-token prompt (issue 19) prefilled 512 tokens a step or 131 (no multiple of the key
    tiles' 64): the same greedy continuation. About 2 x 4k prompt tokens: the slowest golden test."""
    text = "\n".join(p.read_text(errors="replace") for p in sorted(Path(fastserve.__file__).parent.rglob("*.py")))
    ids = default_model.tokenizer.encode(text, add_special=False)[:4000]
    assert len(ids) == 4000
    outs = {}
    for n_batch in (512, 131):
        with fastserve.Engine(default_model, n_parallel=1, n_ctx=4096 + 64, n_batch=n_batch) as engine:
            outs[n_batch] = engine.generate(ids, max_tokens=8, temperature=0, cache_prompt=False).token_ids
    assert outs[512] == outs[131] and len(outs[512]) == 8
