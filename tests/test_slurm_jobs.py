"""status/logs/cancel over fake squeue/scontrol/sacct/scancel, doctor checks, and plan verdicts."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from relaytrain.cli import main
from relaytrain.config import load_config
from relaytrain.plan.checks import make_plan
from relaytrain.slurm.jobs import describe, parse_scontrol_record

from conftest import fake_tool

REPO = Path(__file__).resolve().parents[1]

SCONTROL_123 = (
    "JobId=123 JobName=7b UserId=u(1000) GroupId=u(1000) MCS_label=N/A Priority=4294901758 Nice=0 "
    "Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=2 "
    "BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:10:01 TimeLimit=01:00:00 TimeMin=N/A "
    "SubmitTime=2026-11-22T01:00:00 StartTime=2026-11-22T01:00:01 NodeList=node[1-2] BatchHost=node1 "
    "NumNodes=2 NumCPUs=4 Command={run}/slurm/job.sh WorkDir={work} StdErr={run}/slurm/123.out "
    "StdIn=/dev/null StdOut={run}/slurm/123.out Power="
)


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "7b"
    (run / "slurm").mkdir(parents=True)
    (run / "slurm" / "123.out").write_text("[relaytrain] job 123: restart count 2\nstep 42 loss 2.1\n")
    (run / "slurm" / "124.out").write_text("[relaytrain] job 124: restart count 1\n")
    (run / "slurm" / "jobs.jsonl").write_text(
        json.dumps({"job_id": "123", "run_dir": str(run), "log": str(run / "slurm/%j.out")})
        + "\n"
        + json.dumps({"job_id": "124", "run_dir": str(run), "log": str(run / "slurm/%j.out")})
        + "\n"
    )
    (run / "metrics.jsonl").write_text(
        "\n".join(
            json.dumps(r) for r in ({"step": 41, "loss": 2.2}, {"step": 42, "loss": 2.1}, {"event": "stop"})
        )
        + "\n"
    )
    bin_dir = tmp_path / "bin"
    (tmp_path / "scontrol_123").write_text(SCONTROL_123.format(run=run, work=tmp_path) + "\n")
    fake_tool(
        bin_dir,
        "scontrol",
        f'if [[ "$*" == "show job -o 123" ]]; then cat {tmp_path}/scontrol_123; exit 0; fi\n'
        'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1\n',
    )
    fake_tool(
        bin_dir,
        "sacct",
        "if [[ $1 == -c && $3 == 124 ]]; then\n"
        '  echo "124|7b|COMPLETED|0:0|00:01:00|2|2026-11-22T00:00:00|2026-11-22T00:01:00|node[1-2]"\n'
        '  echo "124|7b|COMPLETED|0:0|00:02:00|2|2026-11-22T00:02:00|2026-11-22T00:04:00|node[1-2]"\n'
        '  exit 0\nfi\necho "Slurm accounting storage is disabled" >&2; exit 1\n',
    )
    fake_tool(
        bin_dir,
        "squeue",
        'if [[ " $* " == *" -j "* ]]; then exit 0; fi\necho "123|7b|RUNNING|10:01|1:00:00|2|node[1-2]"\n',
    )
    fake_tool(bin_dir, "scancel", f'printf "%s\\n" "$@" > {tmp_path}/scancel.args\n')
    fake_tool(bin_dir, "sinfo", 'echo "debug*|up|2"; echo "high|up|2"; echo "maint|down|1"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    for key in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(key, raising=False)
    return tmp_path


def test_scontrol_records_keep_values_with_spaces():
    rec = parse_scontrol_record("JobId=5 JobName=a b Reason=None Command=/x/job.sh --flag StdOut=/o/5.out")
    assert rec["JobName"] == "a b" and rec["Command"] == "/x/job.sh --flag" and rec["StdOut"] == "/o/5.out"


def test_status_of_a_job_shows_restarts_run_dir_and_last_step(cluster, capsys):
    (job,) = describe("123")
    assert (job.state, job.restarts, job.source, job.last_step) == ("RUNNING", 2, "scontrol", 42)
    assert job.run_dir == str(cluster / "runs/7b")
    assert main(["status", "123"]) == 0
    out = capsys.readouterr().out
    assert "RUNNING" in out and "42" in out and "node[1-2]" in out


def test_status_falls_back_to_sacct_completion_file_and_counts_requeues(cluster):
    (job,) = describe("124")
    assert (job.state, job.source, job.restarts, job.elapsed) == ("COMPLETED", "sacct -c", 1, "00:02:00")
    assert job.last_step == 42


def test_status_of_a_run_and_of_the_queue(cluster, capsys):
    jobs = describe("7b")
    assert [j.job_id for j in jobs] == ["123", "124"]
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "123" in out and "RUNNING" in out and "42" in out
    assert main(["status", "999"]) == 2


def test_logs_print_and_follow_until_the_job_has_ended(cluster, capsys):
    assert main(["logs", "123"]) == 0
    assert "step 42 loss 2.1" in capsys.readouterr().out
    assert main(["logs", "124", "-f"]) == 0  # found through jobs.jsonl; squeue says it is gone
    assert "job 124: restart count 1" in capsys.readouterr().out


def test_logs_follow_waits_for_a_queued_jobs_output(cluster, capsys, monkeypatch):
    """`logs RUN -f` right after `launch` (docs/howto/your-own-program.md). Before: "has no log yet", exit 2,
    while the job was still pending. Without -f, or once the job has left the queue, it still says so."""
    import time

    from relaytrain.slurm import jobs

    run = cluster / "runs" / "fresh"
    (run / "slurm").mkdir(parents=True)
    (run / "slurm" / "jobs.jsonl").write_text(json.dumps({"job_id": "125", "log": str(run / "slurm/%j.out")}))
    assert main(["logs", "fresh"]) == 2 and "has no log yet" in capsys.readouterr().err
    asked = []

    def active(job_id):  # pending twice, then running with its output, then over
        asked.append(job_id)
        if len(asked) == 2:
            (run / "slurm" / "125.out").write_text("job 125 started\n")
        return len(asked) < 4

    monkeypatch.setattr(jobs, "is_active", active)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    assert main(["logs", "fresh", "-f"]) == 0
    out = capsys.readouterr()
    assert out.out == "job 125 started\n" and out.err.startswith("waiting for job 125 to start\n"), out
    (run / "slurm" / "125.out").unlink()
    assert main(["logs", "fresh", "-f"]) == 2 and "has no log yet" in capsys.readouterr().err  # not queued


def test_cancel_plain_and_with_a_signal(cluster, capsys):
    assert main(["cancel", "123"]) == 0
    assert (cluster / "scancel.args").read_text().split() == ["--verbose", "123"]
    assert main(["cancel", "123", "--signal", "SIGUSR2"]) == 0
    assert (cluster / "scancel.args").read_text().split() == ["--verbose", "--signal=USR2", "123"]
    assert "sent SIGUSR2" in capsys.readouterr().out


def test_doctor_on_a_login_node(cluster, capsys):
    assert main(["doctor", "--partition", "debug"]) == 0
    out = capsys.readouterr().out
    assert "slurm commands" in out and "debug is up" in out and "tokenizer" in out
    assert main(["doctor", "--partition", "nope"]) == 1
    assert "'nope' not found" in capsys.readouterr().out
    cfg = cluster / "tok.toml"
    cfg.write_text('[data]\ntokenizer = "/nonexistent/tokenizer.json"\n')
    assert main(["doctor", str(cfg)]) == 1
    assert "compute nodes cannot" in capsys.readouterr().out


def test_doctor_inside_an_allocation_checks_every_node(cluster, monkeypatch):
    from relaytrain.slurm.doctor import check_environment, check_shared_dir

    # srun runs the command once per fake node, as SLURMD_NODENAME=nodeK, with this interpreter as python.
    fake_tool(
        cluster / "bin",
        "srun",
        f"for n in node1 node2; do SLURMD_NODENAME=$n PATH={Path(sys.executable).parent}:$PATH "
        '"${@:4}"; done\n',
    )
    name, level, detail = check_shared_dir(cluster / "runs", ["node1", "node2"])
    assert level == "pass", detail
    assert not list((cluster / "runs").glob(".doctor-*"))
    name, level, detail = check_environment(["node1", "node2"])
    assert level == "pass", detail
    fake_tool(cluster / "bin", "srun", 'SLURMD_NODENAME=node1 "${@:4}"\n')  # node2 does not see the directory
    assert check_shared_dir(cluster / "runs", ["node1", "node2"])[1] == "fail"


@pytest.mark.parametrize(
    "preset, overrides, nodes, gpus, verdict, reason",
    [
        ("7b", [], 1, 8, "ok", "dp_shard=8"),
        ("7b", ["--parallel.activation_checkpointing=none"], 1, 8, "ok", "dp_shard=8"),
        (
            "70b",
            ["--parallel.tp=1", "--parallel.dp_shard=1", "--parallel.dp_replicate=8"],
            1,
            8,
            "impossible",
            "shard more",
        ),
        (
            "70b",
            ["--parallel.pp=2", "--parallel.pp_microbatches=8"],
            16,
            8,
            "impossible",
            "raise parallel.pp_microbatches (now 8: micro batches of 16 sequences)",
        ),
        ("70b", ["--parallel.pp=2", "--parallel.pp_microbatches=32"], 16, 8, "ok", "pp=2"),
        ("70b", [], 2, 4, "impossible", "larger than the 4 GPUs"),
        ("70b", ["--parallel.rank_order=dp,pp,cp,tp"], 2, 8, "impossible", "rank_order"),
        ("70b", [], 8, 8, "ok", "hard deadline 540 s, signal 960 s"),
        (
            "70b",
            ["--resilience.hard_deadline_s=120", "--resilience.signal_lead_s=180"],
            8,
            8,
            "warn",
            "these pass: --resilience.hard_deadline_s=540 --resilience.signal_lead_s=780",
        ),
    ],
)
def test_plan_verdicts_on_the_presets(preset, overrides, nodes, gpus, verdict, reason):
    cfg = load_config(REPO / "configs" / f"{preset}.toml", overrides)
    plan = make_plan(cfg, nodes, gpus, "h100")
    assert plan.verdict == verdict
    assert reason in " ".join(detail for _, _, detail in plan.checks)


# Plans of the presets' layouts, not of their data (the data rule is tests/test_data_fit.py's).
TOY = ["--data.allow_small=true"]


def test_plan_cli_exit_codes(capsys, monkeypatch):
    # No cluster to ask: a worker that ran the Slurm tests has the local cluster's SLURM_CONF, whose
    # partition's small node memory would fail the host-memory check of an 8-GPU plan.
    monkeypatch.setenv("SLURM_CONF", "/nonexistent/slurm.conf")
    assert (
        main(
            [
                "plan",
                str(REPO / "configs/7b.toml"),
                "--nodes",
                "1",
                "--gpus-per-node",
                "8",
                "--gpu",
                "h100",
                *TOY,
            ]
        )
        == 0
    )
    assert "verdict: ok" in capsys.readouterr().out
    assert main(["plan", str(REPO / "configs/70b.toml"), "--nodes", "2", "--gpus-per-node", "4", *TOY]) == 1
    assert "impossible" in capsys.readouterr().out


OFFLOADED_8B = [
    "plan",
    str(REPO / "configs/8b.toml"),
    "--nodes",
    "2",
    "--gpus-per-node",
    "1",
    "--gpu",
    "h100",
    "--parallel.cpu_offload=true",
    *TOY,
]


def test_plan_counts_offloaded_states_in_host_memory(tmp_path, monkeypatch, capsys):
    fake_tool(tmp_path / "bin", "sinfo", "printf 'gpu*|gpu:h100:1|524288\\n'\n")  # 512 GiB nodes
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert main(OFFLOADED_8B) == 0
    out = capsys.readouterr().out
    assert "in host memory" in out and "host memory │ ok" in out
    assert "69.8 GiB per node" in out and "of 512.0 GiB" in out
    assert main([*OFFLOADED_8B, "--mem", "64G"]) == 1
    out = capsys.readouterr().out
    assert "host memory │ fail" in out and "of 64.0 GiB" in out and "verdict: impossible" in out
    # The GPU holds only the gathered layers, activations and logits: without offload the same layout
    # needs the 59.8 GiB of states per GPU on top.
    on_gpu = make_plan(load_config(REPO / "configs/8b.toml"), 2, 1, "h100")
    offloaded = make_plan(
        load_config(REPO / "configs/8b.toml", ["--parallel.cpu_offload=true"]), 2, 1, "h100"
    )
    assert on_gpu.verdict == "impossible" and offloaded.verdict == "warn"  # warn: node memory not given
    assert "node memory unknown; pass --mem" in " ".join(d for _, _, d in offloaded.checks)


def test_plan_bad_mem_is_one_line(capsys):
    assert main([*OFFLOADED_8B, "--mem", "64GB"]) == 2
    assert "slurm.mem='64GB' is not a Slurm memory size" in capsys.readouterr().err


def test_plan_prints_parameters_in_human_units(capsys):
    main(
        [
            "plan",
            str(REPO / "configs/debug.toml"),
            "--nodes",
            "1",
            "--gpus-per-node",
            "0",
            "--tasks-per-node",
            "1",
        ]
    )
    assert "│ parameters              │ 3.1 M" in capsys.readouterr().out


@pytest.mark.parametrize(
    "time_limit, margin, level",
    [
        ("5", 300, "fail"),  # 300 s limit: the time budget (save estimate + 300 s) stops every job at once
        ("10", 300, "warn"),  # half of the limit trains: less than 75 %
        ("25", 300, "ok"),  # 80 %
        ("5", 30, "warn"),  # Slurm's signal stops it 180 s early: 40 % trains
        ("30", 30, "ok"),
        ("2", 5, "warn"),  # 120 s: time to train, but the default 180 s signal lead comes as it starts
        ("UNLIMITED", 300, "ok"),
    ],
)
def test_plan_checks_that_the_time_limit_leaves_time_to_train(time_limit, margin, level):
    overrides = [f"--slurm.time={time_limit}", f"--resilience.time_budget_margin_s={margin}"]
    plan = make_plan(load_config(REPO / "configs/debug.toml", overrides), 1, 0, "", tasks_per_node=2)
    (check,) = [c for c in plan.checks if c[0] == "time limit"]
    assert check[1] == level, check
    if level == "fail":
        assert "every job would stop after its first step" in check[2]
        assert "resilience.time_budget_margin_s" in check[2] and "slurm.time" in check[2]


@pytest.mark.parametrize("bad", ["1 hour", "1:2:3:4", "2-", "-5", "01:00:00 "])
def test_a_malformed_slurm_time_is_one_line_before_anything_is_queued(bad, capsys):
    assert main(["plan", str(REPO / "configs/debug.toml"), f"--slurm.time={bad}"]) == 2
    err = capsys.readouterr().err
    assert "slurm.time" in err and "a Slurm time limit: M, M:S, H:M:S" in err and "Traceback" not in err


def test_plan_counts_every_layer_gathered_when_fsdp_never_reshards_after_forward():
    from relaytrain.model import count_parameters

    def gathered(value):
        cfg = load_config(REPO / "configs" / "1b.toml", [f"--parallel.reshard_after_forward={value}"])
        return make_plan(cfg, 1, 8, "h100").memory.working, count_parameters(cfg.model)

    block, params = gathered("default")
    assert gathered("never") == (2 * params, params) and block < params / 10  # 2 bytes a weight, tp 1


def test_plan_counts_what_a_vocabulary_parallel_loss_holds_beside_its_fp32_buffers():
    """Measured by the simulation (8B, FSDP 4 x TP 8): the bf16 logits shard, its bf16 gradient and the
    output projection's gathered input, a one-off that plan once left out (-11% with full AC)."""
    cfg = load_config(REPO / "configs" / "8b.toml", ["--parallel.tp=8"])
    plain = load_config(REPO / "configs" / "8b.toml", ["--parallel.tp=8", "--parallel.loss_parallel=false"])
    with_lp, without = make_plan(cfg, 4, 8, "h100").memory, make_plan(plain, 4, 8, "h100").memory
    tokens = cfg.train.seq_len * cfg.train.micro_batch_size
    fp32_buffers = 12 * tokens * cfg.model.vocab_size / 8
    extra = (4 * cfg.model.vocab_size / 8 + 2 * cfg.model.dim) * tokens
    assert with_lp.logits == pytest.approx(fp32_buffers + extra)
    assert without.logits == pytest.approx(12 * tokens * cfg.model.vocab_size)  # the whole vocabulary
