"""The consumer side of result delivery: Reader (one request) and Waker (all of them).

A Reader owns its request's ResultBuffer (see _delivery.pyx); the decode thread
only appends to it. To wait, a consumer parks on `buffer.waiter`:
  - an asyncio consumer: a Future of its running loop (stdlib asyncio or uvloop);
  - a thread: a lock it holds and that the Waker releases.
The engine is handed one Waker. Delivery calls it at most once per step with the
buffers whose waiting consumer got something; the Waker makes ONE
call_soon_threadsafe per event loop that has ready readers (resolving only their
futures) and releases the lock of each ready thread. It never blocks the decode
thread: releasing a lock and call_soon_threadsafe both return at once.

Invariants:
- FIFO per reader; tokens are consumed in batches (`read_available`), iteration
  is built on top. `result()` sees every token from the first, whatever was read.
- A wake may be spurious (a race the handshake tolerates); every wait re-checks.
- Nothing global: a Reader's memory dies with its last reference and the
  engine's detach. Dropping an unfinished Reader calls `on_cancel` (nobody will
  read it, so its slot should be freed, DESIGN.md contract 7).
- This module does not import asyncio (the engine may import it); the async
  methods import it when first used.
"""
from __future__ import annotations

import time
from _thread import LockType, allocate_lock
from typing import Any, Callable, NamedTuple, Optional

from . import _delivery

# Import-time, on purpose: a missing extension must raise, never fall back.
_DEFAULT_IMPL = _delivery


class Result(NamedTuple):
    """What a finished request produced. tokens: every token id, in order;
    top_ids/top_probs: int32/float32 [len(tokens), n_probs], or None when the
    request did not ask for probabilities."""
    tokens: list
    finish_reason: str
    error: Optional[str]
    top_ids: Any = None
    top_probs: Any = None


def finish_reason(code: int) -> Optional[str]:
    """The finish reason of a FINISH_* code; None while running (code 0)."""
    if code == 0:
        return None
    return _delivery.FINISH_REASONS.get(code) or f"code {code}"


