"""The server's settings: one frozen dataclass, validated here (the engine's own are the Engine's)."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import DEFAULT_BODY_LIMIT, SamplingParams
from ..embedding import POOLINGS

BUILD_INFO = "fastserve-0.1.0"       # /props' build_info, OpenAI's system_fingerprint


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080                 # 0: any free port (the log line says which)
    api_key: str | None = None       # required on every route but server/routes.PUBLIC when set
    timeout: float = 600.0           # s: a client that reads nothing (or sends nothing) this long is dropped
    stall_limit: float = 30.0        # s: work pending and no decode step this long → /health 503, requests fail
    queue_timeout: float = 600.0     # s: most time a request may wait for a slot (0: no limit)
    request_timeout: float = 0.0     # s: most time a request may take in all (0: no limit)
    token_timeout: float = 60.0      # s: most time between two tokens of a running request (0: no limit)
    n_predict: int = -1              # tokens generated when a request does not say (-1: until the slot is full)
    cors_origins: tuple | None = None    # origins allowed to call from a browser ("*": any; None: this machine's)
    body_limit: int = DEFAULT_BODY_LIMIT
    alias: str | None = None         # the model name in responses (default: the file name)
    # s: how long /slots/{id}?action=erase waits for a busy slot's request to end (the erasure happens then,
    # whatever the wait): as long as a request may wait for a slot, since under load a request lasts minutes
    erase_wait: float = 600.0
    tick: float = 0.1                # s: watchdog period (deadlines, stall, dropped clients)
    log_requests: bool = True
    # llama-server's endpoint switches: /metrics is opt-in (--metrics), /slots opt-out (--no-slots),
    # POST /props opt-in (--props); a route switched off answers 501 saying which flag turns it on
    metrics: bool = False
    slots: bool = True
    props: bool = False
    # server-wide sampling defaults (--temp, --top-k, ... --frequency-penalty): what a request gets for a
    # field it does not give; its seed field is unused: `seed` (--seed) is the seed of requests without one
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None          # None: a random seed per request (llama-server's -1)
    ignore_eos: bool = False         # --ignore-eos: a request's ignore_eos when it does not give one
    webui: bool = True               # GET / serves the chat page (--no-webui: 404)
    # a chat's last assistant message is continued, not answered (llama-server's --prefill-assistant, its default)
    prefill_assistant: bool = True
    # reasoning models (server/reasoning.py): their thinking apart from the content, and its budget in tokens
    reasoning_format: str = "auto"   # none | deepseek | auto
    reasoning_budget: int = -1       # -1: none; 0: thinking off; N: at most N tokens of thinking
    chat_template_kwargs: dict | None = None     # further template variables of every chat (enable_thinking, ...)
    # embeddings (server/embeddings_api.py): llama-server's --pooling (none | mean | cls | last) and
    # --embd-normalize (a request's embd_normalize when it gives none: -1 none, 2 Euclidean, p > 2 p-norm)
    pooling: str = "mean"
    embd_normalize: int = 2

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        for name in ("timeout", "stall_limit"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds")
        for name in ("queue_timeout", "request_timeout", "token_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 seconds (0: no limit)")
        if self.body_limit < 1024:
            raise ValueError("--body-limit must be at least 1024 bytes")
        if self.n_predict < -1:
            raise ValueError("--n-predict must be -1 (no limit) or >= 0")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        if self.reasoning_format not in ("none", "deepseek", "auto"):
            raise ValueError(f"--reasoning-format must be none, deepseek or auto, got {self.reasoning_format!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"--pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if self.embd_normalize < -1:
            raise ValueError(f"--embd-normalize must be >= -1, got {self.embd_normalize}")
        if self.reasoning_budget < -1:
            raise ValueError("--reasoning-budget must be -1 (no budget), 0 (no thinking) or a number of tokens")
