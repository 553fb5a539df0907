"""Fixtures of the golden tests: the default model's file and metadata, found without pulling.

The model is large and never committed, so a test that needs it skips, saying what is missing.
(tests/conftest.py holds the pulling `default_model_file` and the `reference` oracle.)
"""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """Path of the default model (SmolLM2-135M-Instruct Q4_1): $FASTSERVE_MODEL, else the cache."""
    path = os.environ.get("FASTSERVE_MODEL") or os.path.expanduser(
        "~/.cache/fastserve/SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        pytest.skip(f"default model not found at {path}: set FASTSERVE_MODEL or pull the model")
    return path


@pytest.fixture(scope="session")
def model_metadata(default_model_path) -> dict:
    """The default model's GGUF metadata (read once per session: ~3 s)."""
    from fastserve.models.gguf_file import GGUFFile

    return GGUFFile(default_model_path).metadata
