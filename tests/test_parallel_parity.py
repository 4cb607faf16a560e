"""Every layout reproduces the one-process run: losses, grad norms and eval loss of the first 3 steps.

The tiny model (dim 64, 4 layers, 4 heads, 2 KV heads, vocab 256, seq 32, global batch 8) is initialised
identically in every layout (per-name seeded init, sharding-invariant), trained with AdamW lr 1e-2 and
grad clipping at 1.0 on the same global batches. Tolerances: fp32 losses and eval loss agree within
2e-5 absolute (observed <= 1e-6: only the reduction order differs), grad norms within 1e-4 relative
(AdamW amplifies reduction-order noise in the weights by step 3); bf16 parameters (FSDP mixed
precision, or autocast in one process) within 5e-2 of the fp32 reference (bf16 rounding, amplified by AdamW).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from parallel_cases import run_case  # noqa: E402

WORKER = Path(__file__).parent / "parallel_cases.py"
N2_CASES = [
    "fsdp",
    "fsdp_reshard_never",
    "fsdp_cpu_offload",
    "fsdp_ac_full",
    "fsdp_ac_selective",
    "fsdp_bf16",
    "fsdp_compile",
    "hsdp_2x1",
    "tp",
    "tp_no_loss_parallel",
    "tp_ac_selective",
    "pp_gpipe",
    "pp_1f1b",
    "pp_interleaved",
]
N4_CASES = ["hsdp_2x2", "fsdp_tp", "pp_fsdp_pp_outer_order", "pp_tp_interleaved"]
BF16_CASES = {"fsdp_bf16", "autocast_bf16"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Like each torchrun rank: on a shared 2-core box, 2 OpenMP threads can be 10x slower than one.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference(one_thread) -> dict:
    return run_case("single", world_size=1, rank=0, gpus_per_node=1)


def assert_matches(result: dict, reference: dict) -> None:
    loose = result["case"] in BF16_CASES
    loss_tol = 5e-2 if loose else 2e-5
    assert result["losses"] == pytest.approx(reference["losses"], abs=loss_tol), result["case"]
    assert result["eval_loss"] == pytest.approx(reference["eval_loss"], abs=loss_tol), result["case"]
    assert result["grad_norms"] == pytest.approx(reference["grad_norms"], rel=5e-2 if loose else 1e-4), (
        result["case"]
    )


def launch(nproc: int, cases: list[str], tmp_path: Path) -> dict[str, dict]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PARALLEL_CASES_COMPILE_BACKEND="aot_eager",
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
    )
    proc = subprocess.run(
        ["torchrun", "--standalone", f"--nproc_per_node={nproc}", str(WORKER), *cases],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            results[result["case"]] = result
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert sorted(results) == sorted(cases)
    return results


@pytest.mark.parametrize("case", ["ac_full", "ac_selective", "autocast_bf16"])
def test_single_process_features_match_reference(case, reference):
    assert_matches(run_case(case, world_size=1, rank=0, gpus_per_node=1), reference)


@pytest.mark.slow
def test_two_process_layouts_match_single_process(reference, tmp_path):
    results = launch(2, N2_CASES, tmp_path)
    for case in N2_CASES:
        assert_matches(results[case], reference)


@pytest.mark.slow
def test_four_process_layouts_match_single_process(reference, tmp_path):
    results = launch(4, N4_CASES, tmp_path)
    for case in N4_CASES:
        assert_matches(results[case], reference)
