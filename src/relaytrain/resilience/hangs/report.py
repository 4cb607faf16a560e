"""The markdown report of a hang (``logs/hang-step<N>.md``): the verdict, every rank, the stacks.

Rendered by the job's hang monitor after the node watchers wrote their ranks' stacks and before any rank is
killed, so it shows the ranks as they hung. Pure: the monitor writes the text where ``RunDir.hang_report``
says.
"""

from __future__ import annotations

from relaytrain.resilience.hangs.detect import (
    FIRST_WORK_FLOORS,
    RankView,
    Verdict,
    one_line,
    phase_label,
    ranks,
    seconds,
)

COLUMNS = (
    "rank",
    "node",
    "pid",
    "state",
    "wchan",
    "step",
    "phase",
    "in phase",
    "collectives entered/left",
    "last collective",
    "idle",
)


def render_report(verdict: Verdict, views: list[RankView], stacks: dict[str, str], job_id: str) -> str:
    """The report's markdown; ``stacks`` maps each node to its stacks section (text), in the order given."""
    lines = [f"# Hang detected at step {verdict.step} (job {job_id})", "", *_verdict(verdict), ""]
    lines += ["## Ranks", "", _row(COLUMNS), _row(["---"] * len(COLUMNS))]
    lines += [_row(_cells(v)) for v in sorted(views, key=lambda v: v.rank)]
    lines += ["", "## The limit", "", *_limit(verdict), "", "## Stacks", ""]
    if not stacks:
        lines += ["No node wrote its ranks' stacks before the report was rendered.", ""]
    for node, text in stacks.items():
        lines += [f"### {one_line(node)}", "", text.rstrip("\n"), ""]
    lines += ["## What happens next", "", *_next(), ""]
    return "\n".join(lines)


def _verdict(verdict: Verdict) -> list[str]:
    if not verdict.culprits:
        return ["No rank is named: the job was not hung when this report was rendered."]
    blamed = ranks([c.rank for c in verdict.culprits])
    lines = [f"{blamed[0].upper()}{blamed[1:]} held the job:", ""]
    lines += [f"- rank {c.rank} on {c.node}, in {c.phase}: {one_line(c.why)}" for c in verdict.culprits]
    if verdict.waiting:
        lines += ["", f"The others: {one_line(verdict.waiting)}."]
    return lines


def _limit(verdict: Verdict) -> list[str]:
    return [
        f"No rank made progress for {seconds(verdict.idle_s)}; the job's limit was "
        f"{seconds(verdict.limit_s)}, the largest over its ranks ({one_line(verdict.limit_why)}).",
        "",
        "A rank's limit is its phase's usual longest pause between moves times `resilience.hang_multiple`, "
        "never below `resilience.hang_floor_s`; a checkpoint save, load, snapshot, evaluation or stop may "
        "also take twice the budget the rank announced; the start-up's launch and set-up, until measured, "
        f"{FIRST_WORK_FLOORS:g} x the floor; no limit exceeds `resilience.hang_timeout_s`.",
    ]


def _next() -> list[str]:
    return [
        "The node watchers end every rank of this job step (SIGKILL), so the step ends with a failure; the "
        "end-of-step decision restarts it in place inside the allocation, restoring from snapshots when they "
        "are on, else from the last checkpoint. The cause `hang` and the culprits go to `crashes.jsonl` and "
        "`relaytrain status`; a node named as culprit twice in this job is left out of the next restart "
        "where the allocation allows it.",
    ]


def _cells(view: RankView) -> list[str]:
    r = view.record
    if r is None:
        known = [str(view.rank), view.node, "", view.state, view.wchan, "", phase_label(view)]
        return [*known, "", "", "", seconds(view.idle_s)]
    # The watcher's idle time counts from the last change the rank wrote, so the phase began that much
    # earlier than (last write - phase start): no clock of this process is needed.
    in_phase = max(0.0, r.updated - r.phase_started) + view.idle_s
    collective = f"{r.collective} (open)" if r.in_collective else r.collective
    return [
        str(view.rank),
        view.node,
        str(r.pid),
        view.state,
        view.wchan,
        str(r.step),
        r.phase.label,
        seconds(in_phase),
        f"{r.collectives_entered}/{r.collectives_left}",
        collective,
        seconds(view.idle_s),
    ]


def _row(cells: list[str] | tuple[str, ...]) -> str:
    return "| " + " | ".join(one_line(c).replace("|", "\\|") for c in cells) + " |"
