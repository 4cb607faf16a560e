"""Whole-file writes have one owner (relaytrain.atomic): a reader sees the old file or the new one, an
error leaves the old one and no temporary, `durable=True` fsyncs the file and its folder; no other
module renames a file over another or fsyncs one by hand."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from relaytrain import atomic

SRC = Path(__file__).resolve().parents[1] / "src" / "relaytrain"
OWNER = "atomic.py"
# fsync without a rename, each for its own reason: appends and exclusive creates, not whole-file replaces.
FSYNC_ELSEWHERE = {
    "job/jsonl.py": "appended lines survive the node's crash",
    "monitor/gpu_monitor.py": "appended GPU samples",
    "checkpoint/storage.py": "a DCP data file streamed under its own name; the COMPLETE manifest commits it",
    "resilience/run_lock.py": "the lock is created exclusively (a hard link), never replaced",
    "preflight/measure.py": "the storage check times a probe file's write, fsync and read-back",
}
# A rename that is not a file's: prepare-data publishes a whole folder of shards at once.
RENAMES_ELSEWHERE = {"data/prepare.py": "a folder of shards, renamed into place"}


def test_write_replaces_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "deep" / "state.json"  # the folder is made
    atomic.write_atomic(path, "one\n", durable=False)
    atomic.write_atomic(path, b"two\n", durable=True)
    assert path.read_text() == "two\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json"]


def test_an_error_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old")

    def chunks():
        yield b"half"
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic.write_chunks(path, chunks(), durable=True)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    with pytest.raises(RuntimeError), atomic.replacing(path, durable=False) as tmp:
        tmp.write_text("new")
        raise RuntimeError("the writer's check failed")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_symlink_is_swapped_the_same_way(tmp_path):
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_2").mkdir()
    for step in ("step_1", "step_2"):
        with atomic.replacing(tmp_path / "latest", durable=True) as tmp:
            os.symlink(step, tmp)
    assert os.readlink(tmp_path / "latest") == "step_2"


def test_durable_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    synced, real_replace = [], os.replace
    monkeypatch.setattr(atomic, "fsync_path", lambda p: synced.append(("fsync", Path(p))))
    monkeypatch.setattr(
        atomic.os, "replace", lambda a, b: synced.append(("replace", Path(b))) or real_replace(a, b)
    )
    path = tmp_path / "COMPLETE"
    atomic.write_atomic(path, b"x", durable=True)
    assert [what for what, _ in synced] == ["fsync", "replace", "fsync"] and synced[2][1] == tmp_path
    synced.clear()
    atomic.write_atomic(path, b"y", durable=False)
    assert [what for what, _ in synced] == ["replace"]


def test_temporary_names_differ_per_thread_and_end_in_tmp(tmp_path):
    import threading

    names = [atomic.temp_name(tmp_path / "f")]
    thread = threading.Thread(target=lambda: names.append(atomic.temp_name(tmp_path / "f")))
    thread.start()
    thread.join()
    assert names[0] != names[1] and all(n.name.endswith(".tmp") and n.name.startswith(".f.") for n in names)


def _offences(tree: ast.AST, rel: str) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        # os.replace/rename, or Path.replace/rename (one argument, not a string: str.replace has two)
        method = isinstance(node.func, ast.Attribute) and node.func.attr in ("replace", "rename")
        one_path = len(node.args) == 1 and not isinstance(node.args[0], ast.Constant)
        renames = name in ("os.replace", "os.rename") or (method and one_path and not node.keywords)
        if renames and rel not in RENAMES_ELSEWHERE:
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
        if name in ("os.fsync", "os.fdatasync") and rel not in FSYNC_ELSEWHERE:
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_else_renames_a_file_into_place_or_fsyncs_by_hand():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if rel != OWNER:
            offenders += _offences(ast.parse(path.read_text()), rel)
    assert not offenders, "write whole files with relaytrain.atomic:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    "source",
    [
        "os.replace(tmp, path)\n",
        "tmp.replace(path)\n",
        "os.rename(a, b)\n",
        "with open(p, 'wb') as f:\n    os.fsync(f.fileno())\n",
    ],
)
def test_the_scan_sees_a_hand_written_replace(source):
    assert _offences(ast.parse(source), "monitor/new.py")


def test_the_scan_leaves_string_replace_alone():
    assert not _offences(
        ast.parse("name = text.replace('a', 'b')\nx = dataclasses.replace(r, a=1)\n"), "m.py"
    )
