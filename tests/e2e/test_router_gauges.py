"""vLLM's three scheduler gauges on /metrics (vllm:num_requests_waiting, vllm:num_requests_running,
vllm:kv_cache_usage_perc), read under a real load on the default model: the values that routers outside
fastserve (llm-d, vLLM's router, SGLang's gateway) balance a pool of servers by."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ServerProc, wait_until

N_SLOTS, N_CTX = 2, 1024            # two slots of 512 tokens
GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def scrape(c: httpx.Client) -> dict:
    """{name: (value, labels, type)} of the three gauges and fastserve's own KV ratio."""
    out = {}
    for fam in text_string_to_metric_families(c.get("/metrics").text):
        if fam.name in GAUGES or fam.name == "fastserve_kv_usage_ratio":
            (s,) = fam.samples
            out[fam.name] = (s.value, s.labels, fam.type)
    return out


def stream(url: str, prompt: str, n_predict: int, got: list) -> None:
    """One streamed /completion; appends (tokens received, time) per event to got."""
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/completion", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and not json.loads(line[6:]).get("stop"):
                got.append(time.monotonic())


@pytest.mark.model
def test_vllm_gauges_under_load(default_model_file, tmp_path):
    srv = ServerProc(default_model_file, tmp_path / "server.log", "-c", str(N_CTX), "-np", str(N_SLOTS))
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            model_id = c.get("/v1/models").json()["data"][0]["id"]
            idle = scrape(c)
            for name in GAUGES:
                value, labels, kind = idle[name]
                assert kind == "gauge" and labels == {"model_name": model_id, "engine": "0"}, name
                assert value == 0, name

            # one stream alone: the KV in use grows with its context, and is its prompt + what it generated
            n_prompt = len(c.post("/tokenize", json={"content": "Tell me a long story about a cat."}).json()["tokens"])
            got: list = []
            t = threading.Thread(target=stream, args=(srv.url, "Tell me a long story about a cat.", 96, got))
            t.start()
            kv = []
            while t.is_alive():
                m = scrape(c)
                if got and m["vllm:num_requests_running"][0] == 1:
                    kv.append(m["vllm:kv_cache_usage_perc"][0] * N_CTX)      # tokens of KV written
                time.sleep(0.1)
            t.join()
            assert len(kv) >= 5, kv
            assert kv == sorted(kv) and kv[-1] > kv[0], kv
            assert all(n_prompt <= k <= n_prompt + 1 + 96 for k in kv), (n_prompt, kv)
            assert wait_until(lambda: scrape(c)["vllm:num_requests_running"][0] == 0, 5)
            done = scrape(c)
            # the finished request's prefix stays cached in its slot: free for vLLM's gauge, held for ours
            assert done["vllm:kv_cache_usage_perc"][0] == 0 and done["fastserve_kv_usage_ratio"][0] > 0

            # six streams on two slots: four wait, two run
            streams = [threading.Thread(target=stream, args=(srv.url, f"Story number {i}: once upon a time", 48, []))
                       for i in range(6)]
            for s in streams:
                s.start()
            seen = []
            while any(s.is_alive() for s in streams):
                m = scrape(c)
                seen.append((m["vllm:num_requests_waiting"][0], m["vllm:num_requests_running"][0],
                             m["vllm:kv_cache_usage_perc"][0]))
                time.sleep(0.05)
            for s in streams:
                s.join()
            waiting, running, usage = zip(*seen)
            assert max(waiting) >= 3 and max(running) == N_SLOTS, seen
            assert all(0 <= r <= N_SLOTS for r in running) and all(0 <= u <= 1 for u in usage), seen
            assert max(usage) > 0
            # the last step's snapshot may come a moment after the last bytes
            assert wait_until(lambda: [scrape(c)[n][0] for n in GAUGES] == [0, 0, 0], 5), scrape(c)
    finally:
        srv.kill()
