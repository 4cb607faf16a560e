"""Render the job script (sbatch, or bash for an existing allocation) from templates/job.sh.j2.

Every value that comes from the user reaches the script shell-quoted (the `q` filter) or, on `#SBATCH`
lines (which bash reads as comments and sbatch parses itself), double-quoted with `\\` and `"` escaped.
Only `slurm.setup` lines are inserted as shell code, because running them is their purpose.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Literal

import jinja2

from relaytrain.config import Config, SlurmConfig
from relaytrain.entry_points import BATCH_DRIVER, CLI, PORTS, TASK, TORCHRUN
from relaytrain.errors import UserError
from relaytrain.job import RunDir
from relaytrain.slurm.container import step_workdir
from relaytrain.slurm.job_env import environment_lines
from relaytrain.slurm.profile import is_rocm
from relaytrain.slurm.submit import submission_line

TEMPLATE_DIR = Path(__file__).parent / "templates"
HEARTBEAT_S = 300
SHUTDOWN_MARGIN_S = 30  # torchrun waits hard_deadline_s + this before it SIGKILLs workers
TORCHRUN_DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
_PLAIN = re.compile(r"[A-Za-z0-9_.,:=/%@+\-]*")


@dataclass
class SweepPoint:
    config_file: str
    run_dir: str
    command: str = ""  # a --command sweep: this point's command, its grid values substituted


@dataclass
class JobSpec:
    """Everything the template needs; built by relaytrain.slurm.launch."""

    cfg: Config  # resolved config (cfg.slurm already merged with profile and CLI)
    run_dir: Path  # absolute
    config_file: Path  # the resolved config the job trains from
    script_path: Path
    workdir: Path  # sbatch --chdir: relative paths in the config resolve from here
    kind: Literal["train", "command"] = "train"
    command: str = ""
    attach_jobid: str = ""
    array: list[SweepPoint] = field(default_factory=list)
    array_max_concurrent: int = 0  # a sweep: at most this many array tasks run at once (0: no cap)
    after: str = ""  # submitted with --dependency=afterok on this job (a chain stage, --after)
    job_name: str = ""
    origin: str = "launch"
    # --signal none: no pre-timeout signal (the default for --command, docs/programs.md)
    send_signal: bool = True

    @property
    def slurm(self) -> SlurmConfig:
        return self.cfg.slurm

    @property
    def rundir(self) -> RunDir:
        return RunDir(self.run_dir)

    @property
    def tasks_per_node(self) -> int:
        """Tasks srun starts per node: one per GPU, unless tasks_per_node says otherwise."""
        s = self.slurm
        return s.tasks_per_node or s.gpus_per_node

    @property
    def launcher(self) -> str:
        return launcher_for(self.kind, self.slurm)


def launcher_for(kind: str, s: SlurmConfig) -> str:
    """What starts the job step's processes: torchrun (one node), srun (several), or the user's command."""
    if kind == "command":
        return "command"
    return "torchrun" if s.nodes == 1 else "srun"  # a node range 1-N needs srun too


def node_range(s: SlurmConfig) -> str:
    """`--nodes` as sbatch takes it: `4`, or `2-4` when Slurm may start the job on fewer nodes."""
    return f"{s.min_nodes}-{s.nodes}" if s.min_nodes and s.min_nodes != s.nodes else str(s.nodes)


def allocated_nodes(s: SlurmConfig) -> str:
    """`sbatch --nodes`: the node range, or the training nodes plus the spares (`slurm.spare_nodes`)."""
    return str(s.nodes + s.spare_nodes) if s.spare_nodes else node_range(s)


# More spares than this idle more of the allocation than a failure costs.
def max_spares(nodes: int) -> int:
    """At most as many spares as training nodes, and 2 for a run of 1 or 2 nodes."""
    return max(nodes, 2)


def check_spares(spec: JobSpec) -> None:
    """One clear refusal for spare nodes the job cannot use (docs/launching.md)."""
    s = spec.slurm
    if not s.spare_nodes:
        return
    if spec.attach_jobid:
        raise UserError(
            f"--spare-nodes {s.spare_nodes} with --jobid {spec.attach_jobid}: an existing allocation has "
            "the nodes it has; spares are allocated by a job of its own (drop --jobid or the spares)"
        )
    if s.min_nodes and s.min_nodes != s.nodes:
        raise UserError(
            f"--spare-nodes {s.spare_nodes} with the node range --nodes {node_range(s)}: a range shrinks "
            "the run when a node fails, spares keep its size; pass one of them (docs/elastic.md)"
        )
    if s.spare_nodes > max_spares(s.nodes):
        raise UserError(
            f"slurm.spare_nodes={s.spare_nodes} for {s.nodes} training node(s): at most "
            f"{max_spares(s.nodes)} spare(s) (as many as training nodes, 2 for 1 or 2), or the idle nodes "
            "cost more than the failures they absorb"
        )
    if s.no_kill is False:
        raise UserError(
            "slurm.no_kill=false with spare nodes: a failed node would end the job, and its spare with it; "
            "drop slurm.no_kill (spares turn --no-kill on)"
        )


def check_survivors(cfg: Config, kind: str) -> None:
    """`resilience.survivors` where the job step has no torchrun of relaytrain's to replace a lost rank:
    refused, rather than accepted and left without effect."""
    launcher = launcher_for(kind, cfg.slurm)
    if not cfg.resilience.survivors or launcher == "torchrun":
        return
    if launcher == "command":
        raise UserError(
            "resilience.survivors=true with --command: survivors are relaytrain's trainer's path, and the "
            "job runs your own program (a dead rank restarts the job step in place); set it to false"
        )
    raise UserError(
        f"resilience.survivors=true: a job of {node_range(cfg.slurm)} nodes runs each rank as one of srun's "
        "tasks, with no torchrun agent to start a replacement, so a dead rank restarts the job step in place "
        "(resilience.max_step_restarts). Set resilience.survivors=false, or run on one node (--nodes 1), "
        "where a lost rank is replaced alone (docs/resilience.md, Survivors)"
    )


def keeps_job_on_node_failure(s: SlurmConfig) -> bool:
    """`sbatch --no-kill`: slurm.no_kill, where `auto` is on for node ranges (the run can go on with
    fewer nodes) and jobs with spares (a spare takes the failed node's place), and off for fixed counts
    (Slurm's own requeue of a NODE_FAIL job does as well)."""
    if s.spare_nodes:
        return True
    if s.nodes < 2:
        return False
    return "-" in node_range(s) if s.no_kill == "auto" else bool(s.no_kill)


def sbatch_value(value: object) -> str:
    """A value for an `#SBATCH` line: plain, or double-quoted the way sbatch's own parser reads it."""
    text = str(value)
    if "\n" in text or "\r" in text:
        raise UserError(f"value {text!r} contains a line break, which an #SBATCH line cannot carry")
    if _PLAIN.fullmatch(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def job_name_for(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", name)[:64] or "relaytrain"


def signal_short(name: str) -> str:
    return name[3:] if name.startswith("SIG") else name


def check_layout(spec: JobSpec) -> None:
    s = spec.slurm
    check_spares(spec)
    if spec.kind == "train" and s.gpus_per_node > 0 and s.tasks_per_node not in (0, s.gpus_per_node):
        raise UserError(
            f"slurm.tasks_per_node={s.tasks_per_node} must equal slurm.gpus_per_node={s.gpus_per_node} "
            "(one training process per GPU); leave tasks_per_node at 0"
        )
    if spec.kind == "command" and not spec.command.strip():
        raise UserError("--command is empty; pass the command to run, e.g. --command 'python train.py'")


def sbatch_options(spec: JobSpec) -> list[str]:
    s, r = spec.slurm, spec.cfg.resilience
    tasks = spec.tasks_per_node
    cpus = s.cpus_per_task
    if spec.launcher == "torchrun":  # one srun task (torchrun) holds every worker's CPUs
        tasks, cpus = 1, s.cpus_per_task * spec.tasks_per_node
    out = [
        f"--job-name={sbatch_value(spec.job_name or job_name_for(spec.cfg.run.name))}",
        f"--nodes={allocated_nodes(s)}",
    ]
    if "-" in node_range(s):
        # Slurm 22.05 sets a job's task count to nodes x --ntasks-per-node at each start and keeps it
        # across a requeue: a range job that ran on 2 nodes could restart only on 2 (docs/elastic.md).
        # Reserve the CPUs of the ranks per node instead; the step's srun sets the tasks per node.
        out.append(f"--mincpus={tasks * max(cpus, 1)}")
    else:
        out.append(f"--ntasks-per-node={tasks}")
    if keeps_job_on_node_failure(s):
        out.append("--no-kill")  # the step restarts on the nodes left, or the job is requeued
    if s.gpus_per_node > 0:
        out.append(f"--gpus-per-node={s.gpus_per_node}")
    if cpus > 0:
        out.append(f"--cpus-per-task={cpus}")
    for flag, value in (
        ("time", s.time),
        ("partition", s.partition),
        ("account", s.account),
        ("qos", s.qos),
        ("mem", s.mem),
        ("constraint", s.constraint),
        ("mail-user", s.mail_user),
    ):
        if value:
            out.append(f"--{flag}={sbatch_value(value)}")
    if s.mail_user:
        out.append(f"--mail-type={sbatch_value(s.mail_type or 'END,FAIL')}")
    if s.exclusive:
        out.append("--exclusive")
    out.append(f"--output={sbatch_value(spec.rundir.job_log('%A_%a' if spec.array else '%j'))}")
    out.append("--open-mode=append")
    out.append(f"--chdir={sbatch_value(spec.workdir)}")
    if spec.send_signal:
        out.append(f"--signal=B:{signal_short(r.slurm_signal)}@{r.signal_lead_s}")
    out.append("--requeue" if r.requeue else "--no-requeue")
    if spec.array:
        cap = f"%{spec.array_max_concurrent}" if spec.array_max_concurrent else ""
        out.append(f"--array=0-{len(spec.array) - 1}{cap}")
    for extra in s.extra_sbatch:
        if "\n" in extra or "\r" in extra:
            raise UserError(f"slurm.extra_sbatch entry {extra!r} contains a line break")
        out.append(extra.strip())
    return out


def python_command(s: SlurmConfig) -> list[str]:
    if s.uv_project:
        return ["uv", "run", "--project", s.uv_project, "python"]
    return ["python"]


def srun_options(spec: JobSpec) -> list[str]:
    s = spec.slurm
    tasks = 1 if spec.launcher == "torchrun" else spec.tasks_per_node
    cpus = s.cpus_per_task * (spec.tasks_per_node if spec.launcher == "torchrun" else 1)
    # With a node range the step takes every node Slurm gave the job (srun without --nodes).
    out = [] if "-" in node_range(s) else [f"--nodes={s.nodes}"]
    out += [f"--ntasks-per-node={tasks}", "--kill-on-bad-exit=1"]
    if cpus > 0:
        out.append(f"--cpus-per-task={cpus}")
    if spec.attach_jobid:
        out += [f"--jobid={spec.attach_jobid}", "--overlap"]
    if s.container_image:
        out.append(f"--container-image={s.container_image}")
        if s.container_mounts:
            out.append("--container-mounts=" + ",".join(s.container_mounts))
        workdir = step_workdir(spec.cfg, spec.workdir)
        if workdir:
            out.append(f"--container-workdir={workdir}")
        if s.container_remap_root:
            out.append("--container-remap-root")
    return out


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env


def _in_run_dir(rundir: RunDir) -> dict[str, str]:
    """Paths of a run directory relative to it, and names in its slurm/ folder with `$job_id` in them."""
    return {
        "slurm": rundir.relative(rundir.slurm),
        "gpu": rundir.relative(rundir.gpu),
        "run_state": rundir.relative(rundir.run_state),
        "attach_log": rundir.attach_log("$job_id").name,
        "pip_freeze": rundir.pip_freeze("$job_id").name,
        "logs": rundir.relative(rundir.logs),
        "flight_recorder": rundir.relative(rundir.flight_recorder("${job_id}")),
    }


def render_script(spec: JobSpec) -> str:
    check_layout(spec)
    s, r = spec.slurm, spec.cfg.resilience
    signals = list(TORCHRUN_DEFAULT_SIGNALS)
    if r.slurm_signal not in signals:
        signals.append(r.slurm_signal)
    what = f"command: {spec.command}" if spec.kind == "command" else f"training run {spec.cfg.run.name}"
    context = {
        "origin": spec.origin,
        "created": datetime.now().isoformat(timespec="seconds"),
        "description": " ".join(what.split()),
        "script_path": shlex.quote(str(spec.script_path)),
        "reproduce": submission_line(spec.script_path, spec.after or None, parsable=False),
        "sbatch_options": sbatch_options(spec),
        "attach_jobid": spec.attach_jobid,
        "slurm": s,
        "signal_name": signal_short(r.slurm_signal) if spec.send_signal else "",
        "run_dir": str(spec.run_dir),
        "slurm_dir": str(spec.rundir.slurm),
        # Paths inside a run directory the script joins to $run_dir (a sweep point's is chosen at run time).
        "in_run_dir": _in_run_dir(spec.rundir),
        "config_file": str(spec.config_file),
        "array": spec.array,
        "nodes": s.nodes,
        "spare_nodes": s.spare_nodes,
        "tasks_per_node": spec.tasks_per_node,
        "gpus_per_node": s.gpus_per_node,
        "rocm": is_rocm(s),
        "python_cmd": python_command(s),
        "heartbeat_s": HEARTBEAT_S,
        "srun_options": srun_options(spec),
        # An exclusive job nobody gave cpus_per_task: its processes share the node's CPUs (resources.py).
        "step_cpus_at_run_time": s.exclusive and s.cpus_per_task == 0 and not spec.attach_jobid,
        "processes_per_task": spec.tasks_per_node if spec.launcher == "torchrun" else 1,
        "gpu_monitor": s.gpus_per_node > 0 and spec.cfg.metrics.gpu_monitor_interval_s > 0,
        "gpu_monitor_interval": spec.cfg.metrics.gpu_monitor_interval_s,
        "map_env": spec.launcher != "torchrun",
        # Each node's hang watcher for the driver's hang monitor (not programs: they publish no progress).
        "hang_watch": spec.launcher in ("torchrun", "srun")
        and r.hang_timeout_s > 0
        and not spec.attach_jobid,
        "launcher": spec.launcher,
        "nproc": spec.tasks_per_node,
        "srun_tasks_per_node": 1 if spec.launcher == "torchrun" else spec.tasks_per_node,
        "torchrun_signals": ",".join(signals),
        # relaytrain's own option of its torchrun (job/torchrun.py), first: lost ranks replaced alone
        "survivor_option": f" --survivor-replacements={r.survivor_replacements}"
        if r.survivors and spec.launcher == "torchrun"
        else "",
        "shutdown_timeout_s": math.ceil(r.hard_deadline_s + SHUTDOWN_MARGIN_S),
        "command": spec.command,
        "snapshots": bool(spec.cfg.checkpoint.snapshot_every),  # an interval, or "auto"
        # the processes the script starts (relaytrain.entry_points)
        "entry": {"cli": CLI, "torchrun": TORCHRUN, "ports": PORTS, "driver": BATCH_DRIVER},
    }
    signal = context["signal_name"] if context["signal_name"] and not spec.attach_jobid else "none"
    where = context["in_run_dir"]
    context["environment"] = environment_lines(s, is_rocm(s), signal, where["logs"], where["flight_recorder"])
    if spec.launcher == "command":  # a torchrun in the command gives its workers relaytrain's save time
        # before it kills them after a forwarded stop signal, not its 30 s; its --shutdown-timeout wins
        context["environment"].append(f"export PET_SHUTDOWN_TIMEOUT={context['shutdown_timeout_s']}")
    wrapper = [*map(shlex.quote, python_command(s)), "-m", TASK]
    wrapper += ["--map-env"] if context["map_env"] else []
    if context["gpu_monitor"]:
        wrapper += ["--gpu-monitor-dir", f'"$run_dir/{where["gpu"]}"', "--gpu-monitor-interval"]
        wrapper.append(str(context["gpu_monitor_interval"]))
    context["task_wrapper"] = " ".join(
        [*wrapper, *(['--hang-watch "$run_dir"'] if context["hang_watch"] else [])]
    )
    if spec.attach_jobid and not spec.attach_jobid.replace("_", "").isdigit():
        raise UserError(f"--jobid {spec.attach_jobid!r} is not a Slurm job id")
    return _environment().get_template("job.sh.j2").render(**context)
