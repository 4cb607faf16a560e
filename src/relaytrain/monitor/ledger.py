"""The time ledger: where every second of every allocation of a run went, from what the run recorded.

An *allocation* is one run of one Slurm job (a requeue is a new one; its Start..End from sacct, else the
run's own first and last record of it), or, outside Slurm, one process of the trainer (its start to its
last record). Each allocation is cut into spans, each in one bucket (``BUCKETS``), from three kinds of
``metrics.jsonl`` records:

* the batch job's driver (``kind: job``): ``job_start``, ``step_start`` and ``step_end`` of every job step
  (a hang's detection time and idle seconds on the step it ended), ``job_end``;
* the trainer's ``start``/``resume`` event: when its process began (``process_start``), when restoring
  began (``restore_start``) and from which tier (``restored_from``); the event's own time ends restoring;
* the trainer's ``ledger`` windows (``monitor/time_ledger.py``): the steps ``from_step``..``step`` and the
  seconds of the window, split into step time, checkpoint blocking, snapshot blocking, the steps slowed
  by a snapshot's background work, and evaluation; then its ``stop`` or ``finished`` event.

Spans are laid one after the other in time; what no record covers is ``unaccounted``, never spread over
the other buckets, so the buckets always add up to the allocation. A span whose bucket a rule chose rather
than a record that measured it (a tail from the last record to a step's or Slurm's end, a process's stop
that no window closed) is marked ``inferred`` with the rule; `relaytrain verify` counts inferred time with
`unaccounted` unless another source confirms it (monitor/ledger_check.py). Step time goes to ``replayed`` for
steps an earlier window already ran (a resume from an older checkpoint), else to ``productive``: each
step counts as productive once. After a crash, the time from the step's last window to the step's end
is ``lost`` (steps that ran but were not kept, and the failure's detection), and so is the time after
the last window of a process outside Slurm that died (a later process followed without its stop);
after a hang, the part from the last progress to the monitor's detection is ``hang``. A ``resume`` inside a
job step is a lost rank replaced while the others stayed (``resilience.survivors``): the steps since the
last window are ``lost``, the fault (its ``recovery`` event) to the restore ``restart``. Time between
allocations is queue time, shown apart: it is wall-clock, not allocation.

This module holds the buckets and the `Ledger`; `ledger_spans.py` builds one. Pure: records and
allocations in, a ``Ledger`` out (`relaytrain status`, `report`, `verify`, the benchmarks and the
trainer's TensorBoard goodput all read this one computation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# In the order a report lists them; `productive` first, `unaccounted` last.
BUCKETS = (
    "productive",
    "startup",
    "restore",
    "replayed",
    "checkpoint",
    "snapshot",
    "eval",
    "hang",
    "restart",
    "lost",
    "stop",
    "unaccounted",
)
BUCKET_MEANING = {
    "productive": "training steps, each step counted once",
    "startup": "allocation start to the first step: batch script, launch, imports, process group, model",
    "restore": "loading the training state (node memory, a peer node, or a DCP checkpoint)",
    "replayed": "steps run again after resuming from an older checkpoint or snapshot",
    "checkpoint": "steps blocked by a DCP checkpoint save",
    "snapshot": "steps blocked by an in-memory snapshot, and steps slowed by its background work",
    "eval": "evaluation",
    "hang": "from a hang's last progress to its detection",
    "restart": "a failed job step's end to the next step's start, a restarted step's start-up, and a lost "
    "rank's replacement while the others stay (survivors)",
    "lost": "after a crash: steps since the last record (not kept) and the failure's detection",
    "stop": "the stop: the last save and the exit, at a signal, a time limit or the end",
    "unaccounted": "time no record covers",
}
WINDOW_PARTS = ("checkpoint", "snapshot", "snapshot_slowdown", "eval")


@dataclass(frozen=True)
class Allocation:
    """One run of a job (``job_id`` None: a process outside Slurm), its Start..End and who said so."""

    job_id: str | None
    restart: int
    start: float
    end: float
    source: str  # "sacct" or "records"
    running: bool = False  # not ended yet: `end` is when it was asked, the time since the last record open


@dataclass
class Span:
    start: float
    end: float
    bucket: str
    detail: str = ""
    inferred: str = ""  # the rule that chose the bucket where no record measured the span ("": measured)

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)


@dataclass
class JobTime:
    """One allocation's spans, in time order, covering it where records allow."""

    allocation: Allocation
    spans: list[Span] = field(default_factory=list)

    @property
    def label(self) -> str:
        a = self.allocation
        if a.job_id is None:
            return f"process {a.restart}" if a.restart else "process"
        return f"job {a.job_id}" + (f" (requeue {a.restart})" if a.restart else "")

    @property
    def seconds(self) -> float:
        return self.allocation.end - self.allocation.start

    def buckets(self) -> dict[str, float]:
        out = dict.fromkeys(BUCKETS, 0.0)
        for span in self.spans:
            out[span.bucket] += span.seconds
        return out

    def inferred(self) -> dict[str, float]:
        """Seconds per bucket of the spans inferred by rule (buckets with none left out)."""
        out: dict[str, float] = {}
        for span in self.spans:
            if span.inferred:
                out[span.bucket] = out.get(span.bucket, 0.0) + span.seconds
        return out


