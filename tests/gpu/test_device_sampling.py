"""Sampling on the device (cuda/sampling.cu sample_chain_f32, fastserve/backends/cuda/sampling.py) against the
host sampler (fastserve._sampling.Sampler) on the same logits.

The contract is IDENTITY, not a distribution test: the same token ids and the same probabilities bit for
bit, every row, every step, with the random state and the penalty window carried from step to step
(greedy, temperature, top-k, top-p, min-p, penalties, logit bias, seeds, pre- and post-sampling lists;
logits with many ties, -inf and NaN). One caveat, stated in fastserve/backends/cuda/sampling.py: the device's
double exp may differ from the host libm's in its last bit; a fixed-point weight then moves by one
unit, which changes a result only in the rare case where a draw or a cut lands on that unit.

Two kinds of tests:
- `cupy` ones run the kernel itself (skip without a GPU, or without the CPU run of the CUDA C that
  tests/gpu/conftest.py describes);
- `fake` ones run everywhere: CupyBackend + Engine + DeviceSampler on tests/gpu/fake_cupy.py, once with
  the kernel emulated by the host sampler's twin (they check the glue: record packing, the one copy
  each way, the per-slot state, probabilities plumbing, graph capture) and once with the kernels' CUDA C
  run on the CPU (the whole path, the real kernel included).
"""
import threading

import numpy as np
import pytest

from fastserve._sampling import Sampler
from fastserve.backends.cuda import kernels as K
from fastserve.backends.cuda.sampling import DeviceSampler

from . import fake_cupy


