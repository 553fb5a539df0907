"""Where the tests find llama.cpp's outputs (facts, kept in the repository) and what only ../shared has.

    tests/golden/data/<name>.json          llama.cpp's outputs the golden tests compare against: inside the
                                           repository, so a bare clone runs them (copied from
                                           shared/reference/, whose README says how they were recorded)
    ../shared/reference/models/<file>      synthetic reference models: NOT in the repository (model files are
                                           never committed); a test that needs one skips, saying so
    tests/golden/synthetic_families.py     the synthetic models of the other recorded families: written at test
                                           time from the default model's vocabulary (skipped without it)
"""
from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOLDEN_DATA = REPO / "tests" / "golden" / "data"
SHARED_REFERENCE = REPO.parent / "shared" / "reference"
DEFAULT_MODEL_REFERENCE = GOLDEN_DATA / "smollm2_q41_llamacpp_greedy.json"


def load_reference(path: Path = DEFAULT_MODEL_REFERENCE) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def shared_model(filename: str) -> str:
    """Path of a synthetic reference model that only ../shared/reference/models holds; skips without it."""
    import pytest

    path = SHARED_REFERENCE / "models" / filename
    if not path.is_file():
        pytest.skip(f"{filename} is only in ../shared/reference/models (not committed: model files never are), "
                    f"and {path} is absent")
    return str(path)


def default_model_or_skip(needed_for: str) -> str:
    """The default model's path (pulled on first use); skips, saying why, when it cannot be obtained."""
    import pytest

    import fastserve
    from fastserve.errors import PullError

    try:
        return fastserve.default_model_path()
    except PullError as exc:
        pytest.skip(f"{needed_for} needs the default model (its vocabulary), which could not be obtained: {exc}")
