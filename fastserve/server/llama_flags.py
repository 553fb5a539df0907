"""llama-server's command-line flags on `fastserve serve`: what fastserve does with each.

FLAGS is the one table: every flag of llama-server's --help (llama.cpp 34af94cd) that a server
script may pass, with what fastserve does — `same` (same meaning), `differs` (taken, with a
different meaning or range, said in the note), `refused` (fastserve cannot honour it: starting
with it fails with the note as the reason), or `later` (belongs to an issue not done yet: refused
the same way). docs/flags.md's compatibility table is generated from it (tests/unit/test_llama_flags.py
checks they agree), and add_refused() turns every refused flag into an argparse option that exits
with its reason, so that no llama-server flag is ever silently ignored. The flags fastserve takes
are defined in cli.py beside its own; apply() maps their values onto the server's settings.
"""
from __future__ import annotations

import argparse
import json

from ..config import DRAFT_P_MIN, SAMPLING_DEFAULTS, SPEC_TYPES, DraftLimits, SamplingParams, SpecConfig
from ..errors import RequestError
from ..models.chat_template import CHATML

DEFAULTS = SAMPLING_DEFAULTS      # the help texts' defaults, stated once (config.SamplingParams)

SAME, DIFFERS, REFUSED = "same", "differs", "refused"

