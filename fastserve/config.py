"""Settings as frozen data, validated once, where they are made: SamplingParams (one request) and
EngineConfig (one engine). Every default the engine, the CLI and the server share is stated here, once.

    SamplingParams.make(n_vocab, temperature=0, seed=7, ...)   # a request's sampling, checked and normalized
    EngineConfig(n_parallel=8, n_ctx=8192, ...)                # an engine's settings, checked
    Engine(model, EngineConfig(...)) or Engine(model, n_parallel=8, ...)

This module imports no extension (the CLI parses its flags with it before anything is loaded).
"""
from __future__ import annotations

import math
import operator
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Optional

import numpy as np

from .errors import ContextExceeded, RequestError

MAX_N_PROBS = 100               # most top-N probabilities a request may ask for per token (llama-server's cap)
MAX_PENALTY_WINDOW = 256        # most tokens of history a request's penalties may look back on (repeat_last_n)
MAX_LOGIT_BIAS = 256            # most logit_bias entries per request
DEFAULT_BODY_LIMIT = 2 << 20    # bytes: the largest HTTP request body (--body-limit)
DEVICES = ("cpu", "cuda", "auto")
_MASK64 = (1 << 64) - 1


def random_seed() -> int:
    return int.from_bytes(os.urandom(8), "little")


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling, as the backend's sampler applies it (fastserve/ref/sampling.py states the
    chain). Defaults are llama-server's. Made through make(), which checks and normalizes: top_k within
    the vocabulary (0: off), repeat_last_n within MAX_PENALTY_WINDOW (-1 became the whole window),
    logit_bias as ((token id, bias), ...), seed a definite uint64 (random when not given)."""
    temperature: float = 0.8            # <= 0: greedy
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple = ()
    n_probs: int = 0                    # top-N probabilities returned per token (0: none)
    post_sampling_probs: bool = False
    seed: int = 0

    @classmethod
    def make(cls, n_vocab: int, *, seed: Optional[int] = None, max_penalty_window: int = MAX_PENALTY_WINDOW,
             max_logit_bias: int = MAX_LOGIT_BIAS, **given) -> "SamplingParams":
        """The checked parameters of a request; fields not given take the defaults above; seed None or -1:
        a random one. Raises RequestError naming the field to change."""
        unknown = set(given) - set(SAMPLING_DEFAULTS)
        if unknown:
            raise RequestError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        n_probs = given.get("n_probs", 0)
        if isinstance(n_probs, int) and n_probs > MAX_N_PROBS:
            raise RequestError(f"n_probs must be at most {MAX_N_PROBS}")
        cfg = check_sampling(n_vocab, max_penalty_window, max_logit_bias, history=(),
                             seed=random_seed() if seed is None or seed == -1 else seed,
                             **{**SAMPLING_DEFAULTS, **given})
        del cfg["history"]                  # the prompt becomes the penalty history at admission
        cfg["logit_bias"] = tuple(cfg["logit_bias"])
        return cls(**cfg)

    def kwargs(self) -> dict:
        """The fields as keyword arguments (Sampler.configure's; logit_bias as a dict)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["logit_bias"] = dict(self.logit_bias)
        return out

    def slot_config(self, history) -> dict:
        """The parameters as check_sampling returns them, with the last repeat_last_n ids of history (ids
        already checked: a prompt the engine tokenized or range-checked) as the penalty history: what a
        sampler's configure_checked() takes, so that a request's sampling is checked once, at make()."""
        n = self.repeat_last_n
        cfg = self.kwargs()
        cfg["logit_bias"] = list(self.logit_bias)
        cfg["history"] = [int(t) for t in history[max(0, len(history) - n):]] if n else []
        return cfg

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


# The defaults of the fields a request may set (seed aside), by name: llama-server's.
SAMPLING_DEFAULTS = {k: v for k, v in asdict(SamplingParams()).items() if k != "seed"}
SAMPLING_DEFAULTS["logit_bias"] = None


SPEC_TYPES = ("none", "ngram-simple", "ngram-mod", "draft-simple")     # speculative decoding's drafters (--spec-type)
DRAFT_N_MAX = 16        # the most tokens a draft model proposes per step, --spec-draft-n-max unset (llama-server's)
DRAFT_P_MIN = 0.75      # a draft model's least top probability drafted, --spec-draft-p-min unset (llama-server's)


@dataclass(frozen=True)
class DraftLimits:
    """How much a slot drafts per step (speculative decoding; llama-server's --spec-draft-n-max / -n-min /
    -p-min and a request's speculative.n_max / n_min / p_min): at most n_max tokens (None: the drafter's own
    most), none when fewer than n_min would be drafted, and only positions whose estimated chance of being
    accepted is at least p_min (fastserve/speculation.py; a draft model's: its own top probability)."""
    n_max: Optional[int] = None
    n_min: int = 0
    p_min: float = 0.0

    def __post_init__(self):
        for name in ("n_max", "n_min"):
            v = getattr(self, name)
            if v is None and name == "n_max":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise RequestError(f"speculative.{name} must be an integer >= 0, got {v!r}")
        if self.n_max is not None and self.n_max < self.n_min:
            raise RequestError(f"speculative.n_max ({self.n_max}) must be >= speculative.n_min ({self.n_min})")
        if isinstance(self.p_min, bool) or not isinstance(self.p_min, (int, float)) \
                or not 0.0 <= self.p_min <= 1.0:
            raise RequestError(f"speculative.p_min must be a number in [0, 1], got {self.p_min!r}")

    def merged(self, given: Mapping) -> "DraftLimits":
        """These limits with a request's speculative.* fields (n_max, n_min, p_min) over them, checked."""
        unknown = set(given) - {"n_max", "n_min", "p_min"}
        if unknown:
            raise RequestError(f"unknown speculative field(s): {', '.join(sorted(unknown))}; known: n_max, "
                               f"n_min, p_min")
        return replace(self, **given)


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding of one engine (llama-server's --spec-* flags; "none": off). ngram-simple looks
    up the last simple_size_n tokens and drafts up to simple_size_m of what followed them
    (simple_min_hits is llama-server's, which its ngram-simple does not read either); ngram-mod chains
    mod_n_match-token lookups, proposing mod_n_min..mod_n_max tokens; draft-simple: draft_model, the path of a
    GGUF model of the same vocabulary, proposes greedily (fastserve/draft_model.py). limits: the server's
    DraftLimits."""
    type: str = "none"
    limits: DraftLimits = DraftLimits()
    draft_model: str = ""
    simple_size_n: int = 12
    simple_size_m: int = 48
    simple_min_hits: int = 1
    mod_n_match: int = 24
    mod_n_min: int = 48
    mod_n_max: int = 64

    def __post_init__(self):
        if self.type not in SPEC_TYPES:
            raise ValueError(f"--spec-type {self.type!r}: fastserve has {', '.join(SPEC_TYPES)}")
        for name, lo, hi in (("simple_size_n", 1, 1024), ("simple_size_m", 1, 1024), ("simple_min_hits", 1, None),
                             ("mod_n_match", 1, 1024), ("mod_n_min", 0, 1024), ("mod_n_max", 0, 1024)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo or (hi is not None and v > hi):
                flag = "--spec-ngram-" + name.replace("simple_", "simple-").replace("mod_", "mod-").replace("_", "-")
                raise ValueError(f"{flag} must be an integer in [{lo}, {hi if hi is not None else 'inf'}], "
                                 f"got {v!r}")
        if self.mod_n_max < self.mod_n_min:
            raise ValueError(f"--spec-ngram-mod-n-max ({self.mod_n_max}) must be >= --spec-ngram-mod-n-min "
                             f"({self.mod_n_min})")
        if (self.type == "draft-simple") != bool(self.draft_model):
            raise ValueError(f"--spec-draft-model {self.draft_model} drafts with --spec-type draft-simple, not "
                             f"{self.type}" if self.draft_model else
                             "--spec-type draft-simple needs a draft model: --spec-draft-model FILE (-md)")

    @property
    def on(self) -> bool:
        return self.type != "none"

    def drafter(self) -> dict:
        """The n-gram drafter's arguments (fastserve._drafts.Drafter's, after n_slots and n_ctx_slot)."""
        if self.type == "ngram-simple":
            return dict(kind=self.type, size_n=self.simple_size_n, size_m=self.simple_size_m, n_min=0)
        return dict(kind=self.type, size_n=self.mod_n_match, size_m=0, n_min=self.mod_n_min)

    @property
    def most(self) -> int:
        """The most tokens the drafter proposes in one step."""
        top = {"ngram-simple": self.simple_size_m, "draft-simple": DRAFT_N_MAX}.get(self.type, self.mod_n_max)
        return top if self.limits.n_max is None else min(top, self.limits.n_max)


@dataclass(frozen=True)
class EngineConfig:
    """One engine's settings (llama-server's flags in brackets).

    n_parallel slots [-np] share n_ctx tokens of KV [-c] (n_ctx // n_parallel each); a step carries at
    most n_batch tokens [-b], decode tokens first, prompts in chunks of at least prefill_chunk; at most
    max_queue requests wait for a slot. device: where the model math runs ("cpu", "cuda", "auto": cuda
    when CuPy sees a GPU). threads: threads of the CPU step [-t] (0: every core). cache_ram_mib: host RAM
    keeping reused slots' prefixes [--cache-ram] (0: off); slot_prompt_similarity: the share of a prompt
    a free slot's cached prefix must exceed for that slot to be picked [-sps]. cache_type_k/v: the CPU
    backend's KV types [-ctk/-ctv]; the CUDA backend keeps f16. trace: time every phase of a step.
    speculative: speculative decoding (SpecConfig; [--spec-type], off by default).
    """
    n_parallel: int = 8
    n_ctx: int = 8192
    n_batch: int = 512
    max_queue: int = 256
    device: str = "cpu"
    threads: int = 0
    prefill_chunk: int = 32
    cache_ram_mib: float = 0.0
    slot_prompt_similarity: float = 0.1
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    trace: bool = False
    speculative: SpecConfig = SpecConfig()

    def __post_init__(self):
        if self.n_parallel < 1 or self.n_batch < 1 or self.max_queue < 0:
            raise ValueError("n_parallel and n_batch must be >= 1, max_queue >= 0")
        if self.n_ctx // self.n_parallel < 2:
            raise ValueError(f"n_ctx={self.n_ctx} leaves less than 2 tokens per slot for n_parallel={self.n_parallel}")
        if self.device == "numpy":
            object.__setattr__(self, "device", "cpu")
        if self.device not in DEVICES:
            raise ValueError(f"unknown backend {self.device!r}; known: cpu, cuda, auto")
        if self.threads is None or self.threads < 0:
            object.__setattr__(self, "threads", 0)
        object.__setattr__(self, "prefill_chunk", max(1, self.prefill_chunk))
        if self.cache_ram_mib < 0:
            raise ValueError("--cache-ram must be >= 0 MiB (0: off)")

    @property
    def n_ctx_slot(self) -> int:
        """Tokens of context each slot holds."""
        return self.n_ctx // self.n_parallel

    def replace(self, **changes) -> "EngineConfig":
        return replace(self, **changes)

    @classmethod
    def from_flags(cls, args, **overrides) -> "EngineConfig":
        """The settings of a parsed command line (argparse's names); a flag a subcommand lacks, or left
        unset (None), keeps the default; overrides win."""
        given = {field: getattr(args, flag) for field, flag in FLAGS.items() if getattr(args, flag, None) is not None}
        return cls(**{**given, **overrides})


# EngineConfig field -> the command line's argparse name (llama-server's flag: -np, -c, -b, ...)
FLAGS = dict(n_parallel="parallel", n_ctx="ctx_size", n_batch="batch_size", device="device", threads="threads",
             max_queue="max_queue", cache_ram_mib="cache_ram", slot_prompt_similarity="slot_prompt_similarity",
             cache_type_k="cache_type_k", cache_type_v="cache_type_v")


# -- the checks -----------------------------------------------------------------------------------------

def check_token_ids(ids, n_vocab: int, what: str = "prompt") -> None:
    """Every id in the vocabulary: a prompt's (Engine.submit), /tokenize's."""
    bad = next((t for t in ids if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise RequestError(f"{what} token ids must be in [0, {n_vocab}), got {bad}")


def check_context(n_prompt: int, n_ctx_slot: int) -> None:
    """A prompt must leave its slot room for one token (llama-server's exceed_context_size_error)."""
    if n_prompt >= n_ctx_slot:
        raise ContextExceeded(n_prompt, n_ctx_slot)


def check_max_tokens(max_tokens) -> None:
    """The tokens to generate: -1 (until the slot is full) or a count (llama-server's n_predict)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < -1:
        raise RequestError(f"max_tokens (n_predict) must be an integer >= -1 (-1: until the context is full), "
                           f"got {max_tokens!r}")


def check_fits(cfg: dict, max_penalty_window: int, max_logit_bias: int, what: str = "this sampler") -> None:
    """A checked configuration (SamplingParams.slot_config) against a sampler's capacities: the one check
    its configure_checked() repeats."""
    if cfg["repeat_last_n"] > max_penalty_window or len(cfg["logit_bias"]) > max_logit_bias \
            or len(cfg["history"]) > cfg["repeat_last_n"]:
        raise RequestError(f"repeat_last_n and logit_bias must fit {what} ({max_penalty_window}, {max_logit_bias})")


def _number(name, value):
    try:
        return float(value)
    except (TypeError, ValueError):
        raise RequestError(f"{name} must be a number, got {value!r}") from None


def _integer(name, value):
    try:
        return operator.index(value)
    except TypeError:
        raise RequestError(f"{name} must be an integer, got {value!r}") from None


def check_sampling(n_vocab, max_penalty_window, max_logit_bias, *, temperature, top_k, top_p, min_p,
                   repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty, seed,
                   logit_bias, n_probs, post_sampling_probs, history):
    """Validate one request's sampling parameters; return them normalized as a dict.

    Shared by both samplers (fastserve._sampling and its twin) and SamplingParams.make, so that they
    accept and refuse exactly the same things. Raises RequestError with a message saying what to change.
    """
    temperature = _number("temperature", temperature)
    if not math.isfinite(temperature):
        raise RequestError(f"temperature must be finite, got {temperature}")
    top_k = _integer("top_k", top_k)
    top_k = 0 if top_k <= 0 else min(top_k, n_vocab)
    top_p = _number("top_p", top_p)
    if not 0.0 <= top_p <= 1.0:
        raise RequestError(f"top_p must be in [0, 1], got {top_p}")
    min_p = _number("min_p", min_p)
    if not 0.0 <= min_p <= 1.0:
        raise RequestError(f"min_p must be in [0, 1], got {min_p}")
    repeat_penalty = _number("repeat_penalty", repeat_penalty)
    if not (math.isfinite(repeat_penalty) and repeat_penalty > 0.0):
        raise RequestError(f"repeat_penalty must be finite and > 0 (1.0 disables it), got {repeat_penalty}")
    presence_penalty = _number("presence_penalty", presence_penalty)
    frequency_penalty = _number("frequency_penalty", frequency_penalty)
    for name, v in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not math.isfinite(v):
            raise RequestError(f"{name} must be finite, got {v}")
    repeat_last_n = _integer("repeat_last_n", repeat_last_n)
    if repeat_last_n == -1:
        repeat_last_n = max_penalty_window
    if not 0 <= repeat_last_n <= max_penalty_window:
        raise RequestError(f"repeat_last_n must be -1 (the whole window), 0 (off) or up to "
                           f"max_penalty_window={max_penalty_window}, got {repeat_last_n}")
    seed = _integer("seed", seed)
    if not 0 <= seed <= _MASK64:
        raise RequestError(f"seed must be in [0, 2**64), got {seed}")
    bias = []
    if logit_bias is not None:
        if not isinstance(logit_bias, Mapping):
            raise RequestError(f"logit_bias must be a dict {{token_id: bias}}, got {type(logit_bias).__name__}")
        if len(logit_bias) > max_logit_bias:
            raise RequestError(f"logit_bias has {len(logit_bias)} entries, at most "
                               f"max_logit_bias={max_logit_bias} are allowed")
        for tok, b in logit_bias.items():
            tok = _integer("logit_bias token id", tok)
            if not 0 <= tok < n_vocab:
                raise RequestError(f"logit_bias token id {tok} is outside the vocabulary [0, {n_vocab})")
            b = _number(f"logit_bias[{tok}]", b)
            if math.isnan(b):
                raise RequestError(f"logit_bias[{tok}] is NaN")
            bias.append((tok, b))
    n_probs = _integer("n_probs", n_probs)
    if not 0 <= n_probs <= n_vocab:
        raise RequestError(f"n_probs must be in [0, {n_vocab}], got {n_probs}")
    if not isinstance(post_sampling_probs, (bool, np.bool_)):
        raise RequestError(f"post_sampling_probs must be a bool, got {post_sampling_probs!r}")
    try:
        hist = np.asarray(history if history is not None else (), dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError):
        raise RequestError("history must be a sequence of token ids") from None
    if hist.size and (hist.min() < 0 or hist.max() >= n_vocab):
        raise RequestError(f"history holds token ids outside the vocabulary [0, {n_vocab})")
    kept = [int(t) for t in hist[max(0, hist.size - repeat_last_n):]] if repeat_last_n else []
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                seed=seed, logit_bias=bias, n_probs=n_probs,
                post_sampling_probs=bool(post_sampling_probs), history=kept)
