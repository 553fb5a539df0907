"""Several models in one server (`fastserve serve --models-dir DIR`, server/router.py) with the default model and
Gemma 3 270M: listed before they load, loaded on first use, streamed side by side, the least recently used one
unloaded at --models-max 1 (RSS falls; a request in flight is never cut), keep_alive 0 and --sleep-idle-seconds
unloading an idle one, unknown models a 404 in each API's shape, bad flags refused at start."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import ollama
import psutil
import pytest

from .conftest import REPO_ROOT, ServerProc, wait_until

CHAT = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def models_dir(default_model_file, tmp_path_factory):
    from fastserve.models.catalog import model_path
    d = tmp_path_factory.mktemp("models")
    (d / "smollm2.gguf").symlink_to(default_model_file)
    (d / "gemma3.gguf").symlink_to(model_path("gemma3-270m"))
    (d / "notes.txt").write_text("not a model")
    (d / "broken.gguf").write_bytes(b"GGUF but not really a model")
    return d


def _serve(models_dir, tmp_path, *flags) -> ServerProc:
    return ServerProc(None, tmp_path / "server.log", "--models-dir", str(models_dir), "-c", "1024", "-np", "2",
                      *flags)


def _loaded(c: httpx.Client) -> set:
    return {m["name"] for m in c.get("/api/ps").json()["models"]}


def _chat(c: httpx.Client, model: str, n: int = 8) -> dict:
    r = c.post("/v1/chat/completions", json={"model": model, "messages": CHAT, "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_two_models_listed_loaded_on_use_and_streamed_side_by_side(models_dir, tmp_path):
    with _serve(models_dir, tmp_path, "--models-max", "2") as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        listed = c.get("/v1/models").json()["data"]
        assert [(m["id"], m["status"]["value"]) for m in listed] == [("broken", "unloaded"), ("gemma3", "unloaded"),
                                                                     ("smollm2", "unloaded")]
        assert {m["name"] for m in c.get("/api/tags").json()["models"]} == {"broken", "gemma3", "smollm2"}
        assert _loaded(c) == set()
        texts = {}

        def stream(model):
            with c.stream("POST", "/v1/chat/completions", json={"model": model, "messages": CHAT, "max_tokens": 16,
                                                                 "temperature": 0, "stream": True}) as r:
                assert r.status_code == 200
                texts[model] = [line for line in r.iter_lines() if line.startswith("data: ")]
        threads = [threading.Thread(target=stream, args=(m,)) for m in ("smollm2", "gemma3")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(v[-1] == "data: [DONE]" and len(v) > 3 for v in texts.values()), texts
        assert _loaded(c) == {"gemma3", "smollm2"}
        # each answer is its own model's: the same as that model alone gives
        assert _chat(c, "smollm2")["choices"][0]["message"] != _chat(c, "gemma3")["choices"][0]["message"]
        client = ollama.Client(host=srv.url)
        assert client.chat(model="gemma3:latest", messages=CHAT, options={"num_predict": 4}).done
        assert client.embed(model="smollm2", input="hello").embeddings
        rc, dt = srv.stop()                      # SIGTERM with two models loaded
        assert rc == 0 and dt < 3.0, (rc, dt)


def test_models_max_one_unloads_the_idle_one_never_one_in_flight(models_dir, tmp_path):
    with _serve(models_dir, tmp_path, "--models-max", "1") as srv, httpx.Client(base_url=srv.url, timeout=180) as c:
        proc = psutil.Process(srv.proc.pid)
        _chat(c, "smollm2")
        small = proc.memory_info().rss
        _chat(c, "gemma3")
        assert _loaded(c) == {"gemma3"}
        big = proc.memory_info().rss
        _chat(c, "smollm2")
        assert _loaded(c) == {"smollm2"}
        back = proc.memory_info().rss
        assert back < big - 100 * 2**20 and back < 1.5 * small, (small, big, back)    # gemma3's memory went
        # a long stream on smollm2 while gemma3 is asked for: the stream ends whole, then gemma3 loads
        lines, done = [], threading.Event()

        def stream():
            with c.stream("POST", "/completion", json={"model": "smollm2", "prompt": "Once upon a time",
                                                       "n_predict": 96, "temperature": 0, "stream": True,
                                                       "ignore_eos": True}) as r:
                lines.extend(line for line in r.iter_lines() if line.startswith("data: "))
            done.set()
        t = threading.Thread(target=stream)
        t.start()
        time.sleep(0.5)                          # the stream has begun
        _chat(c, "gemma3", 4)
        assert done.is_set()                     # gemma3 waited for smollm2's stream to end
        t.join()
        last = json.loads(lines[-1][len("data: "):])
        assert last["stop"] is True and last["tokens_predicted"] == 96, last


def test_keep_alive_zero_and_sleep_idle_unload(models_dir, tmp_path):
    with _serve(models_dir, tmp_path, "--sleep-idle-seconds", "2") as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as c:
        r = c.post("/api/generate", json={"model": "smollm2", "prompt": "hi", "stream": False, "keep_alive": 0,
                                          "options": {"num_predict": 4}})
        assert r.status_code == 200 and r.json()["done"]
        assert _loaded(c) == set()               # unloaded once its answer ended
        _chat(c, "gemma3", 4)
        assert _loaded(c) == {"gemma3"}
        expires = c.get("/api/ps").json()["models"][0]["expires_at"]
        assert expires.startswith(time.strftime("%Y-%m-%dT", time.gmtime()))    # soon, not 2318
        assert wait_until(lambda: _loaded(c) == set(), 10)      # idle for 2 s: unloaded
        assert "loading gemma3" in srv.log() and "loaded gemma3: loaded gemma3.gguf in" in srv.log()


def test_unknown_and_missing_models(models_dir, tmp_path):
    with _serve(models_dir, tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        for path, body, shape in [
                ("/v1/chat/completions", {"model": "llama9", "messages": CHAT}, lambda j: j["error"]["code"] == 404),
                ("/completion", {"model": "llama9", "prompt": "x"}, lambda j: j["error"]["code"] == 404),
                ("/v1/messages", {"model": "llama9", "messages": CHAT, "max_tokens": 4},
                 lambda j: j["type"] == "error" and j["error"]["type"] == "not_found_error"),
                ("/api/chat", {"model": "llama9", "messages": CHAT}, lambda j: set(j) == {"error"})]:
            r = c.post(path, json=body)
            assert r.status_code == 404 and shape(r.json()) and "llama9" in r.text, (path, r.text)
        r = c.post("/v1/chat/completions", json={"messages": CHAT})
        assert r.status_code == 400 and "'model' is required" in r.json()["error"]["message"]
        assert _loaded(c) == set()
        r = c.get("/props")                      # a GET without a model, none loaded: which one is not known
        assert r.status_code == 400 and "'model' is required" in r.json()["error"]["message"]
        _chat(c, "gemma3", 2)
        for path in ("/props", "/tokenizer_info", "/slots"):     # ... one loaded: that one
            r = c.get(path)
            assert r.status_code == 200 and r.json() == c.get(path, params={"model": "gemma3"}).json(), (path, r.text)
        assert "gemma3" in c.get("/props").json()["model_path"]
        assert c.post("/v1/chat/completions", json={"messages": CHAT}).status_code == 400    # a POST still names it
        # a file that does not load: a 500 saying why, for each of its requests; the others go on
        errors = []
        threads = [threading.Thread(target=lambda: errors.append(c.post("/api/chat", json={"model": "broken",
                                                                                           "messages": CHAT})))
                   for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.status_code for r in errors] == [500, 500] and "could not be loaded" in errors[0].json()["error"]
        assert _chat(c, "smollm2", 2)["choices"]
        assert _loaded(c) == {"gemma3", "smollm2"}
        r = c.get("/props")                      # two loaded: a GET without a model cannot pick one
        assert r.status_code == 400 and "'model' is required" in r.json()["error"]["message"]


@pytest.mark.parametrize("flags, says", [
    (["--models-max", "0"], "--models-max must be >= 1"),
    (["-m", "x.gguf"], "give -m (one model) or --models-dir"),
])
def test_bad_flags_are_refused_at_start(models_dir, flags, says):
    p = subprocess.run([sys.executable, "-m", "fastserve", "serve", "--models-dir", str(models_dir), *flags],
                       capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert p.returncode == 2 and says in p.stderr, p.stderr


def test_an_empty_models_dir_and_sleep_without_it_are_refused(tmp_path):
    p = subprocess.run([sys.executable, "-m", "fastserve", "serve", "--models-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert p.returncode == 2 and "no .gguf file there" in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "fastserve", "serve", "--sleep-idle-seconds", "5", "-m", "x.gguf"],
                       capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert p.returncode == 2 and "--sleep-idle-seconds unloads idle models of --models-dir" in p.stderr, p.stderr


def test_the_api_key_comes_before_the_models(models_dir, tmp_path):
    with _serve(models_dir, tmp_path, "--api-key", "k") as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.post("/v1/chat/completions", json={"model": "llama9", "messages": CHAT}).status_code == 401
        assert c.get("/api/tags").status_code == 401
        assert c.get("/v1/models").status_code == 200            # public, as in llama-server
        ok = c.post("/v1/chat/completions", json={"model": "smollm2", "messages": CHAT, "max_tokens": 2},
                    headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200


def test_a_load_does_not_stall_another_models_stream(models_dir, tmp_path):
    """gemma3 loads (a worker thread: ~1 s here) while smollm2 streams: smollm2's tokens keep coming."""
    with _serve(models_dir, tmp_path, "--models-max", "2") as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        _chat(c, "smollm2", 2)
        stamps = []

        def stream():
            with c.stream("POST", "/completion", json={"model": "smollm2", "prompt": "Once upon a time",
                                                       "n_predict": 64, "temperature": 0, "stream": True,
                                                       "ignore_eos": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        stamps.append(time.monotonic())
        t = threading.Thread(target=stream)
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        _chat(c, "gemma3", 2)                    # loads it
        loaded_in = time.monotonic() - t0
        t.join()
    during = [b - a for a, b in zip(stamps, stamps[1:]) if t0 <= b <= t0 + loaded_in]
    assert during and max(during) < 0.5 * loaded_in, (max(during), loaded_in)


def test_many_requests_for_two_models_at_models_max_one(models_dir, tmp_path):
    """Requests for both models at once with room for one: each is answered (no model is unloaded under a
    request, none waits forever), the models taking turns."""
    with _serve(models_dir, tmp_path, "--models-max", "1") as srv, httpx.Client(base_url=srv.url, timeout=180) as c:
        results = []
        threads = [threading.Thread(target=lambda m=m: results.append(_chat(c, m, 4)["model"]))
                   for m in ["smollm2", "gemma3"] * 4]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == ["gemma3"] * 4 + ["smollm2"] * 4
        assert len(_loaded(c)) == 1