# (flags as llama-server spells them, status, note). Grouped as llama-server's --help groups them.
FLAGS: list[tuple[str, str, str]] = [
    # -- common ------------------------------------------------------------------------------------
    ("-h, --help", SAME, "fastserve's own help (`fastserve serve --help`)"),
    ("--usage, --version, -cl, --cache-list, --completion-bash", REFUSED, "no such commands (`pip show fastserve` "
                                                                          "gives the version)"),
    ("-t, --threads N", SAME, "threads of the decode step (default: every core the process may use)"),
    ("-tb, --threads-batch N", REFUSED, "one thread pool does prompts and decoding; use -t"),
    ("-C, --cpu-mask, -Cr, --cpu-range, --cpu-strict, -Cb, --cpu-mask-batch, -Crb, --cpu-range-batch, "
     "--cpu-strict-batch", REFUSED, "no CPU affinity control; use taskset"),
    ("--prio, --prio-batch, --poll, --poll-batch", REFUSED, "no thread priority or polling control"),
    ("-c, --ctx-size N", DIFFERS, "KV tokens shared by the slots, as llama-server; 0 (the model's size) is not "
                                  "taken: give a size (default 8192)"),
    ("-n, --predict, --n-predict N", SAME, "tokens a request gets when it does not say (-1: until its slot is full)"),
    ("-b, --batch-size N", SAME, "most tokens in one step (default 512, llama-server 2048)"),
    ("-ub, --ubatch-size N", DIFFERS, "a step is one forward pass, so a step carries at most min(-b, -ub) tokens"),
    ("--keep N", DIFFERS, "taken (N >= -1); fastserve never discards prompt tokens (no context shift), so all "
                          "are kept whatever N is"),
    ("--swa-full", REFUSED, "a sliding-window model's local layers keep a ring of window + `-b` - 1 positions per slot "
                              "(llama.cpp's default SWA cache size); no full-size option"),
    ("-fa, --flash-attn [on|off|auto]", DIFFERS, "attention is always fastserve's blocked (flash-style) kernel: "
                                                 "on and auto are taken, off is refused"),
    ("--perf, --no-perf", REFUSED, "timings are always on: see /metrics and `fastserve bench`"),
    ("-e, --escape, --no-escape", REFUSED, "no prompt from the command line in `serve`"),
    ("--rope-scaling, --rope-scale, --rope-freq-base, --rope-freq-scale, --yarn-orig-ctx, --yarn-ext-factor, "
     "--yarn-attn-factor, --yarn-beta-slow, --yarn-beta-fast", REFUSED, "RoPE is read from the model, never "
                                                                       "overridden"),
    ("-kvo, --kv-offload, -nkvo, --no-kv-offload", REFUSED, "the KV cache lives with the model (CPU or GPU)"),
    ("--repack, -nr, --no-repack", REFUSED, "weights are used in the file's own blocks, never repacked"),
    ("--no-host", REFUSED, "no host buffer types"),
    ("-ctk, --cache-type-k TYPE; -ctv, --cache-type-v TYPE", DIFFERS, "f16 (default), f32 or q8_0; the other "
                                                                      "llama.cpp types are refused"),
    ("-dt, --defrag-thold N", REFUSED, "deprecated in llama-server; fastserve's KV cache is per slot, never "
                                       "fragmented"),
    ("--mlock", REFUSED, "the model is not locked in RAM (the file stays memory-mapped)"),
    ("--mmap, --no-mmap", DIFFERS, "--mmap is taken (always); --no-mmap is refused: the products run on the "
                                   "file's memory-mapped blocks"),
    ("-dio, --direct-io, -ndio, --no-direct-io, -lm, --load-mode", REFUSED, "the model is always memory-mapped"),
    ("--numa TYPE", REFUSED, "no NUMA placement"),
    ("-dev, --device LIST", DIFFERS, "fastserve's --device is cpu, cuda or auto (one device); a list of llama.cpp "
                                     "devices (CUDA0, ...) and -dev are refused"),
    ("--list-devices", REFUSED, "no device list; --device auto uses the GPU when CuPy sees one"),
    ("-ot, --override-tensor, -cmoe, --cpu-moe, -ncmoe, --n-cpu-moe", REFUSED, "no per-tensor placement, no MoE"),
    ("-ngl, --gpu-layers, --n-gpu-layers N", DIFFERS, "all or nothing: 0 keeps the model on the CPU, all/auto or "
                                                      "at least the model's layers put it on the GPU with --device "
                                                      "cuda; a split is refused. On the CPU any value is taken (no "
                                                      "layer is in VRAM, which a maximum allows)"),
    ("-sm, --split-mode, -ts, --tensor-split, -mg, --main-gpu", REFUSED, "one device only"),
    ("-fit, --fit, -fitt, --fit-target, -fitc, --fit-ctx", REFUSED, "sizes are never adjusted to fit; give -c "
                                                                    "and -np"),
    ("--check-tensors", REFUSED, "tensors are checked for shape and type at load, not for values"),
    ("--override-kv KEY=TYPE:VALUE", REFUSED, "model metadata is never overridden"),
    ("--op-offload, --no-op-offload", REFUSED, "no partial offload"),
    ("--lora, --lora-scaled, --lora-init-without-apply", REFUSED, "no LoRA adapters"),
    ("--control-vector, --control-vector-scaled, --control-vector-layer-range", REFUSED, "no control vectors"),
    ("-m, --model FNAME", SAME, "default: the default model (SmolLM2-135M-Instruct Q4_1), pulled if needed"),
    ("-mu, --model-url, -dr, --docker-repo, -hf, -hfr, --hf-repo, -hff, --hf-file, -hft, --hf-token", REFUSED,
     "no downloads at start; give a local GGUF with -m (`fastserve pull` gets the default model)"),
    ("--log-disable", DIFFERS, "turns off the per-request log lines (start-up lines stay)"),
    ("--log-file FNAME", DIFFERS, "the request log (and the server's log lines) are appended to FNAME instead of "
                                  "stderr; start-up lines stay on stderr"),
    ("--log-colors", REFUSED, "the log has no colours"),
    ("-v, --verbose, --log-verbose", DIFFERS, "the per-request log lines on (there is no debug log)"),
    ("--offline", SAME, "fastserve never downloads at start (only `fastserve pull` does)"),
    ("-lv, --verbosity, --log-verbosity N", DIFFERS, "the request log is info (3): N >= 3 keeps it, N < 3 turns "
                                                     "it off"),
    ("--log-prefix, --no-log-prefix, --log-timestamps, --no-log-timestamps", REFUSED, "one log format: a time "
                                                                                      "stamp and the line"),
    ("-ctkd, --cache-type-k-draft, -ctvd, --cache-type-v-draft", REFUSED, "the draft model's KV cache takes the "
                                                                          "model's types (-ctk / -ctv)"),
    # -- sampling ----------------------------------------------------------------------------------
    ("--samplers, --sampler-seq, --sampling-seq", REFUSED, "one sampler chain: penalties, top-k, top-p, min-p, "
                                                           "temperature"),
    ("-s, --seed SEED", SAME, "the seed of requests that give none (-1, the default: a random one each)"),
    ("--ignore-eos", DIFFERS, "every request's default for ignore_eos (the end-of-generation tokens are never "
                              "sampled); a request's own ignore_eos: false wins, and its logit_bias adds to the ban "
                              "(llama-server 34af94cd keeps the ban for the first and drops it for the second)"),
    ("--temp, --temperature N", SAME, f"server-wide default ({DEFAULTS['temperature']}); a request's own value wins"),
    ("--top-k N", SAME, f"server-wide default ({DEFAULTS['top_k']})"),
    ("--top-p N", SAME, f"server-wide default ({DEFAULTS['top_p']})"),
    ("--min-p N", SAME, f"server-wide default ({DEFAULTS['min_p']})"),
    ("--top-nsigma, --top-n-sigma, --xtc-probability, --xtc-threshold, --typical, --typical-p, --dry-*, --adaptive-*, --dynatemp-*, "
     "--mirostat*", REFUSED, "fastserve has no such sampler (a request that turns one on gets a 400)"),
    ("--repeat-last-n N", SAME, f"server-wide default ({DEFAULTS['repeat_last_n']})"),
    ("--repeat-penalty N", SAME, f"server-wide default ({DEFAULTS['repeat_penalty']})"),
    ("--presence-penalty N", SAME, f"server-wide default ({DEFAULTS['presence_penalty']})"),
    ("--frequency-penalty N", SAME, f"server-wide default ({DEFAULTS['frequency_penalty']})"),
    ("-l, --logit-bias", REFUSED, "not as a flag; a request's logit_bias takes every llama-server form"),
    ("--grammar, --grammar-file, -j, --json-schema, -jf, --json-schema-file", REFUSED,
     "no server-wide constraint: a request gives its own grammar or json_schema (enforced in the sampler)"),
    ("-bs, --backend-sampling", REFUSED, "no switch: sampling always runs where the model runs (on the GPU with "
                                         "--device cuda)"),
    # -- speculative -------------------------------------------------------------------------------
    ("--spec-type TYPE", DIFFERS, "none (default), ngram-simple, ngram-mod or draft-simple (with -md), one of them "
                                  "(llama-server takes a list); "
                                  "the output is plain decoding's, token for token (greedy and seeded sampling); "
                                  "ngram-mod's table is per slot (llama-server's is shared by the slots); the other "
                                  "types are refused"),
    ("--spec-draft-n-max N, --draft-max, --draft-n, --draft N", DIFFERS, "the most tokens a slot drafts per step, for "
                                                                        "every drafter (llama-server: for a draft "
                                                                        "model only; the --draft* spellings are "
                                                                        "its older ones); default: the drafter's own"),
    ("--spec-draft-n-min N, --draft-min, --draft-n-min N", DIFFERS, "a draft shorter than N is not verified (every "
                                                                   "drafter); default 0"),
    ("--spec-draft-p-min P, --draft-p-min P", DIFFERS, "in [0, 1]: a drafted position is verified only while its "
                                                       "estimated chance of acceptance (the slot's record, the "
                                                       "position's depth) is at least P (llama-server: the draft "
                                                       "model's own probability, as fastserve's draft-simple); "
                                                       "default 0.75 for draft-simple (llama-server's), 0 for the "
                                                       "n-gram drafters"),
    ("--spec-ngram-simple-size-n N, --spec-ngram-simple-size-m N", SAME, "lookup length (12) and most tokens "
                                                                          "drafted (48)"),
    ("--spec-ngram-simple-min-hits N", SAME, "taken (N >= 1); llama-server's ngram-simple does not read it either"),
    ("--spec-ngram-mod-n-match N, --spec-ngram-mod-n-min N, --spec-ngram-mod-n-max N", SAME,
     "lookup length (24), shortest chain proposed (48), most tokens drafted (64)"),
    ("--spec-ngram-map-k-*, --spec-ngram-map-k4v-*, -lcs, --lookup-cache-static, -lcd, --lookup-cache-dynamic",
     REFUSED, "no ngram-map or ngram-cache drafters: use --spec-type ngram-simple or ngram-mod"),
    ("-md, --model-draft, --spec-draft-model FNAME", DIFFERS, "a GGUF draft model of the model's vocabulary (the "
                                                              "token count and every piece are checked: else the "
                                                              "start stops saying where they differ); it drafts "
                                                              "greedily on the CPU, on the decode step's threads, "
                                                              "with a KV cache of its own in the model's types; "
                                                              "alone it means --spec-type draft-simple"),
    ("-hfd, --spec-draft-hf, -td, --spec-draft-threads, --spec-draft-*", REFUSED,
     "the draft model runs on the decode step's threads (-t), on the CPU, with the model's KV types; no "
     "download at start (`fastserve pull`, then -md FILE)"),
    # -- server ------------------------------------------------------------------------------------
    ("-ctxcp, --ctx-checkpoints, --swa-checkpoints, -cms, --checkpoint-min-step", REFUSED,
     "no context checkpoints: a sliding-window slot's prefix is reused only where its ring still holds the "
     "window (`/slots` `swa_reusable`), else computed again"),
    ("-cram, --cache-ram N", DIFFERS, "MiB of host RAM for reused slots' prefixes; default 0 (off), llama-server "
                                      "8192; -1 is refused"),
    ("-kvu, --kv-unified, -no-kvu, --no-kv-unified", REFUSED, "each slot has its own KV cache of -c / -np tokens"),
    ("--cache-idle-slots, --no-cache-idle-slots", REFUSED, "an idle slot keeps its prefix for reuse; -cram keeps "
                                                           "reused ones"),
    ("--context-shift, --no-context-shift", DIFFERS, "--no-context-shift is taken (fastserve never shifts: a "
                                                     "request ends when its slot is full); --context-shift is "
                                                     "refused"),
    ("-r, --reverse-prompt, -sp, --special, --spm-infill", REFUSED, "interactive and infill options; not served"),
    ("--warmup, --no-warmup", DIFFERS, "taken; fastserve has no warm-up run to skip"),
    ("--embedding, --embeddings", DIFFERS, "taken; embeddings are served with or without it (/v1/embeddings, "
                                           "/embedding, Ollama's /api/embed), beside completions"),
    ("--pooling {none,mean,cls,last}", DIFFERS, "as llama-server; default mean where llama-server takes the model's "
                                                "(none for a chat model, which its OpenAI route refuses); rank is "
                                                "refused (no reranking)"),
    ("--embd-normalize N", SAME, "a request's embd_normalize when it gives none (default 2: Euclidean)"),
    ("--rerank, --reranking", REFUSED, "no reranking models (/rerank answers 404)"),
    ("-np, --parallel N", DIFFERS, "slots (default 8; llama-server's -1, auto, is not taken)"),
    ("-cb, --cont-batching, -nocb, --no-cont-batching", DIFFERS, "batching is always continuous: -cb is taken, "
                                                                 "-nocb refused"),
    ("-mm, --mmproj, -mmu, --mmproj-url, --mmproj-auto, --no-mmproj, --no-mmproj-auto, --mmproj-offload, "
     "--no-mmproj-offload, --image-min-tokens, "
     "--image-max-tokens, --mtmd-batch-max-tokens, --media-path", REFUSED, "text only: no multimodal models"),
    ("-a, --alias STRING", DIFFERS, "one model name (a comma-separated list is taken as one name)"),
    ("--tags STRING", REFUSED, "no model tags"),
    ("--host HOST", DIFFERS, "an IP address or name; a UNIX socket (.sock) is refused"),
    ("--port PORT", SAME, "0 picks a free port (printed at start)"),
    ("--reuse-port", REFUSED, "one process serves one port"),
    ("--path PATH", REFUSED, "no static files"),
    ("--cors-origins ORIGINS", DIFFERS, "comma-separated origins or *; the default allows pages on this machine "
                                        "(localhost, any port) and the server's own; other origins are refused "
                                        "(403)"),
    ("--cors-methods, --cors-headers, --cors-credentials, --no-cors-credentials", REFUSED,
     "fixed: GET, POST, DELETE, OPTIONS; authorization, content-type, x-api-key, anthropic-version; no credentials"),
    ("--api-prefix PREFIX", REFUSED, "routes are served at the root"),
    ("--ui-config, --webui-config, --ui-config-file, --webui-config-file, --ui-mcp-proxy, --webui-mcp-proxy, "
     "--no-ui-mcp-proxy, --no-webui-mcp-proxy, --tools, "
     "--tools-runtime, --mcp-*, -ag, --agent", REFUSED, "no agent tools, MCP proxy or UI settings"),
    ("--ui, --webui, --no-ui, --no-webui", SAME, "the chat page at / (on by default); --no-webui: 404 there"),
    ("--api-key KEY", DIFFERS, "one key (a comma-separated list is taken as one key); /health, /models and "
                               "/v1/models stay public, as in llama-server"),
    ("--api-key-file FNAME", REFUSED, "not yet; give --api-key"),
    ("--ssl-key-file, --ssl-cert-file", REFUSED, "no TLS: put a proxy in front"),
    ("--chat-template-kwargs STRING", SAME, "a JSON object of template variables for every chat (a request's "
                                            "chat_template_kwargs add to them)"),
    ("-to, --timeout N", DIFFERS, "seconds a client may read (or send) nothing before it is dropped (default "
                                  "600, llama-server 3600)"),
    ("--sse-ping-interval N", REFUSED, "no SSE pings"),
    ("--threads-http N", REFUSED, "HTTP runs on the event loop, one thread"),
    ("--cache-prompt, --no-cache-prompt", REFUSED, "prompt caching is per request (cache_prompt), default on"),
    ("--cache-reuse N", REFUSED, "no KV shifting: only a slot's common prefix is reused"),
    ("--metrics", SAME, "/metrics answers 501 without it"),
    ("--props", SAME, "POST /props answers 501 without it; with it, it changes nothing (400 for any field), "
                      "as llama-server, which changes nothing either"),
    ("--slots, --no-slots", SAME, "/slots answers 501 with --no-slots"),
    ("--slot-save-path PATH", REFUSED, "no slot save/restore (those actions answer 501)"),
    ("--models-dir PATH", DIFFERS, "router mode: every .gguf file there is a model, named by its file name, "
                                   "loaded on its first request (fastserve/server/router.py); not with -m"),
    ("--models-max N", DIFFERS, "models loaded at once (default 4): the least recently used one with no request in "
                                "flight is unloaded first; 0 (llama-server: no limit) is refused"),
    ("--models-preset, --models-autoload, --no-models-autoload", REFUSED, "no presets; a model loads on its "
                                                                          "first request"),
    ("--jinja, --no-jinja", DIFFERS, "chat templates are always Jinja (sandboxed jinja2): --jinja is taken, "
                                     "--no-jinja refused"),
    ("--reasoning-format FORMAT", DIFFERS, "none, deepseek or auto (the default; as deepseek): a template's "
                                           "thinking markers (<think>, [THINK], ...) split reasoning_content off; "
                                           "deepseek-legacy is refused"),
    ("--reasoning-budget N", DIFFERS, "-1 (default): no budget; 0: thinking off (enable_thinking false); N > 0 "
                                      "(llama-server takes -1 and 0): at most N tokens of thinking, enforced in "
                                      "the sampler"),
    ("-rea, --reasoning, --reasoning-effort, --reasoning-budget-message, --reasoning-preserve, "
     "--no-reasoning-preserve, --skip-chat-parsing, --no-skip-chat-parsing", REFUSED,
     "use --reasoning-format and --reasoning-budget (per request: reasoning_effort, thinking_budget_tokens)"),
    ("--chat-template JINJA_TEMPLATE", DIFFERS, "a Jinja template, or the built-in name chatml; llama-server's "
                                                "other built-in names are refused"),
    ("--chat-template-file FILE", SAME, "a Jinja template file"),
    ("--prefill-assistant, --no-prefill-assistant", SAME, "on by default: a chat's last assistant message is "
                                                          "continued (two at the end are a 400)"),
    ("-sps, --slot-prompt-similarity SIMILARITY", SAME, "default 0.1; a sliding-window model's slots and host-RAM "
     "cache entries count a shared prefix only where their rings still hold the window before it "
     "(`/slots` `swa_reusable`)"),
    ("--sleep-idle-seconds SECONDS", DIFFERS, "with --models-dir: a model idle this long is unloaded (-1, the "
                                              "default: never); one model (-m) is never unloaded, so it is "
                                              "refused without --models-dir"),
    ("--log-prompts-dir PATH", REFUSED, "prompts are never logged"),
    ("--embd-gemma-default, --fim-qwen-*-default, --fim-qwen-*-spec, --gpt-oss-*-default, "
     "--vision-gemma-*-default, --spec-default", REFUSED, "no downloads at start: `fastserve pull`, then -m"),
]

