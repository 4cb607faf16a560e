"""The proof that a run's surviving steps consumed every global sample exactly once, in order.

Reads every rank's sample record (data/consumption.py) across all jobs and restarts of a run.

**The lineage rule.** A resumed run replays the steps after its checkpoint: a step may be recorded by
several attempts, and only one of them survived. Records are grouped in segments, one per `begin` line:
an attempt (one start of the processes, its id shared by its ranks) from the step and sample chain it
started at, until its next `begin` (a NaN rollback reloaded the state) or its end. Segments are ordered
as rank 0's record lists them (rank 0 exists in every attempt). The lineage is followed backwards:

- it ends with the last segment, at the step the run recorded it reached (run_state.json), else at the
  last step that segment recorded;
- a segment that began at step b > 0 from chain c continues the newest earlier segment that recorded
  step b with chain c: the state it resumed (checkpoint or snapshot) is the one that step produced;
- it starts with a segment that began at step 0 from the start of the chain.

The steps of a segment in the lineage are those after its begin up to the begin of its successor; steps
it trained past that point were lost work, replayed by the successor (counted, not checked). Since the
chain is part of the data position a checkpoint keeps, a segment that resumed a position no recorded
step produced cannot continue any segment: that is a violation, not a guess.

**What is checked**, for every step s of the lineage, with G the run's global batch (train.
global_batch_size) and D the step's data-parallel size: each data-parallel rank r read global samples
`[(s-1)G + rG/D, (s-1)G + (r+1)G/D)` as an uninterrupted run does; the recorded digest is that index
list's; the loader's chain is the uninterrupted run's; and, over all steps, the ranges tile `[0, SG)`:
no sample skipped, none repeated. The sampler maps global sample indices to each source's windows, one
permutation per epoch (tests/test_data_loader.py); so each sample of each epoch is read exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relaytrain.data.consumption import CHAIN_START, CHAIN_UNKNOWN, chain_next, range_digest, record_files
from relaytrain.errors import UserError
from relaytrain.job import jsonl
from relaytrain.job.rundir import RunDir

_BEGIN = {"attempt": str, "dp_rank": int, "dp_size": int, "begin": int, "chain": str}
_STEP = {"attempt": str, "dp_rank": int, "dp_size": int, "step": int, "first": int, "count": int}
_STEP |= {"digest": str, "chain": str}


@dataclass
class Segment:
    """One attempt's records from one `begin` on: the steps it trained, each with every rank's record."""

    key: tuple[str, int]  # (attempt, how many begins that attempt wrote before this one)
    begin: int
    chain: str
    steps: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)  # step -> rank -> record
    data: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> its begin line's fingerprint

    def name(self) -> str:
        return f"attempt {self.key[0]}" + (f" (after reload {self.key[1]})" if self.key[1] else "")

    def chain_after(self, step: int) -> str | None:
        records = self.steps.get(step, {})
        return records[min(records)]["chain"] if records else None


@dataclass
class SampleReport:
    violations: list[str]
    steps: int = 0  # the lineage's last step
    samples: int = 0
    segments: int = 0
    replayed: int = 0  # steps recorded outside the lineage (trained, then lost and trained again)

    def summary(self) -> str:
        if not self.steps:
            return "no training step recorded"
        return (
            f"steps 1-{self.steps}: global samples [0, {self.samples}) each consumed once, in the "
            f"order of an uninterrupted run ({self.segments} segment(s) in the lineage, "
            f"{self.replayed} replayed step record(s) outside it)"
        )


def _check_shape(record: dict[str, Any], rank: int) -> dict[str, Any]:
    shape = _BEGIN if "begin" in record else _STEP
    for key, kind in shape.items():
        if not isinstance(record.get(key), kind) or isinstance(record.get(key), bool):
            raise UserError(
                f"the sample record of rank {rank} is damaged: {key!r} missing or not {kind.__name__}"
            )
    return record


def read_segments(run: RunDir) -> tuple[list[Segment], list[str]]:
    """The segments in rank 0's order, and violations of the records' own consistency."""
    segments: dict[tuple[str, int], Segment] = {}
    order: list[tuple[str, int]] = []
    problems: list[str] = []
    for rank, path in record_files(run):
        begins: dict[str, int] = {}
        for record in (_check_shape(r, rank) for r in jsonl.read(path).records):
            attempt = record["attempt"]
            if "begin" in record:
                key = (attempt, begins.get(attempt, 0))
                begins[attempt] = key[1] + 1
                seg = segments.setdefault(key, Segment(key, record["begin"], record["chain"]))
                if isinstance(record.get("data"), dict):
                    seg.data[rank] = record["data"]
                if rank == 0:
                    order.append(key)
                if (seg.begin, seg.chain) != (record["begin"], record["chain"]):
                    problems.append(
                        f"{seg.name()}: rank {rank} started at step {record['begin']}, rank 0 "
                        f"at step {seg.begin} (or from another sample chain)"
                    )
                continue
            if attempt not in begins:
                damage = f"attempt {attempt} has a step before its begin line"
                raise UserError(f"the sample record of rank {rank} is damaged: {damage}")
            seg = segments[(attempt, begins[attempt] - 1)]
            seg.steps.setdefault(record["step"], {})[rank] = record
    for key in segments.keys() - set(order):
        problems.append(f"{segments[key].name()} has records of other ranks but none of rank 0")
    return [segments[key] for key in order], problems


def lineage(
    segments: list[Segment], reached: int | None = None
) -> tuple[list[tuple[Segment, int, int]], list[str]]:
    """(segment, first step, last step) of the surviving lineage, oldest first; violations of the rule.
    `reached`: the step the run recorded it reached (run_state.json), where the lineage ends (a crash
    can leave a record of the step that was being read when it struck)."""
    if not segments:
        return [], []
    index = len(segments) - 1
    parts, problems = [], []
    end = max(segments[index].steps, default=segments[index].begin)
    if reached is not None and reached > end:
        problems.append(f"the run reached step {reached} but its sample records end at step {end}")
    elif reached is not None:
        end = max(reached, segments[index].begin)
    while True:
        seg = segments[index]
        parts.append((seg, seg.begin + 1, end))
        if seg.begin == 0:
            if seg.chain != CHAIN_START:
                problems.append(f"{seg.name()} started at step 0 from a loader that had consumed samples")
            break
        if seg.chain == CHAIN_UNKNOWN:
            problems.append(
                f"{seg.name()} resumed at step {seg.begin} from a checkpoint written before sample records "
                f"existed: steps 1-{seg.begin} cannot be verified"
            )
            break
        parents = [i for i in range(index) if segments[i].chain_after(seg.begin) == seg.chain]
        if not parents:
            problems.append(
                f"{seg.name()} resumed at step {seg.begin} from a data position no recorded step produced "
                f"(sample chain {seg.chain})"
            )
            break
        index, end = parents[-1], seg.begin
    return list(reversed(parts)), problems


Range = tuple[int, int, str]  # [start, end) of global sample indices, and which step and rank read them


def _step_problems(seg: Segment, step: int, global_batch: int) -> tuple[list[str], list[Range]]:
    """Violations of one lineage step, and its ranges (start, end, who) for the exactly-once sweep."""
    records = seg.steps.get(step)
    if not records:
        return [f"step {step}: no sample record ({seg.name()} trained it)"], []
    sizes = {r["dp_size"] for r in records.values()}
    if len(sizes) != 1:
        return [f"step {step}: ranks disagree on the data-parallel size ({sorted(sizes)})"], []
    (dp,) = sizes
    problems, ranges = [], []
    for dp_rank in range(dp):
        views = {(r["first"], r["count"], r["digest"]) for r in records.values() if r["dp_rank"] == dp_rank}
        who = f"step {step}, dp rank {dp_rank}/{dp}"
        if len(views) != 1:
            problems.append(f"{who}: " + ("no record" if not views else "its ranks read different samples"))
            continue
        ((first, count, digest),) = views
        ranges.append((first, first + count, who))
        share = global_batch // dp
        want = (step - 1) * global_batch + dp_rank * share
        if (first, count) != (want, share):
            problems.append(
                f"{who}: read global samples [{first}, {first + count}), an uninterrupted run "
                f"reads [{want}, {want + share})"
            )
        if digest != range_digest(first, count):
            problems.append(
                f"{who}: the digest of the indices read is not that of [{first}, {first + count})"
            )
    return problems, ranges


def _coverage(ranges: list[Range], start: int, total: int) -> list[str]:
    """Gaps (skipped samples) and overlaps (repeated samples) of the lineage's ranges over [start, total)."""
    problems, reached, last = [], start, "the start"
    for start, end, who in sorted(ranges):
        if start > reached:
            problems.append(f"global samples [{reached}, {start}) were never consumed (skipped after {last})")
        elif start < reached:
            problems.append(
                f"global samples [{start}, {min(end, reached)}) were consumed twice ({last}, then {who})"
            )
        if end > reached:
            reached, last = end, who
    if reached < total:
        problems.append(f"global samples [{reached}, {total}) were never consumed (skipped after {last})")
    return problems


