"""The CPU backend's KV cache: every layer's keys and values of every slot, in llama-server's cache
types (--cache-type-k / --cache-type-v: f16, the default, f32 or q8_0), in the layout that
fastserve.backends.cpu._attention reads directly (see its docstring):

    k[layer] uint8 [n_slots, ceil(n_rows / KT), Hkv, k_tile_bytes]   keys in transposed tiles of KT
    v[layer] uint8 [n_slots, n_rows, Hkv, row_bytes]                 values, one row per position

n_rows is n_ctx_slot, except in a sliding-window layer (local_layers) with a ring: there it is the
ring's R positions (ring_size), position p at row p % R, so that layer's memory is bounded by its
window, not the context (llama.cpp's SWA cache is sized the same way: window + a step's tokens).

A token's rows are converted once, when its step writes them (store). Positions past a slot's
length are stale and never read (attention reads keys 0..pos only), so copies may move whole tiles.

Rings: a position's row survives until position p + R is written. `held[slot, r]` is the position
whose keys ring row r of slot holds (-1: none valid), the same for every ring layer; reuse_from() reads
it to say how much of a slot's prefix a continuation can still reuse (its window must be in the ring).
"""
from __future__ import annotations

import mmap
import os
import sys
import threading
import weakref

import numpy as np

from . import _attention
from ...errors import ConfigError

KV_CACHE_TYPES = tuple(_attention.KV_TYPES)      # ("f32", "f16", "q8_0")
DEFAULT_CACHE_TYPE = "f16"


