"""CI compiles every CUDA kernel source, so that a broken kernel fails here and not on a GPU.

Each cuda/*.cu is built with nvcc for Hopper (sm_90), warnings as errors, as PTX (its entry points
and parameter lists are checked against the launchers' expectations) and as a cubin (ptxas must
report no register spills). When the scratch venv's CuPy ships NVRTC, the sources are also compiled
the way they are at run time (kernels.read_source through NVRTC).

nvcc is on every CI machine; one without it fails this test, saying so, unless FASTSERVE_NO_NVCC=1
declares a machine that has none (then the test skips).
"""
from __future__ import annotations

import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fastserve.backends.cuda import kernels as K

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted((REPO / "cuda").glob("*.cu"))
ARCH = "sm_90"


@pytest.fixture(scope="module")
def nvcc() -> str:
    path = K.nvcc_available()
    if path is None:
        if os.environ.get("FASTSERVE_NO_NVCC") == "1":
            pytest.skip("FASTSERVE_NO_NVCC=1: this machine has no nvcc, the CUDA sources are not compiled")
        pytest.fail("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): CI compiles every cuda/*.cu "
                    "with it; install the CUDA toolkit, or set FASTSERVE_NO_NVCC=1 on a machine that has none")
    return path


@pytest.fixture(scope="module")
def built(nvcc, tmp_path_factory) -> dict:
    """{family: (ptx text, ptxas report)} for every cuda/*.cu, two compiles at a time."""
    out = tmp_path_factory.mktemp("cuda")

    def build(src: Path):
        base = ["-arch=" + ARCH, "-std=c++17", "-Werror", "all-warnings", "-I", str(src.parent)]
        ptx = out / (src.stem + ".ptx")
        p1 = subprocess.run([nvcc, *base, "--ptx", "-o", str(ptx), str(src)], capture_output=True, text=True,
                            timeout=400)
        p2 = subprocess.run([nvcc, *base, "-cubin", "-Xptxas", "-v", "-o", str(out / (src.stem + ".cubin")), str(src)],
                            capture_output=True, text=True, timeout=400)
        return src.stem, p1, p2, ptx

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(build, SOURCES))
    failures = [f"{name}.cu:\n{p.stderr}" for name, p1, p2, _ in results for p in (p1, p2) if p.returncode]
    assert not failures, "nvcc failed:\n" + "\n".join(failures)
    return {name: (ptx.read_text(), p2.stderr) for name, _, p2, ptx in results}


def _entries(ptx: str) -> dict[str, list[str]]:
    return {m.group(1): re.findall(r"\.param\s+\.(\w+)", m.group(2))
            for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx, re.S)}


def test_every_family_is_a_source_and_back():
    assert {p.stem for p in SOURCES} == set(K.FAMILIES)


def test_every_source_compiles_for_hopper(built):
    assert set(built) == set(K.FAMILIES)


def test_entry_points_are_the_launchers_kernels(built):
    for family, (ptx, _) in built.items():
        assert sorted(_entries(ptx)) == sorted(K.KERNELS[family]), f"{family}.cu"


def test_parameter_lists_match_the_c_signatures(built):
    """The PTX parameter list (what the GPU reads) agrees with the C signature (what the launchers and
    tests/gpu/fake_cupy.py are written against): count, and 64-bit / 32-bit int / float per parameter."""
    from tests.gpu.cuda_emu import c_param_kinds
    from tests.gpu.fake_cupy import _PTX_KIND
    for family, (ptx, _) in built.items():
        src = K.read_source(family)
        for name, params in _entries(ptx).items():
            kinds = c_param_kinds(src, name)
            assert len(kinds) == len(params), f"{name}: C {kinds}, PTX {params}"
            for c, p in zip(kinds, params):
                assert c in _PTX_KIND[p], f"{name}: C {kinds}, PTX {params}"


def test_no_register_spills(built):
    for family, (_, report) in built.items():
        spills = re.findall(r"(\d+) bytes spill stores", report)
        assert spills and all(s == "0" for s in spills), f"{family}.cu spills registers:\n{report}"


def test_runtime_sources_compile_with_nvrtc():
    """As CuPy compiles them at run time: common.cuh pasted in, no include path, NVRTC."""
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as exc:     # no CuPy, or a CuPy without its NVRTC library
        pytest.skip(f"NVRTC not available here ({type(exc).__name__}: {exc})")
    for family in K.FAMILIES:
        prog = nvrtc.createProgram(K.read_source(family), family + ".cu", (), ())
        try:
            nvrtc.compileProgram(prog, [*K.NVRTC_OPTIONS, "-arch=compute_90"])
        except Exception:
            pytest.fail(f"NVRTC rejects {family}.cu:\n{nvrtc.getProgramLog(prog)}")
        finally:
            nvrtc.destroyProgram(prog)
