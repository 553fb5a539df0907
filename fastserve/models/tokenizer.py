"""GGUF vocabulary -> token ids and back, exactly as llama.cpp does it (src/llama-vocab.cpp).

Vocab types:
- "gpt2": byte-level BPE. llama.cpp's pre-tokenizer regexes for the model's `tokenizer.ggml.pre`
  run as a sequence of isolating splits, then the merges run in HF `tokenizers`: its BPE picks the
  lowest merge rank, leftmost on ties, the same order as llama.cpp.
- "llama": llama.cpp's SentencePiece-style tokenizer, in Python. It merges by the *merged token's
  score*, leftmost on ties; HF's BPE gives every merge pair its own rank and cannot express that.

Special tokens (CONTROL, USER_DEFINED, UNKNOWN) are cut out of the text first, longest first, as in
llama.cpp's tokenizer_st_partition. Decoding is byte-exact: token_bytes(id) is llama.cpp's
token_to_piece(special=True); pieces are joined without llama.cpp's BPE "clean_spaces" pass,
because the server streams content piece by piece without it too.
"""
from __future__ import annotations

import heapq
import operator
import re
from functools import partial
from itertools import chain
from typing import Any, Iterable

import numpy as np

from .chat_template import ChatTemplate
from ..errors import ModelLoadError, RequestError

# llama.cpp token attributes (bit flags: auto-detection below ORs CONTROL into some tokens)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 4, 8, 16, 32
_TYPE_ATTR = {1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}  # GGUF token_type
_HIDDEN = CONTROL | UNKNOWN            # rendered as "" when special tokens are skipped
_ISSPACE = " \t\n\v\f\r"               # C isspace(), used by llama.cpp's rstrip

# Pre-tokenizer regexes, verbatim from llama.cpp (llm_tokenizer_bpe); applied in order, each
# splitting the pieces of the one before (matches and the gaps between them both become pieces).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# llama.cpp's adaptation of tekken's case classes: it matches on text where every non-ASCII letter
# is collapsed to one symbol, so "[^a-z] that is a letter" stands for "upper case"; same here.
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
           r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
          r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]

