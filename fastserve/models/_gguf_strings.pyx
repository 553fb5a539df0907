# cython: language_level=3
"""Where the strings of a GGUF string array lie in the mapped file: one C pass, no Python per string.

A GGUF string is its byte count (little-endian uint64) followed by that many bytes. An array of
them is stored back to back, so string i's place depends on every length before it: the walk is
sequential, and done here at C speed so that a 49k-token vocabulary costs microseconds, not a
Python loop. The caller slices and decodes buf[starts[i]:stops[i]].
Twin: fastserve/models/ref/gguf_strings.py.
"""
from libc.stdint cimport int64_t, uint64_t


def string_spans(const unsigned char[::1] buf, Py_ssize_t offset, Py_ssize_t count,
                 int64_t[::1] starts, int64_t[::1] stops):
    """Fill starts[:count], stops[:count] with the byte range of each of `count` strings stored back to
    back from buf[offset]. Returns how many lie wholly inside buf: count when all do; k < count when
    string k's length field or bytes run past the end (starts/stops beyond k are left as they were)."""
    cdef Py_ssize_t n = buf.shape[0], i, done = 0
    cdef uint64_t p, length
    cdef int k
    if count < 0 or count > starts.shape[0] or count > stops.shape[0]:
        raise ValueError(f"count {count} does not fit the output arrays")
    if offset < 0 or offset > n:
        raise ValueError(f"offset {offset} is outside the buffer of {n} bytes")
    p = <uint64_t>offset
    with nogil:
        for i in range(count):
            if <uint64_t>n - p < 8:
                break
            length = 0
            for k in range(8):          # byte by byte: unaligned and host-endian safe
                length |= (<uint64_t>buf[p + k]) << (8 * k)
            p += 8
            if length > <uint64_t>n - p:
                break
            starts[i] = <int64_t>p
            p += length
            stops[i] = <int64_t>p
            done += 1
    return done
