"""The fault points exist only in a fault build (DESIGN.md, "Test-only faults").

Runs in the normal suite: the extensions this checkout imports carry none of the fault
settings' names or messages, the engine's Python sources do not name them, and in a normal
build setting them changes nothing.
"""
import subprocess
from pathlib import Path

import pytest

import fastserve

from .conftest import REPO, run_scenario

NEEDLES = [b"FASTSERVE_TEST_FAIL_CACHE_COPIES", b"FASTSERVE_TEST_FAIL_PROMPT_FILLS", b"FASTSERVE_TEST_STALL_STEP_S",
           b"FASTSERVE_TEST_STALL_EVERY_STEPS",
           b"FASTSERVE_TEST_FAIL", b"FASTSERVE_TEST_STALL", b"test fault", b"fsf_copy", b"fsf_fill", b"fsf_load"]
PACKAGE = Path(fastserve.__file__).parent


def _extensions(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in (".so", ".pyd") and p.is_file())


def _found(path: Path) -> list[bytes]:
    data = path.read_bytes()
    return [n for n in NEEDLES if n in data]


def test_no_built_extension_carries_a_fault_point():
    import fastserve._faults as f
    if f.ENABLED:
        pytest.skip(f"{f.__file__} is a fault build: build the package normally to check the normal build")
    exts = _extensions(PACKAGE)
    assert len(exts) >= 6, f"expected the built extensions in {PACKAGE}, found {exts}"
    assert any(p.name.startswith("_faults.") for p in exts)
    found = {p.name: _found(p) for p in exts}
    assert not any(found.values()), f"fault names in a normal build: {found}"


def test_no_symbols_either():
    nm = subprocess.run(["nm", "-D", "--defined-only", *map(str, _extensions(PACKAGE))],
                        capture_output=True, text=True)
    if nm.returncode != 0 and not nm.stdout:
        pytest.skip(f"nm is not usable here: {nm.stderr.strip()[:200]}")
    assert "fsf_" not in nm.stdout and "FASTSERVE_TEST" not in nm.stdout


def test_the_engine_sources_do_not_name_the_faults():
    """The engine reaches fault points only through neutral calls into fastserve._faults."""
    named = [str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")
             if any(n.decode() in p.read_text(encoding="utf-8") for n in NEEDLES[:5])]
    assert named == []


def test_the_scan_finds_them_in_a_fault_build(fault_build):
    """Positive control: the same scan finds every setting's name in the fault build's _faults."""
    ext = next(Path(fault_build, "fastserve").glob("_faults.*.so"))
    assert set(NEEDLES[:3]) <= set(_found(ext)) and b"test fault" in _found(ext)


def test_in_a_normal_build_the_settings_do_nothing():
    import fastserve._faults as f
    if f.ENABLED:
        pytest.skip("this checkout's extensions are a fault build")
    r = run_scenario("everything", None, FASTSERVE_TEST_FAIL_CACHE_COPIES=5, FASTSERVE_TEST_FAIL_PROMPT_FILLS=5,
                     FASTSERVE_TEST_STALL_STEP_S=30)
    assert r["enabled"] is False and r["settings"] == {}
    assert [c["finish"] for c in r["pair"]] == ["length", "length"]
    assert r["stats"]["refused"] == 0 and r["stats"]["saved"] == 1     # the second slot held the same prefix
    assert r["seconds"] < 25
