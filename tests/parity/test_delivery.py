"""Delivery and ResultBuffer: the compiled module and its pure-Python twin, side by side.

The compiled extension is imported at module level on purpose: a missing or
broken build fails this suite, it never skips it.
"""
import gc
import sys
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastserve._delivery as cdelivery
import fastserve.ref.delivery as rdelivery

from tests.attached import attached

IMPLS = [pytest.param(cdelivery, id="cython"), pytest.param(rdelivery, id="ref")]


def i32(*xs):
    return np.array(xs, dtype=np.int32)


class Calls:
    """A waker that records what it was handed."""

    def __init__(self):
        self.calls = []

    def __call__(self, bufs):
        self.calls.append(list(bufs))


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param


def test_same_public_names():
    names = {n for n in dir(cdelivery) if not n.startswith("_") and n not in ("np",)}
    assert names <= set(dir(rdelivery)), names - set(dir(rdelivery))
    for cls in ("ResultBuffer", "Delivery"):
        c_api = {n for n in dir(getattr(cdelivery, cls)) if not n.startswith("_")}
        r_api = {n for n in dir(getattr(rdelivery, cls)) if not n.startswith("_")}
        assert c_api == r_api, (cls, c_api ^ r_api)
    assert cdelivery.FINISH_REASONS == rdelivery.FINISH_REASONS


def test_fifo_per_reader(impl):
    bufs = [impl.ResultBuffer(64) for _ in range(4)]
    w = Calls()
    dl = attached(impl, bufs, w)
    expect = [[] for _ in range(4)]
    rng = np.random.default_rng(0)
    for step in range(40):
        slots = rng.permutation(4)[: rng.integers(1, 5)].astype(np.int32)
        if step % 7 == 0:                      # several tokens for one slot in one step
            slots = np.concatenate([slots, slots[:1]]).astype(np.int32)
        toks = rng.integers(0, 50_000, len(slots)).astype(np.int32)
        dl.send_step(slots, toks)
        for s, t in zip(slots.tolist(), toks.tolist()):
            if len(expect[s]) < 64:
                expect[s].append(t)
        if step % 3 == 0:
            got = bufs[step % 4].take()
            assert got == expect[step % 4][len(expect[step % 4]) - len(got):]
    for s, b in enumerate(bufs):
        assert b.all_tokens() == expect[s]
        assert b.count == len(expect[s])
        rest = b.take()
        assert b.read_pos == b.count and b.available == 0 and b.take() == []
        assert expect[s][len(expect[s]) - len(rest):] == rest
    assert dl.tokens_sent == sum(map(len, expect))
    assert w.calls == [] and dl.wake() == 0        # nobody waited: no wake at all


def test_probs_only_when_asked(impl):
    dl = impl.Delivery(3, Calls())
    plain, top3, top6 = impl.ResultBuffer(8), impl.ResultBuffer(8, 3), impl.ResultBuffer(8, 6)
    for s, b in enumerate((plain, top3, top6)):
        dl.attach(s, b)
    ids = np.arange(15, dtype=np.int32).reshape(3, 5)
    probs = (np.arange(15, dtype=np.float32) / 100).reshape(3, 5)
    dl.send_step(i32(0, 1, 2), i32(7, 8, 9), ids, probs)
    dl.send_step(i32(1, 2), i32(10, 11))               # a step without probabilities
    assert plain.take_probs()[0] == [7]
    assert plain.n_probs == 0 and plain.all_probs()[0].shape == (1, 0)
    toks, tid, tp = top3.take_probs()
    assert toks == [8, 10]
    np.testing.assert_array_equal(tid, [[5, 6, 7], [-1, -1, -1]])
    np.testing.assert_array_equal(tp, np.array([[0.05, 0.06, 0.07], [0, 0, 0]], np.float32))
    assert tid.dtype == np.int32 and tp.dtype == np.float32
    toks, tid, tp = top6.take_probs()
    np.testing.assert_array_equal(tid, [[10, 11, 12, 13, 14, -1], [-1] * 6])
    np.testing.assert_array_equal(top6.all_probs()[1][0, :5], probs[2])
    assert top6.take_probs()[1].shape == (0, 6)


def test_wake_at_most_once_per_step_and_only_for_waiters(impl):
    bufs = [impl.ResultBuffer(100) for _ in range(32)]
    w = Calls()
    dl = attached(impl, bufs, w)
    slots = np.arange(32, dtype=np.int32)
    armed = bufs[::4]
    for b in armed:
        assert b.arm() is True
    bufs[1].arm(finish_only=True)
    dl.send_step(slots, slots)
    assert w.calls == []                                # the waker runs in wake(), not per token
    assert dl.wake() == len(armed)
    assert len(w.calls) == 1 and w.calls[0] == armed    # one call, exactly the waiting readers
    assert all(b.waiting == 0 for b in armed) and bufs[1].waiting == 2
    for _ in range(5):                                  # nobody waiting: no wake
        dl.send_step(slots, slots)
        assert dl.wake() == 0
    assert len(w.calls) == 1
    dl.finish(1, impl.FINISH_STOP)                      # finish-only waiter: woken by the finish
    dl.detach(1)
    assert dl.wake() == 1 and w.calls[1] == [bufs[1]] and dl.wakes == 2


