"""Chunked prefill that scales (issue 19 item 3): beside decode rows a prompt's chunk is sized so the
step stays near the engine's step target (the other streams' inter-token gap), larger than the old
fixed chunk when the steps are cheap; with nobody decoding a prompt takes the whole batch, unless that
step would run for more than LONE_STEP_S (the watchdog's stall limit is 30 s: a 7 B model's 512 prompt
tokens take ~36 s on 2 cores), and before any step was measured at most FIRST_STEP_TOKENS.

In-process, on the tiny model, with a backend whose forward costs a known time per token."""
import time

import numpy as np

import fastserve
from fastserve.backends.cpu.backend import CpuBackend
from fastserve.scheduler import FIRST_STEP_TOKENS, LONE_STEP_S, prefill_budget

FIXED_S, PER_TOKEN_S = 0.005, 0.0005      # each step's added cost: 5 ms + 0.5 ms a token
TARGET_S = 0.1                             # -> about 190 tokens a step at the fixed point


class _TimedSteps:
    """step() sleeps FIXED_S + PER_TOKEN_S per token; records (tokens per slot, seconds) per step."""

    def __init__(self, inner):
        self.inner, self.steps = inner, []

    def step(self, batch, *args):
        t0 = time.perf_counter()
        slots = np.array(batch.view()[2])
        time.sleep(FIXED_S + PER_TOKEN_S * len(slots))
        out = self.inner.step(batch, *args)
        self.steps.append((np.bincount(slots), time.perf_counter() - t0))
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _engine(tiny_model, backends):
    def factory(cfg, weights, n_slots, n_ctx_slot):
        backends.append(_TimedSteps(CpuBackend(cfg, weights, n_slots, n_ctx_slot)))
        return backends[0]
    engine = fastserve.Engine(tiny_model, n_parallel=4, n_ctx=4 * 1536, n_batch=512, backend=factory)
    engine._step_target_s = TARGET_S
    return engine


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def test_the_budget_rule():
    assert prefill_budget(512, 0, 32, 0.01, 0.5) == 512             # alone: the whole batch
    assert prefill_budget(512, 0, 32, 0.0, 0.5) == FIRST_STEP_TOKENS  # alone, nothing measured yet
    assert prefill_budget(512, 0, 32, 0.07, 0.5) == int(LONE_STEP_S / 0.07)   # alone, a 7 B model's cost
    assert prefill_budget(512, 0, 32, 1.0, 0.5) == 32               # alone and very slow: still a chunk
    assert prefill_budget(481, 31, 32, 0.0, 0.5) == 32              # nothing measured: the old rule
    assert prefill_budget(481, 31, 32, 0.002, 0.5) == 250 - 31      # 0.5 s at 2 ms a token, less the rows
    assert prefill_budget(100, 31, 32, 0.002, 0.5) == 100           # never past the batch
    assert prefill_budget(481, 31, 32, 0.1, 0.5) == 32              # slow steps: a prompt still advances


def test_a_lone_prompt_takes_the_whole_batch(tiny_model):
    backends = []
    with _engine(tiny_model, backends) as engine:
        engine.generate(_prompt(1200, 1), max_tokens=1, temperature=0, cache_prompt=False)
    chunks = [int(per_slot.max()) for per_slot, _ in backends[0].steps]
    assert chunks[:4] == [FIRST_STEP_TOKENS, 512, 512, 1200 - FIRST_STEP_TOKENS - 1024], chunks


def test_beside_decode_rows_the_chunk_keeps_the_step_near_its_target(tiny_model):
    backends = []
    with _engine(tiny_model, backends) as engine:
        streams = [engine.submit(_prompt(20, 10 + i), max_tokens=400, temperature=0) for i in range(3)]
        t0 = time.monotonic()
        while any(r.reader.count == 0 for r in streams) and time.monotonic() - t0 < 10:
            time.sleep(0.005)
        first = len(backends[0].steps)
        engine.generate(_prompt(1400, 2), max_tokens=1, temperature=0, cache_prompt=False)
        for r in streams:
            r.cancel()
    # steps that carried a prompt chunk beside decode rows (one token of a slot)
    mixed = [(per_slot, s) for per_slot, s in backends[0].steps[first:] if (per_slot > 1).any() and (per_slot == 1).any()]
    chunks = [int(per_slot.max()) for per_slot, _ in mixed]
    assert len(mixed) >= 4, chunks
    # Past the first steps (the measured cost still settling) the chunk is far above the old fixed 32
    # and far below the lone prompt's 512; no step runs past twice the target (a loaded machine's margin).
    assert max(chunks) < 400 and max(chunks[2:]) > 100, chunks
    assert max(s for _, s in mixed[2:]) < 2 * TARGET_S, [round(s, 3) for _, s in mixed]
