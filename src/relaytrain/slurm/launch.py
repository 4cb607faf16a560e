"""`relaytrain launch`, `sweep` and `chain`: resolve the config, write the script, check the plan, submit.

Everything a job needs is written to `<run.dir>/<run.name>/slurm/`: `job.sh` (the script) and
`config.toml` (the resolved config, with the merged `[slurm]` section); the job trains from that file,
so a requeued run uses exactly it.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relaytrain.checkpoint.choose import check_resume
from relaytrain.config import Config, ResilienceConfig, SlurmConfig, config_to_toml, load_config
from relaytrain.errors import UserError
from relaytrain.job import RunDir
from relaytrain.plan.checks import Plan
from relaytrain.resilience.run_kind import PROGRAM, TRAIN, RunKind, claim_kind, refuse_other_kind
from relaytrain.slurm.container import check_container
from relaytrain.slurm.grid import parse_grid, render_command
from relaytrain.slurm.launch_checks import check_request, train_data_checked
from relaytrain.slurm.partition_plans import plans_for
from relaytrain.slurm.profile import explicit_config_keys, resolve_slurm
from relaytrain.slurm.run_owner import refuse_busy_run_dir
from relaytrain.slurm.script import JobSpec, SweepPoint, render_script
from relaytrain.slurm.submit import check_after, record_job, submission_line, submit

Printer = Callable[[str], None]


@dataclass
class LaunchRequest:
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    slurm: dict[str, Any] = field(default_factory=dict)  # CLI values for SlurmConfig keys (None: unset)
    profile: str | None = None
    command: str | None = None
    name: str | None = None
    jobid: str | None = None
    after: str | None = None
    dry_run: bool = False
    force: bool = False
    signal: str | None = None  # --signal NAME[@SECONDS] | none; None: none for --command, else the config's
    max_concurrent: int | None = None  # sweep: at most this many array tasks at once (--array=0-K%N)
    # a dry run prints its sbatch line assigning the job id to this shell variable (a chain's stages)
    job_variable: str = ""


def name_override(name: str) -> str:
    """`--run.name="..."`: a run name from --name or a sweep goes through the config's own run.name check."""
    return "--run.name=" + json.dumps(name, ensure_ascii=False)  # a TOML basic string: "12" stays a str


def _overrides(req: LaunchRequest, extra_overrides: list[str] | None) -> list[str]:
    overrides = list(req.overrides) + list(extra_overrides or [])
    if req.name is not None:
        overrides.append(name_override(req.name))
    return overrides


def load_resolved(
    req: LaunchRequest, extra_overrides: list[str] | None = None, notes: list[str] | None = None
) -> Config:
    """The config with its [slurm] section merged from the cluster profile, the config and the flags
    (profile.resolve_slurm), validated as a whole. `notes`: see `_resolved_slurm`."""
    overrides = _overrides(req, extra_overrides)
    written = load_config(req.config, overrides)  # the user's own values, checked as written
    slurm = _resolved_slurm(req, overrides, written, notes)
    return train_data_checked(req, load_config(req.config, overrides, {"slurm": slurm}))


def _resolved_slurm(
    req: LaunchRequest, overrides: list[str], written: Config, notes: list[str] | None = None
) -> dict[str, Any]:
    """With `notes`, CPUs/memory/exclusivity nobody set are chosen and the choice is appended to it
    (relaytrain.slurm.resources); never for --jobid, whose allocation is already made."""
    explicit = explicit_config_keys(req.config, overrides)
    choose = None if req.jobid else notes
    resolved = resolve_slurm(written.slurm, explicit, req.slurm, req.profile, choose, req.command)
    return dataclasses.asdict(resolved)


def load_for_job(
    req: LaunchRequest,
    slurm: SlurmConfig | None = None,
    extra_overrides: list[str] | None = None,
    notes: list[str] | None = None,
) -> tuple[Config, bool]:
    """The config a job runs with, and whether its script asks Slurm for a pre-timeout signal.

    `slurm` is the resolved section (None: resolve it here, `notes` as in `_resolved_slurm`); --jobid
    and --signal set [resilience] keys. All of it goes through load_config, so the validated config is
    the one written and used.
    """
    overrides = _overrides(req, extra_overrides)
    written = load_config(req.config, overrides)  # the user's own values, checked as written
    merged = _resolved_slurm(req, overrides, written, notes) if slurm is None else dataclasses.asdict(slurm)
    send_signal, resilience = signal_settings(written.resilience, req)
    if req.jobid:
        # The allocation belongs to someone else's job: a stop must never requeue it.
        resilience["requeue"] = False
    derived = {"slurm": merged, "resilience": resilience}
    return train_data_checked(req, load_config(req.config, overrides, derived)), send_signal


