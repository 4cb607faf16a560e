"""run_state.json has one reader and writer (relaytrain.resilience.run_state): a typed record whose status
is an enum of the strings the file holds, a file of an earlier version still reads, a damaged or foreign
file is one clear line, and the batch script asks Python whether a requeue is pending."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from relaytrain.job import JobFacts, RunDir
from relaytrain.resilience.batch.crash import classify
from relaytrain.resilience.run_state import (
    RunState,
    RunStateError,
    RunStateFile,
    RunStatus,
    recorded_checkpoint_step,
)

from conftest import child_env

JOB = JobFacts.from_env({"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2"})
# Written by the previous version (handle_stop after a UserError in a Slurm job): the error lived only in
# the message, as repr(UserError(...)), and there was no user_error field.
EARLIER_VERSION = """{
 "exit_code": 1,
 "host": "vm",
 "job_id": "41",
 "message": "UserError('checkpoint save of step 20 failed: no space')",
 "reason": "error",
 "requeue_id": "41",
 "requeue_pending": false,
 "requeue_requested": false,
 "requeued": false,
 "restart_count": 2,
 "saved": false,
 "status": "failed",
 "step": 20,
 "step_restarts": 0,
 "time": "2026-11-27T00:43:58+00:00",
 "unix_time": 1795740238.737
}
"""


@pytest.mark.parametrize("status", list(RunStatus))
def test_each_status_round_trips_as_the_string_the_file_holds(tmp_path, status):
    run = RunDir(tmp_path)
    written = RunStateFile(run).write(RunState.of(status, "why", 7, job_id="41", exit_code=3))
    on_disk = json.loads(run.run_state.read_text())
    assert (
        on_disk["status"] == status.value
        and on_disk["exit_code"] == 3
        and on_disk["requeue_pending"] is False
    )
    back = RunStateFile(run).load()
    assert back == written and back.status is status and back.fact("exit_code") == 3


def test_a_file_of_the_earlier_version_reads_and_its_user_error_is_not_retried(tmp_path):
    run = RunDir(tmp_path)
    run.run_state.write_text(EARLIER_VERSION)
    record = RunStateFile(run).load()
    assert (record.status, record.reason, record.step) == (RunStatus.FAILED, "error", 20)
    assert record.user_error == "checkpoint save of step 20 failed: no space"
    assert record.written_by(JOB) and record.checkpoint_step is None
    assert classify(record, JOB, 1) == (
        False,
        "the run failed with an error the user must fix: checkpoint save of step 20 failed: no space",
    )
    # rewritten unchanged, it is the same JSON: the field names and values are a contract
    RunStateFile(run).write(record)
    assert json.loads(run.run_state.read_text()) == {
        **json.loads(EARLIER_VERSION),
        "user_error": record.user_error,
    }


def test_a_minimal_record_of_an_early_version_takes_the_defaults(tmp_path):
    run = RunDir(tmp_path)
    run.run_state.write_text('{"status": "stopped", "reason": "time_limit", "step": 3}')
    record = RunStateFile(run).load()
    assert (record.status, record.requeue_pending, record.message, record.user_error) == (
        RunStatus.STOPPED,
        False,
        None,
        "",
    )


def test_a_user_error_is_its_own_field(tmp_path):
    run = RunDir(tmp_path)
    RunStateFile(run).write(RunState.of("failed", "error", 5, user_error="disk full", **JOB.identity()))
    assert json.loads(run.run_state.read_text())["user_error"] == "disk full"
    assert classify(RunStateFile(run).read(), JOB, 1)[0] is False
    RunStateFile(run).write(RunState.of("failed", "error", 5, message="RuntimeError('x')", **JOB.identity()))
    assert "user_error" not in json.loads(run.run_state.read_text())  # only when there is one
    assert classify(RunStateFile(run).read(), JOB, 1)[0] is True


HOSTILE = {  # the file, and what the one line says is wrong with it
    "not JSON": (b'{"status": "running", "st', "not JSON"),
    "a list": (b'["running"]', "not a JSON object but list"),
    "an unknown status": (b'{"status": "exploded", "step": 1}', "status 'exploded' is not one of"),
    "no status": (b'{"checkpoint_step": 4}', "status None is not one of"),
    "a step that is text": (b'{"status": "running", "step": "12"}', "field 'step' is '12', not int"),
    "a flag that is text": (
        b'{"status": "stopped", "requeue_pending": "true"}',
        "'requeue_pending' is 'true'",
    ),
    "a step that is a bool": (b'{"status": "running", "step": true}', "field 'step' is True, not int"),
    "bytes that are not UTF-8": (b'{"status": "\xff\xfe"}', "not JSON"),
    "too large": (b'{"status": "running", "pad": "' + b"x" * (2 << 20) + b'"}', "larger than 1048576 bytes"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_damaged_or_foreign_file_is_one_clear_line(tmp_path, case):
    run = RunDir(tmp_path)
    data, words = HOSTILE[case]
    run.run_state.write_bytes(data)
    with pytest.raises(RunStateError) as caught:
        RunStateFile(run).load()
    message = str(caught.value)
    assert message.startswith(f"{run.run_state} is damaged (") and words in message
    assert "\n" not in message and len(message) < 400
    assert RunStateFile(run).read() is None and RunStateFile(run).damage() == message
    assert recorded_checkpoint_step(run) == 0
    # the run itself rewrites it
    RunStateFile(run).write(RunState.of("running", "", 0))
    assert RunStateFile(run).damage() == ""


def test_relaytrain_status_names_a_damaged_record_in_one_line(tmp_path):
    run = RunDir(tmp_path / "runs" / "bad")
    run.root.mkdir(parents=True)
    run.run_state.write_text('{"status": "exploded"}')
    command = [sys.executable, "-m", "relaytrain.cli", "status", str(run.root)]
    done = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "status 'exploded' is not one of running, stopped, finished, failed" in done.stderr
