"""The chaos benchmark's straggler trial (SpecialTrials runs it; chaos_kinds.py).

``straggler_replace``: a ``--nodes 2`` job with one spare node (``slurm.spare_nodes=1``, 1 rank on each
training node) of the straggler check's model (bench/cluster/stragglers.py QUICK_TRIAL_MODEL: its
forward and optimizer phases are above the detector's floor, `MIN_HOST_PHASE_S`; the tiny model's are
not, and a run of it, seed 71, named no one in 100 throttled steps), with the straggler trials' job
limit (`TRIAL_TIME`: at 2 s a step on a loaded machine the profile's 10 min stopped a run for its time
budget, seed 73, and the resume is a requeue),
``resilience.straggler_action=replace`` and snapshots every `SNAPSHOT_EVERY` steps. Once it logged
`spares_straggler.THROTTLE_AT` steps, rank 1 is throttled `spares_straggler.FACTOR` times from outside
the job (``python -m faults.throttle``, a CPU quota; its landed line, read back from the cgroup, is the
first evidence). The trainer must name rank 1 on its node, every rank stop after a snapshot (exit 89),
and the batch job's driver restart the step in place with the spare in that node's place, in the same
job (no requeue); the finished run's losses bit-identical to an uninterrupted run of the same config,
`relaytrain verify RUN` exit 0 and the time ledger within 1 % of sacct's elapsed time, as every chaos
trial.
"""

from __future__ import annotations

from pathlib import Path

from bench import spares_straggler
from bench.cluster.stragglers import QUICK_TRIAL_MODEL, TRIAL_TIME, straggler_config

STEPS = 120  # named about 35 steps after the throttle at step 20 (bench.spares): room to finish after
SNAPSHOT_EVERY = 10
OVERRIDES = (
    f"--checkpoint.snapshot_every={SNAPSHOT_EVERY}",
    "--resilience.straggler_action=replace",
    "--slurm.spare_nodes=1",
)
NODES = 2
NO_SETUP = "true"  # a setup line that changes nothing


def straggler_checks(figures: dict, restarts: int, resubmits: int) -> dict[str, bool]:
    """The trial's own checks, from spares_straggler.analyse's figures of the run's records."""
    return {
        "the throttled rank named, with its node": figures["named_right"] is True,
        "stopped for the straggler after a snapshot": figures["stop_reason"] == "straggler",
        "the spare in the named node's place, world size kept": (
            bool(figures["spare"]) and figures["world_sizes"] == [2] and not figures["resized"]
        ),
        "in the same job (no requeue, no resubmission)": restarts == 0 and resubmits == 0,
    }


class StragglerTrials:
    """Mixed into SpecialTrials (its `bench`: the chaos_run.Bench)."""

    def _straggler_reference(self) -> tuple[Path, tuple[dict, dict]]:
        """The trial's config and its uninterrupted run's losses (run once per benchmark)."""
        bench = self.bench
        if getattr(self, "_straggler", None) is None:
            config = bench.base / "straggler.toml"
            text = straggler_config("straggler-reference", bench.runs, STEPS, QUICK_TRIAL_MODEL, TRIAL_TIME)
            config.write_text(text)
            self._straggler = (config, bench.run_reference(config))
        return self._straggler

    def straggler_replace(self, trial, rng) -> None:
        import faults.throttle as throttle

        bench = self.bench
        config, reference = self._straggler_reference()
        run = bench.run_files(f"special-{trial.index}-straggler-replace")
        trial.job = bench.launch(run.name, *OVERRIDES, setup=NO_SETUP, nodes=NODES, config=config)

        def last() -> int:
            return max((r["step"] for r in run.records("train")), default=0)

        pid = None
        try:
            pid, throttled = spares_straggler.throttle_rank_1(trial.job, last)
            trial.hit.append(
                f"throttle landed: rank {throttled['rank']} on {throttled['node']} ×{throttled['factor']:g} "
                f"(quota {throttled['quota_us']}/{throttled['period_us']} µs) after step {throttled['step']}"
            )
            bench.finish(trial, run, OVERRIDES, setup=NO_SETUP, nodes=NODES, config=config)
        finally:
            if pid is not None:
                throttle.release(pid)
        bench.check(trial, run, reference)
        records = run.records()
        train, events = ([r for r in records if r["kind"] == kind] for kind in ("train", "event"))
        figures = spares_straggler.analyse(train, events, throttled, SNAPSHOT_EVERY)
        slowed, healthy = figures["step_s"]["slowed"], figures["step_s"]["healthy"]
        trial.evidence.insert(0, trial.hit[0] + f"; step time {healthy} → {slowed} s")
        slower = figures["named_slower"]  # as the straggler line says it: 0.25 is "25% slower"
        how = f"{slower:.0%} slower in {figures['named_phase']}" if slower is not None else "not named"
        trial.detail = (
            f"rank 1 on {throttled['node']} throttled ×{throttled['factor']:g} after step "
            f"{throttled['step']}; named {figures['named_rank']} on {figures['named_node']} at step "
            f"{figures['named_at_step']} ({how}); stopped at "
            f"step {figures['stopped_at_step']} ({figures['stop_reason']}); spare {figures['spare']} in its "
            f"place, resumed at step {figures['resumed_at_step']} from {figures['resumed_from']}"
        )
        trial.checks.update(straggler_checks(figures, trial.restarts, trial.resubmits))
