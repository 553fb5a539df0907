"""Every way a model file can be unusable gives a clear ModelLoadError naming the problem."""
import re
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastserve
from fastserve.errors import ModelLoadError
from fastserve.models.synthetic import write_llama_gguf


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file.*fastserve pull"):
        fastserve.load_model(tmp_path / "nope.gguf")


def test_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="directory"):
        fastserve.load_model(tmp_path)


def test_not_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        fastserve.load_model(p)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        fastserve.load_model(p)


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.97])
def test_truncated_file(tiny_model_path, tmp_path, keep):
    p = tmp_path / "cut.gguf"
    data = open(tiny_model_path, "rb").read()
    p.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match="truncated|not a readable GGUF"):
        fastserve.load_model(p)


def test_unsupported_architecture(tmp_path):
    p = write_llama_gguf(tmp_path / "m.gguf", architecture="mamba")
    with pytest.raises(ModelLoadError, match="unsupported model architecture 'mamba'.*supported: llama"):
        fastserve.load_model(p)


def _write_with(path, change):
    """A tiny model whose tensor writer is wrapped by change(real_add, writer, name, arr, weight_type)."""
    from fastserve.models import synthetic

    real_add = synthetic._add
    synthetic._add = lambda *args: change(real_add, *args)
    try:
        return write_llama_gguf(path)
    finally:
        synthetic._add = real_add


def test_unsupported_tensor_type(tmp_path):
    """An integer tensor where a weight belongs: the error names the tensor, its type and the supported ones."""
    def i32_for_q(real_add, writer, name, arr, weight_type):
        if name == "blk.0.attn_q.weight":
            writer.add_tensor(name, arr.astype(np.int32))
        else:
            real_add(writer, name, arr, weight_type)

    p = _write_with(tmp_path / "m.gguf", i32_for_q)
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_q\.weight has type I32.*supported types: F32, F16"):
        fastserve.load_model(p)


def test_missing_tensor(tmp_path):
    """A file whose tensor table lacks a layer's weights."""
    def skip_ffn_up(real_add, writer, name, arr, weight_type):
        if name != "blk.1.ffn_up.weight":
            real_add(writer, name, arr, weight_type)

    p = _write_with(tmp_path / "m.gguf", skip_ffn_up)
    with pytest.raises(ModelLoadError, match=r"missing tensors \['blk\.1\.ffn_up\.weight'\]"):
        fastserve.load_model(p)


# ---- broken files, byte by byte: each error names the file, the problem, and the tensor or key -------
# Positions are found with gguf.GGUFReader (an independent reader) on the intact file, then patched.
from fastserve.models.gguf_file import GGUFFile  # noqa: E402


@pytest.fixture(scope="module")
def intact(tmp_path_factory):
    """(path, bytes, GGUFReader) of a tiny Q8_0 model (block type: the row-size rule applies)."""
    from gguf import GGUFReader

    path = write_llama_gguf(tmp_path_factory.mktemp("intact") / "m.gguf", weight_type="Q8_0")
    return path, open(path, "rb").read(), GGUFReader(path)


def _part_offset(field, index: int) -> int:
    """File offset of field.parts[index] (a field's parts lie back to back from field.offset)."""
    return field.offset + sum(int(p.nbytes) for p in field.parts[:index])


def _tensor(reader, name):
    return next(t for t in reader.tensors if t.name == name)


def _patched(tmp_path, data: bytes, at: int, fmt: str, value) -> str:
    b = bytearray(data)
    struct.pack_into(fmt, b, at, value)
    p = tmp_path / "broken.gguf"
    p.write_bytes(bytes(b))
    return str(p)


def _cut(tmp_path, data: bytes, n: int) -> str:
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:n])
    return str(p)


def _fails(path, pattern: str) -> str:
    with pytest.raises(ModelLoadError, match=pattern) as err:
        GGUFFile(path)
    assert str(path) in str(err.value)
    return str(err.value)


# tensor info parts: name length, name, n_dims, dims, type, offset
NAME, N_DIMS, DIMS, TYPE, OFFSET = 1, 2, 3, 4, 5


