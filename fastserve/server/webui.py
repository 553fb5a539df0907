"""GET / : the chat page, one static file (webui.html beside this module) with its own CSS and JS.

The page talks to /v1/chat/completions from the browser and loads nothing from
anywhere else, so it works offline; its Content-Security-Policy says so to the
browser too (no other origin, no plugin, no frame). It is public when the server
has an API key: the page holds no secret, and asks the user for the key on a 401.
`--no-webui` turns it off (404).
"""
from __future__ import annotations

from functools import cache

from .errors import HttpError
from .response import Response

HTML = "text/html; charset=utf-8"
# Inline script and style only; fetch() to this origin only; nothing else at all.
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
       "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = [("cache-control", "no-cache"), ("content-security-policy", CSP), ("x-content-type-options", "nosniff"),
           ("referrer-policy", "no-referrer")]


@cache
def page() -> bytes:
    """The page's bytes, read from the package once."""
    from importlib import resources     # here: it imports tempfile and zipfile support, not needed to start
    return resources.files(__package__).joinpath("webui.html").read_bytes()


def index(req, ex, *, config):
    if not config.webui:
        raise HttpError(404, "File Not Found: the web UI is off (--no-webui)")
    return Response(200, page(), HTML, HEADERS)
