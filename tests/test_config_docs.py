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
