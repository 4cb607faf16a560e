"""Read a run's metrics.jsonl (and gpu/*.csv) back and stitch requeued jobs into one history.

A run spread over several SLURM jobs appends to one metrics.jsonl. Records are grouped into
*segments*: a new segment starts when ``(job_id, restart, step_restart)`` changes or a
``start``/``resume`` event appears (so local resumes count too); ``step_restart`` counts the job steps
started again inside the allocation after a crash (restarts in place). A job that resumed from an
older checkpoint logs some steps again; the later record for a step wins.
"""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relaytrain.errors import UserError
from relaytrain.job import RunDir, jsonl

START_EVENTS = ("start", "resume")


@dataclass
class Segment:
    """The records of one job (or one local resume), in file order."""

    index: int
    job_id: str | None
    restart: int
    records: list[dict[str, Any]] = field(default_factory=list)
    step_restart: int = 0  # > 0: the job step was started again in place after a crash
    # The previous segment ended with `finished` and this one trains on (train.max_steps raised): a
    # continuation the user asked for, not a restart, so no time or steps are lost to it.
    extends_finished: bool = False

    @property
    def key(self) -> tuple[str | None, int, int]:
        return self.job_id, self.restart, self.step_restart

    @property
    def start_time(self) -> float:
        return self.records[0]["time"]

    @property
    def end_time(self) -> float:
        return self.records[-1]["time"]

    @property
    def train(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["kind"] == "train"]

    def resume_step(self) -> int | None:
        """Where this segment picked up: its resume event, else just before its first train step."""
        for r in self.records:
            if r["kind"] == "event" and r.get("event") == "resume":
                return int(r["step"])
        train = self.train
        return int(train[0]["step"]) if train else None

    def event(self, name: str) -> dict[str, Any] | None:
        return next((r for r in self.records if r["kind"] == "event" and r.get("event") == name), None)

    @property
    def nodes(self) -> int | None:
        """Nodes this segment ran on (its start/resume event), None in older metrics."""
        start = self.event("resume") or self.event("start")
        return start.get("nodes") if start else None

    @property
    def resize_note(self) -> str:
        """`resized 2 -> 1 nodes (4 -> 2 ranks)` when this segment resumed on another layout, else ""."""
        ev = self.event("resize")
        if ev is None:
            return ""
        return (
            f"resized {ev.get('from_nodes')} -> {ev.get('nodes')} nodes "
            f"({ev.get('from_world_size')} -> {ev.get('world_size')} ranks)"
        )

    @property
    def finished(self) -> bool:
        """The segment's last event is `finished`: the run reached train.max_steps here."""
        events = [r for r in self.records if r["kind"] == "event"]
        return bool(events) and events[-1].get("event") == "finished"

    @property
    def label(self) -> str:
        if self.job_id is not None:
            notes = [f"requeue {self.restart}"] if self.restart else []
            notes += [f"restart in place {self.step_restart}"] if self.step_restart else []
            return f"job {self.job_id}" + (f" ({', '.join(notes)})" if notes else "")
        if self.index == 0:
            return "local run"
        return f"local {'extension' if self.extends_finished else 'resume'} {self.index}"


@dataclass
class History:
    """Stitched view: one train/eval record per step, all events, the segments."""

    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    events: list[dict[str, Any]]
    segments: list[Segment]
    skipped_lines: int = 0
    # the straggler windows' per-rank medians (`rank_times` records: rank<R>_<phase>_s), one per step
    rank_times: list[dict[str, Any]] = field(default_factory=list)

    @property
    def start_time(self) -> float:
        return self.segments[0].start_time

    @property
    def restarts(self) -> int:
        """Segments after the first that resumed an unfinished run in a new job, a requeue or a local
        resume (an extension is not a restart; a restart in place is counted apart)."""
        return sum(1 for seg in self.segments[1:] if not seg.extends_finished and not seg.step_restart)

    @property
    def restarts_in_place(self) -> int:
        """Job steps started again inside their allocation after a crash."""
        return sum(1 for seg in self.segments[1:] if seg.step_restart)

    def lost_time(self) -> tuple[float, int]:
        """(seconds, steps) lost to restarts.

        Walks train records in file order keeping the furthest step reached (the frontier).
        When a later job first gets past the frontier, the wall time since the frontier was set,
        less the time the new steps themselves took, is time lost to the restart: queueing,
        startup, checkpoint loading and recomputing steps an older checkpoint did not hold.
        """
        lost_s, lost_steps = 0.0, 0
        frontier_step, frontier_time, frontier_seg = None, 0.0, -1
        for seg in self.segments:
            if seg.extends_finished:
                frontier_seg = seg.index  # picks up where the finished run ended: nothing lost
            resume = seg.resume_step()
            if frontier_step is not None and resume is not None and seg.index != frontier_seg:
                lost_steps += max(frontier_step - resume, 0)
            for rec in seg.train:
                step = rec["step"]
                if frontier_step is not None and step <= frontier_step:
                    continue
                if frontier_step is not None and seg.index != frontier_seg:
                    new_work = (step - frontier_step) * (rec.get("time_step_s") or 0.0)
                    lost_s += max(rec["time"] - frontier_time - new_work, 0.0)
                frontier_step, frontier_time, frontier_seg = step, rec["time"], seg.index
        return lost_s, lost_steps


