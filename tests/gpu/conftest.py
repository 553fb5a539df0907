"""Fixtures of the GPU tests. Every test that asks for `cupy` runs twice: [gpu] on a GPU (without CuPy
or a GPU it SKIPS, saying why) and [cpu] with the same kernels' CUDA C run on the CPU (tests/gpu/cuda_emu),
which needs only g++. test_backend_emulated.py and test_cuda_emu.py need neither and always run.

The default model and llama.cpp's reference outputs are found without pulling (a device machine has
no network): $FASTSERVE_MODEL or the cache for the model (a test that needs it and does not find it
skips, saying where it looked); the oracle is in the repository (tests/golden/data).
"""
from __future__ import annotations

import os

import pytest

# The kernel-level tests also run with the block's threads taking turns in a shuffled order, which
# brings out a read of another thread's write that lacks a barrier (tests/gpu/cuda_emu.set_order).
SHUFFLED_ORDER_MODULES = ("test_kernels", "test_device_sampling")


def pytest_generate_tests(metafunc):
    if "cupy" in metafunc.fixturenames:
        params = ["gpu", "cpu"]
        if metafunc.module.__name__.rsplit(".", 1)[-1] in SHUFFLED_ORDER_MODULES:
            params.append("cpu-shuffled")
        metafunc.parametrize("cupy", params, indirect=True, scope="module")


@pytest.fixture(scope="module")
def cupy(request):
    """CuPy, twice over: "gpu", the real CuPy on a GPU (skips without one), and "cpu", a stand-in
    (tests/gpu/fake_cupy.py) that runs the real kernels' CUDA C on the CPU (tests/gpu/cuda_emu), so
    that the kernels' logic is tested on every machine ("cpu-shuffled": the same, threads in a
    shuffled order). FASTSERVE_FAKE_CUPY=1 replaces "gpu" by the stand-in with NumPy emulations of
    the kernels (to check the tests' own references).
    Module scope: the stand-in leaves sys.modules when the module's tests are done."""
    from . import fake_cupy
    mp = pytest.MonkeyPatch()
    if request.param.startswith("cpu"):
        from . import cuda_emu
        if os.environ.get("FASTSERVE_SKIP_CPU_KERNELS") == "1":
            pytest.skip("FASTSERVE_SKIP_CPU_KERNELS=1 (bench/gpu_check.py on a GPU: CI runs the CPU variants)")
        why = cuda_emu.unavailable()
        if why:
            pytest.skip(f"CPU run of the kernels skipped: {why}")
        before = cuda_emu.order()
        if request.param == "cpu-shuffled":
            cuda_emu.set_order("shuffled", seed=before[1])
        try:
            yield fake_cupy.install(mp, kernels="cuda-c")
        finally:
            mp.undo()
            cuda_emu.set_order(*before)
        return
    if os.environ.get("FASTSERVE_FAKE_CUPY") == "1":
        yield fake_cupy.install(mp, kernels="numpy")
        mp.undo()
        return
    from fastserve.backends.cuda.backend import cuda_status
    ok, why = cuda_status()
    if not ok:
        pytest.skip(f"GPU test skipped: {why}")
    import cupy
    yield cupy


def on_gpu(cupy) -> bool:
    """The real CuPy (not the CPU stand-in)."""
    return not hasattr(cupy, "fake_kernels")


def _model_on_disk(cupy, path: str, what: str, variable: str):
    """The model at path, loaded; skips on the CPU kernel emulator (minutes a step) unless
    FASTSERVE_EMULATE_DEFAULT_MODEL=1, and where the file is not (the device machine cannot pull it)."""
    if not on_gpu(cupy) and os.environ.get("FASTSERVE_EMULATE_DEFAULT_MODEL") != "1":
        pytest.skip(f"{what} on the CPU kernel emulator takes minutes a step; "
                    "FASTSERVE_EMULATE_DEFAULT_MODEL=1 runs it anyway")
    if not os.path.isfile(path):
        pytest.skip(f"{what} not at {path} (set {variable}; the device machine cannot pull it)")
    import fastserve
    return fastserve.load_model(path)


@pytest.fixture(scope="module")
def default_model_on_disk(cupy):
    from fastserve.models.default_model import FILENAME, home
    return _model_on_disk(cupy, os.environ.get("FASTSERVE_MODEL") or os.path.join(home(), FILENAME),
                          "the default model", "FASTSERVE_MODEL")


@pytest.fixture(scope="module")
def gemma3_on_disk(cupy):
    """Gemma 3 270M Q4_K_M (`fastserve pull gemma3-270m`), or the file at $FASTSERVE_GEMMA3_MODEL."""
    from fastserve.models.catalog import GEMMA3_270M
    return _model_on_disk(cupy, os.environ.get("FASTSERVE_GEMMA3_MODEL") or GEMMA3_270M.path(), "Gemma 3 270M",
                          "FASTSERVE_GEMMA3_MODEL")


@pytest.fixture(scope="session")
def reference_cases() -> list:
    """llama.cpp's completions on the default model (tests/golden/data: they travel with the tree)."""
    from ..reference_data import load_reference
    return load_reference()["completions"]


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory):
    """A tiny gemma3 Model (fastserve.models.synthetic, random weights): window 8, GQA 4/1 with
    gemma3's 256-wide heads, tied output, the embedding scaled by sqrt(64). Two layers, one local and one
    global (the file's default pattern would make both local), the global layers' RoPE base 1e6 as
    Gemma 3's (the local ones keep 10k), and a final-logit soft-cap of 30 (Gemma 2 style), so that every
    feature of the row differs from the llama path."""
    import dataclasses

    import fastserve
    from fastserve.models.synthetic import write_llama_gguf
    path = write_llama_gguf(tmp_path_factory.mktemp("models") / "gemma3.gguf", architecture="gemma3", n_layer=2,
                            n_embd=64, n_head=4, n_head_kv=1, head_dim=256, n_ff=128, n_vocab=320,
                            sliding_window=8, tied=True, seed=5)
    model = fastserve.load_model(path)
    model.config = dataclasses.replace(model.config, local_layers=(True, False), rope_base=1e6, logit_softcap=30.0)
    return model
