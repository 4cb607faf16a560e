"""Every README/docs line that runs relaytrain under torchrun starts it as `python -m relaytrain.job.torchrun`
(plain torchrun turns an agreed stop into a `SignalException` traceback and exit 1), and runs as written:
the README's one-node line, stopped by SIGTERM, saves and ends in one line with exit 128 + 15;
docs/parallelism.md's lines train (five steps here, on a smaller model: `--train.max_steps=5`, a run
directory and `SMALL_DIMS` appended).
"""

from __future__ import annotations

import gzip
import json
import os
import shlex
import signal
import subprocess
import time

import pytest

from relaytrain.data.sources import BUNDLED_CORPUS
from test_job_torchrun import clean_env
from test_readme import README, bash_blocks, block
from tiny_config import TINY_TOML

from conftest import REPO

WRAPPER = "python -m relaytrain.job.torchrun "
DOCS = [README, *sorted((REPO / "docs").rglob("*.md"))]


def command_lines(path) -> list[str]:
    """Each command of the file's bash blocks, continuation lines joined."""
    out = []
    for _, lines in bash_blocks(path):
        joined = ""
        for line in lines:
            joined += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
            if not line.endswith("\\"):
                out.append(joined.strip())
                joined = ""
    return out


def under_torchrun(path) -> list[str]:
    return [line for line in command_lines(path) if "relaytrain.cli" in line and "torch" in line]


def test_every_doc_line_that_runs_relaytrain_under_torchrun_uses_the_wrapper():
    found = {str(path.relative_to(REPO)): under_torchrun(path) for path in DOCS}
    assert found["README.md"] and len(found["docs/parallelism.md"]) == 3, found
    for name, lines in found.items():
        for line in lines:
            assert line.startswith(WRAPPER), f"{name}: {line}"


def prepare_the_readme_data(folder) -> None:
    """The README's prepare-data line, as written, in `folder`: the user's corpus.jsonl (the bundled
    corpus's paragraphs) and tokenizer.json (a byte-level BPE of 300 entries, which the tiny model's 320
    fill)."""
    (line,) = [line for line in block(README, "Usage") if line.startswith("relaytrain prepare-data ")]
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        texts = [t for t in f.read().split("\n\n") if t.strip()]
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    for command in (
        "relaytrain train-tokenizer corpus.jsonl --vocab-size 300 --out tokenizer.json",
        line.split("#")[0],
    ):
        done = subprocess.run(["bash", "-c", command], cwd=folder, env=clean_env(), capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_the_readme_one_node_line_stops_cleanly_on_sigterm(tmp_path):
    (line,) = [line for line in block(README, "Usage") if "relaytrain.cli" in line]
    command = line.split("#")[0].strip()
    (toml,) = [word for word in shlex.split(command) if word.endswith(".toml")]
    config = tmp_path / toml  # configs/1b.toml, here a tiny model that trains on
    config.parent.mkdir(parents=True)
    config.write_text(
        '[run]\nname = "one-node"\n' + TINY_TOML + "max_steps = 100000\n\n[metrics]\nlog_every = 1\n"
    )
    prepare_the_readme_data(tmp_path)
    run, metrics = tmp_path / "runs" / "one-node", tmp_path / "runs" / "one-node" / "metrics.jsonl"
    proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=tmp_path, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 240
    while '"kind": "train"' not in (metrics.read_text() if metrics.exists() else ""):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no training step within 240 s"
        time.sleep(0.5)
    os.kill(proc.pid, signal.SIGTERM)  # as a preemption or `scancel` sends it
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    assert "relaytrain.job.torchrun: stopped by signal 15 (SIGTERM)" in err
    state = json.loads((run / "run_state.json").read_text())
    assert state["status"] == "stopped" and state["saved"] is True, state


# The lines' layouts, not the embedded model's size, are what they show: a narrower, shorter model (each
# line's run took 60-80 % of the CPU it took with the debug model's 256 wide, 128 long) that every layout
# still divides (4 heads and 2 KV heads by tp=2, seq_len by tp=2, its 4 layers by pp=2 x 2 virtual
# stages). The batch is the embedded config's, so the micro batch check below still speaks about its
# config. (Fewer layers or a shorter straggler window saved nothing measurable: the ranks' start-up
# dominates.)
SMALL_DIMS = "--model.dim=64 --model.n_heads=4 --model.n_kv_heads=2 --train.seq_len=32"


@pytest.mark.slow
@pytest.mark.parametrize("line", under_torchrun(REPO / "docs" / "parallelism.md"))
def test_the_parallelism_lines_train(line, tmp_path):
    """Each line trains; over its first straggler window (5 steps) every rank timed its layers' forward
    (under tensor parallelism, its linear layers'), and under a pipeline the window records each rank's
    stage, as a rank is compared with the ranks of its own stage only."""
    command = line.split("#")[0].strip() + f" --train.max_steps=5 --run.dir={tmp_path / 'runs'} {SMALL_DIMS}"
    env = clean_env()
    done = subprocess.run(
        ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # The embedded config's micro batch divides each rank's sequences: no line says it was adapted.
    assert "does not divide" not in done.stdout + done.stderr, done.stderr[-3000:]
    run = tmp_path / "runs" / "debug"
    assert json.loads((run / "run_state.json").read_text())["status"] == "finished"
    records = [json.loads(row) for row in (run / "metrics.jsonl").read_text().splitlines()]
    (window,) = [r for r in records if r["kind"] == "rank_times"]
    ranks = int(line.split("--nproc_per_node=")[1].split()[0])
    timed = [window[f"rank{r}_forward_s"] > 0 for r in range(ranks)]
    assert timed == [True] * ranks, window
    stages = window.get("stages")
    assert (sorted(stages) if stages else None) == ([0, 0, 1, 1] if "--parallel.pp=2" in line else None)
