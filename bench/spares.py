"""What a spare node buys on the local Slurm cluster, in two kinds of trial (`--kinds`, both by default).

`kill`: a `--nodes 2 --spare-nodes 1` job (3 nodes, 1 rank on each training node, snapshots every step)
loses its second training node (its slurmd and processes killed, as tests/test_elastic_slurm.py does);
the step restarts in place with the spare in its place.

Measured from the run's own records: the kill to the decision's `step_restart` event (Slurm noticing the
node and the step ending), to the `resume` event (start-up and restore), to the first step trained after
it; the steps lost (the last step logged before the kill less the step the run resumed from); where it
resumed from (a snapshot, a replica from the peer node, or the checkpoint); and whether every logged loss
equals an uninterrupted run's (torchrun, 2 ranks, same config, run alongside).

`straggler`: the same job with snapshots every 10 steps and `resilience.straggler_action = "replace"`, its
rank 1 slowed from outside (a CPU quota): named, stopped after the next snapshot, restarted in place with
the spare in the slow node's place; how soon, how right, and how soon throughput is back
(bench/spares_straggler.py says what is measured and how).

    python -m bench.spares                      # one trial of each kind, results to bench/results/spares.json
    python -m bench.spares --kinds straggler    # the straggler trial alone (the file then holds only it)
    python -m bench.spares --page-from bench/results/spares.json   # the "spares" section of the page

The results file keeps the kill trials under `trials` and the straggler trials under `straggler_trials`;
the section shows a table for each kind the file holds. The exit code is 1 when a trial missed its
targets (kill: bit-exact without a requeue; straggler: `bench.spares_straggler.passed`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import kept, spares_straggler
from bench.cluster import harness
from bench.report import code, fmt, table, write_page

SECTION = "spares"
KINDS = ("kill", "straggler")
STEPS, KILL_AT, STEP_DELAY_S = 40, 8, 0.5


def rows(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, filter(None, lines)) if r.get("kind") == kind]


def reference(run_dir: Path, config: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "relaytrain.cli", "train", str(config), f"--run.dir={run_dir.parent}",
           f"--run.name={run_dir.name}", "--checkpoint.snapshot_every=1"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def kill_trial(base: Path) -> dict[str, Any]:
    from relaytrain.job.env import expand_nodelist
    from relaytrain.localcluster import cluster as local_cluster

    from faults import setup_line

    runs = base / "runs"
    base.mkdir(parents=True, exist_ok=True)
    config = harness.write_config(base / "spares.toml", "spare", runs, STEPS, 0, 10)
    ref = reference(runs / "reference", config)
    slow = f"--slurm.setup=['{setup_line(step_delay_s=STEP_DELAY_S)}']"
    out = harness.relaytrain("launch", str(config), "--nodes", "2", "--spare-nodes", "1",
                             "--tasks-per-node", "1", "--checkpoint.snapshot_every=1", slow)  # fmt: skip
    job = out.split("submitted job ")[1].split()[0]
    run_dir, killed = runs / "spare", None
    try:
        harness.wait(
            lambda: max((r["step"] for r in rows(run_dir, "train")), default=0) >= KILL_AT, 180, "steps"
        )
        killed = expand_nodelist(harness.scontrol_job(job)["NodeList"])[1]
        last_before = max(r["step"] for r in rows(run_dir, "train"))
        killed_at = time.time()
        local_cluster.kill_node(killed)
        fields = harness.wait_job_end(job, 300)
        ref.wait(timeout=300)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
        if ref.poll() is None:
            ref.kill()
        if killed is not None:
            local_cluster.restart_node(killed)
    events = rows(run_dir, "event")
    restart = next(e for e in events if e["event"] == "step_restart")
    resume = next(e for e in events if e["event"] == "resume")
    first = min((r for r in rows(run_dir, "train") if r.get("step_restart") == 1), key=lambda r: r["time"])
    want = {r["step"]: r["loss"] for r in rows(runs / "reference", "train")}
    got = rows(run_dir, "train")
    log = (run_dir / "slurm" / f"{job}.out").read_text(errors="replace")
    source = "snapshot, a replica from the peer node" if "from a peer node" in log else (
        "snapshot" if "resuming from the snapshot" in log else "checkpoint")  # fmt: skip
    return {
        "job": job, "state": fields.get("JobState"), "requeues": int(fields.get("Restarts", "0")),
        "killed": killed, "nodes_after": restart["nodes"], "nodes_replaced": restart.get("nodes_replaced"),
        "world_sizes": sorted({e["world_size"] for e in events if e["event"] in ("start", "resume")}),
        "resized": any(e["event"] == "resize" for e in events),
        "kill_to_decision_s": round(restart["time"] - killed_at, 2),
        "kill_to_resume_s": round(resume["time"] - killed_at, 2),
        "kill_to_first_step_s": round(first["time"] - killed_at, 2),
        "steps_lost": last_before - resume["step"], "resumed_from": source,
        "bit_exact": bool(got) and {r["step"] for r in got} == set(want)
        and all(r["loss"] == want[r["step"]] for r in got),
    }  # fmt: skip


def render(data: dict[str, Any], path: str) -> str:
    kill = render_kill(data) if data["trials"] else "## Spare nodes: a slow node replaced in place\n\n"
    straggler = data.get("straggler_trials")
    return (
        kill
        + (spares_straggler.render(straggler, data["command"], data["date"]) + "\n" if straggler else "")
        + f"Results: `{path}`. Rewritten from the kept results by "
        f"`python -m bench.spares --page-from {path}`.\n"
    )


def render_kill(data: dict[str, Any]) -> str:
    header = ["trial", "job end", "requeues", "node killed → spare", "world size", "resize",
              "kill → decision s", "kill → resume s", "kill → first step s", "steps lost", "resumed from",
              "bit-exact"]  # fmt: skip
    body = [
        (i + 1, t["state"], t["requeues"], " → ".join(t["nodes_replaced"][0]) if t["nodes_replaced"] else "–",
         ",".join(map(str, t["world_sizes"])), "yes" if t["resized"] else "no", fmt(t["kill_to_decision_s"]),
         fmt(t["kill_to_resume_s"]), fmt(t["kill_to_first_step_s"]), t["steps_lost"], t["resumed_from"],
         "yes" if t["bit_exact"] else "**no**")
        for i, t in enumerate(data["trials"])
    ]  # fmt: skip
    return (
        "## Spare nodes: a killed node replaced in place\n\n"
        f"Measured by {code(data['command'])} ({data['date']}) on the local Slurm cluster: a `--nodes 2 "
        f"--spare-nodes 1` job of the tests' tiny model (1 rank per node, snapshots every step, "
        f"{STEP_DELAY_S} s per step), its second training node killed after step {KILL_AT}. Kill → decision "
        "is the step ending after the kill (the surviving rank's collective fails, srun reports the node "
        "failure) and the decision; decision → resume is the restarted step's start-up and restore.\n\n"
        + table(header, body)
        + "\n"
    )


def kinds_arg(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"kinds are {', '.join(KINDS)}, not {text!r}")
    return [k for k in KINDS if k in kinds]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1, help="trials of each kind")
    parser.add_argument("--kinds", type=kinds_arg, default=list(KINDS), help="kill,straggler (both)")
    parser.add_argument("--out", default="spares.json", help="the kept results file (bench/results/)")
    parser.add_argument("--no-lock", action="store_true", help="the caller holds the cluster's lock")
    parser.add_argument("--page-from", help="write the page's section from this kept results file")
    args = parser.parse_args(argv)
    if args.page_from:
        write_page({SECTION: render(kept.load(args.page_from), kept.relative(args.page_from))})
        return 0
    harness.start_cluster(lock=not args.no_lock, nodes=3)  # 2 nodes and the spare
    with harness.cluster_lock(not args.no_lock), tempfile.TemporaryDirectory(prefix="bench-spares-") as base:
        trials = [kill_trial(Path(base) / f"kill{i}") for i in range(args.trials) if "kill" in args.kinds]
        slowed = [spares_straggler.trial(Path(base) / f"straggler{i}") for i in range(args.trials)
                  if "straggler" in args.kinds]  # fmt: skip
    command = "python -m bench.spares" + (f" --trials {args.trials}" if args.trials != 1 else "")
    command += f" --kinds {','.join(args.kinds)}" if args.kinds != list(KINDS) else ""
    data = {"command": command, "date": time.strftime("%Y-%m-%d"), "trials": trials}
    data |= {"straggler_trials": slowed} if slowed else {}
    path = kept.save(args.out, data)
    print(json.dumps(data, indent=1))
    write_page({SECTION: render(data, kept.relative(path))})
    kill_ok = all(t["bit_exact"] and t["requeues"] == 0 for t in trials)
    return 0 if kill_ok and all(map(spares_straggler.passed, slowed)) else 1


if __name__ == "__main__":
    sys.exit(main())