def test_arm_withdraws_when_something_is_there(impl):
    dl = impl.Delivery(1, Calls())
    b = impl.ResultBuffer(4)
    dl.attach(0, b)
    dl.send_step(i32(0), i32(1))
    assert b.arm() is False and b.waiting == 0            # data there: do not park
    assert b.arm(finish_only=True) is True                # waiting for the end only
    b.disarm()
    b.take()
    assert b.arm() is True
    b.disarm()
    dl.finish(0, impl.FINISH_LENGTH)
    assert b.arm() is False and b.arm(finish_only=True) is False


def test_detach_before_wake_still_wakes(impl):
    w = Calls()
    dl = impl.Delivery(2, w)
    b = impl.ResultBuffer(4)
    dl.attach(1, b)
    b.arm()
    dl.send_step(i32(1), i32(5))
    dl.finish(1, impl.FINISH_STOP)
    assert dl.detach(1) is b and dl.detach(1) is None
    dl.attach(1, impl.ResultBuffer(4))                  # the slot is reused at once
    assert dl.wake() == 1 and w.calls == [[b]]
    assert b.take() == [5] and b.finish_code == impl.FINISH_STOP


def test_finish_is_final(impl):
    dl = impl.Delivery(2, Calls())
    b = impl.ResultBuffer(4)
    dl.attach(0, b)
    assert not b.finished and b.finish_code == 0 and b.error is None
    dl.send_step(i32(0), i32(3))
    dl.finish(0, impl.FINISH_ERROR, "prompt fill failed")
    dl.finish(0, impl.FINISH_STOP)                       # first finish wins
    dl.send_step(i32(0), i32(4))                         # ignored after the finish
    assert b.finished and b.finish_code == impl.FINISH_ERROR and b.error == "prompt fill failed"
    assert b.all_tokens() == [3]
    with pytest.raises(ValueError):
        dl.finish(0, 0)
    with pytest.raises(ValueError):
        dl.finish(1, impl.FINISH_STOP)                   # nothing attached there
    with pytest.raises(TypeError):
        dl.finish(0, impl.FINISH_ERROR, 42)


def test_overflow_fails_the_request_not_the_step(impl):
    w = Calls()
    dl = impl.Delivery(2, w)
    small, other = impl.ResultBuffer(2), impl.ResultBuffer(8)
    dl.attach(0, small)
    dl.attach(1, other)
    small.arm(finish_only=True)
    for t in range(3):
        dl.send_step(i32(0, 1), i32(t, t))
    assert small.all_tokens() == [0, 1] and other.all_tokens() == [0, 1, 2]
    assert small.finish_code == impl.FINISH_ERROR and "full" in small.error
    assert dl.wake() == 1 and w.calls == [[small]]


def test_close_finishes_and_wakes_everyone(impl):
    w = Calls()
    dl = impl.Delivery(4, w)
    bufs = [impl.ResultBuffer(4) for _ in range(3)]
    for s, b in enumerate(bufs):
        dl.attach(s, b)
    bufs[0].arm()
    bufs[1].arm(finish_only=True)
    dl.finish(2, impl.FINISH_STOP)
    assert dl.close() == 2 and len(w.calls) == 1
    assert {id(b) for b in w.calls[0]} == {id(bufs[0]), id(bufs[1])}
    assert [b.finish_code for b in bufs] == [impl.FINISH_CLOSED] * 2 + [impl.FINISH_STOP]
    assert dl.attached() == [] and dl.closed
    late = impl.ResultBuffer(4)
    late.arm()
    dl.attach(0, late)                                   # after close: finished at once, and woken
    assert late.finish_code == impl.FINISH_CLOSED and dl.attached() == [] and w.calls[-1] == [late]


def test_reject_an_unattached_reader(impl):
    w = Calls()
    dl = impl.Delivery(1, w)
    b = impl.ResultBuffer(4)
    b.arm(finish_only=True)
    dl.reject(b, impl.FINISH_ERROR, "prompt longer than the context")
    assert b.error == "prompt longer than the context" and b.count == 0
    assert dl.wake() == 1 and w.calls == [[b]]


