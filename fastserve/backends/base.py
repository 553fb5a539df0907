"""What the engine needs from a backend: a forward pass over one batch, and KV slot copies.

A batch holds tokens of several sequences (slots) at different positions. The
backend owns the KV cache, preallocated as [n_slots, n_ctx_slot] per layer; a
slot's KV row at position p is written when a token at position p goes through
forward(). Rows past a slot's current length are stale and never read, so
cutting a slot back needs no work from the backend.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np


class Backend(Protocol):
    n_slots: int
    n_ctx_slot: int
    n_vocab: int

    def forward(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                out_rows: np.ndarray) -> np.ndarray:
        """tokens, positions, slots: int32 [n]; out_rows: int32 [m] indices into the batch.

        Returns float32 logits [m, n_vocab] for the rows asked for (a view the
        backend may reuse at the next call)."""
        ...

    def copy_slot(self, src: int, dst: int, n_tokens: int) -> None:
        """Copy the first n_tokens of KV from slot src to slot dst."""
        ...

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV one token takes in one slot (every layer, K and V)."""
        ...

    def save_slot(self, slot: int, start: int, n_tokens: int, into: np.ndarray) -> None:
        """Copy KV rows start..start+n_tokens of slot into host memory `into` (uint8, at least
        n_tokens * kv_bytes_per_token() bytes, in a layout of the backend's choosing that
        restore_slot reads back). Allocates nothing: `into` belongs to the prompt cache's pool."""
        ...

    def restore_slot(self, slot: int, start: int, n_tokens: int, src: np.ndarray) -> None:
        """Write KV rows start..start+n_tokens of slot from what save_slot put in `src`."""
        ...
