"""The sections of docs/benchmarks.md that no command rebuilds from kept results, each with the reason.

Every section of the page is one of three kinds, and tests/test_bench_pages.py holds each to its kind:

* rebuilt from kept results: it says "Rewritten from the kept results by `COMMAND`" and the test runs
  COMMAND against a copy of the page and requires the section to come out byte for byte;
* written from code alone (`FROM_CODE`: how to run, links; no measured figure): the test compares it with
  the function that writes it;
* listed here (`UNKEPT`): a transcription of runs whose raw output was lost, or figures measured by hand.
  Kept history (a reason that starts with `HISTORY`) names the kept results files its figures come from
  (`sources`, each named in the section and present under bench/results/), or says that none holds them.
  The section says its reason word for word, and its text is pinned by its SHA-256: a hand edit of any
  figure in it fails the test as surely as in a rebuilt section. A correction of the transcription
  itself changes the digest here, in the same commit, where a reviewer sees it.

A section leaves this list when a run keeps its results and the section is rebuilt from them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Unkept:
    reason: str  # said in the section, word for word
    sha256: str  # of the section's text between its markers
    sources: tuple[str, ...] = ()  # kept history: the results files its figures come from


HISTORY = "Kept history, not rebuilt:"
NO_SOURCE = "no results file holds these figures"
STRAGGLER_RUNS = tuple(f"2026-11-28-{t}" for t in ("0558", "0628", "0700", "0916", "0946", "1243", "1503"))
STRAGGLER_RUNS += ("2026-11-28-1548", "2026-11-28-1622", "2026-11-28-1828", "2026-12-07-0126")
STRAGGLER_RUNS += ("2026-12-07-0437",)


def sources_line(unkept: Unkept) -> str:
    """The sentence by which a kept-history section names the results files its figures come from."""
    return "Kept results it draws on: " + ", ".join(f"`{path}`" for path in unkept.sources) + "."


def digest(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


GPU_RUN = (
    "Transcribed, not rebuilt: the raw output of this GPU run (2026-11-27) was not kept; the GPU scripts "
    "now keep each run's results under bench/results/ and rewrite this section from them."
)

UNKEPT: dict[str, Unkept] = {
    "straggler-history": Unkept(
        f"{HISTORY} the straggler rule's tuning history, moved from docs/resilience.md; its figures come "
        'from the kept runs named below, which the sections "Stragglers" and "Straggler rules, replayed" '
        "rebuild.",
        "357b0f6d9687d64ce9bbf20dc12c16b50fa758bcd71fd822dde1c67999cb1d31",
        tuple(f"bench/results/stragglers-{t}.json" for t in STRAGGLER_RUNS),
    ),
    "checkpoint-history": Unkept(
        f"{HISTORY} measured by hand while the checkpoint code was written (moved from "
        f"docs/checkpointing.md); {NO_SOURCE}.",
        "b0a215f8729f540130fb9b4ebad1ccd981b0110237cb02ff881b93b258df8f77",
    ),
    "config-error": Unkept(
        "Measured by hand, not rebuilt: no command measures or keeps these timings.",
        "cfed531da20326d8ed5f559c108742aaad0fa2cc74f14dcbe377b6d6bbf2fc9e",
    ),
    "checkpoint-io": Unkept(
        "Transcribed, not rebuilt: an analysis of three runs of `python bench/checkpoint_io.py` whose "
        "outputs were not kept.",
        "0b59667a5e50ea3608965924d85c146d0b87ffef36ba2a578b2d65d434356445",
    ),
    "snapshots": Unkept(
        "Transcribed, not rebuilt: written by hand from runs of `python bench/snapshot.py` whose own "
        "results were not kept (two of them transcribed into kept files, named below).",
        "4581ce770d61275375bda2b945a98bbbb991e0c891b080b7939d11d499435a14",
    ),
    "torchtitan": Unkept(GPU_RUN, "538cc549b956df2b8d05975bf79aa92f7a11f181ef83058e0a90921c8808f460"),
    "gpu-first-hour": Unkept(GPU_RUN, "261c91d01e91b0c7cbd5d2ff9fcc1f4db110a73909ab8d56966eaacd4648db12"),
    "slurm-e2e": Unkept(
        "Measured by hand, not rebuilt: the figures are the `e2e timing:` lines the tests printed, copied "
        "by hand; no results were kept.",
        "f8644f344694dbd03c7f428c4c5e690531433d35521d8c3f9823b3534bb36f67",
    ),
    "goodput": Unkept(
        "Transcribed, not rebuilt: the raw results of these runs (2026-11-23) were not kept, and no file "
        "under bench/results/ holds the preemption and time-limit rows; `python -m bench.goodput` now keeps "
        "each run's results, from which a new run rebuilds this section.",
        "a1908533868dc63b4aab96438d62bf2aaf68137bb7b33da250e6a528647bf6ce",
    ),
    "simulated-findings": Unkept(
        "Transcribed, not rebuilt: each figure is from the simulation that found the problem, before its "
        "fix; those outputs were not kept.",
        "4f69332b99940971cde37853ee7a25627344ca4e6d606ceb9711946957a2405b",
    ),
}

# Sections with no measured figure, written by a function of the bench code: "module:function".
FROM_CODE: dict[str, str] = {
    "usage": "bench.__main__:usage_section",
    "links": "bench.__main__:links_section",
}
