"""The boundaries of ../shared/STYLE.md ("Boundaries worth a test each"), one test each, and the layer
order of issue 24: no import runs back up a layer, and no circle.

The imports are read from the source (ast over fastserve/**/*.py; the import and cimport lines of the
.pyx/.pxd), so an import inside a function counts as much as one at the top; only the circle check
keeps to the imports that run when a module is imported.

Layers, top to bottom (an import goes down or stays level, never up):
  5  the command line and the public API: cli.py, __main__.py, fastserve/__init__.py
  4  server/ (the event loop's side) and bench/ (load generators); neither imports the other; cluster/
     (replicas of the server on Ray Serve, the server's API and error shapes in front of them)
  3  the engine: the modules at the package root and the twins in ref/
  2  backends/: cpu/ and cuda/ never import each other; both may use base.py, host_sampling.py, rope.py
  1  models/: GGUF files, weights, tokenizer, chat template
  0  what every layer speaks: config.py (frozen settings, all validation), errors.py, and the host
     sampler the backends run (_sampling.pyx and its twin ref/sampling.py: logits in, ids out), which
     issue 24 keeps at the root with the other hot-path .pyx
"""
import ast
import importlib
import pathlib
import re
import subprocess
import sys
from functools import cache
from typing import NamedTuple

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "fastserve"
TESTS = pathlib.Path(__file__).resolve().parents[1]


