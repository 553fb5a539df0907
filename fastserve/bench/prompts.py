"""Prompt sets for `fastserve bench`: a built-in mix (varied English, code, chat) or a JSONL file.

A Prompt carries both forms a server may want: `text` (for /completion and /v1/completions)
and `messages` (for /v1/chat/completions). Lengths are counted in tokens by a `count(text)`
callable (a target's /tokenize, or the in-process tokenizer); `lengths` is a fixed count or a
range drawn uniformly per prompt. Built-in prompts are whole sentences of one kind, added until
the target length is reached and the last one cut at a word, so a count is met within a few tokens.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ENGLISH = [
    "The history of computing is a story of steadily shrinking machines and steadily growing ambitions.",
    "In the small village at the edge of the forest, the baker rose every morning before the sun.",
    "Researchers have long debated whether language models understand the text they produce.",
    "A good cup of coffee depends on the beans, the grind, the water temperature and patience.",
    "The river wound through the valley, carrying snowmelt from the mountains to the distant sea.",
    "Dear committee, I am writing to apply for the position of research assistant in your laboratory.",
    "Once upon a time there was a clockmaker who built a clock that could run backwards in time.",
    "The committee met on Tuesday to discuss the budget, the new library wing and the parking problem.",
    "Bees communicate the direction and distance of flowers to the hive with a short waggle dance.",
    "After the storm the harbour was quiet, and the fishermen counted the boats that had come back.",
]
CODE = [
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    middle = len(items) // 2\n",
    "for (int i = 0; i < n; ++i) {\n    sum += values[i] * weights[i];\n}\nreturn sum / n;\n",
    "SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (customer_id) GROUP BY name;\n",
    "class LRUCache:\n    def __init__(self, capacity):\n        self.capacity = capacity\n        self.items = {}\n",
    "fn parse_line(line: &str) -> Option<(u32, String)> {\n    let (id, rest) = line.split_once(',')?;\n",
    "const res = await fetch(url, { method: 'POST', body: JSON.stringify(payload) });\nconst data = await res.json();\n",
]
CHAT = [
    "Write a short poem about the ocean at night, the moon, and a lighthouse keeper who cannot sleep.",
    "Explain to a ten year old why the sky is blue and why sunsets are often red or orange.",
    "Can you give me three ideas for a vegetarian dinner that takes less than thirty minutes?",
    "What is the difference between a list and a tuple in Python, and when should I use each?",
    "Summarize the plot of a detective story in which the butler is innocent after all.",
    "How do I politely decline an invitation to a wedding of a colleague I barely know?",
]
KINDS = {"english": ENGLISH, "code": CODE, "chat": CHAT}
SENTENCES = ENGLISH[:5] + CHAT[:2] + CODE[:1] + ENGLISH[5:7]     # the in-process bench's older mix


@dataclass(frozen=True)
class Prompt:
    text: str
    kind: str                    # english | code | chat | file
    n_tokens: int | None = None  # as counted when the set was made (None: not counted)

    @property
    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.text}]


def parse_lengths(spec: str) -> tuple[int, int]:
    """'64' -> (64, 64); '60-120' -> (60, 120): prompt tokens, fixed or drawn uniformly."""
    lo, _, hi = spec.partition("-")
    try:
        lo_n, hi_n = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--prompt-tokens {spec!r}: give N or LO-HI (tokens)") from None
    if not 1 <= lo_n <= hi_n:
        raise ValueError(f"--prompt-tokens {spec!r}: need 1 <= LO <= HI")
    return lo_n, hi_n


def builtin(count, n: int, lengths: tuple[int, int], seed: int = 0) -> list[Prompt]:
    """n prompts cycling through the kinds; each of lo..hi tokens as `count(text) -> int` counts them."""
    rng = np.random.default_rng(seed)
    sizes = {s: count(s) for pool in KINDS.values() for s in pool}     # one count per sentence
    kinds = list(KINDS)
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        pool = KINDS[kind]
        target = int(rng.integers(lengths[0], lengths[1] + 1))
        parts, have = [], 0
        while have < target:
            s = pool[int(rng.integers(len(pool)))]
            if have + sizes[s] > target:      # cut the last sentence at a word, in proportion
                words = s.split(" ")
                s = " ".join(words[:max(1, len(words) * (target - have) // sizes[s])])
            parts.append(s)
            have += sizes.get(s) or count(s)
        text = " ".join(parts)
        out.append(Prompt(text, kind, count(text)))
    return out


def load_jsonl(path: str | Path) -> list[Prompt]:
    """One prompt a line: {"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]} (the last
    user message is taken) or a bare JSON string."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i}: not JSON ({exc.msg})") from None
        if isinstance(obj, str):
            text = obj
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            text = obj["prompt"]
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"]:
            text = next((m.get("content") for m in reversed(obj["messages"])
                         if isinstance(m, dict) and m.get("role") == "user"), None)
            if not isinstance(text, str):
                raise ValueError(f"{path}:{i}: 'messages' has no user message with string content")
        else:
            raise ValueError(f"{path}:{i}: expected a string, {{\"prompt\": str}} or {{\"messages\": [...]}}")
        out.append(Prompt(text, "file"))
    if not out:
        raise ValueError(f"{path}: no prompts in the file")
    return out


def make_prompts(tokenizer, n: int, lo: int = 60, hi: int = 100, seed: int = 0) -> list[list[int]]:
    """n prompts of lo..hi token ids, each a different shuffle of SENTENCES (the in-process bench's set)."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(n):
        target = int(rng.integers(lo, hi + 1))
        ids: list[int] = []
        while len(ids) < target:
            ids += tokenizer.encode(" " + SENTENCES[int(rng.integers(len(SENTENCES)))], add_special=False)
        prompts.append(ids[:target])
    return prompts