# Refused flags registered on `fastserve serve` so that passing one exits with its reason: the
# flags of the table rows above that scripts commonly pass (the rest get argparse's "unrecognized").
_REFUSED_OPTIONS: list[tuple[tuple[str, ...], int | str | None]] = [
    # (option strings, nargs: 0 for a switch, None for one value, "?" for an optional value)
    (("-tb", "--threads-batch"), None), (("--mlock",), 0), (("--no-mmap",), 0),
    (("--numa",), None), (("-sm", "--split-mode"), None), (("-ts", "--tensor-split"), None),
    (("-mg", "--main-gpu"), None), (("-hf", "-hfr", "--hf-repo"), None), (("-hff", "--hf-file"), None),
    (("-mu", "--model-url"), None), (("--lora",), None), (("--lora-scaled",), None),
    (("--rope-scaling",), None), (("--rope-scale",), None), (("--rope-freq-base",), None),
    (("--rope-freq-scale",), None), (("-kvu", "--kv-unified"), 0), (("-no-kvu", "--no-kv-unified"), 0),
    (("--context-shift",), 0), (("-nocb", "--no-cont-batching"), 0), (("--no-jinja",), 0),
    (("--rerank", "--reranking"), 0), (("--mmproj", "-mm"), None),
    (("-l", "--logit-bias"), None), (("--grammar",), None), (("--grammar-file",), None),
    (("-j", "--json-schema"), None), (("-jf", "--json-schema-file"), None), (("--samplers",), None),
    (("--sampling-seq", "--sampler-seq"), None), (("--mirostat",), None), (("--typical", "--typical-p"), None),
    (("--dry-multiplier",), None), (("--xtc-probability",), None), (("--top-nsigma", "--top-n-sigma"), None),
    (("--dynatemp-range",), None), (("--api-key-file",), None),
    (("--ssl-key-file",), None), (("--ssl-cert-file",), None), (("--api-prefix",), None), (("--path",), None),
    (("--slot-save-path",), None), (("--threads-http",), None),
    (("--cache-reuse",), None), (("--no-cache-prompt",), 0), (("--sse-ping-interval",), None),
    (("-kvo", "--kv-offload"), 0),
    (("-nkvo", "--no-kv-offload"), 0), (("--override-kv",), None), (("-ot", "--override-tensor"), None),
    (("--check-tensors",), 0), (("-lm", "--load-mode"), None), (("-fit", "--fit"), "?"), (("--swa-full",), 0),
    (("--models-preset",), None),
    (("-bs", "--backend-sampling"), 0), (("--log-colors",), "?"), (("-dt", "--defrag-thold"), None),
    (("--cpu-moe", "-cmoe"), 0), (("-ncmoe", "--n-cpu-moe"), None), (("--list-devices",), 0),
    (("-hfd", "--spec-draft-hf"), None), (("-td", "--spec-draft-threads"), None), (("-ctkd", "--cache-type-k-draft"), None),
    (("-ctvd", "--cache-type-v-draft"), None), (("--spec-ngram-map-k-size-n",), None), (("-lcs", "--lookup-cache-static"), None),
    (("-lcd", "--lookup-cache-dynamic"), None),
]


