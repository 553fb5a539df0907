"""Which web pages may call the server from a browser (CORS), as llama-server's --cors-origins says.

    --cors-origins "*"                 any origin (its answers say `*`)
    --cors-origins A,B                 those origins, and the server's own
    (none)                             pages served from this machine (localhost, 127.0.0.1, [::1], any
                                       port) and the server's own (the chat page at /, however it is reached)

An allowed origin is reflected in Access-Control-Allow-Origin (with Vary: Origin); a preflight OPTIONS is
answered 204 with the methods and headers the routes take. A request whose Origin is not allowed is
refused (403), preflight or not: a page elsewhere cannot make the server generate for it, even blind. A
request without Origin (curl, the SDKs) is no browser's and is never refused here.
"""
from __future__ import annotations

from urllib.parse import urlsplit

from .errors import HttpError

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
PREFLIGHT = [("access-control-allow-methods", "GET, POST, DELETE, OPTIONS"),
             ("access-control-allow-headers", "authorization, content-type, x-api-key, anthropic-version"),
             ("access-control-max-age", "600")]


def parse_origins(value: str | None) -> tuple | None:
    """--cors-origins: None (the default) or the origins, each without a trailing slash."""
    if value is None:
        return None
    origins = tuple(o.strip().rstrip("/") for o in value.split(",") if o.strip())
    if not origins:
        raise ValueError("--cors-origins: give origins (scheme://host[:port], comma-separated) or *")
    for o in origins:
        parts = urlsplit(o)
        if o != "*" and (parts.scheme not in ("http", "https") or not parts.netloc or parts.path):
            raise ValueError(f"--cors-origins: {o!r} is not an origin (scheme://host[:port]) or *")
    return origins


class Cors:
    def __init__(self, origins: tuple | None):
        self.origins = origins
        self.any = origins is not None and "*" in origins

    def allowed(self, origin: str, host: str | None) -> bool:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False                    # "null" (a file or sandboxed page) and other opaque origins
        if self.any or parts.netloc == host:
            return True
        if self.origins is None:
            return parts.hostname in LOCAL_HOSTS
        return origin.rstrip("/") in self.origins

    def check(self, req) -> list:
        """The answer's CORS headers for req; raises 403 for an origin that is not allowed."""
        origin = req.header("origin")
        if origin is None:
            return []
        if not self.allowed(origin, req.header("host")):
            raise HttpError(403, f"origin {origin!r} may not call this server from a browser: start it with "
                                 f"--cors-origins {origin} (or *)")
        if self.any:
            return [("access-control-allow-origin", "*")]
        return [("access-control-allow-origin", origin), ("vary", "origin")]
