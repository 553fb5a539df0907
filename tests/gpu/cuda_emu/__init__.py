"""fastserve's CUDA C kernels, compiled with g++ and run on the CPU (cuda_emu.h says how and what it
cannot show). tests/gpu/fake_cupy.py launches them through here when its kernels are 'emulated'.

A kernel family's source (as kernels.read_source gives it) becomes one shared library: the source,
then runtime.cpp (the fiber scheduler), then one stub per kernel that unpacks an argument array
into the kernel's parameters. Libraries are cached by the hash of all three texts.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
_C_TYPES = {"ptr": "void*", "b64": "long long", "b32": "int", "f32": "float"}
_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL] = {}


_ORDERS = {"ascending": 0, "descending": 1, "shuffled": 2}


_order = [os.environ.get("FASTSERVE_CUDA_EMU_ORDER", "ascending"), int(os.environ.get("FASTSERVE_CUDA_EMU_SEED", "1"))]


def order() -> tuple[str, int]:
    """The thread order in force and its seed (see set_order)."""
    return _order[0], _order[1]


def set_order(name: str, seed: int = 1) -> None:
    """The order in which a block's threads take turns between barriers: ascending (the default, or
    $FASTSERVE_CUDA_EMU_ORDER), descending or shuffled (per block, from seed, or $FASTSERVE_CUDA_EMU_SEED).
    A kernel whose results change with it reads what another thread writes without a barrier between."""
    if name not in _ORDERS:
        raise ValueError(f"the thread order must be one of {', '.join(_ORDERS)}, not {name!r}")
    _order[:] = [name, int(seed)]
    with _lock:
        for lib in _libraries.values():
            lib.fsemu_set_order(ctypes.c_int(_ORDERS[name]), ctypes.c_uint64(int(seed)))


def unavailable() -> str | None:
    """Why kernels cannot run here (None when they can)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return f"the CPU kernel emulator switches fibers on x86-64 and aarch64 only, not {platform.machine()}"
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        return "the CPU kernel emulator needs g++ (or $CXX)"
    return None


def c_param_kinds(source: str, name: str) -> list[str]:
    """Kinds of a kernel's parameters from its C signature: ptr, b64 (long long), b32 (int), f32.
    Kernels instantiated by a macro (e.g. cuda/attention.cu) are read from the macro's NAME(...)."""
    m = re.search(r"\b" + re.escape(name) + r"\s*\(([^)]*)\)\s*\{", source)
    if m is None:       # made by a macro: MACRO(name, ...) and #define MACRO(NAME, ...) ... NAME(params)
        call = re.search(r"^(\w+)\(\s*" + re.escape(name) + r"\s*,", source, re.M)
        if call is not None:
            m = re.search(r"#define\s+" + call.group(1) + r"\(NAME[^)]*\)(?:.|\n)*?\bNAME\s*\(([^)]*)\)", source)
    if m is None:
        raise AttributeError(f"cannot find the C signature of {name}")
    kinds = []
    for p in m.group(1).replace("\\", " ").split(","):
        p = " ".join(p.split())
        if "*" in p:
            kinds.append("ptr")
        elif "long long" in p:
            kinds.append("b64")
        elif p.startswith(("int ", "unsigned int ", "const int ", "const unsigned int ")):
            kinds.append("b32")
        elif p.startswith(("float ", "const float ")):
            kinds.append("f32")
        else:
            raise TypeError(f"{name}: parameter {p!r} of a kind the emulator does not know")
    return kinds


def kernel_names(source: str) -> list[str]:
    """Every extern "C" kernel of a source: written out, or made by a macro whose body declares one."""
    names = re.findall(r'extern\s+"C"\s+__global__\s+void[\s\\]+(?:__launch_bounds__\([^)]*\)[\s\\]*)?(\w+)\s*\(',
                       source)
    for macro in re.findall(r"#define\s+(\w+)\(NAME\b[^)]*\)(?:[^\n]*\\\n)*?[^\n]*extern\s+\"C\"", source):
        names += re.findall(r"^" + macro + r"\(\s*(\w+)\s*,", source, re.M)
    return [n for n in dict.fromkeys(names) if n != "NAME"]


