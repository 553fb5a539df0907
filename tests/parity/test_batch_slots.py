"""_batch and _slots against their pure-Python twins: same behaviour, step by step."""
import numpy as np
import pytest

import fastserve._batch as c_batch
import fastserve._slots as c_slots
import fastserve.ref.batch as r_batch
import fastserve.ref.slots as r_slots

IMPLS = [pytest.param((c_batch, c_slots), id="cython"), pytest.param((r_batch, r_slots), id="python")]


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param


def _contents(batch):
    return tuple(a.tolist() for a in batch.view()) + (batch.owner,)


def test_push_view_and_capacity(impl):
    B, _ = impl
    b = B.Batch(4)
    b.add(5, 0, 1)
    b.add(6, 1, 1, True)
    b.add(9, 7, 2, True)
    assert _contents(b) == ([5, 6, 9], [0, 1, 7], [1, 1, 2], [1, 2], [1, 2], 2)
    assert b.free == 1
    b.add(1, 0, 3)
    with pytest.raises(OverflowError):
        b.add(2, 1, 3)
    b.clear()
    assert _contents(b) == ([], [], [], [], [], -1)


def test_rollback_restores_exactly_the_mark(impl):
    B, _ = impl
    b = B.Batch(16)
    b.add(1, 4, 0, True)
    before = _contents(b)
    m = b.mark()
    for i in range(5):
        b.add(10 + i, i, 3, i == 4)
    assert b.owner == 3
    b.rollback(m)
    assert _contents(b) == before
    with pytest.raises(ValueError):
        b.rollback((9, 0, -1))


def _table(S, n_slots=3, n_ctx=16, eog=(2,)):
    mask = np.zeros(32, np.uint8)
    mask[list(eog)] = 1
    return S.SlotTable(n_slots, n_ctx, mask)


def test_prefill_then_decode_bookkeeping(impl):
    B, S = impl
    t, b = _table(S), B.Batch(8)
    t.start(1, np.array([5, 6, 7, 8, 9], np.int32), 0, 3, 1)
    assert t.prefill_order() == [1]
    assert t.add_prefill(b, 1, 3) == 3                 # chunk: 3 of 5 prompt tokens, no output row
    assert _contents(b) == ([5, 6, 7], [0, 1, 2], [1, 1, 1], [], [], 1)
    finish = np.zeros(8, np.int8)
    t.commit(b, np.zeros(8, np.int32), finish)
    assert t.n_past[1] == 3 and t.state[1] == S.PREFILL
    b.clear()
    assert t.add_prefill(b, 1, 8) == 2                  # the rest; the last prompt token is an output row
    assert _contents(b) == ([8, 9], [3, 4], [1, 1], [1], [1], 1)
    t.commit(b, np.array([11], np.int32), finish)
    assert (t.n_past[1], t.n_tokens[1], t.n_gen[1], t.state[1], finish[0]) == (5, 6, 1, S.DECODE, S.FINISH_NONE)
    b.clear()
    assert t.add_decode(b) == 1
    assert _contents(b) == ([11], [5], [1], [0], [1], 1)
    t.commit(b, np.array([12], np.int32), finish)
    b.clear()
    t.add_decode(b)
    t.commit(b, np.array([13], np.int32), finish)
    assert finish[0] == S.FINISH_LENGTH                 # max_gen = 3
    assert t.tokens[1, :8].tolist() == [5, 6, 7, 8, 9, 11, 12, 13]
    t.release(1)
    assert t.state[1] == S.IDLE and t.n_tokens[1] == t.n_past[1] == 7


def test_eog_and_context_full(impl):
    B, S = impl
    t, b = _table(S, n_ctx=6), B.Batch(8)
    finish = np.zeros(8, np.int8)
    t.start(0, np.array([1, 1, 1], np.int32), 0, 100, 1)
    t.start(2, np.array([1, 1, 1, 1, 1], np.int32), 0, 100, 2)
    t.add_prefill(b, 0, 8)
    t.add_prefill(b, 2, 8)
    t.commit(b, np.array([2, 7], np.int32), finish)
    assert finish[:2].tolist() == [S.FINISH_STOP, S.FINISH_LENGTH]    # slot 2 is full at 6 tokens


def test_failed_fill_leaves_batch_and_slot_clean(impl):
    """The engine's fill protocol: mark, add, fail, rollback → the decode tokens of others survive intact."""
    B, S = impl
    t, b = _table(S), B.Batch(16)
    finish = np.zeros(16, np.int8)
    t.start(0, np.array([3, 4], np.int32), 0, 50, 1)
    t.add_prefill(b, 0, 16)
    t.commit(b, np.array([20], np.int32), finish)      # slot 0 now decodes
    t.start(1, np.array([5, 6, 7, 8], np.int32), 0, 50, 2)
    b.clear()
    t.add_decode(b)
    before = _contents(b)
    mark = b.mark()
    t.add_prefill(b, 1, 16)
    assert b.n == 5
    b.rollback(mark)                                     # the fill failed here
    t.release(1)
    assert _contents(b) == before
    assert t.n_past[1] == 0 and t.n_tokens[1] == 0       # no unwritten prompt token is kept as cached
    t.commit(b, np.array([21], np.int32), finish)
    assert t.tokens[0, :4].tolist() == [3, 4, 20, 21] and t.n_past[0] == 3


