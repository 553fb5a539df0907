"""Prefix reuse, the host-RAM prompt cache, and failure containment (issue 5), on the tiny model.

Reused KV is bit-identical to recomputed KV here (batch-invariant projections, attention over
exactly keys 0..pos), so every comparison below demands exact equality of greedy tokens.
"""
import logging
import threading
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastserve
from fastserve.backends.cpu.backend import CpuBackend
from fastserve.prompt_cache import MIB, PromptCache

from fill_failures import FailingFills

rng = np.random.default_rng(5)
STEMS = [rng.integers(3, 512, 48).astype(np.int32).tolist() for _ in range(3)]   # token-id prompts (no BOS)
GREEDY = dict(temperature=0)


def _ids(stem, n, tail=()):
    return STEMS[stem][:n] + list(tail)


# -- the pool on its own --------------------------------------------------------------------------

@pytest.fixture
def backend(tiny_model):
    be = CpuBackend(tiny_model.config, tiny_model.weights, 2, 128)
    ids = np.asarray(STEMS[0][:40], np.int32)
    pos = np.arange(40)
    be.forward(ids, pos, np.zeros(40, np.int64), pos[-1:])          # slot 0 holds 40 real rows
    return be


def _kv(be, slot, n):
    """Slot's KV rows 0..n, as bytes per layer."""
    buf = np.zeros(n * be.kv_bytes_per_token(), np.uint8)
    be.save_slot(slot, 0, n, buf)
    return np.split(buf, be.cfg.n_layer)


def test_save_then_restore_is_bit_exact(backend):
    pc = PromptCache(backend, 64 * 1024, block_tokens=16)
    assert pc.save(0, np.asarray(STEMS[0][:40], np.int32))
    entry, n = pc.lookup(np.asarray(STEMS[0][:30] + [1, 2], np.int32))
    assert n == 30 and entry.n == 40 and len(entry.blocks) == 3
    assert pc.restore(entry, 1, 0, 40)
    assert all(np.array_equal(a, b) for a, b in zip(_kv(backend, 0, 40), _kv(backend, 1, 40)))
    for k in backend.kv.k + backend.kv.v:
        k[1] = 0
    assert pc.restore(entry, 1, 0, 36)        # ends inside the last block, which holds 8 rows
    assert all(np.array_equal(a, b) for a, b in zip(_kv(backend, 0, 36), _kv(backend, 1, 36)))


def test_the_pool_is_allocated_once_and_reused(backend):
    pc = PromptCache(backend, 256 * 1024, block_tokens=16)
    addr = pc.pool.ctypes.data
    tokens = np.asarray(STEMS[0][:40], np.int32)
    pc.save(0, tokens)
    tracemalloc.start()
    for i in range(20):                 # every save takes blocks of the same pool, none is allocated
        pc.clear()
        assert pc.save(0, tokens)
        pc.restore(pc.lookup(tokens)[0], 1, 0, 40)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert pc.pool.ctypes.data == addr
    assert peak < 40 * backend.kv_bytes_per_token() // 2, f"{peak} bytes allocated by 20 copies"


def test_lru_eviction_and_superseding(backend):
    pc = PromptCache(backend, 4 * 16 * backend.kv_bytes_per_token(), block_tokens=16)   # 4 blocks
    a, b = np.asarray(STEMS[0][:20], np.int32), np.asarray(STEMS[1][:20], np.int32)
    assert pc.save(0, a) and pc.save(0, b)              # 2 blocks each: the pool is full
    pc.lookup(a)
    pc.restore(pc.lookup(a)[0], 1, 0, 20)               # a is now the most recently used
    c = np.asarray(STEMS[2][:10], np.int32)
    assert pc.save(0, c)                                # evicts b, the least recently used
    assert pc.lookup(b)[1] == 0 and pc.lookup(a)[1] == 20 and pc.n_evicted == 1
    assert not pc.save(0, a[:12])                       # already held by a's entry
    longer = np.asarray(STEMS[0][:30], np.int32)
    assert pc.save(0, longer)                           # holds all of a: a's entry goes
    assert [e.n for e in pc.index.values()] == [10, 30]


