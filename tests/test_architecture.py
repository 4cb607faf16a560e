"""The layer rule of docs/architecture.md: a package imports only packages of strictly lower layers.

Imports are read from the source (also those inside functions, the lazy `_EXPORTS` tables and the
CLI's `COMMAND_MODULES`), so an import hidden in a function body cannot break the rule unseen. No
module imports itself through others (an `if __name__ == "__main__":` block counts), and no source file,
the batch script's template included, grows past the size limit.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from relaytrain.job import RunDir

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "relaytrain"
BENCH = ROOT / "bench"  # the benchmarks: the same size limit and no import circle (not layered)
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"

# Bottom to top; the same table is drawn in docs/architecture.md.
LAYERS: list[set[str]] = [
    # leaves; torch_private: the seam to torch's privates (job/torchrun.py patches torchrun through it)
    {"errors", "lazy", "version", "torch_private", "atomic", "entry_points"},
    {"job"},  # the in-job layer: facts of the job this process runs in
    {"config"},
    {"model", "data", "optim"},
    {"parallel", "checkpoint", "resilience", "monitor"},
    {"plan"},  # the memory model and estimates of `relaytrain plan`: pure, no Slurm
    {"slurm", "localcluster", "preflight"},  # login-node side: launcher and job tools; the local test cluster
    {"inspection"},  # status, logs, report, verify: a run directory read back (a job id: slurm/)
    {"trainer", "program"},
    {"cli", "__init__"},
]
LAYER_OF = {name: i for i, layer in enumerate(LAYERS) for name in layer}
MODULE_RE = re.compile(r"^relaytrain\.([a-z_]+)(\.[a-z_]+)*$")


def _unit(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_units(tree: ast.AST) -> set[str]:
    found: set[str] = set()

    def add(module: str) -> None:
        match = MODULE_RE.match(module)
        if match:
            found.add(match.group(1))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                # `import relaytrain` runs the top package; `import relaytrain.x.y` runs it too, but
                # only the way down to x matters for the rule (the package's __init__ imports nothing).
                add("relaytrain.__init__" if alias.name == "relaytrain" else alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError("relative imports hide their target from this test: use relaytrain.x")
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "relaytrain":
                for alias in node.names:
                    # `from relaytrain import program` imports a module; `from relaytrain import
                    # load_model` takes a name from the top package.
                    is_module = (SRC / alias.name).is_dir() or (SRC / f"{alias.name}.py").is_file()
                    add(f"relaytrain.{alias.name}" if is_module else "relaytrain.__init__")
            else:
                add(node.module)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id in ("_EXPORTS", "COMMAND_MODULES") for t in node.targets
        ):
            for const in ast.walk(node.value):
                if isinstance(const, ast.Constant) and isinstance(const.value, str):
                    add(const.value)
    return found


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        unit = _unit(path)
        targets = _imported_units(ast.parse(path.read_text(), filename=str(path))) - {unit}
        edges.setdefault(unit, set()).update(targets)
    return edges


def test_every_package_has_a_layer():
    units = {_unit(p) for p in SRC.rglob("*.py")}
    missing = sorted(u for u in units if u not in LAYER_OF)
    assert not missing, f"add {missing} to LAYERS here and to docs/architecture.md"


def test_lower_layers_never_import_higher_ones():
    violations = [
        f"{unit} (layer {LAYER_OF[unit]}) imports {target} (layer {LAYER_OF[target]})"
        for unit, targets in sorted(_edges().items())
        for target in sorted(targets)
        if target in LAYER_OF and unit in LAYER_OF and LAYER_OF[target] >= LAYER_OF[unit]
    ]
    assert not violations, "\n".join(violations)


def test_only_the_in_job_layer_reads_slurm_variables_inside_a_job():
    # The launcher (slurm/) and the local cluster write SLURM_* into scripts and configs; inside a
    # job only relaytrain.job reads them.
    readers = sorted(
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if _unit(p) not in ("job", "slurm", "localcluster")
        and re.search(r"[\"']SLURM_[A-Z_]+", p.read_text())
    )
    assert not readers, f"these read SLURM_* variables; ask relaytrain.job.JobFacts instead: {readers}"


@pytest.mark.parametrize("layer", range(len(LAYERS)))
def test_the_architecture_page_draws_each_layer(layer):
    text = ARCHITECTURE.read_text()
    for name in LAYERS[layer]:
        shown = {"__init__": "relaytrain/__init__", "lazy": "lazy"}.get(name, name)
        assert shown in text, f"docs/architecture.md does not mention {shown}"


def test_the_rule_catches_an_upward_import(tmp_path):
    tree = ast.parse("def f():\n    from relaytrain.trainer import Trainer\n")
    assert "trainer" in _imported_units(tree)


@pytest.mark.parametrize(
    "source",
    ["import relaytrain\n", "from relaytrain import __version__\n", "from relaytrain import load_model\n"],
)
def test_the_rule_sees_an_import_of_the_top_package(source):
    assert _imported_units(ast.parse(source)) == {"__init__"}


def test_from_relaytrain_import_a_module_names_the_module():
    assert _imported_units(ast.parse("from relaytrain import program, checkpoint\n")) == {
        "program",
        "checkpoint",
    }


MAX_LINES = 400
# A file that cannot be split yet, with the reason; empty: every file fits.
OVERSIZED: dict[str, str] = {}


def _counted_files() -> list[Path]:
    """The Python modules, and the templates of the generated scripts: a batch script is a program;
    the benchmarks' modules and scripts too."""
    return sorted([*SRC.rglob("*.py"), *SRC.rglob("*.j2"), *BENCH.rglob("*.py"), *BENCH.rglob("*.sh")])


