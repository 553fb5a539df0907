"""Fixtures of the GPU tests. Without CuPy or a GPU every test that asks for `cupy` SKIPS, saying why;
test_backend_emulated.py needs neither and always runs.

The default model and llama.cpp's reference outputs are found without pulling (a device machine has
no network): $FASTSERVE_MODEL or the cache for the model, $FASTSERVE_REFERENCE or ../shared/reference
for the oracle; a test that needs one and does not find it skips, saying where it looked.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def cupy():
    """The real CuPy on a GPU. FASTSERVE_FAKE_CUPY=1 runs these tests on tests/gpu/fake_cupy.py instead,
    which checks the tests' own references and the launchers, not the kernels (for developing the tests
    on a machine without a GPU)."""
    if os.environ.get("FASTSERVE_FAKE_CUPY") == "1":
        from . import fake_cupy
        mp = pytest.MonkeyPatch()
        yield fake_cupy.install(mp)
        mp.undo()
        return
    from fastserve.backends.cupy_backend import cuda_status
    ok, why = cuda_status()
    if not ok:
        pytest.skip(f"GPU test skipped: {why}")
    import cupy
    yield cupy


@pytest.fixture(scope="session")
def default_model_on_disk(cupy):
    from fastserve.default_model import FILENAME, home
    path = os.environ.get("FASTSERVE_MODEL") or os.path.join(home(), FILENAME)
    if not os.path.isfile(path):
        pytest.skip(f"default model not at {path} (set FASTSERVE_MODEL; the device machine cannot pull it)")
    import fastserve
    return fastserve.load_model(path)


@pytest.fixture(scope="session")
def reference_cases() -> list:
    candidates = [os.environ.get("FASTSERVE_REFERENCE"),
                  str(REPO.parent / "shared" / "reference" / "smollm2_q41_llamacpp_greedy.json"),
                  str(REPO / ".devcarry" / "smollm2_q41_llamacpp_greedy.json")]
    for c in candidates:
        if c and os.path.isfile(c):
            return json.loads(Path(c).read_text(encoding="utf-8"))["completions"]
    pytest.skip(f"llama.cpp reference outputs not found (looked at {[c for c in candidates if c]})")
