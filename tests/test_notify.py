"""Alerts ([notify], relaytrain.resilience.batch.notify): the events a run's records tell, the bounded queue
that never blocks, retries, the webhook's URL as a secret, the messages; and a real run under the batch driver
(a fake srun, no Slurm) whose events reach a real HTTP receiver in order, each once, with losses that do
not change when the receiver is down."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from relaytrain.config import config_to_toml, load_config
from relaytrain.config.schema import NOTIFY_EVENTS, NotifyConfig
from relaytrain.errors import ConfigError
from relaytrain.job import JobFacts, RunDir
from relaytrain.resilience.batch.notify import Alerts, Watcher, at_job_end
from relaytrain.resilience.batch.notify_send import (
    Alert,
    DeliveryError,
    NotifyError,
    Outbox,
    body,
    command_sender,
    webhook_sender,
    webhook_url,
)
from relaytrain.resilience.run_state import RunState, RunStateFile

import faults
from conftest import TINY, child_env, fake_tool, losses_by_step

SECRET = "https://hooks.example.invalid/services/T000/B000/s3cr3t-t0ken"


# --- the receiver ---------------------------------------------------------------------------------------


class Receiver:
    """A local HTTP server in a thread that keeps each POSTed JSON body; `fail` answers 500 instead."""

    def __init__(self, fail: int = 0, host: str = "127.0.0.1"):
        self.bodies: list[dict] = []
        self.fail = fail  # how many requests to refuse first
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                data = self.rfile.read(int(self.headers["Content-Length"]))
                if outer.fail > 0:
                    outer.fail -= 1
                    self.send_response(500)
                else:
                    outer.bodies.append(json.loads(data))
                    self.send_response(200)
                self.end_headers()

            def log_message(self, *_args):
                pass

        self.server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/hook"  # nothing listens once it is closed


# --- the queue ------------------------------------------------------------------------------------------


def test_post_never_waits_and_a_full_queue_drops_and_counts():
    entered, release = threading.Event(), threading.Event()
    sent: list[str] = []

    def stuck(alert: Alert) -> None:
        entered.set()
        release.wait(10)
        sent.append(alert.event)

    box = Outbox([stuck], size=2, retries=0, backoff_s=0, say=lambda _: None)
    box.post(Alert("started"))
    assert entered.wait(5)  # the thread holds the first; two more fit the queue
    began = time.monotonic()
    results = [box.post(Alert(name)) for name in ("stopped", "requeued", "failed", "finished")]
    assert time.monotonic() - began < 0.5, "post waited"
    assert results == [True, True, False, False]
    release.set()
    counts = box.close(5)
    assert sent == ["started", "stopped", "requeued"]  # in order, each once
    assert (counts.sent, counts.dropped, counts.failed, counts.unsent) == (3, 2, 0, 0)


def test_a_failed_delivery_is_retried_with_doubling_waits_then_counted():
    tries: list[float] = []

    def flaky(alert: Alert) -> None:
        tries.append(time.monotonic())
        if alert.event == "failed" or len(tries) < 3:
            raise DeliveryError("webhook: HTTP 503")

    said: list[str] = []
    box = Outbox([flaky], size=10, retries=2, backoff_s=0.1, say=said.append)
    box.post(Alert("started"))  # fails twice, then goes through
    box.post(Alert("failed"))  # fails three times: counted
    counts = box.close(10)
    assert (counts.sent, counts.failed, counts.retries) == (1, 1, 4)
    waits = [b - a for a, b in zip(tries, tries[1:], strict=False)]
    assert waits[0] >= 0.1 and waits[1] >= 0.2, waits  # 0.1, then 0.2
    assert said == ["alert failed not delivered (webhook: HTTP 503; 3 tries)"]


def test_a_webhook_that_answers_500_is_tried_again_and_gets_the_alert_once():
    receiver = Receiver(fail=3)
    said: list[str] = []
    try:
        send = webhook_sender(f"{receiver.url}?token=s3cr3t", "json", "r", "7", timeout_s=5)
        box = Outbox([send], size=10, retries=1, backoff_s=0.01, say=said.append)
        box.post(Alert("started", 0))  # refused twice: failed, and the line names no secret
        box.post(Alert("finished", 10))  # refused once, then taken
        counts = box.close(10)
    finally:
        receiver.close()
    assert [b["event"] for b in receiver.bodies] == ["finished"]
    assert (counts.sent, counts.retries, counts.failed) == (1, 2, 1)
    assert said == ["alert started not delivered (webhook: HTTP 500; 2 tries)"]


def test_a_sender_that_hangs_costs_the_job_at_most_the_drain_time():
    box = Outbox([lambda _alert: time.sleep(30)], size=10, retries=0, backoff_s=0, say=lambda _: None)
    for name in ("started", "stopped", "finished"):
        box.post(Alert(name))
    began = time.monotonic()
    counts = box.close(0.3)
    assert time.monotonic() - began < 3
    assert (counts.sent, counts.unsent) == (0, 3)


def test_a_sender_that_raises_anything_is_counted_not_raised():
    def broken(_alert: Alert) -> None:
        raise KeyError("oops")

    counts = Outbox([broken], size=1, retries=0, backoff_s=0, say=lambda _: None)
    counts.post(Alert("started"))
    assert counts.close(5).failed == 1


# --- the secret -----------------------------------------------------------------------------------------


def test_the_url_comes_from_a_0600_file_or_the_environment(tmp_path):
    secret = tmp_path / "hook"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    assert webhook_url(NotifyConfig(url_file=str(secret)), {}) == SECRET
    assert webhook_url(NotifyConfig(url_env="MY_HOOK"), {"MY_HOOK": SECRET}) == SECRET
    assert webhook_url(NotifyConfig(), {"MY_HOOK": SECRET}) == ""


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_a_url_file_others_may_read_is_refused_in_one_line_that_names_no_secret(tmp_path, mode):
    secret = tmp_path / "hook"
    secret.write_text(SECRET)
    secret.chmod(mode)
    with pytest.raises(NotifyError) as refused:
        webhook_url(NotifyConfig(url_file=str(secret)), {})
    message = str(refused.value)
    assert message == (
        f"notify.url_file {secret} may be read by group or others (mode {mode:04o}); it holds a secret: "
        f"run `chmod 600 {secret}`"
    )


def test_a_missing_or_wrong_url_is_named_without_its_value(tmp_path):
    with pytest.raises(NotifyError, match="names MY_HOOK, which the job's environment does not set"):
        webhook_url(NotifyConfig(url_env="MY_HOOK"), {})
    with pytest.raises(NotifyError) as wrong:
        webhook_url(NotifyConfig(url_env="MY_HOOK"), {"MY_HOOK": "ftp://s3cr3t-t0ken"})
    assert "s3cr3t" not in str(wrong.value) and "does not hold an http:// or https:// URL" in str(wrong.value)


def test_a_url_file_that_is_not_text_is_refused(tmp_path):
    secret = tmp_path / "hook"
    secret.write_bytes(b"\xff\xfe")
    secret.chmod(0o600)
    with pytest.raises(NotifyError, match="does not hold an http:// or https:// URL"):
        webhook_url(NotifyConfig(url_file=str(secret)), {})


def test_the_toml_cannot_hold_the_url_and_unknown_events_are_refused():
    with pytest.raises(ConfigError, match=r"notify.url_env='https://.*' is not allowed: must be '' or an"):
        load_config(None, [f"--notify.url_env={SECRET}"])
    with pytest.raises(ConfigError, match="notify.url"):
        load_config(None, [f"--notify.url={SECRET}"])
    with pytest.raises(ConfigError) as unknown:
        load_config(None, ['--notify.events=["started","crashed"]'])
    assert str(unknown.value).splitlines() == [
        "notify.events[1]='crashed' is not allowed: must be an event: "
        + ", ".join(repr(n) for n in NOTIFY_EVENTS)
    ]


def test_launch_refuses_a_url_file_others_may_read_and_takes_a_0600_one(tmp_path):
    secret = tmp_path / "hook"
    secret.write_text(SECRET)
    secret.chmod(0o644)
    config = Path(__file__).resolve().parents[1] / "configs" / "debug.toml"
    args = [
        "launch",
        str(config),
        "--dry-run",
        f"--run.dir={tmp_path / 'runs'}",
        f"--notify.url_file={secret}",
    ]
    done = subprocess.run([sys.executable, "-m", "relaytrain.cli", *args], cwd=tmp_path, env=child_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "may be read by group or others (mode 0644)" in done.stderr, done.stderr
    assert "s3cr3t" not in done.stdout + done.stderr
    secret.chmod(0o600)
    done = subprocess.run([sys.executable, "-m", "relaytrain.cli", *args], cwd=tmp_path, env=child_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "s3cr3t" not in done.stdout + done.stderr
    written = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    assert written and not [p for p in written if "s3cr3t" in p.read_text(errors="replace")]


def test_a_failed_webhook_names_no_secret():
    url = closed_port_url() + "/s3cr3t-t0ken"
    send = webhook_sender(url, "slack", "r", "7", timeout_s=2)
    with pytest.raises(DeliveryError) as failed:
        send(Alert("started", 0))
    assert "s3cr3t" not in str(failed.value) and "127.0.0.1" not in str(failed.value), failed.value


# --- the messages ---------------------------------------------------------------------------------------


def test_the_slack_body_is_one_text_line_and_the_json_body_the_events_fields():
    alert = Alert("stopped", 120, {"reason": "preemption", "saved": True}, time=1700000000.25)
    assert json.loads(body(alert, "slack", "llama", "4242")) == {
        "text": "[relaytrain] run llama (job 4242): stopped at step 120: reason=preemption, saved=True"
    }
    assert json.loads(body(alert, "json", "llama", "4242")) == {
        "event": "stopped", "run": "llama", "job_id": "4242", "step": 120, "time": 1700000000.25,
        "reason": "preemption", "saved": True,
    }  # fmt: skip


def test_the_command_gets_the_event_on_stdin_and_its_name_in_the_environment(tmp_path):
    out = tmp_path / "got"
    send = command_sender(f'{{ cat; echo; echo "$RELAYTRAIN_EVENT"; }} > {out}', "r", None, 10)
    send(Alert("hang", 7, {"idle_s": 90.0}))
    stdin, name = out.read_text().splitlines()
    assert json.loads(stdin)["idle_s"] == 90.0 and json.loads(stdin)["event"] == "hang" and name == "hang"
    with pytest.raises(DeliveryError, match="command: exit 3: no route"):
        command_sender("echo no route >&2; exit 3", "r", None, 10)(Alert("hang"))


def test_following_the_records_reads_each_whole_line_once(tmp_path):
    from relaytrain.job.jsonl import read_from

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"a": 1}\n{"b": 2}\n{"c"')
    records, offset = read_from(path, 0)
    assert records == [{"a": 1}, {"b": 2}]
    assert read_from(path, offset) == ([], offset)  # the line being written waits
    with open(path, "a") as f:
        f.write(": 3}\n")
    records, offset = read_from(path, offset)
    assert records == [{"c": 3}] and offset == path.stat().st_size
    path.write_text('{"d": 4}\n')  # replaced by a shorter file: from its start
    assert read_from(path, offset)[0] == [{"d": 4}]
    assert read_from(tmp_path / "none", 5) == ([], 5)


# --- the events -----------------------------------------------------------------------------------------


def records_of_a_crash_restart_and_finish() -> list[dict]:
    return [
        {"kind": "job", "event": "job_start", "step": 0},
        {"kind": "job", "event": "step_start", "step": 0},
        {"kind": "event", "event": "start", "step": 0, "nodes": 1, "time": 1.0},
        {"kind": "train", "step": 1, "loss": 5.0},
        {"kind": "event", "event": "straggler", "step": 1, "rank": 1, "node": "n2", "time": 2.0},
        {"kind": "job", "event": "step_end", "step": 0, "exit_code": 137,
         "hang": {"detected_at": 3.0, "idle_s": 60}},
        {"kind": "event", "event": "step_restart", "step": 0, "reason": "crash", "exit_code": 137,
         "nodes_left_out": ["n2"], "nodes_note": "n2 named twice", "time": 4.0},
        {"kind": "job", "event": "step_start", "step": 0},
        {"kind": "event", "event": "resume", "step": 1, "time": 5.0},
        {"kind": "event", "event": "stop", "step": 2, "reason": "preemption", "saved": True, "time": 6.0},
        {"kind": "event", "event": "finished", "step": 3, "time": 7.0},
    ]  # fmt: skip


def test_the_run_records_become_the_events_in_order():
    watcher = Watcher(no_progress_s=0)
    alerts = [a for r in records_of_a_crash_restart_and_finish() for a in watcher.feed(r, 0.0)]
    assert [(a.event, a.step) for a in alerts] == [
        ("started", 0), ("straggler", 1), ("hang", 1), ("crash_restart", 1), ("node_excluded", 1),
        ("started", 1), ("stopped", 2), ("finished", 3),
    ]  # fmt: skip
    assert alerts[0].fields == {"resumed": False, "nodes": 1} and alerts[5].fields["resumed"] is True
    assert alerts[4].fields == {"nodes": ["n2"], "why": "n2 named twice"}
    assert "nodes_left_out" not in alerts[3].fields and alerts[3].fields["exit_code"] == 137
    assert "reason" not in alerts[3].fields


@pytest.mark.parametrize("reason", ["preflight", "straggler"])
def test_a_restart_after_a_stop_that_was_no_crash_tells_only_its_excluded_nodes(reason):
    restart = {
        "kind": "event",
        "event": "step_restart",
        "step": 0,
        "reason": reason,
        "exit_code": 89,
        "nodes_left_out": ["n2"],
        "nodes_note": f"left out: n2, named by {reason}",
        "time": 4.0,
    }
    assert [a.event for a in Watcher(no_progress_s=0).feed(restart, 0.0)] == ["node_excluded"]
    older = {k: v for k, v in restart.items() if k != "reason"}  # a record written before the reason was
    assert [a.event for a in Watcher(no_progress_s=0).feed(older, 0.0)] == ["crash_restart", "node_excluded"]


def test_no_progress_is_told_once_per_stall_while_a_step_runs():
    watcher = Watcher(no_progress_s=60)
    watcher.feed({"kind": "job", "event": "step_start"}, -1000.0)  # a step that never logs one
    assert [(a.event, a.step) for a in watcher.tick(-939.0)] == [("no_progress", None)]
    watcher.feed({"kind": "job", "event": "step_start"}, 0.0)
    watcher.feed({"kind": "train", "step": 5}, 10.0)
    assert watcher.tick(69.0) == []
    (alert,) = watcher.tick(71.0)
    assert (alert.event, alert.step, alert.fields) == ("no_progress", 5, {"minutes": 1.0})
    assert watcher.tick(200.0) == []  # once
    watcher.feed({"kind": "train", "step": 5}, 210.0)  # not a new step
    assert watcher.tick(300.0) == []
    watcher.feed({"kind": "train", "step": 6}, 310.0)  # it moves again: armed again
    assert [a.event for a in watcher.tick(371.0)] == ["no_progress"]
    watcher.feed({"kind": "job", "event": "step_end", "exit_code": 0}, 400.0)
    watcher.feed({"kind": "train", "step": 7}, 400.0)
    assert watcher.tick(10_000.0) == []  # no step runs: nothing to judge


def test_the_job_end_tells_a_requeue_or_a_failure_this_job_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "55")
    run, job = RunDir(tmp_path), JobFacts.from_env()
    me = job.identity()
    assert at_job_end(run, job) == []
    RunStateFile(run).write(
        RunState.of("stopped", "preemption", 40, requeue_requested=True, requeued=True, **me)
    )
    assert [(a.event, a.step, a.fields) for a in at_job_end(run, job)] == [
        ("requeued", 40, {"reason": "preemption"})
    ]
    RunStateFile(run).write(RunState.of("failed", "nan", 41, message="loss is NaN", **me))
    assert [(a.event, a.fields) for a in at_job_end(run, job)] == [
        ("failed", {"reason": "nan", "error": "loss is NaN"})
    ]
    RunStateFile(run).write(RunState.of("finished", "max_steps", 50, **me))
    assert at_job_end(run, job) == []
    RunStateFile(run).write(RunState.of("failed", "nan", 41, **{**me, "restart_count": 1}))
    assert at_job_end(run, job) == []  # another job's record


def test_the_driver_sends_only_the_picked_events_and_records_its_counts(tmp_path, receiver):
    config = tmp_path / "run.toml"
    cfg = load_config(None, ['--notify.events=["started","finished"]', "--notify.url_env=HOOK",
                             "--notify.format=json"])  # fmt: skip
    config.write_text(config_to_toml(cfg))
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    said: list[str] = []
    alerts = Alerts.start(run, str(config), said.append, {"HOOK": receiver.url})
    assert alerts is not None
    with open(run.metrics, "a") as f:
        for record in records_of_a_crash_restart_and_finish():
            f.write(json.dumps(record) + "\n")
    counts = alerts.close(JobFacts.from_env({}))
    assert [(b["event"], b["step"]) for b in receiver.bodies] == [
        ("started", 0),
        ("started", 1),
        ("finished", 3),
    ]
    assert (counts.sent, counts.failed) == (3, 0) and said == []
    last = json.loads(run.metrics.read_text().splitlines()[-1])
    assert last["kind"] == "job" and last["event"] == "notify" and last["sent"] == 3


def test_no_alerts_without_a_destination_and_one_line_for_a_bad_secret(tmp_path):
    config = tmp_path / "run.toml"
    secret = tmp_path / "hook"
    secret.write_text(SECRET)
    secret.chmod(0o644)
    config.write_text(config_to_toml(load_config(None, [])))
    said: list[str] = []
    assert Alerts.start(RunDir(tmp_path), str(config), said.append, {}) is None and said == []
    config.write_text(config_to_toml(load_config(None, [f"--notify.url_file={secret}"])))
    assert Alerts.start(RunDir(tmp_path), str(config), said.append, {}) is None
    refused = f"notify.url_file {secret} may be read by group or others (mode 0644)"
    assert said == [f"no webhook alerts: {refused}; it holds a secret: run `chmod 600 {secret}`"]


# --- a real run under the driver ------------------------------------------------------------------------

# srun's stand-in: the first step is killed (SIGKILL) once the run logged step 5; the restart runs through.
CRASHING_SRUN = """while [[ $1 == -* ]]; do shift; done
if [[ $RELAYTRAIN_STEP_RESTARTS == 0 ]]; then
  "$@" & pid=$!
  until grep -q '"kind": "train", "step": 5,' "$RUN_DIR/metrics.jsonl" 2>/dev/null; do
    kill -0 $pid 2>/dev/null || exit 1; sleep 0.02
  done
  kill -9 $pid; wait $pid; exit 137