def test_no_source_file_is_longer_than_the_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in _counted_files()
        if (n := len(p.read_text().splitlines())) > MAX_LINES and str(p.relative_to(ROOT)) not in OVERSIZED
    }
    assert not long, f"split these by responsibility (at most {MAX_LINES} lines each): {long}"


MAX_FORMAT_SKIPS = 10  # `# fmt: skip` lines in src/: the line limit is met by splitting, not packing


def test_the_line_limit_is_not_met_by_packing_lines():
    skips = {
        str(p.relative_to(ROOT)): n
        for p in sorted(SRC.rglob("*.py"))
        if (n := sum(line.rstrip().endswith("# fmt: skip") for line in p.read_text().splitlines()))
    }
    assert sum(skips.values()) < MAX_FORMAT_SKIPS, f"let the formatter lay these out: {skips}"


def test_the_size_limit_counts_the_batch_script_template_and_the_benchmarks():
    counted = _counted_files()
    assert SRC / "slurm" / "templates" / "job.sh.j2" in counted and BENCH / "overhead.py" in counted
    assert BENCH / "cluster" / "goodput.py" in counted


def _imports_of(source: str) -> set[str]:
    """Every module name a source imports, anywhere in its body: a function's, and an
    `if __name__ == "__main__":` block's too (run as `python -m`, an alias handing over to another
    module's main still ties the two modules together)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def _module_imports() -> dict[str, set[str]]:
    """Module -> the modules of the package and of the benchmarks it imports, e.g.
    relaytrain.checkpoint.files, bench.cluster.goodput."""
    modules = {}
    for base, folder in ((SRC.parent, SRC), (ROOT, BENCH)):
        for path in folder.rglob("*.py"):
            name = ".".join(path.relative_to(base).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return {
        name: {m for m in _imports_of(path.read_text()) if m in modules and m != name}
        for name, path in modules.items()
    }


def test_no_module_imports_itself_through_others():
    graph, finished = _module_imports(), set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join(path[path.index(module) :] + (module,))}"
        if module not in finished:
            for target in sorted(graph[module]):
                visit(target, path + (module,))
            finished.add(module)

    for module in sorted(graph):
        visit(module, ())


def test_the_cycle_check_sees_a_cycle(monkeypatch):
    graph = {"relaytrain.a": {"relaytrain.b"}, "relaytrain.b": {"relaytrain.a"}}
    monkeypatch.setattr(sys.modules[__name__], "_module_imports", lambda: graph)
    with pytest.raises(AssertionError, match="import cycle: relaytrain.a -> relaytrain.b -> relaytrain.a"):
        test_no_module_imports_itself_through_others()


def test_the_cycle_check_reads_the_benchmarks():
    graph = _module_imports()
    assert "bench.cluster.goodput_extrapolation" in graph["bench.cluster.goodput_crash_extrapolation"]


def test_a_main_block_alias_counts_as_an_import():
    alias = 'if __name__ == "__main__":\n    from relaytrain.resilience.batch.step_end import main\n'
    assert "relaytrain.resilience.batch.step_end" in _imports_of(alias)


def test_the_architecture_page_names_every_checkpoint_module():
    text = ARCHITECTURE.read_text()
    section = text[text.index("## Inside checkpoint/") : text.index("## The launch path")]
    modules = [p.name for p in sorted((SRC / "checkpoint").glob("*.py")) if p.stem != "__init__"]
    missing = [name for name in modules if f"`{name}`" not in section]
    assert not missing, f"docs/architecture.md's checkpoint/ table does not list {missing}"


def _names_used_in(folder: Path) -> set[str]:
    used: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            used |= (
                {node.id}
                if isinstance(node, ast.Name)
                else {node.attr}
                if isinstance(node, ast.Attribute)
                else set()
            )
    return used  # fmt: skip


def test_the_package_keeps_no_helper_only_the_benchmarks_use():
    """A function or constant of relaytrain that the benchmarks import is used by relaytrain itself: the
    helpers that read kept runs back (replays, earlier record formats) live in bench/."""
    used, bench_only = _names_used_in(SRC), []
    for path in sorted(BENCH.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("relaytrain."):
                bench_only += [
                    f"{path.relative_to(ROOT)}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name not in used
                    and not (SRC / f"{alias.name}.py").exists()
                    and not (SRC / alias.name).is_dir()
                ]
    assert not bench_only, "move these to bench/ (only the benchmarks use them):\n" + "\n".join(bench_only)


PATH_IN_DOC = re.compile(r"`((?:[a-z_]+/)+(?:[a-z_0-9]+\.(?:py|j2))?)`")


def _doc_path_exists(path: str) -> bool:
    """A path the page names: inside the package (``checkpoint/front.py``, ``slurm/templates/job.sh.j2``),
    inside a package the row is about (``snapshot/``), or at the top of the repository (``faults/``)."""
    candidates = [SRC / path, ROOT / path, *[d / path for d in SRC.rglob("*") if d.is_dir()]]
    return path in _run_dir_folders() or any(c.exists() for c in candidates)


def _run_dir_folders() -> set[str]:
    """The folders RunDir names at the top of a run directory (`logs/`, `samples/`, ...)."""
    run = RunDir(Path("/run"))
    paths = [getattr(run, name) for name in dir(RunDir) if isinstance(getattr(RunDir, name), property)]
    return {f"{p.name}/" for p in paths if isinstance(p, Path) and p.parent == run.root}


def test_every_path_the_architecture_page_names_exists():
    named = set(PATH_IN_DOC.findall(ARCHITECTURE.read_text()))
    missing = sorted(p for p in named if not _doc_path_exists(p))
    assert named and not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_the_path_check_sees_a_missing_module():
    assert not _doc_path_exists("resilience/no_such_module.py") and _doc_path_exists("checkpoint/front.py")


def test_every_entry_point_the_architecture_page_names_runs_as_a_module():
    """`python -m relaytrain.X` (a process the launch drawing starts) is a module with a main block, or a
    package with __main__.py."""
    text = ARCHITECTURE.read_text()
    named = set(re.findall(r"python -m\s+(relaytrain(?:\.[a-z_]+)+)", text))
    broken = []
    for module in sorted(named):
        path = SRC.parent.joinpath(*module.split("."))
        main = path / "__main__.py" if path.is_dir() else path.with_suffix(".py")
        if not main.is_file() or (
            main.name != "__main__.py" and '__name__ == "__main__"' not in main.read_text()
        ):
            broken.append(module)
    assert {"relaytrain.job.task", "relaytrain.resilience.batch.driver"} <= named and not broken, broken


def test_the_batch_template_only_hands_over():
    lines = len((SRC / "slurm" / "templates" / "job.sh.j2").read_text().splitlines())
    assert lines <= 150, f"job.sh.j2 has {lines} lines: move what it computes into the driver"


# Processes: every `python -m relaytrain.X` is a row of relaytrain/entry_points.py, and a module that starts
# one names it through the table, so each process edge is an arrow the layer rule checks.
from relaytrain.entry_points import ENTRY_POINTS  # noqa: E402

TABLE = SRC / "entry_points.py"
RUN_BY_NAME = re.compile(r"-m\s+relaytrain\.|import relaytrain\.")
# Process edges against the layer rule, each with its reason; a new one fails, one gone fails too.
UPWARD_PROCESS_EDGES: dict[tuple[str, str], str] = {
    ("relaytrain.job.task", "relaytrain.resilience.hangs.watch"): (
        "the task wrapper (no torch import, so layer 1) starts the node's helpers beside the ranks"
    ),
    ("relaytrain.job.task", "relaytrain.monitor.gpu_monitor"): "as the hang watcher",
    (
        "relaytrain.slurm.script",
        "relaytrain.cli",
    ): "each task of a job step runs `relaytrain train`, as a person would",
    ("relaytrain.preflight.commands", "relaytrain.cli"): "`relaytrain preflight` runs itself again as ranks",
    ("relaytrain.resilience.batch.driver", "relaytrain.checkpoint.snapshot"): (
        "the batch job frees the nodes' snapshots with the snapshot tier's own cleanup (one layer)"
    ),
}


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr)
    }


def _process_names(paths: list[Path]) -> list[str]:
    """Strings that start one of relaytrain's processes by name (`"relaytrain.job.task"`, `-m relaytrain.x`,
    a template's `-m relaytrain.x` or `import relaytrain.x`), outside docstrings and the table."""
    modules, found = {e.module for e in ENTRY_POINTS}, []
    for path in paths:
        text = path.read_text()
        if path.suffix != ".py":
            found += [
                f"{path.name}:{i}" for i, line in enumerate(text.splitlines(), 1) if RUN_BY_NAME.search(line)
            ]
            continue
        tree = ast.parse(text)
        skip = _docstrings(tree)
        found += [
            f"{path.name}:{node.lineno}: {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in skip
            and (node.value in modules or re.search(r"-m\s+relaytrain\.", node.value))
        ]
    return found


