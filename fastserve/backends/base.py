"""The whole contract between the engine and a backend: configure a slot, run a step, release a slot.

A step takes the batch the engine built (fastserve/_batch.pyx: int32 tokens, positions, slots, output
rows and the slot of each output row) and gives back one sampled token id per output row, with the
top-N probabilities of the rows whose request asked for them. The sampler is the backend's: the CPU
backend samples its logits on the host (backends/host_sampling.py), the CUDA backend on the device
(fastserve/backends/cuda/sampling.py), so that only ids and asked-for lists cross to the host.

The backend owns the KV cache, preallocated as [n_slots, n_ctx_slot] per layer; a slot's KV row at
position p is written when a token at position p goes through a step. Rows past a slot's current
length are stale and never read, so cutting a slot back needs no work from the backend. A
sliding-window model's local layers may keep only the last kv_ring positions of a slot (a ring): a
prefix is then reusable only while the ring still holds the window before its end (kv_reuse_from).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Protocol

import numpy as np

from ..config import SamplingParams


class StepOutput(NamedTuple):
    """A step's results, valid until the next step (views of reused buffers).
    ids: int32 [m], the token sampled for output row r; probs_ids int32 / probs float32 [m, MAX_N_PROBS]:
    row r's top-n list in its first n columns when its request asked for n_probs = n (other rows: stale);
    None when no row of the step asked."""
    ids: np.ndarray
    probs_ids: Optional[np.ndarray]
    probs: Optional[np.ndarray]


class Backend(Protocol):
    n_slots: int
    n_ctx_slot: int
    n_vocab: int
    samples_on_device: bool         # where step() samples (for reports; the engine does not branch on it)
    masks: np.ndarray               # uint32 [n_slots, ceil(n_vocab / 32)]: the allowed tokens of constrained
                                    # slots (bit t % 32 of word t // 32), written by the engine between steps

    def configure(self, slot: int, params: SamplingParams, history: np.ndarray, constrained: bool = False) -> None:
        """A request starts on slot: its sampling (checked already) and its prompt (int32 token ids) as
        the penalty history; constrained: sample only what masks[slot] allows (before every other stage;
        nothing allowed gives id -1). Raises RequestError on what the sampler cannot hold."""
        ...

    def step(self, batch, lap=None, before_sample=None) -> StepOutput:
        """The forward pass over batch.view() and the sampling of its output rows (every output row's
        slot is configured); returns with the results on the host. lap (the tracer's, or None) is called
        with "forward" once the pass is computed (CPU) or submitted (GPU), "sync" after waiting for the
        device, "sample" after sampling: the step's phases, each timed where it really happens.
        before_sample (or None) is called once masks must be final: after the pass on the CPU, before
        the launch on the GPU (the masks travel with the inputs)."""
        ...

    def sync(self) -> None:
        """Wait until every piece of work queued on the device is done (nothing to wait for on the CPU)."""
        ...

    def release(self, slot: int) -> None:
        """slot's request ended: its sampling state is dropped (its KV stays, for prefix reuse)."""
        ...

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV one token takes in one slot (every layer, K and V)."""
        ...

    def save_slot(self, slot: int, start: int, n_tokens: int, into: np.ndarray) -> None:
        """Copy KV rows start..start+n_tokens of slot into host memory `into` (uint8, at least
        n_tokens * kv_bytes_per_token() bytes, in a layout of the backend's choosing that
        restore_slot reads back). Allocates nothing: `into` belongs to the prompt cache's pool."""
        ...

    def restore_slot(self, slot: int, start: int, n_tokens: int, src: np.ndarray, held_from: int = 0) -> None:
        """Write KV rows start..start+n_tokens of slot from what save_slot put in `src`; held_from: what
        kv_held_from said of the slot when it was saved (the copy's ring rows before it are stale)."""
        ...

    kv_ring: int                    # positions a local layer keeps per slot (0: every position, no ring)

    def kv_bytes(self) -> int:
        """Bytes of the whole KV cache."""
        ...

    def kv_resident(self) -> bool:
        """Every page of the KV cache is in memory (a CPU cache comes in on a thread of its own)."""
        ...

    def kv_held_from(self, slot: int, n_tokens: int) -> int:
        """The first position from which the rings hold every position before n_tokens of slot (0: all)."""
        ...

    def kv_reuse_from(self, slot: int, n_tokens: int) -> int:
        """The shortest prefix (<= n_tokens) of slot's KV that a continuation can reuse (0: any): the ring
        must hold the window before it. A shorter common prefix reuses nothing."""
        ...
