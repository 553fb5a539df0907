"""The default model as a draft model (--spec-type draft-simple): drafting for itself, greedy output is plain
greedy's, alone and among 7 other busy slots, and every draft is accepted (batch invariance: the draft model's
logits for a position are the model's own, whatever its passes held); drafting for synthetic models of its
vocabulary, greedy output is theirs. Gemma 3 270M drafting for itself likewise."""
import pytest

import fastserve
from fastserve.config import SpecConfig


def _plain_and_drafted(model, draft_path: str, prompts: list, n: int = 24):
    """(plain greedy of each prompt alone, the same with the draft model alone for prompts[0] and for all of
    them at once on 8 slots, the snapshot after)."""
    with fastserve.Engine(model, n_parallel=1, n_ctx=512) as engine:
        plain = [engine.generate(p, max_tokens=n, temperature=0, cache_prompt=False).token_ids for p in prompts]
    spec = SpecConfig(type="draft-simple", draft_model=draft_path)
    with fastserve.Engine(model, n_parallel=8, n_ctx=8 * 512, n_batch=128, speculative=spec) as engine:
        alone = engine.generate(prompts[0], max_tokens=n, temperature=0, cache_prompt=False)
        crowd = [engine.submit(p, max_tokens=n, temperature=0, cache_prompt=False) for p in prompts]
        return plain, alone, [r.result() for r in crowd], engine.snapshot


def test_the_default_model_drafting_for_itself_is_plain_greedy_and_always_right(default_model, reference):
    prompts = [c["prompt_token_ids"] for c in reference["completions"]][:8]
    plain, alone, crowd, snap = _plain_and_drafted(default_model, str(default_model.path), prompts)
    assert alone.token_ids == plain[0]
    assert [c.token_ids for c in crowd] == plain
    assert alone.timings["draft_n"] > 0 and snap.n_drafted > 8 * 4
    assert snap.n_drafted_accepted == snap.n_drafted


@pytest.mark.parametrize("family", ["granite", "phi3"])
def test_the_default_model_drafting_for_a_synthetic_model_of_its_vocabulary_is_plain_greedy(
        default_model, reference, tmp_path, family):
    """A random-weight model of another family with SmolLM2's vocabulary (tests/golden/synthetic_families.py),
    the default model drafting for it: greedy is its plain greedy, alone and among 7 busy slots."""
    from tests.golden.synthetic_families import write
    model = fastserve.load_model(write(family, tmp_path, str(default_model.path)))
    prompts = [c["prompt_token_ids"] for c in reference["completions"]][:8]
    plain, alone, crowd, snap = _plain_and_drafted(model, str(default_model.path), prompts)
    assert alone.token_ids == plain[0]
    assert [c.token_ids for c in crowd] == plain
    assert snap.n_drafted > 0


@pytest.mark.model
def test_gemma3_drafting_for_itself_is_plain_greedy_and_always_right():
    """Gemma 3 270M (`fastserve pull gemma3-270m`, pulled on first use): its sliding-window layers' rings in the
    draft's KV too."""
    from fastserve.models.catalog import model_path
    from tests.reference_data import GOLDEN_DATA, load_reference
    path = str(model_path("gemma3-270m"))
    ref = load_reference(GOLDEN_DATA / "gemma3_270m_q4km_llamacpp_greedy.json")
    prompts = [c["prompt_token_ids_add_special_true"] for c in ref["completions"]][:8]
    plain, alone, crowd, snap = _plain_and_drafted(fastserve.load_model(path), path, prompts)
    assert alone.token_ids == plain[0]
    assert [c.token_ids for c in crowd] == plain
    assert snap.n_drafted > 8 * 4 and snap.n_drafted_accepted == snap.n_drafted
