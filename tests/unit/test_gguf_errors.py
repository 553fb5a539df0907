"""Every way a model file can be unusable gives a clear ModelLoadError naming the problem."""
import numpy as np
import pytest

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
