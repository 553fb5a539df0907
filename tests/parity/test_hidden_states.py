"""The forward pass's hidden-state mode (embeddings: CpuBackend.hidden, the out rows' final states after the output
norm instead of their logits): the C pass and the NumPy reference give the same bits, and the output product of
those states gives the logits forward() computes."""
import numpy as np
import pytest

import fastserve
from fastserve.backends.cpu.backend import CpuBackend
from fastserve.models.synthetic import write_llama_gguf

FAMILIES = {"llama": {}, "qwen3": {}, "gemma3": {"sliding_window": 5}, "qwen3moe": {}}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request, tmp_path_factory):
    path = write_llama_gguf(tmp_path_factory.mktemp("hidden") / f"{request.param}.gguf", architecture=request.param,
                            weight_type="Q8_0", seed=3, n_embd=64, n_head=4, n_head_kv=2, n_ff=96, n_layer=2,
                            **FAMILIES[request.param])
    return fastserve.load_model(path)


def _backend(model, reference=False):
    return CpuBackend(model.config, model.weights, 2, 32, threads=2, max_tokens=32, reference=reference)


def test_c_and_reference_states_agree_bit_for_bit(model):
    ids = np.random.default_rng(0).integers(0, model.config.n_vocab, 12)
    pos, slots, rows = np.arange(12), np.zeros(12, int), np.arange(12)
    c = _backend(model).hidden(ids, pos, slots, rows)
    ref = _backend(model, reference=True).hidden(ids, pos, slots, rows)
    assert c.shape == (12, model.config.n_embd) and c.dtype == np.float32
    assert c.tobytes() == ref.tobytes()


def test_the_states_are_what_the_logits_are_made_of(model):
    """Only the output product (and a model's logit soft-cap) lies between the states and the logits."""
    ids = np.random.default_rng(1).integers(0, model.config.n_vocab, 9)
    pos, slots, rows = np.arange(9), np.zeros(9, int), np.array([0, 4, 8])
    be = _backend(model)
    states = be.hidden(ids, pos, slots, rows)
    logits = _backend(model).forward(ids, pos, slots, rows)
    product = np.zeros_like(logits)
    be._mm(states, model.weights.output, product)
    if model.config.logit_softcap > 0:
        c = model.config.logit_softcap
        product = (c * np.tanh(product / c)).astype(np.float32)
        assert np.allclose(product, logits, atol=1e-5)
    else:
        assert product.tobytes() == logits.tobytes()


def test_hidden_refuses_a_buffer_of_the_wrong_width(model):
    be = _backend(model)
    with pytest.raises(ValueError, match="do not fit"):
        be.hidden([1, 2], [0, 1], [0, 0], [0, 1], out=np.zeros((2, model.config.n_embd + 1), np.float32))
