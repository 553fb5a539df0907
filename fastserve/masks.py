"""Per-slot constraints and their allowed-token masks, computed off the decode thread's critical path.

    step k:   ... sample (reads masks) → commit → launch(rows) ──worker: consume token, fill mask──┐
    step k+1: admit → build → forward (worker runs meanwhile) → wait() → sample ◀──────────────────┘

The masks are the sampler's own bit array (Sampler.masks, uint32 [n_slots, words]); the worker writes
row s for slot s only, while the decode thread is busy with the next step's admission, batch and
forward pass (llguidance drops the GIL while it computes; so do the forward pass's kernels). The
decode thread waits for the worker before it samples, and before it hands a slot to a new request.

A matcher that falls into an error state (a token it could not take, a grammar that dead-ends)
gets an all-zero mask: the sampler then yields -1 for its row, and the engine ends the request
with FINISH_GRAMMAR and the matcher's message instead of sampling a garbage token.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


class MaskTable:
    """The decode thread's table of constrained slots (its only user); one worker thread, made on first use."""

    def __init__(self, masks: np.ndarray):
        self.masks = masks                       # uint32 [n_slots, n_words]: the sampler's
        self.constraint = [None] * masks.shape[0]
        self.n_active = 0
        self._pool: ThreadPoolExecutor | None = None
        self._pending = None                     # the worker's current job (a Future) or None
        self.wait_ns = 0                         # time the decode thread spent blocked in wait()
        self.waits = 0

    def start(self, slot: int, constraint) -> None:
        """A constrained request takes `slot`: its first mask is computed now (once per request)."""
        self.wait()
        self.constraint[slot] = constraint
        self.n_active += 1
        _fill(constraint, self.masks[slot])

    def end(self, slot: int) -> None:
        if self.constraint[slot] is not None:
            self.constraint[slot] = None
            self.n_active -= 1

    def launch(self, row_slot, sampled, finish) -> None:
        """After commit: each constrained row's token moves its matcher on, then its next mask is
        computed, in the worker. Rows that finished (finish[r] != 0) are left alone."""
        jobs = [(c, int(sampled[r]), self.masks[s]) for r, s in enumerate(row_slot.tolist())
                if (c := self.constraint[s]) is not None and not finish[r]]
        if not jobs:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fastserve-masks")
        self._pending = self._pool.submit(_advance, jobs)

    def wait(self) -> None:
        """Block until the worker's masks are written (before sampling, before a slot changes hands)."""
        job, self._pending = self._pending, None
        if job is not None:
            t0 = time.perf_counter_ns()
            job.result()
            self.wait_ns += time.perf_counter_ns() - t0
            self.waits += 1

    def error(self, slot: int) -> str:
        """Why slot's constraint allows no token."""
        c = self.constraint[slot]
        msg = c.error if c is not None else ""
        return "the constraint allows no token here" + (f": {msg.splitlines()[0]}" if msg else "")

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _fill(constraint, words: np.ndarray) -> None:
    constraint.fill_mask(words)
    if constraint.matcher.is_error():
        words[:] = 0


def _advance(jobs) -> None:
    for constraint, token, words in jobs:
        try:
            if constraint.commit(token):
                _fill(constraint, words)
                continue
        except Exception:           # llguidance refused a call: this request ends, not the decode thread
            pass
        words[:] = 0
