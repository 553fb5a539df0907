"""Engine-level fault scenarios, each run in a child process (the fault settings are read once,
when fastserve._faults loads, so every setting needs a fresh process).

    FASTSERVE_FAULTS_LIB=build/faults FASTSERVE_TEST_FAIL_PROMPT_FILLS=1 \\
        python -m tests.faults.launch -m tests.faults.scenarios failed_fill

A scenario prints one line `RESULT <json>`; the tests in this folder judge it. Prompts are
token ids (no BOS), greedy, on the tiny random model.
"""
from __future__ import annotations

import json
import logging
import sys
import tempfile
import time

import numpy as np

import fastserve
from fastserve import _faults
from fastserve.models.synthetic import write_llama_gguf

_rng = np.random.default_rng(55)
X, Y = (_rng.integers(3, 512, 40).astype(np.int32).tolist() for _ in range(2))
GREEDY = dict(temperature=0)


class _Log(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def _setup():
    log = _Log()
    logging.getLogger("fastserve").addHandler(log)
    logging.getLogger("fastserve").setLevel(logging.INFO)
    model = fastserve.load_model(write_llama_gguf(tempfile.mkdtemp() + "/tiny.gguf"))
    return model, log


def _pinned_pair(e, prompt, max_tokens=8):
    """Two concurrent completions of prompt, pinned to slots 0 and 1."""
    readers = [e.submit(prompt, max_tokens=max_tokens, id_slot=s, **GREEDY) for s in (0, 1)]
    return [r.result(timeout=60) for r in readers]


def _healthy(e) -> bool:
    """What /health checks of an engine: its decode thread runs, nothing is stuck, it still serves."""
    return (e._thread.is_alive() and e.snapshot.n_running == 0
            and e.generate([5, 6, 7], max_tokens=2, **GREEDY).finish_reason == "length")


def _view(c):
    return {"finish": c.finish_reason, "error": c.error, "tokens": c.token_ids, "slot": c.id_slot,
            "cache_n": c.timings.get("cache_n")}


def refused_copy() -> dict:
    model, log = _setup()
    with fastserve.Engine(model, n_parallel=2, n_ctx=256, cache_ram_mib=1) as e:
        for s in (0, 1):                                        # both slots hold X
            e.generate(X, max_tokens=4, id_slot=s, **GREEDY)
        pair = _pinned_pair(e, Y)                               # each saves X first: both copies refused
        after_pair = e.stats().prompt_cache
        healthy = _healthy(e)
        back = e.generate(X, max_tokens=4, id_slot=0, **GREEDY)   # X's copy was refused: cold
        again = e.generate(Y, max_tokens=8, id_slot=0, **GREEDY)  # Y was saved by `back`: restored
        return {"pair": [_view(c) for c in pair], "stats_after_pair": after_pair, "healthy": healthy,
                "back": _view(back), "again": _view(again), "stats": e.stats().prompt_cache, "log": log.lines}


def failed_fill() -> dict:
    model, log = _setup()
    with fastserve.Engine(model, n_parallel=2, n_ctx=256) as e:
        pair = _pinned_pair(e, X)
        bad = [c.id_slot for c in pair if c.finish_reason == "error"]
        kept = {s: int(e._slots.n_tokens[s]) for s in bad}     # the faulted slot's reusable prefix
        retry = e.generate(X, max_tokens=8, id_slot=bad[0], **GREEDY) if bad else None
        healthy = _healthy(e)
        return {"pair": [_view(c) for c in pair], "kept": kept, "healthy": healthy,
                "retry": retry and _view(retry), "log": log.lines}


def stall() -> dict:
    model, log = _setup()
    with fastserve.Engine(model, n_parallel=1, n_ctx=128) as e:
        t0 = time.monotonic()
        stream = e.submit(X, max_tokens=4, **GREEDY)
        frozen, last, since = 0.0, e.snapshot.step, time.monotonic()
        while not stream.reader.finished and time.monotonic() - t0 < 30:
            time.sleep(0.02)
            snap = e.snapshot
            if snap.step != last:
                last, since = snap.step, time.monotonic()
            else:                           # a request is pending and the heartbeat stands still
                frozen = max(frozen, time.monotonic() - since)
        res = stream.result(timeout=30)
        quick = time.monotonic()
        second = e.generate(Y, max_tokens=4, **GREEDY)          # the stall was for one step only
        return {"first": _view(res), "frozen_s": frozen, "second": _view(second),
                "second_s": time.monotonic() - quick, "log": log.lines}


def everything() -> dict:
    """Every fault path at once, for a build without the checks (the settings must do nothing)."""
    model, log = _setup()
    t0 = time.monotonic()
    with fastserve.Engine(model, n_parallel=2, n_ctx=256, cache_ram_mib=1) as e:
        for s in (0, 1):
            e.generate(X, max_tokens=4, id_slot=s, **GREEDY)
        pair = _pinned_pair(e, Y)
        return {"enabled": _faults.ENABLED, "settings": _faults.settings(), "pair": [_view(c) for c in pair],
                "stats": e.stats().prompt_cache, "seconds": time.monotonic() - t0, "log": log.lines}


if __name__ == "__main__":
    out = {"scenario": sys.argv[1], "faults_module": _faults.__file__, **globals()[sys.argv[1]]()}
    print("RESULT " + json.dumps(out), flush=True)
