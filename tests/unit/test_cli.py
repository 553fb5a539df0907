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
    p = _run("bench", "-m", tiny_model_path, "--clients", "2", "--seconds", "1", "-n", "8")
    assert p.returncode == 0, p.stderr
    assert "forward" in p.stdout and "host work" in p.stdout and "tok/s" in p.stdout
