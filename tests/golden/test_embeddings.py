"""Embeddings of the default model against llama-server's (--embedding --pooling mean / last, -t 2), recorded in
tests/golden/data/smollm2_q41_llamacpp_embeddings.json by tests/golden/record_embeddings.py.

The bar is cosine similarity >= 0.999 per input, not equal bytes: both sides round the activations to int8
before every product, but llama.cpp sums its products and its mean pooling in another order (ggml's kernels
and a float32 matrix product for the mean), so the last bits of every hidden state differ, and the
135M model's 30 layers carry those differences to a few 1e-3 of a unit vector (measured: cosine 0.9994 at
worst, |dx| 0.015 at most). Batch invariance, by contrast, is exact: an input's vector is the same bytes
alone and among 15 others.
"""
from __future__ import annotations

import numpy as np
import pytest

import fastserve
from tests.reference_data import GOLDEN_DATA, load_reference

COSINE_BAR = 0.999


@pytest.fixture(scope="module")
def recorded() -> dict:
    return load_reference(GOLDEN_DATA / "smollm2_q41_llamacpp_embeddings.json")


@pytest.fixture(scope="module")
def engine(default_model):
    eng = fastserve.Engine(default_model, n_parallel=2, n_ctx=2048, threads=2)
    yield eng
    eng.close()


def _cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_the_inputs_tokenize_as_llama_servers(default_model, recorded):
    assert [default_model.tokenizer.encode(t, add_special=True) for t in recorded["texts"]] == recorded["token_ids"]


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_vectors_match_llama_server(engine, recorded, pooling):
    ours = engine.embed(recorded["texts"], pooling=pooling).result(120)
    theirs = recorded["vectors"][pooling]
    assert len(ours) == len(theirs)
    for text, a, b in zip(recorded["texts"], ours, theirs):
        assert a.shape == (len(b),) and a.dtype == np.float32
        assert _cosine(a, b) >= COSINE_BAR, (pooling, text, _cosine(a, b))
        assert abs(np.linalg.norm(a) - 1.0) < 1e-5          # Euclidean, as llama-server's default


def test_token_ids_give_the_texts_vectors(engine, recorded):
    by_text = engine.embed(recorded["texts"]).result(120)
    by_ids = engine.embed(recorded["token_ids"]).result(120)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(by_text, by_ids))


@pytest.mark.parametrize("pooling", ["mean", "last", "cls", "none"])
def test_alone_or_among_fifteen_others_the_same_bytes(engine, recorded, pooling):
    texts = recorded["texts"]
    alone = [engine.embed([t], pooling=pooling).result(120)[0] for t in texts[:2]]
    others = [f"filler number {i}: " + texts[i % len(texts)] * (1 + i % 3) for i in range(14)]
    batch = engine.embed(others[:7] + texts[:2] + others[7:], pooling=pooling).result(120)
    assert batch[7].tobytes() == alone[0].tobytes() and batch[8].tobytes() == alone[1].tobytes()


def test_running_generations_do_not_change_an_embedding(engine, recorded):
    """Embeddings computed while requests decode (their passes interleaved with the steps) are the same bytes."""
    quiet = engine.embed(recorded["texts"]).result(120)
    readers = [engine.submit("Once upon a time", max_tokens=24, temperature=0) for _ in range(2)]
    busy = engine.embed(recorded["texts"]).result(120)
    for r in readers:
        r.result()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(quiet, busy))


def test_pooling_follows_the_hidden_states(default_model, engine, recorded):
    """mean / cls / last / none are the model's final hidden states (after the output norm) pooled: the none
    rows averaged, or their first or last row, normalised, give the other poolings' vectors."""
    from fastserve.embedding import normalize
    text = recorded["texts"][1]
    rows = engine.embed([text], pooling="none").result(60)[0]
    assert rows.shape == (len(recorded["token_ids"][1]), default_model.config.n_embd)
    mean = engine.embed([text], pooling="mean").result(60)[0]
    assert _cosine(mean, rows.astype(np.float64).mean(axis=0)) > 0.999999
    assert engine.embed([text], pooling="cls").result(60)[0].tobytes() == normalize(rows[0], 2).tobytes()
    assert engine.embed([text], pooling="last").result(60)[0].tobytes() == normalize(rows[-1], 2).tobytes()


def test_a_sliding_window_model_chunked_is_one_pass():
    """Gemma 3 270M (local layers of a 512-token window, kept in a ring): an input of 752 tokens embedded in chunks of
    64 beside other inputs, in a slot another input used first, gives every token's state bit for bit as one pass
    of the whole sequence."""
    from fastserve.backends.cpu.backend import CpuBackend
    from fastserve.models.catalog import model_path
    model = fastserve.load_model(model_path("gemma3-270m"))
    text = "In the beginning there was a long story about many different things and people. " * 50
    ids = model.tokenizer.encode(text, add_special=True)[:752]
    assert model.config.sliding_window < len(ids)
    with fastserve.Engine(model, n_parallel=2, n_ctx=4096, threads=2, n_batch=64) as eng:
        rows = eng.embed([[5, 6, 7] * 100, ids], pooling="none").result(300)[1]
    n = len(ids)
    be = CpuBackend(model.config, model.weights, 1, n + 1, threads=2, max_tokens=n)
    positions = np.arange(n)
    assert rows.tobytes() == be.hidden(ids, positions, np.zeros(n), positions).tobytes()
