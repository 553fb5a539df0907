"""Fault tests run fastserve in child processes, against a fault build of its extensions.

FASTSERVE_FAULTS_LIB names a folder that `make build-faults` filled with extensions built
with FASTSERVE_TEST_FAULTS=1 (`make test` builds it and sets this). Unset, the tests look
at the extensions this checkout imports (the normal build) and skip, saying why.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAULT_ENV = ("FASTSERVE_TEST_FAIL_CACHE_COPIES", "FASTSERVE_TEST_FAIL_PROMPT_FILLS", "FASTSERVE_TEST_STALL_STEP_S",
             "FASTSERVE_TEST_STALL_EVERY_STEPS")


def child_env(lib: str | None, **faults) -> dict:
    """The environment of a child: this checkout first on the path, only the given fault settings."""
    env = {k: v for k, v in os.environ.items() if k not in FAULT_ENV and k != "FASTSERVE_FAULTS_LIB"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    if lib:
        env["FASTSERVE_FAULTS_LIB"] = str(lib)
    env.update({k: str(v) for k, v in faults.items()})
    return env


def run_scenario(name: str, lib: str | None, timeout: float = 120, **faults) -> dict:
    """Run tests/faults/scenarios.py's `name` in a child; with lib, on that fault build's extensions."""
    cmd = [sys.executable, "-m", "tests.faults.launch", "-m", "tests.faults.scenarios", name] if lib else \
          [sys.executable, "-m", "tests.faults.scenarios", name]
    p = subprocess.run(cmd, cwd=REPO, env=child_env(lib, **faults), capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"scenario {name} failed (rc {p.returncode}):\n{p.stdout}\n{p.stderr}"
    return json.loads(lines[-1][len("RESULT "):])


def _stale(lib: Path) -> list[str]:
    """_faults.pyx, if newer than the fault build's extension of it (the only one a fault build holds: the
    others are the normal build's, see setup.py)."""
    out = []
    for pyx in [REPO / "fastserve" / "_faults.pyx"]:
        built = list((lib / "fastserve").glob(pyx.stem + ".*.so"))
        if not built or built[0].stat().st_mtime < pyx.stat().st_mtime:
            out.append(pyx.name)
    return out


@pytest.fixture(scope="session")
def fault_build() -> str:
    """The fault build's folder, or a skip that says why there is none."""
    lib = os.environ.get("FASTSERVE_FAULTS_LIB")
    if not lib:
        import fastserve._faults as f
        if not f.ENABLED:
            pytest.skip(f"fastserve's extensions here ({Path(f.__file__).parent}) were built without "
                        f"FASTSERVE_TEST_FAULTS=1, so the fault points do not exist; `make test` builds a "
                        f"fault build into build/faults and runs these tests on it (FASTSERVE_FAULTS_LIB)")
        pytest.skip("fastserve's own extensions carry fault points: rebuild them normally, and give the fault "
                    "build apart in FASTSERVE_FAULTS_LIB")
    lib = (REPO / lib).resolve() if not Path(lib).is_absolute() else Path(lib)
    probe = subprocess.run([sys.executable, "-m", "tests.faults.launch", "-c",
                            "import fastserve._faults as f; print(f.ENABLED)"],
                           cwd=REPO, env=child_env(str(lib)), capture_output=True, text=True, timeout=60)
    if probe.stdout.strip() != "True":
        pytest.skip(f"the extensions in {lib} were built without FASTSERVE_TEST_FAULTS=1 "
                    f"({(probe.stdout + probe.stderr).strip()[-300:]})")
    stale = _stale(lib)
    if stale:
        pytest.fail(f"the fault build in {lib} is older than {', '.join(stale)}: run `make build-faults`")
    return str(lib)
