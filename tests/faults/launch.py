"""Run Python with fastserve's compiled extensions taken from a fault build.

    FASTSERVE_FAULTS_LIB=build/faults python -m tests.faults.launch -m fastserve serve ...
    FASTSERVE_FAULTS_LIB=build/faults python -m tests.faults.launch -c "import fastserve; ..."

The Python sources come from this checkout (run from its root); only the modules
fastserve._* that are compiled extensions are loaded from $FASTSERVE_FAULTS_LIB/fastserve/,
which `make build-faults` fills with the extension that differs (_faults, built with FASTSERVE_TEST_FAULTS=1);
the others are the normal build's.
So a fault build never leaves its .so files where the normal suite would import them.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import sys
from pathlib import Path


class FaultBuildFinder(importlib.abc.MetaPathFinder):
    """fastserve._name → <lib>/fastserve/_name<extension suffix>, when that file exists."""

    def __init__(self, lib: str | os.PathLike):
        self.dir = Path(lib) / "fastserve"

    def find_spec(self, name, path=None, target=None):
        package, _, module = name.rpartition(".")
        if package != "fastserve" or not module.startswith("_"):
            return None
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            f = self.dir / (module + suffix)
            if f.is_file():
                return importlib.util.spec_from_file_location(name, f)
        return None


def install(lib: str | os.PathLike | None = None) -> None:
    lib = lib or os.environ.get("FASTSERVE_FAULTS_LIB")
    if not lib or not (Path(lib) / "fastserve").is_dir():
        raise SystemExit(f"no fault build at {lib!r}: run `make build-faults` and set FASTSERVE_FAULTS_LIB")
    sys.meta_path.insert(0, FaultBuildFinder(lib))


def main(argv: list[str]) -> None:
    install()
    if len(argv) >= 2 and argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif len(argv) >= 2 and argv[0] == "-c":
        sys.argv = ["-c"] + argv[2:]
        exec(compile(argv[1], "<launch -c>", "exec"), {"__name__": "__main__"})
    else:
        raise SystemExit("usage: python -m tests.faults.launch (-m module | -c code) [args...]")


if __name__ == "__main__":
    main(sys.argv[1:])
