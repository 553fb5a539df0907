"""Speculative decoding gives plain greedy, token for token, for every drafter on the synthetic families (random
weights, SmolLM2's vocabulary: tests/golden/synthetic_families.py) and on Gemma 3 270M, one request alone and
8 at once (issue 26): ngram-simple and ngram-mod (1-token lookups, so that the random models' repeats are
drafted), the Oracle (right for a while, then wrong: verifications reject, so a rejected position left in the
KV or the sliding-window ring changes what follows) and a draft model (the default model for the synthetic
families, whose vocabulary they share; Gemma 3 for itself). Every draft is tried (the policy's bar at 0): the
drafts are under test here, not the policy."""
from __future__ import annotations

import pytest

import fastserve
from fastserve.config import SpecConfig
from tests.golden import synthetic_families
from tests.oracle_drafter import ORACLE, Oracle
from tests.reference_data import GOLDEN_DATA, default_model_or_skip, load_reference

FAMILIES = ["granite", "smollm3", "phi3", pytest.param("gemma3", marks=pytest.mark.model)]
N_TOKENS = 32


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, model, its draft model's path, 8 prompts llama.cpp evaluated, plain greedy of each alone)."""
    name = request.param
    if name == "gemma3":
        from fastserve.models.catalog import model_path
        path = draft = str(model_path("gemma3-270m"))
        ref = load_reference(GOLDEN_DATA / "gemma3_270m_q4km_llamacpp_greedy.json")
    else:
        draft = default_model_or_skip(f"{name}'s synthetic model")
        path = synthetic_families.write(name, tmp_path_factory.mktemp(name), draft)
        ref = load_reference(GOLDEN_DATA / f"{name}_synth_llamacpp_greedy.json")
    model = fastserve.load_model(path)
    key = "prompt_token_ids_add_special_true" if model.tokenizer.add_bos else "prompt_token_ids"
    prompts = [c[key] for c in ref["completions"]][:8]
    with fastserve.Engine(model, n_parallel=1, n_ctx=512) as engine:
        plain = [engine.generate(p, max_tokens=N_TOKENS, temperature=0, cache_prompt=False).token_ids
                 for p in prompts]
    return name, model, draft, prompts, plain


def _repeats(prompt, output) -> int:
    """Output positions whose previous token came before (where a 1-token lookup finds something to draft)."""
    seq = list(prompt) + list(output)
    return sum(seq[j - 1] in seq[:j - 1] for j in range(len(prompt), len(seq)))


DRAFTERS = {"ngram-simple": lambda draft: SpecConfig(type="ngram-simple", simple_size_n=1, simple_size_m=8),
            "ngram-mod": lambda draft: SpecConfig(type="ngram-mod", mod_n_match=1, mod_n_min=1, mod_n_max=8),
            "oracle": lambda draft: ORACLE,
            "draft-model": lambda draft: SpecConfig(type="draft-simple", draft_model=draft)}


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_every_drafter_gives_plain_greedy_alone_and_among_7_busy_slots(family, drafter):
    name, model, draft, prompts, plain = family
    spec = DRAFTERS[drafter](draft)
    i = max(range(len(prompts)), key=lambda i: _repeats(prompts[i], plain[i]))     # alone: an n-gram finds drafts
    for some in ([i], range(len(prompts))):
        with fastserve.Engine(model, n_parallel=8, n_ctx=8 * 512, n_batch=128, speculative=spec) as engine:
            if spec is ORACLE:
                engine._spec.drafter = Oracle([list(p) + a for p, a in zip(prompts, plain)], model.config.n_vocab)
            engine._spec.cost.bar = lambda n_rows: 0.0
            readers = [engine.submit(prompts[j], max_tokens=N_TOKENS, temperature=0, cache_prompt=False) for j in some]
            got = [r.result().token_ids for r in readers]
            snap = engine.snapshot
        assert got == [plain[j] for j in some], (name, drafter, len(some))
        assert snap.n_drafted > 0, (name, drafter, len(some))
        if spec is ORACLE:
            assert 0 < snap.n_drafted_accepted < snap.n_drafted