def _name(path: pathlib.Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


PY = {_name(p): p for p in sorted(PKG.rglob("*.py"))}
CYTHON = {}                                     # module -> its .pyx and .pxd
for _p in sorted([*PKG.rglob("*.pyx"), *PKG.rglob("*.pxd")]):
    CYTHON.setdefault(_name(_p), []).append(_p)
MODULES = set(PY) | set(CYTHON)


class Import(NamedTuple):
    src: str            # the importing module
    dst: str            # a module of the package (fastserve.x.y), or an outside top-level name (asyncio)
    where: str          # path:line
    lazy: bool          # inside a function: runs when it is called, not when src is imported
    guarded: bool = False   # inside a `try` that catches its ImportError (a fallback)


def _resolve(name: str) -> str:
    """The package's module that `import name` loads (its longest prefix that is one), or the top-level
    name of an outside one."""
    if name.split(".")[0] != "fastserve":
        return name.split(".")[0]
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _absolute(src: str, is_package: bool, level: int, module: str | None) -> str:
    base = src.split(".") if is_package else src.split(".")[:-1]
    base = base[:len(base) - level + 1] if level else []
    return ".".join(base + ([module] if module else []))


_CATCH_IMPORT_ERROR = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _catches_import_error(node) -> bool:
    return isinstance(node, ast.Try) and any(
        h.type is None or _CATCH_IMPORT_ERROR & {n.id for n in ast.walk(h.type) if isinstance(n, ast.Name)}
        for h in node.handlers)


def _py_imports(mod: str, path: pathlib.Path) -> list[Import]:
    out = []

    def visit(node, lazy, guarded):
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            where = f"{path.relative_to(PKG.parent)}:{getattr(child, 'lineno', 0)}"
            if isinstance(child, ast.Import):
                out.extend(Import(mod, _resolve(a.name), where, inner, guarded) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _absolute(mod, path.name == "__init__.py", child.level, child.module)
                for a in child.names:           # `from pkg import module` imports the module
                    full = f"{base}.{a.name}"
                    out.append(Import(mod, full if full in MODULES else _resolve(base), where, inner, guarded))
            if _catches_import_error(child):
                for part in child.body:
                    visit(ast.Module(body=[part], type_ignores=[]), inner, True)
                for part in child.handlers + child.orelse + child.finalbody:
                    visit(ast.Module(body=[part], type_ignores=[]), inner, guarded)
            else:
                visit(child, inner, guarded)

    visit(ast.parse(path.read_text(), str(path)), False, False)
    return out


_CYTHON_IMPORT = re.compile(r"^([ \t]*)(?:from\s+([\w.]+)\s+c?import\s+\(?\s*([\w, ]+)|c?import\s+([\w.]+))", re.M)


def _cython_imports(mod: str, path: pathlib.Path) -> list[Import]:
    out, text = [], path.read_text()
    for m in _CYTHON_IMPORT.finditer(text):
        where = f"{path.relative_to(PKG.parent)}:{text.count(chr(10), 0, m.start()) + 1}"
        base = m.group(2) or m.group(4)
        names = [n.strip() for n in (m.group(3) or "").split(",") if n.strip()]
        targets = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES] or [base]
        out.extend(Import(mod, _resolve(t), where, bool(m.group(1))) for t in targets)
    return out


@cache
def imports() -> tuple[Import, ...]:
    found = [i for mod, p in PY.items() for i in _py_imports(mod, p)]
    found += [i for mod, ps in CYTHON.items() for p in ps for i in _cython_imports(mod, p)]
    return tuple(i for i in found if i.dst != i.src)


def ours(i: Import) -> bool:
    return i.dst in MODULES


SHARED = {"fastserve.config", "fastserve.errors", "fastserve._sampling", "fastserve.ref.sampling"}
TOP = {"fastserve", "fastserve.cli", "fastserve.__main__"}


def layer(mod: str) -> int:
    if mod in SHARED:
        return 0
    if mod in TOP:
        return 5
    for prefix, n in (("fastserve.models", 1), ("fastserve.backends", 2), ("fastserve.server", 4),
                      ("fastserve.bench", 4), ("fastserve.cluster", 4)):
        if mod == prefix or mod.startswith(prefix + "."):
            return n
    return 3


def area(mod: str) -> str:
    """The folder a module lives in, for the level imports a layer forbids (cpu/ and cuda/, server/ and bench/)."""
    return next((a for a in ("backends.cpu", "backends.cuda", "server", "bench")
                 if mod.startswith(f"fastserve.{a}.") or mod == f"fastserve.{a}"), "")


APART = ({"backends.cpu", "backends.cuda"}, {"server", "bench"})

# Imports that run up a layer on purpose, each with its reason.
UPWARD = {
    ("fastserve.models.transformer", "fastserve.backends.cpu._matmul"):
        "the weights are built as the CPU kernel's BlockMatrix: the kernel's own view of the file's blocks "
        "(memory-mapped, as stored), so the file is read once into the form every product reads",
    ("fastserve.models.model", "fastserve.backends.cpu.backend"):
        "Model.logits (README's Python use: teacher forcing) runs the model through one CpuBackend; lazy, so "
        "loading a model does not import the backend (to go when teacher forcing moves out of Model)",
}


def test_no_import_runs_up_a_layer():
    bad = []
    for i in filter(ours, imports()):
        up = layer(i.dst) > layer(i.src)
        apart = {area(i.src), area(i.dst)} in APART
        if (up or apart) and (i.src, i.dst) not in UPWARD:
            bad.append(f"{i.where}: {i.src} (layer {layer(i.src)}) imports {i.dst} (layer {layer(i.dst)})")
    assert not bad, "\n".join(bad)
    stale = set(UPWARD) - {(i.src, i.dst) for i in imports()}
    assert not stale, f"allowed upward imports that no longer exist (drop them): {stale}"


def test_no_import_circle():
    """Module-level imports only: a lazy one runs after every module is loaded."""
    graph = {}
    for i in imports():
        if ours(i) and not i.lazy:
            graph.setdefault(i.src, set()).add(i.dst)
    done, path = set(), []

    def walk(mod):
        if mod in path:
            return path[path.index(mod):] + [mod]
        if mod in done:
            return None
        path.append(mod)
        for dst in sorted(graph.get(mod, ())):
            circle = walk(dst)
            if circle:
                return circle
        path.pop()
        done.add(mod)
        return None

    for mod in sorted(graph):
        circle = walk(mod)
        assert circle is None, "import circle: " + " -> ".join(circle)


# 1. The engine imports nothing from server/, asyncio, h11 or uvloop; its only outward call is a waker()
#    it is handed.

LOOP_SIDE = {"asyncio", "uvloop", "h11"}
LAZY_ASYNCIO = {"fastserve.reader": "Reader's `async for` asks asyncio for the running loop, inside the "
                                    "coroutine: the loop's side of the crossing, never run on the decode thread"}


def test_boundary_1_engine_knows_no_http_or_event_loop():
    bad = [f"{i.where}: {i.src} imports {i.dst}" for i in imports()
           if layer(i.src) <= 3 and (i.dst in LOOP_SIDE or area(i.dst) == "server")
           and not (i.dst == "asyncio" and i.lazy and i.src in LAZY_ASYNCIO)]
    assert not bad, "\n".join(bad)
    # What importing the engine pulls in, through the libraries it uses too.
    code = ("import sys, fastserve.engine, fastserve.text_reader; "
            "bad = [m for m in ('asyncio', 'uvloop', 'h11', 'fastserve.server') if m in sys.modules]; "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"the engine pulled in {out.stdout.strip()}"


# 2. HTTP is sans-I/O; every route is testable with byte strings and no socket
#    (tests/e2e/test_http_sansio.py drives the routes so: ServerConnection and App, no socket).

TRANSPORT = {"socket", "selectors", "ssl", "uvloop"}
OWNS_TRANSPORT = {"fastserve.server.protocol", "fastserve.server.app"}      # one connection; the wiring
# outside the server, each with its reason
PROBES = {"fastserve.cluster.launch": "`--replicas --ray-address` checks that the address answers a TCP connect: "
                                      "ray.init on an address nobody answers hangs over 2 minutes (ray 2.60)"}


def test_boundary_2_http_is_sans_io():
    http = [i for i in imports() if i.src == "fastserve.server.http"]
    assert any(i.dst == "h11" for i in http)
    bad = [f"{i.where}: server/http.py imports {i.dst}" for i in http
           if i.dst in TRANSPORT | {"asyncio", "threading"} or i.dst in OWNS_TRANSPORT]
    bad += [f"{i.where}: {i.src} imports {i.dst} (only {sorted(OWNS_TRANSPORT)} touch the transport)"
            for i in imports() if (i.dst in TRANSPORT or i.dst == "fastserve.server.protocol")
            and i.src not in OWNS_TRANSPORT and not (i.src in PROBES and i.dst == "socket")]
    assert not bad, "\n".join(bad)
    assert (TESTS / "e2e" / "test_http_sansio.py").is_file()


# 3. A backend is step(batch) -> tokens plus a few lifecycle calls; the scheduler never sees arrays; the
#    model math never sees requests.

SCHEDULER = {"fastserve.scheduler", "fastserve._slots", "fastserve._batch", "fastserve.prompt_cache"}
REQUEST_SIDE = {"fastserve.request", "fastserve.engine", "fastserve.inbox", "fastserve.reader",
                "fastserve.text_reader", "fastserve._delivery", "fastserve.scheduler", "fastserve._slots",
                "fastserve._batch", "fastserve.prompt_cache", "fastserve.masks", "fastserve.grammar"}


def test_boundary_3_scheduler_sees_no_arrays_and_model_math_no_requests():
    bad = [f"{i.where}: the scheduler's {i.src} imports {i.dst}" for i in imports()
           if i.src in SCHEDULER and layer(i.dst) in (1, 2)]
    bad += [f"{i.where}: the model math's {i.src} imports {i.dst}" for i in imports()
            if layer(i.src) in (1, 2) and i.dst in REQUEST_SIDE]
    # Only engine.py, which wires them, knows a backend's type; the rest get the object it hands them.
    bad += [f"{i.where}: {i.src} imports {i.dst} (only fastserve.engine picks a backend)" for i in imports()
            if layer(i.src) == 3 and layer(i.dst) == 2 and i.src != "fastserve.engine"]
    assert not bad, "\n".join(bad)


# 4. A step is a function of the scheduler's frozen output; no global context.

MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "add", "discard",
            "popitem", "appendleft", "extendleft", "popleft", "sort", "reverse", "fill", "put"}
# Module-level state a function changes on purpose, each with its reason.
GLOBAL_STATE = {
    ("fastserve.backends.cuda.kernels", "_cp"): "CuPy, imported on first use: importing the launchers needs none",
    ("fastserve.backends.cuda.kernels", "_modules"): "each kernel family compiled once per device, under _lock: "
                                                     "the same code whichever call fills it",
    ("fastserve.backends.cuda.kernels", "_functions"): "the compiled kernels' handles, as _modules",
    ("fastserve.backends.cuda.kernels", "_SCALARS"): "cuBLAS's alpha as a host float32 [1], one per value (a "
                                                     "model has one or two), the same array whichever call makes it",
}


def _module_names(tree) -> set:
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
    return names


def _changed_globals(tree) -> set:
    """Module-level names that a function rebinds (global) or changes in place (x[k] = v, x.a = v, x.add(v))."""
    module, changed = _module_names(tree), set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        local = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
        local |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                changed |= set(node.names)
            target = None
            if isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, (ast.Store, ast.Del)):
                target = node.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in MUTATORS):
                target = node.func.value
            while isinstance(target, (ast.Subscript, ast.Attribute)):
                target = target.value
            if isinstance(target, ast.Name) and target.id in module and target.id not in local:
                changed.add(target.id)
    return changed


