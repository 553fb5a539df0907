"""Speculative decoding in the engine: the output is plain decoding's, token for token, whatever the drafts
(an oracle that is right for a while and then wrong exercises every rollback: KV length, the sliding-window
ring, the penalties' history, the RNG), alone and among busy slots; and the policy (fastserve/speculation.py)
drafts long where drafts pay and backs off where they do not."""
import numpy as np
import pytest

import fastserve
from fastserve._slots import DECODE
from fastserve.config import DraftLimits, SpecConfig
from fastserve.errors import ConfigError, RequestError
from fastserve.speculation import FORGET, Speculation, StepCost, worth_drafting
from fastserve.tracer import Tracer, delta, summarize
from tests.oracle_drafter import ORACLE, Oracle

PROMPTS = [f"request number {i} says the" + " at" * (i % 5) for i in range(8)]


def _plain(model, prompts, n, **kw):
    with fastserve.Engine(model, n_parallel=1, n_ctx=512) as e:
        return [e.generate(p, max_tokens=n, cache_prompt=False, **kw) for p in prompts]


def _with_oracle(model, prompts, plain, n, n_parallel, **kw):
    """The prompts at once on an engine that drafts with the Oracle (every draft worth trying)."""
    with fastserve.Engine(model, n_parallel=n_parallel, n_ctx=n_parallel * 256, n_batch=64,
                          speculative=ORACLE) as e:
        oracle = Oracle([list(model.tokenizer.encode(p)) + c.token_ids for p, c in zip(prompts, plain)],
                        model.config.n_vocab)
        e._spec.drafter = oracle
        e._spec.cost.bar = lambda n_rows: 0.0
        readers = [e.submit(p, max_tokens=n, cache_prompt=False, **kw) for p in prompts]
        out = [r.result() for r in readers]
        return out, oracle.drafted, e.snapshot


@pytest.fixture(scope="module")
def gemma3_model(tmp_path_factory):
    """A gemma3 model whose local layers keep a ring (window 5; ring 128 of a 256-token slot)."""
    from fastserve.models.synthetic import write_llama_gguf
    return fastserve.load_model(write_llama_gguf(tmp_path_factory.mktemp("g3") / "g3.gguf", architecture="gemma3",
                                                 sliding_window=5, seed=3))


@pytest.mark.parametrize("model_fixture", ["tiny_model", "gemma3_model"])
def test_greedy_output_is_plain_decoding_alone_and_among_busy_slots(request, model_fixture):
    model = request.getfixturevalue(model_fixture)
    n = 150                                         # past the gemma3 ring: rejected rows there overwrite it
    plain = _plain(model, PROMPTS, n, temperature=0)
    alone, drafted, _ = _with_oracle(model, PROMPTS[:1], plain[:1], n, 1, temperature=0)
    crowd, drafted8, snap = _with_oracle(model, PROMPTS, plain, n, 8, temperature=0)
    assert alone[0].token_ids == plain[0].token_ids
    assert [c.token_ids for c in crowd] == [c.token_ids for c in plain]
    assert drafted > n and drafted8 > 4 * n
    assert 0 < snap.n_drafted_accepted < snap.n_drafted and sum(snap.draft_histogram) == snap.n_draft_verified
    assert crowd[0].timings["draft_n"] >= crowd[0].timings["draft_n_accepted"] > 0


@pytest.mark.parametrize("model_fixture", ["tiny_model", "gemma3_model"])
def test_a_reused_prefix_holds_no_rejected_position(request, model_fixture):
    """After a speculative request, a longer prompt reuses its slot's KV (and the host-RAM prompt cache keeps
    a copy of it): what follows is what a fresh computation gives, so no rejected row is in the prefix."""
    model = request.getfixturevalue(model_fixture)
    first = list(model.tokenizer.encode(PROMPTS[2]))
    plain = _plain(model, [first], 140, temperature=0)[0].token_ids
    follow = first + plain + plain[:12]
    want = _plain(model, [follow, first + [7, 8, 9]], 30, temperature=0)
    with fastserve.Engine(model, n_parallel=1, n_ctx=512, n_batch=64, cache_ram_mib=8, speculative=ORACLE) as e:
        e._spec.drafter = Oracle([], model.config.n_vocab)              # it knows nothing: wrong drafts
        e._spec.cost.bar = lambda n_rows: 0.0
        first_out = e.generate(first, max_tokens=140, temperature=0)
        assert first_out.token_ids == plain and first_out.timings["draft_n"] > 50
        again = e.generate(follow, max_tokens=30, temperature=0)
        assert again.timings["cache_n"] > len(first) + 100
        other = e.generate(first + [7, 8, 9], max_tokens=30, temperature=0)    # saves `follow`'s prefix
        back = e.generate(follow, max_tokens=30, temperature=0)        # ... and brings it back
        assert [again.token_ids, other.token_ids] == [c.token_ids for c in want]
        assert back.token_ids == want[0].token_ids and back.timings["cache_n"] > len(first) + 100


