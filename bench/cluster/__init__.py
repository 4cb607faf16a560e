"""Benchmarks on the local Slurm cluster: runs interrupted at random and targeted moments (chaos) and
the share of allocated time they spend training (goodput). They write their own sections of
docs/benchmarks.md (`python -m bench.chaos`, `python -m bench.goodput`), not `python -m bench`'s.

    harness.py                the cluster, its lock, launching and waiting for jobs, rank processes,
                              and RunFiles: the one reader of a run directory's files
    chaos.py                  `python -m bench.chaos`: draws the trials, runs them, writes the section
    chaos_run.py              the random trials: reference run, interruption, checks
    chaos_kinds.py            the targeted trials (SIGKILL in a save, time limit cap, hang, disk full)
    chaos_page.py             the chaos sections from kept results (bench/results/), several runs merged
    chaos_snapshots.py        the targeted trials of the peer replica (2 nodes, a node's memory wiped)
    chaos_hangs.py            `--hangs`: hangs injected (SIGSTOP, FIFO, stalled loader, skipped collective),
                              a slow rank, clean runs; detection time, culprit, restart
    chaos_hangs_clean.py      the clean runs' variants (debug, 1.2 GB wide, compile, restart), their configs
    chaos_hangs_judge.py      one hang trial's figures and checks, from its job log, metrics, hang record
    chaos_hangs_page.py       the hangs section from kept results
    goodput.py                `python -m bench.goodput`: the runs, preempted and time-limited
    goodput_results.py        one run's figures, results files
    goodput_page.py           the goodput section
    goodput_crash.py          `--crashes`: a crash every T seconds, restart in place against requeue
    goodput_extrapolation.py  goodput at 7B scale under preemption, its assumed inputs labelled
    goodput_crash_extrapolation.py  crashes at 7B scale: snapshots against DCP only, every measured input
                              read from the kept results of the run it cites
"""