class LogitsBackend:
    """A backend whose forward pass is the logits the test sets: DeviceSampler over given logits, through
    the real launcher (kernels.sample_chain) and whatever `cp` runs it."""
    samples_on_device = True

    def __init__(self, cp, n_slots, max_out, window=256, bias=256, probs=100, n_vocab=1):
        self.cp, self.max_out, self.max_tokens = cp, max_out, max_out
        self.sample_window, self.sample_bias, self.sample_probs = window, bias, probs
        self.slot_tab_h = np.zeros((n_slots, window + 2 * bias), np.int32)
        self.slot_tab_d = cp.zeros((n_slots, window + 2 * bias), np.int32)
        self.sample_rows_h = np.zeros(max_out * K.SAMPLE_ROW_WORDS, np.int32).view(K.SAMPLE_ROW)
        self.sample_masks_h = np.zeros((max_out, (n_vocab + 31) // 32), np.uint32)
        self.logits = None

    def sample_slot_table(self):
        return self.slot_tab_h

    def upload_sample_slot(self, slot):
        self.slot_tab_d[slot] = self.cp.asarray(self.slot_tab_h[slot])

    def submit_sample(self, tokens, positions, slots, out_rows, n_lists, masked=False):
        self._result = self.forward_sample(tokens, positions, slots, out_rows, n_lists, masked)

    def wait_sample(self):
        return self._result

    def forward_sample(self, tokens, positions, slots, out_rows, n_lists, masked=False):
        cp, m, P = self.cp, len(out_rows), self.sample_probs
        logits = cp.asarray(np.ascontiguousarray(self.logits[:m], np.float32))
        rows = cp.asarray(self.sample_rows_h[:m].view(np.int32).reshape(m, K.SAMPLE_ROW_WORDS))
        ids = cp.asarray(np.full(m, 12345, np.int32))
        lists = cp.asarray(np.full((max(n_lists, 1), 2, P), 777, np.int32))
        masks = cp.asarray(self.sample_masks_h[:max(m, 1)])
        K.sample_chain(logits, rows, self.slot_tab_d, ids, lists, m, self.sample_window, self.sample_bias, masks)
        got = np.asarray(lists.get())[:n_lists]
        return np.asarray(ids.get()), got[:, 0], got[:, 1].view(np.float32)


def _logits(rng, n, V, ties=True):
    """Random logits; with ties: values on a coarse grid (many equal logits) plus -inf and NaN entries."""
    x = (rng.standard_normal((n, V)) * 3.0).astype(np.float32)
    if ties:
        x = np.round(x * 2.0) / 2.0
        x[:, rng.integers(0, V, 5)] = -np.inf
        x[rng.integers(0, n), rng.integers(0, V)] = np.nan
        x[:, rng.integers(0, V, 3)] = x.max(axis=1, keepdims=True)       # ties at the top too
    return x.astype(np.float32)


# Request parameters, each row of a step gets one (slot i: CONFIGS[i % len])
CONFIGS = [
    dict(temperature=0.0),
    dict(temperature=0.0, n_probs=5, repeat_penalty=1.3, logit_bias={3: 5.0, 9: -np.inf}),
    dict(temperature=0.8),                                          # defaults: top_k 40, top_p .95, min_p .05
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),           # the whole vocabulary
    dict(temperature=0.7, top_k=0, top_p=0.5, min_p=0.0, n_probs=7, post_sampling_probs=True),
    dict(temperature=1.3, top_k=5, top_p=0.9, min_p=0.1, n_probs=10),
    dict(temperature=0.9, top_k=0, top_p=0.0, min_p=0.0),           # top_p 0: the best token only
    dict(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, n_probs=6, post_sampling_probs=True),
    dict(temperature=1.1, top_k=0, top_p=0.8, min_p=0.02, repeat_penalty=1.2, presence_penalty=0.5,
         frequency_penalty=0.25, repeat_last_n=16, logit_bias={0: 2.5, 7: 1.0, 11: -3.0}),
    dict(temperature=2.0, top_k=100, top_p=0.99, min_p=0.0, repeat_penalty=0.8, repeat_last_n=-1, n_probs=3,
         post_sampling_probs=True),
]


def _random_masks(rng, n_slots, V, step):
    """Allowed-token bit arrays [n_slots, words]: sparse, dense, a single token, none (every 4th step)."""
    words = (V + 31) // 32
    bits = rng.random((n_slots, words * 32)) < rng.choice([0.02, 0.5, 0.95], size=(n_slots, 1))
    bits[0] = False
    bits[0, rng.integers(0, V)] = step % 4 != 3
    bits[:, V:] = False
    return np.packbits(bits.astype(np.uint8), axis=1, bitorder="little").view("<u4").astype(np.uint32)


def _run_both(cp, V, n_slots, steps, seed, configs=CONFIGS, ties=True, constrained=False):
    """The host Sampler and DeviceSampler over the same logits for `steps` steps; asserts identity.
    constrained: every other slot samples under a random allowed-token mask, new each step."""
    rng = np.random.default_rng(seed)
    host = Sampler(n_slots, V)
    be = LogitsBackend(cp, n_slots, n_slots, n_vocab=V)
    dev = DeviceSampler(be, n_slots, V, masks=host.masks)
    for s in range(n_slots):
        cfg = dict(configs[s % len(configs)], seed=int(rng.integers(0, 2**63)),
                   history=rng.integers(0, V, int(rng.integers(0, 40))).tolist())
        host.configure(s, constrained=constrained and s % 2 == 0, **cfg)
        dev.configure(s, constrained=constrained and s % 2 == 0, **cfg)
    for step in range(steps):
        row_slot = rng.permutation(n_slots)[:max(1, n_slots - step % 3)].astype(np.int32)
        m = len(row_slot)
        if constrained:
            host.masks[:] = _random_masks(rng, n_slots, V, step)
        logits = _logits(rng, m, V, ties)
        be.logits = logits
        want_ids = np.zeros(m, np.int32)
        want_pi, want_p = np.full((m, 100), -7, np.int32), np.full((m, 100), -7.0, np.float32)
        host.sample(logits.copy(), row_slot, want_ids, want_pi, want_p)
        got_ids = np.zeros(m, np.int32)
        got_pi, got_p = np.full((m, 100), -7, np.int32), np.full((m, 100), -7.0, np.float32)
        dev.forward(None, None, None, np.arange(m, dtype=np.int32), row_slot)
        dev.sample(row_slot, got_ids, got_pi, got_p)
        assert got_ids.tolist() == want_ids.tolist(), f"step {step}: rows of slots {row_slot.tolist()}"
        for r, s in enumerate(row_slot):
            n = configs[s % len(configs)].get("n_probs", 0)
            assert got_pi[r, :n].tolist() == want_pi[r, :n].tolist(), f"step {step}, slot {s}"
            assert got_p[r, :n].view(np.int32).tolist() == want_p[r, :n].view(np.int32).tolist(), \
                f"step {step}, slot {s}"
    for s in range(n_slots):
        assert dev.history(s) == host.history(s)


# -- the kernel (GPU, or its CUDA C on the CPU) ----------------------------------------------------

def test_greedy_is_the_host_argmax(cupy):
    _run_both(cupy, 49152, 3, 3, seed=1, configs=[dict(temperature=0.0)])


@pytest.mark.parametrize("V, seed", [(1000, 2), (4099, 3)])
def test_chain_is_identical_to_the_host_sampler(cupy, V, seed):
    _run_both(cupy, V, len(CONFIGS), 4, seed)


def test_chain_without_ties_on_a_large_vocabulary(cupy):
    _run_both(cupy, 49152, len(CONFIGS), 2, seed=4, ties=False)


@pytest.mark.parametrize("V, seed", [(1000, 6), (4099, 7)])
def test_constrained_rows_are_identical_to_the_host_sampler(cupy, V, seed):
    """The mask travels with the row's record: same ids, probabilities and windows as the host
    sampler's constrained rows, -1 where nothing is allowed."""
    _run_both(cupy, V, len(CONFIGS), 8, seed, constrained=True)


def test_rows_without_candidates(cupy):
    """-inf and NaN only: token 0, no draw (the next step's draw is the host's), empty lists."""
    V = 300
    host, be = Sampler(2, V), LogitsBackend(cupy, 2, 2, n_vocab=V)
    dev = DeviceSampler(be, 2, V)
    configs = [dict(temperature=0.9, n_probs=4), dict(temperature=0.0, n_probs=4, post_sampling_probs=True)]
    for s, cfg in enumerate(configs):
        host.configure(s, seed=5 + s, **cfg)
        dev.configure(s, seed=5 + s, **cfg)
    rng = np.random.default_rng(5)
    for bad in (True, False):
        logits = _logits(rng, 2, V)
        if bad:
            logits[:] = -np.inf
            logits[:, ::7] = np.nan
        be.logits = logits
        want, wpi, wp = np.zeros(2, np.int32), np.zeros((2, 100), np.int32), np.zeros((2, 100), np.float32)
        host.sample(logits.copy(), np.arange(2, dtype=np.int32), want, wpi, wp)
        got, gpi, gp = np.zeros(2, np.int32), np.zeros((2, 100), np.int32), np.zeros((2, 100), np.float32)
        dev.forward(None, None, None, np.arange(2), np.arange(2, dtype=np.int32))
        dev.sample(np.arange(2, dtype=np.int32), got, gpi, gp)
        assert got.tolist() == want.tolist()
        assert gpi[:, :4].tolist() == wpi[:, :4].tolist() and gp[:, :4].tolist() == wp[:, :4].tolist()


# -- the glue, everywhere (fake_cupy: the kernel emulated by the host sampler's twin) ----------------

@pytest.fixture(params=["numpy", "cuda-c"])
def fake(request, monkeypatch):
    """fake_cupy with the kernels emulated in NumPy (the sampler: its twin), or their CUDA C run on the
    CPU (tests/gpu/cuda_emu): then the engine tests run the real sampling kernel end to end."""
    if request.param == "cuda-c":
        from . import cuda_emu
        why = cuda_emu.unavailable()
        if why:
            pytest.skip(f"CPU run of the kernels skipped: {why}")
    return fake_cupy.install(monkeypatch, kernels=request.param)


def test_glue_matches_the_host_sampler(fake):
    _run_both(fake, 700, len(CONFIGS), 5, seed=6)


def test_backend_packs_rows_into_the_input_copy(fake, tiny_model):
    """forward_sample: the same ids as forward() + the host sampler, for decode steps (graphs, padding
    rows) and a prefill step; per step one copy in (inputs and records), one copy back, one wait."""
    from fastserve.backends.cuda.backend import CupyBackend
    cfg, w = tiny_model.config, tiny_model.weights
    V = cfg.n_vocab
    be = CupyBackend(cfg, w, 4, 32)
    host = Sampler(4, V)
    dev = DeviceSampler(be, 4, V)
    for s in range(4):
        c = dict(CONFIGS[(s * 3) % len(CONFIGS)], seed=100 + s, history=[1, 2, 3])
        host.configure(s, **c)
        dev.configure(s, **c)
    prompt = np.array([5, 6, 7, 8, 9], np.int32)
    # prefill of slot 0 (one output row), then decode steps of 3 slots (bucket 4: one padding row)
    steps = [(prompt, np.arange(5, dtype=np.int32), np.zeros(5, np.int32), np.array([4], np.int32))]
    for p in range(3):
        ids = np.array([10 + p, 20 + p, 30 + p], np.int32)
        steps.append((ids, np.full(3, 5 + p, np.int32), np.array([0, 2, 3], np.int32), np.arange(3, dtype=np.int32)))
    for toks, pos, slots, out_rows in steps:
        logits = np.array(be.forward(toks, pos, slots, out_rows))
        row_slot = slots[out_rows].astype(np.int32)
        want, wpi, wp = np.zeros(len(out_rows), np.int32), np.zeros((4, 100), np.int32), np.zeros((4, 100), np.float32)
        host.sample(logits, row_slot, want, wpi, wp)
        got, gpi, gp = np.zeros(len(out_rows), np.int32), np.zeros((4, 100), np.int32), np.zeros((4, 100), np.float32)
        calls = []
        rt = fake.cuda.runtime
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(rt, "memcpyAsync", lambda *a, f=rt.memcpyAsync: (calls.append(a[3]), f(*a))[1])
            mp.setattr(be.stream, "synchronize", lambda f=be.stream.synchronize: (calls.append("wait"), f())[1])
            dev.forward(toks, pos, slots, out_rows, row_slot)
            dev.sample(row_slot, got, gpi, gp)
        assert calls == [rt.memcpyHostToDevice, rt.memcpyDeviceToHost, "wait"]
        assert got.tolist() == want.tolist()
        for r, s in enumerate(row_slot):        # each row's list (the host's own entry after it: none on the device)
            n = CONFIGS[(s * 3) % len(CONFIGS)].get("n_probs", 0)
            np.testing.assert_array_equal(gpi[r, :n], wpi[r, :n])
            np.testing.assert_array_equal(gp[r, :n], wp[r, :n])
            assert not n or wpi[r, n] == want[r]
    assert sorted(be._sample_graphs) == [4]


class _HostSampling:
    """CupyBackend's forward() with the host sampler (HostSampled): the engine's step samples its logits on the host."""

    def __new__(cls, *args, **kw):
        from fastserve.backends.cuda.backend import CupyBackend
        from fastserve.backends.host_sampling import HostSampled
        return HostSampled(CupyBackend(*args, **kw))


@pytest.mark.parametrize("n_batch", [512, 3])
def test_engine_samples_on_the_device_as_on_the_host(fake, tiny_model, n_batch):
    """Same backend, same logits: the engine's output (ids and probabilities) with device sampling equals
    its output with the host sampler, for concurrent sampled requests with seeds (also with fewer batch
    tokens than slots: prompts in chunks, steps with fewer output rows than running slots)."""
    import fastserve
    from fastserve.backends.cuda.backend import CupyBackend
    reqs = [dict(prompt=[5, 6, 7, 8], temperature=0.9, seed=11, n_probs=3),
            dict(prompt=[9, 10], temperature=1.2, top_k=0, top_p=0.7, seed=12, repeat_penalty=1.3,
                 frequency_penalty=0.2, logit_bias={4: 3.0}),
            dict(prompt=[11, 12, 13], temperature=0.0, n_probs=2, post_sampling_probs=True),
            dict(prompt=[14, 15, 16, 17, 18], temperature=0.6, min_p=0.2, seed=13, n_probs=4,
                 post_sampling_probs=True),
            # constrained rows: the mask travels with the row's record (grammars that never end)
            dict(prompt=[19, 20], temperature=1.0, top_k=0, seed=14, grammar='root ::= [a-m]{80,}', n_probs=3),
            dict(prompt=[21], temperature=0.0, grammar='root ::= ("ab" | [0-9] | " ")+')]

    def run(cls):
        # Steps must be the same in both runs (products over other batch sizes may round otherwise): a
        # first request holds the decode thread inside its forward pass until all the others are queued.
        entered, gate = threading.Event(), threading.Event()

        def factory(cfg, w, n_slots, n_ctx_slot):
            be = cls(cfg, w, n_slots, n_ctx_slot)
            inner = getattr(be, "model_pass", be)       # the CupyBackend under a HostSampled
            submit = inner._submit

            def gated(*a, **kw):
                entered.set()
                gate.wait(30)
                return submit(*a, **kw)
            inner._submit = gated
            return be

        with fastserve.Engine(tiny_model, n_parallel=6, n_ctx=384, n_batch=n_batch, backend=factory) as e:
            assert e.describe().samples_on_device == (cls is CupyBackend)
            first = e.submit([1, 2], max_tokens=1, temperature=0)
            assert entered.wait(30)
            readers = [e.submit(r.pop("prompt"), max_tokens=10, **r) for r in [dict(q) for q in reqs]]
            gate.set()
            first.result()
            outs = [rd.result() for rd in readers]
        assert all(o.finish_reason == "length" for o in outs), [(o.finish_reason, o.error, o.text) for o in outs]
        return [(o.token_ids, o.probs) for o in outs]

    got = run(CupyBackend)
    want = run(_HostSampling)
    # the host sampler follows each token's n_probs list with the sampled token's own entry; the device's gives
    # none (cuda/sampling.cu): the lists are equal, and the host's own entry is the listed one where listed
    shown = [r.get("n_probs", 0) for r in reqs]
    assert got == [(ids, probs and [p[:n] for p in probs]) for (ids, probs), n in zip(want, shown)]
    for (ids, probs), n in zip(want, shown):
        for tok, p in zip(ids, probs or []):
            assert len(p) == n + 1 and p[n][0] == tok and dict(p[:n]).get(tok, p[n][1]) == p[n][1]
    tok = tiny_model.tokenizer
    assert set(tok.decode(got[4][0])) <= set("abcdefghijklm") and set(tok.decode(got[5][0])) <= set("ab0123456789 ")
