"""A reasoning reply's thinking apart from its content, whole or delta by delta, and the budget's grammar."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from fastserve.server import reasoning as R

THINK = R.Reasoning("<think>", "</think>", split=True, budget=-1)


@pytest.mark.parametrize("opened, text, want", [
    (True, "plan it</think>\n\nthe answer", ("plan it", "the answer")),
    (False, "<think>plan it</think>the answer", ("plan it", "the answer")),
    (False, "  <think>\nplan</think>  x ", ("\nplan", "x ")),
    (False, "no thinking at all", ("", "no thinking at all")),
    (False, " leading space kept", ("", " leading space kept")),
    (True, "cut short in the thought", ("cut short in the thought", "")),
    (False, "<thin", ("", "<thin")),                           # a marker's start that never completed
    (True, "a </thinker> is not the marker</think>b", ("a </thinker> is not the marker", "b")),
])
def test_split_whole_and_delta_by_delta(opened, text, want):
    r = THINK._replace(opened=opened)
    assert R.split(r, text) == want
    for size in (1, 2, 3):                                      # markers cut anywhere between deltas
        s, got = R.Splitter(r), ["", ""]
        for i in range(0, len(text), size):
            a, b = s.feed(text[i:i + size])
            got[0] += a
            got[1] += b
        a, b = s.flush()
        assert (got[0] + a, got[1] + b) == want, size


def test_markers_come_from_the_template():
    assert R.markers("{{ '<think>' }} ... </think>") == ("<think>", "</think>")
    assert R.markers("[THINK] [/THINK]") == ("[THINK]", "[/THINK]")
    assert R.markers("{{ messages }}") is None
    assert R.plan("x", "auto", -1) is None and R.plan("<think></think>", "none", 5).split is False


def test_budget_grammar_uses_a_special_marker_token():
    special = SimpleNamespace(encode=lambda t, add_special: [42] if t == "</think>" else [1, 2],
                              is_special=lambda i: i == 42)
    text = R.budget_grammar(THINK._replace(budget=9), special)
    assert "CLOSE: <[42]>" in text and 'OPEN: "<think>"' in text and "max_tokens=9" in text
