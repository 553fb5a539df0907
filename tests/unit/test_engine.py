"""The Engine on the tiny model: generation, streaming, concurrency, cancellation, limits, failures."""
import gc
import threading
import time

import numpy as np
import pytest

import fastserve
from fastserve.errors import ContextExceeded, EngineClosed, RequestError, ServerBusy
from fastserve.tracer import STEP_SECONDS_BUCKETS
from fill_failures import FailingFills


@pytest.fixture
def engine(tiny_model):
    with fastserve.Engine(tiny_model, n_parallel=4, n_ctx=512, n_batch=64) as e:
        yield e


def _no_eog(engine_or_model):
    """Sampling arguments that ban end-of-generation tokens, so a generation runs until it is ended."""
    tok = engine_or_model.tokenizer
    return {"logit_bias": {t: float("-inf") for t in tok.eog_ids}}


def _slots_free(engine, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.snapshot.n_running == 0 and engine.snapshot.n_waiting == 0:
            return True
        time.sleep(0.005)
    return False


def test_generate_greedy_is_deterministic(engine):
    a = engine.generate("the cat sat", max_tokens=12, temperature=0)
    b = engine.generate("the cat sat", max_tokens=12, temperature=0, cache_prompt=False)
    assert len(a.token_ids) == 12 and a.finish_reason == "length"
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.prompt_tokens == len(engine.tokenizer.encode("the cat sat"))


def test_stream_yields_the_same_text(engine):
    full = engine.generate("hello", max_tokens=10, temperature=0)
    pieces = list(engine.stream("hello", max_tokens=10, temperature=0))
    assert "".join(pieces) == full.text


def test_seeded_sampling_is_reproducible(engine):
    a = engine.generate("abc", max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    b = engine.generate("abc", max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    c = engine.generate("abc", max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=8)
    assert a.token_ids == b.token_ids != c.token_ids


def test_token_id_prompt(engine):
    ids = engine.tokenizer.encode("the cat")
    assert engine.generate(ids, max_tokens=5, temperature=0).token_ids == \
        engine.generate("the cat", max_tokens=5, temperature=0).token_ids


@pytest.fixture(scope="module")
def q4_k_m_model(tmp_path_factory):
    """A small model in llama.cpp's Q4_K_M mix of Q4_K and Q6_K matrices."""
    from fastserve.models.synthetic import write_llama_gguf
    return fastserve.load_model(write_llama_gguf(tmp_path_factory.mktemp("q4km") / "m.gguf", n_embd=256,
                                                 n_ff=512, seed=4, weight_type="Q4_K_M"))


@pytest.mark.parametrize("model_fixture", ["tiny_model", "q4_k_m_model"])
def test_greedy_is_batch_invariant(request, model_fixture):
    """A request's greedy output is the same alone and among 31 concurrent others."""
    tiny_model = request.getfixturevalue(model_fixture)
    prompts = [f"request number {i} says the" + " at" * (i % 7) for i in range(32)]
    with fastserve.Engine(tiny_model, n_parallel=32, n_ctx=32 * 96, n_batch=128) as e:
        alone = [e.generate(p, max_tokens=24, temperature=0, cache_prompt=False).token_ids for p in prompts[:4]]
        readers = [e.submit(p, max_tokens=24, temperature=0, cache_prompt=False) for p in prompts]
        crowd = [r.result().token_ids for r in readers]
    assert crowd[:4] == alone
    assert len({tuple(t) for t in crowd}) > 1


def test_many_threads_call_generate(tiny_model):
    with fastserve.Engine(tiny_model, n_parallel=4, n_ctx=512) as e:
        want = e.generate("xyz", max_tokens=8, temperature=0).token_ids
        got = []
        threads = [threading.Thread(target=lambda: got.append(e.generate("xyz", max_tokens=8, temperature=0).token_ids))
                   for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert got == [want] * 12


def test_stop_string_ends_and_frees_the_slot(engine):
    full = engine.generate("the cat sat", max_tokens=30, temperature=0)
    stop = full.text[5:8]
    assert stop
    out = engine.generate("the cat sat", max_tokens=30, temperature=0, stop=[stop])
    assert out.finish_reason == "stop" and out.stopping_word == stop
    assert out.text == full.text[:full.text.index(stop)]
    assert _slots_free(engine)


def test_cancel_frees_the_slot_within_a_step(engine):
    reader = engine.submit("long one", max_tokens=-1, temperature=0, **_no_eog(engine))
    next(iter(reader))
    reader.cancel()
    res = reader.result(timeout=5)
    assert res.finish_reason == "cancelled"
    assert _slots_free(engine)


def test_erase_of_a_busy_slot_waits_for_its_request_to_end(tiny_model):
    """erase never cuts a request; a busy slot is erased when its request ends, before it can
    take the next one (which then computes its whole prompt), even with that next one already waiting."""
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=256) as e:
        first = e.submit("the running one", max_tokens=24, temperature=0)
        next(iter(first))
        e.erase(0)
        second = e.submit("the running one", max_tokens=4, temperature=0)     # same prompt: would reuse it
        assert first.result(timeout=10).finish_reason == "length" and len(first.result().token_ids) == 24
        assert second.result(timeout=10).finish_reason == "length"
        assert second.reader.n_cached == 0            # the erase came between the two
        assert _slots_free(e)
        assert e.snapshot.slot_erased[0][0] == 1 and e.snapshot.slot_erased[0][1] > 0
        e.erase(0)                            # idle: at once
        deadline = time.monotonic() + 5
        while e.snapshot.slot_erased[0][0] < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert e.snapshot.slot_erased[0][0] == 2 and e.snapshot.slot_tokens[0] == 0


def test_dropped_reader_frees_its_slot(engine):
    reader = engine.submit("nobody reads this", max_tokens=-1, temperature=0)
    del reader
    import gc
    gc.collect()
    assert _slots_free(engine)


def test_context_full_ends_with_length(tiny_model):
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=32) as e:
        out = e.generate("a b c", max_tokens=-1, temperature=0, **_no_eog(e))
    assert out.finish_reason == "length"
    assert out.prompt_tokens + len(out.token_ids) == 32


def test_bad_requests_are_refused_clearly(engine):
    with pytest.raises(RequestError, match="empty"):
        engine.submit("")
    with pytest.raises(ContextExceeded, match="prompt has .* tokens but a slot holds 128") as exc:
        engine.submit(list(range(1, 200)))
    assert (exc.value.n_prompt, exc.value.n_ctx) == (199, 128)
    with pytest.raises(RequestError, match="token ids must be in"):
        engine.submit([1, 2, 100000])
    with pytest.raises(RequestError, match="top_p"):
        engine.submit("x", top_p=2.0)
    with pytest.raises(RequestError, match="unknown sampling parameter"):
        engine.submit("x", temprature=0.5)
    with pytest.raises(RequestError, match="max_tokens"):
        engine.submit("x", max_tokens=-5)
    with pytest.raises(RequestError, match="prompt must be"):
        engine.submit(3.5)


def test_truncation_when_asked(engine):
    out = engine.generate(list(range(1, 200)), max_tokens=3, temperature=0, truncate=True)
    assert out.prompt_tokens == engine.describe().n_ctx_slot // 2 and len(out.token_ids) == 3


def test_max_tokens_zero(engine):
    out = engine.generate("hi", max_tokens=0)
    assert out.token_ids == [] and out.finish_reason == "length"


def test_queue_bound_gives_server_busy(tiny_model):
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=256, max_queue=2) as e:
        readers = []
        with pytest.raises(ServerBusy, match="server busy"):
            for _ in range(50):
                readers.append(e.submit("x", max_tokens=-1, temperature=0))
        assert 2 <= len(readers) <= 4
        for r in readers:
            r.cancel()


def test_close_wakes_every_waiting_consumer(tiny_model):
    e = fastserve.Engine(tiny_model, n_parallel=2, n_ctx=2 * 16384, max_queue=16)   # long enough to be running
    readers = [e.submit("x", max_tokens=-1, temperature=0, **_no_eog(e)) for _ in range(6)]
    results = []
    threads = [threading.Thread(target=lambda r=r: results.append(r.result(timeout=10).finish_reason))
               for r in readers]
    for t in threads:
        t.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    e.close()
    for t in threads:
        t.join(10)
    assert time.monotonic() - t0 < 2
    assert sorted(results) == ["closed"] * 6
    with pytest.raises(EngineClosed):
        e.submit("x")


class _FailingFill(fastserve.Engine):
    """Fails the prompt fill of the next `fail` requests after they added their tokens."""
    fail = 0
    seen = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._slots = FailingFills(self._slots, self._on_fill)

    def _on_fill(self, slot):
        if self.fail > 0:
            self.fail -= 1
            self.seen = (self._batch.mark(), slot)
            raise MemoryError("injected: state copy failed")


def test_failed_fill_rolls_back_and_spares_the_others(tiny_model):
    with _FailingFill(tiny_model, n_parallel=2, n_ctx=512) as e:
        good_alone = e.generate("the good one", max_tokens=10, temperature=0, cache_prompt=False).token_ids
        bad_alone = e.generate("the bad one", max_tokens=10, temperature=0, cache_prompt=False).token_ids
        running = e.submit("the good one", max_tokens=10, temperature=0, cache_prompt=False)
        next(iter(running))                       # decoding: its token is in every batch from now
        marks = []
        real_rollback = e._batch.rollback

        e.fail = 1
        bad = e.submit("the bad one", max_tokens=10, temperature=0, id_slot=1, cache_prompt=False)
        res = bad.result(timeout=10)
        assert res.finish_reason == "error" and "injected" in res.error
        assert running.result(timeout=10).token_ids == good_alone
        # The batch was cut back to the mark taken before the failing slot added anything:
        # at the failure it held exactly the running slot's decode token plus the bad prompt.
        (n, n_out, owner), slot = e.seen
        assert slot == 1 and owner == 1
        # KV that was never written is not reused: the retry recomputes and matches a healthy run.
        assert e._slots.n_past[1] == 0
        again = e.generate("the bad one", max_tokens=10, temperature=0, id_slot=1)
        assert again.token_ids == bad_alone


class _ExplodingBackend:
    def __init__(self, inner):
        self.inner, self.boom = inner, False
        self.n_slots, self.n_ctx_slot, self.n_vocab = inner.n_slots, inner.n_ctx_slot, inner.n_vocab

    def forward(self, *args):
        if self.boom:
            self.boom = False
            raise RuntimeError("device lost")
        return self.inner.forward(*args)


def test_forward_failure_fails_only_that_batch(tiny_model):
    from fastserve.backends.cpu.backend import CpuBackend
    be = _ExplodingBackend(CpuBackend(tiny_model.config, tiny_model.weights, 2, 256))
    with fastserve.Engine(tiny_model, n_parallel=2, n_ctx=512, backend=be) as e:
        want = e.generate("after", max_tokens=5, temperature=0).token_ids
        be.boom = True
        res = e.generate("victim", max_tokens=5, temperature=0)
        assert res.finish_reason == "error" and "device lost" in res.error
        assert e.generate("after", max_tokens=5, temperature=0).token_ids == want


def test_admission_failure_fails_that_request_only(tiny_model, monkeypatch):
    """A request whose admission raises (here the backend's configure) ends with an error naming it; the
    slot is free again, the snapshot's slot_reuse_from is the backend's, the next request is served."""
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=512) as e:
        want = e.generate("after", max_tokens=5, temperature=0).token_ids
        real = e._backend.configure

        def configure(slot, sampling, prompt, **kw):
            if list(prompt) == e.tokenizer.encode("victim"):
                raise RuntimeError("no room for its sampler")
            return real(slot, sampling, prompt, **kw)

        monkeypatch.setattr(e._backend, "configure", configure)
        res = e.generate("victim", max_tokens=5, temperature=0)
        assert res.finish_reason == "error" and "admission failed: no room for its sampler" in res.error
        assert _slots_free(e)
        snap = e.snapshot
        assert snap.slot_reuse_from == (e._backend.kv_reuse_from(0, int(e._slots.n_tokens[0])),)
        assert e.generate("after", max_tokens=5, temperature=0).token_ids == want


