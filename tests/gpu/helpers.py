"""Shared by the GPU tests: error measures and weights rounded as the GPU stores them."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from fastserve.backends.cpu._matmul import BlockMatrix
from fastserve.models.transformer import ModelWeights


def rel_err(got, want) -> float:
    """Worst row's ||got - want|| / ||want|| (rows: the last axis), computed in float64."""
    g = np.asarray(got, np.float64).reshape(-1, np.shape(want)[-1])
    w = np.asarray(want, np.float64).reshape(g.shape)
    num = np.linalg.norm(g - w, axis=1)
    den = np.maximum(np.linalg.norm(w, axis=1), 1e-30)
    return float((num / den).max()) if len(g) else 0.0


def round_to(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 a rounded to f16 or bf16 (nearest even) and back to float32."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "f16":
        return a.astype(np.float16).astype(np.float32)
    if dtype == "bf16":
        u = a.view(np.uint32).astype(np.uint64)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32) << 16
        return r.view(np.float32)
    if dtype == "f32":
        return a
    raise ValueError(dtype)


def rounded_weights(w: ModelWeights, dtype: str) -> ModelWeights:
    """The weights as CupyBackend holds them: matrices (a mixture of experts' experts too) and the embedding
    rounded to dtype (as F32 BlockMatrix, which the NumPy backend multiplies in float32); norms and a mixture of
    experts' router float32 (as the file's)."""
    def rounded(m):
        return BlockMatrix.from_float(round_to(m.to_float(), dtype))

    def ffn(lw):
        if lw.router is None:
            return dict(w_gate_up=rounded(lw.w_gate_up), w_down=rounded(lw.w_down))
        return dict(experts_gate_up=[rounded(m) for m in lw.experts_gate_up],
                    experts_down=[rounded(m) for m in lw.experts_down])

    layers = [dataclasses.replace(lw, wqkv=rounded(lw.wqkv), wo=rounded(lw.wo), **ffn(lw)) for lw in w.layers]
    tok = rounded(w.tok_embd)
    out = tok if w.output is w.tok_embd else rounded(w.output)
    return dataclasses.replace(w, tok_embd=tok, layers=layers, output=out)


def synthetic_family(directory, family: str):
    """The family's synthetic model as tests/golden/synthetic_families.py writes it (its shape, multipliers,
    weight type and seed; granite's weights scaled against its multipliers) with the small test vocabulary
    instead of SmolLM2's 49,152 tokens (which needs the default model, and minutes a step on the emulator)."""
    import fastserve
    from fastserve.models.synthetic import write_llama_gguf
    from tests.golden.synthetic_families import ARCHITECTURE, SPECS
    spec = {k: v for k, v in SPECS[family].items() if k != "pre"}
    return fastserve.load_model(write_llama_gguf(Path(directory) / f"{family}.gguf",
                                                 architecture=ARCHITECTURE.get(family, family), **spec))
