"""Each family of the architecture table against llama.cpp's outputs on a model of that family.

    qwen2, qwen3, llama3   ../shared/reference/models/<family>-synth.gguf (random weights; not in the
                           repository: skipped without ../shared) and llama.cpp's outputs beside them
    granite, smollm3, phi3 tests/golden/synthetic_families.py's models (random weights, SmolLM2's vocabulary:
    qwen3moe               written at test time, byte for byte the file llama.cpp's outputs in tests/golden/data
    qwen3moe-mxfp4         were recorded on by bench/record_family_references.py; qwen3moe-mxfp4: qwen3moe with
    gpt-oss                MXFP4 experts, llama-quantize's MXFP4_MOE: test_mxfp4_family.py; gpt-oss: the o200k
    gpt-oss-mxfp4          pre-tokenizer over that vocabulary; gpt-oss-mxfp4: with MXFP4 experts likewise)
    gemma3                 Gemma 3 270M Q4_K_M (`fastserve pull gemma3-270m`, pulled on first use, as the
                           default model's tests do) and llama.cpp's outputs in tests/golden/data

The bars (issue 13): tokenizer ids identical on every case; teacher forced (prompt + llama.cpp's tokens
through model.logits), top-1 agreement >= 98 % with near-ties (top two within 0.02) forgiven and median
top-5 |dp| <= 0.03; free greedy through the Engine equal over 16 tokens on every prompt, a first
divergence allowed only at such a near-tie; greedy the same alone and among 7 other requests.
"""
from __future__ import annotations

import numpy as np
import pytest

import fastserve
from fastserve.backends.cpu.backend import CpuBackend
from tests.golden import synthetic_families
from tests.reference_data import GOLDEN_DATA, SHARED_REFERENCE, default_model_or_skip, load_reference, shared_model

NEAR_TIE = 0.02
# issue 30: the free-greedy bar of a family where llama.cpp's own -fa off / -t 1 runs flip its greedy text at gaps
# past NEAR_TIE (measured by bench/record_family_references.py into the record's metadata.self_divergence)
OWN_FLIPS_NEAR_TIE = 0.1
SYNTHETIC = ("qwen2", "qwen3", "llama3")
REGENERATED = tuple(synthetic_families.SPECS)
BATCH_CHECKED = ("qwen3", "gemma3", "qwen3moe", "qwen3moe-mxfp4", "gpt-oss", "gpt-oss-mxfp4")   # the MoEs: issue 30's
# Gemma 3 270M's first divergences outside the bar (issue 13: not met on these 3 of 13 prompts), pinned so
# that any other divergence, or these moving, fails. Measured, not a bug (bench/bench_rounding_sensitivity.py,
# bench/bench_layer_op_variants.py): the int8 activation rounding before every product makes this model's
# probabilities move by a median 0.004-0.007 under any last-bit change, and llama.cpp's record is one such
# draw. llama.cpp against its own record misses the same bar: --no-repack (its Q4_K products summed in another
# order) flips medium_story at 0 (gap 0.056); -fa off flips short_word at 8 (0.033) and code_js at 1 (0.031),
# two of the pins below, and long_history at 8 (0.098). Of 13 variants of the element-wise ops (einsum or lane sums, float64 sums, exact float64 ops, three
# exp/tanh forms), none passes here with fewer than 2 such flips; main's NumPy ops passed with 2 only on NumPy's
# AVX2/AVX-512 exp (without it: 3). The ops now use a ~1 ulp exp (fs_exp_neg), with which the default model's
# greedy tests pass with no pin. llama.cpp's fp16 activation scales (q8_0/q8_1) trade these flips for others.
# qwen3moe's: an expert choice at a near-tie in the prompt, not a token's (test_moe_flip_is_an_expert_near_tie):
# at layer 0, row 7 of qa_format_immediate_eos our router's second and third experts are 0.17270 and 0.17253, and
# llama.cpp's rounding picks the third; the row's output then differs, and through attention the prompt's last
# token. A mixture of experts turns rounding into such discrete choices; llama.cpp's own -fa off / -t 1 runs
# did not hit one on these prompts (the record's self_divergence). qwen3moe-mxfp4's likewise: code_js at
# position 5 of its greedy text, where layer 2's second and third experts of the last row are 0.14698 and 0.14625
# (EXPERT_NEAR_TIES, test_moe_flip_is_an_expert_near_tie).
KNOWN_FLIPS = {"gemma3": {"short_word": 8, "code_js": 1, "long_history_~300tok": 0},
               "qwen3moe": {"qa_format_immediate_eos": 0}, "qwen3moe-mxfp4": {"code_js": 5}}
FAMILIES = [*SYNTHETIC, *REGENERATED, pytest.param("gemma3", marks=pytest.mark.model)]


