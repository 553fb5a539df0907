"""The boundaries STYLE.md asks a test for: the engine knows nothing of HTTP or event loops,
and every Cython module has its pure-Python twin (no silent fallback)."""
import importlib
import pathlib
import subprocess
import sys

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "fastserve"


def test_engine_imports_no_server_or_event_loop():
    code = ("import sys, fastserve.engine, fastserve.text_reader; "
            "bad = [m for m in ('asyncio', 'uvloop', 'h11', 'fastserve.server') if m in sys.modules]; "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"the engine pulled in {out.stdout.strip()}"


@pytest.mark.parametrize("pyx", sorted(str(p.relative_to(PKG.parent).with_suffix("")) for p in PKG.rglob("_*.pyx")))
def test_every_extension_has_a_twin_and_is_built(pyx):
    """Each .pyx has its twin in the ref/ folder beside it (fastserve/ref/, backends/cpu/ref/, models/ref/)."""
    folder, stem = pyx.rsplit("/", 1)
    twin = PKG.parent / folder / "ref" / f"{stem.lstrip('_')}.py"
    assert twin.is_file(), f"{pyx}.pyx has no pure-Python twin at {twin}"
    importlib.import_module(f"{folder.replace('/', '.')}.ref.{stem.lstrip('_')}")
    mod = importlib.import_module(pyx.replace("/", "."))        # a missing build raises here: no fallback
    assert mod.__file__.endswith((".so", ".pyd")), f"{pyx} is not the compiled extension"
