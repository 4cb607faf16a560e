"""What the cluster trials (bench/cluster/chaos.py, bench/cluster/goodput.py) share.

The local Slurm cluster and its lock, the tiny trial config, launching a run with `relaytrain launch`,
waiting for jobs and rank processes, preempting a node, and `RunFiles`: the one place that reads a run
directory's files, at the paths relaytrain's `RunDir` names, each through the relaytrain module that
owns it (metrics through `relaytrain.monitor.history`, the time ledger through
`relaytrain.monitor.run_ledger`, run_state.json through `RunStateFile`, crashes.jsonl through `CrashLog`,
checkpoints through `relaytrain.checkpoint.files`), and the run checked by `relaytrain verify`.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from relaytrain.checkpoint import files as checkpoint_files
from relaytrain.errors import UserError
from relaytrain.job import RunDir
from relaytrain.monitor.history import History, build_history, read_records
from relaytrain.monitor.run_ledger import RunTime, run_time
from relaytrain.resilience.batch.crash import CrashLog
from relaytrain.resilience.run_state import RunStateFile

from bench.report import REPO

sys.path.insert(0, str(REPO / "tests"))  # the tiny config the tests use too
from tiny_config import TINY_TOML  # noqa: E402

LOCK = "/tmp/relaytrain-slurm.lock"  # the local cluster is shared: one user at a time
OUT_ROOT = REPO / "bench" / "out"  # git-ignored; each benchmark writes under its own folder
PROFILE = REPO / "configs" / "clusters" / "local.toml"
CLUSTER_NODES, CLUSTER_CPUS_PER_NODE = 2, 4  # started when no local cluster is running
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")  # a job in these states is over
CONFIG = (
    """[run]
name = "{name}"
dir = "{runs}"

"""
    + TINY_TOML
    + """max_steps = {steps}
eval_every = {eval_every}
eval_steps = 2

[optim]
warmup_steps = 2

[metrics]
log_every = 1
tensorboard = false

[checkpoint]
interval = {interval}
mode = "async"

[resilience]
hard_deadline_s = 60
hang_timeout_s = 60

[slurm]
profile = "{profile}"
"""
)


def write_config(path: Path, name: str, runs: Path, steps: int, eval_every: int, interval: int) -> Path:
    """The trials' config: the tests' tiny model, 2 ranks' worth of steps, async checkpoints."""
    path.write_text(
        CONFIG.format(
            name=name, runs=runs, steps=steps, eval_every=eval_every, interval=interval, profile=PROFILE
        )
    )
    return path


# -- the cluster ------------------------------------------------------------------------------------


