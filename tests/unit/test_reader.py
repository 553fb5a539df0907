"""Reader and Waker: blocking and async consumers of Delivery, on both implementations.

fastserve._delivery is imported at module level: a missing extension fails here.
"""
import asyncio
import gc
import os
import queue
import random
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest

import fastserve._delivery as cdelivery
import fastserve.ref.delivery as rdelivery
from fastserve.reader import Reader, Result, Waker

from tests.attached import attached

try:
    import uvloop
except ImportError:  # pragma: no cover - depends on the environment
    uvloop = None

IMPLS = [pytest.param(cdelivery, id="cython"), pytest.param(rdelivery, id="ref")]
LOOPS = [
    pytest.param("asyncio", id="asyncio"),
    pytest.param("uvloop", id="uvloop",
                 marks=pytest.mark.skipif(uvloop is None, reason="uvloop is not installed (pip install uvloop)")),
]


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param


def run_loop(kind, coro):
    if kind == "uvloop":
        return uvloop.run(coro)
    return asyncio.run(coro)


def token(slot, step):
    return slot * 1000 + step


class Producer(threading.Thread):
    """A stand-in decode thread: `steps` steps over `slots`, then finish + detach each."""

    def __init__(self, dl, slots, steps, pause=0.0, probs=0):
        super().__init__(daemon=True)
        self.dl, self.slots, self.steps, self.pause, self.probs = dl, np.asarray(slots, np.int32), steps, pause, probs
        self.steps_done = 0

    def run(self):
        ids = probs = None
        if self.probs:
            ids = np.tile(np.arange(self.probs, dtype=np.int32), (len(self.slots), 1))
            probs = np.full((len(self.slots), self.probs), 0.5, np.float32)
        for step in range(self.steps):
            self.dl.send_step(self.slots, (self.slots * 1000 + step).astype(np.int32), ids, probs)
            self.dl.wake()
            self.steps_done += 1
            if self.pause:
                time.sleep(self.pause)
        for s in self.slots.tolist():
            self.dl.finish(s, cdelivery.FINISH_STOP)
            self.dl.detach(s)
        self.dl.wake()
        self.steps_done += 1


def test_import_does_not_pull_asyncio():
    code = ("import sys, fastserve.reader, fastserve._delivery, fastserve.ref.delivery; "
            "bad = [m for m in ('asyncio', 'uvloop', 'h11') if m in sys.modules]; "
            "assert not bad, bad")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_blocking_iteration_fifo_and_result(impl):
    w = Waker()
    dl = impl.Delivery(2, w)
    r = Reader(64, impl=impl)
    dl.attach(1, r)
    p = Producer(dl, [1], 30, pause=0.0005)
    p.start()
    got = list(r)
    p.join()
    assert got == [token(1, s) for s in range(30)]
    res = r.result(timeout=1)
    assert isinstance(res, Result) and res.tokens == got and res.finish_reason == "stop" and res.error is None
    assert res.top_ids is None
    assert r.finished and r.finish_reason == "stop" and r.read_available() == []
    assert w.calls <= p.steps_done


def test_1000_thread_readers_get_exactly_their_tokens(impl):
    n, steps = 1000, 20
    readers = [Reader(steps, impl=impl) for _ in range(n)]
    w = Waker()
    dl = attached(impl, readers, w)
    got = [None] * n

    def consume(s):
        got[s] = [t for batch in readers[s].batches(timeout=30) for t in batch]

    old = threading.stack_size(256 * 1024)
    try:
        threads = [threading.Thread(target=consume, args=(s,), daemon=True) for s in range(n)]
        for t in threads:
            t.start()
    finally:
        threading.stack_size(old)
    p = Producer(dl, range(n), steps, pause=0.002)
    p.start()
    p.join(60)
    for t in threads:
        t.join(60)
    assert not p.is_alive() and not any(t.is_alive() for t in threads)
    for s in range(n):
        assert got[s] == [token(s, k) for k in range(steps)], s
        assert readers[s].finish_reason == "stop"
    assert 1 <= w.calls <= p.steps_done                  # at most one wake per step
    assert dl.wakes == w.calls


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_1000_async_readers_get_exactly_their_tokens(impl, loop_kind):
    n, steps = 1000, 20
    readers = [Reader(steps, n_probs=2 if s % 10 == 0 else 0, impl=impl) for s in range(n)]
    w = Waker()
    dl = attached(impl, readers, w)

    async def consume(s):
        return [t async for t in readers[s]]

    async def main():
        tasks = [asyncio.create_task(consume(s)) for s in range(n)]
        await asyncio.sleep(0)
        p = Producer(dl, range(n), steps, pause=0.002, probs=2)
        p.start()
        out = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        p.join()
        return out, p.steps_done

    got, steps_done = run_loop(loop_kind, main())
    for s in range(n):
        assert got[s] == [token(s, k) for k in range(steps)], s
    res = readers[0].result(timeout=1)
    assert res.top_ids.shape == (steps, 2) and res.top_probs.dtype == np.float32
    assert readers[1].result().top_ids is None
    assert 1 <= w.calls <= steps_done
    assert w.loop_calls <= w.calls                        # one loop: one call_soon_threadsafe per wake


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_async_iteration_batches_probs_and_aresult(impl, loop_kind):
    w = Waker()
    dl = impl.Delivery(3, w)
    a, b = Reader(32, n_probs=3, impl=impl), Reader(32, impl=impl)
    dl.attach(0, a)
    dl.attach(2, b)

    async def main():
        p = Producer(dl, [0, 2], 10, pause=0.001, probs=3)
        waiter = asyncio.create_task(a.aresult())           # finish-only waiter
        p.start()
        batches = [x async for x in b.abatches()]
        res = await asyncio.wait_for(waiter, 10)
        p.join()
        return batches, res

    batches, res = run_loop(loop_kind, main())
    assert [t for x in batches for t in x] == [token(2, k) for k in range(10)]
    assert res.tokens == [token(0, k) for k in range(10)] and res.finish_reason == "stop"
    np.testing.assert_array_equal(res.top_ids, np.tile(np.arange(3, dtype=np.int32), (10, 1)))
    toks, ids, probs = a.read_available_probs()
    assert toks == res.tokens and ids.shape == (10, 3)


