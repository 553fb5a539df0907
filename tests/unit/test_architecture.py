"""The architecture table (fastserve/models/architecture.py): what each row reads, the errors for what no
row knows, and the forward pass's per-row steps checked against plain NumPy written from the formulas."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fastserve
from fastserve.backends.cuda.backend import unsupported_features
from fastserve.backends.cpu.ref.layer_ops import apply_rope, geglu
from fastserve.backends.rope import rope_tables
from fastserve.errors import ModelLoadError
from fastserve.models.architecture import ARCHITECTURES
from fastserve.models.gguf_file import GGUFFile
from fastserve.models.synthetic import write_llama_gguf
from fastserve.models.transformer import ModelConfig, load_weights


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One small model per row (random weights), with head_dim decoupled from n_embd / n_head."""
    d = tmp_path_factory.mktemp("arch")
    out = {}
    for name in ARCHITECTURES:
        out[name] = fastserve.load_model(write_llama_gguf(
            d / f"{name}.gguf", architecture=name, n_layer={"gemma3": 7, "smollm3": 5}.get(name, 2), head_dim=24,
            sliding_window=8 if name in ("gemma3", "gpt-oss") else 0, tied=name == "gemma3",
            rope_scale=4.0 if name == "gemma3" else 1.0, yarn=(32.0, 4096) if name == "gpt-oss" else None))
    return out


def test_every_row_loads_and_reads_what_it_adds(models):
    llama, qwen2, qwen3, gemma3 = (models[n] for n in ("llama", "qwen2", "qwen3", "gemma3"))
    assert all(m.config.head_dim == 24 and m.config.attn_scale == pytest.approx(24 ** -0.5)
               for n, m in models.items() if n != "granite")
    assert qwen2.weights.layers[0].qkv_bias.shape == ((4 + 2 * 2) * 24,)
    assert llama.weights.layers[0].qkv_bias is None and llama.weights.layers[0].q_norm is None
    assert qwen3.weights.layers[0].q_norm.shape == (24,) and qwen3.weights.layers[0].post_attn_norm is None
    assert qwen2.config.rope_neox and not llama.config.rope_neox
    g = gemma3.config
    assert g.ffn_gelu and g.embd_scale == pytest.approx(8.0) and g.sliding_window == 8
    # llama.cpp's default pattern for gemma3: of each 6 layers the last is global
    assert g.local_layers == (True, True, True, True, True, False, True)
    assert g.rope_base_local == 10000.0 and g.rope_scale == 4.0 and gemma3.weights.output is gemma3.weights.tok_embd
    assert gemma3.weights.layers[3].post_ffn_norm.shape == (64,)
    assert all(m.config.residual_scale == 1.0 and m.config.logit_scale == 1.0 and all(m.config.rope_layers)
               for n, m in models.items() if n not in ("granite", "smollm3"))


def test_granite_reads_its_multipliers(models):
    """granite.embedding_scale, .residual_scale, .attention.scale, .logit_scale (llama.cpp's granite.cpp:
    logits / logit_scale), as float32 as the file stores them."""
    c = models["granite"].config
    assert (c.embd_scale, c.residual_scale, c.attn_scale) == (12.0, np.float32(0.22), 0.015625)
    assert c.logit_scale == np.float32(1 / 8.0) and all(c.rope_layers)


def test_granite_refuses_a_missing_or_zero_logit_scale_and_reads_its_rope_switch(tmp_path):
    """llama.cpp requires granite.logit_scale (a divisor: 0 is corrupt); rope.scaling.finetuned false turns
    RoPE off on every layer."""
    path = write_llama_gguf(tmp_path / "g.gguf", architecture="granite")
    data = open(path, "rb").read()
    open(path, "wb").write(data.replace(b"granite.logit_scale", b"granite.logit_scalX"))
    with pytest.raises(ModelLoadError, match="lacks 'granite.logit_scale'"):
        fastserve.load_model(path)
    md = dict(GGUFFile(write_llama_gguf(tmp_path / "h.gguf", architecture="granite")).metadata)
    assert ModelConfig.from_metadata(md, 512).rope_layers == (True, True)
    md["granite.rope.scaling.finetuned"] = False
    assert ModelConfig.from_metadata(md, 512).rope_layers == (False, False)
    md["granite.logit_scale"] = 0.0
    with pytest.raises(ModelLoadError, match="'granite.logit_scale' is 0.0, not a usable value"):
        ModelConfig.from_metadata(md, 512)


