"""`python -m bench.stragglers`: is a slow rank named, how soon, how right, and at what cost?

    python -m bench.stragglers [--factors 1.2,1.5,2] [--clean 2] [--hog 2] [--load 0] [--page]
    python -m bench.stragglers --page-from bench/results/stragglers-<date>.json  # the section, from them

On the local Slurm cluster (taken under its lock), one trial per slowdown factor (rank 1 throttled from
outside the run, bench/cluster/stragglers.py; a factor given twice is tried twice) and clean trials:
without busy processes (`--clean`), beside one busy-looping process (`--hog`: the kernel runs it beside
one rank or the other, a noisy neighbour of one node on this machine whose cores the cluster's nodes
share) and beside one busy process per core (`--load`: both ranks loaded alike, a busy machine). In
rounds (`rounds`), each trial alone: nothing but the throttle slows one rank of a slowed trial, and a
clean trial's false reports are its own. Then,
on this machine, one torchrun run that measures the detection's own cost beside its step time
(bench/straggler_cost.py). The results
go to bench/results/stragglers-<date>.json; `--page` (or `--page-from`) writes the "stragglers" section of
docs/benchmarks.md from them.
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

from bench import kept
from bench.report import REPO, load_average, machine_info, table, write_page
from bench.straggler_noise import TEST, spread
from bench.straggler_records import niceness

SECTION = "stragglers"
# A run kept as the shipped rule's test (`--test`, its key straggler_noise.TEST): bench.straggler_rules
# judges it by the shipped rule alone and keeps it out of every choice (the ranking of rules, the
# leave-one-run-out check).


def results_name() -> str:
    """Each invocation's results keep their own file (bench.straggler_rules replays them all)."""
    return time.strftime("stragglers-%Y-%m-%d-%H%M.json", time.gmtime())


NAMED_WITHIN = 50  # steps from the slowdown to the `straggler:` line
TARGET_SLOWDOWN = 1.2  # a rank this much slower (or more) is to be named within NAMED_WITHIN steps
COST_TARGET = 0.01  # of the step time
COST_STEPS = 300


def measure(factors: list[float], clean: int, hog: int, load: int = 0, command: str = "",
            dim: int = 0, seq_len: int = 0, test: bool = False, lock: bool = True) -> dict:  # fmt: skip
    from bench.cluster.harness import OUT_ROOT, cluster_lock, start_cluster
    from bench.cluster.stragglers import (
        STEPS,
        THROTTLE_AT,
        TRIAL_DIM,
        TRIAL_SEQ_LEN,
        Trial,
        run_trial,
        trial_model,
    )
    from bench.cluster.stragglers import TRIAL_VOCAB as VOCAB

    dim, seq_len = dim or TRIAL_DIM, seq_len or TRIAL_SEQ_LEN
    model = trial_model(dim, seq_len)
    load_start = load_average()
    start_cluster(lock=lock)
    runs = OUT_ROOT / "stragglers" / time.strftime("%Y%m%d-%H%M%S") / "runs"
    runs.mkdir(parents=True)
    names = [f"slow{f:g}".replace(".", "_") for f in factors]
    names = [n if names.count(n) == 1 else f"{n}_{names[:i].count(n)}" for i, n in enumerate(names)]
    # A slowed trial gives each rank a core of its own (a quota of 1/factor of a CPU slows by the factor only
    # a rank that had a whole CPU); the clean trials without busy processes are their control.
    slowed = [Trial(name, f, 0, pinned=True) for name, f in zip(names, factors, strict=True)]
    clean = [Trial(f"clean{i}", 1.0, 0, pinned=True) for i in range(clean)]
    clean += [Trial(f"hog{i}", 1.0, 1) for i in range(hog)]
    clean += [Trial(f"load{i}", 1.0, os.cpu_count() or 1) for i in range(load)]
    # The cluster's nodes share this machine's cores: a job beside a slowed one, or a CPU hog, would slow
    # its un-throttled rank too, so every trial runs alone. Two pinned jobs at once would put both jobs'
    # rank 1 on one core: where their steps fall into step with each other, each job's rank 1 waits for the
    # other's for windows on end while the rank 0s do not (measured: a report at step 120), a noisy
    # neighbour of one node that no real node has.
    rounds = [[t] for t in [*slowed, *clean]]
    trials = []
    with cluster_lock(lock):
        for (trial,) in rounds:
            trials.append(run_trial(trial, runs, model).as_json())
            print(f"{trial.name}: {json.dumps(trial.named)[:300]} {trial.error}", flush=True)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return {"command": command or "python -m bench.stragglers", "date": date,
            "cpu": machine_info().get("cpu", "?"), "cores": os.cpu_count(), "load": str(load_average()),
            "nice": os.nice(0),  # the bench's and its busy processes' (the ranks: Slurm's daemon's)
            "load_start": load_start, "dim": dim, "seq_len": seq_len, TEST: test,
            "steps": STEPS, "throttle_at": THROTTLE_AT, "vocab_size": VOCAB,
            "settings": _settings(), "rounds": [[t.name for t in r] for r in rounds], "trials": trials,
            "cost": measure_cost(), "load_end": load_average()}  # fmt: skip


