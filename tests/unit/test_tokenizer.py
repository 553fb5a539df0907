"""Tokenizer on tiny hand-built GGUF vocabularies: expected ids worked out by hand from llama.cpp's rules."""
from __future__ import annotations

import numpy as np
import pytest

from fastserve.errors import ModelLoadError, RequestError
from fastserve.models.tokenizer import Tokenizer

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_alphabet() -> list[str]:
    """GPT-2's printable character for each byte 0..255 (spelled out here, not taken from the code under test)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra, out = 0, []
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


# ---- a byte-level BPE ("gpt2") vocabulary -----------------------------------------------------
GPT2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>"]
GPT2_MERGES = ["Ġ t", "h e", "Ġt he", "a t", "Ġ c", "Ġc at", "Ġ 1"]


def gpt2_md(**extra) -> dict:
    tokens = GPT2_SPECIALS + byte_alphabet() + ["Ġt", "he", "Ġthe", "at", "Ġc", "Ġcat", "Ġ1", "Ġdog"]
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3, 4] + [1] * (len(tokens) - 4),
        "tokenizer.ggml.merges": GPT2_MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": CHATML,
    }
    md.update(extra)
    return md


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer.from_metadata(gpt2_md())


def tid(tok: Tokenizer, text: str) -> int:
    return next(i for i in range(tok.n_vocab) if tok.token_text(i) == text)


def test_bpe_merges_by_rank(bpe):
    # " the": Ġ+t (rank 0), h+e (rank 1), then Ġt+he (rank 2); "the" alone has no t+h merge
    assert bpe.encode(" the") == [tid(bpe, "Ġthe")]
    assert bpe.encode("the") == [tid(bpe, "t"), tid(bpe, "he")]
    assert bpe.encode(" the cat") == [tid(bpe, "Ġthe"), tid(bpe, "Ġcat")]


def test_bpe_smollm_pre_tokenizer_splits_digits_and_spaces(bpe):
    # "smollm" isolates every digit first, so " 12" is " ", "1", "2" and never " 1"
    assert bpe.encode(" 12") == [tid(bpe, "Ġ"), tid(bpe, "1"), tid(bpe, "2")]
    # two spaces before a word: "\s+(?!\S)" keeps one space for the word
    assert bpe.encode("  cat") == [tid(bpe, "Ġ"), tid(bpe, "Ġcat")]


def test_bpe_pre_tokenizer_follows_the_pre_type(bpe):
    gpt2 = Tokenizer.from_metadata(gpt2_md(**{"tokenizer.ggml.pre": "gpt-2"}))
    assert gpt2.encode(" 12") == [tid(gpt2, "Ġ1"), tid(gpt2, "2")]          # " ?\p{N}+" keeps " 12" whole
    assert bpe.encode(" 12") == [tid(bpe, "Ġ"), tid(bpe, "1"), tid(bpe, "2")]


def test_bpe_llama3_ignores_merges_for_whole_words(bpe):
    # "Ġdog" has no merges leading to it: only a pre type with ignore_merges (llama3) emits it whole
    llama3 = Tokenizer.from_metadata(gpt2_md(**{"tokenizer.ggml.pre": "llama3"}))
    assert llama3.encode(" dog", add_special=False) == [tid(llama3, "Ġdog")]
    assert bpe.encode(" dog") == [tid(bpe, "Ġ"), tid(bpe, "d"), tid(bpe, "o"), tid(bpe, "g")]


def test_bpe_special_tokens(bpe):
    text = "<|im_start|>the<|im_end|>"
    assert bpe.encode(text) == [1, tid(bpe, "t"), tid(bpe, "he"), 2]
    plain = bpe.encode(text, parse_special=False)
    assert 1 not in plain and 2 not in plain
    assert plain[0] == tid(bpe, "<")
    assert bpe.decode(plain) == text
    # user-defined tokens are matched even without parse_special, as in llama.cpp
    assert bpe.encode("<tool>", parse_special=False) == [3]


def test_bpe_add_special_follows_gguf_keys():
    default = Tokenizer.from_metadata(gpt2_md())
    assert default.add_bos is False and default.encode("at") == [tid(default, "at")]
    both = Tokenizer.from_metadata(gpt2_md(**{"tokenizer.ggml.add_bos_token": True,
                                              "tokenizer.ggml.add_eos_token": True}))
    assert both.encode("at") == [1, tid(both, "at"), 2]
    assert both.encode("at", add_special=False) == [tid(both, "at")]
    assert both.encode("") == [1, 2]
    # llama3's pre-tokenizer defaults to adding BOS when the key is absent
    llama3 = Tokenizer.from_metadata(gpt2_md(**{"tokenizer.ggml.pre": "llama-bpe"}))
    assert llama3.add_bos is True and llama3.encode("at")[0] == 1


def test_bpe_decode_and_token_bytes(bpe):
    assert bpe.token_bytes(tid(bpe, "Ġcat")) == b" cat"
    assert bpe.token_bytes(1) == b"<|im_start|>"
    ids = bpe.encode("<|im_start|> the café<|im_end|>")
    assert bpe.decode(ids) == "<|im_start|> the café<|im_end|>"
    assert bpe.decode(ids, skip_special=True) == " the café"
    with pytest.raises(RequestError):
        bpe.decode([bpe.n_vocab])
    with pytest.raises(RequestError):
        bpe.token_bytes(-1)


def test_eog_ids(bpe):
    # eos, plus the end-of-text tokens llama.cpp recognises by their text
    assert bpe.eog_ids == frozenset({0, 2})
    assert tid(bpe, "<tool>") not in bpe.eog_ids


def test_eog_text_detection_marks_token_as_control():
    md = gpt2_md()
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"] + ["<|eot_id|>"]
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"] + [1]   # mislabelled NORMAL
    tok = Tokenizer.from_metadata(md)
    eot = tok.n_vocab - 1
    assert eot in tok.eog_ids
    assert tok.encode("the<|eot_id|>")[-1] == eot   # now matched as a special token
    assert tok.is_special(eot)


# ---- the incremental decoder ------------------------------------------------------------------
def test_decoder_holds_back_split_emoji(bpe):
    ids = bpe.encode("a🦙b")        # no merges for these bytes: one token per byte
    assert len(ids) == 6
    dec = bpe.decoder()
    assert [dec.push(i) for i in ids] == ["a", "", "", "", "🦙", "b"]
    assert dec.flush() == ""


def test_decoder_flush_replaces_incomplete_bytes(bpe):
    ids = bpe.encode("🦙")
    dec = bpe.decoder()
    assert dec.push(ids[0]) == "" and dec.push(ids[1]) == ""
    assert dec.flush() == "\ufffd"
    assert dec.push(tid(bpe, "at")) == "at"     # flushed: starts clean


def test_decoder_invalid_bytes_do_not_stall(bpe):
    dec = bpe.decoder()
    lone = tid(bpe, byte_alphabet()[0x9F])       # a continuation byte with no lead
    assert dec.push(lone) == "\ufffd"
    assert dec.push(tid(bpe, "at")) == "at"


def test_decoder_skip_special(bpe):
    ids = bpe.encode("<|im_start|>the<|im_end|>")
    assert "".join(bpe.decoder().push(i) for i in ids) == "<|im_start|>the<|im_end|>"
    dec = bpe.decoder(skip_special=True)
    assert "".join(dec.push(i) for i in ids) == "the"


# ---- a SentencePiece ("llama") vocabulary -------------------------------------------------------
SPM_PIECES = [("▁", -1.0), ("a", -2.0), ("b", -2.0), ("c", -2.0), ("ab", -3.0), ("bc", -3.0),
              ("▁a", -4.0), ("▁ab", -0.5), ("x", -2.0), ("▁x", -2.5)]


def spm_md(**extra) -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [p for p, _ in SPM_PIECES]
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [s for _, s in SPM_PIECES],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES),
    }
    md.update(extra)
    return md


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    return Tokenizer.from_metadata(spm_md())


def test_spm_defaults(spm):
    assert (spm.bos_id, spm.eos_id) == (1, 2)
    assert spm.add_bos is True and spm.add_eos is False and spm.add_space_prefix is True
    assert spm.eog_ids == frozenset({2})


def test_spm_equal_scores_merge_leftmost_first():
    tok = Tokenizer.from_metadata(spm_md(**{"tokenizer.ggml.add_space_prefix": False}))
    # "ab" and "bc" score the same: the left pair wins, so "abc" -> ab + c, never a + bc
    assert tok.encode("abc", add_special=False) == [tid(tok, "ab"), tid(tok, "c")]


def test_spm_merges_by_score_of_merged_token(spm):
    # "▁abc": ab (-3) merges before ▁a (-4); then ▁+ab = "▁ab" (-0.5) is the best pair left
    assert spm.encode("abc") == [1, tid(spm, "▁ab"), tid(spm, "c")]
    assert spm.encode("abc", add_special=False) == [tid(spm, "▁ab"), tid(spm, "c")]


def test_spm_space_prefix_after_special_token(spm):
    # llama.cpp puts the space prefix in front of every text fragment that follows a special token
    assert spm.encode("x</s>x", add_special=False) == [tid(spm, "▁x"), 2, tid(spm, "▁x")]
    assert spm.encode("x</s>x", add_special=False, parse_special=False)[0] == tid(spm, "▁x")


def test_spm_byte_fallback(spm):
    # "é" is not in the vocabulary: its UTF-8 bytes C3 A9 become byte tokens
    ids = spm.encode("é", add_special=False)
    assert ids == [tid(spm, "▁"), tid(spm, "<0xC3>"), tid(spm, "<0xA9>")]
    assert spm.token_bytes(tid(spm, "<0xC3>")) == b"\xc3"
    assert spm.decode(ids) == "é"
    dec = spm.decoder()
    assert [dec.push(i) for i in ids] == [" ", "", "é"]


def test_spm_decode_removes_the_space_prefix(spm):
    assert spm.token_bytes(tid(spm, "▁ab")) == b" ab"
    assert spm.decode(spm.encode("abc", add_special=False)) == "abc"
    assert spm.decode(spm.encode("abc")) == "<s> abc"          # BOS first: llama.cpp keeps the space
    assert spm.decode(spm.encode("abc"), skip_special=True) == " abc"


# ---- chat template ------------------------------------------------------------------------------
def test_chat_template_renders(bpe):
    out = bpe.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert bpe.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False) \
        == "<|im_start|>user\nhi<|im_end|>\n"


def test_chat_template_variables_and_raise_exception():
    tpl = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}"
           "{% endif %}{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}")
    tok = Tokenizer.from_metadata(gpt2_md(**{"tokenizer.chat_template": tpl}))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>hi<|im_end|>"
    with pytest.raises(RequestError, match="first message must be from the user"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])


@pytest.mark.parametrize("tpl", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% set x = [] %}{{ x.append(1) }}",
])
def test_chat_template_sandbox_refuses(tpl):
    tok = Tokenizer.from_metadata(gpt2_md(**{"tokenizer.chat_template": tpl}))
    with pytest.raises(RequestError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Hello!\n"}, {"role": "user", "content": " two  words "}]


def test_a_model_without_a_template_chats_in_chatml_as_llama_server():
    """No tokenizer.chat_template: llama-server renders ChatML (common/chat.cpp); the source its /props showed
    for such a model (Gemma 3 270M, recorded in the golden data) renders as fastserve's fallback does."""
    from fastserve.models.chat_template import CHATML, ChatTemplate
    from tests.reference_data import GOLDEN_DATA, load_reference

    llama_fallback = load_reference(GOLDEN_DATA / "gemma3_270m_q4km_llamacpp_greedy.json")["metadata"]["props"]
    theirs = ChatTemplate(llama_fallback["chat_template"])
    without = gpt2_md()
    del without["tokenizer.chat_template"]
    for md in (without, gpt2_md(**{"tokenizer.chat_template": ""})):
        tok = Tokenizer.from_metadata(md)
        assert tok.chat_template == CHATML and tok.chat_template_is_fallback
        for gen in (True, False):
            for n in (1, 2, len(CONVERSATION)):
                assert tok.apply_chat_template(CONVERSATION[:n], add_generation_prompt=gen) == \
                    theirs.render(CONVERSATION[:n], add_generation_prompt=gen)
    assert tok.apply_chat_template(CONVERSATION[1:2]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tool_use = "{{ 'T:' + messages[0]['content'] }}"        # only the tool_use variant: llama-server takes it
    tok = Tokenizer.from_metadata({**md, "tokenizer.chat_template.tool_use": tool_use})
    assert tok.apply_chat_template(CONVERSATION[1:2]) == "T:hi" and not tok.chat_template_is_fallback
    assert not Tokenizer.from_metadata(gpt2_md()).chat_template_is_fallback


def test_chat_template_broken():
    broken = Tokenizer.from_metadata(gpt2_md(**{"tokenizer.chat_template": "{% for %}"}))
    with pytest.raises(RequestError):
        broken.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(RequestError):
        broken.apply_chat_template("hi")


# ---- errors ---------------------------------------------------------------------------------------
def test_unknown_model_type_is_named():
    with pytest.raises(ModelLoadError, match=r"'bert'.*gpt2, llama"):
        Tokenizer.from_metadata(gpt2_md(**{"tokenizer.ggml.model": "bert"}))


def test_unknown_pre_type_is_named_with_the_supported_ones():
    with pytest.raises(ModelLoadError, match=r"'my-pre'.*smollm"):
        Tokenizer.from_metadata(gpt2_md(**{"tokenizer.ggml.pre": "my-pre"}))


def test_missing_vocabulary_and_merges():
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2"})
    md = gpt2_md()
    del md["tokenizer.ggml.merges"]
    with pytest.raises(ModelLoadError, match="merges"):
        Tokenizer.from_metadata(md)


def test_encode_rejects_non_text(bpe):
    with pytest.raises(RequestError):
        bpe.encode(b"bytes")
    assert bpe.decode(bpe.encode("a\ud83db")) == "a\ufffdb"   # a lone surrogate cannot be UTF-8


# ---- the vocabulary built in bulk equals the token-by-token rules ---------------------------------
def _odd_gpt2_md() -> dict:
    """A gpt2 vocabulary with every kind of token the bulk path must hand to the per-token one: a
    character outside GPT-2's byte alphabet (a raw space, a CJK character), an empty text, a text cut
    at a NUL, unknown / unused / byte types, scores and types given as NumPy arrays."""
    md = gpt2_md()
    tokens = md["tokenizer.ggml.tokens"] + ["a b", "中", "Ġé", "", "x\0y", "<0x41>", "Ġunused", "Ġodd"]
    types = md["tokenizer.ggml.token_type"] + [1, 1, 1, 1, 1, 6, 5, 9]
    md.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": np.array(types, np.int32),
               "tokenizer.ggml.scores": np.linspace(-1, 0, len(tokens), dtype=np.float32)})
    return md


