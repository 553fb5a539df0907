"""Generation: one engine request as the HTTP side sees it — deltas, probabilities, metrics, deadlines.

Text is the event loop's business (DESIGN.md contract 4): token ids come from the
request's TextReader in batches (one wake-up per step) and its text layer (the one
Engine.generate uses: detokenizer, stop strings, clocks, outcome) turns them into text
on the loop; a stop string found there cancels the request through the engine's inbox. Whoever consumes
`deltas()` reads at its own pace: a slow HTTP client only makes batches bigger,
the decode thread never waits (the reader's buffer holds the whole request).

Deadlines (queue time, total time, inter-token stall) are checked by the
watchdog every tick from `check()`, which reads only this object and the
engine's snapshot. The inter-token clock restarts on every sign of progress: a token for
the reader, or more KV written in the request's slot (a prefill computing the prompt,
chunk by chunk, is working, not stalled: a 5k-token prompt may take longer than the limit). Ending a request for any reason goes through the exchange:
its `fail()` records why and cancels the task that is writing the response.
"""
from __future__ import annotations

import time
from contextlib import aclosing
from typing import NamedTuple

from ..errors import EngineClosed, ServerBusy
from ..request import ENDED_EARLY, OUTCOMES
from .errors import HttpError


class Delta(NamedTuple):
    text: str
    ids: list            # token ids behind this text
    probs: list | None   # per id: (top_ids list, top_probs list, own probability or None) when asked for


