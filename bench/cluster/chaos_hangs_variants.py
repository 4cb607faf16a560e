"""What a hang trial of `bench.chaos --hangs` (bench/cluster/chaos_hangs.py) runs: its variant (the config of
chaos_hangs_clean.py it runs), its checkpoint.mode, and the flags its `relaytrain launch` gets."""

from __future__ import annotations

from bench.cluster.chaos_hangs_clean import CLEAN_VARIANTS, clean_variant
from bench.cluster.chaos_hangs_judge import LONG_STEP, PHASE_KINDS, HangTrial

CAP_S = 600  # resilience.hang_timeout_s: far above the monitor's floor, so the monitor acts first
OVERRIDES = ("--checkpoint.snapshot_every=2", f"--resilience.hang_timeout_s={CAP_S}")
# The variants whose trial outlasts a job of the profile's 10 minutes (300 s of training once the run's
# time budget keeps resilience.time_budget_margin_s=300 for its stop): the wide state's restores and the
# long step's 20 s steps, with a restart or two in place (seed 5305's wide trials were requeued at their
# time budget). A 30-minute limit keeps such a trial in one allocation.
LONG_JOB_VARIANTS = ("wide", "long")
LONG_JOB_TIME = "00:30:00"


def assign_variant(trial: HangTrial, variants: tuple[str, ...] = CLEAN_VARIANTS) -> None:
    """The variant and checkpoint.mode a clean, phase or long-step trial runs in; the other kinds run the
    debug config's bench as it is ("" for both)."""
    if trial.kind in PHASE_KINDS:
        trial.variant, trial.mode = PHASE_KINDS[trial.kind][1:3]
    elif trial.kind == LONG_STEP:
        trial.variant, trial.mode = "long", "async"
    elif trial.kind == "clean":
        trial.variant, trial.mode = clean_variant(trial.index, variants)


def overrides_of(trial: HangTrial) -> tuple[str, ...]:
    """A trial's flags: OVERRIDES for the kinds that run the debug bench as it is; a variant trial's: its
    checkpoint.mode; the wide state without in-memory snapshots (its 2 newest steps of 1.2 GB in /dev/shm
    do not fit a local node's memory: `relaytrain launch`'s plan refuses the job), so its restore reads
    the disk checkpoint; LONG_JOB_TIME for LONG_JOB_VARIANTS."""
    if not trial.variant:
        return OVERRIDES
    snapshots = ("--checkpoint.snapshot_every=0",) if trial.variant == "wide" else OVERRIDES[:1]
    limit = (f"--slurm.time={LONG_JOB_TIME}",) if trial.variant in LONG_JOB_VARIANTS else ()
    return (*snapshots, *OVERRIDES[1:], f"--checkpoint.mode={trial.mode}", *limit)


def time_limit_note(trial: HangTrial) -> str:
    """What the trial's detail says of a job time limit other than the profile's ("" for none)."""
    return f"; --slurm.time={LONG_JOB_TIME}" if trial.variant in LONG_JOB_VARIANTS else ""
