"""One parse of a generation request: a /completion, /v1/completions or /v1/chat/completions body →
Params (the prompts as token ids, one checked SamplingParams, the limits, the answer's shape). What
llama-server's params_from_json_cmpl does, each field read and each value checked once:

    fields.Body            the field's JSON type ("'top_p' must be a number")
    SamplingParams.make    every sampling value (config.check_sampling): ranges, seed, n_probs, logit_bias ids
    here                   the prompt's form and its text's length before it is tokenized, choices, limits,
                           constraints, the fields fastserve cannot honour
    Engine.submit          the prompt's token ids, its room in a slot, max_tokens: the engine's own checks,
                           run once per choice (errors.refused answers them, llama-server's way)

A sampling field a request leaves out takes the server's default (ServerConfig.sampling: --temp, --top-k,
...; else SamplingParams' own). Unknown fields are ignored, as llama-server and OpenAI do.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from ..config import DraftLimits, SamplingParams
from ..errors import RequestError
from . import reasoning
from .errors import HttpError, exceeded
from .fields import Body, kind, parse_object
from .tools import ToolPlan, chat_messages, response_format, tool_plan, with_tools

# A request's sampling fields (SamplingParams' names, llama-server's) and the JSON type of each.
SAMPLING = {"temperature": Body.number, "top_k": Body.int, "top_p": Body.number, "min_p": Body.number,
            "repeat_penalty": Body.number, "repeat_last_n": Body.int, "presence_penalty": Body.number,
            "frequency_penalty": Body.number}
# the fields another API's request (anthropic_api, responses_api) hands the chat's parse as they are
PASSED_TO_CHAT = (*SAMPLING, "seed", "logit_bias", "ignore_eos", "queue_timeout", "request_timeout", "token_timeout",
                  "stream", "thinking_budget_tokens", "reasoning_format", "chat_template_kwargs")
# A request's speculative decoding limits (llama-server's "speculative.n_max", ...: flat names with a dot).
SPECULATIVE = {"n_max": Body.int, "n_min": Body.int, "p_min": Body.number}
SAMPLER_CHAIN = ["penalties", "top_k", "top_p", "min_p", "temperature"]      # fastserve's, in llama.cpp's names
OFF_SAMPLERS = ("dry", "top_n_sigma", "typ_p", "xtc", "adaptive_p")          # llama.cpp's, all off in fastserve


def prob_pool(shown: int, sampling: SamplingParams) -> int:
    """How many probabilities the engine reports per token so that the sampled token's own is among them."""
    if sampling.temperature <= 0:
        return shown
    k = sampling.top_k
    return max(shown, k if 0 < k <= PROB_POOL else PROB_POOL)


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# llama-server's request fields that fastserve has no such thing for: the value its generation settings
# show (None: not shown), the test of its "off" value, and why. A request that turns one on is refused
# (400), never answered as if it had been applied. (Their companions - dry_base, mirostat_tau,
# xtc_threshold, dynatemp_exponent ... - do nothing while these are off, in llama-server too.)
NOT_SUPPORTED = {
    "dynatemp_range": (0.0, lambda v: _num(v) and v == 0, "no dynamic temperature"),
    "top_n_sigma": (-1.0, lambda v: _num(v) and v <= 0, "no top-n-sigma sampler"),
    "xtc_probability": (0.0, lambda v: _num(v) and v == 0, "no XTC sampler"),
    "typical_p": (1.0, lambda v: _num(v) and v >= 1, "no locally typical sampler"),
    "dry_multiplier": (0.0, lambda v: _num(v) and v == 0, "no DRY sampler"),
    "mirostat": (0, lambda v: _num(v) and v == 0, "no Mirostat"),
    "adaptive_target": (None, lambda v: _num(v) and v < 0, "no adaptive-p sampler"),
    "min_keep": (0, lambda v: _num(v) and v == 0, "no minimum of kept candidates"),
    "n_cmpl": (None, lambda v: _num(v) and v == 1, "one completion per prompt (send the prompt several times, "
                                                   "or use /v1/chat/completions' n)"),
    "n_indent": (None, lambda v: _num(v) and v == 0, "no indentation rule"),
    "t_max_predict_ms": (None, lambda v: _num(v) and v <= 0, "no prediction time limit: see request_timeout"),
    "n_cache_reuse": (None, lambda v: _num(v) and v == 0, "no KV shifting: a slot's common prefix is reused"),
    "return_progress": (None, lambda v: v is False, "no prompt progress events"),
    "lora": (None, lambda v: v == [], "no LoRA adapters"),
}

