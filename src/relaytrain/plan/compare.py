"""`relaytrain plan --simulate`: the analytical plan beside a fake-tensor step of the real build.

The simulation (relaytrain.parallel.simulate) measures what the step's tensors hold; `plan` also adds
what no tensor shows: the CUDA context and communicator buffers (OVERHEAD_BYTES) and allocator
fragmentation (FRAGMENTATION). The comparison is therefore between plan's tensor bytes (states +
gathered layers + activations + logits) and the simulated peak, per category and in total.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from relaytrain.plan.checks import GIB, Plan
from relaytrain.plan.spares import spare_cost

# Plan's categories and the simulated ones each stands for.
GROUPS = (
    ("weights+grads+AdamW", ("parameters", "gradients", "optimizer state")),
    ("gathered layers", ("gathered layers", "communication buffers")),
    ("activations+logits", ("activations", "temporaries")),
)
# Finer: plan's states split as it counts them (an error in one cannot hide behind another).
DETAIL = (
    ("parameters", ("parameters",)),
    ("gradients", ("gradients",)),
    ("optimizer state", ("optimizer state",)),
    ("gathered layers", ("gathered layers", "communication buffers")),
    ("activations+logits", ("activations", "temporaries")),
)
AGREEMENT = 0.10  # plan's tensor total must be within 10% of the simulated peak


@dataclass
class Comparison:
    category: str
    plan_bytes: float
    simulated_bytes: float

    @property
    def relative(self) -> float | None:
        """(plan - simulated) / simulated; None when the simulation holds nothing of it."""
        if not self.simulated_bytes:
            return None
        return (self.plan_bytes - self.simulated_bytes) / self.simulated_bytes


def plan_categories(plan: Plan) -> dict[str, float]:
    mem = plan.memory
    return {
        "weights+grads+AdamW": mem.states,
        "gathered layers": mem.gathered(plan.mode),
        "activations+logits": mem.activations[plan.mode] + mem.logits,
    }


def plan_detail(plan: Plan) -> dict[str, float]:
    """plan_categories with the states split into parameters, gradients and optimizer state."""
    coarse = plan_categories(plan)
    return {**plan.memory.state_parts, **{k: v for k, v in coarse.items() if k != "weights+grads+AdamW"}}


def compare_detail(plan: Plan, sim) -> list[Comparison]:
    """Per DETAIL category and in total, for one simulated rank."""
    return _compare(plan_detail(plan), sim, DETAIL)


def _compare(planned: dict[str, float], sim, groups) -> list[Comparison]:
    """Each group of the simulation's categories against plan's figure of that name, and the total."""
    rows = [
        Comparison(name, planned[name], float(sum(sim.categories[c] for c in members)))
        for name, members in groups
    ]
    rows.append(Comparison("tensors at the peak", sum(planned.values()), float(sim.peak_bytes)))
    return rows


def _records(rows: list[Comparison]) -> list[dict]:
    return [
        {
            "category": c.category,
            "plan_bytes": c.plan_bytes,
            "simulated_bytes": c.simulated_bytes,
            "relative": c.relative,
        }
        for c in rows
    ]


def compare(plan: Plan, sim) -> list[Comparison]:
    """Per category and in total ("tensors at the peak"), for one simulated rank (RankSimulation)."""
    return _compare(plan_categories(plan), sim, GROUPS)


def worst_total(plan: Plan, sims: list) -> Comparison:
    """The total of the rank that holds the most: the one the GPU must fit."""
    top = max(sims, key=lambda s: s.peak_bytes)
    return compare(plan, top)[-1]


def agrees(plan: Plan, sims: list) -> bool:
    rel = worst_total(plan, sims).relative
    return rel is not None and abs(rel) <= AGREEMENT


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 1024**2:.2f} MiB"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0%}"


def comparison_rows(plan: Plan, sim) -> list[tuple[str, str, str, str]]:
    return [
        (c.category, _size(c.plan_bytes), _size(c.simulated_bytes), _pct(c.relative))
        for c in compare(plan, sim)
    ]


def category_rows(sim) -> list[tuple[str, str]]:
    return [(name, _size(value)) for name, value in sim.categories.items()]


def collective_rows(sim) -> list[tuple[str, ...]]:
    return [
        (
            c["op"],
            c["mesh_dim"],
            str(c["group_size"]),
            c["per"],
            str(c["calls"]),
            _size(c["bytes"]),
            f"{c['simulated_calls']}, {_size(c['simulated_bytes'])}",
            "yes" if c["crosses_nodes"] else "no",
        )
        for c in sim.collectives
    ]


def collectives_title(plan: Plan, micro_batches: int) -> str:
    """The table's title: what it counts and how it was scaled from what the simulation ran."""
    n = plan.dims.grad_accum if plan.dims is not None else micro_batches
    if n == micro_batches:
        return f"collectives per step (all {n} micro batch(es) simulated)"
    return (
        f"collectives per step of {n} micro batches: those once per micro batch scaled "
        f"x {n / micro_batches:g} from the {micro_batches} simulated"
    )


