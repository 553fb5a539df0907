"""A draft model for speculative decoding (--spec-type draft-simple, fastserve/draft_model.py): the output is
plain decoding's, greedy and sampled, alone and among busy slots, whatever the draft model (the model itself:
every draft accepted; a quantized copy: some accepted, some not); a rejected draft leaves nothing in the draft's
KV; p_min and n_max bound the drafts; a draft model of another vocabulary stops the start with the reason."""
from types import SimpleNamespace

import numpy as np
import pytest

import fastserve
from fastserve.config import DraftLimits, SpecConfig
from fastserve.draft_model import check_vocabulary
from fastserve.errors import ConfigError
from fastserve.models.synthetic import write_llama_gguf

PROMPTS = [f"request number {i} says the" + " at" * (i % 5) for i in range(8)]
N = 48
SAMPLING = {"greedy": dict(temperature=0), "sampled": dict(temperature=0.8, seed=5, top_k=20)}


@pytest.fixture(scope="module")
def drafts(tiny_model_path, tmp_path_factory):
    """name -> a draft model file for the tiny model: itself, and its weights in Q4_0 (same seed: a draft that
    agrees often, not always)."""
    d = tmp_path_factory.mktemp("drafts")
    return {"itself": tiny_model_path, "q4_0": write_llama_gguf(d / "q4.gguf", weight_type="Q4_0")}


@pytest.fixture(scope="module")
def plain(tiny_model):
    """Each prompt's plain answers, greedy and sampled, computed alone."""
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=512) as e:
        return {name: [e.generate(p, max_tokens=N, cache_prompt=False, **kw).token_ids for p in PROMPTS]
                for name, kw in SAMPLING.items()}


def _spec(path, **limits) -> SpecConfig:
    return SpecConfig(type="draft-simple", draft_model=path, limits=DraftLimits(**limits))


@pytest.mark.parametrize("draft", ["itself", "q4_0"])
def test_output_is_plain_decoding_alone_and_among_busy_slots(tiny_model, drafts, plain, draft):
    # n_batch 32 < the 8 prompts' tokens: the draft model's prompts catch up in chunks, some lag
    spec = _spec(drafts[draft])
    with fastserve.Engine(tiny_model, n_parallel=8, n_ctx=8 * 256, n_batch=32, speculative=spec) as e:
        for name, want in plain.items():
            alone = e.generate(PROMPTS[3], max_tokens=N, cache_prompt=False, **SAMPLING[name])
            crowd = [e.submit(p, max_tokens=N, cache_prompt=False, **SAMPLING[name]) for p in PROMPTS]
            crowd = [r.result() for r in crowd]
            assert alone.token_ids == want[3]
            assert [c.token_ids for c in crowd] == want
            if draft == "itself" and name == "greedy":    # slots taken again: no stale draft KV past a prefix
                assert all(c.timings["draft_n_accepted"] == c.timings["draft_n"] for c in [alone] + crowd)
        snap = e.snapshot
    assert snap.n_drafted > 4 * N and sum(snap.draft_histogram) == snap.n_draft_verified
    if draft == "itself":           # greedy drafts of the model itself: exactly its greedy choices
        assert alone.timings["draft_n"] > 0
    else:
        assert 0 < snap.n_drafted_accepted < snap.n_drafted


def test_the_model_drafting_for_itself_is_always_right_when_greedy(tiny_model, drafts, plain):
    spec = _spec(drafts["itself"])
    with fastserve.Engine(tiny_model, n_parallel=4, n_ctx=4 * 256, n_batch=64, speculative=spec) as e:
        out = [e.submit(p, max_tokens=N, temperature=0, cache_prompt=False) for p in PROMPTS[:4]]
        out = [r.result() for r in out]
        snap = e.snapshot
    assert [c.token_ids for c in out] == plain["greedy"][:4]
    assert snap.n_drafted > 2 * N and snap.n_drafted_accepted == snap.n_drafted


def test_a_rejected_draft_leaves_nothing_in_the_draft_kv(tiny_model, drafts):
    """The model drafting for itself, greedily, for a request sampled hot: many drafts are rejected.
    Afterwards the draft's KV holds the slot's own tokens up to the target's n_past (as of its last
    verification), byte for byte what a fresh pass over those tokens writes; and a greedy continuation on
    that slot has every draft accepted."""
    spec = _spec(drafts["itself"])
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=512, n_batch=64, speculative=spec) as e:
        e._spec.cost.bar = lambda n_rows: 0.0           # every draft worth trying, however many fail
        hot = e.generate(PROMPTS[1], max_tokens=120, temperature=1.5, seed=9)
        assert hot.timings["draft_n"] > hot.timings["draft_n_accepted"] + 20
        text = list(tiny_model.tokenizer.encode(PROMPTS[1])) + hot.token_ids
        draft, n_past = e._spec.model, int(e._slots.n_past[0])
        n_fed = int(draft.n_fed[0])     # the target's n_past at the slot's last verification
        assert len(text) - 20 <= n_fed <= n_past == len(text) - 1
        assert _kv(draft.backend, n_fed) == _kv(_fresh(draft.backend, text[:n_fed]), n_fed)
        greedy = e.generate(text, max_tokens=60, temperature=0)
    assert greedy.timings["cache_n"] == len(text) - 1
    assert greedy.timings["draft_n"] > 20 and greedy.timings["draft_n_accepted"] == greedy.timings["draft_n"]


