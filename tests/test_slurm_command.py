"""Slurm's client commands have one runner (relaytrain.job.slurm_command): a timeout on every call, a typed
result instead of an exception; no other module starts a Slurm command, and `requeue()` is the one
requeue path in Python."""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import pytest

from relaytrain.job import slurm_command
from relaytrain.job.slurm_command import Outcome, run_slurm_command

SRC = Path(__file__).resolve().parents[1] / "src" / "relaytrain"
OWNER = "job/slurm_command.py"
SLURM_TOOLS = {"scontrol", "squeue", "sacct", "sacctmgr", "sbatch", "scancel", "sinfo", "srun", "salloc"}
# The modules that start processes other than Slurm's clients, and what they start: a new one is declared
# here, and none of them spells a Slurm command in a subprocess call (checked below).
PROCESS_STARTERS = {
    "job/task.py": "the node's GPU monitor and hang watcher",
    "job/netdetect.py": "ip",
    "resilience/batch/job_step.py": "the job step itself (srun, argv from the batch script): a long process "
    "whose signals are forwarded, not a client command",
    "resilience/hangs/stacks.py": "py-spy",
    "resilience/batch/job_setup.py": "nvidia-smi / rocm-smi, for the job log",
    "job/standby.py": "the warm standby: the workers' own command, waiting to take a lost rank's place",
    "monitor/gpu_monitor.py": "nvidia-smi / rocm-smi",
    "parallel/simulate.py": "the fake-tensor step in a fresh interpreter",
    "parallel/sim_reshard.py": "the resharding simulation in a fresh interpreter",
    "slurm/doctor.py": "stat, nvidia-smi",
    "slurm/launch.py": "the generated script under bash (launch --jobid)",
    "localcluster/cluster.py": "commands inside a node's namespace",
    "localcluster/daemons.py": "apt-get, munged, slurmctld, slurmd",
    "localcluster/net.py": "ip",
    "localcluster/node_memory.py": "nsenter",
    "preflight/commands.py": "the checks' ranks under torchrun (relaytrain preflight outside Slurm)",
    "resilience/batch/notify_send.py": "the user's [notify] command, the event on its stdin",
}
REQUEUE_OWNER = "resilience/requeue.py"


def tool(folder: Path, name: str, body: str) -> None:
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def bin_dir(tmp_path, monkeypatch):
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return folder


def test_an_answer_a_failure_a_timeout_and_a_missing_tool_are_told_apart(bin_dir):
    tool(bin_dir, "squeue", 'echo "1 RUNNING"\n')
    tool(bin_dir, "scontrol", 'echo "invalid job id" >&2; exit 1\n')
    tool(bin_dir, "sacct", "sleep 5\n")
    answered = run_slurm_command(["squeue", "-h"])
    assert answered.ok and answered.ran and answered.stdout == "1 RUNNING\n" and answered.why() == ""
    failed = run_slurm_command(["scontrol", "show", "job", "9"])
    assert failed.outcome is Outcome.FAILED and failed.ran and not failed.ok and failed.returncode == 1
    assert failed.why() == "scontrol show job 9 exited 1: invalid job id"
    late = run_slurm_command(["sacct"], timeout=0.3)
    assert (
        late.outcome is Outcome.TIMED_OUT
        and not late.ran
        and late.why() == "sacct did not answer within 0.3s"
    )
    missing = run_slurm_command(["sinfo-not-installed"])
    assert missing.outcome is Outcome.MISSING and missing.why() == "sinfo-not-installed is not on PATH"


def test_the_environment_given_is_the_commands_path_included(tmp_path):
    tool(tmp_path / "other", "sinfo", 'echo "$SLURM_CONF"\n')
    env = {"PATH": f"{tmp_path / 'other'}{os.pathsep}/usr/bin:/bin", "SLURM_CONF": "/x/slurm.conf"}
    assert run_slurm_command(["sinfo"], env=env).stdout == "/x/slurm.conf\n"


def test_every_call_has_a_timeout_by_default():
    assert slurm_command.TIMEOUT_S > 0
    signature = run_slurm_command.__defaults__
    assert signature == (slurm_command.TIMEOUT_S,)


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


def _spells_slurm(node: ast.Call) -> bool:
    return any(
        isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value.split(" ")[0] in SLURM_TOOLS
        for arg in node.args
        for c in ast.walk(arg)
    )


def _offences(tree: ast.AST, rel: str) -> list[str]:
    found = []
    for node, name in _calls(tree):
        starts = name.startswith(("subprocess.", "os.exec", "os.spawn", "os.system", "os.popen"))
        if starts and _spells_slurm(node):
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:120]} (a Slurm command)")
        elif starts and rel not in PROCESS_STARTERS:
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:120]} (an undeclared process)")
    return found


def test_nothing_else_starts_a_slurm_command():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if rel != OWNER:
            offenders += _offences(ast.parse(path.read_text()), rel)
    assert not offenders, "run Slurm's clients with relaytrain.job.slurm_command:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    "source, rel",
    [
        ('subprocess.run(["scontrol", "show", "hostnames", x], capture_output=True)\n', "job/env.py"),
        ('subprocess.run(["ip", "addr"])\n', "job/env.py"),  # not declared
        ('subprocess.Popen(["srun", "--overlap", "true"])\n', "job/task.py"),  # declared, but Slurm
    ],
)
def test_the_scan_sees_a_slurm_command_started_by_hand(source, rel):
    assert _offences(ast.parse(source), rel)


def _requeues(tree: ast.AST, rel: str) -> list[str]:
    """Uses of the requeue's own scontrol calls, and command lines that spell `scontrol requeue`."""
    found, inner = [], ("scontrol_requeue", "_scontrol", "_requeue_excluding")
    for node in ast.walk(tree):
        names = (
            [node.id]
            if isinstance(node, ast.Name)
            else [node.attr]
            if isinstance(node, ast.Attribute)
            else []
        )
        names += [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
        found += [f"{rel}:{node.lineno}: {name}" for name in names if name in inner]
        if isinstance(node, (ast.List, ast.Tuple)):
            words = {e.value for e in node.elts if isinstance(e, ast.Constant)}
            if "scontrol" in words and words & {"requeue", "requeuehold"}:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_requeue_is_the_one_requeue_path():
    """Only relaytrain.resilience.requeue spells `scontrol requeue`; everything else calls `requeue()`."""
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if rel != REQUEUE_OWNER:
            offenders += _requeues(ast.parse(path.read_text()), rel)
    assert not offenders, "requeue through relaytrain.resilience.requeue.requeue():\n" + "\n".join(offenders)


def test_the_requeue_scan_sees_a_second_path():
    assert _requeues(ast.parse("from relaytrain.resilience.requeue import scontrol_requeue\n"), "x.py")
    assert _requeues(ast.parse('run_slurm_command(["scontrol", "requeue", job])\n'), "x.py")


def test_the_batch_template_keeps_no_copy_of_the_driver():
    """The batch script sets up the environment and hands over: no requeue, no run_state.json read, no
    port or interface rule of its own (the driver's, resilience/batch/job_setup.py)."""
    template = (SRC / "slurm" / "templates" / "job.sh.j2").read_text()
    for copy in ("scontrol requeue", "run_state", "requeue_pending", "pick_port", "port_in_use", "ip -br"):
        assert copy not in template, copy