def signal_settings(resilience: ResilienceConfig, req: LaunchRequest) -> tuple[bool, dict[str, Any]]:
    """What --signal means: whether the script asks Slurm for a pre-timeout signal, and the
    [resilience] keys it sets.

    A --command program is sent none unless --signal names one: a program that does not handle it
    would die by it (docs/programs.md).
    """
    if req.signal is None:
        return req.command is None, {}
    text = req.signal.strip()
    if text.lower() == "none":
        return False, {}
    name, at, lead = text.partition("@")
    name = name.strip().upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    if name not in ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGURG"):
        raise UserError(f"--signal {req.signal!r}: name USR2, USR1, TERM, ... (e.g. USR2@180), or none")
    settings: dict[str, Any] = {}
    if at:
        if not lead.strip().isdigit() or int(lead) > 65535:
            raise UserError(f"--signal {req.signal!r}: the lead after @ is whole seconds (USR2@180)")
        if resilience.hard_deadline_s >= int(lead):
            # The resolved config.toml must load in the job (validate's rule): refuse it here.
            raise UserError(
                f"--signal {req.signal!r}: the lead must be longer than resilience.hard_deadline_s="
                f"{resilience.hard_deadline_s:g} (the save deadline); lower it, e.g. "
                f"--resilience.hard_deadline_s={max(1, int(lead) // 2)}"
            )
        settings["signal_lead_s"] = int(lead)
    settings["slurm_signal"] = name
    if name not in resilience.signals:
        settings["signals"] = [*resilience.signals, name]  # the program must catch what the script forwards
    return True, settings


def signal_label(cfg: Config) -> str:
    return f"{cfg.resilience.slurm_signal}@{cfg.resilience.signal_lead_s}"


def rundir_of(cfg: Config) -> RunDir:
    return RunDir.of(cfg.run.dir, cfg.run.name).absolute()


def check_plan(cfg: Config, force: bool, out: Printer) -> Plan | None:
    """Check every node count Slurm may start the job on (one, or each of a --nodes MIN-MAX range)."""
    plans = plans_for(cfg)
    failed = []
    for plan in plans:
        at = f" at {plan.nodes} node(s)" if len(plans) > 1 else ""
        for name, level, detail in plan.checks:
            if level != "ok":
                out(f"plan {level}{at}: {name}: {detail}")
            if level == "fail":
                failed.append(f"{detail}{at}")
    if failed:
        if not force:
            narrow = "; narrow the --nodes range," if len(plans) > 1 else ";"
            raise UserError(f"plan refused ({'; '.join(failed)}){narrow} fix the config or pass --force")
        out("plan refused, submitting anyway (--force)")
    return plans[-1]


def write_run_files(cfg: Config) -> tuple[RunDir, Path]:
    rundir = rundir_of(cfg)
    rundir.slurm.mkdir(parents=True, exist_ok=True)
    rundir.slurm_config.write_text(config_to_toml(cfg))
    return rundir, rundir.slurm_config


def write_script(spec: JobSpec) -> str:
    """Render the job script, write it executable to spec.script_path, and return its text."""
    text = render_script(spec)
    spec.script_path.write_text(text)
    spec.script_path.chmod(0o755)
    return text


def build_spec(cfg: Config, req: LaunchRequest, config_file: Path, origin: str = "launch") -> JobSpec:
    rundir = rundir_of(cfg)
    script = rundir.attach_script if req.jobid else rundir.job_script
    return JobSpec(
        cfg=cfg,
        run_dir=rundir.root,
        config_file=config_file,
        script_path=script,
        workdir=Path.cwd(),
        kind="command" if req.command else "train",
        command=req.command or "",
        attach_jobid=req.jobid or "",
        origin=origin,
        after=req.after or "",
    )


def launch(req: LaunchRequest, out: Printer = print) -> int:
    """Write and submit (or dry-run, or attach); returns the exit code for the CLI."""
    rc, _ = launch_job(req, out)
    return rc


