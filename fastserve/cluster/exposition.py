"""The replicas' /metrics merged into one exposition: each family once (its HELP and TYPE), each replica's
samples under it with a `replica` label, so that sums and rates across the cluster are one PromQL away
(`sum by (le) (...)`, `sum(...)`) and no replica's figures hide another's."""
from __future__ import annotations


def _labelled(sample: str, replica: str) -> str:
    """`name{a="b"} 1` -> `name{replica="r",a="b"} 1`; `name 1` -> `name{replica="r"} 1`."""
    ends = [i for i in (sample.find("{"), sample.find(" ")) if i >= 0]
    cut = min(ends)
    if sample[cut] == "{":
        rest = sample[cut + 1:]
        return f'{sample[:cut]}{{replica="{replica}"{"," if not rest.startswith("}") else ""}{rest}'
    return f'{sample[:cut]}{{replica="{replica}"}}{sample[cut:]}'


def _families(text: str) -> dict:
    """{family: (header lines, sample lines)} in the order of the text (format 0.0.4: a family's HELP and TYPE
    come before its samples)."""
    out: dict = {}
    current = None
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            name = line.split(" ", 3)[2]
            if current is None or current[0] != name:
                current = (name, out.setdefault(name, ([], [])))
            current[1][0].append(line)
        elif not line.startswith("#") and current is not None:
            current[1][1].append(line)
    return out


def merge(texts: dict) -> str:
    """texts: {replica id: its /metrics text} -> one exposition."""
    merged: dict = {}
    for replica, text in sorted(texts.items()):
        for name, (headers, samples) in _families(text).items():
            head, body = merged.setdefault(name, (headers, []))
            body.extend(_labelled(s, replica) for s in samples)
    return "".join("\n".join(head + body) + "\n" for head, body in merged.values())
