"""Embeddings: each input's final hidden states (after the output norm), pooled and normalised as llama.cpp's.

    Engine.embed(inputs) ──Inbox(Embed)──▶ decode thread: Embedder.run(budget) once per step, after the step
    EmbedJob.result() / .future ◀── set once every input of the job is done (or failed)

The Embedder owns a KV cache of its own (EMBED_SLOTS sequences of n_ctx_slot tokens; its pages come into
memory only as inputs write them, not all at start as the engine's own cache's) and runs CpuBackend.hidden on it: the forward pass with the out rows' normed states instead of their
logits (no output product). It computes at most the step's prompt budget of tokens per step, so an
embedding shares the machine as a prompt does and never stops the streams; a decode step that has no
embedding to do pays one attribute test.

Batch invariance: the forward pass computes each row on its own, in a fixed order whatever the batch, its
chunks or the threads, and an input's rows see only its own slot; so its vector is the same bytes alone or
among others. Pooling sums in float64 in row order, a fixed order too.
"""
from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future, InvalidStateError

import numpy as np

from .errors import RequestError

log = logging.getLogger("fastserve.embedding")

# llama.cpp's pooling types (--pooling) but rank: none (every token's vector), mean, cls (the first token's),
# last (the last token's).
POOLINGS = ("none", "mean", "cls", "last")
EMBED_SLOTS = 4             # inputs computed side by side in one pass


def normalize(v: np.ndarray, norm: int) -> np.ndarray:
    """llama.cpp's common_embd_normalize of float32 v: -1 none, 0 max absolute scaled to int16's range,
    1 taxicab, 2 Euclidean, p > 2 the p-norm. The sum in float64, the scale applied in float32."""
    x = v.astype(np.float64)
    if norm == -1:
        s = 1.0
    elif norm == 0:
        s = float(np.abs(x).max(initial=0.0)) / 32760.0
    elif norm == 2:
        s = float(np.sqrt(np.dot(x, x)))
    else:
        s = float(np.sum(np.abs(x) ** norm) ** (1.0 / norm))
    return v * np.float32(1.0 / s if s > 0.0 else 0.0)


def check_options(pooling: str, norm) -> None:
    if pooling not in POOLINGS:
        raise RequestError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    if isinstance(norm, bool) or not isinstance(norm, int) or norm < -1:
        raise RequestError(f"embd_normalize must be an integer >= -1 (-1: none, 0: max absolute, 1: taxicab, "
                           f"2: Euclidean, p > 2: p-norm), got {norm!r}")


class PassJob:
    """A job of the decode thread's side passes (embeddings, prompt scores): inputs (int32 token ids each);
    results: per input, written by the decode thread; future: set to results once all are written (or to the
    failure). cancel(): its remaining inputs are skipped at the next step."""

    def __init__(self, inputs: list):
        self.inputs = inputs
        self.results: list = [None] * len(inputs)
        self.n_left = len(inputs)
        self.n_tokens = sum(len(ids) for ids in inputs)
        self.future: Future = Future()
        self.cancelled = False

    def result(self, timeout: float | None = None) -> list:
        return self.future.result(timeout)

    def cancel(self) -> None:
        self.cancelled = True

    def _done(self, results=None, error: BaseException | None = None) -> None:
        """Decode thread: the answer, once. A future its waiter cancelled (asyncio.wrap_future does, when the
        request goes away), even a moment ago, takes none."""
        try:
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(results)
        except InvalidStateError:
            pass


class EmbedJob(PassJob):
    """One embedding request: inputs computed with pooling and normalised with normalize. results (vectors):
    per input, float32 [n_embd] (pooled) or [n_tokens, n_embd] (pooling "none")."""

    def __init__(self, inputs: list, pooling: str, normalize: int):
        super().__init__(inputs)
        self.pooling, self.normalize = pooling, normalize

    @property
    def vectors(self) -> list:
        return self.results


class _Sequence:
    """One input in a slot: how far it is, and its pooled state (float64 sums, or its rows)."""

    def __init__(self, job: EmbedJob, index: int, n_embd: int):
        self.job, self.index, self.done = job, index, 0
        self.ids = job.inputs[index]
        shape = (len(self.ids), n_embd) if job.pooling == "none" else n_embd
        self.acc = np.zeros(shape, np.float64 if job.pooling == "mean" else np.float32)

    def take(self, rows: np.ndarray) -> None:
        """rows float32 [c, n_embd]: the next c tokens' states."""
        pooling, c = self.job.pooling, len(rows)
        if pooling == "mean":
            for r in rows:                  # one row at a time: the same order however the input is chunked
                self.acc += r
        elif pooling == "none":
            self.acc[self.done:self.done + c] = rows
        elif pooling == "last" or self.done == 0:     # cls: the first chunk's first row
            self.acc[:] = rows[-1] if pooling == "last" else rows[0]
        self.done += c

    def result(self) -> np.ndarray:
        job = self.job
        if job.pooling == "none":           # llama-server normalises pooled vectors only
            return self.acc
        v = (self.acc / len(self.ids)).astype(np.float32) if job.pooling == "mean" else self.acc
        return normalize(v, job.normalize)


