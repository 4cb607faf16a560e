"""`relaytrain doctor`: is this cluster (login node or allocation) ready for a relaytrain job?

Each check returns (name, pass|warn|fail, detail). Inside an allocation (SLURM_JOB_ID set) the shared
filesystem and the Python environment are checked on every node with `srun --overlap`.
"""

from __future__ import annotations

import getpass
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

from relaytrain.config import Config
from relaytrain.job import JobFacts
from relaytrain.job.netdetect import high_speed_interfaces, read_ip_brief
from relaytrain.job.slurm_command import run_slurm_command
from relaytrain.monitor.mfu import cpu_capability
from relaytrain.slurm.client import SlurmUnavailable, run_slurm, slurm_error
from relaytrain.version import __version__

Check = tuple[str, str, str]
PROBE_TIMEOUT_S = 60.0
REQUIRED_TOOLS = ("sbatch", "srun", "squeue", "scontrol")
OPTIONAL_TOOLS = ("sinfo", "sacct", "sacctmgr")
SHARED_FS = {
    "nfs",
    "nfs4",
    "lustre",
    "gpfs",
    "beegfs",
    "wekafs",
    "cifs",
    "smb2",
    "ceph",
    "fuse.ceph",
    "cephfs",
    "panfs",
    "fuse.glusterfs",
    "glusterfs",
    "vast",
    "fuse.sshfs",
}
LOCAL_FS = {"tmpfs", "ext2", "ext3", "ext4", "xfs", "btrfs", "overlay", "zfs", "ramfs"}


def srun_probe(args: list[str]) -> tuple[int, str, str]:
    """Run ``srun --overlap ARGS`` in the allocation and keep whatever it says."""
    done = run_slurm_command(["srun", "--overlap", *args], PROBE_TIMEOUT_S)
    return (done.returncode if done.ran else 127), done.stdout, done.stderr or done.why()


def run_tool(cmd: list[str]) -> tuple[int, str, str]:
    """Run a local tool (stat, nvidia-smi) and keep whatever it says."""
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        return 127, "", str(exc)
    return result.returncode, result.stdout, result.stderr


def check_tools() -> Check:
    missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    optional = [t for t in OPTIONAL_TOOLS if shutil.which(t) is None]
    if missing:
        return ("slurm commands", "fail", f"missing {', '.join(missing)}: not a Slurm login or compute node")
    detail = "all found" + (f" (not found: {', '.join(optional)})" if optional else "")
    return ("slurm commands", "pass", detail)


def check_partition(partition: str) -> Check:
    try:
        result = run_slurm(["sinfo", "-h", "-o", "%P|%a|%D"])
    except SlurmUnavailable as exc:
        return ("partition", "fail", str(exc))
    if result.returncode != 0:
        return ("partition", "fail", f"sinfo failed: {slurm_error(result)}")
    out = result.stdout
    parts = {line.split("|")[0]: line.split("|") for line in out.splitlines() if "|" in line}
    default = next((p.rstrip("*") for p in parts if p.endswith("*")), "")
    names = {p.rstrip("*") for p in parts}
    if not partition:
        if default:
            return ("partition", "pass", f"none given; the default partition is {default}")
        return ("partition", "warn", "none given and no default partition; set slurm.partition")
    if partition not in names:
        return ("partition", "fail", f"{partition!r} not found; partitions: {', '.join(sorted(names))}")
    row = parts.get(partition) or parts.get(partition + "*")
    if row and len(row) > 1 and row[1] != "up":
        return ("partition", "warn", f"{partition} is {row[1]}")
    return ("partition", "pass", f"{partition} is up")


def check_account(account: str) -> Check:
    if not account:
        return ("account", "pass", "none given (Slurm uses your default account)")
    if shutil.which("sacctmgr") is None:
        return ("account", "warn", "sacctmgr not found; cannot check the account")
    cmd = ["sacctmgr", "-n", "-P", "show", "assoc", f"user={getpass.getuser()}", f"account={account}"]
    try:
        result = run_slurm([*cmd, "format=account"])
    except SlurmUnavailable as exc:
        return ("account", "fail", str(exc))
    if result.returncode != 0:
        return ("account", "warn", f"sacctmgr failed ({slurm_error(result)[:100]}); cannot check")
    if account in {line.strip() for line in result.stdout.splitlines()}:
        return ("account", "pass", f"{account} is one of your associations")
    return ("account", "fail", f"you have no association with account {account!r}")


def filesystem_type(path: Path) -> str:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    rc, out, _ = run_tool(["stat", "-f", "-c", "%T", str(probe)])
    return out.strip() if rc == 0 else ""


