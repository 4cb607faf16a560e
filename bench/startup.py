"""Time to the first step: from process start, and from a requeued job's start to its first resumed step.

Locally a requeue is `relaytrain train --train.stop_at_step=K` (the job saves step K and ends) followed by
the same command again (it resumes from step K). For each process the clock starts just before it is
spawned; metrics.jsonl gives the wall-clock ``time`` of the ``start``/``resume`` event (set-up done: imports,
model, data, checkpoint loaded) and of the first ``train`` record (first step done). Import times of
``torch`` alone and of ``relaytrain.trainer`` put the set-up in proportion.

    python -m bench.startup [--repeats 3] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

from bench.procs import WORK, events, read_metrics, relaytrain_argv, run, shown, train_records
from bench.report import fmt, median, spread, table

MODULE = "bench.startup"
STOP_AT = 2  # the first job runs steps 1..2, the resumed job steps 3..4


def job_argv(run_root: Path, name: str, extra: list[str]) -> list[str]:
    return relaytrain_argv(
        [
            "train",
            f"--run.dir={run_root}",
            f"--run.name={name}",
            f"--train.max_steps={STOP_AT + 2}",
            f"--train.stop_at_step={STOP_AT}",
            "--optim.warmup_steps=1",
            "--metrics.log_every=1",
            "--train.eval_every=0",
            *extra,
        ]
    )


def timeline(run_dir: Path, spawned: float, event: str, after_step: int) -> dict:
    """Seconds from spawn to the set-up event and to the first train record after ``after_step``."""
    records = read_metrics(run_dir)
    ev = [e for e in events(records, event) if e["step"] == after_step]
    first = [r for r in train_records(records) if r["step"] == after_step + 1]
    if not ev or not first:
        raise RuntimeError(f"{run_dir}/metrics.jsonl lacks the '{event}' event or step {after_step + 1}")
    return {
        "to_setup_s": ev[-1]["time"] - spawned,
        "to_first_step_s": first[-1]["time"] - spawned,
        "first_step_s": first[-1].get("time_step_s"),
    }


IMPORT_PROBE = (
    "import json, time; t0 = time.time(); import torch; t1 = time.time(); import relaytrain.trainer; "
    "print(json.dumps([t0, t1, time.time()]))"
)


def import_times(threads: int) -> dict:
    """Seconds from spawn to the first line of Python, for `import torch`, then for relaytrain.trainer."""
    done = run([sys.executable, "-c", IMPORT_PROBE], threads)
    t0, t1, t2 = json.loads(done.stdout.strip().splitlines()[-1])
    return {"interpreter_s": t0 - done.start_unix, "torch_s": t1 - t0, "relaytrain_s": t2 - t1}


def heaviest_imports(threads: int, top: int = 8) -> list[dict]:
    """What `import relaytrain.trainer` spends its time on after torch: its direct imports, by
    cumulative time, from ``python -X importtime``."""
    done = run([sys.executable, "-X", "importtime", "-c", "import torch; import relaytrain.trainer"], threads)
    rows = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        _self_us, cumulative, name = line[len("import time:") :].split("|")
        depth = (len(name) - len(name.lstrip(" ")) - 1) // 2
        rows.append((depth, int(cumulative), name.strip()))
    names = [r[2] for r in rows]
    if "torch" not in names or "relaytrain.trainer" not in names:
        return []
    start, end = names.index("torch") + 1, names.index("relaytrain.trainer")
    depth = rows[end][0]
    # A module's imports are printed before it, one level deeper.
    children = [r for r in rows[start:end] if r[0] == depth + 1]
    children.sort(key=lambda r: r[1], reverse=True)
    return [{"module": name, "cumulative_s": us / 1e6} for _d, us, name in children[:top]]


def measure(repeats: int = 3, extra: list[str] | None = None, threads: int | None = None) -> dict:
    threads = threads or os.cpu_count() or 1
    extra = list(extra or [])
    run_root = WORK / "runs"
    run_root.mkdir(parents=True, exist_ok=True)
    if not (run_root / ".cache").exists():  # the bundled corpus is tokenized once per run.dir
        run(job_argv(run_root, "startup-warm", extra), threads)
        shutil.rmtree(run_root / "startup-warm", ignore_errors=True)
    samples: dict[str, list] = {"imports": [], "fresh": [], "resume": []}
    argv = []
    for i in range(repeats):
        samples["imports"].append(import_times(threads))
        name = f"startup-{i}"
        shutil.rmtree(run_root / name, ignore_errors=True)
        argv = job_argv(run_root, name, extra)
        first = run(argv, threads)
        samples["fresh"].append(
            timeline(run_root / name, first.start_unix, "start", 0) | {"wall_s": first.wall_s}
        )
        second = run(argv, threads)
        samples["resume"].append(
            timeline(run_root / name, second.start_unix, "resume", STOP_AT) | {"wall_s": second.wall_s}
        )
        shutil.rmtree(run_root / name, ignore_errors=True)
    args = [f"--repeats={repeats}", *extra]
    return {
        "heaviest_imports": heaviest_imports(threads),
        "command": " ".join(["python -m", MODULE, *args]),
        "job_command": re.sub(r"--run\.name=startup-\d+", "--run.name=startup", shown(argv)),
        "threads": threads,
        "repeats": repeats,
        "stop_at": STOP_AT,
        "samples": samples,
    }


def render(result: dict) -> str:
    s = result["samples"]

    def row(label: str, values: list[float]) -> tuple:
        return label, fmt(median(values)), spread(values)

    imports = s["imports"]
    rows = [
        row("interpreter start (spawn -> first line of Python)", [x["interpreter_s"] for x in imports]),
        row("`import torch`", [x["torch_s"] for x in imports]),
        row("`import relaytrain.trainer` after torch", [x["relaytrain_s"] for x in imports]),
        row("fresh job: process start -> `start` event (set-up done)", [x["to_setup_s"] for x in s["fresh"]]),
        row("fresh job: process start -> first step done", [x["to_first_step_s"] for x in s["fresh"]]),
        row("fresh job: first step itself", [x["first_step_s"] for x in s["fresh"]]),
        row(
            "requeued job: process start -> `resume` event (checkpoint loaded)",
            [x["to_setup_s"] for x in s["resume"]],
        ),
        row(
            "requeued job: process start -> first resumed step done",
            [x["to_first_step_s"] for x in s["resume"]],
        ),
        row("requeued job: first resumed step itself", [x["first_step_s"] for x in s["resume"]]),
    ]
    out = "## Time to first step (start and requeue)\n\n"
    out += f"Command: `{result['command']}`\n\n"
    out += (
        f"Repeats: {result['repeats']}. Each runs the job below twice: the first stops after step "
        f"{result['stop_at']} with a checkpoint (`train.stop_at_step`), the second is the same command, as a "
        f"requeued Slurm job would run it, and resumes. {result['threads']} threads; the bundled corpus is "
        "already tokenized (a first run in a new `run.dir` also tokenizes it).\n\n"
    )
    out += table(["interval", "median (s)", "range (s)"], rows)
    out += f"\nJob: `{result['job_command']}`\n"
    interp_s = median(x["interpreter_s"] for x in imports)
    torch_s = median(x["torch_s"] for x in imports)
    own_s = median(x["relaytrain_s"] for x in imports)
    out += "\nApproximate split of the medians (the import times come from separate probe processes):\n\n"
    for label, key, setup_what in (
        ("fresh job", "fresh", "config, model build and init, data loader, CPU peak measurement (0.3 s)"),
        ("requeued job", "resume", "the same plus loading the checkpoint"),
    ):
        setup = median([x["to_setup_s"] for x in s[key]])
        first = median([x["first_step_s"] for x in s[key]])
        out += (
            f"- {label}: interpreter {fmt(interp_s)} s, `import torch` {fmt(torch_s)} s, relaytrain's own "
            f"imports {fmt(own_s)} s, set-up ({setup_what}) {fmt(setup - interp_s - torch_s - own_s)} s, "
            f"first step {fmt(first)} s.\n"
        )
    heavy = result.get("heaviest_imports")
    if heavy:
        out += (
            "\nWhere relaytrain's own import time goes: the imports `import relaytrain.trainer` "
            "triggers once torch is loaded, by cumulative time, each module charged to its first importer "
            "(`python -X importtime -c 'import torch; import relaytrain.trainer'`):\n\n"
        )
        out += table(["module", "seconds"], [(f"`{h['module']}`", fmt(h["cumulative_s"])) for h in heavy])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="default: all cores")
    parser.add_argument("--json", action="store_true", help="print the raw results as JSON")
    args, extra = parser.parse_known_args(argv)
    result = measure(args.repeats, extra, args.threads or None)
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
