"""TextStream: stop strings never leak, not even in part; text is UTF-8 safe."""
import pytest

from fastserve.text import TextStream


class _Chars:
    """A stand-in tokenizer: token i is the i-th character of `alphabet`; token 0 is end-of-generation."""

    def __init__(self, alphabet):
        self.alphabet = alphabet
        self.eog_ids = frozenset({0})

    def decoder(self, skip_special=False):
        alphabet = self.alphabet

        class D:
            def push(self, t):
                return "" if t == 0 else alphabet[t]

            def flush(self):
                return ""
        return D()


ALPHA = "\0abcdefgh XY"


def _ids(text):
    return [ALPHA.index(c) for c in text]


def _run(text, stop):
    s = TextStream(_Chars(ALPHA), stop)
    out = []
    for t in _ids(text):
        out.append(s.push(t))
        if s.stopped:
            break
    out.append(s.finish())
    return out, s


@pytest.mark.parametrize("text,stop,want,word", [
    ("abc def", ["XY"], "abc def", ""),
    ("abc XY def", ["XY"], "abc ", "XY"),
    ("abcdef", ["cd", "bcx"], "ab", "cd"),
    ("abXabY", ["XY"], "abXabY", ""),
    ("ab", ["bcd"], "ab", ""),
])
def test_stop_strings(text, stop, want, word):
    pieces, s = _run(text, stop)
    assert "".join(pieces) == want == s.text
    assert s.stopping_word == word


def test_partial_stop_is_held_back_until_it_cannot_match():
    s = TextStream(_Chars(ALPHA), ["XYZ"])
    assert s.push(ALPHA.index("a")) == "a"
    assert s.push(ALPHA.index("X")) == ""          # could be the start of XYZ
    assert s.push(ALPHA.index("Y")) == ""
    assert s.push(ALPHA.index("a")) == "XYa"       # it was not
    assert s.finish() == ""


def test_end_of_generation_token_adds_no_text():
    s = TextStream(_Chars(ALPHA), [])
    assert s.push(1) == "a" and s.push(0) == "" and s.finish() == ""


def test_utf8_safe_with_real_tokenizer(tiny_model):
    tok = tiny_model.tokenizer
    text = "naïve café 🦙 done"
    ids = tok.encode(text, add_special=False)
    s = TextStream(tok, [])
    pieces = [s.push(i) for i in ids] + [s.finish()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
