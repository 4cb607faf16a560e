"""`resilience.preflight = "exclude"` in a Slurm job: the nodes the checks before the first step named are
left out before training. Every rank judges the same gathered results (judge.py is pure), so they agree
without another collective; rank 0 records the nodes in run_state.json (status stopped, reason
``preflight``), every rank waits for it and the step ends with EXIT_PREFLIGHT. The batch job's driver
then decides (relaytrain.resilience.batch.preflight_exclude): a spare in the node's place or fewer nodes, else
a requeue whose next allocation excludes it, else the job's end with a clear message.

When every node is named, no node is worse than the others (a shared cause: the checkpoint folder is
full, the run needs more memory than any node has): nothing is left out, the lines say so and the run
goes on as with ``report``.
"""

from __future__ import annotations

from relaytrain.job import JobFacts, RunDir
from relaytrain.resilience.batch.preflight_exclude import PREFLIGHT
from relaytrain.resilience.codes import EXIT_PREFLIGHT
from relaytrain.resilience.run_state import RunState, RunStateFile, RunStatus, recorded_step


def named_nodes(problems: dict[str, list[str]]) -> list[str]:
    """The nodes to leave out: those below threshold, unless every node is (then none)."""
    named = [node for node, found in problems.items() if found]
    return named if len(named) < len(problems) else []


def stop_for(problems: dict[str, list[str]], lines: list[str], results: str, env, run: RunDir | None) -> int:
    """Every rank: 0 when nothing is to be left out (train on), else EXIT_PREFLIGHT once rank 0 recorded
    the nodes (``results``: the preflight JSON file, for the record)."""
    nodes = named_nodes(problems)
    if not nodes:
        if env.is_main and lines:
            print("preflight: every node is below threshold: none left out, the run goes on", flush=True)
        return 0
    if env.is_main and run is not None:
        job = JobFacts.from_env()
        verdict = {"nodes": nodes, "lines": lines, "results": results}
        message = f"preflight named {','.join(nodes)} below threshold: left out before the first step"
        record = RunState.of(
            RunStatus.STOPPED,
            PREFLIGHT,
            recorded_step(run) or 0,
            message=message,
            **job.identity(),
            saved=False,
            preflight=verdict,
        )
        RunStateFile(run).write(record)
        print(f"preflight: leaving out {','.join(nodes)}: the job step stops before training", flush=True)
    if env.distributed:
        import torch.distributed as dist

        dist.barrier()  # the record is written before any rank exits (srun ends the others then)
    return EXIT_PREFLIGHT
