"""Host-side cost of a decode step (everything but the forward pass), at 32 slots and 49,152 vocab.

Run: make bench, or pytest bench/bench_engine.py --benchmark-only -p no:cacheprovider -s
Targets (issue 3): batch build for a 32-slot decode step <= 10 us; a whole step's host work <= 0.3 ms.
"""
import time

import numpy as np
import pytest

import fastserve
from fastserve import _batch, _slots
from fastserve.models.synthetic import write_llama_gguf

N_SLOTS, N_VOCAB = 32, 49152


class NullBackend:
    """Returns fixed logits at once: what remains of a step is host work."""

    def __init__(self, cfg, weights, n_slots, n_ctx_slot):
        self.n_slots, self.n_ctx_slot, self.n_vocab = n_slots, n_ctx_slot, cfg.n_vocab
        rng = np.random.default_rng(0)
        self.logits = rng.standard_normal((512, cfg.n_vocab)).astype(np.float32)
        self.logits[:, 0:3] = -30.0          # keep end-of-generation tokens unlikely

    def forward(self, tokens, positions, slots, out_rows):
        return self.logits[:len(out_rows)]


@pytest.fixture(scope="module")
def big_vocab_model(tmp_path_factory):
    path = write_llama_gguf(tmp_path_factory.mktemp("m") / "v49k.gguf", n_vocab=N_VOCAB, n_layer=1)
    return fastserve.load_model(path)


def test_batch_build_32_slots(benchmark):
    table = _slots.SlotTable(N_SLOTS, 256, np.zeros(N_VOCAB, np.uint8))
    batch = _batch.Batch(512)
    for s in range(N_SLOTS):
        table.start(s, np.arange(1, 11, dtype=np.int32), 0, 10 ** 6, s)
    batch.clear()
    for s in range(N_SLOTS):
        table.add_prefill(batch, s, 512)
    table.commit(batch, np.full(512, 5, np.int32), np.zeros(512, np.int8))   # every slot now decodes

    def build():
        batch.clear()
        return table.add_decode(batch)

    assert benchmark(build) == N_SLOTS
    benchmark.extra_info["us_per_build"] = benchmark.stats.stats.median * 1e6


SAMPLING = {"greedy": dict(temperature=0), "top_k40_top_p95": dict(temperature=0.8, top_k=40, top_p=0.95)}


def _steps_of_32_slots(benchmark, engine, params: dict, seconds: float) -> dict:
    """32 endless requests; the tracer's summary over `seconds` of steps, three rounds (the last kept)."""
    readers = [engine.submit([5, 6, 7], max_tokens=-1, seed=i, **params) for i in range(N_SLOTS)]
    try:
        while engine.snapshot.n_running < N_SLOTS:
            time.sleep(0.01)

        def run():
            since = engine.trace_totals()
            time.sleep(seconds)
            for r in readers:
                r.reader.read_available()
            return engine.trace_summary(since)

        return benchmark.pedantic(run, rounds=3, iterations=1)
    finally:
        for r in readers:
            r.cancel()
        engine.close()


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_step_host_work_32_slots(benchmark, big_vocab_model, sampling):
    engine = fastserve.Engine(big_vocab_model, n_parallel=N_SLOTS, n_ctx=N_SLOTS * 65536, backend=NullBackend,
                              trace=True, max_queue=64)
    summary = _steps_of_32_slots(benchmark, engine, SAMPLING[sampling], 0.5)
    host_ms = summary["host_ms_per_step"]
    benchmark.extra_info.update(host_ms_per_step=host_ms, steps=summary["steps"],
                                ms_per_phase=summary["ms_per_step"], send_us_per_token=summary["send_us_per_token"])
    print(f"\n{sampling}: host work {host_ms:.3f} ms/step over {summary['steps']} steps; "
          + ", ".join(f"{k} {v:.3f}" for k, v in summary["ms_per_step"].items()))


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_step_host_work_32_slots_gpu_backend(benchmark, big_vocab_model, sampling, monkeypatch):
    """The same with the GPU backend (CupyBackend, device sampling, CUDA graphs) on a device whose work
    takes no time (tests/gpu/fake_cupy.py, kernels "null"): the host's share of a GPU step is this
    over the device's step time (issue 6: <= 5 % at 32 slots)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.gpu import fake_cupy
    fake_cupy.install(monkeypatch, kernels="null")
    engine = fastserve.Engine(big_vocab_model, n_parallel=N_SLOTS, n_ctx=N_SLOTS * 16384, backend="cuda",
                              trace=True, max_queue=64)
    assert engine.describe().samples_on_device, "the GPU backend should sample on the device"
    summary = _steps_of_32_slots(benchmark, engine, SAMPLING[sampling], 0.3)   # ~0.1 ms a step: within n_ctx
    benchmark.extra_info.update(step_ms=summary["step_ms"], host_ms_per_step=summary["host_ms_per_step"],
                                ms_per_phase=summary["ms_per_step"])
    print(f"\nGPU backend, null device, {sampling}: step {summary['step_ms']:.3f} ms (all host), of which "
          + ", ".join(f"{k} {v:.3f}" for k, v in summary["ms_per_step"].items()))
