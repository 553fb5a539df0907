"""The watchdog: one timer on the event loop, every `tick` seconds (DESIGN.md contract 6).

Each tick it reads the engine's snapshot (never the decode thread itself) and:
- notices a stalled decode loop (work pending, no step for longer than
  --stall-limit): logs it once, counts it, and fails every running request
  with 503 so no client hangs; new requests get 503 until the loop moves again;
- applies each request's deadlines (queue time, total time, inter-token stall);
- drops connections that read nothing, or sent half a request, for --timeout;
- samples the tracer's per-phase step times into /metrics about once a second.
Everything it does is O(requests + connections) per tick, with no allocation
beyond a list copy of each set.
"""
from __future__ import annotations

import asyncio
import time

from .errors import HttpError


class Watchdog:
    """app's timer; engine: what it reads the snapshot of."""

    def __init__(self, app, engine):
        self.app, self._engine = app, engine
        self.stalled_since: float | None = None
        self.n_stalls = 0               # stalls the ticks saw begin
        self._handle = None
        self._next_trace = 0.0

    def start(self) -> None:
        self._schedule()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _schedule(self) -> None:
        self._handle = asyncio.get_running_loop().call_later(self.app.config.tick, self._tick)

    def _tick(self) -> None:
        try:
            self.tick(time.monotonic())
        except Exception as exc:        # the watchdog must outlive any bug it meets
            self.app.log.line(f"watchdog error: {type(exc).__name__}: {exc}")
        finally:
            if self._handle is not None:
                self._schedule()

    def observe(self, stall: str | None, now: float) -> None:
        """Each tick's stall check lands here: log and count the transitions."""
        if stall and self.stalled_since is None:
            self.stalled_since = now
            self.n_stalls += 1
            self.app.log.line(f"watchdog: {stall}; failing the running requests")
        elif not stall and self.stalled_since is not None:
            self.app.log.line(f"watchdog: the decode loop moves again after {now - self.stalled_since:.1f} s")
            self.stalled_since = None

    def stalls_seen(self, stall_now: str | None) -> int:
        """Stalls so far, counting one that began since the last tick (a read: nothing is counted twice)."""
        return self.n_stalls + (1 if stall_now and self.stalled_since is None else 0)

    def tick(self, now: float) -> None:
        app = self.app
        snap = self._engine.snapshot
        stall = app.stall_reason(now)
        self.observe(stall, now)
        for gen in list(app.inflight):
            ex = gen.exchange
            if ex.failure is not None:
                continue
            if stall and not gen.reader.finished:
                app.fail(ex, HttpError(503, stall))
                continue
            err = gen.check(now, snap)
            if err is not None:
                app.fail(ex, err)
        timeout = app.config.timeout
        for conn in list(app.connections):
            conn.check(now, timeout)
        if now >= self._next_trace:
            self._next_trace = now + 1.0
            app.metrics.sample_tracer()
