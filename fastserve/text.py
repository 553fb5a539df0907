"""Token ids → text on the consumer's side: UTF-8 safe, stop strings, end-of-generation tokens.

The decode thread sees token ids only (contract 4); this runs where the
result is read. A stop string is never emitted, not even in part: text that
could still turn into a stop string is held back until it cannot.
"""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        # Control tokens (end-of-generation among them) add no text, as in llama.cpp's server.
        self._decoder = tokenizer.decoder(skip_special=True)
        self._stop = [s for s in stop if s]
        self._longest = max((len(s) for s in self._stop), default=0)
        self._text = ""          # everything decoded, cut at a stop string once one is found
        self._emitted = 0        # characters of _text already handed out
        self.stopping_word = ""

    @property
    def stopped(self) -> bool:
        return bool(self.stopping_word)

    @property
    def text(self) -> str:
        return self._text

    def push(self, token_id: int) -> str:
        """Feed one generated token; returns the text that is now safe to show."""
        if self.stopping_word:
            return ""
        self._text += self._decoder.push(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        """End of generation: the rest, with nothing held back."""
        if not self.stopping_word:
            self._text += self._decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._stop and not self.stopping_word:
            start = max(0, self._emitted - self._longest)
            hit = min(((i, s) for s in self._stop if (i := self._text.find(s, start)) >= 0), default=None)
            if hit is not None:
                self._text, self.stopping_word = self._text[:hit[0]], hit[1]
                final = True
        end = len(self._text)
        if not final and self._stop:
            end -= self._held_back()
        out = self._text[self._emitted:end]
        self._emitted = end
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        tail = self._text[-self._longest:] if self._longest else ""
        for k in range(min(len(tail), self._longest - 1), 0, -1):
            piece = tail[-k:]
            if any(s.startswith(piece) for s in self._stop):
                return k
        return 0
