"""docs/benchmarks.md, every section of it, with no opt-in: each `bench:NAME` block is rebuilt from kept
results by the command it names (it says "Rewritten from the kept results by `COMMAND`": the command is
run against a copy of the page and the block must come out byte for byte), written from code alone
(bench/unkept_sections.FROM_CODE: compared with the function that writes it), or listed in
bench/unkept_sections.UNKEPT with its reason, which the block says, and its text pinned by digest. Outside
the blocks the page holds no figure, and every kept results file is named on a page.

The sections are read from the page, not listed here (bench/report.py describes the convention), so a
section added with its own generator is checked as soon as it is on the page.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

from bench.report import REWRITTEN, section_body, section_names
from bench.unkept_sections import FROM_CODE, HISTORY, NO_SOURCE, UNKEPT, digest, sources_line

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "benchmarks.md"
TEXT = PAGE.read_text()
NAMES = section_names(TEXT)
BLOCKS = re.compile(r"<!-- bench:(?P<name>[\w.-]+) -->\n?.*?<!-- /bench:(?P=name) -->\n?", re.S)
# A bench command as a section names it: in backticks, or at the start of a line of a code block.
COMMAND = re.compile(
    r"(?:^|`)python (?:-m (?P<module>bench[\w.]*)|(?P<script>bench/[\w/]+\.py))(?=[\s`])", re.M
)
BENCH_SOURCES = "\n".join(p.read_text() for p in sorted((REPO / "bench").rglob("*.py")))
KEPT = [(name, m.group("command")) for name in NAMES for m in REWRITTEN.finditer(section_body(TEXT, name))]
REBUILT = {name for name, _ in KEPT}


def test_the_page_has_generated_sections_and_each_name_once():
    assert len(NAMES) == len(set(NAMES)) >= 10


@pytest.mark.parametrize("name", NAMES)
def test_every_section_is_rebuilt_from_kept_results_written_from_code_or_listed_with_its_reason(name):
    kinds = [name in REBUILT, name in FROM_CODE, name in UNKEPT]
    assert sum(kinds) == 1, (
        f"section {name!r} must be exactly one of: rebuilt from kept results (it says 'Rewritten from the "
        "kept results by `COMMAND`'), written from code (bench/unkept_sections.FROM_CODE), or listed in "
        f"bench/unkept_sections.UNKEPT with its reason; it is {kinds}"
    )


def test_every_listed_section_is_on_the_page():
    assert set(UNKEPT) | set(FROM_CODE) <= set(NAMES)


def test_outside_the_sections_the_page_holds_no_figure_and_no_heading_of_its_own():
    outside = BLOCKS.sub("", TEXT)
    assert not re.search(r"\d", outside), f"a figure outside every section: {outside!r}"
    assert [line for line in outside.splitlines() if line.startswith("#")] == ["# Benchmarks"]


@pytest.mark.parametrize("name", sorted(UNKEPT))
def test_a_listed_section_says_its_reason_and_is_pinned_by_its_digest(name):
    body = section_body(TEXT, name)
    assert UNKEPT[name].reason in body, f"section {name!r} does not say its reason: {UNKEPT[name].reason}"
    assert digest(body) == UNKEPT[name].sha256, (
        f"section {name!r} changed, but it is not rebuilt from kept results: its figures are pinned. Rebuild "
        "it from a run's kept results (then remove it from bench/unkept_sections.UNKEPT), or, for a "
        "correction of the transcription itself, change its digest there in the same commit"
    )


@pytest.mark.parametrize("name", sorted(FROM_CODE))
def test_a_section_written_from_code_is_what_its_function_writes(name):
    module, function = FROM_CODE[name].split(":")
    written = getattr(importlib.import_module(module), function)()
    assert section_body(TEXT, name) == written.rstrip() + "\n"


@pytest.mark.parametrize("name", [n for n in NAMES if n not in UNKEPT])
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


def test_the_chaos_crash_and_goodput_sections_are_rebuilt_from_kept_results():
    assert {"chaos", "chaos-restart", "chaos-snapshots", "chaos-snapshot-peers", "goodput-crash"} <= REBUILT
    assert {"goodput-extrapolation", "fault-matrix", "straggler-rules", "snapshot-budget"} <= REBUILT


def test_the_sections_python_m_bench_measures_on_cpu_are_rebuilt_from_its_kept_runs():
    assert {"machine", "matmul-peak", "overhead", "startup", "checkpoint-io-run"} <= REBUILT


def test_the_parallel_layouts_figures_are_rebuilt_here_and_docs_parallelism_md_links_them():
    """docs/parallelism.md keeps which layout runs where; its tokens/s are this page's, from kept runs."""
    assert "parallel-layouts" in REBUILT
    user_page = (REPO / "docs" / "parallelism.md").read_text()
    assert "benchmarks.md#parallel-layouts-on-cpu" in user_page
    assert "tokens/s |" not in user_page and "step (s)" not in user_page, "a table of figures on a user page"


