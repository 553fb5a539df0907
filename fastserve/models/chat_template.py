"""The model's chat template (GGUF `tokenizer.chat_template`), rendered in jinja2's sandbox.

A template is code shipped inside a downloaded file, so it runs in ImmutableSandboxedEnvironment
and any attempt to reach an unsafe attribute (``''.__class__`` ...) fails the request instead of
rendering as an empty string. The environment mirrors what HF transformers gives templates
(trim_blocks, lstrip_blocks, loop controls, a non-escaping ``tojson``, ``raise_exception``,
``strftime_now``), since templates are written against it.

A model whose file has no template (Gemma 3 270M, many base models) chats in ChatML, as llama-server does
(common/chat.cpp: the model's template, else its `tool_use` variant, else ChatML); /props shows the template
in use. CHATML is fastserve's own ChatML template; it renders exactly as llama-server's fallback
(tests/unit/test_tokenizer.py checks it against the source llama-server's /props recorded).
"""
from __future__ import annotations

import datetime
import json
from typing import Any

from ..errors import RequestError


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class ChatTemplate:
    """Compiled lazily on first use: a model with a broken template still serves plain completions.
    source None or empty (the model has none): CHATML, with fallback True."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        self.fallback = not source
        self.source = source or CHATML
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._compiled = None

    @property
    def takes_tools(self) -> bool:
        """The template renders an OpenAI `tools` list itself (it names the variable)."""
        return "tools" in self.source

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, kwargs: dict | None = None) -> str:
        """kwargs: further variables for the template (llama-server's chat_template_kwargs: enable_thinking, ...);
        they never replace the ones given here."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise RequestError("messages must be a list of objects like {\"role\": \"user\", \"content\": \"...\"}")
        try:
            if self._compiled is None:
                self._compiled = _environment().from_string(self.source)
            extra = {**(kwargs or {}), **({"tools": tools} if tools else {})}
            for name in ("messages", "add_generation_prompt", "bos_token", "eos_token"):
                extra.pop(name, None)
            return self._compiled.render(messages=messages, add_generation_prompt=bool(add_generation_prompt),
                                         bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except RequestError:
            raise
        except Exception as exc:   # the template is data: whatever it does wrong is a bad request
            raise RequestError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}") from exc


def _environment():
    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Sandbox(ImmutableSandboxedEnvironment):
        def unsafe_undefined(self, obj, attribute):
            # jinja2's default returns an Undefined that renders as "": refuse loudly instead
            raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is not allowed")

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
        return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env