def test_a_copy_that_does_not_fit_is_refused_and_logged(backend, caplog):
    pc = PromptCache(backend, 16 * backend.kv_bytes_per_token(), block_tokens=16)      # 1 block
    with caplog.at_level(logging.WARNING, "fastserve.prompt_cache"):
        assert not pc.save(0, np.asarray(STEMS[0][:40], np.int32))
    assert pc.n_refused == 1 and not pc.index and len(pc.free) == 1
    assert "refused" in caplog.text and "40 tokens" in caplog.text


def test_a_pool_that_cannot_be_allocated_refuses_every_copy(backend, caplog):
    with caplog.at_level(logging.WARNING, "fastserve.prompt_cache"):
        pc = PromptCache(backend, 1 << 60)                  # an exabyte: numpy cannot have it
        assert not pc.save(0, np.asarray(STEMS[0][:40], np.int32))
    assert pc.n_blocks == 0 and pc.n_refused == 1
    assert "could not be allocated" in caplog.text and "refused" in caplog.text


def test_a_copy_that_fails_halfway_leaves_nothing_behind(backend, caplog):
    pc = PromptCache(backend, 64 * 1024, block_tokens=16)
    assert pc.save(0, np.asarray(STEMS[1][:20], np.int32))
    calls = []

    def save_slot(slot, start, n, into, real=backend.save_slot):
        calls.append(start)
        if len(calls) == 2:
            raise MemoryError("injected")
        real(slot, start, n, into)

    backend.save_slot = save_slot
    free = sorted(pc.free)
    with caplog.at_level(logging.WARNING, "fastserve.prompt_cache"):
        assert not pc.save(0, np.asarray(STEMS[0][:40], np.int32))
    assert calls == [0, 16] and sorted(pc.free) == free and len(pc.index) == 1
    assert "refused" in caplog.text


def test_the_entry_about_to_be_restored_is_never_evicted(backend):
    pc = PromptCache(backend, 3 * 16 * backend.kv_bytes_per_token(), block_tokens=16)  # 3 blocks
    a = np.asarray(STEMS[0][:40], np.int32)
    assert pc.save(0, a)
    keep = pc.lookup(a)[0]
    assert not pc.save(1, np.asarray(STEMS[1][:20], np.int32), keep=keep)   # would need a's blocks
    assert pc.lookup(a)[0] is keep and pc.n_refused == 1


# -- the engine ----------------------------------------------------------------------------------

def test_cache_n_reports_the_reused_prefix(tiny_model):
    with fastserve.Engine(tiny_model, n_parallel=2, n_ctx=256) as e:
        p = _ids(0, 30)
        cold = e.generate(p, max_tokens=6, **GREEDY)
        warm = e.generate(p, max_tokens=6, **GREEDY)
        off = e.generate(p, max_tokens=6, cache_prompt=False, **GREEDY)
        ext = e.generate(p + cold.token_ids + [7, 8], max_tokens=6, **GREEDY)
    assert cold.timings["cache_n"] == 0 and cold.timings["prompt_n"] == 30
    assert warm.timings["cache_n"] == 29 and warm.timings["prompt_n"] == 1
    assert off.timings["cache_n"] == 0
    assert ext.timings["cache_n"] == 30 + 5        # the last generated token's KV was never written
    assert cold.token_ids == warm.token_ids == off.token_ids
    assert warm.id_slot == cold.id_slot and warm.tokens_cached == 36


def test_a_slot_is_picked_by_prefix_similarity_else_least_recently_used(tiny_model):
    with fastserve.Engine(tiny_model, n_parallel=3, n_ctx=3 * 128, slot_prompt_similarity=0.5) as e:
        for s in range(3):
            e.generate(_ids(s, 40), max_tokens=2, id_slot=s, **GREEDY)
        # 30 of 40 tokens shared with slot 1: above the threshold
        assert e.generate(_ids(1, 30, [1] * 10), max_tokens=2, **GREEDY).id_slot == 1
        # 10 of 40 shared with slot 2: below it, so the least recently used slot (0) is taken
        r = e.generate(_ids(2, 10, [1] * 30), max_tokens=2, **GREEDY)
        assert r.id_slot == 0 and r.timings["cache_n"] == 0