@pytest.mark.parametrize("tensor,part,fmt,value,pattern", [
    ("blk.0.attn_k.weight", TYPE, "<I", 99, r"tensor blk\.0\.attn_k\.weight has ggml type id 99, which is not a known "
                                             r"ggml type"),
    ("blk.0.attn_k.weight", TYPE, "<I", 4, r"tensor blk\.0\.attn_k\.weight has ggml type id 4"),   # Q4_2: removed
    ("blk.1.attn_v.weight", DIMS, "<Q", 48, r"tensor blk\.1\.attn_v\.weight \(Q8_0, shape \(32, 48\)\) has rows of 48 "
                                            r"elements, not a multiple of the Q8_0 block of 32"),
    ("output_norm.weight", N_DIMS, "<I", 7, r"tensor output_norm\.weight has 7 dimensions, more than ggml's 4"),
    ("blk.0.ffn_gate.weight", OFFSET, "<Q", 1 << 40, r"tensor blk\.0\.ffn_gate\.weight \(.*\) lies at bytes .* truncated"),
], ids=["unknown-type", "removed-type", "row-not-whole-blocks", "too-many-dims", "offset-past-the-end"])
def test_broken_tensor_info_names_the_tensor(intact, tmp_path, tensor, part, fmt, value, pattern):
    path, data, rd = intact
    _fails(_patched(tmp_path, data, _part_offset(_tensor(rd, tensor).field, part), fmt, value), pattern)


def test_misaligned_tensor_offset(intact, tmp_path):
    path, data, rd = intact
    t = _tensor(rd, "blk.1.ffn_up.weight")
    at = _part_offset(t.field, OFFSET)
    offset = struct.unpack_from("<Q", data, at)[0]
    _fails(_patched(tmp_path, data, at, "<Q", offset + 4),
           rf"tensor blk\.1\.ffn_up\.weight starts at data offset {offset + 4}, not a multiple of the file's alignment 32")


def test_tensor_data_past_the_end_names_the_tensor(intact, tmp_path):
    path, data, rd = intact
    last = max(rd.tensors, key=lambda t: t.data_offset)
    msg = _fails(_cut(tmp_path, data, last.data_offset + 10), rf"tensor {re.escape(last.name)} \(.*\) lies at bytes "
                 rf"\[{last.data_offset}, {last.data_offset + last.n_bytes}\) but the file has .* truncated")
    assert "download it again" in msg


def test_shape_that_does_not_match_the_stored_bytes(intact, tmp_path):
    path, data, rd = intact
    t = _tensor(rd, "blk.0.attn_q.weight")
    ne1_at = _part_offset(t.field, DIMS) + 8
    ne1 = struct.unpack_from("<Q", data, ne1_at)[0]
    _fails(_patched(tmp_path, data, ne1_at, "<Q", ne1 * 2),
           r"tensor blk\.0\.attn_q\.weight \(Q8_0, shape \(128, 64\)\) needs .* but tensor .* starts at .*: its shape does "
           r"not match the bytes stored for it")


def test_duplicate_tensor_name(intact, tmp_path):
    path, data, rd = intact
    t = _tensor(rd, "blk.0.attn_k.weight")
    p = _patched(tmp_path, data, _part_offset(t.field, NAME), "19s", b"blk.0.attn_q.weight")
    _fails(p, r"tensor blk\.0\.attn_q\.weight appears twice")


def test_duplicate_metadata_key(intact, tmp_path):
    path, data, rd = intact
    # two keys of one length: the later one renamed to the earlier one
    keys = [f for f in rd.fields.values() if not f.name.startswith("GGUF.")]
    first, later = next((a, b) for i, a in enumerate(keys) for b in keys[i + 1:] if len(a.name) == len(b.name))
    p = _patched(tmp_path, data, _part_offset(later, 1), f"{len(first.name)}s", first.name.encode())
    _fails(p, rf"metadata key '{re.escape(first.name)}' appears twice")


