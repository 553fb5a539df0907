"""fastserve.cluster on a local Ray cluster (ray.init(num_cpus=2)): 2 replicas of the default model, 4 slots
each, behind the ingress, with the openai client and raw streams. Routing by prefix, the same API and error
shapes, /health and /metrics put together; a replica whose decode loop wedges, and one whose process is
killed, mid-load. Skips where Ray Serve is not installed (pip install 'fastserve[ray]')."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install 'fastserve[ray]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'fastserve[ray]')")
openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from fastserve.cluster import build  # noqa: E402

pytestmark = pytest.mark.model
REPO_ROOT = Path(__file__).resolve().parents[2]
SYSTEM = ("You are a careful assistant for a small bakery. You answer questions about bread, cakes, opening hours "
          "and prices. Keep every answer short, friendly and precise, and never invent a product that the bakery "
          "does not sell. The bakery sells sourdough, rye, baguettes, croissants, cinnamon rolls and apple cake.")
RECOVER_S = 30.0
REPORT_WAIT_S = 1.5             # the replicas report every second
# a completion that always runs its 4 tokens (a sampled EOS once ended one at 3)
FOUR_TOKENS = {"prompt": "The capital of France is", "n_predict": 4, "temperature": 0, "ignore_eos": True}
# prompts that share no prefix (their first letters differ): the router spreads them over the replicas
OPENINGS = [f"{w} morning, the old lighthouse keeper" for w in ("Alpha", "Bright", "Cold", "Damp", "Early", "Foggy",
                                                                   "Grey", "Hazy", "Icy", "Jolly", "Kind", "Lazy")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fastserve_serve_replicas_starts_serves_and_stops(default_model_file, tmp_path):
    """The command line: its own local Ray, one replica, the API on --port; Ctrl-C ends it all with 0. First in
    the file: the module's own Ray (the fixture below) starts after it."""
    port = free_port()
    log = tmp_path / "cluster.log"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "fastserve", "serve", "-m", default_model_file, "--replicas", "1",
                                 "-np", "2", "-c", "1024", "-t", "1", "--port", str(port), "--metrics"],
                                stdout=subprocess.DEVNULL, stderr=f, env=env, cwd=REPO_ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "fastserve: cluster listening on" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health", timeout=10).status_code == 200      # healthy once it says it listens
        r = httpx.post(url + "/completion", json=FOUR_TOKENS, timeout=60)
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 4
        deadline = time.monotonic() + 15     # the replicas report to the board every second (later on a busy box)
        while len(per_replica(url, "vllm:num_requests_waiting")) != 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(per_replica(url, "vllm:num_requests_waiting")) == 1
        family = psutil.Process(proc.pid).children(recursive=True)     # Ray's processes, the replica, its server
        assert any("fastserve" in " ".join(p.cmdline()) and "serve" in p.cmdline() for p in family)
        os.killpg(proc.pid, signal.SIGINT)      # Ctrl-C: the whole process group, Ray's own processes too
        assert proc.wait(60) == 0, log.read_text(errors="replace")[-3000:]
        assert wait_gone(family, 10) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def cluster(default_model_file, tmp_path_factory):
    """(base url, board, stall file template): the app on a local Ray of 2 CPUs; each replica's server is
    tests/e2e/stall_server.py's, whose decode loop hangs while stall-<its pid> exists."""
    stall = str(tmp_path_factory.mktemp("stall") / "stall-{pid}")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}})
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        flags = ["-m", default_model_file, "-c", "2048", "-np", "4", "-t", "1", "-n", "16", "--stall-limit", "2"]
        app, board = build(flags, replicas=2, num_cpus=0.5, metrics=True,
                           launcher=("-m", "tests.e2e.stall_server", stall))
        serve.run(app, name="fastserve", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        assert healthy_replicas(url, board, 2), "the two replicas did not report healthy"
        yield url, board, stall
    finally:
        serve.shutdown()
        ray.shutdown()


def wait_gone(procs: list, timeout: float) -> list:
    """The processes of procs still running after timeout (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def reports(board) -> dict:
    return ray.get(board.read.remote())


def healthy_replicas(url: str, board, n: int, timeout: float = RECOVER_S, exclude=()) -> dict:
    """The board's reports once n replicas (none of exclude) are healthy and /health says 200; {} at timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reps = {r: rep for r, rep in reports(board).items() if rep["healthy"] and r not in exclude}
        if len(reps) >= n and httpx.get(url + "/health", timeout=5).status_code == 200:
            return reps
        time.sleep(0.25)
    return {}


def per_replica(url: str, sample: str) -> dict:
    """{replica: value} of one sample of the merged /metrics."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == sample and "replica" in s.labels:
                out[s.labels["replica"]] = out.get(s.labels["replica"], 0) + s.value
    return out


def sse_stream(url: str, path: str, body: dict) -> dict:
    """A raw streamed /completion: {status, events (its tokens' data objects), error (the error event or None),
    final (the last event, stop: true, or None)}."""
    out = {"status": 0, "events": [], "error": None, "final": None}
    with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", path, json={**body, "stream": True}) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = json.loads(r.read())
            return out
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                out["error"] = obj
            elif obj.get("stop"):       # the last event: the whole count and the timings
                out["final"] = obj
            else:
                out["events"].append(obj)
    return out


def finished(r: dict, n: int) -> bool:
    """The stream ended as a finished request does: its token events up to n tokens, then the final event
    saying n, no error. Tokens, not events: an event carries the tokens its server's loop found waiting (one
    each while the loop keeps up; several when it falls behind the decode thread on a busy box), and its
    tokens_predicted counts them."""
    counts = [e["tokens_predicted"] for e in r["events"]]
    return (r["error"] is None and r["final"] is not None and r["final"]["tokens_predicted"] == n
            and counts[-1:] == [n] and counts == sorted(counts))


def seen(results: list) -> list:
    """What each stream got, for a failed assertion: (token events, tokens, final event?, error code)."""
    return [(len(r["events"]), r["events"][-1]["tokens_predicted"] if r["events"] else 0, r["final"] is not None,
             r["error"] and r["error"]["error"]["code"]) for r in results]


def test_a_stream_is_finished_by_its_tokens_and_its_final_event():
    """finished(): 48 tokens in 22 events is a finished stream; a stream that ends without its final event (a cut
    passed off as an end), one whose final says fewer tokens, or one with an error event, is not."""
    def stream(counts, final=48, error=None):
        return {"status": 200, "events": [{"tokens_predicted": c} for c in counts], "error": error,
                "final": None if final is None else {"stop": True, "tokens_predicted": final}}
    merged = [*range(1, 11), *range(12, 48, 3), 48]             # a loop that fell behind: several tokens an event
    assert finished(stream(range(1, 49)), 48) and finished(stream(merged), 48) and len(merged) == 23
    assert not finished(stream(range(1, 23), final=None), 48)      # cut after 22 tokens, no final event
    assert not finished(stream(range(1, 49), final=None), 48)
    assert not finished(stream(range(1, 48), final=47), 48)
    assert not finished(stream([3, 2, 48]), 48)
    assert not finished(stream(range(1, 23), final=None, error={"error": {"code": 503}}), 48)


def test_chats_route_by_prefix_and_complete(cluster):
    url, board, _ = cluster
    oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    cached0 = per_replica(url, "llamacpp:prompt_tokens_cached_total")
    done0 = per_replica(url, "fastserve_requests_finished_total")

    def chat(i: int) -> str:
        stream = oai.chat.completions.create(model="x", max_tokens=12, temperature=0, stream=True, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}: what do you bake?"}])
        return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

    chat(-1)                        # the first of its prefix: the router learns where it went
    with cf.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(chat, range(16)))
    assert len(texts) == 16 and all(texts)
    time.sleep(2.5)                 # the replicas' next reports
    cached = {r: v - cached0.get(r, 0) for r, v in per_replica(url, "llamacpp:prompt_tokens_cached_total").items()}
    served = {r: v - done0.get(r, 0) for r, v in per_replica(url, "fastserve_requests_finished_total").items()}
    assert sum(cached.values()) > 0, cached
    assert max(cached.values()) >= 0.9 * sum(cached.values()), cached
    assert max(served.values()) >= 0.9 * 17, served         # the shared prefix's requests on one replica

    # the same API: a completion, llama-server's error shape, OpenAI's error shape through the openai client
    r = httpx.post(url + "/completion", json=FOUR_TOKENS, timeout=60)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 4
    r = httpx.post(url + "/completion", json={"prompt": "x", "n_predict": "many"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    with pytest.raises(openai.BadRequestError, match="messages"):
        oai.chat.completions.create(model="x", messages=[], max_tokens=4)
    h = httpx.get(url + "/health", timeout=10)
    assert h.status_code == 200 and len(h.json()["replicas"]) == 2
    running = per_replica(url, "vllm:num_requests_running")
    assert len(running) == 2


def test_a_client_that_goes_away_frees_its_slot(cluster):
    url, board, _ = cluster
    body = {"prompt": OPENINGS[11], "n_predict": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", "/completion", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        time.sleep(REPORT_WAIT_S)
        assert sum(per_replica(url, "vllm:num_requests_running").values()) == 1
    deadline = time.monotonic() + 10                # the ingress cancels the replica's stream, its server the slot
    while sum(per_replica(url, "vllm:num_requests_running").values()) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert sum(per_replica(url, "vllm:num_requests_running").values()) == 0
    assert sum(per_replica(url, "fastserve_client_disconnects_total").values()) >= 1


def busiest(url: str, board) -> tuple:
    """(replica, its report) running the most requests, once a report says that one runs any: on a loaded box
    the requests reach their slots, and the reports the board, later than REPORT_WAIT_S."""
    time.sleep(REPORT_WAIT_S)
    deadline = time.monotonic() + RECOVER_S
    while True:
        running = per_replica(url, "vllm:num_requests_running")
        victim = max(running, key=running.get)
        if running[victim] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert running[victim] > 0, running
    return victim, reports(board)[victim]


def test_wedged_replica_is_replaced(cluster):
    url, board, stall = cluster
    healthy_replicas(url, board, 2)
    body = lambda p: {"prompt": p, "n_predict": 48, "temperature": 0, "ignore_eos": True}      # noqa: E731
    with cf.ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(sse_stream, url, "/completion", body(p)) for p in OPENINGS[:8]]
        wedged, rep = busiest(url, board)
        Path(stall.replace("{pid}", str(rep["server_pid"]))).touch()
        results = [f.result(timeout=120) for f in futs]
    cut = [r for r in results if r["error"] is not None]
    assert cut, "no stream was on the wedged replica"
    for r in cut:                   # started there: the wedged server's watchdog ends them with a clear 503
        assert r["status"] == 200 and r["events"] and r["final"] is None and r["error"]["error"]["code"] == 503, r
        assert "stalled" in r["error"]["error"]["message"]
    # the others, and those that had not started there (passed on to the other replica), whole
    assert all(finished(r, 48) for r in results if r["error"] is None), seen(results)
    t0 = time.monotonic()
    again = healthy_replicas(url, board, 2, exclude={wedged})
    assert again and wedged not in again, reports(board)
    assert time.monotonic() - t0 < RECOVER_S
    r = httpx.post(url + "/completion", json=body(OPENINGS[0]) | {"n_predict": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 4


def test_killed_replica_loses_no_request_that_had_not_started(cluster):
    url, board, _ = cluster
    healthy_replicas(url, board, 2)
    body = lambda i: {"prompt": OPENINGS[i], "n_predict": 48, "temperature": 0, "ignore_eos": True}     # noqa: E731
    with cf.ThreadPoolExecutor(12) as pool:
        streams = [pool.submit(sse_stream, url, "/completion", body(i)) for i in range(8)]
        whole = [pool.submit(httpx.post, url + "/completion", json=body(8 + i), timeout=120) for i in range(4)]
        victim, rep = busiest(url, board)
        os.kill(rep["pid"], signal.SIGKILL)     # the replica's process: its server dies with it
        results = [f.result(timeout=120) for f in streams]
        answers = [f.result(timeout=120) for f in whole]
    # not streamed: none had started, so each went to another replica and completed
    assert [a.status_code for a in answers] == [200] * 4 and all(a.json()["tokens_predicted"] == 48 for a in answers)
    cut = [r for r in results if r["error"] is not None]
    assert cut, "no stream was on the killed replica"
    for r in cut:                   # started on the killed replica: a 503 event after what it had sent
        assert r["status"] == 200 and r["events"] and r["final"] is None and r["error"]["error"]["code"] == 503, r
    assert all(finished(r, 48) for r in results if r["error"] is None), seen(results)
    t0 = time.monotonic()
    again = healthy_replicas(url, board, 2, exclude={victim})
    assert again and time.monotonic() - t0 < RECOVER_S, reports(board)
    r = httpx.post(url + "/completion", json=body(0) | {"n_predict": 4}, timeout=60)
    assert r.status_code == 200
