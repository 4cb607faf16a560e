"""The goodput section's 7B-class extrapolation: goodput(T) from the cost of one interruption, with the
formula printed on the page and a sensitivity grid over its assumed inputs."""

from __future__ import annotations

from dataclasses import dataclass, replace

from bench.report import pct, table

BYTES_PER_PARAM = 12.0  # relaytrain plan's checkpoint estimate: fp32 weights + Adam's two moments


@dataclass
class Extrapolation:
    params: float = 7e9
    write_gbps: float = 2.0  # slurm.fs_write_gbps's default (aggregate GB/s); read assumed the same
    startup_s: float = 60.0  # import torch + NCCL init on a few hundred ranks (assumed; local: tiny)
    exit_s: float = 5.0  # measured locally (signal -> exit, less the save): process teardown
    step_s: float = 10.0  # a 7B step on a few nodes (assumed)
    lost_steps: float = 1.0  # measured: at most the step in flight when the signal came
    async_block_s: float = 1.0  # async periodic saves: blocking part per save (bench checkpoint-io)
    ckpt_every_s: float = 1800.0

    @property
    def save_s(self) -> float:
        return self.params * BYTES_PER_PARAM / (self.write_gbps * 1e9)

    @property
    def load_s(self) -> float:
        return self.save_s  # read bandwidth assumed equal to write

    def cost_s(self) -> float:
        """Allocated seconds lost to one interruption (queue time is not allocated)."""
        return self.save_s + self.exit_s + self.startup_s + self.load_s + self.lost_steps * self.step_s

    def goodput(self, interval_s: float) -> float:
        return max(0.0, 1.0 - self.cost_s() / interval_s - self.async_block_s / self.ckpt_every_s)


TARGET, TARGET_INTERVAL_S = 0.98, 1800.0
EXTRAPOLATION_HEADING = "### 7B-class extrapolation"  # the goodput section's measured part ends here
EXTRAPOLATION_COMMAND = "python -m bench.goodput --extrapolation"
SENSITIVITY_WRITE_GBPS = (2.0, 10.0, 50.0)
SENSITIVITY_COLUMNS = ((60.0, 1.0), (20.0, 1.0), (20.0, 0.0))  # (start-up s, lost steps)


def cost_budget_s(x: Extrapolation, interval_s: float = TARGET_INTERVAL_S, target: float = TARGET) -> float:
    """The largest cost per interruption that still gives `target` goodput at `interval_s`."""
    return (1.0 - target - x.async_block_s / x.ckpt_every_s) * interval_s


def sensitivity(x: Extrapolation) -> dict[tuple[float, float, float], Extrapolation]:
    """`x` with each (write GB/s, start-up s, lost steps) of the grid."""
    return {
        (gbps, startup, lost): replace(x, write_gbps=gbps, startup_s=startup, lost_steps=lost)
        for gbps in SENSITIVITY_WRITE_GBPS
        for startup, lost in SENSITIVITY_COLUMNS
    }


def render_sensitivity(x: Extrapolation) -> str:
    grid = sensitivity(x)
    header = ["write GB/s (save = load)"] + [
        f"start-up {startup:g} s, {lost:g} lost step{'s' * (lost != 1)}"
        for startup, lost in SENSITIVITY_COLUMNS
    ]
    rows = [
        [f"{gbps:g} ({grid[gbps, *SENSITIVITY_COLUMNS[0]].save_s:.1f} s)"]
        + [f"{pct(grid[gbps, s, n].goodput(TARGET_INTERVAL_S))} ({grid[gbps, s, n].cost_s():.0f} s)"
           for s, n in SENSITIVITY_COLUMNS]
        for gbps in SENSITIVITY_WRITE_GBPS
    ]  # fmt: skip
    meeting = [
        f"{gbps:g} GB/s, start-up {s:g} s, {n:g} lost steps"
        for (gbps, s, n), v in grid.items()
        if v.goodput(TARGET_INTERVAL_S) >= TARGET
    ]
    budget = cost_budget_s(x)
    verdict = (
        f"**The {pct(TARGET, 0)} target at a 30-minute interval is not met with the default inputs:** "
        f"{pct(TARGET, 0)} needs the cost of one interruption under {budget:.0f} s ({pct(1 - TARGET, 0)} of "
        f"1800 s less the async blocking); the default inputs cost {x.cost_s():.0f} s, of which the two "
        f"checkpoint transfers are {2 * x.save_s:.0f} s and the start-up {x.startup_s:g} s."
        if x.goodput(TARGET_INTERVAL_S) < TARGET
        else f"The {pct(TARGET, 0)} target at a 30-minute interval is met with the default inputs."
    )
    reach = (
        f" In the grid only {'; '.join(meeting)} reach{'es' * (len(meeting) == 1)} it: the transfers must "
        "come down to a few seconds (an emergency save that only flushes an async checkpoint already in "
        "flight, or a node-local/in-memory tier; a load from a peer or local copy), the start-up to about "
        "20 s, and the step in flight must not be lost."
        if meeting
        else " No cell of the grid reaches it."
    )
    return (
        f"\nSensitivity: goodput at a preemption every 30 minutes (cost per interruption in brackets), "
        f"other inputs as above.\n\n{table(header, rows)}\n{verdict}{reach} These are inputs of the "
        "formula, not measurements at scale.\n"
    )