# pre name -> (regexes, ignore_merges, add_bos default); names and groups as in llama_vocab::impl::load
_PRE_GROUPS: list[tuple[tuple[str, ...], list[str], bool, bool]] = [
    (("default",), _DEFAULT, False, False),
    (("gpt-2", "phi-2", "mpt", "olmo", "jais", "gigachat", "a.x-4.0", "mellum", "exaone4", "trillion",
      "granite-docling"), [_GPT2], False, False),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
     [r"\p{N}", _GPT2], False, False),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
     [_LLAMA3], True, True),
    (("dbrx", "smaug-bpe"), [_LLAMA3], False, False),
    (("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan", "grok-2"), [_QWEN2], False, False),
    (("tekken",), [_TEKKEN], True, True),
    (("gpt-4o", "llama4", "kanana2", "talkie"), [_GPT4O], False, False),
    (("falcon",), [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"], False, False),
]
_PRE = {name: (res, ign, bos) for names, res, ign, bos in _PRE_GROUPS for name in names}
SUPPORTED_MODELS = ("gpt2", "llama")

# Token texts that end generation, and the special-token roles llama.cpp detects by text when the
# GGUF has no id for them (a detected token also becomes CONTROL). FIM pad/rep/sep also end generation.
_EOG_TEXTS = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~["])
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")    # gpt-oss's harmony format
_DETECTED = {  # role -> (GGUF keys, newest first; texts)
    "eot": (("eot_token_id",), ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
            "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")),
    "eom": (("eom_token_id",), ("<|eom_id|>",)),
    "fim_pre": (("fim_pre_token_id", "prefix_token_id"), ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>",
                "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>", "<|prefix|>")),
    "fim_suf": (("fim_suf_token_id", "suffix_token_id"), ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
                "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>")),
    "fim_mid": (("fim_mid_token_id", "middle_token_id"), ("<|fim_middle|>", "<fim-middle>", "<fim_middle>",
                "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>", "<|middle|>")),
    "fim_pad": (("fim_pad_token_id",), ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
    "fim_rep": (("fim_rep_token_id",), ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
    "fim_sep": (("fim_sep_token_id",), ("<|file_sep|>",)),
}


def _byte_chars() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte -> the byte."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in keep]          # shifted to U+0100 onwards, in order
    return {**{chr(b): b for b in keep}, **{chr(256 + k): b for k, b in enumerate(moved)}}


_CHAR_BYTE = _byte_chars()
# code point -> byte for GPT-2's alphabet, -1 elsewhere (the last entry stands for every larger one)
_BYTE_OF = np.full(max(map(ord, _CHAR_BYTE)) + 2, -1, np.int16)
_BYTE_OF[[ord(c) for c in _CHAR_BYTE]] = list(_CHAR_BYTE.values())


class Tokenizer:
    """Token ids <-> text for one GGUF vocabulary. Immutable after construction; thread-safe.

    Attributes: n_vocab; bos_id, eos_id, unk_id, pad_id (None when the model has none); eog_ids (ids that
    end generation); add_bos, add_eos (what encode(add_special=True) adds); add_space_prefix;
    model ("gpt2" | "llama") and pre (the gpt2 pre-tokenizer name).
    """

    def __init__(self, md: dict[str, Any]):
        model = md.get("tokenizer.ggml.model")
        if model not in SUPPORTED_MODELS:
            raise ModelLoadError(f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
                                 f"supported: {', '.join(SUPPORTED_MODELS)}")
        self.model = model
        self._spm = model == "llama"
        tokens = md.get("tokenizer.ggml.tokens")
        if tokens is None or len(tokens) == 0:
            raise ModelLoadError("the model has no vocabulary (tokenizer.ggml.tokens is missing or empty)")
        self._text = _token_texts(tokens)
        n = self.n_vocab = len(self._text)
        self._id = dict(zip(self._text, range(n)))  # duplicates: the last id wins, as in llama.cpp
        # attributes as a NumPy array while the vocabulary is built (bulk masks), a list afterwards
        self._attr = _attributes(md.get("tokenizer.ggml.token_type"), n)
        scores = md.get("tokenizer.ggml.scores")
        scores = np.asarray(scores if scores is not None else [], np.float64)[:n].tolist()
        self._score = scores + [0.0] * (n - len(scores))

        pre = md.get("tokenizer.ggml.pre") or "default"
        add_bos_default = self._spm
        if not self._spm:
            if pre not in _PRE:
                raise ModelLoadError(f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre) for a gpt2 vocabulary; "
                                     f"supported: {', '.join(sorted(_PRE))}")
            regexes, ignore_merges, add_bos_default = _PRE[pre]
            self._hf, self._hf_unk = _build_bpe(self._id, md.get("tokenizer.ggml.merges"), regexes, ignore_merges)
        self.pre = pre if not self._spm else None
        self.add_bos = bool(md.get("tokenizer.ggml.add_bos_token", add_bos_default))
        self.add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
        self.add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", self._spm))

        def key_id(key: str, default: int | None) -> int | None:
            v = md.get("tokenizer.ggml." + key)
            if v is not None and 0 <= int(v) < n:
                return int(v)
            return default if default is not None and default < n else None   # bad id: the default
        # SPM models default to SentencePiece's ids; for gpt2 llama.cpp's default (11) is a Falcon
        # leftover, so a missing id stays None here.
        self.bos_id = key_id("bos_token_id", 1 if self._spm else None)
        self.eos_id = key_id("eos_token_id", 2 if self._spm else None)
        self.unk_id = key_id("unknown_token_id", 0 if self._spm else None)
        self.pad_id = key_id("padding_token_id", None)
        if self.add_bos and self.bos_id is None:
            raise ModelLoadError("the model asks for a BOS token (tokenizer.ggml.add_bos_token) but has no BOS id")
        if self.add_eos and self.eos_id is None:
            raise ModelLoadError("the model asks for an EOS token (tokenizer.ggml.add_eos_token) but has no EOS id")
        self.eog_ids = self._find_roles(md)
        self._specials = self._special_cache(str(md.get("general.name", "")).lower())
        self._pieces = self._all_pieces()
        self._attr = self._attr.tolist()            # per-token lookups on the hot paths: a list is faster
        # as llama-server: the model's template, else its tool_use variant, else ChatML (chat_template.py)
        self._template = ChatTemplate(md.get("tokenizer.chat_template")
                                      or md.get("tokenizer.chat_template.tool_use"),
                                      self._text[self.bos_id] if self.bos_id is not None else "",
                                      self._text[self.eos_id] if self.eos_id is not None else "")

    @classmethod
    def from_metadata(cls, md: dict[str, Any]) -> "Tokenizer":
        """Build from GGUF metadata (key -> value, as GGUFFile.metadata gives it)."""
        return cls(md)

    # ---- construction helpers -------------------------------------------------------------
    def _find_roles(self, md: dict[str, Any]) -> frozenset[int]:
        """End-of-generation ids, found like llama.cpp: GGUF ids first, then token texts."""
        role: dict[str, int | None] = {}
        for name, (keys, texts) in _DETECTED.items():
            ids = [int(md["tokenizer.ggml." + k]) for k in keys if md.get("tokenizer.ggml." + k) is not None]
            ids = [i for i in ids if 0 <= i < self.n_vocab]
            if ids:
                role[name] = ids[0]
                continue
            # llama.cpp takes the first match in hash-map order; the lowest id is our deterministic choice
            found = sorted(self._id[t] for t in texts if t in self._id)
            role[name] = found[0] if found else None
            if found:
                self._attr[found[0]] |= CONTROL
        eog = {role[r] for r in ("fim_pad", "fim_rep", "fim_sep", "eot", "eom") if role[r] is not None}
        for t in _EOG_TEXTS:
            if t in self._id:
                eog.add(self._id[t])
                self._attr[self._id[t]] |= CONTROL
        if self.eos_id is not None:
            eog.add(self.eos_id)
        for t in _ALWAYS_RENDERED:      # llama.cpp's fix for gpt-oss's harmony tokens: rendered, matched in any text
            if t in self._id:
                self._attr[self._id[t]] = USER_DEFINED
        texts = {self._text[i] for i in eog}
        end = self._id.get("<|end|>")       # o200k_harmony (solar-open): <|end|> ends a message, not the generation
        if end in eog and texts & {"<|call|>", "<|calls|>"} and texts & {"<|return|>", "<|flush|>"}:
            eog.discard(end)
            self._attr[end] = USER_DEFINED
        # (llama.cpp's further fixes by token text concern gemma4, whose pre-tokenizer is not supported here)
        return frozenset(eog)

    def _special_cache(self, model_name: str) -> list[tuple[int, str, bool]]:
        """(id, text, rstrip) of the tokens matched in raw text, longest text first."""
        ids = np.flatnonzero(self._attr & (CONTROL | USER_DEFINED | UNKNOWN)).tolist()
        ids.sort(key=lambda i: -len(self._text[i].encode()))
        rstrip = set()
        if "phi-3" in model_name or "phi3" in model_name:   # llama.cpp strips spaces after phi-3's specials
            rstrip = set(ids) | {self._id.get("</s>")}
            rstrip -= {self._id.get(t) for t in ("<unk>", "<s>", "<|endoftext|>")}
        return [(i, self._text[i], i in rstrip) for i in ids]

    def _all_pieces(self) -> list[bytes]:
        """_piece(i) of every token i, in bulk: the plain tokens (NORMAL, the bulk of any vocabulary)
        converted all at once from the vocabulary's code points, the others (special, byte, those with
        a character outside GPT-2's byte alphabet) one by one through _piece."""
        n, attr = self.n_vocab, self._attr
        plain = ((attr & NORMAL) != 0) & ((attr & (CONTROL | UNKNOWN | USER_DEFINED)) == 0)
        try:
            cps = np.frombuffer("".join(self._text).encode("utf-32-le"), np.uint32)   # code points
        except UnicodeEncodeError:          # a lone surrogate in a hand-made vocabulary
            return [self._piece(i) for i in range(n)]
        ends = np.zeros(n + 1, np.int64)    # token i's code points: cps[ends[i]:ends[i + 1]]
        np.cumsum(np.fromiter(map(len, self._text), np.int64, n), out=ends[1:])
        if self._spm:                       # "▁" is a space; UTF-8 of the rest
            cps = np.where(cps == 0x2581, 0x20, cps).astype("<u4")
            blob = cps.tobytes().decode("utf-32-le").encode("utf-8")
            at = np.zeros(len(cps) + 1, np.int64)
            np.cumsum(1 + (cps >= 0x80) + (cps >= 0x800) + (cps >= 0x10000), out=at[1:])
            ends = at[ends]
        else:                               # one byte per character of GPT-2's alphabet
            b = _BYTE_OF[np.minimum(cps, len(_BYTE_OF) - 1)]
            odd = np.flatnonzero(b < 0)
            plain[np.searchsorted(ends, odd, "right") - 1] = False
            blob = b.astype(np.uint8).tobytes()
        at = ends.tolist()
        pieces = [blob[a:z] for a, z in zip(at, at[1:])]
        for i in np.flatnonzero(~plain).tolist():
            pieces[i] = self._piece(i)
        return pieces

    def _piece(self, i: int) -> bytes:
        """llama.cpp's token_to_piece(special=True) of one token."""
        attr, text = self._attr[i], self._text[i]
        if attr & (CONTROL | UNKNOWN | USER_DEFINED):
            return text.encode()
        if attr & NORMAL:
            if self._spm:
                return text.replace("\u2581", " ").encode()
            try:
                return bytes(_CHAR_BYTE[c] for c in text)
            except KeyError:   # a character outside GPT-2's byte alphabet: llama.cpp's marker text
                return b"".join(bytes([_CHAR_BYTE[c]]) if c in _CHAR_BYTE else
                                f"[UNK_BYTE_0x{c.encode().hex()}{text}]".encode() for c in text)
        if attr & BYTE:   # "<0xXX>"
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                return b""
        return b""

    # ---- encoding ------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = True,
               space_prefix: bool = True) -> list[int]:
        """Token ids of `text`. add_special: add BOS/EOS as the model asks; parse_special: match
        special-token texts (e.g. "<|im_start|>") as those tokens instead of as plain text;
        space_prefix=False: no SentencePiece space prefix (the text continues other text)."""
        if not isinstance(text, str):
            raise RequestError(f"text to tokenize must be a str, not {type(text).__name__}")
        text = _valid_unicode(text)
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        prev_special = True   # SPM: the first text fragment, and any after a special token, get a space prefix
        for frag in self._partition(text, parse_special) if text else ():
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self._spm:
                if self.add_space_prefix and prev_special and space_prefix:
                    frag = " " + frag
                out.extend(self._spm_tokenize(frag.replace(" ", "\u2581")))
            else:
                ids = self._hf.encode(frag, add_special_tokens=False).ids
                out.extend(ids if self._hf_unk not in ids else [i for i in ids if i != self._hf_unk])
            prev_special = False
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut special tokens out of the text: str fragments (raw text) and int fragments (token ids)."""
        frags: list[str | int] = [text]
        for tid, piece, rstrip in self._specials:
            # without parse_special, user-defined tokens are still matched (llama.cpp, as HF does)
            if (not parse_special and self._attr[tid] & _HIDDEN) or piece not in text:
                continue
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or piece not in f:
                    out.append(f)
                    continue
                parts = f.split(piece)
                for k, part in enumerate(parts):
                    if k:
                        out.append(tid)
                        if rstrip:
                            part = part.lstrip(_ISSPACE)
                    if part:
                        out.append(part)
            frags = out
        return frags

    def _spm_tokenize(self, text: str) -> list[int]:
        """llama.cpp's llm_tokenizer_spm_session: merge the adjacent pair whose concatenation is the
        highest-scoring token (leftmost on ties) until none is left; unknown characters -> bytes."""
        sym = list(text)            # symbol i's text; "" once merged into its left neighbour
        n = len(sym)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        ids, score, heap = self._id, self._score, []

        def add(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                t = ids.get(sym[left] + sym[right])
                if t is not None:
                    heapq.heappush(heap, (-score[t], left, right, len(sym[left]) + len(sym[right])))

        for i in range(1, n):
            add(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
                continue   # stale: one side was merged since this pair was queued
            sym[left] += sym[right]
            sym[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            add(prv[left], left)
            add(left, nxt[left])
        out, i = [], 0
        while i != -1:
            t = ids.get(sym[i])
            if t is not None:
                out.append(t)
            else:
                out.extend(self._byte_token(b) for b in sym[i].encode())
            i = nxt[i]
        return out

    def _byte_token(self, b: int) -> int:
        t = self._id.get(f"<0x{b:02X}>")
        if t is None and b < 0x80:
            t = self._id.get(chr(b))
        if t is None:   # llama.cpp aborts the tokenization here; an unknown token is kinder
            if self.unk_id is None:
                raise RequestError(f"the vocabulary has no token for byte 0x{b:02X} and no unknown token")
            t = self.unk_id
        return t

    # ---- decoding ------------------------------------------------------------------------
    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token's piece (llama.cpp's token_to_piece with special=True)."""
        self._check(token_id)
        return self._pieces[token_id]

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry itself (e.g. "Ġworld", "<|im_end|>")."""
        self._check(token_id)
        return self._text[token_id]

    def is_special(self, token_id: int) -> bool:
        """True for control and unknown tokens (rendered as "" when special tokens are skipped)."""
        self._check(token_id)
        return bool(self._attr[token_id] & _HIDDEN)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of a token sequence. Invalid UTF-8 becomes U+FFFD. skip_special drops control tokens
        (and a leading BOS / trailing EOS the model adds), like llama.cpp's detokenize."""
        ids = list(ids)
        for i in ids:
            self._check(i)
        remove_space = self.add_space_prefix   # undo the space encode() put in front of the text
        if skip_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space, ids = False, ids[1:]
        if skip_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        pieces = [b"" if skip_special and self._attr[i] & _HIDDEN else self._pieces[i] for i in ids]
        if remove_space and pieces and pieces[0][:1] == b" ":
            pieces[0] = pieces[0][1:]
        return b"".join(pieces).decode("utf-8", "replace")

    def decoder(self, skip_special: bool = False) -> "IncrementalDecoder":
        """A fresh streaming decoder for generated tokens."""
        return IncrementalDecoder(self, skip_special)

    def _check(self, token_id: int) -> None:
        try:
            if 0 <= operator.index(token_id) < self.n_vocab:   # numpy integers are fine too
                return
        except TypeError:
            pass
        raise RequestError(f"token id {token_id!r} is not in the vocabulary [0, {self.n_vocab})")

    # ---- chat ----------------------------------------------------------------------------
    @property
    def chat_template(self) -> str:
        """The template in use: the model's, --chat-template's, or ChatML when the model has none."""
        return self._template.source

    @property
    def chat_template_is_fallback(self) -> bool:
        """The model has no template: chat uses ChatML (chat_template.CHATML), as llama-server's."""
        return self._template.fallback

    def set_chat_template(self, source: str) -> None:
        """Use source (Jinja) instead of the model's template (llama-server's --chat-template)."""
        self._template = ChatTemplate(source, self._template.bos_token, self._template.eos_token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, kwargs: dict | None = None) -> str:
        """Render the chat template (sandboxed jinja2), with OpenAI `tools` when given and further template
        variables (kwargs: enable_thinking, ...). Raises RequestError when the template refuses the messages."""
        return self._template.render(messages, add_generation_prompt, tools, kwargs)

    @property
    def chat_template_takes_tools(self) -> bool:
        return self._template.takes_tools


