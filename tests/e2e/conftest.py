"""End-to-end fixtures: `fastserve serve` as a real subprocess on a free loopback port, on the tiny model.

The server's stderr goes to a file (never a pipe nobody reads); tests read it for
the request log. Every server is killed at teardown if a test did not stop it.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60


class ServerProc:
    """A running `python -m fastserve serve` process (with stall_file: tests/e2e/stall_server.py's, whose
    forward pass hangs while that file exists). metrics: pass --metrics (/metrics is opt-in, as in
    llama-server; the tests read it), unless the test is about the flag itself."""

    def __init__(self, model_path: str, log_path: Path, *flags: str, stall_file: str | None = None,
                 metrics: bool = True):
        self.log_path = log_path
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env.setdefault("OMP_NUM_THREADS", "1")
        launcher = ["-m", "fastserve"] if stall_file is None else ["-m", "tests.e2e.stall_server", stall_file]
        cmd = [sys.executable, *launcher, "serve", *(("-m", model_path) if model_path else ()), "--host", "127.0.0.1",
               "--port", "0", "-t", "1", *(("--metrics",) if metrics else ()), *flags]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._log, cwd=str(REPO_ROOT), env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        port = None
        while time.monotonic() < deadline:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.log())
            if m:
                port = int(m.group(1))
                break
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        if port is None:
            self.kill()
            raise RuntimeError(f"the server did not start; its log:\n{self.log()}")
        self.host, self.port = "127.0.0.1", port
        self.url = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig=signal.SIGTERM, timeout: float = 10.0) -> tuple[int | None, float]:
        """Send sig; (exit code or None if it did not exit within timeout, seconds it took)."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        dt = time.monotonic() - t0
        if rc is None:
            self.kill()
        self._log.close()
        return rc, dt

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> ServerProc:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


@pytest.fixture
def make_server(tiny_model_path, tmp_path):
    """make_server(*flags) -> ServerProc; killed at teardown."""
    procs = []

    def make(*flags: str, stall_file: str | None = None, metrics: bool = True) -> ServerProc:
        p = ServerProc(tiny_model_path, tmp_path / f"server{len(procs)}.log", *flags, stall_file=stall_file,
                       metrics=metrics)
        procs.append(p)
        return p

    yield make
    for p in procs:
        p.kill()


@pytest.fixture(scope="session")
def server(tiny_model_path, tmp_path_factory):
    """One server shared by the API tests: 8 slots of 256 tokens, 16 tokens by default."""
    with ServerProc(tiny_model_path, tmp_path_factory.mktemp("server") / "server.log",
                    "-c", "2048", "-np", "8", "-n", "16", "--timeout", "20") as p:
        yield p


@pytest.fixture(scope="module")
def http(server):
    """An httpx client of the module's server (a module may define its own `server`)."""
    import httpx
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    """The openai package's client of the module's server."""
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def wait_until(pred, timeout: float = 10.0, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    return pred()
