"""fastserve/embedding.py and Engine.embed on the tiny model: llama.cpp's normalisations, the checks of a job's
inputs and options, a cancelled job, a job met by the engine's close, and a failing pass."""
import numpy as np
import pytest

import fastserve
from fastserve.embedding import normalize
from fastserve.errors import ContextExceeded, EngineClosed, RequestError


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = fastserve.Engine(tiny_model, n_parallel=2, n_ctx=64, threads=1)
    yield eng
    eng.close()


@pytest.mark.parametrize("norm, expect", [(-1, [3.0, -4.0]), (0, [3 * 32760 / 4, -32760.0]), (1, [3 / 7, -4 / 7]),
                                          (2, [0.6, -0.8]), (3, [3 / 91 ** (1 / 3), -4 / 91 ** (1 / 3)])])
def test_normalize_as_llama_cpp(norm, expect):
    out = normalize(np.array([3.0, -4.0], np.float32), norm)
    assert out.dtype == np.float32 and np.allclose(out, expect, rtol=1e-6)


def test_a_zero_vector_stays_zero():
    assert normalize(np.zeros(4, np.float32), 2).tolist() == [0.0] * 4


def test_inputs_and_options_are_checked(engine):
    for bad, says in [([], "non-empty list"), ("text", "non-empty list"), ([3.5], "input 0 must be"),
                      ([[1, True]], "input 0 must be"), ([[]], "input 0 is empty"), ([[10 ** 6]], "token ids")]:
        with pytest.raises(RequestError, match=says):
            engine.embed(bad)
    with pytest.raises(RequestError, match="pooling must be one of"):
        engine.embed(["a"], pooling="rank")
    with pytest.raises(RequestError, match="embd_normalize"):
        engine.embed(["a"], normalize=-3)
    with pytest.raises(ContextExceeded):
        engine.embed([[1] * 33])                         # a slot holds 32 tokens
    assert len(engine.embed([[1] * 32]).result(30)[0]) == engine.describe().n_embd     # a full slot is taken


def test_a_cancelled_job_is_skipped_and_the_next_is_answered(engine):
    job = engine.embed([[5] * 30] * 40)
    job.cancel()
    after = engine.embed(["hello"]).result(30)
    assert after[0].shape == (engine.describe().n_embd,)
    assert job.n_left > 0 and not job.future.done()    # skipped: never answered, its inputs never all computed


def test_a_failing_pass_fails_its_job_and_the_engine_goes_on(tiny_model, monkeypatch):
    from fastserve.backends.cpu.backend import CpuBackend
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=64, threads=1) as eng:
        eng.embed(["warm"]).result(30)                  # the embedder exists
        real = CpuBackend.hidden
        monkeypatch.setattr(CpuBackend, "hidden", lambda *a, **k: (_ for _ in ()).throw(MemoryError("boom")))
        with pytest.raises(RequestError, match="embedding failed: MemoryError: boom"):
            eng.embed(["a", "b"]).result(30)
        monkeypatch.setattr(CpuBackend, "hidden", real)
        assert eng.embed(["a"]).result(30)[0].shape == (eng.describe().n_embd,)
        assert len(eng.generate("hi", max_tokens=2, temperature=0).token_ids) == 2


def test_close_answers_every_job(tiny_model):
    eng = fastserve.Engine(tiny_model, n_parallel=1, n_ctx=64, threads=1)
    jobs = [eng.embed([[7] * 30] * 20) for _ in range(3)]
    eng.close()
    for job in jobs:
        try:
            job.result(10)
        except EngineClosed:
            pass
        assert job.future.done()
    with pytest.raises(EngineClosed):
        eng.embed(["late"])


def test_the_tracer_counts_an_embedding_pass_as_forward(tiny_model):
    """A step that only embeds is a step, its pass the forward phase (not the next step's admit)."""
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=64, threads=1, trace=True) as eng:
        eng.embed(["warm"]).result(30)
        before = eng.trace_totals()
        eng.embed([[5] * 30] * 12).result(30)
        s = eng.trace_summary(since=before)
    assert s["steps"] >= 3                              # 12 inputs, 4 side by side
    ms = s["ms_per_step"]
    assert ms["forward"] > ms["admit"] and ms["forward"] > ms["publish"], ms


def test_an_embedder_that_cannot_be_made_fails_the_job_not_the_engine(tiny_model, monkeypatch):
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=64, threads=1) as eng:
        monkeypatch.setattr(type(eng), "_make_embedder", lambda self: (_ for _ in ()).throw(MemoryError("no room")))
        with pytest.raises(RequestError, match="embeddings are not available: MemoryError: no room"):
            eng.embed(["a"]).result(30)
        assert len(eng.generate("hi", max_tokens=2, temperature=0).token_ids) == 2     # the decode thread lives
        monkeypatch.undo()
        assert eng.embed(["a"]).result(30)[0].shape == (eng.describe().n_embd,)


def test_a_future_cancelled_by_its_waiter_takes_no_answer_and_harms_nothing(engine):
    job = engine.embed([[5] * 30] * 8)
    assert job.future.cancel()                          # what asyncio.wrap_future does when the request goes away
    job.cancel()
    assert engine.embed(["after"]).result(30)[0].shape == (engine.describe().n_embd,)
    from fastserve.embedding import EmbedJob
    late = EmbedJob([np.array([1], np.int32)], "mean", 2)
    late.future.cancel()
    late._done([np.zeros(2)])                           # the decode thread answering a moment too late
    late._done(error=RequestError("x"))