class IncrementalDecoder:
    """Token ids in, complete UTF-8 text out, O(piece length) per token.

    Bytes of a character split across tokens are held back until the character is complete;
    flush() returns what is left, invalid bytes as U+FFFD. Unlike decode(), no leading space is
    removed: this streams a continuation, as llama.cpp's server streams content.
    """

    __slots__ = ("_tok", "_skip", "_pending")

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._skip = skip_special
        self._pending = b""    # at most 3 bytes: the start of a character not yet complete

    def push(self, token_id: int) -> str:
        tok = self._tok
        tok._check(token_id)
        if self._skip and tok._attr[token_id] & _HIDDEN:
            return ""
        buf = self._pending + tok._pieces[token_id]
        cut = _complete_prefix(buf)
        self._pending = buf[cut:]
        return buf[:cut].decode("utf-8", "replace")

    def flush(self) -> str:
        out, self._pending = self._pending.decode("utf-8", "replace"), b""
        return out


def _complete_prefix(buf: bytes) -> int:
    """Length of `buf` without a trailing, still incomplete UTF-8 sequence."""
    n = len(buf)
    for i in range(n - 1, max(n - 4, -1), -1):
        b = buf[i]
        if b & 0xC0 == 0x80:
            continue                      # continuation byte: look further back for the lead
        need = 2 if 0xC0 <= b < 0xE0 else 3 if 0xE0 <= b < 0xF0 else 4 if 0xF0 <= b < 0xF8 else 1
        return i if n - i < need else n
    return n