def test_wake_count_per_step_with_mixed_consumers(impl):
    """Threads and tasks on two loops, all waiting: one waker call per step,
    and at most one call_soon_threadsafe per loop per step."""
    n, steps = 60, 40
    readers = [Reader(steps, impl=impl) for _ in range(n)]
    w = Waker()
    dl = attached(impl, readers, w)
    got = {}

    def thread_consumer(s):
        got[s] = list(readers[s].tokens(timeout=30))

    def loop_consumer(slots):
        async def main():
            async def one(s):
                got[s] = [t async for t in readers[s]]
            await asyncio.gather(*(one(s) for s in slots))
        asyncio.run(main())

    threads = [threading.Thread(target=thread_consumer, args=(s,)) for s in range(20)]
    threads += [threading.Thread(target=loop_consumer, args=(range(20, 40),)),
                threading.Thread(target=loop_consumer, args=(range(40, 60),))]
    for t in threads:
        t.start()
    time.sleep(0.2)
    p = Producer(dl, range(n), steps, pause=0.003)
    p.start()
    p.join(30)
    for t in threads:
        t.join(30)
    assert all(got[s] == [token(s, k) for k in range(steps)] for s in range(n))
    assert w.calls <= p.steps_done and dl.wakes == w.calls
    assert w.loop_calls <= 2 * w.calls


@pytest.mark.parametrize("consumer", ["thread", "asyncio"])
def test_ping_pong_never_loses_a_wake(impl, consumer):
    """One token per step, and the next step only once it was read: a lost wake-up
    would stall both sides (caught by the timeouts)."""
    rounds = 10000 if impl is cdelivery else 1000
    w = Waker()
    dl = impl.Delivery(1, w)
    r = Reader(rounds, impl=impl)
    dl.attach(0, r)
    buf = r.buffer
    failed = []

    def producer():
        slot = np.zeros(1, np.int32)
        for k in range(rounds):
            dl.send_step(slot, np.array([k], np.int32))
            dl.wake()
            deadline = time.monotonic() + 10
            while buf.read_pos <= k:
                if time.monotonic() > deadline:
                    failed.append(k)
                    dl.close()
                    return
                time.sleep(0)
        dl.finish(0, cdelivery.FINISH_STOP)
        dl.detach(0)
        dl.wake()

    p = threading.Thread(target=producer)
    p.start()
    if consumer == "thread":
        got = list(r.tokens(timeout=20))
    else:
        async def main():
            return [t async for t in r]
        got = asyncio.run(asyncio.wait_for(main(), 60))
    p.join()
    assert not failed and got == list(range(rounds))
    assert w.calls <= rounds + 1


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_close_wakes_every_waiting_consumer(impl, loop_kind):
    n_threads, n_tasks = 40, 40
    n = n_threads * 2 + n_tasks
    readers = [Reader(16, impl=impl) for _ in range(n)]
    w = Waker()
    dl = attached(impl, readers, w)
    done = []

    def iterate(r):
        list(r.tokens(timeout=20))
        done.append(time.monotonic())

    def result(r):
        r.result(timeout=20)
        done.append(time.monotonic())

    threads = [threading.Thread(target=iterate, args=(readers[s],)) for s in range(n_threads)]
    threads += [threading.Thread(target=result, args=(readers[s],)) for s in range(n_threads, 2 * n_threads)]
    for t in threads:
        t.start()

    async def main():
        async def one(r, k):
            if k % 2:
                await r.aresult()
            else:
                async for _ in r:
                    pass
            done.append(time.monotonic())
        tasks = [asyncio.create_task(one(readers[s], s)) for s in range(2 * n_threads, n)]
        await asyncio.sleep(0.3)
        assert all(r.buffer.waiting for r in readers)          # everybody is parked
        closer = threading.Timer(0.0, dl.close)
        t_close = time.monotonic()
        closer.start()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return t_close

    t_close = run_loop(loop_kind, main())
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
    assert len(done) == n and max(done) - t_close < 2.0
    assert all(r.finish_reason == "closed" for r in readers)
    assert w.calls == 1 and w.woken == n and w.loop_calls == 1
    assert dl.attached() == []


