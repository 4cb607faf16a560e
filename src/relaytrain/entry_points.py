"""Every ``python -m relaytrain.X`` entry point: the one table of relaytrain's processes.

A module that starts another of relaytrain's processes names it through a constant here, never with a
string of its own (tested), so that ``tests/test_architecture.py`` can check each process edge (who
starts whom) as an arrow under the layer rule, and docs/architecture.md's launch drawing shows exactly
the processes of a Slurm job (``in_job``). A leaf: it imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

CLI = "relaytrain.cli"  # the `relaytrain` command
TASK = "relaytrain.job.task"
TORCHRUN = "relaytrain.job.torchrun"
PORTS = "relaytrain.job.ports"
NETDETECT = "relaytrain.job.netdetect"
BATCH_DRIVER = "relaytrain.resilience.batch.driver"
STEP_END = "relaytrain.resilience.batch.step_end"
HANG_WATCH = "relaytrain.resilience.hangs.watch"
GPU_MONITOR = "relaytrain.monitor.gpu_monitor"
SNAPSHOT = "relaytrain.checkpoint.snapshot"
SIMULATE = "relaytrain.parallel.simulate"
SIM_RESHARD = "relaytrain.parallel.sim_reshard"
PROGRAM = "relaytrain.program"
CONFIG_DOCS = "relaytrain.config.docs"
BUILD_CORPUS = "relaytrain.data.corpus.build_corpus"
# Earlier names that batch scripts rendered by earlier versions still run (a requeued job runs its
# script again): each hands over to the module it names, until 0.3.0.
OLD_BATCH_DRIVER = "relaytrain.resilience.job_driver"
OLD_STEP_END = "relaytrain.resilience.step_end"


@dataclass(frozen=True)
class EntryPoint:
    module: str  # python -m MODULE
    what: str  # the process it runs
    # relaytrain's modules that start it by this name (a template: the module that renders it); none: a
    # person, a test or an earlier version's batch script starts it
    started_by: tuple[str, ...] = ()
    in_job: bool = False  # one of a Slurm training job's processes (the launch drawing)
    replaced_by: str | None = None  # an earlier name: the entry point it hands over to


ENTRY_POINTS: tuple[EntryPoint, ...] = (
    EntryPoint(
        CLI,
        "the relaytrain command; in a job step, `relaytrain.cli train` is each rank",
        ("relaytrain.slurm.script", "relaytrain.preflight.commands"),
        in_job=True,
    ),
    EntryPoint(TASK, "the per-task wrapper of a job step", ("relaytrain.slurm.script",), in_job=True),
    EntryPoint(TORCHRUN, "torchrun for a one-node job step", ("relaytrain.slurm.script",), in_job=True),
    EntryPoint(
        PORTS, "MASTER_PORT on the first node of an attached job", ("relaytrain.slurm.script",), in_job=True
    ),
    EntryPoint(NETDETECT, "print the network interface NCCL/Gloo would use"),
    EntryPoint(BATCH_DRIVER, "the batch job's driver", ("relaytrain.slurm.script",), in_job=True),
    EntryPoint(STEP_END, "the end-of-step decision, run by hand after a job step"),
    EntryPoint(HANG_WATCH, "the node's hang watcher", ("relaytrain.job.task",), in_job=True),
    EntryPoint(GPU_MONITOR, "the node's GPU sampler", ("relaytrain.job.task",), in_job=True),
    EntryPoint(
        SNAPSHOT,
        "free a job's in-memory snapshots on a node",
        ("relaytrain.resilience.batch.driver",),
        in_job=True,
    ),
    EntryPoint(SIMULATE, "one fake-tensor step of `plan --simulate`", ("relaytrain.parallel.simulate",)),
    EntryPoint(
        SIM_RESHARD, "a reshard's layout chunks for `plan --simulate`", ("relaytrain.parallel.sim_reshard",)
    ),
    EntryPoint(PROGRAM, "`after-step`: the end-of-step decision for batch scripts of earlier versions"),
    EntryPoint(CONFIG_DOCS, "print the config reference page"),
    EntryPoint(BUILD_CORPUS, "build the bundled text corpus"),
    EntryPoint(OLD_BATCH_DRIVER, "the batch job's driver, earlier name", replaced_by=BATCH_DRIVER),
    EntryPoint(OLD_STEP_END, "the end-of-step decision, earlier name", replaced_by=STEP_END),
)
