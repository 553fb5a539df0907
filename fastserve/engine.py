"""Engine: continuous batching on one decode thread. The one module that wires the others.

    submit() ──Inbox──▶ decode thread: schedule (admit, build → StepPlan) → backend.step (forward, sync,
                                       sample) → commit → deliver → publish
    TextReader over a Reader ◀──ResultBuffer (one per request, no lock) + one wake-up per step──┘

Contracts (DESIGN.md 1-4, 9): the decode thread owns slots, batch, the backend
(its KV cache and sampler); other threads reach it only through the inbox; it never
waits for a reader; everything a step touches is allocated here, up front.
The engine imports nothing from server/, asyncio, h11 or uvloop: its only
outward call is the Waker it hands to Delivery.
"""
from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from functools import partial
from typing import NamedTuple, Optional

import numpy as np

from . import _batch, _delivery, _drafts, _faults, _sampling, _slots
from ._slots import IDLE
from .backends.host_sampling import HostSampled
from .config import DraftLimits, EngineConfig, SamplingParams, check_context, check_max_tokens, check_token_ids
from .draft_model import DraftModel, load_draft
from .embedding import EMBED_SLOTS, Embedder, EmbedJob, check_options
from .scoring import SCORE_ROWS, SCORE_SLOTS, Scorer, ScoreJob
from .errors import ConfigError, ContextExceeded, EngineClosed, RequestError, ServerBusy
from .grammar import Constraint, compile_grammar
from .inbox import Cancel, Embed, Erase, Inbox, Submit
from .masks import MaskTable
from .prompt_cache import MIB, PromptCache
from .reader import Reader, Waker
from .request import Completion, Request, request_ids
from .speculation import Speculation
from .scheduler import STEP_COST_WEIGHT, STEP_TARGET_S, StepPlan, pick_slot, prefill_budget, slot_prefix
from .text_reader import TextReader
from .tracer import Tracer, delta, summarize

log = logging.getLogger("fastserve.engine")

FINISH_STOP, FINISH_LENGTH = _delivery.FINISH_STOP, _delivery.FINISH_LENGTH
FINISH_CANCELLED, FINISH_ERROR, FINISH_CLOSED = (_delivery.FINISH_CANCELLED, _delivery.FINISH_ERROR,
                                                 _delivery.FINISH_CLOSED)
FINISH_GRAMMAR = _delivery.FINISH_GRAMMAR
IDLE_WAIT_S = 0.05          # an idle decode thread still wakes this often (heartbeat, close)
# The Cython modules the engine runs, by name, and their pure-Python twins (Engine(twins=...)).
NATIVE = {"batch": _batch, "slots": _slots, "delivery": _delivery, "sampling": _sampling, "drafts": _drafts}
TWINS = {"batch": "fastserve.ref.batch", "slots": "fastserve.ref.slots", "delivery": "fastserve.ref.delivery",
         "sampling": "fastserve.ref.sampling", "drafts": "fastserve.ref.drafts"}


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
    slot_reuse_from: tuple = () # per slot: the shortest prefix of its cached tokens a prompt can reuse (0: any;
                                # a sliding-window ring holds only the last positions), as of its last request
    slot_drafts: tuple = ()     # per slot: (tokens drafted, accepted) for its current or last request
    n_drafted: int = 0          # speculative decoding since start: tokens drafted, accepted, verifications
    n_drafted_accepted: int = 0
    n_draft_verified: int = 0
    draft_histogram: tuple = () # verifications by accepted tokens (speculation.ACCEPT_BUCKETS' upper bounds)



@dataclass(frozen=True)
class EngineInfo:
    """Engine.describe(): what the engine is, for /slots, /props, /metrics and the start line (plain data)."""
    n_slots: int                # slots (-np)
    n_ctx_slot: int             # tokens of context per slot
    n_batch: int                # most tokens one step carries (-b)
    n_vocab: int
    threads: int                # threads of the CPU step
    device: str                 # "cpu", "cuda", or "custom" (a backend handed in)
    samples_on_device: bool     # where the backend samples (the CUDA backend: on the device)
    cache_type_k: str           # KV cache types (-ctk / -ctv)
    cache_type_v: str
    window: int                 # sliding window of the local layers (0: none)
    ring: int                   # positions a local layer keeps per slot (0: every position)
    kv_bytes: int               # bytes of the KV cache
    kv_resident: bool           # every page of the KV cache in memory (it comes in on a thread of its own)
    model_name: str
    model_path: str
    model_summary: str          # what the load says of itself (time, phases)
    isa: str = ""               # the CPU kernels' instruction set ("avx512vnni", "avx2", "scalar", ...; "" off the CPU)
    speculative: object = None  # config.SpecConfig (its type "none": off)
    n_embd: int = 0             # the width of the model's hidden states (its embeddings)
    model_info: dict = field(default_factory=dict)  # the model's scalar GGUF metadata (general.*, <arch>.*: /api/show)


class EngineStats(NamedTuple):
    """Engine.stats(): n_inbox, messages not yet seen by the decode thread; with tracing on, the tracer's
    totals: steps, ns per phase (tracer.PHASES), and (steps per bucket, seconds) of whole-step times; the
    decode thread's waits for the grammar masks' worker (masks.py), and the host-RAM prompt cache's counts
    (PromptCache.stats; None when it is off)."""
    n_inbox: int
    trace_steps: int = 0
    trace_ns: Optional[dict] = None
    step_histogram: Optional[tuple] = None
    mask_waits: int = 0
    mask_wait_ns: int = 0
    prompt_cache: Optional[dict] = None