def launch_job(req: LaunchRequest, out: Printer = print) -> tuple[int, str | None]:
    """Like `launch`, and also returns the submitted job id (None for dry runs and attach)."""
    check_request(req, "launch")
    notes: list[str] = []
    cfg, send_signal = load_for_job(req, notes=notes)
    refuse_busy_run_dir(rundir_of(cfg), req.after, req.jobid)  # before its files are rewritten
    kind = RunKind(PROGRAM, req.command) if req.command else RunKind(TRAIN)
    refuse_other_kind(rundir_of(cfg), kind)
    check_resume(cfg)
    notes += check_container(cfg, rundir_of(cfg).root, Path.cwd())
    for line in notes:
        out(line)
    if req.command is None:
        check_plan(cfg, req.force, out)
    claim_kind(rundir_of(cfg), kind)
    rundir, config_file = write_run_files(cfg)
    spec = build_spec(cfg, req, config_file)
    spec.send_signal = send_signal
    text = write_script(spec)
    if req.dry_run:
        out(text)
        out(f"dry run: wrote {spec.script_path} and {config_file}; nothing submitted")
        out("submit with: " + submission_line(spec.script_path, req.after, variable=req.job_variable))
        return 0, None
    if req.jobid:
        out(f"attaching to allocation {req.jobid}: bash {spec.script_path}")
        return subprocess.run(["bash", str(spec.script_path)]).returncode, None
    job_id = submit(spec.script_path, req.after)
    record_job(
        rundir.jobs,
        {
            "job_id": job_id,
            "kind": spec.kind,
            "launcher": spec.launcher,
            "log": str(rundir.job_log("%j")),
            "script": str(spec.script_path),
            "config": str(config_file),
            "run_dir": str(spec.run_dir),
            "nodes": cfg.slurm.nodes,
            "gpus_per_node": cfg.slurm.gpus_per_node,
            "after": req.after,
            "signal": signal_label(cfg) if send_signal else "none",
        },
    )
    out(f"submitted job {job_id}")
    out(f"run directory: {spec.run_dir}")
    return 0, job_id


def _values(point: dict[str, str]) -> str:
    """A point as the table shows it: config keys as overrides (--optim.lr=0.1), placeholders as lr=0.1."""
    return " ".join(f"--{k}={v}" if "." in k else f"{k}={v}" for k, v in point.items())


