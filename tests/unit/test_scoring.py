"""Engine.score: each prompt token's log-probability given the tokens before it, against the teacher-forced
logits of Model.logits (computed here, not by the engine), the same alone and beside other work."""
from __future__ import annotations

import numpy as np
import pytest

import fastserve
from fastserve.errors import ContextExceeded, EngineClosed, RequestError
from fastserve.scoring import log_softmax, top_k

PROMPTS = ["the cat sat on the mat", "one two three four five six seven", "a", "hello world, hello again"]


@pytest.fixture(scope="module")
def engine(tiny_model):
    with fastserve.Engine(tiny_model, n_parallel=2, n_ctx=512, threads=1) as eng:
        yield eng


def _expected(model, ids):
    """(logprobs [n] nan first, log-softmax rows [n - 1, n_vocab]) from Model.logits."""
    rows = log_softmax(model.logits(ids))[:-1]
    return np.concatenate([[np.nan], rows[np.arange(len(ids) - 1), ids[1:]]]), rows


def test_scores_are_the_teacher_forced_log_softmax(engine, tiny_model):
    for text in PROMPTS:
        ids = tiny_model.tokenizer.encode(text, add_special=True)
        [s] = engine.score([text], top=3).result(60)
        own, rows = _expected(tiny_model, ids)
        assert len(s.logprobs) == len(ids) and np.isnan(s.logprobs[0])
        np.testing.assert_allclose(s.logprobs[1:], own[1:], rtol=0, atol=1e-9)
        for i in range(1, len(ids)):
            best = np.lexsort((np.arange(rows.shape[1]), -rows[i - 1]))[:3]
            assert s.top_ids[i].tolist() == best.tolist()
            np.testing.assert_allclose(s.top_logprobs[i], rows[i - 1, best], rtol=0, atol=1e-9)
        assert (s.top_ids[0] == -1).all() and np.isnan(s.top_logprobs[0]).all()


def test_the_same_bytes_alone_and_among_other_work(engine, tiny_model):
    alone = [engine.score([p], top=2).result(60)[0] for p in PROMPTS]
    streams = [engine.submit("busy " * 5, max_tokens=40, temperature=0) for _ in range(2)]
    jobs = [engine.score(PROMPTS * 3, top=2) for _ in range(3)]     # 12 prompts each, 4 side by side
    together = [job.result(60) for job in jobs]
    for s in streams:
        s.result()
    for got in together:
        for a, b in zip(alone * 3, got):
            assert a.logprobs.tobytes() == b.logprobs.tobytes()
            assert a.top_ids.tobytes() == b.top_ids.tobytes() and a.top_logprobs.tobytes() == b.top_logprobs.tobytes()


def test_a_prompt_longer_than_a_pass_is_scored_in_chunks(engine, tiny_model):
    ids = (tiny_model.tokenizer.encode(" ".join(PROMPTS * 8), add_special=True) * 2)[:200]     # > SCORE_ROWS
    [s] = engine.score([ids], top=0).result(60)
    own, _ = _expected(tiny_model, ids)
    np.testing.assert_allclose(s.logprobs[1:], own[1:], rtol=0, atol=1e-9)
    assert s.top_ids.shape == (200, 0)


def test_input_is_checked(engine):
    with pytest.raises(RequestError, match="non-empty list"):
        engine.score([])
    with pytest.raises(RequestError, match="top must be"):
        engine.score(["a"], top=-1)
    with pytest.raises(RequestError, match=r"token ids must be in \[0, "):
        engine.score([[1, 10 ** 9]])
    with pytest.raises(ContextExceeded):
        engine.score([[1] * 300])
    with pytest.raises(RequestError, match="is empty"):
        engine.score([[]])


def test_a_closed_engine_refuses(tiny_model):
    eng = fastserve.Engine(tiny_model, n_parallel=1, n_ctx=64, threads=1)
    eng.close()
    with pytest.raises(EngineClosed):
        eng.score(["a"])


def test_top_k_is_ordered_with_ties_to_the_lower_id():
    lp = np.array([[-1.0, -0.5, -0.5, -3.0, -0.5]])
    assert top_k(lp, 2).tolist() == [[1, 2]]
    assert top_k(lp, 4).tolist() == [[1, 2, 4, 0]]
    assert top_k(lp, 0).shape == (1, 0)


def test_log_softmax_is_normalised_per_row():
    x = np.array([[1000.0, 1000.0], [0.0, np.log(3.0)]], np.float32)
    got = log_softmax(x)
    np.testing.assert_allclose(np.exp(got).sum(axis=1), [1.0, 1.0], rtol=1e-12)
    np.testing.assert_allclose(got[0], [np.log(0.5)] * 2, rtol=1e-12)


def test_a_scorer_that_cannot_be_made_fails_the_job_not_the_engine(tiny_model, monkeypatch):
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=64, threads=1) as eng:
        monkeypatch.setattr(type(eng), "_make_scorer", lambda self: (_ for _ in ()).throw(MemoryError("no room")))
        with pytest.raises(RequestError, match="prompt scores are not available: MemoryError: no room"):
            eng.score(["a b"]).result(30)
        assert len(eng.generate("hi", max_tokens=2, temperature=0).token_ids) == 2     # the decode thread lives
        monkeypatch.undo()
        assert len(eng.score(["a b"]).result(30)[0].logprobs) == len(tiny_model.tokenizer.encode("a b"))


def test_a_failed_pass_fails_its_jobs_and_the_next_job_is_scored(tiny_model, monkeypatch):
    from fastserve.scoring import Scorer
    real = Scorer._pass
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=64, threads=1) as eng:
        monkeypatch.setattr(Scorer, "_pass", lambda self, n: (_ for _ in ()).throw(FloatingPointError("bad row")))
        with pytest.raises(RequestError, match="scoring failed: FloatingPointError: bad row"):
            eng.score(["the cat sat", "a b c"]).result(30)
        monkeypatch.setattr(Scorer, "_pass", real)
        [s] = eng.score(["the cat sat"]).result(30)
        assert np.isfinite(s.logprobs[1:]).all()
        assert eng.embed(["a"]).result(30)[0].shape == (eng.describe().n_embd,)    # the other side pass unharmed


def test_a_cancelled_job_leaves_its_prompts_unscored(tiny_model):
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=256, threads=1) as eng:
        job = eng.score([[5] * 200] * 12)
        job.cancel()
        done = eng.score(["a b"])
        done.result(30)                     # a later job is answered: the cancelled one did not hold the pass
        assert not job.future.done()        # nobody waits for it: no answer is made
        assert not any(p.busy for p in eng._passes.values())
