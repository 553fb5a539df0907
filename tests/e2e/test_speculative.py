"""Speculative decoding on the server, as llama-server's (--spec-type, --spec-draft-*, --spec-ngram-*, -md; a
request's speculative.*; /slots, /metrics, timings): one server with ngram-simple and one with a draft model
(the model itself), whose answers are the plain server's; bad flags (a draft model of another vocabulary
among them) stop the start with the reason; a bad speculative.* field is a 400."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from fastserve.models.synthetic import write_llama_gguf

from .conftest import REPO_ROOT, ServerProc

PROMPT = "a b c d a b c d a b c d a b"


@pytest.fixture(scope="module")
def servers(tiny_model_path, tmp_path_factory):
    """(speculating, plain): the same model and slots, one with --spec-type ngram-simple."""
    d = tmp_path_factory.mktemp("spec")
    common = ("-c", "1024", "-np", "4", "-n", "48", "--timeout", "20")
    with ServerProc(tiny_model_path, d / "spec.log", *common, "--spec-type", "ngram-simple",
                    "--spec-ngram-simple-size-n", "1", "--spec-ngram-simple-size-m", "8") as spec, \
            ServerProc(tiny_model_path, d / "plain.log", *common) as plain:
        yield spec, plain


def test_a_draft_model_answers_as_the_plain_server(servers, tiny_model_path, tmp_path):
    """-md alone: --spec-type draft-simple; the model drafting for itself, greedy: every draft accepted (p_min 0:
    the random-weight model is rarely sure). The start line and /props name the draft model."""
    plain = servers[1]
    with ServerProc(tiny_model_path, tmp_path / "md.log", "-c", "1024", "-np", "4", "-n", "48", "--timeout", "20",
                    "-md", tiny_model_path, "--spec-draft-p-min", "0") as md:
        assert f"speculative decoding draft-simple with draft model {tiny_model_path} (n_max 16, n_min 0, p_min 0)" \
            in md.log()
        assert httpx.get(md.url + "/props").json()["speculative"] == {
            "type": "draft-simple", "draft_model": tiny_model_path, "n_max": 16, "n_min": 0, "p_min": 0.0}
        for body in ({}, {"temperature": 0.8, "seed": 4, "top_k": 10}, {"speculative.n_max": 3}):
            assert _complete(md, **body).json()["content"] == _complete(plain, **body).json()["content"]
        t = _complete(md).json()["timings"]
        assert t.get("draft_n", 0) == t.get("draft_n_accepted", 0)     # what it drafted, all accepted
        slots = httpx.get(md.url + "/slots").json()     # over the requests (on a busy machine the cost model may
        assert all(s["speculative"] is True for s in slots)                 # let one go without drafting)
        assert sum(s["draft_n"] for s in slots) > 0
        assert all(s["draft_acceptance"] == 1.0 for s in slots if s["draft_n"])
        assert _complete(md, **{"speculative.type": "ngram-mod"}).status_code == 400


def _complete(server, **body):
    r = httpx.post(server.url + "/completion", json={"prompt": PROMPT, "temperature": 0, **body}, timeout=60)
    return r


def test_answers_are_the_plain_servers_and_say_what_was_drafted(servers):
    spec, plain = servers
    for body in ({}, {"temperature": 0.8, "seed": 4, "top_k": 10}, {"speculative.n_max": 2, "speculative.p_min": 0.1},
                 {"grammar": 'root ::= ([a-d] " ")+ "."'}):
        a, b = _complete(spec, **body).json(), _complete(plain, **body).json()
        assert a["content"] == b["content"]
    t = _complete(spec).json()["timings"]
    assert t["draft_n"] >= t["draft_n_accepted"] >= 0 and t["draft_n"] > 0
    assert "draft_n" not in _complete(plain).json()["timings"]
    off = _complete(spec, **{"speculative.type": "none"}).json()
    assert "draft_n" not in off["timings"] and off["content"] == _complete(plain).json()["content"]
    chat = httpx.post(spec.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}],
                                                               "temperature": 0, "max_tokens": 24}).json()
    assert chat["timings"]["draft_n"] >= 0


def test_slots_and_metrics_show_speculation(servers):
    spec, plain = servers
    assert httpx.get(spec.url + "/props").json()["speculative"] == {
        "type": "ngram-simple", "draft_model": "", "n_max": 8, "n_min": 0, "p_min": 0.0}
    assert httpx.get(plain.url + "/props").json()["speculative"] == {"type": "none"}
    assert "speculative" not in plain.log()
    _complete(spec)
    slots = httpx.get(spec.url + "/slots").json()
    assert all(s["speculative"] is True for s in slots)
    assert sum(s["draft_n"] for s in slots) > 0 and all(0.0 <= s["draft_acceptance"] <= 1.0 for s in slots)
    assert all(s["speculative"] is False and "draft_n" not in s for s in httpx.get(plain.url + "/slots").json())
    text = httpx.get(spec.url + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values["llamacpp:n_drafted_total"] > 0
    assert 0 <= values["llamacpp:n_drafted_accepted_total"] <= values["llamacpp:n_drafted_total"]
    assert values["llamacpp:spec_decode_num_draft_tokens_total"] == values["llamacpp:n_drafted_total"]
    assert values['fastserve_draft_accepted_tokens_bucket{le="+Inf"}'] == values["llamacpp:spec_decode_num_drafts_total"] > 0
    assert httpx.get(plain.url + "/metrics").text.count("llamacpp:n_drafted_total 0") == 1


@pytest.mark.parametrize("body, why", [
    ({"speculative.n_max": 1, "speculative.n_min": 2}, "n_max (1) must be >= speculative.n_min (2)"),
    ({"speculative.p_min": -0.5}, "p_min must be a number in [0, 1]"),
    ({"speculative.p_min": "high"}, "speculative.p_min"),
    ({"speculative.n_max": -1}, "n_max must be an integer >= 0"),
    ({"speculative.type": "ngram-mod"}, "this server drafts with 'ngram-simple'"),
])
def test_a_bad_speculative_field_is_a_400(servers, body, why):
    r = _complete(servers[0], **body)
    assert r.status_code == 400 and why in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("flags, why", [
    (("--spec-type", "ngram-mod", "--spec-draft-n-max", "2", "--spec-draft-n-min", "3"),
     "--spec-draft-n-max (2) must be >= --spec-draft-n-min (3)"),
    (("--spec-type", "ngram-simple", "--spec-draft-p-min", "-0.1"), "--spec-draft-p-min must be a number in [0, 1]"),
    (("--spec-type", "draft-eagle3"), "--spec-type 'draft-eagle3': fastserve has none, ngram-simple, ngram-mod, "
                                      "draft-simple"),
    (("--spec-type", "ngram-mod", "--spec-ngram-mod-n-min", "9", "--spec-ngram-mod-n-max", "4"),
     "--spec-ngram-mod-n-max (4) must be >= --spec-ngram-mod-n-min (9)"),
    (("-md", "draft.gguf"), "draft.gguf: no such file"),
    (("--spec-type", "draft-simple"), "--spec-type draft-simple needs a draft model: --spec-draft-model FILE (-md)"),
    (("--spec-type", "ngram-mod", "--spec-draft-model", "d.gguf"), "--spec-draft-model d.gguf drafts with "
                                                                   "--spec-type draft-simple, not ngram-mod"),
    (("-md", "OTHER_VOCAB"), "the draft model's vocabulary is not the model's: 600 tokens, the model has 512"),
    (("-ctkd", "q8_0"), "the draft model's KV cache takes the model's types"),
])
def test_bad_flags_stop_the_start_with_the_reason(tiny_model_path, tmp_path, flags, why):
    if "OTHER_VOCAB" in flags:
        other = write_llama_gguf(tmp_path / "v600.gguf", n_vocab=600)
        flags = tuple(other if f == "OTHER_VOCAB" else f for f in flags)
    r = subprocess.run([sys.executable, "-m", "fastserve", "serve", "-m", tiny_model_path, "--port", "0", *flags],
                       capture_output=True, text=True, timeout=60, cwd=str(REPO_ROOT),
                       env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and why in r.stderr, r.stderr
