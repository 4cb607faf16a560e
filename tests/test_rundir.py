"""The run directory has one owner, relaytrain.job.RunDir: its layout is a contract between the jobs of a
run, the login-node commands and other programs, and no other module spells one of its names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from relaytrain.job import RunDir
from relaytrain.job.rundir import metrics_record

SRC = Path(__file__).resolve().parents[1] / "src" / "relaytrain"
TEMPLATE = SRC / "slurm" / "templates" / "job.sh.j2"
OWNER = "job/rundir.py"

# The names RunDir gives out: files, folders, and the per-rank / per-job files ({} the rank or job id).
FILES = {"config.toml", "metrics.jsonl", "run_state.json", "crashes.jsonl", "run.lock", "wandb_id"}
FILES |= {"run_kind.json"}
FILES |= {"jobs.jsonl", "job.sh", "attach.sh", "sweep.tsv", "sweep.json", "%j.out", "%A_%a.out"}
FOLDERS = {"slurm", "logs", "gpu", "checkpoints", "tensorboard", "profile", "report", "preflight", "compile"}
PATTERNS = (
    "rank_{}.log",
    "rank_{}.bin",
    "hang_rank{}.txt",
    "deadline_rank{}.txt",
    "pip-freeze-{}.txt",
    "attach-{}.out",
    "{}.out",
)
ALLOWED = {
    # What is inside a checkpoint belongs to relaytrain.checkpoint: a step directory's config.toml.
    "checkpoint/files.py": {"config.toml"},
}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def spellings(source: str) -> list[tuple[int, str]]:
    """(line, name) for every run-dir name a module spells as a path: a file name as a string (alone
    or ending a path), `x / "folder"`, or an f-string that makes a per-rank or per-job file name."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            for name in FILES:
                if re.search(rf"(^|/){re.escape(name)}$", node.value):
                    found.append((node.lineno, name))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            right = node.right
            if isinstance(right, ast.Constant) and right.value in FOLDERS | FILES:
                found.append((node.lineno, right.value))
        elif isinstance(node, ast.JoinedStr):
            shape = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            found += [
                (node.lineno, pattern)
                for pattern in PATTERNS
                if re.search(rf"(^|/){re.escape(pattern)}$", shape)
            ]
    return found


def test_nothing_outside_the_owner_spells_a_run_dir_name():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if rel == OWNER:
            continue
        allowed = ALLOWED.get(rel, set())
        offenders += [
            f"{rel}:{line}: {name}" for line, name in spellings(path.read_text()) if name not in allowed
        ]
    assert not offenders, "ask relaytrain.job.RunDir for these paths:\n" + "\n".join(offenders)


def test_the_job_script_gets_its_run_dir_paths_from_the_owner():
    text = TEMPLATE.read_text()
    spelled = [name for name in FILES | FOLDERS if f"/{name}" in text]
    prefixes = [pattern.split("{}")[0] for pattern in PATTERNS]  # rank_, hang_rank, pip-freeze-, ...
    spelled += [prefix for prefix in prefixes if prefix and f"/{prefix}" in text]
    assert not spelled, f"job.sh.j2 spells {spelled}: pass the path in from RunDir (slurm/script.py)"


def test_the_check_sees_each_kind_of_spelling():
    source = (
        'p = run_dir / "slurm"\n'
        'q = Path("runs/x/metrics.jsonl")\n'
        'r = f"hang_rank{rank}.txt"\n'
        'def f():\n    """Writes metrics.jsonl."""\n'
        'msg = "see crashes.jsonl and the job log"\n'
    )
    assert sorted(name for _, name in spellings(source)) == ["hang_rank{}.txt", "metrics.jsonl", "slurm"]


def test_the_layout_of_a_run_directory():
    run = RunDir.of("runs", "demo")
    assert run.root == Path("runs/demo")
    rel = {name: str(getattr(run, name).relative_to(run.root)) for name in dir(RunDir) if _is_path(run, name)}
    assert rel == {
        "config": "config.toml",
        "metrics": "metrics.jsonl",
        "run_state": "run_state.json",
        "kind": "run_kind.json",
        "crashes": "crashes.jsonl",
        "lock": "run.lock",
        "lock_takeover": "run.lock.takeover",
        "wandb_id": "wandb_id",
        "checkpoints": "checkpoints",
        "tensorboard": "tensorboard",
        "profile": "profile",
        "report": "report",
        "gpu": "gpu",
        "logs": "logs",
        "preflights": "preflight",
        "sample_records": "samples",
        "slurm": "slurm",
        "slurm_config": "slurm/config.toml",
        "job_script": "slurm/job.sh",
        "attach_script": "slurm/attach.sh",
        "jobs": "slurm/jobs.jsonl",
        "sweep_table": "sweep.tsv",
        "sweep_points": "sweep.json",
        "hang": "hang",
        "hang_request": "hang/request.json",
        "hang_record": "hang/last.json",
    }
    assert run.rank_log(3) == run.root / "logs" / "rank_3.log"
    assert run.preflight("12") == run.root / "preflight" / "12.json"
    assert run.hang_dump(0) == run.root / "logs" / "hang_rank0.txt"
    assert run.deadline_dump(1) == run.root / "logs" / "deadline_rank1.txt"
    assert run.hang_report(12) == run.root / "logs" / "hang-step12.md"
    assert run.stack_dump(1) == run.root / "logs" / "stacks_rank1.txt"
    assert run.compile_cache(1) == run.root / "compile" / "rank_1.bin"
    assert run.hang_node("n2") == run.root / "hang" / "nodes" / "n2.json"
    assert run.hang_stacks("n2") == run.root / "hang" / "stacks" / "n2.md"
    assert run.job_log("%A_%a") == run.root / "slurm" / "%A_%a.out"
    assert run.attach_log("$job_id") == run.root / "slurm" / "attach-$job_id.out"
    assert run.pip_freeze("12") == run.root / "slurm" / "pip-freeze-12.txt"
    assert run.sample_record(3) == run.root / "samples" / "rank_3.jsonl"
    assert run.record_rank(run.sample_record(3)) == 3
    assert run.record_rank(run.root / "samples" / "rank_x.jsonl") == -1


def _is_path(run: RunDir, name: str) -> bool:
    return isinstance(getattr(type(run), name, None), property) and isinstance(getattr(run, name), Path)


def test_a_job_log_names_its_run_directory(tmp_path):
    run = RunDir(tmp_path / "demo")
    assert RunDir.holding_job_log(run.job_log("123")) == run
    assert RunDir.holding_job_log(tmp_path / "elsewhere" / "123.out") is None


def test_a_metrics_event_carries_the_job_identity(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    record = metrics_record("event", 5, {"event": "resume", "nodes": 2})
    assert list(record) == ["kind", "step", "time", "job_id", "restart", "event", "nodes"]
    assert (record["kind"], record["step"], record["job_id"], record["restart"]) == ("event", 5, "77", 2)