# A text longer than 16 characters per slot token cannot fit: it is not tokenized whole (tokenizing holds the
# GIL, ~0.9 us a character), only its first EXACT_CHARS, to estimate its size in llama-server's refusal. Up to
# EXACT_CHARS (~60 ms), a text is always tokenized: a small slot's refusal counts its tokens exactly.
PROMPT_CHARS_PER_TOKEN = 16
EXACT_CHARS = 65536
MAX_PROMPTS = 16                # prompts in one request (each takes a slot)
MAX_CHOICES = 16                # OpenAI's n x prompts per request (each takes a slot)
MAX_TOP_LOGPROBS = 20           # OpenAI's cap of chat's top_logprobs; vLLM's of /v1/completions' logprobs
                                # (OpenAI's is 5 there: Ollama's raw /api/generate passes top_logprobs up to 20)
# Probabilities (n_probs, logprobs): the engine reports the top-N of each step and, on the host sampler, the
# sampled token's own entry after them (llama-server's is never missing). The CUDA sampler gives no own entry: the
# token's is looked up among the N, which cover what sampling can pick there: top_k tokens, PROB_POOL when top_k is
# off or larger (a token sampled beyond those reads 0 / -9999.0 on CUDA), and at least the n shown; greedy picks
# the first.
PROB_POOL = 64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TIMEOUT_S = 86400.0
MAX_BIAS_ENTRIES = 1024         # logit_bias pairs in one request (the sampler takes at most 256 tokens)
MAX_BIAS_TEXT = 256             # characters of one logit_bias text (tokenized on the event loop)
# the fields naming how many tokens to generate, first found wins (absent: --n-predict)
MAX_TOKENS = {"llama": ("n_predict", "max_tokens"), "openai": ("max_completion_tokens", "max_tokens")}


class Limits(NamedTuple):
    """A request's time limits (queue_timeout, request_timeout, token_timeout), seconds; 0 means no limit."""
    queue: float
    total: float
    token: float


@dataclass(frozen=True)
class Params:
    """What one request asks for, parsed and checked: llama-server's slot_params."""
    prompts: list                   # each prompt's token ids (Engine.submit checks their range and length)
    sampling: SamplingParams        # checked; its seed is the first choice's (drawn when the request gave none)
    seed: int | None                # as given (None: drawn), for the generation settings
    max_tokens: int                 # -1: until the slot is full; at most a slot's context (Engine.submit checks it)
    stop: list
    limits: Limits
    constraint: dict                # grammar or json_schema for App.compile ({}: none)
    stream: bool = False
    n: int = 1                      # choices of each prompt (OpenAI's n)
    ignore_eos: bool = False
    cache_prompt: bool = True
    id_slot: int = -1
    speculative: object = None      # config.DraftLimits of the request's speculative.* fields (None: the server's)
    # the answer's shape
    texts: tuple = ()               # /completion, an echo: each prompt's text, None for ids (decoded once
                                    # the engine took them): its answer's "prompt"
    return_tokens: bool = False
    timings_per_token: bool = False
    response_fields: tuple = ()     # /completion: the paths its answer keeps ("a/b" reaches into objects)
    include_usage: bool = False     # OpenAI streams: a last chunk with the usage
    logprobs: int | None = None     # OpenAI: alternatives shown per token (None: no logprobs)
    echo: bool = False              # /v1/completions: the prompt before the completion (its tokens scored when
                                    # logprobs is asked; max_tokens 0: the prompt alone)
    shown_probs: int | None = None  # /completion: n_probs as asked (sampling.n_probs may be more: prob_pool)
    tools: ToolPlan | None = None
    messages: tuple = ()            # a chat's, for its template (Parser.conversation makes its prompt)
    reasoning: "reasoning.Reasoning | None" = None      # a reasoning chat's plan (server/reasoning.py)
    template_kwargs: dict | None = None                 # a chat's further template variables

    def choices(self) -> list[tuple[list, SamplingParams]]:
        """(prompt ids, sampling) of each generation, prompt by prompt: choice i of a prompt is seeded
        with seed + i, so that the choices differ."""
        s = self.sampling
        return [(ids, s if i == 0 else replace(s, seed=(s.seed + i) % 2 ** 64))
                for ids in self.prompts for i in range(self.n)]

    def settings(self, sampling: SamplingParams | None = None) -> dict:
        """llama-server's generation settings of the request: its answer's (the seed as given, -1 for a
        drawn one), or, given a choice's sampling, its /slots params (the seed in use)."""
        seed = (-1 if self.seed is None else self.seed) if sampling is None else sampling.seed
        shown = {} if self.shown_probs is None else {"n_probs": self.shown_probs}
        return settings_json(sampling or self.sampling, seed, self.max_tokens, ignore_eos=self.ignore_eos,
                             stream=self.stream, timings_per_token=self.timings_per_token, stop=self.stop,
                             cache_prompt=self.cache_prompt, **shown)


