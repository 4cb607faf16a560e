"""README.md and docs/ are read on other machines: they name only what a user there can open or run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from relaytrain.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

# Paths of the machine the project is developed on, and words about how it is developed.
FOREIGN = re.compile(
    r"/work/|/opt/wheels|\.\./shared|shared/notes|\bseed (?:document|0\d\d)|this session|device tool"
    r"|subagent|other engineers"
)


def _subcommands() -> set[str]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return set(sub.choices)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_docs_name_nothing_outside_the_repository(doc):
    hits = [
        f"{doc.name}:{number}: {line.strip()}"
        for number, line in enumerate(doc.read_text().splitlines(), 1)
        if FOREIGN.search(line)
    ]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_docs_name_only_existing_commands(doc):
    commands = _subcommands()
    text = doc.read_text()
    code = re.findall(r"^```.*?^```", text, re.S | re.M) + re.findall(r"`([^`\n]+)`", text)
    # `relaytrain WORD` at the start of a command in a code span or block, WORD a subcommand's shape.
    lines = [re.sub(r"(^|\s)#.*", "", line) for snippet in code for line in snippet.splitlines()]
    named = {
        word
        for line in lines
        for word in re.findall(r"(?<!from )(?:^|(?<=[\s;&|(]))relaytrain ([a-z][a-z-]+)\b", line)
    }
    unknown = sorted(named - commands)
    assert not unknown, f"{doc.name} names relaytrain commands that do not exist: {unknown}"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    """A link to another page (and its section) of the repository names one that exists."""
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", link) or link.startswith("#"):
            continue
        path, _, anchor = link.partition("#")
        target = (doc.parent / path).resolve()
        if not target.exists() or (anchor and target.suffix == ".md" and anchor not in _anchors(target)):
            broken.append(link)
    assert not broken, f"{doc.name}: {broken}"
