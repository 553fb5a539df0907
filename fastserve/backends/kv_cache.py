"""The CPU backend's KV cache: every layer's keys and values of every slot, in llama-server's cache
types (--cache-type-k / --cache-type-v: f16, the default, f32 or q8_0), in the layout that
fastserve._attention reads directly (see its docstring):

    k[layer] uint8 [n_slots, ceil(n_ctx_slot / KT), Hkv, k_tile_bytes]   keys in transposed tiles of KT
    v[layer] uint8 [n_slots, n_ctx_slot, Hkv, row_bytes]                 values, one row per position

A token's rows are converted once, when its step writes them (store). Positions past a slot's
length are stale and never read (attention reads keys 0..pos only), so copies may move whole tiles.
"""
from __future__ import annotations

import numpy as np

from .. import _attention
from ..errors import ConfigError

KV_CACHE_TYPES = tuple(_attention.KV_TYPES)      # ("f32", "f16", "q8_0")
DEFAULT_CACHE_TYPE = "f16"


class KVCache:
    """kernels: fastserve._attention (or its twin fastserve.ref.attention, for tests)."""

    def __init__(self, n_layer: int, n_slots: int, n_ctx_slot: int, n_head_kv: int, head_dim: int,
                 type_k: str = DEFAULT_CACHE_TYPE, type_v: str = DEFAULT_CACHE_TYPE, kernels=_attention):
        for flag, t in (("--cache-type-k", type_k), ("--cache-type-v", type_v)):
            try:
                kernels.kv_type_id(t, head_dim)
            except ValueError as exc:
                raise ConfigError(f"{flag} {t}: {exc}") from None
        self.kernels = kernels
        self.type_k, self.type_v, self.head_dim = type_k, type_v, head_dim
        self.n_layer, self.n_slots, self.n_ctx_slot, self.n_head_kv = n_layer, n_slots, n_ctx_slot, n_head_kv
        self.row_k, self.row_v = kernels.row_bytes(type_k, head_dim), kernels.row_bytes(type_v, head_dim)
        n_tiles = -(-n_ctx_slot // kernels.KT)
        # np.full, not np.zeros: every page is written now, as llama.cpp clears its KV buffer at start.
        # np.zeros (calloc) leaves each page to its first write, so RSS would creep up for hours as
        # slots reach positions they never reached before.
        self.k = [np.full((n_slots, n_tiles, n_head_kv, kernels.k_tile_bytes(type_k, head_dim)), 0, np.uint8)
                  for _ in range(n_layer)]
        self.v = [np.full((n_slots, n_ctx_slot, n_head_kv, self.row_v), 0, np.uint8) for _ in range(n_layer)]

    def bytes_per_token(self) -> int:
        """Bytes one token's KV takes in one slot (every layer, K and V)."""
        return self.n_layer * self.n_head_kv * (self.row_k + self.row_v)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)

    def store(self, layer: int, k: np.ndarray, v: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> None:
        """k, v float32 [n, Hkv, D] (C-contiguous): row i goes to (slots[i], positions[i])."""
        self.kernels.store(self.type_k, self.type_v, self.k[layer], self.v[layer], k, v, slots, positions)

    def copy_slot(self, src: int, dst: int, n_tokens: int) -> None:
        """Positions 0..n_tokens of src into dst (the K tile holding the last ones goes whole)."""
        n_tiles = -(-n_tokens // self.kernels.KT)
        for k, v in zip(self.k, self.v):
            k[dst, :n_tiles] = k[src, :n_tiles]
            v[dst, :n_tokens] = v[src, :n_tokens]

    def save_slot(self, slot: int, start: int, n_tokens: int, into: np.ndarray) -> None:
        """Positions start..start+n_tokens of slot into `into` (uint8, >= n_tokens * bytes_per_token()),
        laid out per layer as K rows [n_tokens, Hkv, row_k] then V rows [n_tokens, Hkv, row_v], each
        row in the cache type's row format. Allocates nothing."""
        for li, (kr, vr) in enumerate(self._rows(into, n_tokens)):
            self.kernels.move_rows(self.type_k, self.type_v, self.k[li], self.v[li], self.head_dim, slot, start,
                                   kr, vr, False)

    def restore_slot(self, slot: int, start: int, n_tokens: int, src: np.ndarray) -> None:
        """The inverse of save_slot."""
        for li, (kr, vr) in enumerate(self._rows(src, n_tokens)):
            self.kernels.move_rows(self.type_k, self.type_v, self.k[li], self.v[li], self.head_dim, slot, start,
                                   kr, vr, True)

    def _rows(self, buf: np.ndarray, n_tokens: int):
        nbytes = n_tokens * self.bytes_per_token()
        if buf.dtype != np.uint8 or buf.ndim != 1 or len(buf) < nbytes or not buf.flags.c_contiguous:
            raise ValueError(f"a KV copy of {n_tokens} tokens needs a contiguous uint8 buffer of {nbytes} bytes")
        layer = n_tokens * self.n_head_kv * (self.row_k + self.row_v)
        split = n_tokens * self.n_head_kv * self.row_k
        for li in range(self.n_layer):
            part = buf[li * layer:(li + 1) * layer]
            yield (part[:split].reshape(n_tokens, self.n_head_kv, self.row_k),
                   part[split:].reshape(n_tokens, self.n_head_kv, self.row_v))