def test_no_process_is_started_by_a_name_outside_the_table():
    paths = [p for p in sorted([*SRC.rglob("*.py"), *SRC.rglob("*.j2")]) if p != TABLE]
    found = _process_names(paths)
    assert not found, f"name these processes through relaytrain.entry_points: {found}"


def test_the_table_check_sees_a_process_started_by_name(tmp_path):
    planted = tmp_path / "starter.py"
    planted.write_text('"""python -m relaytrain.job.task in a docstring is fine."""\nimport subprocess\n')
    assert not _process_names([planted])
    planted.write_text(planted.read_text() + 'subprocess.run(["python", "-m", "relaytrain.job.task"])\n')
    template = tmp_path / "job.sh.j2"
    template.write_text("srun python -m relaytrain.cli train\n")
    assert len(_process_names([planted, template])) == 2


def _runnable_modules() -> set[str]:
    found = set()
    for path in SRC.rglob("*.py"):
        name = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
        if path.name == "__main__.py":
            found.add(name.removesuffix(".__main__"))
        elif '__name__ == "__main__"' in path.read_text():
            found.add(name)
    return found


def test_every_entry_point_is_a_row_of_the_table():
    assert _runnable_modules() == {e.module for e in ENTRY_POINTS}


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")


def test_each_starter_is_declared_in_the_table():
    """A module that imports an entry point's name from the table starts that process (or is it)."""
    import relaytrain.entry_points as table

    used: set[tuple[str, str]] = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "relaytrain.entry_points":
                starter = _module_of(path).removesuffix(".__main__")
                used |= {(starter, getattr(table, a.name)) for a in node.names if a.name.isupper()}
    used = {(starter, module) for starter, module in used if starter != module}
    declared = {(starter, e.module) for e in ENTRY_POINTS for starter in e.started_by if starter != e.module}
    assert used == declared, (
        f"starting, not declared: {used - declared}; declared, not starting: {declared - used}"
    )