def check_shared_dir(run_root: Path, nodes: list[str]) -> Check:
    run_root = run_root.absolute()
    if len(nodes) > 1:
        run_root.mkdir(parents=True, exist_ok=True)
        token = f".doctor-{uuid.uuid4().hex[:8]}"
        marker = f"{run_root}/{token}-$SLURMD_NODENAME"
        rc, _, err = srun_probe(
            [
                f"--nodes={len(nodes)}",
                "--ntasks-per-node=1",
                "bash",
                "-c",
                f'touch "{marker}"',
            ]
        )
        seen = sorted(p.name.removeprefix(token + "-") for p in run_root.glob(token + "-*"))
        for p in run_root.glob(token + "-*"):
            p.unlink()
        if rc == 0 and len(seen) == len(nodes):
            return (
                "shared run directory",
                "pass",
                f"{run_root}: files written by all {len(nodes)} nodes are seen",
            )
        return (
            "shared run directory",
            "fail",
            f"{run_root}: only {seen or 'no nodes'} wrote files visible "
            f"here ({err.strip()[:80]}); put run.dir on a filesystem every node mounts",
        )
    fs = filesystem_type(run_root)
    if str(run_root).startswith(("/tmp", "/var/tmp", "/dev/shm")) or fs in LOCAL_FS:
        return (
            "shared run directory",
            "warn",
            f"{run_root} is on {fs or 'a local path'}: other nodes may not "
            "see it; use a shared filesystem for multi-node runs",
        )
    if fs in SHARED_FS:
        return ("shared run directory", "pass", f"{run_root} is on {fs}")
    return (
        "shared run directory",
        "warn",
        f"{run_root} is on {fs or 'an unknown filesystem'}; check every node mounts it",
    )


def check_network(preferred: str = "") -> Check:
    names = high_speed_interfaces(read_ip_brief())
    if preferred:
        status = "pass" if preferred in names or not names else "warn"
        return ("high-speed network", status, f"profile sets {preferred}; found {names or 'no ib*/hsn*'}")
    if names:
        return ("high-speed network", "pass", f"{', '.join(names)} (NCCL_SOCKET_IFNAME={names[0]})")
    return (
        "high-speed network",
        "warn",
        "no ib*/hsn* interface up here; NCCL and Gloo use their default "
        "(fine on a login node or single-node jobs)",
    )


def check_gpus(expected: int, in_job: bool) -> Check:
    for tool, args in (("nvidia-smi", ["-L"]), ("rocm-smi", ["--showid"])):
        if shutil.which(tool):
            rc, out, _ = run_tool([tool, *args])
            count = sum(1 for line in out.splitlines() if line.startswith("GPU") or "GPU[" in line)
            if rc == 0 and count:
                if in_job and expected and count < expected:
                    return ("GPUs", "fail", f"{count} visible, the job expects {expected} per node")
                return ("GPUs", "pass", f"{count} visible ({tool})")
    level = "fail" if in_job and expected else "warn"
    return ("GPUs", level, "no GPU visible here" + ("" if in_job else " (normal on a login node)"))


def _environment_signature() -> str:
    return f"{sys.executable} relaytrain {__version__}"


def check_environment(nodes: list[str]) -> Check:
    here = _environment_signature()
    if len(nodes) <= 1:
        return ("python environment", "pass", here)
    code = "import sys, relaytrain; print(sys.executable, 'relaytrain', relaytrain.__version__)"
    rc, out, err = srun_probe([f"--nodes={len(nodes)}", "--ntasks-per-node=1", "python", "-c", code])
    answers = {line.strip() for line in out.splitlines() if line.strip()}
    if rc != 0 or not answers:
        return ("python environment", "fail", f"relaytrain not importable on every node: {err.strip()[:120]}")
    if len(answers) > 1 or here not in answers:
        return ("python environment", "fail", "nodes differ: " + " | ".join(sorted(answers | {here})))
    return ("python environment", "pass", f"{here} on all {len(nodes)} nodes")


def check_tokenizer(cfg: Config | None) -> Check:
    if cfg is None:
        return ("tokenizer", "pass", "no config given; nothing to check")
    tok = cfg.data.tokenizer
    if tok == "byte":
        return ("tokenizer", "pass", "built-in byte tokenizer")
    if Path(tok).is_file():
        return ("tokenizer", "pass", f"{tok} is cached locally")
    return (
        "tokenizer",
        "fail",
        f"data.tokenizer {tok!r} not found; compute nodes cannot download it: "
        "copy tokenizer.json to a shared path first",
    )


def run_checks(cfg: Config | None, partition: str = "", account: str = "") -> list[Check]:
    job = JobFacts.from_env()
    in_job = job.in_slurm
    nodes = job.nodes()
    s = cfg.slurm if cfg is not None else None
    checks = [check_tools()]
    if checks[0][1] != "fail":
        checks.append(check_partition(partition or (s.partition if s else "")))
        checks.append(check_account(account or (s.account if s else "")))
    run_root = Path(cfg.run.dir) if cfg is not None else Path("runs")
    checks.append(check_shared_dir(run_root, nodes))
    checks.append(check_network(s.network_interface if s else ""))
    expected = s.gpus_per_node if s and s.gpus_per_node > 0 else 0
    checks.append(check_gpus(expected, in_job))
    checks.append(check_environment(nodes))
    checks.append(("CPU capability", "pass", f"{cpu_capability()} (bf16 speed and rounding depend on it)"))
    checks.append(check_tokenizer(cfg))
    return checks
