"""Sliding-window layers kept in a ring (backends/cpu/kv_cache.py): a Gemma-like synthetic model (window 8,
5 local layers of 7) whose local layers keep only the last R = 64 positions of a slot gives the bits of
the same model keeping every position: greedy tokens and top-5 probabilities over prompts many windows
long, whatever the chunks a prompt is computed in; and a slot's cached prefix is reused only where the
ring still holds the window before the divergence (else computed again, with the same result)."""
from __future__ import annotations

import numpy as np
import pytest

import fastserve
from fastserve.models.synthetic import write_llama_gguf

N_CTX = 512
RING = 64           # window 8 + up to 57 tokens per step, in whole K tiles


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = write_llama_gguf(tmp_path_factory.mktemp("swa") / "gemma3.gguf", architecture="gemma3", n_layer=7,
                            head_dim=24, sliding_window=8, seed=3)
    return fastserve.load_model(path)


def _slots(engine) -> list:
    """GET /slots of a server on engine (the route alone, no socket)."""
    import orjson

    from fastserve.server.app import App
    from fastserve.server.config import ServerConfig
    from fastserve.server.http import HttpRequest
    from fastserve.server.protocol import Exchange

    class Conn:
        peer = "test"

    req = HttpRequest("GET", "/slots", {"host": "h"}, b"")
    return orjson.loads(App(engine, ServerConfig(log_requests=False)).handle(req, Exchange(Conn(), req)).body)


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def _run(engine, prompt, n=12, **kw):
    r = engine.generate(prompt, max_tokens=n, temperature=0, n_probs=5, **kw)
    return r.token_ids, r.probs


@pytest.fixture(scope="module")
def full(gemma):
    """The model keeping every position (n_batch large enough that no ring is smaller than the context)."""
    with fastserve.Engine(gemma, n_parallel=1, n_ctx=N_CTX, n_batch=N_CTX, threads=1) as e:
        assert e.describe().ring == 0
        yield e


@pytest.mark.parametrize("n_batch,prefill_chunk", [(57, 57), (8, 8), (16, 5)])
def test_ring_gives_the_bits_of_every_position(gemma, full, n_batch, prefill_chunk):
    prompt = _prompt(1, 300)                # ~37 windows; the ring of 64 wraps 4 times
    want = _run(full, prompt, cache_prompt=False)
    with fastserve.Engine(gemma, n_parallel=2, n_ctx=2 * N_CTX, n_batch=n_batch, prefill_chunk=prefill_chunk,
                          threads=1) as e:
        assert e.describe().ring == RING
        kv = e._backend.kv
        assert kv.nbytes() < 0.5 * 7 * 2 * N_CTX * kv.n_head_kv * (kv.row_k + kv.row_v)   # 5 of 7 layers: 64 rows
        assert _run(e, prompt, cache_prompt=False) == want
        # beside another request (other slot, other chunks): the same bits
        other = e.submit(_prompt(2, 200), max_tokens=30, temperature=0)
        assert _run(e, prompt, cache_prompt=False) == want
        other.result()


def test_prefix_reuse_where_the_ring_allows(gemma, full):
    first = _prompt(4, 300)
    with fastserve.Engine(gemma, n_parallel=1, n_ctx=N_CTX, n_batch=32, threads=1) as e:
        assert e.describe().ring == RING
        r = e.generate(first, max_tokens=20, temperature=0)
        n_held = len(first) + 19                           # the last token's KV is never written
        reuse_from = e._backend.kv_reuse_from(0, n_held)
        # the ring holds positions n_held - 64 .. n_held - 1: a continuation needs the 7 keys before it
        assert reuse_from == n_held - RING + 8 - 1 == e.snapshot.slot_reuse_from[0]
        for diverge, reused in ((300, 300), (n_held - RING + 8 - 1, n_held - RING + 7),   # within the ring
                                (n_held - RING + 6, 0), (200, 0)):                      # beyond it
            prompt = first[:diverge] + _prompt(diverge, 40)
            r = e.generate(prompt, max_tokens=12, temperature=0, n_probs=5)
            assert r.timings["cache_n"] == reused, diverge
            assert (r.token_ids, r.probs) == _run(full, prompt, cache_prompt=False), diverge
            # put the slot back as the first request left it
            e.generate(first, max_tokens=20, temperature=0, cache_prompt=False)
        slot = _slots(e)[0]
        assert (slot["n_swa"], slot["swa_ring"], slot["swa_reusable"]) == (8, RING, [reuse_from, n_held])


