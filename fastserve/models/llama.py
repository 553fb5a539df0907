"""Llama-family hyperparameters and weights, read from a GGUF file.

Covers SmolLM2, TinyLlama, Llama 2/3, Mistral-style models: RMSNorm, RoPE
(llama.cpp's "normal" pair layout, since convert_hf_to_gguf permutes Q and K for
it), grouped-query attention, SwiGLU, tied or separate output matrix.

Weights are dequantized once at load to float32 (CPU) with gguf.quants, and the matrices are also
packed once for fastserve._matmul's int8 product (LlamaWeights.packed["q8"]): the int8 blocks of
Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 tensors are taken as they are (exact; Q4_1/Q5_1 keep their offset),
any other type is requantized from float32 (one scale per 32 inputs).
Matrix orientation: numpy shape (out_features, in_features), so y = x @ W.T.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import ModelLoadError
from .gguf_file import GGUFFile

SUPPORTED_ARCHITECTURES = ("llama",)
# Types gguf.quants can dequantize (checked at import time of gguf; listed for error messages).
PLAIN_TYPES = ("F32", "F16", "BF16", "F64")
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
               "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
               "TQ1_0", "TQ2_0", "MXFP4")
SUPPORTED_TENSOR_TYPES = PLAIN_TYPES + QUANT_TYPES


@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    head_dim: int
    rope_dim: int
    rope_base: float
    rope_scale: float       # linear position scaling (1.0 = none)
    norm_eps: float

    @classmethod
    def from_metadata(cls, md: dict, n_vocab: int) -> "LlamaConfig":
        arch = md.get("general.architecture", "<missing>")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(f"unsupported model architecture {arch!r}; supported: "
                                 f"{', '.join(SUPPORTED_ARCHITECTURES)} (SmolLM2, TinyLlama, Llama 2/3, Mistral-style)")

        def value(key, default, kinds, ok):
            full = f"{arch}.{key}"
            v = md.get(full, default)
            if v is None:
                raise ModelLoadError(f"GGUF metadata lacks {full!r}; the file is incomplete")
            if isinstance(v, bool) or not isinstance(v, kinds) or not ok(v):
                raise ModelLoadError(f"GGUF metadata {full!r} is {v!r}, not a usable value; the file is corrupt")
            return v

        def count(key, default=None) -> int:      # a size: a positive integer that fits an int32
            return int(value(key, default, (int, np.integer), lambda v: 0 < v < 2**31))

        def number(key, default) -> float:
            return float(value(key, default, (int, float, np.number), lambda v: bool(np.isfinite(v))))

        n_embd = count("embedding_length")
        n_head = count("attention.head_count")
        n_head_kv = count("attention.head_count_kv", n_head)
        if n_head % n_head_kv:
            raise ModelLoadError(f"GGUF metadata: {n_head} attention heads do not split into groups of "
                                 f"{n_head_kv} KV heads; the file is corrupt")
        head_dim = count("attention.key_length", n_embd // n_head)
        scaling = md.get(f"{arch}.rope.scaling.type", "none")
        factor = number("rope.scaling.factor", 1.0) or 1.0
        return cls(
            n_layer=count("block_count"),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            n_ff=count("feed_forward_length"),
            n_vocab=n_vocab,
            n_ctx_train=count("context_length", 2048),
            head_dim=head_dim,
            rope_dim=count("rope.dimension_count", head_dim),
            rope_base=number("rope.freq_base", 10000.0),
            rope_scale=factor if scaling == "linear" else 1.0,
            norm_eps=number("attention.layer_norm_rms_epsilon", 1e-5),
        )


@dataclass
class LayerWeights:
    """Q, K, V and gate, up are stacked so that each is one matrix product (fewer, larger calls)."""
    attn_norm: np.ndarray   # [n_embd]
    wqkv: np.ndarray        # [(n_head + 2*n_head_kv)*head_dim, n_embd]: rows Q, then K, then V
    wo: np.ndarray          # [n_embd, n_head*head_dim]
    ffn_norm: np.ndarray    # [n_embd]
    w_gate_up: np.ndarray   # [2*n_ff, n_embd]: rows gate, then up
    w_down: np.ndarray      # [n_embd, n_ff]


@dataclass
class LlamaWeights:
    tok_embd: np.ndarray            # [n_vocab, n_embd]
    layers: list[LayerWeights]
    out_norm: np.ndarray            # [n_embd]
    output: np.ndarray              # [n_vocab, n_embd]; the same array as tok_embd when tied
    rope_freqs: np.ndarray | None   # [rope_dim/2] llama3-style frequency factors, or None
    # Backend-specific copies made once per weights object (e.g. "q8": the matrices requantized for
    # fastserve._matmul), so that every backend built on these weights shares them.
    packed: dict = field(default_factory=dict, repr=False, compare=False)


def dequantize(entry, path: str) -> np.ndarray:
    """One tensor as float32, numpy shape = entry.shape."""
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


# GGUF blocks of 32 weights that are int8 values times a scale (plus an offset): bytes per block.
EXACT_BLOCK_TYPES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}


def exact_blocks(entry):
    """A Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 matrix [rows, cols] as it is stored: (q int8 [rows, cols],
    d float32 [rows, cols/32], m float32 like d for Q4_1/Q5_1, else None), w = d * q (+ m) per
    block. None for any other type. (ggml's block layouts: f16 d, [f16 m], [u32 high bits], then
    16 bytes whose low nibbles are elements 0..15 and high nibbles 16..31, or 32 int8 for Q8_0.)"""
    t = entry.type_name
    if t not in EXACT_BLOCK_TYPES or len(entry.shape) != 2 or entry.shape[1] % 32:
        return None
    rows, cols = entry.shape
    raw = np.asarray(entry.data, dtype=np.uint8).reshape(-1, EXACT_BLOCK_TYPES[t])
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, cols // 32)
    m = None
    if t == "Q8_0":
        return raw[:, 2:].copy().view(np.int8).reshape(rows, cols), d, None
    at = 2
    if t in ("Q4_1", "Q5_1"):
        m = raw[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(rows, cols // 32)
        at = 4
    q = np.empty((len(raw), 32), np.uint8)
    if t in ("Q5_0", "Q5_1"):
        qh = raw[:, at:at + 4].copy().view("<u4")                      # [blocks, 1]
        at += 4
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    qs = raw[:, at:at + 16]
    q[:, :16], q[:, 16:] = qs & 0x0F, qs >> 4
    if t in ("Q5_0", "Q5_1"):
        q |= high
    q = q.view(np.int8)
    if t == "Q4_0":
        q -= 8
    elif t == "Q5_0":
        q -= 16
    return q.reshape(rows, cols), d, m


def _q8_matrix(entries, f32: np.ndarray):
    """The Q8Matrix of the row-wise concatenation of entries (whose float32 values are f32): exact
    blocks where the type has them, the others requantized from f32; offsets if any part has them."""
    from .._matmul import Q8Matrix, quantize_rows

    parts, row = [], 0
    for e in entries:
        blocks = exact_blocks(e)
        if blocks is None:
            blocks = (*quantize_rows(np.ascontiguousarray(f32[row:row + e.shape[0]])), None)
        parts.append(blocks)
        row += e.shape[0]
    q = np.concatenate([p[0] for p in parts])
    d = np.concatenate([p[1] for p in parts])
    m = None
    if any(p[2] is not None for p in parts):
        m = np.concatenate([p[2] if p[2] is not None else np.zeros_like(p[1]) for p in parts])
    return Q8Matrix.from_blocks(np.ascontiguousarray(q), np.ascontiguousarray(d), m)


class _Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done = total, label, 0
        self.enabled = sys.stderr.isatty()

    def step(self):
        self.done += 1
        if self.enabled:
            width = 30
            filled = width * self.done // self.total
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def load_weights(gf: GGUFFile, cfg: LlamaConfig, q8: bool = True) -> LlamaWeights:
    """Dequantize every tensor the forward pass needs; checks shapes against cfg. q8: also pack the
    matrices for fastserve._matmul (packed["q8"], see the module docstring)."""
    names = ["token_embd.weight", "output_norm.weight"]
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    names += [f"blk.{i}.{p}.weight" for i in range(cfg.n_layer) for p in per_layer]
    has_output = "output.weight" in gf.tensors
    if has_output:
        names.append("output.weight")
    missing = [n for n in names if n not in gf.tensors]
    if missing:
        raise ModelLoadError(f"{gf.path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
                             "is this a llama-family model?")
    progress = _Progress(len(names), "loading weights")
    got = {}
    for n in names:
        got[n] = dequantize(gf.tensors[n], gf.path)
        progress.step()

    q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    expected = {"token_embd.weight": (cfg.n_vocab, cfg.n_embd), "output_norm.weight": (cfg.n_embd,)}
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        expected.update({b + "attn_norm.weight": (cfg.n_embd,), b + "ffn_norm.weight": (cfg.n_embd,),
                         b + "attn_q.weight": (q_dim, cfg.n_embd), b + "attn_k.weight": (kv_dim, cfg.n_embd),
                         b + "attn_v.weight": (kv_dim, cfg.n_embd), b + "attn_output.weight": (cfg.n_embd, q_dim),
                         b + "ffn_gate.weight": (cfg.n_ff, cfg.n_embd), b + "ffn_up.weight": (cfg.n_ff, cfg.n_embd),
                         b + "ffn_down.weight": (cfg.n_embd, cfg.n_ff)})
    for n, shape in expected.items():
        if got[n].shape != shape:
            raise ModelLoadError(f"{gf.path}: tensor {n} has shape {got[n].shape}, expected {shape}")

    layers = []
    for i in range(cfg.n_layer):
        t = {p: got.pop(f"blk.{i}.{p}.weight") for p in per_layer}
        layers.append(LayerWeights(
            attn_norm=t["attn_norm"],
            wqkv=np.concatenate([t["attn_q"], t["attn_k"], t["attn_v"]]),
            wo=t["attn_output"], ffn_norm=t["ffn_norm"],
            w_gate_up=np.concatenate([t["ffn_gate"], t["ffn_up"]]),
            w_down=t["ffn_down"]))
    rope_freqs = None
    if "rope_freqs.weight" in gf.tensors:
        rope_freqs = dequantize(gf.tensors["rope_freqs.weight"], gf.path).reshape(-1)
    tok = got["token_embd.weight"]
    weights = LlamaWeights(tok_embd=tok, layers=layers, out_norm=got["output_norm.weight"],
                           output=got["output.weight"] if has_output else tok, rope_freqs=rope_freqs)
    if q8:
        t = gf.tensors
        packed = []
        for i, lw in enumerate(layers):
            b = f"blk.{i}."
            packed.append((_q8_matrix([t[b + "attn_q.weight"], t[b + "attn_k.weight"], t[b + "attn_v.weight"]], lw.wqkv),
                           _q8_matrix([t[b + "attn_output.weight"]], lw.wo),
                           _q8_matrix([t[b + "ffn_gate.weight"], t[b + "ffn_up.weight"]], lw.w_gate_up),
                           _q8_matrix([t[b + "ffn_down.weight"]], lw.w_down)))
        output = _q8_matrix([t["output.weight" if has_output else "token_embd.weight"]], weights.output)
        weights.packed["q8"] = (packed, output)
    return weights
