"""Sampling on the device: the sampler of CupyBackend's step (it owns one DeviceSampler).

The chain and its rules are the host sampler's (fastserve/ref/sampling.py); cuda/sampling.cu applies
them to the logits where they are, so that a step copies back only the token ids and the probability
lists that requests asked for. This module keeps, on the host, the per-slot state the kernel reads, and
packs each step's rows:

- configure() (admission): the request's parameters, normalized by the same check_config as the host
  Sampler, become the slot's SampleRow record (kernels.SAMPLE_ROW); its seed the slot's splitmix64
  state; its prompt's tail the slot's penalty window (a ring) and its logit bias a list, both written
  into the backend's slot table and copied to the device once.
- forward(): the records of the step's output rows, gathered from their slots' records in one take,
  are written into the backend's pinned buffer that travels with the batch's inputs; the backend queues
  the pass and the chain (submit_sample).
- constraints: a slot configured with constrained=True samples from the allowed tokens of its row of
  `masks` (uint32 [n_slots, ceil(n_vocab / 32)], which the engine fills): forward() copies the rows'
  masks into the backend's pinned mask buffer, which travels with the records (the record's mask_row
  names its row), and the kernel applies it before every other stage, as the host sampler does.
- sample(): the one wait (wait_sample), then what the host sampler does to its state after a row, vectorized over the rows: a row that
  drew (not greedy, some candidate) moves its slot's splitmix64 state one step; each row's token goes
  into its slot's window ring (the kernel wrote the same token into the device's copy).

Same token ids and probabilities as fastserve._sampling.Sampler for the same logits and seed: the
kernel follows the same integer rules (checked bit for bit with the kernel's CUDA C run on the CPU,
tests/gpu/test_device_sampling.py). The one thing not shared on a GPU is exp (double): CUDA's may
differ from the host libm's in the last bit. That moves a fixed-point weight by one unit at most (for
the largest weights in about 1 of 32 such cases, far less often for small ones), which changes a token
only when the draw lands on that unit (odds about 2**-47) and a probability only when it crosses a
float32 rounding (about 2**-23).

Preconditions, as the engine's steps satisfy them: each slot has at most one output row per step, and
every step fits the backend's buffers (n <= max_tokens, m <= max_out; the engine makes its CupyBackend
with max_tokens = n_batch, and max_out is at least min(n_slots, max_tokens)).
"""
from __future__ import annotations

import math

import numpy as np