def _fresh(backend, tokens):
    """A new CPU backend of the same model and cache types, its slot 0 written by one pass over tokens."""
    from fastserve.backends.cpu.backend import CpuBackend
    kv = backend.kv
    fresh = CpuBackend(backend.cfg, backend.w, 1, backend.n_ctx_slot, cache_type_k=kv.type_k, cache_type_v=kv.type_v,
                       max_tokens=len(tokens))
    rows = np.arange(len(tokens))
    fresh.forward(np.asarray(tokens), rows, np.zeros_like(rows), rows[-1:])
    return fresh


def _kv(backend, n: int) -> bytes:
    into = np.zeros(n * backend.kv_bytes_per_token(), np.uint8)
    backend.save_slot(0, 0, n, into)
    return into.tobytes()


def test_p_min_and_n_max_bound_the_drafts(tiny_model, drafts, plain):
    want = plain["greedy"][0]
    spec = _spec(drafts["itself"], p_min=1.0)
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=512, speculative=spec) as e:
        none = e.generate(PROMPTS[0], max_tokens=N, temperature=0, cache_prompt=False)     # no probability is 1
        two = e.generate(PROMPTS[0], max_tokens=N, temperature=0, cache_prompt=False,
                         speculative={"p_min": 0.0, "n_max": 2})
        snap = e.snapshot
    assert none.token_ids == two.token_ids == want
    assert none.timings.get("draft_n", 0) == 0
    assert two.timings["draft_n"] > N // 3 and snap.n_drafted <= 2 * snap.n_draft_verified


def test_a_draft_model_of_another_vocabulary_stops_the_start(tiny_model, tmp_path):
    other = write_llama_gguf(tmp_path / "v600.gguf", n_vocab=600)
    with pytest.raises(ConfigError, match="the draft model's vocabulary is not the model's: 600 tokens, the model "
                                          "has 512"):
        fastserve.Engine(tiny_model, n_parallel=1, n_ctx=256, speculative=_spec(other))


def test_the_vocabulary_check_names_the_first_piece_that_differs():
    def model(pieces):
        return SimpleNamespace(tokenizer=SimpleNamespace(n_vocab=len(pieces), token_bytes=lambda i: pieces[i]))
    check_vocabulary(model([b"a", b"b", b"c"]), model([b"a", b"b", b"c"]))
    with pytest.raises(ConfigError, match=r"token 1 is b'x' in the draft model, b'b' in the model"):
        check_vocabulary(model([b"a", b"b", b"c"]), model([b"a", b"x", b"c"]))


@pytest.mark.parametrize("fields, why", [
    (dict(type="draft-simple"), "--spec-type draft-simple needs a draft model: --spec-draft-model FILE"),
    (dict(type="ngram-mod", draft_model="d.gguf"), "--spec-draft-model d.gguf drafts with --spec-type draft-simple, "
                                                   "not ngram-mod"),
])
def test_a_draft_model_goes_with_draft_simple(fields, why):
    with pytest.raises(ValueError, match=why):
        SpecConfig(**fields)


def test_a_sliding_window_model_drafting_for_itself_past_its_ring(tmp_path):
    """Gemma 3's local layers keep a ring (window 5; 128 rows of a 256-token slot) in the draft's KV too: drafts
    and rejections past the ring's length leave greedy plain and every greedy draft right."""
    path = write_llama_gguf(tmp_path / "g3.gguf", architecture="gemma3", sliding_window=5, seed=3)
    model = fastserve.load_model(path)
    with fastserve.Engine(model, n_parallel=1, n_ctx=256) as e:
        plain = [e.generate(p, max_tokens=150, temperature=0, cache_prompt=False).token_ids for p in PROMPTS[:3]]
    with fastserve.Engine(model, n_parallel=3, n_ctx=3 * 256, n_batch=64, speculative=_spec(path)) as e:
        assert e._spec.model.backend.kv_ring == 128
        hot = e.generate(PROMPTS[0], max_tokens=150, temperature=1.5, seed=2)      # rejections in the ring
        crowd = [e.submit(p, max_tokens=150, temperature=0) for p in PROMPTS[:3]]
        crowd = [r.result() for r in crowd]
    assert hot.timings["draft_n"] > hot.timings["draft_n_accepted"]
    assert [c.token_ids for c in crowd] == plain
    assert all(c.timings["draft_n_accepted"] == c.timings["draft_n"] > 0 for c in crowd)


def test_a_prefix_whose_window_the_ring_lost_is_computed_again():
    """A new prompt sharing 6 tokens with what the slot's draft KV holds reuses them; when the ring no longer holds
    the window before them (kv_reuse_from above the prefix), it starts from 0."""
    from fastserve.draft_model import DraftModel

    class Backend:                      # the CPU backend's surface that DraftModel reads before a pass
        n_slots, n_ctx_slot, n_vocab, reuse_from = 1, 32, 8, 0

        def kv_reuse_from(self, slot, n):
            return self.reuse_from

    be = Backend()
    draft = DraftModel(be, max_tokens=16, min_chunk=4)
    old, new = np.arange(1, 21, dtype=np.int32), np.r_[np.arange(1, 7), [9, 9, 9]].astype(np.int32)
    draft.fed[0, :20], draft.n_fed[0], draft.agreed[0] = old, 20, 20
    draft.reset(0)
    draft.rollback(new[None, :], np.array([len(new)]), np.array([0]))
    assert draft.n_fed[0] == 6
    draft.fed[0, :20], draft.n_fed[0] = old, 20
    be.reuse_from = 7
    draft.reset(0)
    draft.rollback(new[None, :], np.array([len(new)]), np.array([0]))
    assert draft.n_fed[0] == 0
