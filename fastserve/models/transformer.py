"""Transformer hyperparameters and weights, read from a GGUF file, for every family of the
architecture table (models/architecture.py: llama, qwen2, qwen3, gemma3, granite, smollm3, phi3, qwen3moe,
gpt-oss): RMSNorm, RoPE, grouped-query attention, a gated FFN (or a mixture of experts), tied or separate output
matrix, and what the row adds.

The matrices stay as the file stores them (memory-mapped): fastserve.backends.cpu._matmul.BlockMatrix views of the
tensors' blocks, on which the CPU products run directly (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K,
Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4, F32, F16, BF16); a tensor of any other type is repacked once at load into
Q8_0 blocks (logged).
Only the norm vectors and biases are decoded to float32. The GPU backend decodes one matrix at a time
while uploading (BlockMatrix.to_float).
Matrix orientation: numpy shape (out_features, in_features), so y = x @ W.T.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass

import numpy as np

from ..errors import ModelLoadError
from .architecture import GELU, NEOX, Architecture, architecture, check_tensors
from .gguf_file import GGUFFile

log = logging.getLogger("fastserve.models")

# Types gguf.quants can dequantize (checked at import time of gguf; listed for error messages).
PLAIN_TYPES = ("F32", "F16", "BF16", "F64")
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
               "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
               "TQ1_0", "TQ2_0", "MXFP4")
SUPPORTED_TENSOR_TYPES = PLAIN_TYPES + QUANT_TYPES


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a model, the family's row included."""
    arch: Architecture
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int               # the FFN's width (a mixture of experts': one expert's)
    n_vocab: int
    n_ctx_train: int
    head_dim: int           # key and value head size (need not be n_embd / n_head)
    rope_dim: int
    rope_base: float
    rope_scale: float       # position scaling (1.0 = none): linear, or YaRN's factor when rope_yarn
    rope_attn_factor: float # RoPE's cos and sin multiplied by it (<arch>.rope.scaling.attn_factor; 1.0 = none)
    n_ctx_orig: int         # the context the model was trained at before its RoPE scaling (longrope's choice)
    rope_layers: tuple[bool, ...]   # [n_layer]: True where the layer rotates q and k
    norm_eps: float
    attn_scale: float       # the query scale of attention's scores
    embd_scale: float       # the embedding rows' scale (1.0 = none)
    sliding_window: int     # keys a local layer's query sees, itself included (0: no local layers)
    local_layers: tuple[bool, ...]  # [n_layer]: True for a sliding-window layer
    rope_base_local: float  # the local layers' RoPE base
    logit_softcap: float    # logits = c * tanh(logits / c) when > 0
    residual_scale: float   # each block's output multiplied by it before the residual add (1.0 = none)
    logit_scale: float      # the logits multiplied by it (1.0 = none; Granite: 1 / <arch>.logit_scale)
    n_expert: int = 0       # a mixture of experts' FFNs per layer (0: one dense FFN)
    n_expert_used: int = 0  # the experts each token runs (its top k by router probability)
    expert_weights_scale: float = 1.0   # the normalised expert weights multiplied by it
    rope_yarn: bool = False         # <arch>.rope.scaling.type yarn: rope_scale is YaRN's factor over n_ctx_orig
    rope_scale_local: float = 1.0   # the local layers' position scaling (gpt-oss: the global one)

    @property
    def rope_neox(self) -> bool:
        return self.arch.rope == NEOX

    @property
    def ffn_gelu(self) -> bool:
        return self.arch.ffn_act == GELU

    @classmethod
    def from_metadata(cls, md: dict, n_vocab: int) -> "ModelConfig":
        name = md.get("general.architecture", "<missing>")
        arch = architecture(name)

        def value(key, default, kinds, ok):
            full = f"{name}.{key}"
            v = md.get(full, default)
            if v is None:
                raise ModelLoadError(f"GGUF metadata lacks {full!r}; the file is incomplete")
            if isinstance(v, bool) or not isinstance(v, kinds) or not ok(v):
                raise ModelLoadError(f"GGUF metadata {full!r} is {v!r}, not a usable value; the file is corrupt")
            return v

        def count(key, default=None) -> int:      # a size: a positive integer that fits an int32
            return int(value(key, default, (int, np.integer), lambda v: 0 < v < 2**31))

        def number(key, default, ok=lambda v: True) -> float:
            return float(value(key, default, (int, float, np.number), lambda v: bool(np.isfinite(v)) and ok(v)))

        n_embd = count("embedding_length")
        n_layer = count("block_count")
        n_head = count("attention.head_count")
        n_head_kv = count("attention.head_count_kv", n_head)
        if n_head % n_head_kv:
            raise ModelLoadError(f"GGUF metadata: {n_head} attention heads do not split into groups of "
                                 f"{n_head_kv} KV heads; the file is corrupt")
        head_dim = count("attention.key_length", n_embd // n_head)
        if count("attention.value_length", head_dim) != head_dim:
            raise ModelLoadError(f"GGUF metadata: {name}.attention.value_length differs from key_length "
                                 f"({head_dim}); fastserve runs models whose K and V heads have one size")
        scaling = md.get(f"{name}.rope.scaling.type", "none")
        if scaling not in ("none", "linear", "longrope", "yarn"):
            raise ModelLoadError(f"GGUF metadata: RoPE scaling {scaling!r} is not one fastserve runs "
                                 "(none, linear, longrope, yarn)")
        factor = number("rope.scaling.factor", 1.0, lambda v: v >= 0) or 1.0      # 0: none, as llama.cpp
        window, local = 0, (False,) * n_layer
        if arch.sliding_window:
            window = int(value("attention.sliding_window", 0, (int, np.integer), lambda v: 0 <= v < 2**31))
            period = count("attention.sliding_window_pattern", arch.swa_period) if window else 0
            # llama.cpp's set_swa_pattern: of each `period` layers the last is global
            local = tuple(bool(window) and i % period < period - 1 for i in range(n_layer))
        # gemma3's 27B scales queries by n_embd / n_head, the others by head_dim (llama.cpp's gemma3.cpp)
        q_size = n_embd // n_head if name == "gemma3" and n_layer == 62 else head_dim
        attn_scale, embd_scale = float(1.0 / np.sqrt(q_size)), 1.0
        if arch.embd_scale_sqrt:
            embd_scale = float(np.sqrt(np.float32(n_embd)))
        residual_scale, logit_scale, rope_on = 1.0, 1.0, True
        if arch.multipliers:            # llama.cpp's granite.cpp: a scale of 0 (or none) is no scale
            embd_scale = number("embedding_scale", 0.0) or 1.0
            attn_scale = number("attention.scale", 0.0) or attn_scale
            residual_scale = number("residual_scale", 0.0) or 1.0
            divisor = value("logit_scale", None, (int, float, np.number), lambda v: bool(np.isfinite(v)) and v != 0)
            logit_scale = float(np.float32(1.0) / np.float32(divisor))
            rope_on = bool(md.get(f"{name}.rope.scaling.finetuned", True))
        n_ctx_train = count("context_length", 2048)
        n_expert = n_expert_used = 0
        n_ff = count("feed_forward_length") if not arch.moe else 0
        if arch.moe:        # llama.cpp's qwen3moe.cpp: n_ff_exp, else n_ff / n_expert_used
            n_expert, n_expert_used = count("expert_count"), count("expert_used_count")
            if n_expert_used > n_expert:
                raise ModelLoadError(f"GGUF metadata: {n_expert_used} experts used per token of {n_expert}; "
                                     "the file is corrupt")
            n_ff = (count("expert_feed_forward_length") if f"{name}.expert_feed_forward_length" in md
                    else count("feed_forward_length") // n_expert_used)
        return cls(
            arch=arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            n_ff=n_ff,
            n_vocab=n_vocab,
            n_ctx_train=n_ctx_train,
            head_dim=head_dim,
            rope_dim=count("rope.dimension_count", head_dim),
            rope_base=number("rope.freq_base", 10000.0, lambda v: v > 0),
            rope_scale=factor if scaling in ("linear", "longrope", "yarn") else 1.0,
            rope_yarn=scaling == "yarn",
            rope_scale_local=factor if arch.swa_rope_global and scaling in ("linear", "yarn") else 1.0,
            rope_attn_factor=number("rope.scaling.attn_factor", 1.0),
            n_ctx_orig=count("rope.scaling.original_context_length", n_ctx_train),
            # llama.cpp's smollm3.cpp: layer i rotates unless (i + 1) % n_no_rope_layer_step == 0
            rope_layers=tuple(rope_on and not (arch.nope_period and (i + 1) % arch.nope_period == 0)
                              for i in range(n_layer)),
            norm_eps=number("attention.layer_norm_rms_epsilon", 1e-5),
            attn_scale=attn_scale,
            embd_scale=embd_scale,
            sliding_window=window,
            local_layers=local,
            rope_base_local=number("rope.freq_base_swa", number("rope.freq_base", 10000.0) if arch.swa_rope_global
                                   else arch.swa_rope_base, lambda v: v > 0) if window else 0.0,
            logit_softcap=number("final_logit_softcapping", 0.0) if arch.logit_softcap else 0.0,
            residual_scale=residual_scale,
            logit_scale=logit_scale,
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            # llama.cpp's build_moe_ffn: a scale of 0 (or none) is no scale
            expert_weights_scale=number("expert_weights_scale", 0.0) or 1.0,
        )


@dataclass
class LayerWeights:
    """Q, K, V and gate, up are stacked so that each is one matrix product (fewer, larger calls).
    Matrices are fastserve.backends.cpu._matmul.BlockMatrix views of the file's blocks; norms are float32."""
    attn_norm: np.ndarray   # [n_embd]
    wqkv: object            # [(n_head + 2*n_head_kv)*head_dim, n_embd]: rows Q, then K, then V
    wo: object              # [n_embd, n_head*head_dim]
    ffn_norm: np.ndarray    # [n_embd]
    w_gate_up: object       # [2*n_ff, n_embd]: rows gate, then up (None for a mixture of experts)
    w_down: object          # [n_embd, n_ff] (None for a mixture of experts)
    # What some rows add (None where the row has none):
    qkv_bias: np.ndarray | None = None        # [(n_head + 2*n_head_kv)*head_dim]: Q, K, V biases
    q_norm: np.ndarray | None = None          # [head_dim]: per-head RMSNorm of q
    k_norm: np.ndarray | None = None          # [head_dim]: per-head RMSNorm of k
    post_attn_norm: np.ndarray | None = None  # [n_embd]: the attention block's output norm
    post_ffn_norm: np.ndarray | None = None   # [n_embd]: the FFN block's output norm
    # A mixture of experts (cfg.n_expert > 0): the router and each expert's matrices, views of the 3-D tensors
    router: object | None = None              # [n_expert, n_embd]
    experts_gate_up: list | None = None       # n_expert x [2*n_ff, n_embd]: expert e's gate rows, then its up rows
    experts_down: list | None = None          # n_expert x [n_embd, n_ff]
    # gpt-oss's biases and sinks
    out_bias: np.ndarray | None = None        # [n_embd]: o's bias
    attn_sinks: np.ndarray | None = None      # [n_head]: each head's sink logit
    router_bias: np.ndarray | None = None     # [n_expert]
    experts_gate_up_bias: np.ndarray | None = None   # [n_expert, 2*n_ff]: expert e's gate biases, then its up ones
    experts_down_bias: np.ndarray | None = None      # [n_expert, n_embd]


@dataclass
class ModelWeights:
    tok_embd: object                # BlockMatrix [n_vocab, n_embd] (get_rows: the embedding lookup)
    layers: list[LayerWeights]
    out_norm: np.ndarray            # [n_embd]
    output: object                  # BlockMatrix [n_vocab, n_embd]; the same object as tok_embd when tied
    rope_freqs: np.ndarray | None   # [rope_dim/2] llama3-style frequency factors, or None
    rope_long: np.ndarray | None = None     # [rope_dim/2] longrope's factors past the original context, or None
    rope_short: np.ndarray | None = None    # [rope_dim/2] and within it

    def rope_factors(self, cfg: ModelConfig, n_ctx_slot: int) -> np.ndarray | None:
        """The frequency factors of a slot of n_ctx_slot positions (llama.cpp's get_rope_factors: rope_freqs
        when the file has them, else longrope's long ones when the slot's context passes the original one)."""
        if self.rope_freqs is not None:
            return self.rope_freqs
        return self.rope_long if n_ctx_slot > cfg.n_ctx_orig else self.rope_short


def dequantize(entry, path: str) -> np.ndarray:
    """One tensor as float32, numpy shape = entry.shape (norm vectors, and the types the kernels
    do not run, before they are repacked)."""
    if entry.type_name not in SUPPORTED_TENSOR_TYPES:
        raise ModelLoadError(f"{path}: tensor {entry.name} has type {entry.type_name}, which fastserve cannot "
                             f"run; supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}")
    if entry.type_name == "F32":
        out = np.asarray(entry.data, dtype=np.float32)
    elif entry.type_name in ("F16", "F64"):
        out = np.asarray(entry.data).astype(np.float32)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize
        out = gguf_dequantize(np.asarray(entry.data), GGMLQuantizationType(entry.type_id)).astype(np.float32, copy=False)
    return np.ascontiguousarray(out.reshape(entry.shape))


def matrix_part(entry, path: str):
    """(label, type, data, rows) of one 2-D tensor for BlockMatrix: its mapped bytes as they are for a
    kernel type; any other type repacked once into Q8_0 blocks (F64 into F32), logged."""
    # up a layer, on purpose: the types the CPU kernels run on the file's own blocks (the rest is repacked)
    from ..backends.cpu._matmul import KERNEL_TYPES

    if entry.type_name not in SUPPORTED_TENSOR_TYPES:
        dequantize(entry, path)                                          # raises the unsupported-type error
    rows, cols = entry.shape
    if entry.type_name in KERNEL_TYPES:
        return (f"{path}: tensor {entry.name}", entry.type_name, entry.data, rows)
    f32 = dequantize(entry, path)
    if entry.type_name == "F64" or cols % 32:
        log.info("tensor %s: %s repacked to F32", entry.name, entry.type_name)
        return (f"{path}: tensor {entry.name}", "F32", f32, rows)
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    log.info("tensor %s: %s repacked to Q8_0", entry.name, entry.type_name)
    return (f"{path}: tensor {entry.name}", "Q8_0", quantize(f32, GGMLQuantizationType.Q8_0), rows)


def expert_entry(entry, e: int):
    """Expert e of a 3-D expert tensor [n_expert, rows, cols]: a 2-D entry viewing its rows (no copy)."""
    return dataclasses.replace(entry, name=f"{entry.name}[{e}]", shape=entry.shape[1:], data=entry.data[e])


def block_matrix(entries, path: str):
    """The BlockMatrix of the row-wise concatenation of entries (2-D tensors of one width)."""
    # up a layer, on purpose: the weights are the CPU kernel's own view of the mapped blocks (no copy, no decode)
    from ..backends.cpu._matmul import BlockMatrix

    try:
        return BlockMatrix([matrix_part(e, path) for e in entries], entries[0].shape[1])
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None


class _Progress:
    """The load's progress bar (tqdm) on stderr, only when stderr is a terminal: tqdm is imported only then,
    so a server started by a script (stderr a file or a pipe) pays nothing for it."""

    def __init__(self, total: int, label: str):
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=label, unit="layer", file=sys.stderr)

    def step(self):
        if self.bar is not None:
            self.bar.update(1)
            if self.bar.n >= self.bar.total:
                self.bar.close()


def load_weights(gf: GGUFFile, cfg: ModelConfig) -> ModelWeights:
    """Views of every tensor the forward pass needs, as the file stores them (no matrix is decoded:
    the products run on the mapped blocks); norms and biases as float32. Checks names and shapes
    against cfg and its architecture row."""
    arch = cfg.arch
    check_tensors(arch, gf.tensors, cfg.n_layer, gf.path)
    names = ["token_embd.weight", "output_norm.weight"]
    names += [f"blk.{i}.{p}" for i in range(cfg.n_layer) for p in arch.layer_tensors()]
    has_output = "output.weight" in gf.tensors
    if has_output:
        names.append("output.weight")
    missing = [n for n in names if n not in gf.tensors]
    if missing:
        raise ModelLoadError(f"{gf.path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
                             f"the {arch.name!r} architecture ({arch.families}) needs them")

    d, D = cfg.n_embd, cfg.head_dim
    q_dim, kv_dim = cfg.n_head * D, cfg.n_head_kv * D
    per_layer = {"attn_norm.weight": (d,), "ffn_norm.weight": (d,), "attn_q.weight": (q_dim, d),
                 "attn_k.weight": (kv_dim, d), "attn_v.weight": (kv_dim, d), "attn_output.weight": (d, q_dim),
                 "attn_qkv.weight": (q_dim + 2 * kv_dim, d), "ffn_gate.weight": (cfg.n_ff, d),
                 "ffn_up.weight": ((2 if arch.fused_gate_up else 1) * cfg.n_ff, d), "ffn_down.weight": (d, cfg.n_ff),
                 "attn_q.bias": (q_dim,), "attn_k.bias": (kv_dim,), "attn_v.bias": (kv_dim,),
                 "attn_q_norm.weight": (D,), "attn_k_norm.weight": (D,),
                 "post_attention_norm.weight": (d,), "post_ffw_norm.weight": (d,),
                 "ffn_gate_inp.weight": (cfg.n_expert, d), "ffn_gate_exps.weight": (cfg.n_expert, cfg.n_ff, d),
                 "ffn_up_exps.weight": (cfg.n_expert, cfg.n_ff, d), "ffn_down_exps.weight": (cfg.n_expert, d, cfg.n_ff),
                 "attn_output.bias": (d,), "attn_sinks.weight": (cfg.n_head,), "ffn_gate_inp.bias": (cfg.n_expert,),
                 "ffn_gate_exps.bias": (cfg.n_expert, cfg.n_ff), "ffn_up_exps.bias": (cfg.n_expert, cfg.n_ff),
                 "ffn_down_exps.bias": (cfg.n_expert, d)}
    expected = {"token_embd.weight": (cfg.n_vocab, d), "output_norm.weight": (d,), "output.weight": (cfg.n_vocab, d),
                "rope_freqs.weight": (cfg.rope_dim // 2,), "rope_factors_long.weight": (cfg.rope_dim // 2,),
                "rope_factors_short.weight": (cfg.rope_dim // 2,)}
    for i in range(cfg.n_layer):
        expected.update({f"blk.{i}.{p}": shape for p, shape in per_layer.items()})
    for n in gf.tensors:
        if tuple(gf.tensors[n].shape) != expected[n]:
            raise ModelLoadError(f"{gf.path}: tensor {n} has shape {tuple(gf.tensors[n].shape)}, expected {expected[n]}")

    t = gf.tensors

    def vec(name):
        return dequantize(t[name], gf.path).reshape(-1) if name in t else None

    def rows(*names):       # 2-D tensors [n_expert, width] side by side (an expert's biases), or None
        return np.concatenate([dequantize(t[n], gf.path) for n in names], axis=1) if names[0] in t else None

    gf.will_need([n for n in t if len(t[n].shape) == 1 or n.endswith(".bias")])   # norms and biases: read together
    progress = _Progress(cfg.n_layer + 1, "loading weights")
    layers = []
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        bias = None
        if arch.qkv_bias:
            bias = np.concatenate([vec(b + "attn_q.bias"), vec(b + "attn_k.bias"), vec(b + "attn_v.bias")])
        if arch.moe:
            ffn = dict(router=block_matrix([t[b + "ffn_gate_inp.weight"]], gf.path),
                       experts_gate_up=[block_matrix([expert_entry(t[b + "ffn_gate_exps.weight"], e),
                                                      expert_entry(t[b + "ffn_up_exps.weight"], e)], gf.path)
                                        for e in range(cfg.n_expert)],
                       experts_down=[block_matrix([expert_entry(t[b + "ffn_down_exps.weight"], e)], gf.path)
                                     for e in range(cfg.n_expert)],
                       w_gate_up=None, w_down=None)
        else:
            ffn = dict(w_gate_up=block_matrix([t[b + n] for n in arch.gate_up_tensors()], gf.path),
                       w_down=block_matrix([t[b + "ffn_down.weight"]], gf.path))
        layers.append(LayerWeights(
            attn_norm=vec(b + "attn_norm.weight"),
            wqkv=block_matrix([t[b + n] for n in arch.qkv_tensors()], gf.path),
            wo=block_matrix([t[b + "attn_output.weight"]], gf.path),
            ffn_norm=vec(b + arch.ffn_norm),
            qkv_bias=bias, q_norm=vec(b + "attn_q_norm.weight"), k_norm=vec(b + "attn_k_norm.weight"),
            post_attn_norm=vec(b + "post_attention_norm.weight") if arch.sandwich_norms else None,
            post_ffn_norm=vec(b + "post_ffw_norm.weight"),
            out_bias=vec(b + "attn_output.bias"), attn_sinks=vec(b + "attn_sinks.weight"),
            router_bias=vec(b + "ffn_gate_inp.bias"),
            experts_gate_up_bias=rows(b + "ffn_gate_exps.bias", b + "ffn_up_exps.bias"),
            experts_down_bias=rows(b + "ffn_down_exps.bias"),
            **ffn))
        progress.step()
    tok = block_matrix([t["token_embd.weight"]], gf.path)
    output = block_matrix([t["output.weight"]], gf.path) if has_output else tok
    progress.step()
    return ModelWeights(tok_embd=tok, layers=layers, out_norm=vec("output_norm.weight"),
                        output=output, rope_freqs=vec("rope_freqs.weight"),
                        rope_long=vec("rope_factors_long.weight"), rope_short=vec("rope_factors_short.weight"))