def sweep(req: LaunchRequest, grid_items: list[str], out: Printer = print) -> int:
    """One job array over the grid: a config (and, with --command, a command) per point."""
    if req.jobid:
        raise UserError("relaytrain sweep submits a job array; --jobid does not apply")
    check_request(req, "sweep")
    grid = parse_grid(grid_items, req.command)
    if req.max_concurrent is not None and req.max_concurrent < 1:
        raise UserError(
            f"--max-concurrent {req.max_concurrent}: pass the most array tasks to run at once (>= 1)"
        )
    notes: list[str] = []
    base = load_resolved(req, notes=notes)
    keys = [key for key, _ in grid]
    points: list[tuple[dict[str, str], Config, str]] = []
    send_signal = False
    for index, values in enumerate(itertools.product(*[options for _, options in grid])):
        point = dict(zip(keys, values, strict=True))
        point_overrides = [f"--{k}={v}" for k, v in point.items() if "." in k]
        # Every point runs on the sweep's resolved [slurm] section, whatever the point's overrides say.
        point_req = dataclasses.replace(req, name=f"{base.run.name}-{index}")
        cfg, send_signal = load_for_job(point_req, base.slurm, point_overrides)
        command = render_command(req.command, point) if req.command is not None else ""
        points.append((point, cfg, command))
    for _, cfg, _ in points:
        notes += check_container(cfg, rundir_of(cfg).root, Path.cwd())
    for line in dict.fromkeys(notes):  # the same line once, not once per point
        out(line)
    for point, cfg, command in points:
        refuse_busy_run_dir(rundir_of(cfg), req.after)
        refuse_other_kind(rundir_of(cfg), RunKind(PROGRAM, command) if command else RunKind(TRAIN))
        check_resume(cfg)
        out(f"point {cfg.run.name}: {_values(point)}" + (f": {command}" if command else ""))
        if req.command is None:
            check_plan(cfg, req.force, out)
    sweep_cfg, _ = load_for_job(dataclasses.replace(req, name=f"{base.run.name}-sweep"), base.slurm)
    sweep_run = rundir_of(sweep_cfg)
    sweep_run.slurm.mkdir(parents=True, exist_ok=True)
    array = []
    table = ["index\trun_name\t" + ("values\tcommand" if req.command is not None else "overrides")]
    rows = []
    for index, (point, cfg, command) in enumerate(points):
        claim_kind(rundir_of(cfg), RunKind(PROGRAM, command) if command else RunKind(TRAIN))
        point_dir, config_file = write_run_files(cfg)
        array.append(SweepPoint(config_file=str(config_file), run_dir=str(point_dir.root), command=command))
        table.append("\t".join([str(index), cfg.run.name, _values(point)] + ([command] if command else [])))
        overrides = [f"--{k}={v}" for k, v in point.items() if "." in k]
        rows.append({"index": index, "run_name": cfg.run.name, "overrides": overrides, "values": point})
        if command:
            rows[-1]["command"] = command
    sweep_run.sweep_table.write_text("\n".join(table) + "\n")
    sweep_run.sweep_points.write_text(json.dumps(rows, indent=2) + "\n")
    spec = JobSpec(
        cfg=sweep_cfg,
        run_dir=sweep_run.root,
        config_file=Path(array[0].config_file),
        script_path=sweep_run.job_script,
        workdir=Path.cwd(),
        kind="command" if req.command is not None else "train",
        command=req.command or "",
        array=array,
        array_max_concurrent=req.max_concurrent or 0,
        origin="sweep",
        send_signal=send_signal,
        after=req.after or "",
    )
    text = write_script(spec)
    if req.dry_run:
        out(text)
        out(f"dry run: wrote {spec.script_path} and {sweep_run.sweep_table}; nothing submitted")
        out("submit with: " + submission_line(spec.script_path, req.after))
        return 0
    job_id = submit(spec.script_path, req.after)
    record_job(
        sweep_run.jobs,
        {
            "job_id": job_id,
            "kind": "sweep",
            "points": len(points),
            "log": str(sweep_run.job_log("%A_%a")),
            "script": str(spec.script_path),
            "run_dir": str(sweep_run.root),
            "after": req.after,
        },
    )
    for index, point in enumerate(array):
        record_job(
            RunDir(Path(point.run_dir)).jobs,
            {
                "job_id": f"{job_id}_{index}",
                "kind": "sweep-point",
                "log": str(sweep_run.job_log("%A_%a")),
                "script": str(spec.script_path),
                "config": point.config_file,
                "run_dir": point.run_dir,
            },
        )
    out(f"submitted job array {job_id} ({len(points)} points, table in {sweep_run.sweep_table})")
    out(f"run directories: {rundir_of(points[0][1]).root} ... {rundir_of(points[-1][1]).root}")
    return 0


def chain(req: LaunchRequest, configs: list[str], out: Printer = print) -> int:
    """Submit each config as a job that starts only after the previous one succeeded (afterok).

    A dry run submits nothing, so a stage's job id is not known: each stage's sbatch line is printed
    assigning its id to `$stageN`, and the next stage depends on that variable (the whole chain,
    links included, can be pasted into a shell).
    """
    if len(configs) < 1:
        raise UserError("relaytrain chain needs at least one CONFIG")
    if req.jobid or req.command:
        raise UserError("relaytrain chain submits new jobs; --jobid and --command do not apply")
    if req.after:
        check_after(req.after)
    submissions: list[str] = []

    def stage_out(line: str) -> None:
        if line.startswith("submit with: "):
            submissions.append(line.removeprefix("submit with: "))
        out(line)

    previous = req.after
    for stage, config in enumerate(configs):
        stage_req = copy.copy(req)
        stage_req.config, stage_req.after = config, previous
        stage_req.job_variable = f"stage{stage}" if req.dry_run else ""
        out(f"stage {stage}: {config}" + (f" (after {previous})" if previous else ""))
        _, job_id = launch_job(stage_req, stage_out)
        previous = f"$stage{stage}" if req.dry_run else job_id
    if req.dry_run:
        out("dry run: the chain is submitted with these commands, in order:")
        for line in submissions:
            out(f"    {line}")
    return 0
