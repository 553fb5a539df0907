"""The host sampler as a backend's step: forward() gives logits on the host, fastserve._sampling samples them.

HostSampling is what the CPU backend (CpuBackend) mixes in to implement the step half of the Backend
contract (backends/base.py); HostSampled(model_pass) gives it to any object with that forward() alone
(test doubles, benchmark backends that return fixed logits, a backend wrapped to misbehave).
    forward(tokens, positions, slots, out_rows) -> float32 logits [m, n_vocab] (may be a reused buffer)
"""
from __future__ import annotations

import numpy as np

from .. import _sampling
from ..config import MAX_LOGIT_BIAS, MAX_N_PROBS, MAX_PENALTY_WINDOW, SamplingParams
from .base import StepOutput


class HostSampling:
    """configure / step / sync / release over self.forward(); set up once by init_sampling()."""

    samples_on_device = False
    verifies_drafts = True          # its sampler checks drafted rows in order (speculative decoding)
    reports_own_prob = True         # a row's probabilities end with the sampled token's own entry (column n_probs)

    def init_sampling(self, n_slots: int, n_vocab: int, max_rows: int, impl=None) -> None:
        """The sampler and the step's outputs, for steps of up to max_rows output rows (more: grown once).
        impl: the module providing Sampler (fastserve._sampling, or its twin fastserve.ref.sampling)."""
        self.sampler = (impl or _sampling).Sampler(n_slots, n_vocab, MAX_PENALTY_WINDOW, MAX_LOGIT_BIAS)
        self.masks = self.sampler.masks     # constrained slots' allowed tokens (the engine writes them)
        self.draft_masks = self.sampler.draft_masks     # ... and those of their drafted rows
        self._alloc_outputs(max(1, max_rows))
        self._n_probs = np.zeros(n_slots, np.int32)     # per slot: n_probs of its request (0: none asked)
        self._n_asking = 0                              # slots whose request asked for probabilities

    def _alloc_outputs(self, rows: int) -> None:
        self._ids = np.zeros(rows, np.int32)                       # [rows] sampled ids
        # [rows, MAX_N_PROBS + 1]: a row's top n_probs, then the sampled token's own entry
        self._probs_ids = np.zeros((rows, MAX_N_PROBS + 1), np.int32)
        self._probs = np.zeros((rows, MAX_N_PROBS + 1), np.float32)

    def configure(self, slot: int, params: SamplingParams, history, constrained: bool = False) -> None:
        self.sampler.configure_checked(slot, params.slot_config(history), constrained)
        self._n_asking += int(params.n_probs > 0) - int(self._n_probs[slot] > 0)
        self._n_probs[slot] = params.n_probs

    def release(self, slot: int) -> None:
        if self._n_probs[slot]:
            self._n_asking -= 1
            self._n_probs[slot] = 0

    def step(self, batch, lap=None, before_sample=None) -> StepOutput:
        tokens, positions, slots, out_rows, row_slot = batch.view()
        logits = self.forward(tokens, positions, slots, out_rows)
        if lap is not None:
            lap("forward")
            lap("sync")             # the logits are on the host: no wait
        if before_sample is not None:
            before_sample()         # the constrained rows' masks are written (computed during forward)
        m = len(row_slot)
        if m > len(self._ids):
            self._alloc_outputs(m)
        ids = self._ids[:m]
        drafts = batch.row_draft[:m] if batch.n_drafted else None      # speculative rows: verified in order
        if self._n_asking:
            self.sampler.sample(logits, row_slot, ids, self._probs_ids, self._probs, drafts)
            out = StepOutput(ids, self._probs_ids[:m], self._probs[:m])
        else:
            self.sampler.sample(logits, row_slot, ids, None, None, drafts)
            out = StepOutput(ids, None, None)
        if lap is not None:
            lap("sample")
        return out

    def sync(self) -> None:
        """forward() returns with its logits on the host: nothing is left to wait for."""


class HostSampled(HostSampling):
    """A model pass with forward() only, made a Backend with the host sampler. Other attributes (KV copies,
    n_slots, ...) are the model pass's."""

    def __init__(self, model_pass, max_rows: int = 512):
        self.model_pass = model_pass
        self.n_slots, self.n_ctx_slot, self.n_vocab = model_pass.n_slots, model_pass.n_ctx_slot, model_pass.n_vocab
        self.init_sampling(self.n_slots, self.n_vocab, max_rows)

    def forward(self, tokens, positions, slots, out_rows):
        return self.model_pass.forward(tokens, positions, slots, out_rows)

    # A pass that says nothing of rings (a test double over forward()) keeps every position.
    @property
    def kv_ring(self) -> int:
        return getattr(self.model_pass, "kv_ring", 0)

    def kv_held_from(self, slot: int, n_tokens: int) -> int:
        inner = getattr(self.model_pass, "kv_held_from", None)
        return inner(slot, n_tokens) if inner is not None else 0

    def kv_reuse_from(self, slot: int, n_tokens: int) -> int:
        inner = getattr(self.model_pass, "kv_reuse_from", None)
        return inner(slot, n_tokens) if inner is not None else 0

    def __getattr__(self, name):
        return getattr(self.model_pass, name)
