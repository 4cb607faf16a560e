"""The chaos benchmark's targeted trials of the peer replica (SpecialTrials runs them; chaos_kinds.py).

Both run on 2 nodes x 1 task (each node with its own /dev/shm) with ``checkpoint.snapshot_every=1`` and
kill rank 1 at a random step at least 2 past the last interval checkpoint; the step restarts in place.

* ``wipe_node_with_snapshots``: rank 1's node also loses its memory (every snapshot of the job on it,
  rank 1's own files and the replicas of rank 0's): the run resumes from the snapshot of the step it
  reached, rank 1's file fetched from its replica on rank 0's node; at most one step replayed.
* ``wipe_both_copies_with_snapshots``: rank 1's files are gone from both nodes (its node's memory and its
  replica on rank 0's node; rank 0's files stay): no snapshot step is complete, the run falls back to
  the interval checkpoint and says so in the log, and replays the steps since it.

Either way the finished run's losses are bit-identical to the uninterrupted reference run's.
"""

from __future__ import annotations

from relaytrain.config import load_config

from bench.cluster.chaos_run import GONE, INTERVAL, STEPS, wait_gone
from bench.cluster.harness import RunFiles, kill_with_node_memory, rank_pids, wait, wipe_snapshots

FROM_PEER = "(1 of 2 rank file(s) from a peer node)"
PARTIAL = "no node holds the file of rank(s) 1"
FELL_BACK = "no snapshot newer than the checkpoints is complete: resuming from the checkpoint"


def kill_step(rng) -> int:
    """A step 2 to 7 past an interval checkpoint (not the first: there is one to fall back to)."""
    return rng.choice([s for s in range(INTERVAL + 2, STEPS - 8) if 2 <= s % INTERVAL <= 7])


class SnapshotTrials:
    """Mixed into SpecialTrials (its `bench`: the chaos_run.Bench)."""

    NODES = 2
    OVERRIDES = ("--checkpoint.snapshot_every=1",)

    def _kill_and_wipe(self, trial, rng, both_copies: bool) -> tuple[RunFiles, int, int, list[str]]:
        """Launch, kill rank 1 after a random step, wipe; (run, step killed after, step resumed, wiped)."""
        bench = self.bench
        run = bench.run_files(f"special-{trial.index}-{trial.kind.replace('_', '-')}")
        trial.job = bench.launch(run.name, *self.OVERRIDES, nodes=self.NODES)
        target = kill_step(rng)

        def last() -> int:
            return max((r["step"] for r in run.records("train") if not r.get("step_restart")), default=0)

        pids = wait(lambda: last() >= target and rank_pids(trial.job, rank=1), 240, f"step {target}")
        snapshot_dir = load_config(bench.config).checkpoint.snapshot_dir
        killed_at = last()
        node, wiped, signalled = kill_with_node_memory(trial.job, pids, snapshot_dir)
        trial.hit += [f"SIGKILL pid {p} (rank 1){': ' + GONE if wait_gone(p) else ''}" for p in signalled]
        survivor = next(n for n in bench.cluster.nodes if n != node)
        if both_copies:
            # rank 0's writer thread may still store a replica it received before the kill: wipe rank 1's
            # files on its node once the step's processes are gone, before the restarted step reads them
            wait(lambda: not rank_pids(trial.job), 120, "the killed step's ranks to exit", interval=0.02)
            wiped += wipe_snapshots(survivor, trial.job, snapshot_dir, rank=1)
        bench.finish(trial, run, self.OVERRIDES, nodes=self.NODES)
        bench.check(trial, run)
        resumes = [r for r in run.records("event") if r.get("event") == "resume"]
        resumed = int(resumes[0]["step"]) if resumes else -1
        trial.checks["restarted in place"] = bool(resumes) and resumes[0].get("step_restart") == 1
        return run, killed_at, resumed, wiped

    def wipe_node_with_snapshots(self, trial, rng) -> None:
        run, killed_at, resumed, wiped = self._kill_and_wipe(trial, rng, both_copies=False)
        trial.detail = (
            f"SIGKILL rank 1 after step {killed_at}, its node's snapshots wiped ({len(wiped)} folder(s)); "
            f"resumed from step {resumed}"
        )
        trial.checks["rank 1's file from the peer node"] = FROM_PEER in run.rank_log(0)
        trial.checks["at most one step replayed (the snapshot)"] = killed_at - 1 <= resumed <= killed_at + 1

    def wipe_both_copies_with_snapshots(self, trial, rng) -> None:
        run, killed_at, resumed, wiped = self._kill_and_wipe(trial, rng, both_copies=True)
        log = run.rank_log(0)
        trial.detail = (
            f"SIGKILL rank 1 after step {killed_at}, its files wiped on both nodes ({len(wiped)} path(s)); "
            f"resumed from step {resumed}"
        )
        fell_back = PARTIAL in log and FELL_BACK in log
        trial.checks["no complete snapshot: fell back to the checkpoint, logged"] = fell_back
        checkpoint = killed_at // INTERVAL * INTERVAL
        trial.checks["resumed from the last interval checkpoint"] = resumed == checkpoint