def test_qwen3moe_reads_its_experts_and_refuses_bad_counts(models, tmp_path):
    """expert_count, expert_used_count, expert_feed_forward_length (else llama.cpp's n_ff / n_expert_used),
    expert_weights_scale (0 or none: none); the experts as views of the 3-D tensors; a count missing or more
    experts used than there are is refused, and so is an expert tensor of the wrong shape."""
    m = models["qwen3moe"]
    c, lw = m.config, m.weights.layers[1]
    assert (c.n_expert, c.n_expert_used, c.n_ff, c.expert_weights_scale) == (8, 2, 128, 1.0)
    assert lw.w_gate_up is None and lw.router.shape == (8, 64) and len(lw.experts_down) == 8
    assert lw.experts_gate_up[5].shape == (256, 64) and lw.experts_down[5].shape == (64, 128)
    assert lw.experts_gate_up[5].labels[1].endswith("blk.1.ffn_up_exps.weight[5]")
    md = dict(GGUFFile(write_llama_gguf(tmp_path / "m.gguf", architecture="qwen3moe")).metadata)
    md["qwen3moe.expert_weights_scale"] = 2.5
    del md["qwen3moe.expert_feed_forward_length"]
    md["qwen3moe.feed_forward_length"] = 300
    assert (ModelConfig.from_metadata(md, 512).n_ff, ModelConfig.from_metadata(md, 512).expert_weights_scale) == (150, 2.5)
    md["qwen3moe.expert_used_count"] = 9
    with pytest.raises(ModelLoadError, match="9 experts used per token of 8"):
        ModelConfig.from_metadata(md, 512)
    del md["qwen3moe.expert_count"]
    with pytest.raises(ModelLoadError, match="lacks 'qwen3moe.expert_count'"):
        ModelConfig.from_metadata(md, 512)
    gf = GGUFFile(write_llama_gguf(tmp_path / "n.gguf", architecture="qwen3moe", n_expert=4))
    cfg = ModelConfig.from_metadata(gf.metadata, 512)
    with pytest.raises(ModelLoadError, match=r"ffn_gate_inp.weight has shape \(4, 64\), expected \(6, 64\)"):
        load_weights(gf, dataclasses.replace(cfg, n_expert=6))


def test_smollm3_skips_rope_on_every_fourth_layer(models):
    """llama.cpp's smollm3.cpp: layer il rotates unless (il + 1) % 4 == 0."""
    assert models["smollm3"].config.rope_layers == (True, True, True, False, True)


def test_phi3_reads_fused_tensors_and_longrope(models):
    """attn_qkv is W_qkv, ffn_up [2 n_ff, d] is W_gu (gate rows first); rope_factors_short within the
    original context (4096), long past it; RoPE's attn_factor from the file."""
    p = models["phi3"]
    lw, c = p.weights.layers[0], p.config
    assert lw.wqkv.shape == ((4 + 2 * 2) * 24, 64) and lw.w_gate_up.shape == (2 * c.n_ff, 64)
    assert c.rope_neox and c.n_ctx_orig == 4096 and c.rope_attn_factor == pytest.approx(1.1902381)
    assert p.weights.rope_factors(c, 4096) is p.weights.rope_short
    assert p.weights.rope_factors(c, 4097) is p.weights.rope_long
    assert not np.array_equal(p.weights.rope_long, p.weights.rope_short)
    cos, sin = rope_tables(c, 3, None)
    assert np.allclose(cos ** 2 + sin ** 2, c.rope_attn_factor ** 2)


def test_rows_change_the_logits(models):
    """Each family computes something of its own from the same ids (the rows are not ignored)."""
    ids = [5, 17, 99, 3, 250, 42]
    logits = {n: m.logits(ids) for n, m in models.items()}
    assert all(np.isfinite(v).all() for v in logits.values())
    names = list(logits)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not np.allclose(logits[a], logits[b]), (a, b)


def test_unknown_architecture_names_it_and_lists_the_table(tmp_path):
    path = write_llama_gguf(tmp_path / "m.gguf", architecture="mamba")
    with pytest.raises(ModelLoadError) as err:
        fastserve.load_model(path)
    msg = str(err.value)
    assert "'mamba'" in msg and all(name in msg for name in ARCHITECTURES)


@pytest.mark.parametrize("field, value", [("rope", "gptj"), ("ffn_act", "relu"), ("moe_gating", "sigmoid")])
def test_a_row_with_a_kind_the_backends_do_not_know_is_refused(field, value):
    """The backends test rope, ffn_act and moe_gating by equality (rope_neox, topk_softmax): a misspelt or new
    kind would silently run another one; the row is refused where it is written."""
    with pytest.raises(ValueError, match=rf"'qwen3moe': {field} '{value}' is not one of"):
        dataclasses.replace(ARCHITECTURES["qwen3moe"], **{field: value})


