"""The responses /v1/responses keeps for `previous_response_id` (and GET / DELETE /v1/responses/{id}).

In memory only, least recently used first out, bounded both in entries and in the characters of what they
hold: each entry keeps the whole conversation it ended (so a follow-up needs no chain of ancestors, and an
evicted ancestor breaks nothing that came after it).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import orjson

MAX_RESPONSES = 512
MAX_CHARS = 64 << 20        # of the entries' JSON, all together


class Stored(NamedTuple):
    messages: list          # the conversation as chat messages, its instructions left out (they do not carry over)
    calls: frozenset        # the call_ids of the function calls in it: what a function_call_output may answer
    response: dict          # the response object, as it was answered
    size: int


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS):
        self.max_responses, self.max_chars = max_responses, max_chars
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self.chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, rid: str) -> Stored | None:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def put(self, rid: str, messages: list, calls: frozenset, response: dict) -> None:
        size = len(orjson.dumps(messages)) + len(orjson.dumps(response))
        if size > self.max_chars:
            return                  # kept, it would evict everything else: not kept
        self.delete(rid)
        self._entries[rid] = Stored(messages, calls, response, size)
        self.chars += size
        while len(self._entries) > self.max_responses or self.chars > self.max_chars:
            _, old = self._entries.popitem(last=False)
            self.chars -= old.size

    def delete(self, rid: str) -> bool:
        entry = self._entries.pop(rid, None)
        if entry is None:
            return False
        self.chars -= entry.size
        return True