def render_extrapolation(x: Extrapolation) -> str:
    rows = [(label, pct(x.goodput(t))) for label, t in (("every 30 min", 1800), ("every 4 h", 14400))]
    return (
        f"\n{EXTRAPOLATION_HEADING}\n\n"
        "goodput(T) = 1 − (save + exit + start-up + load + lost_steps × step) / T "
        "− async_block / ckpt_every, "
        "with save = load = params × 12 B / write bandwidth (relaytrain plan's checkpoint estimate: fp32 "
        "weights and Adam's two moments; read assumed as fast as write). Queue time is not allocated time, "
        "so it is not in the formula (it costs wall-clock time, not allocation). Inputs: "
        f"params {x.params:.0e}, write {x.write_gbps:g} GB/s (`slurm.fs_write_gbps` default) → save "
        f"{x.save_s:.0f} s, load {x.save_s:.0f} s; exit {x.exit_s:g} s (local: the processes are gone "
        f"within the 5 s GraceTime); start-up {x.startup_s:g} s (assumed: imports and NCCL init at scale, "
        f"not measurable here); step {x.step_s:g} s (assumed); lost steps {x.lost_steps:g} (an upper "
        "bound: the step in flight; 0 were lost here); "
        f"async blocking {x.async_block_s:g} s per periodic save every {x.ckpt_every_s:g} s. Cost per "
        f"interruption: {x.cost_s():.0f} s.\n\n" + table(["preemption", "goodput"], rows)
        + render_sensitivity(x) + render_crash_extrapolation(CrashExtrapolation(x))
    )  # fmt: skip


# -- crashes: the in-memory snapshot tier against DCP only ---------------------------------------------

# Measured on this project's machine (2 cores, CPU; docs/benchmarks.md, "In-memory snapshots",
# `python bench/snapshot.py`, 2026-11-24): a 1.19 GB state per rank on 2 nodes of the local cluster.
MEASURED_STATE_GB = 1.19
MEASURED_RESTORE_LOCAL_S = 0.987  # restore from the node's memory (read, verify, copy into the model)
MEASURED_RESTORE_PEER_S = 1.462  # the same with rank 1's file fetched from the peer node over gloo
MEASURED_BLOCKING_GBPS = 1.20 / 0.129  # the blocking copy into the reused host buffer
MEASURED_REPLICATE_GBPS = 0.264  # per direction, both ranks sending at once (gloo, TCP between nodes)
MEASURED_SHM_WRITE_GBPS = 2 * 1.19 / 4.338  # a rank writing its own file and the replica it received
MEASURED_DETECTION_S = 2.2  # a kill to the end-of-step decision ("Crashes: restart in place", 2.06-2.54 s)
CRASH_INTERVALS = (
    ("every 1 h", 3600.0),
    ("every 3 h (Llama 3's rate on 16k GPUs: 419 in 54 days)", 3 * 3600.0),
    ("every 12 h", 43200.0),
)


@dataclass
class CrashExtrapolation:
    """One crash, restarted in place: with DCP only, or with an in-memory snapshot every few steps."""

    base: Extrapolation  # params, write bandwidth (DCP load), start-up, step, periodic checkpoints
    ranks: int = 64  # assumed: 8 nodes x 8 GPUs, each holding 1/64 of the state
    snapshot_every: int = 1
    detection_s: float = MEASURED_DETECTION_S
    restore_local_gbps: float = MEASURED_STATE_GB / MEASURED_RESTORE_LOCAL_S
    restore_peer_gbps: float = MEASURED_STATE_GB / MEASURED_RESTORE_PEER_S
    blocking_gbps: float = MEASURED_BLOCKING_GBPS
    replicate_gbps: float = MEASURED_REPLICATE_GBPS
    shm_write_gbps: float = MEASURED_SHM_WRITE_GBPS

    @property
    def state_gb(self) -> float:
        return self.base.params * BYTES_PER_PARAM / self.ranks / 1e9

    def dcp_cost_s(self) -> float:
        """detection + start-up + DCP load + half an interval of replay."""
        b = self.base
        return self.detection_s + b.startup_s + b.load_s + b.ckpt_every_s / 2

    def restore_s(self, peer: bool) -> float:
        return self.state_gb / (self.restore_peer_gbps if peer else self.restore_local_gbps)

    def snapshot_cost_s(self, peer: bool) -> float:
        """detection + start-up + restore from memory + up to snapshot_every steps replayed."""
        replay = self.snapshot_every * self.base.step_s
        return self.detection_s + self.base.startup_s + self.restore_s(peer) + replay

    def background_s(self) -> float:
        """Replication to the peer and the two writes to /dev/shm, after the blocking copy."""
        return self.state_gb / self.replicate_gbps + 2 * self.state_gb / self.shm_write_gbps

    def snapshot_overhead(self) -> float:
        """Share of training time the snapshots take: the blocking copy, and any wait for the previous
        snapshot's background work that outlasts snapshot_every steps."""
        interval = self.snapshot_every * self.base.step_s
        wait = max(0.0, self.background_s() - interval)
        return (self.state_gb / self.blocking_gbps + wait) / interval

    def goodput(self, mtbf_s: float, snapshots: bool, peer: bool = False) -> float:
        b = self.base
        periodic = b.async_block_s / b.ckpt_every_s
        if not snapshots:
            return max(0.0, 1.0 - self.dcp_cost_s() / mtbf_s - periodic)
        cost = self.snapshot_cost_s(peer)
        return max(0.0, 1.0 - cost / mtbf_s - periodic - self.snapshot_overhead())