def test_cancel_and_drop_call_on_cancel_once(impl):
    calls = []
    r = Reader(8, on_cancel=lambda: calls.append("x"), impl=impl)
    assert not r.cancelled
    r.cancel()
    r.cancel()
    assert calls == ["x"] and r.cancelled
    del r
    assert calls == ["x"]

    Reader(8, on_cancel=lambda: calls.append("dropped"), impl=impl)   # dropped unfinished: cancels
    assert calls == ["x", "dropped"]

    dl = impl.Delivery(1, Waker())
    r = Reader(8, on_cancel=lambda: calls.append("late"), impl=impl)
    dl.attach(0, r)
    dl.finish(0, cdelivery.FINISH_LENGTH)
    r.cancel()                                              # finished: nothing to cancel
    del r
    assert calls == ["x", "dropped"]


def test_cancel_routes_through_an_inbox_and_finishes(impl):
    inbox = queue.SimpleQueue()
    dl = impl.Delivery(1, Waker())
    r = Reader(100, on_cancel=lambda: inbox.put(("cancel", 0)), impl=impl)
    dl.attach(0, r)
    stop = threading.Event()

    def engine():
        step = 0
        while not stop.is_set():
            while not inbox.empty():
                _, slot = inbox.get()
                if dl.buffer(slot) is not None:
                    dl.finish(slot, cdelivery.FINISH_CANCELLED)
                    dl.detach(slot)
            dl.send_step(np.zeros(1, np.int32), np.array([step], np.int32))
            dl.wake()
            step += 1
            time.sleep(0.001)

    t = threading.Thread(target=engine)
    t.start()
    try:
        seen = []
        for tok in r:
            seen.append(tok)
            if len(seen) == 5:
                r.cancel()
        assert r.finish_reason == "cancelled" and seen[:5] == [0, 1, 2, 3, 4]
        assert r.result(timeout=1).tokens == seen
    finally:
        stop.set()
        t.join()


def test_timeouts(impl):
    dl = impl.Delivery(1, Waker())
    r = Reader(8, impl=impl)
    dl.attach(0, r)
    t0 = time.monotonic()
    assert r.wait(timeout=0.05) is False
    with pytest.raises(TimeoutError):
        r.result(timeout=0.05)
    with pytest.raises(TimeoutError):
        next(r.tokens(timeout=0.05))
    assert time.monotonic() - t0 < 2
    assert r.buffer.waiting == 0 and r.buffer.waiter is None
    dl.send_step(np.zeros(1, np.int32), np.array([9], np.int32))
    assert r.wait(timeout=0) is True and r.read_available() == [9]


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_cancelled_task_withdraws_its_wait(impl, loop_kind):
    w = Waker()
    dl = impl.Delivery(1, w)
    r = Reader(8, impl=impl)
    dl.attach(0, r)

    async def main():
        task = asyncio.create_task(r.wait_async())
        await asyncio.sleep(0.01)
        assert r.buffer.waiting == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run_loop(loop_kind, main())
    assert r.buffer.waiting == 0 and r.buffer.waiter is None
    dl.send_step(np.zeros(1, np.int32), np.array([1], np.int32))
    assert dl.wake() == 0 and w.calls == 0                 # nobody waits any more: no wake


def test_waker_tolerates_a_closed_loop_and_a_released_lock(impl):
    loop = asyncio.new_event_loop()
    buf = impl.ResultBuffer(4)
    buf.waiter = loop.create_future()
    loop.close()
    lock_buf = impl.ResultBuffer(4)
    lock_buf.waiter = threading.Lock()                      # not held: release() would raise
    w = Waker()
    w([buf, lock_buf, impl.ResultBuffer(4)])
    assert w.calls == 1 and w.loop_calls == 1


