"""`python -m bench.chaos --hangs KIND[,KIND] --trials N`: hangs on real Slurm, detected, named, restarted.

    python -m bench.chaos --hangs all --trials 3 --seed 7     # every kind 3 times; writes the "hangs" section
    python -m bench.chaos --hangs clean --trials 20           # false detections over 20 clean runs
    python -m bench.chaos --hangs hang_stop_compile,hang_stop_save,hang_stop_eval --trials 2   # in phases
    python -m bench.chaos --page-from hangs-seed7-DATE.json --section hangs   # the section from kept results

Each trial is a run of the debug config's model and batch (configs/debug.toml: a step takes about half a
second here) on 2 nodes x 1 task of the local Slurm cluster (`relaytrain cluster up`), 40 steps, interval
checkpoints every 10 steps, evaluations every 10, and in-memory snapshots every 2 steps. The absolute
cap (`resilience.hang_timeout_s`, also the in-process watchdog's timeout) is set to 600 s, so the job's
hang monitor, with its default floor and multiple, is what acts; the wide and long variants' jobs get 30
minutes (chaos_hangs_variants.py). Reference runs come first, then the trials, each holding the cluster
lock. The kinds (faults/pythonpath/relaytrain_faults.py has the injected ones):

* ``hang_stop_rank0``, ``hang_stop_rank1``: the bench SIGSTOPs the rank's process (its pid from the node
  watcher's hang/nodes/<node>.json) after a random step, and sees it stopped (state T); it kills it
  afterwards if nothing did.
* ``hang_fifo``: the rank's data fetch opens a FIFO with no writer (blocked in the kernel: a dead mount).
* ``hang_loader_stall``: the rank's data fetch waits forever on an Event (a deadlocked loader).
* ``hang_stop_restore``, ``hang_stop_compile``, ``hang_stop_rendezvous``, ``hang_stop_save``,
  ``hang_stop_eval`` (issue 53's cases a, b, c, e, f): the rank (index % 2) SIGSTOPs itself right after
  it published the phase (faults/: ``stop_in_phase``; its landed line gives the time): the restore of the
  1.2 GB ``wide`` state and the rendezvous, both in the restart in place that follows the bench's
  SIGKILL of the other rank (after step 3 of wide, 5 of debug); a graph's compilation (the ``compile``
  variant's config); a sync checkpoint save of the ``wide`` state; the debug run's first evaluation.
* ``hang_stop_long_step`` (issue 53's case d): the ``long`` variant's run (every rank sleeps LAYER_DELAY_S
  before each layer's forward: 4 layers x 2 micro batches, a step of about 21 s, marks 2.5 s apart), 8
  steps; after a random step from the 2nd to the 4th and a random 20-80 % of the step median, the bench
  SIGSTOPs the rank (index % 2) from outside, inside the forward of the step under way.
* ``hang_skip_collective``: the rank skips the all-reduce of its logged loss once (desynchronised). On
  gloo its next collective is paired with the one the others wait in and gloo fails both at once (size
  mismatch): a crash, restarted in place, which the trial records as such (no hang to detect).
* ``slow_rank``: the rank runs 5x slower from step 3, still moving: a `straggler hint:` line, no restart.
* ``clean``: no hang, with checkpoint.mode async and sync in turn, evaluations, and a CPU-bound process
  beside the run the whole time: any `hang detected:` line is a false detection. Its variants, by trial
  index (bench/cluster/chaos_hangs_clean.py; `--clean-variants` picks some): ``debug``; ``wide`` (about
  1.2 GB of model and AdamW state, 6 steps, its own reference run); ``compile`` (`parallel.compile=true`:
  a long first step); ``restart`` (one rank SIGKILLed mid-run: the step restarts in place, and must);
  ``compile_cold`` (compile with Inductor's caches off: every graph compiled from scratch); ``long``.

The faulted rank alternates (trial index mod 2) for the injected kinds. Per trial: the fault's time, the
detection's, the culprit named in hang/last.json against the faulted rank and its node, the time from the
fault to the first step after the restart, whether crashes.jsonl shows the hang's crash restarted in
place (a later requeue at the time budget does not undo that), steps replayed, and losses against an
uninterrupted reference run (bench/cluster/chaos_hangs_judge.py). A trial counts only with evidence its
fault landed: the landed line in the job log, or the stopped process seen in state T.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from relaytrain.resilience.batch.crash import RESTARTED

import faults
from bench import kept
from bench.cluster.chaos_hangs_clean import (
    CLEAN_VARIANTS,
    DEBUG,
    LAYER_DELAY_S,
    VariantBenches,
    parse_variants,
    remove_cold_folder,
    variant_setup,
    write_clean_config,
)
from bench.cluster.chaos_hangs_judge import (
    DETECTED,
    KINDS,
    LONG_STEP,
    MISMATCH,
    PHASE_KINDS,
    HangTrial,
    judge,
)
from bench.cluster.chaos_hangs_page import SECTION, render_hangs_section
from bench.cluster.chaos_hangs_variants import OVERRIDES, assign_variant, overrides_of, time_limit_note
from bench.cluster.chaos_page import results_data
from bench.cluster.chaos_run import ALLOWED, STEPS, Bench, kill_pids
from bench.cluster.harness import (
    RunFiles,
    cluster_lock,
    error_text,
    load_averages,
    locate,
    proc_state,
    start_cluster,
    wait,
)
from bench.report import machine_info, write_page

NODES = 2

LOCK_GAP_S = 10  # the cluster lock left free between chunks: another user's waiting flock takes it
DETECT_WAIT_S = 240  # no `hang detected:` line this long after the fault: the trial fails
SLOW_FACTOR, SLOW_FROM_STEP = 5, 3
NO_FAULT = "true"  # the setup of a resubmitted run: full speed, no fault
# The hang monitor's and the node watchers' files are part of a run that had a hang
HANG_ALLOWED = re.compile(rf"^(hang/.*|{ALLOWED.pattern[1:-1]})$")


def first_run_setup(**fault) -> str:
    """The batch shell's setup: the fault, in the job's first run only (not a requeue). The debug model's
    steps are long enough to aim a fault at: no step delay."""
    line = faults.setup_line(**fault)
    return f'if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then {line}; fi'


# What each injected kind's landed line says (faults/pythonpath/relaytrain_faults.py); the step delay's
# lines land too
LANDED_SAYS = {
    "hang_fifo": "FIFO read with no writer",
    "hang_loader_stall": "data loader stall",
    "hang_skip_collective": "skipped the loss_mean collective",
    "slow_rank": "slower steps",
}


def fault_landed(log: str, kind: str, rank: int) -> tuple[str, float] | None:
    """(text, Unix time) of the landed line of `kind`'s fault on `rank` in a job log, None before it lands."""
    says = f"SIGSTOP in {PHASE_KINDS[kind][0]}" if kind in PHASE_KINDS else LANDED_SAYS[kind]
    for text, at in faults.landed_at(log):
        if says in text and f" on rank {rank}" in text and at is not None:
            return text, at
    return None


