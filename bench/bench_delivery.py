"""Result delivery costs, per token (pytest-benchmark).

    PYTHONPATH=. python -m pytest bench/bench_delivery.py --benchmark-only -p no:cacheprovider

Each benchmark times a round of `steps` decode steps over 32 slots with 32
readers; extra_info["tokens"] is the number of tokens per round, so
per-token cost = round time / tokens. Target: send_step <= 0.5 us per token,
the step's single wake-up included.
"""
import asyncio
import threading

import numpy as np
import pytest

import fastserve._delivery as cdelivery
import fastserve.ref.delivery as rdelivery
from fastserve.reader import Reader, Waker

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

N = 32
SLOTS = np.arange(N, dtype=np.int32)
TOKENS = (SLOTS * 7 + 1).astype(np.int32)
PROB_IDS = np.tile(np.arange(5, dtype=np.int32), (N, 1))
PROBS = np.full((N, 5), 0.2, np.float32)


def _attached(impl, capacity, waker, n_probs=0):
    dl = impl.Delivery(N, waker)
    readers = [Reader(capacity, n_probs=n_probs, impl=impl) for _ in range(N)]
    for s, r in enumerate(readers):
        dl.attach(s, r)
    return dl, readers


def _per_token(benchmark, tokens):
    benchmark.extra_info["tokens"] = tokens
    stats = benchmark.stats.stats
    benchmark.extra_info["median_us_per_token"] = round(stats.median / tokens * 1e6, 4)


@pytest.mark.parametrize("impl", [cdelivery, rdelivery], ids=["cython", "ref"])
def test_send_step_32_slots_nobody_waiting(benchmark, impl):
    """The common case: 32 streams, consumers busy elsewhere; send_step + wake()."""
    steps = 256 if impl is cdelivery else 16
    keep = []

    def setup():
        keep[:] = [_attached(impl, steps, Waker())]
        return keep[0], {}

    def round_(dl, readers):
        send, wake = dl.send_step, dl.wake
        for _ in range(steps):
            send(SLOTS, TOKENS)
            wake()

    benchmark.pedantic(round_, setup=setup, rounds=200 if impl is cdelivery else 20, warmup_rounds=5)
    _per_token(benchmark, steps * N)


def test_send_step_32_slots_with_probs(benchmark):
    """Every request asked for top-5 probabilities."""
    steps = 256
    keep = []

    def setup():
        keep[:] = [_attached(cdelivery, steps, Waker(), n_probs=5)]
        return keep[0], {}

    def round_(dl, readers):
        send, wake = dl.send_step, dl.wake
        for _ in range(steps):
            send(SLOTS, TOKENS, PROB_IDS, PROBS)
            wake()

    benchmark.pedantic(round_, setup=setup, rounds=200, warmup_rounds=5)
    _per_token(benchmark, steps * N)


@pytest.mark.parametrize("idle", [0, 1, N], ids=["all-read", "one-never-reads", "none-read"])
@pytest.mark.parametrize("impl", [cdelivery, rdelivery], ids=["cython", "ref"])
def test_send_step_with_readers_that_never_read(benchmark, impl, idle):
    """A consumer that never reads only fills its own buffer: a round of sends costs the same whether
    every reader keeps up, one never reads or none does, `backlog` tokens already unread in each idle
    reader's buffer. (tests/parity/test_delivery.py checks it by counting instead: the twin's work per
    step does not grow with a reader's backlog, and an idle reader is woken once.)"""
    steps, backlog = (256, 4096) if impl is cdelivery else (16, 256)
    keep = []

    def setup():
        dl, readers = _attached(impl, backlog + steps, Waker())
        for _ in range(backlog):
            dl.send_step(SLOTS, TOKENS)
        for r in readers[idle:]:
            r.read_available()
        keep[:] = [(dl, readers)]
        return (dl,), {}

    def round_(dl):
        send, wake = dl.send_step, dl.wake
        for _ in range(steps):
            send(SLOTS, TOKENS)
            wake()

    benchmark.pedantic(round_, setup=setup, rounds=100 if impl is cdelivery else 20, warmup_rounds=2)
    benchmark.extra_info["idle_readers"] = idle
    _per_token(benchmark, steps * N)


@pytest.mark.parametrize("kind", ["asyncio", "uvloop", "threads"])
def test_send_step_32_slots_all_waiting(benchmark, kind):
    """Worst case for the producer: all 32 readers parked, so the step claims 32
    wakes and makes its one waker call (32 futures resolved by one
    call_soon_threadsafe, or 32 lock releases). One step per round."""
    if kind == "uvloop" and uvloop is None:
        pytest.skip("uvloop is not installed")
    rounds = 3000
    w = Waker()
    dl, readers = _attached(cdelivery, rounds + 100, w)
    bufs = [r.buffer for r in readers]
    loop = None
    if kind != "threads":
        loop = uvloop.new_event_loop() if kind == "uvloop" else asyncio.new_event_loop()
    locks = [threading.Lock() for _ in range(N)]

    def setup():
        if loop is not None:
            loop.run_until_complete(asyncio.sleep(0))      # run the previous round's wake
            for b in bufs:
                b.take()
                b.waiter = loop.create_future()
                b.arm()
        else:
            for b, lock in zip(bufs, locks):
                b.take()
                lock.acquire(False)
                b.waiter = lock
                b.arm()
        return (), {}

    def step():
        dl.send_step(SLOTS, TOKENS)
        dl.wake()

    try:
        benchmark.pedantic(step, setup=setup, rounds=rounds, warmup_rounds=20)
    finally:
        if loop is not None:
            loop.close()
    assert w.woken >= N * rounds
    _per_token(benchmark, N)


@pytest.mark.parametrize("per_step", [1, 16])
def test_consumer_take(benchmark, per_step):
    """Consumer drain: each of 32 readers takes what arrived (1 or 16 steps' worth)."""
    steps = per_step
    keep = []

    def setup():
        dl, readers = _attached(cdelivery, steps, Waker())
        for _ in range(steps):
            dl.send_step(SLOTS, TOKENS)
        keep[:] = [dl]
        return (readers,), {}

    def drain(readers):
        for r in readers:
            r.read_available()

    benchmark.pedantic(drain, setup=setup, rounds=2000, warmup_rounds=20)
    _per_token(benchmark, steps * N)


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_async_round_trip(benchmark, kind):
    """End to end on one thread: send_step + wake, then the loop resolves the 32
    futures and 32 tasks each take their token through `async for`. Includes one
    run_until_complete per step, so it is an upper bound on the consumer's cost."""
    if kind == "uvloop" and uvloop is None:
        pytest.skip("uvloop is not installed")
    steps = 2000
    loop = uvloop.new_event_loop() if kind == "uvloop" else asyncio.new_event_loop()
    w = Waker()
    dl, readers = _attached(cdelivery, steps + 100, w)
    state = {"left": 0, "done": None}

    async def consume(r):
        async for _ in r:
            state["left"] -= 1
            if state["left"] == 0:
                state["done"].set_result(None)

    tasks = [loop.create_task(consume(r)) for r in readers]
    loop.run_until_complete(asyncio.sleep(0.01))          # all parked

    def step():
        state["left"] = N
        state["done"] = loop.create_future()
        dl.send_step(SLOTS, TOKENS)
        dl.wake()
        loop.run_until_complete(state["done"])

    try:
        benchmark.pedantic(step, rounds=steps, warmup_rounds=20)
    finally:
        dl.close()
        loop.run_until_complete(asyncio.gather(*tasks))
        loop.close()
    _per_token(benchmark, N)
