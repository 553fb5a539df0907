"""Constrained generation on the tiny model: llguidance's vocabulary, compile errors, the engine's masks."""
import json

import numpy as np
import pytest

import fastserve
from fastserve import grammar as G
from fastserve.errors import RequestError


@pytest.fixture(scope="module")
def engine(tiny_model):
    with fastserve.Engine(tiny_model, n_parallel=8, n_ctx=2048, n_batch=64) as e:
        yield e


def test_vocabulary_is_built_once_and_kept_with_the_tokenizer(tiny_model):
    tok = tiny_model.tokenizer
    v = G.vocabulary(tok)
    assert G.vocabulary(tok) is v
    assert v.vocab_size == tok.n_vocab
    assert set(v.eos_tokens) == set(tok.eog_ids)
    text = "hello, world"
    assert v.decode_bytes(tok.encode(text, add_special=False)) == text.encode()


def allowed(c, n_vocab):
    words = np.zeros(G.mask_words(n_vocab), np.uint32)
    c.fill_mask(words)
    return set(np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:n_vocab]).tolist())


def test_special_tokens_are_not_text(tiny_model):
    """A character class never lets a special token (e.g. "<|im_end|>") through as text; a
    grammar that names the token's text gets that token (llguidance's rule)."""
    tok = tiny_model.tokenizer
    special = [i for i in range(tok.n_vocab) if tok.is_special(i)]
    assert special
    c = G.Constraint(tok, G.compile_grammar(grammar='root ::= "<" [|a-z_]+ ">"'))
    ok = allowed(c, tok.n_vocab)
    assert ok and not ok & set(special)
    name = tok.token_text(special[1])
    assert allowed(G.Constraint(tok, G.compile_grammar(grammar=f'root ::= "{name}"')), tok.n_vocab) == {special[1]}


@pytest.mark.parametrize("kw, msg", [
    (dict(grammar="root ::= undefined_rule"), "Rule 'undefined_rule' not found"),
    (dict(grammar="root ::= \"a"), "invalid grammar"),
    (dict(grammar="   "), "'grammar' is empty"),
    (dict(json_schema={"type": "strin"}), "Invalid type: strin"),
    (dict(json_schema={"type": "array", "uniqueItems": True}), 'Unimplemented keys: ["uniqueItems"]'),
    (dict(json_schema={"type": "integer", "minimum": 5, "maximum": 2}), "Unsatisfiable schema"),
    (dict(json_schema="{not json"), "'json_schema' is not valid JSON"),
    (dict(json_schema=[1]), "must be a JSON schema object"),
    (dict(grammar="root ::= \"a\"", json_schema={}), "give one constraint"),
])
def test_bad_constraints_are_request_errors_with_the_compilers_message(kw, msg):
    with pytest.raises(RequestError, match=msg.replace("[", r"\[").replace("(", r"\(")):
        G.compile_grammar(**kw)


def test_engine_refuses_a_bad_grammar_before_taking_a_slot(engine):
    step = engine.snapshot.step
    with pytest.raises(RequestError, match="not found"):
        engine.submit("x", grammar="root ::= nope")
    assert engine.snapshot.n_running == 0 and engine.snapshot.n_waiting == 0
    assert engine.snapshot.step - step < 5


def test_a_random_model_follows_a_gbnf_grammar(engine):
    g = 'root ::= "(" [a-c]+ ")" " = " [0-9]{1,3}'
    for seed in range(3):
        out = engine.generate("x", grammar=g, max_tokens=40, temperature=1.0, seed=seed)
        c = G.Constraint(engine.tokenizer, G.compile_grammar(grammar=g))
        assert out.finish_reason == "stop", out
        assert c.accepts(out.token_ids), out.text
        assert out.text.startswith("(") and ")" in out.text


def test_a_random_model_writes_json_that_validates(engine):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 9},
                                               "tag": {"enum": ["x", "y"]}},
              "required": ["n", "tag"], "additionalProperties": False}
    out = engine.generate("{", json_schema=schema, max_tokens=60, temperature=0.0)
    assert out.finish_reason == "stop", out
    jsonschema.validate(json.loads(out.text), schema)


def test_constraint_with_no_allowed_token_ends_with_finish_grammar(engine):
    """Every token the grammar allows is banned: the request ends at once, clearly, no token sent."""
    tok = engine.tokenizer
    allowed = [i for i in range(tok.n_vocab) if tok.token_bytes(i) == b"q"]
    out = engine.generate("x", grammar='root ::= "q"', max_tokens=8, temperature=0.0,
                          logit_bias={t: float("-inf") for t in allowed})
    assert out.finish_reason == "grammar" and out.token_ids == []
    assert "allows no token" in out.error