def ring_size(window: int, step_tokens: int, n_ctx_slot: int, kt: int = _attention.KT) -> int:
    """Positions a sliding-window layer keeps per slot: the window plus the most tokens one step writes
    into one slot, less one (the step's last query still sees window - 1 keys before the step's first
    token), rounded up to whole K tiles; 0 (no ring: every position) when that is not below n_ctx_slot."""
    if window <= 0:
        return 0
    r = -(-(window + max(1, step_tokens) - 1) // kt) * kt
    return r if r < n_ctx_slot else 0


MADV_POPULATE_WRITE = 23       # Linux 5.14+: fault pages in writable, as a write would, without writing them


def mapped_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """uint8 zeros of shape in an anonymous map of their own (no page resident yet: the kernel gives a
    zero page at the first touch); np.full where there is no mmap with MAP_ANONYMOUS."""
    n = int(np.prod(shape, dtype=np.int64))
    if not hasattr(mmap, "MAP_ANONYMOUS") or n == 0:
        return np.full(shape, 0, np.uint8)
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(buf, np.uint8).reshape(shape)      # the array holds the map; unmapped with it


def _populate_call():
    """libc's madvise through ctypes (which lets the GIL go during the call), or None off Linux (the
    advice's number is Linux's)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


POPULATE_CHUNK = 64 << 20      # bytes the fill thread faults in per call: it lets a dropped cache go between calls


def _populate(refs: list, madvise, done: threading.Event) -> None:
    """The thread that makes a cache resident, chunk by chunk. It holds weak references to the arrays (a
    strong one only during a call), so a cache dropped meanwhile is freed and the thread stops. Where the
    kernel refuses the advice (ENOMEM, EINTR, ...), the rest is written as np.full would. Always sets done."""
    try:            # the lowest priority (Linux: per thread): the decode step's threads go first when both run
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):
        pass
    try:
        for ref in refs:
            for start in range(0, _nbytes(ref), POPULATE_CHUNK):
                a = ref()
                if a is None:                   # the cache is gone: nothing left to make resident
                    return
                flat = a.reshape(-1)[start:start + POPULATE_CHUNK]
                if not make_resident([flat], madvise):
                    flat.fill(0)
                del a, flat
    finally:
        done.set()


def _nbytes(ref) -> int:
    a = ref()
    return 0 if a is None else a.nbytes


def make_resident(arrays: list[np.ndarray], madvise) -> bool:
    """Fault every page of arrays in (MADV_POPULATE_WRITE); their contents are not touched, so this may
    run while other threads write them. False when the kernel refuses (unknown before 5.14, ENOMEM, ...)."""
    for a in arrays:
        if a.nbytes and madvise(a.ctypes.data, a.nbytes, MADV_POPULATE_WRITE) != 0:
            return False
    return True


class KVCache:
    """kernels: fastserve.backends.cpu._attention (or its twin fastserve.backends.cpu.ref.attention, for tests).

    window, local_layers: the model's sliding window (keys a local layer's query sees) and which
    layers are local ([n_layer] bools; () for none); step_tokens: the most tokens one step writes
    into one slot, which sizes the ring (ring_size); a step of more is refused (begin_step). resident: every
    page brought in at start (_make_resident); False leaves them to the first writes (the embeddings' cache:
    embedding.py, whose slots seldom fill)."""

    def __init__(self, n_layer: int, n_slots: int, n_ctx_slot: int, n_head_kv: int, head_dim: int,
                 type_k: str = DEFAULT_CACHE_TYPE, type_v: str = DEFAULT_CACHE_TYPE, kernels=_attention, *,
                 window: int = 0, local_layers=(), step_tokens: int = 512, resident: bool = True):
        for flag, t in (("--cache-type-k", type_k), ("--cache-type-v", type_v)):
            try:
                kernels.kv_type_id(t, head_dim)
            except ValueError as exc:
                raise ConfigError(f"{flag} {t}: {exc}") from None
        self.kernels = kernels
        self.type_k, self.type_v, self.head_dim = type_k, type_v, head_dim
        self.n_layer, self.n_slots, self.n_ctx_slot, self.n_head_kv = n_layer, n_slots, n_ctx_slot, n_head_kv
        self.row_k, self.row_v = kernels.row_bytes(type_k, head_dim), kernels.row_bytes(type_v, head_dim)
        self.window, self.step_tokens = (window if any(local_layers) else 0), step_tokens
        self.ring = ring_size(self.window, step_tokens, n_ctx_slot, kernels.KT)
        # per layer: its ring (0: a row for every position)
        self.rings = [self.ring if li < len(local_layers) and local_layers[li] else 0 for li in range(n_layer)]
        self.held = np.full((n_slots, self.ring), -1, np.int64)
        self._rows = np.zeros(max(1, step_tokens), np.int64)          # store's scratch: ring rows
        self.k, self.v = [], []
        for ring in self.rings:
            n_rows = ring or n_ctx_slot
            self.k.append(mapped_zeros((n_slots, -(-n_rows // kernels.KT), n_head_kv,
                                        kernels.k_tile_bytes(type_k, head_dim))))
            self.v.append(mapped_zeros((n_slots, n_rows, n_head_kv, self.row_v)))
        self.resident = threading.Event()       # set once every page of the cache is in memory (or the fill stopped: the cache was dropped)
        if resident:
            self._make_resident()
        else:
            self.resident.set()                 # nothing to wait for: pages come in as they are written

    def _make_resident(self) -> None:
        """Every page of the cache in memory soon after the start, as llama.cpp clears its KV buffer at start:
        left to the first writes, RSS would creep up for hours as slots reach positions they never
        reached before. The kernel faults the pages in (MADV_POPULATE_WRITE) on a thread of its own, the
        GIL let go, at the lowest priority, while the server starts and serves: a step that writes a page
        not yet in only faults it in itself. Where the advice is unknown, the pages are written now (np.full's
        way); where the kernel refuses it later, the thread writes them."""
        arrays = [a for a in self.k + self.v if a.nbytes]
        madvise = _populate_call() if arrays else None
        if madvise is not None and make_resident(arrays[:1], madvise):
            refs = [weakref.ref(a) for a in arrays[1:]]
            threading.Thread(target=_populate, args=(refs, madvise, self.resident), name="fastserve-kv-resident",
                             daemon=True).start()
            return
        for a in arrays:
            a.fill(0)
        self.resident.set()

    def bytes_per_token(self) -> int:
        """Bytes one token's KV takes in one slot (every layer, K and V): the size of a saved copy's row."""
        return self.n_layer * self.n_head_kv * (self.row_k + self.row_v)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)

    def begin_step(self, slots: np.ndarray, positions: np.ndarray) -> None:
        """A step's rows (int64 [n] each), before any layer stores them: refuses more than step_tokens
        into one slot when there is a ring, and records which position each ring row will hold. Once per
        step, whoever runs the layers' stores (this class's store, or a C forward pass)."""
        if not self.ring:
            return
        n = len(positions)
        if n and (slots.min() < 0 or slots.max() >= self.n_slots or positions.min() < 0):
            raise ValueError(f"slots must be in [0, {self.n_slots}) and positions >= 0, got slots "
                             f"{slots.min()}..{slots.max()}, positions from {positions.min()}")
        if n > self.step_tokens and np.bincount(slots, minlength=self.n_slots).max() > self.step_tokens:
            raise ValueError(f"a step wrote more than {self.step_tokens} tokens into one slot: the ring of "
                             f"{self.ring} positions holds a window of {self.window} only for that many")
        rows = np.remainder(positions, self.ring, out=self._rows[:n]) if n <= len(self._rows) else positions % self.ring
        self.held[slots, rows] = positions

    def store(self, layer: int, k: np.ndarray, v: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> None:
        """k, v float32 [n, Hkv, D] (C-contiguous): row i goes to (slots[i], positions[i]) (after begin_step)."""
        self.kernels.store(self.type_k, self.type_v, self.k[layer], self.v[layer], k, v, slots, positions,
                           ring=self.rings[layer])

    # -- what a slot's prefix still holds -------------------------------------------------------

    def held_from(self, slot: int, n_tokens: int) -> int:
        """The first position p such that the ring layers hold every position p..n_tokens-1 of slot
        (0 without a ring: every position is kept)."""
        if not self.ring or n_tokens <= 0:
            return 0
        lo = max(0, n_tokens - self.ring)
        p = np.arange(lo, n_tokens)
        bad = np.flatnonzero(self.held[slot, p % self.ring] != p)
        return int(p[bad[-1]]) + 1 if len(bad) else lo

    def reuse_from(self, slot: int, n_tokens: int) -> int:
        """The shortest prefix m > 0 of slot's first n_tokens that a continuation at position m can
        reuse (0: any): its first query sees keys m - window + 1 .. m - 1, which the ring must still
        hold. A shorter common prefix reuses nothing (recomputing from m' < m needs keys still earlier)."""
        held = self.held_from(slot, n_tokens)
        return held + self.window - 1 if held else 0

    # -- copies -----------------------------------------------------------------------------------

    def copy_slot(self, src: int, dst: int, n_tokens: int) -> None:
        """Positions 0..n_tokens of src into dst (the K tile holding the last ones goes whole; a ring whole)."""
        kt = self.kernels.KT
        for k, v, ring in zip(self.k, self.v, self.rings):
            n_rows = min(n_tokens, ring) if ring else n_tokens
            k[dst, :-(-n_rows // kt)] = k[src, :-(-n_rows // kt)]
            v[dst, :n_rows] = v[src, :n_rows]
        if self.ring:
            self.held[dst] = np.where(self.held[src] < n_tokens, self.held[src], -1)

    def save_slot(self, slot: int, start: int, n_tokens: int, into: np.ndarray) -> None:
        """Positions start..start+n_tokens of slot into `into` (uint8, >= n_tokens * bytes_per_token()),
        laid out per layer as K rows [n_tokens, Hkv, row_k] then V rows [n_tokens, Hkv, row_v], each
        row in the cache type's row format. A ring layer's positions before held_from() are stale copies.
        Allocates nothing."""
        for li, (kr, vr) in enumerate(self._copy_rows(into, n_tokens)):
            self.kernels.move_rows(self.type_k, self.type_v, self.k[li], self.v[li], self.head_dim, slot, start,
                                   kr, vr, False, ring=self.rings[li])

    def restore_slot(self, slot: int, start: int, n_tokens: int, src: np.ndarray, held_from: int = 0) -> None:
        """The inverse of save_slot. held_from: the copy's first position whose ring rows were valid
        (held_from() of the slot it was saved from); the ring layers hold none before it."""
        for li, (kr, vr) in enumerate(self._copy_rows(src, n_tokens)):
            self.kernels.move_rows(self.type_k, self.type_v, self.k[li], self.v[li], self.head_dim, slot, start,
                                   kr, vr, True, ring=self.rings[li])
        if self.ring:
            p = np.arange(max(start, start + n_tokens - self.ring), start + n_tokens)
            self.held[slot, p % self.ring] = np.where(p >= held_from, p, -1)

    def _copy_rows(self, buf: np.ndarray, n_tokens: int):
        nbytes = n_tokens * self.bytes_per_token()
        if buf.dtype != np.uint8 or buf.ndim != 1 or len(buf) < nbytes or not buf.flags.c_contiguous:
            raise ValueError(f"a KV copy of {n_tokens} tokens needs a contiguous uint8 buffer of {nbytes} bytes")
        layer = n_tokens * self.n_head_kv * (self.row_k + self.row_v)
        split = n_tokens * self.n_head_kv * self.row_k
        for li in range(self.n_layer):
            part = buf[li * layer:(li + 1) * layer]
            yield (part[:split].reshape(n_tokens, self.n_head_kv, self.row_k),
                   part[split:].reshape(n_tokens, self.n_head_kv, self.row_v))