def tp_crosses_nodes(sims: list) -> bool:
    return any(c["mesh_dim"] == "tp" and c["crosses_nodes"] for s in sims for c in s.collectives)


def as_json(plan: Plan, sims: list, micro_batches: int, warning: str = "") -> dict:
    """The machine-readable `plan --simulate --json` record."""
    out = {
        "parameters": plan.parameters,
        "nodes": plan.nodes,
        "gpus_per_node": plan.gpus_per_node,
        "layout": plan.dims.describe() if plan.dims is not None else None,
        "verdict": plan.verdict,
        "checks": [{"check": n, "result": level, "detail": d} for n, level, d in plan.checks],
        "plan_bytes": plan_categories(plan) if plan.memory is not None else None,
        "plan_detail_bytes": plan_detail(plan) if plan.memory is not None else None,
        "plan_total_bytes": plan.memory.total(plan.mode) if plan.memory is not None else None,
        "simulation_warning": warning or None,
        "simulated_micro_batches": micro_batches,
        "ranks": [],
    }
    for sim in sims:
        record = asdict(sim)
        record["comparison"] = _records(compare(plan, sim))
        record["detail_comparison"] = _records(compare_detail(plan, sim))
        out["ranks"].append(record)
    if sims:
        out["agrees_within_10_percent"] = agrees(plan, sims)
        out["tp_crosses_nodes"] = tp_crosses_nodes(sims)
    return out


def run_simulation(cfg, plan: Plan, progress) -> tuple[list, str]:
    """(simulated ranks, warning): nothing and no warning for an impossible layout (plan says why);
    nothing and a one-line warning when the fake step cannot run it."""
    from relaytrain.parallel.simulate import SimulationError, simulate

    if plan.dims is None or plan.memory is None:
        return [], ""
    try:
        return simulate(cfg, plan.dims, plan.gpus_per_node or plan.tasks_per_node, progress), ""
    except SimulationError as exc:
        return [], f"the simulation could not run this layout ({exc}); the analytical plan stands"


def reshard_lines(cfg, plans: list[Plan], progress) -> list[str]:
    """For a node range: a checkpoint saved at the largest count, loaded at every other, on metadata."""
    from relaytrain.parallel.sim_reshard import check_reshard, chunks_of_layout

    usable = [p for p in plans if p.dims is not None and p.dims.pp == 1]
    if len(usable) < 2:
        return []
    per_node = [p.gpus_per_node or p.tasks_per_node for p in usable]
    top = usable[-1]
    progress(f"reshard check: chunks of every parameter at {top.dims.world_size} ranks")
    try:
        saved = chunks_of_layout(cfg, top.dims.world_size, per_node[-1])
        lines = []
        for plan, gpn in zip(usable[:-1], per_node[:-1], strict=True):
            progress(f"reshard check: loading into {plan.dims.world_size} ranks")
            check = check_reshard(saved, chunks_of_layout(cfg, plan.dims.world_size, gpn))
            verdict = "every tensor covered exactly once" if not check.problems else check.problems[0]
            lines.append(
                f"reshard {top.dims.world_size} -> {plan.dims.world_size} ranks (DCP plan on metadata): "
                f"{check.tensors} tensors, {check.saved_chunks} saved chunks, {check.load_reads} reads; "
                f"{verdict}"
            )
        return lines
    except RuntimeError as exc:
        return [f"reshard check could not run: {exc}"]


