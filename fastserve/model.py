"""Model: a loaded GGUF llama model — config, weights, tokenizer — and teacher-forced logits."""
from __future__ import annotations

import os
import time

import numpy as np

from .models.gguf_file import GGUFFile
from .models.llama import LlamaConfig, load_weights
from .tokenizer import Tokenizer


class Model:
    def __init__(self, path: str | os.PathLike):
        t0 = time.perf_counter()
        gf = GGUFFile(path)
        self.path = gf.path
        self.metadata = gf.metadata
        self.tokenizer = Tokenizer.from_metadata(gf.metadata)
        self.config = LlamaConfig.from_metadata(gf.metadata, n_vocab=self.tokenizer.n_vocab)
        self.weights = load_weights(gf, self.config)
        self.load_seconds = time.perf_counter() - t0

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def logits(self, token_ids) -> np.ndarray:
        """Teacher forcing: float32 [len(token_ids), n_vocab] for one fresh sequence from position 0."""
        from .backends.numpy_backend import NumpyBackend

        ids = np.asarray(list(token_ids), dtype=np.int32)
        n = len(ids)
        if n == 0:
            return np.zeros((0, self.config.n_vocab), np.float32)
        if ids.min() < 0 or ids.max() >= self.config.n_vocab:
            raise ValueError(f"token ids must be in [0, {self.config.n_vocab})")
        backend = NumpyBackend(self.config, self.weights, n_slots=1, n_ctx_slot=n)
        rows = np.arange(n, dtype=np.int32)
        return np.ascontiguousarray(backend.forward(ids, rows, np.zeros(n, np.int32), rows), dtype=np.float32)


def load_model(path: str | os.PathLike) -> Model:
    """Load a llama-family GGUF model (memory-mapped; the products run on its blocks as stored)."""
    return Model(path)