def test_constrained_greedy_is_batch_invariant(engine):
    g = 'root ::= [a-z ]{5,30} "."'
    alone = engine.generate("the", grammar=g, max_tokens=24, temperature=0.0).token_ids
    readers = [engine.submit("the", grammar=g, max_tokens=24, temperature=0.0)]
    readers += [engine.submit(f"other {k}", max_tokens=24, temperature=0.8, seed=k,
                              **({"json_schema": {"type": "object"}} if k % 2 else {})) for k in range(7)]
    results = [r.result() for r in readers]
    assert results[0].token_ids == alone
    assert all(r.finish_reason in ("stop", "length") for r in results)


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(engine):
    plain = engine.generate("abc", max_tokens=10, temperature=0.0).token_ids
    r1 = engine.submit("abc", max_tokens=10, temperature=0.0)
    r2 = engine.submit("abc", max_tokens=10, temperature=0.0, grammar='root ::= "z"+')
    assert r1.result().token_ids == plain
    assert set(r2.result().text) == {"z"}


def test_sentencepiece_vocabulary():
    """A SentencePiece vocabulary ("▁" spaces, <0xXX> byte tokens, control tokens): token bytes as
    llama.cpp renders them; a grammar's text is reached through them, never through the controls."""
    from fastserve.models.tokenizer import Tokenizer
    from tests.unit.test_tokenizer import spm_md
    tok = Tokenizer.from_metadata(spm_md())
    v = G.vocabulary(tok)
    assert v.vocab_size == tok.n_vocab and set(v.eos_tokens) == set(tok.eog_ids)
    ids = tok.encode(" abxc", add_special=False, space_prefix=False)     # a continuation: no extra space
    assert v.decode_bytes(ids) == b" abxc" and tok.token_text(ids[0]) == "\u2581ab"
    c = G.Constraint(tok, G.compile_grammar(grammar='root ::= " ab" [xc]+'))
    ok = allowed(c, tok.n_vocab)
    assert ids[0] in ok and not ok & {0, 1, 2}
    assert c.accepts(ids)
    assert not c.accepts(tok.encode(" b", add_special=False, space_prefix=False), prefix=True)


def test_a_compiled_constraint_is_submitted_as_is_and_copies_are_independent(engine):
    """Engine.constraint() compiles (any thread); submit(constraint=) takes it without a second compile, never
    beside a grammar; a copy (Constraint.copy) starts where the original stood and moves on its own."""
    g = 'root ::= [a-z ]{5,30} "."'
    c = engine.constraint(grammar=g)
    twin = c.copy()
    assert twin.matcher is not c.matcher
    want = engine.generate("the", grammar=g, max_tokens=24, temperature=0.0).token_ids
    assert engine.generate("the", constraint=c, max_tokens=24, temperature=0.0).token_ids == want
    # c's matcher has run to its end; the twin, copied before, still stands at the start
    assert engine.generate("the", constraint=twin, max_tokens=24, temperature=0.0).token_ids == want
    assert engine.constraint() is None
    with pytest.raises(RequestError, match="not both"):
        engine.submit("the", constraint=engine.constraint(grammar=g), grammar=g)
    with pytest.raises(RequestError, match="invalid grammar"):
        engine.constraint(grammar='root ::= "a')


def test_a_missing_additional_properties_closes_the_object(tiny_model):
    """As llama.cpp's schema converter: an object that lists its properties takes no others unless it says so
    (a small model otherwise adds keys until n_predict runs out); nested ones too, allOf's members not."""
    tok = tiny_model.tokenizer
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "inner": {"properties": {"n": {"type": "integer"}}}}}

    def accepts(schema, text: str) -> bool:
        return G.Constraint(tok, G.compile_grammar(json_schema=schema)).accepts(
            tok.encode(text, add_special=False), prefix=True)
    assert accepts(schema, '{"ok": true, "inner": {"n": 1}}')
    assert not accepts(schema, '{"ok": true, "name"')
    assert not accepts(schema, '{"inner": {"n": 1, "m"')
    assert accepts({**schema, "additionalProperties": True}, '{"ok": true, "name": 1}')
    assert accepts({"type": "object"}, '{"anything": [1]}')         # no properties listed: any object
    assert G.closed_objects({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}) == \
        {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert G.closed_objects({"$defs": {"x": {"properties": {}}}, "items": [{"properties": {}}]}) == \
        {"$defs": {"x": {"properties": {}, "additionalProperties": False}},
         "items": [{"properties": {}, "additionalProperties": False}]}


def test_json_whitespace_is_bounded_as_llama_cpps(tiny_model):
    """Between JSON tokens: nothing, one space, or one or two newlines and an indent of at most 20 (llama.cpp's
    space rule); a model cannot fill n_predict with blanks."""
    tok = tiny_model.tokenizer
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}

    def accepts(text: str) -> bool:
        return G.Constraint(tok, G.compile_grammar(json_schema=schema)).accepts(
            tok.encode(text, add_special=False), prefix=True)
    for fine in ('{"ok":true}', '{ "ok": true }', '{\n  "ok": true\n}', '{\n\n' + " " * 20 + '"ok"', '{\n\t"ok"'):
        assert accepts(fine), fine
    for endless in ('{  "ok"', '{\n' + " " * 21, '{\n\n\n', '{ \n', '{"ok":  '):
        assert not accepts(endless), endless
