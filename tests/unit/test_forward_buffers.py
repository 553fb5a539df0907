"""The CPU forward pass allocates its activations once (Activations), not per step (issue 10 item 6),
and the preallocated path gives the same logits as fresh arrays would."""
import tracemalloc

import numpy as np
import pytest

import fastserve
from fastserve.backends.cpu.backend import CpuBackend
from fastserve.models.synthetic import write_llama_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fastserve.load_model(write_llama_gguf(tmp_path_factory.mktemp("fb") / "m.gguf", n_embd=1024, n_ff=2048,
                                                 n_vocab=2048, seed=5, weight_type="Q4_1"))


def step(be, n, start):
    toks = (np.arange(n, dtype=np.int32) * 37) % be.n_vocab
    pos = np.full(n, start, np.int32)
    slots = np.arange(n, dtype=np.int32)
    return be.forward(toks, pos, slots, np.arange(n, dtype=np.int32))


def test_a_step_allocates_no_activation_sized_array(model):
    be = CpuBackend(model.config, model.weights, n_slots=32, n_ctx_slot=64, max_tokens=32, reuse_logits=True)
    step(be, 32, 0)                                  # warm-up: lazy one-time state
    old = np.setbufsize(256)          # NumPy's broadcasting ufuncs buffer up to bufsize elements per
    tracemalloc.start()               # operand whatever their size: keep those small here
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        for p in range(1, 4):
            step(be, 32, p)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        np.setbufsize(old)
    # The residual stream of a step is 32 x 1024 x 4 = 128 KiB, its gate/up product 512 KiB, its
    # logits 256 KiB: what a step may allocate (index arrays, views, ufunc buffers) stays far below
    # the smallest of them.
    stream = 32 * 1024 * 4
    assert peak < stream / 4, f"a step allocated {peak} bytes at its peak (one residual stream: {stream})"


def test_reused_buffers_give_the_logits_of_fresh_ones(model):
    fresh = CpuBackend(model.config, model.weights, n_slots=8, n_ctx_slot=64, max_tokens=1)   # grows
    reused = CpuBackend(model.config, model.weights, n_slots=8, n_ctx_slot=64, max_tokens=8, reuse_logits=True)
    for p, n in enumerate((8, 3, 8, 1)):
        a, b = step(fresh, n, p), step(reused, n, p)
        assert a.shape == b.shape == (n, model.config.n_vocab)
        assert np.array_equal(a, b)
    assert not np.shares_memory(step(fresh, 2, 4), step(fresh, 2, 5))      # callers that keep logits