def test_host_cache_restores_a_prefix_the_slot_lost(tiny_model, caplog):
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=128, cache_ram_mib=1) as e:
        a, b = _ids(0, 40), _ids(1, 40)
        first = e.generate(a, max_tokens=5, **GREEDY)
        e.generate(b, max_tokens=5, **GREEDY)                   # the slot's prefix of a is saved
        again = e.generate(a, max_tokens=5, **GREEDY)           # ... and restored
        off = e.generate(a, max_tokens=5, cache_prompt=False, **GREEDY)
        stats = e.stats().prompt_cache
    assert again.timings["cache_n"] == 39 and again.token_ids == first.token_ids == off.token_ids
    assert off.timings["cache_n"] == 0
    assert stats["saved"] >= 2 and stats["restored"] == 1 and stats["refused"] == 0


def test_a_refused_copy_is_not_a_slot_failure(tiny_model, caplog):
    """Every save refused (8 KiB: not one block): both pinned slots complete, with equal content."""
    with fastserve.Engine(tiny_model, n_parallel=2, n_ctx=256, cache_ram_mib=16 * 512 / MIB) as e:
        for s in (0, 1):
            e.generate(_ids(0, 40), max_tokens=3, id_slot=s, **GREEDY)
        with caplog.at_level(logging.WARNING, "fastserve.prompt_cache"):
            rs = [e.submit(_ids(1, 40), max_tokens=8, id_slot=s, **GREEDY) for s in (0, 1)]
            out = [r.result(timeout=30) for r in rs]
        assert [o.finish_reason for o in out] == ["length", "length"]
        assert out[0].token_ids == out[1].token_ids
        assert e.stats().prompt_cache["refused"] == 2 and "refused" in caplog.text
        back = e.generate(_ids(0, 40), max_tokens=3, id_slot=0, **GREEDY)
        assert back.timings["cache_n"] == 0                      # its copy was refused: cold
        assert e.snapshot.n_running == 0 and e._thread.is_alive()


class _Gated(fastserve.Engine):
    """The decode thread waits for `gate` before each admission. fail = {slot: k}: the slot's
    next k fills go through, the one after fails (after adding its tokens), once."""

    def __init__(self, *args, **kwargs):
        self.gate = threading.Event()
        self.fail = {}
        self.builds = []
        super().__init__(*args, **kwargs)
        self._slots = FailingFills(self._slots, self._on_fill)

    def _admit(self):
        self.gate.wait()
        super()._admit()

    def _build(self):
        built = super()._build()
        self.builds.append(self._batch.view()[2].tolist())
        return built

    def _on_fill(self, slot):
        if slot in self.fail:
            self.fail[slot] -= 1
            if self.fail[slot] < 0:
                del self.fail[slot]
                raise MemoryError("injected after the fill added its tokens")


def test_a_failed_fill_uses_up_no_turn(tiny_model):
    e = _Gated(tiny_model, n_parallel=2, n_ctx=256, n_batch=16)
    try:
        e.fail = {0: 0}
        bad = e.submit(_ids(0, 20), max_tokens=2, id_slot=0, **GREEDY)
        good = e.submit(_ids(1, 20), max_tokens=2, id_slot=1, **GREEDY)
        e.builds.clear()
        e.gate.set()
        assert bad.result(timeout=10).finish_reason == "error"
        assert good.result(timeout=10).finish_reason == "length"
        # the step in which slot 0's fill failed gave slot 1 the whole batch
        assert e.builds[0] == [1] * 16
    finally:
        e.gate.set()
        e.close()


def _answer_then_another(e) -> list:
    """Stem 0's greedy answer, without the cache; then stem 1 in the slot (which saves stem 0)."""
    want = e.generate(_ids(0, 40), max_tokens=4, cache_prompt=False, **GREEDY).token_ids
    e.generate(_ids(1, 30), max_tokens=2, **GREEDY)
    return want


def test_a_fill_failing_on_its_second_chunk_keeps_the_first(tiny_model):
    with _Gated(tiny_model, n_parallel=1, n_ctx=128, n_batch=16) as e:
        e.gate.set()
        want = _answer_then_another(e)
        e.fail = {0: 1}
        res = e.generate(_ids(0, 40), max_tokens=4, **GREEDY)
        assert res.finish_reason == "error" and "injected" in res.error
        assert e._slots.n_past[0] == 16 and e._slots.n_tokens[0] == 16   # the chunk whose KV was written
        retry = e.generate(_ids(0, 40), max_tokens=4, **GREEDY)
        assert retry.timings["cache_n"] == 16 and retry.token_ids == want


