"""A real multi-node Slurm cluster on this machine: munged, slurmctld and one slurmd per node.

Each node runs in its own network namespace (own address, own hostname), so multi-node jobs really
talk over TCP between nodes; the root namespace holds the controller address, so ``sbatch``,
``squeue`` and tests work from an ordinary shell with ``SLURM_CONF`` set. See docs/local-cluster.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from relaytrain.errors import UserError
from relaytrain.job.slurm_command import SlurmResult, run_slurm_command
from relaytrain.localcluster import daemons, lock, net, node_memory

DEFAULT_BASE_DIR = Path("/tmp/relaytrain-cluster")
BASE_DIR_ENV = "RELAYTRAIN_CLUSTER_DIR"
STATE_FILE = "cluster.json"
CONTROLLER_PORT = 6817
SLURMD_PORT = 6818
MAX_NODES = 200
READY_STATES = {"idle", "mixed", "allocated", "completing"}
START_TIMEOUT_S = 60.0

Report = Callable[[str], None]


@dataclass(frozen=True)
class ClusterInfo:
    """How to reach a running local cluster. ``env`` holds what clients need (SLURM_CONF)."""

    base_dir: Path
    slurm_conf: Path
    nodes: tuple[str, ...]
    cpus_per_node: int
    node_addrs: dict[str, str] = field(default_factory=dict)
    controller_addr: str = net.CONTROLLER_ADDR
    started: bool = False

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.slurm_conf)}

    def usage(self) -> str:
        nodes = ", ".join(f"{n} {self.node_addrs[n]}" for n in self.nodes)
        return "\n".join(
            [
                f"Slurm cluster up: {len(self.nodes)} nodes ({nodes}) x {self.cpus_per_node} CPUs, "
                f"controller {self.controller_addr}:{CONTROLLER_PORT}.",
                "Partitions: debug (default), high (preempts debug jobs, which are requeued).",
                "Use it from this shell:",
                f"  export SLURM_CONF={self.slurm_conf}",
                "  sinfo; squeue; sbatch --nodes=2 --ntasks-per-node=2 --wrap 'srun hostname'",
                "  sacct -c -j <jobid>    (finished jobs, from the jobcomp file)",
                f"Logs: {self.base_dir}/log.  Stop it: relaytrain cluster down",
            ]
        )


def resolve_base_dir(base_dir: str | Path | None = None) -> Path:
    return Path(base_dir or os.environ.get(BASE_DIR_ENV) or DEFAULT_BASE_DIR).resolve()


def _conf_path(base: Path) -> Path:
    return base / "slurm.conf"


def _ctld_pid_file(base: Path) -> Path:
    return base / "run" / "slurmctld.pid"


def _slurmd_pid_file(base: Path, name: str) -> Path:
    return base / "run" / f"slurmd-{name}.pid"


def _load_state(base: Path) -> dict | None:
    try:
        return json.loads((base / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def _info(base: Path, state: dict, started: bool) -> ClusterInfo:
    count = state["nodes"]
    names = tuple(net.node_name(k) for k in range(1, count + 1))
    addrs = {net.node_name(k): net.node_addr(k) for k in range(1, count + 1)}
    return ClusterInfo(base, _conf_path(base), names, state["cpus_per_node"], addrs, started=started)


def run_slurm(args: list[str], base: Path, timeout: float = 30.0) -> SlurmResult:
    """Run a Slurm client (sinfo, squeue, scontrol, scancel...) against this cluster."""
    env = {**os.environ, "SLURM_CONF": str(_conf_path(base))}
    return run_slurm_command(args, timeout, env=env)


def node_states(base: Path) -> dict[str, str]:
    """Node name -> sinfo's long state (``idle``, ``down*``, ``mixed``...); empty if no controller."""
    if not daemons.daemon_alive(_ctld_pid_file(base), "slurmctld"):
        return {}
    done = run_slurm(["sinfo", "-h", "-N", "-o", "%N|%T"], base, timeout=10)
    if done.returncode != 0:
        return {}
    pairs = (line.split("|", 1) for line in done.stdout.splitlines() if "|" in line)
    return {name: state for name, state in pairs}


def _ready(state: str) -> bool:
    return state in READY_STATES