def test_seeded_sampling_with_penalties_is_plain_sampling(tiny_model):
    kw = dict(temperature=0.8, top_k=20, top_p=0.9, repeat_penalty=1.3, repeat_last_n=16, seed=42)
    plain = _plain(tiny_model, PROMPTS[:4], 80, **kw)
    crowd, drafted, _ = _with_oracle(tiny_model, PROMPTS[:4], plain, 80, 4, **kw)
    assert [c.token_ids for c in crowd] == [c.token_ids for c in plain] and drafted > 0


@pytest.mark.model
@pytest.mark.parametrize("spec", [ORACLE, SpecConfig(type="ngram-simple", simple_size_n=3),
                                  SpecConfig(type="ngram-mod", mod_n_match=3, mod_n_min=2)],
                         ids=["oracle", "ngram-simple", "ngram-mod"])
def test_default_model_greedy_is_byte_identical(default_model, spec):
    """Every drafter on the default model, one request alone and eight at once (one of them constrained by a
    JSON schema, which drafts what its schema allows), against plain decoding."""
    prompts = ["List the numbers from one to twenty: one, two, three,", "def add(a, b):\n    return a + b\n\n"
               "def add3(a, b, c):\n    return", "The quick brown fox jumps over the lazy dog. The quick brown",
               *[f"Write a short poem about the number {i}." for i in range(5)]]
    n = 48
    plain = _plain(default_model, prompts, n, temperature=0)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    with fastserve.Engine(default_model, n_parallel=1, n_ctx=512) as e:
        plain_json = e.generate("A JSON object:", max_tokens=24, temperature=0, json_schema=schema).token_ids
    for n_parallel, some in ((1, prompts[:1]), (8, prompts)):
        with fastserve.Engine(default_model, n_parallel=n_parallel, n_ctx=n_parallel * 256, n_batch=128,
                              speculative=spec) as e:
            if spec is ORACLE:
                e._spec.drafter = Oracle([list(default_model.tokenizer.encode(p)) + c.token_ids
                                          for p, c in zip(prompts, plain)], default_model.config.n_vocab)
                e._spec.cost.bar = lambda n_rows: 0.0
            readers = [e.submit(p, max_tokens=n, temperature=0, cache_prompt=False) for p in some]
            js = e.submit("A JSON object:", max_tokens=24, temperature=0, json_schema=schema) if n_parallel > 1 else None
            got = [r.result().token_ids for r in readers]
            assert got == [c.token_ids for c in plain[:len(some)]], (spec.type, n_parallel)
            if js is not None:
                assert js.result().token_ids == plain_json
                assert e.snapshot.n_drafted > 0


GRAMMAR = 'root ::= ([a-z] [a-z] [a-z] " ")+ "."'     # where a token goes depends on what came before


