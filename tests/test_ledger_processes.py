"""The one walk of metrics.jsonl by trainer process (monitor/ledger_processes.py) and verify's two checks
that read it: logged steps no ledger window covers, and the ledger's step time against the train
records'."""

from __future__ import annotations

from typing import Any

from relaytrain.monitor.ledger_processes import processes
from relaytrain.monitor.ledger_sources import steps_without_window
from relaytrain.monitor.ledger_spans import build_ledger
from relaytrain.monitor.ledger_steps import productive_against_steps

T0 = 1000.0


def process(
    t: float, begin: int, steps: int, step_s: float = 1.0, event: str = "start"
) -> list[dict[str, Any]]:
    """A trainer outside Slurm: a window a step (1 s each), a train record every second step (its step
    timer's mean `step_s`), then a stop at the last step."""
    rows: list[dict[str, Any]] = [
        {"kind": "event", "event": event, "step": begin, "time": t, "process_start": t}
    ]
    for s in range(begin + 1, begin + steps + 1):
        at = t + s - begin
        rows.append({"kind": "ledger", "step": s, "time": at, "seconds": {},
                     "window": {"from_step": s, "since": at - 1.0, "until": at}})  # fmt: skip
        if (s - begin) % 2 == 0:
            rows.append(
                {"kind": "train", "step": s, "time": at, "time_step_s": step_s, "time_checkpoint_s": 0.0}
            )
    rows.append({"kind": "event", "event": "stop", "step": begin + steps, "time": t + steps + 0.2})
    return rows


def test_each_start_or_resume_begins_a_process_with_its_windows_and_steps():
    records = process(T0, 0, 4) + process(T0 + 10, 4, 4, event="resume")
    found = processes(records)
    assert [(p.alloc, p.begin, len(p.windows), [r["step"] for r in p.train], p.ended) for p in found] == [
        ((None, 0), 0, 4, [2, 4], True),
        ((None, 1), 4, 4, [6, 8], True),
    ]
    assert (found[1].windows[0].first, found[1].windows[0].since) == (5, T0 + 10.0)


def test_a_logged_step_outside_every_window_and_step_time_off_the_train_records_are_named():
    records = process(T0, 0, 4)
    assert steps_without_window(records) == []
    violations, note = productive_against_steps(build_ledger(records), records)
    assert violations == [] and "the ledger's step time of 4 logged step(s) is 4.0s" in note
    # step 4's window dropped: its train record lies in none
    dropped = [r for r in records if not (r["kind"] == "ledger" and r["step"] == 4)]
    assert steps_without_window(dropped) == [
        "the process that began at step 0 logged steps 4 (its train records) that no ledger window covers: "
        "their time is not measured"
    ]
    # the step timer says 2 s a step, the windows 1 s: the ledger's productive time is not the steps'
    slow = process(T0, 0, 4, step_s=2.0)
    (line,) = productive_against_steps(build_ledger(slow), slow)[0]
    assert line.startswith("productive: process's ledger puts 4.000 s in its steps") and "-4.000 s" in line
