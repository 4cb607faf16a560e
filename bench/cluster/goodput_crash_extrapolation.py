"""The goodput section's crash part: one crash at 7B scale, restarted in place, with DCP only or with an
in-memory snapshot every few steps. Every measured input is read from the kept results of the run it
comes from (bench/results/, bench/kept.py): the two two-node runs of `python bench/snapshot.py` (both
shown, side by side) and the crash run of `python -m bench.goodput --crashes` (detection). Every other
input is labelled assumed on the page; a sensitivity grid varies replication bandwidth, step time and
snapshot interval."""

from __future__ import annotations

from dataclasses import dataclass, replace

from bench import kept
from bench.cluster.goodput_crash import mean_detection
from bench.cluster.goodput_extrapolation import (
    BYTES_PER_PARAM,
    EXTRAPOLATION_COMMAND,
    Extrapolation,
    render_preemption_extrapolation,
)
from bench.report import pct, table

# The kept runs the crash part cites (bench/results/): the two two-node snapshot runs, in run order, and
# the crash run whose detection it uses.
SNAPSHOT_RUNS = ("snapshot-2026-11-24-0725.json", "snapshot-2026-11-24-0739.json")
CRASH_RUN = "goodput-crash-2026-11-24.json"
CRASH_INTERVALS = (
    ("every 1 h", 3600.0),
    ("every 3 h (Llama 3's rate on 16k GPUs: 419 in 54 days)", 3 * 3600.0),
    ("every 12 h", 43200.0),
)
SENSITIVITY_MTBF_S = 3 * 3600.0
SENSITIVITY_REPLICATE_MB_S = (1000.0, 10000.0)  # beside the measured runs' own figures
SENSITIVITY_STEP_S = (5.0, 10.0, 30.0)
SENSITIVITY_EVERY = (1, 4)


@dataclass(frozen=True)
class SnapshotRun:
    """The measured inputs of one kept two-node snapshot run (rates per rank)."""

    name: str  # the kept file
    when: str  # its date and time, how the page tells the runs apart
    state_gb: float
    restore_local_s: float
    restore_peer_s: float
    replicate_gbps: float
    shm_write_gbps: float
    blocking_gbps: float
    blocking_from: str  # the kept file of the one-process blocking copy (this run's, when it has one)


def snapshot_run(name: str, fallback: str = SNAPSHOT_RUNS[0]) -> SnapshotRun:
    """A kept snapshot run's inputs; the blocking copy's rate from its one-process part, or from
    `fallback`'s when the run recorded none."""
    data = kept.load(name)
    fig = lambda key, d=data, n=name: kept.figure(d, key, n)  # noqa: E731
    own = "state_blocking_s" in data.get("figures", {})
    source = name if own else fallback
    blocking = data if own else kept.load(fallback)
    state_gb = fig("nodes_state_gb")
    return SnapshotRun(
        name=kept.relative(name),
        when=str(data.get("date", "?")),
        state_gb=state_gb,
        restore_local_s=fig("restore_local_s"),
        restore_peer_s=fig("restore_peer_s"),
        replicate_gbps=fig("replicate_mb_s") / 1000,
        shm_write_gbps=2 * state_gb / fig("shm_write_s"),  # a rank writes its own file and the replica
        blocking_gbps=kept.figure(blocking, "state_gb", source)
        / kept.figure(blocking, "state_blocking_s", source),
        blocking_from=kept.relative(source),
    )


def measured_detection(name: str = CRASH_RUN) -> tuple[float, int]:
    """The kill -> end-of-step decision over every crash of the kept crash run; (seconds, crashes)."""
    runs = kept.load(name)["runs"]
    return mean_detection(runs), sum(r["crashes"] for r in runs)


@dataclass
class CrashExtrapolation:
    """One crash, restarted in place: with DCP only, or with an in-memory snapshot every few steps."""

    base: Extrapolation  # params, write bandwidth (DCP load), start-up, step, periodic checkpoints
    ranks: int = 64  # assumed: 8 nodes x 8 GPUs, each holding 1/64 of the state
    snapshot_every: int = 1
    detection_s: float = float("nan")
    restore_local_gbps: float = float("nan")
    restore_peer_gbps: float = float("nan")
    blocking_gbps: float = float("nan")
    replicate_gbps: float = float("nan")
    shm_write_gbps: float = float("nan")

    @classmethod
    def measured(cls, base: Extrapolation, run: SnapshotRun, detection_s: float) -> CrashExtrapolation:
        return cls(base, detection_s=detection_s, restore_local_gbps=run.state_gb / run.restore_local_s,
                   restore_peer_gbps=run.state_gb / run.restore_peer_s, blocking_gbps=run.blocking_gbps,
                   replicate_gbps=run.replicate_gbps, shm_write_gbps=run.shm_write_gbps)  # fmt: skip

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


