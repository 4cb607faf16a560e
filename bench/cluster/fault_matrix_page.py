"""The "fault-matrix" section of docs/benchmarks.md, from a kept results file
(bench/results/fault-matrix-*.json) and nothing else, so that
`python -m bench.fault_matrix --page-from FILE` rewrites it byte for byte."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from bench import kept
from bench.cluster.fault_matrix_judge import (
    INFRA,
    KINDS,
    MAX_REPRODUCTIONS,
    MAX_STEPS_LOST,
    MatrixTrial,
    summary,
)
from bench.report import REPO, table

SECTION = "fault-matrix"
COMMAND = "python -m bench.fault_matrix"


def load_trials(data: dict[str, Any], name: str = "") -> list[MatrixTrial]:
    names = {f.name for f in fields(MatrixTrial)}
    try:
        return [MatrixTrial(**{k: v for k, v in row.items() if k in names}) for row in data.get("trials", [])]
    except TypeError as err:
        raise ValueError(f"{name or 'the results'} hold no fault matrix trials ({err})") from None


def _n(value: float | int | None) -> str:
    return "–" if value is None else f"{value:g}"


def rows_table(trials: list[MatrixTrial]) -> str:
    rows = []
    for t in trials:
        kind = KINDS[t.kind]
        cls = "machines" if kind.cls == INFRA else "user"
        decisions = " → ".join(t.decisions) or t.decision or "–"
        rows.append((
            f"`{t.kind}`", cls, kind.fault, f"**{t.decision or '–'}**", decisions, t.restarts, t.requeues,
            _n(t.reproductions), _n(t.seconds_to_decision), _n(t.steps_lost),
            "right" if t.right else f"**wrong**: {t.why}",
        ))  # fmt: skip
    header = ("kind", "fault of", "the fault", "decision", "decisions in order", "restarts", "requeues",
              "reproductions", "fault → decision (s)", "steps lost", "verdict")  # fmt: skip
    return table(header, rows)


def causes(trials: list[MatrixTrial]) -> str:
    """What each user fault's stop said: the cause named, as the job log and run_state.json have it."""
    repo = str(REPO.resolve())  # the page names no path outside the repository
    lines = [f"- `{t.kind}`: {' '.join(t.message.replace(repo, '.').replace('|', '/').split())}"
             for t in trials if KINDS[t.kind].cls != INFRA]  # fmt: skip
    return "\n".join(lines) + "\n" if lines else ""


def merged(paths: list[str]) -> tuple[list[MatrixTrial], list[tuple[dict[str, Any], list[str]]]]:
    """Each kind's trial from the last kept file that has it (in run order), and each file's data with the
    kinds it gave."""
    datas = [kept.load(path) for path in paths]
    by_kind: dict[str, tuple[int, MatrixTrial]] = {}
    for i, (path, data) in enumerate(zip(paths, datas, strict=True)):
        by_kind |= {t.kind: (i, t) for t in load_trials(data, kept.relative(path))}
    order = list(KINDS)
    trials = sorted((t for _, t in by_kind.values()), key=lambda t: order.index(t.kind))
    gave = [[k for k in order if k in by_kind and by_kind[k][0] == i] for i in range(len(datas))]
    return trials, list(zip(datas, gave, strict=True))


def every_run(paths: list[str], datas: list[tuple[dict[str, Any], list[str]]]) -> str:
    """Each kept run's own verdicts, wrong ones named with why: the table shows each kind's last trial
    only, so a kind that went wrong in an earlier run would otherwise not show."""
    parts = []
    for i, (path, (data, shown)) in enumerate(zip(paths, datas, strict=True), 1):
        trials = load_trials(data, kept.relative(path))
        wrong = [f"`{t.kind}` {t.why}" for t in trials if not t.right]
        right = sum(t.right for t in trials)
        hidden = [t.kind for t in trials if t.kind not in shown]
        parts.append(
            f"run {i} ({kept.relative(path)}, {data.get('date', '?')}): {right} of {len(trials)} right"
            + (f" ({'; '.join(wrong)})" if wrong else "")
            + (f"; superseded code: {data['superseded']}" if data.get("superseded") else "")
            + (f"; its trials of {', '.join(hidden)} superseded by a later run's" if hidden else "")
        )
    return f"Every kept run, {len(KINDS)} kinds: " + "; ".join(parts) + "."


def render_section(paths: str | list[str]) -> str:
    paths = [paths] if isinstance(paths, str) else list(paths)
    trials, datas = merged(paths)
    s = summary(trials)
    met = s["right"] == s["trials"] and not s["false_stops"] and s["user_within_reproductions"] == s["user"]
    files = " ".join(kept.relative(p) for p in paths)
    runs = "; ".join(
        f"`{d.get('command', COMMAND)}` on {d.get('date', '?')} ({d.get('cpu', '?')}, {d.get('cores', '?')} "
        f"cores, load {d.get('load', '?')}; its trials shown: {', '.join(kinds) or 'none'})"
        for d, kinds in datas
    )
    return (
        "## Fault matrix: restart or stop, decided right\n\n"
        f"Rewritten from the kept results by `{COMMAND} --page-from {files}`; measured by {runs}; on the "
        "local Slurm cluster: 2-node jobs (1 rank a node) of the tiny config, `checkpoint.snapshot_every=1`, "
        "one trial a fault kind (from the last run that has it).\n\n" + every_run(paths, datas) + "\n\n"
        "A fault of the machines is right when the job was restarted in place, requeued or went on, was "
        f"never stopped, finished, and replayed at most {MAX_STEPS_LOST} step. A fault of the user is right "
        f"when the job stopped with its cause named after at most {MAX_REPRODUCTIONS} reproduction (each "
        "restart or requeue runs the fault again) and was not requeued. *fault → decision*: from the fault's "
        "landed line (or the benchmark's own action) to the decision's record (crashes.jsonl, the stop "
        "event, run_state.json). The judge: bench/cluster/fault_matrix_judge.py.\n\n"
        + rows_table(trials)
        + "\n"
        + f"Verdicts right: **{s['right']}/{s['trials']}**; false stops: **{s['false_stops']}**; user faults "
        f"stopped after <= {MAX_REPRODUCTIONS} reproduction: "
        f"**{s['user_within_reproductions']}/{s['user']}** "
        f"(most: {s['max_reproductions']}); most steps lost by a fault of the machines: "
        f"{s['max_steps_lost']}. Targets (every verdict right, 0 false stops, user faults stopped after <= 1 "
        f"reproduction): **{'met' if met else 'missed'}**.\n\n"
        "The causes the user faults' stops named:\n\n" + causes(trials)
    )
