"""Which free slot a request takes (scheduler.pick_slot), on the slot table alone (both twins): the longest
shared prefix that the slot can still reuse (a sliding window's ring, asked through `reusable`)."""
import numpy as np
import pytest

from fastserve import _slots
from fastserve.ref import slots as ref_slots
from fastserve.scheduler import pick_slot

PROMPT = np.arange(10, 40, dtype=np.int32)          # 30 tokens


@pytest.fixture(params=[_slots, ref_slots], ids=["cython", "twin"])
def table(request):
    """4 idle slots sharing 20, 10, 0 and 30 (all) tokens with PROMPT; slot 2 admitted least recently."""
    t = request.param.SlotTable(4, 64, np.zeros(64, np.uint8))
    for slot, (n, seq) in enumerate(((20, 3), (10, 4), (0, 1), (30, 2))):
        cached = np.concatenate([PROMPT[:n], np.full(5, 60, np.int32)])
        t.start(slot, cached, 0, 1, seq)
        t.n_past[slot] = t.n_tokens[slot]            # as if computed
        t.release(slot)
    return t


def _pick(t, reusable=None, similarity=0.1, prompt=PROMPT):
    return pick_slot(t, prompt, id_slot=-1, cache_prompt=True, similarity=similarity, reusable=reusable)


def test_without_a_window_the_longest_shared_prefix(table):
    assert _pick(table) == 3
    assert _pick(table, reusable=lambda s, n: True) == 3


def test_a_prefix_the_slot_cannot_reuse_counts_nothing(table):
    asked = []

    def reusable(slot, n):
        asked.append((slot, n))
        return slot != 3
    assert _pick(table, reusable) == 0
    assert (3, 29) in asked              # judged at what admission reuses: the last prompt token is computed
    assert _pick(table, lambda s, n: s == 1) == 1


def test_nothing_reusable_or_too_little_takes_the_least_recent_slot(table):
    assert _pick(table, lambda s, n: False) == 2
    assert _pick(table, lambda s, n: s == 1, similarity=0.5) == 2     # 10 of 30 reusable: below half