def test_attach_tells_the_buffer_where_its_request_runs(impl):
    """The buffer is all the two sides share of a request: its slot and prompt tokens reused come in it too."""
    dl = impl.Delivery(3, Calls())
    b, refused = impl.ResultBuffer(4), impl.ResultBuffer(4)
    assert (b.slot, b.n_cached) == (-1, 0)
    dl.attach(2, b, 5)
    dl.reject(refused, impl.FINISH_LENGTH)
    assert (b.slot, b.n_cached) == (2, 5) and (refused.slot, refused.n_cached) == (-1, 0)


def test_bad_arguments(impl):
    dl = impl.Delivery(2, Calls())
    with pytest.raises(ValueError):
        impl.Delivery(0, Calls())
    with pytest.raises(TypeError):
        impl.Delivery(2, None)
    with pytest.raises(ValueError):
        impl.ResultBuffer(0)
    with pytest.raises(ValueError):
        impl.ResultBuffer(4, -1)
    with pytest.raises(IndexError):
        dl.attach(2, impl.ResultBuffer(4))
    with pytest.raises(IndexError):
        dl.send_step(i32(5), i32(1))
    with pytest.raises(IndexError):
        dl.send_step(i32(-1), i32(1))
    with pytest.raises(ValueError):
        dl.send_step(i32(0, 1), i32(1))
    with pytest.raises(ValueError):
        dl.send_step(np.array([0], np.int64), i32(1))
    with pytest.raises(ValueError):
        dl.send_step(i32(0), i32(1), np.zeros((1, 2), np.int32), None)
    with pytest.raises(ValueError):
        dl.send_step(i32(0), i32(1), np.zeros((1, 2), np.int32), np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError):
        dl.send_step(i32(0), i32(1), np.zeros((1, 2), np.int32), np.zeros((1, 2), np.float64))
    dl.attach(0, impl.ResultBuffer(4))
    with pytest.raises(ValueError):
        dl.attach(0, impl.ResultBuffer(4))
    other = cdelivery if impl is rdelivery else rdelivery
    with pytest.raises(TypeError):
        dl.attach(1, other.ResultBuffer(4))              # the two implementations do not mix


def test_buffer_dies_with_detach_and_drop(impl):
    woken = []
    dl = impl.Delivery(2, lambda bufs: woken.append(len(bufs)))
    b = impl.ResultBuffer(1024, 5)
    ref = weakref.ref(b)
    dl.attach(0, b)
    b.arm()
    dl.send_step(i32(0), i32(1), np.zeros((1, 5), np.int32), np.zeros((1, 5), np.float32))
    del b
    assert ref() is not None                              # attached: the producer holds it
    dl.finish(0, impl.FINISH_STOP)
    dl.detach(0)
    assert dl.wake() == 1 and woken == [1]
    assert ref() is None                                  # refcounting alone: no gc, no registry


def _lines_run(code, call) -> int:
    """call(), and how many lines of `code`'s file it ran (sys.settrace: the twin's work, counted)."""
    count = [0]

    def trace(frame, event, arg):
        if frame.f_code.co_filename != code.__file__:
            return None
        if event == "line":
            count[0] += 1
        return trace

    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
    return count[0]


def test_never_reading_reader_does_not_slow_sends(impl):
    """A consumer that never reads only fills its own buffer (the invariant at the top of
    _delivery.pyx): it is woken once, for the wait it armed, and never again, while the readers that
    keep up are woken every step; its tokens still arrive. In the twin, the work of a step (lines run)
    does not grow with the reader's backlog. That is a count, not a clock: the timing is
    bench/bench_delivery.py's test_send_step_with_readers_that_never_read (the compiled module runs
    the twin's algorithm, which a trace cannot see into)."""
    n_slots, steps = 4, 50
    slots = np.arange(n_slots, dtype=np.int32)
    bufs = [impl.ResultBuffer(steps) for _ in range(n_slots)]
    w = Calls()
    dl = attached(impl, bufs, w)
    for b in bufs:
        b.arm()                                          # bufs[0] waits once and never reads

    def step():
        dl.send_step(slots, slots)
        dl.wake()

    lines = []
    for _ in range(steps):
        lines.append(_lines_run(impl, step))
        for b in bufs[1:]:                               # the others keep up
            b.take()
            b.arm()
    woken = [[bufs.index(b) for b in call] for call in w.calls]
    assert woken == [[0, 1, 2, 3]] + [[1, 2, 3]] * (steps - 1)
    assert bufs[0].count == steps and bufs[0].read_pos == 0
    if impl is rdelivery:
        assert lines[0] > 0 and len(set(lines[1:])) == 1, lines     # step 1 also claims bufs[0]


