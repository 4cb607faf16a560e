"""The in-job layer (relaytrain.job): job facts, SLURM -> torch env mapping, port, interface, task wrapper."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from relaytrain.job import JobFacts
from relaytrain.job.env import apply_slurm_env, normalize_amd_visibility, tasks_on_node
from relaytrain.job.netdetect import detect_interface, high_speed_interfaces
from relaytrain.job.ports import PORT_MAX, PORT_MIN, base_port, choose_port, has_no_listener

from conftest import child_env

# What srun sets for task 5 of a 2-node x 4-task step (values as Slurm 22.05 prints them).
SRUN_TASK_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURMD_NODENAME": "gpu08",
}


def test_srun_task_is_mapped_to_torch_variables():
    env = dict(SRUN_TASK_ENV)
    assert apply_slurm_env(env) is True
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("5", "1", "8")
    assert (env["LOCAL_WORLD_SIZE"], env["NODE_RANK"]) == ("4", "1")
    assert env["MASTER_ADDR"] == "gpu07"
    assert env["MASTER_PORT"] == str(base_port("4242"))
    assert PORT_MIN <= int(env["MASTER_PORT"]) <= PORT_MAX


def test_script_exports_win_and_uneven_nodes_give_the_right_local_world_size():
    env = dict(
        SRUN_TASK_ENV,
        MASTER_ADDR="10.0.0.1",
        MASTER_PORT="17000",
        SLURM_STEP_TASKS_PER_NODE="4,3",
        SLURM_STEP_NUM_TASKS="7",
    )
    assert apply_slurm_env(env)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "17000")
    assert (env["LOCAL_WORLD_SIZE"], env["WORLD_SIZE"]) == ("3", "7")
    assert tasks_on_node("2(x3),1", 2) == 2 and tasks_on_node("2(x3),1", 3) == 1


def test_no_mapping_under_torchrun_in_the_batch_shell_or_outside_slurm():
    torchrun = dict(SRUN_TASK_ENV, RANK="3", WORLD_SIZE="8", LOCAL_RANK="3")
    assert apply_slurm_env(torchrun) is False and torchrun["RANK"] == "3"
    batch = {k: v for k, v in SRUN_TASK_ENV.items() if k not in ("SLURM_STEP_ID",)}
    assert apply_slurm_env(batch) is False and "RANK" not in batch
    batch_step = dict(SRUN_TASK_ENV, SLURM_STEP_ID="4294967291")  # Slurm's id of the batch step
    assert apply_slurm_env(batch_step) is False
    empty: dict[str, str] = {}
    assert apply_slurm_env(empty) is False and empty == {}


def test_amd_visibility_drops_only_duplicated_absolute_ids():
    env = {"ROCR_VISIBLE_DEVICES": "4,5,6,7", "HIP_VISIBLE_DEVICES": "4,5,6,7", "CUDA_VISIBLE_DEVICES": "0,1"}
    normalize_amd_visibility(env)
    assert "HIP_VISIBLE_DEVICES" not in env and env["CUDA_VISIBLE_DEVICES"] == "0,1"
    same = {"ROCR_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": "0,1"}
    normalize_amd_visibility(same)
    assert same["HIP_VISIBLE_DEVICES"] == "0,1"  # renumbered ids mean the same devices: harmless


def test_job_facts_first_run_array_task_and_end_time():
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-3]", "SLURMD_NODENAME": "n2"}
    info = JobFacts.from_env(dict(env, SLURM_JOB_NUM_NODES="3"))
    assert info.in_slurm and info.restart_count == 0 and info.requeue_id == "77"
    assert info.nodes() == ["n1", "n2", "n3"] and info.num_nodes == 3 and info.host() == "n2"
    assert info.identity() == {"job_id": "77", "requeue_id": "77", "restart_count": 0, "step_restarts": 0}
    arr = JobFacts.from_env(
        {
            "SLURM_JOB_ID": "81",
            "SLURM_ARRAY_JOB_ID": "80",
            "SLURM_ARRAY_TASK_ID": "1",
            "SLURM_RESTART_COUNT": "2",
            "SLURM_JOB_END_TIME": "1700000000",
        }
    )
    assert arr.requeue_id == "80_1" and arr.restart_count == 2
    assert arr.end_time() == (1700000000.0, "SLURM_JOB_END_TIME")
    # Old Slurm versions (and some wrappers) export only SLURM_JOBID.
    assert JobFacts.from_env({"SLURM_JOBID": "9"}).requeue_id == "9"
    outside = JobFacts.from_env({})
    assert not outside.in_slurm and outside.nodes() == [] and outside.end_time() == (None, "not a SLURM job")


def test_the_job_layer_imports_nothing_above_it():
    code = (
        "import sys, relaytrain.job, relaytrain.job.task; "
        "print(sorted(m for m in sys.modules if m.startswith('relaytrain') or m == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    leaves = ("relaytrain.errors", "relaytrain.version", "relaytrain.entry_points")  # layer 0
    loaded = {m for m in eval(out) if not m.startswith(("relaytrain.job", *leaves))}
    assert loaded == {"relaytrain"}


def test_port_is_deterministic_and_skips_ports_in_use():
    assert base_port(4242) == base_port("4242") == PORT_MIN + 4242 % 5001
    assert base_port(5001) == PORT_MIN and PORT_MIN <= base_port("80_1") <= PORT_MAX
    busy = {base_port(9), base_port(9) + 1}
    assert choose_port(9, lambda p: p not in busy) == base_port(9) + 2
    assert choose_port(5000, lambda p: p != PORT_MAX) == PORT_MIN  # wraps inside the range


def _listening_on_a_job_base_port(sock: socket.socket) -> int:
    """A job id whose base port this test could take (listening on it), whatever else runs here."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    for job_id in range(1234, 1234 + 500):
        try:
            sock.bind(("127.0.0.1", base_port(job_id)))
        except OSError:
            continue  # taken by another process on this machine: the next job id's port
        sock.listen()
        return job_id
    raise AssertionError("500 job ids' base ports are all taken on this machine")