@dataclass
class Ledger:
    jobs: list[JobTime]
    queue_s: float

    @property
    def allocated_s(self) -> float:
        return sum(job.seconds for job in self.jobs)

    @property
    def buckets(self) -> dict[str, float]:
        out = dict.fromkeys(BUCKETS, 0.0)
        for job in self.jobs:
            for name, seconds in job.buckets().items():
                out[name] += seconds
        return out

    @property
    def inferred(self) -> dict[str, float]:
        """Seconds per bucket inferred by rule, over all allocations."""
        out: dict[str, float] = {}
        for job in self.jobs:
            for name, seconds in job.inferred().items():
                out[name] = out.get(name, 0.0) + seconds
        return out

    @property
    def goodput(self) -> float | None:
        allocated = self.allocated_s
        return self.buckets["productive"] / allocated if allocated > 0 else None

    def losses(self) -> list[tuple[str, float]]:
        """The buckets other than productive, largest first, those with any time."""
        lost = [(name, s) for name, s in self.buckets.items() if name != "productive" and s > 0]
        return sorted(lost, key=lambda item: -item[1])

    def as_json(self) -> dict[str, Any]:
        return {
            "allocated_s": round(self.allocated_s, 6),
            "queue_s": round(self.queue_s, 3),
            "goodput": None if self.goodput is None else round(self.goodput, 5),
            "buckets": {name: round(s, 6) for name, s in self.buckets.items()},
            "inferred_s": round(sum(self.inferred.values()), 6),
            "inferred": {name: round(s, 6) for name, s in self.inferred.items()},
            "jobs": [
                {
                    "label": job.label,
                    "job_id": job.allocation.job_id,
                    "restart": job.allocation.restart,
                    "start": job.allocation.start,
                    "end": job.allocation.end,
                    "source": job.allocation.source,
                    "buckets": {name: round(s, 6) for name, s in job.buckets().items() if s > 0},
                    "inferred_s": round(sum(job.inferred().values()), 6),
                }
                for job in self.jobs
            ],
        }

    def summary(self, largest: int = 3) -> list[str]:
        """A few lines: goodput of the allocated time, then the largest losses."""
        allocated = self.allocated_s
        if self.goodput is None:
            return ["no allocated time recorded yet"]
        jobs = len(self.jobs)
        head = (
            f"{self.goodput:.1%} of {duration(allocated)} allocated ({jobs} allocation{'s' * (jobs != 1)}"
            + (f"; {duration(self.queue_s)} queued between them, not counted" if self.queue_s >= 0.5 else "")
            + ")"
        )
        losses = ", ".join(
            f"{name} {s / allocated:.1%} ({duration(s)})" for name, s in self.losses()[:largest]
        )
        lines = [head] + ([f"largest losses: {losses}"] if losses else [])
        unaccounted, inferred = self.buckets["unaccounted"], sum(self.inferred.values())
        lines.append(
            f"measured {1 - (unaccounted + inferred) / allocated:.1%}, inferred by rule "
            f"{inferred / allocated:.1%} ({duration(inferred)}), unaccounted "
            f"{unaccounted / allocated:.1%} ({duration(unaccounted)})"
        )
        return lines


def duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