class Generation:
    __slots__ = ("metrics", "inflight", "text", "reader", "params", "sampling", "n_prompt", "n_probs", "limits",
                 "probs", "t_admit", "progress_seen", "t_progress", "t_arrival", "outcome", "exchange", "_closed",
                 "queued_behind")

    def __init__(self, exchange, ids: list, sampling, params, constraint=None, *, engine, metrics, inflight: set):
        """One choice of a request, submitted to the engine. ids: its prompt's token ids and sampling its
        SamplingParams (params.Params.choices); params: what the request asked (params.Params); constraint:
        this choice's own compiled grammar or schema (App.compile). inflight: the server's running
        generations, which this one is in until it closes. Raises HttpError (503: queue full, shutting down)
        or the engine's RequestError (the exchange's 400: errors.refused)."""
        snap = engine.snapshot
        try:
            self.text = engine.submit(ids, sampling=sampling, max_tokens=params.max_tokens, stop=params.stop,
                                      cache_prompt=params.cache_prompt, id_slot=params.id_slot, constraint=constraint,
                                      speculative=params.speculative)
        except ServerBusy as exc:
            metrics.rejected.inc(1, "queue_full")
            raise HttpError(503, str(exc)) from None
        except EngineClosed:
            raise HttpError(503, "the server is shutting down") from None
        self.reader = self.text.reader              # token ids; its slot and cached prompt tokens once admitted
        self.params, self.sampling = params, sampling
        self.metrics, self.inflight = metrics, inflight
        self.exchange = exchange
        self.n_prompt = len(ids)
        self.n_probs = sampling.n_probs
        self.limits = params.limits
        # the deadlines run from the request's arrival: its parse and grammar compile count (App.compile)
        self.t_arrival = getattr(exchange, "t0", None) or self.text.t_submit
        self.probs: list | None = [] if self.n_probs else None
        self.t_progress = self.text.t_submit
        self.t_admit = None
        self.queued_behind = snap.n_waiting + snap.n_running >= len(snap.slot_state)
        self.progress_seen = (0, -1)       # (tokens for the reader, tokens with KV written in the slot)
        self.outcome = None                # request.OUTCOMES' entry, once it ended well
        self._closed = False
        exchange.generation = self
        inflight.add(self)

    # -- consuming ---------------------------------------------------------------------------

    async def deltas(self):
        """Async iterator of Delta until the request ends; raises HttpError when it failed."""
        n_probs = self.n_probs
        try:
            async with aclosing(self.reader.abatches(probs=bool(n_probs))) as batches:
                async for got in batches:
                    if n_probs:
                        ids, top_ids, top_probs = got
                        probs = [_entry(top_ids[i].tolist(), top_probs[i].tolist(), n_probs) for i in range(len(ids))]
                    else:
                        ids, probs = got, None
                    delta = self._feed(ids, probs)
                    if delta.text or delta.ids:
                        yield delta
                    if self.text.stopped:
                        break
            tail = self.text.flush()
            self._finish()
            if tail:
                yield Delta(tail, [], [] if self.n_probs else None)
        finally:
            self.close()

    async def run(self) -> None:
        """Consume to the end (non-streaming responses)."""
        async for _ in self.deltas():
            pass

    def _feed(self, ids: list, probs) -> Delta:
        stream, m = self.text, self.metrics
        t_last = stream.t_last
        text, n = stream.feed(ids)          # a stop string cancels the request: the slot is free within a step
        now = stream.t_last
        if t_last is None:
            m.ttft.observe(now - stream.t_submit)
            if self.t_admit is None:
                self._admitted(now if self.queued_behind else stream.t_submit)
        else:
            m.itl.observe((now - t_last) / len(ids), len(ids))
        used = ids[:n] if n < len(ids) else ids
        if probs is not None:
            probs = probs[:n]
            self.probs.extend(probs)
        return Delta(text, used, probs)

    def _finish(self) -> None:
        """The reader ended: how (request.OUTCOMES), or raise the failure."""
        stream = self.text
        reason = stream.outcome()
        outcome = OUTCOMES.get(reason, ENDED_EARLY)
        if outcome.status:
            raise HttpError(outcome.status, outcome.message.format(error=self.reader.error or "unknown error",
                                                                   reason=reason))
        self.outcome = outcome
        self.metrics.e2e.observe(stream.t_end - stream.t_submit)
        self.metrics.requests_done.inc(1, outcome.stop_type)

    # -- what the routes read ----------------------------------------------------------------

    @property
    def ids(self) -> list:
        """The generated token ids behind the text so far."""
        return self.text.token_ids

    @property
    def stop_type(self) -> str:
        return self.outcome.stop_type if self.outcome is not None else "none"

    @property
    def openai_finish_reason(self) -> str:
        return self.outcome.openai if self.outcome is not None else "stop"

    def _admitted(self, t: float) -> None:
        self.t_admit = t
        self.metrics.queue_time.observe(t - self.text.t_submit)

    def close(self) -> None:
        """Stop the request if it still runs (idempotent); nothing is left behind."""
        if self._closed:
            return
        self._closed = True
        self.reader.cancel()
        self.inflight.discard(self)
        self.metrics.llama.add(self)       # llama-server's totals count every request, however it ended

    # -- watchdog ----------------------------------------------------------------------------

    def check(self, now: float, snap) -> HttpError | None:
        """Deadlines and admission tracking, from the snapshot only. Returns the failure, if any."""
        reader = self.reader
        if self.t_admit is None:
            if reader.slot >= 0 or reader.count or reader.finished:
                self._admitted(now)
            elif self.limits.queue and now - self.t_arrival > self.limits.queue:
                self.metrics.deadlines.inc(1, "queue")
                return HttpError(503, f"no slot became free within the queue limit of {self.limits.queue:g} s "
                                      f"({snap.n_running} running, {snap.n_waiting} waiting)")
        if reader.finished:
            return None
        if self.limits.total and now - self.t_arrival > self.limits.total:
            self.metrics.deadlines.inc(1, "total")
            return HttpError(504, f"the request ran past its time limit of {self.limits.total:g} s")
        slot = reader.slot
        progress = (reader.count, snap.slot_past[slot] if 0 <= slot < len(snap.slot_past) else -1)
        if progress != self.progress_seen:
            self.progress_seen = progress
            self.t_progress = now
        elif self.t_admit is not None and self.limits.token and \
                now - max(self.t_progress, self.t_admit) > self.limits.token:
            self.metrics.deadlines.inc(1, "token")
            what = "" if progress[0] else " (the prompt is not advancing)"
            return HttpError(504, f"no token for {now - max(self.t_progress, self.t_admit):.1f} s{what} "
                                  f"(inter-token limit {self.limits.token:g} s)")
        return None

    def id_slot(self) -> int:
        return self.reader.slot

    # -- summaries ---------------------------------------------------------------------------

    def timings(self) -> dict:
        """llama.cpp's timings object (ms), from the text layer's clocks. prompt_ms runs from admission to
        the first token."""
        stream, n_cached = self.text, self.reader.n_cached
        t_end = stream.t_end or time.monotonic()
        t0 = self.t_admit if self.t_admit is not None else stream.t_submit
        t1 = stream.t_first if stream.t_first is not None else t_end
        prompt_ms = max(0.0, (t1 - t0) * 1e3)
        n_gen = len(stream.token_ids)
        n_eval = self.n_prompt - n_cached
        predicted_ms = max(0.0, (t_end - t1) * 1e3)
        return {
            "cache_n": n_cached,
            "prompt_n": n_eval,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / n_eval if n_eval else 0.0,
            "prompt_per_second": n_eval / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
            "predicted_n": n_gen,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / n_gen if n_gen else 0.0,
            "predicted_per_second": n_gen / predicted_ms * 1e3 if predicted_ms > 0 else 0.0,
            "queue_ms": max(0.0, (t0 - stream.t_submit) * 1e3),
            **self._drafts(),
        }

    def _drafts(self) -> dict:
        """Speculative decoding's part of the timings, as llama-server's (only when the request drafted)."""
        buf = self.reader.buffer
        return {"draft_n": buf.draft_n, "draft_n_accepted": buf.draft_n_accepted} if buf.draft_n else {}


def _entry(ids: list, probs: list, n: int) -> tuple:
    """A token's (top ids, top probabilities, own probability) from its row of the engine's n-column list: the list
    without its padding (id -1: fewer than n candidates), then the sampled token's own probability where the
    engine gave it (column n), else None."""
    own = probs[n] if len(ids) > n else None
    keep = [i for i in range(min(n, len(ids))) if ids[i] >= 0]
    return [ids[i] for i in keep], [probs[i] for i in keep], own
