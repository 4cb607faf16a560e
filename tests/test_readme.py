"""The README and docs/local-cluster.md run as written.

Every ```bash block of the two files is claimed by one test here (`test_every_bash_block_is_claimed`
fails when a block is added or moved without a test seeing it); the commands are read from the files
at run time, so a changed command is what the test runs.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from relaytrain.cli import build_parser

import needs
from conftest import child_env

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
LOCAL_CLUSTER_DOC = REPO / "docs" / "local-cluster.md"

# (file, the heading above the block) of every bash block, in order; each is run by a test below.
CLAIMED_BLOCKS = [
    (README, "relaytrain"),  # the quickstart: test_readme_opens_with_two_commands, .ci/run
    (README, "Usage"),  # test_usage_commands_parse, test_usage_plan_runs
    (README, "The cluster example"),  # test_readme_cluster_example_runs_verbatim
    (LOCAL_CLUSTER_DOC, "A local multi-node Slurm cluster: `relaytrain cluster up|status|down`"),
]


def bash_blocks(path: Path) -> list[tuple[str, list[str]]]:
    """(nearest heading above, command lines) of each ```bash block."""
    text = path.read_text()
    blocks = []
    for match in re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M):
        headings = re.findall(r"^#+ (.+)$", text[: match.start()], re.M)
        lines = [line for line in match.group(1).splitlines() if line.strip()]
        blocks.append((headings[-1] if headings else "", lines))
    return blocks


def block(path: Path, heading: str) -> list[str]:
    found = [lines for h, lines in bash_blocks(path) if h == heading]
    assert len(found) == 1, f"{path.name}: expected one bash block under '{heading}'"
    return found[0]


def quickstart_commands() -> list[str]:
    text = README.read_text()
    first = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first and text.index(first.group(0)) < 200, "the README must open with the quickstart block"
    return block(README, "relaytrain")


def test_every_bash_block_is_claimed():
    found = [(path, heading) for path in (README, LOCAL_CLUSTER_DOC) for heading, _ in bash_blocks(path)]
    assert found == CLAIMED_BLOCKS


def test_readme_opens_with_two_commands():
    commands = quickstart_commands()
    assert len(commands) == 2
    assert commands[0].endswith("relaytrain train")
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command_and_nothing_else_on_the_python_side():
    """CI adds no Python install or build step the README's command lacks: what a test needs built, the
    test session builds (tests/prebuilt.py), so a fresh machine passes with the README's command alone."""
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert quickstart_commands()[1] in ci
    python_side = [line for line in ci if re.search(r"\b(pip|python3?)\b", line) and not line.startswith("#")]
    assert python_side == [quickstart_commands()[1]], python_side


def _relaytrain_argv(command: str) -> list[str]:
    words = shlex.split(command, comments=True)
    if words[:3] == ["python", "-m", "relaytrain.job.torchrun"]:  # not plain torchrun (test_doc_torchrun.py)
        return words[words.index("relaytrain.cli") + 1 :]
    assert words[0] == "relaytrain", command
    return words[1:]


def test_usage_commands_parse():
    """Each usage line names a real command with real flags (they train 1B-70B models: not run here)."""
    parser = build_parser()
    for line in block(README, "Usage"):
        for command in line.split("#")[0].split(";"):
            if not command.strip():
                continue
            args, extra = parser.parse_known_args(_relaytrain_argv(command))
            assert getattr(args, "func", None), command
            assert not extra or getattr(args, "accepts_overrides", False), command
            assert all(e.startswith("--") and "=" in e for e in extra), command


def test_usage_plan_runs():
    plans = [line for line in block(README, "Usage") if line.startswith("relaytrain plan ")]
    assert plans
    for line in plans:
        done = subprocess.run(["bash", "-c", line], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "verdict:" in done.stdout


def test_usage_verify_runs(tmp_path, stopped_and_resumed_run):
    """`relaytrain verify runs/8b` as written, in a directory whose runs/8b is a tiny stopped and resumed
    run's."""
    (line,) = [line for line in block(README, "Usage") if line.startswith("relaytrain verify ")]
    target = Path(shlex.split(line, comments=True)[2])
    shutil.copytree(stopped_and_resumed_run, tmp_path / target, symlinks=True)
    done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == f"verify {target}: OK"


def test_usage_status_json_and_report_run(tmp_path, stopped_and_resumed_run):
    """`relaytrain status runs/8b --json` and `relaytrain report runs/8b` as written, on a copy of a tiny
    stopped and resumed run: the state and the time ledger as JSON, the report with its ledger plot."""
    usage = block(README, "Usage")
    (status,) = [line for line in usage if line.startswith("relaytrain status ") and "--json" in line]
    (report,) = [line for line in usage if line.startswith("relaytrain report ")]
    target = Path(shlex.split(report, comments=True)[2])
    assert shlex.split(status, comments=True)[2] == str(target)
    shutil.copytree(stopped_and_resumed_run, tmp_path / target, symlinks=True)
    run = {"cwd": tmp_path, "env": child_env(), "capture_output": True, "text": True, "timeout": 120}
    done = [subprocess.run(["bash", "-c", line], **run) for line in (status, report)]
    assert all(d.returncode == 0 for d in done), [d.stdout + d.stderr for d in done]
    ledger = json.loads(done[0].stdout)["ledger"]
    assert ledger["allocated_s"] > 0 and 0 < ledger["goodput"] < 1 and "unaccounted" in ledger["buckets"]
    assert "ledger.png" in done[1].stdout and (tmp_path / target / "report" / "ledger.png").is_file()


def test_torch_requirement_is_a_range_that_admits_the_on_disk_build():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch,) = [d for d in deps if re.match(r"torch\b", d)]
    spec = torch.removeprefix("torch").replace(" ", "")
    assert "==" not in spec, "an exact pin replaces the torch of every container image"
    bounds = dict(re.findall(r"(>=|<)([\d.]+)", spec))
    assert set(bounds) == {">=", "<"}, torch
    low, high = (tuple(int(x) for x in bounds[op].split(".")) for op in (">=", "<"))
    # Every release the suite was run on (docs/containers.md, "Tested on") is inside, and nothing newer.
    assert low <= (2, 12, 0) and (2, 15, 0) < high <= (2, 16)
    assert low >= (2, 12), "torchrun's --shutdown-timeout (the generated job script passes it) came in 2.12"


def _run_in_shell(script: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{script}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def _exported_slurm_conf(lines: list[str]) -> str:
    (line,) = [line for line in lines if line.startswith("export SLURM_CONF=")]
    return shlex.split(line, comments=True)[1].split("=", 1)[1]


def _take_down(slurm_cluster) -> None:
    """The suite's cluster (a node set for each lane of tests/slurm_grouping.py) is not the documented
    size: the walkthrough starts its own, from nothing, as a reader would."""
    from relaytrain.localcluster import cluster as local_cluster

    local_cluster.cluster_down(slurm_cluster.base_dir)


def _bring_back(slurm_cluster) -> None:
    from relaytrain.localcluster import cluster as local_cluster

    local_cluster.cluster_up(nodes=len(slurm_cluster.nodes), cpus_per_node=slurm_cluster.cpus_per_node)


@pytest.mark.slurm
def test_local_cluster_walkthrough_runs_verbatim(slurm_cluster, tmp_path):
    lines = block(LOCAL_CLUSTER_DOC, "A local multi-node Slurm cluster: `relaytrain cluster up|status|down`")
    if _exported_slurm_conf(lines) != str(slurm_cluster.slurm_conf):
        needs.skip_or_fail(f"the session's cluster is not the documented one ({slurm_cluster.slurm_conf})")
    assert lines[-1] == "relaytrain cluster down"
    try:
        _take_down(slurm_cluster)
        done = _run_in_shell("\n".join(lines), tmp_path, timeout=300)
    finally:
        _bring_back(slurm_cluster)
    assert re.search(r"\bCOMPLETED\b", done.stdout), done.stdout
    (output,) = tmp_path.glob("slurm-*.out")
    assert sorted(output.read_text().split()) == ["nsnode1", "nsnode1", "nsnode2", "nsnode2"]
    assert '"up": true' in done.stdout and "stopped" in done.stdout


@pytest.mark.slurm
def test_readme_cluster_example_runs_verbatim(slurm_cluster, tmp_path):
    """Everything before `cluster down` runs; the job must then finish COMPLETED; then the rest runs."""
    from slurm_fixtures import job_fields, wait_job_finished

    lines = block(README, "The cluster example")
    if _exported_slurm_conf(lines) != str(slurm_cluster.slurm_conf):
        needs.skip_or_fail(f"the session's cluster is not the documented one ({slurm_cluster.slurm_conf})")
    down = lines.index("relaytrain cluster down")
    export = next(line for line in lines if line.startswith("export "))
    shutil.copytree(REPO / "configs", tmp_path / "configs")  # the README runs from a checkout
    try:
        _take_down(slurm_cluster)
        done = _run_in_shell("\n".join(lines[:down]), tmp_path, timeout=300)
        job_id = int(re.search(r"submitted job (\d+)", done.stdout).group(1))
        assert re.search(rf"^│ {job_id} ", done.stdout, re.M), f"relaytrain status lists no job {job_id}"
        fields = wait_job_finished(job_id, timeout=900)
        log = tmp_path / "runs" / "debug" / "slurm" / f"{job_id}.out"
        assert fields["JobState"] == "COMPLETED", log.read_text() if log.exists() else fields
        status = _run_in_shell(f"{export}\nrelaytrain status {job_id}", tmp_path, timeout=120)
        assert "COMPLETED" in status.stdout
        assert job_fields(job_id)["NumNodes"] == "2"
        metrics = (tmp_path / "runs" / "debug" / "metrics.jsonl").read_text()
        assert '"loss"' in metrics
        _run_in_shell("\n".join([export, *lines[down:]]), tmp_path, timeout=120)
    finally:
        _bring_back(slurm_cluster)
