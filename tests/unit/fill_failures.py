"""A prompt fill that fails after it added its tokens, without the fault build: the engine's slot table
wrapped so that add_prefill adds, then calls on_fill(slot), which may raise (the engine rolls back)."""


class FailingFills:
    def __init__(self, slots, on_fill):
        self._slots, self._on_fill = slots, on_fill

    def add_prefill(self, batch, slot, max_tokens):
        n = self._slots.add_prefill(batch, slot, max_tokens)
        self._on_fill(slot)
        return n

    def __getattr__(self, name):
        return getattr(self._slots, name)
