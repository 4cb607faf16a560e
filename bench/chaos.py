"""`python -m bench.chaos`: interrupt real Slurm jobs at random moments and check that no work is lost.

    python -m bench.chaos --trials 20 --seed 7      # writes its section of docs/benchmarks.md
    python -m bench.chaos --quick                   # 3 trials (the `slurm` test runs this), no page
    python -m bench.chaos --page-from A/results.json B/results.json ...  # the page from several runs

With several runs' results (in run order) the page shows every random trial and every SIGKILL-during-save
trial (listed under the checkpoint.mode it reported), and of the other targeted kinds only the latest run
that has each, saying which earlier rows it replaces.

Each trial draws a (phase, event) pair from a seeded generator, launches a tiny 2-rank run on the local
Slurm cluster (`relaytrain cluster up`), waits for the phase, fires the event, and continues the run to
the end: the job requeues itself (preemption, a crash), or the benchmark resubmits it where the policy
is not to requeue (a USR2 cancel). The finished run is compared with one uninterrupted reference run of
the same config: every logged loss bit-identical, the set of steps the same (replayed steps counted),
`checkpoints/latest` naming a complete checkpoint, no files beyond the documented set, and the last
`run_state.json` saying `finished`.

The benchmark holds /tmp/relaytrain-slurm.lock (the cluster is shared) for chunks of `--chunk` trials.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from bench.chaos_special import SPECIAL_KINDS, SpecialTrial, SpecialTrials
from bench.report import REPO, code, machine_info, table, write_page

sys.path.insert(0, str(REPO / "tests"))  # the tiny config the tests use too
from tiny_config import TINY_TOML  # noqa: E402

LOCK = "/tmp/relaytrain-slurm.lock"
OUT = REPO / "bench" / "out" / "chaos"
STEPS = 40
INTERVAL = 10
EVAL_EVERY = 10
STEP_DELAY_S = 0.3  # first run only: a 40-step tiny run lasts ~15 s, long enough to hit a phase
PHASES = ("mid_step", "mid_eval", "async_save", "startup", "resume_load", "emergency_save")
EVENTS = ("usr2", "preempt", "sigkill_rank", "kill_node")
# Files a finished run may hold: everything else is a leftover.
ALLOWED = re.compile(
    r"^(config\.toml|metrics\.jsonl|run_state\.json|crashes\.jsonl|slurm/.*|logs/.*|tensorboard/.*|"
    r"checkpoints/latest|checkpoints/step_\d+/.*)$"
)
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


@dataclass
class Trial:
    index: int
    phase: str
    event: str
    job: str = ""
    fired_at_step: int = -1
    resubmits: int = 0
    restarts: int = 0
    bit_exact: bool = False
    steps_replayed: int = 0
    latest_complete: bool = False
    leftovers: list[str] = field(default_factory=list)
    final_status: str = ""
    seconds: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return (
            self.bit_exact and self.latest_complete and not self.leftovers and self.final_status == "finished"
        )


def relaytrain(*args: str, timeout: float = 120) -> str:
    done = subprocess.run(["relaytrain", *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(
            f"relaytrain {' '.join(args)} exited {done.returncode}: {done.stdout}{done.stderr}"
        )
    return done.stdout


def scontrol_job(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    return dict(re.findall(r"(?:^|\s)(\w+)=(\S*)", out))


def records(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in rows if r.get("kind") == kind]


def wait(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


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


@contextmanager
def cluster_lock(enabled: bool = True):
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


class Bench:
    def __init__(self, base: Path, cluster):
        self.base, self.cluster = base, cluster
        self.runs = base / "runs"
        self.config = base / "chaos.toml"
        self.config.write_text(
            CONFIG.format(
                name="reference",
                runs=self.runs,
                steps=STEPS,
                eval_every=EVAL_EVERY,
                interval=INTERVAL,
                profile=REPO / "configs" / "clusters" / "local.toml",
            )  # fmt: skip
        )
        self.reference: dict[int, float] = {}
        self.reference_val: dict[int, float] = {}

    def run_reference(self) -> None:
        """The uninterrupted run: torchrun on this machine, same config and world size (2)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "relaytrain.cli", "train", str(self.config)]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"the reference run failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        run_dir = self.runs / "reference"
        self.reference = {r["step"]: r["loss"] for r in records(run_dir, "train")}
        self.reference_val = {r["step"]: r["val_loss"] for r in records(run_dir, "eval") if "val_loss" in r}

    # -- one trial ---------------------------------------------------------------------------------

    def launch(self, name: str, *overrides: str, setup: str | None = None) -> str:
        """Submit the run; `setup` replaces the default (slow steps in the first run only)."""
        delay = f"export RELAYTRAIN_STEP_DELAY_S={STEP_DELAY_S}"
        slow = setup or f'if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then {delay}; fi'
        out = relaytrain("launch", str(self.config), "--nodes", "1", "--tasks-per-node", "2",
                         f"--run.name={name}", f"--slurm.setup=['{slow}']", *overrides)  # fmt: skip
        match = re.search(r"submitted job (\d+)", out)
        if not match:
            raise RuntimeError(f"no job id in: {out}")
        return match.group(1)

    def wait_phase(self, trial: Trial, run_dir: Path, rng: random.Random) -> None:
        def last() -> int:
            return max((r["step"] for r in records(run_dir, "train") if r.get("restart", 0) == 0), default=0)

        def running() -> bool:
            return bool(rank_pids(trial.job))

        if trial.phase == "startup":
            wait(running, 120, "the ranks to start")
            time.sleep(rng.uniform(0.0, 4.0))  # before or after `import torch` (about 3 s here)
        elif trial.phase == "mid_eval":
            target = rng.choice([EVAL_EVERY * k for k in range(1, STEPS // EVAL_EVERY)])
            wait(lambda: last() >= target - 1, 180, f"step {target - 1}")
        elif trial.phase == "async_save":
            target = rng.choice([INTERVAL * k for k in range(1, STEPS // INTERVAL)])
            wait(lambda: last() >= target, 180, f"step {target}")
        else:  # mid_step, emergency_save, resume_load (the first event)
            target = rng.randint(3, STEPS - 8)
            wait(lambda: last() >= target, 180, f"step {target}")
        trial.fired_at_step = last()

    def fire(self, trial: Trial, event: str) -> None:
        if event == "usr2":
            subprocess.run(["scancel", "--signal=USR2", trial.job], check=False, timeout=30)
        elif event == "sigkill_rank":
            for pid in rank_pids(trial.job, rank=1):
                os.kill(pid, signal.SIGKILL)
        elif event == "preempt":
            node = scontrol_job(trial.job).get("BatchHost", "")
            subprocess.run(["sbatch", "--partition=high", f"--nodelist={node}", "--nodes=1", "--ntasks=1",
                            f"--cpus-per-task={self.cluster.cpus_per_node}", "--output=/dev/null",
                            "--wrap=sleep 2"], check=True, capture_output=True, timeout=30)  # fmt: skip
        elif event == "kill_node":
            from relaytrain.localcluster import cluster as local_cluster

            node = scontrol_job(trial.job).get("BatchHost", "")
            local_cluster.kill_node(node, self.cluster.base_dir)
            trial.error = f"killed {node}"
            self._dead_node = node
        else:
            raise ValueError(event)

    def run_trial(self, trial: Trial, rng: random.Random) -> None:
        start = time.monotonic()
        name = f"chaos-{trial.index}"
        run_dir = self.runs / name
        self._dead_node = ""
        try:
            trial.job = self.launch(name)
            self.wait_phase(trial, run_dir, rng)
            self.fire(trial, trial.event)
            if trial.phase == "emergency_save":
                time.sleep(rng.uniform(0.1, 1.0))  # a second signal while the first one's save runs
                self.fire(trial, "usr2" if trial.event != "kill_node" else "kill_node")
            if trial.phase == "resume_load":
                wait(lambda: int(scontrol_job(trial.job).get("Restarts", "0")) >= 1
                     or scontrol_job(trial.job).get("JobState") not in ("RUNNING", "PENDING"),
                     120, "a requeue")  # fmt: skip
                if int(scontrol_job(trial.job).get("Restarts", "0")) >= 1:
                    wait(lambda: rank_pids(trial.job), 120, "the resumed ranks to start")
                    time.sleep(rng.uniform(1.0, 5.0))  # torch import, then the checkpoint load
                    self.fire(trial, "sigkill_rank")
            if self._dead_node:
                from relaytrain.localcluster import cluster as local_cluster

                wait(
                    lambda: int(scontrol_job(trial.job).get("Restarts", "0")) >= 1,
                    120,
                    "node-failure requeue",
                )
                local_cluster.restart_node(self._dead_node, self.cluster.base_dir)
                trial.error = ""
            self.finish(trial, run_dir)
            self.check(trial, run_dir)
        except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as err:
            trial.error = str(err)[:300]
            subprocess.run(["scancel", trial.job], capture_output=True, timeout=30)
        trial.seconds = round(time.monotonic() - start, 1)

    def finish(self, trial, run_dir: Path, overrides: tuple[str, ...] = (), setup: str | None = None) -> None:
        """Wait for the job; resubmit while the run is not finished (the policy did not requeue)."""
        job = trial.job
        for _ in range(4):
            fields = wait(lambda job=job: (f := scontrol_job(job)) and f.get("JobState") in
                          ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") and f, 420,
                          f"job {job} to end", interval=1.0)  # fmt: skip
            trial.restarts += int(fields.get("Restarts", "0"))
            state = (
                json.loads((run_dir / "run_state.json").read_text())
                if (run_dir / "run_state.json").exists()
                else {}
            )
            trial.final_status = state.get("status", "")
            if hasattr(trial, "states"):
                trial.states.append({k: state.get(k) for k in ("status", "reason", "step", "message")})
            if trial.final_status == "finished":
                return
            trial.resubmits += 1
            job = self.launch(run_dir.name, *overrides, setup=setup)
        raise RuntimeError(f"run {run_dir.name} did not finish after {trial.resubmits} resubmissions")

    def check(self, trial, run_dir: Path) -> None:
        rows = records(run_dir, "train")
        steps = [r["step"] for r in rows]
        trial.steps_replayed = len(steps) - len(set(steps))
        vals = {r["step"]: r["val_loss"] for r in records(run_dir, "eval") if "val_loss" in r}
        trial.bit_exact = (
            set(steps) == set(self.reference)
            and all(r["loss"] == self.reference[r["step"]] for r in rows)
            and all(v == self.reference_val.get(s) for s, v in vals.items())
            and set(vals) == set(self.reference_val)
        )
        from relaytrain.checkpoint.files import COMPLETE, read_latest

        latest = read_latest(run_dir / "checkpoints")  # the checkpoint layer owns what `latest` is
        trial.latest_complete = latest is not None and (latest / COMPLETE).is_file()
        trial.leftovers = sorted(
            str(p.relative_to(run_dir)) for p in run_dir.rglob("*")
            if p.is_file() and not ALLOWED.match(str(p.relative_to(run_dir)))
        )[:5]  # fmt: skip


def draw(trials: int, seed: int) -> list[Trial]:
    rng = random.Random(seed)
    out = []
    for i in range(trials):
        phase = rng.choice(PHASES)
        event = rng.choice(("sigkill_rank",) if phase == "resume_load" else EVENTS)
        out.append(Trial(i, phase, event))
    return out


def render(trials: list[Trial], seed: int | str, command: str, info: dict, load: str = "") -> str:
    ok = sum(t.ok for t in trials)
    rows = [
        (t.index, t.phase, t.event, t.fired_at_step, t.restarts, t.resubmits,
         "yes" if t.bit_exact else "**no**", t.steps_replayed,
         "yes" if t.latest_complete else "**no**", ", ".join(t.leftovers) or "none",
         t.final_status, t.seconds, t.error or "")
        for t in trials
    ]  # fmt: skip
    return (
        "## Chaos: random interruptions on real Slurm\n\n"
        f"Date {datetime.now(UTC).date()}, machine: {info.get('cpu', '?')} ({info.get('cores', '?')} cores), "
        f"local Slurm cluster (`relaytrain cluster up`). Seed(s) **{seed}**. Command(s): {code(command)}.\n"
        f"Load average (1/5/15 min) at the start → end: {load or 'not recorded'}.\n"
        f"A 2-rank tiny run ({STEPS} steps, async checkpoint every {INTERVAL}, eval every {EVAL_EVERY}) "
        "per trial, "
        "compared with one uninterrupted reference run. Leftovers: files outside config.toml, metrics.jsonl, "
        "run_state.json, crashes.jsonl, slurm/, logs/, checkpoints/latest and complete checkpoints.\n\n"
        f"**{ok} of {len(trials)} trials passed** (bit-exact losses and val_losses, latest complete, "
        "no leftovers, finished).\n\n"
        + table(
            [
                "#",
                "phase",
                "event",
                "fired at step",
                "restarts",
                "resubmits",
                "bit-exact",
                "steps replayed",
                "latest complete",
                "leftovers",
                "final status",
                "s",
                "error",
            ],
            rows,
        )  # fmt: skip
    )


def draw_special(
    kill_saves: int, specials: bool | list[str], start: int, modes: str = "async,sync"
) -> list[SpecialTrial]:
    cycle = [f"kill_save_{mode}" for mode in modes.split(",")]
    kinds = [cycle[i % len(cycle)] for i in range(kill_saves)]
    kinds += list(specials if isinstance(specials, list | tuple) else SPECIAL_KINDS if specials else [])
    return [SpecialTrial(start + i, kind) for i, kind in enumerate(kinds)]


# A kill-save trial names the checkpoint.mode it really ran with (a benchmark bug once ran every one sync).
KILL_MODE = re.compile(r"in the (a?sync) save")


@dataclass
class MergedSpecial:
    """The targeted rows of several runs as the page shows them."""

    trials: list[SpecialTrial]
    superseded: list[SpecialTrial]  # replaced by a later run of the same kind
    relabelled: int  # kill-save rows whose kind was corrected to the mode they ran with


def merge_special(trials: list[SpecialTrial]) -> MergedSpecial:
    """Merge rows given in run order: kill-save trials add up (each is one more kill), any other kind
    shows only the latest run that has it. Rows are numbered again from 0."""
    kills, relabelled = [], 0
    for t in trials:
        if not t.kind.startswith("kill_save"):
            continue
        mode = KILL_MODE.search(t.detail)
        if mode and t.kind != f"kill_save_{mode.group(1)}":
            t, relabelled = replace(t, kind=f"kill_save_{mode.group(1)}"), relabelled + 1
        kills.append(t)
    others = [t for t in trials if not t.kind.startswith("kill_save")]
    latest = {t.kind: t.seed for t in others}  # the last run wins
    kept = [t for t in others if t.seed == latest[t.kind]]
    order = {kind: i for i, kind in enumerate(SPECIAL_KINDS)}
    kept.sort(key=lambda t: order.get(t.kind, len(order)))  # stable: a run's own order within a kind
    superseded = [t for t in others if t.seed != latest[t.kind]]
    rows = [replace(t, index=i) for i, t in enumerate(kills + kept)]
    return MergedSpecial(rows, superseded, relabelled)


def kill_save_line(trials: list[SpecialTrial]) -> str:
    kill = [t for t in trials if t.kind.startswith("kill_save")]
    in_flight = sum(t.checks.get("save in flight when killed", False) for t in kill)
    fell_back = sum(
        t.checks.get("resumed from the previous complete checkpoint", False) and t.ok for t in kill
    )
    modes = ", ".join(
        f"{sum(t.kind == f'kill_save_{m}' for t in kill)} {m}" for m in ("async", "sync")
    )  # fmt: skip
    return (
        f"SIGKILL during a save: **{fell_back} of {len(kill)}** ({modes}) fell back to the previous complete "
        f"checkpoint and finished bit-exact ({in_flight} of {len(kill)} kills landed while the save was in "
        "flight: its step directory existed without COMPLETE)."
    )


def render_special(trials: list[SpecialTrial], merged: MergedSpecial | None = None) -> str:
    if not trials:
        return ""
    seeds = merged is not None
    rows = [
        ((t.index, t.seed) if seeds else (t.index,)) + (t.kind, t.detail or "–",
         "; ".join(f"{name}: {'yes' if ok else '**no**'}" for name, ok in t.checks.items()) or "–",
         "yes" if t.bit_exact else "**no**", t.steps_replayed, t.restarts, t.resubmits,
         "yes" if t.latest_complete else "**no**", ", ".join(t.leftovers) or "none", t.final_status,
         t.seconds, t.error or "")
        for t in trials
    ]  # fmt: skip
    header = ["#", "seed"] if seeds else ["#"]
    notes = ""
    if merged is not None and merged.relabelled:
        notes += (
            f" {merged.relabelled} kill-save rows are listed under the checkpoint.mode they reported "
            "('what happened'), not the one their run asked for."
        )
    if merged is not None and merged.superseded:
        dropped = "; ".join(
            f"seed {seed}: " + ", ".join(sorted({t.kind for t in merged.superseded if t.seed == seed}))
            for seed in sorted({t.seed for t in merged.superseded})
        )  # fmt: skip
        notes += f" Not shown, because a later run of the same kind replaces them: {dropped}."
    return (
        "\n### Targeted trials\n\n"
        + kill_save_line(trials)
        + " The kinds: `bench/chaos_special.py`."
        + notes
        + "\n\n"
        + table(header + ["kind", "what happened", "checks", "bit-exact", "steps replayed", "restarts",
                          "resubmits", "latest complete", "leftovers", "final status", "s", "error"], rows)
    )  # fmt: skip


def summary(trials: list[Trial], special: list[SpecialTrial]) -> str:
    """The issue's targets, each with what this page's trials show."""

    def verdict(kinds: tuple[str, ...]) -> str:
        rows = [t for t in special if t.kind in kinds]
        if not rows:
            return "not run"
        parts = []
        for t in rows:
            failed = [name for name, ok in t.checks.items() if not ok]
            state = "pass" if t.ok else "**fail** (" + ", ".join(failed or [t.error or "not finished"]) + ")"
            parts.append(f"{t.kind} (row {t.index}): {state}")
        return "; ".join(parts)

    bit_exact = sum(t.bit_exact for t in trials)
    kill = [t for t in special if t.kind.startswith("kill_save")]
    fell_back = sum(
        t.ok and t.checks.get("resumed from the previous complete checkpoint", False) for t in kill
    )
    disk = [t for t in special if t.kind == "disk_full"]
    lost = sum(not t.checks.get("previous checkpoint intact", False) for t in disk)
    lines = [
        f"- 20 random trials, 20 bit-exact: **{bit_exact} of {len(trials)}** bit-exact, "
        f"{sum(t.ok for t in trials)} passed every check.",
        f"- ≥ 10 SIGKILL-during-save trials fall back: **{fell_back} of {len(kill)}**.",
        "- Disk full, 0 checkpoints lost: "
        + (f"**{lost} lost** in {len(disk)} trial(s); " if disk else "")
        + f"{verdict(('disk_full',))}.",
        f"- Requeue cap: {verdict(('time_limit_cap', 'time_limit_cap_budget'))}.",
        f"- Hang: {verdict(('hang',))}.",
    ]  # fmt: skip
    return "\n### Against the issue's targets\n\n" + "\n".join(lines) + "\n"


def load_results(paths: list[str]) -> tuple[list[Trial], list[SpecialTrial]]:
    """Trials of several runs' results.json, in the order given; targeted ones carry their run's seed."""
    trials, special = [], []
    for path in paths:
        seed = m.group(1) if (m := re.search(r"seed(\d+)", str(path))) else ""
        for row in json.loads(Path(path).read_text()):
            if "kind" in row:
                special.append(SpecialTrial(**{**row, "seed": row.get("seed") or seed}))
            else:
                trials.append(Trial(**row))
    return trials, special


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="random (phase, event) trials")
    parser.add_argument("--kill-saves", type=int, default=10, help="SIGKILL-during-save trials")
    parser.add_argument("--kill-save-modes", default="async,sync", help="checkpoint.mode of those, in turn")
    parser.add_argument("--special", default="", help=f"only these of {','.join(SPECIAL_KINDS)}")
    parser.add_argument("--no-special", action="store_true", help="skip time limit/cap, hang, disk full")
    parser.add_argument("--seed", type=int, default=None, help="default: from the clock (printed)")
    parser.add_argument("--quick", action="store_true", help="3 random trials only, no page")
    parser.add_argument("--chunk", type=int, default=5, help="trials per hold of the cluster lock")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--no-lock", action="store_true", help=f"the caller holds {LOCK} already")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument(
        "--page-from",
        nargs="+",
        metavar="RESULTS_JSON",
        help="write the page from earlier runs' results.json files (seed from --seed)",
    )
    parser.add_argument("--load", default="", help="load averages to print on the page (with --page-from)")
    parser.add_argument("--note", action="append", default=[], help="a paragraph to add (--page-from)")
    parser.add_argument("--command", action="append", default=[], help="a run's command (--page-from)")
    args = parser.parse_args(argv)  # fmt: skip
    command = "python -m bench.chaos " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.page_from:
        trials, special = load_results(args.page_from)
        merged = merge_special(special)
        seeds = ", ".join(sorted({m.group(1) for p in args.page_from if (m := re.search(r"seed(\d+)", p))}))
        shown = "`; `".join(args.command) if args.command else command.strip()
        section = (
            render(trials, seeds, shown, machine_info(), args.load)
            + render_special(merged.trials, merged)
            + summary(trials, merged.trials)
        )
        section += "".join(f"\n{note}\n" for note in args.note)
        print(section)
        write_page({"chaos": section})
        return 0
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    trials = draw(3 if args.quick else args.trials, seed)
    kinds = args.special.split(",") if args.special else not args.no_special
    special = draw_special(args.kill_saves, kinds, len(trials), args.kill_save_modes)
    special = [] if args.quick else [replace(t, seed=str(seed)) for t in special]
    print(f"bench.chaos: seed {seed}, {len(trials)} random + {len(special)} targeted trials", flush=True)
    from relaytrain.localcluster import cluster as local_cluster

    base = Path(args.out) / f"seed{seed}-{int(time.time())}"
    base.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed + 1)
    load = [os.getloadavg()]
    with cluster_lock(not args.no_lock):
        info = local_cluster.running_cluster() or local_cluster.cluster_up(nodes=2, cpus_per_node=4)
    os.environ.update(info.env)
    bench = Bench(base, info)
    bench.run_reference()
    targeted = SpecialTrials(bench, records, rank_pids, wait)
    everything = [*trials, *special]
    for start in range(0, len(everything), args.chunk):
        with cluster_lock(not args.no_lock):
            for trial in everything[start : start + args.chunk]:
                if isinstance(trial, SpecialTrial):
                    targeted.run(trial, rng)
                else:
                    bench.run_trial(trial, rng)
                print(f"bench.chaos: {json.dumps(asdict(trial))}", flush=True)
                (base / "results.json").write_text(json.dumps([asdict(t) for t in everything], indent=1))
    load.append(os.getloadavg())
    loads = " → ".join("/".join(f"{x:.1f}" for x in la) for la in load)
    section = render(trials, seed, command.strip(), machine_info(), loads) + render_special(special)
    section += summary(trials, special)
    print(section)
    if not (args.quick or args.no_write):
        write_page({"chaos": section})
    return 0 if all(t.ok for t in everything) else 1


if __name__ == "__main__":
    sys.exit(main())