class Reader:
    """The consumer object of one request.

    Reader(capacity, n_probs=0, on_cancel=None, impl=None)
      capacity: the slot's context size (the most tokens the request can produce);
      n_probs: top-N probabilities kept per token (0: none are kept);
      on_cancel: called once, with no argument, by cancel() or when an unfinished
        Reader is dropped; the engine routes it to its inbox;
      impl: the module providing ResultBuffer (fastserve._delivery, or
        fastserve.ref.delivery in parity tests).
    One consumer at a time: iterate it from one thread or one task.
    """

    __slots__ = ("buffer", "_on_cancel", "_cancelled", "_park", "_batch", "_bi", "__weakref__")

    def __init__(self, capacity: int, n_probs: int = 0, on_cancel: Optional[Callable[[], Any]] = None,
                 impl=None):
        self.buffer = (impl or _DEFAULT_IMPL).ResultBuffer(capacity, n_probs)
        self._on_cancel = on_cancel
        self._cancelled = False
        self._park = None          # lock for blocking waits, made on first use
        self._batch = ()           # async per-token iteration: current batch and index
        self._bi = 0

    # -- state -------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.buffer.finished

    @property
    def count(self) -> int:
        """Tokens the engine produced for this request so far, read or not."""
        return self.buffer.count

    @property
    def finish_code(self) -> int:
        return self.buffer.finish_code

    @property
    def finish_reason(self) -> Optional[str]:
        """None while running, then 'stop', 'length', 'cancelled', 'error' or 'closed'."""
        return finish_reason(self.buffer.finish_code)

    @property
    def error(self) -> Optional[str]:
        return self.buffer.error

    @property
    def slot(self) -> int:
        """The slot that runs the request: -1 until the engine admits it (and for one refused at admission)."""
        return self.buffer.slot

    @property
    def n_cached(self) -> int:
        """Prompt tokens whose KV the admission reused (0 until then)."""
        return self.buffer.n_cached

    @property
    def cancelled(self) -> bool:
        """cancel() was called (the engine finishes the request within a step)."""
        return self._cancelled

    # -- non-blocking reads --------------------------------------------------------

    def read_available(self) -> list:
        """Consume the token ids available now (list[int], FIFO, possibly empty)."""
        return self.buffer.take()

    def read_available_probs(self):
        """Consume what is available now with its probabilities:
        (ids list[int], top_ids int32[k, n_probs], top_probs float32[k, n_probs])."""
        return self.buffer.take_probs()

    # -- blocking (threads) ----------------------------------------------------------

    def wait(self, timeout: Optional[float] = None, finish_only: bool = False) -> bool:
        """Block until a token is available (or, with finish_only, until the request
        finished). Returns False on timeout."""
        buf = self.buffer
        deadline = None if timeout is None else time.monotonic() + timeout
        park = self._park
        if park is None:
            park = self._park = allocate_lock()
        while not (buf.finished if finish_only else buf.ready):
            park.acquire(False)            # held = armed; also swallows a stale wake
            buf.waiter = park
            try:
                if buf.arm(finish_only):
                    if deadline is None:
                        park.acquire()
                    else:
                        left = deadline - time.monotonic()
                        if left <= 0 or not park.acquire(True, left):
                            return bool(buf.finished if finish_only else buf.ready)
            finally:
                buf.waiter = None
                buf.disarm()
        return True

    def batches(self, timeout: Optional[float] = None):
        """Blocking iterator over batches of token ids (list[int]) until finished.
        timeout: the most seconds to wait for each batch (TimeoutError)."""
        buf = self.buffer
        while True:
            done = buf.finished            # before take(): then take() sees the final count
            batch = buf.take()
            if batch:
                yield batch
            elif done:
                return
            elif not self.wait(timeout):
                raise TimeoutError(f"no token within {timeout} s")

    def tokens(self, timeout: Optional[float] = None):
        """Blocking iterator over token ids until finished (FIFO)."""
        for batch in self.batches(timeout):
            yield from batch

    __iter__ = tokens

    def result(self, timeout: Optional[float] = None) -> Result:
        """Block until finished; every token id and the finish reason.
        Does not consume: iteration and result() see the same tokens."""
        if not self.wait(timeout, finish_only=True):
            raise TimeoutError(f"request not finished within {timeout} s")
        return self._result()

    def _result(self) -> Result:
        buf = self.buffer
        top_ids, top_probs = buf.all_probs() if buf.n_probs else (None, None)
        return Result(buf.all_tokens(), finish_reason(buf.finish_code), buf.error, top_ids, top_probs)

    # -- async (any running loop: stdlib asyncio or uvloop) --------------------------

    async def wait_async(self, finish_only: bool = False) -> None:
        """Wait, on the running loop, until a token is available (or the request finished)."""
        buf = self.buffer
        if buf.finished if finish_only else buf.ready:
            return
        import asyncio

        loop = asyncio.get_running_loop()
        while not (buf.finished if finish_only else buf.ready):
            fut = loop.create_future()
            buf.waiter = fut
            try:
                if buf.arm(finish_only):
                    await fut
            finally:
                buf.waiter = None
                buf.disarm()

    async def abatches(self, probs: bool = False):
        """Async iterator over batches of token ids (list[int]) until finished; with probs, over what
        read_available_probs() gives: (ids, top_ids int32 [k, n_probs], top_probs float32 [k, n_probs])."""
        buf = self.buffer
        while True:
            done = buf.finished            # before take(): then take() sees the final count
            got = buf.take_probs() if probs else buf.take()
            if got[0] if probs else got:
                yield got
            elif done:
                return
            else:
                await self.wait_async()

    def __aiter__(self):
        return self

    async def __anext__(self) -> int:
        i = self._bi
        batch = self._batch
        if i < len(batch):
            self._bi = i + 1
            return batch[i]
        buf = self.buffer
        while True:
            done = buf.finished
            batch = buf.take()
            if batch:
                self._batch = batch
                self._bi = 1
                return batch[0]
            if done:
                raise StopAsyncIteration
            await self.wait_async()

    async def aresult(self) -> Result:
        """Wait on the running loop until finished; same as result()."""
        await self.wait_async(finish_only=True)
        return self._result()

    # -- cancellation ------------------------------------------------------------------

    def cancel(self) -> None:
        """Ask the engine to stop this request: calls on_cancel once (no-op when the
        request already finished). The reader finishes with 'cancelled' within a step."""
        if self._cancelled or self.buffer.finished:
            return
        self._cancelled = True
        if self._on_cancel is not None:
            self._on_cancel()

    def __del__(self):
        # Nobody will read this request any more: let the engine free its slot.
        try:
            if not self._cancelled and self._on_cancel is not None and not self.buffer.finished:
                self._cancelled = True
                self._on_cancel()
        except Exception:
            pass

    def __repr__(self):
        buf = self.buffer
        return (f"<Reader {buf.count} tokens, {buf.available} unread, "
                f"{self.finish_reason or 'running'}>")


def _resolve(futures):
    """On the loop: wake the ready readers' tasks."""
    for fut in futures:
        if not fut.done():
            fut.set_result(None)


class Waker:
    """The engine's one outward call: waker(buffers), at most once per step.

    Releases each ready thread's lock, and makes one call_soon_threadsafe per event
    loop with ready readers. Counters: `calls` (waker calls), `loop_calls`
    (call_soon_threadsafe calls), `woken` (buffers handed in).
    """

    __slots__ = ("calls", "loop_calls", "woken")

    def __init__(self):
        self.calls = 0
        self.loop_calls = 0
        self.woken = 0

    def __call__(self, buffers) -> None:
        self.calls += 1
        self.woken += len(buffers)
        loop0 = None
        futs0 = None
        others = None               # {loop: [futures]} beyond the first loop
        for buf in buffers:
            w = buf.waiter
            if w is None:
                continue            # the consumer already stopped waiting
            if type(w) is LockType:
                try:
                    w.release()
                except RuntimeError:
                    pass            # already released: the consumer is awake
                continue
            loop = w.get_loop()
            if loop is loop0:
                futs0.append(w)
            elif loop0 is None:
                loop0, futs0 = loop, [w]
            else:
                if others is None:
                    others = {}
                others.setdefault(loop, []).append(w)
        if loop0 is not None:
            self._post(loop0, futs0)
            if others:
                for loop, futs in others.items():
                    self._post(loop, futs)

    def _post(self, loop, futs) -> None:
        self.loop_calls += 1
        try:
            loop.call_soon_threadsafe(_resolve, futs)
        except RuntimeError:
            pass                    # the loop is closed: nobody is left to wake there