def read_records(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Records of a metrics.jsonl in file order, and how many lines could not be parsed
    (a job killed mid-write can leave a torn last line)."""
    if not path.is_file():
        raise UserError(f"no metrics file at {path}: is this a run directory written by `relaytrain train`?")
    found = jsonl.read(path)
    records, skipped = [], found.skipped
    for rec in found.records:
        if "step" not in rec or "time" not in rec:
            skipped += 1
            continue
        rec.setdefault("kind", "train")
        records.append(rec)
    if not records:
        raise UserError(f"{path} holds no metric records yet: let the run log at least one step")
    return records, skipped


def build_history(records: list[dict[str, Any]], skipped_lines: int = 0) -> History:
    segments: list[Segment] = []
    for rec in records:
        if rec["kind"] == "job":  # the batch job's driver (the time ledger's): not a training segment
            continue
        key = (rec.get("job_id"), int(rec.get("restart") or 0), int(rec.get("step_restart") or 0))
        starts = rec["kind"] == "event" and rec.get("event") in START_EVENTS
        current = segments[-1] if segments else None
        if current is None or current.key != key or (starts and current.records):
            extends = current is not None and current.finished
            current = Segment(len(segments), key[0], key[1], step_restart=key[2], extends_finished=extends)
            segments.append(current)
        current.records.append(rec)
    latest: dict[str, dict[int, dict[str, Any]]] = {"train": {}, "eval": {}, "rank_times": {}}
    for rec in records:
        if rec["kind"] in latest:
            latest[rec["kind"]][int(rec["step"])] = rec  # file order: the later record wins
    return History(
        train=[latest["train"][s] for s in sorted(latest["train"])],
        eval=[latest["eval"][s] for s in sorted(latest["eval"])],
        events=[r for r in records if r["kind"] == "event"],
        segments=segments,
        skipped_lines=skipped_lines,
        rank_times=[latest["rank_times"][s] for s in sorted(latest["rank_times"])],
    )


def load_history(run: RunDir) -> History:
    records, skipped = read_records(run.metrics)
    return build_history(records, skipped)


def read_gpu_csvs(gpu_dir: Path) -> dict[str, list[dict[str, float]]]:
    """Per host: samples ``{"time", "util_gpu_pct", "power_w", "mem_used_mib"}`` averaged over
    the host's GPUs (utilisation, memory) or summed (power)."""
    hosts: dict[str, list[dict[str, float]]] = {}
    for path in sorted(gpu_dir.glob("*.csv")) if gpu_dir.is_dir() else []:
        by_time: dict[float, list[dict[str, str]]] = {}
        with open(path, newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                try:
                    by_time.setdefault(float(row["time"]), []).append(row)
                except (KeyError, TypeError, ValueError):
                    continue  # a torn last line
        samples = []
        for t in sorted(by_time):
            rows = by_time[t]
            sample = {"time": t}
            for key, reduce in (
                ("util_gpu_pct", statistics.fmean),
                ("power_w", sum),
                ("mem_used_mib", statistics.fmean),
            ):
                values = [float(r[key]) for r in rows if r.get(key) not in (None, "")]
                sample[key] = reduce(values) if values else float("nan")
            samples.append(sample)
        if samples:
            hosts[path.stem] = samples
    return hosts
