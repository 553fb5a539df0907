"""`fastserve bench`'s parts without a server: figures from known arrivals, prompts, --help, and an
in-process run on the tiny model whose JSON round-trips and whose plots are PNGs of the stated size."""
from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys

import pytest

from fastserve.bench.client import Record, Target, _event_tokens, request_body
from fastserve.bench.figures import level_figures, ratio_spread
from fastserve.bench.load import Level, LevelRun
from fastserve.bench.prompts import Prompt, builtin, load_jsonl, parse_lengths


def _run_of(records, t0=10.0, t1=20.0):
    return LevelRun(Target("x", "http://h"), Level("clients", 2), t0, t1, records)


def test_window_accounting_and_percentiles():
    # a request wholly inside the window: sent at 11, tokens at 11.5, 11.6, 11.7 (2 at once), done at 11.8
    a = Record(11.0, 11.8, 200, None, [(11.5, 1), (11.6, 1), (11.7, 2)], True)
    # a warm-up request: its tokens before t0 do not count, the one after does (and its gap)
    b = Record(9.0, 10.2, 200, None, [(9.5, 1), (10.1, 1)], True)
    # an error in the window, and a request cancelled at the window's end
    c = Record(12.0, 12.1, 503, "http 503", [], True)
    d = Record(19.0, 20.0, 200, None, [(19.4, 1), (20.5, 1)], False)
    f = level_figures(_run_of([a, b, c, d]))
    assert f["tokens"] == 4 + 1 + 1 and f["tok_s"] == pytest.approx(0.6)
    assert f["requests_finished"] == 2 and f["errors"] == {"http 503": 1}
    assert f["ttft_ms"]["n"] == 2 and f["ttft_ms"]["max"] == pytest.approx(500.0)     # a and d; b's first was before
    # gaps ending in the window, one per arrival: a's 100 and 100 (2 tokens in one piece), b's 600; not d's past t1
    assert f["itl_ms"]["n"] == 3 and f["itl_ms"]["max"] == pytest.approx(600.0)
    assert f["itl_ms"]["p50"] == pytest.approx(100.0)
    assert f["tpot_ms"]["n"] == 2            # a (0.2 s over 3 gaps) and b
    assert f["tpot_ms"]["p50"] == pytest.approx((200 / 3 + 600) / 2)
    assert f["e2e_ms"]["max"] == pytest.approx(1200.0)
    empty = level_figures(_run_of([]))
    assert empty["itl_ms"]["p99"] is None and empty["tok_s"] == 0


def test_ab_ratio_and_spread():
    a = [{"tok_s": 100.0}, {"tok_s": 120.0}]
    b = [{"tok_s": 50.0}, {"tok_s": 80.0}]
    q = ratio_spread(a, b, ("tok_s",))
    assert q["ratio"] == pytest.approx(110 / 65) and q["min"] == pytest.approx(1.5) and q["max"] == 2.0


def test_event_token_counts_per_api():
    assert _event_tokens("llamacpp", {"content": "a", "tokens_predicted": 3}, 1) == (2, None)
    assert _event_tokens("llamacpp", {"stop": True, "tokens_predicted": 9}, 9) == (0, 9)
    assert _event_tokens("openai", {"choices": [{"text": "hi"}]}, 0) == (1, None)
    assert _event_tokens("chat", {"choices": [{"delta": {"content": ""}}]}, 0) == (0, None)
    assert _event_tokens("chat", {"choices": [], "usage": {"completion_tokens": 7}}, 0) == (0, 7)
    p = Prompt("hello", "chat")
    assert request_body("chat", p, _params())["messages"] == [{"role": "user", "content": "hello"}]
    assert request_body("llamacpp", p, _params(ignore_eos=True))["ignore_eos"] is True


def _params(**kw):
    from fastserve.bench.client import Params
    return Params(**kw)