def _unit_of(module: str) -> str:
    return module.split(".")[1]


def test_process_edges_follow_the_layer_rule():
    edges = {(starter, e.module) for e in ENTRY_POINTS for starter in e.started_by}
    upward = {
        (a, b)
        for a, b in edges
        if _unit_of(a) != _unit_of(b) and LAYER_OF[_unit_of(b)] >= LAYER_OF[_unit_of(a)]
    }
    new = sorted(upward - set(UPWARD_PROCESS_EDGES))
    gone = sorted(set(UPWARD_PROCESS_EDGES) - upward)
    assert not new and not gone, f"process edges against the layer rule: {new}; listed but gone: {gone}"


def test_the_launch_drawing_shows_the_processes_of_a_job():
    text = ARCHITECTURE.read_text()
    section = text[text.index("## The launch path") :]
    drawing = section.split("```")[1]
    named = set(re.findall(r"relaytrain(?:\.[a-z_]+)+", drawing))
    assert named == {e.module for e in ENTRY_POINTS if e.in_job}


def _drawn_layers() -> dict[str, int]:
    """The layer drawing of docs/architecture.md read back: package or module -> its layer. Names stand
    left of column 44, where the descriptions begin (a line of names only may run on)."""
    block = ARCHITECTURE.read_text().split("## The layers", 1)[1].split("```")[1]
    drawn: dict[str, int] = {}
    layer = -1
    for line in block.splitlines():
        if match := re.match(r"^\s?(\d)\s", line):
            layer = int(match.group(1))
        names = line if len(line) > 44 and line[43] != " " else line[:44]
        for token in re.findall(r"relaytrain/__init__|\b[a-z_]+/|\b[a-z_]+\.py\b", names):
            name = token.removesuffix("/").removesuffix(".py")
            name = "__init__" if token == "relaytrain/__init__" else name
            drawn[name] = layer
    return drawn


