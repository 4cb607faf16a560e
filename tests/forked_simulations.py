"""Simulated ranks forked from one interpreter that imported torch once (the suite's CPU is start-up).

`relaytrain plan --simulate` runs each simulated rank in a fresh interpreter (`simulate._run_child`: the
fake process group is one per process), and an interpreter's start-up (torch, dynamo, DTensor) costs more
CPU than the small layouts' simulations themselves. The tests that call the simulation in-process get
their children from a forkserver instead: one process per worker imports what a simulated rank imports,
then forks a child per rank, as fresh as an interpreter that has just imported them (the server itself
runs no torch op, so no thread pool is copied). The child runs the product's own entry,
`simulate._simulate_in_child`, and hands its result back through a file as `_run_child` does. The
fresh-interpreter path itself stays covered by the tests that simulate through `relaytrain plan`.
"""

from __future__ import annotations

import multiprocessing
import pickle
import tempfile
from pathlib import Path

from relaytrain.parallel import simulate as sim

# What `simulate_rank` imports on its way to the step, loaded once in the server.
PRELOAD = [
    "torch",
    "torch.distributed",
    "relaytrain.parallel.simulate",
    "relaytrain.optim",
    "relaytrain.parallel.parallel_model",
    "relaytrain.parallel.sim_comm",
    "relaytrain.parallel.sim_memory",
    "relaytrain.parallel.sim_pipeline",
    "relaytrain.torch_private",
]


def _child(arguments: tuple, result: str) -> None:
    """In the forked child: what `python -m relaytrain.parallel.simulate RESULT` does."""
    Path(result).write_bytes(pickle.dumps(sim._simulate_in_child(*arguments)))


def context() -> multiprocessing.context.ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_child(arguments: tuple) -> sim.RankSimulation | str:
    """`simulate._run_child`'s contract (a RankSimulation, or the failure as text) from a forked child."""
    with tempfile.TemporaryDirectory(prefix="relaytrain-sim-") as tmp:
        result = Path(tmp) / "result.pickle"
        child = context().Process(target=_child, args=(arguments, str(result)))
        child.start()
        child.join()
        if child.exitcode != 0 or not result.is_file():
            return f"the simulating process exited {child.exitcode}"
        # Our own child wrote it a moment ago, in our own temporary directory.
        out = pickle.loads(result.read_bytes())  # noqa: S301
        return out if isinstance(out, str) else sim.RankSimulation(**out)
