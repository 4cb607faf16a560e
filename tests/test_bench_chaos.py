"""`python -m bench.chaos --quick` on the real local Slurm cluster: 3 random interruptions, no work lost.

Like every `slurm` test it runs under `flock /tmp/relaytrain-slurm.lock`, hence `--no-lock`.
"""

from __future__ import annotations

import json

import pytest

from bench import chaos

pytestmark = pytest.mark.slurm


def test_trials_are_drawn_from_the_seed():
    assert [(t.phase, t.event) for t in chaos.draw(5, 11)] == [(t.phase, t.event) for t in chaos.draw(5, 11)]
    assert all(t.phase in chaos.PHASES and t.event in chaos.EVENTS for t in chaos.draw(40, 3))
    assert all(t.event == "sigkill_rank" for t in chaos.draw(40, 3) if t.phase == "resume_load")


def test_quick_chaos_run_loses_no_work(slurm_cluster, tmp_path, capsys):
    code = chaos.main(["--quick", "--seed", "1", "--no-lock", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    results = json.loads(next(tmp_path.glob("seed1-*/results.json")).read_text())
    assert len(results) == 3
    failed = [r for r in results if not (r["bit_exact"] and r["latest_complete"] and not r["leftovers"])]
    assert code == 0 and not failed, out[-4000:]