def render_crash_extrapolation(c: CrashExtrapolation) -> str:
    b = c.base
    rows = [
        (label, f"{pct(c.goodput(t, False))} ({c.dcp_cost_s():.0f} s)",
         f"{pct(c.goodput(t, True))} ({c.snapshot_cost_s(False):.0f} s)",
         f"{pct(c.goodput(t, True, peer=True))} ({c.snapshot_cost_s(True):.0f} s)")
        for label, t in CRASH_INTERVALS
    ]  # fmt: skip
    formula = (
        "A crash (a rank or a node lost) restarts the job step in place. With DCP only it costs detection + "
        "start-up + DCP load + replay of half a checkpoint interval (on average); with a snapshot every "
        "`snapshot_every` steps, detection + start-up + restore from memory (the node's own, or the peer's "
        "replica when the node lost its memory) + at most `snapshot_every` steps replayed (an upper bound). "
        "goodput(MTBF) = 1 − cost / MTBF − async_block / ckpt_every, less, with snapshots, their share of "
        "the step: (blocking copy + any wait for the previous snapshot's replication and writes beyond "
        "`snapshot_every` steps) / (`snapshot_every` × step)."
    )
    measured = (
        "Inputs **measured** here (`python bench/snapshot.py`, the in-memory snapshots section: 2 nodes of "
        f"the local cluster, CPU, {MEASURED_STATE_GB} GB of state per rank): restore from local memory "
        f"{c.restore_local_gbps:.2f} GB/s per rank ({MEASURED_RESTORE_LOCAL_S} s), from the peer node "
        f"{c.restore_peer_gbps:.2f} GB/s ({MEASURED_RESTORE_PEER_S} s), blocking copy "
        f"{c.blocking_gbps:.1f} GB/s, replication {c.replicate_gbps * 1000:.0f} MB/s per direction, writes "
        f"to /dev/shm {c.shm_write_gbps:.2f} GB/s; detection {c.detection_s:g} s (the crash runs, "
        'section "Crashes: restart in place against requeue").'
    )
    assumed = (
        f"**Assumed**: {b.params:.0e} parameters on {c.ranks} ranks → {c.state_gb:.2f} GB of state per rank "
        f"(12 B per parameter); start-up {b.startup_s:g} s; step {b.step_s:g} s; DCP load {b.load_s:.0f} s "
        f"({b.write_gbps:g} GB/s); a DCP checkpoint every {b.ckpt_every_s:g} s; `snapshot_every` = "
        f"{c.snapshot_every}. Then a snapshot restores in {c.restore_s(False):.1f} s (local) or "
        f"{c.restore_s(True):.1f} s (peer), blocks {c.state_gb / c.blocking_gbps:.2f} s a step, and its "
        f"background work takes {c.background_s():.1f} s of each {c.snapshot_every * b.step_s:g} s "
        f"interval: overhead {pct(c.snapshot_overhead())}."
    )
    header = ["crash (MTBF of the job)", "DCP only (cost per crash)", "snapshots, local memory",
              "snapshots, from the peer"]  # fmt: skip
    return (
        f"\n### Crashes at 7B scale: in-memory snapshots against DCP only\n\n{formula}\n\n{measured} "
        f"{assumed}\n\n{table(header, rows)}\nThe restore figures are host-memory and TCP rates of a "
        "2-core CPU machine; a GPU node's memory bandwidth and network (tens of GB/s) make them faster, so "
        "the snapshot columns are a lower bound on goodput. With snapshots the crash cost is dominated by "
        "the assumed start-up, not by the restore. The extrapolation is rewritten by "
        f"`{EXTRAPOLATION_COMMAND}` when its inputs change (the runs above stay as measured).\n"
    )