def test_the_layer_drawing_is_the_layer_rule():
    """Each package the drawing names exists, at the layer the rule gives it."""
    drawn = _drawn_layers()
    units = {_unit(p) for p in SRC.rglob("*.py")}
    assert drawn == LAYER_OF and set(drawn) == units, (drawn, LAYER_OF)


def test_the_architecture_page_names_every_resilience_module_in_its_process():
    """Each module of resilience/ is named in its sub-package's row (the top's in the first table)."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("## Inside resilience/") : text.index("## The launch path")]
    rows = {row.split("|")[1].strip(" `"): row for row in section.splitlines() if row.startswith("| `")}
    missing = []
    for path in sorted((SRC / "resilience").rglob("*.py")):
        rel = path.relative_to(SRC / "resilience")
        if path.stem in ("__init__", "__main__"):
            continue
        row = rows.get(f"{rel.parts[0]}/" if len(rel.parts) > 1 else rel.name, "")
        if f"`{path.name}`" not in row:
            missing.append(str(rel))
    assert not missing, f"docs/architecture.md's resilience/ tables do not list {missing}"


def test_an_earlier_name_runs_the_entry_point_it_names():
    """Batch scripts of earlier versions run the driver and the decision by their earlier names."""
    import subprocess

    earlier = [e for e in ENTRY_POINTS if e.replaced_by]
    assert earlier
    for entry in earlier:
        main = SRC.parent.joinpath(*entry.module.split("."), "__main__.py")
        assert f"from {entry.replaced_by} import main" in main.read_text(), entry.module
        done = subprocess.run([sys.executable, "-m", entry.module, "--help"], capture_output=True, text=True)
        assert done.returncode == 0 and "--run-dir" in done.stdout, (entry.module, done.stderr)