def test_a_tensor_the_row_does_not_know_is_refused(tmp_path):
    path = write_llama_gguf(tmp_path / "m.gguf", extra_tensors=("blk.0.attn_sinks.weight",))
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.attn_sinks\.weight is not one the 'llama' "
                                             r"architecture reads; it reads .*attn_q\.weight"):
        fastserve.load_model(path)


def test_a_tensor_another_row_needs_is_refused_too(tmp_path):
    """A llama file with q/k norms (a qwen3 model mislabelled) would silently lose them: refused."""
    path = write_llama_gguf(tmp_path / "m.gguf", extra_tensors=("blk.1.post_ffw_norm.weight",))
    with pytest.raises(ModelLoadError, match=r"blk\.1\.post_ffw_norm\.weight is not one the 'llama'"):
        fastserve.load_model(path)


def test_a_missing_tensor_of_the_row_is_named(tmp_path):
    """A llama model's tensors labelled qwen3: its q/k norms are missing."""
    path3 = write_llama_gguf(tmp_path / "q3.gguf", architecture="llama")
    data = open(path3, "rb").read().replace(b"llama", b"qwen3")
    open(path3, "wb").write(data)
    with pytest.raises(ModelLoadError, match=r"missing tensors .*attn_q_norm.*'qwen3' architecture"):
        fastserve.load_model(path3)


def test_neox_rope_rotates_halves(models):
    cfg = models["qwen2"].config
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, cfg.head_dim)).astype(np.float32)
    cos, sin = rope_tables(cfg, 3, None)
    want = x.astype(np.float64).copy()
    h = cfg.rope_dim // 2
    a, b = x[..., :h].astype(np.float64), x[..., h:cfg.rope_dim].astype(np.float64)
    c, s = cos[:, None, :], sin[:, None, :]
    want[..., :h], want[..., h:cfg.rope_dim] = a * c - b * s, a * s + b * c
    apply_rope(x, cos, sin, cfg.rope_dim, neox=True)
    np.testing.assert_allclose(x, want, rtol=1e-6, atol=1e-6)


def test_geglu_is_tanh_gelu_times_up():
    rng = np.random.default_rng(1)
    g, u = (rng.standard_normal((4, 32)).astype(np.float32) * 3 for _ in range(2))
    gd = g.astype(np.float64)
    want = 0.5 * gd * (1 + np.tanh(np.sqrt(2 / np.pi) * (gd + 0.044715 * gd ** 3))) * u
    np.testing.assert_allclose(geglu(g, u, np.empty_like(g)), want, rtol=1e-5, atol=1e-6)


def test_the_gpu_backend_reads_the_same_rows(models):
    """Every row runs on the CUDA kernels (gemma3's GeGLU, sandwich norms, local layers included); what a
    model needs that they do not run is named, and refused at construction before any CuPy is touched
    (and `auto` then picks the CPU)."""
    from fastserve.backends.cuda.backend import CHECKED_ARCHITECTURES, CupyBackend, DeviceUnavailable
    for name, m in models.items():
        got = unsupported_features(m.config)
        if name in CHECKED_ARCHITECTURES:
            assert got == [], name
        else:           # a row not checked on CUDA (none today) is refused by its name
            assert got and got[0].startswith(f"the {name!r} architecture's row"), name
    assert set(models) <= set(CHECKED_ARCHITECTURES)
    moe = dataclasses.replace(models["qwen3moe"].config, n_expert=600)
    assert unsupported_features(moe) == ["600 experts (cuda/moe.cu: at most 512)"]
    with pytest.raises(DeviceUnavailable, match=r"does not run 600 experts.*'qwen3moe'.*--device cpu"):
        CupyBackend(moe, models["qwen3moe"].weights, 1, 16)
    # a row the CUDA backend has not been checked on (a family added to the table for the CPU) is refused by name
    new_row = dataclasses.replace(models["llama"].config.arch, name="deepseek2")
    cfg = dataclasses.replace(models["llama"].config, arch=new_row)
    assert len(unsupported_features(cfg)) == 1 and "'deepseek2'" in unsupported_features(cfg)[0]
    with pytest.raises(DeviceUnavailable, match=r"does not run the 'deepseek2' architecture's row.*--device cpu"):
        CupyBackend(cfg, models["llama"].weights, 1, 16)
    # gpt-oss's o bias beside a sandwich norm, and its swiglu_oai in a dense FFN: refused, named
    oss = models["gpt-oss"].config
    llama_oai = dataclasses.replace(models["llama"].config.arch, ffn_act="swiglu_oai")
    for arch, named in ((dataclasses.replace(oss.arch, sandwich_norms=True), "an output bias beside sandwich norms"),
                        (llama_oai, "swiglu_oai in a dense")):
        base = oss if arch.moe else models["llama"].config
        assert any(named in f for f in unsupported_features(dataclasses.replace(base, arch=arch))), named
    g = models["gemma3"]
    for change, named in ((dict(head_dim=512), "head_dim 512"), (dict(head_dim=260), "head_dim 260"),
                          (dict(n_head=16, n_head_kv=1), "16 query heads per KV head")):
        cfg = dataclasses.replace(g.config, **change)
        assert [named in f for f in unsupported_features(cfg)] == [True]
        with pytest.raises(DeviceUnavailable, match=f"does not run {named}.*'gemma3'.*--device cpu"):
            CupyBackend(cfg, g.weights, 1, 16)


