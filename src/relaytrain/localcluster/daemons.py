"""Packages, pid files and processes behind the local Slurm cluster: install, start, check, stop."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from relaytrain.errors import UserError

SLURM_PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
# program -> Debian package that provides it
REQUIRED_PROGRAMS = {
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "sbatch": "slurm-client",
    "munged": "munge",
    "ip": "iproute2",
    "nsenter": "util-linux",
    "unshare": "util-linux",
}
MUNGE_RUN_DIR = Path("/run/munge")
MUNGE_PID_FILE = MUNGE_RUN_DIR / "munged.pid"
MUNGE_KEY = Path("/etc/munge/munge.key")


def install_command(packages: list[str]) -> str:
    return (
        "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
        + " ".join(packages)
    )


def missing_packages() -> list[str]:
    missing = {pkg for prog, pkg in REQUIRED_PROGRAMS.items() if shutil.which(prog) is None}
    if missing & set(SLURM_PACKAGES):
        missing |= set(SLURM_PACKAGES)
    return sorted(missing)


def is_root() -> bool:
    return os.geteuid() == 0


def ensure_installed() -> None:
    """Install Debian's slurm-wlm pieces and munge when missing (root only)."""
    missing = missing_packages()
    if not missing:
        return
    if not is_root():
        raise UserError(f"Slurm is not installed; as root run: {install_command(missing)}")
    if shutil.which("apt-get") is None:
        raise UserError(f"missing {' '.join(missing)} and no apt-get here; install them by hand")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "--no-install-recommends", *missing],
    ):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {done.returncode}):\n{tail}")


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def pid_alive(pid: int | None, program: str | None = None) -> bool:
    """True if ``pid`` runs and is not a zombie (and, if given, its command name is ``program``)."""
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    state = stat[stat.rindex(")") + 2]
    if state in "ZX":
        return False
    return program is None or comm == program[:15]


def daemon_alive(pid_file: Path, program: str) -> bool:
    return pid_alive(read_pid(pid_file), program)


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def start_detached(cmd: list[str], env: dict[str, str]) -> None:
    """Run a command that daemonizes itself, without handing it our stdout/stderr pipes."""
    done = subprocess.run(
        cmd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {done.returncode}): {done.stderr.strip()}")


def stop_pid(pid: int | None, program: str | None = None, timeout: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL."""
    if not pid_alive(pid, program):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if not wait_until(lambda: not pid_alive(pid), timeout):
        kill_pids([pid])


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not any(pid_alive(p) for p in pids), 5.0)


def munged_alive() -> bool:
    return daemon_alive(MUNGE_PID_FILE, "munged")


def ensure_munged() -> bool:
    """Start munged unless it runs already; returns True if this call started it."""
    if munged_alive():
        return False
    if not MUNGE_KEY.exists():
        subprocess.run(["mungekey", "--create", "--keyfile", str(MUNGE_KEY)], check=True)
        shutil.chown(MUNGE_KEY, "munge", "munge")
        MUNGE_KEY.chmod(0o600)
    MUNGE_RUN_DIR.mkdir(parents=True, exist_ok=True)
    shutil.chown(MUNGE_RUN_DIR, "munge", "munge")
    MUNGE_RUN_DIR.chmod(0o755)
    start_detached(["runuser", "-u", "munge", "--", "munged"], env=_plain_env())
    if not wait_until(munged_alive, 10.0):
        raise RuntimeError(f"munged did not start (no live pid in {MUNGE_PID_FILE})")
    return True


def _plain_env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LANG": "C.UTF-8"}


def daemon_env(slurm_conf: Path) -> dict[str, str]:
    return {**_plain_env(), "SLURM_CONF": str(slurm_conf)}