def _daemons_alive(base: Path, state: dict) -> dict[str, bool]:
    alive = {
        "munged": daemons.munged_alive(),
        "slurmctld": daemons.daemon_alive(_ctld_pid_file(base), "slurmctld"),
    }
    for name in _info(base, state, False).nodes:
        alive[f"slurmd:{name}"] = daemons.daemon_alive(_slurmd_pid_file(base, name), "slurmd")
    return alive


def _healthy(base: Path, state: dict) -> bool:
    if not all(_daemons_alive(base, state).values()):
        return False
    states = node_states(base)
    names = _info(base, state, False).nodes
    return all(_ready(states.get(name, "")) for name in names)


def _render_conf(base: Path, nodes: int, cpus_per_node: int) -> str:
    templates = jinja2.Environment(
        loader=jinja2.PackageLoader("relaytrain.localcluster", "templates"),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    mem_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    return templates.get_template("slurm.conf.j2").render(
        base_dir=base,
        controller_name=net.CONTROLLER_NAME,
        controller_addr=net.CONTROLLER_ADDR,
        controller_port=CONTROLLER_PORT,
        slurmd_port=SLURMD_PORT,
        cpus_per_node=cpus_per_node,
        memory_mb=max(256, mem_mb // max(1, nodes)),
        nodes=[{"name": net.node_name(k), "addr": net.node_addr(k)} for k in range(1, nodes + 1)],
    )


def _fresh_dirs(base: Path) -> None:
    for sub in ("state", "spool", "run", "log"):
        shutil.rmtree(base / sub, ignore_errors=True)
    for sub in ("state", "spool", "run", "log"):
        (base / sub).mkdir(parents=True, exist_ok=True)


def _log_tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _start_slurmctld(base: Path) -> None:
    # Own UTS namespace: the controller's hostname must equal SlurmctldHost, whatever the machine's is.
    script = f"hostname {net.CONTROLLER_NAME} && exec slurmctld"
    env = daemons.daemon_env(_conf_path(base))
    daemons.start_detached(["unshare", "--uts", "sh", "-c", script], env)
    if not daemons.wait_until(lambda: daemons.daemon_alive(_ctld_pid_file(base), "slurmctld"), 15.0):
        log = base / "log" / "slurmctld.log"
        raise RuntimeError(f"slurmctld did not start; end of {log}:\n{_log_tail(log)}")


def _start_slurmd(base: Path, name: str) -> None:
    # nsenter, not `ip netns exec`: the latter remounts /sys and slurmd then finds no cgroup fs.
    # Its own tmpfs on /dev/shm in a private mount namespace: the node's memory, gone with the node.
    ns = net.netns_path(net.node_netns(net.node_index(name)))
    script = f"{node_memory.mount_command(name)} && hostname {name} && exec slurmd"
    env = daemons.daemon_env(_conf_path(base))
    daemons.start_detached(["nsenter", f"--net={ns}", *node_memory.NAMESPACES, "sh", "-c", script], env)
    pid_file = _slurmd_pid_file(base, name)
    if not daemons.wait_until(lambda: daemons.daemon_alive(pid_file, "slurmd"), 15.0):
        log = base / "log" / f"slurmd-{name}.log"
        raise RuntimeError(f"slurmd for {name} did not start; end of {log}:\n{_log_tail(log)}")


def _wait_nodes_ready(base: Path, names: tuple[str, ...], timeout: float = START_TIMEOUT_S) -> None:
    resumed: set[str] = set()

    def ready() -> bool:
        states = node_states(base)
        for name in names:
            state = states.get(name, "")
            # DOWN/DRAIN without '*' means slurmd answers but an old reason keeps the node out.
            if name not in resumed and state.startswith(("down", "drain")) and not state.endswith("*"):
                run_slurm(["scontrol", "update", f"NodeName={name}", "State=RESUME"], base)
                resumed.add(name)
        return all(_ready(states.get(name, "")) for name in names)

    if not daemons.wait_until(ready, timeout, interval=0.3):
        log = base / "log" / "slurmctld.log"
        raise RuntimeError(
            f"nodes not idle after {timeout:.0f} s: {node_states(base)}; end of {log}:\n{_log_tail(log)}"
        )


@lock.serialized(resolve_base_dir)  # racing callers take turns: the second finds the first's cluster up
def cluster_up(
    nodes: int = 2, cpus_per_node: int = 4, base_dir: str | Path | None = None, report: Report | None = None
) -> ClusterInfo:
    """Start the cluster (installing Slurm when missing), or return the one already running."""
    say = report or (lambda _msg: None)
    if not 1 <= nodes <= MAX_NODES:
        raise UserError(f"--nodes must be between 1 and {MAX_NODES}, got {nodes}")
    if cpus_per_node < 1:
        raise UserError(f"--cpus-per-node must be at least 1, got {cpus_per_node}")
    base = resolve_base_dir(base_dir)
    wanted = {"nodes": nodes, "cpus_per_node": cpus_per_node}
    state = _load_state(base)
    if state and _healthy(base, state):
        if {k: state[k] for k in wanted} != wanted:
            raise UserError(
                f"a cluster with {state['nodes']} nodes x {state['cpus_per_node']} CPUs is already up in "
                f"{base}; run `relaytrain cluster down` first to change its size"
            )
        if has_node_memory(base):
            say("cluster already up")
            return _info(base, state, started=False)
        if not daemons.is_root():
            raise UserError(
                "the running cluster's nodes share /dev/shm; restart it as root: sudo relaytrain cluster up"
            )
        say("restarting the cluster: its nodes share /dev/shm (no private node memory)")
        cluster_down(base)
        state = None
    if not daemons.is_root():
        daemons.ensure_installed()  # raises with the apt command when Slurm is missing
        raise UserError("starting the local Slurm cluster needs root: sudo relaytrain cluster up")
    if not state or {k: state.get(k) for k in wanted} != wanted:
        # Leftovers of another size, or of a cluster whose cluster.json is gone, would clash.
        if cluster_down(base):
            say("removed the leftovers of an earlier cluster")
        state = None
    say("checking Slurm packages")
    daemons.ensure_installed()
    if not state:
        _fresh_dirs(base)
    started_munged = daemons.ensure_munged() or bool(state and state.get("started_munged"))
    # Saved before anything else starts, so that `down` cleans up after an interrupted `up` too.
    state = {**wanted, "started_munged": started_munged, "layout": node_memory.LAYOUT}
    (base / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
    say("creating network namespaces")
    net.ensure_network(nodes)
    net.set_hosts_entries(nodes)
    _conf_path(base).write_text(_render_conf(base, nodes, cpus_per_node))
    info = _info(base, state, started=True)
    if not daemons.daemon_alive(_ctld_pid_file(base), "slurmctld"):
        say("starting slurmctld")
        _start_slurmctld(base)
    for name in info.nodes:
        if not daemons.daemon_alive(_slurmd_pid_file(base, name), "slurmd"):
            say(f"starting slurmd on {name}")
            _start_slurmd(base, name)
    say("waiting for all nodes to be idle")
    _wait_nodes_ready(base, info.nodes)
    return info


def _cancel_all_jobs(base: Path) -> None:
    done = run_slurm(["squeue", "-h", "-o", "%A"], base, timeout=10)
    job_ids = done.stdout.split() if done.returncode == 0 else []
    if not job_ids:
        return
    run_slurm(["scancel", *job_ids], base)

    def no_jobs() -> bool:
        listed = run_slurm(["squeue", "-h", "-o", "%A"], base, timeout=10)
        return listed.returncode != 0 or not listed.stdout.split()

    daemons.wait_until(no_jobs, 20.0, interval=0.5)


@lock.serialized(resolve_base_dir)
def cluster_down(base_dir: str | Path | None = None, report: Report | None = None) -> bool:
    """Stop what ``cluster_up`` started; returns False if nothing of the cluster was left to stop."""
    say = report or (lambda _msg: None)
    base = resolve_base_dir(base_dir)
    state = _load_state(base) or {}
    namespaces = net.our_namespaces()
    ctld_alive = daemons.daemon_alive(_ctld_pid_file(base), "slurmctld")
    if not state and not namespaces and not ctld_alive:
        return False
    if not daemons.is_root():
        raise UserError("stopping the local Slurm cluster needs root: sudo relaytrain cluster down")
    if ctld_alive:
        say("cancelling jobs")
        _cancel_all_jobs(base)
    say("stopping slurmd")
    for pid_file in sorted((base / "run").glob("slurmd-*.pid")):
        daemons.stop_pid(daemons.read_pid(pid_file), "slurmd")
    for ns in namespaces:
        if ns != net.BRIDGE_NS:
            daemons.kill_pids(net.pids_in_netns(ns))  # job processes that outlived their slurmstepd
    say("stopping slurmctld")
    daemons.stop_pid(daemons.read_pid(_ctld_pid_file(base)), "slurmctld")
    if state.get("started_munged"):
        say("stopping munged")
        daemons.stop_pid(daemons.read_pid(daemons.MUNGE_PID_FILE), "munged")
    say("removing namespaces and /etc/hosts entries")
    net.remove_network()
    net.remove_hosts_entries()
    for sub in ("state", "spool", "run"):
        shutil.rmtree(base / sub, ignore_errors=True)
    (base / STATE_FILE).unlink(missing_ok=True)
    return True


def cluster_status(base_dir: str | Path | None = None) -> dict:
    """Daemons, nodes and jobs of the local cluster, as plain data."""
    base = resolve_base_dir(base_dir)
    state = _load_state(base)
    status: dict = {"base_dir": str(base), "slurm_conf": str(_conf_path(base)), "configured": bool(state)}
    if not state:
        return {**status, "up": False, "daemons": {}, "nodes": {}, "jobs": []}
    alive = _daemons_alive(base, state)
    nodes = node_states(base)
    jobs = []
    if alive["slurmctld"]:
        done = run_slurm(["squeue", "-h", "-o", "%A|%P|%j|%T|%N|%r"], base, timeout=10)
        keys = ("job_id", "partition", "name", "state", "nodes", "reason")
        jobs = [dict(zip(keys, line.split("|"), strict=False)) for line in done.stdout.splitlines()]
    names = _info(base, state, False).nodes
    up = all(alive.values()) and all(_ready(nodes.get(n, "")) for n in names)
    return {
        **status,
        "up": up,
        "node_count": state["nodes"],
        "cpus_per_node": state["cpus_per_node"],
        "daemons": alive,
        "nodes": nodes,
        "jobs": jobs,
    }


def has_node_memory(base_dir: str | Path | None = None) -> bool:
    """Whether every node runs with its own memory (node_memory.py); a node restarted by an older
    relaytrain does not."""
    base = resolve_base_dir(base_dir)
    state = _load_state(base) or {}
    pids = (
        [daemons.read_pid(_slurmd_pid_file(base, n)) for n in _info(base, state, False).nodes]
        if state
        else []
    )
    return state.get("layout") == node_memory.LAYOUT and node_memory.private(pids)


def running_cluster(base_dir: str | Path | None = None) -> ClusterInfo | None:
    """The ClusterInfo of a healthy running cluster, or None."""
    base = resolve_base_dir(base_dir)
    state = _load_state(base)
    return _info(base, state, started=False) if state and _healthy(base, state) else None


def on_node(name: str, command: list[str], base_dir: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run `command` as the node's processes see the machine (its own /dev/shm), e.g. to wipe it."""
    pid = daemons.read_pid(_slurmd_pid_file(resolve_base_dir(base_dir), name))
    if not daemons.pid_alive(pid, "slurmd"):
        raise UserError(f"node {name} is not running")
    return node_memory.enter(pid, command)


def kill_node(name: str, base_dir: str | Path | None = None) -> list[int]:
    """Simulate a crashed node: SIGKILL its slurmd and every job process in its namespace."""
    base = resolve_base_dir(base_dir)
    index = net.node_index(name)
    pids = net.pids_in_netns(net.node_netns(index))
    daemons.kill_pids(pids)
    _slurmd_pid_file(base, name).unlink(missing_ok=True)
    return pids


def restart_node(name: str, base_dir: str | Path | None = None, timeout: float = START_TIMEOUT_S) -> None:
    """Start a killed node's slurmd again and wait until Slurm has it back in service."""
    base = resolve_base_dir(base_dir)
    net.node_index(name)
    if not daemons.daemon_alive(_slurmd_pid_file(base, name), "slurmd"):
        _start_slurmd(base, name)
    _wait_nodes_ready(base, (name,), timeout)