def print_simulation(console, plan: Plan, sims: list, micro_batches: int) -> None:
    from rich.table import Table

    for sim in sims:
        coords = ", ".join(f"{k} {v}" for k, v in sim.coordinates.items())
        title = (
            f"simulated rank {sim.rank} ({sim.role}; {coords}): peak {_size(sim.peak_bytes)} at the "
            f"{sim.peak_at}; {sim.seconds:.0f} s, {sim.host_peak_bytes / GIB:.1f} GiB host memory"
        )
        table = Table(title=title, show_header=True)
        for column in ("memory", "plan", "simulated", "plan vs simulated"):
            table.add_column(column)
        for row in comparison_rows(plan, sim):
            table.add_row(*row)
        console.print(table)
        detail = Table(show_header=True, title="at the peak, by category")
        detail.add_column("category")
        detail.add_column("bytes")
        for row in category_rows(sim):
            detail.add_row(*row)
        console.print(detail)
        comms = Table(show_header=True, title=collectives_title(plan, micro_batches))
        columns = (
            "collective",
            "mesh dim",
            "group",
            "once per",
            "calls",
            "payload",
            "simulated",
            "crosses nodes",
        )
        for column in columns:
            comms.add_column(column)
        for row in collective_rows(sim):
            comms.add_row(*row)
        console.print(comms)
        kernels = ", ".join(sim.attention_kernels) or "none"
        console.print(f"attention kernel of the fake CPU step: {kernels}")
    if sims:
        total = worst_total(plan, sims)
        word = "is within" if agrees(plan, sims) else "is NOT within"
        console.print(
            f"plan's tensor memory {word} {AGREEMENT:.0%} of the simulation's peak: "
            f"{_size(total.plan_bytes)} vs {_size(total.simulated_bytes)} "
            f"({_pct(total.relative)}); "
            f"{micro_batches} of {plan.dims.grad_accum} micro batches simulated. "
            "No timing: the step ran on fake tensors."
        )
        if tp_crosses_nodes(sims):
            console.print("[red]tensor-parallel collectives cross a node boundary on the real mesh[/]")


def report(cfg, plans: list[Plan], console, simulate: bool, json_out: bool, print_plan) -> int:
    """`plan --simulate` / `--json`: the plan (`print_plan` prints its tables), then the simulation beside
    it; with --json one record on stdout (progress on stderr). Exit 1 for an impossible layout, as plan."""
    import json
    import sys

    from relaytrain.parallel.simulate import simulated_micro_batches

    plan = plans[-1]
    if not json_out:
        print_plan()
    sims, warning = [], ""
    progress = (lambda line: print(line, file=sys.stderr)) if json_out else console.print
    if simulate:
        sims, warning = run_simulation(cfg, plan, progress)
    reshard = reshard_lines(cfg, plans, progress) if simulate and len(plans) > 1 else []
    micro = simulated_micro_batches(cfg.parallel, plan.dims) if plan.dims is not None else 0
    impossible = any(p.verdict == "impossible" for p in plans)
    if json_out:
        spares = {"spares": spare_cost(cfg.slurm)} if cfg.slurm.spare_nodes else {}
        print(json.dumps({**as_json(plan, sims, micro, warning), "reshard": reshard, **spares}, indent=2))
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    else:
        print_simulation(console, plan, sims, micro)
        for line in reshard:
            print(line, flush=True)
        if warning:
            print(f"warning: {warning}", flush=True)  # one line, unwrapped
        verdict = "impossible" if impossible else plan.verdict
        console.print(f"verdict: [{'red' if verdict == 'impossible' else 'green'}]{verdict}[/]")
    return 1 if impossible else 0
