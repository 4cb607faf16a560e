"""docs/benchmarks.md's generated sections, whatever they are: every `bench:NAME` block on the page names a
bench command that exists and a bench module that writes a block of that name, and a block that says it is
"Rewritten from the kept results by `COMMAND`" comes out of that command byte for byte.

The sections are read from the page, not listed here (bench/report.py describes the convention), so a
section added with its own generator is checked as soon as it is on the page.
"""

from __future__ import annotations

import importlib.util
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

from bench.report import REWRITTEN, section_body, section_names

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "benchmarks.md"
TEXT = PAGE.read_text()
NAMES = section_names(TEXT)
# A bench command as a section names it: in backticks, or at the start of a line of a code block.
COMMAND = re.compile(
    r"(?:^|`)python (?:-m (?P<module>bench[\w.]*)|(?P<script>bench/[\w/]+\.py))(?=[\s`])", re.M
)
BENCH_SOURCES = "\n".join(p.read_text() for p in sorted((REPO / "bench").rglob("*.py")))
KEPT = [(name, m.group("command")) for name in NAMES for m in REWRITTEN.finditer(section_body(TEXT, name))]


def test_the_page_has_generated_sections_and_each_name_once():
    assert len(NAMES) == len(set(NAMES)) >= 10


@pytest.mark.parametrize("name", NAMES)
def test_each_section_names_a_bench_command_that_exists_and_bench_code_writes_its_block(name):
    body = section_body(TEXT, name)
    named = [m.groupdict() for m in COMMAND.finditer(body)]
    assert named, f"section {name!r} names no bench command (`python -m bench...` or `python bench/...`)"
    for command in named:
        if command["module"]:
            assert importlib.util.find_spec(command["module"]) is not None, f"{name}: {command['module']}"
        else:
            assert (REPO / command["script"]).is_file(), f"{name}: {command['script']} does not exist"
    assert f'"{name}"' in BENCH_SOURCES, f"no bench module writes a block named {name!r}"


def test_the_chaos_and_crash_sections_are_rebuilt_from_kept_results():
    assert {"chaos", "chaos-restart", "chaos-snapshots", "chaos-snapshot-peers", "goodput-crash"} <= {
        name for name, _ in KEPT
    }


@pytest.mark.parametrize(("name", "command"), KEPT, ids=[name for name, _ in KEPT])
def test_a_section_rebuilt_from_kept_results_comes_out_of_its_command_byte_for_byte(
    name, command, tmp_path, monkeypatch, capsys
):
    argv = shlex.split(command)
    assert argv[0] == "python" and len(argv) > 1, f"{name}: not a python command: {command}"
    copy = tmp_path / "benchmarks.md"
    copy.write_text(TEXT)
    monkeypatch.setenv("BENCH_PAGE", str(copy))  # bench.report.write_page writes the copy
    monkeypatch.chdir(REPO)
    module = argv[2] if argv[1] == "-m" else None
    args = argv[3:] if module else argv[2:]
    monkeypatch.setattr(sys, "argv", [module or argv[1], *args])
    with pytest.raises(SystemExit) as exited:  # `python -m MODULE ...` or `python bench/SCRIPT.py ...`
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(REPO / argv[1]), run_name="__main__")
            sys.exit(0)
    assert exited.value.code in (0, None), capsys.readouterr().err
    regenerated = copy.read_text()
    assert section_body(regenerated, name) == section_body(TEXT, name)
    assert regenerated == TEXT  # and nothing else on the page moved
