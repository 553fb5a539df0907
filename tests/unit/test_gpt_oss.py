"""gpt-oss's row of the architecture table as fastserve reads it: its tensors (biases, attention sinks, the FFN
norm stored as post_attention_norm, the router's and experts' biases), its keys (sliding window every other layer,
YaRN on every layer), what is refused, its tokenizer's harmony tokens (llama.cpp's fixes by token text), and that the
CUDA backend runs it. Its numbers: tests/unit/test_architecture.py (against the formulas),
tests/parity/test_forward.py (C = reference, batch invariance), tests/golden/test_families.py (against llama.cpp)."""
import numpy as np
import pytest

import fastserve
from fastserve.errors import ModelLoadError
from fastserve.models.architecture import SWIGLU_OAI, TOPK_SOFTMAX
from fastserve.models.gguf_file import GGUFFile
from fastserve.models.synthetic import tiny_vocab, write_llama_gguf
from fastserve.models.tokenizer import CONTROL, USER_DEFINED, Tokenizer
from fastserve.models.transformer import ModelConfig, dequantize

SHAPE = dict(architecture="gpt-oss", n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=64, n_expert=8,
             n_expert_used=4, sliding_window=16, rope_base=150000.0, yarn=(32.0, 4096), n_ctx=131072)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_llama_gguf(tmp_path_factory.mktemp("gpt-oss") / "gpt-oss.gguf", **SHAPE)


def test_gpt_oss_reads_its_row(path):
    model = fastserve.load_model(path)
    cfg, lw = model.config, model.weights.layers[1]
    assert cfg.arch.ffn_act == SWIGLU_OAI and cfg.arch.moe_gating == TOPK_SOFTMAX and cfg.rope_neox
    # llama.cpp's openai-moe: of each 2 layers the first slides; every layer rotates with the file's base and YaRN
    assert cfg.local_layers == (True, False, True, False) and cfg.sliding_window == 16
    assert cfg.rope_base_local == cfg.rope_base == 150000.0 and cfg.rope_scale_local == cfg.rope_scale == 32.0
    assert cfg.rope_yarn and cfg.n_ctx_orig == 4096 and cfg.attn_scale == pytest.approx(32 ** -0.5)
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff) == (8, 4, 64)
    gf = GGUFFile(path)
    post = dequantize(gf.tensors["blk.1.post_attention_norm.weight"], path)
    assert np.array_equal(lw.ffn_norm, post) and lw.post_attn_norm is None      # the FFN's norm, not a sandwich
    assert lw.qkv_bias.shape == ((4 + 2 * 2) * 32,) and lw.out_bias.shape == (64,) and lw.attn_sinks.shape == (4,)
    assert lw.router_bias.shape == (8,) and lw.experts_gate_up_bias.shape == (8, 128)
    assert lw.experts_down_bias.shape == (8, 64)
    gate = dequantize(gf.tensors["blk.1.ffn_gate_exps.bias"], path)
    up = dequantize(gf.tensors["blk.1.ffn_up_exps.bias"], path)
    assert np.array_equal(lw.experts_gate_up_bias[3], np.concatenate([gate[3], up[3]]))


def test_a_dense_ffn_norm_or_an_unknown_rope_scaling_is_refused(path, tmp_path):
    extra = write_llama_gguf(tmp_path / "extra.gguf", **SHAPE, extra_tensors=("blk.0.ffn_norm.weight",))
    with pytest.raises(ModelLoadError, match=r"tensor blk.0.ffn_norm.weight is not one the 'gpt-oss' architecture"):
        fastserve.load_model(extra)
    md = dict(GGUFFile(path).metadata)
    md["gpt-oss.rope.scaling.type"] = "su"
    with pytest.raises(ModelLoadError, match=r"RoPE scaling 'su' is not one fastserve runs"):
        ModelConfig.from_metadata(md, 512)


@pytest.mark.parametrize("key, value", [("rope.scaling.factor", -32.0), ("rope.freq_base", 0.0),
                                        ("rope.freq_base", -150000.0), ("rope.freq_base_swa", -1.0)])
def test_a_rope_scale_or_base_that_is_not_positive_is_refused(path, key, value):
    """A negative YaRN factor or a base <= 0 made NaN RoPE tables (the log of a negative scale, a negative base to
    a fractional power) without a word; the file is refused naming the key (a factor of 0 means none, as llama.cpp)."""
    md = dict(GGUFFile(path).metadata)
    md[f"gpt-oss.{key}"] = value
    with pytest.raises(ModelLoadError, match=rf"'gpt-oss.{key}' is {value!r}, not a usable value"):
        ModelConfig.from_metadata(md, 512)
    md[f"gpt-oss.{key}"] = 0.0 if key == "rope.scaling.factor" else 1e4
    assert ModelConfig.from_metadata(md, 512).rope_scale >= 1.0


def test_the_cuda_backend_runs_gpt_oss(path):
    """The CUDA backend's kernels run every step of gpt-oss's row (checked on the emulators against the CPU:
    tests/gpu/test_backend_emulated.py, test_parity.py), so nothing is refused for it."""
    from fastserve.backends.cuda.backend import CHECKED_ARCHITECTURES, unsupported_features
    model = fastserve.load_model(path)
    assert "gpt-oss" in CHECKED_ARCHITECTURES
    assert unsupported_features(model.config) == []


def _harmony_tokenizer() -> Tokenizer:
    """tiny_vocab with gpt-oss's harmony tokens (CONTROL, as in its vocabulary) under its o200k pre-tokenizer."""
    tokens, types, merges = tiny_vocab(400)
    harmony = ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>"]
    tokens[-len(harmony):], types[-len(harmony):] = harmony, [3] * len(harmony)
    return Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-4o",
                                    "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                                    "tokenizer.ggml.merges": merges, "tokenizer.ggml.eos_token_id": 2})


def test_harmony_tokens_as_llama_cpp_fixes_them():
    """llama.cpp's fixes by token text for o200k_harmony: <|channel|>, <|message|>, <|start|>, <|constrain|> are
    USER_DEFINED (matched in any text, rendered when special tokens are skipped); with <|return|> and <|call|>
    ending generation, <|end|> does not (it ends a message) and is USER_DEFINED too."""
    tok = _harmony_tokenizer()
    ids = {t: tok.encode(t, add_special=False)[0] for t in ("<|channel|>", "<|end|>", "<|return|>", "<|call|>")}
    assert ids["<|return|>"] in tok.eog_ids and ids["<|call|>"] in tok.eog_ids and ids["<|end|>"] not in tok.eog_ids
    for t in ("<|channel|>", "<|end|>"):
        assert tok._attr[ids[t]] == USER_DEFINED
        assert tok.encode(f"a{t}b", add_special=False, parse_special=False)[1] == ids[t]
        assert tok.decode([ids[t]], skip_special=True) == t
    assert tok._attr[ids["<|return|>"]] & CONTROL
    assert ids["<|return|>"] not in tok.encode("a<|return|>b", add_special=False, parse_special=False)
