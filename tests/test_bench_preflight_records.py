"""bench.preflight_records reads preflight records of real jobs (each job step once, 2 nodes or more), gives
their phases and counts the false exclusions of clean starts; bench.preflight_starts refuses bad arguments
in one line."""

from __future__ import annotations

import json

import pytest

from bench import preflight_records, preflight_starts


def record(folder, name, job, seconds, phases, gflops, passed=(True, True)):
    path = folder / "runs" / name / "preflight" / f"{job}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    nodes = {f"n{i}": {"passed": ok} for i, ok in enumerate(passed)}
    ranks = [{"figures": {"gflops": g, "gbps": 1.0}, "seconds": phases} for g in gflops]
    path.write_text(json.dumps({"job": job, "time": 1.0, "seconds": seconds, "nodes": nodes, "ranks": ranks}))
    return path


def test_each_job_step_of_two_nodes_or_more_is_read_once(tmp_path):
    phases = {"compute": 0.8, "network": 0.8, "storage": 0.1}
    record(tmp_path, "a", "7", 2.0, phases, [10.0, 5.0], passed=(True, False))
    record(tmp_path, "b", "8", 2.0, phases, [10.0], passed=(True,))  # one node: no median
    (tmp_path / "runs" / "again").symlink_to(tmp_path / "runs" / "a")  # the same record through a link
    rows = preflight_records.collect([tmp_path])
    assert [(r["record"].split("/", 1)[1], r["named"]) for r in rows] == [("runs/a/preflight/7.json", ["n1"])]
    assert rows[0]["compute_shortfall_pct"] == pytest.approx(100 / 3)  # 5 against the median 7.5
    assert rows[0]["phases"] == phases


def test_the_phases_where_the_records_keep_them(tmp_path):
    record(tmp_path, "a", "7", 2.2, {"compute": 0.8, "network": 0.8, "storage": 0.1}, [10.0, 9.0])
    (line,) = preflight_records.phases(preflight_records.collect([tmp_path]))
    assert "the phases 1.70 s (compute 0.800 s, network 0.800 s, storage 0.100 s" in line
    assert line.endswith("writing the record) 0.500 s."), line
    old = {**preflight_records.collect([tmp_path])[0]}
    del old["phases"]  # records kept before the phases were: no line
    assert preflight_records.phases([old]) == []


def test_false_exclusions_count_starts_not_job_steps():
    rows = [{"record": "a/s0/preflight/7.json", "named": ["n1"]},
            {"record": "a/s0/preflight/7-r1.json", "named": []},
            {"record": "a/s1/preflight/8.json", "named": []}]  # fmt: skip
    (line,) = preflight_records.false_exclusions(rows)
    assert "left out in 1 of 2 (95 % upper bound 97 %) clean starts" in line, line


@pytest.mark.parametrize("args", [["--nodes", "1", "--out", "x"], ["--starts", "0", "--out", "x"]])
def test_preflight_starts_refuses_bad_arguments_in_one_line(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        preflight_starts.main(args)
    assert exit_.value.code == 2 and "at least" in capsys.readouterr().err


def test_the_checks_share_of_the_start_up_where_the_run_kept_its_start_up(tmp_path):
    record(tmp_path, "a", "7", 2.0, {"compute": 0.8, "network": 0.8, "storage": 0.1}, [10.0, 9.0])
    (row,) = preflight_records.collect([tmp_path])
    assert row["startup_s"] is None and preflight_records.startup([row]) == []  # no metrics: no ledger
    (line,) = preflight_records.startup([{**row, "startup_s": 10.0}, {**row, "startup_s": 40.0}])
    assert "over the 2 starts checked once: median 25.0 s; the checks were 12.5 % of it" in line, line