fi
exec "$@"
"""


def drive_a_crashing_run(tmp_path: Path, name: str, notify: list[str], env: dict[str, str]) -> Path:
    """The batch driver runs a tiny single-process training run that is killed once and finishes after
    a restart in place; the run directory."""
    run = [f"--run.dir={tmp_path / 'runs'}", f"--run.name={name}", "--train.max_steps=10"]
    cfg = load_config(
        None, [*TINY, *run, "--checkpoint.interval=2", "--resilience.hang_timeout_s=0", *notify]
    )
    run_dir = tmp_path / "runs" / name
    run_dir.mkdir(parents=True)
    config = run_dir / "config.toml"
    config.write_text(config_to_toml(cfg))
    bin_dir = tmp_path / "bin"
    fake_tool(bin_dir, "srun", CRASHING_SRUN)
    fake_tool(bin_dir, "scontrol", "exit 0\n")
    command = [sys.executable, "-m", "relaytrain.resilience.batch.driver", "--run-dir", str(run_dir),
               "--config", str(config), "--nodes", "node1", "--",
               sys.executable, "-m", "relaytrain.cli", "train", str(config)]  # fmt: skip
    fault = faults.env(step_delay_s=0.05)  # steps slow enough for the kill to land mid-run
    child = child_env(SLURM_JOB_ID="777", RUN_DIR=str(run_dir), PATH=f"{bin_dir}:{os.environ['PATH']}",
                      **fault, **env)  # fmt: skip
    done = subprocess.run(command, env=child, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "job step finished with exit code 137" in done.stdout, done.stdout[-4000:]
    assert SECRET_PART not in done.stdout + done.stderr
    return run_dir


SECRET_PART = "s3cr3t"


def notify_record(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (record,) = [r for r in records if r.get("kind") == "job" and r.get("event") == "notify"]
    return record


@pytest.mark.slow
def test_a_real_run_that_crashes_once_and_finishes_tells_the_receiver_its_events(tmp_path, receiver):
    url = f"{receiver.url}?token={SECRET_PART}"
    up = drive_a_crashing_run(
        tmp_path, "up", ["--notify.url_env=HOOK", "--notify.format=json"], {"HOOK": url}
    )
    events = [(b["event"], b["step"], b.get("resumed")) for b in receiver.bodies]
    assert [e[0] for e in events] == ["started", "crash_restart", "started", "finished"], receiver.bodies
    assert events[0] == ("started", 0, False) and events[2][2] is True and events[3][1] == 10
    assert receiver.bodies[1]["exit_code"] == 137 and receiver.bodies[1]["step"] >= 5  # the step it reached
    assert {b["job_id"] for b in receiver.bodies} == {"777"}
    assert notify_record(up) | {"time": 0} == {
        **notify_record(up), "time": 0, "sent": 4, "failed": 0, "dropped": 0, "unsent": 0, "retries": 0
    }  # fmt: skip

    # The receiver down: every delivery fails and is counted; the losses are those of a run without [notify].
    down_url = closed_port_url() + f"?token={SECRET_PART}"
    quick = ["--notify.url_env=HOOK", "--notify.retries=1", "--notify.backoff_s=0.05"]
    down = drive_a_crashing_run(tmp_path, "down", quick, {"HOOK": down_url})
    plain = drive_a_crashing_run(tmp_path, "plain", [], {})
    assert notify_record(down)["failed"] == 4 and notify_record(down)["sent"] == 0
    assert not [r for r in (plain / "metrics.jsonl").read_text().splitlines() if '"event": "notify"' in r]
    assert losses_by_step(down) == losses_by_step(plain) == losses_by_step(up)
    assert sorted(losses_by_step(plain)) == list(range(1, 11))
