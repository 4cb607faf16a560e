"""A run's JSON Lines files have one writer and reader (relaytrain.job.jsonl): whole lines appended,
a torn last line skipped and counted, a tail that drops the line its window cuts, one event record."""

from __future__ import annotations

import ast
import json
import multiprocessing
from pathlib import Path

from relaytrain.job import RunDir, jsonl

SRC = Path(__file__).resolve().parents[1] / "src" / "relaytrain"
OWNER = "job/jsonl.py"
# Reads documents a user gives to prepare-data, not a run's files.
NOT_A_RUN_FILE = {"data/readers.py"}
# Files appended to that are not JSON Lines: GPU samples (CSV), rank logs and stack dumps (text), a lock.
TEXT_APPENDERS = {
    "monitor/gpu_monitor.py",
    "monitor/logs.py",
    "resilience/rank/watchdog.py",
    "resilience/rank/stack_signal.py",  # faulthandler's stacks, plain text
    "data/sources.py",
}


def test_append_writes_whole_lines_and_read_gives_them_back(tmp_path):
    path = tmp_path / "deep" / "a.jsonl"  # the folder is made
    jsonl.append(path, {"b": 1, "a": [1, 2]})
    jsonl.append(path, {"b": 2, "a": None}, sort_keys=True)
    assert path.read_text() == '{"b": 1, "a": [1, 2]}\n{"a": null, "b": 2}\n'
    assert jsonl.read(path) == jsonl.Records([{"b": 1, "a": [1, 2]}, {"a": None, "b": 2}], 0)
    assert jsonl.read(tmp_path / "missing.jsonl") == jsonl.Records([], 0)


def test_a_torn_last_line_and_foreign_lines_are_skipped_and_counted(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n[1, 2]\n\n{"step": 2}\n{"step": 3, "lo')  # killed mid-write
    found = jsonl.read(path)
    assert found.records == [{"step": 1}, {"step": 2}] and found.skipped == 2
    jsonl.append(path, {"step": 4})  # the next job appends after the torn line: its record stays whole
    found = jsonl.read(path)
    assert found.records == [{"step": 1}, {"step": 2}, {"step": 4}] and found.skipped == 2
    writer = jsonl.Appender(path)  # the metrics logger's held-open file: the same care when it opens
    path.write_text(path.read_text() + '{"torn')
    writer.close()
    writer = jsonl.Appender(path)
    writer.write({"step": 5})
    writer.close()
    assert jsonl.read(path).records[-1] == {"step": 5}


def test_tail_reads_the_last_records_and_skips_the_line_its_window_cuts(tmp_path):
    path = tmp_path / "m.jsonl"
    for step in range(200):
        jsonl.append(path, {"step": step, "pad": "x" * 40})
    size = 1000
    records = jsonl.tail(path, size)
    steps = [r["step"] for r in records]
    assert steps[-1] == 199 and steps == list(range(steps[0], 200)) and len(steps) < 20
    text = jsonl.tail_text(path, size)
    assert len(text.encode()) == size and text.endswith("}\n")
    cut = text.split("\n")[0]  # the window starts inside a line: that record is not returned half-read
    assert not cut.startswith('{"step"') and f'"step": {steps[0] - 1},' not in text
    line = len(path.read_bytes().splitlines(keepends=True)[-1])  # steps 100-199: lines of one length
    # a window of exactly 7 lines starts on a line: all 7 come back
    assert [r["step"] for r in jsonl.tail(path, 7 * line)] == list(range(193, 200))
    assert jsonl.tail(tmp_path / "missing.jsonl") == [] and jsonl.tail_text(tmp_path / "missing") == ""
    small = tmp_path / "s.jsonl"
    jsonl.append(small, {"step": 0})
    assert jsonl.tail(small, size) == [{"step": 0}]  # a window bigger than the file cuts nothing


def test_nan_is_refused_not_written(tmp_path):
    path = tmp_path / "m.jsonl"
    try:
        jsonl.append(path, {"loss": float("nan")})
    except ValueError:
        pass
    else:
        raise AssertionError("NaN written: other readers would reject the file")
    assert not path.exists() or path.read_text() == ""


def test_an_event_is_the_metrics_record_of_kind_event(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    run = RunDir(tmp_path)
    record = jsonl.append_event(run, "resume", 5, nodes=2)
    assert list(record) == ["kind", "step", "time", "job_id", "restart", "event", "nodes"]
    assert json.loads(run.metrics.read_text()) == record


def _append_many(path: str, worker: int) -> None:
    for i in range(200):
        jsonl.append(Path(path), {"worker": worker, "i": i, "pad": "y" * 300})


def test_processes_appending_at_once_never_interleave_a_line(tmp_path):
    path = tmp_path / "shared.jsonl"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(str(path), w)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    found = jsonl.read(path)
    assert found.skipped == 0 and len(found.records) == 600


def test_nothing_else_parses_or_appends_json_lines():
    """Every JSONL writer and reader goes through the owner: no other module parses a line of JSON or
    appends to a .jsonl file by hand."""
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if rel == OWNER or rel in NOT_A_RUN_FILE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name, args = ast.unparse(node.func), [ast.unparse(a) for a in node.args]
            if name == "json.loads" and args and "line" in args[0]:
                offenders.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            modes = args[1:2] + [ast.unparse(k.value) for k in node.keywords if k.arg == "mode"]
            if name == "open" and any("a" in m for m in modes) and rel not in TEXT_APPENDERS:
                offenders.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "use relaytrain.job.jsonl:\n" + "\n".join(offenders)