def test_a_failed_fill_leaves_no_cache_entry_behind(tiny_model):
    with _Gated(tiny_model, n_parallel=1, n_ctx=128, cache_ram_mib=1) as e:
        e.gate.set()
        want = _answer_then_another(e)
        e.generate(_ids(2, 30), max_tokens=2, **GREEDY)          # saves stem 1
        pc = e._prompt_cache
        e.fail = {0: 0}
        res = e.generate(_ids(1, 20, [9] * 20), max_tokens=4, **GREEDY)   # restores 20, saves stem 2, fails
        assert res.finish_reason == "error"
        assert [x.n for x in pc.index.values()] == [43, 31, 31]           # stem 0, stem 1, stem 2: whole
        assert e._slots.n_tokens[0] == 20                                 # the restored rows are real KV
        e.generate(_ids(2, 30), max_tokens=2, **GREEDY)
        assert len(pc.index) == 3                                         # 20 tokens of stem 1: held already
        retry = e.generate(_ids(0, 40), max_tokens=4, **GREEDY)
        assert retry.timings["cache_n"] == 39 and retry.token_ids == want


# -- property: the cache never changes a greedy output ---------------------------------------------

@pytest.fixture(scope="module")
def engines(tiny_model):
    kw = dict(n_parallel=2, n_ctx=2 * 128, n_batch=32)
    es = {"ref": fastserve.Engine(tiny_model, **kw)}
    block = 32 * es["ref"]._backend.kv_bytes_per_token()                         # a pool block's bytes
    es.update({"slots": fastserve.Engine(tiny_model, **kw),
               "ram": fastserve.Engine(tiny_model, cache_ram_mib=6 * block / MIB, **kw),   # evictions
               "ram_tiny": fastserve.Engine(tiny_model, cache_ram_mib=block / MIB, **kw)})  # refusals
    yield es
    for e in es.values():
        e.close()


request = st.tuples(st.integers(0, 2), st.integers(0, 48), st.lists(st.integers(3, 511), max_size=5),
                    st.integers(1, 5), st.sampled_from([-1, -1, 0, 1]), st.booleans())
waves = st.lists(st.lists(request, min_size=1, max_size=3), min_size=1, max_size=5)


def _check_waves(engines, waves):
    """Each wave's requests run concurrently on every engine; greedy outputs must equal the reference's."""
    for wave in waves:
        reqs = [(_ids(s, n, tail) or [5], m, slot, cp) for s, n, tail, m, slot, cp in wave]
        want = [r.result(timeout=30).token_ids for r in
                [engines["ref"].submit(p, max_tokens=m, id_slot=slot, cache_prompt=False, **GREEDY)
                 for p, m, slot, _ in reqs]]
        for name in ("slots", "ram", "ram_tiny"):
            e = engines[name]
            got = [r.result(timeout=30) for r in
                   [e.submit(p, max_tokens=m, id_slot=slot, cache_prompt=cp or name == "slots", **GREEDY)
                    for p, m, slot, cp in reqs]]
            assert [g.token_ids for g in got] == want, name
            assert all(g.timings["cache_n"] < len(p) for g, (p, *_) in zip(got, reqs))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(waves=waves)
def test_cache_never_changes_greedy_output(engines, waves):
    _check_waves(engines, waves)


def test_the_cache_engines_save_restore_evict_and_refuse(engines):
    """A fixed sequence through the property's engines: each cache path is really taken."""
    before = {n: engines[n].stats().prompt_cache for n in ("ram", "ram_tiny")}
    seq = [[(s, 48, [], 3, -1, True) for s in (0, 1)], [(2, 48, [], 3, 0, True)], [(2, 40, [], 3, 1, True)],
           [(0, 44, [1], 3, 0, True)], [(1, 30, [2, 3], 3, -1, True)], [(0, 48, [4], 3, 1, False)]]
    _check_waves(engines, seq)
    ram, tiny = (engines[n].stats().prompt_cache for n in ("ram", "ram_tiny"))
    assert ram["saved"] > before["ram"]["saved"] and ram["restored"] > before["ram"]["restored"]
    assert tiny["refused"] > before["ram_tiny"]["refused"]