def check_samples(run: RunDir, global_batch: int, reached: int | None = None) -> SampleReport:
    """Every violation of exactly-once, in-order consumption along the run's surviving lineage, which ends
    at step `reached` when the run recorded one (see `lineage`)."""
    if not run.sample_records.is_dir():
        return SampleReport([f"no sample records in {run.sample_records} (the run never trained a step)"])
    segments, problems = read_segments(run)
    parts, rule = lineage(segments, reached)
    problems += rule
    ranges: list[Range] = []
    start_step = parts[0][1] if parts else 1  # after step 1 when the lineage could not be followed back
    chain, chain_broken, steps = CHAIN_START, start_step != 1, 0
    for seg, first_step, last_step in parts:
        for step in range(first_step, last_step + 1):
            step_problems, step_ranges = _step_problems(seg, step, global_batch)
            problems += step_problems
            ranges += step_ranges
            chain = chain_next(chain, (step - 1) * global_batch, global_batch)
            if not chain_broken and seg.chain_after(step) not in (None, chain):
                chain_broken = True
                why = "the position it resumed had consumed other samples; later steps not compared"
                problems.append(
                    f"step {step}: the loader's sample chain is not an uninterrupted run's ({why})"
                )
            steps = step
    problems += _coverage(ranges, (start_step - 1) * global_batch, steps * global_batch)
    in_lineage = sum(last - first + 1 for _, first, last in parts)
    recorded = sum(len(seg.steps) for seg in segments)
    return SampleReport(problems, steps, steps * global_batch, len(parts), recorded - in_lineage)