def test_tracer_summary(tiny_model):
    with fastserve.Engine(tiny_model, n_parallel=2, n_ctx=256, trace=True) as e:
        e.generate("trace me", max_tokens=8, temperature=0)
        s = e.trace_summary()
    assert s["steps"] >= 8 and s["tokens_sent"] >= 8
    assert set(s["ms_per_step"]) == {"admit", "build", "forward", "sync", "sample", "publish"}
    assert 0 < s["host_share"] < 1
    counts, total_s = e.stats().step_histogram        # every traced step in one bucket, its time summed
    assert len(counts) == len(STEP_SECONDS_BUCKETS) + 1 and sum(counts) == s["steps"]
    assert 0 < total_s <= s["step_ms"] * s["steps"] / 1e3 * 1.001    # the phases also time idle admits
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=64) as e:
        with pytest.raises(RuntimeError, match="tracing is off"):
            e.trace_summary()


def test_erase_replies_once_it_is_done(tiny_model):
    """erase(slot, reply): the decode thread calls reply(n_erased) once the prefix is dropped (no polling)."""
    import queue
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=256) as e:
        done = e.generate("a prefix to drop", max_tokens=4, temperature=0)
        replies = queue.Queue()
        e.erase(0, replies.put)
        n = replies.get(timeout=5)
        assert 0 < n <= done.prompt_tokens + len(done.token_ids) and replies.empty()
        deadline = time.monotonic() + 5             # the snapshot of that step follows the reply
        while e.snapshot.slot_erased[0][0] < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert e.snapshot.slot_erased[0] == (1, n) and e.snapshot.slot_tokens[0] == 0