@pytest.mark.parametrize("with_probs", [False, True])
def test_send_step_allocates_nothing_per_token(with_probs):
    """Contract 9, compiled path only (the twin is a reference, not a hot path):
    the memory a step touches on the heap does not grow with the tokens sent."""
    import tracemalloc

    def peak(n):
        dl = cdelivery.Delivery(n, lambda bufs: None)
        bufs = [cdelivery.ResultBuffer(64, 5) for _ in range(n)]
        for s, b in enumerate(bufs):
            dl.attach(s, b)
        slots = np.arange(n, dtype=np.int32)
        ids = np.zeros((n, 5), np.int32) if with_probs else None
        probs = np.zeros((n, 5), np.float32) if with_probs else None
        dl.send_step(slots, slots, ids, probs)
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            for _ in range(10):
                bufs[0].arm()
                dl.send_step(slots, slots, ids, probs)
                dl.wake()
            current, top = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return current - base, top - base

    small, large = peak(1), peak(4096)
    assert large[0] <= 0 and small[0] <= 0
    assert large[1] <= small[1] + 64, (small, large)


def test_detach_and_reattach_between_claim_and_wake(impl):
    """A slot claimed, detached, re-attached and claimed again in one step: each
    claimed buffer is woken exactly once (the detached ones first)."""
    w = Calls()
    dl = impl.Delivery(2, w)
    bufs = [impl.ResultBuffer(4) for _ in range(50)]
    other = impl.ResultBuffer(4)
    dl.attach(1, other)
    other.arm()
    for b in bufs:
        dl.attach(0, b)
        b.arm()
        dl.send_step(i32(0, 1), i32(1, 2))
        dl.detach(0)
    assert dl.wake() == 51 and len(w.calls) == 1
    assert [id(b) for b in w.calls[0]] == [id(b) for b in bufs] + [id(other)]


# -- parity: random operation sequences give the same observable trace on both -------

OPS = st.lists(st.tuples(st.sampled_from(["attach", "detach", "send", "probs", "finish", "arm", "arm_fin",
                                          "take", "disarm", "wake", "reject", "close"]),
                         st.integers(0, 5), st.integers(0, 3)), max_size=60)


def _trace(impl, ops):
    out = []
    buf_ids = {}
    w = Calls()
    dl = impl.Delivery(4, w)
    bufs = [impl.ResultBuffer(6, n % 3) for n in range(6)]
    for i, b in enumerate(bufs):
        buf_ids[id(b)] = i
    for op, a, b in ops:
        buf = bufs[a]
        try:
            if op == "attach":
                dl.attach(b, buf)
            elif op == "detach":
                r = dl.detach(b)
                out.append(None if r is None else buf_ids[id(r)])
            elif op in ("send", "probs"):
                slots = np.array(sorted({b, (a + b) % 4, a % 4}), np.int32)
                toks = (slots * 7 + a).astype(np.int32)
                if op == "probs":
                    ids = np.arange(len(slots) * 2, dtype=np.int32).reshape(-1, 2)
                    dl.send_step(slots, toks, ids, ids.astype(np.float32) / 10)
                else:
                    dl.send_step(slots, toks)
            elif op == "finish":
                dl.finish(b, 1 + a, None if a % 2 else f"err{a}")
            elif op == "arm":
                out.append(buf.arm())
            elif op == "arm_fin":
                out.append(buf.arm(True))
            elif op == "take":
                if buf.n_probs:
                    toks, ids, probs = buf.take_probs()
                    out.append((toks, ids.tolist(), probs.tolist()))
                else:
                    out.append(buf.take())
            elif op == "disarm":
                buf.disarm()
            elif op == "wake":
                out.append(dl.wake())
            elif op == "reject":
                dl.reject(buf, 4, "rejected")
            elif op == "close":
                out.append(dl.close())
        except (ValueError, IndexError) as exc:
            out.append(type(exc).__name__)
    out.append([[buf_ids[id(x)] for x in call] for call in w.calls])
    out.append(dl.attached())
    out.append(dl.tokens_sent)
    out.append(dl.wakes)
    for buf in bufs:
        ids, probs = buf.all_probs()
        out.append((buf.all_tokens(), ids.tolist(), probs.tolist(), buf.read_pos, buf.finish_code,
                    buf.error, buf.waiting, buf.ready, buf.available))
    return out


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_parity_random_sequences(ops):
    assert _trace(cdelivery, ops) == _trace(rdelivery, ops)


def test_no_leak_when_buffers_die_attached_to_a_dropped_delivery(impl):
    bufs = [impl.ResultBuffer(16) for _ in range(4)]
    refs = [weakref.ref(b) for b in bufs]
    dl = impl.Delivery(4, Calls())
    for s, b in enumerate(bufs):
        dl.attach(s, b)
    del bufs, b, dl
    gc.collect()
    assert all(r() is None for r in refs)
