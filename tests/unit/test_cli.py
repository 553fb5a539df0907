"""The command line, run as a user would."""
import subprocess
import sys


def _run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "fastserve", *args], capture_output=True, text=True,
                          timeout=120, **kw)


def test_generate(tiny_model_path):
    p = _run("generate", "-m", tiny_model_path, "-n", "8", "--temp", "0", "the cat")
    assert p.returncode == 0, p.stderr
    assert "8 tokens in" in p.stderr and p.stdout.strip()
    assert "loaded tiny.gguf in" in p.stderr and "(parse " in p.stderr and "tokenizer " in p.stderr


def test_missing_model_is_a_clear_error(tmp_path):
    p = _run("generate", "-m", str(tmp_path / "none.gguf"), "x")
    assert p.returncode == 1
    assert "fastserve: error:" in p.stderr and "no such file" in p.stderr
    assert "Traceback" not in p.stderr


def test_bench_prints_the_phase_table(tiny_model_path):
    p = _run("bench", "-m", tiny_model_path, "--clients", "2", "--seconds", "1", "--warmup", "0.3", "-n", "8",
             "--no-progress")
    assert p.returncode == 0, p.stderr
    assert "forward" in p.stdout and "host work" in p.stdout and "tok/s" in p.stdout


def test_cache_type_flags(tiny_model_path):
    from fastserve.backends.cpu.kv_cache import KV_CACHE_TYPES
    assert set(KV_CACHE_TYPES) == {"f16", "f32", "q8_0"}      # the choices cli.py writes out
    p = _run("generate", "-m", tiny_model_path, "-n", "4", "--temp", "0", "-ctk", "f32", "--cache-type-v", "f16",
             "the cat")
    assert p.returncode == 0, p.stderr
    # the tiny model's head_dim (16) cannot hold q8_0 blocks of 32: a clear error, no traceback
    p = _run("generate", "-m", tiny_model_path, "-n", "4", "--cache-type-k", "q8_0", "the cat")
    assert p.returncode == 1 and "--cache-type-k q8_0" in p.stderr and "multiple of 32" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    p = _run("generate", "-m", tiny_model_path, "--cache-type-v", "q4_0", "x")
    assert p.returncode == 2 and "invalid choice" in p.stderr
