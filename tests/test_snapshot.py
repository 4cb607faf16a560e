"""In-memory snapshots: the file format, the node folder, the ring of replicas, the restore plan, and a
killed run that resumes from its snapshot bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from relaytrain.checkpoint.snapshot import store
from relaytrain.checkpoint.snapshot.format import SnapshotFormatError, Staging, decode, read_meta
from relaytrain.checkpoint.snapshot.peers import Ring
from relaytrain.checkpoint.snapshot.restore import _plan
from relaytrain.job.facts import JobFacts

import faults
from conftest import child_env, kill_after_snapshots, losses_by_step, run_cli


def _tree():
    wide = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {
        "model": {"w": torch.randn(5, 3), "bf": torch.randn(4).to(torch.bfloat16), "t": wide.t()},
        "optim": {"state.w.step": torch.tensor(3.0), "param_groups.w.lr": 1e-3, "empty": torch.empty(0, 2)},
        "states": {
            "rng": {"torch": torch.get_rng_state(), "python": [1, 2, 3], "pos": None},
            "data": {"samples": 7, "weights": (0.5, 0.25), 3: "int key", "flag": True},
        },
    }


def _blob(tree, meta=None) -> bytes:
    staged = Staging().stage(tree, meta or {"step": 4})
    return b"".join(bytes(c) for c in staged.chunks())


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


def test_format_round_trip_is_exact():
    tree = _tree()
    blob = _blob(tree, {"step": 4, "world_size": 2})
    meta, back = decode(blob)
    assert meta == {"step": 4, "world_size": 2} == read_meta(blob)
    _same(tree, back)


def test_staging_reuses_its_buffer_and_copies():
    staging, tree = Staging(), _tree()
    first = staging.stage(tree, {})
    tree["model"]["w"].add_(1.0)  # training goes on: the staged copy must not change
    assert not torch.equal(
        decode(b"".join(bytes(c) for c in first.chunks()))[1]["model"]["w"], tree["model"]["w"]
    )
    second = staging.stage(tree, {})
    assert second.data.data_ptr() == first.data.data_ptr()  # same layout: the buffer is reused


def test_reading_refuses_what_is_not_a_snapshot():
    blob = _blob(_tree())
    with pytest.raises(SnapshotFormatError, match="magic"):
        decode(b"PK\x03\x04" + blob[4:])
    with pytest.raises(SnapshotFormatError, match="past the end"):
        decode(blob[: len(blob) - 64])
    evil = json.dumps({"meta": {}, "tree": {"__reduce__": ["os.system", "touch x"]}, "tensors": []}).encode()
    with pytest.raises(SnapshotFormatError, match="unknown entry"):
        decode(b"RLTSNAP1" + len(evil).to_bytes(8, "little") + evil)
    with pytest.raises(TypeError, match="cannot hold"):
        Staging().stage({"f": object()}, {})


def test_node_folder_lists_only_finished_files(tmp_path):
    node = tmp_path / "node"
    meta = {"step": 3, "world_size": 2, "config_hash": "h"}
    entry = store.write_snapshot(store.step_dir(node, 3), 0, [b"abc", b"def"], meta)
    assert entry["size"] == 6 and entry["checksum"].startswith("xxh3_64:")
    store.write_snapshot(store.step_dir(node, 3), 1, [b"xyz"], {**meta, "rank": 1})
    store.entry_file(store.step_dir(node, 3), 1).unlink()  # a write killed before its entry
    store.write_snapshot(store.step_dir(node, 4), 0, [b"abcd"], {**meta, "step": 4})
    store.snapshot_file(store.step_dir(node, 4), 0).write_bytes(b"ab")  # truncated afterwards
    assert {s: sorted(r) for s, r in store.holdings(node).items()} == {3: [0]}
    assert bytes(store.read_verified(store.step_dir(node, 3), 0, entry["checksum"])) == b"abcdef"
    store.snapshot_file(store.step_dir(node, 3), 0).write_bytes(b"abcdeX")  # same size, a flipped byte
    assert store.read_verified(store.step_dir(node, 3), 0, entry["checksum"]) is None
    store.keep_from(node, 4)
    assert not store.step_dir(node, 3).exists() and store.step_dir(node, 4).exists()


def test_job_folders_are_scoped_and_cleanup_takes_only_its_job(tmp_path):
    job7 = JobFacts(job_id="7", node_name="n1")
    run = tmp_path / "runs/a"
    root = store.job_root(tmp_path, run, job7)
    assert root.name.startswith("relaytrain-job7-")
    assert root != store.job_root(tmp_path, tmp_path / "runs/b", job7)  # another run of the same job
    other = store.job_root(tmp_path, run, JobFacts(job_id="77"))
    for folder in (root / "n1", other / "n1"):
        folder.mkdir(parents=True)
    assert store.remove_job(tmp_path, "7") == [root]
    assert other.exists() and not root.exists()


def test_a_start_removes_what_earlier_jobs_of_its_run_left_on_its_node(tmp_path):
    run = tmp_path / "runs/a"
    earlier = store.job_root(tmp_path, run, JobFacts(job_id="7"))  # requeued elsewhere, never cleaned here
    mine = store.job_root(tmp_path, run, JobFacts(job_id="8"))
    another_run = store.job_root(tmp_path, tmp_path / "runs/b", JobFacts(job_id="7"))
    others = [another_run, store.job_root(tmp_path, run, JobFacts())]  # and outside Slurm
    for folder in (earlier, mine, *others):
        (folder / "n1").mkdir(parents=True)
    assert store.remove_earlier_jobs(tmp_path, run, JobFacts(job_id="8")) == [earlier]
    assert mine.exists() and all(o.exists() for o in others) and not earlier.exists()


def test_ring_over_nodes_and_clipping():
    ring = Ring.of(["a", "a", "b", "b", "c", "c"], replicas=1)
    assert [ring.targets(r) for r in range(6)] == [[2], [3], [4], [5], [0], [1]]
    assert ring.sources(0) == [4]
    two = Ring.of(["a", "a", "b", "b", "c", "c"], replicas=5)
    assert two.degree == 2 and two.targets(0) == [2, 4]
    alone = Ring.of(["a", "a"], replicas=1)
    assert alone.degree == 0 and alone.targets(1) == [] and alone.is_node_leader(0)


def _entry(step, rank, world=2, checksum="xxh3_64:0"):
    return {"step": step, "rank": rank, "world_size": world, "config_hash": "h", "checksum": checksum}


def test_restore_plan(tmp_path, caplog):
    caplog.set_level("INFO", "relaytrain.checkpoint")
    ckpt = tmp_path / "checkpoints"
    # node 0 holds rank 0 and rank 1's replica of step 5, node 1 only step 4: rank 1's own copy is preferred
    reports = [{5: {0: _entry(5, 0), 1: _entry(5, 1)}, 4: {0: _entry(4, 0)}}, {4: {1: _entry(4, 1)}}]
    plan = _plan(reports, ckpt, 2, "h", set())
    assert plan["step"] == 5 and plan["sources"] == {0: 0, 1: 0}
    assert _plan(reports, ckpt, 2, "h", {5})["sources"] == {0: 0, 1: 1}  # step 5 damaged: step 4
    partial = [{6: {0: _entry(6, 0)}}, {}]
    assert _plan(partial, ckpt, 2, "h", set()) is None
    assert "skipping the partial snapshot of step 6: no node holds the file of rank(s) 1" in caplog.text
    assert _plan(reports, ckpt, 4, "h", set()) is None  # another world size
    assert "world size 2, this run has 4: resuming from the checkpoint instead, which reshards" in caplog.text
    assert _plan(reports, ckpt, 2, "other", set()) is None
    (ckpt / "step_5").mkdir(parents=True)
    (ckpt / "step_5/COMPLETE").write_text("{}")
    assert _plan(reports, ckpt, 2, "h", set()) is None  # not newer than the checkpoint
    assert "not newer than the checkpoint of step 5" in caplog.text


SNAP = ["--train.max_steps=8", "--checkpoint.interval=0", "--checkpoint.snapshot_every=1"]


def test_killed_run_resumes_from_its_snapshot_bit_exact(tmp_path, tiny_args):
    """SIGKILL mid-run (no checkpoint saved): the restart resumes from the snapshot in memory and the loss
    curve equals the uninterrupted one; a damaged newest snapshot is reported and the one before is used."""
    shm = tmp_path / "shm"
    args = ["train", *tiny_args, *SNAP, f"--checkpoint.snapshot_dir={shm}"]
    ref = run_cli([*args, "--run.name=ref"], tmp_path)
    assert ref.returncode == 0, ref.stderr[-2000:]
    assert not shm.exists() or not any(shm.iterdir())  # a finished run leaves no snapshot behind

    cmd = [sys.executable, "-m", "relaytrain.cli", *args, "--run.name=cut"]
    env = child_env(**faults.env(step_delay_s=0.3))
    with open(tmp_path / "cut.out", "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    node = kill_after_snapshots(proc, shm, 2)
    steps = sorted(store.holdings(node))
    assert len(steps) >= 2 and not (tmp_path / "runs/cut/checkpoints").exists(), steps
    newest = store.snapshot_file(store.step_dir(node, steps[-1]), 0)
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF
    newest.write_bytes(bytes(data))

    again = run_cli([*args, "--run.name=cut"], tmp_path)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert f"skipping the damaged snapshot of step {steps[-1]}: rank 0's file" in out
    assert f"resuming from the snapshot of step {steps[-2]} in node memory" in out  # the one before
    assert "starting fresh" not in out
    assert losses_by_step(tmp_path / "runs/cut") == losses_by_step(tmp_path / "runs/ref")
    records = [json.loads(x) for x in (tmp_path / "runs/cut/metrics.jsonl").read_text().splitlines()]
    assert any(r.get("snapshot_bytes", 0) > 0 and "snapshot_blocking_s" in r for r in records)
    snaps = [r for r in records if "snapshot_waited_s" in r]
    assert snaps and all(0 <= r["snapshot_waited_s"] <= r["snapshot_blocking_s"] for r in snaps)
    assert not any(shm.iterdir())
    verified = run_cli(["verify", str(tmp_path / "runs/cut")], tmp_path)  # steps after the snapshot replayed
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "(2 segment(s) in the lineage" in verified.stdout


def test_cleanup_entry_point_removes_only_this_jobs_snapshots(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(f'[checkpoint]\nsnapshot_dir = "{tmp_path / "shm"}"\n')
    mine, other = tmp_path / "shm/relaytrain-job55-abc/n1", tmp_path / "shm/relaytrain-job556-abc/n1"
    mine.mkdir(parents=True)
    other.mkdir(parents=True)
    command = [sys.executable, "-m", "relaytrain.checkpoint.snapshot", "cleanup", "--config", str(config)]
    done = subprocess.run(command, env=child_env(SLURM_JOB_ID="55"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "removed the snapshots of job 55" in done.stdout
    assert not mine.parent.exists() and other.exists()
    outside = subprocess.run(command, env=child_env(), capture_output=True, text=True)
    assert outside.returncode == 2 and "give --job-id" in outside.stderr


def test_plan_counts_snapshots_and_replicas_in_host_memory():
    from relaytrain.config import load_config
    from relaytrain.plan.checks import make_plan

    from conftest import REPO

    cfg = load_config(REPO / "configs/8b.toml", ["--checkpoint.snapshot_every=10"])
    checks = {
        n: (lvl, d)
        for n, lvl, d in make_plan(cfg, 2, 8, "h100", host_memory=(1024 * 2**30, "--mem 1T")).checks
    }
    level, detail = checks["snapshots"]
    assert level == "ok" and "1 replica(s)" in detail and "of 1024.0 GiB (--mem 1T)" in detail
    small = make_plan(cfg, 2, 8, "h100", host_memory=(128 * 2**30, "--mem 128G"))
    assert small.verdict == "impossible"
    assert any(n == "snapshots" and lvl == "fail" for n, lvl, _ in small.checks)
    alone = make_plan(cfg, 1, 8, "h100", host_memory=(1024 * 2**30, "--mem 1T"))
    assert "0 replica(s)" in {n: d for n, _, d in alone.checks}["snapshots"]  # one node: no peer


def test_a_snapshot_restore_continues_the_lineage_of_the_newest_checkpoint(tmp_path):
    """Checkpoints saved after a restore from a snapshot still keep the damaged dirs the line keeps."""
    from relaytrain.checkpoint.files import FORMAT_NAME
    from relaytrain.checkpoint.resume import KEPT_DAMAGED, CheckpointLoader

    step_dir = tmp_path / "step_10"
    step_dir.mkdir()
    meta = {
        "format": FORMAT_NAME,
        "step": 10,
        "resumed_from": "/a/step_4",
        "resume_arg": "/a/step_4",
        KEPT_DAMAGED: ["step_8"],
    }
    (step_dir / "metadata.json").write_text(json.dumps(meta))
    loader = CheckpointLoader.__new__(CheckpointLoader)
    loader.continue_line_of(step_dir)
    assert loader.kept_damaged == {"step_8"} and loader.lineage["resumed_from"] == "/a/step_4"
