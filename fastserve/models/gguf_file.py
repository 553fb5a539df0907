"""Open a GGUF file (memory-mapped) and read its metadata and tensor table.

The layout (GGUF v2 and v3, little-endian; llama.cpp's docs/gguf.md):
    header   "GGUF", uint32 version, uint64 n_tensors, uint64 n_kv
    n_kv     key (string), uint32 value type, value   -- an array: uint32 item type, uint64 n, n items
    n_tensors name (string), uint32 n_dims, uint64 ne[n_dims] (fastest first), uint32 ggml type,
             uint64 offset (from the data section's start, a multiple of general.alignment)
    padding  to general.alignment (default 32); then the data section
A string is a uint64 byte count and that many UTF-8 bytes.

Reading touches only the header pages: string arrays (the vocabulary, the merges) are located
in one C pass (fastserve.models._gguf_strings) and decoded from the mapped file; numeric arrays become
NumPy arrays; tensor data stays in the map, untouched, as views. Every way a file can be unusable
(missing, not GGUF, truncated, misaligned, an unknown type, sizes that do not add up) becomes a
ModelLoadError naming the file and, where one is at fault, the tensor or the key.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._gguf_strings import string_spans
from ..errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)               # v1 had 32-bit counts; v2 and v3 share one little-endian layout
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                    # GGML_MAX_DIMS
MAX_NESTING = 8                 # arrays of arrays: llama.cpp reads none; gguf-py any (we stop short of recursion limits)

# ggml type id -> (name, elements per block, bytes per block): ggml's type traits (ggml/src/ggml.c).
# Ids absent here were removed from ggml (4, 5, 31-33, 36-38) or are newer than this table.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}
# Types whose data is viewed as typed elements; every other one (BF16 too: NumPy has no bfloat16)
# as uint8 rows of whole blocks, numpy shape (..., ne0 / block * block bytes).
ELEMENT_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4",
                  "I64": "<i8"}

# GGUF metadata value types: id -> (struct format of a scalar, NumPy dtype of an array item)
_SCALARS = {0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
            5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "<u1"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
            12: ("<d", "<f8")}
_SIZES = {t: struct.calcsize(f) for t, (f, _) in _SCALARS.items()}
BOOL, STRING, ARRAY = 7, 8, 9
_MIN_KV_BYTES = 8 + 4 + 1                # key length, value type, the smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8   # name length, n_dims, type, offset


@dataclass(frozen=True)
class TensorEntry:
    name: str
    type_name: str          # e.g. "Q4_1", "F32" (ggml's type name)
    type_id: int
    shape: tuple[int, ...]  # numpy order: rows first (GGUF's ne reversed)
    data: np.ndarray        # raw bytes or elements, memory-mapped


class GGUFFile:
    """A GGUF file: `metadata` (key -> python value) and `tensors` (name -> TensorEntry).

    Metadata values: int, float, bool, str; an array of numbers or bools is a 1-D NumPy array, an
    array of strings a list of str, an array of arrays a list of those.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        _check_header(self.path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        # every tensor's data is a view whose .base chain ends at this mmap, as np.memmap's do
        self._bytes = np.ndarray((len(self._map),), np.uint8, buffer=self._map)
        r = _Reader(self.path, self._map, self._bytes)
        self.version, n_tensors, n_kv = _read_counts(r)
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = r.string(f"metadata key #{i}")
            if key in self.metadata:
                raise ModelLoadError(f"{self.path}: metadata key {key!r} appears twice; the file is corrupt")
            value_type = r.u32(f"the type of metadata key {key!r}")
            if key == "general.alignment" and value_type != 4:
                raise ModelLoadError(f"{self.path}: general.alignment has value type {value_type}, not uint32 (4); "
                                     "the file is corrupt")
            self.metadata[key] = r.value(value_type, key)
        self.alignment = _alignment(self.path, self.metadata)
        infos = [_read_tensor_info(r, i) for i in range(r.count(n_tensors, _MIN_TENSOR_INFO_BYTES, "tensors"))]
        self.data_offset = -(-r.pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorEntry] = {}
        for name, dims, type_id, offset in infos:
            if name in self.tensors:
                raise ModelLoadError(f"{self.path}: tensor {name} appears twice in the tensor table; the file is corrupt")
            self.tensors[name] = self._entry(name, dims, type_id, offset)
        self._check_no_overlap(infos)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "<missing>"))

    def _entry(self, name: str, dims: tuple[int, ...], type_id: int, offset: int) -> TensorEntry:
        """The tensor's view into the map, after checking its type, shape, alignment and extent."""
        where = f"{self.path}: tensor {name}"
        if type_id not in GGML_TYPES:
            raise ModelLoadError(f"{where} has ggml type id {type_id}, which is not a known ggml type (removed "
                                 "from ggml or newer than fastserve); the file is corrupt or needs a newer fastserve")
        type_name, block, block_bytes = GGML_TYPES[type_id]
        shape = tuple(reversed(dims))
        ne0 = dims[0] if dims else 1
        if ne0 % block:
            raise ModelLoadError(f"{where} ({type_name}, shape {shape}) has rows of {ne0} elements, not a "
                                 f"multiple of the {type_name} block of {block}; the file is corrupt")
        if offset % self.alignment:
            raise ModelLoadError(f"{where} starts at data offset {offset}, not a multiple of the file's "
                                 f"alignment {self.alignment} (general.alignment); the file is corrupt")
        n_elements = math.prod(dims)
        n_bytes = n_elements // block * block_bytes
        start = self.data_offset + offset
        if start + n_bytes > len(self._bytes):
            raise ModelLoadError(f"{where} ({type_name}, shape {shape}, {n_bytes} bytes) lies at bytes "
                                 f"[{start}, {start + n_bytes}) but the file has {len(self._bytes)} bytes: "
                                 "truncated; download it again")
        raw = self._bytes[start:start + n_bytes]
        if type_name in ELEMENT_DTYPES:
            data = raw.view(ELEMENT_DTYPES[type_name]).reshape(shape)
        else:
            data = raw.reshape(shape[:-1] + (ne0 // block * block_bytes,))
        return TensorEntry(name, type_name, type_id, shape, data)

    def will_need(self, names) -> None:
        """Ask the kernel to read these tensors' pages now, all together (madvise WILLNEED): touched one
        by one in a file that is not in the page cache, each small tensor is a page fault waiting on the
        disk (a 7 B file's ~200 norms and biases took 0.7-2.8 s that way). Only a hint: no-op where the
        platform lacks it."""
        if not hasattr(self._map, "madvise") or not hasattr(mmap, "MADV_WILLNEED"):
            return
        base, page = self._bytes.__array_interface__["data"][0], mmap.PAGESIZE
        for name in names:
            data = self.tensors[name].data
            start = data.__array_interface__["data"][0] - base
            first = start // page * page
            self._map.madvise(mmap.MADV_WILLNEED, first, start + data.nbytes - first)

    def _check_no_overlap(self, infos) -> None:
        """Each tensor's bytes end before the next one's begin: a shape that disagrees with the data it
        was written with shows up here (llama.cpp requires them back to back, padded to the alignment)."""
        order = sorted(infos, key=lambda info: info[3])
        for (name, _, _, offset), (next_name, _, _, next_offset) in zip(order, order[1:]):
            entry = self.tensors[name]
            end = offset + entry.data.nbytes
            if end > next_offset:
                raise ModelLoadError(
                    f"{self.path}: tensor {name} ({entry.type_name}, shape {entry.shape}) needs {entry.data.nbytes} "
                    f"bytes from data offset {offset}, but tensor {next_name} starts at {next_offset}: its shape "
                    "does not match the bytes stored for it; the file is corrupt")


class _Reader:
    """A cursor over the mapped file; every read is bounds-checked and names what it reads."""

    def __init__(self, path: str, buf: mmap.mmap, arr: np.ndarray):
        self.path, self.buf, self.arr, self.size, self.pos = path, buf, arr, len(arr), 0

    def need(self, n: int, what: str) -> int:
        """The current position, after checking that n bytes follow it."""
        if n > self.size - self.pos:
            raise ModelLoadError(f"{self.path}: truncated: {what} needs bytes [{self.pos}, {self.pos + n}) but the "
                                 f"file has {self.size} bytes; download it again")
        return self.pos

    def scalar(self, type_id: int, what: str):
        fmt = _SCALARS[type_id][0]
        (v,) = struct.unpack_from(fmt, self.buf, self.need(_SIZES[type_id], what))
        self.pos += _SIZES[type_id]
        return v

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def count(self, n: int, min_bytes: int, what: str) -> int:
        """n, after checking that n items of at least min_bytes each fit in the rest of the file."""
        if n * min_bytes > self.size - self.pos:
            raise ModelLoadError(f"{self.path}: the file claims {n} {what}, more than its remaining "
                                 f"{self.size - self.pos} bytes can hold; the file is truncated or corrupt")
        return n

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        start = self.need(n, what)
        self.pos += n
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ModelLoadError(f"{self.path}: {what} is not valid UTF-8 ({exc}); the file is corrupt") from exc

    def value(self, type_id: int, key: str, depth: int = 0):
        """One metadata value of the given type (an array's items read in bulk); depth: arrays around it."""
        if type_id in _SCALARS:
            return self.scalar(type_id, f"the value of metadata key {key!r}")
        if type_id == STRING:
            return self.string(f"the value of metadata key {key!r}")
        if type_id != ARRAY:
            raise ModelLoadError(f"{self.path}: metadata key {key!r} has unknown value type {type_id}; "
                                 "the file is corrupt")
        item = self.u32(f"the item type of metadata array {key!r}")
        n = self.u64(f"the length of metadata array {key!r}")
        what = f"items of metadata array {key!r}"
        if item in _SCALARS:
            start = self.need(self.count(n, _SIZES[item], what) * _SIZES[item], f"the {n} {what}")
            self.pos += n * _SIZES[item]
            items = np.frombuffer(self.buf, _SCALARS[item][1], n, start).copy()
            return items != 0 if item == BOOL else items
        if item == STRING:
            return self.strings(self.count(n, 8, what), key)
        if item == ARRAY:
            if depth >= MAX_NESTING:
                raise ModelLoadError(f"{self.path}: metadata array {key!r} nests arrays deeper than {MAX_NESTING}; "
                                     "the file is corrupt")
            return [self.value(ARRAY, f"{key}[{i}]", depth + 1) for i in range(self.count(n, 12, what))]
        raise ModelLoadError(f"{self.path}: metadata array {key!r} has unknown item type {item}; the file is corrupt")

    def strings(self, n: int, key: str) -> list[str]:
        """n strings stored back to back: located in one C pass, each decoded from the map."""
        starts, stops = np.empty(n, np.int64), np.empty(n, np.int64)
        done = string_spans(self.arr, self.pos, n, starts, stops)
        if done < n:
            self.pos = int(stops[done - 1]) if done else self.pos
            self.string(f"string #{done} of metadata array {key!r}")    # raises, naming the place
            raise ModelLoadError(f"{self.path}: string #{done} of metadata array {key!r} runs past the end of the file")
        self.pos = int(stops[-1]) if n else self.pos
        buf = self.buf
        try:
            return [buf[a:b].decode("utf-8") for a, b in zip(starts.tolist(), stops.tolist())]
        except UnicodeDecodeError:
            bad = next(i for i, (a, b) in enumerate(zip(starts.tolist(), stops.tolist())) if not _is_utf8(buf[a:b]))
            raise ModelLoadError(f"{self.path}: string #{bad} of metadata array {key!r} is not valid UTF-8 "
                                 f"({buf[starts[bad]:stops[bad]][:40]!r}); the file is corrupt") from None


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _read_counts(r: _Reader) -> tuple[int, int, int]:
    r.pos = 4
    version = r.u32("the header")
    if version & 0xFFFF == 0 and version:
        raise ModelLoadError(f"{r.path}: a big-endian GGUF file (version field {version:#010x}); fastserve reads "
                             "little-endian files only")
    if version == 1:
        raise ModelLoadError(f"{r.path}: GGUF version 1 is no longer supported; convert the model again with a "
                             "current llama.cpp")
    if version not in VERSIONS:
        raise ModelLoadError(f"{r.path}: GGUF version {version} is not one fastserve reads "
                             f"({', '.join(map(str, VERSIONS))})")
    n_tensors = r.u64("the header")
    n_kv = r.count(r.u64("the header"), _MIN_KV_BYTES, "metadata keys")
    return version, n_tensors, n_kv


def _read_tensor_info(r: _Reader, i: int) -> tuple[str, tuple[int, ...], int, int]:
    """(name, ne fastest first, ggml type id, data offset) of tensor info #i."""
    name = r.string(f"the name of tensor #{i}")
    n_dims = r.u32(f"tensor {name}'s dimension count")
    if n_dims > MAX_DIMS:
        raise ModelLoadError(f"{r.path}: tensor {name} has {n_dims} dimensions, more than ggml's {MAX_DIMS}; "
                             "the file is corrupt")
    start = r.need(8 * n_dims, f"tensor {name}'s shape")
    dims = struct.unpack_from(f"<{n_dims}Q", r.buf, start)
    r.pos += 8 * n_dims
    type_id = r.u32(f"tensor {name}'s type")
    return name, dims, type_id, r.u64(f"tensor {name}'s data offset")


def _alignment(path: str, md: dict) -> int:
    """general.alignment (a uint32, checked by the caller): a power of two; absent: 32."""
    a = md.get("general.alignment", DEFAULT_ALIGNMENT)
    if a <= 0 or a & (a - 1):
        raise ModelLoadError(f"{path}: general.alignment is {a!r}, not a power of two; the file is corrupt")
    return a


def _check_header(path: str) -> None:
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file; pass a GGUF model path, or run `fastserve pull` "
                             "for the default model")
    if os.path.isdir(path):
        raise ModelLoadError(f"{path}: is a directory, not a GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (first bytes {magic!r}, expected {GGUF_MAGIC!r})")
