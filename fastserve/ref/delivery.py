"""Pure-Python twin of fastserve/_delivery.pyx: same names, same behaviour.

The invariants are the ones at the top of _delivery.pyx. Here the GIL stands in
for the atomics: every attribute store and load below is one bytecode-level
operation, so the count-then-finish publication order and the waiting-flag
handshake hold as written (this twin is not meant for free-threaded builds).
"""
from __future__ import annotations

import numpy as np

FINISH_STOP = 1
FINISH_LENGTH = 2
FINISH_CANCELLED = 3
FINISH_ERROR = 4
FINISH_CLOSED = 5
FINISH_GRAMMAR = 6
FINISH_REASONS = {1: "stop", 2: "length", 3: "cancelled", 4: "error", 5: "closed", 6: "grammar"}

WAIT_NONE, WAIT_DATA, WAIT_FINISH = 0, 1, 2


def _index(x):
    """Accept what Cython's Py_ssize_t/int arguments accept: integers, not floats."""
    return x.__index__()


class ResultBuffer:
    """One request's token buffer: int32 ids [capacity], and top-N ids/probs
    [capacity, n_probs] only when n_probs > 0."""

    __slots__ = ("_capacity", "_n_probs", "_tokens", "_top_ids", "_top_probs", "_count", "_read_pos",
                 "_finish_code", "_error", "_overflowed", "_waiting", "waiter", "_slot", "_n_cached", "draft_n",
                 "draft_n_accepted", "__weakref__")

    def __init__(self, capacity: int, n_probs: int = 0):
        capacity, n_probs = _index(capacity), _index(n_probs)
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if n_probs < 0:
            raise ValueError(f"n_probs must be >= 0, got {n_probs}")
        self._capacity = capacity
        self._n_probs = n_probs
        self._tokens = np.empty(capacity, dtype=np.int32)                       # [capacity]
        self._top_ids = np.empty((capacity, n_probs), dtype=np.int32) if n_probs else None      # [capacity, N]
        self._top_probs = np.empty((capacity, n_probs), dtype=np.float32) if n_probs else None  # [capacity, N]
        self._count = 0
        self._read_pos = 0
        self._finish_code = 0
        self._error = None
        self._overflowed = False
        self._waiting = WAIT_NONE
        self.waiter = None
        self._slot, self._n_cached = -1, 0
        self.draft_n = self.draft_n_accepted = 0       # speculative decoding: written before the finish

    capacity = property(lambda self: self._capacity)
    n_probs = property(lambda self: self._n_probs)
    count = property(lambda self: self._count, doc="Tokens published so far.")
    read_pos = property(lambda self: self._read_pos, doc="Tokens consumed so far.")
    available = property(lambda self: self._count - self._read_pos, doc="Published, not consumed.")
    finished = property(lambda self: self._finish_code != 0)
    finish_code = property(lambda self: self._finish_code, doc="0 while running, then the FINISH_* code.")
    waiting = property(lambda self: self._waiting)
    slot = property(lambda self: self._slot, doc="Where the request runs (-1 until attach()).")
    n_cached = property(lambda self: self._n_cached, doc="Its prompt tokens whose KV was reused.")

    @property
    def error(self):
        if self._finish_code == 0:
            return None
        if self._error is None and self._overflowed:
            return f"result buffer full: more than {self._capacity} tokens sent to one request"
        return self._error

    @property
    def ready(self):
        return self._finish_code != 0 or self._count > self._read_pos

    # -- consumer side ---------------------------------------------------------

    def take(self):
        start, stop = self._read_pos, self._count
        out = self._tokens[start:stop].tolist()
        self._read_pos = stop
        return out

    def take_probs(self):
        start, stop = self._read_pos, self._count
        out = (self._tokens[start:stop].tolist(),) + self._probs(start, stop)
        self._read_pos = stop
        return out

    def all_tokens(self):
        return self._tokens[:self._count].tolist()

    def all_probs(self):
        return self._probs(0, self._count)

    def _probs(self, start, stop):
        if not self._n_probs:
            return np.empty((stop - start, 0), np.int32), np.empty((stop - start, 0), np.float32)
        return self._top_ids[start:stop].copy(), self._top_probs[start:stop].copy()

    def arm(self, finish_only=False):
        self._waiting = WAIT_FINISH if finish_only else WAIT_DATA
        if self._finish_code != 0 or (not finish_only and self._count > self._read_pos):
            self._waiting = WAIT_NONE
            return False
        return True

    def disarm(self):
        self._waiting = WAIT_NONE

    # -- producer side (Delivery only) -----------------------------------------

    def _send(self, token, ids, probs):
        if self._finish_code != 0:
            return False
        c = self._count
        if c >= self._capacity:
            self._overflowed = True
            self._finish_code = FINISH_ERROR
            return False
        self._tokens[c] = token
        n = self._n_probs
        if n:
            k = 0 if ids is None else min(n, ids.shape[0])
            if k:
                self._top_ids[c, :k] = ids[:k]
                self._top_probs[c, :k] = probs[:k]
            self._top_ids[c, k:] = -1
            self._top_probs[c, k:] = 0.0
        self._count = c + 1
        return True

    def _claim(self, states):
        """Move `waiting` from one of `states` to WAIT_NONE; True when we did."""
        if self._waiting in states:
            self._waiting = WAIT_NONE
            return True
        return False

    def __repr__(self):
        return (f"<ResultBuffer {self._count}/{self._capacity} tokens, read {self._read_pos}, "
                f"n_probs {self._n_probs}, finish {self._finish_code}>")


