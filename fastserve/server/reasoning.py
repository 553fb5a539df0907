"""Reasoning models: their thinking apart from their answer, and a budget on it (llama-server's --reasoning-format,
--reasoning-budget).

A template that names a thinking marker pair (MARKERS: <think>...</think> for DeepSeek-R1 and Qwen3, [THINK]...
[/THINK], <seed:think>...) makes a reasoning chat. With --reasoning-format deepseek or auto (the default), the
text up to the closing marker is the reply's reasoning (chat `reasoning_content`, Anthropic `thinking` blocks,
Responses `reasoning` items) and what follows it the content; a prompt that ends inside an opened marker (the
template opened it: DeepSeek-R1) starts in the thinking. none: the text is the content, markers and all.

A budget of N >= 1 tokens is enforced in the sampler: the request's constraint is a grammar (llguidance's Lark)
whose thought may take at most N tokens, after which the closing marker is the only text allowed, then any
answer; 0 turns the thinking off in the template (enable_thinking false, as llama-server). A request whose
constraint is already JSON or a grammar (tools, response_format, grammar) keeps it, and its text is all
content: JSON from the first token leaves no thinking.
"""
from __future__ import annotations

from typing import NamedTuple

from .errors import HttpError

MARKERS = (("<think>", "</think>"), ("<seed:think>", "</seed:think>"), ("[THINK]", "[/THINK]"))
FORMATS = ("none", "deepseek", "auto")
# OpenAI's reasoning_effort as a budget (-1: none but the request's max_tokens)
EFFORT_BUDGET = {"none": 0, "minimal": 0, "low": 1024, "medium": 4096, "high": -1}


class Reasoning(NamedTuple):
    """A reasoning chat's plan: its markers, whether to split, its budget, whether the prompt opened the thinking."""
    open: str
    close: str
    split: bool
    budget: int              # -1: no budget
    opened: bool = False


def markers(template: str) -> tuple[str, str] | None:
    """The thinking markers the template names, or None (not a reasoning template)."""
    return next(((o, c) for o, c in MARKERS if o in template and c in template), None)


def plan(template: str, fmt: str, budget: int) -> Reasoning | None:
    pair = markers(template)
    if pair is None:
        return None
    return Reasoning(*pair, split=fmt != "none", budget=budget)


def request_budget(body, default: int) -> int:
    """The request's thinking budget: thinking_budget_tokens, else reasoning_effort, else the server's."""
    n = body.int("thinking_budget_tokens", None, lo=-1)
    if n is not None:
        return n
    effort = body.raw("reasoning_effort")
    if effort is None:
        return default
    if effort not in EFFORT_BUDGET:
        raise HttpError(400, f"'reasoning_effort' must be one of {', '.join(EFFORT_BUDGET)}, got {effort!r}")
    return EFFORT_BUDGET[effort]


def request_format(body, default: str) -> str:
    fmt = body.str("reasoning_format", default)
    if fmt not in FORMATS:
        raise HttpError(400, f"'reasoning_format' must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def budget_grammar(r: Reasoning, tokenizer) -> str:
    """llguidance Lark: an optional opening marker (unless the prompt opened it), a thought of at most r.budget
    tokens that never closes itself early, the closing marker, any answer."""
    close, open_ = _literal(r.close, tokenizer), _literal(r.open, tokenizer)
    start = "start: thought CLOSE answer" if r.opened else "start: OPEN? thought CLOSE answer"
    return "\n".join([
        '%llguidance {"allow_invalid_utf8": true}',        # the thought as free as without the grammar
        start,
        f"OPEN: {open_}",
        f"CLOSE: {close}",
        f"thought[max_tokens={r.budget}]: THOUGHT",
        f"THOUGHT: /(?s:.*)/ & ~/(?s:.*){_regex(r.close)}(?s:.*)/",
        "answer: /(?s:.*)/",
    ])


def _literal(marker: str, tokenizer) -> str:
    """A marker in Lark: its special token when the vocabulary has it as one (grammar text never matches
    those), else the string."""
    ids = tokenizer.encode(marker, add_special=False)
    if len(ids) == 1 and tokenizer.is_special(ids[0]):
        return f"<[{ids[0]}]>"
    return '"' + marker.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _regex(text: str) -> str:
    """text as a Lark regex literal's body: the regex syntax's own characters and the delimiter escaped."""
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~/")


def thought_tokens(r: Reasoning, tokenizer, ids: list) -> int:
    """How many of a reply's tokens are its thinking, its closing marker included (a thought cut short: all)."""
    decoder, text = tokenizer.decoder(), ""
    for n, t in enumerate(ids, 1):
        text += decoder.push(t)
        if r.close in text:
            return n
    thought, content = split(r, text + decoder.flush())
    return len(ids) if thought and not content else 0


def split(r: Reasoning, text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole reply."""
    s = Splitter(r)
    a, b = s.feed(text)
    c, d = s.flush()
    return a + c, b + d


class Splitter:
    """Text deltas -> (reasoning, content) deltas, holding back what could be the start of a marker."""

    def __init__(self, r: Reasoning):
        self.r = r
        self.state = "thinking" if r.opened else "start"      # start -> thinking | content; thinking -> content
        self.pending = ""
        self.after_thought = False          # the content follows a closing marker: its leading blanks go

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning, content = "", ""
        while True:
            if self.state == "start":
                head = self.pending.lstrip()
                if head.startswith(self.r.open):
                    self.pending = head[len(self.r.open):]
                    self.state = "thinking"
                elif self.r.open.startswith(head) and head:
                    return reasoning, content           # could still be the marker
                elif not head and self.pending:
                    return reasoning, content
                else:
                    self.state = "content"
            elif self.state == "thinking":
                i = self.pending.find(self.r.close)
                if i >= 0:
                    reasoning += self.pending[:i]
                    self.pending = self.pending[i + len(self.r.close):]
                    self.state, self.after_thought = "content", True
                    continue
                keep = _partial_suffix(self.pending, self.r.close)
                reasoning += self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                return reasoning, content
            else:
                if self.after_thought:
                    self.pending = self.pending.lstrip()
                    if not self.pending:
                        return reasoning, content
                    self.after_thought = False
                content += self.pending
                self.pending = ""
                return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is held back, at the end: the rest of a thought cut short is reasoning."""
        rest, self.pending = self.pending, ""
        if self.state == "thinking":
            return rest, ""
        return "", rest.lstrip() if self.after_thought else rest


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of text that begins marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
