"""fastserve.cluster's parts that need no Ray cluster: the merged exposition, the replicas' flags, the routing
text, and the start's refusals (--replicas 0, --port 0, a Ray address nobody answers)."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fastserve.cluster.exposition import merge
from fastserve.cluster.launch import replica_flags, replica_resources

ONE = """# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total {n}
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="m",engine="0"}} {n}
# HELP fastserve_queue_time_seconds Time from submit to getting a slot.
# TYPE fastserve_queue_time_seconds histogram
fastserve_queue_time_seconds_bucket{{le="0.5"}} {n}
fastserve_queue_time_seconds_bucket{{le="+Inf"}} {n}
fastserve_queue_time_seconds_sum 0.25
fastserve_queue_time_seconds_count {n}
"""


def test_merge_labels_each_replica_once_per_family():
    text = merge({"b": ONE.format(n=2), "a": ONE.format(n=1)})
    fams = {f.name: f for f in text_string_to_metric_families(text)}     # the official parser takes it
    cached = {s.labels["replica"]: s.value for s in fams["llamacpp:prompt_tokens_cached"].samples}
    assert cached == {"a": 1, "b": 2}
    (run_a, run_b) = fams["vllm:num_requests_running"].samples
    assert run_a.labels == {"replica": "a", "model_name": "m", "engine": "0"} and run_b.value == 2
    assert fams["fastserve_queue_time_seconds"].type == "histogram"
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1
    assert merge({}) == ""


def test_replica_flags_leave_out_the_clusters_own():
    argv = ["serve", "-m", "x.gguf", "--replicas", "2", "--ray-address=h:1", "--host", "0.0.0.0", "--port", "80",
            "-np", "4", "--metrics"]
    assert replica_flags(argv) == ["-m", "x.gguf", "-np", "4", "--metrics"]


def test_replicas_share_the_cores_out_and_a_gpu_replica_takes_a_gpu():
    assert replica_resources(0, "cpu", 2, 16) == (8, 8, 0)        # -t 0: the node's cores shared out
    assert replica_resources(0, "cpu", 4, 2) == (1, 1, 0)         # at least one each
    assert replica_resources(3, "cpu", 2, 16) == (3, 3, 0)        # -t as given, and as many CPUs reserved
    assert replica_resources(0, "cuda", 2, 16) == (1, 1, 1)


def test_routing_text_is_the_prompt_or_the_messages():
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'fastserve[ray]')")
    from fastserve.cluster.ingress import routing_text
    chat = b'{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}'
    assert routing_text("POST", "/v1/chat/completions", chat) == "be briefhi"
    assert routing_text("POST", "/completion", b'{"prompt": "The sky"}') == "The sky"
    assert routing_text("POST", "/v1/messages", b'{"system": "s", "messages": [{"role": "user", "content": "u"}]}') == "su"
    # no text to match (token ids, no body, not JSON): still some text, as the router divides by its length
    assert routing_text("POST", "/completion", b'{"prompt": [1, 2, 3]}') == "POST /completion"
    assert routing_text("GET", "/v1/models", b"") == "GET /v1/models"
    assert routing_text("POST", "/completion", b"{not json") == "POST /completion"


def _serve(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastserve", "serve", *flags], capture_output=True, text=True,
                          timeout=60)


def test_bad_replica_count_stops_the_start():
    for n in ("0", "-1"):
        r = _serve("--replicas", n)
        assert r.returncode == 1 and "a cluster needs at least 1 replica" in r.stderr, r.stderr


def test_without_ray_the_start_says_what_to_install():
    blocked = ("import sys; sys.modules['ray'] = None; from fastserve.cli import main; "
               "sys.exit(main(['serve', '--replicas', '2', '--port', '8999']))")
    r = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "--replicas needs Ray Serve: pip install 'fastserve[ray]'" in r.stderr, r.stderr


def test_port_0_stops_the_start():
    r = _serve("--replicas", "2", "--port", "0")
    assert r.returncode == 1 and "--replicas needs a --port" in r.stderr, r.stderr


def test_unreachable_ray_address_stops_the_start():
    with socket.socket() as s:          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _serve("--replicas", "2", "--ray-address", f"127.0.0.1:{port}")
    assert r.returncode == 1 and f"--ray-address 127.0.0.1:{port}: no Ray cluster answers there" in r.stderr
    r = _serve("--replicas", "2", "--ray-address", "nonsense")
    assert r.returncode == 1 and "expected host:port" in r.stderr
    r = _serve("--ray-address", f"127.0.0.1:{port}")
    assert r.returncode == 1 and "--ray-address goes with --replicas N" in r.stderr