def _check_slot(slot, n_slots):
    if slot < 0 or slot >= n_slots:
        raise IndexError(f"slot {slot} out of range [0, {n_slots})")


def _as_array(x, dtype, ndim, name):
    if x is None:
        raise TypeError(f"{name} must not be None")
    a = np.asarray(x)
    if a.ndim != ndim:
        raise ValueError(f"Buffer has wrong number of dimensions (expected {ndim}, got {a.ndim})")
    if a.dtype != dtype:
        raise ValueError(f"Buffer dtype mismatch, expected {np.dtype(dtype)} but got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError("ndarray is not C-contiguous")
    return a


class Delivery:
    """The decode thread's side: a slot-indexed table of attached buffers."""

    def __init__(self, n_slots: int, waker):
        n_slots = _index(n_slots)
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        if not callable(waker):
            raise TypeError("waker must be callable: waker(buffers)")
        self._n_slots = n_slots
        self._bufs = [None] * n_slots
        self._ready_slots = []
        self._ready_flag = [False] * n_slots
        self._pending = []
        self._waker = waker
        self._closed = False
        self._tokens_sent = 0
        self._wakes = 0

    n_slots = property(lambda self: self._n_slots)
    tokens_sent = property(lambda self: self._tokens_sent, doc="Tokens appended since creation.")
    wakes = property(lambda self: self._wakes, doc="Waker calls since creation.")
    closed = property(lambda self: self._closed)

    def buffer(self, slot):
        _check_slot(slot, self._n_slots)
        return self._bufs[slot]

    def attach(self, slot, reader, n_cached=0):
        _check_slot(slot, self._n_slots)
        n_cached = _index(n_cached)
        buf = reader if isinstance(reader, ResultBuffer) else getattr(reader, "buffer", reader)
        if not isinstance(buf, ResultBuffer):
            raise TypeError(f"Cannot convert {type(buf).__name__} to fastserve.ref.delivery.ResultBuffer")
        if self._bufs[slot] is not None:
            raise ValueError(f"slot {slot} already has a reader attached; detach it first")
        if self._closed:
            self._finish_buf(buf, FINISH_CLOSED, None)
            self.wake()
            return
        buf._slot, buf._n_cached = slot, n_cached
        self._bufs[slot] = buf

    def detach(self, slot):
        _check_slot(slot, self._n_slots)
        buf = self._bufs[slot]
        if buf is None:
            return None
        if self._ready_flag[slot]:
            self._ready_flag[slot] = False
            self._pending.append(buf)
            self._ready_slots.remove(slot)
        self._bufs[slot] = None
        return buf

    def send_step(self, slots, tokens, probs_ids=None, probs=None):
        slots = _as_array(slots, np.int32, 1, "slots")
        tokens = _as_array(tokens, np.int32, 1, "tokens")
        if probs_ids is not None:
            probs_ids = _as_array(probs_ids, np.int32, 2, "probs_ids")
        if probs is not None:
            probs = _as_array(probs, np.float32, 2, "probs")
        n = slots.shape[0]
        if tokens.shape[0] != n:
            raise ValueError(f"tokens has {tokens.shape[0]} entries for {n} slots")
        if (probs_ids is None) != (probs is None):
            raise ValueError("probs_ids and probs go together: give both or neither")
        if probs_ids is not None:
            if probs_ids.shape[0] != n or probs.shape[0] != n or probs_ids.shape[1] != probs.shape[1]:
                raise ValueError(f"probs_ids {probs_ids.shape[:2]} and probs {probs.shape[:2]} "
                                 f"must both be [{n}, N]")
        for s in slots.tolist():
            _check_slot(s, self._n_slots)
        sent = 0
        slot_list, token_list = slots.tolist(), tokens.tolist()
        for i, s in enumerate(slot_list):
            buf = self._bufs[s]
            if buf is None or token_list[i] < 0:
                continue
            ids_row = probs_row = None
            if probs_ids is not None and probs_ids.shape[1]:
                ids_row, probs_row = probs_ids[i], probs[i]
            if buf._send(token_list[i], ids_row, probs_row):
                sent += 1
        for s in slot_list:
            buf = self._bufs[s]
            if buf is None or self._ready_flag[s]:
                continue
            states = (WAIT_DATA,) if buf._finish_code == 0 else (WAIT_DATA, WAIT_FINISH)
            if buf._claim(states):
                self._ready_flag[s] = True
                self._ready_slots.append(s)
        self._tokens_sent += sent

    def finish(self, slot, code, error=None):
        _check_slot(slot, self._n_slots)
        code = _index(code)
        buf = self._bufs[slot]
        if buf is None:
            raise ValueError(f"slot {slot} has no reader attached")
        self._finish_buf(buf, code, error)

    def reject(self, reader, code, error=None):
        code = _index(code)
        buf = reader if isinstance(reader, ResultBuffer) else getattr(reader, "buffer", reader)
        if not isinstance(buf, ResultBuffer):
            raise TypeError(f"Cannot convert {type(buf).__name__} to fastserve.ref.delivery.ResultBuffer")
        self._finish_buf(buf, code, error)

    def _finish_buf(self, buf, code, error):
        if code <= 0:
            raise ValueError(f"finish code must be > 0, got {code}")
        if error is not None and not isinstance(error, str):
            raise TypeError("error must be a str or None")
        if buf._finish_code != 0:
            return
        buf._error = error
        buf._finish_code = code
        if buf._claim((WAIT_DATA, WAIT_FINISH)):
            self._pending.append(buf)

    def wake(self):
        ready = self._pending
        for s in self._ready_slots:
            if self._ready_flag[s]:
                self._ready_flag[s] = False
                ready.append(self._bufs[s])
        self._ready_slots.clear()
        if not ready:
            return 0
        self._pending = []
        self._wakes += 1
        self._waker(ready)
        return len(ready)

    def close(self):
        self._closed = True
        for slot in range(self._n_slots):
            buf = self._bufs[slot]
            if buf is not None:
                self._finish_buf(buf, FINISH_CLOSED, None)
                self.detach(slot)
        return self.wake()

    def attached(self):
        return [s for s in range(self._n_slots) if self._bufs[s] is not None]

    def __repr__(self):
        return f"<Delivery {len(self.attached())}/{self._n_slots} slots attached, {self.tokens_sent} tokens sent>"
