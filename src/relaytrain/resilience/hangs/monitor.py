"""The job's hang monitor: a thread of the batch driver that watches every node's watcher while a step runs.

It lives outside the training processes and survives any one of them (a stopped rank 0 that hosts the
rendezvous store included). Every ``interval_s`` or so (``slow_ranks.sample_gap``) it reads the node
files the node watchers rewrite (``RunDir.hang_node``), turns them into ``detect.RankView`` s and
asks ``detect.assess``:

* a job that still moves may have a straggler: one ``straggler hint:`` line in the job log, a hint of the
  straggler concept (the straggler watch measures and acts; the hint restarts nothing);
* a job where no rank moved for longer than its limit hangs. Before anything is killed the monitor asks
  every node watcher for its ranks' stacks (``RunDir.hang_request``), writes the report
  (``RunDir.hang_report(step)``), prints one job-log line starting ``hang detected:``, records the hang
  for the end-of-step decision (``record.HangRecordFile``), then asks the watchers to end their
  ranks. The step ends; the decision restarts it in place (docs/resilience.md, Hangs).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from relaytrain.job import JobFacts, RunDir
from relaytrain.job.progress import Phase, ProgressRecord
from relaytrain.resilience.hangs.detect import (
    HangPolicy,
    RankView,
    Verdict,
    assess,
    hang_line,
)
from relaytrain.resilience.hangs.record import HangRecord, HangRecordFile
from relaytrain.resilience.hangs.report import render_report
from relaytrain.resilience.hangs.slow_ranks import SlowRankTracker, sample_gap
from relaytrain.resilience.hangs.watch import read_json, write_json

INTERVAL_S = 2.0
STACKS_WAIT_S = 20.0  # how long the watchers get to answer with their ranks' stacks
END_WAIT_S = 30.0  # how long the ranks get to die after the watchers were told, before srun is told
# A step that ended without a hang: per phase that set the job's limit, the pause nearest it (the bench's
# clean trials read it: how close a clean run came to a false detection, phase by phase)
NEAREST = "hang monitor: the pause nearest its limit, per phase:"


def rank_view(fields: dict[str, Any], node: str, read_at: float, now: float) -> RankView:
    """One rank of a node file its watcher wrote at ``read_at`` (time.time()), seen at ``now``; raises
    KeyError/TypeError/ValueError on a damaged one."""
    medians = {p: float(fields["medians"][p.label]) for p in Phase if p.label in fields["medians"]}
    pauses = {p: float(v) for p in Phase if (v := fields.get("pauses", {}).get(p.label)) is not None}
    record = ProgressRecord(
        rank=int(fields["rank"]),
        local_rank=int(fields["local_rank"]),
        pid=int(fields["pid"]),
        step=int(fields["step"]),
        phase=Phase(int(fields["phase_code"])),
        phase_started=float(fields["phase_started"]),
        updated=float(fields["updated"]),
        budget_s=float(fields["budget_s"]),
        collectives_entered=int(fields["collectives_entered"]),
        collectives_left=int(fields["collectives_left"]),
        collective=str(fields["collective"]),
        expected_collective=str(fields.get("expected_collective", "")),
        step_collectives=int(fields["step_collectives"]),
        last_step_collectives=int(fields["last_step_collectives"]),
        usual_step_collectives=int(fields["usual_step_collectives"]),
        medians=medians,
        marks=int(fields.get("marks", 0)),
        pauses=pauses,
    )
    # The file is up to a watcher interval old: the rank has been idle at least that much longer.
    idle = float(fields["idle_s"]) + max(now - read_at, 0.0)
    return RankView(record.rank, node, record, idle, str(fields["state"]), str(fields["wchan"]), read_at)


class HangMonitor:
    """Watches one job step; ``end_step`` ends it when the node watchers could not."""

    def __init__(
        self,
        run: RunDir,
        policy: HangPolicy,
        job: JobFacts,
        end_step: Callable[[], None],
        say: Callable[[str], None],
        interval_s: float = INTERVAL_S,
    ):
        self.run, self.policy, self.job = run, policy, job
        self.end_step, self.say, self.interval_s = end_step, say, interval_s
        self.slow = SlowRankTracker()
        self.verdict: Verdict | None = None
        self.longest = (0.0, 0.0)  # the longest time no rank moved without a hang, and the limit then
        # per phase that set the job's limit (its label): the pause that came nearest it, and the limit
        self.nearest: dict[str, tuple[float, float]] = {}
        self._stop = threading.Event()
        self._gaps = random.Random()  # the looks' spacing (slow_ranks.sample_gap)
        self._thread = threading.Thread(target=self._watch, name="hang-monitor", daemon=True)

    @staticmethod
    def forget_last(run: RunDir) -> None:
        """Before a step starts: an earlier step's request must not reach the new step's watchers (the
        record stays: it names its job, restart and step, and the benchmarks read it)."""
        with contextlib.suppress(OSError):
            run.hang_request.unlink()

    def start(self) -> HangMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=STACKS_WAIT_S + END_WAIT_S + 10)
        if self.verdict is None and self.longest[0] > 0:
            # How close a clean step came to its limit: the measure behind hang_floor_s's default.
            idle, limit = self.longest
            self.say(
                f"hang monitor: the longest pause of this step was {idle:.1f} s (limit then {limit:.0f} s)"
            )
        if self.verdict is None and self.nearest:
            per_phase = "; ".join(f"{p} {i:.1f} s of {x:.0f} s" for p, (i, x) in sorted(self.nearest.items()))
            self.say(f"{NEAREST} {per_phase}")

    def nodes(self) -> dict[str, dict[str, Any]]:
        """The node files of this job step, by node."""
        found = {}
        for path in sorted(self.run.hang_node("x").parent.glob("*.json")):
            data = read_json(path)
            if data is None or str(data.get("job_id")) != self.job.job_id:
                continue
            step = (data.get("restart_count"), data.get("step_restarts"))
            if step == (self.job.restart_count, self.job.step_restarts) and isinstance(
                data.get("ranks"), list
            ):
                found[str(data.get("node", path.stem))] = data
        return found

    def views(self, nodes: dict[str, dict[str, Any]] | None = None) -> list[RankView]:
        now, views = time.time(), []
        for node, data in (self.nodes() if nodes is None else nodes).items():
            try:
                read_at = float(data["time"])
                views += [rank_view(fields, node, read_at, now) for fields in data["ranks"]]
            except (KeyError, TypeError, ValueError, AttributeError):
                continue  # a damaged node file: that node's ranks count as not yet published
        return sorted(views, key=lambda v: v.rank)

    def check(self) -> Verdict | None:
        """One look at the job; the verdict when it hangs."""
        views = self.views()
        if not views:
            return None
        verdict = assess(views, self.policy, len(views))
        if verdict.hung:
            return verdict
        if verdict.limit_s < self.policy.cap_s:  # a phase bounded below the cap
            if verdict.idle_s > self.longest[0]:
                self.longest = (verdict.idle_s, verdict.limit_s)
            phase = verdict.limit_why.split(":", 1)[0].split(" in ", 1)[-1]  # `rank 1 in PHASE: why`
            idle, limit = self.nearest.get(phase, (0.0, 1.0))
            if verdict.idle_s / verdict.limit_s > idle / limit:
                self.nearest[phase] = (verdict.idle_s, verdict.limit_s)
        self.slow.sample(views, time.monotonic())
        line = self.slow.report(time.monotonic())
        if line:
            self.say(line)
        return None

    def _watch(self) -> None:
        while not self._stop.wait(sample_gap(self.interval_s, self._gaps)):
            verdict = self.check()
            if verdict is not None:
                self.verdict = verdict
                self.act(verdict)
                return

    def act(self, verdict: Verdict) -> None:
        job = self.job
        ident = f"{job.job_id}.{job.restart_count}.{job.step_restarts}.{int(time.time())}"
        request = {
            "id": ident,
            "job_id": job.job_id,
            "restart_count": job.restart_count,
            "step_restarts": job.step_restarts,
            "step": verdict.step,
        }
        write_json(self.run.hang_request, {**request, "end": False})
        nodes = self.nodes()
        stacks = self.wait_for_stacks(ident, list(nodes))
        report = self.run.hang_report(verdict.step)
        relative = self.run.relative(report)
        with contextlib.suppress(OSError):
            report.parent.mkdir(parents=True, exist_ok=True)
            report.write_text(render_report(verdict, self.views(nodes), stacks, job.job_id), encoding="utf-8")
        line = hang_line(verdict, relative)
        print(line, flush=True)  # the job log's line starts with it (no stamp in front)
        culprits = tuple(asdict(c) for c in verdict.culprits)
        record = HangRecord(
            job_id=job.job_id,
            step_restarts=job.step_restarts,
            step=verdict.step,
            detected_at=time.time(),
            idle_s=verdict.idle_s,
            limit_s=verdict.limit_s,
            culprits=culprits,
            line=line,
            report=relative,
            restart_count=job.restart_count,
        )
        HangRecordFile(self.run).write(record)
        write_json(self.run.hang_request, {**request, "end": True})
        if self._stop.wait(END_WAIT_S):
            return  # the step ended
        self.say(f"the ranks are still running {END_WAIT_S:g} s after the hang: ending the job step")
        self.end_step()

    def wait_for_stacks(self, ident: str, nodes: list[str]) -> dict[str, str]:
        stacks: dict[str, str] = {}
        deadline = time.monotonic() + STACKS_WAIT_S
        while len(stacks) < len(nodes) and time.monotonic() < deadline and not self._stop.is_set():
            for node in nodes:
                if node in stacks:
                    continue
                with contextlib.suppress(OSError):
                    text = self.run.hang_stacks(node).read_text(encoding="utf-8", errors="replace")
                    if text.startswith(f"<!-- request {ident} -->"):
                        stacks[node] = text.split("\n", 1)[1] if "\n" in text else ""
            time.sleep(0.2)
        for node in nodes:
            stacks.setdefault(node, f"(node {node}'s watcher did not answer within {STACKS_WAIT_S:g} s)")
        return stacks
