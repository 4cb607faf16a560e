"""A config mistake is reported before torch is imported: users iterate on configs all day, and importing
torch takes seconds. Checked by what the process imported, not by timing it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, child_env

# Runs the CLI as `relaytrain` does, then says whether torch was ever imported.
WRAPPER = (
    "import sys; from relaytrain.cli import main; code = main(sys.argv[1:]); "
    "print('torch imported:', 'torch' in sys.modules, file=sys.stderr); sys.exit(code)"
)
CONFIG = str(REPO / "configs" / "debug.toml")


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--train.max_stepz=3"],
        ["train", CONFIG, "--train.micro_batch_size=3"],  # a check between two fields
        ["plan", CONFIG, "--model.dimm=3"],
        ["launch", CONFIG, "--dry-run", "--model.dimm=3"],
        ["sweep", CONFIG, "--grid", "optim.lr=1e-3,2e-3", "--model.dimm=3"],
        ["chain", CONFIG, CONFIG, "--model.dimm=3"],
        ["doctor", CONFIG, "--model.dimm=3"],
    ],
)
def test_a_config_mistake_exits_before_torch_is_imported(tmp_path, argv):
    proc = subprocess.run(
        [sys.executable, "-c", WRAPPER, *argv],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    error, imported = proc.stderr.strip().splitlines()
    assert error.startswith("relaytrain: error: ")
    assert "micro_batch_size" in error or "did you mean" in error
    assert imported == "torch imported: False"