@pytest.mark.parametrize("make_md", [gpt2_md, spm_md, _odd_gpt2_md], ids=["gpt2", "spm", "odd"])
def test_pieces_in_bulk_equal_token_by_token(make_md):
    tok = Tokenizer.from_metadata(make_md())
    assert tok._pieces == [tok._piece(i) for i in range(tok.n_vocab)]


def test_odd_vocabulary_texts_and_pieces():
    tok = Tokenizer.from_metadata(_odd_gpt2_md())
    n = len(gpt2_md()["tokenizer.ggml.tokens"])
    assert [tok.token_text(i) for i in range(n, n + 5)] == ["a b", "中", "Ġé", f"[EMPTY_{n + 3}]", "x"]
    assert tok.token_bytes(n) == b"a[UNK_BYTE_0x20a b]b"        # llama.cpp's marker for a raw space
    assert tok.token_bytes(n + 2) == b" \xe9"                     # é is byte 0xE9 in GPT-2's alphabet
    assert tok.token_bytes(n + 5) == b"A" and tok.token_bytes(n + 6) == b"" and tok.token_bytes(n + 7) == b""
    assert tok._score[:2] == [-1.0, float(np.float32(-1 + 1 / (tok.n_vocab - 1)))]


def test_merge_pairs_fast_path_equals_the_loop():
    from fastserve.models.tokenizer import _merge_pairs, _merge_pairs_loop

    vocab = {t: i for i, t in enumerate(gpt2_md()["tokenizer.ggml.tokens"])}
    clean = GPT2_MERGES
    assert _merge_pairs(clean, vocab) == _merge_pairs_loop(clean, vocab) == [tuple(m.split(" ")) for m in clean]
    # a duplicate, an unknown part, no space after the first character, a leading space, a newline
    messy = ["Ġ t", "h e", "Ġ t", "q zz", "he", "  x", "a\nt", "a t"]
    assert _merge_pairs(messy, vocab) == _merge_pairs_loop(messy, vocab) == [("Ġ", "t"), ("h", "e"), ("a", "t")]


def test_bpe_holds_the_merges_the_loop_keeps():
    """_build_bpe hands cleanly split merges to HF, which checks the vocabulary itself: a merge with an
    unknown part or merged token sends the whole list through the loop, as a messy one does."""
    import json

    from fastserve.models.tokenizer import _build_bpe, _merge_pairs_loop

    vocab = {t: i for i, t in enumerate(gpt2_md()["tokenizer.ggml.tokens"])}
    unknown_part, unknown_merged = ["Ġ t", "q zz", "h e"], ["Ġ t", "h e", "t Ġ"]
    for merges in (GPT2_MERGES, unknown_part, unknown_merged, ["Ġ t", "h e", "Ġ t", "  x", "a\nt", "a t"]):
        hf, unk = _build_bpe(vocab, merges, [r"\s+"], False)
        assert unk is None
        held = [tuple(p) if isinstance(p, list) else tuple(p.split(" ", 1))
                for p in json.loads(hf.to_str())["model"]["merges"]]
        assert held == _merge_pairs_loop(merges, vocab), merges
