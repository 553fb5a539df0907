"""examples/notebook.py, openai_client.py and host_stalls.py, each run as a user runs it (its own process),
on the tiny model: they must finish and print what they promise. (desktop_chat.py: test_desktop_chat.py.)"""
from __future__ import annotations

import os
import subprocess
import sys

import httpx

from fastserve.tracer import PHASES

from ..artifacts import REPO_ROOT
from ..e2e.conftest import ServerProc


def run_example(name: str, *args: str, **env: str) -> str:
    full_env = {**os.environ, **env, "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / name), *args], capture_output=True,
                          text=True, timeout=120, env=full_env, cwd=REPO_ROOT)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_notebook(tiny_model_path):
    out = run_example("notebook.py", FASTSERVE_MODEL=tiny_model_path)
    assert "(16 tokens, finish: length)" in out
    assert "4 requests in " in out and "same text as one at a time: True" in out
    assert len(out.strip().splitlines()) >= 6          # every cell printed something


def test_host_stalls(tiny_model_path):
    out = run_example("host_stalls.py", "--model", tiny_model_path, "--clients", "2", "--seconds", "1",
                      "--max-tokens", "16")
    assert "2 clients, " in out and " tokens/s" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    for phase in PHASES:
        assert phase in rows and float(rows[phase][0]) >= 0, out
    assert float(rows["forward"][0]) > 0 and "steps;" in out


def test_openai_client(tiny_model_path, tmp_path):
    srv = ServerProc(tiny_model_path, tmp_path / "server.log", "-np", "2", "-c", "1024", "--api-key", "k")
    try:
        out = run_example("openai_client.py", "--base-url", srv.url + "/v1", "--api-key", "k", "--prompt", "Hi")
        # The streamed text is the server's greedy reply, whole.
        r = httpx.post(srv.url + "/v1/chat/completions", headers={"authorization": "Bearer k"}, json={
            "messages": [{"role": "system", "content": "You are a concise assistant."},
                         {"role": "user", "content": "Hi"}], "max_tokens": 64, "temperature": 0}, timeout=60)
        expected = r.json()["choices"][0]["message"]["content"]
        n = r.json()["usage"]["completion_tokens"]
        assert n > 0 and expected and out.startswith("model: ") and expected in out
        assert f"[{n} tokens in " in out
    finally:
        srv.stop()
