"""bench/snapshot.py's two-node part: its table from a results file (the measurement itself needs the
local Slurm cluster and minutes; docs/benchmarks.md, "In-memory snapshots", has its figures), and its
restore check (bench/snapshot_nodes.py) run in one process."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tiny_config import TINY_TOML

from bench import snapshot_nodes as nodes
from bench.report import REPO
from conftest import child_env

spec = importlib.util.spec_from_file_location("bench_snapshot", REPO / "bench" / "snapshot.py")
snapshot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(snapshot)

RESULTS = {
    "nodes": ["n1", "n2"], "params": 99_000_000, "snapshot_bytes": [1.19e9, 1.19e9],
    "blocking_s": [0.8, 0.7], "dcp_save_s": 4.2,
    "written": [{"replicate_s": 4.0, "replicated_bytes": 1.19e9, "write_s": 4.3},
                {"replicate_s": 4.5, "replicated_bytes": 1.19e9, "write_s": 4.1}],
    "restores": [
        {"tier": "local", "step": 2, "source": "snapshot", "restore_s": 1.0, "bit_exact": True},
        {"tier": "peer", "step": 2, "source": "snapshot", "restore_s": 1.5, "bit_exact": False,
         "model_exact": True, "optim_exact": False},
        {"tier": "dcp", "step": 1, "source": "checkpoint", "restore_s": 1.8, "bit_exact": True,
         "page_cache_dropped": False, "snapshot_lookup_s": 0.01},
    ],
}  # fmt: skip


def test_the_two_node_rows_take_the_slowest_rank_and_say_where_each_restore_came_from():
    size, *rows = snapshot.nodes_rows(RESULTS)
    assert size == "| 2 nodes: model and AdamW state per rank | 1.19 GB (99 M parameters) |"
    assert all(row.startswith("| 2 nodes, 1.19 GB state per rank: ") for row in rows)
    assert rows[0].endswith("| 0.800 s |")
    assert "| 4.500 s, 264 MB/s per direction |" in rows[1] and rows[2].endswith("| 4.300 s |")
    local, peer, dcp = rows[3:6]
    assert "from local memory" in local and "(step 2 from the snapshot, bit-exact)" in local
    assert "from the peer node" in peer and "NOT bit-exact: AdamW state differs" in peer
    assert "step 1 from the checkpoint" in dcp and "page cache not dropped" in dcp
    assert rows[6].endswith("| 4.200 s |")


def test_the_model_is_sized_to_the_state_asked_for_and_unknown_parts_are_refused(monkeypatch, capsys):
    assert snapshot.nodes_layers(1.2) == 17 and snapshot.nodes_layers(0.01) == 1
    assert snapshot.wide_model(1.2) == ["--model.dim=1024", "--model.n_layers=9"]  # one process: all of it
    monkeypatch.setattr(sys, "argv", ["bench/snapshot.py", "--parts", "debug,tpu"])
    with pytest.raises(SystemExit) as exited:
        snapshot.main()
    assert exited.value.code == 2
    assert "--parts: unknown tpu; choose from debug,wide,state,nodes,gpu" in capsys.readouterr().err


def test_the_gpu_part_needs_cuda_and_reports_the_blocking_share_apart_from_the_wait(monkeypatch, capsys):
    monkeypatch.setattr(snapshot, "_cuda", lambda: False)
    monkeypatch.setattr(sys, "argv", ["bench/snapshot.py", "--parts", "gpu", "--no-keep"])
    with pytest.raises(SystemExit) as exited:
        snapshot.main()
    assert exited.value.code == 2 and "torch sees no CUDA GPU here" in capsys.readouterr().err
    r = {"step_plain_s": 0.5, "step_snap_s": 0.52, "blocking_s": 0.03, "blocking_max_s": 0.04,
         "waited_s": 0.02, "mb": 4800.0}  # fmt: skip
    rows = snapshot.gpu_rows("0.4b", r)
    assert rows[0].startswith("| GPU, 0.4b shape (4.80 GB per rank): step without snapshots")
    assert rows[3].endswith("| 0.0200 s; 0.0100 s, 1.9% of the step |")  # the launch: 10 ms of 520
    assert rows[4].endswith("| +4.0% |")


def test_a_gpu_run_keeps_each_shapes_figures(tmp_path, monkeypatch):
    from bench import kept

    monkeypatch.setattr(kept, "RESULTS_DIR", tmp_path)
    r = {"step_plain_s": 0.5, "step_snap_s": 0.52, "blocking_s": 0.03, "blocking_max_s": 0.04,
         "waited_s": 0.02, "mb": 4800.0}  # fmt: skip
    snapshot.keep("snapshot-gpu.json", "python bench/snapshot.py --parts gpu", {"gpu": {"0.4b": r, "1b": r}})
    figures = kept.load("snapshot-gpu.json")["figures"]
    assert figures["gpu_0.4b_blocking_s"] == 0.03 and figures["gpu_1b_waited_s"] == 0.02


def test_the_page_names_the_command_that_measured_the_section():
    page = (REPO / "docs" / "benchmarks.md").read_text()
    section = page[page.index("## In-memory snapshots") :]
    assert "with `python bench/snapshot.py`, one invocation" in section[:400]


def test_a_step_row_gives_the_blocking_share_of_the_step_with_snapshots():
    rows = snapshot.step_rows("x", {"step_plain_s": 1.0, "step_snap_s": 2.0, "blocking_s": 0.1,
                                    "blocking_max_s": 0.2, "mb": 12.5})  # fmt: skip
    assert rows[2].endswith("| 0.1000 s (0.2000 s), 5.0% of the step, 12.5 MB per rank |")
    assert rows[2].startswith("| x: blocking per snapshot, median (max) |")


def test_a_run_keeps_its_figures_and_the_extrapolation_reads_them_back(tmp_path, monkeypatch):
    from bench import kept
    from bench.cluster.goodput_crash_extrapolation import snapshot_run

    monkeypatch.setattr(kept, "RESULTS_DIR", tmp_path)
    state = {"gb": 1.2, "blocking_s": 0.12, "write_s": 0.5, "restore_s": 0.1}
    exact = {**RESULTS, "restores": [{**r, "bit_exact": True} for r in RESULTS["restores"]]}
    snapshot.keep("snapshot-a.json", "python bench/snapshot.py", {"state": state, "nodes": exact})
    saved = kept.load("snapshot-a.json")
    assert saved["command"] == "python bench/snapshot.py" and saved["parts"]["nodes"] == exact
    run = snapshot_run("snapshot-a.json")
    assert run.name == kept.relative(tmp_path / "snapshot-a.json")
    assert run.replicate_gbps == pytest.approx(1.19e9 / 4.5 / 1e9)  # the slowest rank's replication
    assert (run.restore_local_s, run.restore_peer_s) == (1.0, 1.5)
    assert run.blocking_gbps == pytest.approx(1.2 / 0.12) and run.shm_write_gbps == pytest.approx(
        2 * 1.19 / 4.3
    )
    # a restore that did not give the state back is no figure: the extrapolation refuses the file
    snapshot.keep("snapshot-b.json", "python bench/snapshot.py", {"state": state, "nodes": RESULTS})
    with pytest.raises(ValueError, match="record no figure 'restore_peer_s'"):
        snapshot_run("snapshot-b.json")


def run_nodes_bench(tmp_path):
    """bench/snapshot_nodes.py in one process (tiers local and dcp: no peer): its results."""
    config = tmp_path / "nodes.toml"
    config.write_text(
        TINY_TOML + "max_steps = 10\neval_every = 0\n\n"
        f'[run]\nname = "nodes"\ndir = "{tmp_path / "runs"}"\n\n'
        f'[checkpoint]\nsnapshot_every = 1\nsnapshot_dir = "{tmp_path / "shm"}"\n'
        'mode = "sync"\ninterval = 100\n\n'
        "[metrics]\ntensorboard = false\n"
    )
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
         "-m", "bench.snapshot_nodes", "--out", str(out), "--tiers", "local,dcp"],
        cwd=REPO, env=child_env(RELAYTRAIN_CONFIG=str(config)), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return json.loads(out.read_text())


def test_the_restore_check_compares_the_model_and_the_adamw_state(tmp_path):
    """Each restore is compared on the parameters, AdamW's moments and step counters, and the step: a
    restore that left the optimizer out would read `optim_exact: false` and not bit-exact."""
    local, dcp = run_nodes_bench(tmp_path)["restores"]
    assert (local["tier"], local["source"], local["step"]) == ("local", "snapshot", 2)
    assert (dcp["tier"], dcp["source"], dcp["step"]) == ("dcp", "checkpoint", 1)
    for restore in (local, dcp):
        assert restore["model_exact"] and restore["optim_exact"] and restore["bit_exact"], restore


def test_the_optimizer_tensors_are_every_moment_and_step_counter():
    import torch

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    opt = torch.optim.AdamW(params)
    assert nodes.optimizer_tensors([opt]) == []
    sum(p.sum() for p in params).backward()
    opt.step()
    tensors = nodes.optimizer_tensors([opt])
    assert [t.shape for t in tensors] == [(3,), (3,), (), (2,), (2,), ()]  # exp_avg, exp_avg_sq, step
