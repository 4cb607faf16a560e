"""Kill -> next step with `resilience.survivors` on, against the restart of every process, in one
invocation: the trainer under `python -m relaytrain.job.torchrun` on gloo/CPU (a tiny model).

    python -m bench.survivors [--ranks 4] [--trials 3] [--kill-at 5] [--steps 100] [--seed 57] [--no-write]
    python -m bench.survivors --page-from bench/results/survivors-<date>.json ...   # every kept run

An uninterrupted run gives the reference losses. Then, per trial, one rank drawn from `--seed` (rank 0
included) is SIGKILLed from outside in two runs:

* survivors: `--resilience.survivors=true`: once step `--kill-at` is logged and the launcher's standby
  process says it is ready (imported, waiting: the state a fault meets after the start-up); the other
  ranks keep their processes, the standby takes the dead one's place, and the step is redone from the
  snapshot of the last step. `--steps` must leave the standby time to get ready.
* restart: survivors off (the path without them), after the same step as the survivors run's kill: the
  launcher ends every worker and fails, and the bench starts the same command at once, as the batch
  driver's restart in place does (without srun's step start and the driver's decision: the restart's
  figure is a lower bound of a Slurm job's).

Per run, from the bench's clock at the kill to the `time` of the next step in metrics.jsonl: kill -> next
step; the steps replayed; the losses equal to the reference's at every step; the processes besides the
killed one that exited (survivors: a rank's pid before the kill against after the recovery); and the
survivors' recovery event (detect, repair, transfer, redo) and what replaced the dead rank (the launcher's
log: the standby, or a new process). Snapshots every step.
Keeps bench/results/survivors-<UTC date and time>.json and writes the `survivors` section of
docs/benchmarks.md from every kept run: the latest in full, each earlier one as a row.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import kept
from bench.procs import bench_env
from bench.report import REPO, fmt, machine_info, python_command, table, write_page

MODULE = "bench.survivors"
SECTION = "survivors"
ORDER = ["startup", "compile-restart", "survivor-regroup", SECTION]
# The launcher's lines (relaytrain.job.torchrun): its standby ready, and what took the dead rank's place.
READY = r"relaytrain\.job\.torchrun: the standby process \(pid \d+\) is ready"
REPLACED = r"the other ranks stay: (?:the standby process \(pid \d+(, still importing)?\)|(no standby))"
MODEL = [
    "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
    "--model.vocab_size=320", "--train.seq_len=32", "--train.global_batch_size=8",
    "--train.micro_batch_size=2", "--optim.warmup_steps=2", "--train.eval_every=0", "--metrics.log_every=1",
    "--metrics.tensorboard=false", "--checkpoint.interval=0", "--checkpoint.snapshot_every=1",
]  # fmt: skip


def launch(run_dir: Path, ranks: int, steps: int, survivors: bool) -> subprocess.Popen:
    command = [sys.executable, "-m", "relaytrain.job.torchrun"]
    command += ["--survivor-replacements=3"] if survivors else []  # as a one-node job's, restarts 0
    command += ["--standalone", f"--nproc_per_node={ranks}", "--max_restarts=0"]
    command += ["-m", "relaytrain.cli", "train", *MODEL]
    command += [f"--train.max_steps={steps}", f"--run.dir={run_dir.parent}", f"--run.name={run_dir.name}"]
    command += [f"--resilience.survivors={str(survivors).lower()}"]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = (run_dir.parent / f"{run_dir.name}.log").open("a")
    return subprocess.Popen(command, cwd=REPO, env=bench_env(1), stdout=log, stderr=subprocess.STDOUT)


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(run_dir) if r["kind"] == "train"}


def worker_pids(parent: int) -> dict[int, int]:
    """RANK -> pid of the launcher's workers (its children)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent
            ):
                env = (entry / "environ").read_bytes().split(b"\0")
                rank = next(v[5:] for v in env if v.startswith(b"RANK="))
                found[int(rank)] = int(entry.name)
        except (OSError, StopIteration, ValueError, IndexError):
            continue
    return found


def wait(run_dir: Path, proc: subprocess.Popen, done, timeout: float = 600, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not done(rows(run_dir)):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"{run_dir}: ended or timed out first (log {run_dir.parent / run_dir.name}.log)"
            )
        time.sleep(interval)


def replacement(line: re.Match | None) -> str:
    """What took the dead rank's place, from the launcher's line (`REPLACED`)."""
    if line is None:
        return "not logged"
    return "new process" if line.group(2) else "standby, still importing" if line.group(1) else "standby"


def log_of(run_dir: Path) -> str:
    return (run_dir.parent / f"{run_dir.name}.log").read_text(errors="replace")


