"""bench.preflight_scale: the ring all-reduce's fit recovers its latency and bandwidth terms, the network
phase follows measure.allreduce_bandwidth's rounds, the estimate at 128 nodes is the sum of its parts read
from the fits, the section is rewritten from a kept file, and bad arguments get one line."""

from __future__ import annotations

import json

import pytest

from bench import preflight_scale as scale


def row(nodes: int, allreduce: float, rest: float, step: float, network: float = 0.8) -> dict:
    return {
        "nodes": nodes, "job": str(nodes), "exit": 0, "named": [], "step_s": step, "command_s": 10.0 + nodes,
        "checks_s": 2.0, "slowest": {"compute": 0.9, "network": network, "storage": 0.05}, "rest_s": rest,
        "allreduce_s": allreduce,
    }  # fmt: skip


def test_the_ring_fit_recovers_alpha_and_beta():
    alpha, beta = 1e-4, 5e-3
    points = [(p, scale.ring_s(alpha, beta, p)) for p in (2, 3, 4, 6)]
    assert scale.ring_fit(points) == pytest.approx((alpha, beta))
    # a time that shrinks with the nodes has no latency term: alpha stays at 0, not below
    assert scale.ring_fit([(2, 0.03), (4, 0.02), (6, 0.01)])[0] == 0.0


def test_a_line_never_shrinks_with_the_nodes():
    assert scale.line_fit([(2, 1.0), (4, 2.0)]) == pytest.approx((0.0, 0.5))
    assert scale.line_fit([(2, 2.0), (4, 1.0)]) == pytest.approx((1.5, 0.0))


def test_the_network_phase_runs_the_rounds_its_budget_allows():
    # 10 ms an all-reduce, no latency: 80 rounds fit 0.8 s, capped at 50
    assert scale.network_phase_s(0.0, 0.01, 2, 0.8) == pytest.approx(0.02 + 50 * 0.01)
    # 1 s an all-reduce: at least 3 rounds, past the budget
    assert scale.network_phase_s(0.0, 1.0, 2, 0.8) == pytest.approx(2.0 + 3 * 1.0)


def data(rows: list[dict]) -> dict:
    machine = {"date": "2026-12-07 21:00 UTC", "cpu": "cpu", "cores": 2, "commit": "abc"}
    return {"machine": machine, "command": "python -m bench.preflight_scale", "budget": 2.0, "rows": rows,
            "judge_write_s": 0.03}  # fmt: skip


def test_the_estimate_is_the_sum_of_its_parts_at_128_nodes():
    rows = [row(k, scale.ring_s(1e-4, 5e-3, k), 0.05 + 0.01 * k, 0.2 + 0.02 * k) for k in (2, 4, 6)]
    est = scale.estimate(data(rows), cores=0)  # the times as measured
    parts = est["parts"]
    assert parts["compute"] == 0.9 and parts["storage"] == 0.05 and parts["judge_write"] == 0.03
    assert parts["gather"] == pytest.approx(0.05 + 0.01 * 128 + 2 * 127 * est["alpha_s"])
    assert est["command_parts"]["step_start"] == pytest.approx(0.2 + 0.02 * 128)
    assert est["allreduce_s"] == pytest.approx(scale.ring_s(1e-4, 5e-3, 128))
    assert est["checks_s"] == pytest.approx(sum(parts.values()))
    assert est["command_s"] == pytest.approx(est["checks_s"] + sum(est["command_parts"].values()))
    # a measured phase the model falls short of is added as it is
    slower = [{**r, "slowest": {**r["slowest"], "network": 5.0}} for r in rows]
    margin = scale.estimate(data(slower), cores=0)["network_margin_s"]
    assert margin == pytest.approx(5.0 - scale.network_phase_s(1e-4, 5e-3, 2, 0.8))


def test_a_part_that_keeps_a_core_busy_is_divided_by_the_nodes_sharing_each_core():
    # on 2 cores, 4 nodes share each core two by two: a part twice as long there is no growth
    rows = [row(2, 0.01, 0.3, 0.05), row(4, 0.02, 0.6, 0.10)]
    est = scale.estimate(data(rows))  # the machine's 2 cores
    assert est["rest_fit"] == pytest.approx((0.3, 0.0)) and est["step_fit"] == pytest.approx((0.05, 0.0))
    assert est["alpha_s"] == 0.0 and est["allreduce_s"] == pytest.approx(
        scale.ring_s(0.0, est["beta_s"], 128)
    )
    assert scale.estimate(data(rows), cores=0)["rest_fit"] == pytest.approx((0.0, 0.15))  # as measured


def test_the_section_is_rewritten_from_a_kept_file(tmp_path, monkeypatch):
    rows = [row(k, scale.ring_s(1e-4, 5e-3, k), 0.05, 0.2) for k in (2, 4)]
    kept = tmp_path / "preflight-scale-x.json"
    kept.write_text(json.dumps(data(rows)))
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n")
    monkeypatch.setenv("BENCH_PAGE", str(page))
    assert scale.main(["--page-from", str(kept)]) == 0
    text = page.read_text()
    assert "<!-- bench:preflight-scale -->" in text
    assert "**The checks before a job step's first step: " in text
    assert f"--page-from {kept}`" in text


@pytest.mark.slow
def test_judging_and_writing_is_timed_on_copies_of_a_measured_rank():
    rank = {"rank": 0, "node": "n0", "figures": {"gflops": 10.0, "gbps": 1.0}, "seconds": {}}
    assert 0 < scale.judge_and_write_s({"ranks": [rank]}, nodes=8, repeats=1) < 30


BAD = [["--nodes", "2"], ["--nodes", "1,2"], ["--nodes", "2,x"], ["--repeats", "0"]]


@pytest.mark.parametrize("args", BAD)
def test_bad_arguments_get_one_line(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        scale.main(args)
    assert exit_.value.code == 2 and "--nodes" in capsys.readouterr().err
