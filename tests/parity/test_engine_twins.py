"""The whole Engine on the pure-Python twins (Engine(twins=...)): each twin, swapped in for its Cython
module, gives the same completions as the engine on the extensions (ids, finish reasons, probabilities)."""
import pytest

import fastserve
from fastserve.config import SpecConfig

REQUESTS = [
    dict(prompt="the cat sat on", max_tokens=6, temperature=0),
    dict(prompt="a dog ran", max_tokens=6, temperature=0.9, seed=5, top_k=0, top_p=0.9, n_probs=3,
         repeat_penalty=1.2),
    dict(prompt="stop right here", max_tokens=8, temperature=0.7, seed=9, stop=["e"]),
    dict(prompt="json", max_tokens=12, temperature=1.0, seed=3, top_k=0, n_probs=2,
         json_schema={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
]


def _run(model, twins, **settings):
    with fastserve.Engine(model, n_parallel=2, n_ctx=256, twins=twins, **settings) as e:
        running = {"batch": e._batch, "slots": e._slots, "delivery": e._delivery, "sampling": e._backend.sampler}
        if e._spec is not None:
            running["drafts"] = e._spec.drafter
        assert {n for n, obj in running.items() if type(obj).__module__.startswith("fastserve.ref.")} == set(twins)
        readers = [e.submit(r["prompt"], **{k: v for k, v in r.items() if k != "prompt"}) for r in REQUESTS]
        done = [rd.result(timeout=60) for rd in readers]
    return [(c.token_ids, c.finish_reason, c.text, c.probs) for c in done]


@pytest.fixture(scope="module")
def native(tiny_model):
    return _run(tiny_model, ())


@pytest.mark.parametrize("twins", [("batch", "slots"), ("delivery",), ("sampling",)], ids=lambda t: "+".join(t))
def test_the_engine_on_a_twin_completes_as_on_the_extension(tiny_model, native, twins):
    assert _run(tiny_model, twins) == native


@pytest.mark.parametrize("twins", [(), ("drafts",), ("batch", "slots", "delivery", "sampling", "drafts")],
                         ids=["native", "drafts", "all"])
def test_speculative_decoding_on_the_twins_completes_as_plain_decoding(tiny_model, native, twins):
    spec = SpecConfig(type="ngram-simple", simple_size_n=1, simple_size_m=4)      # drafts at every repeat
    assert _run(tiny_model, twins, speculative=spec) == native


def test_twins_are_named():
    with pytest.raises(ValueError, match="no twin for nope"):
        fastserve.Engine._modules(("nope",))
    with pytest.raises(ValueError, match="ask for both"):
        fastserve.Engine._modules(("slots",))
    assert {m.__name__ for m in fastserve.Engine._modules("all").values()} == {
        "fastserve.ref.batch", "fastserve.ref.slots", "fastserve.ref.delivery", "fastserve.ref.sampling",
        "fastserve.ref.drafts"}
