"""Build the Cython hot path and ship cuda/*.cu inside the package.

Environment switches (read at build time only):
  FASTSERVE_TEST_FAULTS=1   compile the test-only fault points in (never in a release build)
  FASTSERVE_DEBUG=1         Cython annotate + linetrace, no -O3
"""
import glob
import os
import shutil

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("FASTSERVE_DEBUG") == "1"
FAULTS = os.environ.get("FASTSERVE_TEST_FAULTS") == "1"


class BuildPyWithKernels(build_py):
    """Copy cuda/*.cu into the built package as fastserve/cuda/."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "fastserve", "cuda")
        os.makedirs(target, exist_ok=True)
        for src in glob.glob(os.path.join(HERE, "cuda", "*.cu")) + glob.glob(os.path.join(HERE, "cuda", "*.cuh")):
            shutil.copy2(src, target)


class BuildExtParallel(build_ext):
    """Compile the extensions on every core (pip's build and `make build` alike), unless -j says otherwise."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

CPU = os.path.join("fastserve", "backends", "cpu")
# The CPU backend's native modules: (headers they include, extra compiler flags). Their float operations
# are specified one by one (batch invariance, bit parity with their twins in backends/cpu/ref/): no fused
# multiply-add. -fno-trapping-math changes no result (only whether FP exceptions may be raised): it lets
# GCC vectorise the selects of exp2 / sigmoid in _forward (else "control flow in loop").
CPU_NATIVE = {
    "fastserve.backends.cpu._matmul": (("_matmul_kernels.h", "_matmul_fused.h", "_matmul_float.h", "_gguf_blocks.h",
                                         "_stage_avx512.h", "_stage_avx2.h"), ("-ffp-contract=off",)),
    "fastserve.backends.cpu._attention": (("_attention_kernels.h", "_attention_simd.h"), ("-ffp-contract=off",)),
    "fastserve.backends.cpu._forward": (("_layer_ops.h", "_attention_kernels.h", "_attention_simd.h", "_matmul.pxd",
                                         "_attention.pxd"), ("-ffp-contract=off", "-fno-trapping-math")),
}


def extensions():
    macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
    if FAULTS:
        # _faults.pyx compiles its checks only under this C macro; the generated .c is the same
        # for both builds. Build a fault build apart, never in place (see the Makefile's build-faults).
        macros.append(("FASTSERVE_TEST_FAULTS", "1"))
    if DEBUG:
        macros.append(("CYTHON_TRACE_NOGIL", "1"))
    args = ["-O0", "-g"] if DEBUG else ["-O3"]
    exts = []
    pyxs = sorted(glob.glob(os.path.join("fastserve", "**", "*.pyx"), recursive=True))
    if FAULTS:
        # Only _faults differs in a fault build: tests/faults/launch.py takes each extension from the
        # fault build where it is there, else the normal one, so the others need not be built twice.
        pyxs = [os.path.join("fastserve", "_faults.pyx")]
    for pyx in pyxs:
        name = os.path.splitext(pyx)[0].replace(os.sep, ".")
        # Helper threads (the decode thread's Pool, backends/cpu/_pool.h): pthreads.
        ext_args, link_args = list(args) + ["-pthread"], ["-pthread"]
        depends, extra = CPU_NATIVE.get(name, ((), ()))
        exts.append(Extension(name, [pyx], define_macros=macros, extra_compile_args=ext_args + list(extra),
                              extra_link_args=link_args,
                              depends=[os.path.join(CPU, f) for f in ("_pool.h", "_pool.pxd") + depends]))
    return cythonize(
        exts,
        nthreads=os.cpu_count() or 1,        # Cython's C generation, one module per process
        language_level=3,
        annotate=DEBUG,
        compile_time_env={"FASTSERVE_TEST_FAULTS": FAULTS},
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
            "linetrace": DEBUG,
        },
    )


setup(ext_modules=extensions(), cmdclass={"build_py": BuildPyWithKernels, "build_ext": BuildExtParallel})