def test_builtin_prompts_meet_their_lengths(tmp_path):
    count = lambda s: len(s.split())      # noqa: E731 - a word is a token here
    ps = builtin(count, 30, parse_lengths("40-60"))
    assert {p.kind for p in ps} == {"english", "code", "chat"}
    assert all(38 <= p.n_tokens <= 62 for p in ps), [p.n_tokens for p in ps]
    assert len({p.text for p in ps}) == 30
    assert parse_lengths("64") == (64, 64)
    with pytest.raises(ValueError, match="LO-HI"):
        parse_lengths("a-b")
    f = tmp_path / "p.jsonl"
    f.write_text('"plain"\n{"prompt": "p"}\n\n{"messages": [{"role": "user", "content": "m"}]}\n')
    assert [p.text for p in load_jsonl(f)] == ["plain", "p", "m"]
    f.write_text('{"prompt": 3}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: expected"):
        load_jsonl(f)


def test_help_documents_every_flag():
    from fastserve.cli import main
    parser = {}
    orig = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        parser["p"] = self
        raise SystemExit(0)
    argparse.ArgumentParser.parse_args = capture
    try:
        with pytest.raises(SystemExit):
            main(["bench"])
    finally:
        argparse.ArgumentParser.parse_args = orig
    bench = parser["p"]._subparsers._group_actions[0].choices["bench"]
    text = subprocess.run([sys.executable, "-m", "fastserve", "bench", "--help"], capture_output=True,
                          text=True, timeout=60).stdout
    flags = [a for a in bench._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 30
    for a in flags:
        assert a.help and a.help != argparse.SUPPRESS, a.option_strings
        assert all(s in text for s in a.option_strings), a.option_strings


def test_inprocess_run_json_round_trips_and_plots_are_pngs(tiny_model_path, tmp_path):
    from fastserve.bench.plots import SIZE
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "fastserve", "bench", "-m", tiny_model_path, "--clients", "1,3",
                        "--duration", "0.6", "--warmup", "0.2", "-n", "16", "--prompt-tokens", "8-16",
                        "--json", str(out / "r.json"), "--plot", str(out), "--no-progress"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "phase table, in-process, 3 clients" in p.stdout and "tok/s" in p.stdout
    text = (out / "r.json").read_text()
    r = json.loads(text)
    assert json.dumps(r, indent=1, allow_nan=False) == text
    assert r["command"].startswith("fastserve bench -m ") and r["command"].endswith("--no-progress")
    assert r["machine"]["cpus"] >= 1 and r["versions"]["httpx"]
    assert [lv["value"] for lv in r["levels"]] == [1, 3]
    assert all(run["figures"]["tok_s"] > 0 and run["figures"]["phases"]["steps"] > 0 for run in r["runs"])
    assert r["runs"][1]["figures"]["rss_mib"]["peak"] > 10
    for name in ("itl_over_time.png", "concurrency.png", "phases.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
        assert struct.unpack(">II", data[16:24]) == SIZE, name
        assert len(data) > 10_000     # drawn, not blank


def test_bad_flags_are_clear_errors(capsys):
    from fastserve.cli import main
    assert main(["bench", "--clients", "0", "--url", "http://x"]) == 2
    assert "--clients '0'" in capsys.readouterr().err
    assert main(["bench", "--url", "localhost:8080"]) == 2
    assert "http://" in capsys.readouterr().err
    assert main(["bench", "--url", "http://x", "--prompt-tokens", "9-3"]) == 2
    assert "LO <= HI" in capsys.readouterr().err


def test_open_loop_poisson_arrivals_in_process(tiny_model):
    """--rate R: arrivals at about R/s whatever the server does, on an in-process Engine."""
    import asyncio

    import fastserve
    from fastserve.bench.client import Params
    from fastserve.bench.load import poisson_offsets, run_level
    prompts = [Prompt("the cat sat on the mat", "english")] * 4
    with fastserve.Engine(tiny_model, n_parallel=4, n_ctx=1024, trace=True) as engine:
        run = asyncio.run(run_level(Target("in-process", None, "inprocess"), Level("rate", 40.0), prompts,
                                    Params(n_predict=8), 0.2, 1.5, engine=engine, seed=3))
    f = level_figures(run)
    assert f["requests_finished"] >= f["requests_sent"] * 0.8 and f["tok_s"] > 0 and f["phases"]["steps"] > 0
    # Each request leaves at its scheduled time, never before it: the schedule's arrivals all went out
    # (the level's end may cancel the last 0.25 s), in order, the median at most 0.2 s late on a busy
    # 2-core loop. (The gaps' shape is the schedule's test below: CI's loop once lagged 6 ms, enough to
    # push real gaps' median over the mean.)
    schedule = poisson_offsets(40.0, 1.7, 3)
    late = [r.t_sent - (run.t0 - 0.2 + at) for r, at in zip(run.records, schedule)]
    assert sum(at < 1.45 for at in schedule) <= len(run.records) <= len(schedule), len(run.records)
    assert min(late) > -0.002 and sorted(late)[len(late) // 2] < 0.2, late


def test_poisson_schedule_is_exponential():
    """Arrivals at about `rate`/s with exponential gaps: the median gap below the mean (ln 2 of it), a long
    tail; the seed fixes the schedule; another seed gives another."""
    import numpy as np

    from fastserve.bench.load import poisson_offsets
    at = poisson_offsets(40.0, 100.0, 3)
    gaps = np.diff([0.0] + at)
    assert 40 * 100 * 0.9 <= len(at) <= 40 * 100 * 1.1 and all(0 < t < 100 for t in at)
    assert abs(np.median(gaps) * 40 - np.log(2)) < 0.05 and gaps.max() > 5 / 40
    assert poisson_offsets(40.0, 100.0, 3) == at != poisson_offsets(40.0, 100.0, 4)


def test_a_local_servers_pid_is_found_by_its_port():
    import os
    import socket

    from fastserve.bench.load import pid_listening_on
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert pid_listening_on(s.getsockname()[1]) == os.getpid()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))          # bound, not listening: not a server
        assert pid_listening_on(s.getsockname()[1]) is None