def _reference_logits(model, ids) -> np.ndarray:
    """The forward pass written out from the formulas in float64, one row's steps at a time, with
    explicit masks (causal; local layers: q - window < p <= q): what the backend must compute."""
    cfg, w = model.config, model.weights
    n, H, Hkv, D, d = len(ids), cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_embd

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * g

    def rope(x, base, scale):
        half = cfg.rope_dim // 2
        theta = np.arange(n)[:, None] / scale * base ** (-np.arange(half) * 2.0 / cfg.rope_dim)
        factors = w.rope_factors(cfg, n)        # model.logits' slot: the sequence's length
        if factors is not None:
            theta = theta / factors[:half]
        mag = cfg.rope_attn_factor
        if cfg.rope_yarn and scale != 1:        # YaRN (llama.cpp's rope_yarn): pairs that turn fewer than beta_slow
            # times over the original context interpolated (pos / scale), more than beta_fast extrapolated (pos),
            # a linear ramp between; cos and sin times 1 + 0.1 ln(scale)
            def dim(turns):
                return cfg.rope_dim * np.log(cfg.n_ctx_orig / (turns * 2 * np.pi)) / (2 * np.log(base))
            lo, hi = max(0, np.floor(dim(32.0))), min(cfg.rope_dim - 1, np.ceil(dim(1.0)))
            extrapolated = 1 - np.clip((np.arange(half) - lo) / max(0.001, hi - lo), 0, 1)
            theta = theta * scale * (extrapolated + (1 - extrapolated) / scale)
            mag = mag * (1 + 0.1 * np.log(scale))
        c, s = (np.cos(theta) * mag)[:, None], (np.sin(theta) * mag)[:, None]
        i0, i1 = (np.arange(half), np.arange(half, 2 * half)) if cfg.rope_neox else (np.arange(0, 2 * half, 2),
                                                                                  np.arange(1, 2 * half, 2))
        out = x.copy()
        out[..., i0], out[..., i1] = x[..., i0] * c - x[..., i1] * s, x[..., i0] * s + x[..., i1] * c
        return out

    def ffn(h, w_gate_up, w_down, gu_bias=0, down_bias=0):
        gu = h @ w_gate_up.to_float().T + gu_bias
        g, u = gu[:, :cfg.n_ff], gu[:, cfg.n_ff:]
        if cfg.arch.ffn_act == "swiglu_oai":        # gpt-oss: the gate clamped above at 7, up to [-7, 7]
            g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0) + 1
            return (g / (1 + np.exp(-1.702 * g)) * u) @ w_down.to_float().T + down_bias
        act = (0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) if cfg.ffn_gelu
               else g / (1 + np.exp(-g)))
        return (act * u) @ w_down.to_float().T + down_bias

    def moe(h, lw):         # the router's softmax, each row's top k, their weights renormalised (gpt-oss: its
        logits = h @ lw.router.to_float().T      # logits' (biased) top k, then their softmax)
        if lw.router_bias is not None:
            logits = logits + lw.router_bias
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out = np.zeros_like(h)
        for i, row in enumerate(p):
            top = np.argsort(-row)[:cfg.n_expert_used]
            for e in top:
                biases = {} if lw.router_bias is None else dict(gu_bias=lw.experts_gate_up_bias[e],
                                                                down_bias=lw.experts_down_bias[e])
                out[i] += row[e] / row[top].sum() * ffn(h[i:i + 1], lw.experts_gate_up[e], lw.experts_down[e],
                                                        **biases)[0]
        return out

    x = w.tok_embd.to_float().astype(np.float64)[ids] * cfg.embd_scale
    r = cfg.residual_scale
    qpos, kpos = np.arange(n)[:, None], np.arange(n)[None, :]
    for li, lw in enumerate(w.layers):
        qkv = norm(x, lw.attn_norm) @ lw.wqkv.to_float().T + (lw.qkv_bias if lw.qkv_bias is not None else 0)
        q = qkv[:, :H * D].reshape(n, H, D)
        k = qkv[:, H * D:(H + Hkv) * D].reshape(n, Hkv, D)
        v = qkv[:, (H + Hkv) * D:].reshape(n, Hkv, D)
        if lw.q_norm is not None:
            q, k = norm(q, lw.q_norm), norm(k, lw.k_norm)
        # local layers: their own base, no position scaling (llama.cpp's rope_freq_scale_train_swa = 1; gpt-oss's
        # the global ones)
        base, scale = ((cfg.rope_base_local, cfg.rope_scale_local) if cfg.local_layers[li]
                       else (cfg.rope_base, cfg.rope_scale))
        if cfg.rope_layers[li]:
            q, k = rope(q, base, scale), rope(k, base, scale)
        visible = kpos <= qpos
        if cfg.local_layers[li]:
            visible &= qpos - cfg.sliding_window < kpos
        k, v = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) * cfg.attn_scale
        s = np.where(visible, s, -np.inf)
        m = s.max(-1, keepdims=True)
        if lw.attn_sinks is not None:       # gpt-oss: a logit per head in the denominator only
            m = np.maximum(m, lw.attn_sinks[:, None, None])
        p = np.exp(s - m)
        p /= p.sum(-1, keepdims=True) + (np.exp(lw.attn_sinks[:, None, None] - m) if lw.attn_sinks is not None else 0)
        a = np.einsum("hqk,khd->qhd", p, v).reshape(n, H * D) @ lw.wo.to_float().T
        if lw.out_bias is not None:
            a = a + lw.out_bias
        x = x + r * (norm(a, lw.post_attn_norm) if lw.post_attn_norm is not None else a)
        h = norm(x, lw.ffn_norm)
        f = ffn(h, lw.w_gate_up, lw.w_down) if not cfg.n_expert else moe(h, lw)
        x = x + r * (norm(f, lw.post_ffn_norm) if lw.post_ffn_norm is not None else f)
    return norm(x, w.out_norm) @ w.output.to_float().T * cfg.logit_scale


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_the_forward_pass_is_the_formulas(models, name):
    """Every row's pass (F32 weights, f32 cache) against the formulas, over 20 positions: past gemma3's
    window of 8 on its local layers."""
    model = models[name]
    ids = list(np.random.default_rng(2).integers(0, model.config.n_vocab, 20))
    got = model.logits(ids, "f32", "f32")
    want = _reference_logits(model, ids)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_prefix_reuse_and_the_host_cache_keep_every_row_greedy_output(models, name):
    """A reused prefix (in the slot, or restored from host RAM) continues as a cold prefill does, for
    every row; gemma3's prompt is longer than its window (the cache keeps every position, so a local
    layer's reused prefix is as good as a recomputed one)."""
    rng = np.random.default_rng(3)
    a, b = (list(rng.integers(3, 500, 30)) for _ in range(2))
    greedy = dict(max_tokens=6, temperature=0)
    with fastserve.Engine(models[name], n_parallel=1, n_ctx=128, cache_ram_mib=1) as e:
        cold = e.generate(a, cache_prompt=False, **greedy)
        first = e.generate(a, **greedy)
        warm = e.generate(a, **greedy)                  # the slot's own prefix
        e.generate(b, **greedy)                         # a's prefix saved to host RAM ...
        restored = e.generate(a, **greedy)              # ... and restored
    assert warm.timings["cache_n"] == 29 and restored.timings["cache_n"] == 29
    assert cold.token_ids == first.token_ids == warm.token_ids == restored.token_ids


def test_local_layers_are_the_same_whatever_the_prefill_chunk(models):
    """gemma3 (window 8): a 60-token prompt prefilled 64, 7 or 3 tokens a step, alone or beside another
    request: the same greedy tokens (chunks straddle the window's edge)."""
    ids = list(np.random.default_rng(4).integers(3, 500, 60))
    outs = []
    for n_batch in (64, 7, 3):
        with fastserve.Engine(models["gemma3"], n_parallel=2, n_ctx=2 * 128, n_batch=n_batch) as e:
            other = e.submit(ids[::-1], max_tokens=8, temperature=0, cache_prompt=False)
            outs.append(e.generate(ids, max_tokens=8, temperature=0, cache_prompt=False).token_ids)
            other.result()
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 8
