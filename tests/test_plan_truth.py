"""`relaytrain plan` tells the whole truth (issue 35): async checkpoints' host memory, jobs too short to
train, the pipeline bubble, why there is no estimate, and pipeline micro batches that fit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from relaytrain.cli import main
from relaytrain.config import load_config
from relaytrain.plan.checks import make_plan, plan_rows
from relaytrain.plan.gpu_memory import GIB

REPO = Path(__file__).resolve().parents[1]
PRESET_70B = REPO / "configs/70b.toml"
TOY = ["--data.allow_small=true"]  # plans of the layout, not of the data (tests/test_data_fit.py)


def check(plan, name: str) -> tuple[str, str]:
    (found,) = [(level, detail) for n, level, detail in plan.checks if n == name]
    return found


def test_async_checkpoint_buffers_count_in_host_memory_per_node(capsys):
    """70B on 4 x 8: each save copies a rank's fp32 weights and AdamW moments (12 P / 32) into pinned host
    buffers, 8 ranks a node: 212 GB per node beside 4 GiB per process."""
    cfg = load_config(PRESET_70B)
    roomy = make_plan(cfg, 4, 8, "h100", host_memory=(512 * GIB, "--mem 512G"))
    level, detail = check(roomy, "host memory")
    pinned = 12 * roomy.parameters / 32 * 8
    assert pinned == pytest.approx(212e9, rel=0.01)
    assert level == "ok" and f"async checkpoint buffers (pinned) {pinned / GIB:.1f} GiB" in detail, detail
    assert f"{(pinned + 32 * GIB) / GIB:.1f} GiB per node for 8 process(es)" in detail
    small = make_plan(cfg, 4, 8, "h100", host_memory=(192 * GIB, "--mem 192G"))
    level, detail = check(small, "host memory")
    assert (level, small.verdict) == ("fail", "impossible") and 'checkpoint.mode="sync"' in detail
    sync = make_plan(
        load_config(PRESET_70B, ["--checkpoint.mode=sync"]), 4, 8, "h100", host_memory=(192 * GIB, "")
    )
    assert "host memory" not in [name for name, _, _ in sync.checks] and sync.verdict == "ok"
    # Through the CLI: --mem is the node's memory the buffers must fit in.
    args = [
        "plan",
        str(PRESET_70B),
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--gpu",
        "h100",
        "--mem",
        "192G",
        *TOY,
    ]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "host memory │ fail" in out and "verdict: impossible" in out


def test_a_job_that_trains_few_steps_warns_and_names_a_limit_that_passes():
    """70B on 4 x 8 with a 1-hour limit: Slurm's signal 960 s before the limit stops it, a resumed job
    first loads 847 GB (about 423 s at 2 GB/s): about 7 steps of ~319 s per job."""
    short = make_plan(load_config(PRESET_70B, ["--slurm.time=01:00:00"]), 4, 8, "h100")
    level, detail = check(short, "time limit")
    assert level == "warn" and short.verdict == "warn", detail
    assert "stops itself 960 s before the limit" in detail and "loads the checkpoint (about 423 s)" in detail
    assert "2217 s (62% of the limit) train, about 7 steps (estimate)" in detail, detail
    suggested = re.search(r"this passes: --slurm.time=(\S+)$", detail).group(1)
    assert suggested == "01:40:00"
    passing = make_plan(load_config(PRESET_70B, [f"--slurm.time={suggested}"]), 4, 8, "h100")
    assert check(passing, "time limit")[0] == "ok"
    just_under = make_plan(load_config(PRESET_70B, ["--slurm.time=01:30:00"]), 4, 8, "h100")
    assert check(just_under, "time limit")[0] == "warn"
    # A limit that the stop and the load fill: every resumed job would stop after its first step.
    level, detail = check(make_plan(load_config(PRESET_70B, ["--slurm.time=20"]), 4, 8, "h100"), "time limit")
    assert level == "fail" and "0 s (0% of the limit) train" in detail and "--slurm.time=01:40:00" in detail
    # Few steps alone warn too: 81 % of two hours train, 5 steps of ~1280 s on one node.
    slow = make_plan(load_config(PRESET_70B, ["--slurm.time=02:00:00"]), 1, 8, "h100")
    level, detail = check(slow, "time limit")
    assert level == "warn" and "about 5 steps" in detail, detail


def test_step_estimate_includes_the_pipeline_bubble():
    def seconds(*overrides: str):
        return make_plan(load_config(PRESET_70B, ["--parallel.pp=2", *overrides]), 16, 8, "h100").step

    few, many = seconds("--parallel.pp_microbatches=2"), seconds("--parallel.pp_microbatches=128")
    compute = few.step_flops / (128 * 989e12 * 0.40)
    assert few.seconds == pytest.approx(compute * (1 + 1 / 2))
    assert many.seconds == pytest.approx(compute * (1 + 1 / 128))
    interleaved = seconds(
        "--parallel.pp_microbatches=8",
        "--parallel.pp_schedule=interleaved_1f1b",
        "--parallel.pp_virtual_stages=2",
    )
    assert interleaved.seconds == pytest.approx(compute * (1 + 1 / 16))
    table = dict(plan_rows(make_plan(load_config(PRESET_70B, ["--parallel.pp=2"]), 16, 8, "h100")))
    assert "+ 0.8% for the pipeline bubble" in table["step time (estimate)"]


def test_no_step_estimate_says_the_layout_failed(capsys):
    args = ["plan", str(PRESET_70B), "--nodes", "2", "--gpus-per-node", "4", "--gpu", "h100", *TOY]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "not estimated: the layout failed (see the layout check)" in out and "CPU-only" not in out
    cpu = [
        "plan",
        str(REPO / "configs/debug.toml"),
        "--nodes",
        "1",
        "--gpus-per-node",
        "0",
        "--tasks-per-node",
        "2",
    ]
    assert main(cpu) == 0
    assert "not estimated: CPU-only nodes" in capsys.readouterr().out


@pytest.mark.parametrize(
    "preset, overrides, nodes, gpus, micro, accum",
    [
        ("70b", ["--parallel.pp=2"], 4, 8, 1, 512),
        ("70b", ["--parallel.pp=2"], 16, 8, 1, 128),
        ("8b", ["--parallel.pp=2"], 2, 8, 1, 64),
        ("debug", ["--parallel.pp=2"], 1, 2, 4, 4),
        ("debug", ["--parallel.pp=2", "--train.micro_batch_size=16"], 1, 2, 8, 2),  # at least pp
        ("debug", ["--parallel.pp=2", "--parallel.pp_microbatches=8"], 1, 2, 2, 8),  # as set
        (  # interleaved takes a multiple of pp: 4 micro batches of 3, not 3 of 4
            "debug",
            [
                *(
                    "--parallel.pp=2",
                    "--parallel.pp_schedule=interleaved_1f1b",
                    "--parallel.pp_virtual_stages=2",
                ),
                *("--train.global_batch_size=12", "--train.micro_batch_size=4"),
            ],
            1,
            2,
            3,
            4,
        ),
    ],
)
def test_pipeline_micro_batches_default_to_train_micro_batch_size(
    preset, overrides, nodes, gpus, micro, accum
):
    """The 70B preset with pp=2 was impossible with the old default of pp micro batches (2 of 64
    sequences on 4 x 8: 238.5 GiB per GPU); micro batches of train.micro_batch_size fit."""
    cfg = load_config(REPO / "configs" / f"{preset}.toml", overrides)
    plan = make_plan(cfg, nodes, gpus, "h100")
    assert (plan.dims.micro_batch_size, plan.dims.grad_accum) == (micro, accum)
    assert plan.verdict != "impossible", plan.checks


def test_the_node_crossing_check_walks_one_period_of_the_layout_not_every_rank(monkeypatch):
    """At slurm.nodes' upper bound (100,000 nodes of 8) the check looks at the groups of one period of
    the rank pattern (the least common multiple of a tp block and a node), not at 800,000 ranks."""
    from relaytrain.errors import UserError
    from relaytrain.parallel.dims import ParallelDims
    from relaytrain.parallel.layout import validate_layout

    seen = []
    group_of = ParallelDims.group_of
    monkeypatch.setattr(ParallelDims, "group_of", lambda self, r, d: seen.append(r) or group_of(self, r, d))
    cfg = load_config(PRESET_70B)
    with pytest.raises(UserError, match="global_batch_size=1024 must be divisible"):
        validate_layout(cfg.parallel, cfg.model, cfg.train, 800_000, 8, "cuda")
    assert 0 < len(seen) <= 8
