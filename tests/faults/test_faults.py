"""Issue 5's acceptance on a fault build, engine level: a refused state copy is not a slot
failure, a failed prompt fill leaves the batch and its prompt clean, a stalled step is seen.

Each test runs one scenario of scenarios.py in a child process with its fault settings.
"""
from .conftest import run_scenario


def test_a_refused_copy_is_not_a_slot_failure(fault_build):
    """2 refused copies; two concurrent completions pinned to slots 0 and 1 (each reused for a new prompt)."""
    r = run_scenario("refused_copy", fault_build, FASTSERVE_TEST_FAIL_CACHE_COPIES=2)
    a, b = r["pair"]
    assert a["finish"] == b["finish"] == "length" and a["tokens"] == b["tokens"]
    assert (a["slot"], b["slot"]) == (0, 1)
    assert r["healthy"]
    assert r["stats_after_pair"]["refused"] == 2 and r["stats_after_pair"]["entries"] == 0
    refused = [ln for ln in r["log"] if "copy refused" in ln]
    assert len(refused) == 2 and all("could not be allocated" in ln for ln in refused)
    assert r["back"]["cache_n"] == 0                        # a refused copy: the restore is cold
    assert r["again"]["cache_n"] == 39 and r["again"]["tokens"] == a["tokens"]   # later copies work
    assert r["stats"]["saved"] >= 1 and r["stats"]["restored"] == 1


def test_a_failed_fill_leaves_the_batch_and_its_prompt_clean(fault_build):
    """1 failed fill; the same two-slot setup: exactly one errors, the other completes, and a retry
    on the faulted slot recomputes (cache_n 0) and gives the good slot's content."""
    r = run_scenario("failed_fill", fault_build, FASTSERVE_TEST_FAIL_PROMPT_FILLS=1)
    errors = [c for c in r["pair"] if c["finish"] == "error"]
    good = [c for c in r["pair"] if c["finish"] == "length"]
    assert len(errors) == 1 and len(good) == 1
    assert "prompt processing failed" in errors[0]["error"] and "after adding its tokens" in errors[0]["error"]
    assert r["retry"]["finish"] == "length" and r["retry"]["slot"] == errors[0]["slot"]
    assert r["retry"]["cache_n"] == 0
    assert r["retry"]["tokens"] == good[0]["tokens"]
    assert r["kept"] == {str(errors[0]["slot"]): 0}           # no phantom prompt tokens on the slot
    assert r["healthy"]
    assert any("prompt fill of slot" in ln and "failed" in ln for ln in r["log"])


def test_a_stalled_step_holds_the_heartbeat_once(fault_build):
    r = run_scenario("stall", fault_build, FASTSERVE_TEST_STALL_STEP_S=1.0)
    assert r["first"]["finish"] == "length" and r["second"]["finish"] == "length"
    assert 0.8 <= r["frozen_s"] < 5
    assert r["second_s"] < 0.8                                 # only the next step stalls
