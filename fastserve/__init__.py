"""fastserve: single-process LLM inference for GGUF models (llama, Qwen 2/3, Gemma 3 families).

    import fastserve
    model = fastserve.load_model(fastserve.default_model_path())
    with fastserve.Engine(model, n_parallel=8) as engine:
        print(engine.generate("The capital of France is", max_tokens=16, temperature=0).text)
"""
from .engine import Engine
from .errors import ContextExceeded, EngineClosed, FastserveError, ModelLoadError, PullError, RequestError, ServerBusy
from .models.model import Model, load_model
from .models.default_model import default_model_path, pull
from .request import Completion

__all__ = ["Engine", "Model", "Completion", "load_model", "default_model_path", "pull",
           "FastserveError", "ModelLoadError", "PullError", "RequestError", "ContextExceeded", "ServerBusy",
           "EngineClosed"]
