"""config.py: SamplingParams and EngineConfig are checked once, where they are made; their defaults are
the ones every layer uses; a checked SamplingParams configures both samplers as configure() does."""
import dataclasses

import numpy as np
import pytest

import fastserve._sampling as c_sampling
import fastserve.ref.sampling as r_sampling
from fastserve.config import MAX_N_PROBS, SAMPLING_DEFAULTS, EngineConfig, SamplingParams
from fastserve.errors import RequestError


def test_sampling_params_defaults_and_checks():
    p = SamplingParams.make(1000, seed=7)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed) == (0.8, 40, 0.95, 0.05, 7)
    assert SAMPLING_DEFAULTS["temperature"] == SamplingParams.temperature and "seed" not in SAMPLING_DEFAULTS
    assert SamplingParams.make(1000, top_k=5000, repeat_last_n=-1).top_k == 1000        # normalized once
    assert SamplingParams.make(1000, repeat_last_n=-1).repeat_last_n == 256
    assert SamplingParams.make(1000, logit_bias={3: 1.5}).logit_bias == ((3, 1.5),)
    assert SamplingParams.make(1000).seed != SamplingParams.make(1000).seed            # random when not given
    with pytest.raises(RequestError, match="unknown sampling parameter"):
        SamplingParams.make(1000, temprature=1)
    with pytest.raises(RequestError, match=f"at most {MAX_N_PROBS}"):
        SamplingParams.make(1000, n_probs=MAX_N_PROBS + 1)
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams.make(1000, top_p=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0


def test_engine_config_checks():
    c = EngineConfig(n_parallel=4, n_ctx=1024)
    assert c.n_ctx_slot == 256 and c.replace(n_batch=64).n_batch == 64 and c.n_batch == EngineConfig.n_batch
    with pytest.raises(ValueError, match="less than 2 tokens per slot"):
        EngineConfig(n_parallel=8, n_ctx=8)
    with pytest.raises(ValueError, match="unknown backend"):
        EngineConfig(device="tpu")
    assert EngineConfig(device="numpy").device == "cpu" and EngineConfig(prefill_chunk=0).prefill_chunk == 1


@pytest.mark.parametrize("mod", [c_sampling, r_sampling], ids=["cython", "python"])
def test_a_checked_request_configures_the_sampler_as_configure_does(mod):
    V = 300
    rng = np.random.default_rng(1)
    history = rng.integers(0, V, 90).astype(np.int32)
    given = dict(temperature=0.9, top_k=0, top_p=0.8, repeat_penalty=1.3, repeat_last_n=32, logit_bias={4: 2.0},
                 n_probs=3)
    params = SamplingParams.make(V, seed=11, **given)
    a, b = mod.Sampler(2, V), mod.Sampler(2, V)
    a.configure(0, seed=11, history=history, **given)
    b.configure_checked(0, params.slot_config(history))
    assert a.history(0) == b.history(0) == history[-32:].tolist()
    logits = rng.standard_normal((1, V)).astype(np.float32)
    outs = []
    for s in (a, b):
        ids, pi, pp = np.zeros(1, np.int32), np.zeros((1, 3), np.int32), np.zeros((1, 3), np.float32)
        s.sample(logits.copy(), np.zeros(1, np.int32), ids, pi, pp)
        outs.append((ids.tolist(), pi.tolist(), pp.tolist()))
    assert outs[0] == outs[1]
    with pytest.raises(RequestError, match="must fit"):
        mod.Sampler(2, V, 16, 16).configure_checked(0, params.slot_config(history))
