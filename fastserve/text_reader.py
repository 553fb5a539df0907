"""TextReader: one request's text, a layer over its Reader. Engine.submit returns it; Engine.generate/stream
and the HTTP routes read through it.

The Reader (fastserve/reader.py) holds the request's token ids, its waits and its cancel; a TextStream (text.py)
turns the ids into text on the consumer's side (DESIGN.md contract 4): detokenization and stop strings. A stop
string found here cancels the request (the reader's cancel: the engine's inbox), whose outcome is then "word"
(finish reason "stop"). Its clocks (time.monotonic(): submit, first token, last token, end) are the request's
timings for both layers, and its outcome() is the key of request.OUTCOMES, the one table of how a request can end.
What was asked (id, n_prompt) is kept here too: the engine's Request stays on its side.
"""
from __future__ import annotations

import time
from typing import Optional

from .reader import Reader
from .request import Completion
from .text import TextStream


class TextReader:
    """TextReader(reader, tokenizer, stop=(), *, id=0, n_prompt=0)
      reader: the request's Reader (token ids; its slot and n_cached once admitted);
      id, n_prompt (prompt tokens): the request as submitted.
    Iterate it (blocking or `async for`) for text pieces; result() gives the whole Completion, also after
    iterating; cancel() stops the request. One consumer at a time, as for its Reader."""

    __slots__ = ("reader", "id", "n_prompt", "_text", "_tokens", "t_submit", "t_first", "t_last", "t_end")

    def __init__(self, reader: Reader, tokenizer, stop=(), *, id: int = 0, n_prompt: int = 0):
        self.reader = reader
        self.id, self.n_prompt = id, n_prompt
        self._text = TextStream(tokenizer, stop)
        self._tokens: list[int] = []       # token ids turned into text so far (cut at a stop string)
        self.t_submit = time.monotonic()
        self.t_first: float | None = None  # the first token fed
        self.t_last: float | None = None   # the last batch fed
        self.t_end: float | None = None    # flush(): the text is complete

    def cancel(self) -> None:
        """Stop the request (it ends 'cancelled' within a step; nothing happens once it ended)."""
        self.reader.cancel()

    # -- the text layer ---------------------------------------------------------------------------

    def feed(self, batch) -> tuple[str, int]:
        """The text of a batch of generated ids: (what is now safe to show, how many of the ids it used;
        fewer than len(batch) when a stop string ended the text, which also cancels the request)."""
        if not batch:
            return "", 0
        now = time.monotonic()
        if self.t_first is None:
            self.t_first = now
        self.t_last = now
        text = self._text
        out = []
        n = 0
        for tok in batch:
            if text.stopped:
                break
            n += 1
            out.append(text.push(tok))
            if text.stopped:
                self.reader.cancel()       # free the slot: nobody wants what follows
        self._tokens.extend(batch[:n] if n < len(batch) else batch)
        return "".join(out), n

    def flush(self) -> str:
        """The end of the text: what was held back (nothing of a stop string)."""
        if self.t_end is None:
            self.t_end = time.monotonic()
        return self._text.finish()

    @property
    def text(self) -> str:
        return self._text.text

    @property
    def stopping_word(self) -> str:
        return self._text.stopping_word

    @property
    def stopped(self) -> bool:
        """A stop string ended the text."""
        return self._text.stopped

    @property
    def token_ids(self) -> list:
        """The ids turned into text so far (cut at a stop string)."""
        return self._tokens

    def outcome(self) -> Optional[str]:
        """How the request ended, a key of request.OUTCOMES ("word" for a stop string); None while it runs."""
        return "word" if self._text.stopped else self.reader.finish_reason

    # -- iteration and results ---------------------------------------------------------------------

    def __iter__(self):
        """Blocking iteration over text pieces (never half a character, never part of a stop string)."""
        for batch in self.reader.batches():
            yield from self._pieces(batch)
            if self._text.stopped:
                break
        yield from self._pieces(None)

    def __aiter__(self):
        return self._aiter()

    async def _aiter(self):
        async for batch in self.reader.abatches():
            for piece in self._pieces(batch):
                yield piece
            if self._text.stopped:
                break
        for piece in self._pieces(None):
            yield piece

    def _pieces(self, batch):
        """The text of one batch of token ids (None: the end), as zero or one piece."""
        piece = self.flush() if batch is None else self.feed(batch)[0]
        if piece:
            yield piece

    def result(self, timeout: Optional[float] = None) -> Completion:
        """Block until finished; the whole completion (also after iterating)."""
        if not self._text.stopped and not self.reader.wait(timeout, finish_only=True):
            raise TimeoutError(f"request not finished within {timeout} s")
        return self._completion()

    async def aresult(self) -> Completion:
        if not self._text.stopped:
            await self.reader.wait_async(finish_only=True)
        return self._completion()

    def _completion(self) -> Completion:
        reader = self.reader
        self.feed(reader.read_available())
        self.flush()
        reason = "stop" if self._text.stopped else (reader.finish_reason or "stop")
        probs = None
        if reader.buffer.n_probs:
            ids, ps = reader.buffer.all_probs()
            n = len(self._tokens)
            probs = [list(zip(ids[i].tolist(), ps[i].tolist())) for i in range(min(n, len(ids)))]
        timings = {"total_ms": (time.monotonic() - self.t_submit) * 1e3}
        if self.t_first is not None:
            timings["first_token_ms"] = (self.t_first - self.t_submit) * 1e3
        slot = reader.slot
        if slot >= 0:
            timings["cache_n"] = reader.n_cached
            timings["prompt_n"] = self.n_prompt - reader.n_cached
            if reader.buffer.draft_n:               # speculative decoding, as llama-server's timings say it
                timings["draft_n"] = reader.buffer.draft_n
                timings["draft_n_accepted"] = reader.buffer.draft_n_accepted
        return Completion(text=self._text.text, token_ids=list(self._tokens), finish_reason=reason,
                          prompt_tokens=self.n_prompt, stopping_word=self._text.stopping_word,
                          error=reader.error, probs=probs, timings=timings, id_slot=slot,
                          tokens_cached=self.n_prompt + reader.count if slot >= 0 else 0)
