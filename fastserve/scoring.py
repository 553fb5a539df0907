"""Prompt scores: each prompt token's log-probability given the tokens before it (teacher forcing), and the
most probable alternatives there: what OpenAI's `echo` with `logprobs` returns, and what evaluation harnesses
(lm-evaluation-harness's loglikelihood) sum.

    Engine.score(prompts, top=k) ──Inbox(Embed)──▶ decode thread: Scorer.run(budget) once per step, after the step
    ScoreJob.result() / .future ◀── per prompt, PromptScores

The Scorer is the Embedder's side pass (embedding.py) with logits instead of hidden states: its own KV cache
(a fresh sequence from position 0 per prompt, never a slot's cached prefix), at most the step's prompt budget
of tokens a step. Row i's logits give token i + 1's log-probability, so a prompt of n tokens takes a pass
over its first n - 1; the first token has none (OpenAI's null).

Batch invariance: the forward pass computes each row on its own, in a fixed order whatever the batch or the
threads (embedding.py), and the log-softmax of a row is NumPy float64 over that row alone: a prompt's scores
are the same bytes alone or beside others, and equal log_softmax(Model.logits(prompt)).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .embedding import Embedder, PassJob

SCORE_SLOTS = 4             # prompts computed side by side in one pass
SCORE_ROWS = 64             # logits rows of one pass: [64, n_vocab] float32 (64 MiB at Gemma 3's 262k vocabulary)


class PromptScores(NamedTuple):
    """One prompt's scores, n = its tokens: logprobs float64 [n] (token i's natural log-probability; nan at
    0); top_ids int32 [n, k] and top_logprobs float64 [n, k]: the k most probable tokens at each position,
    most probable first, ties to the lower id (row 0: -1 and nan)."""
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


class ScoreJob(PassJob):
    """One scoring request: inputs (int32 token ids each), top: alternatives kept per token. results:
    per input, PromptScores."""

    def __init__(self, inputs: list, top: int):
        super().__init__(inputs)
        self.top = top


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 [m, n_vocab] natural-log probabilities of float32 logits rows, each row on its own."""
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=1, keepdims=True))
    return x


def top_k(lp: np.ndarray, k: int) -> np.ndarray:
    """int32 [m, k]: the k largest of each row of lp (k < its width), largest first, ties to the lower id."""
    if k == 0:
        return np.zeros((len(lp), 0), np.int32)
    part = np.argpartition(-lp, k - 1, axis=1)[:, :k]
    cut = np.take_along_axis(lp, part, 1).min(axis=1, keepdims=True)    # the k-th value: ties at it to the lower ids
    out = np.empty((len(lp), k), np.int32)
    for r in range(len(lp)):
        ids = np.flatnonzero(lp[r] >= cut[r, 0])
        ids = ids[np.lexsort((ids, -lp[r, ids]))][:k]
        out[r] = ids
    return out


class _Scored:
    """One prompt in a scoring slot: the pass runs over its tokens but the last (ids), each row scoring the next."""

    def __init__(self, job: ScoreJob, index: int):
        self.job, self.index, self.done = job, index, 0
        prompt = job.inputs[index]
        self.ids, self.targets = prompt[:-1], prompt[1:]
        n, k = len(prompt), job.top
        self.scores = PromptScores(np.full(n, np.nan), np.full((n, k), -1, np.int32), np.full((n, k), np.nan))

    def take(self, rows: np.ndarray) -> None:
        """rows float32 [c, n_vocab]: the logits of the next c tokens, each scoring the token after it."""
        c, at = len(rows), self.done + 1
        lp = log_softmax(rows)
        self.scores.logprobs[at:at + c] = lp[np.arange(c), self.targets[self.done:self.done + c]]
        best = top_k(lp, self.job.top)
        self.scores.top_ids[at:at + c] = best
        self.scores.top_logprobs[at:at + c] = np.take_along_axis(lp, best.astype(np.int64), 1)
        self.done += c

    def result(self) -> PromptScores:
        return self.scores


class Scorer(Embedder):
    """Scoring jobs on the decode thread, as the Embedder runs embedding jobs: backend a CpuBackend of
    SCORE_SLOTS slots (its own KV cache) made with reuse_logits for SCORE_ROWS rows."""

    KIND = "scoring"

    def _out(self, max_tokens: int) -> np.ndarray:
        return np.zeros((0, 0), np.float32)         # the backend's own reused logits

    def _pass(self, n: int) -> np.ndarray:
        tokens, pos, slot = self._tokens
        return self._be.forward(tokens[:n], pos[:n], slot[:n], self._rows[:n])

    def _sequence(self, job, index: int):
        return _Scored(job, index)

    def add(self, job: ScoreJob) -> None:
        """A one-token prompt has nothing to compute: its scores are answered here."""
        for i, ids in enumerate(job.inputs):
            if len(ids) > 1:
                self._waiting.append((job, i))
            else:
                self._finish(_Scored(job, i))