class _Refuse(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        row = covers(self.option_strings[-1])
        why = row[2] if row is not None else "not supported"
        parser.error(f"{option_string} (llama-server's) is not supported by fastserve: {why}")


def _template_kwargs(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--chat-template-kwargs: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("--chat-template-kwargs must be a JSON object, like '{\"enable_thinking\": false}'")
    return value


def add_refused(parser: argparse.ArgumentParser) -> None:
    """Register llama-server's refused flags on parser: each exits with its reason (argparse.SUPPRESS keeps
    them out of --help; docs/flags.md lists them)."""
    for options, nargs in _REFUSED_OPTIONS:
        parser.add_argument(*options, action=_Refuse, nargs=nargs, help=argparse.SUPPRESS,
                            dest=f"_refused_{options[-1].lstrip('-').replace('-', '_')}", default=None)


def add_taken(parser: argparse.ArgumentParser) -> None:
    """llama-server's flags that fastserve takes, with no fastserve flag of their own in cli.py."""
    g = parser.add_argument_group("llama-server compatibility (see docs/flags.md)")
    g.add_argument("-ub", "--ubatch-size", type=int, default=None,
                   help="physical batch: a step carries at most min(-b, -ub) tokens")
    g.add_argument("--keep", type=int, default=0, help="taken for llama-server scripts (nothing is ever discarded)")
    g.add_argument("-fa", "--flash-attn", nargs="?", const="on", default="auto", choices=("on", "off", "auto"),
                   help="on/auto: fastserve's attention is always blocked (flash-style); off is refused")
    g.add_argument("--mmap", action="store_true", help="taken: the model is always memory-mapped")
    g.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="n_gpu_layers", default=None,
                   help="0: the model stays on the CPU; all/auto or >= its layers: on the GPU with --device cuda")
    g.add_argument("--no-context-shift", action="store_true", help="taken: fastserve never shifts context")
    g.add_argument("--jinja", action="store_true", help="taken: chat templates are always Jinja")
    g.add_argument("--chat-template", help="a Jinja chat template (or the built-in name chatml) instead of the model's")
    g.add_argument("--chat-template-file", help="a file holding a Jinja chat template instead of the model's")
    g.add_argument("--prefill-assistant", dest="prefill_assistant", action="store_true", default=True,
                   help="a chat's last assistant message is continued (the default)")
    g.add_argument("--no-prefill-assistant", dest="prefill_assistant", action="store_false",
                   help="a chat's last assistant message is rendered by the template, and answered")
    g.add_argument("--reasoning-format", default="auto", choices=("none", "deepseek", "auto"),
                   help="a reasoning model's thinking: apart from the content (deepseek, auto) or in it (none)")
    g.add_argument("--reasoning-budget", type=int, default=-1,
                   help="tokens of thinking at most (-1: no budget, 0: thinking off)")
    g.add_argument("--chat-template-kwargs", help="a JSON object of further chat template variables")
    g.add_argument("--log-file", help="append the request log to this file instead of stderr")
    g.add_argument("-lv", "--verbosity", "--log-verbosity", dest="log_verbosity", type=int, default=None,
                   help="< 3 turns the request log off, >= 3 keeps it")
    g.add_argument("-v", "--verbose", "--log-verbose", dest="verbose", action="store_true",
                   help="the request log on")
    g.add_argument("--offline", action="store_true", help="taken: nothing is downloaded at start")
    g.add_argument("--warmup", "--no-warmup", dest="warmup", action="store_true", help="taken: there is no warm-up")
    g.add_argument("-cb", "--cont-batching", action="store_true", help="taken: batching is always continuous")
    g.add_argument("--embedding", "--embeddings", action="store_true",
                   help="taken: embeddings are always served (/v1/embeddings, /embedding, /api/embed)")
    g.add_argument("--pooling", default="mean", choices=("none", "mean", "cls", "last"),
                   help="how an input's token vectors make its embedding (default mean; none: every token's)")
    g.add_argument("--embd-normalize", dest="embd_normalize", type=int, default=2,
                   help="embeddings' normalisation when a request does not say (-1 none, 0 max absolute, "
                        "1 taxicab, 2 Euclidean, p > 2 p-norm)")
    g.add_argument("--models-dir", help="serve every .gguf file in this folder, each loaded on its first request")
    g.add_argument("--models-max", type=int, default=4, help="with --models-dir: models loaded at once (default 4)")
    g.add_argument("--sleep-idle-seconds", type=float, default=-1,
                   help="with --models-dir: unload a model idle this long (-1: never)")
    g.add_argument("--metrics", action="store_true", help="serve /metrics (501 without it, as llama-server)")
    g.add_argument("--props", action="store_true", help="take POST /props (501 without it)")
    g.add_argument("--slots", dest="slots", action="store_true", default=True, help="serve /slots (the default)")
    g.add_argument("--no-slots", dest="slots", action="store_false", help="/slots answers 501")
    # server-wide sampling defaults: absent, fastserve.config.SamplingParams' (llama-server's own)
    g.add_argument("--temp", "--temperature", dest="temperature", type=float)
    g.add_argument("--top-k", dest="top_k", type=int)
    g.add_argument("--top-p", dest="top_p", type=float)
    g.add_argument("--min-p", dest="min_p", type=float)
    g.add_argument("-s", "--seed", dest="seed", type=int, help="seed of requests that give none (-1: random)")
    g.add_argument("--repeat-penalty", dest="repeat_penalty", type=float)
    g.add_argument("--repeat-last-n", dest="repeat_last_n", type=int)
    g.add_argument("--presence-penalty", dest="presence_penalty", type=float)
    g.add_argument("--frequency-penalty", dest="frequency_penalty", type=float)
    g.add_argument("--ignore-eos", dest="ignore_eos", action="store_true",
                   help="requests that do not say ignore_eos never sample the end-of-generation tokens")
    s = parser.add_argument_group("speculative decoding (output identical to plain decoding; see docs/flags.md)")
    s.add_argument("--spec-type", default="none", help=f"the drafter: {', '.join(SPEC_TYPES)}")
    s.add_argument("-md", "--model-draft", "--spec-draft-model", dest="spec_draft_model",
                   help="a draft model of the same vocabulary (GGUF file): --spec-type draft-simple")
    s.add_argument("--spec-draft-n-max", "--draft-max", "--draft-n", "--draft", dest="spec_n_max", type=int,
                   help="most tokens a slot drafts per step (default: the drafter's own)")
    s.add_argument("--spec-draft-n-min", "--draft-min", "--draft-n-min", dest="spec_n_min", type=int, default=0,
                   help="drafts shorter than this are not verified")
    s.add_argument("--spec-draft-p-min", "--draft-p-min", dest="spec_p_min", type=float,
                   help="verify a drafted position only while its estimated chance of acceptance is at least this "
                        f"(default: {DRAFT_P_MIN} for a draft model, 0 for the n-gram drafters)")
    for flag, field in SPEC_NGRAM_FLAGS.items():
        s.add_argument(flag, dest=f"spec_{field}", type=int, default=getattr(SpecConfig, field))


# llama-server's n-gram drafter flags -> SpecConfig's fields.
SPEC_NGRAM_FLAGS = {"--spec-ngram-simple-size-n": "simple_size_n", "--spec-ngram-simple-size-m": "simple_size_m",
                    "--spec-ngram-simple-min-hits": "simple_min_hits", "--spec-ngram-mod-n-match": "mod_n_match",
                    "--spec-ngram-mod-n-min": "mod_n_min", "--spec-ngram-mod-n-max": "mod_n_max"}


def speculative(args) -> SpecConfig:
    """The --spec-* flags, checked (ValueError naming the flag)."""
    draft = args.spec_draft_model or ""
    kind = "draft-simple" if draft and args.spec_type == "none" else args.spec_type    # -md alone: llama-server's
    p_min = args.spec_p_min if args.spec_p_min is not None else DRAFT_P_MIN if kind == "draft-simple" else 0.0
    try:
        limits = DraftLimits(n_max=args.spec_n_max, n_min=args.spec_n_min, p_min=p_min)
    except ValueError as exc:
        flags = {"speculative.n_max": "--spec-draft-n-max", "speculative.n_min": "--spec-draft-n-min",
                 "speculative.p_min": "--spec-draft-p-min"}
        msg = str(exc)
        for field, flag in flags.items():
            msg = msg.replace(field, flag)
        raise ValueError(msg) from None
    return SpecConfig(type=kind, limits=limits, draft_model=draft,
                      **{field: getattr(args, f"spec_{field}") for field in SPEC_NGRAM_FLAGS.values()})


# llama-server's built-in chat template names that fastserve has (the ChatML format).
BUILTIN_TEMPLATES = {"chatml": CHATML}


def resolve(args) -> dict:
    """What llama-server's flags on `fastserve serve` ask for, checked (ValueError names the flag):
    n_batch, device, sampling (ServerConfig.sampling), ignore_eos, log_requests, log_file, chat_template (source or
    None), n_gpu_layers (None, "all" or an int: check_gpu_layers() needs the model's depth)."""
    out = {"n_batch": args.batch_size, "device": getattr(args, "device", None), "log_file": args.log_file,
           "pooling": args.pooling, "embd_normalize": args.embd_normalize,
           "log_requests": not args.log_disable, "chat_template": None, "n_gpu_layers": None,
           "chat_template_kwargs": _template_kwargs(args.chat_template_kwargs)}
    if args.host.endswith(".sock"):
        raise ValueError(f"--host {args.host}: fastserve does not serve on a UNIX socket; give an address")
    if args.ctx_size == 0:
        raise ValueError("-c 0 (llama-server: the model's own context size) is not taken; give a size")
    if args.parallel == -1:
        raise ValueError("-np -1 (llama-server: auto) is not taken; give a number of slots")
    if args.ubatch_size is not None:
        if args.ubatch_size < 1:
            raise ValueError(f"--ubatch-size must be >= 1, got {args.ubatch_size}")
        out["n_batch"] = min(args.batch_size, args.ubatch_size)
    if args.models_dir is None and args.sleep_idle_seconds >= 0:
        raise ValueError("--sleep-idle-seconds unloads idle models of --models-dir; one model (-m) is never unloaded")
    if args.models_dir is not None and args.model is not None:
        raise ValueError("give -m (one model) or --models-dir (several), not both")
    if args.models_max < 1:
        raise ValueError(f"--models-max must be >= 1 (models loaded at once), got {args.models_max}")
    if args.embd_normalize < -1:
        raise ValueError(f"--embd-normalize must be >= -1, got {args.embd_normalize}")
    if args.keep < -1:
        raise ValueError(f"--keep must be >= -1, got {args.keep}")
    if args.flash_attn == "off":
        raise ValueError("--flash-attn off is not supported: fastserve's attention is always its blocked "
                         "(flash-style) kernel")
    if args.verbose:
        out["log_requests"] = True
    if args.log_verbosity is not None:
        out["log_requests"] = args.log_verbosity >= 3 and not args.log_disable
    if args.chat_template is not None and args.chat_template_file is not None:
        raise ValueError("give --chat-template or --chat-template-file, not both")
    if args.chat_template_file is not None:
        try:
            with open(args.chat_template_file, encoding="utf-8") as f:
                out["chat_template"] = f.read()
        except OSError as exc:
            raise ValueError(f"--chat-template-file: {exc}") from None
    elif args.chat_template is not None:
        src = args.chat_template
        if "{%" not in src and "{{" not in src:
            if src not in BUILTIN_TEMPLATES:
                raise ValueError(f"--chat-template {src!r}: not a Jinja template, and not a built-in name fastserve "
                                 f"has ({', '.join(BUILTIN_TEMPLATES)}); give the template itself or a file "
                                 f"(--chat-template-file)")
            src = BUILTIN_TEMPLATES[src]
        out["chat_template"] = src
    ngl = args.n_gpu_layers
    if ngl is not None:
        if ngl in ("all", "auto"):
            out["n_gpu_layers"] = "all"
        else:
            try:
                out["n_gpu_layers"] = int(ngl)
            except ValueError:
                raise ValueError(f"--n-gpu-layers must be a number, 'auto' or 'all', got {ngl!r}") from None
            if out["n_gpu_layers"] < 0:
                out["n_gpu_layers"] = "all"            # llama.cpp reads a negative count as all
            elif out["n_gpu_layers"] == 0 and out["device"] in ("cuda", "auto"):
                out["device"] = "cpu"                  # 0 layers in VRAM: the model stays on the CPU
    # the sampling flags' dests are SamplingParams' field names (those with no flag are absent)
    out["sampling"] = {name: getattr(args, name) for name in SAMPLING_DEFAULTS if getattr(args, name, None) is not None}
    out["ignore_eos"] = args.ignore_eos
    out["speculative"] = speculative(args)
    out["seed"] = None
    if args.seed is not None and args.seed != -1:
        if not 0 <= args.seed < 2 ** 64:
            raise ValueError(f"--seed must be -1 (random) or in [0, 2**64), got {args.seed}")
        out["seed"] = args.seed
    return out


def check_gpu_layers(n_gpu_layers, device, n_layers: int) -> None:
    """On the GPU, the model goes whole: a count below its layers (a split) is refused."""
    if device == "cuda" and isinstance(n_gpu_layers, int) and 0 < n_gpu_layers < n_layers:
        raise ValueError(f"--n-gpu-layers {n_gpu_layers}: fastserve cannot split a model between the CPU and the GPU "
                         f"({n_layers} layers): give 0 (CPU) or all")


def sampling_defaults(n_vocab: int, given: dict):
    """The server-wide SamplingParams of the sampling flags (resolve()'s "sampling"), checked as a request's
    fields are (ValueError naming the flag)."""
    try:
        return SamplingParams.make(n_vocab, seed=0, **given)
    except RequestError as exc:
        raise ValueError(f"sampling flags: {exc}") from None


def _names(flags: str) -> list[str]:
    """The option names a table row's first column spells ("-c, --ctx-size N; -ctv, ..." -> -c, --ctx-size, -ctv)."""
    out = []
    for part in flags.replace(";", ",").replace("(", ",").replace(")", ",").split(","):
        word = part.strip().split(" ")[0]
        if word.startswith("-"):
            out.append(word)
    return out


def covers(option: str) -> tuple[str, str, str] | None:
    """The row that speaks for option (a row's name may be a pattern: --dry-*), or None."""
    from fnmatch import fnmatchcase
    for row in FLAGS:
        if any(n == option or ("*" in n and fnmatchcase(option, n)) for n in _names(row[0])):
            return row
    return None


def markdown_table() -> str:
    """docs/flags.md's table of llama-server's flags (generated: tests/unit/test_llama_flags.py compares)."""
    label = {SAME: "same", DIFFERS: "differs", REFUSED: "refused"}
    lines = ["| llama-server flag | fastserve | how, or why not |", "| --- | --- | --- |"]
    for flags, status, note in FLAGS:
        lines.append(f"| `{flags}` | {label[status]} | {note} |")
    return "\n".join(lines)
