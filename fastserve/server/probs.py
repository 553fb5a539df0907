"""Token probabilities as each API writes them: llama-server's completion_probabilities, OpenAI's
legacy logprobs and its chat logprobs. Each takes a generation's ids and, per id, the engine's top-N
(ids, probabilities) of that step and the sampled token's own probability (generation._entry): its true one,
listed or not, from the host sampler; None from the CUDA sampler, which gives none: then it is looked up among
the N (params.prob_pool makes N cover what sampling can pick; 0 when it lies outside: top_k off or above 64)."""
from __future__ import annotations

import math


def logprob(p: float) -> float:
    return math.log(p) if p > 0 else -9999.0


def _own(tid: int, top_ids: list, top_ps: list, own) -> float:
    """The sampled token's probability: the engine's own where it gave one, else the listed one."""
    return own if own is not None else next((q for t, q in zip(top_ids, top_ps) if t == tid), 0.0)


def _text(tok, tid: int) -> str:
    return tok.token_bytes(tid).decode("utf-8", "replace")


def completion_probabilities(tok, ids: list, probs: list, post: bool, k: int) -> list:
    """llama-server's entries of k alternatives: probabilities after sampling (post_sampling_probs), else
    logprobs; the sampled token's own is the engine's (or looked for among all it listed: params.prob_pool)."""
    key, top_key = ("prob", "top_probs") if post else ("logprob", "top_logprobs")
    value = (lambda p: p) if post else logprob

    def token(tid: int) -> dict:
        b = tok.token_bytes(tid)
        return {"id": tid, "token": b.decode("utf-8", "replace"), "bytes": list(b)}

    out = []
    for tid, (top_ids, top_ps, own) in zip(ids, probs):
        e = token(tid)
        e[key] = value(_own(tid, top_ids, top_ps, own))
        e[top_key] = [{**token(t), key: value(q)} for t, q in zip(top_ids[:k], top_ps[:k])]
        out.append(e)
    return out


def legacy_logprobs(tok, ids: list, probs: list, k: int, offset: int) -> dict:
    """OpenAI's /v1/completions logprobs of k alternatives; offset: the text's offset in the choice's text."""
    tokens, token_lp, top, offsets = [], [], [], []
    for tid, (top_ids, top_ps, own) in zip(ids, probs):
        text = _text(tok, tid)
        tokens.append(text)
        token_lp.append(logprob(_own(tid, top_ids, top_ps, own)))
        alts = {}       # most probable first: of two tokens that read alike (byte tokens read as U+FFFD), the first
        for t, q in zip(top_ids[:k], top_ps[:k]):
            alts.setdefault(_text(tok, t), logprob(q))
        top.append(alts)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lp, "top_logprobs": top, "text_offset": offsets}


def prompt_logprobs(tok, ids: list, scores, k: int) -> dict:
    """OpenAI's /v1/completions logprobs of an echoed prompt, k alternatives: scores (scoring.PromptScores) of
    each token given those before it; the first has none (null), as OpenAI's."""
    tokens, token_lp, top, offsets, offset = [], [None], [None], [], 0
    for tid in ids:
        text = _text(tok, tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    for i in range(1, len(ids)):
        token_lp.append(float(scores.logprobs[i]))
        alts = {}       # as legacy_logprobs: of two tokens that read alike, the more probable
        for t, q in zip(scores.top_ids[i][:k].tolist(), scores.top_logprobs[i][:k].tolist()):
            alts.setdefault(_text(tok, t), q)
        top.append(alts)
    return {"tokens": tokens, "token_logprobs": token_lp, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tok, ids: list, probs: list, k: int) -> list:
    """OpenAI's chat logprobs content of k alternatives."""
    out = []
    for tid, (top_ids, top_ps, own) in zip(ids, probs):
        b = tok.token_bytes(tid)
        out.append({"token": b.decode("utf-8", "replace"), "bytes": list(b),
                    "logprob": logprob(_own(tid, top_ids, top_ps, own)),
                    "top_logprobs": [{"token": _text(tok, t), "bytes": list(tok.token_bytes(t)), "logprob": logprob(q)}
                                     for t, q in zip(top_ids[:k], top_ps[:k])]})
    return out
