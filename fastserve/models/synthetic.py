"""Write small (or large) llama GGUF files with random weights: for tests, benchmarks and device checks.

The vocabulary is GPT-2 byte-level BPE (pre-tokenizer "smollm"): three special
tokens, the 256 byte symbols, a few merges, and filler tokens up to n_vocab.
"""
from __future__ import annotations

import os

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a t", "Ġ w", "o r", "e n", "l l"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte value 0..255 (bytes_to_unicode)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def tiny_vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """tokens, token types, merges for a byte-level BPE vocabulary of exactly n_vocab entries."""
    tokens = list(SPECIALS) + byte_symbols()
    for m in MERGES:
        a, b = m.split(" ")
        tokens.append(a + b)
    if n_vocab < len(tokens):
        raise ValueError(f"n_vocab must be >= {len(tokens)}")
    sym = byte_symbols()
    i = 0
    while len(tokens) < n_vocab:       # filler: unreachable by merges, still valid byte-level strings
        tokens.append("Ġ" + "".join(sym[ord(c)] for c in f"f{i}"))
        i += 1
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, list(MERGES)



def add_tiny_tokenizer(w, n_vocab: int, chat_template: str | None = None) -> None:
    """tiny_vocab's byte-level BPE vocabulary (BOS 1, EOS 2, no BOS added) and a chat template into a
    gguf.GGUFWriter: the tokenizer fastserve and llama.cpp both load."""
    tokens, types, merges = tiny_vocab(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def add_llama_header(w, *, n_layer: int, n_ctx: int, n_embd: int, n_ff: int, n_head: int, n_head_kv: int,
                     head_dim: int, n_vocab: int, rope_base: float = 10000.0) -> None:
    """A llama-shaped model's hyperparameters into a gguf.GGUFWriter, under its architecture's keys: the
    blocks, context, widths, heads, RoPE (base, head_dim dimensions rotated), RMS norm eps 1e-5, vocabulary."""
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(n_vocab)


# Granite 3's multipliers (granite-3.x config.json: embedding_multiplier, residual_multiplier,
# attention_multiplier, logits_scaling), under their GGUF keys
MULTIPLIERS = {"embedding_scale": 12.0, "residual_scale": 0.22, "attention.scale": 0.015625, "logit_scale": 8.0}
# Phi-3's longrope keys (Phi-3-mini-128k: attn_factor sqrt(1 + ln(32) / ln(4096)), trained at 4096)
LONGROPE = {"attn_factor": 1.1902380714238083, "original_context_length": 4096}


def write_llama_gguf(path: str | os.PathLike, *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4,
                     n_head_kv: int = 2, n_ff: int = 128, n_vocab: int = 512, n_ctx: int = 2048,
                     weight_type: str = "F32", tied: bool = False, seed: int = 0,
                     architecture: str = "llama", head_dim: int | None = None, sliding_window: int = 0,
                     extra_tensors: tuple[str, ...] = (), rope_scale: float = 1.0,
                     chat_template: str | None = CHAT_TEMPLATE, tokenizer=None, output_scale: float = 1.0,
                     zero_output_rows=(), rope_base: float = 10000.0, tensor_scales: dict | None = None,
                     n_expert: int = 8, n_expert_used: int = 2, yarn: tuple[float, int] | None = None) -> str:
    """Write a GGUF of one architecture of the table (models/architecture.py) with random weights: the
    llama tensors plus what the row adds (biases, q/k norms, sandwich norms); head_dim: when not
    n_embd / n_head (written as key_length); sliding_window: for a row with local layers;
    extra_tensors: names of further [n_embd] tensors (a tensor no row knows, for error tests);
    rope_scale: linear RoPE position scaling (rope.scaling.type linear) when not 1; chat_template: None
    writes none (a model that chats in the fallback template); tokenizer: a function that writes the
    tokenizer keys into the gguf.GGUFWriter instead of tiny_vocab's (its vocabulary of n_vocab tokens);
    output_scale: the output matrix's rows scaled by it; zero_output_rows: token ids whose output rows
    are zero (never the argmax: e.g. byte tokens that are no text alone); tensor_scales: {kind: factor},
    the matrices of a kind (a name without blk.N. and .weight, e.g. "attn_q", "token_embd") scaled by it.
    What a row adds beyond the llama tensors is written with values of its real models': granite's
    multipliers (MULTIPLIERS), phi3's fused Q, K, V and gate, up tensors and its longrope factors and
    keys (LONGROPE), a mixture of experts' router (F32, as converted files keep it) and n_expert experts of
    n_ff each, n_expert_used per token (expert_count, expert_used_count, expert_feed_forward_length), gpt-oss's
    biases (F32, N(0, 0.5^2)) and attention sinks (N(0, 1.5^2)) and its FFN norm's name (post_attention_norm).
    yarn: (factor, original context): YaRN RoPE scaling keys (rope.scaling.type yarn), as gpt-oss's files.
    weight_type: F32, F16, a type gguf.quants can quantize,
    Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS (fastserve.models.blocks' encoder; K-quants and IQ4_XS:
    rows of a multiple of 256 inputs), "MXFP4_MOE" (llama-quantize's mix of that name: the 3-D expert tensors MXFP4,
    every other matrix Q8_0) or "Q4_K_M"
    (llama.cpp's mix: attn_v and ffn_down in Q6_K, the other matrices in Q4_K)."""
    import gguf

    from .architecture import ARCHITECTURES

    row = ARCHITECTURES.get(architecture)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(os.fspath(path), architecture)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    head_dim = head_dim or n_embd // n_head
    if sliding_window:
        w.add_sliding_window(sliding_window)
    if rope_scale != 1.0:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_scale)
    if yarn is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(yarn[0])
        w.add_rope_scaling_orig_ctx_len(yarn[1])
    add_llama_header(w, n_layer=n_layer, n_ctx=n_ctx, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
                     head_dim=head_dim, n_vocab=n_vocab, rope_base=rope_base)
    if row is not None and row.multipliers:
        for key, value in MULTIPLIERS.items():
            w.add_float32(f"{architecture}.{key}", value)
    if row is not None and row.longrope:
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        w.add_float32(f"{architecture}.rope.scaling.attn_factor", LONGROPE["attn_factor"])
        w.add_uint32(f"{architecture}.rope.scaling.original_context_length", LONGROPE["original_context_length"])
    moe = row is not None and row.moe
    if moe:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_feed_forward_length(n_ff)
    if tokenizer is None:
        add_tiny_tokenizer(w, n_vocab, chat_template)
    else:
        tokenizer(w)

    def mat(name, rows, cols, scale, experts=0, t=weight_type):
        scale *= (tensor_scales or {}).get(name.split(".")[-2], 1.0)
        if t == "Q4_K_M":
            t = "Q6_K" if ("attn_v" in name or "ffn_down" in name) else "Q4_K"
        elif t == "MXFP4_MOE":
            t = "MXFP4" if experts else "Q8_0"
        shape = (experts, rows, cols) if experts else (rows, cols)
        _add(w, name, (rng.standard_normal(shape) * scale).astype(np.float32), t)

    def vec(name, n):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", n_vocab, n_embd, 1.0)
    fused_qkv = row is not None and row.fused_qkv
    fused_gate_up = row is not None and row.fused_gate_up
    for i in range(n_layer):
        b = f"blk.{i}."
        vec(b + "attn_norm.weight", n_embd)
        if fused_qkv:
            mat(b + "attn_qkv.weight", (n_head + 2 * n_head_kv) * head_dim, n_embd, n_embd ** -0.5)
        else:
            mat(b + "attn_q.weight", n_head * head_dim, n_embd, n_embd ** -0.5)
            mat(b + "attn_k.weight", n_head_kv * head_dim, n_embd, n_embd ** -0.5)
            mat(b + "attn_v.weight", n_head_kv * head_dim, n_embd, n_embd ** -0.5)
        mat(b + "attn_output.weight", n_embd, n_head * head_dim, (n_head * head_dim) ** -0.5)
        vec(b + (row.ffn_norm if row is not None else "ffn_norm.weight"), n_embd)
        if moe:
            mat(b + "ffn_gate_inp.weight", n_expert, n_embd, n_embd ** -0.5, t="F32")
            mat(b + "ffn_gate_exps.weight", n_ff, n_embd, n_embd ** -0.5, n_expert)
            mat(b + "ffn_up_exps.weight", n_ff, n_embd, n_embd ** -0.5, n_expert)
            mat(b + "ffn_down_exps.weight", n_embd, n_ff, n_ff ** -0.5, n_expert)
        elif fused_gate_up:
            mat(b + "ffn_up.weight", 2 * n_ff, n_embd, n_embd ** -0.5)
        else:
            mat(b + "ffn_gate.weight", n_ff, n_embd, n_embd ** -0.5)
            mat(b + "ffn_up.weight", n_ff, n_embd, n_embd ** -0.5)
        if not moe:
            mat(b + "ffn_down.weight", n_embd, n_ff, n_ff ** -0.5)
        sizes = {"attn_q.bias": n_head * head_dim, "attn_k.bias": n_head_kv * head_dim,
                 "attn_v.bias": n_head_kv * head_dim, "attn_q_norm.weight": head_dim, "attn_k_norm.weight": head_dim,
                 "post_attention_norm.weight": n_embd, "post_ffw_norm.weight": n_embd}
        biases = {"attn_output.bias": (n_embd,), "ffn_gate_inp.bias": (n_expert,),
                  "ffn_gate_exps.bias": (n_expert, n_ff), "ffn_up_exps.bias": (n_expert, n_ff),
                  "ffn_down_exps.bias": (n_expert, n_embd)}
        for name in (row.layer_tensors() if row else ()):
            if name in sizes and name != row.ffn_norm:
                vec(b + name, sizes[name])
            elif name in biases:
                w.add_tensor(b + name, (0.5 * rng.standard_normal(biases[name])).astype(np.float32))
            elif name == "attn_sinks.weight":
                w.add_tensor(b + name, (1.5 * rng.standard_normal(n_head)).astype(np.float32))
    if row is not None and row.longrope:       # longrope's factors: ~1 near the high frequencies, growing
        grow = np.linspace(0.0, 1.0, head_dim // 2)
        w.add_tensor("rope_factors_long.weight", (1.0 + 30.0 * grow ** 2).astype(np.float32))
        w.add_tensor("rope_factors_short.weight", (1.0 + 2.0 * grow ** 2).astype(np.float32))
    for name in extra_tensors:
        vec(name, n_embd)
    vec("output_norm.weight", n_embd)
    if not tied:
        out = rng.standard_normal((n_vocab, n_embd)) * (output_scale * n_embd ** -0.5)
        out[np.asarray(zero_output_rows, dtype=np.int64)] = 0.0
        mix_output = {"Q4_K_M": "Q4_K", "MXFP4_MOE": "Q8_0"}        # the mixes' output type
        _add(w, "output.weight", out.astype(np.float32), mix_output.get(weight_type, weight_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


def _add(writer, name: str, arr: np.ndarray, weight_type: str) -> None:
    import gguf

    if weight_type == "F32":
        writer.add_tensor(name, arr)
    elif weight_type == "F16":
        writer.add_tensor(name, arr.astype(np.float16))
    elif weight_type in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"):
        from .blocks import encode
        blocks = encode(weight_type, arr.reshape(-1, arr.shape[-1])).reshape(*arr.shape[:-1], -1)    # 3-D: experts
        writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[weight_type])
    else:
        qtype = gguf.GGMLQuantizationType[weight_type]
        writer.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