def test_drafts_are_verified_and_the_rejected_rows_left_behind(impl):
    """A DECODE slot with a draft adds 1 + k output rows; commit keeps the samples up to the first that
    differs from the next row's draft, marks the rest REJECTED, and n_past ends at n_tokens - 1."""
    B, S = impl
    t, b = _table(S, n_ctx=32), B.Batch(16)
    finish = np.zeros(16, np.int8)
    t.start(0, np.array([4, 5], np.int32), 0, 50, 1)
    t.start(1, np.array([6, 7], np.int32), 0, 50, 2)
    t.add_prefill(b, 0, 8)
    t.add_prefill(b, 1, 8)
    t.commit(b, np.array([10, 20], np.int32), finish)
    b.clear()
    drafts = np.array([[11, 12, 13, 0], [21, 22, 0, 0]], np.int32)
    n_draft = np.array([3, 2], np.int32)
    assert t.add_decode(b, drafts, n_draft) == 2
    assert _contents(b) == ([10, 11, 12, 13, 20, 21, 22], [2, 3, 4, 5, 2, 3, 4], [0, 0, 0, 0, 1, 1, 1],
                            list(range(7)), [0, 0, 0, 0, 1, 1, 1], 1)
    assert b.row_draft[:7].tolist() == [11, 12, 13, -1, 21, 22, -1] and b.n_drafted == 5
    sampled = np.array([11, 19, 25, 26, 21, 22, 23], np.int32)   # slot 0: 11 taken, 12 rejected (19 instead)
    t.commit(b, sampled, finish)
    assert sampled.tolist() == [11, 19, S.REJECTED, S.REJECTED, 21, 22, 23]
    assert t.tokens[0, :t.n_tokens[0]].tolist() == [4, 5, 10, 11, 19] and t.n_past[0] == 4
    assert t.tokens[1, :t.n_tokens[1]].tolist() == [6, 7, 20, 21, 22, 23] and t.n_past[1] == 5
    assert (t.n_drafted.tolist(), t.n_accepted.tolist()) == ([3, 2, 0], [1, 2, 0])
    assert finish[:7].tolist() == [0] * 7
    b.clear()                                       # a draft that ends the request (the eog id 2) cuts there
    t.add_decode(b, np.array([[2, 30, 0, 0], [0, 0, 0, 0]], np.int32), np.array([2, 0], np.int32))
    sampled = np.array([2, 30, 31, 24], np.int32)
    t.commit(b, sampled, finish)
    assert sampled.tolist() == [2, S.REJECTED, S.REJECTED, 24] and finish[:4].tolist() == [S.FINISH_STOP, 0, 0, 0]
    assert t.tokens[0, t.n_tokens[0] - 1] == 2 and t.n_past[0] == t.n_tokens[0] - 1
    b = B.Batch(4)                                  # a draft that does not fit the batch whole is dropped
    n_draft = np.array([0, 5], np.int32)
    t.add_decode(b, np.arange(10, dtype=np.int32).reshape(2, 5), n_draft)
    assert n_draft[1] == 0 and b.n == 2 and b.n_drafted == 0


def test_random_sequences_match_twin():
    rng = np.random.default_rng(5)
    mask = np.zeros(50, np.uint8)
    mask[3] = 1
    tc, tr = c_slots.SlotTable(4, 24, mask), r_slots.SlotTable(4, 24, mask)
    bc, br = c_batch.Batch(12), r_batch.Batch(12)
    fc, fr = np.zeros(12, np.int8), np.zeros(12, np.int8)
    seq = 0
    for step in range(300):
        for s in range(4):
            if tc.state[s] == c_slots.IDLE and rng.random() < 0.5:
                prompt = rng.integers(0, 50, rng.integers(1, 12)).astype(np.int32)
                seq += 1
                max_gen = int(rng.integers(1, 10))
                for t in (tc, tr):
                    t.start(s, prompt, 0, max_gen, seq)
        drafts = rng.integers(0, 50, (4, 5)).astype(np.int32)          # speculative rows, half the time
        n_draft = np.where(rng.random(4) < 0.5, rng.integers(0, 6, 4), 0).astype(np.int32)
        n_draft_r = n_draft.copy()
        bc.clear()
        br.clear()
        assert tc.add_decode(bc, drafts, n_draft) == tr.add_decode(br, drafts, n_draft_r)
        assert (n_draft == n_draft_r).all()
        order = tc.prefill_order()
        assert order == tr.prefill_order()
        for s in order:
            k = int(rng.integers(1, 6))
            assert tc.add_prefill(bc, s, k) == tr.add_prefill(br, s, k)
        assert _contents(bc) == _contents(br)
        sampled = rng.integers(0, 50, 12).astype(np.int32)
        agree = rng.random(12) < 0.7                    # a draft row's sample often equals the next draft
        sampled[:bc.n_out] = np.where(agree[:bc.n_out] & (bc.row_draft[:bc.n_out] >= 0),
                                      bc.row_draft[:bc.n_out], sampled[:bc.n_out])
        sampled_r = sampled.copy()
        tc.commit(bc, sampled, fc)
        tr.commit(br, sampled_r, fr)
        assert fc[:bc.n_out].tolist() == fr[:br.n_out].tolist()
        assert (sampled == sampled_r).all()
        for r in np.flatnonzero(fc[:bc.n_out]):
            s = int(bc.row_slot[r])
            tc.release(s)
            tr.release(s)
        for name in ("state", "n_tokens", "n_past", "n_gen", "tokens", "n_drafted", "n_accepted"):
            assert np.array_equal(getattr(tc, name), getattr(tr, name)), name