def measure_cost() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cost.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "bench.straggler_cost", str(out), str(COST_STEPS)]  # fmt: skip
        subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, timeout=600, check=True)
        return json.loads(out.read_text())


def _busy(hog: int | bool, cores: int) -> str:
    """A clean trial's busy processes (results kept before the count: a bool, True for one)."""
    count = int(hog)
    return "none" if count == 0 else "one per core" if count == cores else str(count)


def _false_reports(clean: list[dict], cores: int) -> str:
    """False reports in all clean runs, then by the busy processes beside them."""
    kinds: dict[str, list[int]] = {}
    for t in clean:
        kinds.setdefault(_busy(t["hog"], cores), []).append(len(t["named"]))
    words = {"none": "without busy processes", "1": "beside one", "one per core": "beside one per core"}
    parts = [f"{sum(n)} over {len(n)} {words.get(k, 'beside ' + k)}" for k, n in kinds.items()]
    return f"{sum(len(t['named']) for t in clean)} over {len(clean)} runs ({'; '.join(parts)})"


def _measured_in(slowed: list[dict]) -> str:
    """The phase the slowed trials' slowdowns were measured in (results kept before: the optimizer's)."""
    return " and ".join(sorted({t.get("measured_in") or "optimizer" for t in slowed})) or "optimizer"


def _against_quota(slowed: list[dict]) -> str:
    """How the measured slowdowns compare with the quotas asked (results kept before: nothing)."""
    measured = [t for t in slowed if t.get("applied") is not None]
    if not measured:
        return ""
    above = sum(1 for t in measured if t["applied"] > t["factor"])
    return f" (here the slowdown caused was above the quota asked in {above} of {len(measured)} slowed runs)"


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _settings() -> dict:
    from relaytrain.config.schema import ResilienceConfig
    from relaytrain.resilience.rank.straggler import phase_floor

    r = ResilienceConfig()
    return {"threshold": r.straggler_threshold, "every": r.straggler_every, "windows": r.straggler_windows,
            "needed": r.straggler_windows_over, "min_phase_s": phase_floor("cpu")}  # fmt: skip


def _described(settings: dict | None) -> str:
    if settings is None:  # results kept before the settings were recorded
        return "the default straggler settings"
    from bench.straggler_rules import needed_of

    needed = needed_of(settings)
    # results kept before the floor was recorded compared phases from 1 ms on, as the page then said nothing
    floor = f", phases of {1000 * settings['min_phase_s']:g} ms or more" if "min_phase_s" in settings else ""
    return (f"the default straggler settings of its code (threshold {settings['threshold']:g}, windows of "
            f"{settings['every']} steps, over it in {needed} of the last {settings['windows']} "
            f"windows{floor})")  # fmt: skip