def test_churn_loses_nothing_and_leaks_nothing(impl):
    """Requests come and go (some readers dropped mid-stream) while the producer publishes."""
    n_slots, n_requests = 32, 600
    rng = random.Random(7)
    lengths = [rng.randint(1, 40) for _ in range(n_requests)]
    abandon = {i for i in range(n_requests) if rng.random() < 0.25}
    inbox = queue.SimpleQueue()
    w = Waker()
    dl = impl.Delivery(n_slots, w)
    refs = []
    stop = threading.Event()
    steps = [0]

    def engine():
        free = list(range(n_slots))
        active = {}                                         # slot -> [request id, produced]
        by_id = {}
        waiting = []
        while not (stop.is_set() and not active and inbox.empty() and not waiting):
            while not inbox.empty():
                kind, x = inbox.get()
                if kind == "admit":
                    waiting.append(x)
                elif x in by_id:                            # cancel
                    slot = by_id.pop(x)
                    del active[slot]
                    dl.finish(slot, cdelivery.FINISH_CANCELLED)
                    dl.detach(slot)
                    free.append(slot)
            while waiting and free:
                rid, reader = waiting.pop(0)
                slot = free.pop()
                dl.attach(slot, reader)
                del reader                                  # keep the buffer only (in dl)
                active[slot] = [rid, 0]
                by_id[rid] = slot
            if active:
                slots = np.array(sorted(active), np.int32)
                toks = np.array([active[s][0] * 1000 + active[s][1] for s in slots.tolist()], np.int32)
                dl.send_step(slots, toks)
                for s in slots.tolist():
                    active[s][1] += 1
                    rid, made = active[s]
                    if made == lengths[rid]:
                        dl.finish(s, cdelivery.FINISH_STOP)
                        dl.detach(s)
                        del active[s], by_id[rid]
                        free.append(s)
            dl.wake()
            steps[0] += 1
            time.sleep(0.0002)

    async def client(rid):
        r = Reader(64, on_cancel=lambda: inbox.put(("cancel", rid)), impl=impl)
        refs.append(weakref.ref(r.buffer))
        inbox.put(("admit", (rid, r)))
        got = []
        async for tok in r:
            got.append(tok)
            if rid in abandon and len(got) >= lengths[rid] // 2:
                break
        if rid in abandon:
            del r                                           # dropped: __del__ cancels through the inbox
            return None
        assert r.finish_reason == "stop"
        return got

    async def main():
        sem = asyncio.Semaphore(48)

        async def limited(rid):
            async with sem:
                return await client(rid)
        return await asyncio.wait_for(asyncio.gather(*(limited(i) for i in range(n_requests))), 60)

    t = threading.Thread(target=engine)
    t.start()
    try:
        results = asyncio.run(main())
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive()
    for rid, got in enumerate(results):
        if rid not in abandon:
            assert got == [rid * 1000 + k for k in range(lengths[rid])], rid
    assert dl.attached() == []
    del results
    gc.collect()
    assert sum(r() is not None for r in refs) == 0          # every buffer is gone
    assert w.calls <= steps[0]


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="RSS is read from /proc (Linux)")
def test_200k_abandoned_readers_do_not_grow_rss(impl):
    """Each lifecycle: created, attached, sent tokens (some with probs), maybe parked
    on, finished and detached, then dropped with everything still unread."""
    n_slots = 50
    slots = np.arange(n_slots, dtype=np.int32)
    ids = np.tile(np.arange(4, dtype=np.int32), (n_slots, 1))
    probs = np.full((n_slots, 4), 0.25, np.float32)
    dl = impl.Delivery(n_slots, Waker())
    sink = []

    def lifecycles(n):
        for _ in range(n // n_slots):
            readers = [Reader(256, n_probs=4 if s % 8 == 0 else 0, on_cancel=sink.clear, impl=impl)
                       for s in range(n_slots)]
            for s, r in enumerate(readers):
                dl.attach(s, r)
            readers[0].buffer.arm()
            dl.send_step(slots, slots, ids, probs)
            dl.send_step(slots, slots)
            for s in range(n_slots):
                dl.finish(s, cdelivery.FINISH_CANCELLED)
                dl.detach(s)
            dl.wake()
            del readers, r

    lifecycles(20_000)                                      # warm-up: allocator pools, caches
    gc.collect()
    before = _rss()
    t0 = time.monotonic()
    lifecycles(200_000)
    gc.collect()
    grown = _rss() - before
    assert grown <= 1 << 20, f"RSS grew by {grown / 1024:.0f} kB over 200,000 readers"
    assert time.monotonic() - t0 < 20
