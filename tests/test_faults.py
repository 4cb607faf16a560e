"""The fault injectors of faults/ land in a real training process, and stay out of it unless asked for.

The resilience tests judge the NaN guard and the stop machinery with these faults; here the faults
themselves are judged, so that one that silently stopped landing fails as "did not land".
"""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import faults
from conftest import TINY, child_env, run_cli

TOKENS_PER_STEP = 8 * 32  # TINY: global_batch_size x seq_len


def train_rows(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return {r["step"]: r for r in rows if r.get("kind") == "train"}


def python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def output(code: str, env: dict[str, str]) -> str:
    done = python(code, env)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


# Whether this process has faults armed: the one-shot import hook waiting for relaytrain.trainer
ARMED = "import sys; print(['idle', 'armed'][any(type(f).__name__ == '_AfterImport' for f in sys.meta_path)])"


def test_faults_armed_only_when_asked_and_a_shadowed_sitecustomize_still_runs(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("print('the other sitecustomize ran')\n")
    path = {"PYTHONPATH": f"{faults.PYTHONPATH_DIR}:{other}"}
    assert output(ARMED, child_env(**path)).split() == ["the", "other", "sitecustomize", "ran", "idle"]
    armed = child_env(**path, **faults.variables(step_delay_s=0.1))
    assert output(ARMED, armed).split()[-1] == "armed"
    # A fault asked for wrongly stops the process with one line, instead of arming nothing
    bad = python("pass", child_env(**faults.env(nan_at_steps=(1,)), RELAYTRAIN_FAULT_NAN_RANK="last"))
    assert bad.returncode != 0 and "RELAYTRAIN_FAULT_NAN_RANK='last' is not a valid int" in bad.stderr
    misspelt = python("pass", child_env(**faults.env(), RELAYTRAIN_FAULT_STEP_DELAY="1"))
    assert misspelt.returncode != 0 and "unknown RELAYTRAIN_FAULT_STEP_DELAY;" in misspelt.stderr


def test_a_landed_line_reaches_stderr_in_one_write_with_its_newline(monkeypatch):
    """Ranks share one pipe under torchrun and srun, unbuffered (PYTHONUNBUFFERED): a line written in two
    pieces can have another rank's line land between them, and its landed text is read wrongly."""
    from faults.pythonpath import relaytrain_faults

    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    relaytrain_faults.say("FIFO read with no writer at step 4 on rank 1: /tmp/x/dead-mount")
    (line,) = writes
    assert line.endswith("\n") and faults.landed_at(line)[0][0].endswith(": /tmp/x/dead-mount")


def test_a_slurm_setup_line_arms_the_faults_for_the_processes_the_script_starts():
    line = faults.setup_line(step_delay_s=0.4)
    assert "'" not in line  # it goes into a TOML literal string (slurm.setup)
    for path in ({}, {"PYTHONPATH": "/elsewhere"}):
        env = {k: v for k, v in child_env().items() if k != "PYTHONPATH"} | path
        script = f"{line}; {shlex.quote(sys.executable)} -c {shlex.quote(ARMED)}; echo $PYTHONPATH"
        done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
        assert done.stdout.split() == ["armed", ":".join([str(faults.PYTHONPATH_DIR), *path.values()])]


def test_nan_fault_lands_in_the_loss_of_its_step(tmp_path):
    args = ["train", *TINY, "--train.max_steps=4", f"--run.dir={tmp_path}", "--run.name=run",
            "--resilience.nan_policy=skip", "--resilience.nan_max_consecutive=2"]  # fmt: skip
    proc = run_cli(args, cwd=tmp_path, **faults.env(nan_at_steps=(2,)))
    out = proc.stdout + proc.stderr
    landed = faults.landed(out)
    assert landed == ["NaN loss at step 2 on rank 0"], f"the NaN fault did not land:\n{out[-3000:]}"
    assert proc.returncode == 0, out[-3000:]
    losses = {step: row["loss"] for step, row in train_rows(tmp_path / "run").items()}
    assert losses[2] is None, f"step 2's logged loss is not the injected NaN: {losses}"  # JSON null
    assert all(math.isfinite(losses[s]) for s in (1, 3, 4)), losses


def test_step_delay_fault_lands_after_every_step(tmp_path):
    delay = 1.0
    args = ["train", *TINY, "--train.max_steps=3", f"--run.dir={tmp_path}", "--run.name=run"]
    proc = run_cli(args, cwd=tmp_path, **faults.env(step_delay_s=delay))
    out = proc.stdout + proc.stderr
    assert faults.landed(out) == ["1 s step delay after step 1 on rank 0"], f"the delay did not land:\n{out}"
    assert proc.returncode == 0, out[-3000:]
    rows = train_rows(tmp_path / "run")
    seconds = {step: TOKENS_PER_STEP / row["tokens_per_s"] for step, row in rows.items()}
    assert all(s >= delay for s in seconds.values()), f"a step took less than the {delay} s delay: {seconds}"


def test_layer_delay_fault_sleeps_inside_every_layers_forward(tmp_path):
    """TINY: 2 layers x 2 micro batches a step, so a step holds 4 layer delays (inside the forward)."""
    delay = 0.25
    args = ["train", *TINY, "--train.max_steps=2", f"--run.dir={tmp_path}", "--run.name=run"]
    proc = run_cli(args, cwd=tmp_path, **faults.env(layer_delay_s=delay))
    out = proc.stdout + proc.stderr
    assert faults.landed(out) == ["0.25 s delay before each layer's forward on rank 0"], out[-3000:]
    assert proc.returncode == 0, out[-3000:]
    rows = train_rows(tmp_path / "run")
    seconds = {step: TOKENS_PER_STEP / row["tokens_per_s"] for step, row in rows.items()}
    assert all(s >= 4 * delay for s in seconds.values()), f"a step held fewer than 4 delays: {seconds}"


def test_user_faults_land_as_real_errors_every_time(tmp_path):
    """The deterministic faults of the fault matrix (bench/fault_matrix.py): a shape error at step k from
    torch itself (recorded by the run), an import error at start-up (before run_state.json)."""
    args = ["train", *TINY, "--train.max_steps=4", f"--run.dir={tmp_path}", "--run.name=run"]
    proc = run_cli(args, cwd=tmp_path, **faults.env(shape_error_at_step=2))
    out = proc.stdout + proc.stderr
    assert faults.landed(out) == ["shape error at step 2 on rank 0"], out[-3000:]
    # torch 2.15 names the op first: "RuntimeError: mm: mat1 and mat2 shapes cannot be multiplied"
    assert proc.returncode == 1 and re.search(
        r"RuntimeError: (mm: )?mat1 and mat2 shapes cannot be multiplied", out
    )
    state = json.loads((tmp_path / "run" / "run_state.json").read_text())
    assert (state["status"], state["reason"], state["step"]) == ("failed", "error", 1), state
    assert "shapes cannot be multiplied" in state["message"]
    args[-1] = "--run.name=other"
    proc = run_cli(args, cwd=tmp_path, **faults.env(import_module="relaytrain_missing_plugin"))
    out = proc.stdout + proc.stderr
    assert faults.landed(out) == ["importing relaytrain_missing_plugin with relaytrain.trainer"], out[-3000:]
    assert proc.returncode == 1 and "ModuleNotFoundError: No module named 'relaytrain_missing_plugin'" in out
    assert not (tmp_path / "other").exists()  # it died before the run directory was made
