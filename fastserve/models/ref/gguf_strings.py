"""Pure-Python twin of fastserve.models._gguf_strings (same names, same behaviour)."""
import struct


def string_spans(buf, offset, count, starts, stops):
    n = len(buf)
    if count < 0 or count > len(starts) or count > len(stops):
        raise ValueError(f"count {count} does not fit the output arrays")
    if offset < 0 or offset > n:
        raise ValueError(f"offset {offset} is outside the buffer of {n} bytes")
    p = offset
    for i in range(count):
        if n - p < 8:
            return i
        (length,) = struct.unpack_from("<Q", buf, p)
        p += 8
        if length > n - p:
            return i
        starts[i] = p
        p += length
        stops[i] = p
    return count
