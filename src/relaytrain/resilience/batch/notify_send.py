"""Alerts' delivery (``[notify]``, the events: ``notify.py``): the webhook's URL, the message, the senders
(a webhook: a Slack-compatible ``{"text": ...}`` body or the event's fields as JSON; a command: the event
as JSON on its stdin) and ``Outbox``, the bounded queue and its one thread.

``post`` never waits: an alert that finds the queue full is dropped and counted. Each delivery has a
timeout and is retried with doubling waits; one that fails after them is counted, never raised. The URL
is a secret: it comes from an environment variable or a file only its owner may read (mode 0600), never
from the TOML, and no message names it.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import stat
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relaytrain.config.schema import NotifyConfig
from relaytrain.errors import UserError

log = logging.getLogger(__name__)

EVENT_ENV = "RELAYTRAIN_EVENT"  # a notify.command's environment: the event's name
MAX_BACKOFF_S = 300.0


class NotifyError(UserError):
    """[notify] cannot deliver: its URL is missing, not a URL, or in a file others may read."""


@dataclass(frozen=True)
class Alert:
    event: str  # one of NOTIFY_EVENTS
    step: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)


# --- the secret ---------------------------------------------------------------------------------------


def webhook_url(cfg: NotifyConfig, environ: Mapping[str, str]) -> str:
    """The webhook's URL ("" for none) from ``notify.url_file`` or ``notify.url_env``. NotifyError when the
    file may be read by others, or what it names holds no http(s) URL; the URL is never in the message."""
    if cfg.url_file:
        path = Path(cfg.url_file).expanduser()
        try:
            mode = path.stat().st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise NotifyError(
                    f"notify.url_file {path} may be read by group or others (mode {stat.S_IMODE(mode):04o}); "
                    f"it holds a secret: run `chmod 600 {path}`"
                )
            url = path.read_text(encoding="utf-8").strip()
        except OSError as error:
            raise NotifyError(f"notify.url_file {path} cannot be read: {error.strerror}") from None
        except UnicodeDecodeError:
            raise NotifyError(f"notify.url_file {path} does not hold an http:// or https:// URL") from None
        where = f"notify.url_file {path}"
    elif cfg.url_env:
        url = environ.get(cfg.url_env, "").strip()
        if not url:
            raise NotifyError(f"notify.url_env names {cfg.url_env}, which the job's environment does not set")
        where = f"${cfg.url_env} (notify.url_env)"
    else:
        return ""
    if not url.startswith(("http://", "https://")) or any(c.isspace() for c in url):
        raise NotifyError(f"{where} does not hold an http:// or https:// URL")
    return url


# --- the message --------------------------------------------------------------------------------------


def payload(alert: Alert, run: str, job_id: str | None) -> dict[str, Any]:
    """The generic JSON body (and a command's stdin): the event, the run, the job, the step, its fields."""
    head = {"event": alert.event, "run": run, "job_id": job_id, "step": alert.step}
    return {**head, "time": round(alert.time, 3), **alert.fields}


def _value(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value) or "none"
    return str(value)


def text(alert: Alert, run: str, job_id: str | None) -> str:
    """One line for a person (the Slack body): `[relaytrain] run NAME (job ID): EVENT at step N: k=v, ...`."""
    where = f"[relaytrain] run {run}" + (f" (job {job_id})" if job_id else "")
    step = f" at step {alert.step}" if alert.step is not None else ""
    details = ", ".join(f"{k}={_value(v)}" for k, v in alert.fields.items() if v not in (None, "", []))
    return f"{where}: {alert.event}{step}" + (f": {details}" if details else "")


def body(alert: Alert, fmt: str, run: str, job_id: str | None) -> bytes:
    """The webhook's JSON body: slack, ``{"text": ...}``; json, ``payload``."""
    data = {"text": text(alert, run, job_id)} if fmt == "slack" else payload(alert, run, job_id)
    return json.dumps(data, default=str).encode("utf-8")


# --- delivery -----------------------------------------------------------------------------------------

Sender = Callable[[Alert], None]  # delivers one alert or raises


class DeliveryError(Exception):
    """One try failed; the message names no secret."""


def webhook_sender(url: str, fmt: str, run: str, job_id: str | None, timeout_s: float) -> Sender:
    def send(alert: Alert) -> None:
        request = urllib.request.Request(
            url,
            data=body(alert, fmt, run, job_id),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:  # noqa: S310 (http(s) only)
                answer.read(1024)
        except urllib.error.HTTPError as error:
            raise DeliveryError(f"webhook: HTTP {error.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as error:
            why = getattr(error, "reason", error)
            raise DeliveryError(f"webhook: {type(why).__name__}: {str(why).replace(url, '<url>')}") from None

    return send


def command_sender(command: str, run: str, job_id: str | None, timeout_s: float) -> Sender:
    def send(alert: Alert) -> None:
        stdin = json.dumps(payload(alert, run, job_id), default=str)
        env = {**os.environ, EVENT_ENV: alert.event}
        try:
            done = subprocess.run(
                ["/bin/sh", "-c", command],
                input=stdin,
                text=True,
                env=env,
                capture_output=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            raise DeliveryError(f"command: no exit within {timeout_s:g} s") from None
        except OSError as error:
            raise DeliveryError(f"command: {error.strerror}") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or [""])[-1][:200]
            raise DeliveryError(f"command: exit {done.returncode}" + (f": {last}" if last else ""))

    return send


@dataclass
class Counts:
    sent: int = 0  # alerts every sender took
    failed: int = 0  # alerts a sender refused after every retry
    dropped: int = 0  # alerts that found the queue full
    unsent: int = 0  # alerts still queued when the job ended
    retries: int = 0  # tries after a failed one


class Outbox:
    """A bounded queue of alerts and the one thread that delivers them in order. ``post`` never waits."""

    def __init__(
        self,
        senders: list[Sender],
        size: int,
        retries: int,
        backoff_s: float,
        say: Callable[[str], None] = log.warning,
    ):
        self.senders, self.retries, self.backoff_s, self.say = senders, retries, backoff_s, say
        self.queue: queue.Queue[Alert] = queue.Queue(maxsize=size)
        self.counts = Counts()
        self._stop = threading.Event()  # set: the job ends now, no more waiting
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="relaytrain-notify", daemon=True)
        self._thread.start()

    def post(self, alert: Alert) -> bool:
        try:
            self.queue.put_nowait(alert)
            return True
        except queue.Full:
            with self._lock:
                self.counts.dropped += 1
            self.say(f"alert {alert.event} dropped: {self.queue.maxsize} alerts wait to be sent")
            return False

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                alert = self.queue.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                ok = all([self._deliver(send, alert) for send in self.senders])
                with self._lock:
                    if ok:
                        self.counts.sent += 1
                    else:
                        self.counts.failed += 1
            finally:
                self.queue.task_done()

    def _deliver(self, send: Sender, alert: Alert) -> bool:
        for attempt in range(self.retries + 1):
            if attempt:
                with self._lock:
                    self.counts.retries += 1
                if self._stop.wait(min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempt - 1))):
                    break  # the job ends: no more waiting
            try:
                send(alert)
                return True
            except Exception as error:  # noqa: BLE001  (a sender's failure is counted, never raised)
                why = str(error) if isinstance(error, DeliveryError) else type(error).__name__
        self.say(f"alert {alert.event} not delivered ({why}; {attempt + 1} tries)")
        return False

    def close(self, drain_s: float) -> Counts:
        """Deliver what is queued for at most ``drain_s`` seconds, then stop; what is left counts unsent."""
        deadline = time.monotonic() + drain_s
        while self.queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(timeout=max(1.0, min(drain_s, 5.0)))
        with self._lock:
            self.counts.unsent = self.queue.qsize() + (1 if self._thread.is_alive() else 0)
            return Counts(**vars(self.counts))