from . import kernels as K
from ...errors import RequestError
from ...config import SAMPLING_DEFAULTS, check_fits, check_sampling as check_config

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class DeviceSampler:
    """Per-slot sampling state for the device's sampler; the decode thread's only (like Sampler)."""

    def __init__(self, backend, n_slots: int, n_vocab: int, max_penalty_window: int = 256,
                 max_logit_bias: int = 256, masks=None):
        self.backend = backend
        self.n_slots, self.n_vocab = int(n_slots), int(n_vocab)
        self.max_penalty_window, self.max_logit_bias = int(max_penalty_window), int(max_logit_bias)
        self._W, self._B = backend.sample_window, backend.sample_bias
        self._tab = backend.sample_slot_table()        # [n_slots, W + 2B] int32, pinned: ring, bias ids, bias bits
        self._rows = backend.sample_rows_h             # [max_out] SAMPLE_ROW, pinned: this step's records
        self._slot_rows = np.zeros(self.n_slots, K.SAMPLE_ROW)     # per slot: record, state, window length/position
        self._window = np.zeros(self.n_slots, np.int64)            # repeat_last_n per slot
        self._configured = np.zeros(self.n_slots, bool)
        self._constrained = np.zeros(self.n_slots, bool)
        # uint32 [n_slots, ceil(n_vocab / 32)]: each constrained slot's allowed tokens (the engine fills it)
        self.masks = masks if masks is not None else np.zeros((self.n_slots, (self.n_vocab + 31) // 32), np.uint32)
        self._masked_rows = np.zeros(0, np.int64)
        self._ask_rows = np.zeros(backend.max_out, np.int64)       # output rows that asked for lists
        self._n_lists = 0
        self._m = 0

    def configure(self, slot, *, seed, history=(), constrained=False, **params):
        """Sampler.configure's parameters (config.SAMPLING_DEFAULTS for those not given) and checks;
        the slot's window and bias go to the device."""
        if not 0 <= slot < self.n_slots:
            raise RequestError(f"slot {slot} out of range [0, {self.n_slots})")
        cfg = check_config(self.n_vocab, self.max_penalty_window, self.max_logit_bias, seed=seed, history=history,
                           **{**SAMPLING_DEFAULTS, **params})
        self.configure_checked(slot, cfg, constrained)

    def configure_checked(self, slot, cfg, constrained=False) -> None:
        """configure() with parameters check_sampling already normalized (SamplingParams.slot_config)."""
        if not 0 <= slot < self.n_slots:
            raise RequestError(f"slot {slot} out of range [0, {self.n_slots})")
        check_fits(cfg, self._W, self._B, "the device sampler")
        rp, pp, fp = (np.float32(cfg[k]) for k in ("repeat_penalty", "presence_penalty", "frequency_penalty"))
        window, hist, bias = cfg["repeat_last_n"], cfg["history"], cfg["logit_bias"]
        greedy = cfg["temperature"] <= 0.0
        penalize = window > 0 and not (rp == 1 and fp == 0 and pp == 0)
        rec = self._slot_rows[slot:slot + 1]
        rec["temperature"], rec["top_p"], rec["min_p"] = cfg["temperature"], cfg["top_p"], cfg["min_p"]
        rec["log_min_p"] = math.log(cfg["min_p"]) if cfg["min_p"] > 0.0 else -math.inf
        rec["rng"] = np.uint64(cfg["seed"])
        rec["top_k"], rec["n_probs"], rec["probs_row"] = cfg["top_k"], cfg["n_probs"], -1
        rec["flags"] = ((K.SAMPLE_GREEDY if greedy else 0) | (K.SAMPLE_POST_PROBS if cfg["post_sampling_probs"] else 0)
                        | (K.SAMPLE_PENALIZE if penalize else 0))
        rec["slot"], rec["n_bias"], rec["mask_row"] = slot, len(bias), -1
        rec["hist_len"], rec["hist_pos"] = len(hist), (len(hist) % window if window else -1)
        rec["repeat_penalty"], rec["presence_penalty"], rec["frequency_penalty"] = rp, pp, fp
        tab, W, B = self._tab[slot], self._W, self._B
        tab[:len(hist)] = hist
        tab[W:W + len(bias)] = [t for t, _ in bias]
        tab[W + B:W + B + len(bias)] = np.array([b for _, b in bias], np.float32).view(np.int32)
        self._window[slot] = window
        self._configured[slot] = True
        self._constrained[slot] = bool(constrained)
        self.backend.upload_sample_slot(slot)

    def history(self, slot: int) -> list:
        """The slot's penalty window, oldest token first (as Sampler.history)."""
        rec, w = self._slot_rows[slot], int(self._window[slot])
        n, pos = int(rec["hist_len"]), int(rec["hist_pos"])
        ring = self._tab[slot, :w].tolist()
        return ring[:n] if n < w else ring[pos:] + ring[:pos]

    def forward(self, tokens, positions, slots, out_rows, row_slot) -> None:
        """The backend's pass over the batch and the sampling chain over its output rows (row r for slot
        row_slot[r]), one wait; sample() then reads the results."""
        m = len(row_slot)
        if m and not self._configured[row_slot].all():
            raise ValueError("a row's slot was never configured")
        rows = self._rows[:m]
        np.take(self._slot_rows, row_slot, out=rows)
        n_lists = 0
        ask = rows["n_probs"] > 0
        if ask.any():
            asked = np.flatnonzero(ask)
            n_lists = len(asked)
            self._ask_rows[:n_lists] = asked
            rows["probs_row"][asked] = np.arange(n_lists)
        self._m, self._n_lists = m, n_lists
        self._masked_rows = np.flatnonzero(self._constrained[row_slot])
        if len(self._masked_rows):          # their masks go with the records: row r reads mask row r
            rows["mask_row"][self._masked_rows] = self._masked_rows
            self.backend.sample_masks_h[self._masked_rows] = self.masks[row_slot[self._masked_rows]]
        self.backend.submit_sample(tokens, positions, slots, out_rows, n_lists, masked=len(self._masked_rows) > 0)

    @property
    def n_lists(self) -> int:
        """Output rows of the last forward() that asked for probabilities."""
        return self._n_lists

    def sample(self, row_slot, out_ids, probs_ids=None, probs=None, result=None) -> None:
        """The tokens of the last forward() into out_ids[:m]; rows that asked for probabilities get
        probs_ids[r, :n] / probs[r, :n]; then each row's slot state moves on as the host sampler's.
        result: what the backend's wait_sample() returned (None: it is called here, waiting for the device)."""
        ids, list_ids, list_probs = self.backend.wait_sample() if result is None else result
        m, k = self._m, self._n_lists
        rows = self._rows[:m]
        out = out_ids[:m]
        np.maximum(ids, 0, out=out)             # -1: no candidate, token 0 (and no draw) ...
        dead = np.zeros(m, bool)
        if len(self._masked_rows):              # ... but a constrained row keeps -1: nothing was allowed
            mr = self._masked_rows
            out[mr] = ids[mr]
            dead[mr] = ids[mr] < 0
        if k:
            ask = self._ask_rows[:k]
            width = list_ids.shape[1]
            probs_ids[ask, :width] = list_ids
            probs[ask, :width] = list_probs
        drew = ((rows["flags"] & K.SAMPLE_GREEDY) == 0) & (ids >= 0)
        state = self._slot_rows["rng"]
        state[row_slot] = rows["rng"] + drew.astype(np.uint64) * _GOLDEN      # wraps modulo 2**64
        win = self._window[row_slot]
        on = (win > 0) & ~dead
        if on.any():
            s, w = row_slot[on], win[on]
            pos = rows["hist_pos"][on]
            self._tab[s, pos] = out[on]
            self._slot_rows["hist_pos"][s] = (pos + 1) % w
            self._slot_rows["hist_len"][s] = np.minimum(rows["hist_len"][on] + 1, w)