@contextmanager
def cluster_lock(enabled: bool = True) -> Iterator[None]:
    """flock(LOCK), unless the caller already holds it (`flock LOCK pytest -m slurm` runs the quick test)."""
    if not enabled:
        yield
        return
    with open(LOCK, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def start_cluster(lock: bool = True, nodes: int = CLUSTER_NODES):
    """The running local cluster, else a new one; its environment (SLURM_CONF, PATH) becomes ours. A
    running cluster with fewer than `nodes` nodes (a job with a spare needs 3: 2 would leave it pending
    for ever, "PartitionNodeLimit") is restarted in place with `nodes`, under the lock, as the Slurm
    tests' fixture does (tests/slurm_fixtures.py), and left up."""
    from relaytrain.localcluster import cluster as local_cluster

    with cluster_lock(lock):
        info = local_cluster.running_cluster()
        if info is not None and len(info.nodes) < nodes:
            print(f"bench: the local cluster has {len(info.nodes)} nodes, {nodes} needed: restarting it")
            local_cluster.cluster_down(info.base_dir)
            info = local_cluster.cluster_up(nodes=nodes, cpus_per_node=info.cpus_per_node)
        info = info or local_cluster.cluster_up(nodes=nodes, cpus_per_node=CLUSTER_CPUS_PER_NODE)
    os.environ.update(info.env)
    return info


def load_averages(samples: list[tuple[float, float, float]]) -> str:
    """`0.7/1.2/1.6 → 0.8/0.8/0.9`: os.getloadavg() samples, in order."""
    return " → ".join("/".join(f"{x:.1f}" for x in sample) for sample in samples)


# -- jobs -------------------------------------------------------------------------------------------


def relaytrain(*args: str, timeout: float = 120) -> str:
    done = subprocess.run(["relaytrain", *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(
            f"relaytrain {' '.join(args)} exited {done.returncode}: {done.stdout}{done.stderr}"
        )
    return done.stdout


def launch(config: Path, name: str, setup: str, *overrides: str, nodes: int = 1) -> str:
    """`relaytrain launch` of the run `name`: 2 ranks on one node (or 1 on each of 2 `nodes`), `setup` run
    in the batch shell before the step; its job id."""
    out = relaytrain("launch", str(config), "--nodes", str(nodes), "--tasks-per-node", str(2 // nodes),
                     f"--run.name={name}", f"--slurm.setup=['{setup}']", *overrides)  # fmt: skip
    match = re.search(r"submitted job (\d+)", out)
    if not match:
        raise RuntimeError(f"no job id in: {out}")
    return match.group(1)


def scontrol_job(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    return dict(re.findall(r"(?:^|\s)(\w+)=(\S*)", out))


def wait(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.3) -> Any:
    """The first true value of `predicate`, polled every `interval` s; TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def wait_job_end(job: str, timeout: float, interval: float = 1.0) -> dict[str, str]:
    """scontrol's fields of `job` once it is over (a requeued job is not: it goes back to PENDING)."""
    return wait(
        lambda: (fields := scontrol_job(job)) and fields.get("JobState") in ENDED and fields,
        timeout,
        f"job {job} to end",
        interval=interval,
    )


def preempting_partition() -> str:
    """The partition whose jobs preempt the benchmark's (PreemptMode=REQUEUE): the local cluster's `high`,
    or the one RELAYTRAIN_PREEMPT_PARTITION names (the test suite's lanes have one each)."""
    return os.environ.get("RELAYTRAIN_PREEMPT_PARTITION") or "high"


def preempt(job: str, cpus: int, hold_s: float, check: bool = False) -> str:
    """Take the node `job` runs on with a job on the preempting partition; the node. With `check`,
    sbatch's refusal (or no node to take) raises."""
    node = scontrol_job(job).get("BatchHost", "")
    if check and not node:
        raise RuntimeError(f"job {job} runs on no node to preempt")
    high, where = f"--partition={preempting_partition()}", f"--nodelist={node}"
    subprocess.run(["sbatch", high, where, "--nodes=1", "--ntasks=1", f"--cpus-per-task={cpus}",
                    "--output=/dev/null", f"--wrap=sleep {hold_s:g}"],
                   check=check, capture_output=True, timeout=30)  # fmt: skip
    return node


def rank_pids(job: str, rank: int | None = None) -> list[int]:
    """The job's training processes (not torchrun), found through their environment."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() not in environ or b"relaytrain.cli\0train" not in cmdline:
            continue
        if b"torch.distributed.run" in cmdline or b"relaytrain.job.torchrun" in cmdline:
            continue  # the torchrun agent, not a rank
        if rank is None or f"RANK={rank}".encode() in environ:
            pids.append(int(proc.name))
    return pids


def node_of(pid: int) -> str:
    """The local-cluster node a job process runs on (its slurmd's name)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"SLURMD_NODENAME="))


def wipe_snapshots(node: str, job: str, snapshot_dir: str, rank: int | None = None) -> list[str]:
    """Remove job `job`'s in-memory snapshots (or only rank `rank`'s files) from `node`'s memory, inside
    the node (bench/cluster/snapshot_wipe.py); the paths removed."""
    from relaytrain.localcluster import cluster as local_cluster

    command = f"cd {REPO} && {sys.executable} -m bench.cluster.snapshot_wipe {snapshot_dir} {job}"
    command += f" --rank {rank}" if rank is not None else ""
    done = local_cluster.on_node(node, ["sh", "-c", command])
    if done.returncode != 0:
        raise RuntimeError(f"wiping the snapshots of job {job} on {node} failed: {done.stderr[-500:]}")
    return done.stdout.split()


def kill_with_node_memory(job: str, pids: list[int], snapshot_dir: str) -> tuple[str, list[str], list[int]]:
    """SIGKILL a rank's processes, then remove every snapshot of the job from their node's memory, as a
    node that lost its memory would: (the node, the paths removed, the pids signalled)."""
    node = node_of(pids[0])
    signalled = []
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            signalled.append(pid)
    return node, wipe_snapshots(node, job, snapshot_dir), signalled


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# -- a run's files ----------------------------------------------------------------------------------


def _json_object(path: Path) -> dict[str, Any]:
    """A JSON object file, {} when it is missing, half written or not an object (its writer replaces it)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class RunFiles:
    """Everything the trials read from one run directory: each path from relaytrain's `RunDir`, each
    file read by the module that owns it. Nothing else in bench/cluster/ opens a file in a run directory."""

    def __init__(self, path: Path | str):
        self.dir = RunDir(Path(path))
        self.path = self.dir.root
        self.name = self.path.name

    def records(self, kind: str | None = None) -> list[dict[str, Any]]:
        """metrics.jsonl in file order (a requeued run's replayed steps included), of one kind or all;
        none yet is an empty list, a torn last line is skipped."""
        try:
            rows, _ = read_records(self.dir.metrics)
        except UserError:  # not written yet, or no record yet
            return []
        return [r for r in rows if kind is None or r["kind"] == kind]

    def history(self) -> History:
        """The run stitched over its jobs: one train record per step (the last one logged), all events."""
        return build_history(self.records())

    def time_ledger(self) -> RunTime:
        """The run's time ledger, with Slurm's Start..End of its jobs' runs where sacct answers, and what
        it was built from; RuntimeError (a trial's error) before the first record."""
        try:
            return run_time(self.dir)
        except UserError as err:
            raise RuntimeError(f"no time ledger: {err}") from None

    def verify(self) -> tuple[int, list[str]]:
        """`relaytrain verify RUN`'s exit code and its output lines (stdout, then stderr)."""
        done = subprocess.run([sys.executable, "-m", "relaytrain.cli", "verify", str(self.path)],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        return done.returncode, (done.stdout + done.stderr).splitlines()

    def state(self) -> dict[str, Any]:
        """The last run_state.json as its JSON object, {} when there is none yet (or it is damaged)."""
        record = RunStateFile(self.dir).read()
        return record.as_json() if record is not None else {}

    def crashes(self) -> list[dict[str, Any]]:
        return CrashLog(self.dir).entries()

    def job_log(self) -> str:
        """Every batch job's output, in job id order."""
        logs = sorted(self.dir.slurm.glob(self.dir.job_log("*").name), key=lambda p: (len(p.name), p.name))
        return "\n".join(p.read_text(errors="replace") for p in logs)

    def rank_log(self, rank: int) -> str:
        """What rank `rank` logged (every job of the run), "" when nothing yet."""
        path = self.dir.rank_log(rank)
        return path.read_text(errors="replace") if path.is_file() else ""

    def hang_stacks(self, rank: int) -> str:
        """The stacks the hang watchdog of `rank` dumped, "" when it dumped none."""
        path = self.dir.hang_dump(rank)
        return path.read_text(errors="replace") if path.is_file() else ""

    def hang_nodes(self) -> list[dict[str, Any]]:
        """The node watchers' views (hang/nodes/<node>.json) now: one object per readable node file."""
        return [view for p in sorted(self.dir.hang.glob("nodes/*.json")) if (view := _json_object(p))]

    def hang_record(self) -> dict[str, Any]:
        """The last hang the job's monitor detected (hang/last.json), {} when none (or unreadable)."""
        return _json_object(self.dir.hang_record)

    @property
    def checkpoints(self) -> Path:
        return self.dir.checkpoints

    def step_dir(self, step: int) -> Path:
        return self.checkpoints / checkpoint_files.step_dir_name(step)

    def committed(self, step_dir: Path) -> bool:
        return (step_dir / checkpoint_files.COMPLETE).is_file()

    def latest(self) -> Path | None:
        """Where `checkpoints/latest` points (the checkpoint layer owns what `latest` is)."""
        return checkpoint_files.read_latest(self.checkpoints)

    def latest_complete(self) -> bool:
        latest = self.latest()
        return latest is not None and self.committed(latest)

    def largest_checkpoint_bytes(self) -> int:
        return max((tree_bytes(e.path) for e in checkpoint_files.list_steps(self.checkpoints)), default=0)

    def leftovers(self, allowed: re.Pattern[str], limit: int = 5) -> list[str]:
        """Files, relative to the run directory, that `allowed` does not match (the first `limit`)."""
        found = (self.dir.relative(p) for p in self.path.rglob("*") if p.is_file())
        return sorted(rel for rel in found if not allowed.match(rel))[:limit]


def proc_state(pid: int) -> str:
    """/proc/<pid>/stat's state letter, "X" when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def error_text(err: BaseException, head: int = 200, tail: int = 500) -> str:
    """A trial's error, short: its start (what failed) and its end (why: a command's output ends with it)."""
    text = str(err)
    return text if len(text) <= head + tail else f"{text[:head]} ... {text[-tail:]}"


def watched_rank(run: RunFiles, job: str, rank: int) -> tuple[int, str] | None:
    """(pid, node) of `rank` as the node watchers see it in job `job`'s hang/nodes/<node>.json files."""
    for view in run.hang_nodes():
        if str(view.get("job_id")) != job:
            continue
        for entry in view.get("ranks") or []:
            if isinstance(entry, dict) and entry.get("rank") == rank and entry.get("state") != "X":
                return int(entry["pid"]), str(entry.get("node") or view.get("node"))
    return None


def locate(run: RunFiles, job: str, rank: int) -> tuple[int, str, str]:
    """(pid, node, where from) of `rank`: the node watchers' files, else (none within 30 s) /proc."""
    with suppress(TimeoutError):
        pid, node = wait(lambda: watched_rank(run, job, rank), 30, f"the node watchers' view of rank {rank}")
        return pid, node, "hang/nodes"
    pids = wait(lambda: rank_pids(job, rank=rank), 30, f"rank {rank}'s process")
    return pids[0], node_of(pids[0]), "/proc (no node watcher file)"
