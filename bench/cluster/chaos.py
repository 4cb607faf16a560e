"""`python -m bench.chaos`: interrupt real Slurm jobs at random moments and check that no work is lost.

    python -m bench.chaos --trials 20 --seed 7      # writes its section of docs/benchmarks.md
    python -m bench.chaos --quick                   # 2 trials (the `slurm` test runs this), no page
    python -m bench.chaos --page-from A.json B.json --section chaos  # a section from kept results
    python -m bench.chaos --hangs all --trials 3    # hangs: bench/cluster/chaos_hangs.py

Every run but a quick one keeps its results in bench/results/chaos-seed<seed>-<date>.json (bench/kept.py)
and writes its section from that file, as `--page-from` does, so the page equals what the kept results
give (tests/test_bench_pages.py checks it). With several runs' results (in run order) the section shows
every random trial and every SIGKILL-during-save trial (listed under the checkpoint.mode it reported), and
of the other targeted kinds only the latest run that has each, saying which earlier rows it replaces.

Each trial draws a (phase, event) pair from a seeded generator, launches a tiny 2-rank run on the local
Slurm cluster (`relaytrain cluster up`), waits for the phase, fires the event, and continues the run to
the end: the job requeues itself (preemption, a crash), or the benchmark resubmits it where the policy
is not to requeue (a USR2 cancel). The finished run is compared with one uninterrupted reference run of
the same config: every logged loss bit-identical, the set of steps the same (replayed steps counted),
`checkpoints/latest` naming a complete checkpoint, no files beyond the documented set, the last
`run_state.json` saying `finished`, and evidence that the fault landed (chaos_run.fault_evidence: a
crashes.jsonl line, a stop or resume event, a requeue or resubmission, the killed process gone): a trial
whose fault reached nothing proves nothing and does not count. Each finished run must also pass
`relaytrain verify RUN` (exit 0), and its time ledger add up to sacct's elapsed time of its jobs within
1 %, at most 1 % unaccounted (bench/cluster/ledger_figures.py); each trial keeps both (`verify_exit`,
`ledger`: the ledger's seconds per bucket and the share of them inferred by rule, not measured).

The benchmark holds /tmp/relaytrain-slurm.lock (the cluster is shared) for chunks of `--chunk` trials.
The random trials are in chaos_run.py, the targeted ones in chaos_kinds.py, the page in chaos_page.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path

from bench import kept
from bench.cluster import chaos_hangs, chaos_straggler
from bench.cluster.chaos_hangs_clean import CLEAN_VARIANTS, parse_variants
from bench.cluster.chaos_hangs_page import SECTION as HANGS
from bench.cluster.chaos_hangs_page import render_hangs_section
from bench.cluster.chaos_kinds import SPECIAL_KINDS, SpecialTrial, SpecialTrials
from bench.cluster.chaos_page import SECTIONS, render_section, results_data
from bench.cluster.chaos_run import Bench, draw
from bench.cluster.harness import CLUSTER_NODES, LOCK, OUT_ROOT, cluster_lock, load_averages, start_cluster
from bench.report import machine_info, write_page

OUT = OUT_ROOT / "chaos"


def draw_special(
    kill_saves: int, specials: bool | list[str], start: int, modes: str = "async,sync"
) -> list[SpecialTrial]:
    cycle = [f"kill_save_{mode}" for mode in modes.split(",")]
    kinds = [cycle[i % len(cycle)] for i in range(kill_saves)]
    kinds += list(specials if isinstance(specials, list | tuple) else SPECIAL_KINDS if specials else [])
    return [SpecialTrial(start + i, kind) for i, kind in enumerate(kinds)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trials", type=int, default=20, help="random (phase, event) trials; with --hangs: per kind"
    )
    kinds = ",".join(chaos_hangs.KINDS)
    hangs_help = f"hang trials only (chaos_hangs.py): all, or of {kinds}; writes the {HANGS!r} section"
    parser.add_argument("--hangs", metavar="KIND[,KIND]", help=hangs_help)
    variants = ",".join(CLEAN_VARIANTS)
    parser.add_argument("--clean-variants", default=variants, help=f"--hangs clean: of {variants}, in turn")
    parser.add_argument("--kill-saves", type=int, default=10, help="SIGKILL-during-save trials")
    parser.add_argument("--kill-save-modes", default="async,sync", help="checkpoint.mode of those, in turn")
    parser.add_argument("--special", default="", help=f"only these of {','.join(SPECIAL_KINDS)}")
    parser.add_argument("--no-special", action="store_true", help="skip time limit/cap, hang, disk full")
    parser.add_argument("--seed", type=int, default=None, help="default: from the clock (printed)")
    parser.add_argument(
        "--quick", action="store_true", help="2 random trials only (--hangs: as asked), no page"
    )
    parser.add_argument("--chunk", type=int, default=5, help="trials per hold of the cluster lock")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--section", default="chaos", help="page section to write")
    parser.add_argument("--no-lock", action="store_true", help=f"the caller holds {LOCK} already")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument(
        "--page-from",
        nargs="+",
        metavar="KEPT_JSON",
        help="write --section from kept results files (bench/results/chaos-seed*.json), in run order",
    )
    args = parser.parse_args(argv)  # fmt: skip
    if args.section not in (*SECTIONS, HANGS):
        parser.error(
            f"--section: no chaos section {args.section!r}; choose from {', '.join([*SECTIONS, HANGS])}"
        )
    command = "python -m bench.chaos " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.page_from:
        try:
            if args.section == HANGS:
                section = render_hangs_section(args.page_from)
            else:
                section = render_section(args.page_from, args.section)
        except (ValueError, TypeError) as err:
            parser.error(f"--page-from: {err}")
        print(section)
        write_page({args.section: section})
        return 0
    if args.hangs:
        if args.hangs != "all" and not set(args.hangs.split(",")) <= set(chaos_hangs.KINDS):
            parser.error(f"--hangs: choose from all, {', '.join(chaos_hangs.KINDS)}")
        try:
            parse_variants(args.clean_variants)
        except ValueError as err:
            parser.error(f"--clean-variants: {err}")
        return chaos_hangs.main(args, command)
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    trials = draw(2 if args.quick else args.trials, seed)
    kinds = args.special.split(",") if args.special else not args.no_special
    special = draw_special(args.kill_saves, kinds, len(trials), args.kill_save_modes)
    special = [] if args.quick else [replace(t, seed=str(seed)) for t in special]
    print(f"bench.chaos: seed {seed}, {len(trials)} random + {len(special)} targeted trials", flush=True)
    base = Path(args.out) / f"seed{seed}-{int(time.time())}"
    base.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed + 1)
    load = [os.getloadavg()]
    spare = any(t.kind == "straggler_replace" for t in special)  # its job: 2 nodes and the spare
    info = start_cluster(lock=not args.no_lock, nodes=chaos_straggler.NODES + 1 if spare else CLUSTER_NODES)
    bench = Bench(base, info)
    bench.run_reference()
    targeted = SpecialTrials(bench)
    everything = [*trials, *special]
    now = datetime.now(UTC)
    keep = f"chaos-seed{seed}-{now:%Y-%m-%d-%H%M}.json"  # in bench/results/, unless --quick

    def save() -> None:
        data = results_data(command.strip(), str(now.date()), seed, machine_info(),
                            load_averages([*load, os.getloadavg()]), everything)  # fmt: skip
        (base / "results.json").write_text(json.dumps(data, indent=1))
        if not args.quick:
            kept.save(keep, data)

    for start in range(0, len(everything), args.chunk):
        with cluster_lock(not args.no_lock):
            for trial in everything[start : start + args.chunk]:
                if isinstance(trial, SpecialTrial):
                    targeted.run(trial, rng)
                else:
                    bench.run_trial(trial, rng)
                print(f"bench.chaos: {json.dumps(asdict(trial))}", flush=True)
                save()
    save()
    section = render_section([str(base / "results.json")], args.section)
    print(section)
    if not (args.quick or args.no_write):
        write_page({args.section: render_section([keep], args.section)})
    return 0 if all(t.ok for t in everything) else 1


if __name__ == "__main__":
    sys.exit(main())