@pytest.mark.parametrize("drafter", ["oracle", "draft-simple"])
def test_constrained_requests_draft_what_their_grammar_allows_and_roll_it_back(tiny_model_path, tiny_model,
                                                                              monkeypatch, drafter):
    """Grammar-constrained greedy requests with speculation, alone and among 7 busy slots (3 constrained, 4
    not): plain decoding's tokens; their drafts are cut where the mask refuses one (the Oracle's wrong
    drafts, the draft model's unconstrained argmax) and rejected where it allows a wrong one; every draft
    the matcher took is rolled back before the sampled tokens move it on (without that rollback the
    grammar's 4-character rhythm breaks and the requests end with "grammar")."""
    from fastserve import masks
    model, n = tiny_model, 60
    prompts = PROMPTS[:4]
    kw = dict(max_tokens=n, temperature=0, cache_prompt=False)
    plain = _plain(model, prompts, n, temperature=0, grammar=GRAMMAR) + _plain(model, prompts, n, temperature=0)
    spec = SpecConfig(type="draft-simple", draft_model=tiny_model_path) if drafter == "draft-simple" else ORACLE
    cut = []
    real_draft = masks.MaskTable.draft

    def draft(self, drafts, n_draft, k_min):
        before = int(n_draft.sum())
        kept = real_draft(self, drafts, n_draft, k_min)
        cut.append(before - kept)
        return kept
    monkeypatch.setattr(masks.MaskTable, "draft", draft)
    for n_parallel, some in ((1, [0]), (8, range(8))):
        with fastserve.Engine(model, n_parallel=n_parallel, n_ctx=n_parallel * 256, n_batch=64, speculative=spec) as e:
            if spec is ORACLE:
                e._spec.drafter = Oracle([list(model.tokenizer.encode(p)) + c.token_ids
                                          for p, c in zip(prompts * 2, plain)], model.config.n_vocab)
            e._spec.cost.bar = lambda n_rows: 0.0
            readers = [e.submit(prompts[i % 4], grammar=GRAMMAR if i < 4 else None, **kw) for i in some]
            got = [r.result() for r in readers]
            assert [g.token_ids for g in got] == [plain[i].token_ids for i in some], (drafter, n_parallel)
            assert [g.finish_reason for g in got] == [plain[i].finish_reason for i in some]
            t = got[0].timings          # the draft model drafting for itself is wrong only where the mask cuts
            assert 0 < t["draft_n_accepted"] <= t["draft_n"] and (spec is not ORACLE or t["draft_n_accepted"] < t["draft_n"])
    assert sum(cut) > 0


def test_the_sampler_reads_a_constrained_slots_draft_masks_row_by_row():
    """Row j >= 1 of a constrained slot's drafted run samples within draft_masks[slot, j - 1] (both
    implementations); a run longer than the draft masks is refused."""
    import importlib
    for impl in ("fastserve._sampling", "fastserve.ref.sampling"):
        s = importlib.import_module(impl).Sampler(2, 64)
        s.configure(1, seed=1, temperature=0.0, constrained=True)
        logits = np.tile(np.arange(64, dtype=np.float32), (3, 1))    # argmax 63 everywhere
        s.masks[1, 0] = 1 << 5                                       # row 0: token 5 only
        s.draft_masks[1, 0, 0] = 1 << 7                              # row 1: token 7 only
        s.draft_masks[1, 1, 1] = 1 << 2                              # row 2: token 34 only
        ids = np.zeros(3, np.int32)
        s.sample(logits, np.array([1, 1, 1], np.int32), ids, drafts=np.array([5, 7, -1], np.int32))
        assert ids.tolist() == [5, 7, 34], impl
        most = s.draft_masks.shape[1]
        run = most + 2
        with pytest.raises(ValueError, match="at most"):
            s.sample(np.zeros((run, 64), np.float32), np.ones(run, np.int32), np.zeros(run, np.int32),
                     drafts=np.array([0] * (run - 1) + [-1], np.int32))


# -- the policy ------------------------------------------------------------------------------------------

def test_step_cost_fits_the_line_and_sets_the_bar():
    cost = StepCost()
    assert cost.bar(1) == pytest.approx(0.2 / 1.2)               # before any step: the prior share
    for n in [1, 5, 1, 9, 1, 17, 3] * 10:
        cost.observe(n, 0.006 + 0.0012 * n)
    a, b = cost.line()
    assert a == pytest.approx(0.006, rel=1e-6) and b == pytest.approx(0.0012, rel=1e-6)
    assert cost.bar(1) < 0.2 < cost.bar(8) < cost.bar(32) < 1.0      # more slots busy: a draft must be surer
    assert worth_drafting(0.95, cost.bar(1)) > 25 > worth_drafting(0.95, cost.bar(32)) >= 0
    assert worth_drafting(0.3, cost.bar(1)) == 1 and worth_drafting(0.1, cost.bar(1)) == 0