class Embedder:
    """Embedding jobs on the decode thread: add() queues one, run(budget) computes the next chunk of each
    running input (EMBED_SLOTS at a time), at most budget tokens. backend: a CpuBackend of EMBED_SLOTS
    slots (its own KV cache); max_tokens: the most tokens one run carries (its buffers')."""

    KIND = "embedding"              # in its failures' messages

    def __init__(self, backend, max_tokens: int):
        self._be, self._n_embd = backend, backend.cfg.n_embd
        self._waiting: deque[tuple[EmbedJob, int]] = deque()       # (job, input index) not started yet
        self._slots: list = [None] * backend.n_slots                # the running inputs (_Sequence or alike)
        self._tokens = np.zeros((3, max_tokens), np.int64)         # tokens, positions, slots of a run
        self._rows = np.arange(max_tokens, dtype=np.int64)         # every row is an out row
        self.max_tokens = max_tokens
        self._states = self._out(max_tokens)

    @property
    def busy(self) -> bool:
        return bool(self._waiting) or any(s is not None for s in self._slots)

    def _out(self, max_tokens: int) -> np.ndarray:
        """The reused buffer a pass writes its rows into: float32 [max_tokens, n_embd]."""
        return np.zeros((max_tokens, self._n_embd), np.float32)

    def _pass(self, n: int) -> np.ndarray:
        """The forward pass over the run's first n tokens: one row per token (the hidden states)."""
        tokens, pos, slot = self._tokens
        return self._be.hidden(tokens[:n], pos[:n], slot[:n], self._rows[:n], out=self._states)

    def _sequence(self, job, index: int):
        return _Sequence(job, index, self._n_embd)

    def add(self, job: EmbedJob) -> None:
        self._waiting.extend((job, i) for i in range(len(job.inputs)))

    def run(self, budget: int) -> int:
        """One pass over the next chunks of the running inputs (at most budget tokens); returns the tokens."""
        self._admit()
        tokens, pos, slot = self._tokens
        n, chunks = 0, []
        for s, seq in enumerate(self._slots):
            c = min(len(seq.ids) - seq.done, budget - n, self.max_tokens - n) if seq is not None else 0
            if c <= 0:
                continue
            tokens[n:n + c] = seq.ids[seq.done:seq.done + c]
            pos[n:n + c] = np.arange(seq.done, seq.done + c)
            slot[n:n + c] = s
            chunks.append((s, n, c))
            n += c
        if n == 0:
            return 0
        try:
            states = self._pass(n)
        except Exception as exc:           # contained: the inputs of this pass fail, the engine goes on
            log.exception("%s pass failed", self.KIND)
            error = RequestError(f"{self.KIND} failed: {type(exc).__name__}: {exc}")
            for job in {self._slots[s].job for s, _, _ in chunks}:
                self._fail(job, error)
            return n
        for s, start, c in chunks:
            seq = self._slots[s]
            seq.take(states[start:start + c])
            if seq.done == len(seq.ids):
                self._slots[s] = None
                self._finish(seq)
        return n

    def close(self, error: BaseException) -> None:
        """Every job not answered yet gets error (the engine is closing)."""
        for job in {j for j, _ in self._waiting} | {s.job for s in self._slots if s is not None}:
            job._done(error=error)
        self._waiting.clear()
        self._slots = [None] * len(self._slots)

    def _admit(self) -> None:
        """Cancelled jobs leave their slots; free slots take waiting inputs."""
        for s, seq in enumerate(self._slots):
            if seq is not None and seq.job.cancelled:
                self._slots[s] = None
        for s in range(len(self._slots)):
            while self._slots[s] is None and self._waiting:
                job, i = self._waiting.popleft()
                if not job.cancelled:
                    self._slots[s] = self._sequence(job, i)

    def _finish(self, seq: _Sequence) -> None:
        job = seq.job
        job.results[seq.index] = seq.result()
        job.n_left -= 1
        if job.n_left == 0:
            job._done(job.results)

    def _fail(self, job: EmbedJob, error: BaseException) -> None:
        job.cancelled = True                # its other inputs are dropped at the next admission
        for s, seq in enumerate(self._slots):
            if seq is not None and seq.job is job:
                self._slots[s] = None
        job._done(error=error)
