"""The generated reference pages (docs/reference/) are current, and every config key has a description."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from relaytrain.config.docs import undescribed

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference"


def _generator():
    spec = importlib.util.spec_from_file_location("reference_generate", REFERENCE / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", ["config.md", "cli.md", "run-directory.md"])
def test_reference_page_is_current(page):
    render = _generator().PAGES[page]
    assert (REFERENCE / page).read_text() == render(), "regenerate: python docs/reference/generate.py"


def test_every_config_key_has_a_description():
    assert not undescribed(), f"config keys without a comment in config/schema.py: {undescribed()}"


def test_every_run_directory_entry_has_a_description():
    missing = [path for path, doc in _generator()._run_dir_entries() if not doc]
    assert not missing, f"RunDir members without a docstring: {missing}"


def test_every_flag_has_help():
    generate = _generator()
    missing = [
        f"{name} {generate._argument(action)}"
        for name, _, parser in generate._commands(generate.build_parser(), "")
        for action in parser._actions
        if not action.help and action.__class__.__name__ not in ("_SubParsersAction", "_HelpAction")
    ]
    assert not missing, f"flags without help: {missing}"


# A table naming this many keys of one config section is a copy of the reference (it drifts).
COPIED_KEYS = 4


def copied_key_tables(text: str) -> dict[str, list[str]]:
    """Per config section, the keys a page's tables list in their first column (several in a cell
    count each; `section.key` and a bare `key` both count), where one table lists COPIED_KEYS or more."""
    import dataclasses
    import re

    from relaytrain.config import schema

    keys = {
        section.name: {f.name for f in dataclasses.fields(section.default_factory)}
        for section in dataclasses.fields(schema.Config)
    }
    found: dict[str, list[str]] = {}
    for table in re.findall(r"(?:^\|.*\n)+", text, flags=re.M):
        first = [row.split("|")[1] for row in table.splitlines() if row.count("|") > 2]
        named = [re.sub(r"^[a-z_]+\.", "", n) for cell in first for n in re.findall(r"`([a-z_.]+)`", cell)]
        for section, section_keys in keys.items():
            listed = [n for n in named if n in section_keys]
            if len(set(listed)) >= COPIED_KEYS:
                found.setdefault(section, []).extend(listed)
    return found


def test_the_measure_finds_a_copied_key_table():
    table = "| key | meaning |\n| --- | --- |\n| `partition`, `account` | a |\n| `qos` | b |\n| `mem` | c |\n"
    assert copied_key_tables(table) == {"slurm": ["partition", "account", "qos", "mem"]}
    assert copied_key_tables(table.replace("| `mem` | c |\n", "")) == {}


@pytest.mark.parametrize(
    "page",
    [
        REFERENCE.parents[1] / "README.md",
        *(p for p in sorted(REFERENCE.parent.rglob("*.md")) if p.parent != REFERENCE),
    ],
    ids=lambda p: str(p.relative_to(REFERENCE.parents[1])),
)
def test_pages_link_to_the_reference_instead_of_copying_keys(page):
    copied = copied_key_tables(page.read_text())
    assert not copied, f"{page.name} lists config keys in a table ({copied}): link docs/reference/config.md"
