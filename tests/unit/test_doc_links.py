"""Every relative link in README.md, ARCHITECTURE.md and docs/*.md points at a file or folder that exists."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")     # [text](target "title")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)                  # http:, https:, mailto:, ...


def links(text: str) -> list[str]:
    """Targets of the inline links outside code (a link's text may itself be `code`)."""
    return LINK.findall(CODE.sub("", FENCE.sub("", text)))       # [`x`](y) keeps its target: [](y)


def test_links_are_found():
    assert links("see [a](docs/a.md), [`b`](b.py) and `[x](not-a-link)`\n```\n[c](c.md)\n```\n") == [
        "docs/a.md", "b.py"]


def test_the_documents_exist():
    assert (ROOT / "docs").is_dir() and len(DOCUMENTS) > 2


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = []
    for target in links(doc.read_text()):
        if EXTERNAL.match(target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (doc.parent / path).exists():
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links to files that do not exist: {broken}"
