"""Host-RAM prompt cache: slots' KV prefixes kept in a preallocated pool, restored when a prompt shares them.

    slot KV ──save()──▶ pool blocks (one uint8 buffer, allocated once) ──restore()──▶ slot KV

The pool is `n_blocks` blocks of `block_tokens` tokens each, allocated once when the engine
starts and reused for every copy (never a fresh, zero-filled buffer per copy):
    pool  uint8 [n_blocks, block_tokens * kv_bytes_per_token]   KV, in the backend's layout
    ids   int32 [n_blocks, block_tokens]                         the token ids of those rows
An entry is a token prefix of n tokens held in ceil(n / block_tokens) blocks; entries are
kept least recently used first and the oldest go first when a copy needs room.

Invariants:
- An entry is in the index only once every one of its blocks was copied: a copy that fails
  halfway gives its blocks back, so nothing half-built stays behind.
- A copy that does not fit the byte budget, or whose memory cannot be had, is refused: it is
  logged and counted, and the caller goes on without it (a later restore is cold). save()
  never raises for that: a refused copy is never a slot failure (DESIGN.md, "Batch assembly
  and failures").
- The decode thread is the only caller (DESIGN.md contract 1); stats() may be read from
  anywhere (plain ints).
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np

from . import _faults
from .scheduler import common_prefix

log = logging.getLogger("fastserve.prompt_cache")
MIB = 1 << 20


class Entry:
    __slots__ = ("key", "n", "blocks", "held_from", "reuse_from")

    def __init__(self, key: int, n: int, blocks: list[int], held_from: int = 0, reuse_from: int = 0):
        self.key, self.n, self.blocks = key, n, blocks     # n tokens in blocks[0], blocks[1], ...
        # a sliding-window model's ring layers held only positions held_from..n-1 (backend.kv_held_from),
        # so a restore serves a shared prefix m only for reuse_from <= m <= n (backend.kv_reuse_from; 0: any m)
        self.held_from, self.reuse_from = held_from, reuse_from


class PromptCache:
    """budget_bytes of host RAM for KV prefixes of `backend`'s slots.

    min_tokens: shorter prefixes are not worth an entry (recomputing them is as cheap)."""

    def __init__(self, backend, budget_bytes: int, block_tokens: int = 32, min_tokens: int = 8):
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.backend = backend
        self.block_tokens, self.min_tokens = block_tokens, max(1, min_tokens)
        self.bytes_per_token = int(backend.kv_bytes_per_token())
        self.block_bytes = block_tokens * self.bytes_per_token
        self.n_blocks = int(budget_bytes) // self.block_bytes
        if self.n_blocks == 0:
            log.warning("prompt cache: %.2f MiB holds no block of %d tokens (%.2f MiB); every copy will be refused",
                        budget_bytes / MIB, block_tokens, self.block_bytes / MIB)
        try:        # np.empty: pages are taken from the OS on first use, never zero-filled per copy
            self.pool = np.empty((self.n_blocks, self.block_bytes), np.uint8)
        except MemoryError:
            log.warning("prompt cache: %.0f MiB of host RAM could not be allocated; every copy will be refused",
                        budget_bytes / MIB)
            self.n_blocks = 0
            self.pool = np.empty((0, self.block_bytes), np.uint8)
        self.ids = np.empty((self.n_blocks, block_tokens), np.int32)
        self.free = list(range(self.n_blocks - 1, -1, -1))     # a stack: low blocks are used first
        self.index: OrderedDict[int, Entry] = OrderedDict()    # least recently used first
        self._keys = 0
        self.n_saved = self.n_restored = self.n_refused = self.n_evicted = 0

    # -- lookups --------------------------------------------------------------------------

    def lookup(self, prompt: np.ndarray, n_max: int | None = None) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with prompt that a restore can reuse, and that prefix's
        length (0: none). A sliding-window entry's shared prefix counts only from its reuse_from on,
        judged at n_max (the most of it the caller reuses; default: all)."""
        best, best_len = None, 0
        for e in self.index.values():
            n = self._common_prefix(e, prompt)
            if n > best_len and (n if n_max is None else min(n, n_max)) >= e.reuse_from:
                best, best_len = e, n
        return best, best_len

    def _common_prefix(self, e: Entry, tokens: np.ndarray) -> int:
        n, done, bt = min(e.n, len(tokens)), 0, self.block_tokens
        for b in e.blocks:
            k = min(bt, n - done)
            if k <= 0:
                break
            same = common_prefix(self.ids[b, :k], tokens[done:done + k])
            if same < k:
                return done + same
            done += k
        return done

    # -- copies ---------------------------------------------------------------------------

    def save(self, slot: int, tokens: np.ndarray, keep: Entry | None = None) -> bool:
        """Copy the KV of slot's first len(tokens) tokens (ids `tokens`) into the pool.

        False when it was not kept: too short, already held, or refused (logged). `keep`
        (an entry about to be restored) is never evicted to make room."""
        n = len(tokens)
        if n < self.min_tokens:
            return False
        # with a sliding window an entry serves only the shared prefixes from its reuse_from on: a longer
        # entry holds all of a shorter one only if it serves every prefix that one serves
        reuse_from = self.backend.kv_reuse_from(slot, n)
        superseded = []
        for e in self.index.values():
            common = self._common_prefix(e, tokens)
            if common == n and e.reuse_from <= reuse_from:      # an entry already holds all of it
                self.index.move_to_end(e.key)
                return False
            if common == e.n and reuse_from <= e.reuse_from and e is not keep:   # this copy holds all of e
                superseded.append(e)
        k = -(-n // self.block_tokens)
        try:
            blocks = self._take(k, keep, superseded)
        except MemoryError as exc:
            self._refuse(slot, n, exc)
            return False
        bt = self.block_tokens
        try:
            for i, b in enumerate(blocks):
                lo = i * bt
                m = min(bt, n - lo)
                self.backend.save_slot(slot, lo, m, self.pool[b])
                self.ids[b, :m] = tokens[lo:lo + m]
        except Exception as exc:                    # nothing half-built stays: the blocks go back
            self.free.extend(blocks)
            self._refuse(slot, n, exc)
            return False
        for e in superseded:
            self._drop(e)
        self._keys += 1
        self.index[self._keys] = Entry(self._keys, n, blocks, self.backend.kv_held_from(slot, n), reuse_from)
        self.n_saved += 1
        return True

    def restore(self, e: Entry, slot: int, start: int, n: int) -> bool:
        """Write the KV of tokens start..n of entry e into slot (rows before start already hold
        the same tokens). Whole blocks are copied, as they were saved, so rows up to the end of the
        last block may be written too: they are past what the slot will hold, stale, never read.
        False when the copy failed (logged): rows from start on are then not valid. (With a sliding
        window the caller asks the backend what the slot can reuse after it: kv_reuse_from.)"""
        bt = self.block_tokens
        try:
            for i in range(start // bt, -(-n // bt)):
                lo = i * bt
                self.backend.restore_slot(slot, lo, min(bt, e.n - lo), self.pool[e.blocks[i]], e.held_from)
        except Exception as exc:
            log.warning("slot %d: prompt cache restore of %d tokens failed (%s: %s); computing them instead",
                        slot, n, type(exc).__name__, exc)
            return False
        self.index.move_to_end(e.key)
        self.n_restored += 1
        return True

    def _take(self, k: int, keep: Entry | None, first: list[Entry]) -> list[int]:
        """k free blocks, evicting the entries `first` (this copy holds all they hold), then the least
        recently used ones, never `keep`. MemoryError when impossible."""
        _faults.check_copy()
        reserved = len(keep.blocks) if keep is not None else 0
        if k > self.n_blocks - reserved:
            raise MemoryError(f"it needs {k * self.block_bytes / MIB:.2f} MiB and the cache holds "
                              f"{(self.n_blocks - reserved) * self.block_bytes / MIB:.2f} MiB")
        while len(self.free) < k:
            if first:                           # popped here, so the caller does not drop it again
                self._drop(first.pop())
                continue
            self._drop(next(e for e in self.index.values() if e is not keep))
            self.n_evicted += 1
        return [self.free.pop() for _ in range(k)]

    def _drop(self, e: Entry) -> None:
        del self.index[e.key]
        self.free.extend(e.blocks)

    def _refuse(self, slot: int, n: int, exc: BaseException) -> None:
        self.n_refused += 1
        log.warning("slot %d: prompt cache copy refused (%d tokens, %.2f MiB): %s; a later restore of it will be cold",
                    slot, n, n * self.bytes_per_token / MIB, exc)

    def clear(self) -> None:
        self.index.clear()
        self.free = list(range(self.n_blocks - 1, -1, -1))

    def stats(self) -> dict:
        used = self.n_blocks - len(self.free)
        return {"entries": len(self.index), "tokens": sum(e.n for e in list(self.index.values())),
                "bytes_used": used * self.block_bytes, "bytes_budget": self.n_blocks * self.block_bytes,
                "saved": self.n_saved, "restored": self.n_restored, "refused": self.n_refused,
                "evicted": self.n_evicted}
