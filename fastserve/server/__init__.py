"""The HTTP server: uvloop + h11 in the engine's process, llama.cpp- and OpenAI-compatible.

    http.py      sans-I/O HTTP/1.1 (h11): bytes in → HttpRequest, responses → bytes
    protocol.py  one connection on the loop: flow control, disconnects, timeouts
    app.py       routing, auth, CORS, request lifecycle, the routes' services; Server; serve(args)
    routes.py    the route table; /health /slots /metrics /props /tokenize /detokenize /slots/{id}
    params.py    one parse of a generation request: body → Params (prompts, SamplingParams, limits)
    llama_api.py POST /completion          openai_api.py  /v1/models /v1/completions /v1/chat/completions
    embeddings_api.py /v1/embeddings /embedding            ollama_api.py  Ollama's /api/* routes
                                                       (ollama_body.py: its bodies → the chat's)
    generation.py one engine request as the loop sees it (text, deadlines); fanout.py several of them
    watchdog.py  stall detection, deadlines, dropping clients that do not read
    metrics.py   Prometheus text          sse.py, response.py, probs.py, fields.py, tools.py, errors.py,
                                           reqlog.py, config.py, llama_flags.py
"""
from .app import App, Server, serve
from .config import ServerConfig

__all__ = ["App", "Server", "ServerConfig", "serve"]
