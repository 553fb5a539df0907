"""The tokenizer against llama.cpp on the default model: ids must match exactly, text must round-trip.

Reference: tests/golden/data/smollm2_q41_llamacpp_greedy.json (llama.cpp's /tokenize and /completion).
"""
from __future__ import annotations

import pytest

from fastserve.models.tokenizer import Tokenizer

from tests.reference_data import GOLDEN_DATA, load_reference

_CASES = load_reference()


def _names(section: str) -> list[str]:
    return [c["name"] for c in _CASES[section]]


def _case(reference: dict, section: str, name: str) -> dict:
    return next(c for c in reference[section] if c["name"] == name)


@pytest.fixture(scope="module")
def tok(model_metadata) -> Tokenizer:
    return Tokenizer.from_metadata(model_metadata)


def _decode_stream(tok: Tokenizer, ids, skip_special: bool = False) -> list[str]:
    dec = tok.decoder(skip_special=skip_special)
    return [dec.push(i) for i in ids] + [dec.flush()]


def _assert_encodes_as_recorded(tok: Tokenizer, text: str, ids: list) -> None:
    """ids: llama.cpp's ids for text with the defaults, add_special=False, add_special=True, parse_special=False."""
    for kw, want in zip(({}, {"add_special": False}, {"add_special": True}, {"parse_special": False}), ids, strict=True):
        assert tok.encode(text, **kw) == want, kw


@pytest.mark.model
@pytest.mark.parametrize("name", _names("tokenization_cases"))
def test_tokenization_case(tok, reference, name):
    c = _case(reference, "tokenization_cases", name)
    _assert_encodes_as_recorded(tok, c["text"], [c[f"ids_{s}"] for s in ("default", "add_special_false",
                                                                          "add_special_true", "parse_special_false")])
    for p in c["pieces"]:   # a str piece is valid UTF-8; otherwise llama.cpp gave the byte values
        want = p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
        assert tok.token_bytes(p["id"]) == want, p


@pytest.mark.model
@pytest.mark.parametrize("name", _names("completions"))
def test_completion_prompt_ids(tok, reference, name):
    c = _case(reference, "completions", name)
    _assert_encodes_as_recorded(tok, c["prompt"], [c[f"prompt_token_ids{s}"] for s in (
        "", "_add_special_false", "_add_special_true", "_parse_special_false")])


@pytest.mark.model
def test_round_trip_and_streaming(tok, reference):
    texts = [c["text"] for c in reference["tokenization_cases"]] + [c["prompt"] for c in reference["completions"]]
    for text in texts:
        for ids in (tok.encode(text), tok.encode(text, parse_special=False)):
            assert tok.decode(ids) == text
            parts = _decode_stream(tok, ids)
            assert "".join(parts) == text
            assert not any("\ufffd" in p for p in parts), (text, parts)


@pytest.mark.model
@pytest.mark.parametrize("name", ["emoji", "unicode_cjk"])
def test_streaming_never_splits_a_character(tok, reference, name):
    c = _case(reference, "tokenization_cases", name)
    parts = _decode_stream(tok, c["ids_default"])
    assert "".join(parts) == c["text"]
    assert all("\ufffd" not in p for p in parts)
    # the cases do split characters across tokens, so holding bytes back is really exercised
    assert any(p == "" for p in parts[:-1])


@pytest.mark.model
@pytest.mark.parametrize("name", _names("completions"))
def test_generated_text_matches_server_content(tok, reference, name):
    """llama.cpp's server renders generated control tokens (EOS) as nothing in `content`."""
    c = _case(reference, "completions", name)
    ids = c["generated_token_ids"]
    assert "".join(_decode_stream(tok, ids, skip_special=True)) == c["content"]
    assert tok.decode(ids, skip_special=True) == c["content"]


@pytest.mark.model
def test_special_ids_and_chat_template(tok, reference):
    props = reference["metadata"]["props"]
    assert tok.n_vocab == 49152
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.add_bos is False and tok.add_eos is False
    assert tok.token_bytes(tok.bos_id).decode() == props["bos_token"]
    assert tok.token_bytes(tok.eos_id).decode() == props["eos_token"]
    # <|endoftext|> and <|im_end|> by text; <reponame> because llama.cpp takes it as the FIM repo token
    assert tok.eog_ids == frozenset({0, 2, 4})
    chat = _case(reference, "completions", "chat_chatml_system")["prompt"]
    messages = [{"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"},
                {"role": "user", "content": "Write a haiku about autumn leaves."}]
    assert tok.apply_chat_template(messages) == chat


@pytest.mark.model
def test_vocabulary_built_in_bulk_equals_token_by_token(tok, model_metadata):
    """The load-time shortcuts (pieces from the whole vocabulary's code points, merges split by one
    regex) give what the token-by-token rules give, on the real 49k vocabulary."""
    from fastserve.models.tokenizer import _merge_pairs, _merge_pairs_loop

    assert tok._pieces == [tok._piece(i) for i in range(tok.n_vocab)]
    merges = model_metadata["tokenizer.ggml.merges"]
    assert _merge_pairs(merges, tok._id) == _merge_pairs_loop(merges, tok._id)


_PRE_CASES = load_reference(GOLDEN_DATA / "pretokenizer_cases.json")["cases"]


@pytest.mark.model
@pytest.mark.parametrize("pre", sorted(_PRE_CASES))
def test_pre_tokenizer_split_as_llama_cpp(model_metadata, pre):
    """qwen2 (Qwen 2/2.5/3) and llama-bpe (Llama 3) pre-tokenizers on SmolLM2's vocabulary: llama.cpp's ids
    (recorded on the synthetic models of shared/reference, which carry this vocabulary under that pre)."""
    tok = Tokenizer.from_metadata({**model_metadata, "tokenizer.ggml.pre": pre})
    bad = [(c["name"], key) for c in _PRE_CASES[pre]
           for key, kw in (("ids_add_special_false", {"add_special": False}), ("ids_add_special_true", {}),
                           ("ids_parse_special_false", {"add_special": False, "parse_special": False}))
           if tok.encode(c["text"], **kw) != c[key]]
    assert not bad, bad
