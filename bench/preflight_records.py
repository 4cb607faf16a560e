"""What the checks before a job step measured on real job starts: how far each node fell below the median
of its job, against the thresholds that `resilience.preflight = "exclude"` would act on.

    python -m bench.preflight_records FOLDER [FOLDER ...] [--section preflight-starts] [--no-write]
    python -m bench.preflight_records --page-from bench/results/preflight-records-<date>.json

Reads every `<run_dir>/preflight/<job>.json` under the FOLDERs (run directories of jobs on a Slurm
cluster, such as those the Slurm test suite leaves in its temporary folders), one record per job step of
2 or more nodes, each once (a folder reached twice through a link counts once). Keeps, per record, its
path under its FOLDER, the node count, the worst compute and network shortfall below the median, the
nodes it named, the checks' seconds and rank 0's seconds in each phase, in
bench/results/<section>-<UTC date and time>.json, and writes that section of docs/benchmarks.md:
`preflight-records` (the records of any jobs) or `preflight-starts` (the clean starts of
bench.preflight_starts). Where the records hold each phase's seconds, the section gives them (their time
at 128 nodes is bench.preflight_scale's estimate). The FOLDERs themselves are not kept: the section names
each record by its FOLDER's last part.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench import kept
from bench.bounds import rate
from bench.report import fmt, machine_info, python_command, table

MODULE = "bench.preflight_records"
SECTION = "preflight-records"
SECTIONS = {
    SECTION: "Preflight on real job starts: how far a node fell below its job's median",
    "preflight-starts": "Preflight on clean job starts with exclude: false exclusions, the time per start",
}
ORDER = ["preflight", SECTION, "preflight-starts", "preflight-scale", "quickstart"]
NEAR = 10.0  # points below a threshold that count as near it
PHASES = ("compute", "network", "storage")


def _shortfall(ranks: list[dict], key: str) -> float | None:
    values = [r.get("figures", {}).get(key) for r in ranks]
    values = [v for v in values if v]
    if len(values) < 2:
        return None
    mid = statistics.median(values)
    return max(0.0, max((mid - v) / mid * 100 for v in values))


def _rank0_phases(ranks: list[dict]) -> dict[str, float]:
    """The seconds rank 0 spent in each phase: the record's `seconds` are rank 0's, from the checks' start
    to the record written, so what they hold beyond these is the gathering, judging and writing."""
    first = next((r for r in ranks if r.get("rank") == 0), ranks[0] if ranks else {})
    return {k: first.get("seconds", {}).get(k, 0.0) for k in PHASES}


def _startup_s(run_dir: Path) -> float | None:
    """The run's start-up in its time ledger (relaytrain.monitor), for a run of one job step checked once
    (a start that was left out or restarted has time of other kinds in its start-up); else None."""
    from relaytrain.errors import UserError
    from relaytrain.job import RunDir
    from relaytrain.monitor.run_ledger import run_ledger

    if len(list((run_dir / "preflight").glob("*.json"))) != 1:
        return None
    try:
        return run_ledger(RunDir(run_dir), ask_slurm=False).buckets.get("startup")
    except (UserError, OSError, ValueError):
        return None


def collect(folders: list[Path]) -> list[dict]:
    rows, seen = [], set()
    for folder in folders:
        for path in sorted(folder.rglob("preflight/*.json")):
            real = path.resolve()
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            identity = (record.get("job"), record.get("time"))
            if real in seen or identity in seen or len(record.get("nodes", {})) < 2:
                continue
            seen.update({real, identity})
            rows.append({
                "record": f"{folder.name}/{path.relative_to(folder).as_posix()}",
                "nodes": len(record["nodes"]),
                "compute_shortfall_pct": _shortfall(record.get("ranks", []), "gflops"),
                "network_shortfall_pct": _shortfall(record.get("ranks", []), "gbps"),
                "named": sorted(n for n, v in record["nodes"].items() if not v.get("passed", True)),
                "seconds": record.get("seconds"),
                "phases": _rank0_phases(record.get("ranks", [])),
                "thresholds": record.get("thresholds", {}),
                "startup_s": _startup_s(path.parent.parent),
            })  # fmt: skip
    return rows


def render(data: dict) -> str:
    rows, m = data["rows"], data["machine"]
    compute = [r["compute_shortfall_pct"] for r in rows if r["compute_shortfall_pct"] is not None]
    network = [r["network_shortfall_pct"] for r in rows if r["network_shortfall_pct"] is not None]
    limits = rows[0]["thresholds"] if rows else {}
    cpct, npct = limits.get("compute_pct", 40.0), limits.get("network_pct", 50.0)
    named = [r for r in rows if r["named"]]
    near = [c for c in compute if c >= cpct - NEAR]
    body = [
        (r["record"], r["nodes"], fmt(r["compute_shortfall_pct"]), fmt(r["network_shortfall_pct"]),
         fmt(r["seconds"]), ", ".join(r["named"]) or "none")
        for r in rows
    ]  # fmt: skip
    lines = [
        f"## {SECTIONS[data.get('section', SECTION)]}",
        "",
        f"Read {m['date']} on {m['cpu']} ({m['cores']} cores), commit {m['commit']}, by `{data['command']}`, "
        f"from the run directories of {data['description']}. Thresholds of the records: compute "
        f"{fmt(cpct)} %, network {fmt(npct)} % below the median.",
        "",
        table(
            [
                "record",
                "nodes",
                "worst compute shortfall (%)",
                "worst network shortfall (%)",
                "checks (s)",
                "named",
            ],
            body,
        ).rstrip(),  # fmt: skip
        "",
        f"* Job steps of 2 or more nodes: {len(rows)}; with a node named: {len(named)}.",
        f"* Worst compute shortfall: median {fmt(statistics.median(compute)) if compute else '-'} %, "
        f"largest {fmt(max(compute)) if compute else '-'} %; within {fmt(NEAR)} points of the threshold: "
        f"{len(near)} of {len(compute)}.",
        f"* Worst network shortfall: largest {fmt(max(network)) if network else '-'} %.",
        f"* The checks took {fmt(statistics.median([r['seconds'] for r in rows if r['seconds']]))} s "
        "(median) a job step."
        if rows
        else "* No record.",
        *(false_exclusions(rows) if data.get("section") == "preflight-starts" else []),
        *startup(rows),
        *phases(rows),
        "",
        kept.rewritten(python_command(MODULE), kept.relative(data["kept"])).rstrip(),
    ]
    return "\n".join(lines) + "\n"


def false_exclusions(rows: list[dict]) -> list[str]:
    """Clean starts (run directories: a start's first check and those after its restarts) that named a
    node: each a false exclusion, since nothing slowed their nodes; the count with its upper bound."""
    starts: dict[str, bool] = {}
    for r in rows:
        run = r["record"].rsplit("/preflight/", 1)[0]
        starts[run] = starts.get(run, False) or bool(r["named"])
    if not starts:
        return []
    named = sum(starts.values())
    return [
        "* False exclusions: a node that nothing had slowed was left out in "
        f"{rate(named, len(starts), 'upper')} clean starts (a start: one run directory, its first check "
        "and the check after its restart)."
    ]


def startup(rows: list[dict]) -> list[str]:
    """The checks' share of a job step's start-up, where the records' runs have their start-up kept."""
    pairs = [(r["seconds"], r["startup_s"]) for r in rows if r.get("startup_s") and r["seconds"]]
    if not pairs:
        return []
    start = fmt(statistics.median(b for _, b in pairs))
    share = fmt(statistics.median(a / b * 100 for a, b in pairs))
    return [
        f"* Start-up of a job step (the time ledger's `startup`, from the batch job's start to the first "
        f"step), over the {len(pairs)} starts checked once: median {start} s; the checks were {share} % of "
        "it (median)."
    ]


def phases(rows: list[dict]) -> list[str]:
    """Rank 0's seconds in each phase and the rest (none where the records do not keep the phases); their
    time at more nodes is bench.preflight_scale's."""
    if not rows or any("phases" not in r or not r["seconds"] for r in rows):
        return []
    total = statistics.median(sum(r["phases"].values()) for r in rows)
    rest = statistics.median(max(0.0, r["seconds"] - sum(r["phases"].values())) for r in rows)
    parts = ", ".join(f"{k} {fmt(statistics.median(r['phases'][k] for r in rows))} s" for k in PHASES)
    return [
        f"* Per job step (median): the phases {fmt(total)} s ({parts}; rank 0's), the rest "
        f"(waiting for the other ranks, gathering their results, judging, writing the record) {fmt(rest)} s.",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", type=Path, help="folders holding run directories")
    parser.add_argument("--describe", default="jobs on a Slurm cluster", help="what the folders hold")
    parser.add_argument("--section", default=SECTION, choices=sorted(SECTIONS), help="the page's section")
    parser.add_argument("--no-write", action="store_true", help="print the section, leave the page alone")
    parser.add_argument("--page-from", default="", help="measure nothing: rewrite the section from this file")
    args = parser.parse_args(argv)
    if args.page_from:
        try:
            section = kept.load(args.page_from).get("section", SECTION)
        except ValueError as err:
            parser.error(f"--page-from: {err}")
        kept.rewrite_from(args.page_from, render, section, ORDER, parser.error)
        return 0
    if not args.folders:
        parser.error("name the folders that hold run directories (or --page-from a kept file)")
    command = python_command(MODULE, ["FOLDER ...", "--describe TEXT"])
    if args.section != SECTION:
        command = python_command(MODULE, ["FOLDER ...", "--section", args.section, "--describe TEXT"])
    data = {"machine": machine_info(), "command": command, "description": args.describe}
    data["rows"] = collect(args.folders)
    if args.section != SECTION:
        data["section"] = args.section
    kept.keep_and_show(args.section, data, render, args.section, ORDER, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