def _valid_unicode(text: str) -> str:
    """Lone surrogates (e.g. from JSON "\\ud83d") cannot be UTF-8: they become U+FFFD."""
    try:
        text.encode("utf-8")      # C speed; the common case
    except UnicodeEncodeError:
        text = "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)
    return text


def _token_texts(tokens) -> list[str]:
    """llama.cpp reads token texts as C strings (cut at NUL) and renames empty ones."""
    texts = list(tokens)
    if "\0" in "".join(texts):
        texts = [t.split("\0", 1)[0] for t in texts]
    if "" in texts:
        texts = [t or f"[EMPTY_{i}]" for i, t in enumerate(texts)]
    return texts


def _attributes(types, n: int) -> np.ndarray:
    """int64 [n]: llama.cpp's attribute bits of each GGUF token_type (unknown types: 0; missing: NORMAL)."""
    attr = np.full(n, NORMAL, np.int64)
    if types is not None and len(types):
        t = np.asarray(types, np.int64)[:n]
        lut = np.array([0, *(_TYPE_ATTR[k] for k in range(1, 7)), 0], np.int64)   # 1..6; else 0
        attr[:len(t)] = lut[np.where((t >= 1) & (t <= 6), t, 7)]
    return attr


def _merge_pairs(merges, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The (left, right) pairs HF's BPE takes, in rank order, as _merge_pairs_loop gives them. The
    common case (every merge splits, none repeats, all parts known) runs at C speed: one regex over
    the joined merges, and lookups through map(); anything else goes through the loop."""
    pairs = _split_merges(merges)
    if (pairs is not None and all(map(vocab.__contains__, chain.from_iterable(pairs)))
            and all(map(vocab.__contains__, map("".join, pairs)))):
        return pairs
    return _merge_pairs_loop(merges, vocab)


def _split_merges(merges) -> list[tuple[str, str]] | None:
    """Every merge split at its first space after the first character, by one regex over the joined
    merges; None unless each splits so and none repeats (then _merge_pairs_loop's pairs, were all parts known)."""
    joined = "\n".join(merges)
    pairs = _MERGE_SPLIT.findall(joined)
    if (len(pairs) == len(merges) and joined.count("\n") == len(merges) - 1
            and len(set(merges)) == len(merges)):         # equal merges <=> equal pairs (m == a + " " + b)
        return pairs
    return None


def _merge_pairs_loop(merges, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """llama.cpp splits a merge at the first space after its first character and keeps a duplicate's
    first rank; HF needs every part, and the merged token, in the vocabulary (it panics otherwise)."""
    pairs, seen = [], set()
    for m in merges:
        p = m.find(" ", 1)
        a, b = (m[:p], m[p + 1:]) if p > 0 else (m, "")
        if (a, b) not in seen and a in vocab and b in vocab and a + b in vocab:
            seen.add((a, b))
            pairs.append((a, b))
    return pairs


_MERGE_SPLIT = re.compile(r"^(.[^ \n]*) (.*)$", re.MULTILINE)


def _build_bpe(vocab: dict[str, int], merges: list[str] | None, regexes: list[str], ignore_merges: bool):
    from tokenizers import Regex
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    if merges is None or len(merges) == 0:
        raise ModelLoadError("gpt2 vocabulary without merges (tokenizer.ggml.merges is missing)")
    # A byte with no token of its own stays a symbol in llama.cpp, blocking merges across it, and is
    # dropped only at the end; HF would drop it first. A placeholder unknown token keeps it in place.
    unk, known = None, vocab
    if not all(c in vocab for c in _CHAR_BYTE):
        unk = max(vocab.values()) + 1
        vocab = {**vocab, "\0unk": unk}       # no real token holds a NUL
    bpe = partial(models.BPE, vocab, unk_token="\0unk" if unk is not None else None, ignore_merges=ignore_merges)
    # The common case: the merges split cleanly, and HF itself checks that every part and every merged
    # token is in the vocabulary (it refuses the list otherwise), which spares _merge_pairs' own pass.
    pairs, model = _split_merges(merges), None
    if pairs is not None and unk is None:      # (with the placeholder HF's check would know one token more)
        try:
            model = bpe(merges=pairs)
        except Exception:               # "Token `x` out of vocabulary": the loop drops such merges
            model = None
    hf = HFTokenizer(model if model is not None else bpe(merges=_merge_pairs_loop(merges, known)))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), "isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return hf, unk