def test_the_port_an_attached_script_asks_for_skips_a_listening_socket():
    """`python -m relaytrain.job.ports JOB_ID`, run on the allocation's first node by an attached script."""
    with socket.socket() as sock:
        job_id = _listening_on_a_job_base_port(sock)
        out = subprocess.run(
            [sys.executable, "-m", "relaytrain.job.ports", str(job_id)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert int(out) == choose_port(job_id, has_no_listener) == base_port(job_id) + 1


# Recorded `ip -br addr` outputs.
IP_DGX_IB = """lo               UNKNOWN        127.0.0.1/8 ::1/128
eno1             UP             10.31.1.21/16 fe80::3eec:efff:fe4a:1b2c/64
ibp12s0          DOWN
ib0              UP             10.32.1.21/16 fe80::ba59:9f03:0:1/64
ib1              UP             10.33.1.21/16 fe80::ba59:9f03:0:2/64
docker0          DOWN           172.17.0.1/16
"""
IP_FRONTIER = """lo               UNKNOWN        127.0.0.1/8 ::1/128
hsn0             UP             10.128.3.45/14 fe80::ee0d:9aff:fe71:28a2/64
hsn1             UP             10.128.3.46/14 fe80::ee0d:9aff:fe71:28a3/64
nmn0             UP             10.100.3.45/22
"""
IP_IB_DOWN_WITH_PKEY = """lo               UNKNOWN        127.0.0.1/8 ::1/128
ib0              DOWN
ib0.8066@ib0     UP             192.168.20.4/24 fe80::1/64
em4              UP             10.0.7.4/24
"""
IP_ETHERNET_ONLY = """lo               UNKNOWN        127.0.0.1/8 ::1/128
eth0             UP             192.0.2.2/24 fd00::2/64 fe80::fc:ff:fe00:1/64
rlt-host@if3     UP             10.250.0.1/24 fe80::9862:d3ff:fe0b:d53/64
"""
IP_IB_NO_ADDRESS = """ib0              UP
hsn0             UP             10.1.0.2/16
"""


@pytest.mark.parametrize(
    "text, expected",
    [
        (IP_DGX_IB, "ib0"),
        (IP_FRONTIER, "hsn0"),
        (IP_IB_DOWN_WITH_PKEY, "ib0.8066"),
        (IP_ETHERNET_ONLY, None),
        (IP_IB_NO_ADDRESS, "hsn0"),
        ("", None),
    ],
)
def test_interface_detection(text, expected):
    assert detect_interface(text) == expected


def test_profile_interface_wins_and_doctor_lists_all():
    assert detect_interface(IP_DGX_IB, preferred="eno1") == "eno1"
    assert high_speed_interfaces(IP_DGX_IB) == ["ib0", "ib1"]
    assert high_speed_interfaces(IP_FRONTIER) == ["hsn0", "hsn1"]


def test_task_wrapper_maps_the_environment_and_execs_the_command():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RANK", "MASTER"))}
    env.update(SRUN_TASK_ENV)
    keys = "('RANK', 'LOCAL_RANK', 'MASTER_ADDR')"
    code = f"import json, os; print(json.dumps({{k: os.environ[k] for k in {keys}}}))"
    out = subprocess.run(
        [sys.executable, "-m", "relaytrain.job.task", "--map-env", "--", sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout) == {"RANK": "5", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu07"}
    bad = subprocess.run(
        [sys.executable, "-m", "relaytrain.job.task", "--", "/nonexistent/cmd"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 127 and "cannot run" in bad.stderr


def test_a_stop_signal_during_the_wrappers_start_reaches_the_trainers_early_capture():
    """srun forwards Slurm's pre-timeout signal while the task wrapper still starts: the wrapper must
    not die by it, and the command it execs must learn of it (the trainer's early capture replays it)."""
    command = (
        "import signal; from relaytrain.resilience.rank import early_signals; "
        "early_signals.capture_early_signals(); "
        "print([signal.Signals(s).name for s in early_signals.drain_early_signals()]); "
        "import os; print(os.environ.get('RELAYTRAIN_EARLY_SIGNALS'))"
    )
    # The signal is sent from inside the wrapper's process, after its capture and before its exec: a
    # forced version of the race (an srun forwarding it in the wrapper's first milliseconds).
    code = (
        "import os, signal, sys; from relaytrain.job import task; task.capture_stop_signals(); "
        "os.kill(os.getpid(), signal.SIGUSR2); "
        f"sys.exit(task.main(['--', sys.executable, '-c', {command!r}]))"
    )
    env = child_env(RELAYTRAIN_EARLY_SIGNALS="SIGTERM")  # named by an outer wrapper: both are kept
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["['SIGTERM', 'SIGUSR2']", "None"]  # replayed, then consumed


def test_a_step_placed_by_a_host_file_gets_the_node_rank_of_its_rank_block(tmp_path):
    """A spare (gpu09) in gpu07's place: the host file puts ranks 0-3 on gpu09 and 4-7 on gpu08, while
    Slurm numbers the step's nodes in its own order (gpu08 is node 0). NODE_RANK follows the ranks, as a
    --command program (Lightning, accelerate) needs it."""
    hosts = tmp_path / "hosts"
    hosts.write_text("gpu09\n" * 4 + "gpu08\n" * 4)
    step = {**SRUN_TASK_ENV, "SLURM_NODEID": "0", "SLURM_HOSTFILE": str(hosts)}
    placed = dict(step)
    assert apply_slurm_env(placed) and placed["NODE_RANK"] == "1"
    spare = dict(step, SLURMD_NODENAME="gpu09", SLURM_NODEID="1", SLURM_PROCID="1", SLURM_LOCALID="1")
    assert apply_slurm_env(spare) and spare["NODE_RANK"] == "0"
    unreadable = dict(step, SLURM_HOSTFILE=str(tmp_path / "gone"))
    assert apply_slurm_env(unreadable) and unreadable["NODE_RANK"] == "0"  # Slurm's own number then
