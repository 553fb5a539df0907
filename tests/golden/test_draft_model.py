"""The default model drafting for itself (--spec-type draft-simple, -md the same file): greedy output is plain
greedy's, alone and among 7 other busy slots, and every draft is accepted (batch invariance: the draft model's
logits for a position are the model's own, whatever its passes held)."""
import fastserve
from fastserve.config import SpecConfig


def test_the_default_model_drafting_for_itself_is_plain_greedy_and_always_right(default_model, reference):
    prompts = [c["prompt_token_ids"] for c in reference["completions"]][:8]
    with fastserve.Engine(default_model, n_parallel=1, n_ctx=512) as engine:
        plain = [engine.generate(p, max_tokens=24, temperature=0, cache_prompt=False).token_ids for p in prompts]
    spec = SpecConfig(type="draft-simple", draft_model=str(default_model.path))
    with fastserve.Engine(default_model, n_parallel=8, n_ctx=8 * 512, n_batch=128, speculative=spec) as engine:
        alone = engine.generate(prompts[0], max_tokens=24, temperature=0, cache_prompt=False)
        crowd = [engine.submit(p, max_tokens=24, temperature=0, cache_prompt=False) for p in prompts]
        crowd = [r.result() for r in crowd]
        snap = engine.snapshot
    assert alone.token_ids == plain[0]
    assert [c.token_ids for c in crowd] == plain
    assert alone.timings["draft_n"] > 0 and snap.n_drafted > 8 * 4
    assert snap.n_drafted_accepted == snap.n_drafted
