"""Alerts (``[notify]``): the batch job's driver tells the run's owner what happens to the run.

The events come from where the run already records them, never from a second source: the driver follows
the run's ``metrics.jsonl`` (the trainer's ``start``/``resume``, ``stop``, ``finished`` and ``straggler``
events; the end-of-step decision's ``step_restart``: ``crash_restart`` for a crash's, ``node_excluded``
alone for a restart after preflight's or a straggler's stop; the driver's own ``step_start``/``step_end``
records, a hang on the latter) and, at the job's end, reads ``run_state.json`` (requeued, failed). It judges
``no_progress`` itself: a job step runs and the step count has not advanced for
``notify.no_progress_min`` minutes. The driver survives the ranks, so it tells of their crashes.

Delivery never blocks nor fails the training (``notify_send.py``): ``Outbox`` is a bounded queue served
by one thread (an event that finds the queue full is dropped and counted), each delivery has a timeout
and is retried with doubling waits, and at the job's end the driver gives what is still queued
``notify.drain_s`` seconds.
The counts (sent, failed, dropped, unsent) go into ``metrics.jsonl`` as a ``notify`` job record.

The webhook's URL is a secret: it comes from an environment variable (``notify.url_env``) or a file only
its owner may read (``notify.url_file``, mode 0600), never from the TOML, and no line names it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from relaytrain.config.schema import NOTIFY_EVENTS, NotifyConfig
from relaytrain.job import JobFacts, RunDir
from relaytrain.job.jsonl import append_job_record, read_from
from relaytrain.resilience.batch.notify_send import (
    Alert,
    Counts,
    NotifyError,
    Outbox,
    Sender,
    command_sender,
    webhook_sender,
    webhook_url,
)
from relaytrain.resilience.requeue import EXCLUDED_FACT
from relaytrain.resilience.run_state import RunStateFile, RunStatus

POLL_S = 1.0  # how often the driver reads the run's new records
_RECORD_KEYS = ("kind", "event", "time", "job_id", "restart", "step_restart")  # not an alert's own fields


# --- the events, from the run's records ---------------------------------------------------------------


def _own_fields(record: Mapping[str, Any], *drop: str) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in _RECORD_KEYS and k not in drop and k != "step"}


class Watcher:
    """Turns the run's records, as they are appended, into alerts; judges ``no_progress``. Pure: the
    caller hands it the records and the clock."""

    def __init__(self, no_progress_s: float):
        self.no_progress_s = no_progress_s
        self.running = False  # a job step runs
        self.step: int | None = None  # the highest step a record of this job step named
        self.moved = 0.0  # when it last advanced (or the step started)
        self.told = False  # no_progress told since then

    def feed(self, record: Mapping[str, Any], now: float) -> list[Alert]:
        kind, event, step = record.get("kind"), record.get("event"), record.get("step")
        step = step if isinstance(step, int) else None
        if kind == "job":
            if event == "step_start":
                self.running, self.step, self.moved, self.told = True, None, now, False
            elif event == "step_end":
                self.running = False
                hang = record.get("hang")
                if isinstance(hang, dict):
                    return [Alert("hang", self.step, {"exit_code": record.get("exit_code"), **hang})]
            return []
        if step is not None and (self.step is None or step > self.step):
            self.step, self.moved, self.told = step, now, False
        if kind != "event":
            return []
        if event in ("start", "resume"):
            fields = {"resumed": event == "resume", "nodes": record.get("nodes")}
            return [Alert("started", step, fields, _time(record))]
        if event == "stop":
            return [Alert("stopped", step, _own_fields(record), _time(record))]
        if event == "finished":
            return [Alert("finished", step, {}, _time(record))]
        if event == "straggler":
            return [Alert("straggler", step, _own_fields(record), _time(record))]
        if event == "step_restart":
            # the step the crashed step had logged last (the decision's is the run's record, older)
            step = self.step if self.step is not None else step
            restart = _own_fields(record, "nodes_left_out", "nodes_note", "reason")
            # a restart after preflight's or a straggler's stop is no crash: only its nodes are told
            crashed = record.get("reason", "crash") == "crash"
            alerts = [Alert("crash_restart", step, restart, _time(record))] if crashed else []
            if record.get("nodes_left_out"):
                excluded = {"nodes": record["nodes_left_out"], "why": record.get("nodes_note")}
                alerts.append(Alert("node_excluded", step, excluded, _time(record)))
            return alerts
        return []

    def tick(self, now: float) -> list[Alert]:
        if not self.running or self.told or self.no_progress_s <= 0 or now - self.moved < self.no_progress_s:
            return []
        self.told = True
        return [Alert("no_progress", self.step, {"minutes": round((now - self.moved) / 60, 1)})]


def _time(record: Mapping[str, Any]) -> float:
    value = record.get("time")
    return float(value) if isinstance(value, int | float) else time.time()


def at_job_end(run: RunDir, job: JobFacts) -> list[Alert]:
    """What run_state.json says this job ended with: requeued (and the nodes its ExcNodeList got), or
    failed (nothing for a stop or a finish, which their events told)."""
    record = RunStateFile(run).read()
    if record is None or not record.written_by(job):
        return []
    if record.requeued or record.requeue_requested:
        alerts = [Alert("requeued", record.step, {"reason": record.reason})]
        excluded = record.fact(EXCLUDED_FACT)
        if isinstance(excluded, list) and excluded:
            why = f"the requeued job's next allocation excludes them (ExcNodeList), after: {record.reason}"
            alerts.append(Alert("node_excluded", record.step, {"nodes": excluded, "why": why}))
        return alerts
    if record.status is RunStatus.FAILED:
        why = {"reason": record.reason, "error": record.user_error or record.message}
        return [Alert("failed", record.step, why)]
    return []


# --- the driver's alerts ------------------------------------------------------------------------------


class Alerts:
    """The batch driver's alerts: a thread that follows the run's records and the outbox that sends them.
    ``start`` returns None when [notify] sends nowhere (or cannot: it says why once)."""

    def __init__(self, run: RunDir, cfg: NotifyConfig, senders: list[Sender], say: Callable[[str], None]):
        self.run, self.cfg, self.say = run, cfg, say
        self.events = set(cfg.events)
        self.outbox = Outbox(senders, cfg.queue_size, cfg.retries, cfg.backoff_s, say)
        self.watcher = Watcher(cfg.no_progress_min * 60)
        try:
            self.offset = run.metrics.stat().st_size  # this job's records only
        except OSError:
            self.offset = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="relaytrain-notify-records", daemon=True)

    @classmethod
    def start(
        cls, run: RunDir, config: str, say: Callable[[str], None], environ: Mapping[str, str] | None = None
    ) -> Alerts | None:
        environ = os.environ if environ is None else environ
        try:
            from relaytrain.config import load_config

            cfg = load_config(config).notify
        except Exception as error:  # noqa: BLE001  (no alerts, the job runs on)
            say(f"no alerts: cannot read the run's config {config}: {error}")
            return None
        job_id = JobFacts.from_env(environ).job_id or None
        senders: list[Sender] = []
        try:
            url = webhook_url(cfg, environ)
        except NotifyError as error:
            say(f"no webhook alerts: {error}")
            url = ""
        if url:
            senders.append(webhook_sender(url, cfg.format, run.root.name, job_id, cfg.timeout_s))
        if cfg.command:
            senders.append(command_sender(cfg.command, run.root.name, job_id, cfg.timeout_s))
        if not senders or not cfg.events:
            return None
        try:
            alerts = cls(run, cfg, senders, say)
            alerts._thread.start()
        except RuntimeError as error:  # no thread to spare: the job runs on without alerts
            say(f"no alerts: {error}")
            return None
        return alerts

    def emit(self, alerts: Iterable[Alert]) -> None:
        for alert in alerts:
            if alert.event in self.events:
                self.outbox.post(alert)

    def poll(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        records, self.offset = read_from(self.run.metrics, self.offset)
        for record in records:
            self.emit(self.watcher.feed(record, now))
        self.emit(self.watcher.tick(now))

    def _follow(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.poll()
            except Exception as error:  # noqa: BLE001  (alerts stop; the job goes on)
                self.say(f"alerts stopped: {type(error).__name__}: {error}")
                return

    def close(self, job: JobFacts) -> Counts:
        """The job ends: the last records, what run_state.json says, at most drain_s to send them, then
        the counts into metrics.jsonl (a `notify` job record)."""
        self._stop.set()
        self._thread.join(timeout=POLL_S + 5)
        try:
            self.poll()
            self.emit(at_job_end(self.run, job))
        except Exception as error:  # noqa: BLE001
            self.say(f"alerts: the job's last events are unknown: {type(error).__name__}: {error}")
        counts = self.outbox.close(self.cfg.drain_s)
        try:
            append_job_record(self.run, "notify", **vars(counts))
        except OSError as error:
            self.say(f"could not record the alerts' counts in {self.run.metrics}: {error}")
        if counts.failed or counts.dropped or counts.unsent:
            self.say(
                f"alerts: {counts.sent} sent, {counts.failed} failed, {counts.dropped} dropped, "
                f"{counts.unsent} unsent"
            )
        return counts


__all__ = ["NOTIFY_EVENTS", "Alert", "Alerts", "Counts", "NotifyError", "Outbox", "Watcher", "webhook_url"]