FORMULA = (
    "A crash (a rank or a node lost) restarts the job step in place. With DCP only it costs detection + "
    "start-up + DCP load + replay of half a checkpoint interval (on average); with a snapshot every "
    "`snapshot_every` steps, detection + start-up + restore from memory (the node's own, or the peer's "
    "replica when the node lost its memory) + at most `snapshot_every` steps replayed (an upper bound). "
    "goodput(MTBF) = 1 − cost / MTBF − async_block / ckpt_every, less, with snapshots, their share of "
    "the step: (blocking copy + any wait for the previous snapshot's replication and writes beyond "
    "`snapshot_every` steps) / (`snapshot_every` × step)."
)


def measured_line(runs: list[SnapshotRun], models: list[CrashExtrapolation], crashes: int) -> str:
    parts = []
    for r, c in zip(runs, models, strict=True):
        borrowed = "" if r.blocking_from == r.name else f" (this run recorded none: `{r.blocking_from}`'s)"
        parts.append(
            f"run {r.when} (`{r.name}`, {r.state_gb} GB of state per rank): restore from local memory "
            f"{c.restore_local_gbps:.2f} GB/s per rank ({r.restore_local_s} s), from the peer node "
            f"{c.restore_peer_gbps:.2f} GB/s ({r.restore_peer_s} s), replication "
            f"{r.replicate_gbps * 1000:.0f} MB/s per direction, writes to /dev/shm {c.shm_write_gbps:.2f} "
            f"GB/s, blocking copy {c.blocking_gbps:.1f} GB/s{borrowed}"
        )
    return (
        "Inputs **measured** here, each read from the kept results of the run that measured it (2 nodes of "
        "the local cluster, CPU, `python bench/snapshot.py`, two runs of the same command): "
        + "; ".join(parts)
        + f"; detection {models[0].detection_s:.2f} s (the mean over the {crashes} crashes of "
        f'`{kept.relative(CRASH_RUN)}`, section "Crashes: restart in place against requeue").'
        + "".join(f" {said}" for said in (kept.transcription(p) for p in sources(runs)) if said)
    )


def sources(runs: list[SnapshotRun]) -> list[str]:
    """The kept files the measured inputs are read from, each once, in the order the line names them."""
    names = [name for r in runs for name in (r.name, r.blocking_from)] + [kept.relative(CRASH_RUN)]
    return list(dict.fromkeys(names))


def assumed_line(c: CrashExtrapolation, runs: list[SnapshotRun], models: list[CrashExtrapolation]) -> str:
    b = c.base
    each = "; ".join(
        f"with run {r.when}'s figures a snapshot restores in {m.restore_s(False):.1f} s (local) or "
        f"{m.restore_s(True):.1f} s (peer), blocks {m.state_gb / m.blocking_gbps:.2f} s a step, and its "
        f"background work takes {m.background_s():.1f} s of each {m.snapshot_every * b.step_s:g} s "
        f"interval: overhead {pct(m.snapshot_overhead())}"
        for r, m in zip(runs, models, strict=True)
    )
    return (
        f"**Assumed**: {b.params:.0e} parameters on {c.ranks} ranks → {c.state_gb:.2f} GB of state per rank "
        f"(12 B per parameter); start-up {b.startup_s:g} s; step {b.step_s:g} s; DCP load {b.load_s:.0f} s "
        f"({b.write_gbps:g} GB/s); a DCP checkpoint every {b.ckpt_every_s:g} s, blocking "
        f"{b.async_block_s:g} s; `snapshot_every` = {c.snapshot_every}. Then {each}."
    )


