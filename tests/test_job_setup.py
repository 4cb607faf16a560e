"""What the batch job's driver sets up before its first step (resilience/batch/job_setup.py), formerly
the batch shell's: the training nodes and spares, the master, and the job log's record of the environment."""

from __future__ import annotations

import re
import subprocess
import sys

from relaytrain.job import JobFacts
from relaytrain.job.ports import PORT_MAX, PORT_MIN
from relaytrain.resilience.batch import job_setup, spares


def test_the_first_nodes_train_and_the_others_are_spares(monkeypatch):
    job = JobFacts.from_env({"SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "n1,n2,n3"})
    assert spares.split_nodes(job, 2) == (["n1", "n2"], ["n3"])
    assert spares.split_nodes(job, 0) == (["n1", "n2", "n3"], [])
    environ = {"SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "n1,n2,n3"}
    monkeypatch.setattr(job_setup, "read_ip_brief", lambda: "ib0 UP 10.0.0.1/16\n")
    nodes = job_setup.prepare(environ, 2, 8)
    assert nodes.training == ["n1", "n2"] and environ["MASTER_ADDR"] == "n1"
    assert PORT_MIN <= int(environ["MASTER_PORT"]) <= PORT_MAX
    assert environ["NCCL_SOCKET_IFNAME"] == environ["GLOO_SOCKET_IFNAME"] == "ib0"


def test_the_environment_record_leaves_secrets_out(capsys, tmp_path):
    environ = {"NCCL_DEBUG": "INFO", "HF_TOKEN": "x", "TORCH_API_KEY": "s3cret", "HOME": "/root"}
    job_setup.record_environment(environ, "no-such-gpu-tool", None)
    out = capsys.readouterr().out
    assert "    NCCL_DEBUG=INFO\n" in out and "s3cret" not in out and "HOME" not in out


def test_the_package_list_is_pip_freeze_s(capsys, tmp_path):
    """The kept list names what `pip freeze` names, each at its version; an editable install says so. In
    this process setuptools (imported) has put its vendored copies on sys.path: they are left out."""
    import setuptools  # noqa: F401 - appends setuptools/_vendor to sys.path, as in the suite's workers

    kept = tmp_path / "slurm" / "pip-freeze-41.txt"
    job_setup.record_environment({}, "no-such-gpu-tool", kept)
    lines = kept.read_text().splitlines()
    pip = [sys.executable, "-m", "pip", "freeze"]
    frozen = subprocess.run(pip, capture_output=True, text=True, check=True).stdout.splitlines()

    def name(line: str) -> str:
        return re.sub(r"[-_.]+", "-", line.split("  #")[0].lower())

    pinned = [line for line in frozen if "==" in line and not line.startswith("#")]
    editable = [line for line in lines if "# editable install from" in line]
    assert {name(line) for line in lines} - {name(line) for line in editable} == {name(p) for p in pinned}
    assert len(editable) == len([line for line in frozen if line.startswith("-e ")]), (editable, frozen)
    assert any(line.startswith("relaytrain==") for line in lines)
    out = capsys.readouterr().out
    assert f"python packages: {len(lines)} (full list in {kept})" in out and "    torch==" in out
