"""bench.goodput's arithmetic on a synthetic preempted run (the benchmark itself needs the Slurm cluster)."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from bench import goodput


def log_line(t: float, message: str) -> str:
    stamp = datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")
    return f"{stamp} [rank 0 node1 local 0] INFO relaytrain.checkpoint: {message}"


def test_goodput_and_the_split_of_one_preemption(tmp_path):
    t0 = 1_000_000.0
    rows = [{"kind": "event", "event": "start", "step": 0, "time": t0}]
    rows += [{"kind": "train", "step": s, "time": t0 + s, "time_step_s": 0.5, "restart": 0}
             for s in range(1, 7)]  # fmt: skip
    rows += [{"kind": "event", "event": "stop", "step": 6, "time": t0 + 6.2}]
    rows += [{"kind": "event", "event": "resume", "step": 4, "time": t0 + 30}]
    rows += [{"kind": "train", "step": s, "time": t0 + 27 + s, "time_step_s": 0.5, "restart": 1}
             for s in range(5, 11)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    log = "\n".join([
        log_line(t0 + 6.5, "checkpoint step 6 (preemption) committed: /x/s6 (write 0.50s, blocking 0.50s)"),
        log_line(t0 + 29, "resuming from /x/step_6 (step 6): latest"),
    ])  # fmt: skip
    result = goodput.RunResult("preempt-60s", "preempted")
    goodput.analyse(result, tmp_path, [(t0 - 1, t0 + 9), (t0 + 20, t0 + 40)], log)

    assert (result.steps, result.replayed, result.interruptions) == (10, 2, 1)
    assert result.productive_s == pytest.approx(5.0) and result.allocated_s == pytest.approx(30.0)
    assert result.goodput == pytest.approx(5.0 / 30.0)
    (s2e,) = result.signal_to_exit
    assert s2e == pytest.approx({"total": 2.8, "save": 0.5, "exit": 2.3})
    (r2s,) = result.requeue_to_step
    assert r2s == pytest.approx({"total": 22.5, "queue": 11.0, "startup": 9.0, "load": 1.0})


def test_the_7b_extrapolation_formula():
    x = goodput.Extrapolation(params=7e9, write_gbps=2.0, startup_s=60, exit_s=5, step_s=10, lost_steps=1)
    assert x.save_s == pytest.approx(42.0)  # 7e9 x 12 B / 2 GB/s
    assert x.cost_s() == pytest.approx(42 + 5 + 60 + 42 + 10)
    assert x.goodput(1800) == pytest.approx(1 - 159 / 1800 - x.async_block_s / x.ckpt_every_s)
    assert x.goodput(14400) > x.goodput(1800)
    assert "goodput(T) = 1 −" in goodput.render_extrapolation(x)