def _stubs(source: str) -> str:
    lines = []
    for name in kernel_names(source):
        kinds = c_param_kinds(source, name)
        types = ", ".join(_C_TYPES[k] for k in kinds)
        args = ", ".join(f"*({_C_TYPES[k]}*)a[{i}]" for i, k in enumerate(kinds))
        lines.append(f'FSEMU_EXPORT void fsemu_stub_{name}(void** a) {{\n'
                     f'    reinterpret_cast<void (*)({types})>(&{name})({args});\n}}')
    return "\n".join(lines) + "\n"


def _cache_dir() -> Path:
    d = os.environ.get("FASTSERVE_CUDA_EMU_CACHE")
    base = Path(d) if d else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fastserve" / "cuda_emu"
    base.mkdir(parents=True, exist_ok=True)
    return base


def library(source: str) -> ctypes.CDLL:
    """The source compiled for the CPU (cached on disk and in memory)."""
    text = source + "\n" + (HERE / "runtime.cpp").read_text() + "\n" + _stubs(source)
    header = HERE / "cuda_emu.h"
    key = hashlib.sha256((header.read_text() + text).encode()).hexdigest()[:24]
    with _lock:
        lib = _libraries.get(key)
        if lib is not None:
            return lib
    path = _cache_dir() / f"{key}.so"
    if not path.exists():
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "k.cpp"
            src.write_text(text)
            out = Path(tmp) / "k.so"
            cmd = [os.environ.get("CXX", "g++"), "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
                   "-fno-strict-aliasing", "-Wall", "-Wno-unknown-pragmas", "-Wno-cast-function-type",
                   "-Wno-unused-function", "-Wno-unused-variable", "-include", str(header), "-o", str(out), str(src)]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"g++ could not compile the kernels for the CPU:\n{p.stderr[-6000:]}")
            tmp_target = path.with_suffix(f".{os.getpid()}.tmp")
            shutil.copyfile(out, tmp_target)
            os.replace(tmp_target, path)
    lib = ctypes.CDLL(str(path))
    if _order[0] not in _ORDERS:
        raise ValueError(f"FASTSERVE_CUDA_EMU_ORDER must be one of {', '.join(_ORDERS)}, not {_order[0]!r}")
    lib.fsemu_set_order(ctypes.c_int(_ORDERS[_order[0]]), ctypes.c_uint64(_order[1]))
    lib.fsemu_launch.restype = ctypes.c_int
    lib.fsemu_launch.argtypes = ([ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_uint] * 6
                                 + [ctypes.c_char_p, ctypes.c_int])
    with _lock:
        _libraries[key] = lib
    return lib


_CTYPE = {"ptr": ctypes.c_void_p, "b64": ctypes.c_int64, "f32": ctypes.c_float}


def _pack(kind: str, value):
    if kind == "b32":
        v = int(value)
        return ctypes.c_uint32(v) if v > 0x7FFFFFFF else ctypes.c_int32(v)
    if kind == "b64":
        v = int(value)
        return ctypes.c_uint64(v) if v > 0x7FFFFFFFFFFFFFFF else ctypes.c_int64(v)
    if kind == "ptr":
        return ctypes.c_void_p(int(value))
    return ctypes.c_float(float(value))


class Kernel:
    """One kernel of a compiled family: kernel(grid, block, values) with values already plain
    (pointers as ints, scalars as numbers), in the kinds of c_param_kinds."""

    def __init__(self, source: str, name: str):
        self.name = name
        self.kinds = c_param_kinds(source, name)
        lib = library(source)
        self._launch = lib.fsemu_launch
        self._stub = ctypes.cast(getattr(lib, f"fsemu_stub_{name}"), ctypes.c_void_p)

    def __call__(self, grid, block, values) -> None:
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
        if len(values) != len(self.kinds):
            raise TypeError(f"{self.name}: {len(values)} arguments for {len(self.kinds)} parameters")
        held = [_pack(k, v) for k, v in zip(self.kinds, values)]
        argv = (ctypes.c_void_p * len(held))(*[ctypes.addressof(h) for h in held])
        err = ctypes.create_string_buffer(600)
        if self._launch(self._stub, argv, *grid, *block, err, len(err)) != 0:
            raise RuntimeError(f"{self.name} grid={grid} block={block}: {err.value.decode(errors='replace')}")
