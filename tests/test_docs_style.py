"""User pages are read by people who want to get something done: short sentences.

A page listed in SHORT_PAGES has a median sentence of at most 18 words and none over 50. Sentences are
counted in the prose only: code blocks, tables and headings are left out, an inline code span or a
link counts as one word, and each list item is a sentence of its own at least.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"

# The pages held to the limits. The other user pages are longer-sentenced still; each joins this list once
# it is rewritten.
SHORT_PAGES = [
    REPO / "README.md",
    *sorted((DOCS / "howto").glob("*.md")),
    *sorted((DOCS / "reference").glob("*.md")),
    DOCS / "model.md",
    DOCS / "local-cluster.md",
    DOCS / "elastic.md",
    DOCS / "containers.md",
    DOCS / "parallelism.md",
    DOCS / "data.md",
    DOCS / "programs.md",
    DOCS / "monitoring.md",
    DOCS / "launching.md",
    DOCS / "checkpointing.md",
    DOCS / "resilience.md",
]
MEDIAN_WORDS = 18
MAX_WORDS = 50

ITEM = re.compile(r"^([-*]|\d+\.)\s+")


def prose_units(text: str) -> list[str]:
    """The page's paragraphs and list items, joined to one line each; code, tables and headings left out."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    units: list[str] = []
    current: list[str] = []
    for line in [*text.splitlines(), ""]:
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "|")) or ITEM.match(stripped):
            if current:
                units.append(" ".join(current))
            current = [ITEM.sub("", stripped)] if ITEM.match(stripped) else []
            continue
        current.append(stripped)
    return units


def sentence_lengths(text: str) -> list[int]:
    lengths = []
    for unit in prose_units(text):
        unit = re.sub(r"`[^`]*`", "CODE", unit)
        unit = re.sub(r"\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1).replace(" ", "_") or "LINK", unit)
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z*(\[])", unit):
            if sentence.split():
                lengths.append(len(sentence.split()))
    return lengths


def test_the_measure_counts_what_a_reader_reads():
    text = "# T\n\nOne two three. Four `a b c` five.\n\n```bash\nnot counted\n```\n\n- an item\n| a |\n"
    assert sentence_lengths(text) == [3, 3, 2]


@pytest.mark.parametrize("page", SHORT_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_sentences_are_short(page):
    lengths = sentence_lengths(page.read_text())
    assert lengths, page
    long = [n for n in lengths if n > MAX_WORDS]
    assert not long, f"{page.name}: {len(long)} sentence(s) over {MAX_WORDS} words: {long}"
    assert statistics.median(lengths) <= MEDIAN_WORDS, f"{page.name}: median {statistics.median(lengths)}"
