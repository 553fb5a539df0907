"""Issue 5's acceptance over HTTP: `fastserve serve` on the fault build (tests/faults/launch.py),
two slots, the tiny model, requests pinned with id_slot. Plain http.client, one thread per request.
"""
from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from .conftest import REPO, child_env

PROMPT_A, PROMPT_B = (np.random.default_rng(56).integers(3, 512, 40).tolist() for _ in range(2))


class _Server:
    def __init__(self, lib, model_path, log_path, *flags, **faults):
        self.log_path = log_path
        cmd = [sys.executable, "-m", "tests.faults.launch", "-m", "fastserve", "serve", "-m", model_path,
               "--host", "127.0.0.1", "--port", "0", "-t", "1", "-np", "2", "-c", "512", *flags]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(lib, **faults), stdout=subprocess.DEVNULL,
                                     stderr=self._log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.log())
            if m:
                self.port = int(m.group(1))
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the server did not start:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def request(self, method, path, body=None, timeout=60):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=json.dumps(body) if body is not None else None,
                         headers={"content-type": "application/json"})
            r = conn.getresponse()
            return r.status, json.loads(r.read() or b"null")
        finally:
            conn.close()

    def completion(self, prompt, slot, n_predict=8):
        return self.request("POST", "/completion", {"prompt": prompt, "n_predict": n_predict, "temperature": 0,
                                                    "id_slot": slot})

    def concurrent(self, prompt, slots=(0, 1)):
        out = {}
        threads = [threading.Thread(target=lambda s=s: out.__setitem__(s, self.completion(prompt, s))) for s in slots]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        return [out[s] for s in slots]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


@pytest.fixture
def serve(fault_build, tiny_model_path, tmp_path):
    servers = []

    def start(*flags, **faults):
        servers.append(_Server(fault_build, tiny_model_path, tmp_path / f"server{len(servers)}.log", *flags, **faults))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def _has_flag(flag: str) -> bool:
    out = subprocess.run([sys.executable, "-m", "fastserve", "serve", "--help"], cwd=REPO, env=child_env(None),
                         capture_output=True, text=True, timeout=60).stdout
    return flag in out


def test_http_a_failed_fill_leaves_the_batch_and_its_prompt_clean(serve):
    srv = serve(FASTSERVE_TEST_FAIL_PROMPT_FILLS=1)
    pair = srv.concurrent(PROMPT_A)
    bad = [i for i, (status, _) in enumerate(pair) if status != 200]
    good = [body for status, body in pair if status == 200]
    assert len(bad) == 1 and len(good) == 1, pair
    assert pair[bad[0]][0] == 500 and "after adding its tokens" in pair[bad[0]][1]["error"]["message"]
    status, retry = srv.completion(PROMPT_A, bad[0])
    assert status == 200 and retry["timings"]["cache_n"] == 0
    assert retry["content"] == good[0]["content"] and retry["id_slot"] == bad[0]
    assert srv.request("GET", "/health")[0] == 200


def test_http_a_refused_copy_is_not_a_slot_failure(serve):
    if not _has_flag("--cache-ram"):
        pytest.skip("`fastserve serve` has no --cache-ram flag yet (Engine(cache_ram_mib=...) is not wired to it)")
    srv = serve("--cache-ram", "1", FASTSERVE_TEST_FAIL_CACHE_COPIES=2)
    for s in (0, 1):
        assert srv.completion(PROMPT_A, s, n_predict=4)[0] == 200
    (sa, a), (sb, b) = srv.concurrent(PROMPT_B)
    assert sa == sb == 200 and a["content"] == b["content"]
    assert srv.request("GET", "/health")[0] == 200
    assert srv.log().count("copy refused") == 2


def test_http_a_stalled_step_turns_health_503_then_back(serve):
    """The next step blocks 3 s: the watchdog fails the running request and /health answers 503
    until the loop moves again, then 200."""
    srv = serve("--stall-limit", "0.5", FASTSERVE_TEST_STALL_STEP_S=3)
    out = []
    t = threading.Thread(target=lambda: out.append(srv.completion(PROMPT_A, 0, 4)))
    t0 = time.monotonic()
    t.start()
    seen = []
    while time.monotonic() - t0 < 4.5:
        seen.append(srv.request("GET", "/health", timeout=5)[0])
        time.sleep(0.1)
    t.join(30)
    assert out[0][0] == 503 and "stalled" in out[0][1]["error"]["message"]
    assert 503 in seen and seen[-1] == 200
    assert srv.completion(PROMPT_B, 1, 4)[0] == 200
