"""Benchmarks on the local Slurm cluster: runs interrupted at random and targeted moments (chaos) and
the share of allocated time they spend training (goodput). They write their own sections of
docs/benchmarks.md (`python -m bench.chaos`, `python -m bench.goodput`), not `python -m bench`'s.

    harness.py                the cluster, its lock, launching and waiting for jobs, rank processes,
                              and RunFiles: the one reader of a run directory's files
    chaos.py                  `python -m bench.chaos`: draws the trials, runs them, writes the section
    chaos_run.py              the random trials: reference run, interruption, checks
    chaos_kinds.py            the targeted trials (SIGKILL in a save, time limit cap, hang, disk full)
    chaos_page.py             the chaos section, several runs' results merged
    goodput.py                `python -m bench.goodput`: the runs, preempted and time-limited
    goodput_results.py        one run's figures, results files
    goodput_page.py           the goodput section
    goodput_extrapolation.py  goodput at 7B scale from the measured costs
"""