class _Slots:
    """The SlotTable's fields propose() and observe() read."""

    def __init__(self, n_slots, n_ctx_slot=256):
        self.n_ctx_slot = n_ctx_slot
        self.state = np.full(n_slots, DECODE, np.int32)
        self.tokens = np.tile(np.arange(n_ctx_slot, dtype=np.int32) % 60, (n_slots, 1))   # drafts always found
        self.n_tokens = np.full(n_slots, 200, np.int32)
        self.n_gen = np.zeros(n_slots, np.int32)
        self.max_gen = np.full(n_slots, 1000, np.int32)
        self.n_drafted = np.zeros(n_slots, np.int32)
        self.n_accepted = np.zeros(n_slots, np.int32)


def _spec(n_slots, **limits):
    spec = Speculation(SpecConfig(type="ngram-simple", simple_size_n=3), n_slots, 256, 512)
    for s in range(n_slots):
        spec.start(s, DraftLimits(**limits) if limits else None, constrained=False)
    for _ in range(40):
        spec.cost.observe(1, 0.0072)
        spec.cost.observe(9, 0.0168)
    return spec


def test_drafts_grow_while_accepted_and_stop_when_they_fail():
    spec, slots = _spec(1), _Slots(1)
    sizes = []
    for _ in range(6):                              # every draft accepted: 2, then longer, up to size_m
        spec.propose(slots, 512)
        sizes.append(int(spec.n_draft[0]))
        slots.n_drafted[0] += sizes[-1]
        slots.n_accepted[0] += sizes[-1]
        spec.observe(slots)
    assert sizes[0] == 2 and sizes == sorted(sizes) and sizes[-1] == 48
    fails = 0
    while spec.propose(slots, 512):                 # then every draft rejected at once: down to none
        slots.n_drafted[0] += int(spec.n_draft[0])
        spec.observe(slots)
        fails += 1
    assert 3 <= fails <= 12 and spec.n_draft[0] == 0
    steps = 0
    while spec.propose(slots, 512) == 0:            # not drafting, its misses fade: it tries again, briefly
        steps += 1
        assert steps < 200
    assert spec.n_draft[0] == 1 and steps > 5


def test_many_busy_slots_draft_less_and_the_batch_keeps_their_decode_rows():
    one, eight = _spec(1), _spec(8)
    for spec in (one, eight):
        spec.hits[:] = 9.0                          # alpha 0.9 everywhere
    one.propose(_Slots(1), 512)
    eight.propose(_Slots(8), 512)
    assert one.n_draft[0] > eight.n_draft[0] > 0
    spec = _spec(8)
    spec.hits[:] = 1e6
    total = spec.propose(_Slots(8), 20)             # 8 decode rows first, drafts share the other 12
    assert 0 < total <= 12


def test_request_limits_and_constrained_slots():
    spec, slots = _spec(3), _Slots(3)
    spec.hits[:] = 1e6
    spec.start(0, DraftLimits(n_max=3), constrained=False)
    spec.start(1, DraftLimits(n_min=40, n_max=45), constrained=False)
    spec.start(2, None, constrained=True)
    spec.hits[:] = 1e6
    spec.propose(slots, 512)
    assert spec.n_draft.tolist() == [3, 45, 0]          # no draft masks: a constrained slot does not draft
    spec.constrained_most = 8
    spec.start(2, None, constrained=True)
    spec.hits[:] = 1e6
    spec.propose(slots, 512)
    assert spec.n_draft.tolist() == [3, 45, 8]
    spec.start(0, DraftLimits(p_min=1.0), constrained=False)     # no position is certain: none
    spec.hits[:] = 9.0
    spec.propose(slots, 512)
    assert spec.n_draft[0] == 0 and 0 < FORGET < 1


def test_bad_limits_and_configs_are_refused():
    for bad, why in ((dict(n_max=2, n_min=3), "n_max .2. must be >= speculative.n_min"),
                     (dict(p_min=-0.1), "p_min must be a number in"), (dict(n_min=-1), "n_min must be an integer"),
                     (dict(p_min="x"), "p_min")):
        with pytest.raises(RequestError, match=why):
            DraftLimits(**bad)
    with pytest.raises(RequestError, match="unknown speculative field"):
        DraftLimits().merged({"n_maxx": 3})
    with pytest.raises(ValueError, match="--spec-type"):
        SpecConfig(type="draft-simple")
    with pytest.raises(ValueError, match="--spec-ngram-mod-n-max .3. must be >="):
        SpecConfig(type="ngram-mod", mod_n_max=3)
    with pytest.raises(ValueError, match="--spec-ngram-simple-size-n"):
        SpecConfig(type="ngram-simple", simple_size_n=0)