def _reference(family: str) -> dict:
    if family == "gemma3":
        return load_reference(GOLDEN_DATA / "gemma3_270m_q4km_llamacpp_greedy.json")
    if family in REGENERATED:
        return load_reference(GOLDEN_DATA / f"{family}_synth_llamacpp_greedy.json")
    path = SHARED_REFERENCE / f"{family}_synth_llamacpp_greedy.json"
    if not path.is_file():
        pytest.skip(f"{path.name} is only in ../shared/reference (beside its model, which is never committed)")
    return load_reference(path)


def _regenerated(name: str, ref: dict, request) -> str:
    """The family's synthetic model written afresh; the file llama.cpp's outputs were recorded on, or a failure."""
    vocab_model = default_model_or_skip(f"{name}'s synthetic model")
    path = synthetic_families.write(name, request.getfixturevalue("tmp_path_factory").mktemp(name), vocab_model)
    got, want = synthetic_families.sha256(path), ref["metadata"]["model_sha256"]
    assert got == want, (f"{name}: the regenerated model (sha256 {got}) is not the one llama.cpp's outputs were "
                         f"recorded on ({want}); record them again: python bench/record_family_references.py")
    return path


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(name, model, llama.cpp's outputs, the prompts llama.cpp evaluated)."""
    name = request.param
    ref = _reference(name)
    if name == "gemma3":
        from fastserve.models.catalog import model_path
        path = model_path("gemma3-270m")
    elif name in REGENERATED:
        path = _regenerated(name, ref, request)
    else:
        path = shared_model(f"{name}-synth.gguf")
    model = fastserve.load_model(path)
    # /completion adds BOS when the file says so: the evaluated prompt is then the add_special one
    key = "prompt_token_ids_add_special_true" if model.tokenizer.add_bos else "prompt_token_ids"
    return name, model, ref, [c[key] for c in ref["completions"]]


def test_tokenizer_ids_identical(family):
    """llama.cpp's /tokenize: add_special false unless asked (its default), parse_special true unless asked."""
    _, model, ref, _ = family
    tok = model.tokenizer
    bad = []
    for c in ref["tokenization_cases"]:
        text = c["text"]
        for key, ids in (("ids_default", tok.encode(text, add_special=False)),
                         ("ids_add_special_false", tok.encode(text, add_special=False)),
                         ("ids_add_special_true", tok.encode(text, add_special=True)),
                         ("ids_parse_special_false", tok.encode(text, add_special=False, parse_special=False))):
            if ids != c[key]:
                bad.append((c["name"], key))
        for p in c["pieces"]:
            want = p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
            if tok.token_bytes(p["id"]) != want:
                bad.append((c["name"], "piece", p["id"]))
    for c in ref["completions"]:
        if tok.encode(c["prompt"], add_special=True) != c["prompt_token_ids_add_special_true"]:
            bad.append((c["name"], "prompt"))
        if tok.encode(c["prompt"], add_special=False) != c["prompt_token_ids_add_special_false"]:
            bad.append((c["name"], "prompt without BOS"))
    assert not bad, bad


def _probs(row):
    p = np.exp(row.astype(np.float64) - row.max())
    return p / p.sum()


def teacher_forced_scores(model, ref, prompts, cache_type: str = "f16", n_ctx_slot: int = 0) -> tuple[float, float]:
    """Prompt + llama.cpp's tokens through the model: (top-1 agreement with near-ties forgiven, median over
    positions of the largest |dp| over llama.cpp's top 5). n_ctx_slot: the backend's slot context (0: the
    sequence's length). Also bench/bench_layer_op_variants.py's measure."""
    agree, total, worst = 0, 0, []
    for case, prompt in zip(ref["completions"], prompts):
        ids = np.asarray(prompt + case["generated_token_ids"], np.int32)
        # model.logits, but only the rows compared (Gemma's 262k-wide output product of a prompt row costs)
        backend = CpuBackend(model.config, model.weights, n_slots=1, n_ctx_slot=n_ctx_slot or len(ids),
                             cache_type_k=cache_type, cache_type_v=cache_type)
        rows = np.array([len(prompt) - 1 + e["pos"] for e in case["top5_per_position"]], np.int32)
        logits = backend.forward(ids, np.arange(len(ids), dtype=np.int32), np.zeros(len(ids), np.int32), rows)
        for row, entry in zip(logits, case["top5_per_position"]):
            ours, p, top = int(np.argmax(row)), _probs(row), entry["top5"]
            near_tie = top[0]["prob"] - top[1]["prob"] <= NEAR_TIE
            agree += ours == entry["id"] or (near_tie and ours in (top[0]["id"], top[1]["id"]))
            total += 1
            worst.append(max(abs(p[t["id"]] - t["prob"]) for t in top))
    return agree / total, float(np.median(worst))


def test_teacher_forced(family):
    name, model, ref, prompts = family
    agreement, median = teacher_forced_scores(model, ref, prompts)
    print(f"{name}: top-1 agreement {agreement:.4f}, median top-5 |dp| {median:.4f}")
    assert agreement >= 0.98
    assert median <= 0.03


def _first_divergence(case, got, n=16):
    """None when got equals llama.cpp's first n tokens; else (position, llama.cpp's gap between its top and
    our token there: None when ours is not among its top 5)."""
    want = case["generated_token_ids"][:n]
    first = next((i for i in range(min(len(got), len(want))) if got[i] != want[i]), None)
    if first is None:
        assert len(got) == len(want), f"{case['name']}: {len(got)} tokens, llama.cpp {len(want)}"
        return None
    top = case["top5_per_position"][first]["top5"]
    gap = next((top[0]["prob"] - t["prob"] for t in top[1:] if t["id"] == got[first]), None)
    return first, None if gap is None else round(gap, 4)


def greedy_near_tie(ref: dict) -> float:
    """NEAR_TIE, or OWN_FLIPS_NEAR_TIE where the record shows llama.cpp's own runs diverging past NEAR_TIE."""
    own = ref["metadata"].get("self_divergence", {})
    gaps = [gap for runs in own.values() for _, gap in runs.values()]
    return OWN_FLIPS_NEAR_TIE if any(g is None or g > NEAR_TIE for g in gaps) else NEAR_TIE


def test_free_greedy_matches(family):
    """Equal over 16 tokens, or a first divergence at a near-tie (our token one of llama.cpp's
    candidates within NEAR_TIE of its top; greedy_near_tie's wider bar where llama.cpp's own runs flip
    at more)."""
    name, model, ref, prompts = family
    near_tie = greedy_near_tie(ref)
    with fastserve.Engine(model, n_parallel=4, n_ctx=4 * 512) as engine:
        readers = [engine.submit(p, max_tokens=16, temperature=0, cache_prompt=False) for p in prompts]
        ours = [r.result().token_ids for r in readers]
    flips = {c["name"]: f for c, got in zip(ref["completions"], ours) if (f := _first_divergence(c, got)) is not None}
    print(f"{name}: {len(prompts) - len(flips)}/{len(prompts)} prompts equal over 16 tokens; first divergences "
          f"(position, llama.cpp's top-two gap) {flips}; near-tie bar {near_tie}")
    known = KNOWN_FLIPS.get(name, {})
    bad = {k: f for k, f in flips.items() if (f[1] is None or f[1] > near_tie) and known.get(k) != f[0]}
    assert not bad, f"{name}: divergences outside a near-tie: {bad}"


def test_greedy_alone_and_among_seven_others(family):
    """The same greedy tokens for a request alone and in a batch of 8 (other prompts, slots, chunks)."""
    name, model, _, prompts = family
    if name not in BATCH_CHECKED:
        pytest.skip(f"checked on {' and '.join(BATCH_CHECKED)} (one synthetic family, Gemma 3), to keep the suite short")
    with fastserve.Engine(model, n_parallel=8, n_ctx=8 * 512, n_batch=128) as engine:
        crowd = [engine.submit(p, max_tokens=16, temperature=0, cache_prompt=False) for p in prompts[:8]]
        crowd = [r.result().token_ids for r in crowd]
    with fastserve.Engine(model, n_parallel=1, n_ctx=512) as engine:
        alone = [engine.generate(p, max_tokens=16, temperature=0, cache_prompt=False).token_ids for p in prompts[:3]]
    for i, want in enumerate(alone):
        assert crowd[i] == want, f"prompt {i} differs in company"


def test_greedy_with_speculative_decoding_is_plain_greedy(family):
    """Speculative decoding among 8 requests gives plain greedy's tokens: n-gram drafts on Gemma 3, whose text
    repeats itself; on a random-weight family, whose text does not, drafts right for a while and then wrong
    (tests/unit/test_speculation.py's Oracle)."""
    from fastserve.config import SpecConfig
    from tests.oracle_drafter import ORACLE, Oracle
    name, model, _, prompts = family
    if name not in BATCH_CHECKED:
        pytest.skip(f"checked on {' and '.join(BATCH_CHECKED)} (one synthetic family, Gemma 3), to keep the suite short")
    with fastserve.Engine(model, n_parallel=1, n_ctx=512) as engine:
        alone = [engine.generate(p, max_tokens=32, temperature=0, cache_prompt=False).token_ids for p in prompts[:8]]
    spec = SpecConfig(type="ngram-simple", simple_size_n=1, simple_size_m=8) if name == "gemma3" else ORACLE
    with fastserve.Engine(model, n_parallel=8, n_ctx=8 * 512, n_batch=128, speculative=spec) as engine:
        if spec is ORACLE:
            engine._spec.drafter = Oracle([list(p) + a for p, a in zip(prompts, alone)], model.config.n_vocab)
            engine._spec.cost.bar = lambda n_rows: 0.0
        crowd = [engine.submit(p, max_tokens=32, temperature=0, cache_prompt=False) for p in prompts[:8]]
        crowd = [r.result().token_ids for r in crowd]
        drafted = engine.snapshot.n_drafted
    assert crowd == alone and drafted > 0


# KNOWN_FLIPS' mixture-of-experts entries: (family, prompt, llama.cpp's tokens before the flip, layer, row, the
# router's gap there between its second and third experts)
EXPERT_NEAR_TIES = [("qwen3moe", "qa_format_immediate_eos", 0, 0, 7, 0.0002),
                    ("qwen3moe-mxfp4", "code_js", 5, 2, -1, 0.001)]


@pytest.mark.parametrize("name,prompt,n_generated,layer,row,gap", EXPERT_NEAR_TIES)
def test_moe_flip_is_an_expert_near_tie(request, monkeypatch, name, prompt, n_generated, layer, row, gap):
    """KNOWN_FLIPS' mixture-of-experts entries explained: at the flip our router's second and third experts of one
    layer and row are within `gap`; with the third in place of the second there, the next-token distribution is
    llama.cpp's recorded one (the same top token, its top 5 within 0.002), and without it it is not."""
    from fastserve.backends.cpu.ref import forward as ref_forward
    ref = load_reference(GOLDEN_DATA / f"{name}_synth_llamacpp_greedy.json")
    model = fastserve.load_model(_regenerated(name, ref, request))
    case = next(c for c in ref["completions"] if c["name"] == prompt)
    assert KNOWN_FLIPS[name][prompt] == n_generated
    ids = case["prompt_token_ids"] + case["generated_token_ids"][:n_generated]
    top = case["top5_per_position"][n_generated]["top5"]
    route, calls, gaps = ref_forward.route, [], []

    def swapped(logits, k, scale, *rest):           # the layer's call (one per layer): the row takes its third expert
        experts, weights = route(logits, k, scale, *rest)
        if len(calls) == layer:
            p = np.exp(logits[row].astype(np.float64) - logits[row].max())
            p /= p.sum()
            order = np.argsort(-p, kind="stable")
            gaps.append(p[order[1]] - p[order[2]])
            experts[row] = order[[0, 2]]
            weights[row] = p[experts[row]] / p[experts[row]].sum()
        calls.append(layer)
        return experts, weights

    def probs():
        backend = CpuBackend(model.config, model.weights, 1, len(ids), reference=True)
        return _probs(backend.forward(ids, np.arange(len(ids)), np.zeros(len(ids), int), [len(ids) - 1])[0])

    plain = probs()
    monkeypatch.setattr(ref_forward, "route", swapped)
    flipped = probs()
    assert gaps[0] < gap
    assert int(np.argmax(flipped)) == top[0]["id"]
    assert max(abs(flipped[t["id"]] - t["prob"]) for t in top) < 0.002
    assert int(np.argmax(plain)) != top[0]["id"]


def test_phi3_longrope_past_its_original_context(request):
    """phi3's long RoPE factors: a slot context past the model's original one (8192 > 4096) switches from the
    short factors to the long ones (llama.cpp's get_rope_factors), against llama-server at -c 8192: the same
    teacher-forced and greedy bars."""
    n_ctx = 8192
    ref = load_reference(GOLDEN_DATA / f"phi3_synth_ctx{n_ctx}_llamacpp_greedy.json")
    model = fastserve.load_model(_regenerated("phi3", ref, request))
    prompts = [c["prompt_token_ids"] for c in ref["completions"]]
    agreement, median = teacher_forced_scores(model, ref, prompts, n_ctx_slot=n_ctx)
    print(f"phi3 at a slot context of {n_ctx}: top-1 agreement {agreement:.4f}, median top-5 |dp| {median:.4f}")
    assert agreement >= 0.98 and median <= 0.03
    with fastserve.Engine(model, n_parallel=1, n_ctx=n_ctx) as engine:
        ours = [engine.generate(p, max_tokens=16, temperature=0, cache_prompt=False).token_ids for p in prompts]
    flips = {c["name"]: f for c, got in zip(ref["completions"], ours) if (f := _first_divergence(c, got)) is not None}
    near_tie = greedy_near_tie(ref)
    assert not {k: f for k, f in flips.items() if f[1] is None or f[1] > near_tie}, flips