def test_slot_states_agree_with_the_slot_table():
    from fastserve import _slots
    from fastserve.request import SlotState
    assert (SlotState.IDLE, SlotState.PREFILL, SlotState.DECODE) == (_slots.IDLE, _slots.PREFILL, _slots.DECODE)


def test_describe_says_what_the_engine_is(tiny_model):
    with fastserve.Engine(tiny_model, n_parallel=2, n_ctx=512, n_batch=64, threads=1) as e:
        info = e.describe()
        deadline = time.monotonic() + 10
        while not e.describe().kv_resident and time.monotonic() < deadline:    # it comes in on its own thread
            time.sleep(0.01)
        assert e.describe().kv_resident
    assert (info.n_slots, info.n_ctx_slot, info.n_batch, info.threads, info.n_vocab) == (
        2, 256, 64, 1, tiny_model.config.n_vocab)
    assert (info.device, info.samples_on_device, info.cache_type_k, info.cache_type_v) == ("cpu", False, "f16", "f16")
    assert (info.window, info.ring) == (tiny_model.config.sliding_window, 0) and info.kv_bytes > 0
    assert info.model_path == str(tiny_model.path) and info.model_summary == tiny_model.load_summary()


def test_describe_names_the_kernels_isa(tiny_model, monkeypatch):
    """The CPU kernels' instruction set is chosen at run time (FASTSERVE_ISA overrides it) and described."""
    from fastserve.backends.cpu import _matmul
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=64, threads=1) as e:
        assert e.describe().isa == _matmul.best_isa() and e.describe().isa in _matmul.isas()
    monkeypatch.setenv("FASTSERVE_ISA", "scalar")
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=64, threads=1) as e:
        assert e.describe().isa == "scalar"


def test_the_caller_and_the_decode_thread_share_a_requests_buffer_only(engine):
    """What submit() hands back (the text layer and its Reader) holds no Request; where the request ran
    comes to the reader in its buffer."""
    from fastserve.request import Request
    text = engine.submit("hello", max_tokens=3, temperature=0)
    held = [text, text.reader, *gc.get_referents(text), *gc.get_referents(text.reader)]
    assert not any(isinstance(o, Request) for o in held)
    done = text.result(timeout=10)
    assert text.reader.slot == done.id_slot >= 0 and text.reader.n_cached == done.timings["cache_n"]


def test_trace_summary_of_a_window(tiny_model):
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=256, trace=True) as e:
        e.generate("the first", max_tokens=8, temperature=0)
        since = e.trace_totals()
        e.generate("the second", max_tokens=4, temperature=0)
        window, whole = e.trace_summary(since), e.trace_summary()
    assert 4 <= window["steps"] < whole["steps"] and window["tokens_sent"] == 4
    assert set(window["ms_per_step"]) == set(whole["ms_per_step"]) and window["step_ms"] > 0
