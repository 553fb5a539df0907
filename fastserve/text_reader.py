"""TextReader: the Reader that engine.submit() returns — text pieces out, stop strings applied.

It is a Reader (fastserve/reader.py: token ids, blocking and async waits,
cancel) with a TextStream on top. Detokenization and stop strings run here, on
the consumer's side; a stop string found here cancels the request, whose
finish reason is then "stop".
"""
from __future__ import annotations

import time
from typing import Optional

from .reader import Reader
from .request import Admission, Completion
from .text import TextStream


class TextReader(Reader):
    __slots__ = ("_text", "_tokens", "_prompt_tokens", "_t_submit", "_t_first", "_params", "admission")

    def __init__(self, capacity: int, tokenizer, stop=(), n_probs: int = 0, on_cancel=None,
                 prompt_tokens: int = 0, params=None):
        super().__init__(capacity, n_probs, on_cancel)
        self._text = TextStream(tokenizer, stop)
        self._tokens: list[int] = []       # token ids turned into text so far (cut at a stop string)
        self._prompt_tokens = prompt_tokens
        self._params = params
        self._t_submit = time.perf_counter()
        self._t_first: float | None = None
        self.admission = Admission()       # slot and cached prompt tokens, set by the engine at admission

    def _feed(self, batch) -> str:
        if self._t_first is None and batch:
            self._t_first = time.perf_counter()
        out = []
        for tok in batch:
            if self._text.stopped:
                break
            self._tokens.append(tok)
            out.append(self._text.push(tok))
            if self._text.stopped:
                self.cancel()              # free the slot: nobody wants what follows
        return "".join(out)

    def _tail(self) -> str:
        return self._text.finish()

    def __iter__(self):
        """Blocking iteration over text pieces (never half a character, never part of a stop string)."""
        for batch in self.batches():
            yield from self._pieces(batch)
            if self._text.stopped:
                break
        yield from self._pieces(None)

    def _pieces(self, batch):
        """The text of one batch of token ids (None: the end), as zero or one piece."""
        piece = self._tail() if batch is None else self._feed(batch)
        if piece:
            yield piece

    def __aiter__(self):
        return self._aiter()

    async def _aiter(self):
        async for batch in self.abatches():
            for piece in self._pieces(batch):
                yield piece
            if self._text.stopped:
                break
        for piece in self._pieces(None):
            yield piece

    def result(self, timeout: Optional[float] = None) -> Completion:
        """Block until finished; the whole completion (also after iterating)."""
        if not self._text.stopped and not self.wait(timeout, finish_only=True):
            raise TimeoutError(f"request not finished within {timeout} s")
        return self._completion()

    async def aresult(self) -> Completion:
        if not self._text.stopped:
            await self.wait_async(finish_only=True)
        return self._completion()

    def _completion(self) -> Completion:
        self._feed(self.read_available())
        self._tail()
        reason = "stop" if self._text.stopped else (self.finish_reason or "stop")
        probs = None
        if self.buffer.n_probs:
            ids, ps = self.buffer.all_probs()
            n = len(self._tokens)
            probs = [list(zip(ids[i].tolist(), ps[i].tolist())) for i in range(min(n, len(ids)))]
        t_end = time.perf_counter()
        timings = {"total_ms": (t_end - self._t_submit) * 1e3}
        if self._t_first is not None:
            timings["first_token_ms"] = (self._t_first - self._t_submit) * 1e3
        adm = self.admission
        if adm.slot >= 0:
            timings["cache_n"] = adm.n_cached
            timings["prompt_n"] = self._prompt_tokens - adm.n_cached
        return Completion(text=self._text.text, token_ids=list(self._tokens), finish_reason=reason,
                          prompt_tokens=self._prompt_tokens, stopping_word=self._text.stopping_word,
                          error=self.error, probs=probs, timings=timings, id_slot=adm.slot,
                          tokens_cached=self._prompt_tokens + self.buffer.count if adm.slot >= 0 else 0)