def run_once(where: Path, args, reference: dict | None, rank: int, at_step: int, survivors: bool) -> dict:
    run_dir = where / ("survivors" if survivors else "restart")
    proc = launch(run_dir, args.ranks, args.steps, survivors)
    wait(run_dir, proc, lambda rs: any(r["kind"] == "train" and r["step"] >= at_step for r in rs))
    if survivors:
        wait(run_dir, proc, lambda rs: re.search(READY, log_of(run_dir)), interval=0.1)
    before = worker_pids(proc.pid)
    killed_at = time.time()
    os.kill(before[rank], signal.SIGKILL)
    exited = 0
    if survivors:
        wait(run_dir, proc, lambda rs: any(r.get("event") == "recovery" for r in rs))
        after = worker_pids(proc.pid)
        exited = sum(after.get(r) != pid for r, pid in before.items() if r != rank)
    else:
        proc.wait(timeout=300)
        proc = launch(run_dir, args.ranks, args.steps, survivors)
    if proc.wait(timeout=600) != 0:
        raise RuntimeError(f"{run_dir}: exit {proc.returncode}")
    records = rows(run_dir)
    replaced = re.search(REPLACED, log_of(run_dir)) if survivors else None
    last = max(r["step"] for r in records if r["kind"] == "train" and r["time"] <= killed_at)
    after_kill = [r for r in records if r["kind"] == "train" and r["time"] > killed_at]
    restored = [r["step"] for r in records if r.get("event") == "resume" and r["time"] > killed_at]
    out = {
        "path": "survivors" if survivors else "restart",
        "killed_rank": rank,
        "killed_after_step": last,
        "kill_to_next_s": min(r["time"] for r in after_kill) - killed_at,
        "steps_replayed": last - restored[0] if restored else None,
        "bit_exact": reference is not None and losses(run_dir) == reference,
        "others_exited": exited if survivors else args.ranks - 1,
    }
    if survivors:
        out["replacement"] = replacement(replaced)
        (event,) = [r for r in records if r.get("event") == "recovery"]
        out["recovery"] = {
            k: event[k] for k in ("detect_s", "repair_s", "transfer_s", "redo_s", "fault_to_step_s")
        }
    return out


def measure(args) -> dict:
    where = Path(tempfile.mkdtemp(prefix="bench-survivors-"))  # kept when a run fails: its logs
    ref = where / "reference"
    proc = launch(ref, args.ranks, args.steps, False)
    if proc.wait(timeout=600) != 0:
        raise RuntimeError(f"the reference run failed: {ref}.log")
    reference = losses(ref)
    draw = random.Random(args.seed)
    trials = []
    for n in range(args.trials):
        rank = draw.randrange(args.ranks)
        survivors = run_once(where / f"t{n}", args, reference, rank, args.kill_at, True)
        restart = run_once(where / f"t{n}", args, reference, rank, survivors["killed_after_step"], False)
        trials.append([survivors, restart])
        print(json.dumps(trials[-1]), flush=True)
    shutil.rmtree(where, ignore_errors=True)
    return {"trials": trials}


def killed_at(surv: list[dict], args: dict) -> str:
    """The steps the kills came after: `--kill-at` (earlier results), else each survivors run's (the
    restart run's kill came after the same step)."""
    steps = [r["killed_after_step"] for r in surv if "killed_after_step" in r]
    return str(sorted(steps)) if steps else str(args["kill_at"])


def replaced_by(surv: list[dict]) -> str:
    """What took the dead rank's place in the survivors runs (earlier results: always a new process)."""
    if not any("replacement" in r for r in surv):
        return (
            "The survivors' repair waits for the replacement's start-up (a new process: its imports, its "
            "process group, its model): no warm standby process takes the lost rank's place yet."
        )
    kinds = sorted({r["replacement"] for r in surv})
    said = ", ".join(f"{k} in {sum(r['replacement'] == k for r in surv)}" for k in kinds)
    return (
        f"What took the dead rank's place (the launcher's log): {said} of {len(surv)}. The standby "
        "process was started before the kill (after the ranks' start-up), had imported the trainer and "
        "waited; the kill came once the launcher said it was ready."
    )


def medians(data: dict) -> tuple[float, float]:
    """Kill -> next step, medians: (survivors, restart)."""
    runs = [run for trial in data["trials"] for run in trial]
    return tuple(
        statistics.median(r["kill_to_next_s"] for r in runs if r["path"] == path)
        for path in ("survivors", "restart")
    )  # type: ignore[return-value]


def render(data: dict) -> str:
    """One run's section, with the sentence naming its file (what a measurement prints)."""
    return render_run(data) + "\n" + kept.rewritten(python_command(MODULE), kept.relative(data["kept"]))


