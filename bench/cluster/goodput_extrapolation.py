"""The goodput section's 7B-class extrapolation: goodput(T) from the cost of one interruption, with the
formula printed on the page and a sensitivity grid over its assumed inputs; its crash part (measured inputs
from kept results) is goodput_crash_extrapolation.py."""

from __future__ import annotations

from dataclasses import dataclass, replace

from bench.report import pct, table

BYTES_PER_PARAM = 12.0  # relaytrain plan's checkpoint estimate: fp32 weights + Adam's two moments


@dataclass
class Extrapolation:
    params: float = 7e9
    write_gbps: float = 2.0  # slurm.fs_write_gbps's default (aggregate GB/s); read assumed the same
    startup_s: float = 60.0  # import torch + NCCL init on a few hundred ranks (assumed; local: tiny)
    exit_s: float = 5.0  # assumed: Slurm's GraceTime (a setting, 5 s here), the longest an exit may take
    step_s: float = 10.0  # a 7B step on a few nodes (assumed)
    lost_steps: float = 1.0  # assumed upper bound: the step in flight when the signal came (0 measured)
    async_block_s: float = 1.0  # assumed: blocking part of an async periodic save
    ckpt_every_s: float = 1800.0  # assumed: a DCP checkpoint every 30 minutes

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
EXTRAPOLATION_HEADING = "### 7B-class extrapolation"
# The extrapolation's own section of the page, after the measured runs' ("goodput"): rewritten from the kept
# results and its stated assumptions alone, so the page test rebuilds it byte for byte.
EXTRAPOLATION_SECTION = "goodput-extrapolation"
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


def render_preemption_extrapolation(x: Extrapolation) -> str:
    """The preemption part of the section; the crash part follows it (goodput_crash_extrapolation.py)."""
    rows = [(label, pct(x.goodput(t))) for label, t in (("every 30 min", 1800), ("every 4 h", 14400))]
    return (
        f"{EXTRAPOLATION_HEADING}\n\n"
        "goodput(T) = 1 − (save + exit + start-up + load + lost_steps × step) / T "
        "− async_block / ckpt_every, "
        "with save = load = params × 12 B / write bandwidth (relaytrain plan's checkpoint estimate: fp32 "
        "weights and Adam's two moments; read assumed as fast as write). Queue time is not allocated time, "
        "so it is not in the formula (it costs wall-clock time, not allocation). Inputs: "
        f"params {x.params:.0e} (assumed), write {x.write_gbps:g} GB/s (assumed: `slurm.fs_write_gbps` "
        f"default) → save {x.save_s:.0f} s, load {x.save_s:.0f} s; exit {x.exit_s:g} s (assumed: Slurm's "
        "GraceTime, a setting and not a measurement, the longest the processes may take to exit after the "
        "signal); "
        f"start-up {x.startup_s:g} s (assumed: imports and NCCL init at scale, "
        f"not measurable here); step {x.step_s:g} s (assumed); lost steps {x.lost_steps:g} (assumed, an "
        "upper bound: the step in flight; 0 were lost in the runs above); "
        f"async blocking {x.async_block_s:g} s (assumed) per periodic save every {x.ckpt_every_s:g} s "
        "(assumed). Cost per "
        f"interruption: {x.cost_s():.0f} s.\n\n" + table(["preemption", "goodput"], rows)
        + render_sensitivity(x)
    )  # fmt: skip