def test_the_parallel_layouts_line_of_docs_parallelism_md_runs_as_written(tmp_path, monkeypatch, capsys):
    """The page's command, as it writes it, with one layout and two steps appended (every layout takes
    minutes of CPU): it times that layout, keeps its results (here under tmp_path) and prints the section."""
    from test_docs_cli import bash_lines

    from bench import kept

    page = REPO / "docs" / "parallelism.md"
    (line,) = [line for line in bash_lines(page) if line.startswith("python -m bench.parallel_layouts")]
    argv = [*shlex.split(line), "--layouts=single", "--steps=2", "--no-write"]
    monkeypatch.setattr(kept, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(sys, "argv", [argv[2], *argv[3:]])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    assert exited.value.code in (0, None), capsys.readouterr().err
    (path,) = tmp_path.glob("parallel-layouts-*.json")
    data = kept.load(path)
    assert [row["case"] for row in data["rows"]] == ["single"] and data["rows"][0]["tokens_per_s"] > 0
    assert data["command"] == "python -m bench.parallel_layouts --steps=2 --layouts=single"
    assert "| 1 | one process |" in capsys.readouterr().out


def test_parallel_layouts_refuses_a_layout_it_does_not_know(tmp_path, monkeypatch, capsys):
    from bench import kept, parallel_layouts

    monkeypatch.setattr(kept, "RESULTS_DIR", tmp_path)
    with pytest.raises(SystemExit) as exited:
        parallel_layouts.main(["--layouts=fsdp,fsdp_2d", "--no-write"])
    assert exited.value.code == 2 and "no such layout: fsdp_2d" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_every_kept_results_file_is_named_on_a_page():
    """No kept run disappears: each file under bench/results/ is named by the section that shows it (or,
    for inputs of other pages, by that page)."""
    pages = TEXT + "".join(p.read_text() for p in sorted((REPO / "docs").rglob("*.md")))
    kept = sorted(p.name for p in (REPO / "bench" / "results").glob("*.json"))
    assert kept and [name for name in kept if name not in pages] == []


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


def test_the_readme_states_the_figures_of_the_latest_kept_run_of_its_first_command():
    """README.md's time and losses of `relaytrain train` are the last kept `python -m bench.quickstart`
    run's, as bench/quickstart.readme_figures words them (the README's line breaks aside)."""
    from bench import kept, quickstart

    runs = quickstart.kept_runs()
    assert runs, "no kept run of `python -m bench.quickstart` under bench/results/"
    sentence = quickstart.readme_figures(kept.load(runs[-1]), kept.relative(runs[-1]))
    readme = " ".join((REPO / "README.md").read_text().split())
    assert sentence in readme, f"README.md must say, word for word: {sentence}"


RESULTS_NAMED = re.compile(r"bench/results/[\w./-]+?\.json")


@pytest.mark.parametrize("name", sorted(REBUILT))
def test_a_section_rebuilt_from_a_transcribed_kept_file_says_it_is_transcribed(name):
    """A kept file copied from an earlier page (its `transcribed` field, bench/kept.py) is history, not a
    measurement: the section rebuilt from it says so in the file's own words."""
    import json

    body = " ".join(section_body(TEXT, name).split())
    for path in sorted(set(RESULTS_NAMED.findall(body))):
        if not (REPO / path).is_file():  # a pattern such as bench/results/simulated/ID.json
            continue
        said = json.loads((REPO / path).read_text()).get("transcribed")
        if said:
            assert " ".join(said.split()).rstrip(".") in body, f"{name}: {path} is a transcription; say so"


@pytest.mark.parametrize("name", sorted(n for n, u in UNKEPT.items() if u.reason.startswith(HISTORY)))
def test_kept_history_names_the_kept_results_its_figures_come_from_or_says_none_does(name):
    """A section kept as history (not rebuilt) names its source results files, each one kept under
    bench/results/, in one sentence; a history with none says that no results file holds its figures."""
    unkept = UNKEPT[name]
    body = " ".join(section_body(TEXT, name).split())
    if not unkept.sources:
        assert NO_SOURCE in unkept.reason, f"{name}: name its kept results, or say {NO_SOURCE!r}"
        return
    missing = [path for path in unkept.sources if not (REPO / path).is_file()]
    assert missing == [], f"{name}: its sources are not kept: {missing}"
    assert sources_line(unkept) in body, f"{name} must say: {sources_line(unkept)}"


def test_the_hand_written_histories_are_marked_as_kept_history():
    assert {"straggler-history", "checkpoint-history"} <= {
        name for name, unkept in UNKEPT.items() if unkept.reason.startswith(HISTORY)
    }