def test_boundary_4_no_global_context():
    """No function below the server changes module-level state (a table, a class attribute, a global),
    so what a step computes depends on its inputs and the objects it is handed alone."""
    found = {(mod, name) for mod, p in PY.items() if layer(mod) <= 3
             for name in _changed_globals(ast.parse(p.read_text()))}
    assert found <= set(GLOBAL_STATE), "module-level state changed by a function: " + \
        ", ".join(f"{m}.{n}" for m, n in sorted(found - set(GLOBAL_STATE)))
    assert set(GLOBAL_STATE) <= found, f"stale allowances (drop them): {set(GLOBAL_STATE) - found}"


# 5. Each .pyx has a pure-Python twin; one parity suite runs both. A missing extension raises; nothing
#    falls back silently.

# Twins that a parity test runs through a switch rather than by name.
SWITCHED = {"fastserve.backends.cpu.ref.forward": ("test_forward.py", "reference=True")}   # CpuBackend's


def _loads(test: pathlib.Path, module: str) -> bool:
    """The test file imports module, or names it whole for importlib."""
    tree = ast.parse(test.read_text())
    return (any(i.dst == module for i in _py_imports(f"tests.{test.stem}", test))
            or any(isinstance(n, ast.Constant) and n.value == module for n in ast.walk(tree)))


