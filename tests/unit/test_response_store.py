"""The responses /v1/responses keeps: least recently used out first, bounded in entries and in characters."""
from __future__ import annotations

from fastserve.server.response_store import ResponseStore


def _put(store: ResponseStore, rid: str, text: str = "x") -> None:
    store.put(rid, [{"role": "user", "content": text}], frozenset({"call_" + rid}), {"id": rid})


def test_the_least_recently_used_goes_first():
    store = ResponseStore(max_responses=3)
    for rid in "abc":
        _put(store, rid)
    assert store.get("a").response == {"id": "a"}          # a is now the most recently used
    _put(store, "d")
    assert store.get("b") is None and [r for r in "acd" if store.get(r)] == ["a", "c", "d"]
    assert store.get("c").calls == frozenset({"call_c"}) and len(store) == 3


def test_bounded_in_characters_and_deletable():
    one = len('[{"role":"user","content":""}]') + len('{"id":"a"}')
    store = ResponseStore(max_chars=3 * (one + 100))
    for rid in "abcd":
        _put(store, rid, "y" * 100)
    assert [r for r in "abcd" if store.get(r)] == ["b", "c", "d"] and store.chars == 3 * (one + 100)
    _put(store, "huge", "z" * 10_000)                      # larger than the whole budget: not kept, nothing evicted
    assert store.get("huge") is None and len(store) == 3
    _put(store, "c", "y" * 100)                             # stored again: replaced, counted once
    assert store.chars == 3 * (one + 100)
    assert store.delete("c") and not store.delete("c") and store.chars == 2 * (one + 100)