def verdicts(runs: list[SnapshotRun], models: list[CrashExtrapolation]) -> str:
    mtbf = SENSITIVITY_MTBF_S
    said = []
    for r, m in zip(runs, models, strict=True):
        snap, dcp = m.goodput(mtbf, True, peer=True), m.goodput(mtbf, False)
        said.append(
            f"with run {r.when}'s figures a snapshot every step {'beats' if snap > dcp else '**loses to**'} "
            f"DCP only at a crash every 3 h ({pct(snap)} against {pct(dcp)})"
        )
    return (
        "At the assumed 10 s step the two measured runs disagree: " + "; ".join(said) + ". Where the "
        "background work (replication and writes) outlasts `snapshot_every` steps, each snapshot waits for "
        "the previous one's, and the wait is training time lost; the grid below shows where that happens."
    )


def render_sensitivity(c: CrashExtrapolation, runs: list[SnapshotRun]) -> str:
    """Goodput with snapshots (restore from the peer) at a crash every 3 h over replication bandwidth x
    step time x snapshot interval, other inputs from the slower measured run."""
    slow = min(runs, key=lambda r: r.replicate_gbps)
    rates = sorted({r.replicate_gbps for r in runs} | {mb / 1000 for mb in SENSITIVITY_REPLICATE_MB_S})
    columns = [(step, every) for step in SENSITIVITY_STEP_S for every in SENSITIVITY_EVERY]
    measured = {r.replicate_gbps: r.when for r in runs}
    rows = []
    for gbps in rates:
        label = f"{gbps * 1000:.0f}" + (f" (run {measured[gbps]})" if gbps in measured else "")
        cells = []
        for step, every in columns:
            m = replace(c, base=replace(c.base, step_s=step), snapshot_every=every, replicate_gbps=gbps)
            snap, dcp = m.goodput(SENSITIVITY_MTBF_S, True, peer=True), m.goodput(SENSITIVITY_MTBF_S, False)
            cell = f"{pct(snap)} ({pct(m.snapshot_overhead())})"
            cells.append(cell if snap > dcp else f"**{cell}**")
        rows.append([label, *cells])
    header = ["replication MB/s per direction"] + [
        f"step {step:g} s, snapshot every {every}" for step, every in columns
    ]
    dcp = c.goodput(SENSITIVITY_MTBF_S, False)
    return (
        f"\nSensitivity: goodput with a snapshot every N steps, restored from the peer, at a crash every 3 h "
        f"(the snapshots' overhead in brackets); the other inputs from run {slow.when} (the slower). "
        f"DCP only gives {pct(dcp)} whatever the step; **bold**: snapshots do worse than DCP only.\n\n"
        + table(header, rows)
    )


def render_crash_extrapolation(base: Extrapolation) -> str:
    runs = [snapshot_run(name) for name in SNAPSHOT_RUNS]
    detection, crashes = measured_detection()
    models = [CrashExtrapolation.measured(base, r, detection) for r in runs]
    rows = [
        (label, f"{pct(models[0].goodput(t, False))} ({models[0].dcp_cost_s():.0f} s)",
         *(f"{pct(m.goodput(t, True, peer=peer))} ({m.snapshot_cost_s(peer):.0f} s)"
           for m in models for peer in (False, True)))
        for label, t in CRASH_INTERVALS
    ]  # fmt: skip
    slower = min(models, key=lambda m: m.replicate_gbps)
    header = ["crash (MTBF of the job)", "DCP only (cost per crash)"] + [
        f"snapshots, {where} (run {r.when})" for r in runs for where in ("local memory", "from the peer")
    ]
    return (
        f"\n### Crashes at 7B scale: in-memory snapshots against DCP only\n\n{FORMULA}\n\n"
        f"{measured_line(runs, models, crashes)} {assumed_line(models[0], runs, models)}\n\n"
        f"{table(header, rows)}\n{verdicts(runs, models)}\n"
        + render_sensitivity(slower, runs)
        + "\nThe restore figures are host-memory and TCP rates of a 2-core CPU machine; a GPU node's memory "
        "bandwidth and network (tens of GB/s) make them faster. With snapshots the crash cost is dominated "
        "by the assumed start-up, not by the restore; whether snapshots pay at all depends on the background "
        "work fitting into `snapshot_every` steps. This extrapolation is rewritten from the kept results by "
        f"`{EXTRAPOLATION_COMMAND}` (the kept files named above; every other input is the assumption "
        "stated), apart from the measured runs of the section before it.\n"
    )


def render_extrapolation(x: Extrapolation) -> str:
    """The section `goodput-extrapolation`: preemptions, then crashes from the kept results."""
    return render_preemption_extrapolation(x) + render_crash_extrapolation(x)