def render_page(runs: list[dict]) -> str:
    """The section from every kept run: the latest in full, the earlier ones as rows, all files named."""
    runs = sorted(runs, key=lambda data: data["machine"]["date"])
    lines = [render_run(runs[-1])]
    if len(runs) > 1:
        rows = []
        for data in runs[:-1]:
            surv = [trial[0] for trial in data["trials"]]
            survivors, restart = medians(data)
            took = ", ".join(sorted({r.get("replacement", "new process") for r in surv}))
            rows.append((data["machine"]["date"], data["machine"]["commit"], took, fmt(survivors),
                         fmt(restart), f"{restart / survivors:.2f}x"))  # fmt: skip
        header = ["run", "commit", "replacement", "survivors (s)", "restart (s)", "restart / survivors"]
        lines += ["Earlier runs (kill -> next step, medians):", "", table(header, rows).rstrip(), ""]
    names = [kept.relative(data["kept"]) for data in runs]
    lines.append(
        f"Results: {', '.join(f'`{name}`' for name in names)}. Rewritten from the kept results by "
        f"`{python_command(MODULE)} --page-from {' '.join(names)}`.\n"
    )
    return "\n".join(lines)


def render_run(data: dict) -> str:
    m, a = data["machine"], data["args"]
    runs = [run for trial in data["trials"] for run in trial]
    of = lambda path: [r for r in runs if r["path"] == path]  # noqa: E731

    def row(label: str, values: list[float]) -> tuple:
        return label, fmt(statistics.median(values)), f"{fmt(min(values))} - {fmt(max(values))}"

    surv, rest = of("survivors"), of("restart")
    split = [(k, [r["recovery"][k] for r in surv]) for k in ("detect_s", "repair_s", "transfer_s", "redo_s")]
    table_rows = [
        row("survivors: kill -> next step", [r["kill_to_next_s"] for r in surv]),
        *[row(f"survivors: {k[:-2]} (recovery event)", v) for k, v in split],
        row("restart of every process: kill -> next step", [r["kill_to_next_s"] for r in rest]),
    ]
    ratio = statistics.median([r["kill_to_next_s"] for r in rest]) / statistics.median(
        [r["kill_to_next_s"] for r in surv]
    )
    exact = lambda rs: f"{sum(r['bit_exact'] for r in rs)} of {len(rs)}"  # noqa: E731
    lines = [
        "## Survivors: kill -> next step, the trainer on gloo",
        "",
        f"{m['date']}, {m['cpu']} ({m['cores']} cores, load {m['load_start']} at the start), "
        f"torch {m['torch']}, commit {m['commit']}. {a['ranks']} ranks under "
        "`python -m relaytrain.job.torchrun`, "
        f"the tests' tiny model, snapshots every step; per trial one rank (drawn, rank 0 included: killed "
        f"{sorted(r['killed_rank'] for r in surv)}) SIGKILLed from outside after step "
        f"{killed_at(surv, a)} of {a['steps']}, once with `resilience.survivors` on and once off (the "
        "launcher fails and the same command starts at once, as the batch driver's restart in place does, "
        "without srun's step start: "
        f"a lower bound), {len(surv)} trials. Command: `{data['command']}`.",
        "",
        table(["interval", "median (s)", "range (s)"], table_rows).rstrip(),
        "",
        f"Restart / survivors, medians: {ratio:.2f}x. Losses equal to an uninterrupted run's at every step: "
        f"survivors {exact(surv)}, restart {exact(rest)}; steps replayed (survivors): "
        f"{sorted(r['steps_replayed'] for r in surv)}; processes besides the killed one that exited: "
        f"survivors {sum(r['others_exited'] for r in surv)}, "
        f"restart {sum(r['others_exited'] for r in rest)}. " + replaced_by(surv),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=57)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--page-from", nargs="+", default=[])
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.page_from:
        try:
            runs = [kept.page_from(path) for path in args.page_from]
        except ValueError as err:
            parser.error(f"--page-from: {err}")
        print(f"wrote {write_page({SECTION: render_page(runs)}, ORDER)}")
        return 0
    if not 0 < args.kill_at < args.steps - 1:
        parser.error(f"--kill-at must be between 1 and --steps - 2 ({args.steps - 2})")
    shown = [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("no_write", "page_from")
    ]
    data = {"machine": machine_info(), "command": python_command(MODULE, shown), "args": vars(args)}
    data |= measure(args)
    kept.keep_and_show("survivors", data, render, SECTION, ORDER, write=False)
    if not args.no_write:
        runs = [kept.page_from(path) for path in sorted(kept.RESULTS_DIR.glob("survivors-*.json"))]
        print(f"wrote {write_page({SECTION: render_page(runs)}, ORDER)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
