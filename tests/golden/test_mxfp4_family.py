"""qwen3moe-mxfp4 and gpt-oss-mxfp4 (tests/golden/synthetic_families.py: with MXFP4 experts, gpt-oss's type): the file
llama.cpp's outputs were recorded on is llama-quantize's, and fastserve runs its MXFP4 blocks as they are.

tests/golden/test_families.py holds fastserve to llama.cpp on it (the bars of every family). Here: the file's
tensors are byte for byte what the peer's llama-quantize makes of the same weights written in F32 with its
MXFP4_MOE mix (skipped without llama-quantize: $LLAMA_QUANTIZE, PATH, or ~/llama-peer/build/bin); its expert
tensors load as MXFP4 views of the mapped file, never repacked; its logits are the F32 file's within MXFP4's
rounding (a relative RMS of 0.17 measured; scale bytes one too high, 2x each expert weight, give 1.14).
"""
from __future__ import annotations

import mmap
import os
import shutil
import subprocess

import numpy as np
import pytest

import fastserve
from fastserve.models.gguf_file import GGUFFile
from tests.golden import synthetic_families
from tests.reference_data import GOLDEN_DATA, default_model_or_skip, load_reference

FAMILIES = ("qwen3moe-mxfp4", "gpt-oss-mxfp4")
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, there lived a king"


def llama_quantize() -> str | None:
    for path in (os.environ.get("LLAMA_QUANTIZE"), shutil.which("llama-quantize"),
                 os.path.expanduser("~/llama-peer/build/bin/llama-quantize")):
        if path and os.access(path, os.X_OK):
            return path
    return None


@pytest.fixture(scope="module", params=FAMILIES)
def models(tmp_path_factory, request):
    """(the family's file, checked against the record's sha256; the same weights in F32)."""
    family = request.param
    vocab = default_model_or_skip(f"{family}'s synthetic model")
    path = synthetic_families.write(family, tmp_path_factory.mktemp("mxfp4"), vocab)
    want = load_reference(GOLDEN_DATA / f"{family}_synth_llamacpp_greedy.json")["metadata"]["model_sha256"]
    assert synthetic_families.sha256(path) == want, "not the file llama.cpp's outputs were recorded on"
    return path, synthetic_families.write(family, tmp_path_factory.mktemp("f32"), vocab, weight_type="F32")


@pytest.mark.skipif(llama_quantize() is None, reason="llama-quantize is not built here ($LLAMA_QUANTIZE, PATH, "
                    "~/llama-peer/build/bin: ../shared/tools/build-llama-server.sh)")
def test_the_file_is_llama_quantizes(models, tmp_path):
    path, f32 = models
    out = tmp_path / "quantized.gguf"
    done = subprocess.run([llama_quantize(), f32, str(out), "MXFP4_MOE"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ours, theirs = GGUFFile(path).tensors, GGUFFile(str(out)).tensors
    assert sorted(ours) == sorted(theirs)
    differ = [n for n, t in ours.items() if t.type_name != theirs[n].type_name or
              np.asarray(t.data).tobytes() != np.asarray(theirs[n].data).tobytes()]
    assert not differ, differ
    assert {t.type_name for t in ours.values()} == {"MXFP4", "Q8_0", "F32"}
    assert [n for n, t in ours.items() if t.type_name == "MXFP4"] == [
        f"blk.{i}.ffn_{k}_exps.weight" for i in range(fastserve.load_model(f32).config.n_layer)
        for k in ("gate", "up", "down")]


def test_experts_run_as_mxfp4_blocks(models):
    path, f32 = models
    model = fastserve.load_model(path)
    lw = model.weights.layers[2]
    for matrix in (lw.experts_gate_up[7], lw.experts_down[7]):
        assert set(matrix.types) == {"MXFP4"}
        for arr in matrix.arrays:
            root = arr
            while getattr(root, "base", None) is not None:
                root = root.base
            assert isinstance(root, mmap.mmap), f"{matrix.labels}: not a view of the mapped file"
    ids = model.tokenizer.encode(PROMPT, add_special=True)
    ours, exact = model.logits(ids), fastserve.load_model(f32).logits(ids)
    assert np.sqrt(np.mean((ours - exact) ** 2) / np.mean(exact ** 2)) < 0.3
