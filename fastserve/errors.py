"""The exceptions fastserve raises on purpose. Each message says what to do."""


class FastserveError(Exception):
    """Base class of every error fastserve raises on purpose."""


class ModelLoadError(FastserveError):
    """The model file is missing, is not GGUF, is truncated, or holds something we cannot run."""


class PullError(FastserveError):
    """The default model could not be obtained."""


class RequestError(FastserveError, ValueError):
    """A request is invalid (bad parameter, prompt too long, empty prompt)."""


class ContextExceeded(RequestError):
    """A prompt leaves its slot no room for a token: n_prompt tokens against a slot of n_ctx (llama-server's
    exceed_context_size_error, whose fields the server answers with)."""

    def __init__(self, n_prompt: int, n_ctx: int):
        super().__init__(f"the prompt has {n_prompt} tokens but a slot holds {n_ctx} (n_ctx / n_parallel); "
                         f"shorten it or ask for truncation")
        self.n_prompt, self.n_ctx = n_prompt, n_ctx


class ServerBusy(FastserveError):
    """Every slot is busy and the waiting queue is full."""


class EngineClosed(FastserveError):
    """The engine was closed; no more requests are taken."""


class ConfigError(FastserveError, ValueError):
    """A setting cannot work with this model or backend (e.g. a KV cache type the head size does not fit)."""