@pytest.mark.parametrize("what,pattern", [
    ("tensor_count", r"claims 1099511627776 tensors, more than its remaining \d+ bytes can hold"),
    ("kv_count", r"claims 1099511627776 metadata keys, more than its remaining \d+ bytes can hold"),
])
def test_absurd_counts_in_the_header(intact, tmp_path, what, pattern):
    path, data, rd = intact
    _fails(_patched(tmp_path, data, rd.fields[f"GGUF.{what}"].offset, "<Q", 1 << 40), pattern)


def test_absurd_array_length(intact, tmp_path):
    path, data, rd = intact
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
        f = rd.fields[key]
        _fails(_patched(tmp_path, data, _part_offset(f, 4), "<Q", 1 << 40),       # parts: klen, key, type, itype, n
               rf"claims 1099511627776 items of metadata array '{re.escape(key)}', more than its remaining")


def test_absurd_string_length(intact, tmp_path):
    path, data, rd = intact
    f = rd.fields["tokenizer.ggml.tokens"]
    _fails(_patched(tmp_path, data, _part_offset(f, 5 + 2 * 7), "<Q", 1 << 62),     # the length of token #7
           r"truncated: string #7 of metadata array 'tokenizer\.ggml\.tokens' needs bytes")
    f = rd.fields["general.architecture"]
    _fails(_patched(tmp_path, data, _part_offset(f, 3), "<Q", 2**64 - 1), r"truncated: the value of metadata key "
           r"'general\.architecture' needs bytes")


@pytest.mark.parametrize("where,pattern", [
    (lambda rd: 12, r"truncated: the header needs bytes \[8, 16\)"),
    (lambda rd: _part_offset(rd.fields["tokenizer.ggml.tokens"], 5) + 8 * 512 + 10, r"truncated: (the length of )?string #\d+ of metadata array "
                                                                r"'tokenizer\.ggml\.tokens'"),
    (lambda rd: _part_offset(rd.fields["tokenizer.ggml.merges"], 3) + 2, r"truncated: the item type of metadata array "
                                                                r"'tokenizer\.ggml\.merges'"),
    (lambda rd: _part_offset(_tensor(rd, "blk.1.attn_q.weight").field, DIMS) + 3,
     r"truncated: tensor blk\.1\.attn_q\.weight's shape needs bytes"),
    (lambda rd: _tensor(rd, "blk.1.attn_q.weight").field.offset + 5, r"truncated: the length of the name of tensor #\d+"),
    (lambda rd: rd.fields["tokenizer.chat_template"].offset + 12, r"truncated: metadata key #\d+ needs bytes"),
    (lambda rd: rd.fields["llama.block_count"].offset + 12, r"claims 20 metadata keys, more than its remaining 57 bytes"),
])
def test_truncated_header_metadata_and_tensor_table(intact, tmp_path, where, pattern):
    path, data, rd = intact
    _fails(_cut(tmp_path, data, where(rd)), pattern)


def test_invalid_utf8_in_the_vocabulary(intact, tmp_path):
    path, data, rd = intact
    f = rd.fields["tokenizer.ggml.tokens"]
    _fails(_patched(tmp_path, data, _part_offset(f, 6 + 2 * 100), "B", 0xFF),         # first byte of token #100
           r"string #100 of metadata array 'tokenizer\.ggml\.tokens' is not valid UTF-8")


def test_unknown_value_type(intact, tmp_path):
    path, data, rd = intact
    f = rd.fields["llama.block_count"]
    _fails(_patched(tmp_path, data, _part_offset(f, 2), "<I", 13), r"metadata key 'llama\.block_count' has unknown value type 13")
    f = rd.fields["tokenizer.ggml.token_type"]
    _fails(_patched(tmp_path, data, _part_offset(f, 3), "<I", 42), r"array 'tokenizer\.ggml\.token_type' has unknown item type 42")


@pytest.mark.parametrize("version,pattern", [
    (1, r"GGUF version 1 is no longer supported"),
    (4, r"GGUF version 4 is not one fastserve reads \(2, 3\)"),
    (0x03000000, r"big-endian GGUF file"),
])
def test_versions(intact, tmp_path, version, pattern):
    path, data, rd = intact
    _fails(_patched(tmp_path, data, 4, "<I", version), pattern)


