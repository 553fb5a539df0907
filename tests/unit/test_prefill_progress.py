"""The inter-token limit and a long prefill: a request whose prompt takes longer than the limit to
compute, chunk after chunk, is working and must get its answer; a prefill that stops advancing is
still a stall (issue 19). In-process: a real Engine on the tiny model whose steps are slowed down,
and the Generation's deadline check as the watchdog calls it."""
import time
from types import SimpleNamespace

import numpy as np

import fastserve
from fastserve.backends.cpu.backend import CpuBackend
from fastserve.config import SamplingParams
from fastserve.server.errors import HttpError
from fastserve.server.generation import Generation
from fastserve.server.metrics import LlamaTotals
from fastserve.server.params import Limits, Params


class _SlowSteps:
    """forward() takes `delay` s more per step; `hang` s more once, at the step numbered `hang_at`."""

    def __init__(self, inner, delay: float, hang_at: int = -1, hang: float = 0.0):
        self.inner, self.delay, self.hang_at, self.hang, self.steps = inner, delay, hang_at, hang, 0

    def forward(self, *args):
        time.sleep(self.delay + (self.hang if self.steps == self.hang_at else 0.0))
        self.steps += 1
        return self.inner.forward(*args)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _Counter:
    def __init__(self):
        self.seen = []

    def inc(self, n, kind=None):
        self.seen.append(kind)

    def observe(self, v):
        pass


def _run(tiny_model, delay, token_limit, hang_at=-1, hang=0.0):
    """Submits a 200-token prompt (25 prefill steps of 8) and checks deadlines every 20 ms as the
    watchdog does. Returns (the failure or None, the Generation, the prefill's seconds)."""
    backends = []

    def factory(cfg, weights, n_slots, n_ctx_slot):
        backends.append(_SlowSteps(CpuBackend(cfg, weights, n_slots, n_ctx_slot), delay, hang_at, hang))
        return backends[0]

    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=512, n_batch=8, backend=factory) as engine:
        app = SimpleNamespace(inflight=set(),
                              metrics=SimpleNamespace(deadlines=_Counter(), queue_time=_Counter(),
                                                      rejected=_Counter(), llama=LlamaTotals()))
        prompt = np.random.default_rng(3).integers(3, 500, 200).tolist()
        sampling = SamplingParams.make(tiny_model.config.n_vocab, temperature=0)
        params = Params([prompt], sampling, None, max_tokens=2, stop=[], limits=Limits(0, 0, token_limit), constraint={})
        gen = Generation(SimpleNamespace(generation=None), prompt, sampling, params, engine=engine,
                         metrics=app.metrics, inflight=app.inflight)
        t0 = time.monotonic()
        err = None
        while not gen.reader.buffer.finished and time.monotonic() - t0 < 30:
            err = gen.check(time.monotonic(), engine.snapshot)
            if err is not None:
                gen.close()
                break
            time.sleep(0.02)
        dt = time.monotonic() - t0
        return err, gen, dt, app


def test_a_prefill_longer_than_the_token_limit_is_not_a_stall(tiny_model):
    err, gen, dt, app = _run(tiny_model, delay=0.1, token_limit=0.4)
    assert err is None, str(err)
    assert gen.reader.buffer.finished and gen.reader.buffer.count == 2
    assert dt > 0.4 * 3, f"the prefill took {dt:.2f} s: too short to test the limit"
    assert app.metrics.deadlines.seen == []


def test_a_prefill_that_stops_advancing_is_a_stall(tiny_model):
    err, gen, dt, app = _run(tiny_model, delay=0.01, token_limit=0.5, hang_at=5, hang=1.5)
    assert isinstance(err, HttpError) and err.status == 504
    assert "no token" in str(err) and "prompt is not advancing" in str(err), str(err)
    assert app.metrics.deadlines.seen == ["token"]
