"""fastserve's GGUF reader against gguf.GGUFReader (an independent reader): the same metadata and the same
tensor table, on every kind of synthetic model the repo writes and on the default model; and reading a
file touches none of its tensor data."""
from __future__ import annotations

import os

import numpy as np
import pytest

from fastserve.models.gguf_file import GGML_TYPES, GGUFFile
from fastserve.models.synthetic import write_llama_gguf


def _flat(v):
    """GGUFReader flattens nested arrays into one list; compare ours the same way."""
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, list) and any(isinstance(x, (list, np.ndarray)) for x in v):
        return [y for x in v for y in _flat(x)]
    return v


def assert_same_as_gguf_reader(path) -> GGUFFile:
    from gguf import GGUFReader

    ours, theirs = GGUFFile(path), GGUFReader(path)
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(want)
    for key, value in ours.metadata.items():
        got = _flat(value)
        assert got == want[key] and type(got) is type(want[key]), key
        if isinstance(value, np.ndarray):    # the item type survives: e.g. float32 scores stay float32
            assert value.dtype == theirs.fields[key].parts[-1].dtype.newbyteorder("="), key
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    assert ours.data_offset == theirs.data_offset and ours.alignment == theirs.alignment
    for t in theirs.tensors:
        e = ours.tensors[t.name]
        assert (e.type_id, e.type_name) == (int(t.tensor_type), t.tensor_type.name), t.name
        assert e.shape == tuple(reversed(t.shape.tolist())), t.name
        assert (e.data.dtype, e.data.shape) == (t.data.dtype, t.data.shape), t.name
        assert not e.data.flags.writeable and np.array_equal(e.data, t.data, equal_nan=e.data.dtype.kind == "f"), t.name
    return ours


@pytest.mark.parametrize("kwargs", [
    {}, {"weight_type": "F16"}, {"weight_type": "BF16"}, {"weight_type": "Q8_0"}, {"weight_type": "Q5_0"},
    {"weight_type": "Q5_1"}, {"weight_type": "Q4_0"}, {"weight_type": "Q4_1"}, {"weight_type": "TQ1_0", "n_embd": 256, "n_ff": 256},
    {"weight_type": "MXFP4"}, {"tied": True}, {"architecture": "mamba"}, {"n_vocab": 8192, "n_layer": 1},
], ids=lambda kw: "-".join(f"{v}" for v in kw.values()) or "F32")
def test_same_as_gguf_reader_on_synthetic_models(tmp_path, kwargs):
    assert_same_as_gguf_reader(write_llama_gguf(tmp_path / "m.gguf", **kwargs))


def test_same_as_gguf_reader_on_every_value_type(tmp_path):
    """Every metadata value type, arrays of each, an empty array and a nested array."""
    import gguf

    path = str(tmp_path / "kv.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for name in ("uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "uint64", "int64", "float64"):
        getattr(w, f"add_{name}")(f"test.{name}", 7)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "héllo")
    w.add_array("test.floats", [0.5, -1.25, 3.0])
    w.add_array("test.bools", [True, False, True])
    w.add_array("test.strings", ["a", "", "ünï"])
    w.add_array("test.empty", [])
    w.add_array("test.nested", [[1, 2], [3, 4, 5]])
    w.add_tensor("t", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gf = assert_same_as_gguf_reader(path)
    md = gf.metadata
    assert md["test.nested"][1].tolist() == [3, 4, 5] and md["test.strings"] == ["a", "", "ünï"]
    assert md["test.bools"].dtype == np.bool_ and md["test.float32"] == 7.0 and md["test.bool"] is True


@pytest.mark.model
def test_same_as_gguf_reader_on_the_default_model(default_model_file):
    gf = assert_same_as_gguf_reader(default_model_file)
    assert len(gf.metadata["tokenizer.ggml.tokens"]) == 49152 and len(gf.tensors) == 272


def test_ggml_type_table_matches_gguf():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    theirs = {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType if t in GGML_QUANT_SIZES}
    assert {i: GGML_TYPES[i] for i in theirs if i in GGML_TYPES} == theirs
    assert set(theirs) <= set(GGML_TYPES), "gguf knows types that fastserve's table lacks"


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc/self/status (RssFile) to see which pages were touched")
def test_reading_touches_no_tensor_data(tmp_path):
    """64 MiB of weights, mapped: reading the file faults in its header pages only."""
    path = write_llama_gguf(tmp_path / "big.gguf", n_layer=1, n_embd=1024, n_head=8, n_head_kv=8, n_ff=1024,
                            n_vocab=6144)
    before = _rss_file_kib()
    gf = GGUFFile(path)
    grown = _rss_file_kib() - before
    weights = sum(e.data.nbytes for e in gf.tensors.values())
    assert weights > 60 << 20
    assert grown < 1024, f"reading the header mapped {grown} KiB of the file"


def test_tensor_data_are_views_of_the_mapped_file(tiny_model_path):
    import mmap

    for e in GGUFFile(tiny_model_path).tensors.values():
        root = e.data
        while getattr(root, "base", None) is not None:
            root = root.base
        assert isinstance(root, mmap.mmap), e.name


def test_will_need_asks_for_whole_pages_of_each_tensor(tiny_model_path):
    """will_need gives the kernel one page-aligned WILLNEED range per tensor that covers its bytes, so
    a cold file's small tensors are read together at load (mmap.madvise is read-only on the map, so a
    stand-in records the calls)."""
    import mmap

    if not hasattr(mmap, "MADV_WILLNEED"):
        pytest.skip("this platform has no madvise(MADV_WILLNEED)")
    gf = GGUFFile(tiny_model_path)
    calls = []

    class Recorder:
        def madvise(self, option, start, length):
            calls.append((option, start, length))

    real, gf._map = gf._map, Recorder()
    names = [n for n, e in gf.tensors.items() if len(e.shape) == 1]
    gf.will_need(names)
    gf._map = real
    base = gf._bytes.__array_interface__["data"][0]
    assert len(calls) == len(names) > 0
    for name, (option, start, length) in zip(names, calls):
        data = gf.tensors[name].data
        at = data.__array_interface__["data"][0] - base
        assert option == mmap.MADV_WILLNEED and start % mmap.PAGESIZE == 0
        assert start <= at and at + data.nbytes <= start + length < at + data.nbytes + mmap.PAGESIZE
    gf.will_need(names)                     # the real call on the map: a hint, no error