def test_version_2_reads_like_3(intact, tmp_path):
    path, data, rd = intact
    gf = GGUFFile(_patched(tmp_path, data, 4, "<I", 2))
    assert gf.version == 2 and len(gf.tensors) == len(rd.tensors)


def _with_alignment(path, value_type: str, value: int) -> str:
    """The tiny model with a general.alignment key of the given type and value (the writer still aligns to 32)."""
    import gguf
    from fastserve.models import synthetic

    real = gguf.GGUFWriter.add_chat_template

    def also_alignment(self, tpl):
        real(self, tpl)
        getattr(self, f"add_{value_type}")("general.alignment", value)

    gguf.GGUFWriter.add_chat_template = also_alignment
    try:
        return synthetic.write_llama_gguf(path, weight_type="Q8_0")   # rows of 68 bytes: offsets off 256
    finally:
        gguf.GGUFWriter.add_chat_template = real


def test_alignment_key(tmp_path):
    _fails(_with_alignment(tmp_path / "a.gguf", "uint32", 48), r"general\.alignment is 48, not a power of two")
    _fails(_with_alignment(tmp_path / "b.gguf", "uint64", 32), r"general\.alignment has value type 10, not uint32")
    # a larger power of two than the data was written with: the first tensor not on a 256 boundary is named
    _fails(_with_alignment(tmp_path / "c.gguf", "uint32", 256), r"tensor \S+ starts at data offset \d+, not a multiple "
                                                               r"of the file's alignment 256")
    assert GGUFFile(_with_alignment(tmp_path / "d.gguf", "uint32", 32)).alignment == 32


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_damage_is_a_clear_error_or_a_readable_file(intact, tmp_path, data):
    """Random byte changes and cuts in the header, metadata and tensor table: GGUFFile either reads the
    file or raises ModelLoadError, never anything else (no IndexError, struct.error, MemoryError ...)."""
    path, raw, rd = intact
    b = bytearray(raw[:rd.data_offset + 64])
    for _ in range(data.draw(st.integers(1, 4))):
        b[data.draw(st.integers(0, rd.data_offset - 1))] = data.draw(st.integers(0, 255))
    b = b[:data.draw(st.integers(0, len(b)))] if data.draw(st.booleans()) else b + raw[rd.data_offset + 64:]
    p = tmp_path / "fuzz.gguf"
    p.write_bytes(bytes(b))
    try:
        GGUFFile(p)
    except ModelLoadError:
        pass


@pytest.mark.parametrize("key,value,pattern", [
    ("llama.block_count", 100000, r"the metadata says 100000 layers \(block_count\) but the file holds 21 tensors"),
    ("llama.block_count", 2**31, r"'llama\.block_count' is 2147483648, not a usable value"),
    ("llama.attention.head_count", 0, r"'llama\.attention\.head_count' is 0, not a usable value"),
    ("llama.attention.head_count_kv", 3, r"4 attention heads do not split into groups of 3 KV heads"),
])
def test_hyperparameters_that_cannot_be_right(intact, tmp_path, key, value, pattern):
    """A readable file whose sizes are nonsense: refused before anything is sized by them."""
    path, data, rd = intact
    with pytest.raises(ModelLoadError, match=pattern):
        fastserve.load_model(_patched(tmp_path, data, _part_offset(rd.fields[key], 3), "<I", value))


def test_arrays_nested_too_deep(tmp_path):
    """Arrays of arrays 10 000 deep (12 bytes a level): refused, not a RecursionError."""
    depth = 10_000
    kv = struct.pack("<Q", 4) + b"deep" + struct.pack("<I", 9)                  # key "deep", type ARRAY
    kv += (struct.pack("<IQ", 9, 1)) * depth + struct.pack("<IQ", 4, 0)          # ... of one array ... of no uint32
    p = tmp_path / "deep.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv)
    _fails(p, r"metadata array 'deep(\[0\])+' nests arrays deeper than 8")
