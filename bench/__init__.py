"""Benchmarks behind every performance figure in docs/benchmarks.md.

``python -m bench`` (or ``bench/run.sh``) measures, then rewrites the page's sections it owns and keeps
everything else. Each measuring module has ``measure(options) -> dict`` (JSON-safe results, with the
command that reproduces each figure) and ``render(results) -> str`` (the section's Markdown body), and
runs alone as ``python -m bench.<module>``.

Page sections are delimited by ``<!-- bench:NAME -->`` ... ``<!-- /bench:NAME -->``; the runner replaces
only the blocks it measured in this invocation and keeps every other byte, so sections that others write
(the checkpoint work's ``checkpoint-io`` analysis, the "Slurm end to end" section) survive a rerun. Scripts
owned by others are run, not copied: bench/checkpoint_io.py prints Markdown and a final JSON line, which
bench/checkpoint_section.py turns into the ``checkpoint-io-run`` block with the target verdicts.

The trials on the local Slurm cluster (``python -m bench.chaos``, ``python -m bench.goodput``) are the
package bench/cluster/; they write their own sections and are not part of ``python -m bench``.

Results that a section or an extrapolation is rebuilt from are kept in bench/results/ (bench/kept.py),
committed with the page; such a section names the command that rewrites it from them (bench/report.py's
REWRITTEN), and tests/test_bench_pages.py checks that it comes out byte for byte.

The ``simulated`` section ("Simulated at scale") is ``python -m bench.simulated_table``: it renders the
kept ``relaytrain plan --simulate --json`` outputs of bench/results/simulated/ (``--run`` simulates rows
again; the rows are bench/simulated_rows.py), and is not part of ``python -m bench`` either.
"""
