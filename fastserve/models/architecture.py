"""What the model families differ in: one row per GGUF `general.architecture`.

The forward pass (backends/cpu/backend.py, backends/cuda/backend.py) is written once; it reads a
row (through ModelConfig) instead of the architecture's name. A family is added by a row here and
a golden test, not by a new forward pass. Facts not stated in a GGUF file (RoPE layout, which
layers are local, the local layers' RoPE base, norms the file's tensor names imply) are taken from
llama.cpp's model code (src/llama-model.cpp, src/models/<arch>.cpp), read for facts only.

Every layer is
    h = norm(x) -> q, k, v = h W_qkv^T (+ bias) -> [per-head RMSNorm of q, k] -> [RoPE(q, k)]
      -> attention (a sliding window on local layers) -> a = out W_o^T -> [norm(a)] -> x += [r *] a
    h = norm(x) -> g, u = h W_gu^T -> s = act(g) * u -> f = s W_down^T -> [norm(f)] -> x += [r *] f
(a mixture-of-experts row: f = sum over the token's top-k experts e, by rank, of w_e (s_e W_down,e^T), with
g_e, u_e = h W_gu,e^T and the weights w from the router's logits h W_router^T by the row's gating: SOFTMAX, the
softmax over all experts, top k, renormalised over the k (qwen3moe); TOPK_SOFTMAX, the top k logits, then the
softmax over those k (gpt-oss: "weights before softmax"); gpt-oss adds biases to the router's logits and to each
expert's gate, up and down products)
with the bracketed steps present where the row says so (sandwich norms: the norm after each block;
RoPE on every layer but SmolLM3's every 4th; r: Granite's residual multiplier; gpt-oss: o's bias, each head's
attention sink in the softmax's denominator, and its FFN norm stored as post_attention_norm), between
x = [s *] the embedding rows and logits = [c tanh(. / c)] [1/l *] norm(x) W_out^T. W_qkv and W_gu are
one matrix each whether the file stores Q, K, V (gate, up) as separate tensors or fused (Phi-3).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ModelLoadError

ADJACENT, NEOX = "adjacent", "neox"     # RoPE: pairs (2i, 2i+1) (llama.cpp "normal") or (i, i + D/2)
SILU, GELU = "silu", "gelu"             # the FFN's gate: SwiGLU or GeGLU (tanh-approximated GELU)
SWIGLU_OAI = "swiglu_oai"               # gpt-oss's SwiGLU: min(g, 7) sigmoid(1.702 min(g, 7)) (clamp(u, -7, 7) + 1)
FFN_ACTS = (SILU, GELU, SWIGLU_OAI)
SOFTMAX, TOPK_SOFTMAX = "softmax", "topk_softmax"   # a router's gating (the docstring above)


@dataclass(frozen=True)
class Architecture:
    """One family. Tensor names are GGUF's (blk.N.<name>.weight)."""
    name: str                       # general.architecture
    families: str                   # for messages
    rope: str                       # ADJACENT or NEOX
    ffn_act: str                    # SILU, GELU or SWIGLU_OAI
    qkv_bias: bool = False          # blk.N.attn_{q,k,v}.bias: q/k/v biases
    out_bias: bool = False          # blk.N.attn_output.bias: o's bias
    attn_sinks: bool = False        # blk.N.attn_sinks.weight [n_head]: a logit per head in the softmax's denominator
    ffn_norm: str = "ffn_norm.weight"   # the FFN's input norm (gpt-oss stores it as post_attention_norm.weight)
    qk_norm: bool = False           # blk.N.attn_{q,k}_norm: per-head RMSNorm of q and k, before RoPE
    sandwich_norms: bool = False    # blk.N.post_attention_norm, post_ffw_norm: norms after each block
    embd_scale_sqrt: bool = False   # the embedding rows scaled by sqrt(n_embd)
    rope_freqs: bool = False        # rope_freqs.weight (llama3-style frequency factors), when present
    sliding_window: bool = False    # <arch>.attention.sliding_window: local layers
    swa_period: int = 0             # of each swa_period layers, the last is global (when the file has
                                    # no sliding_window_pattern)
    swa_rope_base: float = 10000.0  # the local layers' RoPE base (when the file has no freq_base_swa)
    swa_rope_global: bool = False   # the local layers rotate as the global ones (base, unless freq_base_swa, and
                                    # scaling: llama.cpp's openai-moe), not with swa_rope_base unscaled
    logit_softcap: bool = False     # <arch>.final_logit_softcapping, when present
    multipliers: bool = False       # Granite's <arch>.embedding_scale (s), .residual_scale (r), .attention.scale
                                    # (the scores' scale), .logit_scale (l, logits / l); and its RoPE switch
                                    # <arch>.rope.scaling.finetuned (false: no RoPE)
    nope_period: int = 0            # of each nope_period layers the last has no RoPE (SmolLM3: 4, llama.cpp's
                                    # n_no_rope_layer_step, not a key of the file)
    fused_qkv: bool = False         # blk.N.attn_qkv.weight: the Q, K, V rows in one tensor
    fused_gate_up: bool = False     # blk.N.ffn_up.weight [2 n_ff, n_embd]: the gate rows, then the up rows
    longrope: bool = False          # rope_factors_long / _short.weight: frequency factors chosen by the slot's
                                    # context against <arch>.rope.scaling.original_context_length (Phi-3)
    moe: bool = False               # blk.N.ffn_gate_inp.weight [n_expert, n_embd]: a router over <arch>.expert_count
                                    # experts, <arch>.expert_used_count of them per token, whose FFNs are
                                    # blk.N.ffn_{gate,up,down}_exps [n_expert, ...]; no dense ffn_{gate,up,down}
    moe_gating: str = SOFTMAX       # SOFTMAX or TOPK_SOFTMAX (the docstring above)
    moe_biases: bool = False        # blk.N.ffn_gate_inp.bias [n_expert], ffn_{gate,up,down}_exps.bias [n_expert, ...]

    def __post_init__(self):
        # the backends test these by equality: a misspelt value would silently run the other kind
        for field, value, kinds in (("rope", self.rope, (ADJACENT, NEOX)), ("ffn_act", self.ffn_act, FFN_ACTS),
                                    ("moe_gating", self.moe_gating, (SOFTMAX, TOPK_SOFTMAX))):
            if value not in kinds:
                raise ValueError(f"architecture {self.name!r}: {field} {value!r} is not one of {', '.join(kinds)}")

    def layer_tensors(self) -> tuple[str, ...]:
        """The per-layer tensor names this row reads (without the blk.N. prefix)."""
        ffn = ["ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"] \
            if self.moe else [*self.gate_up_tensors(), "ffn_down.weight"]
        if self.moe and self.moe_biases:
            ffn += ["ffn_gate_inp.bias", "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias"]
        names = ["attn_norm.weight", *self.qkv_tensors(), "attn_output.weight", self.ffn_norm, *ffn]
        if self.qkv_bias:
            names += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
        if self.out_bias:
            names += ["attn_output.bias"]
        if self.attn_sinks:
            names += ["attn_sinks.weight"]
        if self.qk_norm:
            names += ["attn_q_norm.weight", "attn_k_norm.weight"]
        if self.sandwich_norms:
            names += ["post_attention_norm.weight", "post_ffw_norm.weight"]
        return tuple(names)

    def qkv_tensors(self) -> tuple[str, ...]:
        """The tensors whose rows, in this order, are W_qkv."""
        return ("attn_qkv.weight",) if self.fused_qkv else ("attn_q.weight", "attn_k.weight", "attn_v.weight")

    def gate_up_tensors(self) -> tuple[str, ...]:
        """The tensors whose rows, in this order, are W_gu (gate, then up)."""
        return ("ffn_up.weight",) if self.fused_gate_up else ("ffn_gate.weight", "ffn_up.weight")

    def global_tensors(self) -> tuple[str, ...]:
        """Tensor names outside the layers this row may read (output.weight and the RoPE factors optional)."""
        return ("token_embd.weight", "output_norm.weight", "output.weight") + (
            ("rope_freqs.weight",) if self.rope_freqs else ()) + (
            ("rope_factors_long.weight", "rope_factors_short.weight") if self.longrope else ())


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", "SmolLM2, TinyLlama, Llama 2/3, Mistral-style", ADJACENT, SILU, rope_freqs=True),
    Architecture("qwen2", "Qwen 2, Qwen 2.5", NEOX, SILU, qkv_bias=True),
    Architecture("qwen3", "Qwen 3", NEOX, SILU, qk_norm=True),
    Architecture("gemma3", "Gemma 3", NEOX, GELU, qk_norm=True, sandwich_norms=True, embd_scale_sqrt=True,
                 sliding_window=True, swa_period=6, swa_rope_base=10000.0, logit_softcap=True),
    Architecture("granite", "IBM Granite 3", ADJACENT, SILU, multipliers=True),
    Architecture("smollm3", "SmolLM3", ADJACENT, SILU, nope_period=4),
    Architecture("phi3", "Phi-3, Phi-3.5, Phi-4", NEOX, SILU, fused_qkv=True, fused_gate_up=True, longrope=True),
    Architecture("qwen3moe", "Qwen 3 MoE", NEOX, SILU, qk_norm=True, moe=True),
    Architecture("gpt-oss", "gpt-oss-20b, gpt-oss-120b", NEOX, SWIGLU_OAI, qkv_bias=True, out_bias=True,
                 attn_sinks=True, ffn_norm="post_attention_norm.weight", sliding_window=True, swa_period=2,
                 swa_rope_global=True,
                 moe=True, moe_gating=TOPK_SOFTMAX, moe_biases=True),
)}


def supported() -> str:
    """e.g. "llama (SmolLM2, ...), qwen2 (Qwen 2, Qwen 2.5), ..." for error messages."""
    return ", ".join(f"{a.name} ({a.families})" for a in ARCHITECTURES.values())


def architecture(name: str) -> Architecture:
    """The row of general.architecture `name`; a ModelLoadError naming it and the supported ones if none."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ModelLoadError(f"unsupported model architecture {name!r}; supported: {supported()}") from None


def check_tensors(arch: Architecture, names, n_layer: int, path: str) -> None:
    """Every tensor of the file is one the row reads: a tensor it does not know would be ignored,
    and the model would compute something else than it was trained for. Raises naming it."""
    per_layer = set(arch.layer_tensors())
    known = set(arch.global_tensors())
    for name in names:
        if name in known:
            continue
        parts = name.split(".", 2)
        if (len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < n_layer
                and parts[2] in per_layer):
            continue
        raise ModelLoadError(
            f"{path}: tensor {name} is not one the {arch.name!r} architecture reads; it reads "
            f"{', '.join(sorted(known))} and per layer blk.N.{{{', '.join(sorted(per_layer))}}}")