def settings_json(sampling: SamplingParams, seed: int, max_tokens: int, *, ignore_eos: bool, **extra) -> dict:
    """llama-server's generation settings object (/props' default_generation_settings.params, an answer's
    generation_settings, /slots' params): its field names; samplers fastserve lacks show their "off" value."""
    out = {"seed": seed, **{name: getattr(sampling, name) for name in SAMPLING}}
    out.update({name: off for name, (off, _, _) in NOT_SUPPORTED.items() if off is not None})
    out.update({"max_tokens": max_tokens, "n_predict": max_tokens, "n_keep": 0, "ignore_eos": ignore_eos,
                "stream": False, "n_probs": sampling.n_probs, "post_sampling_probs": sampling.post_sampling_probs,
                "samplers": SAMPLER_CHAIN, "timings_per_token": False, **extra})
    return out


def _texts(raw, prompts: list) -> tuple:
    """Each prompt's text as the request gave it, None for one given as ids."""
    texts = raw if len(prompts) > 1 else [raw]
    return tuple(t if isinstance(t, str) else None for t in texts)


class Parser:
    """Request bodies (JSON bytes) → Params, for one server: its tokenizer, its engine's shape (EngineInfo), its defaults."""

    def __init__(self, tokenizer, info, config):
        self.tokenizer, self.config = tokenizer, config
        self.n_vocab = info.n_vocab                 # the model's: the sampler's rows
        self.n_ctx = info.n_ctx_slot
        self.max_chars = max(self.n_ctx * PROMPT_CHARS_PER_TOKEN, EXACT_CHARS)
        self.spec = info.speculative                # config.SpecConfig (type "none": off)

    # -- the three routes ----------------------------------------------------------------------------

    def completion(self, data: bytes) -> Params:
        """llama-server's /completion."""
        body = parse_object(data)
        raw = body.raw("prompt")
        prompts = self.prompts(raw)
        fields = body.raw("response_fields", [])
        if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
            raise HttpError(400, "'response_fields' must be an array of field names (\"a/b\" for a nested one)")
        n_probs, post = body.int("n_probs", 0), body.bool("post_sampling_probs")
        params = self._params(body, prompts, "llama", n_probs=n_probs, post_sampling_probs=post,
                              constraint=self.constraint(body), cache_prompt=body.bool("cache_prompt", True),
                              id_slot=body.int("id_slot", -1, lo=-1), return_tokens=body.bool("return_tokens"),
                              timings_per_token=body.bool("timings_per_token"), response_fields=tuple(fields),
                              texts=_texts(raw, prompts), shown_probs=n_probs)
        return params

    def completions(self, data: bytes) -> Params:
        """OpenAI's legacy /v1/completions: a prompt or a list of them (as llama-server), n choices of each."""
        body = parse_object(data)
        if body.int("best_of", 1, lo=1) > 1:
            raise HttpError(400, "'best_of' > 1 is not supported")
        if body.str("suffix"):
            raise HttpError(400, "'suffix' is not supported")
        raw = body.raw("prompt")
        prompts = self.prompts(raw)
        n = self._choices(body, len(prompts))
        logprobs = body.int("logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
        echo = body.bool("echo")
        if echo and n > 1:
            raise HttpError(400, "'echo' with 'n' > 1 is not supported: send the prompt once per choice")
        if echo and body.bool("stream"):
            raise HttpError(400, "'echo' with 'stream' is not supported: the prompt's scores come whole, "
                                 "ask without 'stream'")
        return self._params(body, prompts, "openai", n=n, logprobs=logprobs,
                            n_probs=0 if logprobs is None else max(1, logprobs),
                            constraint=self.constraint(body), include_usage=_include_usage(body),
                            echo=echo, texts=_texts(raw, prompts) if echo else ())

    def chat(self, data: bytes) -> Params:
        """OpenAI's /v1/chat/completions, its prompt still to be made (conversation()): tools or a
        response_format become the request's constraint."""
        return self.chat_body(parse_object(data))

    def chat_body(self, body: Body) -> Params:
        """chat() of a parsed body: also the form other APIs' requests are translated into (anthropic_api,
        responses_api)."""
        n = self._choices(body, 1)
        plan, schema, constraint = tool_plan(body), response_format(body), self.constraint(body)
        given = [name for name, v in (("tools", plan), ("response_format", schema), ("grammar", constraint or None))
                 if v is not None]
        if len(given) > 1:
            raise HttpError(400, f"give one constraint, not several: {', '.join(given)}")
        if plan is not None:
            constraint = {"json_schema": plan.schema}
        elif schema is not None:
            constraint = {"json_schema": schema}
        want = body.bool("logprobs")
        top = body.int("top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
        if top is not None and not want:
            raise HttpError(400, "'top_logprobs' needs 'logprobs': true")
        messages = chat_messages(body.raw("messages"), self.tokenizer.chat_template_takes_tools)
        think, kwargs = self.reasoning(body)
        if think is not None and constraint:
            think = None            # JSON or a grammar from the first token: no thinking to split off or budget
        elif think is not None and think.budget > 0:
            constraint = {"lark": reasoning.budget_grammar(think, self.tokenizer)}
        return self._params(body, [], "openai", n=n, logprobs=(top or 0) if want else None,
                            n_probs=max(1, top or 0) if want else 0, constraint=constraint,
                            include_usage=_include_usage(body), tools=plan, messages=tuple(messages),
                            timings_per_token=body.bool("timings_per_token"), reasoning=think,
                            template_kwargs=kwargs)

    def reasoning(self, body: Body) -> tuple:
        """(the chat's reasoning plan, or None for a template without thinking markers; its template variables:
        --chat-template-kwargs and the request's chat_template_kwargs, enable_thinking false for a budget of 0)."""
        cfg = self.config
        given = body.raw("chat_template_kwargs")
        if given is not None and not isinstance(given, dict):
            raise HttpError(400, "'chat_template_kwargs' must be an object of template variables")
        kwargs = {**(cfg.chat_template_kwargs or {}), **(given or {})}
        budget = reasoning.request_budget(body, cfg.reasoning_budget)
        think = reasoning.plan(self.tokenizer.chat_template, reasoning.request_format(body, cfg.reasoning_format),
                               budget)
        if think is not None and budget == 0:
            kwargs.setdefault("enable_thinking", False)
        return think, kwargs

    def _params(self, body: Body, prompts: list, api: str, *, n_probs: int, post_sampling_probs: bool = False,
                **fields) -> Params:
        """What the three routes read alike: sampling, seed, max tokens, stop strings, limits. n_probs: the
        probabilities shown per token (the engine reports prob_pool of them)."""
        cfg = self.config
        seed = body.int("seed", cfg.seed)
        seed = None if seed == -1 else seed
        ignore_eos = body.bool("ignore_eos", cfg.ignore_eos)
        sampling = self.sampling(body, ignore_eos, seed=seed, n_probs=n_probs, post_sampling_probs=post_sampling_probs)
        if n_probs:
            sampling = replace(sampling, n_probs=prob_pool(n_probs, sampling))
        max_tokens = cfg.n_predict
        for name in MAX_TOKENS[api]:
            if body.has(name):
                max_tokens = body.int(name)         # its range: Engine.submit's
                break
        return Params(prompts, sampling, seed, min(max_tokens, self.n_ctx), stop(body), limits(body, cfg),
                      stream=body.bool("stream"), ignore_eos=ignore_eos, speculative=self.speculative(body),
                      **fields)

    # -- the parts -----------------------------------------------------------------------------------

    def sampling(self, body: Body, ignore_eos: bool, **given) -> SamplingParams:
        """The request's sampling over the server's defaults, checked once (SamplingParams.make)."""
        for name, (_, off, why) in NOT_SUPPORTED.items():
            v = body.raw(name)
            if v is not None and not off(v):
                raise HttpError(400, f"'{name}' = {v!r} is not supported by fastserve: {why}; leave it out")
        chain = body.raw("samplers")
        if chain is not None and (not isinstance(chain, list) or [x for x in chain if x not in OFF_SAMPLERS]
                                  != SAMPLER_CHAIN):
            raise HttpError(400, f"'samplers' must be fastserve's chain {SAMPLER_CHAIN} (in that order; samplers "
                                 f"that are off may be named too), got {chain!r}")
        defaults = self.config.sampling.kwargs()
        del defaults["seed"]
        for name, read in SAMPLING.items():
            v = read(body, name)
            if v is not None:
                given[name] = v
        bias = self.logit_bias(body)
        if ignore_eos:              # as llama-server: the end-of-generation tokens are never sampled
            bias.update({tok: -math.inf for tok in self.tokenizer.eog_ids})
        return SamplingParams.make(self.n_vocab, **{**defaults, **given, "logit_bias": bias})

    def speculative(self, body: Body):
        """llama-server's speculative.n_max / n_min / p_min (and speculative.type: the server's, or "none" to
        draft nothing) over the server's limits, checked: a DraftLimits, or None when the request gives none.
        They change the speed only; a server without speculation takes them and drafts nothing."""
        given = {name: read(body, f"speculative.{name}") for name, read in SPECULATIVE.items()}
        given = {name: v for name, v in given.items() if v is not None}
        server = self.spec.type if self.spec is not None else "none"
        kind = body.str("speculative.type")
        if kind is not None:
            if kind not in ("none", server):
                raise HttpError(400, f"'speculative.type' {kind!r}: this server drafts with {server!r} "
                                     f"(--spec-type); a request may give that or 'none'")
            if kind == "none":
                given["n_max"], given["n_min"] = 0, 0
        if not given:
            return None
        try:
            return (self.spec.limits if self.spec is not None else DraftLimits()).merged(given)
        except RequestError as exc:
            raise HttpError(400, str(exc)) from None

    def logit_bias(self, body: Body) -> dict:
        """{token_id: bias} from every form llama-server takes: [[id, bias], ...], [["text", bias], ...],
        {"id": bias, ...} and {"text": bias, ...}; a text stands for each of its tokens (tokenized without
        BOS), and a bias of false means "never" (-inf). Unlike llama-server, an entry it would skip (a bad
        pair, an id outside the vocabulary, a bias that is not a number) is a 400 naming it."""
        v = body.raw("logit_bias")
        if v is None:
            return {}
        if isinstance(v, dict):
            pairs = [(int(k) if k.lstrip("-").isdigit() else k, b) for k, b in v.items()]
        elif isinstance(v, list):
            if not all(isinstance(item, list) and len(item) == 2 for item in v):
                raise HttpError(400, "'logit_bias' as an array must hold [token_id or text, bias] pairs")
            pairs = [tuple(item) for item in v]
        else:
            raise HttpError(400, "'logit_bias' must be an object {token_id or text: bias} or an array of pairs")
        if len(pairs) > MAX_BIAS_ENTRIES:
            raise HttpError(400, f"'logit_bias' has {len(pairs)} entries; at most {MAX_BIAS_ENTRIES}")
        out = {}
        for key, b in pairs:
            if b is False:
                b = -math.inf
            elif not _num(b):
                raise HttpError(400, f"'logit_bias' biases must be numbers (or false), got {kind(b)} for {key!r}")
            if isinstance(key, str):
                if len(key) > MAX_BIAS_TEXT:
                    raise HttpError(400, f"'logit_bias' texts may have at most {MAX_BIAS_TEXT} characters")
                ids = self.tokenizer.encode(key, add_special=False) if key else []
                if not ids:
                    raise HttpError(400, f"'logit_bias' text {key!r} has no tokens")
            elif not isinstance(key, int) or isinstance(key, bool):      # its range: SamplingParams.make's
                raise HttpError(400, f"'logit_bias' token ids must be integers, got {key!r}")
            else:
                ids = [key]
            for tok in ids:
                out[tok] = float(b)
        return out

    def prompts(self, value, name: str = "prompt") -> list[list[int]]:
        """Every prompt of a request as token ids. As llama-server reads it: an array holding a number is
        one prompt (ids, or ids mixed with text); any other array is a list of prompts."""
        if isinstance(value, list) and value and not any(_num(x) for x in value):
            if len(value) > MAX_PROMPTS:
                raise HttpError(400, f"'{name}' holds {len(value)} prompts; at most {MAX_PROMPTS} are taken at once")
            return [self.prompt(p, f"{name}[{i}]") for i, p in enumerate(value)]
        return [self.prompt(value, name)]

    def prompt(self, value, name: str = "prompt", limit: int | None = None) -> list[int]:
        """One prompt as token ids: text, token ids, or llama.cpp's mix of both ([1, "text", 2, ...]), also
        inside llama-server's object form {"prompt_string": ...} (its multimodal_data is refused: no vision);
        text gets the BOS token when it comes first. Reads no further once it is longer than a slot
        (Engine.submit refuses it then); given a limit (/tokenize), refuses more than limit tokens."""
        tok = self.tokenizer
        cap = self.n_ctx if limit is None else limit
        if isinstance(value, dict):
            if value.get("multimodal_data"):
                raise HttpError(400, f"'{name}.multimodal_data': multimodal prompts are not supported (no vision)")
            if "prompt_string" not in value:
                raise HttpError(400, f"'{name}' as an object must be {{\"prompt_string\": ...}}")
            value, name = value["prompt_string"], f"{name}.prompt_string"
        if value is None:
            raise HttpError(400, f"'{name}' is required")
        if isinstance(value, str):
            value = [value]
        elif not isinstance(value, list):
            raise HttpError(400, f"'{name}' must be a string, an array of token ids or {{\"prompt_string\": ...}}")
        ids = []
        for i, x in enumerate(value):
            if isinstance(x, str):
                self.check_length(x, len(ids))
                ids.extend(tok.encode(x, add_special=i == 0))
            elif not isinstance(x, int) or isinstance(x, bool):
                raise HttpError(400, f"'{name}' must be a string, an array of token ids and strings, or an array "
                                     f"of such prompts; got {type(x).__name__} at [{i}]")
            else:
                ids.append(x)
            if len(ids) > cap:
                break                          # already too long: tokenize no more
        if not ids:
            raise HttpError(400, f"'{name}' is empty")
        if limit is not None and len(ids) > limit:
            raise HttpError(400, f"'{name}' has more than {limit} tokens; at most {limit} are tokenized at once")
        return ids

    def conversation(self, params: Params) -> Params:
        """A chat's params with its prompt: the messages through the model's chat template, tokenized. Apart
        from the rest of the parse: with tools, their schema's compile must be judged first (the template's
        text describes them). An assistant message last is a prefill (llama-server's, on unless
        --no-prefill-assistant): the template renders the others, then its text follows, to be continued."""
        text = self.chat_text(params)
        self.check_length(text)            # the template's text: what is tokenized
        ids = self.tokenizer.encode(text, add_special=True)
        if not ids:
            raise HttpError(400, "the conversation is empty")
        think = params.reasoning
        if think is not None:              # a template that opens the thinking: the reply starts inside it
            think = think._replace(opened=text.rstrip().endswith(think.open))
        return replace(params, prompts=[ids], reasoning=think)

    def chat_text(self, params: Params) -> str:
        """The text of a chat's prompt (conversation(); POST /apply-template answers it)."""
        tok, plan = self.tokenizer, params.tools
        native = tok.chat_template_takes_tools
        messages = list(params.messages) if plan is None else with_tools(list(params.messages), plan, native)
        prefill = ""
        if self.config.prefill_assistant and messages[-1]["role"] == "assistant":
            if len(messages) > 1 and messages[-2]["role"] == "assistant":
                raise HttpError(400, "Cannot have 2 or more assistant messages at the end of the list.")
            prefill = messages.pop()["content"]
        return tok.apply_chat_template(messages, add_generation_prompt=True,
                                       tools=plan.tools if plan is not None and native else None,
                                       kwargs=params.template_kwargs) + prefill

    def check_length(self, text: str, n_before: int = 0) -> None:
        """Refuse, before tokenizing it whole, text too long to fit in a slot (after n_before tokens): llama-server's
        exceed_context_size_error, its n_prompt_tokens estimated from the first EXACT_CHARS characters' tokens."""
        if len(text) > self.max_chars:
            n = len(self.tokenizer.encode(text[:EXACT_CHARS], add_special=False))
            estimate = n_before + math.ceil(n * len(text) / EXACT_CHARS)
            raise exceeded(max(estimate, self.n_ctx + 1), self.n_ctx, about=True)

    @staticmethod
    def constraint(body: Body) -> dict:
        """grammar (GBNF; "" means none, as llama-server reads it) or json_schema, for App.compile."""
        out = {}
        grammar = body.str("grammar")
        if grammar:
            out["grammar"] = grammar
        schema = body.raw("json_schema")
        if schema is not None:
            if not isinstance(schema, (dict, str)):
                raise HttpError(400, "'json_schema' must be a JSON schema object")
            out["json_schema"] = schema
        return out

    @staticmethod
    def _choices(body: Body, n_prompts: int) -> int:
        n = body.int("n", 1, lo=1, hi=MAX_CHOICES)
        if n_prompts * n > MAX_CHOICES:
            raise HttpError(400, f"{n_prompts} prompts x n = {n} make {n_prompts * n} choices; at most "
                                 f"{MAX_CHOICES} are generated per request")
        return n


def stop(body: Body) -> list[str]:
    """A stop string or a list of them."""
    v = body.raw("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise HttpError(400, "'stop' must be a string or an array of strings")
    if len(v) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in v):
        raise HttpError(400, f"'stop' allows at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters")
    return [s for s in v if s]


def limits(body: Body, cfg) -> Limits:
    """fastserve's per-request time limits (queue_timeout, request_timeout, token_timeout, seconds): each may
    only shorten the server's."""
    def limit(name: str, server_value: float) -> float:
        v = body.number(name, None, lo=0.0, hi=MAX_TIMEOUT_S)
        if v is None or v <= 0:
            return server_value
        return min(v, server_value) if server_value > 0 else v
    return Limits(queue=limit("queue_timeout", cfg.queue_timeout), total=limit("request_timeout", cfg.request_timeout),
                  token=limit("token_timeout", cfg.token_timeout))


def _include_usage(body: Body) -> bool:
    opts = body.raw("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise HttpError(400, "'stream_options' must be an object")
    return Body(opts or {}).bool("include_usage")