def _scalars(metadata: dict) -> dict:
    """The model's metadata but its arrays and long texts (the vocabulary, merges, chat template)."""
    return {k: v for k, v in metadata.items() if isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 256)}


def default_threads() -> int:
    """The cores this process may run on (llama.cpp's -t default is the cores too)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class Engine:
    """Many concurrent requests on one model, decoded together; its settings are an EngineConfig
    (fastserve/config.py), each request's sampling a SamplingParams made at submit().

    n_parallel slots share n_ctx tokens of KV (n_ctx / n_parallel each, as llama.cpp's -c / -np); a step
    carries at most n_batch tokens, decode tokens first; at most max_queue requests wait for a slot.
    Prefix reuse: a request reuses the longest prefix of its prompt already in a slot's KV (cache_prompt);
    the host-RAM prompt cache (cache_ram_mib, fastserve/prompt_cache.py) keeps the prefixes of reused slots.

    Its public surface is the door the server uses: submit, embed, score, cancel, erase, snapshot, stats(), constraint,
    tokenizer, describe(), trace_totals(); and generate, stream, trace_summary, close for in-process use.
    """

    def __init__(self, model, config: EngineConfig | None = None, *, backend=None, twins=(), **settings):
        """config: an EngineConfig, or its fields as keyword arguments (settings). backend: a device name
        ("cpu", "cuda", "auto": EngineConfig.device), or a backend instance, class or factory
        factory(model_config, weights, n_slots, n_ctx_slot) (tests, benchmarks). twins: names of
        NATIVE modules to run as their pure-Python twins (fastserve/ref/; "slots" needs "batch"), or
        "all" (the parity tests run the whole engine on each)."""
        if isinstance(backend, str):
            settings["device"] = backend
        if settings.get("threads") is None:
            settings.pop("threads", None)
        config = (config or EngineConfig()).replace(**settings) if settings else (config or EngineConfig())
        # Public attributes (the door): tokenizer and snapshot; every other one is the engine's own.
        self.tokenizer = model.tokenizer
        self._config = config
        # Threads of the CPU backend's step (products and attention, llama.cpp's -t): every core by
        # default. Its helpers take tasks dynamically, so an event loop that needs a core for a
        # moment delays one task, not the step (see _pool.h).
        self._threads = config.threads or default_threads()
        self._model = model
        self._n_slots, self._n_ctx_slot, self._n_batch = config.n_parallel, config.n_ctx_slot, config.n_batch
        self._max_queue, self._prefill_chunk = config.max_queue, config.prefill_chunk
        # Prompt chunks beside decode rows are sized to keep a step near step_target_s (scheduler.prefill_budget);
        # _s_per_token: measured seconds of a step per token it carried (0: nothing measured yet).
        self._step_target_s, self._s_per_token = STEP_TARGET_S, 0.0
        self._t_build = 0.0                                 # perf_counter() at the start of the step's build
        n_vocab, n_batch = model.config.n_vocab, config.n_batch
        impl = self._impl = self._modules(twins)
        self._device, self._backend = self._make_backend(None if isinstance(backend, str) else backend)
        if impl["sampling"] is not _sampling and hasattr(self._backend, "init_sampling"):
            self._backend.init_sampling(self._n_slots, n_vocab, n_batch, impl=impl["sampling"])
        # the host sampler follows a row's top n_probs with the sampled token's own entry (its probability also
        # when it is not listed); the device's sampler does not yet
        self._own_prob = int(getattr(self._backend, "reports_own_prob", False))
        eog = np.zeros(n_vocab, np.uint8)
        eog[list(self.tokenizer.eog_ids)] = 1
        self._slots = impl["slots"].SlotTable(self._n_slots, self._n_ctx_slot, eog)
        self._batch = impl["batch"].Batch(n_batch)
        self._delivery = impl["delivery"].Delivery(self._n_slots, Waker())
        self._inbox = Inbox()
        # Prefix reuse: a free slot is picked for its cached prefix when that prefix is more than this
        # share of the prompt (llama.cpp's --slot-prompt-similarity); the host-RAM cache keeps the
        # prefixes of reused slots (llama.cpp's --cache-ram, MiB, 0 = off), its pool allocated here, once.
        self._slot_prompt_similarity = float(config.slot_prompt_similarity)
        self._prompt_cache = (PromptCache(self._backend, int(config.cache_ram_mib * MIB))
                              if config.cache_ram_mib > 0 else None)
        self._finish = np.zeros(n_batch, np.int8)      # [n_batch] per output row: FINISH_* of its request
        # constrained slots (grammar / JSON schema): their masks, and their drafted rows' where the sampler has them
        self._masks = MaskTable(self._backend.masks, getattr(self._backend, "draft_masks", None))
        self._spec = self._make_speculation(config)     # speculative decoding (None: off)
        self._eog_id = min(self.tokenizer.eog_ids) if self.tokenizer.eog_ids else 0
        self._jobs: list[Request | None] = [None] * self._n_slots    # slot -> running job
        # erase() of a busy slot: its prefix is dropped when its request ends, before the slot can take
        # another (else, under load, a freed slot is taken again before an erase gets to it). slot -> replies.
        self._erase_on_end: dict[int, list] = {}
        self._erased = [(0, 0)] * self._n_slots                  # slot -> (erasures, tokens the last one dropped)
        self._reuse_from = [0] * self._n_slots                   # slot -> backend.kv_reuse_from at its last release
        self._waiting: deque[Request] = deque()
        self._passes: dict[type, Embedder] = {}     # EmbedJob / ScoreJob -> its side pass, made by the decode
                                                    # thread at the first such job
        self._closing = False
        self._closed = False
        self._seq = 0
        self._tokens_generated = 0
        self._tokens_prompt = 0
        self.snapshot = self._make_snapshot(0)
        self._info = self._make_info()
        self._tracer = Tracer() if config.trace else None     # its clock starts with the decode thread
        self._thread = threading.Thread(target=self._run, name="fastserve-decode", daemon=True)
        self._thread.start()

    @staticmethod
    def _modules(twins) -> dict:
        names = set(TWINS) if twins == "all" else set(twins)
        unknown = names - set(TWINS)
        if unknown:
            raise ValueError(f"no twin for {', '.join(sorted(unknown))}; known: {', '.join(TWINS)}")
        if "slots" in names and "batch" not in names:
            raise ValueError("the slots twin fills the batch twin: ask for both")
        return {n: importlib.import_module(TWINS[n]) if n in names else NATIVE[n] for n in NATIVE}

    def _make_speculation(self, config: EngineConfig) -> Speculation | None:
        """Speculative decoding's drafts and policy (fastserve/speculation.py), or None when it is off."""
        spec = config.speculative
        if not spec.on:
            return None
        if not getattr(self._backend, "verifies_drafts", False):
            raise ConfigError(f"speculative decoding (--spec-type {spec.type}) needs a sampler that verifies "
                              f"drafts, which the {self._device} backend does not have yet; use --device cpu")
        model = self._make_draft_model(spec.draft_model) if spec.draft_model else None
        draft_masks = self._masks.draft_masks
        return Speculation(spec, self._n_slots, self._n_ctx_slot, self._n_batch, impl=self._impl["drafts"],
                           model=model, constrained_most=0 if draft_masks is None else draft_masks.shape[1])

    def _make_draft_model(self, path: str) -> DraftModel:
        """draft-simple's drafter: the draft model loaded and its vocabulary checked (draft_model.py), the CPU
        forward on its weights with a KV cache of its own, shaped as the engine's and in its cache types (a model
        drafting for itself agrees bit for bit), its pages coming in as they are written."""
        from .backends.cpu.backend import CpuBackend
        draft, cfg = load_draft(path, self._model), self._config
        backend = CpuBackend(draft.config, draft.weights, self._n_slots, self._n_ctx_slot, threads=self._threads,
                             cache_type_k=cfg.cache_type_k, cache_type_v=cfg.cache_type_v, max_tokens=self._n_batch,
                             reuse_logits=True, kv_resident=False)
        return DraftModel(backend, self._n_batch, self._prefill_chunk, name=draft.name)

    def _make_backend(self, backend) -> tuple:
        """(its device: "cpu", "cuda" or "custom" for one handed in, the backend)."""
        if backend is not None:
            if isinstance(backend, type) or not hasattr(backend, "forward"):   # a class or a factory
                backend = backend(self._model.config, self._model.weights, self._n_slots, self._n_ctx_slot)
            # A model pass whose class has forward() alone (a test double, a wrapper that delegates the
            # rest, a benchmark's fixed logits): the host sampler over its forward().
            return "custom", backend if hasattr(type(backend), "step") else HostSampled(backend, self._n_batch)
        cfg, device = self._config, self._config.device
        if device == "auto":            # CUDA when CuPy sees a GPU and runs the model's family, else the CPU
            from .backends.cuda.backend import cuda_status, unsupported_features
            device = "cuda" if cuda_status()[0] and not unsupported_features(self._model.config) else "cpu"
        if device == "cpu":
            from .backends.cpu.backend import CpuBackend
            return "cpu", CpuBackend(self._model.config, self._model.weights, self._n_slots, self._n_ctx_slot,
                                     threads=self._threads, cache_type_k=cfg.cache_type_k,
                                     cache_type_v=cfg.cache_type_v, max_tokens=self._n_batch, reuse_logits=True)
        from .backends.cuda.backend import CupyBackend
        if (cfg.cache_type_k, cfg.cache_type_v) != ("f16", "f16"):
            raise ConfigError(f"the CUDA backend keeps its KV cache in f16; --cache-type-k {cfg.cache_type_k} / "
                              f"--cache-type-v {cfg.cache_type_v} are for the CPU backend (--device cpu)")
        return "cuda", CupyBackend(self._model.config, self._model.weights, self._n_slots, self._n_ctx_slot,
                                   max_tokens=self._n_batch)

    # -- the caller's side (any thread) ------------------------------------------------------

    def submit(self, prompt, *, max_tokens: int = -1, stop=(), seed: int | None = None,
               add_special: bool = True, cache_prompt: bool = True, id_slot: int = -1,
               truncate: bool = False, grammar: str | None = None, json_schema=None,
               constraint: Constraint | None = None, sampling: SamplingParams | None = None,
               speculative=None, **fields) -> TextReader:
        """Queue a request; returns its TextReader at once (text pieces, result(), cancel(); its .reader: the
        token ids). prompt: text or a list of token ids.

        sampling: a SamplingParams made beforehand (checked once, by whoever made it, e.g. the server's
        parse), or instead its fields as keywords (SamplingParams.make's, with seed).
        grammar (GBNF text) or json_schema (a dict or its JSON text): only output it accepts is
        sampled (fastserve/grammar.py); it is compiled here, in the caller's thread. constraint: one
        compiled beforehand (Engine.constraint(), e.g. in a worker thread), for this request alone.
        speculative: its drafting limits, a DraftLimits or a dict of n_max / n_min / p_min over the engine's
        (llama-server's speculative.* fields); they change the speed only, never the output.
        n_probs = n: each token's probabilities are its top n, then, on the host sampler (CPU backend), the
        sampled token's own (id, probability), also when it is not among the n.
        The prompt's token ids, its room in a slot and max_tokens are checked here only (the server leaves
        them to this call). Raises RequestError (bad request; ContextExceeded: a prompt its slot cannot
        hold), ServerBusy (queue full), EngineClosed."""
        if self._closing:
            raise EngineClosed("the engine is closed")
        if constraint is None:
            constraint = self.constraint(grammar, json_schema)
        elif grammar is not None or json_schema is not None:
            raise RequestError("give a compiled constraint or a grammar / json_schema, not both")
        ids = self._prompt_ids(prompt, add_special, truncate)
        if sampling is None:
            params = SamplingParams.make(self._model.config.n_vocab, seed=seed, **fields)
        elif fields or seed is not None:
            raise RequestError("give a SamplingParams or its fields, not both")
        else:
            params = sampling
        if isinstance(stop, str):
            stop = [stop]
        check_max_tokens(max_tokens)
        draft = self._draft_limits(speculative)
        if not -1 <= id_slot < self._n_slots:
            raise RequestError(f"id_slot must be -1 or in [0, {self._n_slots})")
        if len(self._waiting) + len(self._inbox) >= self._max_queue + self._free_slots_hint():
            raise ServerBusy(f"server busy: {self._n_slots} slots running and {self._max_queue} requests waiting")
        # The caller's side (a Reader and its text) and the decode thread's (the Request) share the buffer only.
        job_id = next(request_ids)
        n_cols = params.n_probs + self._own_prob if params.n_probs else 0
        reader = Reader(self._n_ctx_slot, n_cols, on_cancel=partial(self.cancel, job_id),
                        impl=self._impl["delivery"])
        job = Request(job_id, ids, params, max_tokens, reader.buffer, cache_prompt=bool(cache_prompt),
                      id_slot=id_slot, constraint=constraint, draft=draft)
        text = TextReader(reader, self.tokenizer, list(stop), id=job_id, n_prompt=len(ids))
        self._inbox.put(Submit(job))
        if self._closed:                    # the decode thread is gone: nobody else will end it
            self._delivery.reject(job.buffer, FINISH_CLOSED)
            self._delivery.wake()
        return text

    def embed(self, inputs, *, pooling: str = "mean", normalize: int = 2, add_special: bool = True) -> EmbedJob:
        """Queue an embedding job; returns its EmbedJob at once (.result(): per input, float32 [n_embd], or
        [n_tokens, n_embd] with pooling "none"; .future for an event loop). inputs: a list of texts or token
        id lists, each at most a slot's context. pooling: embedding.POOLINGS; normalize: llama.cpp's
        embd_normalize (-1 none, 2 Euclidean, ...; pooled vectors only). Tokenized here, in the caller's
        thread; computed on the decode thread beside the running requests (embedding.py). Raises
        RequestError (ContextExceeded: an input longer than a slot), EngineClosed."""
        if self._closing:
            raise EngineClosed("the engine is closed")
        check_options(pooling, normalize)
        if not isinstance(inputs, (list, tuple)) or not inputs:
            raise RequestError("embedding inputs must be a non-empty list of texts or token id lists")
        return self._side_job(EmbedJob([self._input_ids(x, i, add_special) for i, x in enumerate(inputs)],
                                       pooling, normalize))

    def score(self, prompts, *, top: int = 0, add_special: bool = True) -> ScoreJob:
        """Queue a scoring job; returns its ScoreJob at once (.result(): per prompt, scoring.PromptScores: each
        token's log-probability given the tokens before it, and the top most probable tokens there). prompts:
        a list of texts or token id lists, each at most a slot's context. Computed on the decode thread beside
        the running requests, from position 0 on a KV cache of its own (scoring.py). Raises RequestError
        (ContextExceeded: a prompt longer than a slot), EngineClosed."""
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise RequestError("prompts to score must be a non-empty list of texts or token id lists")
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top < self._model.config.n_vocab:
            raise RequestError(f"top must be an integer in [0, {self._model.config.n_vocab}), got {top!r}")
        return self._side_job(ScoreJob([self._input_ids(x, i, add_special) for i, x in enumerate(prompts)], top))

    def _side_job(self, job):
        """job (EmbedJob, ScoreJob) to the decode thread."""
        if self._closing:
            raise EngineClosed("the engine is closed")
        self._inbox.put(Embed(job))
        if self._closed:                    # the decode thread is gone: nobody else will answer it
            job._done(error=EngineClosed("the engine is closed"))
        return job

    def _input_ids(self, value, index: int, add_special: bool) -> np.ndarray:
        """One embedding (or scored) input's token ids: checked, non-empty, within a slot."""
        if isinstance(value, str):
            ids = self.tokenizer.encode(value, add_special=add_special)
        elif isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            ids = list(value)
            check_token_ids(ids, self._model.config.n_vocab, what=f"input {index}")
        else:
            raise RequestError(f"input {index} must be a string or a list of token ids")
        if not ids:
            raise RequestError(f"input {index} is empty (no tokens)")
        if len(ids) > self._n_ctx_slot:
            raise ContextExceeded(len(ids), self._n_ctx_slot)
        return np.asarray(ids, dtype=np.int32)

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

    def cancel(self, job_id: int) -> None:
        """Stop request job_id (its reader ends 'cancelled' within a step; nothing happens if it ended)."""
        self._inbox.put(Cancel(job_id))

    def erase(self, slot: int, reply=None) -> None:
        """Drop slot's cached prefix without cutting a request: at once when the slot is idle when the
        decode thread gets to it, else as soon as its request ends, before the slot takes another.
        reply(n_erased), if given, is called once from the decode thread then: it must not block.
        snapshot.slot_erased[slot] counts the erasures (and the tokens the last one dropped)."""
        if not 0 <= slot < self._n_slots:
            raise RequestError(f"slot must be in [0, {self._n_slots})")
        self._inbox.put(Erase(slot, reply))

    def constraint(self, grammar=None, json_schema=None, lark=None) -> Constraint | None:
        """The compiled matcher of a GBNF grammar, a JSON schema or a Lark grammar (llguidance's: a reasoning
        budget's) (None for none), for submit(constraint=). Any thread; takes as long as llguidance's compiler
        (it drops the GIL). Raises RequestError."""
        text = compile_grammar(grammar=grammar, json_schema=json_schema, lark=lark)
        return None if text is None else Constraint(self.tokenizer, text)

    def stats(self) -> EngineStats:
        """What the snapshot cannot say, read now from any thread without waiting for the decode thread."""
        tr, masks, pc = self._tracer, self._masks, self._prompt_cache
        trace = () if tr is None else (tr.steps, dict(tr.ns), tr.step_histogram())
        return EngineStats(len(self._inbox), *trace, mask_waits=masks.waits, mask_wait_ns=masks.wait_ns,
                           prompt_cache=None if pc is None else pc.stats())

    def describe(self) -> EngineInfo:
        """The engine's shape and model, read now from any thread (all fixed at start but kv_resident)."""
        info = self._info
        if not info.kv_resident and self._backend.kv_resident():
            info = self._info = replace(info, kv_resident=True)
        return info

    def trace_totals(self) -> dict | None:
        """The tracer's raw running totals (Tracer.totals: GET /trace; two readings give a window), None when off."""
        return None if self._tracer is None else self._tracer.totals()

    def trace_summary(self, since: dict | None = None) -> dict:
        """The tracer's summary (tracer.summarize) of every step, or of those after `since`, a trace_totals()."""
        if self._tracer is None:
            raise RuntimeError("tracing is off: create the Engine with trace=True")
        totals = self._tracer.totals()
        return summarize(totals if since is None else delta(totals, since))

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking requests, finish every reader with 'closed', stop the decode thread (within a step)."""
        self._closing = True
        self._inbox.wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _draft_limits(self, speculative) -> DraftLimits | None:
        """A request's speculative.* limits, checked (RequestError), or None for the engine's."""
        if speculative is None or isinstance(speculative, DraftLimits):
            return speculative
        if not isinstance(speculative, dict):
            raise RequestError(f"speculative must be an object of n_max / n_min / p_min, got {speculative!r}")
        return self._config.speculative.limits.merged(speculative)

    def _free_slots_hint(self) -> int:
        return self._n_slots - self.snapshot.n_running

    def _prompt_ids(self, prompt, add_special: bool, truncate: bool) -> np.ndarray:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special=add_special)
        elif isinstance(prompt, (list, tuple, np.ndarray)) and all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
            ids = [int(t) for t in prompt]
            check_token_ids(ids, self._model.config.n_vocab)
        else:
            raise RequestError("prompt must be a string or a list of token ids")
        if not ids:
            raise RequestError("the prompt is empty")
        if truncate and len(ids) >= self._n_ctx_slot:
            ids = ids[-(self._n_ctx_slot // 2):]
        check_context(len(ids), self._n_ctx_slot)       # ContextExceeded: the server's exceed_context_size_error
        return np.asarray(ids, dtype=np.int32)

    # -- the decode thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closing:
                if not self._step():
                    t0 = time.perf_counter_ns()
                    self._inbox.wait(IDLE_WAIT_S)
                    if self._tracer is not None:
                        self._tracer.idle(time.perf_counter_ns() - t0)
        except BaseException:
            log.exception("decode thread crashed")
            raise
        finally:
            self._shutdown()

    def _step(self) -> bool:
        """One step: schedule → backend step (forward, sync, sample) → commit → deliver → publish. False when
        there was nothing to compute. With tracing on, each phase ends with its lap (tracer.PHASES)."""
        self._admit()                       # schedule: the inbox, then free slots to waiting requests
        plan = self._build()                # schedule: decode tokens first, then prompt chunks
        if plan is not None and (out := self._backend_step()) is not None:
            self._commit(out.ids)           # each id into its slot; self._finish: the requests that end
            self._deliver(plan, out)        # each id into its reader; the requests that ended end
            self._measure_step()
        embedded = self._embed() > 0
        self._publish()                     # the one wake-up of the readers, then the snapshot
        if (plan is not None or embedded) and self._tracer is not None:
            self._tracer.end_step()         # the publish phase ends: the step is counted
        return plan is not None or embedded

    def _embed(self) -> int:
        """The side passes of this step (embeddings, then prompt scores): together at most the prompt budget
        a step of this size leaves (the whole batch when nothing else runs), never fewer than a prompt chunk."""
        busy = [p for p in self._passes.values() if p.busy]
        if not busy:
            return 0
        batch, tracer = self._batch, self._tracer
        budget = max(self._prefill_chunk,
                     prefill_budget(batch.free, batch.n, self._prefill_chunk, self._s_per_token, self._step_target_s))
        if tracer is not None:
            tracer.lap("publish")           # the step's commit and delivery, before the pass
        n = 0
        for side in busy:
            n += side.run(max(budget - n, 1))
        if tracer is not None:
            tracer.lap("forward")           # a side pass is a forward pass of the step
        return n

    def _backend_step(self):
        """The backend's step over the batch; None when it failed (only the batch's requests fail then)."""
        try:
            return self._backend.step(self._batch, None if self._tracer is None else self._tracer.lap,
                                      self._masks.wait if self._masks.n_active else None)
        except Exception as exc:
            log.exception("forward pass failed")
            self._fail_batch(f"forward pass failed: {type(exc).__name__}: {exc}")
            return None

    def _measure_step(self) -> None:
        """The moving average of a step's seconds per token (its build to its delivery), which sizes the next
        prompt chunks."""
        seconds = time.perf_counter() - self._t_build
        cost, prev = seconds / self._batch.n, self._s_per_token
        self._s_per_token = cost if not prev else prev + STEP_COST_WEIGHT * (cost - prev)
        if self._spec is not None:
            self._spec.cost.observe(self._batch.n, seconds)

    def _build(self) -> StepPlan | None:
        """Decode tokens first, then prompt chunks into the batch; a failed fill is rolled back and fails
        only its request. The step's plan, or None when there is nothing to compute."""
        self._t_build = time.perf_counter()
        batch = self._batch
        batch.clear()
        spec = self._spec
        drafted = spec is not None and spec.propose(self._slots, batch.capacity)
        if drafted and self._masks.n_active:        # constrained slots keep the drafts their grammar allows
            drafted = self._masks.draft(spec.drafts, spec.n_draft, spec.k_min)
        if drafted:
            n_decode = self._slots.add_decode(batch, spec.drafts, spec.n_draft)    # + each slot's draft rows
        else:
            n_decode = self._slots.add_decode(batch)
        chunks = []
        budget = prefill_budget(batch.free, batch.n, self._prefill_chunk, self._s_per_token, self._step_target_s)
        for slot in self._slots.prefill_order():
            if budget <= 0:
                break
            mark = batch.mark()
            try:
                n_added = self._slots.add_prefill(batch, slot, budget)
                _faults.check_fill()        # the fault build can fail a fill here (tests/faults)
            except Exception as exc:       # no turn used: the budget stays for the next slots
                batch.rollback(mark)
                log.warning("prompt fill of slot %d failed: %s", slot, exc)
                self._end(slot, FINISH_ERROR, f"prompt processing failed: {exc}")
                continue
            budget -= n_added
            chunks.append((slot, n_added))
        if batch.n == 0:
            return None
        _faults.check_step()        # a test stall is host time: the tracer counts it in build, not forward
        if self._tracer is not None:
            self._tracer.lap("build")
        return StepPlan(n_decode, tuple(chunks))

    def _commit(self, ids) -> None:
        """Each sampled id into its slot; self._finish[r]: how output row r's request ends (0: it goes on)."""
        if self._masks.n_active:
            self._commit_constrained(ids)
        else:
            self._slots.commit(self._batch, ids, self._finish)     # rows after a rejected draft: REJECTED
        if self._batch.n_drafted:
            self._observe_drafts()

    def _observe_drafts(self) -> None:
        """After a step that verified drafts: the policy's estimates, the requests' timings (kept current, so a
        request ended by a stop string has them too), the tracer's counts."""
        spec, slots = self._spec, self._slots
        drafted, accepted = spec.n_drafted, spec.n_accepted
        for s in spec.observe(slots).tolist():
            buf = self._jobs[s].buffer
            buf.draft_n, buf.draft_n_accepted = int(slots.n_drafted[s]), int(slots.n_accepted[s])
        if self._tracer is not None:
            self._tracer.drafts(spec.n_drafted - drafted, spec.n_accepted - accepted)

    def _commit_constrained(self, ids) -> None:
        """The commit with grammar masks: a row whose constraint allowed no token (-1) ends with FINISH_GRAMMAR,
        its reader finished before the step's delivery (so it is sent nothing more) and the row given an
        end-of-generation id for the slot table; the other constrained rows' next masks are then computed
        while the next step's forward pass runs (masks.py)."""
        row_slot = self._batch.row_slot[:self._batch.n_out]
        refused = np.flatnonzero(ids == -1)        # (-2: a row after a rejected draft)
        for r in refused.tolist():
            slot = int(row_slot[r])
            self._delivery.finish(slot, FINISH_GRAMMAR, self._masks.error(slot))
        ids[refused] = self._eog_id
        self._slots.commit(self._batch, ids, self._finish)
        self._finish[refused] = FINISH_GRAMMAR             # _deliver ends their requests
        self._masks.launch(row_slot, ids, self._finish)

    def _deliver(self, plan: StepPlan, out) -> None:
        """The step's tokens into their readers (one pass, fastserve/_delivery.pyx); finished requests end."""
        row_slot, n_out = self._batch.row_slot, self._batch.n_out
        t0 = time.perf_counter_ns()
        if out.probs is not None:
            self._delivery.send_step(row_slot[:n_out], out.ids, out.probs_ids, out.probs)
        else:
            self._delivery.send_step(row_slot[:n_out], out.ids)
        if self._tracer is not None:
            self._tracer.sends(n_out, time.perf_counter_ns() - t0)
        self._tokens_prompt += plan.n_prompt
        self._tokens_generated += n_out - (int(np.count_nonzero(out.ids < 0)) if self._batch.n_drafted else 0)
        finish = self._finish[:n_out]
        for r in np.flatnonzero(finish):
            self._end(int(row_slot[r]), int(finish[r]))

    def _admit(self) -> None:
        for msg in self._inbox.drain():
            self._on_message[type(msg)](self, msg)
        while self._waiting and not self._closing:
            job = self._waiting[0]
            slot = pick_slot(self._slots, job.prompt, id_slot=job.id_slot, cache_prompt=job.cache_prompt,
                             similarity=self._slot_prompt_similarity, reusable=self._window_allows)
            if slot < 0:
                if job.id_slot >= 0:
                    self._waiting.rotate(-1)     # a pinned job waits without blocking the others
                    if all(j.id_slot >= 0 and self._slots.state[j.id_slot] != IDLE for j in self._waiting):
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
                    self._release(slot)
                    self._delivery.reject(job.buffer, FINISH_ERROR, f"admission failed: {exc}")
        if self._tracer is not None:
            self._tracer.lap("admit")

    def _start(self, job: Request, slot: int) -> None:
        n_cached = min(slot_prefix(self._slots, slot, job.prompt), len(job.prompt) - 1) if job.cache_prompt else 0
        n_cached = self._window_reusable(slot, n_cached)
        max_gen = job.max_tokens if job.max_tokens >= 0 else self._n_ctx_slot
        if max_gen == 0:                        # nothing to run: the request never holds the slot
            self._delivery.reject(job.buffer, FINISH_LENGTH)
            return
        self._backend.configure(slot, job.sampling, job.prompt, constrained=job.constraint is not None)
        if job.constraint is not None:
            self._masks.start(slot, job.constraint)
        if self._prompt_cache is not None:      # it writes the slot's KV: nothing that can fail comes after it
            n_cached = self._swap_prefix(slot, job, n_cached)
        self._seq += 1
        self._slots.start(slot, job.prompt, n_cached, max_gen, self._seq)
        if self._spec is not None:
            self._spec.start(slot, job.draft, constrained=job.constraint is not None)
        self._delivery.attach(slot, job.buffer, n_cached)      # the reader learns its slot and n_cached
        self._jobs[slot] = job

    def _swap_prefix(self, slot: int, job: Request, n_cached: int) -> int:
        """The host-RAM cache at admission: keep the slot's prefix before the new prompt overwrites it,
        and bring back a longer prefix of the prompt when the cache holds one. Returns the new n_cached.
        Neither copy can fail the request: a refused save is logged, a failed restore computes instead."""
        pc, prompt = self._prompt_cache, job.prompt
        entry, n_hit = pc.lookup(prompt, len(prompt) - 1) if job.cache_prompt else (None, 0)
        n_hit = min(n_hit, len(prompt) - 1)
        n_old = int(self._slots.n_tokens[slot])
        if n_old > slot_prefix(self._slots, slot, prompt):
            pc.save(slot, self._slots.tokens[slot, :n_old], keep=entry if n_hit > n_cached else None)
        if n_hit > n_cached and pc.restore(entry, slot, n_cached, n_hit):
            return self._window_reusable(slot, n_hit) or self._window_reusable(slot, n_cached)
        return n_cached

    def _window_reusable(self, slot: int, n: int) -> int:
        """n, or 0 when the slot's sliding-window ring no longer holds the window before position n."""
        return n if self._window_allows(slot, n) else 0

    def _window_allows(self, slot: int, n: int) -> bool:
        """Whether slot's KV serves a continuation after its first n tokens (always, without a window)."""
        return n >= self._backend.kv_reuse_from(slot, n)

    def _end(self, slot: int, code: int, error: str | None = None) -> None:
        """Finish the slot's request, detach its reader, free the slot (its KV prefix stays reusable)."""
        job = self._jobs[slot]
        if job is None:
            return
        self._delivery.finish(slot, code, error)
        self._delivery.detach(slot)
        self._release(slot)
        self._jobs[slot] = None
        if slot in self._erase_on_end:
            self._forget(slot, self._erase_on_end.pop(slot))

    def _release(self, slot: int) -> None:
        """Free the slot and its grammar mask (if any); what of its KV prefix a next prompt can reuse is
        recorded for /slots."""
        self._slots.release(slot)
        self._backend.release(slot)
        self._masks.end(slot)
        self._reuse_from[slot] = self._backend.kv_reuse_from(slot, int(self._slots.n_tokens[slot]))

    def _cancel(self, job_id: int) -> None:
        for slot, job in enumerate(self._jobs):
            if job is not None and job.id == job_id:
                self._end(slot, FINISH_CANCELLED)
                return
        for job in self._waiting:
            if job.id == job_id:
                self._waiting.remove(job)
                self._delivery.reject(job.buffer, FINISH_CANCELLED)
                return

    def _on_submit(self, msg: Submit) -> None:
        self._waiting.append(msg.job)

    def _on_cancel(self, msg: Cancel) -> None:
        self._cancel(msg.job_id)

    def _on_embed(self, msg: Embed) -> None:
        kind = type(msg.job)
        if kind not in self._passes:
            what, make = self._make_pass[kind]
            try:
                self._passes[kind] = getattr(self, make)()
            except Exception as exc:       # contained: this job fails (the next one tries again), the engine goes on
                log.exception("the pass of %s could not be made", what)
                msg.job._done(error=RequestError(f"{what} are not available: {type(exc).__name__}: {exc}"))
                return
        self._passes[kind].add(msg.job)

    def _make_embedder(self) -> Embedder:
        """The embedding pass: the CPU forward on the model's weights with a KV cache of its own (on any device:
        the CUDA backend has no hidden-state pass yet), EMBED_SLOTS slots of a slot's context whose pages come in
        only as inputs reach them (a short input costs its own rows, not the cache's size)."""
        from .backends.cpu.backend import CpuBackend
        cfg = self._config
        backend = CpuBackend(self._model.config, self._model.weights, EMBED_SLOTS, self._n_ctx_slot,
                             threads=self._threads, cache_type_k=cfg.cache_type_k, cache_type_v=cfg.cache_type_v,
                             max_tokens=self._n_batch, kv_resident=False)
        return Embedder(backend, self._n_batch)

    def _make_scorer(self) -> Scorer:
        """The scoring pass: the CPU forward as the embedding pass's, its logits rows kept (SCORE_ROWS a pass)."""
        from .backends.cpu.backend import CpuBackend
        cfg = self._config
        backend = CpuBackend(self._model.config, self._model.weights, SCORE_SLOTS, self._n_ctx_slot,
                             threads=self._threads, cache_type_k=cfg.cache_type_k, cache_type_v=cfg.cache_type_v,
                             max_tokens=SCORE_ROWS, reuse_logits=True, kv_resident=False)
        return Scorer(backend, SCORE_ROWS)

    _make_pass = {EmbedJob: ("embeddings", "_make_embedder"), ScoreJob: ("prompt scores", "_make_scorer")}

    def _on_erase(self, msg: Erase) -> None:
        if self._jobs[msg.slot] is None:
            self._forget(msg.slot, [msg.reply])
        else:
            self._erase_on_end.setdefault(msg.slot, []).append(msg.reply)

    _on_message = {Submit: _on_submit, Cancel: _on_cancel, Erase: _on_erase, Embed: _on_embed}

    def _forget(self, slot: int, replies) -> None:
        """Drop an idle slot's cached prefix; counted in snapshot.slot_erased; each reply gets the tokens dropped."""
        n_erased = int(self._slots.n_tokens[slot])
        self._erased[slot] = (self._erased[slot][0] + 1, n_erased)
        self._slots.forget(slot)
        self._reuse_from[slot] = 0
        for reply in replies:
            if reply is not None:
                reply(n_erased)

    def _fail_batch(self, error: str) -> None:
        for slot in sorted(set(self._batch.view()[2].tolist())):
            self._end(int(slot), FINISH_ERROR, error)

    def _publish(self) -> None:
        """End of a step: the one wake-up of the consumer side, then the snapshot."""
        self._delivery.wake()
        self.snapshot = self._make_snapshot(self.snapshot.step + 1)

    def _make_info(self) -> EngineInfo:
        be, m = self._backend, self._model
        # A backend handed in (tests, benchmarks) may hold no KV cache of its own.
        kv_bytes, kv_resident = (be.kv_bytes(), be.kv_resident()) if hasattr(be, "kv_bytes") else (0, True)
        return EngineInfo(
            n_slots=self._n_slots, n_ctx_slot=self._n_ctx_slot, n_batch=self._n_batch, n_vocab=m.config.n_vocab,
            n_embd=m.config.n_embd, model_info=_scalars(getattr(m, "metadata", {})),
            threads=self._threads, device=self._device, samples_on_device=be.samples_on_device,
            cache_type_k=self._config.cache_type_k, cache_type_v=self._config.cache_type_v,
            window=m.config.sliding_window, ring=getattr(be, "kv_ring", 0),
            kv_bytes=kv_bytes, kv_resident=kv_resident, isa=getattr(be, "isa", ""),
            speculative=self._config.speculative,
            model_name=getattr(m, "name", "model"), model_path=str(getattr(m, "path", "")),
            model_summary=(m.load_summary() if hasattr(m, "load_summary") else "") + self._spec_summary())

    def _spec_summary(self) -> str:
        """Speculative decoding in the start line (the draft model named, as llama-server's log does)."""
        spec = self._config.speculative
        if not spec.on:
            return ""
        lim = spec.limits
        return (f"; speculative decoding {spec.type}" + (f" with draft model {spec.draft_model}" if spec.draft_model
                                                          else "") + f" (n_max {spec.most}, n_min {lim.n_min}, "
                f"p_min {lim.p_min:g})")

    def _make_snapshot(self, step: int) -> Snapshot:
        n_running = sum(j is not None for j in self._jobs)
        n_waiting = len(self._waiting)
        embedding = any(p.busy for p in self._passes.values())
        return Snapshot(step=step, t_step=time.monotonic(),
                        busy=bool(n_running or n_waiting or len(self._inbox) or embedding),
                        n_running=n_running, n_waiting=n_waiting,
                        slot_state=tuple(self._slots.state.tolist()), slot_tokens=tuple(self._slots.n_tokens.tolist()),
                        slot_past=tuple(self._slots.n_past.tolist()),
                        slot_job=tuple(0 if j is None else j.id for j in self._jobs),
                        tokens_generated=self._tokens_generated, tokens_prompt=self._tokens_prompt,
                        slot_erased=tuple(self._erased), slot_reuse_from=tuple(self._reuse_from),
                        **self._draft_snapshot())

    def _draft_snapshot(self) -> dict:
        spec = self._spec
        if spec is None:
            return {}
        return dict(slot_drafts=tuple(zip(self._slots.n_drafted.tolist(), self._slots.n_accepted.tolist())),
                    n_drafted=spec.n_drafted, n_drafted_accepted=spec.n_accepted, n_draft_verified=spec.n_verified,
                    draft_histogram=tuple(spec.histogram))

    def _shutdown(self) -> None:
        """Decode thread exit: every reader, running, waiting or still in the inbox, ends 'closed'."""
        self._closing = True
        closed = EngineClosed("the engine is closed")
        for msg in self._inbox.drain():
            if type(msg) is Submit:
                self._waiting.append(msg.job)
            elif type(msg) is Embed:
                msg.job._done(error=closed)
        for side in self._passes.values():
            side.close(closed)
        for job in self._waiting:
            self._delivery.reject(job.buffer, FINISH_CLOSED)
        self._waiting.clear()
        for slot in range(self._n_slots):
            self._jobs[slot] = None
        self._delivery.close()
        self._masks.close()
        self._closed = True
        self._publish()
