"""Loading weights of every quantized type, the forward pass, and batch invariance of the NumPy backend."""
import numpy as np
import pytest

import fastserve
from fastserve.backends.cpu.backend import CpuBackend
from fastserve.models.synthetic import write_llama_gguf


def test_tiny_model_loads(tiny_model):
    cfg = tiny_model.config
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.n_vocab) == (2, 64, 4, 2, 512)
    assert tiny_model.tokenizer.n_vocab == 512


def test_logits_shape_and_dtype(tiny_model):
    out = tiny_model.logits([5, 6, 7, 8])
    assert out.shape == (4, 512) and out.dtype == np.float32
    assert np.isfinite(out).all()
    assert tiny_model.logits([]).shape == (0, 512)
    with pytest.raises(ValueError):
        tiny_model.logits([512])


def test_logits_are_causal(tiny_model):
    """Row i depends only on tokens 0..i."""
    a = tiny_model.logits([5, 6, 7, 8])
    b = tiny_model.logits([5, 6, 7, 99])
    np.testing.assert_array_equal(a[:3], b[:3])
    assert not np.array_equal(a[3], b[3])


@pytest.mark.parametrize("qtype,tol", [("F16", 1e-3), ("BF16", 5e-3), ("Q8_0", 1e-2), ("Q5_0", 5e-2),
                                       ("Q5_1", 5e-2), ("Q4_0", 0.1), ("Q4_1", 0.1)])
def test_quantized_weights_match_f32(tmp_path, qtype, tol):
    """The same random model written in another tensor type: weights within the type's quantization
    error (relative RMS), and logits that still agree (correlation)."""
    ref = fastserve.load_model(write_llama_gguf(tmp_path / "f32.gguf", seed=3))
    q = fastserve.load_model(write_llama_gguf(tmp_path / f"{qtype}.gguf", seed=3, weight_type=qtype))
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        a, b = getattr(ref.weights.layers[1], name).to_float(), getattr(q.weights.layers[1], name).to_float()
        rel = np.sqrt(np.mean((a - b) ** 2) / np.mean(a ** 2))
        assert 0 < rel < tol, f"{qtype} {name}: relative RMS error {rel}"
    ids = [10, 200, 33, 4, 71, 300]
    a, b = ref.logits(ids).ravel(), q.logits(ids).ravel()
    assert np.corrcoef(a, b)[0, 1] > 0.95


def _forward_rows(backend, seqs):
    """Run several sequences (slot i = seqs[i]) in one batch, all from position 0; return per-token logits."""
    toks, pos, slots = [], [], []
    for s, seq in enumerate(seqs):
        toks += seq
        pos += list(range(len(seq)))
        slots += [s] * len(seq)
    rows = np.arange(len(toks))
    out = backend.forward(np.array(toks, np.int32), np.array(pos), np.array(slots), rows)
    split = np.cumsum([len(s) for s in seqs])[:-1]
    return np.split(out, split)


@pytest.fixture(scope="module")
def q4_k_m_model(tmp_path_factory):
    """A small model in llama.cpp's Q4_K_M mix: Q|K|V and gate|up stack Q4_K with Q6_K parts."""
    path = write_llama_gguf(tmp_path_factory.mktemp("q4km") / "q4km.gguf", n_embd=256, n_ff=512, seed=4,
                            weight_type="Q4_K_M")
    model = fastserve.load_model(path)
    assert model.weights.layers[0].wqkv.types == ("Q4_K", "Q4_K", "Q6_K")
    return model


@pytest.mark.parametrize("model_fixture", ["tiny_model", "q4_k_m_model", "default_model"])
def test_batch_invariance(request, model_fixture):
    """A token's logits are bit-identical alone, among other sequences, and under any prompt chunking."""
    model = request.getfixturevalue(model_fixture)
    cfg, w = model.config, model.weights
    rng = np.random.default_rng(0)
    target = rng.integers(0, cfg.n_vocab, 40).tolist()
    others = [rng.integers(0, cfg.n_vocab, n).tolist() for n in (1, 7, 33, 2)]

    alone = _forward_rows(CpuBackend(cfg, w, 1, 64), [target])[0]
    crowd = _forward_rows(CpuBackend(cfg, w, 5, 64), others[:2] + [target] + others[2:])[2]
    np.testing.assert_array_equal(alone, crowd)

    # The same sequence fed in chunks of 1, 3 and 11 tokens, one step each, with a neighbour decoding.
    for chunk in (1, 3, 11):
        be = CpuBackend(cfg, w, 2, 64)
        rows = []
        for start in range(0, len(target), chunk):
            part = target[start:start + chunk]
            toks = part + [7]
            pos = list(range(start, start + len(part))) + [start]
            slots = [0] * len(part) + [1]
            out = be.forward(np.array(toks, np.int32), np.array(pos), np.array(slots), np.arange(len(part)))
            rows.append(out.copy())
        np.testing.assert_array_equal(np.concatenate(rows), alone, err_msg=f"chunk {chunk}")