def remove_fifo(landed: str) -> None:
    """Remove the FIFO (and its folder) that a FIFO fault's landed line names: the rank that opened it is
    gone, and nobody else reads it."""
    fifo = Path(landed.rsplit(": ", 1)[-1])
    if fifo.parent.name.startswith("relaytrain-fault-"):
        fifo.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            fifo.parent.rmdir()


class HangTrials:
    """Runs hang trials on a chaos_run.Bench (its reference run, launch, finish and loss check)."""

    def __init__(self, bench: Bench, variants: tuple[str, ...] = CLEAN_VARIANTS):
        self.bench, self.variants = bench, variants
        self.benches = VariantBenches(bench)  # a clean variant's config and reference run
        self.failed: dict[str, str] = {}  # a variant whose reference run failed: the error

    def prepare(self, trials: list[HangTrial]) -> None:
        """The reference run of every config the trials run, before they take the cluster lock: a
        reference run is torchrun on this machine and needs no Slurm."""
        for trial in trials:
            assign_variant(trial, self.variants)
            variant = trial.variant or DEBUG.name  # the kinds without a variant run the debug bench
            if variant not in self.failed:
                try:
                    self.benches(variant)
                except (RuntimeError, OSError, subprocess.SubprocessError) as err:
                    self.failed[variant] = f"the {variant} reference run: {err}"[:300]

    def run(self, trial: HangTrial, rng) -> None:
        assign_variant(trial, self.variants)
        variant = trial.variant or DEBUG.name
        if variant in self.failed:
            trial.error = self.failed[variant]
            return
        try:
            bench = self.benches(variant)  # its reference run first (done by prepare, unless not called)
        except (RuntimeError, OSError, subprocess.SubprocessError) as err:
            trial.error = f"the {variant} reference run: {err}"[:300]
            return
        start = time.monotonic()
        name = "-".join(filter(None, ("hangs", str(trial.index), trial.kind, trial.variant)))
        run = bench.run_files(name.replace("_", "-"))
        evidence: list[str] = []
        try:
            if trial.kind.startswith("hang_stop_rank") or trial.kind == LONG_STEP:
                self.stop(bench, trial, run, rng, evidence)
            elif trial.kind == "clean":
                self.clean(bench, trial, run, rng, evidence)
            elif trial.kind in PHASE_KINDS:
                self.in_phase(bench, trial, run, evidence)
            else:
                self.injected(trial, run, rng, evidence)
            bench.check(trial, run)
            trial.leftovers = run.leftovers(HANG_ALLOWED)
            trial.evidence = evidence
            judge(trial, run.job_log(), run.hang_record(), run.records(), run.crashes())
        except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError, KeyError, ValueError) as err:
            trial.error = error_text(err)
            trial.evidence = evidence
            subprocess.run(["scancel", trial.job], capture_output=True, timeout=30)
        trial.seconds = round(time.monotonic() - start, 1)

    def _step_time(self, run: RunFiles, trial: HangTrial) -> float:
        """The Unix time the last step before the fault was logged at."""
        return max(float(r["time"]) for r in run.records("train") if float(r["time"]) <= trial.fault_time)

    def _last_step(self, run: RunFiles) -> int:
        return max((r["step"] for r in run.records("train") if not r.get("step_restart")), default=0)

    def _until_detected(self, trial: HangTrial, run: RunFiles, bench: Bench | None = None) -> None:
        """Wait for the monitor's `hang detected:` line, then for the run to end (resubmitted if needed)."""
        ends = ("hang detected:", MISMATCH) if trial.kind == "hang_skip_collective" else ("hang detected:",)
        wait(
            lambda: any(e in run.job_log() for e in ends),
            DETECT_WAIT_S,
            "a `hang detected:` line in the job log",
        )
        (bench or self.bench).finish(trial, run, overrides_of(trial), setup=NO_FAULT, nodes=NODES)

    def stop(self, bench: Bench, trial: HangTrial, run: RunFiles, rng, evidence: list[str]) -> None:
        """SIGSTOP the rank from outside after a random step (the long step's: in the middle of the next)."""
        if trial.kind == LONG_STEP:
            trial.rank, trial.at_step = trial.index % 2, rng.randint(2, 4)
            setup = faults.setup_line(layer_delay_s=LAYER_DELAY_S)  # every job step: the model is slow
        else:
            trial.rank, trial.at_step = (
                int(trial.kind.removeprefix("hang_stop_rank")),
                rng.randint(5, STEPS - 15),
            )
            setup = first_run_setup()
        trial.job = bench.launch(run.name, *overrides_of(trial), setup=setup, nodes=NODES)
        wait(lambda: self._last_step(run) >= trial.at_step, 600, f"step {trial.at_step}")
        if trial.kind == LONG_STEP:
            landed = [t for t, _ in faults.landed_at(run.job_log()) if f"forward on rank {trial.rank}" in t]
            evidence += [f"landed: {t}" for t in landed[:1]]
            steps = sorted(r["time_step_s"] for r in run.records("train"))
            time.sleep(rng.uniform(0.2, 0.8) * steps[len(steps) // 2])  # into the next step's forward
        pid, trial.node, source = locate(run, trial.job, trial.rank)
        trial.fault_time = time.time()
        os.kill(pid, signal.SIGSTOP)
        trial.hit.append(f"SIGSTOP pid {pid} (rank {trial.rank} on {trial.node}, pid from {source})")
        try:
            wait(lambda: proc_state(pid) in ("T", "t"), 5, f"pid {pid} to stop", interval=0.01)
            seen = time.time() - trial.fault_time
            evidence.append(f"pid {pid} (rank {trial.rank}) seen in state T {seen:.2f} s after the SIGSTOP")
            trial.detail = f"SIGSTOP rank {trial.rank} on {trial.node} after step {self._last_step(run)}"
            if trial.kind == LONG_STEP:
                into = time.time() - self._step_time(run, trial)
                trial.detail += f" ({into:.1f} s into the next step){time_limit_note(trial)}"
            self._until_detected(trial, run, bench)
        finally:
            if proc_state(pid) in ("T", "t"):  # nothing ended it: leave no stopped process behind
                for sig in (signal.SIGKILL, signal.SIGCONT):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                trial.hit.append(f"pid {pid} still stopped after the trial: killed by the bench")

    def injected(self, trial: HangTrial, run: RunFiles, rng, evidence: list[str]) -> None:
        """The faults that land from inside the rank (faults/): their landed line gives the time."""
        trial.rank = trial.index % 2
        if trial.kind == "slow_rank":
            trial.at_step = SLOW_FROM_STEP
            fault = {"slow_factor": SLOW_FACTOR, "slow_from_step": SLOW_FROM_STEP}
        else:
            trial.at_step = rng.randint(5, STEPS - 15)
            variable = {"hang_fifo": "fifo_at_step", "hang_loader_stall": "stall_at_step",
                        "hang_skip_collective": "skip_collective_at_step"}[trial.kind]  # fmt: skip
            fault = {variable: trial.at_step}
        setup = first_run_setup(rank=trial.rank, **fault)
        trial.job = self.bench.launch(run.name, *OVERRIDES, setup=setup, nodes=NODES)
        text, trial.fault_time = wait(lambda: fault_landed(run.job_log(), trial.kind, trial.rank), 300,
                                      "the fault's landed line in the job log")  # fmt: skip
        evidence.append(f"landed: {text}")
        trial.detail = text
        try:
            _, trial.node, _ = locate(run, trial.job, trial.rank)
            if trial.kind == "slow_rank":
                self.bench.finish(trial, run, OVERRIDES, setup=NO_FAULT, nodes=NODES)
            else:
                self._until_detected(trial, run)
        finally:
            if trial.kind == "hang_fifo":
                remove_fifo(text)

    def in_phase(self, bench: Bench, trial: HangTrial, run: RunFiles, evidence: list[str]) -> None:
        """The rank SIGSTOPs itself as it publishes the kind's phase (faults/: stop_in_phase), in its
        variant's config; detected, named and restarted in place like a SIGSTOP from outside."""
        trial.rank = trial.index % 2
        label, _, _, job_step = PHASE_KINDS[trial.kind]
        overrides = overrides_of(trial)
        setup = first_run_setup(rank=trial.rank, stop_in_phase=label, stop_in_job_step=job_step)
        trial.job = bench.launch(run.name, *overrides, setup=setup, nodes=NODES)
        if job_step == 1:  # the other rank SIGKILLed after a save: the step restarts in place, and restores
            killed, after = 1 - trial.rank, 3 if trial.variant == "wide" else 5
            wait(lambda: self._last_step(run) >= after, 600, f"step {after}")
            pid, node, source = locate(run, trial.job, killed)
            trial.hit += [
                *kill_pids(trial.job, [pid], killed),
                f"pid {pid} (rank {killed} on {node}) from {source}",
            ]
        text, trial.fault_time = wait(lambda: fault_landed(run.job_log(), trial.kind, trial.rank), 600,
                                      "the fault's landed line in the job log")  # fmt: skip
        pid, trial.node, source = locate(run, trial.job, trial.rank)
        trial.at_step = self._last_step(run)
        state = proc_state(pid)
        evidence.append(f"landed: {text}; pid {pid} (rank {trial.rank}, from {source}) in state {state}")
        trial.detail = f"{text} (after step {trial.at_step}){time_limit_note(trial)}"
        wait(lambda: DETECTED in run.job_log(), DETECT_WAIT_S, "a `hang detected:` line in the job log")
        bench.finish(trial, run, overrides, setup=NO_FAULT, nodes=NODES)

    def clean(self, bench: Bench, trial: HangTrial, run: RunFiles, rng, evidence: list[str]) -> None:
        """A run without a hang beside a CPU-bound process, of the trial's variant (chaos_hangs_clean.py);
        the restart variant SIGKILLs one rank at a random step."""
        overrides = overrides_of(trial)
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a CPU-bound neighbour
        try:
            setup = "; ".join(filter(None, (first_run_setup(), variant_setup(trial.variant, bench.base))))
            trial.job = bench.launch(run.name, *overrides, setup=setup, nodes=NODES)
            if trial.variant == "restart":
                self.kill_one(trial, run, rng, evidence)
            bench.finish(trial, run, overrides, setup=NO_FAULT, nodes=NODES)
            alive = hog.poll() is None
        finally:
            hog.kill()
            hog.wait()
            remove_cold_folder(bench.base, trial.job)
        evals, train = len(run.records("eval")), run.records("train")
        saves = sorted({r["step"] for r in train if r.get("time_checkpoint_s", 0) > 0})
        first = f"{train[0]['time_step_s']:.1f} s" if train else "none"
        trial.detail = (f"{trial.variant}, checkpoint.mode={trial.mode}, {len(train)} steps (the first "
                        f"{first}), {evals} evaluations, saves after steps {saves}"
                        f"{time_limit_note(trial)}")  # fmt: skip
        if trial.variant == "restart":
            trial.detail += f"; SIGKILL rank {trial.rank} on {trial.node} after step {trial.at_step}"
        if alive and evals:
            evidence.append(f"CPU-bound process pid {hog.pid} ran beside the whole run; {evals} evaluations")
        if trial.variant == "long":
            evidence += [f"landed: {t}" for t in faults.landed(run.job_log()) if "forward on rank" in t][:2]

    def kill_one(self, trial: HangTrial, run: RunFiles, rng, evidence: list[str]) -> None:
        """SIGKILL rank index % 2 after a random step, then wait for the step to restart in place."""
        trial.rank, trial.at_step = trial.index % 2, rng.randint(5, DEBUG.steps - 15)
        wait(lambda: self._last_step(run) >= trial.at_step, 240, f"step {trial.at_step}")
        pid, trial.node, source = locate(run, trial.job, trial.rank)
        trial.at_step = self._last_step(run)
        trial.fault_time = time.time()
        trial.hit += [*kill_pids(trial.job, [pid], trial.rank), f"pid {pid} from {source}"]
        entry = wait(lambda: [c for c in run.crashes() if c.get("action") == RESTARTED], 120,
                     "a crashes.jsonl entry with action restart")  # fmt: skip
        evidence.append(f"crashes.jsonl: action {entry[0]['action']} at step {entry[0].get('step', '?')}")


def draw(kinds: list[str], trials: int, start: int = 0) -> list[HangTrial]:
    """`trials` of each kind, kinds interleaved (a slow machine hour spreads over every kind)."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"no hang kind {', '.join(unknown)}; the kinds: all, {', '.join(KINDS)}")
    order = [k for _ in range(trials) for k in kinds]
    return [HangTrial(start + i, kind) for i, kind in enumerate(order)]


def main(args, command: str) -> int:
    """`bench.chaos --hangs`: run the trials, keep their results, write the "hangs" section."""
    kinds = list(KINDS) if args.hangs == "all" else args.hangs.split(",")
    trials = draw(kinds, args.trials)
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    for t in trials:
        t.seed = str(seed)
    print(f"bench.chaos --hangs: seed {seed}, {len(trials)} trials of {', '.join(kinds)}", flush=True)
    base = Path(args.out) / f"hangs-seed{seed}-{int(time.time())}"
    base.mkdir(parents=True, exist_ok=True)
    rng, load = random.Random(seed), [os.getloadavg()]
    bench = Bench(base, start_cluster(lock=not args.no_lock))
    write_clean_config(bench, DEBUG)
    runner = HangTrials(bench, parse_variants(args.clean_variants))
    runner.prepare(trials)  # the reference runs, before any trial holds the cluster lock
    now = datetime.now(UTC)
    keep = f"hangs-seed{seed}-{now:%Y-%m-%d-%H%M}.json"  # in bench/results/, unless --quick

    def save() -> None:
        data = results_data(command.strip(), str(now.date()), seed, machine_info(),
                            load_averages([*load, os.getloadavg()]), trials)  # fmt: skip
        (base / "results.json").write_text(json.dumps(data, indent=1))
        if not args.quick:
            kept.save(keep, data)

    for start in range(0, len(trials), args.chunk):
        with cluster_lock(not args.no_lock):
            for trial in trials[start : start + args.chunk]:
                runner.run(trial, rng)
                print(f"bench.chaos --hangs: {json.dumps(asdict(trial))}", flush=True)
                save()
        if start + args.chunk < len(trials) and not args.no_lock:
            time.sleep(LOCK_GAP_S)  # a user waiting for the lock gets it now, not after every trial
    save()
    print(render_hangs_section([str(base / "results.json")]))
    if not (args.quick or args.no_write):
        write_page({SECTION: render_hangs_section([keep])})
    return 0 if all(t.ok for t in trials) else 1