def test_the_host_ram_cache_restores_what_the_ring_held(gemma, full):
    """A prefix saved from a ring slot and restored into it: reused within the window's reach, else computed."""
    a, b = _prompt(6, 250), _prompt(7, 100)
    with fastserve.Engine(gemma, n_parallel=1, n_ctx=N_CTX, n_batch=32, threads=1, cache_ram_mib=64) as e:
        e.generate(a, max_tokens=10, temperature=0)
        e.generate(b, max_tokens=10, temperature=0)       # a's prefix goes to the host-RAM cache
        entry = next(iter(e._prompt_cache.index.values()))
        assert entry.n == 259 and entry.held_from == 259 - RING
        for diverge, reused in ((250, 250), (200, 0)):
            prompt = a[:diverge] + _prompt(diverge + 1, 30)
            r = e.generate(prompt, max_tokens=12, temperature=0, n_probs=5)
            assert r.timings["cache_n"] == reused, diverge
            assert (r.token_ids, r.probs) == _run(full, prompt, cache_prompt=False), diverge
            e.generate(b, max_tokens=10, temperature=0, cache_prompt=False)


def test_a_free_slot_is_chosen_by_the_prefix_its_ring_can_reuse(gemma, full):
    """Slot 0 shares 100 tokens with the prompt but its ring holds only its last 64 positions; slot 1 shares
    50 and holds them all: slot 1 reuses its 50, where counting the bare common prefix would take slot 0
    and reuse nothing."""
    a = _prompt(8, 300)
    b = a[:50] + _prompt(9, 6)
    prompt = a[:100] + _prompt(10, 30)
    with fastserve.Engine(gemma, n_parallel=2, n_ctx=2 * N_CTX, n_batch=32, threads=1) as e:
        e.generate(a, max_tokens=10, temperature=0, id_slot=0)
        e.generate(b, max_tokens=5, temperature=0, id_slot=1)
        s0, s1 = _slots(e)
        assert s0["swa_reusable"] == [309 - RING + 7, 309] and s1["swa_reusable"] == [0, 60]
        r = e.generate(prompt, max_tokens=12, temperature=0, n_probs=5)
        assert (r.id_slot, r.timings["cache_n"]) == (1, 50)
        assert (r.token_ids, r.probs) == _run(full, prompt, cache_prompt=False)
        assert _slots(e)[0]["swa_reusable"] == s0["swa_reusable"]        # slot 0 kept a's prefix


def test_the_host_ram_cache_chooses_the_entry_a_restore_can_reuse(gemma, full):
    """Entries sharing 100 tokens with the prompt whose rings hold only their last 64 positions (a's, q's),
    and c's sharing 50 with every ring row held: the lookup gives c's 50. Before c is there, nothing
    reusable is in the cache, and the lookup costs no copy."""
    a = _prompt(11, 300)
    q = a[:100] + _prompt(12, 100)
    c = a[:50] + _prompt(13, 6)
    other = _prompt(14, 40)
    prompt = a[:100] + _prompt(15, 30)
    with fastserve.Engine(gemma, n_parallel=1, n_ctx=N_CTX, n_batch=32, threads=1, cache_ram_mib=64) as e:
        pc = e._prompt_cache
        e.generate(a, max_tokens=10, temperature=0)
        e.generate(other, max_tokens=1, temperature=0)      # a's prefix goes to the host-RAM cache
        assert [(x.n, x.held_from) for x in pc.index.values()] == [(309, 309 - RING)]
        restored = pc.n_restored
        r = e.generate(q, max_tokens=10, temperature=0)
        assert r.timings["cache_n"] == 0 and pc.n_restored == restored    # nothing reusable: no copy
        e.generate(c, max_tokens=5, temperature=0)          # q's prefix goes to the cache
        e.generate(other, max_tokens=1, temperature=0)      # and c's
        assert sorted((x.n, x.held_from) for x in pc.index.values()) == [
            (40, 0), (60, 0), (209, 209 - RING), (309, 309 - RING)]
        restored = pc.n_restored
        r = e.generate(prompt, max_tokens=12, temperature=0, n_probs=5)
        assert r.timings["cache_n"] == 50 and pc.n_restored == restored + 1
        assert (r.token_ids, r.probs) == _run(full, prompt, cache_prompt=False)


def test_a_longer_entry_replaces_a_shorter_one_only_if_it_serves_its_prefixes(gemma, full):
    """s (40 tokens, every ring row held) is a prefix of l (240): without a window l's copy would replace
    s's; with one, l serves only shared prefixes from 183 on, so s's entry stays and serves s's 40."""
    s = _prompt(16, 40)
    long = s + _prompt(17, 200)
    other = _prompt(18, 30)
    prompt = s + _prompt(19, 30)
    with fastserve.Engine(gemma, n_parallel=1, n_ctx=N_CTX, n_batch=32, threads=1, cache_ram_mib=64) as e:
        pc = e._prompt_cache
        for p in (s, other, long, other):                   # s's, then long's prefixes go to the cache
            e.generate(p, max_tokens=1, temperature=0)
        assert sorted((x.n, x.held_from) for x in pc.index.values()) == [(30, 0), (40, 0), (240, 240 - RING)]
        r = e.generate(prompt, max_tokens=12, temperature=0, n_probs=5)
        assert r.timings["cache_n"] == 40
        assert (r.token_ids, r.probs) == _run(full, prompt, cache_prompt=False)