def _within(slowed: list[dict], ok: list[bool]) -> str:
    """The target's count: the slowed runs whose rank was slowed TARGET_SLOWDOWN times or more from outside
    on a core of its own (a pinned trial: the quota slows it by the factor asked or more), then the runs by
    the slowdown measured: the throttled rank's time against its peer's after the throttle (what the detector
    compares), and the slowdown the throttle caused against the ranks' own difference before it."""
    if all(t.get("applied") is None for t in slowed):  # results kept before the slowdown was measured
        return f"{sum(ok)} of {len(ok)} slowed runs"
    parts = []
    pinned = [(t, k) for t, k in zip(slowed, ok, strict=True) if t.get("pinned")]
    target = [k for t, k in pinned if t["factor"] >= TARGET_SLOWDOWN]
    if target:  # none: results kept before the trials were pinned, or every quota asked was smaller
        parts.append(
            f"{sum(target)} of {len(target)} slowed runs whose rank got a quota of {TARGET_SLOWDOWN:g}x or "
            "more on a core of its own (the target: a rank that much slower than its peers)"
        )
    if any(t.get("against_peer") is not None for t in slowed):  # results kept before the peer ratio
        peer = [k for t, k in zip(slowed, ok, strict=True) if (t.get("against_peer") or 0) >= TARGET_SLOWDOWN]
        parts.append(
            f"{sum(peer)} of {len(peer)} {'' if parts else 'slowed runs '}whose throttled rank ran "
            f"{TARGET_SLOWDOWN:g}x as long as its peer or more after the throttle"
            f"{'' if parts else ' (the target: a rank that much slower than its peers)'}"
        )
    caused = [k for t, k in zip(slowed, ok, strict=True) if (t.get("applied") or 0) >= TARGET_SLOWDOWN]
    rest = [k for t, k in zip(slowed, ok, strict=True) if (t.get("applied") or 0) < TARGET_SLOWDOWN]
    parts.append(
        f"{sum(caused)} of {len(caused)} {'' if parts else 'slowed runs '}whose throttle caused a slowdown "
        f"of {TARGET_SLOWDOWN:g}x or more"
        f"{'' if parts else ' (the target)'}, {sum(rest)} of {len(rest)} whose throttle caused less"
    )
    return "; ".join(parts)


def _pinning(trials: list[dict]) -> str:
    """Which trials had each rank on a core of its own (results kept before pinning: none)."""
    pinned = [t["name"] for t in trials if t.get("pinned")]
    if not pinned:
        return ""
    read_back = [t for t in trials if t.get("pinned_to")]  # results kept before the read-back: none
    evidence = (
        f"; read back from every rank's threads after pinning in {len(read_back)} of {len(pinned)}: "
        + ", ".join(
            sorted(
                {
                    " and ".join(
                        f"rank {r} on CPU {', '.join(map(str, c))}" for r, c in t["pinned_to"].items()
                    )
                    for t in read_back
                }
            )
        )  # fmt: skip
        if read_back
        else ""
    )
    return (
        f" Pinned ({', '.join(pinned)}{evidence}): from its first step each rank's threads run on a core of "
        "their own (rank r on CPU r, set from outside the run), as a node has its own cores, so that a quota "
        "of 1/factor of a CPU slows the rank by the factor; the runs beside busy processes are not pinned "
        "(the kernel places ranks and busy processes)."
    )


def _tested(data: dict) -> str:
    """Whether the run shown is kept as a test of the shipped rule (`--test`)."""
    if not data.get(TEST):
        return ""
    return (
        ', kept as a test of the shipped rule: no choice of a rule saw it ("Straggler rules, replayed" '
        "judges it by the shipped rule alone)"
    )


def _loads(data: dict) -> str:
    """The machine's load average (1/5/15 min) as the run recorded it: at the end of the trials (results
    kept before the start was recorded), or at the start and at the end of the whole run."""
    if "load_start" not in data:
        return f"load {data['load']}"
    start, end = (" / ".join(f"{v:.2f}" for v in data[k]) for k in ("load_start", "load_end"))
    said = f"load average 1/5/15 min {start} at the start, {end} at the end"
    if max(data["load_start"][0], data["load_end"][0]) > data["cores"]:
        said += ": above the core count, other processes held the cores"
    return said + "; " * ("nice" in data) + niceness(data)


def _trial_load(trial: dict) -> str:
    """The machine's 1-minute load average at a trial's start and end (results kept before: "–")."""
    return " → ".join(f"{v:.1f}" for v in trial["load"]) if trial.get("load") else "–"


def _model(data: dict) -> str:
    """The trials' model beyond dim 128 and seq 64 (results kept before it was recorded: vocabulary 320)."""
    return f", vocabulary {data.get('vocab_size', 320)}"