@pytest.mark.parametrize("pyx", sorted(str(p.relative_to(PKG.parent).with_suffix("")) for p in PKG.rglob("_*.pyx")))
def test_boundary_5_every_extension_has_a_twin_and_is_built(pyx):
    """Each .pyx has its twin in the ref/ folder beside it (fastserve/ref/, backends/cpu/ref/, models/ref/),
    which a parity test imports; the extension is built and imported as such, never caught."""
    folder, stem = pyx.rsplit("/", 1)
    twin = PKG.parent / folder / "ref" / f"{stem.lstrip('_')}.py"
    assert twin.is_file(), f"{pyx}.pyx has no pure-Python twin at {twin}"
    twin_name = f"{folder.replace('/', '.')}.ref.{stem.lstrip('_')}"
    importlib.import_module(twin_name)
    if twin_name in SWITCHED:
        test, switch = SWITCHED[twin_name]
        assert switch in (TESTS / "parity" / test).read_text(), f"tests/parity/{test} no longer runs {switch}"
    else:
        parity = [p.name for p in (TESTS / "parity").glob("test_*.py") if _loads(p, twin_name)]
        assert parity, f"no test in tests/parity/ imports {twin_name}"
    name = pyx.replace("/", ".")
    caught = [i.where for i in imports() if i.dst == name and i.guarded]
    assert not caught, f"{name} imported under a try that catches its ImportError (a silent fallback): {caught}"
    mod = importlib.import_module(name)        # a missing build raises here: no fallback
    assert mod.__file__.endswith((".so", ".pyd")), f"{pyx} is not the compiled extension"


# 6. Two threads, two crossings: the inbox and the readers.

PRIMITIVES = {f"threading.{n}" for n in ("Thread", "Lock", "RLock", "Event", "Condition", "Semaphore",
                                          "BoundedSemaphore", "Barrier", "Timer")}
PRIMITIVES |= {"_thread.allocate_lock", "_thread.start_new_thread", "queue.Queue", "queue.SimpleQueue",
               "queue.LifoQueue", "queue.PriorityQueue", "concurrent.futures.ThreadPoolExecutor",
               "concurrent.futures.ProcessPoolExecutor", "multiprocessing.Process", "concurrent.futures.Future"}
