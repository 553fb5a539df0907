"""Engine: continuous batching on one decode thread. The one module that wires the others.

    submit() ──Inbox──▶ decode thread: admit → build batch → forward → sample → commit → deliver
    Reader ◀──ResultBuffer (one per request, no lock) + one wake-up per step──┘

Contracts (../shared/DESIGN.md 1-4, 9): the decode thread owns slots, batch,
sampler and KV cache; other threads reach it only through the inbox; it never
waits for a reader; everything a step touches is allocated here, up front.
The engine imports nothing from server/, asyncio, h11 or uvloop: its only
outward call is the Waker it hands to Delivery.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from . import _delivery, _faults
from ._batch import Batch
from ._delivery import Delivery
from ._sampling import Sampler
from ._slots import DECODE, IDLE, SlotTable
from .device_sampling import device_sampler_for
from .errors import ConfigError, EngineClosed, RequestError, ServerBusy
from .grammar import Constraint, compile_grammar
from .inbox import Inbox
from .masks import MaskTable
from .prompt_cache import MIB, PromptCache
from .reader import Waker
from .ref.sampling import check_config
from .request import SAMPLING_DEFAULTS, Completion, Job, random_seed
from .scheduler import pick_slot, slot_prefix
from .text_reader import TextReader
from .tracer import Tracer

log = logging.getLogger("fastserve.engine")

FINISH_STOP, FINISH_LENGTH = _delivery.FINISH_STOP, _delivery.FINISH_LENGTH
FINISH_CANCELLED, FINISH_ERROR, FINISH_CLOSED = (_delivery.FINISH_CANCELLED, _delivery.FINISH_ERROR,
                                                 _delivery.FINISH_CLOSED)
FINISH_GRAMMAR = _delivery.FINISH_GRAMMAR
IDLE_WAIT_S = 0.05          # an idle decode thread still wakes this often (heartbeat, close)


@dataclass(frozen=True)
class Snapshot:
    """What the decode thread publishes after each step; readers never block on it."""
    step: int                   # heartbeat: grows by one per step
    t_step: float               # time.monotonic() at the end of the last step
    busy: bool                  # work pending (running or waiting requests)
    n_running: int
    n_waiting: int
    slot_state: tuple           # per slot: IDLE / PREFILL / DECODE
    slot_tokens: tuple          # per slot: tokens held (prompt + generated)
    slot_past: tuple            # per slot: tokens whose KV is written (grows chunk by chunk in a prefill)
    slot_job: tuple             # per slot: job id or 0
    tokens_generated: int       # since start
    tokens_prompt: int          # prompt tokens computed since start
    slot_erased: tuple = ()     # per slot: (times its cached prefix was erased, tokens the last erase dropped)



def default_threads() -> int:
    """The cores this process may run on (llama.cpp's -t default is the cores too)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)

class Engine:
    """Many concurrent requests on one model, decoded together.

    n_parallel slots share n_ctx tokens of KV (n_ctx / n_parallel each, as
    llama.cpp's -c / -np); a step carries at most n_batch tokens, decode tokens
    first; at most max_queue requests wait for a slot.
    Prefix reuse: a request reuses the longest prefix of its prompt already in a slot's KV
    (cache_prompt); slot_prompt_similarity is the share of the prompt a free slot's prefix must
    exceed for that slot to be picked (else the least recently used one); cache_ram_mib > 0 keeps
    the prefixes of reused slots in that much host RAM (fastserve/prompt_cache.py), 0 = off.
    cache_type_k / cache_type_v: the KV cache's types on the CPU backend ("f16", "f32", "q8_0"; llama-server's
    --cache-type-k/-v); the CUDA backend keeps its KV in its own dtype and refuses any other.
    """

    def __init__(self, model, n_parallel: int = 8, n_ctx: int = 8192, n_batch: int = 512,
                 max_queue: int = 256, backend=None, trace: bool = False, threads: int | None = None,
                 prefill_chunk: int = 32, cache_ram_mib: float = 0, slot_prompt_similarity: float = 0.1,
                 cache_type_k: str = "f16", cache_type_v: str = "f16"):
        if n_parallel < 1 or n_batch < 1 or max_queue < 0:
            raise ValueError("n_parallel and n_batch must be >= 1, max_queue >= 0")
        if n_ctx // n_parallel < 2:
            raise ValueError(f"n_ctx={n_ctx} leaves less than 2 tokens per slot for n_parallel={n_parallel}")
        # Threads of the CPU backend's step (products and attention, llama.cpp's -t): every core by
        # default. Its helpers take tasks dynamically, so an event loop that needs a core for a
        # moment delays one task, not the step (see _pool.h).
        self.threads = max(1, threads or default_threads())
        self.model = model
        self.tokenizer = model.tokenizer
        self.n_slots, self.n_ctx_slot, self.n_batch = n_parallel, n_ctx // n_parallel, n_batch
        self.max_queue, self.prefill_chunk = max_queue, max(1, prefill_chunk)
        self.cache_type_k, self.cache_type_v = cache_type_k, cache_type_v
        n_vocab = model.config.n_vocab
        self.backend = self._make_backend(backend)
        eog = np.zeros(n_vocab, np.uint8)
        eog[list(self.tokenizer.eog_ids)] = 1
        self.slots = SlotTable(self.n_slots, self.n_ctx_slot, eog)
        self.batch = Batch(n_batch)
        self.sampler = Sampler(self.n_slots, n_vocab)
        self.delivery = Delivery(self.n_slots, Waker())
        self.inbox = Inbox()
        self.tracer = Tracer() if trace else None
        # Prefix reuse: a free slot is picked for its cached prefix when that prefix is more than this
        # share of the prompt (llama.cpp's --slot-prompt-similarity); the host-RAM cache keeps the
        # prefixes of reused slots (llama.cpp's --cache-ram, MiB, 0 = off), its pool allocated here, once.
        self.slot_prompt_similarity = float(slot_prompt_similarity)
        self.prompt_cache = PromptCache(self.backend, int(cache_ram_mib * MIB)) if cache_ram_mib > 0 else None
        # Step outputs, one row per output row of the batch: [n_batch] and [n_batch, max n_probs].
        self._sampled = np.zeros(n_batch, np.int32)
        self._finish = np.zeros(n_batch, np.int8)
        self._probs_ids = np.zeros((n_batch, 100), np.int32)
        self._probs = np.zeros((n_batch, 100), np.float32)
        # Sampling on the device when the backend has it (only ids and asked-for lists come back);
        # self.sampler still validates and holds each request's configuration.
        self.device_sampler = device_sampler_for(self.backend, self.sampler, n_batch, self._probs.shape[1])
        self.masks = MaskTable(self.sampler.masks)          # constrained slots (grammar / JSON schema)
        self._eog_id = min(self.tokenizer.eog_ids) if self.tokenizer.eog_ids else 0
        self._jobs: list[Job | None] = [None] * self.n_slots     # slot -> running job
        # erase_idle_slot() on a busy slot: its prefix is dropped when its request ends, before the slot can
        # take another (else, under load, a freed slot is taken again before an erase gets to it).
        self._erase_on_end: set[int] = set()
        self._erased = [(0, 0)] * self.n_slots                   # slot -> (erasures, tokens the last one dropped)
        self._waiting: deque[Job] = deque()
        self._closing = False
        self._closed = False
        self._seq = 0
        self._n_probs_slots = 0
        self._tokens_generated = 0
        self._tokens_prompt = 0
        self.snapshot = self._make_snapshot(0)
        self._thread = threading.Thread(target=self._run, name="fastserve-decode", daemon=True)
        self._thread.start()

    def _make_backend(self, backend):
        if backend == "auto":           # CUDA when CuPy sees a GPU, else the CPU
            from .backends.cupy_backend import cuda_status
            backend = "cuda" if cuda_status()[0] else "cpu"
        if backend is None or backend in ("cpu", "numpy"):
            from .backends.numpy_backend import NumpyBackend
            return NumpyBackend(self.model.config, self.model.weights, self.n_slots, self.n_ctx_slot,
                                threads=self.threads, cache_type_k=self.cache_type_k, cache_type_v=self.cache_type_v,
                                max_tokens=self.n_batch, reuse_logits=True)
        if backend == "cuda":
            from .backends.cupy_backend import CupyBackend
            if (self.cache_type_k, self.cache_type_v) != ("f16", "f16"):
                raise ConfigError(f"the CUDA backend keeps its KV cache in f16; --cache-type-k {self.cache_type_k} / "
                                 f"--cache-type-v {self.cache_type_v} are for the CPU backend (--device cpu)")
            return CupyBackend(self.model.config, self.model.weights, self.n_slots, self.n_ctx_slot,
                               max_tokens=self.n_batch)
        if isinstance(backend, str):
            raise ValueError(f"unknown backend {backend!r}; known: cpu, cuda, auto")
        if isinstance(backend, type) or not hasattr(backend, "forward"):   # a class or a factory
            return backend(self.model.config, self.model.weights, self.n_slots, self.n_ctx_slot)
        return backend

    # -- the caller's side (any thread) ------------------------------------------------------

    def submit(self, prompt, *, max_tokens: int = -1, stop=(), seed: int | None = None,
               add_special: bool = True, cache_prompt: bool = True, id_slot: int = -1,
               truncate: bool = False, grammar: str | None = None, json_schema=None, **sampling) -> TextReader:
        """Queue a request; returns its Reader at once. prompt: text or a list of token ids.

        sampling: temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n,
        presence_penalty, frequency_penalty, logit_bias, n_probs, post_sampling_probs.
        grammar (GBNF text) or json_schema (a dict or its JSON text): only output it accepts is
        sampled (fastserve/grammar.py); it is compiled here, in the caller's thread.
        Raises RequestError (bad request), ServerBusy (queue full), EngineClosed."""
        if self._closing:
            raise EngineClosed("the engine is closed")
        constraint = self._constraint(grammar, json_schema)
        ids = self._prompt_ids(prompt, add_special, truncate)
        unknown = set(sampling) - set(SAMPLING_DEFAULTS)
        if unknown:
            raise RequestError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        params = {**SAMPLING_DEFAULTS, **sampling}
        params["seed"] = random_seed() if seed is None or seed == -1 else seed
        if params["n_probs"] and params["n_probs"] > self._probs.shape[1]:
            raise RequestError(f"n_probs must be at most {self._probs.shape[1]}")
        cfg = check_config(self.model.config.n_vocab, self.sampler.max_penalty_window,
                           self.sampler.max_logit_bias, history=(), **params)
        del cfg["history"]                  # the prompt becomes the penalty history at admission
        cfg["logit_bias"] = dict(cfg["logit_bias"])
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(max_tokens, int) or max_tokens < -1:
            raise RequestError("max_tokens must be an integer >= -1 (-1: until the context is full)")
        if not -1 <= id_slot < self.n_slots:
            raise RequestError(f"id_slot must be -1 or in [0, {self.n_slots})")
        if len(self._waiting) + len(self.inbox) >= self.max_queue + self._free_slots_hint():
            raise ServerBusy(f"server busy: {self.n_slots} slots running and {self.max_queue} requests waiting")
        reader = TextReader(self.n_ctx_slot, self.tokenizer, stop=list(stop), n_probs=cfg["n_probs"],
                            prompt_tokens=len(ids))
        job = Job(prompt=ids, sampling=cfg, max_tokens=max_tokens, buffer=reader.buffer,
                  cache_prompt=bool(cache_prompt), id_slot=id_slot, admission=reader.admission,
                  constraint=constraint)
        reader._on_cancel = lambda inbox=self.inbox, jid=job.id: inbox.put("cancel", jid)
        self.inbox.put("submit", job)
        if self._closed:                    # the decode thread is gone: nobody else will end it
            self.delivery.reject(job.buffer, FINISH_CLOSED)
            self.delivery.wake()
        return reader

    def generate(self, prompt, **kwargs) -> Completion:
        """Submit and wait: the whole completion (callable from many threads at once)."""
        return self.submit(prompt, **kwargs).result()

    def stream(self, prompt, **kwargs):
        """Submit and iterate: text pieces as they are produced."""
        reader = self.submit(prompt, **kwargs)
        try:
            yield from reader
        finally:
            reader.cancel()

    def erase_slot(self, slot: int) -> None:
        """Drop slot's cached prefix (its running request, if any, is cancelled)."""
        if not 0 <= slot < self.n_slots:
            raise RequestError(f"slot must be in [0, {self.n_slots})")
        self.inbox.put("erase", slot)

    def erase_idle_slot(self, slot: int) -> None:
        """Drop slot's cached prefix without cutting a request: at once when the slot is idle when the
        decode thread gets to it, else as soon as its request ends, before the slot takes another.
        snapshot.slot_erased[slot] counts the erasures (and the tokens the last one dropped)."""
        if not 0 <= slot < self.n_slots:
            raise RequestError(f"slot must be in [0, {self.n_slots})")
        self.inbox.put("erase_idle", slot)

    def trace_summary(self) -> dict:
        if self.tracer is None:
            raise RuntimeError("tracing is off: create the Engine with trace=True")
        return self.tracer.summary()

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking requests, finish every reader with 'closed', stop the decode thread (within a step)."""
        self._closing = True
        self.inbox.wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _constraint(self, grammar, json_schema) -> Constraint | None:
        text = compile_grammar(grammar=grammar, json_schema=json_schema)
        if text is None:
            return None
        return Constraint(self.tokenizer, text)

    def _free_slots_hint(self) -> int:
        return self.n_slots - self.snapshot.n_running

    def _prompt_ids(self, prompt, add_special: bool, truncate: bool) -> np.ndarray:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special=add_special)
        elif isinstance(prompt, (list, tuple, np.ndarray)) and all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
            ids = [int(t) for t in prompt]
            if any(not 0 <= t < self.model.config.n_vocab for t in ids):
                raise RequestError(f"prompt token ids must be in [0, {self.model.config.n_vocab})")
        else:
            raise RequestError("prompt must be a string or a list of token ids")
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= self.n_ctx_slot:
            if not truncate:
                raise RequestError(f"the prompt has {len(ids)} tokens but a slot holds {self.n_ctx_slot} "
                                   f"(n_ctx / n_parallel); shorten it or ask for truncation")
            ids = ids[-(self.n_ctx_slot // 2):]
        return np.asarray(ids, dtype=np.int32)

    # -- the decode thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closing:
                if not self._step():
                    t0 = time.perf_counter_ns()
                    self.inbox.wait(IDLE_WAIT_S)
                    if self.tracer is not None:
                        self.tracer.idle(time.perf_counter_ns() - t0)
        except BaseException:
            log.exception("decode thread crashed")
            raise
        finally:
            self._shutdown()

    def _step(self) -> bool:
        """One step: admit → build → forward → sample → commit → deliver. False when there was nothing to do."""
        tr = self.tracer
        if tr is not None:
            tr.begin()
        self._admit()
        if tr is not None:
            tr.lap("admit")
        batch = self.batch
        if not self._build():
            self._publish()
            return False
        if tr is not None:
            tr.lap("build")
        _faults.check_step()
        tokens, positions, slots, out_rows, row_slot = batch.view()
        ds = self.device_sampler
        try:
            if ds is not None:      # forward and sampling on the device; the ids are on the host after it
                if self.masks.n_active:
                    self.masks.wait()   # the masks travel with the rows' records
                ds.forward(tokens, positions, slots, out_rows, row_slot)
            else:
                logits = self.backend.forward(tokens, positions, slots, out_rows)
            if tr is not None:
                tr.lap("forward")
            sync = getattr(self.backend, "sync", None)
            if sync is not None:
                sync()
        except Exception as exc:   # contained: only this batch's requests fail
            log.exception("forward pass failed")
            self._fail_batch(f"forward pass failed: {type(exc).__name__}: {exc}")
            self._publish()
            return True
        if tr is not None:
            tr.lap("sync")
        n_out = batch.n_out
        sampled = self._sampled[:n_out]
        dead = ()
        if ds is not None:
            ds.sample(row_slot, sampled, self._probs_ids, self._probs)
        else:
            if self.masks.n_active:
                self.masks.wait()
            self.sampler.sample(logits, row_slot, sampled, self._probs_ids, self._probs)
        if self.masks.n_active:
            dead = self._unsampleable(row_slot, sampled)
        if tr is not None:
            tr.lap("sample")
        self.slots.commit(batch, self._sampled, self._finish)
        if self.masks.n_active:
            self.masks.launch(row_slot, sampled, self._finish)
        self._deliver(row_slot, sampled, n_out)
        for slot in dead:
            self._end(slot, FINISH_GRAMMAR)
        self._tokens_prompt += batch.n - self._n_decode
        self._tokens_generated += n_out
        self._publish()
        if tr is not None:
            tr.lap("publish")
            tr.end()
        return True

    def _build(self) -> bool:
        """Decode tokens first, then prompt chunks; a failed fill is rolled back and fails only its request."""
        batch = self.batch
        batch.clear()
        self._n_decode = self.slots.add_decode(batch)
        budget = batch.free if self._n_decode == 0 else min(batch.free, max(self.prefill_chunk, self._n_decode))
        for slot in self.slots.prefill_order():
            if budget <= 0:
                break
            mark = batch.mark()
            try:
                n_added = self.slots.add_prefill(batch, slot, budget)
                self._after_fill(slot)
            except Exception as exc:       # no turn used: the budget stays for the next slots
                batch.rollback(mark)
                log.warning("prompt fill of slot %d failed: %s", slot, exc)
                self._end(slot, FINISH_ERROR, f"prompt processing failed: {exc}")
                continue
            budget -= n_added
        return batch.n > 0

    def _after_fill(self, slot: int) -> None:
        """Called after a slot added its prompt tokens to the batch; an exception fails only that fill."""
        _faults.check_fill()

    def _unsampleable(self, row_slot, sampled) -> list:
        """Rows whose constraint allowed no token (-1): their requests finish with FINISH_GRAMMAR now
        (so the reader is sent nothing more) and their slots are freed after delivery; the row gets an
        end-of-generation id for commit. Returns those slots."""
        dead = []
        for r in np.flatnonzero(sampled < 0).tolist():
            slot = int(row_slot[r])
            self.delivery.finish(slot, FINISH_GRAMMAR, self.masks.error(slot))
            sampled[r] = self._eog_id
            dead.append(slot)
        return dead

    def _deliver(self, row_slot, sampled, n_out: int) -> None:
        t0 = time.perf_counter_ns()
        if self._n_probs_slots:
            self.delivery.send_step(row_slot, sampled, self._probs_ids[:n_out], self._probs[:n_out])
        else:
            self.delivery.send_step(row_slot, sampled)
        if self.tracer is not None:
            self.tracer.sends(n_out, time.perf_counter_ns() - t0)
        finish = self._finish[:n_out]
        for r in np.flatnonzero(finish):
            self._end(int(row_slot[r]), int(finish[r]))

    def _admit(self) -> None:
        for msg in self.inbox.drain():
            if msg.kind == "submit":
                self._waiting.append(msg.payload)
            elif msg.kind == "cancel":
                self._cancel(msg.payload)
            elif msg.kind == "erase":
                self._erase(msg.payload)
            elif msg.kind == "erase_idle":          # erase_idle_slot(): never cuts a running request
                if self._jobs[msg.payload] is None:
                    self._forget(msg.payload)
                else:
                    self._erase_on_end.add(msg.payload)
        while self._waiting and not self._closing:
            job = self._waiting[0]
            slot = pick_slot(self.slots, job.prompt, id_slot=job.id_slot, cache_prompt=job.cache_prompt,
                             similarity=self.slot_prompt_similarity)
            if slot < 0:
                if job.id_slot >= 0:
                    self._waiting.rotate(-1)     # a pinned job waits without blocking the others
                    if all(j.id_slot >= 0 and self.slots.state[j.id_slot] != IDLE for j in self._waiting):
                        break
                    continue
                break
            self._waiting.popleft()
            try:
                self._start(job, slot)
            except Exception as exc:       # contained: this request fails, the others go on
                log.exception("admitting request %d failed", job.id)
                if self._jobs[slot] is job:
                    self._end(slot, FINISH_ERROR, f"admission failed: {exc}")
                else:
                    self.slots.release(slot)
                    self.delivery.reject(job.buffer, FINISH_ERROR, f"admission failed: {exc}")

    def _start(self, job: Job, slot: int) -> None:
        n_cached = min(slot_prefix(self.slots, slot, job.prompt), len(job.prompt) - 1) if job.cache_prompt else 0
        max_gen = job.max_tokens if job.max_tokens >= 0 else self.n_ctx_slot
        if max_gen == 0:
            job.slot, job.n_cached = slot, n_cached
            self.delivery.reject(job.buffer, FINISH_LENGTH)
            return
        self.sampler.configure(slot, history=job.prompt, constrained=job.constraint is not None, **job.sampling)
        if job.constraint is not None:
            self.masks.start(slot, job.constraint)
        if self.device_sampler is not None:
            self.device_sampler.configure(slot, history=job.prompt, constrained=job.constraint is not None,
                                          **job.sampling)
        if self.prompt_cache is not None:       # it writes the slot's KV: nothing that can fail comes after it
            n_cached = self._swap_prefix(slot, job, n_cached)
        job.slot, job.n_cached = slot, n_cached
        if job.admission is not None:
            job.admission.slot, job.admission.n_cached = slot, n_cached
        self._seq += 1
        self.slots.start(slot, job.prompt, n_cached, max_gen, self._seq)
        self.delivery.attach(slot, job.buffer)
        self._jobs[slot] = job
        if job.sampling["n_probs"]:
            self._n_probs_slots += 1

    def _swap_prefix(self, slot: int, job: Job, n_cached: int) -> int:
        """The host-RAM cache at admission: keep the slot's prefix before the new prompt overwrites it,
        and bring back a longer prefix of the prompt when the cache holds one. Returns the new n_cached.
        Neither copy can fail the request: a refused save is logged, a failed restore computes instead."""
        pc, prompt = self.prompt_cache, job.prompt
        entry, n_hit = pc.lookup(prompt) if job.cache_prompt else (None, 0)
        n_hit = min(n_hit, len(prompt) - 1)
        n_old = int(self.slots.n_tokens[slot])
        if n_old > slot_prefix(self.slots, slot, prompt):
            pc.save(slot, self.slots.tokens[slot, :n_old], keep=entry if n_hit > n_cached else None)
        if n_hit > n_cached and pc.restore(entry, slot, n_cached, n_hit):
            return n_hit
        return n_cached

    def _end(self, slot: int, code: int, error: str | None = None) -> None:
        """Finish the slot's request, detach its reader, free the slot (its KV prefix stays reusable)."""
        job = self._jobs[slot]
        if job is None:
            return
        self.delivery.finish(slot, code, error)
        self.delivery.detach(slot)
        self.slots.release(slot)
        self._jobs[slot] = None
        self.masks.end(slot)
        if job.sampling["n_probs"]:
            self._n_probs_slots -= 1
        if slot in self._erase_on_end:
            self._forget(slot)

    def _cancel(self, job_id: int) -> None:
        for slot, job in enumerate(self._jobs):
            if job is not None and job.id == job_id:
                self._end(slot, FINISH_CANCELLED)
                return
        for job in self._waiting:
            if job.id == job_id:
                self._waiting.remove(job)
                self.delivery.reject(job.buffer, FINISH_CANCELLED)
                return

    def _erase(self, slot: int) -> None:
        if self._jobs[slot] is not None:
            self._end(slot, FINISH_CANCELLED)
        self._forget(slot)

    def _forget(self, slot: int) -> None:
        """Drop an idle slot's cached prefix; counted in snapshot.slot_erased."""
        self._erase_on_end.discard(slot)
        self._erased[slot] = (self._erased[slot][0] + 1, int(self.slots.n_tokens[slot]))
        self.slots.forget(slot)

    def _fail_batch(self, error: str) -> None:
        for slot in sorted(set(self.batch.view()[2].tolist())):
            self._end(int(slot), FINISH_ERROR, error)

    def _publish(self) -> None:
        """End of a step: the one wake-up of the consumer side, then the snapshot."""
        self.delivery.wake()
        self.snapshot = self._make_snapshot(self.snapshot.step + 1)

    def _make_snapshot(self, step: int) -> Snapshot:
        n_running = sum(j is not None for j in self._jobs)
        n_waiting = len(self._waiting)
        return Snapshot(step=step, t_step=time.monotonic(), busy=bool(n_running or n_waiting or len(self.inbox)),
                        n_running=n_running, n_waiting=n_waiting,
                        slot_state=tuple(self.slots.state.tolist()), slot_tokens=tuple(self.slots.n_tokens.tolist()),
                        slot_past=tuple(self.slots.n_past.tolist()),
                        slot_job=tuple(0 if j is None else j.id for j in self._jobs),
                        tokens_generated=self._tokens_generated, tokens_prompt=self._tokens_prompt,
                        slot_erased=tuple(self._erased))

    def _shutdown(self) -> None:
        """Decode thread exit: every reader, running, waiting or still in the inbox, ends 'closed'."""
        self._closing = True
        for msg in self.inbox.drain():
            if msg.kind == "submit":
                self._waiting.append(msg.payload)
        for job in self._waiting:
            self.delivery.reject(job.buffer, FINISH_CLOSED)
        self._waiting.clear()
        for slot in range(self.n_slots):
            self._jobs[slot] = None
        self.delivery.close()
        self.masks.close()
        self._closed = True
        self._publish()
