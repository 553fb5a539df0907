"""Model: a loaded GGUF model of a family of the architecture table — config, weights, tokenizer — and teacher-forced logits."""
from __future__ import annotations

import os
import time

import numpy as np

from ..errors import ModelLoadError
from .hugepages import no_huge_page_advice
from .gguf_file import GGUFFile
from .transformer import ModelConfig, load_weights
from .tokenizer import Tokenizer


class Model:
    def __init__(self, path: str | os.PathLike):
        t0 = time.perf_counter()
        no_huge_page_advice()           # before the first large array: see hugepages.py
        gf = GGUFFile(path)
        self.path = gf.path
        self.metadata = gf.metadata
        t1 = time.perf_counter()
        self.tokenizer = Tokenizer.from_metadata(gf.metadata)
        t2 = time.perf_counter()
        self.config = ModelConfig.from_metadata(gf.metadata, n_vocab=self.tokenizer.n_vocab)
        if self.config.n_layer > len(gf.tensors):     # before anything is sized by it
            raise ModelLoadError(f"{gf.path}: the metadata says {self.config.n_layer} layers (block_count) but the "
                                 f"file holds {len(gf.tensors)} tensors; the file is corrupt")
        self.weights = load_weights(gf, self.config)
        t3 = time.perf_counter()
        self.load_seconds = t3 - t0
        self.load_phases = {"parse": t1 - t0, "tokenizer": t2 - t1, "weights": t3 - t2}   # seconds

    def load_summary(self) -> str:
        """e.g. "loaded m.gguf in 0.21 s (parse 0.03 s, tokenizer 0.08 s, weights 0.10 s)"."""
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in self.load_phases.items())
        return f"loaded {self.name} in {self.load_seconds:.2f} s ({phases})"

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def logits(self, token_ids, cache_type_k: str = "f16", cache_type_v: str = "f16") -> np.ndarray:
        """Teacher forcing: float32 [len(token_ids), n_vocab] for one fresh sequence from position 0,
        with the KV cache in those types (see backends/cpu/kv_cache.py)."""
        # up a layer, on purpose: teacher forcing is the CPU backend's forward (the golden tests' oracle), imported here lazily
        from ..backends.cpu.backend import CpuBackend

        ids = np.asarray(list(token_ids), dtype=np.int32)
        n = len(ids)
        if n == 0:
            return np.zeros((0, self.config.n_vocab), np.float32)
        if ids.min() < 0 or ids.max() >= self.config.n_vocab:
            raise ValueError(f"token ids must be in [0, {self.config.n_vocab})")
        backend = CpuBackend(self.config, self.weights, n_slots=1, n_ctx_slot=n, cache_type_k=cache_type_k,
                               cache_type_v=cache_type_v, max_tokens=n)
        rows = np.arange(n, dtype=np.int32)
        return np.ascontiguousarray(backend.forward(ids, rows, np.zeros(n, np.int32), rows), dtype=np.float32)


def load_model(path: str | os.PathLike) -> Model:
    """Load a GGUF model of a supported architecture (models/architecture.py: llama, qwen2, qwen3, gemma3),
    memory-mapped; the products run on its blocks as stored."""
    return Model(path)
