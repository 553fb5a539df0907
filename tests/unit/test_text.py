"""TextStream: stop strings never leak, not even in part; text is UTF-8 safe. TextReader: that text as a
layer over a request's Reader, which keeps its own meaning (token ids, Result)."""
import numpy as np
import pytest

import fastserve._delivery as cdelivery
import fastserve.ref.delivery as rdelivery
from fastserve.reader import Reader, Waker
from fastserve.text import TextStream
from fastserve.text_reader import TextReader


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


@pytest.mark.parametrize("impl", [cdelivery, rdelivery], ids=["cython", "ref"])
def test_text_reader_is_a_layer_over_a_reader(impl):
    """The text of a request read through its Reader: pieces, a stop string that cancels through the reader's
    on_cancel, and a Completion whose slot and reused prompt tokens came in the buffer; the Reader under it
    still gives every token id and its Result."""
    cancels = []
    reader = Reader(16, on_cancel=lambda: cancels.append(1), impl=impl)
    text = TextReader(reader, _Chars(ALPHA), stop=["XY"], id=7, n_prompt=3)
    dl = impl.Delivery(1, Waker())
    dl.attach(0, reader, 2)
    ids = _ids("ab cXYd")
    for t in ids:
        dl.send_step(np.zeros(1, np.int32), np.array([t], np.int32))
    assert "".join(text) == "ab c" and cancels == [1]          # the stop string cancelled the request
    done = text.result()
    assert (done.text, done.finish_reason, done.stopping_word, done.token_ids) == ("ab c", "stop", "XY", ids[:6])
    assert (done.id_slot, done.timings["cache_n"], done.timings["prompt_n"], done.tokens_cached) == (0, 2, 1, 10)
    dl.finish(0, impl.FINISH_CANCELLED)
    assert reader.result().tokens == ids and reader.result().finish_reason == "cancelled"