CROSSINGS = {
    ("fastserve.inbox", "threading.Event"): "the loop -> engine crossing: wakes the idle decode thread",
    ("fastserve.reader", "_thread.allocate_lock"): "the engine -> reader crossing: a blocking reader parks on it",
    ("fastserve.reader", "call_soon_threadsafe"): "the engine -> reader crossing: one wake-up per loop per step",
    ("fastserve.embedding", "concurrent.futures.Future"): "the engine -> reader crossing of an embedding job: set "
                                                          "once, when its last input is done (one wake-up per job)",
}
# Threads and locks below the server that are not crossings, each with its reason.
OTHER_THREADS = {
    ("fastserve.engine", "threading.Thread"): "the decode thread itself",
    ("fastserve.masks", "concurrent.futures.ThreadPoolExecutor"):
        "the grammar masks' worker: computes the next step's masks while the step runs; the decode thread "
        "waits for it before sampling (MaskTable.wait), so it never meets the loop",
    ("fastserve.grammar", "threading.Lock"):
        "the vocabulary's llguidance tokenizer is built once, whichever compile thread "
        "(the server's pool, Engine.constraint) asks first",
    ("fastserve.backends.cpu.kv_cache", "threading.Thread"):
        "the KV fill thread: faults the cache's pages in at start, then ends; it shares no state but the pages",
    ("fastserve.backends.cpu.kv_cache", "threading.Event"): "set by the KV fill thread when the cache is resident",
    ("fastserve.backends.cuda.kernels", "threading.Lock"): "each kernel family compiled once per device",
}


def _thread_primitives(tree) -> set:
    alias = {}                                  # local name -> dotted origin
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            alias.update({(a.asname or a.name).split(".")[0]: (a.asname and a.name) or a.name.split(".")[0]
                          for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            alias.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("call_soon_threadsafe",
                                                                       "run_coroutine_threadsafe"):
            found.add(node.func.attr)
            continue
        first, *rest = ast.unparse(node.func).split(".")
        dotted = ".".join([alias.get(first, first), *rest])
        if dotted in PRIMITIVES:
            found.add(dotted)
    return found


def test_boundary_6_two_threads_two_crossings():
    """Every thread and cross-thread primitive the Python code below the server makes is a crossing or
    named here with its reason. (The CPU backend's worker pool, _pool.h, is C: its threads work inside
    one step's products, fork/join on the decode thread.)"""
    found = {(mod, prim) for mod, p in PY.items() if layer(mod) <= 3
             for prim in _thread_primitives(ast.parse(p.read_text()))}
    allowed = set(CROSSINGS) | set(OTHER_THREADS)
    assert found <= allowed, "threads or cross-thread primitives below the server: " + \
        ", ".join(f"{m}: {p}" for m, p in sorted(found - allowed))
    assert allowed <= found, f"stale allowances (drop them): {allowed - found}"


# 7. Kernels are reached only through their launchers (backends/cuda/kernels.py: dtype, shape and
#    contiguity asserted before each launch, each family compiled once per device).

RAW = {"RawKernel", "RawModule", "ElementwiseKernel", "ReductionKernel", "get_function", "compile_with_cache"}
LAUNCHERS = "fastserve.backends.cuda.kernels"
HANDLES = {"module", "function", "read_source"}    # kernels.py's own plumbing: a compiled module, a kernel, its source


def test_boundary_7_kernels_only_through_launchers():
    bad = []
    for mod, p in PY.items():
        if mod == LAUNCHERS:
            continue
        tree = ast.parse(p.read_text())
        launchers = set()                       # the names this module gives kernels.py
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _absolute(mod, p.name == "__init__.py", node.level, node.module)
                launchers |= {a.asname or a.name for a in node.names if f"{base}.{a.name}" == LAUNCHERS}
                bad += [f"{p.relative_to(PKG.parent)}:{node.lineno}: imports kernels.{a.name}" for a in node.names
                        if base == LAUNCHERS and a.name in HANDLES]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in RAW or isinstance(node, ast.Name) and node.id in RAW:
                bad.append(f"{p.relative_to(PKG.parent)}:{node.lineno}: {ast.unparse(node)}")
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in launchers and node.attr in HANDLES):
                bad.append(f"{p.relative_to(PKG.parent)}:{node.lineno}: {ast.unparse(node)} (a raw kernel handle)")
    assert not bad, "\n".join(bad)