def test_the_server_flags_default_p_min_as_llama_server():
    """--spec-draft-p-min unset: a draft model's 0.75 (llama-server's), the n-gram drafters' 0; given: taken."""
    import argparse

    from fastserve.server import llama_flags
    parser = argparse.ArgumentParser()
    llama_flags.add_taken(parser)
    p_min = lambda *argv: llama_flags.speculative(parser.parse_args(argv)).limits.p_min      # noqa: E731
    assert p_min("-md", "d.gguf") == p_min("--spec-type", "draft-simple", "--spec-draft-model", "d.gguf") == 0.75
    assert p_min("--spec-type", "ngram-mod") == p_min("--spec-type", "ngram-simple") == 0.0
    assert p_min("-md", "d.gguf", "--spec-draft-p-min", "0") == 0.0
    assert p_min("--spec-type", "ngram-mod", "--draft-p-min", "0.5") == 0.5


def test_engine_requests_with_bad_speculative_fields(tiny_model):
    with fastserve.Engine(tiny_model, n_parallel=1, n_ctx=128, speculative=SpecConfig(type="ngram-mod")) as e:
        with pytest.raises(RequestError, match="n_max"):
            e.submit("hi", max_tokens=2, speculative={"n_max": 1, "n_min": 2})
        with pytest.raises(RequestError, match="speculative must be an object"):
            e.submit("hi", max_tokens=2, speculative=[3])
        assert e.generate("hi", max_tokens=3, speculative={"n_max": 4}).finish_reason == "length"


def test_a_backend_that_cannot_verify_is_refused(tiny_model):
    class NoVerify:                                 # a backend with step() of its own and no verifying sampler
        def __init__(self, cfg, weights, n_slots, n_ctx_slot):
            self.n_slots, self.n_ctx_slot, self.n_vocab = n_slots, n_ctx_slot, cfg.n_vocab
            self.masks = np.zeros((n_slots, (cfg.n_vocab + 31) // 32), np.uint32)
            self.samples_on_device = True

        def step(self, batch, lap=None, before_sample=None):
            raise AssertionError("never run")

        forward = step
    with pytest.raises(ConfigError, match="verifies drafts"):
        fastserve.Engine(tiny_model, backend=NoVerify, speculative=SpecConfig(type="ngram-simple"))


def test_the_tracer_counts_drafts_for_the_bench_table():
    t = Tracer()
    before = t.totals()
    t.drafts(10, 7)
    t.drafts(6, 1)
    s = summarize(delta(t.totals(), before))
    assert (s["drafted"], s["acceptance"]) == (16, 0.5)
    old = {k: v for k, v in before.items() if k not in ("drafted", "accepted")}      # a server from before
    assert summarize(delta(old, old))["acceptance"] is None


def test_fastserve_bench_shows_the_acceptance(tiny_model_path, tmp_path):
    """`fastserve bench --spec-type ngram-mod` (in-process): its phase table has the draft acc column, filled
    (accepted / drafted tokens of the window), as its JSON has; without --spec-type the figure is absent."""
    import json
    import subprocess
    import sys
    for spec, drafted in (("ngram-mod", True), ("none", False)):
        out = tmp_path / f"{spec}.json"
        p = subprocess.run([sys.executable, "-m", "fastserve", "bench", "-m", tiny_model_path, "--clients", "2",
                            "--duration", "1.0", "--warmup", "0.2", "-n", "32", "--prompt-tokens", "8-16",
                            "--spec-type", spec, "--probes", "", "--json", str(out), "--no-progress"],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        phases = json.loads(out.read_text())["runs"][0]["figures"]["phases"]
        assert "draft acc" in p.stdout
        if drafted:
            assert phases["drafted"] > 0 and 0.0 <= phases["acceptance"] <= 1.0
            assert f"{phases['acceptance']:.0%}" in p.stdout
        else:
            assert phases["acceptance"] is None
