"""Slow one rank of a running job from outside it: a CPU quota on all its threads (a straggler).

    python -m faults.throttle --job JOB --rank R --factor 1.5     # rank R of Slurm job JOB, 1.5x slower
    python -m faults.throttle --pid PID --factor 2                # any process
    python -m faults.throttle --release --pid PID                 # back to its own cgroup's share

The rank's process (every thread: ``cgroup.procs`` moves them all) goes into a new cgroup of its own
whose quota lets it run ``cpus / factor`` CPUs' worth per period, where ``cpus`` is the compute threads it
runs (its ``OMP_NUM_THREADS``; the local cluster's ranks run one). A rank that would run its work at that
many full CPUs then takes ``factor`` times as long. A quota alone does not slow a rank that already gets
less than it (a busy machine, where every process has a fraction of a CPU), so the cgroup's CPU weight is
also cut to ``1/factor`` of a process's: when CPUs are contended, the rank gets ``factor`` times less of
them than its peers. A benchmark still compares the slowdown measured with the one applied. The period is
short (2 ms, longer only where the kernel's 1 ms minimum quota needs it) so that every phase of a step is
slowed alike, not one in a hundred by a long stall. cgroup v1 (``cpu.cfs_quota_us``, ``cpu.shares``) and
v2 (``cpu.max``, ``cpu.weight``) both work; it needs root.

The rank is found through ``/proc``: the process whose environment has ``SLURM_JOB_ID=JOB`` and
``RANK=R`` and whose command line runs ``relaytrain.cli train`` (not the torchrun agent). On success it
prints one ``relaytrain-faults: landed: throttle ...`` line (what ``faults.landed`` reads) with the pid,
node, factor, quota and the cgroup path, after reading the pid back from the cgroup.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from pathlib import Path

from faults.pythonpath.relaytrain_faults import LANDED

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 2_000
MIN_QUOTA_US = 1_000  # the kernel refuses a smaller CFS quota
V1_SHARES, V2_WEIGHT = 1024, 100  # a process's CPU weight when nobody set one
PREFIX = "relaytrain-throttle-"


def job_process(job: str, marks: tuple[bytes, ...], command: bytes, proc: Path = Path("/proc")) -> int | None:
    """A process of Slurm job `job` on this machine whose environment holds every one of `marks` and whose
    command line runs `relaytrain COMMAND` in this process (not through a launcher), or None."""
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() not in environ or b"relaytrain.cli\0" + command not in cmdline:
            continue
        if b"torch.distributed.run" in cmdline or b"relaytrain.job.torchrun" in cmdline:
            continue
        if all(mark in environ for mark in marks):
            return int(entry.name)
    return None


def rank_pid(job: str, rank: int, proc: Path = Path("/proc")) -> int | None:
    """The training process of `rank` in Slurm job `job` on this machine, or None."""
    return job_process(job, (f"RANK={rank}".encode(),), b"train", proc)


def _environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


def compute_threads(pid: int) -> int:
    """The compute threads the process runs: its OMP_NUM_THREADS, else 1."""
    try:
        return max(1, int(_environ(pid).get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


def quota_us(factor: float, cpus: int, period_us: int = PERIOD_US) -> tuple[int, int]:
    """(quota, period) in microseconds that make `cpus` full-speed threads `factor` times slower: the
    period is widened where the quota would fall under the kernel's minimum, never the quota raised
    (which would slow the rank by less than asked)."""
    if factor < 1:
        raise ValueError(f"a slowdown factor is at least 1, not {factor}")
    period = max(period_us, math.ceil(MIN_QUOTA_US * factor / cpus))
    return round(cpus * period / factor), period


def weight(factor: float, default: int) -> int:
    """The CPU weight that gives the cgroup `1/factor` of a default process's share of a busy CPU."""
    return max(2, round(default / factor))


def _cgroup_root() -> tuple[Path, str]:
    if (V1 / "cpu.cfs_quota_us").exists():
        return V1, "v1"
    if (V2 / "cgroup.controllers").exists() and "cpu" in (V2 / "cgroup.controllers").read_text().split():
        return V2, "v2"
    raise SystemExit("throttle: no writable cpu cgroup (v1 /sys/fs/cgroup/cpu or v2 with the cpu controller)")


def throttle(pid: int, factor: float, cpus: int, period_us: int = PERIOD_US) -> dict[str, object]:
    root, version = _cgroup_root()
    group = root / f"{PREFIX}{pid}"
    group.mkdir(exist_ok=True)
    quota, period = quota_us(factor, cpus, period_us)
    if version == "v1":
        shares = weight(factor, V1_SHARES)
        (group / "cpu.cfs_period_us").write_text(str(period))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
        (group / "cpu.shares").write_text(str(shares))
    else:
        shares = weight(factor, V2_WEIGHT)
        (root / "cgroup.subtree_control").write_text("+cpu")
        (group / "cpu.max").write_text(f"{quota} {period}")
        (group / "cpu.weight").write_text(str(shares))
    (group / "cgroup.procs").write_text(str(pid))  # every thread of the process moves with it
    members = {int(p) for p in (group / "cgroup.procs").read_text().split()}
    if pid not in members:
        raise SystemExit(f"throttle: pid {pid} is not in {group} after moving it there")
    return {"pid": pid, "factor": factor, "cpus": cpus, "quota_us": quota, "period_us": period,
            "weight": shares, "cgroup": str(group), "cgroup_version": version}  # fmt: skip


def release(pid: int) -> None:
    """The process back into the root cpu cgroup; its throttle cgroup removed."""
    root, _version = _cgroup_root()
    group = root / f"{PREFIX}{pid}"
    with contextlib.suppress(OSError):  # the process has exited
        (root / "cgroup.procs").write_text(str(pid))
    if group.exists():
        group.rmdir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m faults.throttle", description=__doc__.split("\n")[0])
    parser.add_argument("--job", help="Slurm job id (with --rank)")
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--pid", type=int, help="the process, instead of --job/--rank")
    parser.add_argument("--factor", type=float, default=1.5, help="how many times slower (>= 1)")
    parser.add_argument("--period-us", type=int, default=PERIOD_US)
    parser.add_argument("--release", action="store_true", help="undo a throttle")
    args = parser.parse_args(argv)
    pid = args.pid if args.pid is not None else (rank_pid(args.job, args.rank) if args.job else None)
    if pid is None:
        print(f"throttle: no process of job {args.job} rank {args.rank} on this machine", file=sys.stderr)
        return 1
    if args.release:
        release(pid)
        print(f"throttle: released pid {pid}")
        return 0
    done = throttle(pid, args.factor, compute_threads(pid), args.period_us)
    node = _environ(pid).get("SLURMD_NODENAME", os.uname().nodename)
    fields = " ".join(f"{k}={v}" for k, v in done.items())
    print(f"{LANDED} throttle rank={args.rank} node={node} {fields}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
