"""_gguf_strings against its pure-Python twin: the same spans, and the same count when strings run out."""
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastserve.models._gguf_strings as c_strings
import fastserve.models.ref.gguf_strings as r_strings

IMPLS = [pytest.param(c_strings, id="cython"), pytest.param(r_strings, id="python")]


def _packed(strings: list[bytes], lead: bytes = b"") -> np.ndarray:
    return np.frombuffer(lead + b"".join(struct.pack("<Q", len(s)) + s for s in strings), np.uint8)


def _spans(impl, buf, offset, count):
    starts, stops = np.full(count, -1, np.int64), np.full(count, -1, np.int64)
    done = impl.string_spans(buf, offset, count, starts, stops)
    return done, starts.tolist(), stops.tolist()


@pytest.mark.parametrize("impl", IMPLS)
def test_spans_of_back_to_back_strings(impl):
    strings = [b"a", b"", "Ġthé".encode(), b"x" * 300]
    buf = _packed(strings, lead=b"GGUF")
    done, starts, stops = _spans(impl, buf, 4, len(strings))
    assert done == 4
    assert [buf[a:b].tobytes() for a, b in zip(starts, stops)] == strings
    assert stops[-1] == len(buf)


@pytest.mark.parametrize("impl", IMPLS)
def test_strings_running_past_the_end_are_counted_out(impl):
    buf = _packed([b"ab", b"cdef"])
    assert _spans(impl, buf[:-1], 0, 2)[0] == 1              # the second string's bytes are cut
    assert _spans(impl, buf[:13], 0, 2)[0] == 1              # the second length field is cut
    assert _spans(impl, buf, 0, 3)[0] == 2                   # a third string that is not there
    huge = np.frombuffer(struct.pack("<Q", 2**64 - 1) + b"abc", np.uint8)
    assert _spans(impl, huge, 0, 1) == (0, [-1], [-1])       # a length near 2**64 must not wrap around


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments(impl):
    buf = _packed([b"ab"])
    with pytest.raises(ValueError):
        impl.string_spans(buf, 0, 2, np.zeros(1, np.int64), np.zeros(2, np.int64))
    with pytest.raises(ValueError):
        impl.string_spans(buf, len(buf) + 1, 0, np.zeros(0, np.int64), np.zeros(0, np.int64))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=20), max_size=30), st.integers(0, 40), st.data())
def test_twins_agree_on_random_and_cut_buffers(strings, count, data):
    buf = _packed(strings)
    cut = data.draw(st.integers(0, len(buf)))
    offset = data.draw(st.integers(0, cut))
    assert _spans(c_strings, buf[:cut], offset, count) == _spans(r_strings, buf[:cut], offset, count)