def _arrangement(data: dict) -> str:
    """How the trials shared the machine: the rounds of jobs run at once."""
    if "rounds" not in data:  # results kept before the rounds were recorded
        return "Two jobs ran at once, each slowed run beside a clean one (and its CPU hog, when it had one)."
    rounds = "; ".join(" beside ".join(r) if len(r) > 1 else f"{r[0]} alone" for r in data["rounds"])
    return f"The jobs ran in rounds, one round at a time: {rounds}."


def _trials(slowed: list[dict]) -> str:
    """How many trials each quota asked had (a factor given twice is tried twice)."""
    counts: dict[float, int] = {}
    for t in slowed:
        counts[t["factor"]] = counts.get(t["factor"], 0) + 1
    if all(n == 1 for n in counts.values()):
        return "One trial each."
    each = ", ".join(f"{n} at {f:g}x" for f, n in counts.items())
    return f"Slowed trials: {each}; one trial per row."


def render(data: dict, source: str) -> str:
    slowed = [t for t in data["trials"] if t["factor"] > 1]
    clean = [t for t in data["trials"] if t["factor"] == 1]
    rows, within = [], []
    for t in slowed:
        first = t["named"][0] if t["named"] else None
        steps = None if first is None or t["throttled_at"] is None else first["step"] - t["throttled_at"]
        right = first is not None and first["rank"] == t["rank"] and first["node"] == t["node"]
        within.append(steps is not None and 0 < steps <= NAMED_WITHIN and right)  # at the throttle: before it
        measured = "–" if first is None else f"{1 + first['slower']:.2f}x in {first['phase']}"
        applied = "–" if t.get("applied") is None else f"{t['applied']:.2f}x"
        peer = "–" if t.get("against_peer") is None else f"{t['against_peer']:.2f}x"
        job = "–" if t.get("step_slowdown") is None else f"{t['step_slowdown']:.2f}x"
        named = "none" if first is None else f"rank {first['rank']} on {first['node']}"
        rows.append((f"{t['factor']:g}x", applied, peer, job, f"rank {t['rank']} on {t['node']}",
                     t["throttled_at"], "–" if first is None else first["step"],
                     "–" if steps is None else steps, named, _yes(right), measured,
                     t["error"] or ""))  # fmt: skip
    slow_table = table(["quota asked", "slowdown it caused", "against its peer after", "job's step after",
                        "throttled", "at step",
                        "named at step", "steps to the line", "named", "rank and node right",
                        "detector's measure", "error"],
                       rows)  # fmt: skip
    false = [(t["name"], _busy(t["hog"], data["cores"]), _trial_load(t), t["state"], len(t["named"]),
              t["error"] or "") for t in clean]  # fmt: skip
    false_table = table(["run", "busy processes beside it", "load average (1 min)", "job", "false reports",
                         "error"], false)  # fmt: skip
    cost = data["cost"]
    wrong = sum(1 for t in slowed if any(n["rank"] != t["rank"] for n in t["named"]))
    early = sum(1 for t in slowed if t["throttled_at"] is not None and t["named"]
                and t["named"][0]["step"] <= t["throttled_at"])  # fmt: skip
    return "\n".join([
        "## Stragglers",
        "",
        f"Rewritten from the kept results by `python -m bench.stragglers --page-from {source}`; measured by "
        f"`{data.get('command', 'python -m bench.stragglers')}` on {data['date']} ({data['cpu']}, "
        f"{data['cores']} cores, {_loads(data)}), on the local Slurm cluster: 2 nodes x 1 task, a small "
        f"model (dim {data.get('dim', 128)}, seq {data.get('seq_len', 64)}) "
        f"for {data['steps']} steps with {_described(data.get('settings'))}"
        f"{_model(data)}. After step "
        f"{data['throttle_at']} rank 1's process gets a CPU quota of 1/factor of its one compute thread "
        "and 1/factor of a process's CPU weight from outside the run (a cgroup, 2 ms period: `python -m "
        "faults.throttle`); the clean runs "
        "throttle nothing, without busy processes, beside one busy-looping process (the cluster's nodes "
        "share this machine's cores: the kernel runs it beside one rank or the other, a noisy neighbour of "
        "one node), or beside one per core (both ranks loaded alike, a busy machine). "
        f"{_arrangement(data)}{_pinning(data['trials'])} {_trials(slowed)}",
        "",
        slow_table,
        "",
        false_table,
        "",
        f"* Named within {NAMED_WITHIN} steps with the right rank and node: {_within(slowed, within)}; "
        f"a rank that was not throttled named in a slowed run: {wrong} of {len(slowed)}; the throttled "
        f"rank named at or before its throttle's step (a false report): {early} of {len(slowed)}; false "
        "reports on "
        f"clean runs: {_false_reports(clean, data['cores'])}.",
        f"* The detection's own cost, measured inside one {cost['steps']}-step torchrun run of 2 ranks on "
        f"this machine (bench/straggler_cost.py: the timing around the phases and every step's bookkeeping "
        f"and window gather, summed on the rank that spent most): {1e6 * cost['cost_per_step_s']:.0f} µs per "
        f"step against a {1e3 * cost['mean_step_s']:.0f} ms step, {100 * cost['cost_share']:.2f} % "
        f"(target < {100 * COST_TARGET:.0f} %).",
        f"* {spread(data)}",
        "* \"Slowdown it caused\" is measured apart from the detector, from the run's `rank_times` records "
        f"(each rank's median {_measured_in(slowed)} phase per window): rank 1's against rank 0's over the "
        "windows after "
        "the throttle, divided by the same before it. A CPU quota does not slow a phase by a set amount: "
        "the kernel enforces it at its 4 ms tick, so a phase of a few ms may escape it or be held for a "
        "whole period, and on a machine whose cores are shared by other work a rank that got less than a "
        f"whole CPU to begin with is slowed by less{_against_quota(slowed)}. \"Detector's measure\" is what "
        "the `straggler` event reported: the median over its windows of the throttled rank's fastest phase "
        "against the other's (the fastest: a burst of noise does not count), below the mean slowdown where "
        "the slowdown itself comes in bursts. \"Against its peer after\" is rank 1's time against rank 0's "
        "over the windows after the throttle, not divided by the ranks' difference before it: what the "
        "detector compares, and below the slowdown caused where rank 1 was the faster rank before. \"Job's "
        "step after\" is the job's median step time over the windows after the throttle against before it: "
        "a synchronous job runs at its slowest rank's pace, and the phases a rank does alone are a part of "
        "its step.",
        f"* This section shows one run{_tested(data)}. Every kept straggler run, with the shipped rule's "
        "counts on each (those measured with code that did not time the forward phase included), the rule "
        "judged on runs it was not chosen by, and how it was tuned on them: \"Straggler rules, replayed\", "
        "below.",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stragglers", description=__doc__.split("\n")[0])
    parser.add_argument("--factors", default="1.2,1.5,2")
    parser.add_argument("--clean", type=int, default=2, help="clean runs without a CPU hog")
    parser.add_argument("--hog", type=int, default=2, help="clean runs beside one busy process")
    parser.add_argument("--load", type=int, default=0, help="clean runs beside one busy process per core")
    parser.add_argument("--page", action="store_true", help="write the section of docs/benchmarks.md")
    parser.add_argument("--page-from", help="only write the section, from this kept results file")
    parser.add_argument("--dim", type=int, default=0, help="the trials' model width (default 128)")
    parser.add_argument("--seq-len", type=int, default=0, help="the trials' sequence length (default 64)")
    parser.add_argument(
        "--test",
        action="store_true",
        help="a test of the shipped rule: bench.straggler_rules keeps this run out of every choice",
    )
    parser.add_argument(
        "--no-lock", action="store_true", help="the caller holds the cluster's lock (flock LOCK python ...)"
    )
    args = parser.parse_args(argv)
    if args.page_from:
        write_page({SECTION: render(kept.load(args.page_from), kept.relative(args.page_from))})
        return 0
    command = "python -m bench.stragglers " + " ".join(argv if argv is not None else sys.argv[1:])
    factors = [float(f) for f in args.factors.split(",")]
    data = measure(factors, args.clean, args.hog, args.load, command.strip(), args.dim, args.seq_len,
                   args.test, not args.no_lock)  # fmt: skip
    path = kept.save(results_name(), data)
    print(f"wrote {kept.relative(path)}")
    if args.page:
        write_page({SECTION: render(data, kept.relative(path))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
